use idempotency::{Idem, idempotent};
use sqlx::{Sqlite, Transaction};

struct PaymentService {
    idem: Idem<Sqlite>,
}

impl PaymentService {
    #[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay", engine = self.idem)]
    async fn pay(&self, tx: &mut Transaction<'_, Sqlite>, order_id: u64) -> Result<u64, idempotency::Error> {
        let _ = tx;
        Ok(order_id)
    }
}

fn main() {
    let _ = PaymentService::pay;
}
