use idempotency::{Idem, idempotent};
use sqlx::{Sqlite, Transaction};

#[derive(Debug)]
enum PayError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
}

impl From<idempotency::Error> for PayError {
    fn from(e: idempotency::Error) -> Self {
        PayError::Idem(e)
    }
}

impl From<sqlx::Error> for PayError {
    fn from(e: sqlx::Error) -> Self {
        PayError::Db(e)
    }
}

#[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay")]
async fn pay(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    order_id: i64,
    amount: i64,
) -> Result<i64, PayError> {
    sqlx::query("UPDATE orders SET paid = ? WHERE id = ?")
        .bind(amount)
        .bind(order_id)
        .execute(&mut **tx)
        .await?;
    Ok(amount)
}

fn main() {
    let _ = pay;
}
