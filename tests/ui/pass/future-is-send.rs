use idempotency::{Idem, idempotent};
use sqlx::{Sqlite, Transaction};

#[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay")]
async fn pay(idem: &Idem<Sqlite>, tx: &mut Transaction<'_, Sqlite>, order_id: i64) -> Result<i64, idempotency::Error> {
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    Ok(order_id)
}

fn assert_send<T: Send>(_: T) {}

fn main() {
    // Built, never polled: a multi-threaded runtime (`tokio::spawn`, axum
    // handlers) needs the future to be `Send`.
    assert_send(async {
        let idem = Idem::sqlite_memory().await.unwrap();
        pay(&idem, 1).await
    });
}
