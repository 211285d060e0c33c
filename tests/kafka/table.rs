//! The settlement table on Kafka, commits held at the lowest unsettled
//! message, a key's order, and a database down waited out.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use idempotency::Outcome;
use idempotency::kafka::{Action, Reason, Settled};
use tokio::sync::{Notify, mpsc};

use crate::support::*;

/// The settlement table on Kafka: an ack, a replay, a key reused, poison,
/// and a failing body retried through the retry topic (with its count) and
/// then dead-lettered with the reason in its headers; the offsets committed
/// to the end of both topics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_of_the_settlement_table_on_kafka() {
    let Some(w) = world(1, true).await else { return };
    w.produce_event(0, &event(1, "sku-1", 2)).await;
    w.produce_event(0, &event(1, "sku-1", 2)).await; // a copy: same key, same arguments
    w.produce_event(0, &event(2, "sku-1", 3)).await;
    w.produce_event(0, &event(2, "sku-1", 4)).await; // the key reused with other arguments
    w.produce(0, "poison", b"{not json", &[]).await;
    w.produce_event(0, &event(3, "no-such-sku", 1)).await; // the body fails every time
    let consumer = w.consumer().concurrency(4).max_retries(1).retry_delay(Duration::from_millis(20));
    let mut running = Running::start(consumer, deducting(&w.idem));
    let mut seen = running.take(7).await;
    running.stop().await;
    seen.sort_by_key(|s| (s.delivery.topic.clone(), s.delivery.offset));
    let table: Vec<(&str, i64, Action, Option<Outcome>, u64)> = seen
        .iter()
        .map(|s| (s.delivery.topic.as_str(), s.delivery.offset, s.action, s.outcome, s.delivery.retries))
        .collect();
    let retry = w.names.retry_topic.as_str();
    assert_eq!(
        table,
        vec![
            ("orders", 0, Action::Ack, Some(Outcome::Executed), 0),
            ("orders", 1, Action::Ack, Some(Outcome::Replayed), 0),
            ("orders", 2, Action::Ack, Some(Outcome::Executed), 0),
            ("orders", 3, Action::DeadLetter(Reason::KeyReused), Some(Outcome::KeyReused), 0),
            ("orders", 4, Action::DeadLetter(Reason::Poison), None, 0),
            ("orders", 5, Action::Retry { count: 1 }, Some(Outcome::Failed), 0),
            (retry, 0, Action::DeadLetter(Reason::RetriesExhausted), Some(Outcome::Failed), 1),
        ],
        "{seen:#?}"
    );

    // Reconciled: the business table, the records, the topics.
    assert_eq!(w.moves().await, BTreeMap::from([(1, 1), (2, 1)]));
    assert_eq!(w.records("t_kafka_deduct").await, 2);
    let retries = w.read_topic(retry, 1);
    assert_eq!((retries[0].key.as_deref(), retries[0].header("Idem-Retries")), (Some("3"), Some("1")));
    let dead = w.read_topic(&w.names.dead_letter_topic, 3);
    let mut dead: Vec<(&str, &str, &str, &str)> = dead
        .iter()
        .map(|d| {
            (
                d.header(idempotency::kafka::DEAD_REASON_HEADER).unwrap(),
                d.header(idempotency::kafka::DEAD_TOPIC_HEADER).unwrap(),
                d.header(idempotency::kafka::DEAD_OFFSET_HEADER).unwrap(),
                d.payload.as_str(),
            )
        })
        .collect();
    dead.sort();
    assert_eq!(
        dead,
        vec![
            ("key_reused", "orders", "3", r#"{"order_id":2,"sku":"sku-1","qty":4}"#),
            ("poison", "orders", "4", "{not json"),
            ("retries_exhausted", retry, "0", r#"{"order_id":3,"sku":"no-such-sku","qty":1}"#),
        ]
    );
    w.await_committed("orders", &[Some(6)]);
    w.await_committed(retry, &[Some(1)]);
    w.remove().await;
}

/// Offsets are committed only up to the lowest message not yet settled,
/// and a later message of a key waits for the earlier one, while other keys
/// go on beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_stop_at_the_lowest_unsettled_message_and_a_key_keeps_its_order() {
    let Some(w) = world(1, true).await else { return };
    // Offsets 0 and 2 share the key "a"; 1 has "b".
    for (order, key) in [(10, "a"), (11, "b"), (12, "a")] {
        let payload = serde_json::to_vec(&event(order, "sku-1", 1)).unwrap();
        w.produce(0, key, &payload, &[]).await;
    }
    let log: Log = Arc::default();
    let gate = Arc::new(Notify::new());
    let (started_tx, mut started) = mpsc::unbounded_channel::<i64>();
    let handler = {
        let (idem, log, gate) = (w.idem.clone(), Arc::clone(&log), Arc::clone(&gate));
        move |e: OrderPaid| {
            let (idem, log, gate, started_tx) = (idem.clone(), Arc::clone(&log), Arc::clone(&gate), started_tx.clone());
            async move {
                log.lock().unwrap().push(format!("start {}", e.order_id));
                let _ = started_tx.send(e.order_id);
                if e.order_id == 10 {
                    gate.notified().await;
                }
                deduct_stock(&idem, e).await
            }
        }
    };
    let mut running = Running::logged(w.consumer().concurrency(3), handler, Arc::clone(&log));
    // 10 is held; 11 (another key) runs and settles beside it.
    let mut first = vec![started.recv().await.unwrap(), started.recv().await.unwrap()];
    first.sort();
    assert_eq!(first, [10, 11]);
    let b = running.next().await;
    assert_eq!((b.delivery.offset, b.action), (1, Action::Ack));
    // The broker's view once that settlement's commit landed: still at 0,
    // the message still running.
    w.await_committed("orders", &[Some(0)]);
    assert!(started.try_recv().is_err(), "12 started while 10, of its key, had not settled");
    gate.notify_one();
    let rest = running.take(2).await;
    assert_eq!(
        rest.iter().map(|s| (s.delivery.offset, s.action)).collect::<Vec<_>>(),
        [(0, Action::Ack), (2, Action::Ack)]
    );
    w.await_committed("orders", &[Some(3)]);
    running.stop().await;
    let log = log.lock().unwrap().clone();
    let settled_10 = log.iter().position(|l| l == "settled 0").unwrap();
    let start_12 = log.iter().position(|l| l == "start 12").unwrap();
    assert!(settled_10 < start_12, "12 started before 10 settled: {log:?}");
    assert_eq!(w.moves().await, BTreeMap::from([(10, 1), (11, 1), (12, 1)]));
    assert_eq!(w.records("t_kafka_deduct").await, 3);
    w.remove().await;
}

/// A database down (`Error::Storage`) is waited out in the runner: the
/// message comes back after `storage_delay`, uncounted (no retry copy, its
/// retry header still 0), its offset not committed past, and its key's
/// next message waiting, while another key goes on; once the database
/// answers it executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_down_is_waited_out_uncounted_holding_its_key_and_the_commit() {
    let Some(w) = world(1, true).await else { return };
    // Offsets 0 and 1 share the key "a"; 2 has "b".
    for (order, key) in [(20, "a"), (21, "a"), (22, "b")] {
        w.produce(0, key, &serde_json::to_vec(&event(order, "sku-1", 1)).unwrap(), &[]).await;
    }
    let down = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let log: Log = Arc::default();
    let handler = {
        let (idem, down, log) = (w.idem.clone(), Arc::clone(&down), Arc::clone(&log));
        move |e: OrderPaid| {
            let (idem, down, log) = (idem.clone(), Arc::clone(&down), Arc::clone(&log));
            async move {
                log.lock().unwrap().push(format!("start {}", e.order_id));
                if e.order_id == 20 && down.load(std::sync::atomic::Ordering::SeqCst) {
                    let e: StockError = Box::new(idempotency::Error::Storage(sqlx::Error::PoolTimedOut));
                    return Err(e);
                }
                deduct_stock(&idem, e).await
            }
        }
    };
    let consumer = w.consumer().concurrency(3).storage_delay(Duration::from_millis(100));
    let mut running = Running::logged(consumer, handler, Arc::clone(&log));
    let mut seen = Vec::new();
    while !(seen.iter().any(|s: &Settled| s.delivery.offset == 0) && seen.iter().any(|s| s.delivery.offset == 2)) {
        seen.push(running.next().await);
    }
    // "b" settled beside it; the commit stays at the waiting message.
    w.await_committed("orders", &[Some(0)]);
    down.store(false, std::sync::atomic::Ordering::SeqCst);
    while !seen.iter().any(|s| s.delivery.offset == 1) {
        seen.push(running.next().await);
    }
    running.stop().await;
    let of = |offset: i64| -> Vec<(Action, Option<Outcome>, u64)> {
        seen.iter().filter(|s| s.delivery.offset == offset).map(|s| (s.action, s.outcome, s.delivery.retries)).collect()
    };
    let waits = of(0);
    let (last, requeues) = waits.split_last().unwrap();
    assert!(!requeues.is_empty(), "{waits:?}");
    assert!(requeues.iter().all(|r| *r == (Action::Requeue, None, 0)), "uncounted: {waits:?}");
    assert_eq!(*last, (Action::Ack, Some(Outcome::Executed), 0));
    assert_eq!(of(1), [(Action::Ack, Some(Outcome::Executed), 0)]);
    assert_eq!(of(2), [(Action::Ack, Some(Outcome::Executed), 0)]);
    let log = log.lock().unwrap().clone();
    let settled_0 = log.iter().rposition(|l| l == "settled 0").unwrap();
    let start_21 = log.iter().position(|l| l == "start 21").unwrap();
    assert!(settled_0 < start_21, "21 started before 20, of its key, settled: {log:?}");
    w.await_committed("orders", &[Some(3)]);
    assert_eq!(w.moves().await, BTreeMap::from([(20, 1), (21, 1), (22, 1)]));
    assert_eq!(w.records("t_kafka_deduct").await, 3);
    w.remove().await;
}
