//! Records a real cluster carries, that no record may wedge a group with:
//! a header name that is not UTF-8, a dead-letter copy replayed into the
//! topic, messages too large to dead-letter whole; and a panic in the
//! runner's own polling task.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotency::Outcome;
use idempotency::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idempotency::kafka::{Action, DEAD_DROPPED_HEADER, DEAD_ERROR_HEADER, Event, Reason, RunError};

use crate::support::*;

/// Regression: rdkafka's header reading unwraps a name's UTF-8 check, so a
/// record whose header name is not UTF-8 (any client may write one) panicked
/// the runner's polling task, and `run` waited for ever; the group's next
/// owner of the partition fetched the record and died the same way. Now
/// the record is poison: dead-lettered with its reason, its headers kept
/// byte for byte, and the group goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_name_that_is_not_utf8_is_dead_lettered_as_poison_and_the_group_goes_on() {
    let Some(w) = world(1, false).await else { return };
    let bad: &[u8] = b"\xff\xfetrace";
    let payload = serde_json::to_vec(&event(1, "sku-1", 1)).unwrap();
    produce_raw(&w, 0, b"1", &payload, &[(bad, b"t-1"), (b"Idem-Message-Id", b"m-1")]);
    // tansu keeps the name's bytes as they were sent.
    let stored = w.read_topic("orders", 1);
    assert_eq!(stored[0].raw_headers[0], (bad.to_vec(), Some(b"t-1".to_vec())), "{stored:?}");
    w.produce_event(0, &event(2, "sku-1", 1)).await;

    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (idem, calls) = (w.idem.clone(), Arc::clone(&calls));
        move |e: OrderPaid| {
            calls.fetch_add(1, Ordering::SeqCst);
            let idem = idem.clone();
            async move { deduct_stock(&idem, e).await }
        }
    };
    let mut running = Running::start(w.consumer(), handler);
    let mut seen = running.take(2).await;
    // The dead letter's copy is produced after its slot is free: either settles first.
    seen.sort_by_key(|s| s.delivery.offset);
    let table: Vec<(i64, Action, Option<Outcome>, Option<&str>)> =
        seen.iter().map(|s| (s.delivery.offset, s.action, s.outcome, s.error.as_deref())).collect();
    assert_eq!(
        table,
        [
            (0, Action::DeadLetter(Reason::Poison), None, Some("header 0's name is not UTF-8 (bytes fffe7472616365)")),
            (1, Action::Ack, Some(Outcome::Executed), None),
        ]
    );
    w.await_committed("orders", &[Some(2)]);
    running.stop().await;
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the poison message never reached the handler");

    // The dead letter: the original's headers as they were, then the runner's.
    let dead = w.read_topic(&w.names.dead_letter_topic, 1);
    let text = |v: &str| Some(v.as_bytes().to_vec());
    let name = |n: &str| n.as_bytes().to_vec();
    assert_eq!(
        dead[0].raw_headers,
        [
            (bad.to_vec(), text("t-1")),
            (name("Idem-Message-Id"), text("m-1")),
            (name("Idem-Dead-Reason"), text("poison")),
            (name("Idem-Topic"), text("orders")),
            (name("Idem-Partition"), text("0")),
            (name("Idem-Offset"), text("0")),
            (name("Idem-Error"), text("header 0's name is not UTF-8 (bytes fffe7472616365)")),
        ]
    );
    assert_eq!((dead[0].key.as_deref(), dead[0].payload.as_bytes()), (Some("1"), payload.as_slice()));
    assert_eq!(w.moves().await, BTreeMap::from([(2, 1)]));
    w.remove().await;
}

/// A panic in the runner's own polling task (here the `on_event` hook, which
/// it calls) ends `run` with `RunError::Panicked` instead of leaving it
/// waiting on a consumer nothing polls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_runners_polling_task_ends_run_with_an_error() {
    let Some(w) = world(1, false).await else { return };
    w.produce_event(0, &event(1, "sku-1", 1)).await;
    let consumer = w.consumer().on_event(|e| {
        if matches!(e, Event::Assigned(_)) {
            panic!("the hook refuses the assignment");
        }
    });
    let ended = tokio::time::timeout(BOUND, consumer.run(std::future::pending::<()>(), deducting(&w.idem)))
        .await
        .expect("run never ended");
    match ended {
        Err(RunError::Panicked { task: "poll", panic }) => assert_eq!(panic, "the hook refuses the assignment"),
        other => panic!("{other:?}"),
    }
    assert_eq!(w.committed("orders", 1), [None]);
    w.remove().await;
}

/// Regression: `Idem-Retries` was read on the work topic too, so a
/// dead-letter copy replayed into the topic (it carries the count it
/// had) was dead-lettered again at once, never retried. It counts on the
/// retry topic only: the replayed copy gets its whole budget again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_copy_replayed_into_the_topic_gets_its_retries_again() {
    let Some(w) = world(1, false).await else { return };
    let payload = serde_json::to_vec(&event(5, "no-such-sku", 1)).unwrap();
    w.produce(0, "5", &payload, &[("Idem-Retries", "2"), ("Idem-Dead-Reason", "retries_exhausted")]).await;
    let consumer = w.consumer().max_retries(2).retry_delay(Duration::ZERO);
    let mut running = Running::start(consumer, deducting(&w.idem));
    let retry = w.names.retry_topic.as_str();
    let expected = [
        ("orders", 0, Action::Retry { count: 1 }, 0),
        (retry, 0, Action::Retry { count: 2 }, 1),
        (retry, 1, Action::DeadLetter(Reason::RetriesExhausted), 2),
    ];
    for expected in expected {
        let s = running.next().await;
        assert_eq!((s.delivery.topic.as_str(), s.delivery.offset, s.action, s.delivery.retries), expected);
    }
    running.stop().await;
    let dead = w.read_topic(&w.names.dead_letter_topic, 1);
    assert_eq!(
        (dead[0].header("Idem-Dead-Reason"), dead[0].header("Idem-Topic")),
        (Some("retries_exhausted"), Some(retry))
    );
    w.await_committed("orders", &[Some(1)]);
    w.await_committed(retry, &[Some(2)]);
    w.remove().await;
}

/// Regression: a dead letter the runner's producer refuses for its size
/// (over its `message.max.bytes`, which another client may legally exceed)
/// came back `NotStored` on every try and ran the handler again each retry
/// delay, holding the partition's commit for good. Now the copy is stored
/// without the payload (a large payload), or as a pointer to the original
/// with the error cut short (a large error text): each handler called once,
/// both settled, the commit past them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_too_large_to_dead_letter_whole_are_stored_without_what_does_not_fit() {
    let Some(w) = world(1, false).await else { return };
    // Another client, allowed larger messages than the runner's producer (1 MB).
    let mut config = w.config();
    config.set("message.max.bytes", "4000000");
    let large: FutureProducer = config.create().unwrap();
    let big_payload = serde_json::to_vec(&event(9, &"x".repeat(1_200_000), 1)).unwrap();
    let headers = idempotency::kafka::rdkafka::message::OwnedHeaders::new()
        .insert(idempotency::kafka::rdkafka::message::Header { key: "trace", value: Some("t-9") });
    let record = FutureRecord::to("orders").partition(0).key("9").payload(&big_payload).headers(headers);
    large.send(record, Duration::from_secs(30)).await.map_err(|(e, _)| e).unwrap();
    w.produce_event(0, &event(10, "sku-1", 1)).await;

    // Order 9's error is short; order 10's is larger than the limit.
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = Arc::clone(&calls);
        move |e: OrderPaid| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move {
                let error: StockError = match e.order_id {
                    9 => "no such sku".into(),
                    _ => "y".repeat(1_200_000).into(),
                };
                Err::<(), _>(error)
            }
        }
    };
    let mut config = w.consumer_config();
    // The consumer fetches what it is given (KIP-74 or not).
    config.set("fetch.max.bytes", "8000000").set("max.partition.fetch.bytes", "8000000");
    let consumer =
        idempotency::kafka::Consumer::new(config, "orders", "stock").max_retries(0).retry_delay(Duration::ZERO);
    let mut running = Running::start(consumer, handler);
    let mut seen = running.take(2).await;
    seen.sort_by_key(|s| s.delivery.offset);
    let table: Vec<(i64, Action)> = seen.iter().map(|s| (s.delivery.offset, s.action)).collect();
    let exhausted = Action::DeadLetter(Reason::RetriesExhausted);
    assert_eq!(table, [(0, exhausted), (1, exhausted)]);
    w.await_committed("orders", &[Some(2)]);
    running.stop().await;
    assert_eq!(calls.load(Ordering::SeqCst), 2, "each handler ran once");

    // In the order of the originals (their copies may have been stored in either).
    let mut dead = w.read_topic(&w.names.dead_letter_topic, 2);
    dead.sort_by_key(|d| d.header("Idem-Offset").map(str::to_owned));
    // Without its payload: the key, the headers and the runner's.
    assert_eq!((dead[0].key.as_deref(), dead[0].null_payload), (Some("9"), true));
    assert_eq!(
        (dead[0].header("trace"), dead[0].header(DEAD_DROPPED_HEADER), dead[0].header(DEAD_ERROR_HEADER)),
        (Some("t-9"), Some("payload"), Some(r#""no such sku""#))
    );
    assert_eq!(
        (dead[0].header("Idem-Offset"), dead[0].header("Idem-Dead-Reason")),
        (Some("0"), Some("retries_exhausted"))
    );
    // A pointer: where the message is, why, and the error's first kilobyte.
    assert_eq!((dead[1].key.as_deref(), dead[1].null_payload), (None, true));
    let names: Vec<&str> = dead[1].headers.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        names,
        ["Idem-Dead-Reason", "Idem-Topic", "Idem-Partition", "Idem-Offset", "Idem-Error", "Idem-Dropped"]
    );
    assert_eq!(dead[1].header(DEAD_DROPPED_HEADER), Some("key,payload,headers"));
    assert_eq!(dead[1].header("Idem-Offset"), Some("1"));
    assert_eq!(dead[1].header(DEAD_ERROR_HEADER).map(str::len), Some(1024));
    w.remove().await;
}
