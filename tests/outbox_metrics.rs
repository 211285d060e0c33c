//! The outbox relay's metrics (features `outbox` and `metrics`): its own
//! test binary, so the global recorder sees this test's relay alone.

use std::time::{Duration, Instant};

use idempotency::Idem;
use idempotency::outbox::{Confirm, Event, Message, MessageId, Publisher, Relay};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// Confirms `ok`, refuses `bad`, leaves `mute` unanswered, and reports
/// `dup` as a copy the broker already had.
struct ByDestination;

impl Publisher for ByDestination {
    async fn publish(&mut self, batch: &[Message]) -> Vec<Confirm> {
        batch
            .iter()
            .map(|m| match m.destination() {
                "bad" => Confirm::Refused("refused by the test".into()),
                "mute" => Confirm::Unconfirmed("no answer in the test".into()),
                "dup" => Confirm::Sent { duplicate: true },
                _ => Confirm::Sent { duplicate: false },
            })
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_counts_each_message_by_the_brokers_answer() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().expect("the only recorder of this test binary");
    idempotency::metrics::describe();

    let idem = Idem::sqlite_memory().await.unwrap();
    let mut tx = idem.pool().begin().await.unwrap();
    for (i, destination) in ["ok", "ok", "dup", "bad", "mute"].into_iter().enumerate() {
        let id = MessageId::derive("t_metrics", &format!("m{i}"), 0).unwrap();
        idempotency::outbox::queue(&mut tx, Event::raw(destination, "{}").id(id)).await.unwrap();
    }
    tx.commit().await.unwrap();

    let relay = Relay::new(&idem, ByDestination)
        .max_attempts(1)
        .poll_interval(Duration::from_millis(10))
        .retry_backoff(Duration::from_secs(60), Duration::from_secs(60));
    let stats = relay.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));
    let start = Instant::now();
    while stats.published() < 3 || stats.dead() < 1 {
        assert!(start.elapsed() < Duration::from_secs(10), "the relay's first batch");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = stop.send(());
    task.await.unwrap();

    let mut seen = std::collections::HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let label = key.key().labels().map(|l| format!("{}={}", l.key(), l.value())).collect::<Vec<_>>().join(",");
        if let DebugValue::Counter(n) = value {
            seen.insert(format!("{}{{{label}}}", key.key().name()), n);
        }
    }
    let get = |name: &str| seen.get(name).copied().unwrap_or(0);
    assert_eq!(get("idem_outbox_messages_total{result=sent}"), 2, "{seen:?}");
    assert_eq!(get("idem_outbox_messages_total{result=duplicate}"), 1, "{seen:?}");
    assert_eq!(get("idem_outbox_messages_total{result=dead}"), 1, "{seen:?}");
    assert_eq!(get("idem_outbox_messages_total{result=refused}"), 0, "{seen:?}");
    assert_eq!(get("idem_outbox_messages_total{result=unmarked}"), 0, "{seen:?}");
    // The unanswered message is tried again after each back-off of the relay.
    assert!(get("idem_outbox_messages_total{result=unconfirmed}") >= 1, "{seen:?}");
    assert_eq!(
        get("idem_outbox_batches_total{}"),
        get("idem_outbox_messages_total{result=unconfirmed}"),
        "one batch per look while the last message stays unanswered: {seen:?}"
    );
}
