//! How long a key stays held: a duplicate's wait on the record (bounded by
//! `lock_wait`), a claim's lease running out under a slow body, a claim
//! left by a call that died after its commit.

use std::sync::Arc;
use std::time::Duration;

use idempotency::Idem;
use idempotency_testkit::{
    TestBackend, redis_cached_response, redis_client, redis_forget, redis_set, redis_value_after, unique,
};

use super::B;
use super::fixture::{
    Mode, Probe, Receipt, Redis, TestError, engine, expire_now, is_in_progress, ledger_rows, pay, pay_short_lease,
    redis_location, until_expired, until_held, until_started,
};

/// Without Redis, a duplicate waits for the first call: in memory when both
/// run on one engine, on the record's unique index when the duplicate runs
/// on another (another instance). Past `lock_wait` it answers `InProgress`
/// while the first call still runs. (SQLite serializes writers instead:
/// another engine's duplicate waits its turn under the busy timeout, then
/// replays.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_waiting_past_the_lock_bound_is_in_progress() {
    let Some(pool) = B::open(&unique("db"), 4).await else { return };
    B::prepare(&pool).await;
    let idem = Idem::builder(pool.clone()).lock_wait(LOCK_WAIT).build();
    let elsewhere = Idem::builder(pool).lock_wait(LOCK_WAIT).build();
    idem.migrate().await.expect("migrate");
    let probe = Arc::new(Probe::default());
    let k = unique("lockwait");

    let first = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay(&idem, k, 4, &probe, Mode::HeldThenOk).await })
    };
    until_held(&probe).await;
    let (same_engine, waited) = timed(pay(&idem, k.clone(), 4, &probe, Mode::Ok)).await;
    assert!(is_in_progress(&same_engine), "{same_engine:?}");
    assert_waited_the_bound(waited);
    let second = {
        let (elsewhere, k, probe) = (elsewhere.clone(), k.clone(), probe.clone());
        tokio::spawn(timed(async move { pay(&elsewhere, k, 4, &probe, Mode::Ok).await }))
    };
    let first = settle_held_and_elsewhere(&probe, first, second).await;
    assert_eq!(pay(&idem, k.clone(), 4, &probe, Mode::Ok).await.unwrap(), first);
    assert_eq!(probe.runs(), 1);
    assert_eq!(ledger_rows(&idem, &k).await, 1);
}

/// The `lock_wait` of the lock-bound tests.
const LOCK_WAIT: Duration = Duration::from_secs(1);

/// `call`'s answer and how long it took.
async fn timed<T>(call: impl std::future::Future<Output = T>) -> (T, Duration) {
    let started = std::time::Instant::now();
    let answer = call.await;
    (answer, started.elapsed())
}

/// An `InProgress` that came from the bound: it took about `LOCK_WAIT`,
/// not an instant refusal, nor a server default far past it (MariaDB's 50 s;
/// PostgreSQL's none). The upper bound is generous: a loaded machine may
/// answer seconds late, and only a server default takes 20 s. The lower
/// one allows a server's coarse clock (a tick, 4–10 ms): MariaDB times a
/// lock wait on one and answered 998 ms into a 1 s `innodb_lock_wait_timeout`.
fn assert_waited_the_bound(waited: Duration) {
    let least = LOCK_WAIT - Duration::from_millis(20);
    assert!(waited >= least, "answered after {waited:?}, before the {LOCK_WAIT:?} bound");
    assert!(waited < Duration::from_secs(20), "answered after {waited:?}, far past the {LOCK_WAIT:?} bound");
}

/// Settles a first call held at its gate and its duplicate on another engine
/// (timed by `timed`). Where the record wait is bounded, the duplicate
/// answers `InProgress` after `LOCK_WAIT` while the first is still held;
/// SQLite's waits for the commit and replays it. Returns the first call's
/// result.
async fn settle_held_and_elsewhere(
    probe: &Probe,
    first: tokio::task::JoinHandle<Result<Receipt, TestError>>,
    second: tokio::task::JoinHandle<(Result<Receipt, TestError>, Duration)>,
) -> Receipt {
    if B::LOCK_WAIT_BOUNDED {
        // Unbounded, the duplicate would wait for the held call forever.
        let second = tokio::time::timeout(Duration::from_secs(30), second).await.expect("the duplicate hung");
        let (second, waited) = second.unwrap();
        assert!(is_in_progress(&second), "{second:?}");
        assert_waited_the_bound(waited);
        assert!(!first.is_finished(), "the first call is still held");
        probe.open();
        first.await.unwrap().unwrap()
    } else {
        probe.open();
        let first = first.await.unwrap().unwrap();
        assert_eq!(second.await.unwrap().0.unwrap(), first);
        first
    }
}

/// The same wait on another engine, when the first call is replacing an
/// expired record: every record statement stays under the bound, not only
/// the first insert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_of_a_call_replacing_an_expired_record_is_bounded_too() {
    let Some(pool) = B::open(&unique("db"), 4).await else { return };
    B::prepare(&pool).await;
    let idem = Idem::builder(pool.clone()).lock_wait(LOCK_WAIT).build();
    let elsewhere = Idem::builder(pool).lock_wait(LOCK_WAIT).build();
    idem.migrate().await.expect("migrate");
    let probe = Arc::new(Probe::default());
    let k = unique("lockwait-expired");
    pay(&idem, k.clone(), 4, &probe, Mode::Ok).await.unwrap();
    expire_now(&idem, "t_pay", &k).await;
    until_expired(&idem, "t_pay", &k).await;

    let first = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay(&idem, k, 4, &probe, Mode::HeldThenOk).await })
    };
    until_started(&probe, 2).await;
    let second = {
        let (elsewhere, k, probe) = (elsewhere.clone(), k.clone(), probe.clone());
        tokio::spawn(timed(async move { pay(&elsewhere, k, 4, &probe, Mode::Ok).await }))
    };
    // (On SQLite the duplicate waits for the commit and finds the new row live.)
    settle_held_and_elsewhere(&probe, first, second).await;
    assert_eq!(probe.runs(), 2, "the first call and the one after expiry");
    assert_eq!(ledger_rows(&idem, &k).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_after_the_lease_still_commits_once() {
    let Some(idem) = engine(&unique("db"), 4, Redis::On).await else { return };
    let Some(client) = redis_client().await else { return };
    let probe = Arc::new(Probe::default());
    let k = unique("lease");

    let first = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay_short_lease(&idem, k, &probe, Mode::HeldThenOk).await })
    };
    until_started(&probe, 1).await;
    // Its 100 ms lease runs out while its body is held.
    let claim =
        redis_value_after(&client, &redis_location(&idem, "t_lease", &k).await.claim, Duration::from_secs(10)).await;
    assert_eq!(claim, None, "the lease ran out");
    assert!(!first.is_finished());

    let second = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { idempotency::observe(pay_short_lease(&idem, k, &probe, Mode::Ok)).await })
    };
    // Bounded: a duplicate blocked behind the held body must fail, not hang.
    let second = async { tokio::time::timeout(Duration::from_secs(30), second).await.expect("the duplicate hung") };
    let (first, second) = if B::ONE_WRITER {
        // SQLite: the duplicate waits for the write lock, so the first commits
        // first and the duplicate's record meets it.
        probe.open();
        let first = first.await.unwrap().unwrap();
        let (second, outcome) = second.await.unwrap();
        assert_eq!((first.run, outcome), (1, Some(idempotency::Outcome::Replayed)));
        (first, second.unwrap())
    } else {
        // The duplicate claims the key, runs its body and commits; the first,
        // let go, meets that record at its own insert, rolls back and replays.
        let (second, outcome) = second.await.unwrap();
        assert_eq!(outcome, Some(idempotency::Outcome::Executed));
        probe.open();
        (first.await.unwrap().unwrap(), second.unwrap())
    };
    assert_eq!(first, second, "both callers got the committed result");
    assert_eq!(probe.runs(), 2, "both bodies ran");
    assert_eq!(ledger_rows(&idem, &k).await, 1, "one committed business write");
    // A later call replays the committed result. Whether its body runs
    // first depends on whether the result has reached Redis (a spawned
    // write, which a lost claim race may skip): with no copy there it
    // claims the key, runs, meets the record and rolls back. So the body
    // count is not asserted; the committed writes are.
    assert_eq!(pay_short_lease(&idem, k.clone(), &probe, Mode::Ok).await.unwrap(), first);
    assert_eq!(ledger_rows(&idem, &k).await, 1, "the later call committed nothing");
}

/// Regression: a call that committed but died before its cache write leaves
/// its claim in Redis until the lease ends; duplicates must replay from the
/// record meanwhile, not answer `InProgress`.
#[tokio::test]
async fn claim_left_by_a_call_that_died_after_commit_replays_from_the_record() {
    let Some(idem) = engine(&unique("db"), 4, Redis::On).await else { return };
    let Some(client) = redis_client().await else { return };
    let probe = Probe::default();
    let k = unique("orphan");
    let first = pay(&idem, k.clone(), 8, &probe, Mode::Ok).await.unwrap();
    // Our own cache write lands first; then Redis is made to look like it
    // holds a claim whose owner died after its commit.
    let at = redis_location(&idem, "t_pay", &k).await;
    redis_cached_response(&client, &at).await;
    redis_forget(&client, &at).await;
    redis_set(&client, &at.claim, "p:dead-token:0", 60_000).await;

    let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 8, &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap(), outcome), (first, Some(idempotency::Outcome::Replayed)));
    let reused = pay(&idem, k.clone(), 9, &probe, Mode::Ok).await;
    assert!(matches!(reused, Err(TestError::Idem(idempotency::Error::KeyReused { .. }))), "{reused:?}");
    assert_eq!(probe.runs(), 1);
}
