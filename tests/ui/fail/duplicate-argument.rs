use idempotency::{Idem, idempotent};
use sqlx::Sqlite;

#[idempotent(key = "order_<order_id>", ttl = "24h", ttl = "1h", biz = "pay")]
async fn pay(idem: &Idem<Sqlite>, order_id: u64) -> Result<u64, idempotency::Error> {
    Ok(order_id)
}

fn main() {}
