use async_trait::async_trait;
use idempotency::{Idem, idempotent};
use sqlx::Sqlite;

#[async_trait]
trait Payments {
    async fn pay(&self, order_id: u64) -> Result<u64, idempotency::Error>;
}

struct Service {
    idem: Idem<Sqlite>,
}

#[idempotent(key = "order_<order_id>", ttl = "24h", biz = "pay", engine = self.idem)]
#[async_trait]
impl Payments for Service {
    async fn pay(&self, order_id: u64) -> Result<u64, idempotency::Error> {
        Ok(order_id)
    }
}

fn main() {}
