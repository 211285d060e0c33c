use idempotency::{Idem, idempotent};
use sqlx::{Sqlite, Transaction};

#[idempotent(key = "order_<order_id>", ttl = "24h", biz = "pay")]
async fn pay(
    idem: &Idem<Sqlite>,
    #[idem(skip_if_default)] tx: &mut Transaction<'_, Sqlite>,
    order_id: u64,
) -> Result<u64, idempotency::Error> {
    let _ = tx;
    Ok(order_id)
}

fn main() {}
