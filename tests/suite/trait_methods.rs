//! `#[idempotent]` on the methods of an `#[async_trait]` impl, as tonic
//! services are written: called through `dyn Trait` and from a spawned
//! task, they execute once and replay, in the engine's transaction and in
//! the caller's (`join`).

use std::sync::Arc;

use async_trait::async_trait;
use idempotency::{Idem, Outcome, idempotent};
use idempotency_testkit::unique;
use sqlx::Transaction;

use super::Db;
use super::fixture::{Mode, Probe, Receipt, Redis, TestError, body, engine, ledger_rows, record_rows_for};

#[async_trait]
trait Payments: Send + Sync {
    async fn pay(&self, k: String, amount: i64) -> Result<Receipt, TestError>;
    async fn pay_in(&self, tx: &mut Transaction<'_, Db>, k: String, amount: i64) -> Result<Receipt, TestError>;
}

struct Service {
    idem: Idem<Db>,
    probe: Probe,
}

#[async_trait]
impl Payments for Service {
    #[idempotent(key = "<k>", ttl = "1h", biz = "t_pay", engine = self.idem)]
    async fn pay(&self, tx: &mut Transaction<'_, Db>, k: String, amount: i64) -> Result<Receipt, TestError> {
        let run = body(tx, &k, amount, &self.probe, Mode::Ok).await?;
        Ok(Receipt { key: k, amount, run })
    }

    #[idempotent(key = "<k>", ttl = "1h", biz = "t_pay", engine = self.idem, join)]
    async fn pay_in(&self, tx: &mut Transaction<'_, Db>, k: String, amount: i64) -> Result<Receipt, TestError> {
        let run = body(tx, &k, amount, &self.probe, Mode::Ok).await?;
        Ok(Receipt { key: k, amount, run })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_trait_methods_execute_once_and_replay() {
    let Some(idem) = engine(&unique("db"), 2, Redis::Off).await else { return };
    let service: Arc<dyn Payments> = Arc::new(Service { idem: idem.clone(), probe: Probe::default() });
    let k = unique("trait");

    let first = {
        let (service, k) = (service.clone(), k.clone());
        tokio::spawn(async move { idempotency::observe(service.pay(k, 7)).await }).await.unwrap()
    };
    let (first, outcome) = (first.0.unwrap(), first.1);
    assert_eq!((first.clone(), outcome), (Receipt { key: k.clone(), amount: 7, run: 1 }, Some(Outcome::Executed)));
    let (again, outcome) = idempotency::observe(service.pay(k.clone(), 7)).await;
    assert_eq!((again.unwrap(), outcome), (first.clone(), Some(Outcome::Replayed)));

    // Joined: the same record replays in the caller's transaction; a new
    // key executes there and commits with it.
    let fresh = unique("trait-join");
    let mut tx = idem.pool().begin().await.unwrap();
    let (joined, outcome) = idempotency::observe(service.pay_in(&mut tx, k.clone(), 7)).await;
    assert_eq!((joined.unwrap(), outcome), (first, Some(Outcome::Replayed)));
    let (executed, outcome) = idempotency::observe(service.pay_in(&mut tx, fresh.clone(), 8)).await;
    assert_eq!((executed.unwrap().run, outcome), (2, Some(Outcome::Executed)));
    tx.commit().await.unwrap();

    assert_eq!((ledger_rows(&idem, &k).await, ledger_rows(&idem, &fresh).await), (1, 1));
    assert_eq!((record_rows_for(&idem, "t_pay", &k).await, record_rows_for(&idem, "t_pay", &fresh).await), (1, 1));
}
