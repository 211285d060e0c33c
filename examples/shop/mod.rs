//! What the two HTTP servers (`examples/http.rs` on axum, `examples/actix.rs`
//! on actix-web) share: the orders and their payment, the errors in business
//! terms, and the store with its housekeeping. Each server keeps only its
//! framework's part: the extractors, the handlers, the answers.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use idempotency::{Backend, Idem, TokenError};
use serde::{Deserialize, Serialize};
use sqlx::AssertSqlSafe;

/// The business action pay tokens are issued for.
pub const PAY_TOKENS: &str = "http_pay";
/// How long a pay token lives: the time a user may take to fill the form.
pub const PAY_TOKEN_TTL: Duration = Duration::from_secs(15 * 60);

/// What `GET /orders/{id}/pay-token` answers.
#[derive(Debug, Serialize)]
pub struct PayToken {
    pub token: String,
    /// Seconds the token stays usable.
    pub expires_in: u64,
}

/// The order's state column and its allowed moves (layer 4).
#[derive(Clone, Copy, Debug, PartialEq, idempotency::State)]
#[state(table = "orders", id = "id", column = "status")]
#[state(transitions(Pending -> Paid, Paid -> Refunded, Pending -> Closed))]
pub enum OrderStatus {
    Pending,
    Paid,
    Refunded,
    Closed,
}

/// The request body.
#[derive(Debug, Serialize, Deserialize)]
pub struct PayReq {
    /// Integer cents.
    pub amount: i64,
}

/// What a successful payment answers, and what a retry replays.
#[derive(Debug, Serialize, Deserialize)]
pub struct PayResponse {
    pub order_id: i64,
    pub amount: i64,
    pub payment_id: i64,
    pub status: String,
}

/// The handler's error: the engine's, or the business rules'. An `Err` is
/// never recorded, so the same request may be sent again.
#[derive(Debug)]
pub enum ApiError {
    Idem(idempotency::Error),
    /// The token is refused (403) or cannot be checked (503).
    Token(TokenError),
    Refused(Refusal),
}

/// What the business rules refuse.
#[derive(Debug)]
pub enum Refusal {
    /// The order exists but can no longer be paid (closed, refunded).
    NotPayable(i64),
    /// Another caller paid the order already: nothing of their payment is
    /// shown.
    PaidByAnother(i64),
    NotFound(i64),
    BadAmount,
}

impl Refusal {
    /// The HTTP status and the problem's `code`.
    pub fn status_and_code(&self) -> (u16, &'static str) {
        match self {
            Refusal::NotPayable(_) => (409, "ORDER_NOT_PAYABLE"),
            Refusal::PaidByAnother(_) => (409, "ORDER_ALREADY_PAID"),
            Refusal::NotFound(_) => (404, "ORDER_NOT_FOUND"),
            Refusal::BadAmount => (422, "INVALID_AMOUNT"),
        }
    }
}

/// The problem's `detail`.
impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::NotPayable(id) => write!(f, "order {id} is not pending payment"),
            Refusal::PaidByAnother(id) => write!(f, "order {id} is already paid"),
            Refusal::NotFound(id) => write!(f, "no order {id}"),
            Refusal::BadAmount => f.write_str("amount must be a positive number of cents"),
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiError::Idem(e) => e.fmt(f),
            ApiError::Token(e) => e.fmt(f),
            ApiError::Refused(r) => r.fmt(f),
        }
    }
}

impl From<idempotency::Error> for ApiError {
    fn from(e: idempotency::Error) -> Self {
        ApiError::Idem(e)
    }
}

impl From<TokenError> for ApiError {
    fn from(e: TokenError) -> Self {
        ApiError::Token(e)
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        // Rolled back, nothing written; `idempotency::Error` tells by the
        // database's code whether a retry can help: a failure that passes
        // (connection, deadlock, lock wait) is `Storage` (503, retry), one
        // that recurs (a constraint, bad data, bad SQL) `StorageRefused`
        // (500, do not retry), never 503 for a failure a retry meets again.
        ApiError::Idem(e.into())
    }
}

/// The idempotent payment for one database, beside the invoking module's
/// `App` (which holds the engine as `idem`): `pay_by_key`, `pay_by_token`
/// and the body they share. MySQL and SQLite take the same SQL (`?`
/// placeholders); only the type and the new row's id differ.
macro_rules! payments {
    ($db:ty, $payment_id:path) => {
        use idempotency::state::{Advanced, advance};
        use idempotency::{StoredJson, idempotent};
        use sqlx::Transaction;
        use $crate::shop::{ApiError, OrderStatus, PayReq, PayResponse, Refusal};

        /// Once per (user, Idempotency-Key). The key template is scoped
        /// to the principal; `app` (the engine's root) is not part of the
        /// fingerprint, everything else is. The answer is the payment as
        /// its record stores it (`StoredJson`): a replay sends those bytes
        /// on, not decoded into a `PayResponse` and encoded again. The
        /// record keeps the order as its `biz_no`, which
        /// `payments.order_id` holds too: `idem reconcile --biz http_pay
        /// --table payments --column order_id --record-field biz_no`
        /// compares them (the keys, made by clients, are in no business
        /// table).
        #[idempotent(key = "<user>:<idem_key>", ttl = "24h", biz = "http_pay", biz_no = "<order_id>", engine = app.idem)]
        async fn pay_by_key(
            app: &App,
            tx: &mut Transaction<'_, $db>,
            user: String,
            idem_key: String,
            order_id: i64,
            req: PayReq,
        ) -> Result<StoredJson<PayResponse>, ApiError> {
            charge(tx, &user, order_id, &req).await.map(StoredJson::new)
        }

        /// Once per token: every submit of one token meets this record
        /// (another `biz`, so a client's key can never name it; reconciled
        /// as `--biz http_pay_token`, the same way).
        #[idempotent(key = "<user>:<token>", ttl = "24h", biz = "http_pay_token", biz_no = "<order_id>", engine = app.idem)]
        async fn pay_by_token(
            app: &App,
            tx: &mut Transaction<'_, $db>,
            user: String,
            token: String,
            order_id: i64,
            req: PayReq,
        ) -> Result<StoredJson<PayResponse>, ApiError> {
            charge(tx, &user, order_id, &req).await.map(StoredJson::new)
        }

        /// The payment itself, in the call's transaction.
        async fn charge(
            tx: &mut Transaction<'_, $db>,
            user: &str,
            order_id: i64,
            req: &PayReq,
        ) -> Result<PayResponse, ApiError> {
            if req.amount <= 0 {
                return Err(ApiError::Refused(Refusal::BadAmount));
            }
            // Layer 4: the order's own state decides, even when two keys
            // (a client that invents a new one per retry) reach this body.
            match advance(idempotency::transition!(OrderStatus: Pending -> Paid)).run(&mut **tx, order_id).await? {
                Advanced::Applied => {}
                Advanced::AlreadyThere => {
                    // Paid before, under another key. The caller's own
                    // payment is the answer (a client that invented a new
                    // key for its retry); another user's is never shown.
                    let own: Option<(i64, i64)> =
                        sqlx::query_as("SELECT id, amount FROM payments WHERE order_id = ? AND user_id = ?")
                            .bind(order_id)
                            .bind(user)
                            .fetch_optional(&mut **tx)
                            .await?;
                    return match own {
                        Some((payment_id, amount)) => {
                            Ok(PayResponse { order_id, amount, payment_id, status: "PAID".into() })
                        }
                        None => Err(ApiError::Refused(Refusal::PaidByAnother(order_id))),
                    };
                }
                Advanced::Conflict { .. } => return Err(ApiError::Refused(Refusal::NotPayable(order_id))),
                Advanced::NotFound => return Err(ApiError::Refused(Refusal::NotFound(order_id))),
            }
            let inserted = sqlx::query("INSERT INTO payments (order_id, user_id, amount) VALUES (?, ?, ?)")
                .bind(order_id)
                .bind(user)
                .bind(req.amount)
                .execute(&mut **tx)
                .await?;
            Ok(PayResponse { order_id, amount: req.amount, payment_id: $payment_id(&inserted), status: "PAID".into() })
        }
    };
}
pub(crate) use payments;

pub fn mysql_payment_id(result: &sqlx::mysql::MySqlQueryResult) -> i64 {
    i64::try_from(result.last_insert_id()).unwrap_or(i64::MAX)
}

pub fn sqlite_payment_id(result: &sqlx::sqlite::SqliteQueryResult) -> i64 {
    result.last_insert_rowid()
}

/// The database the server keeps orders, payments and records in.
pub enum Store {
    MySql(Idem<sqlx::MySql>),
    Sqlite(Idem<sqlx::Sqlite>),
}

const MYSQL_DDL: &str = "
    CREATE TABLE IF NOT EXISTS orders (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL);
    CREATE TABLE IF NOT EXISTS payments (
        id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BIGINT NOT NULL,
        user_id VARCHAR(64) NOT NULL, amount BIGINT NOT NULL, KEY (order_id));";
const SQLITE_DDL: &str = "
    CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL);
    CREATE TABLE IF NOT EXISTS payments (
        id INTEGER PRIMARY KEY AUTOINCREMENT, order_id INTEGER NOT NULL,
        user_id TEXT NOT NULL, amount INTEGER NOT NULL);";

/// Opens the store the environment names (`IDEM_MYSQL_URL`, else the SQLite
/// file in `IDEM_SQLITE_URL`, else an in-memory database), with the Redis
/// claim when `redis` is given: the engine migrated, the business tables
/// made, orders 1..=10000 as `PENDING`, and the purge running.
pub async fn open(redis: Option<redis::Client>) -> Result<Store, Box<dyn std::error::Error>> {
    if let Ok(url) = std::env::var("IDEM_MYSQL_URL") {
        let pool = sqlx::mysql::MySqlPoolOptions::new().max_connections(16).connect(&url).await?;
        let idem = engine(pool, redis);
        idem.migrate().await?;
        sqlx::raw_sql(MYSQL_DDL).execute(idem.pool()).await?;
        sqlx::query(seed_orders("INSERT IGNORE")).execute(idem.pool()).await?;
        purge_periodically(idem.clone());
        return Ok(Store::MySql(idem));
    }
    let pool = match std::env::var("IDEM_SQLITE_URL") {
        Ok(url) => {
            let options = sqlx::sqlite::SqliteConnectOptions::from_str(&url)?
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(5));
            sqlx::sqlite::SqlitePoolOptions::new().max_connections(8).connect_with(options).await?
        }
        Err(_) => Idem::sqlite_memory().await?.pool().clone(),
    };
    let idem = engine(pool, redis);
    idem.migrate().await?;
    sqlx::raw_sql(SQLITE_DDL).execute(idem.pool()).await?;
    sqlx::query(seed_orders("INSERT OR IGNORE")).execute(idem.pool()).await?;
    purge_periodically(idem.clone());
    Ok(Store::Sqlite(idem))
}

/// Orders 1..=10000 as `PENDING`, in one statement; existing rows are kept.
fn seed_orders(insert_ignore: &'static str) -> AssertSqlSafe<String> {
    let rows: Vec<String> = (1..=10_000).map(|id| format!("({id},'PENDING')")).collect();
    // Safe: made of a literal and integers only.
    AssertSqlSafe(format!("{insert_ignore} INTO orders (id, status) VALUES {}", rows.join(",")))
}

/// The engine, with the Redis claim when `IDEM_REDIS_URL` is set.
fn engine<DB: Backend>(pool: sqlx::Pool<DB>, redis: Option<redis::Client>) -> Idem<DB> {
    let builder = Idem::builder(pool);
    match redis {
        Some(client) => builder.redis(client).build(),
        None => builder.build(),
    }
}

/// Deletes expired records and tokens now and then, keeping `idem_record`
/// and `idem_token` bounded.
fn purge_periodically<DB: Backend>(idem: Idem<DB>) {
    tokio::spawn(async move {
        loop {
            if let Err(e) = idem.purge_expired(1_000).await {
                eprintln!("purge failed: {e}");
            }
            if let Err(e) = idem.tokens().purge_expired(1_000).await {
                eprintln!("token purge failed: {e}");
            }
            tokio::time::sleep(Duration::from_secs(3_600)).await;
        }
    });
}
