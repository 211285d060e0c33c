// `#[async_trait]` on the impl expands first; `#[idempotent]` then rewrites
// the boxed future inside each method, whose signature keeps matching the
// trait: the engine's transaction is not in the trait, the caller's
// (`join`) is.
use async_trait::async_trait;
use idempotency::{Idem, idempotent};
use sqlx::{Sqlite, Transaction};

#[async_trait]
trait Payments {
    async fn pay(&self, order_id: i64, note: &str) -> Result<i64, idempotency::Error>;
    async fn pay_in(&self, tx: &mut Transaction<'_, Sqlite>, order_id: i64) -> Result<i64, idempotency::Error>;
}

struct Service {
    idem: Idem<Sqlite>,
}

#[async_trait]
impl Payments for Service {
    #[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay", engine = self.idem)]
    async fn pay(&self, tx: &mut Transaction<'_, Sqlite>, order_id: i64, note: &str) -> Result<i64, idempotency::Error> {
        sqlx::query("SELECT ?").bind(note).execute(&mut **tx).await?;
        Ok(order_id)
    }

    #[idempotent(key = "order_<order_id>_pay_in", ttl = "24h", biz = "pay_in", engine = self.idem, join)]
    async fn pay_in(&self, tx: &mut Transaction<'_, Sqlite>, order_id: i64) -> Result<i64, idempotency::Error> {
        sqlx::query("SELECT 1").execute(&mut **tx).await?;
        Ok(order_id)
    }
}

/// `?Send`: the boxed future without `Send`.
#[async_trait(?Send)]
trait Local {
    async fn settle(&self, slot: i64) -> Result<i64, idempotency::Error>;
}

#[async_trait(?Send)]
impl Local for Service {
    #[idempotent(key = "settle_<slot>", ttl = "7d", biz = "settle", engine = self.idem)]
    async fn settle(&self, tx: &mut Transaction<'_, Sqlite>, slot: i64) -> Result<i64, idempotency::Error> {
        let _ = tx;
        Ok(slot)
    }
}

fn assert_send<T: Send>(_: T) {}

fn main() {
    assert_send(async {
        let service = Service { idem: Idem::sqlite_memory().await.unwrap() };
        let payments: &(dyn Payments + Sync) = &service;
        payments.pay(1, "first").await
    });
    let _ = <Service as Local>::settle;
}
