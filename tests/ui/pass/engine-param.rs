use std::sync::Arc;

use idempotency::{Idem, idempotent};
use sqlx::{Sqlite, Transaction};

// Neither state is `Serialize`: the parameter the engine comes from is
// plumbing, not part of the fingerprint.
#[derive(Clone)]
struct AppState {
    idem: Arc<Idem<Sqlite>>,
}

struct OwnedState {
    idem: Idem<Sqlite>,
}

#[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay", engine = app.idem)]
async fn pay(app: AppState, tx: &mut Transaction<'_, Sqlite>, order_id: u64) -> Result<u64, idempotency::Error> {
    let _ = tx;
    Ok(order_id)
}

#[idempotent(key = "order_<order_id>_ship", ttl = "24h", biz = "ship", engine = state.idem)]
async fn ship(state: OwnedState, order_id: u64) -> Result<u64, idempotency::Error> {
    Ok(order_id)
}

#[idempotent(key = "order_<order_id>_cancel", ttl = "24h", biz = "cancel", engine = app.idem)]
async fn cancel(app: &AppState, order_id: u64) -> Result<u64, idempotency::Error> {
    Ok(order_id)
}

fn main() {
    let _ = (pay, ship, cancel);
}
