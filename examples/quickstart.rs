//! `cargo run --example quickstart`: embedded SQLite, no servers.
//! First call, replay, key reuse and the status query, each printed.

use idem::{Idem, Status, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, Transaction};

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Receipt {
    order_id: i64,
    amount: i64,
    paid_rows: u64,
}

#[derive(Debug)]
enum PayError {
    Idem(idem::Error),
    Db(sqlx::Error),
}

impl std::fmt::Display for PayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PayError::Idem(e) => write!(f, "{e}"),
            PayError::Db(e) => write!(f, "database: {e}"),
        }
    }
}

impl std::error::Error for PayError {}

impl From<idem::Error> for PayError {
    fn from(e: idem::Error) -> Self {
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
    let paid = sqlx::query("UPDATE orders SET status = 'PAID' WHERE id = ? AND status = 'PENDING'")
        .bind(order_id)
        .execute(&mut **tx)
        .await?;
    sqlx::query("INSERT INTO payments (order_id, amount) VALUES (?, ?)")
        .bind(order_id)
        .bind(amount)
        .execute(&mut **tx)
        .await?;
    Ok(Receipt { order_id, amount, paid_rows: paid.rows_affected() })
}

#[tokio::main]
async fn main() -> Result<(), PayError> {
    let idem = Idem::sqlite_memory().await?;
    sqlx::raw_sql(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL);
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
        Err(PayError::Idem(e @ idem::Error::KeyReused { .. })) => println!("other amount -> rejected: {e}"),
        other => println!("other amount -> unexpected: {other:?}"),
    }

    match idem.status("pay", "order_42_pay").await? {
        Status::Completed { response } => println!("status       -> completed, stored response {response}"),
        other => println!("status       -> {other:?}"),
    }
    println!("status of an unused key -> {:?}", idem.status("pay", "order_7_pay").await?);

    let payments: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payments").fetch_one(idem.pool()).await?;
    println!("payments rows: {payments} (the body ran once)");
    Ok(())
}
