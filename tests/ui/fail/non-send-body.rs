use std::rc::Rc;

use idempotency::{Idem, idempotent};
use sqlx::{Sqlite, Transaction};

#[idempotent(key = "order_<order_id>", ttl = "24h", biz = "pay")]
async fn pay(idem: &Idem<Sqlite>, tx: &mut Transaction<'_, Sqlite>, order_id: u64) -> Result<u64, idempotency::Error> {
    // Held across an await: the body's future is not `Send`.
    let shared = Rc::new(order_id);
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    Ok(*shared)
}

fn main() {}
