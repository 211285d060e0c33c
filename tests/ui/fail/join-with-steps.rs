use idempotency::{Idem, Steps, idempotent};
use sqlx::Sqlite;

#[idempotent(key = "order_<order_id>", ttl = "24h", biz = "charge", steps, join)]
async fn charge(idem: &Idem<Sqlite>, steps: &mut Steps<Sqlite>, order_id: u64) -> Result<u64, idempotency::Error> {
    Ok(order_id)
}

fn main() {}
