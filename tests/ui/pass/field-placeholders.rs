use idempotency::{Idem, idempotent};
use serde::Serialize;
use sqlx::{Sqlite, Transaction};

#[derive(Serialize)]
struct Order {
    id: u64,
}

#[derive(Serialize)]
struct PayReq {
    order: Order,
    idem_key: String,
    amount: i64,
}

#[idempotent(key = "<user>:<req.order.id>:<req.idem_key>", ttl = "24h", biz = "pay")]
async fn pay(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    user: u64,
    req: PayReq,
) -> Result<i64, idempotency::Error> {
    let _ = tx;
    Ok(req.amount)
}

fn main() {
    let _ = pay;
}
