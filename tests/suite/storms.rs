//! Many callers on one key at once: the body runs once, over one engine
//! or two, with or without Redis; duplicates on one engine wait in memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use idempotency::Idem;
use idempotency_testkit::{TestBackend, unique};
use tokio::sync::Barrier;

use super::fixture::{
    Mode, Probe, Receipt, Redis, engine, is_in_progress, ledger_rows, pay, until_held, with_and_without_redis,
};
use super::{B, Db};

/// `callers` tasks released together by a barrier, spread over `engines`,
/// all paying the same key: the body runs once, everyone gets that result
/// or `InProgress`, and afterwards everyone gets the replay.
pub(crate) async fn storm(engines: Vec<Idem<Db>>, callers: usize) {
    let k = unique("storm");
    let probe = Arc::new(Probe::default());
    let barrier = Arc::new(Barrier::new(callers));
    let mut tasks = Vec::new();
    for i in 0..callers {
        let (idem, k, probe, barrier) = (engines[i % engines.len()].clone(), k.clone(), probe.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            pay(&idem, k, 500, &probe, Mode::Slow(100)).await
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.expect("no task panics"));
    }
    assert_eq!(probe.runs(), 1, "the body ran {} times", probe.runs());
    let expected = Receipt { key: k.clone(), amount: 500, run: 1 };
    let (mut ok, mut busy) = (0, 0);
    for r in &results {
        match r {
            Ok(receipt) => {
                assert_eq!(receipt, &expected);
                ok += 1;
            }
            r if is_in_progress(r) => busy += 1,
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    assert!(ok >= 1, "nobody got the result");
    assert_eq!(ok + busy, callers);
    for idem in &engines {
        assert_eq!(ledger_rows(idem, &k).await, 1);
        for _ in 0..5 {
            assert_eq!(pay(idem, k.clone(), 500, &probe, Mode::Ok).await.unwrap(), expected);
        }
    }
    assert_eq!(probe.runs(), 1);
}

async fn storm_one_engine(redis: Redis) {
    let name = unique("db");
    let Some(idem) = engine(&name, 10, redis).await else { return };
    storm(vec![idem], 100).await;
}

async fn storm_two_engines(redis: Redis) {
    let name = unique("db");
    let Some(a) = engine(&name, 8, redis).await else { return };
    let Some(b) = engine(&name, 8, redis).await else { return };
    storm(vec![a, b], 100).await;
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    storm_of_100_runs_the_body_once,
    storm_of_100_runs_the_body_once_with_redis => storm_one_engine
);

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    storm_over_two_engines_runs_the_body_once,
    storm_over_two_engines_runs_the_body_once_with_redis => storm_two_engines
);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_with_redis_on_a_dead_port_runs_the_body_once() {
    storm_one_engine(Redis::DeadPort).await;
}

/// Without Redis, duplicates on one engine wait for the first call in
/// memory and take its result: they never ask the pool for a connection.
/// The first call holds the pool's only connection at its gate; once every
/// duplicate waits, the pool is closed, so a duplicate that asked for a
/// connection, or asks later, fails with `PoolClosed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_on_one_engine_wait_in_memory_without_a_connection() {
    let Some(opened) = B::open(&unique("db"), 1).await else { return };
    B::prepare(&opened).await;
    let options = (*opened.connect_options()).clone();
    opened.close().await;
    let pool = sqlx::pool::PoolOptions::<Db>::new().max_connections(1).connect_with(options.clone()).await;
    let idem = Idem::new(pool.expect("pool of one"));
    idem.migrate().await.expect("migrate");
    let observer = sqlx::pool::PoolOptions::<Db>::new().max_connections(1).connect_with(options).await;
    let observer = Idem::new(observer.expect("observer pool"));
    let probe = Arc::new(Probe::default());
    let k = unique("inmemory");

    let first = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay(&idem, k, 7, &probe, Mode::HeldThenOk).await })
    };
    until_held(&probe).await;
    // The first call is at its gate, on the pool's only connection.
    let waiting = Arc::new(AtomicUsize::new(0));
    let duplicates: Vec<_> = (0..20)
        .map(|_| {
            let (idem, k, probe, waiting) = (idem.clone(), k.clone(), probe.clone(), waiting.clone());
            tokio::spawn(async move {
                counted_once_pending(&waiting, idempotency::observe(pay(&idem, k, 7, &probe, Mode::Ok))).await
            })
        })
        .collect();
    let start = std::time::Instant::now();
    while waiting.load(SeqCst) < 20 {
        assert!(start.elapsed() < Duration::from_secs(30), "{} of 20 duplicates wait", waiting.load(SeqCst));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let closing = idem.pool().close(); // marks the pool closed at once
    probe.open();
    let first = first.await.unwrap().unwrap();
    closing.await; // the first call gave its connection back
    for duplicate in duplicates {
        let (result, outcome) = duplicate.await.unwrap();
        assert_eq!(result.unwrap(), first);
        assert_eq!(outcome, Some(idempotency::Outcome::Replayed));
    }
    assert_eq!(probe.runs(), 1);
    assert_eq!(ledger_rows(&observer, &k).await, 1);
}

/// Runs `call`, counting it in `waiting` the first time it is pending: it
/// is then parked at its first wait.
async fn counted_once_pending<F: std::future::Future>(waiting: &AtomicUsize, call: F) -> F::Output {
    let mut call = std::pin::pin!(call);
    let mut counted = false;
    std::future::poll_fn(|cx| {
        let poll = call.as_mut().poll(cx);
        if poll.is_pending() && !counted {
            counted = true;
            waiting.fetch_add(1, SeqCst);
        }
        poll
    })
    .await
}
