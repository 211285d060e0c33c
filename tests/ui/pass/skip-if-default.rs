use idempotency::{Idem, idempotent};
use serde::Serialize;
use sqlx::{Sqlite, Transaction};

#[derive(Default, Serialize)]
struct Gift {
    wrap: bool,
}

// Arguments added after calls were made: left out of the fingerprint while
// they equal their `Default`, through patterns too.
#[idempotent(key = "order_<order_id>", ttl = "24h", biz = "pay")]
async fn pay(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    order_id: u64,
    #[idem(skip_if_default)] coupon: Option<String>,
    #[idem(skip_if_default)] express: bool,
    #[idem(skip_if_default)] note: &str,
    #[idem(skip_if_default)] (gift, count): (Gift, u32),
) -> Result<u64, idempotency::Error> {
    let _ = (&mut **tx, coupon, express, note, gift.wrap, count);
    Ok(order_id)
}

fn main() {
    let _ = pay;
}
