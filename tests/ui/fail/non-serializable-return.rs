use idempotency::{Idem, idempotent};
use sqlx::Sqlite;

struct Receipt {
    order_id: u64,
}

#[idempotent(key = "order_<order_id>", ttl = "24h", biz = "pay")]
async fn pay(idem: &Idem<Sqlite>, order_id: u64) -> Result<Receipt, idempotency::Error> {
    Ok(Receipt { order_id })
}

fn main() {}
