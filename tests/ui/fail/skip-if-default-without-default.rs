use idempotency::{Idem, idempotent};
use serde::Serialize;
use sqlx::Sqlite;

#[derive(Serialize)]
struct Currency(&'static str);

#[idempotent(key = "order_<order_id>", ttl = "24h", biz = "pay")]
async fn pay(
    idem: &Idem<Sqlite>,
    order_id: u64,
    #[idem(skip_if_default)] currency: Currency,
) -> Result<u64, idempotency::Error> {
    let _ = currency.0;
    Ok(order_id)
}

fn main() {}
