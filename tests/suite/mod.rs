// The behaviour suite, shared by the backend targets (`tests/sqlite.rs`,
// `tests/mysql.rs`, `tests/postgres.rs`) through `include!`. Each includer
// defines `Db`, the SQL constants, `open(name, max_connections)` and
// `prepare(pool)`. Every test uses its own keys, so all run in parallel.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use idem::{Idem, Status, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::Transaction;
use tokio::sync::Barrier;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    key: String,
    amount: i64,
    /// Which execution of the body produced it: a second execution would say 2.
    run: usize,
}

#[derive(Debug)]
#[allow(dead_code)] // the fields show in assertion messages through Debug
enum TestError {
    Idem(idem::Error),
    Db(sqlx::Error),
    Body,
}

impl From<idem::Error> for TestError {
    fn from(e: idem::Error) -> Self {
        TestError::Idem(e)
    }
}

impl From<sqlx::Error> for TestError {
    fn from(e: sqlx::Error) -> Self {
        TestError::Db(e)
    }
}

/// How the body behaves; skipped from the fingerprint so a retry after a
/// failure is the same call.
#[derive(Debug, Clone, Copy)]
enum Mode {
    Ok,
    Fail,
    Panic,
    Slow(u64),
    /// Waits for `Probe::open`, then succeeds.
    HeldThenOk,
    /// Waits for `Probe::open`, then fails.
    HeldThenFail,
}

/// Waits until `runs` bodies have started (the first call holds its key).
async fn until_started(probe: &Probe, runs: usize) {
    let start = std::time::Instant::now();
    while probe.runs() < runs {
        assert!(start.elapsed() < Duration::from_secs(30), "{} of {runs} bodies started", probe.runs());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until a `Held*` body has done its statements and waits at the gate.
async fn until_held(probe: &Probe) {
    let start = std::time::Instant::now();
    while probe.held.load(SeqCst) == 0 {
        assert!(start.elapsed() < Duration::from_secs(30), "no body reached its gate");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until the record of `(biz, k)` has expired, as the engine sees it.
async fn until_expired(idem: &Idem<Db>, biz: &str, k: &str) {
    let start = std::time::Instant::now();
    loop {
        let status = idem.status(biz, k).await.unwrap();
        if status == Status::Expired {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "still {status:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Calls until the answer is no longer `InProgress`: a claim left by a
/// failed or dropped call is released from a spawned task (up to 500 tries,
/// 20 ms apart: far less than the 30 s lease).
async fn past_the_release<F, Fut>(call: F) -> Result<Receipt, TestError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Receipt, TestError>>,
{
    let mut answer = call().await;
    for _ in 0..500 {
        if !is_in_progress(&answer) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        answer = call().await;
    }
    answer
}

/// Counts how many times a body started, and holds `Held*` bodies.
struct Probe {
    runs: AtomicUsize,
    /// `Held*` bodies that reached the gate: their statements are done.
    held: AtomicUsize,
    gate: tokio::sync::Semaphore,
}

impl Default for Probe {
    fn default() -> Self {
        Self { runs: AtomicUsize::new(0), held: AtomicUsize::new(0), gate: tokio::sync::Semaphore::new(0) }
    }
}

impl Probe {
    fn runs(&self) -> usize {
        self.runs.load(SeqCst)
    }

    /// Lets one held body go on.
    fn open(&self) {
        self.gate.add_permits(1);
    }
}

async fn body(
    tx: &mut Transaction<'_, Db>,
    k: &str,
    amount: i64,
    probe: &Probe,
    mode: Mode,
) -> Result<usize, TestError> {
    let run = probe.runs.fetch_add(1, SeqCst) + 1;
    sqlx::query(INSERT_LEDGER).bind(k).bind(amount).execute(&mut **tx).await?;
    match mode {
        Mode::Ok => {}
        Mode::Fail => return Err(TestError::Body),
        Mode::Panic => panic!("the body panics"),
        Mode::Slow(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
        Mode::HeldThenOk | Mode::HeldThenFail => {
            probe.held.fetch_add(1, SeqCst);
            probe.gate.acquire().await.expect("gate").forget();
            if matches!(mode, Mode::HeldThenFail) {
                return Err(TestError::Body);
            }
        }
    }
    Ok(run)
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_pay")]
async fn pay(
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

#[idempotent(key = "<k>", ttl = "1s", biz = "t_ttl")]
async fn pay_short_ttl(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    #[idem(skip)] probe: &Probe,
    #[idem(skip)] mode: Mode,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, 1, probe, mode).await?;
    Ok(Receipt { key: k, amount: 1, run })
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_lease", lease = "100ms")]
async fn pay_short_lease(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    #[idem(skip)] probe: &Probe,
    #[idem(skip)] mode: Mode,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, 1, probe, mode).await?;
    Ok(Receipt { key: k, amount: 1, run })
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Cart {
    items: HashMap<String, i64>,
    nested: Vec<HashMap<String, String>>,
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_cart")]
async fn checkout(idem: &Idem<Db>, k: String, cart: Cart, #[idem(skip)] probe: &Probe) -> Result<usize, TestError> {
    Ok(probe.runs.fetch_add(1, SeqCst) + 1)
}

#[idempotent(key = "bad_<k>", ttl = "1h", biz = "t_badkey")]
async fn with_bad_key(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    #[idem(skip)] probe: &Probe,
) -> Result<usize, TestError> {
    body(tx, &k, 1, probe, Mode::Ok).await
}

#[idempotent(key = "bad_<k>", ttl = "1h", biz = "t_longkey")]
async fn with_long_key(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    #[idem(skip)] probe: &Probe,
) -> Result<usize, TestError> {
    body(tx, &k, 1, probe, Mode::Ok).await
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_bad_empty")]
async fn with_empty_key(idem: &Idem<Db>, k: String, #[idem(skip)] probe: &Probe) -> Result<usize, TestError> {
    Ok(probe.runs.fetch_add(1, SeqCst) + 1)
}

macro_rules! falsy_fn {
    ($name:ident, $biz:literal, $ty:ty, $value:expr) => {
        #[idempotent(key = "<k>", ttl = "1h", biz = $biz)]
        async fn $name(idem: &Idem<Db>, k: String, #[idem(skip)] probe: &Probe) -> Result<$ty, TestError> {
            probe.runs.fetch_add(1, SeqCst);
            Ok($value)
        }
    };
}
falsy_fn!(zero, "t_falsy_zero", i64, 0);
falsy_fn!(empty_string, "t_falsy_str", String, String::new());
falsy_fn!(empty_vec, "t_falsy_vec", Vec<i32>, Vec::new());
falsy_fn!(unit, "t_falsy_unit", (), ());
falsy_fn!(none, "t_falsy_none", Option<i32>, None);
falsy_fn!(falsy_false, "t_falsy_bool", bool, false);

/// A result whose stored form differs from the value: a field left out of
/// the JSON, and a float JSON cannot hold when `amount` is 0.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Shown {
    ratio: f64,
    #[serde(skip_serializing, default)]
    note: String,
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_shown")]
async fn shown(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    #[idem(skip)] probe: &Probe,
) -> Result<Shown, TestError> {
    body(tx, &k, amount, probe, Mode::Ok).await?;
    Ok(Shown { ratio: if amount == 0 { f64::NAN } else { amount as f64 }, note: "not stored".into() })
}

/// Runs `$helper` as two tests: the first name without Redis, the second
/// with it.
macro_rules! with_and_without_redis {
    ($(#[$attr:meta])* $without:ident, $with:ident => $helper:ident) => {
        $(#[$attr])*
        async fn $without() {
            $helper(Redis::Off).await;
        }

        $(#[$attr])*
        async fn $with() {
            $helper(Redis::On).await;
        }
    };
}

/// An engine on its own database name (SQLite: its own file), optionally
/// with Redis; `None` when a server is unreachable (the test then passes
/// after printing `skipped: ...`).
async fn engine(name: &str, max_connections: u32, redis: Redis) -> Option<Idem<Db>> {
    let pool = open(name, max_connections).await?;
    prepare(&pool).await;
    let builder = Idem::builder(pool);
    let builder = match redis {
        Redis::Off => builder,
        Redis::On => builder.redis(common::redis_client().await?),
        Redis::DeadPort => builder.redis(redis::Client::open("redis://127.0.0.1:1").unwrap()),
    };
    let idem = builder.build();
    idem.migrate().await.expect("migrate");
    Some(idem)
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Redis {
    Off,
    On,
    DeadPort,
}

/// The Redis key of `(biz, k)` on `idem`: `idem:<namespace>:<biz>:<key>`.
async fn redis_key(idem: &Idem<Db>, biz: &str, k: &str) -> String {
    let namespace = idem.redis_namespace().await.expect("namespace").expect("migrated");
    format!("idem:{namespace}:{biz}:{k}")
}

async fn ledger_rows(idem: &Idem<Db>, k: &str) -> i64 {
    sqlx::query_scalar(COUNT_LEDGER).bind(k).fetch_one(idem.pool()).await.expect("count ledger")
}

fn is_in_progress(r: &Result<Receipt, TestError>) -> bool {
    matches!(r, Err(TestError::Idem(idem::Error::InProgress { .. })))
}

/// `callers` tasks released together by a barrier, spread over `engines`,
/// all paying the same key: the body runs once, everyone gets that result
/// or `InProgress`, and afterwards everyone gets the replay.
async fn storm(engines: Vec<Idem<Db>>, callers: usize) {
    let k = common::unique("storm");
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
    let name = common::unique("db");
    let Some(idem) = engine(&name, 10, redis).await else { return };
    storm(vec![idem], 100).await;
}

async fn storm_two_engines(redis: Redis) {
    let name = common::unique("db");
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

/// A pool of one connection: had the failed call kept it, or given it back
/// inside its transaction, the calls after it could not run (or would
/// commit its write).
async fn failed_body_leaves_nothing(redis: Redis) {
    let Some(idem) = engine(&common::unique("db"), 1, redis).await else { return };
    let probe = Probe::default();
    let k = common::unique("fail");

    let failed = pay(&idem, k.clone(), 7, &probe, Mode::Fail).await;
    assert!(matches!(failed, Err(TestError::Body)), "{failed:?}");
    assert_eq!(ledger_rows(&idem, &k).await, 0, "the business write was rolled back");
    assert_eq!(idem.status("t_pay", &k).await.unwrap(), Status::Absent);

    let again = pay(&idem, k.clone(), 7, &probe, Mode::Ok).await.unwrap();
    assert_eq!(again, Receipt { key: k.clone(), amount: 7, run: 2 });
    assert_eq!(ledger_rows(&idem, &k).await, 1);
    assert_eq!(pay(&idem, k.clone(), 7, &probe, Mode::Ok).await.unwrap(), again);
    assert_eq!(probe.runs(), 2);
}

with_and_without_redis!(
    #[tokio::test]
    failed_body_leaves_nothing_behind,
    failed_body_leaves_nothing_behind_with_redis => failed_body_leaves_nothing
);

/// A pool of one connection, as for a failed body.
async fn panicking_body_leaves_nothing(redis: Redis) {
    let Some(idem) = engine(&common::unique("db"), 1, redis).await else { return };
    let probe = Arc::new(Probe::default());
    let k = common::unique("panic");

    let task = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay(&idem, k, 7, &probe, Mode::Panic).await })
    };
    assert!(task.await.unwrap_err().is_panic());
    assert_eq!(ledger_rows(&idem, &k).await, 0);

    let again = past_the_release(|| pay(&idem, k.clone(), 7, &probe, Mode::Ok)).await.unwrap();
    assert_eq!(again, Receipt { key: k.clone(), amount: 7, run: 2 });
    assert_eq!(ledger_rows(&idem, &k).await, 1);
    assert_eq!(pay(&idem, k.clone(), 7, &probe, Mode::Ok).await.unwrap(), again);
    assert_eq!(probe.runs(), 2);
}

with_and_without_redis!(
    #[tokio::test]
    panicking_body_leaves_nothing_behind,
    panicking_body_leaves_nothing_behind_with_redis => panicking_body_leaves_nothing
);

async fn dropped_call_leaves_nothing(redis: Redis) {
    let name = common::unique("db");
    // One connection: if the dropped call left it inside its transaction,
    // the calls below could not run.
    let Some(idem) = engine(&name, 1, redis).await else { return };
    let Some(observer) = engine(&name, 2, Redis::Off).await else { return };
    let probe = Probe::default();
    let k = common::unique("drop");

    // Dropped inside its body, between statements. (Dropped while a MySQL
    // reply is half read, sqlx may never get the connection back: sqlx#563.)
    tokio::select! {
        cut = pay(&idem, k.clone(), 9, &probe, Mode::HeldThenOk) => panic!("the call finished: {cut:?}"),
        () = until_held(&probe) => {}
    }
    assert_eq!(probe.runs(), 1);
    assert_eq!(ledger_rows(&observer, &k).await, 0);

    let next = past_the_release(|| pay(&idem, k.clone(), 9, &probe, Mode::Ok)).await.unwrap();
    assert_eq!(next, Receipt { key: k.clone(), amount: 9, run: 2 });
    assert_eq!(pay(&idem, k.clone(), 9, &probe, Mode::Ok).await.unwrap(), next);
    assert_eq!(ledger_rows(&observer, &k).await, 1);
    assert_eq!(probe.runs(), 2);
}

with_and_without_redis!(
    #[tokio::test]
    dropped_call_leaves_nothing_behind,
    dropped_call_leaves_nothing_behind_with_redis => dropped_call_leaves_nothing
);

/// Without Redis, a duplicate waits for the first call: in memory when both
/// run on one engine, on the record's unique index when the duplicate runs
/// on another (another instance). Past `lock_wait` it answers `InProgress`
/// while the first call still runs. (SQLite serializes writers instead:
/// another engine's duplicate waits its turn under the busy timeout, then
/// replays.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_waiting_past_the_lock_bound_is_in_progress() {
    let Some(pool) = open(&common::unique("db"), 4).await else { return };
    prepare(&pool).await;
    let idem = Idem::builder(pool.clone()).lock_wait(LOCK_WAIT).build();
    let elsewhere = Idem::builder(pool).lock_wait(LOCK_WAIT).build();
    idem.migrate().await.expect("migrate");
    let probe = Arc::new(Probe::default());
    let k = common::unique("lockwait");

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

/// An `InProgress` that came from the bound: it took the whole `LOCK_WAIT`,
/// not an instant refusal, nor a server default far past it.
fn assert_waited_the_bound(waited: Duration) {
    assert!(waited >= LOCK_WAIT, "answered after {waited:?}, before the {LOCK_WAIT:?} bound");
    assert!(waited < LOCK_WAIT * 3, "answered after {waited:?}, far past the {LOCK_WAIT:?} bound");
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
    if LOCK_WAIT_BOUNDED {
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

/// Without Redis, duplicates on one engine wait for the first call in
/// memory and take its result: they never ask the pool for a connection.
/// The first call holds the pool's only connection at its gate; once every
/// duplicate waits, the pool is closed, so a duplicate that asked for a
/// connection, or asks later, fails with `PoolClosed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_on_one_engine_wait_in_memory_without_a_connection() {
    let Some(opened) = open(&common::unique("db"), 1).await else { return };
    prepare(&opened).await;
    let options = (*opened.connect_options()).clone();
    opened.close().await;
    let pool = sqlx::pool::PoolOptions::<Db>::new().max_connections(1).connect_with(options.clone()).await;
    let idem = Idem::new(pool.expect("pool of one"));
    idem.migrate().await.expect("migrate");
    let observer = sqlx::pool::PoolOptions::<Db>::new().max_connections(1).connect_with(options).await;
    let observer = Idem::new(observer.expect("observer pool"));
    let probe = Arc::new(Probe::default());
    let k = common::unique("inmemory");

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
                counted_once_pending(&waiting, idem::observe(pay(&idem, k, 7, &probe, Mode::Ok))).await
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
        assert_eq!(outcome, Some(idem::Outcome::Replayed));
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

/// The same wait on another engine, when the first call is replacing an
/// expired record: every record statement stays under the bound, not only
/// the first insert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_of_a_call_replacing_an_expired_record_is_bounded_too() {
    let Some(pool) = open(&common::unique("db"), 4).await else { return };
    prepare(&pool).await;
    let idem = Idem::builder(pool.clone()).lock_wait(LOCK_WAIT).build();
    let elsewhere = Idem::builder(pool).lock_wait(LOCK_WAIT).build();
    idem.migrate().await.expect("migrate");
    let probe = Arc::new(Probe::default());
    let k = common::unique("lockwait-expired");
    pay_short_ttl(&idem, k.clone(), &probe, Mode::Ok).await.unwrap();
    until_expired(&idem, "t_ttl", &k).await;

    let first = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay_short_ttl(&idem, k, &probe, Mode::HeldThenOk).await })
    };
    until_started(&probe, 2).await;
    let second = {
        let (elsewhere, k, probe) = (elsewhere.clone(), k.clone(), probe.clone());
        tokio::spawn(timed(async move { pay_short_ttl(&elsewhere, k, &probe, Mode::Ok).await }))
    };
    // (On SQLite the duplicate finds the row live: the 1 s ttl counts from the commit.)
    settle_held_and_elsewhere(&probe, first, second).await;
    assert_eq!(probe.runs(), 2, "the first call and the one after expiry");
    assert_eq!(ledger_rows(&idem, &k).await, 2);
}

/// An engine whose Redis is a private `redis-server` (a test may pause it),
/// connected and its scripts loaded by one call.
async fn engine_on_private_redis(redis_timeout: Duration) -> Option<(common::servers::RedisServer, Idem<Db>)> {
    let server = common::servers::RedisServer::start()?;
    let pool = open(&common::unique("db"), 4).await?;
    prepare(&pool).await;
    let idem = Idem::builder(pool).redis(server.client()).redis_timeout(redis_timeout).build();
    idem.migrate().await.expect("migrate");
    pay(&idem, common::unique("warm"), 1, &Probe::default(), Mode::Ok).await.unwrap();
    Some((server, idem))
}

/// Regression: when Redis answers too late, the claim script may still have
/// run; that claim is released so retries do not wait out the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_whose_answer_came_too_late_is_released() {
    let Some((server, idem)) = engine_on_private_redis(Duration::from_millis(100)).await else { return };
    let probe = Probe::default();

    // Redis holds commands for 1.5 s: our claim waits in its queue, times
    // out on our side, then runs.
    common::redis_pause(&server.client(), 1_500).await;
    let k = common::unique("late");
    let started = std::time::Instant::now();
    let failed = pay(&idem, k.clone(), 2, &probe, Mode::Fail).await;
    assert!(matches!(failed, Err(TestError::Body)), "{failed:?}");
    assert!(started.elapsed() >= Duration::from_millis(100), "the claim timed out (the pause held it)");

    // The release follows within a few Redis timeouts; the lease is 30 s.
    let left = common::redis_value_after(&server.client(), &redis_key(&idem, "t_pay", &k).await, Duration::from_secs(15)).await;
    assert_eq!(left, None, "the late claim was released");
}

/// Regression: a call dropped while its claim is on the way to Redis (its
/// client gave up) may still have claimed the key; that claim is released
/// rather than left for the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_of_a_call_dropped_while_redis_is_slow_is_released() {
    let Some((server, idem)) = engine_on_private_redis(Duration::from_secs(2)).await else { return };
    let probe = Probe::default();

    common::redis_pause(&server.client(), 600).await;
    let k = common::unique("dropped");
    let dropped = tokio::time::timeout(Duration::from_millis(100), pay(&idem, k.clone(), 2, &probe, Mode::Ok)).await;
    assert!(dropped.is_err(), "the call was still waiting for Redis: {dropped:?}");
    assert_eq!(probe.runs(), 0, "its body never started");

    // After the pause the claim lands; it is gone well before its 30 s lease.
    let left = common::redis_value_after(&server.client(), &redis_key(&idem, "t_pay", &k).await, Duration::from_secs(15)).await;
    assert_eq!(left, None, "the dropped call's claim was released");
    let (again, outcome) = idem::observe(pay(&idem, k.clone(), 2, &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap().run, outcome), (1, Some(idem::Outcome::Executed)));
}

/// Regression: a failed body's release that meets the Redis back-off (another
/// call's Redis operation just timed out) is retried, not skipped: the
/// claim would otherwise answer `InProgress` to every retry for the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_during_the_redis_back_off_is_retried() {
    let Some((server, idem)) = engine_on_private_redis(Duration::from_millis(200)).await else { return };
    let probe = Arc::new(Probe::default());

    let k = common::unique("backoff");
    let held = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay(&idem, k, 2, &probe, Mode::HeldThenFail).await })
    };
    until_started(&probe, 1).await; // it holds its claim
    // Another Redis operation times out (a status query: it needs no write
    // lock, which SQLite's held transaction keeps): Redis is left alone for
    // the next second.
    common::redis_pause(&server.client(), 1_500).await;
    let started = std::time::Instant::now();
    let status = idem.status("t_pay", &common::unique("other")).await.unwrap();
    assert_eq!(status, Status::Absent);
    assert!(started.elapsed() >= Duration::from_millis(200), "the status query timed out (the pause held it)");
    // The held body fails inside that second; its release meets the back-off.
    probe.open();
    assert!(matches!(held.await.unwrap(), Err(TestError::Body)));

    let left = common::redis_value_after(&server.client(), &redis_key(&idem, "t_pay", &k).await, Duration::from_secs(15)).await;
    assert_eq!(left, None, "the failed call's claim was released");
}

/// Regression: with a claim the record goes in last, so when Redis lost a
/// finished call's cached result, a duplicate runs its body; if that body
/// fails on what the first call left (an order already paid), the caller
/// still gets the first result, not the body's error.
#[tokio::test]
async fn duplicate_whose_body_fails_after_redis_lost_the_result_replays() {
    let Some(idem) = engine(&common::unique("db"), 4, Redis::On).await else { return };
    let Some(client) = common::redis_client().await else { return };
    let probe = Probe::default();
    let k = common::unique("lost");
    let first = pay(&idem, k.clone(), 5, &probe, Mode::Ok).await.unwrap();
    common::redis_del(&client, &redis_key(&idem, "t_pay", &k).await).await; // evicted, flushed, restarted

    let (again, outcome) = idem::observe(pay(&idem, k.clone(), 5, &probe, Mode::Fail)).await;
    assert_eq!((again.unwrap(), outcome), (first, Some(idem::Outcome::Replayed)));
    common::redis_del(&client, &redis_key(&idem, "t_pay", &k).await).await;
    let reused = pay(&idem, k.clone(), 6, &probe, Mode::Fail).await;
    assert!(matches!(reused, Err(TestError::Idem(idem::Error::KeyReused { .. }))), "{reused:?}");
    assert_eq!(probe.runs(), 3, "both duplicates ran their bodies, which failed");
    assert_eq!(ledger_rows(&idem, &k).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_after_the_lease_still_commits_once() {
    let Some(idem) = engine(&common::unique("db"), 4, Redis::On).await else { return };
    let Some(client) = common::redis_client().await else { return };
    let probe = Arc::new(Probe::default());
    let k = common::unique("lease");

    let first = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay_short_lease(&idem, k, &probe, Mode::HeldThenOk).await })
    };
    until_started(&probe, 1).await;
    // Its 100 ms lease runs out while its body is held.
    let claim = common::redis_value_after(&client, &redis_key(&idem, "t_lease", &k).await, Duration::from_secs(10)).await;
    assert_eq!(claim, None, "the lease ran out");
    assert!(!first.is_finished());

    let second = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { idem::observe(pay_short_lease(&idem, k, &probe, Mode::Ok)).await })
    };
    // Bounded: a duplicate blocked behind the held body must fail, not hang.
    let second = async { tokio::time::timeout(Duration::from_secs(30), second).await.expect("the duplicate hung") };
    let (first, second) = if ONE_WRITER {
        // SQLite: the duplicate waits for the write lock, so the first commits
        // first and the duplicate's record meets it.
        probe.open();
        let first = first.await.unwrap().unwrap();
        let (second, outcome) = second.await.unwrap();
        assert_eq!((first.run, outcome), (1, Some(idem::Outcome::Replayed)));
        (first, second.unwrap())
    } else {
        // The duplicate claims the key, runs its body and commits; the first,
        // let go, meets that record at its own insert, rolls back and replays.
        let (second, outcome) = second.await.unwrap();
        assert_eq!(outcome, Some(idem::Outcome::Executed));
        probe.open();
        (first.await.unwrap().unwrap(), second.unwrap())
    };
    assert_eq!(first, second, "both callers got the committed result");
    assert_eq!(probe.runs(), 2, "both bodies ran");
    assert_eq!(ledger_rows(&idem, &k).await, 1, "one committed business write");
    assert_eq!(pay_short_lease(&idem, k.clone(), &probe, Mode::Ok).await.unwrap(), first);
    assert_eq!(probe.runs(), 2);
}

/// Regression: a call that committed but died before its cache write leaves
/// its claim in Redis until the lease ends; duplicates must replay from the
/// record meanwhile, not answer `InProgress`.
#[tokio::test]
async fn claim_left_by_a_call_that_died_after_commit_replays_from_the_record() {
    let Some(idem) = engine(&common::unique("db"), 4, Redis::On).await else { return };
    let Some(client) = common::redis_client().await else { return };
    let probe = Probe::default();
    let k = common::unique("orphan");
    let first = pay(&idem, k.clone(), 8, &probe, Mode::Ok).await.unwrap();
    // Our own cache write lands first; then the key is made to look like a
    // claim whose owner died after its commit.
    let key = redis_key(&idem, "t_pay", &k).await;
    common::redis_cached_response(&client, &key).await;
    common::redis_set(&client, &key, "p:dead-token:0", 60_000).await;

    let (again, outcome) = idem::observe(pay(&idem, k.clone(), 8, &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap(), outcome), (first, Some(idem::Outcome::Replayed)));
    let reused = pay(&idem, k.clone(), 9, &probe, Mode::Ok).await;
    assert!(matches!(reused, Err(TestError::Idem(idem::Error::KeyReused { .. }))), "{reused:?}");
    assert_eq!(probe.runs(), 1);
}

async fn unreachable_database_is_a_storage_error(redis: Redis) {
    let mut builder = Idem::builder(dead_pool());
    let client = match redis {
        Redis::On => {
            let Some(client) = common::redis_client().await else { return };
            builder = builder.redis(client.clone());
            Some(client)
        }
        _ => None,
    };
    // The namespace is set: the database that would hold one is down.
    let namespace = idem::Namespace::new(&common::unique("nodb")).unwrap();
    let idem = builder.redis_namespace(namespace).build();
    let probe = Probe::default();
    let k = common::unique("nodb");
    let r = pay(&idem, k.clone(), 1, &probe, Mode::Ok).await;
    assert!(matches!(r, Err(TestError::Idem(idem::Error::Storage(_)))), "{r:?}");
    assert_eq!(probe.runs(), 0, "no body without a transaction");
    if let Some(client) = client {
        // The claim taken before the database failed was released.
        assert!(!common::redis_exists(&client, &redis_key(&idem, "t_pay", &k).await).await);
    }
}

with_and_without_redis!(
    #[tokio::test]
    unreachable_database_is_a_storage_error_and_runs_nothing,
    unreachable_database_is_a_storage_error_and_runs_nothing_with_redis => unreachable_database_is_a_storage_error
);

async fn key_reuse_is_refused(redis: Redis) {
    let Some(idem) = engine(&common::unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = common::unique("reuse");
    pay(&idem, k.clone(), 100, &probe, Mode::Ok).await.unwrap();
    let reused = pay(&idem, k.clone(), 101, &probe, Mode::Ok).await;
    assert!(matches!(reused, Err(TestError::Idem(idem::Error::KeyReused { .. }))), "{reused:?}");
    assert_eq!(ledger_rows(&idem, &k).await, 1);
    assert_eq!(probe.runs(), 1);
}

with_and_without_redis!(
    #[tokio::test]
    same_key_other_arguments_is_key_reused,
    same_key_other_arguments_is_key_reused_with_redis => key_reuse_is_refused
);

#[tokio::test]
async fn hashmap_arguments_fingerprint_the_same_in_any_order() {
    let Some(idem) = engine(&common::unique("db"), 4, Redis::Off).await else { return };
    let probe = Probe::default();
    let k = common::unique("cart");
    let pairs: Vec<(String, i64)> = (0..40).map(|i| (format!("sku{i}"), i)).collect();
    let forward: HashMap<String, i64> = pairs.iter().cloned().collect();
    let backward: HashMap<String, i64> = pairs.iter().rev().cloned().collect();
    let nested = |n: usize| vec![(0..n).map(|i| (format!("f{i}"), format!("v{i}"))).collect::<HashMap<_, _>>()];
    let first = checkout(&idem, k.clone(), Cart { items: forward, nested: nested(20) }, &probe).await.unwrap();
    let second = checkout(&idem, k.clone(), Cart { items: backward, nested: nested(20) }, &probe).await.unwrap();
    assert_eq!((first, second, probe.runs()), (1, 1, 1));
    let mut changed: HashMap<String, i64> = pairs.iter().cloned().collect();
    changed.insert("sku0".into(), 99);
    let reused = checkout(&idem, k.clone(), Cart { items: changed, nested: nested(20) }, &probe).await;
    assert!(matches!(reused, Err(TestError::Idem(idem::Error::KeyReused { .. }))), "{reused:?}");
}

/// Hostile keys, each rendered through `bad_<k>`: every one must be refused
/// with `InvalidKey` before any Redis or database write.
/// Hostile values of `k` in the key template `bad_<k>`, each with the
/// refusal it must get (offsets count the `bad_` prefix).
fn hostile_keys() -> Vec<(&'static str, String, idem::KeyError)> {
    use idem::KeyError::{BadChar, TooLong};
    let bad = |ch: char, in_k: usize| BadChar { ch, at: "bad_".len() + in_k };
    vec![
        ("256 bytes", "k".repeat(252), TooLong { len: 256, max: 255 }),
        ("10k bytes", "k".repeat(10_000), TooLong { len: 10_004, max: 255 }),
        ("space", "with space".into(), bad(' ', 4)),
        ("only spaces", "   ".into(), bad(' ', 0)),
        ("tab", "a\tb".into(), bad('\t', 1)),
        ("newline", "new\nline".into(), bad('\n', 3)),
        ("carriage return", "a\rb".into(), bad('\r', 1)),
        ("redis CRLF injection", "x\r\nSET pwned 1\r\n".into(), bad('\r', 1)),
        ("NUL", "nul\0".into(), bad('\0', 3)),
        ("escape", "a\u{1b}[31m".into(), bad('\u{1b}', 1)),
        ("DEL", "a\u{7f}".into(), bad('\u{7f}', 1)),
        ("glob *", "star*".into(), bad('*', 4)),
        ("glob ?", "what?".into(), bad('?', 4)),
        ("glob []", "[ab]".into(), bad('[', 0)),
        ("hash tag {}", "{brace}".into(), bad('{', 0)),
        ("single quote", "o'brien".into(), bad('\'', 1)),
        ("double quote", "say\"hi\"".into(), bad('"', 3)),
        ("sql comment", "a;--".into(), bad(';', 1)),
        ("sql injection", "1' OR '1'='1".into(), bad('\'', 1)),
        ("backslash", "a\\b".into(), bad('\\', 1)),
        ("percent", "100%".into(), bad('%', 3)),
        ("slash", "a/b".into(), bad('/', 1)),
        ("hash", "a#b".into(), bad('#', 1)),
        ("at", "a@b".into(), bad('@', 1)),
        ("plus", "a+b".into(), bad('+', 1)),
        ("comma", "a,b".into(), bad(',', 1)),
        ("equals", "a=b".into(), bad('=', 1)),
        ("latin accent", "caf\u{e9}".into(), bad('\u{e9}', 3)),
        ("cyrillic lookalike a", "b\u{430}d".into(), bad('\u{430}', 1)),
        ("fullwidth k", "\u{ff4b}ey".into(), bad('\u{ff4b}', 0)),
        ("zero-width space", "a\u{200b}b".into(), bad('\u{200b}', 1)),
        ("right-to-left override", "a\u{202e}b".into(), bad('\u{202e}', 1)),
        ("combining accent", "e\u{301}".into(), bad('\u{301}', 1)),
        ("emoji", "pay\u{1f4b8}".into(), bad('\u{1f4b8}', 3)),
    ]
}

/// Whether `r` is exactly the refusal `expected`.
fn refused_with<T: std::fmt::Debug>(r: &Result<T, TestError>, expected: &idem::KeyError) -> bool {
    matches!(r, Err(TestError::Idem(idem::Error::InvalidKey(e))) if e == expected)
}

#[tokio::test]
async fn hostile_keys_are_refused_before_any_write() {
    let Some(idem) = engine(&common::unique("db"), 4, Redis::On).await else { return };
    // The same engine over servers that never answer: a refusal that touched
    // either would come out as `Storage` instead.
    let unreachable = Idem::builder(dead_pool()).redis(redis::Client::open("redis://127.0.0.1:1").unwrap()).build();
    let probe = Probe::default();
    let hostile = hostile_keys();
    assert!(hostile.len() >= 30);
    for (what, k, expected) in &hostile {
        for engine in [&idem, &unreachable] {
            let r = with_bad_key(engine, k.clone(), &probe).await;
            assert!(refused_with(&r, expected), "{what}: {r:?}, expected {expected:?}");
        }
    }
    for engine in [&idem, &unreachable] {
        let empty = with_empty_key(engine, String::new(), &probe).await;
        assert!(refused_with(&empty, &idem::KeyError::Missing), "{empty:?}");
    }
    assert_eq!(probe.runs(), 0, "no body ran");
    // (Some keys cannot even be looked up: MySQL's key column is ASCII, and
    // PostgreSQL text refuses NUL. The engine never sends them.)
    for (_, k, _) in hostile.iter().filter(|(_, k, _)| k.is_ascii() && !k.contains('\0')) {
        assert_eq!(record_rows_for(&idem, "t_badkey", &format!("bad_{k}")).await, 0);
        assert_eq!(ledger_rows(&idem, k).await, 0);
    }
    assert_eq!(record_rows_for(&idem, "t_bad_empty", "").await, 0);
    if let Some(client) = common::redis_client().await {
        for (what, k, _) in &hostile {
            assert!(!common::redis_exists(&client, &redis_key(&idem, "t_badkey", &format!("bad_{k}")).await).await, "{what}");
        }
        assert!(!common::redis_exists(&client, &redis_key(&idem, "t_bad_empty", "").await).await);
        assert!(!common::redis_exists(&client, "pwned").await, "no command was injected");
    }
}

/// The shortest key, one byte, end to end.
#[idempotent(key = "<k>", ttl = "1h", biz = "t_one")]
async fn with_one_byte_key(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    #[idem(skip)] probe: &Probe,
) -> Result<usize, TestError> {
    body(tx, "t_one", 1, probe, Mode::Ok).await
}

#[tokio::test]
async fn one_byte_key_works_end_to_end() {
    // A private Redis: the one key is not shared with the other backends' runs.
    let Some((_server, idem)) = engine_on_private_redis(Duration::from_millis(500)).await else { return };
    // The database may be shared with earlier runs: start from nothing.
    sqlx::query(DELETE_RECORD).bind("t_one").bind("x").execute(idem.pool()).await.expect("delete");
    let probe = Probe::default();
    let (first, outcome) = idem::observe(with_one_byte_key(&idem, "x".into(), &probe)).await;
    assert_eq!((first.unwrap(), outcome), (1, Some(idem::Outcome::Executed)));
    let (again, outcome) = idem::observe(with_one_byte_key(&idem, "x".into(), &probe)).await;
    assert_eq!((again.unwrap(), outcome), (1, Some(idem::Outcome::Replayed)));
    assert_eq!(record_rows_for(&idem, "t_one", "x").await, 1);
    assert_eq!(probe.runs(), 1);
}

#[tokio::test]
async fn edge_keys_that_obey_the_rule_work() {
    let Some(idem) = engine(&common::unique("db"), 4, Redis::On).await else { return };
    let probe = Probe::default();
    let unique = common::unique("edge").replace('-', "_");
    let longest = format!("{unique}{}", "k".repeat(251 - unique.len())); // "bad_" + 251 = 255 bytes
    for k in [longest, format!("{unique}.a:b-c_D"), format!("{unique}_")] {
        let first = with_long_key(&idem, k.clone(), &probe).await.unwrap();
        assert_eq!(with_long_key(&idem, k.clone(), &probe).await.unwrap(), first, "replayed");
        assert_eq!(record_rows_for(&idem, "t_longkey", &format!("bad_{k}")).await, 1);
    }
    assert_eq!(probe.runs(), 3);
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_echo")]
async fn echo(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    note: String,
    #[idem(skip)] probe: &Probe,
) -> Result<String, TestError> {
    body(tx, &k, 1, probe, Mode::Ok).await?;
    Ok(note)
}

#[tokio::test]
async fn hostile_arguments_are_stored_and_replayed_byte_for_byte() {
    let name = common::unique("db");
    let Some(idem) = engine(&name, 4, Redis::On).await else { return };
    let Some(plain) = engine(&name, 4, Redis::Off).await else { return };
    let Some(client) = common::redis_client().await else { return };
    let probe = Probe::default();
    let notes = [
        "'; DROP TABLE idem_record; --".to_string(),
        "\"quoted\" \\ back\\slash".to_string(),
        "nul \0 inside".to_string(),
        "crlf \r\nSET pwned 1\r\n".to_string(),
        "unicode caf\u{e9} \u{1f4b8} \u{202e}rtl".to_string(),
        "x".repeat(100_000),
    ];
    for note in &notes {
        let k = common::unique("echo");
        assert_eq!(&echo(&idem, k.clone(), note.clone(), &probe).await.unwrap(), note);
        let cached = common::redis_cached_response(&client, &redis_key(&idem, "t_echo", &k).await).await;
        assert_eq!(cached, serde_json::to_string(note).unwrap(), "cached byte for byte");
        assert_eq!(&echo(&idem, k.clone(), note.clone(), &probe).await.unwrap(), note, "replayed from Redis");
        assert_eq!(&echo(&plain, k.clone(), note.clone(), &probe).await.unwrap(), note, "replayed from the record");
        let Status::Completed { response } = idem.status("t_echo", &k).await.unwrap() else { panic!("not stored") };
        assert_eq!(response, serde_json::to_string(note).unwrap());
        // Executed without Redis (the record goes in first, completed with its response).
        let k = common::unique("echo-plain");
        assert_eq!(&echo(&plain, k.clone(), note.clone(), &probe).await.unwrap(), note);
        assert_eq!(&echo(&plain, k.clone(), note.clone(), &probe).await.unwrap(), note, "replayed from the record");
        assert_eq!(ledger_rows(&plain, &k).await, 1);
        assert_eq!(record_rows_for(&plain, "t_echo", &k).await, 1);
    }
    assert_eq!(probe.runs(), 2 * notes.len());
    assert!(!common::redis_exists(&client, "pwned").await, "no command was injected");
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_bizno", biz_no = "<no>")]
async fn with_biz_no(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    no: String,
    #[idem(skip)] probe: &Probe,
) -> Result<usize, TestError> {
    body(tx, &k, 1, probe, Mode::Ok).await
}

/// `biz_no` is free text: whatever it holds lands in its column unchanged,
/// with Redis (record inserted last) and without (record completed last).
#[tokio::test]
async fn biz_no_is_stored_exactly() {
    let name = common::unique("db");
    let Some(claimed) = engine(&name, 4, Redis::On).await else { return };
    let Some(plain) = engine(&name, 4, Redis::Off).await else { return };
    let probe = Probe::default();
    let numbers = ["o'1", "back\\slash \\' \"", "caf\u{e9} \u{1f4b8}", "", "--; DROP TABLE idem_record"];
    for idem in [&claimed, &plain] {
        for no in numbers {
            let k = common::unique("bizno");
            with_biz_no(idem, k.clone(), no.to_owned(), &probe).await.unwrap();
            let stored: Option<String> =
                sqlx::query_scalar(BIZ_NO).bind("t_bizno").bind(&k).fetch_one(idem.pool()).await.unwrap();
            assert_eq!(stored.as_deref(), Some(no));
        }
    }
    assert_eq!(probe.runs(), 2 * numbers.len());
}

/// A `biz_no` past its 64-byte column is refused before anything is written,
/// with and without Redis: over servers that never answer the refusal is the
/// same, so nothing was sent. 64 bytes fit.
#[tokio::test]
async fn biz_no_longer_than_64_bytes_is_refused_before_any_write() {
    let name = common::unique("db");
    let Some(claimed) = engine(&name, 4, Redis::On).await else { return };
    let Some(plain) = engine(&name, 4, Redis::Off).await else { return };
    let unreachable = Idem::builder(dead_pool()).redis(redis::Client::open("redis://127.0.0.1:1").unwrap()).build();
    let probe = Probe::default();
    for (idem, reachable) in [(&claimed, true), (&plain, true), (&unreachable, false)] {
        let k = common::unique("bizno-long");
        let refused = with_biz_no(idem, k.clone(), "n".repeat(65), &probe).await;
        let too_long = matches!(refused, Err(TestError::Idem(idem::Error::BizNoTooLong { len: 65, max: 64 })));
        assert!(too_long, "{refused:?}");
        if !reachable {
            continue;
        }
        assert_eq!(record_rows_for(idem, "t_bizno", &k).await, 0);
        assert_eq!(ledger_rows(idem, &k).await, 0);
        assert_eq!(idem.status("t_bizno", &k).await.unwrap(), Status::Absent, "no record, no claim");
    }
    assert_eq!(probe.runs(), 0, "no body ran");

    let k = common::unique("bizno-64");
    assert_eq!(with_biz_no(&plain, k.clone(), "n".repeat(64), &probe).await.unwrap(), 1);
    let stored: Option<String> =
        sqlx::query_scalar(BIZ_NO).bind("t_bizno").bind(&k).fetch_one(plain.pool()).await.unwrap();
    assert_eq!(stored, Some("n".repeat(64)));
}

/// Keys compare byte for byte: `Order-1` and `order-1` are two keys, each
/// executed and recorded (MySQL's key columns are `ascii_bin`: its default
/// collations ignore case and would merge them).
async fn keys_differing_in_case_are_two_keys(redis: Redis) {
    let Some(idem) = engine(&common::unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let upper = common::unique("Order");
    let lower = upper.to_lowercase();
    assert_ne!(upper, lower);
    let first = pay(&idem, upper.clone(), 5, &probe, Mode::Ok).await.unwrap();
    let second = pay(&idem, lower.clone(), 5, &probe, Mode::Ok).await.unwrap();
    assert_eq!(first, Receipt { key: upper.clone(), amount: 5, run: 1 });
    assert_eq!(second, Receipt { key: lower.clone(), amount: 5, run: 2 });
    assert_eq!(pay(&idem, upper.clone(), 5, &probe, Mode::Ok).await.unwrap(), first);
    assert_eq!(pay(&idem, lower.clone(), 5, &probe, Mode::Ok).await.unwrap(), second);
    assert_eq!(probe.runs(), 2);
    for (k, receipt) in [(&upper, &first), (&lower, &second)] {
        assert_eq!(record_rows_for(&idem, "t_pay", k).await, 1, "{k}");
        let status = idem.status("t_pay", k).await.unwrap();
        assert_eq!(status, Status::Completed { response: serde_json::to_string(receipt).unwrap() });
    }
}

with_and_without_redis!(
    #[tokio::test]
    keys_differing_only_in_case_are_two_keys,
    keys_differing_only_in_case_are_two_keys_with_redis => keys_differing_in_case_are_two_keys
);

/// Every `(biz_type, idem_key)` in `idem_record`, sorted.
async fn all_records(pool: &sqlx::Pool<Db>) -> Vec<(String, String)> {
    let mut rows: Vec<(String, String)> =
        sqlx::query_as("SELECT biz_type, idem_key FROM idem_record").fetch_all(pool).await.expect("records");
    rows.sort();
    rows
}

/// `purge_expired(limit)` deletes expired records only, at most `limit` per
/// call. On a database of its own: it deletes whatever has expired.
#[tokio::test]
async fn purge_expired_deletes_expired_records_in_batches() {
    let name = common::unique("purge").replace('-', "_");
    let Some(pool) = open_private(&name).await else { return };
    prepare(&pool).await;
    let idem = Idem::new(pool.clone());
    idem.migrate().await.expect("migrate");
    let probe = Probe::default();
    let expired: Vec<String> = (0..5).map(|i| format!("gone-{i}")).collect();
    let live: Vec<(String, String)> = (0..3).map(|i| ("t_pay".to_owned(), format!("kept-{i}"))).collect();
    for k in &expired {
        pay_short_ttl(&idem, k.clone(), &probe, Mode::Ok).await.unwrap();
    }
    let mut receipts = Vec::new();
    for (_, k) in &live {
        receipts.push(pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap());
    }
    for k in &expired {
        until_expired(&idem, "t_ttl", k).await;
    }
    assert_eq!(all_records(&pool).await.len(), 8);

    assert_eq!(idem.purge_expired(3).await.unwrap(), 3);
    let left = all_records(&pool).await;
    let (left_live, left_expired): (Vec<_>, Vec<_>) = left.into_iter().partition(|(biz, _)| biz == "t_pay");
    assert_eq!(left_live, live, "every live record stays");
    assert_eq!(left_expired.len(), 2, "{left_expired:?}");
    assert!(left_expired.iter().all(|(biz, k)| biz == "t_ttl" && expired.contains(k)), "{left_expired:?}");

    assert_eq!(idem.purge_expired(10).await.unwrap(), 2, "the rest");
    assert_eq!(all_records(&pool).await, live);
    assert_eq!(idem.purge_expired(10).await.unwrap(), 0);
    for k in &expired {
        assert_eq!(idem.status("t_ttl", k).await.unwrap(), Status::Absent, "{k} was purged");
    }
    for ((_, k), receipt) in live.iter().zip(&receipts) {
        assert_eq!(&pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap(), receipt, "{k} still replays");
    }
    assert_eq!(probe.runs(), 8);
    drop(idem);
    drop_private(pool, &name).await;
}

async fn falsy_values_replay_exactly(redis: Redis) {
    let Some(idem) = engine(&common::unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = common::unique("falsy");
    for _ in 0..3 {
        assert_eq!(zero(&idem, k.clone(), &probe).await.unwrap(), 0);
        assert_eq!(empty_string(&idem, k.clone(), &probe).await.unwrap(), "");
        assert_eq!(empty_vec(&idem, k.clone(), &probe).await.unwrap(), Vec::<i32>::new());
        unit(&idem, k.clone(), &probe).await.unwrap();
        assert_eq!(none(&idem, k.clone(), &probe).await.unwrap(), None);
        assert!(!falsy_false(&idem, k.clone(), &probe).await.unwrap());
    }
    assert_eq!(probe.runs(), 6, "each fn ran once, then replayed twice");
    let stored = |biz: &'static str| {
        let idem = idem.clone();
        let k = k.clone();
        async move { idem.status(biz, &k).await.unwrap() }
    };
    assert_eq!(stored("t_falsy_zero").await, Status::Completed { response: "0".into() });
    assert_eq!(stored("t_falsy_str").await, Status::Completed { response: "\"\"".into() });
    assert_eq!(stored("t_falsy_vec").await, Status::Completed { response: "[]".into() });
    assert_eq!(stored("t_falsy_unit").await, Status::Completed { response: "null".into() });
    assert_eq!(stored("t_falsy_none").await, Status::Completed { response: "null".into() });
    assert_eq!(stored("t_falsy_bool").await, Status::Completed { response: "false".into() });
}

with_and_without_redis!(
    #[tokio::test]
    falsy_values_replay_exactly_them,
    falsy_values_replay_exactly_them_with_redis => falsy_values_replay_exactly
);

/// The first caller gets the result as its duplicates will (read back from
/// its stored form), and a result that could not replay commits nothing.
async fn first_result_is_the_replayed_one(redis: Redis) {
    let Some(idem) = engine(&common::unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = common::unique("shown");
    let first = shown(&idem, k.clone(), 3, &probe).await.unwrap();
    assert_eq!(first, Shown { ratio: 3.0, note: String::new() }, "the skipped field is left out for everyone");
    assert_eq!(shown(&idem, k.clone(), 3, &probe).await.unwrap(), first);

    let nan = common::unique("nan");
    for attempt in 1..=2 {
        let refused = shown(&idem, nan.clone(), 0, &probe).await;
        assert!(matches!(refused, Err(TestError::Idem(idem::Error::Serialize(_)))), "attempt {attempt}: {refused:?}");
    }
    assert_eq!(probe.runs(), 3, "one execution, then two that could not be stored");
    assert_eq!(ledger_rows(&idem, &nan).await, 0, "nothing of theirs committed");
    assert_eq!(record_rows_for(&idem, "t_shown", &nan).await, 0);
}

with_and_without_redis!(
    #[tokio::test]
    first_result_is_the_replayed_one_without_redis,
    first_result_is_the_replayed_one_with_redis => first_result_is_the_replayed_one
);

async fn expired_record_executes_again(redis: Redis) {
    let Some(idem) = engine(&common::unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = common::unique("ttl");
    let first = pay_short_ttl(&idem, k.clone(), &probe, Mode::Ok).await.unwrap();
    assert_eq!(pay_short_ttl(&idem, k.clone(), &probe, Mode::Ok).await.unwrap(), first);
    until_expired(&idem, "t_ttl", &k).await;
    let second = pay_short_ttl(&idem, k.clone(), &probe, Mode::Ok).await.unwrap();
    assert_eq!(second.run, 2, "executed again after expiry");
    assert_eq!(pay_short_ttl(&idem, k.clone(), &probe, Mode::Ok).await.unwrap(), second);
    assert_eq!(ledger_rows(&idem, &k).await, 2);
    assert_eq!(record_rows_for(&idem, "t_ttl", &k).await, 1, "the expired row was replaced");
}

async fn record_rows_for(idem: &Idem<Db>, biz: &str, k: &str) -> i64 {
    sqlx::query_scalar(COUNT_RECORDS_KEY).bind(biz).bind(k).fetch_one(idem.pool()).await.expect("count")
}

with_and_without_redis!(
    #[tokio::test]
    expired_record_lets_the_next_call_execute,
    expired_record_lets_the_next_call_execute_with_redis => expired_record_executes_again
);

#[tokio::test]
async fn corrupted_stored_response_is_a_replay_error() {
    let Some(idem) = engine(&common::unique("db"), 4, Redis::Off).await else { return };
    let probe = Probe::default();
    let k = common::unique("corrupt");
    pay(&idem, k.clone(), 5, &probe, Mode::Ok).await.unwrap();
    sqlx::query(CORRUPT).bind("{\"key\": 42").bind("t_pay").bind(&k).execute(idem.pool()).await.unwrap();
    let r = pay(&idem, k.clone(), 5, &probe, Mode::Ok).await;
    match r {
        Err(TestError::Idem(idem::Error::Replay { biz, key, .. })) => assert_eq!((biz, key), ("t_pay", k.clone())),
        other => panic!("{other:?}"),
    }
    assert_eq!(probe.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_each_stage() {
    let Some(idem) = engine(&common::unique("db"), 4, Redis::On).await else { return };
    let probe = Arc::new(Probe::default());
    let k = common::unique("status");
    assert_eq!(idem.status("t_pay", &k).await.unwrap(), Status::Absent);
    let running = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay(&idem, k, 3, &probe, Mode::HeldThenOk).await })
    };
    until_started(&probe, 1).await;
    assert_eq!(idem.status("t_pay", &k).await.unwrap(), Status::InProgress);
    probe.open();
    let receipt = running.await.unwrap().unwrap();
    let status = idem.status("t_pay", &k).await.unwrap();
    assert_eq!(status.response::<Receipt>().unwrap().unwrap(), receipt);
    assert!(matches!(idem.status("t_pay", "no such key").await, Err(idem::Error::InvalidKey(_))));
    // `biz` obeys the attribute's rule: with a `:` it could read another pair's claim.
    for biz in ["t:pay", "T_pay", ""] {
        let refused = idem.status(biz, &k).await;
        assert!(matches!(refused, Err(idem::Error::InvalidBiz)), "{biz:?}: {refused:?}");
    }
}

// ---- Redis entries belong to one record store; cached results never outlive their record ----

/// An engine with the shared Redis over a database of its own.
async fn engine_on_private_database(name: &str) -> Option<(sqlx::Pool<Db>, Idem<Db>)> {
    let client = common::redis_client().await?;
    let pool = open_private(name).await?;
    prepare(&pool).await;
    let idem = Idem::builder(pool.clone()).redis(client).build();
    idem.migrate().await.expect("migrate");
    Some((pool, idem))
}

/// Regression: two databases (two tenants, or staging and production)
/// sharing one Redis never answer each other's calls: each runs its own
/// body, keeps its own record, and sees its own key reuse only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn databases_sharing_a_redis_never_replay_each_others_results() {
    let (name_a, name_b) = (common::unique("tenant_a").replace('-', "_"), common::unique("tenant_b").replace('-', "_"));
    let Some((pool_a, a)) = engine_on_private_database(&name_a).await else { return };
    let Some((pool_b, b)) = engine_on_private_database(&name_b).await else { return };
    let Some(client) = common::redis_client().await else { return };
    let (ns_a, ns_b) = (a.redis_namespace().await.unwrap().unwrap(), b.redis_namespace().await.unwrap().unwrap());
    assert_ne!(ns_a, ns_b, "each database made its own namespace");
    let (probe_a, probe_b) = (Probe::default(), Probe::default());
    let k = common::unique("order_1");

    let paid_a = pay(&a, k.clone(), 5, &probe_a, Mode::Ok).await.unwrap();
    // A's result is cached: under a shared key layout B would now replay it.
    common::redis_cached_response(&client, &redis_key(&a, "t_pay", &k).await).await;

    let (paid_b, outcome) = idem::observe(pay(&b, k.clone(), 5, &probe_b, Mode::Ok)).await;
    assert_eq!(outcome, Some(idem::Outcome::Executed), "B ran its own body");
    let paid_b = paid_b.unwrap();
    assert_eq!((paid_a.run, paid_b.run, probe_a.runs(), probe_b.runs()), (1, 1, 1, 1));
    assert_eq!((ledger_rows(&a, &k).await, ledger_rows(&b, &k).await), (1, 1));
    assert_eq!((record_rows_for(&a, "t_pay", &k).await, record_rows_for(&b, "t_pay", &k).await), (1, 1));
    assert!(matches!(b.status("t_pay", &k).await.unwrap(), Status::Completed { .. }));

    // Another amount: `KeyReused` on each side, for the key each used.
    let other = common::unique("order_2");
    pay(&a, other.clone(), 5, &probe_a, Mode::Ok).await.unwrap();
    common::redis_cached_response(&client, &redis_key(&a, "t_pay", &other).await).await;
    let (fresh, outcome) = idem::observe(pay(&b, other.clone(), 6, &probe_b, Mode::Ok)).await;
    assert_eq!((fresh.unwrap().amount, outcome), (6, Some(idem::Outcome::Executed)), "B never used the key");
    let reused = pay(&b, k.clone(), 6, &probe_b, Mode::Ok).await;
    assert!(matches!(reused, Err(TestError::Idem(idem::Error::KeyReused { .. }))), "{reused:?}");
    assert_eq!(pay(&a, k.clone(), 5, &probe_a, Mode::Ok).await.unwrap(), paid_a, "A still replays its own");
    assert_eq!((probe_a.runs(), probe_b.runs()), (2, 2));

    drop((a, b));
    drop_private(pool_a, &name_a).await;
    drop_private(pool_b, &name_b).await;
}

/// Regression: a database dropped and re-created (a restore, a test reset)
/// while Redis keeps the old entries gets a new namespace at `migrate`: the
/// next call executes, whether the engine is new or the one that migrated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_database_does_not_see_the_old_redis_entries() {
    let name = common::unique("recreated").replace('-', "_");
    let Some((pool, idem)) = engine_on_private_database(&name).await else { return };
    let Some(client) = common::redis_client().await else { return };
    let probe = Probe::default();
    let k = common::unique("order_1");
    pay(&idem, k.clone(), 5, &probe, Mode::Ok).await.unwrap();
    let old_key = redis_key(&idem, "t_pay", &k).await;
    common::redis_cached_response(&client, &old_key).await;
    drop(idem);
    drop_private(pool, &name).await;

    let Some((pool, idem)) = engine_on_private_database(&name).await else { return };
    assert!(common::redis_exists(&client, &old_key).await, "Redis kept the old entry");
    let (again, outcome) = idem::observe(pay(&idem, k.clone(), 5, &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap().run, outcome), (2, Some(idem::Outcome::Executed)));
    assert_eq!((ledger_rows(&idem, &k).await, record_rows_for(&idem, "t_pay", &k).await), (1, 1));

    // Reset under a running engine: `migrate` makes it read the new namespace.
    sqlx::raw_sql("DROP TABLE idem_meta").execute(&pool).await.expect("drop idem_meta");
    sqlx::query(DELETE_RECORD).bind("t_pay").bind(&k).execute(&pool).await.expect("delete record");
    idem.migrate().await.expect("migrate");
    let (again, outcome) = idem::observe(pay(&idem, k.clone(), 5, &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap().run, outcome), (3, Some(idem::Outcome::Executed)));

    drop(idem);
    drop_private(pool, &name).await;
}

/// An explicit namespace is used as given, and shared by the engines given it.
#[tokio::test]
async fn an_explicit_namespace_is_shared_by_the_engines_given_it() {
    let Some(client) = common::redis_client().await else { return };
    let Some(pool) = open(&common::unique("db"), 4).await else { return };
    prepare(&pool).await;
    let namespace = idem::Namespace::new(&common::unique("shared")).unwrap();
    let build = || Idem::builder(pool.clone()).redis(client.clone()).redis_namespace(namespace.clone()).build();
    let (a, b) = (build(), build());
    a.migrate().await.expect("migrate");
    assert_eq!(b.redis_namespace().await.unwrap(), Some(namespace.clone()));
    let probe = Probe::default();
    let k = common::unique("explicit");
    let first = pay(&a, k.clone(), 5, &probe, Mode::Ok).await.unwrap();
    let cached = common::redis_cached_response(&client, &format!("idem:{namespace}:t_pay:{k}")).await;
    assert_eq!(cached, serde_json::to_string(&first).unwrap());
    // Replayed from Redis, not the record: the record is gone.
    sqlx::query(DELETE_RECORD).bind("t_pay").bind(&k).execute(&pool).await.expect("delete record");
    let (again, outcome) = idem::observe(pay(&b, k.clone(), 5, &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap(), outcome), (first, Some(idem::Outcome::Replayed)));
    assert!(idem::Namespace::new("a:b").is_err(), "a `:` could merge two namespaces' keys");
}

/// Regression: a cached result written late (Redis paused while the cache
/// write waited) carries its record's expiry: once the record expired, the
/// copy is a miss and the next call executes, rather than replaying it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_result_written_late_does_not_outlive_its_record() {
    let Some((server, idem)) = engine_on_private_redis(Duration::from_secs(10)).await else { return };
    let probe = Arc::new(Probe::default());
    let k = common::unique("late_cache");
    let first = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay_short_ttl(&idem, k, &probe, Mode::HeldThenOk).await })
    };
    until_held(&probe).await;
    // The cache write after the commit waits 2.5 s in Redis; the record
    // (ttl 1 s) expires meanwhile.
    common::redis_pause(&server.client(), 2_500).await;
    probe.open();
    let first = first.await.unwrap().unwrap();
    let key = redis_key(&idem, "t_ttl", &k).await;
    let cached = common::redis_cached_response(&server.client(), &key).await;
    assert_eq!(cached, serde_json::to_string(&first).unwrap(), "the late write landed");
    until_expired(&idem, "t_ttl", &k).await;

    let (again, outcome) = idem::observe(pay_short_ttl(&idem, k.clone(), &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap().run, outcome), (2, Some(idem::Outcome::Executed)), "the stale copy was a miss");
    assert_eq!(ledger_rows(&idem, &k).await, 2);
}

/// Regression: a cache write that meets the Redis back-off (another call's
/// Redis operation just timed out) is tried again later, so the claim does
/// not live out its 30 s lease: the key soon holds the finished result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_write_during_the_back_off_is_retried() {
    let Some((server, idem)) = engine_on_private_redis(Duration::from_millis(200)).await else { return };
    let probe = Arc::new(Probe::default());
    let k = common::unique("finish_backoff");
    let held = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay(&idem, k, 2, &probe, Mode::HeldThenOk).await })
    };
    until_held(&probe).await;
    common::redis_pause(&server.client(), 1_000).await;
    let started = std::time::Instant::now();
    assert_eq!(idem.status("t_pay", &common::unique("other")).await.unwrap(), Status::Absent);
    assert!(started.elapsed() >= Duration::from_millis(200), "the status query timed out (the pause held it)");
    // Within the back-off: the cache write is skipped at first.
    probe.open();
    let first = held.await.unwrap().unwrap();
    let cached = common::redis_cached_response(&server.client(), &redis_key(&idem, "t_pay", &k).await).await;
    assert_eq!(cached, serde_json::to_string(&first).unwrap());
    let (again, outcome) = idem::observe(pay(&idem, k.clone(), 2, &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap(), outcome), (first, Some(idem::Outcome::Replayed)));
    assert_eq!(probe.runs(), 1);
}

// ---- a duplicate never gets a failure when a record committed ----

/// Which lock a `pay_locking` body takes, and when.
#[derive(Debug, Clone, Copy)]
enum LockOrder {
    /// Locks the business row, then returns (the record goes in after).
    RowThenReturn,
    /// Waits at the gate, then locks the business row.
    HeldThenRow,
}

#[idempotent(key = "<k>", ttl = "3s", biz = "t_lock")]
async fn pay_locking(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    #[idem(skip)] probe: &Probe,
    #[idem(skip)] order: LockOrder,
) -> Result<Receipt, TestError> {
    let run = probe.runs.fetch_add(1, SeqCst) + 1;
    sqlx::query(INSERT_LEDGER).bind(&k).bind(amount).execute(&mut **tx).await?;
    if let LockOrder::HeldThenRow = order {
        probe.held.fetch_add(1, SeqCst);
        probe.gate.acquire().await.expect("gate").forget();
    }
    sqlx::query("UPDATE idem_classify SET v = v + 1 WHERE id = 1").execute(&mut **tx).await?;
    if let LockOrder::RowThenReturn = order {
        probe.held.fetch_add(1, SeqCst);
    }
    Ok(Receipt { key: k, amount, run })
}

/// A call without a claim (record first) and a claimed call (record last)
/// whose bodies lock one business row: held at gates so they deadlock for
/// certain. The victim, whichever the server picks, replays the winner.
async fn deadlock_between_claimed_and_unclaimed(over_an_expired_record: bool) {
    if ONE_WRITER {
        return; // one writer at a time: nothing to deadlock on
    }
    let name = common::unique("deadlock").replace('-', "_");
    let Some((pool, claimed)) = engine_on_private_database(&name).await else { return };
    sqlx::raw_sql(CLASSIFY_DDL).execute(&pool).await.expect("business row");
    let unclaimed = Idem::new(pool.clone());
    let probe = Arc::new(Probe::default());
    let k = common::unique("deadlock");
    if over_an_expired_record {
        let before = Probe::default();
        before.open();
        pay_locking(&unclaimed, k.clone(), 7, &before, LockOrder::RowThenReturn).await.unwrap();
        until_expired(&unclaimed, "t_lock", &k).await;
    }

    // Without a claim: record in, body held before it locks the row.
    let first = {
        let (idem, k, probe) = (unclaimed.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { idem::observe(pay_locking(&idem, k, 7, &probe, LockOrder::HeldThenRow)).await })
    };
    until_held(&probe).await;
    // With a claim: the body locks the row, then the record insert waits on
    // the first call's record.
    let second = {
        let (idem, k, probe) = (claimed.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { idem::observe(pay_locking(&idem, k, 7, &probe, LockOrder::RowThenReturn)).await })
    };
    let start = std::time::Instant::now();
    while probe.held.load(SeqCst) < 2 {
        assert!(start.elapsed() < Duration::from_secs(30), "the claimed body never locked the row");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    probe.open(); // the first now waits on the row: a deadlock either way round

    let (first, first_outcome) = first.await.unwrap();
    let (second, second_outcome) = second.await.unwrap();
    let (first, second) = (first.expect("the first call failed"), second.expect("the claimed call failed"));
    assert_eq!(first, second, "both callers got the committed result");
    let mut outcomes = vec![first_outcome, second_outcome];
    outcomes.sort_by_key(|o| format!("{o:?}"));
    assert_eq!(outcomes, vec![Some(idem::Outcome::Executed), Some(idem::Outcome::Replayed)]);
    assert_eq!(probe.runs(), 2, "both bodies ran; one was rolled back");
    assert_eq!(ledger_rows(&claimed, &k).await, 1 + i64::from(over_an_expired_record));
    assert_eq!(record_rows_for(&claimed, "t_lock", &k).await, 1);

    drop((claimed, unclaimed));
    drop_private(pool, &name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_between_a_claimed_and_an_unclaimed_call_replays_the_winner() {
    deadlock_between_claimed_and_unclaimed(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_between_two_calls_replacing_an_expired_record_replays_the_winner() {
    deadlock_between_claimed_and_unclaimed(true).await;
}

/// A cached value corrupted in Redis (a result the fn's type cannot read)
/// answers `Error::Replay`, never a panic, and runs nothing.
#[tokio::test]
async fn corrupted_cached_value_is_a_replay_error() {
    let Some(idem) = engine(&common::unique("db"), 4, Redis::On).await else { return };
    let Some(client) = common::redis_client().await else { return };
    let probe = Probe::default();
    let k = common::unique("corrupt_cache");
    let first = pay(&idem, k.clone(), 8, &probe, Mode::Ok).await.unwrap();
    let key = redis_key(&idem, "t_pay", &k).await;
    let cached = common::redis_cached_response(&client, &key).await;
    assert_eq!(cached, serde_json::to_string(&first).unwrap());
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let value: String = redis::cmd("GET").arg(&key).query_async(&mut conn).await.expect("GET");
    let corrupted = value.replace(&cached, "{\"not\":\"a receipt\"}");
    common::redis_set(&client, &key, &corrupted, 60_000).await;

    let (again, outcome) = idem::observe(pay(&idem, k.clone(), 8, &probe, Mode::Ok)).await;
    assert!(matches!(again, Err(TestError::Idem(idem::Error::Replay { .. }))), "{again:?}");
    assert_eq!(outcome, Some(idem::Outcome::Rejected));
    assert_eq!((probe.runs(), ledger_rows(&idem, &k).await), (1, 1));
}
