//! Behaviour of `#[idempotent]` on SQLite (a file per test, WAL), with and
//! without Redis (`IDEM_REDIS_URL`): the shared suite, and what only SQLite
//! does.

mod suite;

/// The backend the suite runs on here.
type SuiteBackend = idempotency_testkit::backend::Sqlite;

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::{Idem, Outcome, idempotent};
use idempotency_testkit::{TestBackend, unique};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Pool, Sqlite, Transaction};
use tokio::sync::watch;

use suite::fixture::{Mode, Probe, Receipt, TestError, body, is_in_progress, pay, until_started};

/// A file of its own, WAL, its busy timeout short.
fn options(name: &str) -> SqliteConnectOptions {
    let dir = std::env::temp_dir().join("idem-tests");
    std::fs::create_dir_all(&dir).expect("temp dir");
    SqliteConnectOptions::new()
        .filename(dir.join(format!("{}.db", unique(name))))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_millis(200))
}

/// Regression: on SQLite a duplicate waits at `BEGIN IMMEDIATE`; past its
/// bound (the busy timeout, and `lock_wait` if longer) that is
/// `InProgress` (someone holds the key), not `Storage`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_past_the_busy_timeout_is_in_progress() {
    let pool = SqlitePoolOptions::new().max_connections(2).connect_with(options("busy")).await.expect("sqlite file");
    SuiteBackend::prepare(&pool).await;
    let idem = Idem::new(pool.clone());
    idem.migrate().await.expect("migrate");
    // Another instance: a duplicate on the same engine would wait in memory.
    let elsewhere = Idem::builder(pool).lock_wait(Duration::from_millis(500)).build();
    let probe = Arc::new(Probe::default());
    let k = unique("busy");

    let first = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay(&idem, k, 6, &probe, Mode::HeldThenOk).await })
    };
    until_started(&probe, 1).await;
    let second = pay(&elsewhere, k.clone(), 6, &probe, Mode::Ok).await;
    assert!(is_in_progress(&second), "{second:?}");
    assert!(!first.is_finished());
    probe.open();
    let first = first.await.unwrap().unwrap();
    assert_eq!(pay(&idem, k.clone(), 6, &probe, Mode::Ok).await.unwrap(), first);
    assert_eq!(probe.runs(), 1);
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_sqlite_wait", wait = "30s")]
async fn pay_waiting(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    k: String,
    amount: i64,
    #[idem(skip)] probe: &Probe,
    #[idem(skip)] mode: Mode,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, amount, probe, mode).await?;
    Ok(Receipt { key: k, amount, run })
}

/// Regression: a duplicate on another instance answered `InProgress` once
/// SQLite's busy timeout passed at its `BEGIN IMMEDIATE`, whatever its
/// `wait` (`Builder::wait` promises `lock_wait` or `wait`, whichever is
/// longer). It now asks for the write lock again until its bound: with a
/// busy timeout of 200 ms and `wait = "30s"` it is still waiting after its
/// pool was asked five times (each a `BEGIN IMMEDIATE` that timed out, but
/// the first), and replays the first call's value once that one is let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_elsewhere_waits_past_the_busy_timeout_for_its_wait() {
    let options = options("busy-wait");
    let pool = SqlitePoolOptions::new().max_connections(2).connect_with(options.clone()).await.expect("sqlite file");
    SuiteBackend::prepare(&pool).await;
    let idem = Idem::new(pool);
    idem.migrate().await.expect("migrate");
    // Another instance, as another process opens the file: its own pool,
    // which counts the connections it hands out.
    let asked = watch::Sender::new(0u64);
    let (on_acquire, on_connect) = (asked.clone(), asked.clone());
    let own: Pool<Sqlite> = SqlitePoolOptions::new()
        .max_connections(2)
        .before_acquire(move |_, _| {
            on_acquire.send_modify(|n| *n += 1);
            Box::pin(async { Ok(true) })
        })
        .after_connect(move |_, _| {
            on_connect.send_modify(|n| *n += 1);
            Box::pin(async { Ok(()) })
        })
        .connect_lazy_with(options);
    let elsewhere = Idem::new(own);
    let (probe, k) = (Arc::new(Probe::default()), unique("busy-wait"));
    let first = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay_waiting(&idem, k, 6, &probe, Mode::HeldThenOk).await })
    };
    until_started(&probe, 1).await;
    let started = Instant::now();
    let duplicate = {
        let (elsewhere, k, probe) = (elsewhere.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { idempotency::observe(pay_waiting(&elsewhere, k, 6, &probe, Mode::Ok)).await })
    };
    let mut count = asked.subscribe();
    let five = tokio::time::timeout(Duration::from_secs(30), count.wait_for(|n| *n >= 5)).await;
    five.expect("the duplicate asked for the write lock again").expect("counted");
    assert!(!duplicate.is_finished(), "answered after {:?}", started.elapsed());
    probe.open();
    let first = first.await.unwrap().unwrap();
    let (again, outcome) = tokio::time::timeout(Duration::from_secs(30), duplicate).await.expect("told").unwrap();
    assert_eq!((again.unwrap(), outcome), (first, Some(Outcome::Replayed)));
    assert_eq!(probe.runs(), 1);
}
