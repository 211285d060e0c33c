//! Behaviour of `#[idempotent]` on SQLite (a file per test, WAL), with and
//! without Redis (`IDEM_REDIS_URL`): the shared suite, and what only SQLite
//! does.

mod suite;

/// The backend the suite runs on here.
type SuiteBackend = idempotency_testkit::backend::Sqlite;

use std::sync::Arc;
use std::time::Duration;

use idempotency::Idem;
use idempotency_testkit::{TestBackend, unique};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

use suite::fixture::{Mode, Probe, is_in_progress, pay, until_started};

/// Regression: on SQLite a duplicate waits at `BEGIN IMMEDIATE`; past the
/// busy timeout that is `InProgress` (someone holds the key), not `Storage`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_past_the_busy_timeout_is_in_progress() {
    let dir = std::env::temp_dir().join("idem-tests");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let options = SqliteConnectOptions::new()
        .filename(dir.join(format!("{}.db", unique("busy"))))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_millis(200));
    let pool = SqlitePoolOptions::new().max_connections(2).connect_with(options).await.expect("sqlite file");
    SuiteBackend::prepare(&pool).await;
    let idem = Idem::new(pool.clone());
    idem.migrate().await.expect("migrate");
    // Another instance: a duplicate on the same engine would wait in memory.
    let elsewhere = Idem::new(pool);
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
