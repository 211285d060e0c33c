//! `cargo run --example grpc --features tonic`
//!
//! A tonic server with one idempotent method, `idem.example.Payments/Pay`
//! ([`payments.proto`](grpc/payments.proto)), the caller named by the
//! metadata `x-user-id` (a stand-in for real authentication) and the retry
//! key by `idempotency-key`. Orders 1..=10000 exist as `PENDING`, in SQLite:
//! the file in `IDEM_SQLITE_URL` (e.g. `sqlite:idem-grpc.db`) or, unset, an
//! in-memory database. It listens on `IDEM_GRPC_ADDR` (default
//! `127.0.0.1:50051`), first calls itself through a real tonic client and
//! prints what each call answered, then keeps serving:
//!
//! ```text
//! first call:   PayReply { order_id: 42, user: "alice", amount: 1999, payment_id: 1 }
//! the same:     PayReply { order_id: 42, user: "alice", amount: 1999, payment_id: 1 } idempotent-replayed: true
//! amount 5:     FailedPrecondition idem-code IDEMPOTENCY_KEY_REUSED
//! key "abc":    InvalidArgument idem-code INVALID_IDEMPOTENCY_KEY
//! ```
//!
//! With grpcurl:
//! ```sh
//! grpcurl -plaintext -import-path examples/grpc -proto payments.proto \
//!   -H 'x-user-id: alice' -H 'idempotency-key: 5d0c2a6e-pay-43' \
//!   -d '{"order_id":43,"amount":1999}' 127.0.0.1:50051 idem.example.Payments/Pay
//! ```
//! The same command again answers the same reply plus the response
//! metadata `idempotent-replayed: true`; a duplicate sent while the first
//! runs answers `UNAVAILABLE` with `grpc-retry-pushback-ms: 1000`, which a
//! retry policy on `UNAVAILABLE` waits out and then receives the replay.

// The service's messages, trait, server and client (what tonic-build makes of payments.proto).
#[path = "grpc/proto.rs"]
mod proto;

use std::str::FromStr;
use std::time::Duration;

use idempotency::grpc::{self, check_principal};
use idempotency::http::IdempotencyKey;
use idempotency::{Idem, idempotent};
use proto::{PayReply, PayRequest, Payments, PaymentsClient, PaymentsServer};
use sqlx::{AssertSqlSafe, Sqlite, Transaction};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

/// Why a payment did not go through. An `Err` is never recorded, so the
/// same request may be sent again.
#[derive(Debug)]
enum PayError {
    Idem(idempotency::Error),
    /// The order exists but can no longer be paid.
    NotPayable(i64),
    BadAmount,
}

impl From<idempotency::Error> for PayError {
    fn from(e: idempotency::Error) -> Self {
        PayError::Idem(e)
    }
}

impl From<sqlx::Error> for PayError {
    fn from(e: sqlx::Error) -> Self {
        // Rolled back, nothing written: retryable, like the engine's own storage failures.
        PayError::Idem(e.into())
    }
}

/// The status each failure answers: the engine's by its table
/// (`idempotency::grpc`), the business rules' with codes of their own.
impl From<PayError> for Status {
    fn from(e: PayError) -> Self {
        match e {
            PayError::Idem(e) => e.into(),
            PayError::NotPayable(id) => {
                Status::failed_precondition(format!("ORDER_NOT_PAYABLE: order {id} is not pending payment"))
            }
            PayError::BadAmount => {
                Status::invalid_argument("INVALID_AMOUNT: amount must be a positive number of cents")
            }
        }
    }
}

/// Once per (user, idempotency-key): the key template is scoped to the
/// principal; the engine is not part of the fingerprint, everything else is.
#[idempotent(key = "<user>:<idem_key>", ttl = "24h", biz = "grpc_pay")]
async fn pay_order(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    user: String,
    idem_key: String,
    order_id: i64,
    amount: i64,
) -> Result<PayReply, PayError> {
    if amount <= 0 {
        return Err(PayError::BadAmount);
    }
    let paid = sqlx::query("UPDATE orders SET status = 'PAID' WHERE id = ? AND status = 'PENDING'")
        .bind(order_id)
        .execute(&mut **tx)
        .await?;
    if paid.rows_affected() == 0 {
        return Err(PayError::NotPayable(order_id));
    }
    let payment = sqlx::query("INSERT INTO payments (order_id, user_id, amount) VALUES (?, ?, ?)")
        .bind(order_id)
        .bind(&user)
        .bind(amount)
        .execute(&mut **tx)
        .await?;
    Ok(PayReply { order_id, user, amount, payment_id: payment.last_insert_rowid() })
}

struct PaymentService {
    idem: Idem<Sqlite>,
}

#[tonic::async_trait]
impl Payments for PaymentService {
    async fn pay(&self, request: Request<PayRequest>) -> Result<Response<PayReply>, Status> {
        let user = caller(&request)?;
        let IdempotencyKey(idem_key) = IdempotencyKey::from_metadata(request.metadata())?;
        let PayRequest { order_id, amount } = request.into_inner();
        grpc::respond(pay_order(&self.idem, user, idem_key, order_id, amount)).await
    }
}

/// The authenticated principal; here simply the metadata `x-user-id`.
/// None is `UNAUTHENTICATED`; one that cannot scope a key (`:` in it, or
/// anything outside `[A-Za-z0-9_.-]{1,64}`) is refused by `check_principal`
/// with `INVALID_ARGUMENT`, so that two users' keys never render the same.
fn caller<T>(request: &Request<T>) -> Result<String, Status> {
    let Some(user) = request.metadata().get("x-user-id") else {
        return Err(Status::unauthenticated("send x-user-id: 1 to 64 characters from A-Z a-z 0-9 _ . -"));
    };
    let user = String::from_utf8_lossy(user.as_bytes());
    check_principal(&user)?;
    Ok(user.into_owned())
}

const DDL: &str = "
    CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL);
    CREATE TABLE IF NOT EXISTS payments (
        id INTEGER PRIMARY KEY AUTOINCREMENT, order_id INTEGER NOT NULL,
        user_id TEXT NOT NULL, amount INTEGER NOT NULL);";

/// Orders 1..=10000 as `PENDING`, in one statement; existing rows are kept.
fn seed_orders() -> AssertSqlSafe<String> {
    let rows: Vec<String> = (1..=10_000).map(|id| format!("({id},'PENDING')")).collect();
    // Safe: made of a literal and integers only.
    AssertSqlSafe(format!("INSERT OR IGNORE INTO orders (id, status) VALUES {}", rows.join(",")))
}

/// A `Pay` request from alice with these metadata values.
fn pay_request(order_id: i64, amount: i64, key: &str) -> Result<Request<PayRequest>, Box<dyn std::error::Error>> {
    let mut request = Request::new(PayRequest { order_id, amount });
    request.metadata_mut().insert("x-user-id", "alice".parse()?);
    request.metadata_mut().insert("idempotency-key", key.parse()?);
    Ok(request)
}

/// One line per answer: the reply and its replay marker, or the status code and `idem-code`.
fn show(answer: Result<Response<PayReply>, Status>) -> String {
    match answer {
        Ok(response) => match response.metadata().get("idempotent-replayed") {
            Some(marker) => format!("{:?} idempotent-replayed: {}", response.get_ref(), marker.to_str().unwrap_or("?")),
            None => format!("{:?}", response.get_ref()),
        },
        Err(status) => {
            let code = status.metadata().get("idem-code").and_then(|v| v.to_str().ok()).unwrap_or("-");
            format!("{:?} idem-code {code}", status.code())
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("IDEM_GRPC_ADDR").unwrap_or_else(|_| "127.0.0.1:50051".into());
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
    let idem = Idem::new(pool);
    idem.migrate().await?;
    sqlx::raw_sql(DDL).execute(idem.pool()).await?;
    sqlx::query(seed_orders()).execute(idem.pool()).await?;

    let listener = tokio::net::TcpListener::bind(&addr).await?;
    let local = listener.local_addr()?;
    let service = PaymentsServer::new(PaymentService { idem });
    let server = tokio::spawn(Server::builder().serve_with_incoming(service, TcpIncoming::from(listener)));
    println!("serving idem.example.Payments on {local} (SQLite)");

    let mut client = PaymentsClient::new(Channel::from_shared(format!("http://{local}"))?.connect().await?);
    let key = format!("demo-{}-pay-42", std::process::id());
    println!("first call:   {}", show(client.pay(pay_request(42, 1999, &key)?).await));
    println!("the same:     {}", show(client.pay(pay_request(42, 1999, &key)?).await));
    println!("amount 5:     {}", show(client.pay(pay_request(42, 5, &key)?).await));
    println!("key \"abc\":    {}", show(client.pay(pay_request(42, 1999, "abc")?).await));

    server.await??;
    Ok(())
}
