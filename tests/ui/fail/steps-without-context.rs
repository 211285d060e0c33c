use idempotency::{Idem, idempotent};
use sqlx::Sqlite;

#[idempotent(key = "order_<order_id>_charge", ttl = "24h", biz = "charge", steps)]
async fn charge(idem: &Idem<Sqlite>, order_id: u64) -> Result<u64, idempotency::Error> {
    Ok(order_id)
}

fn main() {}
