use idempotency::{Idem, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{MySql, MySqlPool, Transaction};

#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    order_id: u64,
    amount: i64,
}

// The error may be your own type, if it converts from `idempotency::Error`.
#[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay")]
async fn pay(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    order_id: u64,
    amount: i64,
) -> Result<Receipt, idempotency::Error> {
    sqlx::query("UPDATE orders SET status = 'PAID' WHERE id = ? AND status = 'PENDING'")
        .bind(order_id)
        .execute(&mut **tx)
        .await?; // a sqlx::Error converts: Storage (retry later) or StorageRefused, by its code
    Ok(Receipt { order_id, amount })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = MySqlPool::connect("mysql://root@127.0.0.1:3306/test").await?;
    let redis = redis::Client::open("redis://127.0.0.1:6379")?; // optional: the fast path
    let idem = Idem::builder(pool).redis(redis).build();
    idem.migrate().await?; // at every start: creates the engine's tables if absent

    // This example's business table.
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS orders (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL)")
        .execute(idem.pool())
        .await?;
    sqlx::query("INSERT IGNORE INTO orders VALUES (7, 'PENDING')").execute(idem.pool()).await?;

    // Callers do not pass the transaction:
    let receipt = pay(&idem, 7, 1999).await?; // runs the body
    let again = pay(&idem, 7, 1999).await?; // replays the stored Receipt, body not run
    println!("{receipt:?}\n{again:?}");
    Ok(())
}
