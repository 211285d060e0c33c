// The two-phase mode: `steps` in the attribute, the step context as a
// parameter the caller never passes, a step, a permanent failure, the final
// transaction; the call's future is `Send`.
use idempotency::{Idem, Steps, idempotent};
use sqlx::Sqlite;

#[derive(serde::Serialize, serde::Deserialize)]
struct Charge {
    id: String,
    amount: i64,
}

#[idempotent(key = "order_<order_id>_charge", ttl = "24h", biz = "charge", steps)]
async fn charge(
    idem: &Idem<Sqlite>,
    steps: &mut Steps<Sqlite>,
    order_id: i64,
    amount: i64,
) -> Result<Charge, idempotency::Error> {
    let charge: Charge = steps
        .step("charge", |step_key| async move { Ok::<_, idempotency::Error>(Charge { id: step_key.to_string(), amount }) })
        .await?;
    if charge.amount < 0 {
        return Err(steps.permanent("negative amount"));
    }
    let tx = steps.transaction().await?;
    sqlx::query("INSERT INTO payment (order_id, charge_id) VALUES (?, ?)")
        .bind(order_id)
        .bind(&charge.id)
        .execute(&mut **tx)
        .await?;
    Ok(charge)
}

fn assert_send<T: Send>(_: T) {}

fn main() {
    assert_send(async {
        let idem = Idem::sqlite_memory().await.unwrap();
        charge(&idem, 1, 1999).await
    });
}
