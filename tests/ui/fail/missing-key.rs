use idempotency::{Idem, idempotent};
use sqlx::Sqlite;

#[idempotent(ttl = "24h", biz = "pay")]
async fn pay(idem: &Idem<Sqlite>, order_id: u64) -> Result<u64, idempotency::Error> {
    Ok(order_id)
}

fn main() {}
