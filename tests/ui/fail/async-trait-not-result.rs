use async_trait::async_trait;
use idempotency::{Idem, idempotent};
use sqlx::Sqlite;

#[async_trait]
trait Payments {
    async fn pay(&self, order_id: u64) -> u64;
}

struct Service {
    idem: Idem<Sqlite>,
}

#[async_trait]
impl Payments for Service {
    #[idempotent(key = "order_<order_id>", ttl = "24h", biz = "pay", engine = self.idem)]
    async fn pay(&self, order_id: u64) -> u64 {
        order_id
    }
}

fn main() {}
