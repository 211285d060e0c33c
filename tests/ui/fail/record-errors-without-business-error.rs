use idempotency::{Idem, idempotent};
use sqlx::{Sqlite, Transaction};

#[derive(Debug)]
enum PayError {
    Declined,
    Idem(idempotency::Error),
}

impl From<idempotency::Error> for PayError {
    fn from(e: idempotency::Error) -> Self {
        PayError::Idem(e)
    }
}

#[idempotent(key = "order_<order_id>", ttl = "24h", biz = "pay", record_errors)]
async fn pay(idem: &Idem<Sqlite>, tx: &mut Transaction<'_, Sqlite>, order_id: u64) -> Result<u64, PayError> {
    let _ = tx;
    if order_id == 0 {
        return Err(PayError::Declined);
    }
    Ok(order_id)
}

fn main() {}
