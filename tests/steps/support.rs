//! What the steps tests share: the databases (each behind [`TestDb`]: its
//! pool, its payment table, and reads of the call tables), engines with and
//! without Redis, and unique keys.

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotency::{Backend, Idem};
use sqlx::{Pool, Transaction};

/// The table the bodies write their local rows into: no unique key, so a
/// payment written twice shows as two rows.
pub const PAYMENT_TABLE: &str = "steps_payment";

pub use idempotency_testkit::{redis_url, unique};

/// A call's row in `idem_call`, as the tests read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallState {
    pub status: i16,
    pub fence: i64,
    pub response: Option<String>,
    pub biz_no: Option<String>,
}

/// What differs per database for these tests.
pub trait TestDb: Backend {
    /// Connects (`None` when the server does not answer: the test skips).
    fn connect() -> impl Future<Output = Option<Connected<Self>>> + Send;

    /// Creates the payment table if absent.
    fn create_payments(pool: &Pool<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Writes a payment in the final transaction.
    fn insert_payment(
        tx: &mut Transaction<'_, Self>,
        key: &str,
        charge_id: &str,
        amount: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Payment rows of a key.
    fn payments(pool: &Pool<Self>, key: &str) -> impl Future<Output = i64> + Send;

    /// The call of `(biz, key)` in `idem_call`.
    fn call(pool: &Pool<Self>, biz: &str, key: &str) -> impl Future<Output = Option<CallState>> + Send;

    /// Steps recorded for the call of `(biz, key)`.
    fn steps(pool: &Pool<Self>, biz: &str, key: &str) -> impl Future<Output = i64> + Send;

    /// The status of the plain mode's record of `(biz, key)` in `idem_record`.
    fn record_status(pool: &Pool<Self>, biz: &str, key: &str) -> impl Future<Output = Option<i16>> + Send;

    /// Runs `sql` (written by the test, with no input in it): how a test
    /// ends a lease or an expiry at once instead of waiting for it.
    fn force(pool: &Pool<Self>, sql: String) -> impl Future<Output = ()> + Send;
}

type CallColumns = (i16, i64, Option<String>, Option<String>);

fn state((status, fence, response, biz_no): CallColumns) -> CallState {
    CallState { status, fence, response, biz_no }
}

macro_rules! test_db {
    ($db:ty, $auto_id:literal, $insert:literal, $payments:literal, $call:literal, $steps:literal, $record:literal, $connect:expr) => {
        impl TestDb for $db {
            async fn connect() -> Option<Connected<Self>> {
                $connect.await
            }

            async fn create_payments(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
                let ddl = format!(
                    "CREATE TABLE IF NOT EXISTS {PAYMENT_TABLE} (id {}, idem_key VARCHAR(255) NOT NULL, charge_id VARCHAR(64) NOT NULL, amount BIGINT NOT NULL)",
                    $auto_id
                );
                // Twice: PostgreSQL's concurrent `CREATE TABLE IF NOT EXISTS`
                // can collide in the catalog (42P07, or 23505 on its type), and
                // the loser gets its error once the winner committed the table.
                match sqlx::raw_sql(sqlx::AssertSqlSafe(ddl.clone())).execute(pool).await {
                    Ok(_) => Ok(()),
                    Err(_) => sqlx::raw_sql(sqlx::AssertSqlSafe(ddl)).execute(pool).await.map(drop),
                }
            }

            async fn insert_payment(
                tx: &mut Transaction<'_, Self>,
                key: &str,
                charge_id: &str,
                amount: i64,
            ) -> Result<(), sqlx::Error> {
                sqlx::query($insert).bind(key).bind(charge_id).bind(amount).execute(&mut **tx).await.map(drop)
            }

            async fn payments(pool: &Pool<Self>, key: &str) -> i64 {
                sqlx::query_scalar($payments).bind(key).fetch_one(pool).await.expect("count payments")
            }

            async fn call(pool: &Pool<Self>, biz: &str, key: &str) -> Option<CallState> {
                let row: Option<CallColumns> =
                    sqlx::query_as($call).bind(biz).bind(key).fetch_optional(pool).await.expect("read idem_call");
                row.map(state)
            }

            async fn steps(pool: &Pool<Self>, biz: &str, key: &str) -> i64 {
                sqlx::query_scalar($steps).bind(biz).bind(key).fetch_one(pool).await.expect("count steps")
            }

            async fn record_status(pool: &Pool<Self>, biz: &str, key: &str) -> Option<i16> {
                sqlx::query_scalar($record).bind(biz).bind(key).fetch_optional(pool).await.expect("read idem_record")
            }

            async fn force(pool: &Pool<Self>, sql: String) {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone())).execute(pool).await.expect(&sql);
            }
        }
    };
}

test_db!(
    sqlx::Sqlite,
    "INTEGER PRIMARY KEY",
    "INSERT INTO steps_payment (idem_key, charge_id, amount) VALUES (?, ?, ?)",
    "SELECT COUNT(*) FROM steps_payment WHERE idem_key = ?",
    "SELECT status, fence, response, biz_no FROM idem_call WHERE biz_type = ? AND idem_key = ?",
    "SELECT COUNT(*) FROM idem_step s JOIN idem_call c ON c.id = s.call_id WHERE c.biz_type = ? AND c.idem_key = ?",
    "SELECT status FROM idem_record WHERE biz_type = ? AND idem_key = ?",
    sqlite()
);

test_db!(
    sqlx::MySql,
    "BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY",
    "INSERT INTO steps_payment (idem_key, charge_id, amount) VALUES (?, ?, ?)",
    "SELECT COUNT(*) FROM steps_payment WHERE idem_key = ?",
    "SELECT status, fence, response, biz_no FROM idem_call WHERE biz_type = ? AND idem_key = ?",
    "SELECT COUNT(*) FROM idem_step s JOIN idem_call c ON c.id = s.call_id WHERE c.biz_type = ? AND c.idem_key = ?",
    "SELECT status FROM idem_record WHERE biz_type = ? AND idem_key = ?",
    async {
        let options = sqlx::mysql::MySqlPoolOptions::new().max_connections(8).acquire_timeout(Duration::from_secs(10));
        let url = idempotency_testkit::mysql_url();
        let pool = idempotency_testkit::reach("mysql", || async { options.clone().connect(&url).await.ok() }).await?;
        Some(Connected { pool, _file: None })
    }
);

test_db!(
    sqlx::Postgres,
    "BIGSERIAL PRIMARY KEY",
    "INSERT INTO steps_payment (idem_key, charge_id, amount) VALUES ($1, $2, $3)",
    "SELECT COUNT(*) FROM steps_payment WHERE idem_key = $1",
    "SELECT status, fence, response, biz_no FROM idem_call WHERE biz_type = $1 AND idem_key = $2",
    "SELECT COUNT(*) FROM idem_step s JOIN idem_call c ON c.id = s.call_id WHERE c.biz_type = $1 AND c.idem_key = $2",
    "SELECT status FROM idem_record WHERE biz_type = $1 AND idem_key = $2",
    async {
        let options = sqlx::postgres::PgPoolOptions::new().max_connections(8).acquire_timeout(Duration::from_secs(10));
        let url = idempotency_testkit::pg_url();
        let pool =
            idempotency_testkit::reach("postgres", || async { options.clone().connect(&url).await.ok() }).await?;
        Some(Connected { pool, _file: None })
    }
);

/// A pool, and the private file it lives in (SQLite), deleted on drop.
pub struct Connected<DB: sqlx::Database> {
    pub pool: Pool<DB>,
    pub _file: Option<TempFile>,
}

/// A database file deleted (with its journals) when dropped.
pub struct TempFile(std::path::PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let mut path = self.0.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }
}

/// A private SQLite file, so several connections (calls running at once)
/// share one database.
async fn sqlite() -> Option<Connected<sqlx::Sqlite>> {
    let file = TempFile(std::env::temp_dir().join(format!("{}.db", unique("idem-steps"))));
    let options = sqlx::sqlite::SqliteConnectOptions::new().filename(&file.0).create_if_missing(true);
    let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(4).connect_with(options).await.expect("sqlite");
    Some(Connected { pool, _file: Some(file) })
}

/// A migrated engine over `pool` (with the payment table), on the shared
/// Redis when `redis`; `None` when Redis does not answer.
pub async fn engine<DB: TestDb>(pool: Pool<DB>, redis: bool) -> Option<Idem<DB>> {
    let idem = unmigrated_engine(pool.clone(), redis).await?;
    idem.migrate().await.expect("migrate");
    DB::create_payments(&pool).await.expect("payment table");
    Some(idem)
}

/// An engine over a database migrated before (the child processes').
pub async fn unmigrated_engine<DB: TestDb>(pool: Pool<DB>, redis: bool) -> Option<Idem<DB>> {
    let mut builder = Idem::builder(pool);
    if redis {
        builder = builder.redis(idempotency_testkit::redis_client().await?);
    }
    Some(builder.build())
}

/// Whether the shared Redis answers (else its tests skip, with a line).
pub async fn redis_answers() -> bool {
    idempotency_testkit::redis_client().await.is_some()
}

/// Milliseconds since the Unix epoch: comparable between processes.
pub fn epoch_ms() -> i64 {
    i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis()).unwrap()
}
