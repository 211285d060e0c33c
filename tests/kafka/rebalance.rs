//! Rebalances: partitions revoked while their messages are handled, revoked
//! while fetching is paused, and lost.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency::Outcome;
use idempotency::kafka::{Action, Consumer, Event};
use idempotency_testkit::kafka::Request;

use crate::support::*;

/// Partitions revoked while their messages are being handled, one of them
/// handed to another consumer that gets the same message: one execution
/// each, both consumers settle (the new owners replay), and the former
/// owner's settlements commit nothing: an offset it committed would move
/// the group's offset back behind what the new owners committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_revoked_mid_handling_executes_once_and_its_former_owner_commits_nothing() {
    let Some(w) = world(2, true).await else { return };
    // Per partition: a message held in its first consumer's handler (after
    // its call committed), then one that runs freely.
    for (partition, held, free) in [(0, 1, 3), (1, 2, 4)] {
        w.produce_event(partition, &event(held, "sku-1", 1)).await;
        w.produce_event(partition, &event(free, "sku-1", 1)).await;
    }
    let holds = Holds::default();
    holds.held.lock().unwrap().extend([1, 2]);
    let fast = |c: Consumer| c.concurrency(4).in_progress_delay(Duration::from_millis(50));
    let mut a = Running::start(fast(w.consumer()), holds.handler(&w.idem));
    holds.await_called(2).await;
    // 3 and 4 settle beside the held ones; nothing commits past 1 and 2.
    let a_free = a.take(2).await;
    assert!(a_free.iter().all(|s| s.action == Action::Ack && s.outcome == Some(Outcome::Executed)), "{a_free:#?}");
    w.await_committed("orders", &[Some(0), Some(0)]);

    // A second consumer joins: both partitions are revoked from the first,
    // one comes back to it and one goes to the newcomer; each gets the
    // messages again from offset 0 and replays them.
    let mut b = Running::start(fast(w.consumer()), holds.handler(&w.idem));
    let mut replays = Vec::new();
    let start = Instant::now();
    while replays.len() < 4 {
        assert!(start.elapsed() < BOUND, "replays: {replays:#?}");
        tokio::select! {
            Some(s) = a.settlements.recv() => replays.push(("a", s)),
            Some(s) = b.settlements.recv() => replays.push(("b", s)),
        }
        replays.retain(|(_, s)| s.action != Action::Requeue);
    }
    assert!(
        replays.iter().all(|(_, s)| s.action == Action::Ack && s.outcome == Some(Outcome::Replayed)),
        "{replays:#?}"
    );
    let by_b: Vec<i32> = replays.iter().filter(|(who, _)| *who == "b").map(|(_, s)| s.delivery.partition).collect();
    assert_eq!(by_b.len(), 2, "the newcomer took one partition: {replays:#?}");
    assert_eq!(by_b[0], by_b[1]);
    w.await_committed("orders", &[Some(2), Some(2)]);

    // The first consumer's held handlers return now: its settlements are of
    // an assignment that is gone, and commit nothing.
    holds.release.notify_waiters();
    let late = a.take(2).await;
    assert!(late.iter().all(|s| s.action == Action::Ack && s.outcome == Some(Outcome::Executed)), "{late:#?}");
    // Stopping flushes its commits (a final synchronous one after them).
    a.stop().await;
    b.stop().await;
    assert_eq!(w.committed("orders", 2), [Some(2), Some(2)], "a former owner moved the group's offset back");
    assert_eq!(w.moves().await, BTreeMap::from([(1, 1), (2, 1), (3, 1), (4, 1)]));
    assert_eq!(w.records("t_kafka_deduct").await, 4);
    assert_eq!(
        w.read_topic("orders", 4).iter().map(|r| (r.partition, r.offset)).collect::<Vec<_>>(),
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    );
    w.remove().await;
}

/// Regression: a revocation while fetching was paused kept the pause: the
/// book dropped what it held of the revoked partitions, the new assignment
/// was paused as well, and only taking a message resumed fetching, so
/// nothing ever did; the consumer heartbeated for ever while its partitions
/// did not move. One consumer, `concurrency(1)`, its handler held on the
/// first message of a key while the key's later ones wait (fetching
/// paused); a second consumer joins (eager rebalance: everything revoked);
/// the held handler returns; new messages go to both partitions: both
/// consumers handle theirs, every order executes once, and the group's
/// offsets reach the end of both partitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_while_fetching_is_paused_leaves_no_partition_stalled() {
    let Some(w) = world(2, false).await else { return };
    for order in 1..=5 {
        w.produce(0, "a", &serde_json::to_vec(&event(order, "sku-1", 1)).unwrap(), &[]).await;
    }
    let holds = Holds::default();
    holds.held.lock().unwrap().push(1);
    let one = |c: Consumer| c.concurrency(1).in_progress_delay(Duration::ZERO);
    let mut a = Running::start(one(w.consumer()), holds.handler(&w.idem));
    holds.await_called(1).await;
    let held = a.event(|e| if let Event::FetchPaused { held } = e { Some(*held) } else { None }).await;
    assert_eq!(held, 4, "orders 2 to 5 wait behind order 1, of their key");

    let b = Running::start(one(w.consumer()), holds.handler(&w.idem));
    a.event(|e| matches!(e, Event::Revoked { lost: false, .. }).then_some(())).await;
    let mine = a
        .event(|e| match e {
            Event::Assigned(partitions) => Some(partitions.iter().filter(|(t, _)| t == "orders").count()),
            _ => None,
        })
        .await;
    assert_eq!(mine, 1, "one partition of the topic each");
    holds.release.notify_waiters();
    w.produce(0, "b", &serde_json::to_vec(&event(6, "sku-1", 1)).unwrap(), &[]).await;
    w.produce(1, "c", &serde_json::to_vec(&event(7, "sku-1", 1)).unwrap(), &[]).await;
    w.await_committed("orders", &[Some(6), Some(1)]);
    a.stop().await;
    b.stop().await;
    assert_eq!(w.moves().await, (1..=7).map(|o| (o, 1)).collect::<BTreeMap<_, _>>());
    assert_eq!(w.records("t_kafka_deduct").await, 7);
    w.remove().await;
}

/// A revocation of lost partitions sends no commit: the group moved on
/// without this consumer. The gate fails the coordinator's commits (the
/// settled offset stays uncommitted), then the test's event hook holds the
/// runner's polling task, past `max.poll.interval.ms`, until librdkafka
/// gives up on the application and leaves the group: the assignment is
/// lost, no commit request reaches the gate from then to the revocation,
/// and the broker's committed offset stays where it was. (Sent anyway, the
/// commit carries the member id librdkafka reset, and tansu refuses it
/// with `UnknownMemberId`, as Kafka does in a group with members: the gate's
/// count is what tells.) The consumer rejoins, gets the message again and
/// replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_partitions_are_forgotten_without_a_commit() {
    let Some(w) = gated_world(1).await else { return };
    let gate = w.gate.clone().unwrap();
    w.produce_event(0, &event(1, "sku-1", 1)).await;
    let mut config = w.config();
    // The smallest poll interval librdkafka allows (no less than the session).
    config.set("session.timeout.ms", "6000").set("max.poll.interval.ms", "6000");
    gate.refuse(Request::OffsetCommit);
    // Commit requests sent by then: at the failure, and at the revocation.
    let sent: Arc<Mutex<Vec<usize>>> = Arc::default();
    let (hold, seen) = (gate.clone(), Arc::clone(&sent));
    let hook = move |e: &Event| match e {
        Event::CommitFailed { offset: 1, .. } if seen.lock().unwrap().is_empty() => {
            seen.lock().unwrap().push(hold.seen(Request::OffsetCommit));
            // Commits pass again; the polling task is held until librdkafka
            // leaves the group.
            hold.admit(Request::OffsetCommit);
            // (Its worker's other tasks handed to another thread meanwhile.)
            let left = tokio::task::block_in_place(|| hold.block_until_seen(Request::LeaveGroup, 1, BOUND));
            assert!(left, "librdkafka never left the group");
        }
        Event::Revoked { lost: true, .. } => seen.lock().unwrap().push(hold.seen(Request::OffsetCommit)),
        _ => {}
    };
    let consumer = Consumer::new(config, &w.topic, &w.group);
    let mut a = Running::observed(consumer, deducting(&w.idem), Log::default(), hook);
    let first = a.next().await;
    assert_eq!((first.delivery.offset, first.action, first.outcome), (0, Action::Ack, Some(Outcome::Executed)));
    let lost = a.event(|e| if let Event::Revoked { lost, .. } = e { Some(*lost) } else { None }).await;
    assert!(lost, "revoked, not lost");
    assert_eq!(gate.seen(Request::LeaveGroup), 1);
    let sent = sent.lock().unwrap().clone();
    assert!(sent.len() == 2 && sent[0] > 0, "{sent:?}");
    assert_eq!(sent[0], sent[1], "a commit was sent for lost partitions");
    assert_eq!(w.committed("orders", 1), [None]);
    let again = a.next().await;
    assert_eq!((again.delivery.offset, again.action, again.outcome), (0, Action::Ack, Some(Outcome::Replayed)));
    w.await_committed("orders", &[Some(1)]);
    a.stop().await;
    assert_eq!(w.moves().await, BTreeMap::from([(1, 1)]));
    w.remove().await;
}
