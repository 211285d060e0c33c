use idempotency::{Idem, idempotent};
use sqlx::Sqlite;

#[idempotent(key = "order_<order_id>", ttl = "24h", biz = "pay")]
async fn pay(idem: &Idem<Sqlite>, order_id: u64) -> Option<u64> {
    Some(order_id)
}

fn main() {}
