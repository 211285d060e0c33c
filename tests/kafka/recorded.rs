//! A recorded answer: a handler passing on its call's recorded decline is
//! settled once, as the answer it is.

use std::collections::BTreeMap;
use std::time::Duration;

use idempotency::kafka::Action;
use idempotency::{Idem, Outcome, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{MySql, Transaction};

use crate::support::*;

/// What `reserve` answers when the stock is short: recorded, replayed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct OutOfStock {
    sku: String,
    short: i64,
}

/// `reserve`'s error: the decline (a final answer), or a failure. The
/// handler boxes it into a [`StockError`], as the other handlers' errors.
#[derive(Debug)]
enum ReserveError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
    OutOfStock(OutOfStock),
}

impl std::fmt::Display for ReserveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

/// Its `idempotency::Error` in the source chain, where a boxed error is searched.
impl std::error::Error for ReserveError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReserveError::Idem(e) => Some(e),
            ReserveError::Db(e) => Some(e),
            ReserveError::OutOfStock(_) => None,
        }
    }
}

impl From<idempotency::Error> for ReserveError {
    fn from(e: idempotency::Error) -> Self {
        ReserveError::Idem(e)
    }
}

impl From<sqlx::Error> for ReserveError {
    fn from(e: sqlx::Error) -> Self {
        ReserveError::Db(e)
    }
}

impl idempotency::BusinessError for ReserveError {
    type Record = OutOfStock;

    fn recorded(&self) -> Option<OutOfStock> {
        match self {
            ReserveError::OutOfStock(out) => Some(out.clone()),
            _ => None,
        }
    }

    fn replayed(record: OutOfStock) -> Self {
        ReserveError::OutOfStock(record)
    }
}

/// How many times `reserve`'s body ran (a decline rolls its writes back).
static RESERVE_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Deducts, or declines for good when the stock would go below zero: the
/// deduction rolls back and the decline is recorded (`record_errors`).
#[idempotent(key = "reserve_<event.order_id>", ttl = "1h", biz = "t_kafka_reserve", record_errors)]
async fn reserve(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, event: OrderPaid) -> Result<(), ReserveError> {
    RESERVE_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    sqlx::query("UPDATE stock SET qty = qty - ? WHERE sku = ?")
        .bind(event.qty)
        .bind(&event.sku)
        .execute(&mut **tx)
        .await?;
    let left: i64 =
        sqlx::query_scalar("SELECT qty FROM stock WHERE sku = ?").bind(&event.sku).fetch_one(&mut **tx).await?;
    if left < 0 {
        return Err(ReserveError::OutOfStock(OutOfStock { sku: event.sku, short: -left }));
    }
    Ok(())
}

/// Regression: a handler passing on its call's recorded decline was
/// retried through the retry topic, then dead-lettered, each retry only
/// replaying the decision. The decline and a duplicate of it are each
/// settled once as a recorded answer (`AckRecorded`, counted under
/// `ack_recorded`), nothing copied to the retry or dead-letter topic, the
/// offsets committed past both; the body ran once, its deduction rolled
/// back, the decline recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_decline_and_its_duplicate_are_settled_once() {
    let Some(w) = world(1, true).await else { return };
    idempotency_testkit::counters::install();
    w.produce_event(0, &event(9, "sku-1", 5000)).await;
    w.produce_event(0, &event(9, "sku-1", 5000)).await; // a copy: same key, same arguments
    let consumer = w.consumer().max_retries(2).retry_delay(Duration::from_millis(20));
    let reserving = {
        let idem = w.idem.clone();
        move |e: OrderPaid| {
            let idem = idem.clone();
            async move { reserve(&idem, e).await.map_err(StockError::from) }
        }
    };
    let mut running = Running::start(consumer, reserving);
    let mut seen = running.take(2).await;
    let rest = running.stop().await;
    seen.sort_by_key(|s| s.delivery.offset);
    let table: Vec<(&str, i64, Action, Option<Outcome>, u64)> = seen
        .iter()
        .map(|s| (s.delivery.topic.as_str(), s.delivery.offset, s.action, s.outcome, s.delivery.retries))
        .collect();
    assert_eq!(
        table,
        vec![
            ("orders", 0, Action::AckRecorded, Some(Outcome::Executed), 0),
            ("orders", 1, Action::AckRecorded, Some(Outcome::Replayed), 0),
        ],
        "{seen:#?}"
    );
    assert!(rest.is_empty(), "settled once each: {rest:#?}");
    assert!(seen.iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("OutOfStock"))), "{seen:#?}");
    assert_eq!(RESERVE_RUNS.load(std::sync::atomic::Ordering::SeqCst), 1, "the copy replayed the decline");
    assert_eq!(w.moves().await, BTreeMap::new());
    let stock: i64 =
        sqlx::query_scalar("SELECT qty FROM stock WHERE sku = 'sku-1'").fetch_one(w.idem.pool()).await.unwrap();
    assert_eq!(stock, 1000, "the deduction rolled back");
    let recorded = r#"{"sku":"sku-1","short":4000}"#.to_owned();
    assert_eq!(
        w.idem.status("t_kafka_reserve", "reserve_9").await.unwrap(),
        idempotency::Status::Failed { error: recorded }
    );
    let records: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_record WHERE biz_type = 't_kafka_reserve'")
        .fetch_one(w.idem.pool())
        .await
        .unwrap();
    assert_eq!(records, 1);
    w.await_committed("orders", &[Some(2)]);
    let counted = idempotency_testkit::counters::counted_by(
        idempotency::metrics::KAFKA_SETTLEMENTS,
        &[("topic", "orders")],
        "action",
    );
    // Other tests of this process settle on a topic of the same name (each on its own broker).
    assert_eq!(counted.get("ack_recorded"), Some(&2), "{counted:?}");
    w.remove().await;
}
