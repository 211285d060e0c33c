//! `cargo run --example quickstart`: embedded SQLite, no servers.
//! First call, replay, key reuse, the status query, and the state layer
//! stopping a second payment made under another key, each printed.

use idempotency::state::{Advanced, advance};
use idempotency::{Idem, Status, col, idempotent, transition};
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, Transaction};

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

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Receipt {
    order_id: i64,
    amount: i64,
    /// Whether this call paid the order (a duplicate under another key finds it paid).
    paid_now: bool,
}

#[derive(Debug)]
enum PayError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
    NotPayable(OrderStatus),
    NoSuchOrder,
}

impl std::fmt::Display for PayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PayError::Idem(e) => write!(f, "{e}"),
            PayError::Db(e) => write!(f, "database: {e}"),
            PayError::NotPayable(state) => write!(f, "the order is {state:?}"),
            PayError::NoSuchOrder => f.write_str("no such order"),
        }
    }
}

impl std::error::Error for PayError {}

impl From<idempotency::Error> for PayError {
    fn from(e: idempotency::Error) -> Self {
        PayError::Idem(e)
    }
}

impl From<sqlx::Error> for PayError {
    fn from(e: sqlx::Error) -> Self {
        PayError::Db(e)
    }
}

#[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay")]
async fn pay(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    order_id: i64,
    amount: i64,
) -> Result<Receipt, PayError> {
    let paid_now = match advance(transition!(OrderStatus: Pending -> Paid))
        .set(col!(paid_amount), amount)
        .run(&mut **tx, order_id)
        .await?
    {
        Advanced::Applied => true,
        // Paid already: success, and nothing to write.
        Advanced::AlreadyThere => false,
        Advanced::Conflict { current } => return Err(PayError::NotPayable(current)),
        Advanced::NotFound => return Err(PayError::NoSuchOrder),
    };
    if paid_now {
        sqlx::query("INSERT INTO payments (order_id, amount) VALUES (?, ?)")
            .bind(order_id)
            .bind(amount)
            .execute(&mut **tx)
            .await?;
    }
    Ok(Receipt { order_id, amount, paid_now })
}

/// The same payment under a key of the caller's choosing: a client that
/// sends a fresh key on every retry defeats the record, not the state.
#[idempotent(key = "<request_id>", ttl = "24h", biz = "pay_by_request")]
async fn pay_by_request(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    request_id: String,
    order_id: i64,
    amount: i64,
) -> Result<Receipt, PayError> {
    let answer = advance(transition!(OrderStatus: Pending -> Paid)).run(&mut **tx, order_id).await?;
    match answer {
        Advanced::Applied | Advanced::AlreadyThere => {
            Ok(Receipt { order_id, amount, paid_now: answer == Advanced::Applied })
        }
        Advanced::Conflict { current } => Err(PayError::NotPayable(current)),
        Advanced::NotFound => Err(PayError::NoSuchOrder),
    }
}

#[tokio::main]
async fn main() -> Result<(), PayError> {
    let idem = Idem::sqlite_memory().await?;
    sqlx::raw_sql(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL, paid_amount INTEGER NULL);
         CREATE TABLE payments (id INTEGER PRIMARY KEY, order_id INTEGER NOT NULL, amount INTEGER NOT NULL);
         INSERT INTO orders (id, status) VALUES (42, 'PENDING');",
    )
    .execute(idem.pool())
    .await?;

    let first = pay(&idem, 42, 1999).await?;
    println!("first call   -> executed: {first:?}");

    let again = pay(&idem, 42, 1999).await?;
    println!("same call    -> replayed: {again:?} (identical: {})", again == first);

    match pay(&idem, 42, 5).await {
        Err(PayError::Idem(e @ idempotency::Error::KeyReused { .. })) => println!("other amount -> rejected: {e}"),
        other => println!("other amount -> unexpected: {other:?}"),
    }

    match idem.status("pay", "order_42_pay").await? {
        Status::Completed { response } => println!("status       -> completed, stored response {response}"),
        other => println!("status       -> {other:?}"),
    }
    println!("status of an unused key -> {:?}", idem.status("pay", "order_7_pay").await?);

    let retry = pay_by_request(&idem, "req-7f3a".into(), 42, 1999).await?;
    println!("another key  -> executed, but the order was paid already: {retry:?}");

    let payments: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payments").fetch_one(idem.pool()).await?;
    println!("payments rows: {payments} (one payment)");
    Ok(())
}
