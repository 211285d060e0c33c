//! A duplicate of a running call waits for its answer (`wait`, per fn or
//! `Builder::wait`), told by Redis when it ends rather than polling: it gets
//! the first call's result (or goes ahead as a first call if that one
//! failed), and `InProgress` only once its bound passes. Two engines on one
//! database and one Redis stand for two instances. Every wait here ends on
//! the event (the first call let go), seen through Redis's own count of
//! subscribers; the bounds are generous, only against hangs.

use std::sync::Arc;
use std::time::Duration;

use idempotency::{Idem, Outcome, idempotent};
use idempotency_testkit::{TestBackend, unique};
use sqlx::Transaction;

use super::fixture::{
    Mode, Probe, Receipt, TestError, body, is_in_progress, ledger_rows, lent, redis_location, until, until_held,
};
use super::{B, Db};

/// `pay`'s twin that waits for a running duplicate whatever the engine says.
#[idempotent(key = "<k>", ttl = "1h", biz = "t_wait", wait = "30s")]
async fn pay_waiting(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    #[idem(skip)] probe: &Probe,
    #[idem(skip)] mode: Mode,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, amount, probe, mode).await?;
    Ok(Receipt { key: k, amount, run })
}

/// Two engines over one database and the shared Redis, waiting `wait` by
/// default; `None` when a server is unreachable.
async fn instances(wait: Duration) -> Option<(Idem<Db>, Idem<Db>)> {
    let pool = B::open(&unique("db"), 24).await?;
    B::prepare(&pool).await;
    let client = idempotency_testkit::redis_client().await?;
    let engine = || Idem::builder(pool.clone()).redis(client.clone()).wait(wait).build();
    let (a, b) = (engine(), engine());
    a.migrate().await.expect("migrate");
    Some((a, b))
}

/// Until Redis counts `n` subscribers on the claim's channel of `(biz, k)`:
/// one per engine with waiters.
async fn until_waiting(idem: &Idem<Db>, biz: &str, k: &str, n: i64) {
    let at = redis_location(idem, biz, k).await;
    let client = idempotency_testkit::redis_client().await.expect("redis");
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let start = std::time::Instant::now();
    loop {
        let counts: Vec<(String, i64)> =
            redis::cmd("PUBSUB").arg("NUMSUB").arg(&at.claim).query_async(&mut conn).await.expect("NUMSUB");
        if counts.first().map_or(0, |(_, count)| *count) >= n {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{counts:?}: the duplicates never waited");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Duplicates on both instances while the first call is held: each waits
/// (as Redis's subscriber count shows), and once the first is let go every
/// one replays its result; the body ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_wait_for_the_running_call_and_get_its_result() {
    const DUPLICATES: usize = 8;
    let Some((a, b)) = instances(Duration::from_secs(30)).await else { return };
    let probe = Arc::new(Probe::default());
    let k = unique("wait");
    let first = {
        let (a, probe, k) = (a.clone(), probe.clone(), k.clone());
        tokio::spawn(async move { super::fixture::pay(&a, k, 7, &probe, Mode::HeldThenOk).await })
    };
    until_held(&probe).await;
    let duplicates: Vec<_> = (0..DUPLICATES)
        .map(|i| {
            let (idem, probe, k) = (if i % 2 == 0 { a.clone() } else { b.clone() }, probe.clone(), k.clone());
            tokio::spawn(async move { idempotency::observe(super::fixture::pay(&idem, k, 7, &probe, Mode::Ok)).await })
        })
        .collect();
    until_waiting(&a, "t_pay", &k, 2).await;
    assert!(duplicates.iter().all(|d| !d.is_finished()), "a duplicate answered while the first ran");
    // Waiting, they hold no connection (one opened beside its claim was
    // rolled back): the first call's is the one lent.
    until("the waiters hold no connection", || lent(&a) == 1).await;
    probe.open();
    let first = first.await.unwrap().expect("the first call");
    for duplicate in duplicates {
        let (answer, outcome) = duplicate.await.unwrap();
        assert_eq!((answer.expect("waited and replayed"), outcome), (first.clone(), Some(Outcome::Replayed)));
    }
    assert_eq!((probe.runs(), ledger_rows(&a, &k).await), (1, 1));
}

/// The first call fails while duplicates wait: one of them goes ahead as a
/// first call, and every other replays its result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_goes_ahead_when_the_running_call_fails() {
    const DUPLICATES: usize = 6;
    let Some((a, b)) = instances(Duration::from_secs(30)).await else { return };
    let probe = Arc::new(Probe::default());
    let k = unique("wait-fail");
    let first = {
        let (a, probe, k) = (a.clone(), probe.clone(), k.clone());
        tokio::spawn(async move { super::fixture::pay(&a, k, 7, &probe, Mode::HeldThenFail).await })
    };
    until_held(&probe).await;
    let duplicates: Vec<_> = (0..DUPLICATES)
        .map(|i| {
            let (idem, probe, k) = (if i % 2 == 0 { a.clone() } else { b.clone() }, probe.clone(), k.clone());
            tokio::spawn(async move { idempotency::observe(super::fixture::pay(&idem, k, 7, &probe, Mode::Ok)).await })
        })
        .collect();
    until_waiting(&a, "t_pay", &k, 2).await;
    probe.open();
    assert!(matches!(first.await.unwrap(), Err(TestError::Body)));
    let mut answers = Vec::new();
    for duplicate in duplicates {
        let (answer, outcome) = duplicate.await.unwrap();
        answers.push((answer.expect("an answer"), outcome.expect("an outcome")));
    }
    let executed = answers.iter().filter(|(_, o)| *o == Outcome::Executed).count();
    assert_eq!(executed, 1, "{answers:?}");
    assert!(answers.iter().all(|(receipt, _)| receipt.run == 2), "{answers:?}");
    assert_eq!((probe.runs(), ledger_rows(&a, &k).await), (2, 1));
}

/// Past its bound a waiter answers `InProgress` while the first still runs;
/// a fn's own `wait` overrides the engine's zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bound_ends_a_wait_and_a_fns_own_wait_overrides_the_engines() {
    let Some((a, b)) = instances(Duration::from_millis(200)).await else { return };
    let probe = Arc::new(Probe::default());
    let k = unique("wait-bound");
    let first = {
        let (a, probe, k) = (a.clone(), probe.clone(), k.clone());
        tokio::spawn(async move { super::fixture::pay(&a, k, 7, &probe, Mode::HeldThenOk).await })
    };
    until_held(&probe).await;
    let (bounded, outcome) = idempotency::observe(super::fixture::pay(&b, k.clone(), 7, &probe, Mode::Ok)).await;
    assert!(is_in_progress(&bounded), "{bounded:?}");
    assert_eq!(outcome, Some(Outcome::InProgress));
    probe.open();
    let first = first.await.unwrap().expect("the first call");

    // An engine that does not wait, and a fn that does.
    let Some((a, b)) = instances(Duration::ZERO).await else { return };
    let probe = Arc::new(Probe::default());
    let k = unique("wait-fn");
    let held = {
        let (a, probe, k) = (a.clone(), probe.clone(), k.clone());
        tokio::spawn(async move { pay_waiting(&a, k, 7, &probe, Mode::HeldThenOk).await })
    };
    until_held(&probe).await;
    let waiting = {
        let (b, probe, k) = (b.clone(), probe.clone(), k.clone());
        tokio::spawn(async move { idempotency::observe(pay_waiting(&b, k, 7, &probe, Mode::Ok)).await })
    };
    until_waiting(&a, "t_wait", &k, 1).await;
    probe.open();
    let held = held.await.unwrap().expect("the first call");
    let (answer, outcome) = waiting.await.unwrap();
    assert_eq!((answer.expect("waited"), outcome), (held, Some(Outcome::Replayed)));
    let _ = first;
}
