//! Behaviour of `#[idempotent]` on SQLite (a file per test, WAL), with and
//! without Redis (`IDEM_REDIS_URL`).

mod common;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

type Db = sqlx::Sqlite;

const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_test_ledger (
    id INTEGER PRIMARY KEY, k TEXT NOT NULL, amount INTEGER NOT NULL)";
const INSERT_LEDGER: &str = "INSERT INTO idem_test_ledger (k, amount) VALUES (?, ?)";
const COUNT_LEDGER: &str = "SELECT COUNT(*) FROM idem_test_ledger WHERE k = ?";
const COUNT_RECORDS_KEY: &str = "SELECT COUNT(*) FROM idem_record WHERE biz_type = ? AND idem_key = ?";
/// Whether a duplicate's wait on the record is bounded by `lock_wait`.
const LOCK_WAIT_BOUNDED: bool = false;
/// One writer at a time: a second transaction waits for the first to end.
const ONE_WRITER: bool = true;
/// Two rows to lock, for the error-classification test.
const CLASSIFY_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_classify (id INT PRIMARY KEY, v INT NOT NULL); INSERT OR IGNORE INTO idem_classify VALUES (1, 0), (2, 0)";
const DELETE_RECORD: &str = "DELETE FROM idem_record WHERE biz_type = ? AND idem_key = ?";
const CORRUPT: &str = "UPDATE idem_record SET response = ? WHERE biz_type = ? AND idem_key = ?";
const BIZ_NO: &str = "SELECT biz_no FROM idem_record WHERE biz_type = ? AND idem_key = ?";

async fn open(name: &str, max_connections: u32) -> Option<sqlx::Pool<Db>> {
    let dir = std::env::temp_dir().join("idem-tests");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let options = SqliteConnectOptions::new()
        .filename(dir.join(format!("{name}.db")))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(std::time::Duration::from_secs(30));
    let pool = SqlitePoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(std::time::Duration::from_secs(60))
        .connect_with(options)
        .await
        .expect("sqlite file");
    Some(pool)
}

/// A database of its own, for a test that must see every row of
/// `idem_record` (SQLite: `open`'s file is already its own).
async fn open_private(name: &str) -> Option<sqlx::Pool<Db>> {
    open(name, 2).await
}

/// Closes a database `open_private` made and deletes its files.
async fn drop_private(pool: sqlx::Pool<Db>, name: &str) {
    pool.close().await;
    let dir = std::env::temp_dir().join("idem-tests");
    for suffix in ["db", "db-wal", "db-shm"] {
        let _ = std::fs::remove_file(dir.join(format!("{name}.{suffix}")));
    }
}

/// A pool whose database cannot be opened (a file in a folder that does not exist).
fn dead_pool() -> sqlx::Pool<Db> {
    let options = SqliteConnectOptions::new().filename("/nonexistent-idem-dir/none.db").create_if_missing(false);
    SqlitePoolOptions::new().acquire_timeout(std::time::Duration::from_secs(2)).connect_lazy_with(options)
}

async fn prepare(pool: &sqlx::Pool<Db>) {
    sqlx::raw_sql(LEDGER_DDL).execute(pool).await.expect("ledger table");
}

include!("suite/mod.rs");

/// Regression: on SQLite a duplicate waits at `BEGIN IMMEDIATE`; past the
/// busy timeout that is `InProgress` (someone holds the key), not `Storage`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_past_the_busy_timeout_is_in_progress() {
    let dir = std::env::temp_dir().join("idem-tests");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let options = SqliteConnectOptions::new()
        .filename(dir.join(format!("{}.db", common::unique("busy"))))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_millis(200));
    let pool = SqlitePoolOptions::new().max_connections(2).connect_with(options).await.expect("sqlite file");
    prepare(&pool).await;
    let idem = Idem::new(pool.clone());
    idem.migrate().await.expect("migrate");
    // Another instance: a duplicate on the same engine would wait in memory.
    let elsewhere = Idem::new(pool);
    let probe = Arc::new(Probe::default());
    let k = common::unique("busy");

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
