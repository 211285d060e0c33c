//! The settlement table of `idempotency::redis_streams`, row by row, each test
//! asserting the exact Redis state left behind: acked, pending with which
//! delivery count and idle time, the dead-letter entry and its fields.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::collections::HashMap;

use idempotency::redis_streams::{Action, Reason};
use idempotency::{Idem, Outcome, Status};
use sqlx::mysql::MySqlPoolOptions;

use crate::support::*;

/// Row "the handler returned `Ok`": acked whatever its call returned (an
/// execution, a reused key, a body error it dealt with); never retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_returning_ok_is_acked_whatever_the_outcome() {
    let Some(w) = world(100).await else { return };
    let order = order_id();
    let unknown = idempotency_testkit::unique("no-such-sku");
    w.add_event(order, 2, "first").await;
    w.add_event(order, 5, "reused").await;
    w.add(&[("message_id", b"failing"), ("payload", &event(order_id(), &unknown, 1))]).await;

    let idem = w.idem.clone();
    let mut running = spawn_consumer(w.consumer("c"), move |shutdown, consumer| {
        Box::pin(consumer.run(shutdown, move |event: OrderPaid| {
            let idem = idem.clone();
            async move {
                // Dealt with here (say, logged): the entry is done.
                let _ = deduct_stock(&idem, event).await;
                Ok::<(), StockError>(())
            }
        }))
    });
    let seen = running.until(|seen| seen.len() == 3).await;
    let rest = running.stop().await;

    // In the order handled; one entry's settlement may finish after the next one's.
    let mut got: Vec<(Option<&str>, Action, Option<Outcome>, u64)> =
        seen.iter().map(|s| (s.message_id.as_deref(), s.action, s.outcome, s.delivery.count)).collect();
    got.sort_by_key(|(id, ..)| ["first", "reused", "failing"].iter().position(|want| Some(*want) == *id));
    assert_eq!(
        got,
        vec![
            (Some("first"), Action::Ack, Some(Outcome::Executed), 1),
            (Some("reused"), Action::Ack, Some(Outcome::KeyReused), 1),
            (Some("failing"), Action::Ack, Some(Outcome::Failed), 1),
        ]
    );
    assert!(rest.is_empty() && seen.iter().all(|s| s.error.is_none()), "{seen:#?} {rest:#?}");
    assert_eq!(w.pending().await, vec![]);
    assert_eq!(w.length(&w.dead).await, 0);
    assert_eq!((w.stock().await, w.moves().await), (98, 1));
    w.remove().await;
}

/// Row "a recorded answer" (regression: a handler passing on its call's
/// recorded decline was left pending for a counted retry at each delivery,
/// then dead-lettered, each delivery only replaying the decision). The
/// decline and a duplicate of it are each acked at their first delivery
/// (`AckRecorded`, counted under `ack_recorded`): nothing pending, nothing
/// dead-lettered; the body ran once, its deduction rolled back, the decline
/// recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_decline_and_its_duplicate_are_acked_once() {
    let Some(w) = world(1).await else { return };
    idempotency_testkit::counters::install();
    let order = order_id();
    w.add_event(order, 5, "decline").await;
    w.add_event(order, 5, "duplicate").await;

    let idem = w.idem.clone();
    let mut running = spawn_consumer(w.consumer("c").max_deliver(3), move |shutdown, consumer| {
        Box::pin(consumer.run(shutdown, move |event: OrderPaid| {
            let idem = idem.clone();
            async move { reserve(&idem, event).await }
        }))
    });
    let seen = running.until(|seen| seen.len() == 2).await;
    let rest = running.stop().await;

    let mut got: Vec<(Option<&str>, Action, Option<Outcome>, u64)> =
        seen.iter().map(|s| (s.message_id.as_deref(), s.action, s.outcome, s.delivery.count)).collect();
    got.sort_by_key(|(id, ..)| *id);
    assert_eq!(
        got,
        vec![
            (Some("decline"), Action::AckRecorded, Some(Outcome::Executed), 1),
            (Some("duplicate"), Action::AckRecorded, Some(Outcome::Replayed), 1),
        ]
    );
    assert!(rest.is_empty(), "settled once each: {rest:#?}");
    assert!(seen.iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("OutOfStock"))), "{seen:#?}");
    assert_eq!(body_runs(&w.sku), 1, "the duplicate replayed the decline");
    assert_eq!(w.pending().await, vec![]);
    assert_eq!(w.length(&w.dead).await, 0);
    assert_eq!((w.stock().await, w.moves().await), (1, 0), "the deduction rolled back");
    let key = format!("reserve_{order}");
    let recorded = format!(r#"{{"sku":"{}","short":4}}"#, w.sku);
    assert_eq!(w.idem.status("t_rs_reserve", &key).await.unwrap(), Status::Failed { error: recorded });
    let counted = idempotency_testkit::counters::counted_by(
        idempotency::metrics::REDIS_STREAM_SETTLEMENTS,
        &[("stream", w.stream.as_str())],
        "action",
    );
    assert_eq!(counted, HashMap::from([("ack_recorded".to_owned(), 2)]));
    w.remove().await;
}

/// Row "`Error::Storage`": the entry is left pending with its delivery
/// count put back (`XCLAIM ... RETRYCOUNT 0`) and idle so that it comes back
/// after `storage_delay`; it does so as often as the outage lasts (here 3
/// times with `max_deliver(2)`), always at delivery 1, then executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_down_is_left_pending_uncounted_then_executed_once() {
    let Some(w) = world(100).await else { return };
    let entry = w.add_event(order_id(), 3, "outage").await;
    let dead_pool = MySqlPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy("mysql://root@127.0.0.1:1/test")
        .expect("lazy pool");
    let down = Idem::builder(dead_pool).redis(w.client.clone()).build();
    const OUTAGE_ATTEMPTS: usize = 3;
    let storage_delay = Duration::from_millis(600);
    let claim_idle = Duration::from_millis(1500);

    let calls = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(Mutex::new(Vec::new()));
    let (up, handler_calls, handler_started) = (w.idem.clone(), Arc::clone(&calls), Arc::clone(&started));
    let consumer = w.consumer("c").max_deliver(2).claim_idle(claim_idle).storage_delay(storage_delay);
    let mut running = spawn_consumer(consumer, move |shutdown, consumer| {
        Box::pin(consumer.run(shutdown, move |event: OrderPaid| {
            let attempt = handler_calls.fetch_add(1, SeqCst);
            handler_started.lock().unwrap().push(Instant::now());
            let idem = if attempt < OUTAGE_ATTEMPTS { down.clone() } else { up.clone() };
            async move { deduct_stock(&idem, event).await }
        }))
    });
    let first = running.next().await;
    // Right after the first requeue: pending, delivered 0 (the claim makes it 1
    // again), idle as if delivered claim_idle - storage_delay ago.
    let pending = w.pending().await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!((pending[0].id.as_str(), pending[0].delivered), (entry.as_str(), 0), "{pending:?}");
    let expected_idle = (claim_idle - storage_delay).as_millis() as u64;
    assert!((expected_idle..expected_idle + 400).contains(&pending[0].idle_ms), "{pending:?}");
    let mut seen = vec![first];
    seen.extend(running.until(|seen| seen.iter().any(|s| s.action != Action::Requeue)).await);
    let rest = running.stop().await;

    assert_eq!(
        actions(&seen),
        vec![
            (Action::Requeue, Some(Outcome::Failed), 1),
            (Action::Requeue, Some(Outcome::Failed), 1),
            (Action::Requeue, Some(Outcome::Failed), 1),
            (Action::Ack, Some(Outcome::Executed), 1),
        ],
        "{seen:#?}"
    );
    assert!(rest.is_empty(), "{rest:#?}");
    assert!(seen[..3].iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("Storage"))), "{seen:#?}");
    assert_eq!(calls.load(SeqCst), OUTAGE_ATTEMPTS + 1);
    let started = started.lock().unwrap().clone();
    for pair in started.windows(2) {
        assert!(pair[1] - pair[0] >= storage_delay, "back only after storage_delay: {started:?}");
    }
    assert_eq!(body_runs(&w.sku), 1, "the body never started while the database was down");
    assert_eq!((w.stock().await, w.moves().await), (97, 1));
    assert_eq!(w.pending().await, vec![]);
    assert_eq!(w.length(&w.dead).await, 0);
    w.remove().await;
}

/// Row "`InProgress`": a duplicate handled while the first is in its body
/// is left pending uncounted, comes back at delivery 1 still, and is acked
/// as a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_during_the_body_is_left_pending_uncounted_then_replayed() {
    let Some(w) = world(100).await else { return };
    let order = order_id();
    w.add_event(order, 2, "dup-1").await;
    w.add_event(order, 2, "dup-2").await;

    let gate = hold_next_body(&w.sku);
    let mut running = w.run(w.consumer("c").concurrency(2), false);
    let busy = running.next().await;
    assert_eq!((busy.action, busy.outcome, busy.delivery.count), (Action::Requeue, Some(Outcome::InProgress), 1));
    let pending = w.pending().await;
    let waiting = pending.iter().find(|p| p.id == busy.delivery.entry_id).expect("still pending");
    assert_eq!(waiting.delivered, 0, "put back uncounted: {pending:?}");
    gate.notify_one();
    let seen = running.until(|seen| seen.iter().filter(|s| s.action == Action::Ack).count() == 2).await;
    let rest = running.stop().await;

    let acked: Vec<(Option<&str>, Option<Outcome>, u64)> = seen
        .iter()
        .filter(|s| s.action == Action::Ack)
        .map(|s| (s.message_id.as_deref(), s.outcome, s.delivery.count))
        .collect();
    let holder = if busy.message_id.as_deref() == Some("dup-1") { "dup-2" } else { "dup-1" };
    assert!(acked.contains(&(Some(holder), Some(Outcome::Executed), 1)), "{seen:#?}");
    assert!(acked.contains(&(busy.message_id.as_deref(), Some(Outcome::Replayed), 1)), "uncounted: {seen:#?}");
    assert!(rest.is_empty() && seen.iter().all(|s| matches!(s.action, Action::Ack | Action::Requeue)), "{seen:#?}");
    assert_eq!(body_runs(&w.sku), 1);
    assert_eq!((w.stock().await, w.moves().await), (98, 1));
    assert_eq!(w.pending().await, vec![]);
    assert_eq!(w.length(&w.dead).await, 0);
    w.remove().await;
}

/// Rows "`KeyReused`" and "poison": a reused key, a payload that is not
/// JSON and an entry without a payload field are copied to the dead-letter
/// stream (their fields and the reason) and acked, once each; the first
/// order is deducted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_reused_and_poison_are_dead_lettered_with_their_reason_and_acked() {
    let Some(w) = world(100).await else { return };
    let order = order_id();
    let reused = event(order, &w.sku, 5);
    w.add_event(order, 2, "first").await;
    let reused_id = w.add(&[("message_id", b"reused"), ("payload", &reused)]).await;
    let bad_json = w.add(&[("message_id", b"bad-json"), ("payload", b"{not json")]).await;
    let no_payload = w.add(&[("message_id", b"no-payload"), ("data", b"{}")]).await;

    let mut running = w.run(w.consumer("c"), false);
    let seen = running.until(|seen| seen.len() == 4).await;
    let calls = Arc::clone(&running.calls);
    let rest = running.stop().await;

    let by_id = |id: &str| seen.iter().find(|s| s.message_id.as_deref() == Some(id)).expect(id).clone();
    assert_eq!((by_id("first").action, by_id("first").outcome), (Action::Ack, Some(Outcome::Executed)));
    assert_eq!(
        (by_id("reused").action, by_id("reused").outcome),
        (Action::DeadLetter(Reason::KeyReused), Some(Outcome::KeyReused))
    );
    assert_eq!((by_id("bad-json").action, by_id("bad-json").outcome), (Action::DeadLetter(Reason::Poison), None));
    assert_eq!(by_id("no-payload").action, Action::DeadLetter(Reason::Poison));
    assert_eq!(by_id("no-payload").error.as_deref(), Some("no payload field"));
    assert!(rest.is_empty(), "nothing else: {rest:#?}");
    assert_eq!(calls.load(SeqCst), 2, "poison never reached the handler");
    assert_eq!(body_runs(&w.sku), 1);

    let dead = w.dead_letters().await;
    let mut dead = dead;
    dead.sort_by(|a, b| a["idem_entry_id"].cmp(&b["idem_entry_id"]));
    let summary: Vec<(&str, &str, &str, &str)> = dead
        .iter()
        .map(|d| {
            (
                d["message_id"].as_str(),
                d["idem_dead_reason"].as_str(),
                d["idem_entry_id"].as_str(),
                d["idem_delivered"].as_str(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("reused", "key_reused", reused_id.as_str(), "1"),
            ("bad-json", "poison", bad_json.as_str(), "1"),
            ("no-payload", "poison", no_payload.as_str(), "1"),
        ]
    );
    assert!(dead.iter().all(|d| d["idem_stream"] == w.stream), "{dead:?}");
    assert_eq!(dead[0]["payload"].as_bytes(), reused.as_slice(), "the original fields");
    assert_eq!((dead[1]["payload"].as_str(), dead[2]["data"].as_str()), ("{not json", "{}"));
    assert!(dead[0]["idem_error"].contains("KeyReused") && dead[1]["idem_error"].starts_with("payload: "), "{dead:?}");
    assert_eq!(w.pending().await, vec![], "all acked");
    assert_eq!((w.stock().await, w.moves().await), (98, 1));
    w.remove().await;
}

/// Row "invalid key" (`Rejected`): dead-lettered at once, never retried;
/// the body never runs, nothing is written, no record either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_key_is_dead_lettered_and_nothing_written() {
    let Some(w) = world(100).await else { return };
    let reference = format!("bad ref {}", idempotency_testkit::unique("r"));
    let payload = serde_json::to_vec(&Restocked { reference: reference.clone(), sku: w.sku.clone(), qty: 5 }).unwrap();
    let entry = w.add(&[("payload", &payload)]).await;

    let idem = w.idem.clone();
    let mut running = spawn_consumer(w.consumer("c"), move |shutdown, consumer| {
        Box::pin(consumer.run(shutdown, move |event: Restocked| {
            let idem = idem.clone();
            async move { restock(&idem, event).await }
        }))
    });
    let settled = running.next().await;
    let rest = running.stop().await;

    assert_eq!(
        (settled.action, settled.outcome, settled.delivery.count),
        (Action::DeadLetter(Reason::Rejected), Some(Outcome::Rejected), 1)
    );
    assert!(settled.error.as_deref().is_some_and(|e| e.contains("InvalidKey")), "{settled:#?}");
    assert!(rest.is_empty(), "never retried: {rest:#?}");
    assert_eq!(body_runs(&w.sku), 0, "the body never ran");
    let dead = w.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0]["idem_dead_reason"].as_str(), dead[0]["idem_entry_id"].as_str()), ("rejected", entry.as_str()));
    assert_eq!(dead[0]["payload"].as_bytes(), payload.as_slice());
    assert_eq!(w.pending().await, vec![]);
    assert_eq!((w.stock().await, w.moves().await), (100, 0));
    let records: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM idem_record WHERE biz_type = 't_rs_restock' AND idem_key LIKE ?")
            .bind(format!("%{}", reference.trim_start_matches("bad ref ")))
            .fetch_one(w.idem.pool())
            .await
            .unwrap();
    assert_eq!(records, 0);
    w.remove().await;
}

/// Row "the body's own error": left pending to come back after
/// `retry_delay`, each claim counting a delivery, until the count reaches
/// `max_deliver`; then dead-lettered with `deliveries_exhausted` and acked.
/// The body ran `max_deliver` times; nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_body_is_retried_until_max_deliver_then_dead_lettered() {
    let Some(w) = world(100).await else { return };
    let unknown = idempotency_testkit::unique("no-such-sku");
    let order = order_id();
    let entry = w.add(&[("message_id", b"failing"), ("payload", &event(order, &unknown, 1))]).await;
    let retry_delay = Duration::from_millis(300);

    let mut running = w.run(w.consumer("c").max_deliver(3).retry_delay(retry_delay), false);
    let first = running.next().await;
    let pending = w.pending().await;
    assert_eq!((pending.len(), pending[0].delivered), (1, 1), "counted: {pending:?}");
    let mut seen = vec![first];
    seen.extend(running.until(|seen| seen.iter().any(|s| matches!(s.action, Action::DeadLetter(_)))).await);
    let rest = running.stop().await;

    assert_eq!(
        actions(&seen),
        vec![
            (Action::Retry { count: 2 }, Some(Outcome::Failed), 1),
            (Action::Retry { count: 3 }, Some(Outcome::Failed), 2),
            (Action::DeadLetter(Reason::DeliveriesExhausted), Some(Outcome::Failed), 3),
        ]
    );
    assert!(rest.is_empty(), "{rest:#?}");
    assert!(seen.iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("UnknownSku"))), "{seen:#?}");
    assert_eq!(body_runs(&unknown), 3, "max_deliver attempts");
    let dead = w.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (dead[0]["idem_dead_reason"].as_str(), dead[0]["idem_entry_id"].as_str(), dead[0]["idem_delivered"].as_str()),
        ("deliveries_exhausted", entry.as_str(), "3")
    );
    assert_eq!(w.pending().await, vec![]);
    let moves: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_rs_moves WHERE order_id = ?")
        .bind(order)
        .fetch_one(w.idem.pool())
        .await
        .unwrap();
    assert_eq!(moves, 0);
    w.remove().await;
}

/// Row "a panic": a handler that panics while being called fails like any
/// other: retried up to `max_deliver`, then dead-lettered; never left
/// unsettled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_panicking_is_retried_then_dead_lettered() {
    let Some(w) = world(100).await else { return };
    w.add_event(order_id(), PANICS, "panics").await;

    let mut running = w.run(w.consumer("c").max_deliver(2), false);
    let seen = running.until(|seen| seen.iter().any(|s| matches!(s.action, Action::DeadLetter(_)))).await;
    let calls = Arc::clone(&running.calls);
    let rest = running.stop().await;

    assert_eq!(
        actions(&seen),
        vec![(Action::Retry { count: 2 }, None, 1), (Action::DeadLetter(Reason::DeliveriesExhausted), None, 2)]
    );
    assert!(rest.is_empty(), "{rest:#?}");
    assert!(seen.iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("handler panicked"))), "{seen:#?}");
    assert_eq!(calls.load(SeqCst), 2);
    assert_eq!(body_runs(&w.sku), 0);
    let dead = w.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert!(dead[0]["idem_error"].contains("handler panicked"), "{dead:?}");
    assert_eq!(w.pending().await, vec![]);
    assert_eq!(w.stock().await, 100);
    w.remove().await;
}

/// `run_with_id` keys the call by the entry's `message_id` field: a copy of
/// one event appended again (a new entry id) replays instead of executing;
/// an entry without the field, or with one that is not UTF-8, is poison.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_with_id_keys_by_the_message_id_field_and_an_entry_without_one_is_poison() {
    let Some(w) = world(100).await else { return };
    let message_id = idempotency_testkit::unique("m").replace('-', "_");
    let order = order_id();
    let first = w.add(&[("message_id", message_id.as_bytes()), ("payload", &event(order, &w.sku, 1))]).await;
    let copy = w.add(&[("message_id", message_id.as_bytes()), ("payload", &event(order, &w.sku, 1))]).await;
    w.add(&[("payload", &event(order_id(), &w.sku, 1))]).await;
    w.add(&[("message_id", &[0xff, 0xfe]), ("payload", &event(order_id(), &w.sku, 1))]).await;

    let mut running = w.run(w.consumer("c"), true);
    let seen = running.until(|seen| seen.len() == 4).await;
    let rest = running.stop().await;

    // In entry order (one entry's settlement may finish after the next one's).
    let mut seen = seen;
    seen.sort_by(|a, b| a.delivery.entry_id.cmp(&b.delivery.entry_id));
    let got: Vec<(Action, Option<Outcome>, Option<&str>)> =
        seen.iter().map(|s| (s.action, s.outcome, s.message_id.as_deref())).collect();
    assert_eq!(
        got,
        vec![
            (Action::Ack, Some(Outcome::Executed), Some(message_id.as_str())),
            (Action::Ack, Some(Outcome::Replayed), Some(message_id.as_str())),
            (Action::DeadLetter(Reason::Poison), None, None),
            (Action::DeadLetter(Reason::Poison), None, None),
        ]
    );
    assert_eq!(
        (seen[0].delivery.entry_id.as_str(), seen[1].delivery.entry_id.as_str()),
        (first.as_str(), copy.as_str())
    );
    assert!(seen[2..].iter().all(|s| s.error.as_deref() == Some("no message id field (UTF-8)")), "{seen:#?}");
    assert!(rest.is_empty(), "{rest:#?}");
    assert_eq!(body_runs(&w.sku), 1);
    assert_eq!((w.stock().await, w.moves().await), (99, 1));
    assert_eq!(w.length(&w.dead).await, 2);
    assert_eq!(w.pending().await, vec![]);
    w.remove().await;
}
