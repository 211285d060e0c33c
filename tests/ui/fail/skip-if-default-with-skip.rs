use idempotency::{Idem, idempotent};
use sqlx::Sqlite;

#[idempotent(key = "order_<order_id>", ttl = "24h", biz = "pay")]
async fn pay(
    idem: &Idem<Sqlite>,
    order_id: u64,
    #[idem(skip, skip_if_default)] coupon: Option<String>,
) -> Result<u64, idempotency::Error> {
    let _ = coupon;
    Ok(order_id)
}

fn main() {}
