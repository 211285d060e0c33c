use idempotency::{Idem, idempotent};
use sqlx::Sqlite;

// Not `Serialize`: only `#[idem(skip)]` keeps it out of the fingerprint.
struct RequestContext {
    trace: String,
}

#[idempotent(key = "refund_<order_id>", ttl = "7d", biz = "refund")]
async fn refund(
    idem: &Idem<Sqlite>,
    #[idem(skip)] ctx: RequestContext,
    order_id: u64,
) -> Result<u64, idempotency::Error> {
    let _ = ctx.trace;
    Ok(order_id)
}

fn main() {
    let _ = refund;
}
