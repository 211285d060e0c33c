//! `cargo run --example http --features axum,mysql,sqlite,redis`
//!
//! An axum server with one idempotent endpoint, `POST /orders/{id}/pay`
//! (JSON body `{"amount": <integer cents>}`), the caller named by an
//! `X-User-Id` header (a stand-in for real authentication) and the retry key
//! either made by the client (`Idempotency-Key`) or issued by the server
//! (`GET /orders/{id}/pay-token`, then `Idempotency-Token`). Orders
//! 1..=10000 exist as `PENDING`.
//!
//! Environment:
//! - `IDEM_HTTP_ADDR`: where to listen (default `127.0.0.1:3000`);
//! - `IDEM_MYSQL_URL`: MySQL / MariaDB, e.g. `mysql://root@127.0.0.1:3306/test`;
//!   unset, SQLite: the file in `IDEM_SQLITE_URL` (e.g. `sqlite:idem-http.db`)
//!   or, unset too, an in-memory database;
//! - `IDEM_REDIS_URL`: the optional Redis claim, e.g. `redis://127.0.0.1:6379`.
//!
//! With `--features metrics` too, `GET /metrics` answers the engine's metrics
//! in the Prometheus text format (`curl localhost:3000/metrics`).
//!
//! ```sh
//! curl -i -X POST localhost:3000/orders/42/pay -H 'X-User-Id: alice' \
//!   -H 'Idempotency-Key: 5d0c2a6e-pay-42' -H 'Content-Type: application/json' -d '{"amount":1999}'
//! ```
//! The same command again answers the same body plus `Idempotent-Replayed: true`,
//! and so does `-H 'Idempotency-Key: "5d0c2a6e-pay-42"'` (the quoted form of
//! the IETF draft: the same key); with `{"amount":5}` it answers 422
//! `IDEMPOTENCY_KEY_REUSED`, and with `-H 'X-User-Id: alice:x'` 400
//! `INVALID_PRINCIPAL`. A client that sends a fresh key with its retry
//! defeats the record, not the order's own state (layer 4,
//! `idempotency::state`): the second body finds the order already paid and answers
//! 200 with the first payment, writing nothing.
//!
//! For clients that must not make up their own keys, the form asks for a
//! token first (it is alice's alone, for 15 minutes) and the submit sends it:
//! ```sh
//! curl -s localhost:3000/orders/43/pay-token -H 'X-User-Id: alice'
//! # {"token":"<32 characters>","expires_in":900}
//! curl -i -X POST localhost:3000/orders/43/pay -H 'X-User-Id: alice' \
//!   -H 'Idempotency-Token: <token>' -H 'Content-Type: application/json' -d '{"amount":1999}'
//! ```
//! The same submit again replays the first answer (`Idempotent-Replayed:
//! true`), or answers 409 while the first runs; a submit whose payment fails
//! (say `{"amount":0}`, 422) gives the token back, so the corrected submit
//! runs. A forged, expired or another user's token answers 403
//! `IDEMPOTENCY_TOKEN_INVALID`, and nothing is written. Tokens live in Redis
//! when `IDEM_REDIS_URL` is set (then a Redis outage answers 503, never a
//! pass), in the table `idem_token` otherwise.

use std::str::FromStr;
use std::time::Duration;

use axum::extract::{FromRequestParts, Path, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router, middleware};
use idempotency::http::{IdempotencyKey, IdempotencyToken, KeyOrToken, Problem, check_principal, replay_header};
use idempotency::state::{Advanced, advance};
use idempotency::{Backend, Idem, TokenError, idempotent, transition};
use serde::{Deserialize, Serialize};
use sqlx::{AssertSqlSafe, Transaction};

/// The business action pay tokens are issued for.
const PAY_TOKENS: &str = "http_pay";
/// How long a pay token lives: the time a user may take to fill the form.
const PAY_TOKEN_TTL: Duration = Duration::from_secs(15 * 60);

/// What `GET /orders/{id}/pay-token` answers.
#[derive(Debug, Serialize)]
struct PayToken {
    token: String,
    /// Seconds the token stays usable.
    expires_in: u64,
}

/// The order's state column and its allowed moves (layer 4).
#[derive(Clone, Copy, Debug, PartialEq, idempotency::State)]
#[state(table = "orders", id = "id", column = "status")]
#[state(transitions(Pending -> Paid, Paid -> Refunded, Pending -> Closed))]
enum OrderStatus {
    Pending,
    Paid,
    Refunded,
    Closed,
}

/// The request body.
#[derive(Debug, Serialize, Deserialize)]
struct PayReq {
    /// Integer cents.
    amount: i64,
}

/// What a successful payment answers, and what a retry replays.
#[derive(Debug, Serialize, Deserialize)]
struct PayResponse {
    order_id: i64,
    amount: i64,
    payment_id: i64,
    status: String,
}

impl IntoResponse for PayResponse {
    fn into_response(self) -> Response {
        (StatusCode::OK, Json(self)).into_response()
    }
}

/// The handler's error: the engine's, or the business rules'. An `Err` is
/// never recorded, so the same request may be sent again.
#[derive(Debug)]
enum ApiError {
    Idem(idempotency::Error),
    /// The token is refused (403) or cannot be checked (503).
    Token(TokenError),
    /// The order exists but can no longer be paid (closed, refunded).
    NotPayable(i64),
    NotFound(i64),
    BadAmount,
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
        // Rolled back, nothing written: retryable, like the engine's own storage failures (503).
        ApiError::Idem(e.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Idem(e) => e.into_response(),
            ApiError::Token(e) => e.into_response(),
            ApiError::NotPayable(id) => {
                problem(StatusCode::CONFLICT, "ORDER_NOT_PAYABLE", format!("order {id} is not pending payment"))
            }
            ApiError::NotFound(id) => problem(StatusCode::NOT_FOUND, "ORDER_NOT_FOUND", format!("no order {id}")),
            ApiError::BadAmount => problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "INVALID_AMOUNT",
                "amount must be a positive number of cents".into(),
            ),
        }
    }
}

/// An `application/problem+json` answer in the same shape as the engine's.
fn problem(status: StatusCode, code: &'static str, detail: String) -> Response {
    let title = status.canonical_reason().unwrap_or("Error");
    Problem { status, code, title, detail, retry_after: None }.into_response()
}

/// The authenticated principal; here simply the `X-User-Id` header. None
/// is 401; one that cannot scope a key (`:` in it, the separator in the key
/// template, or anything outside `[A-Za-z0-9_.-]{1,64}`) is refused by
/// `check_principal` with 400 `INVALID_PRINCIPAL`, so that two users' keys
/// can never render the same.
struct UserId(String);

impl<S: Send + Sync> FromRequestParts<S> for UserId {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Response> {
        let Some(value) = parts.headers.get("x-user-id") else {
            let detail = "send X-User-Id: 1 to 64 characters from A-Z a-z 0-9 _ . -".to_owned();
            return Err(problem(StatusCode::UNAUTHORIZED, "UNAUTHENTICATED", detail));
        };
        let user = String::from_utf8_lossy(value.as_bytes());
        check_principal(&user).map_err(IntoResponse::into_response)?;
        Ok(UserId(user.into_owned()))
    }
}

/// The handler and its router for one database. MySQL and SQLite take the
/// same SQL (`?` placeholders); only the type and the new row's id differ.
macro_rules! pay_service {
    ($module:ident, $db:ty, $payment_id:path) => {
        mod $module {
            use super::*;

            #[derive(Clone)]
            pub struct App {
                pub idem: Idem<$db>,
            }

            /// A token for paying an order, for this user alone.
            async fn pay_token(
                State(app): State<App>,
                UserId(user): UserId,
                Path(_order_id): Path<i64>,
            ) -> Result<Json<PayToken>, ApiError> {
                let issued = app.idem.tokens().issue(PAY_TOKENS, &user, PAY_TOKEN_TTL).await?;
                Ok(Json(PayToken { token: issued.token, expires_in: issued.ttl.as_secs() }))
            }

            /// Pays an order once per retry key: the client's
            /// `Idempotency-Key`, or the `Idempotency-Token` the server
            /// issued (consumed here, given back if the payment fails).
            async fn pay(
                State(app): State<App>,
                UserId(user): UserId,
                proof: KeyOrToken,
                Path(order_id): Path<i64>,
                Json(req): Json<PayReq>,
            ) -> Result<PayResponse, ApiError> {
                match proof {
                    KeyOrToken::Key(IdempotencyKey(idem_key)) => pay_by_key(&app, user, idem_key, order_id, req).await,
                    KeyOrToken::Token(IdempotencyToken(token)) => {
                        let call = || pay_by_token(&app, user.clone(), token.clone(), order_id, req);
                        app.idem.tokens().redeem(PAY_TOKENS, &user, &token, call).await
                    }
                }
            }

            /// Once per (user, Idempotency-Key). The key template is scoped
            /// to the principal; `app` (the engine's root) is not part of the
            /// fingerprint, everything else is.
            #[idempotent(key = "<user>:<idem_key>", ttl = "24h", biz = "http_pay", engine = app.idem)]
            async fn pay_by_key(
                app: &App,
                tx: &mut Transaction<'_, $db>,
                user: String,
                idem_key: String,
                order_id: i64,
                req: PayReq,
            ) -> Result<PayResponse, ApiError> {
                charge(tx, &user, order_id, &req).await
            }

            /// Once per token: every submit of one token meets this record
            /// (another `biz`, so a client's key can never name it).
            #[idempotent(key = "<user>:<token>", ttl = "24h", biz = "http_pay_token", engine = app.idem)]
            async fn pay_by_token(
                app: &App,
                tx: &mut Transaction<'_, $db>,
                user: String,
                token: String,
                order_id: i64,
                req: PayReq,
            ) -> Result<PayResponse, ApiError> {
                charge(tx, &user, order_id, &req).await
            }

            /// The payment itself, in the call's transaction.
            async fn charge(
                tx: &mut Transaction<'_, $db>,
                user: &str,
                order_id: i64,
                req: &PayReq,
            ) -> Result<PayResponse, ApiError> {
                if req.amount <= 0 {
                    return Err(ApiError::BadAmount);
                }
                // Layer 4: the order's own state decides, even when two keys
                // (a client that invents a new one per retry) reach this body.
                match advance(transition!(OrderStatus: Pending -> Paid)).run(&mut **tx, order_id).await? {
                    Advanced::Applied => {}
                    Advanced::AlreadyThere => {
                        // Paid before, under another key: success, with that payment.
                        let (payment_id, amount): (i64, i64) =
                            sqlx::query_as("SELECT id, amount FROM payments WHERE order_id = ?")
                                .bind(order_id)
                                .fetch_one(&mut **tx)
                                .await?;
                        return Ok(PayResponse { order_id, amount, payment_id, status: "PAID".into() });
                    }
                    Advanced::Conflict { .. } => return Err(ApiError::NotPayable(order_id)),
                    Advanced::NotFound => return Err(ApiError::NotFound(order_id)),
                }
                let inserted = sqlx::query("INSERT INTO payments (order_id, user_id, amount) VALUES (?, ?, ?)")
                    .bind(order_id)
                    .bind(user)
                    .bind(req.amount)
                    .execute(&mut **tx)
                    .await?;
                Ok(PayResponse {
                    order_id,
                    amount: req.amount,
                    payment_id: $payment_id(&inserted),
                    status: "PAID".into(),
                })
            }

            pub fn router(idem: Idem<$db>) -> Router {
                Router::new()
                    .route("/orders/{id}/pay", post(pay))
                    .route("/orders/{id}/pay-token", get(pay_token))
                    .layer(middleware::from_fn(replay_header))
                    .with_state(App { idem })
            }
        }
    };
}

fn mysql_payment_id(result: &sqlx::mysql::MySqlQueryResult) -> i64 {
    i64::try_from(result.last_insert_id()).unwrap_or(i64::MAX)
}

fn sqlite_payment_id(result: &sqlx::sqlite::SqliteQueryResult) -> i64 {
    result.last_insert_rowid()
}

pay_service!(on_mysql, sqlx::MySql, mysql_payment_id);
pay_service!(on_sqlite, sqlx::Sqlite, sqlite_payment_id);

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

/// `GET /metrics`: what the engine recorded, in the Prometheus text format.
/// The exporter only renders; axum serves it (no listener of its own).
#[cfg(feature = "metrics")]
fn metrics_route() -> Result<Router, Box<dyn std::error::Error>> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    idempotency::metrics::describe();
    // Histograms are summarised on upkeep, which nothing else runs here.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    Ok(Router::new().route("/metrics", axum::routing::get(move || std::future::ready(handle.render()))))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("IDEM_HTTP_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let redis = std::env::var("IDEM_REDIS_URL").ok().map(redis::Client::open).transpose()?;
    let claims = if redis.is_some() { "with the Redis claim" } else { "without Redis" };

    let (router, store) = if let Ok(url) = std::env::var("IDEM_MYSQL_URL") {
        let pool = sqlx::mysql::MySqlPoolOptions::new().max_connections(16).connect(&url).await?;
        let idem = engine(pool, redis);
        idem.migrate().await?;
        sqlx::raw_sql(MYSQL_DDL).execute(idem.pool()).await?;
        sqlx::query(seed_orders("INSERT IGNORE")).execute(idem.pool()).await?;
        purge_periodically(idem.clone());
        (on_mysql::router(idem), "MySQL")
    } else {
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
        (on_sqlite::router(idem), "SQLite")
    };

    #[cfg(feature = "metrics")]
    let router = router.merge(metrics_route()?);
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{} ({store}, {claims})", listener.local_addr()?);
    axum::serve(listener, router).await?;
    Ok(())
}
