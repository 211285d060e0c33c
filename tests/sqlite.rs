//! Behaviour of `#[idempotent]` on SQLite (a file per test, WAL), with and
//! without Redis (`IDEM_REDIS_URL`).

mod common;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

type Db = sqlx::Sqlite;

const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_test_ledger (
    id INTEGER PRIMARY KEY, k TEXT NOT NULL, amount INTEGER NOT NULL)";
const INSERT_LEDGER: &str = "INSERT INTO idem_test_ledger (k, amount) VALUES (?, ?)";
const COUNT_LEDGER: &str = "SELECT COUNT(*) FROM idem_test_ledger WHERE k = ?";
const COUNT_RECORDS: &str = "SELECT COUNT(*) FROM idem_record WHERE biz_type = ?";
const COUNT_RECORDS_KEY: &str = "SELECT COUNT(*) FROM idem_record WHERE biz_type = ? AND idem_key = ?";
/// Whether a duplicate's wait on the record is bounded by `lock_wait`.
const LOCK_WAIT_BOUNDED: bool = false;
const CORRUPT: &str = "UPDATE idem_record SET response = ? WHERE biz_type = ? AND idem_key = ?";

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

async fn prepare(pool: &sqlx::Pool<Db>) {
    sqlx::raw_sql(LEDGER_DDL).execute(pool).await.expect("ledger table");
}

include!("suite/mod.rs");
