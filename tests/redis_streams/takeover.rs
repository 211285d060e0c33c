//! Entries a consumer took and did not settle: taken over by another
//! consumer of the group (`XAUTOCLAIM`) and replayed, whether the first hung
//! in-process or was a process killed with SIGKILL; and a stop in the middle
//! of a read, which gives back what the read brought.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use idempotency::Outcome;
use idempotency::redis_streams::{Action, Consumer};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::support::*;

// ---------------------------------------------------------------- duplicates and a redelivery

/// The README's case on Redis Streams: a consumer commits the deduction and
/// dies before its `XACK`; another consumer of the group takes the entry
/// over (`XAUTOCLAIM`) and replays instead of deducting again. With 4 more
/// duplicates: every entry acked as a replay, the body ran once, nothing
/// pending, nothing dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_and_a_redelivery_deduct_once() {
    let Some(w) = world(100).await else { return };
    let order = order_id();
    let mut ids = Vec::new();
    for i in 1..=5 {
        ids.push(w.add_event(order, 3, &format!("dup-{i}")).await);
    }

    // The doomed consumer, one entry at a time: its handler commits the first
    // entry, says so, and hangs before returning, so the runner never acks.
    let (committed_tx, mut committed) = mpsc::unbounded_channel();
    let doomed = {
        let idem = w.idem.clone();
        tokio::spawn(w.consumer("doomed").run(std::future::pending::<()>(), move |event: OrderPaid| {
            let (idem, committed) = (idem.clone(), committed_tx.clone());
            async move {
                let deducted = deduct_stock(&idem, event).await;
                committed.send(deducted.is_ok()).expect("test listens");
                std::future::pending::<()>().await;
                deducted
            }
        }))
    };
    assert_eq!(within("the doomed consumer's commit", committed.recv()).await, Some(true));
    assert_eq!((body_runs(&w.sku), w.moves().await, w.stock().await), (1, 1, 97), "committed before the crash");
    doomed.abort();
    let _ = doomed.await;
    let pending = w.pending().await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(
        (pending[0].id.as_str(), pending[0].consumer.as_str(), pending[0].delivered),
        (ids[0].as_str(), "doomed", 1)
    );

    let mut survivor = w.run(w.consumer("survivor").concurrency(4), false);
    let seen = survivor.until(|seen| seen.len() == 5).await;
    let rest = survivor.stop().await;

    assert!(rest.is_empty(), "{rest:#?}");
    assert!(seen.iter().all(|s| s.action == Action::Ack && s.outcome == Some(Outcome::Replayed)), "{seen:#?}");
    let mut got: Vec<(String, u64)> = seen.iter().map(|s| (s.message_id.clone().unwrap(), s.delivery.count)).collect();
    got.sort();
    let expected: Vec<(String, u64)> = (1..=5).map(|i| (format!("dup-{i}"), if i == 1 { 2 } else { 1 })).collect();
    assert_eq!(got, expected, "only the dead consumer's entry came back, claimed: its second delivery");
    let taken_over = seen.iter().find(|s| s.delivery.count == 2).unwrap();
    assert_eq!(taken_over.delivery.entry_id, ids[0]);
    assert_eq!(body_runs(&w.sku), 1, "the body ran once, in the consumer that died");
    assert_eq!((w.stock().await, w.moves().await), (97, 1));
    assert_eq!(w.pending().await, vec![], "every entry acked");
    assert_eq!(w.length(&w.dead).await, 0);
    w.remove().await;
}

// ---------------------------------------------------------------- a consumer process killed before XACK

/// Set in a child's environment: what it consumes, as JSON.
const CHILD_ENV: &str = "IDEM_REDIS_STREAMS_CHILD";

#[derive(Debug, Serialize, Deserialize)]
struct ChildConfig {
    stream: String,
    redis_url: String,
}

/// The child's entry: does nothing unless the parent set [`CHILD_ENV`].
/// It consumes as `child`; once its call committed it prints
/// `IDEM-STOP after_commit` and waits, never acking, to be killed there.
#[test]
fn child_process() {
    let Ok(config) = std::env::var(CHILD_ENV) else { return };
    let config: ChildConfig = serde_json::from_str(&config).expect("child config");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async move {
        let client = redis::Client::open(config.redis_url).unwrap();
        let idem = mysql_engine(Some(&client)).await.expect("mysql answers");
        let _ = Consumer::new(client, config.stream, GROUP)
            .consumer_name("child")
            .run(std::future::pending::<()>(), move |event: OrderPaid| {
                let idem = idem.clone();
                async move {
                    let deducted = deduct_stock(&idem, event).await;
                    println!("IDEM-STOP after_commit {}", deducted.is_ok());
                    std::future::pending::<()>().await;
                    deducted
                }
            })
            .await;
    });
}

/// A consumer process killed with SIGKILL after its call committed and
/// before its `XACK`: its entry stays pending in its name; once idle for
/// `claim_idle`, the other consumer takes it over with `XAUTOCLAIM` (its
/// second delivery) and replays: the body ran once, the entry is acked,
/// nothing is pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_after_its_commit_and_before_xack_is_taken_over_and_replays() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let Some(w) = world(100).await else { return };
    let order = order_id();
    let entry = w.add_event(order, 4, "killed-1").await;

    let config = ChildConfig { stream: w.stream.clone(), redis_url: idempotency_testkit::redis_url() };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "takeover::child_process", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, serde_json::to_string(&config).unwrap())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the child");
    let stdout = child.stdout.take().unwrap();
    let marker = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout).lines().map_while(Result::ok).find_map(|line| {
            line.find("IDEM-STOP after_commit ").map(|at| line[at + "IDEM-STOP after_commit ".len()..].to_owned())
        })
    });
    let committed = within("the child's commit", marker).await.unwrap();
    assert_eq!(committed.as_deref(), Some("true"), "the child's call committed");
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    let killed_at = Instant::now();
    assert_eq!((w.moves().await, w.stock().await), (1, 96), "committed by the child");
    let pending = w.pending().await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(
        (pending[0].id.as_str(), pending[0].consumer.as_str(), pending[0].delivered),
        (entry.as_str(), "child", 1)
    );

    let claim_idle = Duration::from_millis(800);
    let mut survivor = w.run(w.consumer("survivor").claim_idle(claim_idle), false);
    let taken = survivor.next().await;
    let taken_after = killed_at.elapsed();
    let rest = survivor.stop().await;

    assert!(rest.is_empty(), "{rest:#?}");
    assert_eq!((taken.action, taken.outcome, taken.delivery.count), (Action::Ack, Some(Outcome::Replayed), 2));
    assert_eq!((taken.delivery.entry_id.as_str(), taken.message_id.as_deref()), (entry.as_str(), Some("killed-1")));
    assert_eq!(body_runs(&w.sku), 0, "the body never ran here: it replayed the child's result");
    assert_eq!((w.moves().await, w.stock().await), (1, 96), "deducted once");
    assert_eq!(w.pending().await, vec![], "acked");
    assert_eq!(w.length(&w.dead).await, 0);
    println!("taken over {taken_after:?} after the kill (claim_idle {claim_idle:?})");
    w.remove().await;
}

/// A stop while a read is in flight: the runner waits for the read, and an
/// entry it brought (delivered by Redis, not started) is given back
/// uncounted and claimable at once (`Returned`); the next consumer takes it
/// at delivery 1 still and executes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_mid_read_gives_back_what_the_read_brought_uncounted() {
    // A private server: its only reads are this runner's.
    let Some(server) = idempotency_testkit::servers::RedisServer::start() else { return };
    let Some(idem) = mysql_engine(Some(&server.client())).await else { return };
    let w = world_on(idem, server.client(), 100).await;
    // Claims far apart: the reads block for the longest time (1 s).
    let mut running = w.run(w.consumer("stopping").claim_interval(Duration::from_secs(30)), false);
    // Into a read that has just begun, so that most of its second of
    // blocking is left for the stop and the entry: the first read that
    // blocked has ended (Redis counts a read once it ends) and the next
    // one blocks.
    within("the runner blocked in a fresh read", async {
        let mut ended_before = None;
        loop {
            let ended = server.calls().get("xreadgroup").copied().unwrap_or(0);
            if blocked_in_a_read(&w).await {
                match ended_before {
                    Some(before) if ended > before => break,
                    None => ended_before = Some(ended),
                    Some(_) => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let stop = running.stop.take().unwrap();
    let _ = stop.send(());
    let entry = w.add_event(order_id(), 1, "mid-read").await;
    within("the runner's stop", &mut running.task).await.expect("runner task").expect("clean stop");
    let returned = running.settlements.try_recv().expect("the entry the read brought was settled");
    assert_eq!((returned.action, returned.outcome, returned.delivery.count), (Action::Returned, None, 1));
    assert_eq!(returned.delivery.entry_id, entry);
    assert_eq!(running.calls.load(SeqCst), 0, "never started");
    let pending = w.pending().await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!((pending[0].delivered, pending[0].consumer.as_str()), (0, "stopping"), "uncounted: {pending:?}");
    assert!(pending[0].idle_ms >= 1500, "claimable at once: {pending:?}");

    let mut next = w.run(w.consumer("next"), false);
    let taken = next.next().await;
    let rest = next.stop().await;
    assert_eq!((taken.action, taken.outcome, taken.delivery.count), (Action::Ack, Some(Outcome::Executed), 1));
    assert!(rest.is_empty(), "{rest:#?}");
    assert_eq!(w.pending().await, vec![]);
    assert_eq!(w.moves().await, 1);
    w.remove().await;
}

/// Whether a client of the (private) server is blocked in `XREADGROUP`.
async fn blocked_in_a_read(w: &World) -> bool {
    let clients: String = redis::cmd("CLIENT").arg("LIST").query_async(&mut w.conn()).await.expect("CLIENT LIST");
    clients.lines().any(|c| {
        let mut fields = c.split(' ');
        fields.clone().any(|f| f == "cmd=xreadgroup") && fields.any(|f| f.starts_with("flags=") && f.contains('b'))
    })
}
