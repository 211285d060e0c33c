//! What the suite's themes share: the result and error types, the probe
//! that counts and holds bodies, the annotated fns most tests call
//! (`pay` and its short-ttl and short-lease twins), engines over the
//! target's backend, and small waits and counts.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use idempotency::{Idem, Status, idempotent};
use idempotency_testkit::servers::RedisServer;
use idempotency_testkit::{TestBackend, redis_client, unique};
use serde::{Deserialize, Serialize};
use sqlx::Transaction;

use super::{B, Db};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Receipt {
    pub(crate) key: String,
    pub(crate) amount: i64,
    /// Which execution of the body produced it: a second execution would say 2.
    pub(crate) run: usize,
}

#[derive(Debug)]
#[allow(dead_code)] // the fields show in assertion messages through Debug
pub(crate) enum TestError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
    Body,
}

impl From<idempotency::Error> for TestError {
    fn from(e: idempotency::Error) -> Self {
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
pub(crate) enum Mode {
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
pub(crate) async fn until_started(probe: &Probe, runs: usize) {
    let start = std::time::Instant::now();
    while probe.runs() < runs {
        assert!(start.elapsed() < Duration::from_secs(30), "{} of {runs} bodies started", probe.runs());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until `done` holds; 30 s only turn a hang into a failure.
pub(crate) async fn until(what: &str, done: impl Fn() -> bool) {
    let start = std::time::Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(30), "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Connections the engine's pool has lent out.
pub(crate) fn lent(idem: &Idem<Db>) -> u32 {
    idem.pool().size() - idem.pool().num_idle() as u32
}

/// Waits until a `Held*` body has done its statements and waits at the gate.
pub(crate) async fn until_held(probe: &Probe) {
    let start = std::time::Instant::now();
    while probe.held.load(SeqCst) == 0 {
        assert!(start.elapsed() < Duration::from_secs(30), "no body reached its gate");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until the record of `(biz, k)` has expired, as the engine sees it.
pub(crate) async fn until_expired(idem: &Idem<Db>, biz: &str, k: &str) {
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

/// Ends the record of `(biz, k)` now, as if its ttl had passed: its
/// `expires_at` set in the past, and its cached copy and claim gone from
/// the shared Redis (a copy never lives past its record). Tests use a long
/// ttl and this, so no second call has to come within a short one.
pub(crate) async fn expire_now(idem: &Idem<Db>, biz: &str, k: &str) {
    let sql = format!("UPDATE idem_record SET expires_at = 1 WHERE biz_type = '{biz}' AND idem_key = '{k}'");
    let done = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(idem.pool()).await.expect("expire the record");
    assert_eq!(done.rows_affected(), 1, "no record of {biz} {k}");
    if let Some(client) = redis_client().await {
        idempotency_testkit::redis_forget(&client, &redis_location(idem, biz, k).await).await;
    }
}

/// Calls until the answer is no longer `InProgress`: a claim left by a
/// failed or dropped call is released from a spawned task (up to 500 tries,
/// 20 ms apart: far less than the 30 s lease).
pub(crate) async fn past_the_release<F, Fut>(call: F) -> Result<Receipt, TestError>
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
pub(crate) struct Probe {
    pub(crate) runs: AtomicUsize,
    /// `Held*` bodies that reached the gate: their statements are done.
    pub(crate) held: AtomicUsize,
    pub(crate) gate: tokio::sync::Semaphore,
}

impl Default for Probe {
    fn default() -> Self {
        Self { runs: AtomicUsize::new(0), held: AtomicUsize::new(0), gate: tokio::sync::Semaphore::new(0) }
    }
}

impl Probe {
    pub(crate) fn runs(&self) -> usize {
        self.runs.load(SeqCst)
    }

    /// Lets one held body go on.
    pub(crate) fn open(&self) {
        self.gate.add_permits(1);
    }
}

/// What the suite's bodies do: count the run, write a ledger row, then
/// behave as `mode` says.
pub(crate) async fn body(
    tx: &mut Transaction<'_, Db>,
    k: &str,
    amount: i64,
    probe: &Probe,
    mode: Mode,
) -> Result<usize, TestError> {
    let run = probe.runs.fetch_add(1, SeqCst) + 1;
    sqlx::query(B::INSERT_LEDGER).bind(k).bind(amount).execute(&mut **tx).await?;
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
pub(crate) async fn pay(
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

/// `pay` inside the caller's transaction: the same `biz`, key and
/// arguments, so each replays the other's record.
#[idempotent(key = "<k>", ttl = "1h", biz = "t_pay", join)]
pub(crate) async fn pay_in(
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
pub(crate) async fn pay_short_ttl(
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
pub(crate) async fn pay_short_lease(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    #[idem(skip)] probe: &Probe,
    #[idem(skip)] mode: Mode,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, 1, probe, mode).await?;
    Ok(Receipt { key: k, amount: 1, run })
}

/// Runs `$helper` as two tests: the first name without Redis, the second
/// with it.
macro_rules! with_and_without_redis {
    ($(#[$attr:meta])* $without:ident, $with:ident => $helper:ident) => {
        $(#[$attr])*
        async fn $without() {
            $helper($crate::suite::fixture::Redis::Off).await;
        }

        $(#[$attr])*
        async fn $with() {
            $helper($crate::suite::fixture::Redis::On).await;
        }
    };
}
pub(crate) use with_and_without_redis;

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Redis {
    Off,
    On,
    DeadPort,
}

/// An engine on its own database name (SQLite: its own file), optionally
/// with Redis; `None` when a server is unreachable (the test then passes
/// after printing `skipped: ...`).
pub(crate) async fn engine(name: &str, max_connections: u32, redis: Redis) -> Option<Idem<Db>> {
    let pool = B::open(name, max_connections).await?;
    B::prepare(&pool).await;
    let builder = Idem::builder(pool);
    let builder = match redis {
        Redis::Off => builder,
        Redis::On => builder.redis(redis_client().await?),
        Redis::DeadPort => builder.redis(redis::Client::open("redis://127.0.0.1:1").unwrap()),
    };
    let idem = builder.build();
    idem.migrate().await.expect("migrate");
    Some(idem)
}

/// An engine whose Redis is a private `redis-server` (a test may pause it),
/// connected and its scripts loaded by one call.
pub(crate) async fn engine_on_private_redis(redis_timeout: Duration) -> Option<(RedisServer, Idem<Db>)> {
    let server = RedisServer::start()?;
    let pool = B::open(&unique("db"), 4).await?;
    B::prepare(&pool).await;
    let idem = Idem::builder(pool).redis(server.client()).redis_timeout(redis_timeout).build();
    idem.migrate().await.expect("migrate");
    pay(&idem, unique("warm"), 1, &Probe::default(), Mode::Ok).await.unwrap();
    Some((server, idem))
}

/// An engine with the shared Redis over a database of its own.
pub(crate) async fn engine_on_private_database(name: &str) -> Option<(sqlx::Pool<Db>, Idem<Db>)> {
    let client = redis_client().await?;
    let pool = B::open_private(name, 2).await?;
    B::prepare(&pool).await;
    let idem = Idem::builder(pool.clone()).redis(client).build();
    idem.migrate().await.expect("migrate");
    Some((pool, idem))
}

/// Where `(biz, k)` on `idem` lives in Redis: its claim key and its field
/// in the result hashes.
pub(crate) async fn redis_location(idem: &Idem<Db>, biz: &str, k: &str) -> idempotency_testkit::Location {
    let namespace = idem.redis_namespace().await.expect("namespace").expect("migrated");
    idempotency::redis_layout::locate(namespace.as_str(), biz, k).expect("a valid namespace")
}

/// The ledger rows of `k`: how many bodies of it committed.
pub(crate) async fn ledger_rows(idem: &Idem<Db>, k: &str) -> i64 {
    sqlx::query_scalar(B::COUNT_LEDGER).bind(k).fetch_one(idem.pool()).await.expect("count ledger")
}

/// The `idem_record` rows of `(biz, k)`.
pub(crate) async fn record_rows_for(idem: &Idem<Db>, biz: &str, k: &str) -> i64 {
    sqlx::query_scalar(B::COUNT_RECORDS_KEY).bind(biz).bind(k).fetch_one(idem.pool()).await.expect("count")
}

pub(crate) fn is_in_progress(r: &Result<Receipt, TestError>) -> bool {
    matches!(r, Err(TestError::Idem(idempotency::Error::InProgress { .. })))
}
