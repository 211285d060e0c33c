//! What the runner holds stays bounded while retries wait, and an offset
//! counts as committed only once the coordinator confirmed it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use idempotency::Outcome;
use idempotency::kafka::{Action, Event};
use idempotency_testkit::kafka::Request;
use tokio::sync::{Notify, mpsc};

use crate::support::*;

/// Regression: a message waiting out its retry delay did not count toward
/// the fetch pause (its slot was freed before the delay), so a handler that
/// failed on unique keys let the runner fetch and hold messages at the
/// fetch rate times the delay, whatever `concurrency` said. With
/// `concurrency(1)` (a pause at four held messages, lifted at two) the
/// first handler call is held until fetching has paused on the messages
/// behind it; released, every call fails and waits out a retry delay longer
/// than the test's bound. The messages waiting count as held: fetching
/// never resumes, and the handler runs for those fetched before the pause
/// only. Stopping gives them back unsettled at once (no retry copy, nothing
/// committed past them): the next owner gets them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_waiting_out_a_retry_count_toward_the_fetch_pause() {
    let Some(w) = world(1, false).await else { return };
    for order in 1..=40 {
        w.produce_event(0, &event(order, "no-such-sku", 1)).await;
    }
    let gate = Arc::new(Notify::new());
    let (started_tx, mut started) = mpsc::unbounded_channel::<i64>();
    let handler = {
        let (idem, gate) = (w.idem.clone(), Arc::clone(&gate));
        move |e: OrderPaid| {
            let (idem, gate, started_tx) = (idem.clone(), Arc::clone(&gate), started_tx.clone());
            async move {
                let _ = started_tx.send(e.order_id);
                if e.order_id == 1 {
                    gate.notified().await;
                }
                deduct_stock(&idem, e).await
            }
        }
    };
    // Far longer than the bound: a stop that waited it out would fail the test.
    let consumer = w.consumer().concurrency(1).retry_delay(Duration::from_secs(600));
    let mut running = Running::start(consumer, handler);
    let mut calls = vec![tokio::time::timeout(BOUND, started.recv()).await.unwrap().unwrap()];
    assert_eq!(calls, [1]);
    let held = running.event(|e| if let Event::FetchPaused { held } = e { Some(*held) } else { None }).await;
    assert_eq!(held, 4, "paused behind the held call");
    gate.notify_one();
    // Three more calls: each failed and waits for its retry. A runner that
    // did not count them held two at the second and resumed fetching.
    while calls.len() < 4 {
        calls.push(tokio::time::timeout(BOUND, started.recv()).await.expect("a call in time").unwrap());
    }
    let mut seen = Vec::new();
    while let Ok(e) = running.events.try_recv() {
        seen.push(e);
    }
    assert!(!seen.iter().any(|e| matches!(e, Event::FetchResumed { .. })), "resumed while retries waited: {seen:?}");
    let returned = running.stop().await;
    while let Ok(order) = started.try_recv() {
        calls.push(order);
    }
    assert!(calls == [1, 2, 3, 4] || calls == [1, 2, 3, 4, 5], "handler calls: {calls:?}");
    // Every call waited for its retry, and was given back at the stop.
    let mut offsets: Vec<i64> = returned.iter().map(|s| s.delivery.offset).collect();
    offsets.sort();
    assert_eq!(offsets, (0..calls.len() as i64).collect::<Vec<_>>(), "{returned:#?}");
    assert!(
        returned.iter().all(|s| s.action == Action::Returned && s.outcome == Some(Outcome::Failed)),
        "{returned:#?}"
    );
    assert_eq!(w.committed("orders", 1), [Some(0)], "nothing settled, nothing committed past");
    assert_eq!(w.moves().await, BTreeMap::new());
    w.remove().await;
}

/// Regression: an offset counted as committed once its commit was handed to
/// librdkafka, so when the coordinator failed that commit, the runner's
/// final commit on stop (and a revocation's) skipped the partition and its
/// settled messages came back to the next owner. The gate cuts the
/// coordinator's connection at every commit: the runner hears the commit
/// failed, and once commits pass again, its stop commits the offset and
/// waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_the_coordinator_failed_is_made_again_on_stop() {
    let Some(w) = gated_world(1).await else { return };
    let gate = w.gate.as_ref().unwrap();
    w.produce_event(0, &event(1, "sku-1", 1)).await;
    gate.refuse(Request::OffsetCommit);
    let mut running = Running::start(w.consumer(), deducting(&w.idem));
    let settled = running.next().await;
    assert_eq!((settled.delivery.offset, settled.action, settled.outcome), (0, Action::Ack, Some(Outcome::Executed)));
    let failed = running
        .event(|e| match e {
            Event::CommitFailed { offset, .. } => Some(*offset),
            _ => None,
        })
        .await;
    assert_eq!(failed, 1);
    assert!(gate.cuts(Request::OffsetCommit) > 0);
    assert_eq!(w.committed("orders", 1), [None]);
    gate.admit(Request::OffsetCommit);
    running.stop().await;
    assert_eq!(w.committed("orders", 1), [Some(1)], "the stop's commit skipped the offset whose commit failed");
    assert_eq!(w.moves().await, BTreeMap::from([(1, 1)]));
    w.remove().await;
}
