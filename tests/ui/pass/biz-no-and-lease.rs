use idempotency::{Idem, idempotent};
use sqlx::{Sqlite, Transaction};

#[idempotent(
    key = "order_<order_id>_pay",
    ttl = "24h",
    biz = "pay",
    biz_no = "<order_id>",
    lease = "5s"
)]
async fn pay(idem: &Idem<Sqlite>, tx: &mut Transaction<'_, Sqlite>, order_id: u64) -> Result<u64, idempotency::Error> {
    let _ = tx;
    Ok(order_id)
}

fn main() {
    let _ = pay;
}
