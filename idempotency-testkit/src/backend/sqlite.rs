//! SQLite: a file per test in the temp dir (WAL), no server.

use std::path::PathBuf;
use std::time::Duration;

use sqlx::Pool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

use super::TestBackend;

/// SQLite, one file per database name under `<temp>/idem-tests/`.
pub struct Sqlite;

impl Sqlite {
    /// The folder of the test databases, created if missing.
    pub fn dir() -> PathBuf {
        let dir = std::env::temp_dir().join("idem-tests");
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }
}

const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_test_ledger (
    id INTEGER PRIMARY KEY, k TEXT NOT NULL, amount INTEGER NOT NULL)";

impl TestBackend for Sqlite {
    type Db = sqlx::Sqlite;

    const NAME: &'static str = "sqlite";

    const INSERT_LEDGER: &'static str = "INSERT INTO idem_test_ledger (k, amount) VALUES (?, ?)";
    const COUNT_LEDGER: &'static str = "SELECT COUNT(*) FROM idem_test_ledger WHERE k = ?";
    const COUNT_RECORDS_KEY: &'static str = "SELECT COUNT(*) FROM idem_record WHERE biz_type = ? AND idem_key = ?";
    const DELETE_RECORD: &'static str = "DELETE FROM idem_record WHERE biz_type = ? AND idem_key = ?";
    const CORRUPT: &'static str = "UPDATE idem_record SET response = ? WHERE biz_type = ? AND idem_key = ?";
    const BIZ_NO: &'static str = "SELECT biz_no FROM idem_record WHERE biz_type = ? AND idem_key = ?";
    const RECORD_TABLE_BEFORE_DIGEST: &'static str = "CREATE TABLE idem_record (
        id INTEGER PRIMARY KEY,
        biz_type TEXT NOT NULL,
        idem_key TEXT NOT NULL,
        biz_no TEXT NULL,
        params_hash TEXT NOT NULL,
        status INTEGER NOT NULL,
        response TEXT NULL,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL,
        expires_at INTEGER NOT NULL,
        UNIQUE (biz_type, idem_key)
    );
    CREATE INDEX idx_idem_record_biz_no ON idem_record (biz_type, biz_no);
    CREATE INDEX idx_idem_record_expires_at ON idem_record (expires_at);";
    const INSERT_RECORD_BEFORE_DIGEST: &'static str = "INSERT INTO idem_record (biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)";
    const RECORD_UNIQUE_INDEXES: &'static str = "SELECT group_concat(c.name, ',') FROM pragma_index_list('idem_record') AS l, \
        pragma_index_info(l.name) AS c WHERE l.\"unique\" = 1 AND l.origin <> 'pk' GROUP BY l.name";
    const LOCKABLE_ROWS_DDL: &'static str = "CREATE TABLE IF NOT EXISTS idem_classify (id INT PRIMARY KEY, v INT NOT NULL); INSERT OR IGNORE INTO idem_classify VALUES (1, 0), (2, 0)";

    const LOCK_WAIT_BOUNDED: bool = false;
    const ONE_WRITER: bool = true;

    async fn open(name: &str, max_connections: u32) -> Option<Pool<sqlx::Sqlite>> {
        let options = SqliteConnectOptions::new()
            .filename(Self::dir().join(format!("{name}.db")))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(30));
        let pool = SqlitePoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(options)
            .await
            .expect("sqlite file");
        Some(pool)
    }

    /// `open`'s file is already a database of its own.
    async fn open_private(name: &str, max_connections: u32) -> Option<Pool<sqlx::Sqlite>> {
        Self::open(name, max_connections).await
    }

    async fn drop_private(pool: Pool<sqlx::Sqlite>, name: &str) {
        pool.close().await;
        let dir = std::env::temp_dir().join("idem-tests");
        for suffix in ["db", "db-wal", "db-shm"] {
            let _ = std::fs::remove_file(dir.join(format!("{name}.{suffix}")));
        }
    }

    /// A file in a folder that does not exist.
    fn dead_pool() -> Pool<sqlx::Sqlite> {
        let options = SqliteConnectOptions::new().filename("/nonexistent-idem-dir/none.db").create_if_missing(false);
        SqlitePoolOptions::new().acquire_timeout(Duration::from_secs(2)).connect_lazy_with(options)
    }

    async fn prepare(pool: &Pool<sqlx::Sqlite>) {
        sqlx::raw_sql(LEDGER_DDL).execute(pool).await.expect("ledger table");
    }
}
