use idempotency::{Idem, idempotent};
use sqlx::{Sqlite, Transaction};

#[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay", join)]
async fn pay(idem: &Idem<Sqlite>, tx: &mut Transaction<'_, Sqlite>, order_id: i64) -> Result<i64, idempotency::Error> {
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    Ok(order_id)
}

fn assert_send<T: Send>(_: T) {}

fn main() {
    // The caller passes its own transaction, and may call twice in it; the
    // future stays `Send` for `tokio::spawn` and axum handlers.
    assert_send(async {
        let idem = Idem::sqlite_memory().await.unwrap();
        let mut tx = idem.pool().begin().await.unwrap();
        let first = pay(&idem, &mut tx, 1).await;
        let again = pay(&idem, &mut tx, 1).await;
        tx.commit().await.unwrap();
        (first, again)
    });
}
