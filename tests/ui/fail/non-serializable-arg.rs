use idempotency::{Idem, idempotent};
use sqlx::Sqlite;

struct Card {
    number: String,
}

#[idempotent(key = "order_<order_id>", ttl = "24h", biz = "pay")]
async fn pay(idem: &Idem<Sqlite>, order_id: u64, card: Card) -> Result<u64, idempotency::Error> {
    let _ = card.number;
    Ok(order_id)
}

fn main() {}
