// `crate = "..."`: the generated code reaches idempotency through the given path,
// for a dependency renamed (`extern crate` here, `package =` in Cargo.toml)
// or re-exported from a crate of one's own.
extern crate idempotency as renamed;

use renamed::{Idem, idempotent};
use sqlx::{Sqlite, Transaction};

#[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay", crate = "renamed")]
async fn pay(idem: &Idem<Sqlite>, tx: &mut Transaction<'_, Sqlite>, order_id: i64) -> Result<i64, renamed::Error> {
    let _ = tx;
    Ok(order_id)
}

/// Stands for a crate that re-exports idempotency, so its users need no dependency
/// of their own.
mod platform {
    pub use ::idempotency as reexported;
}

mod orders {
    use crate::platform::reexported::{Idem, idempotent};

    #[idempotent(key = "order_<order_id>_refund", ttl = "7d", biz = "refund", crate = "crate::platform::reexported")]
    pub async fn refund(idem: &Idem<sqlx::Sqlite>, order_id: i64) -> Result<i64, crate::platform::reexported::Error> {
        Ok(order_id)
    }
}

fn main() {
    let _ = pay;
    let _ = orders::refund;
}
