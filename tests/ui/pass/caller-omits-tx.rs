use idempotency::{Idem, idempotent};
use sqlx::{Sqlite, Transaction};

#[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay")]
async fn pay(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    order_id: i64,
    amount: i64,
) -> Result<i64, idempotency::Error> {
    let _ = tx;
    Ok(order_id + amount)
}

// The caller never sees the transaction: the engine opens it.
async fn caller(idem: &Idem<Sqlite>) -> Result<i64, idempotency::Error> {
    pay(idem, 42, 1999).await
}

fn main() {
    let _ = caller;
}
