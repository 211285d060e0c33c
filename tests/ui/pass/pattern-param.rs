use idempotency::{Idem, idempotent};
use serde::Serialize;
use sqlx::{Sqlite, Transaction};

struct Json<T>(T);

#[derive(Serialize)]
struct PayReq {
    order_id: u64,
    amount: i64,
}

#[idempotent(key = "order_<req.order_id>_pay", ttl = "24h", biz = "pay")]
async fn pay(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    Json(req): Json<PayReq>,
) -> Result<i64, idempotency::Error> {
    let _ = tx;
    Ok(req.amount)
}

fn main() {
    let _ = pay;
}
