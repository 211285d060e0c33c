// A trait with native `async fn` (no `#[async_trait]`): the method is an
// `async fn` when `#[idempotent]` sees it, as any other.
use idempotency::{Idem, idempotent};
use sqlx::{Sqlite, Transaction};

trait Payments {
    fn pay(&self, order_id: i64) -> impl Future<Output = Result<i64, idempotency::Error>> + Send;
}

struct Service {
    idem: Idem<Sqlite>,
}

impl Payments for Service {
    #[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay", engine = self.idem)]
    async fn pay(&self, tx: &mut Transaction<'_, Sqlite>, order_id: i64) -> Result<i64, idempotency::Error> {
        let _ = tx;
        Ok(order_id)
    }
}

fn main() {
    let _ = <Service as Payments>::pay;
}
