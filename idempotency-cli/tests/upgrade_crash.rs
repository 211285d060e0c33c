//! Issue 26.1: the migration of a record table of an earlier version, run by
//! a real `idem migrate` process SIGKILLed at the point that matters
//! (MariaDB: halfway through the backfill, its steps committed one by one;
//! PostgreSQL and SQLite: inside their one transaction), finishes with the
//! next `idem migrate`; then every record is found by its digest.

// The test's own statements, on a direct connection: the tool prepares
// its statements in `src/store.rs` only.
#![allow(clippy::disallowed_methods)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idempotency_testkit::TestBackend;
use idempotency_testkit::backend::{MySql, Postgres, Sqlite};
use sqlx::Pool;

/// Enough rows that the migration takes a second or more: time to stop it.
const ROWS: i64 = 200_000;

/// What differs per database.
struct Case {
    /// Fills the earlier table with [`ROWS`] records `t_up` / `k<i>`.
    fill: &'static str,
    /// Counts the rows whose `key_digest` is the server's own digest of
    /// their key (`None`: SQLite has no hash function).
    digests_right: Option<&'static str>,
    /// The database URL for `idem`.
    url: String,
}

fn idem(url: &str, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    command
        .args(args)
        .env("IDEM_DATABASE_URL", url)
        .env_remove("IDEM_REDIS_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

async fn unique_indexes<B: TestBackend>(pool: &Pool<B::Db>) -> Vec<String>
where
    for<'c> &'c Pool<B::Db>: sqlx::Executor<'c, Database = B::Db>,
    String: sqlx::Type<B::Db> + for<'r> sqlx::Decode<'r, B::Db>,
    (String,): for<'r> sqlx::FromRow<'r, <B::Db as sqlx::Database>::Row>,
    <B::Db as sqlx::Database>::Arguments: for<'q> sqlx::IntoArguments<B::Db>,
{
    let mut found: Vec<String> = sqlx::query_scalar(B::RECORD_UNIQUE_INDEXES).fetch_all(pool).await.expect("indexes");
    found.sort();
    found
}

/// Kills `child` (SIGKILL) once `at_the_point` says so; false if the child
/// ended first.
async fn kill_when<F, Fut>(child: &mut Child, mut at_the_point: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if child.try_wait().expect("child").is_some() {
            return false;
        }
        if at_the_point().await {
            child.kill().expect("SIGKILL");
            child.wait().expect("reaped");
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the migration never reached the point to stop it");
}

macro_rules! crash_case {
    ($test:ident, $backend:ty, $case:expr, $point:expr, $halfway:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            type B = $backend;
            let name = format!("idem_upcrash_{}", std::process::id());
            let Some(pool) = B::open_private(&name, 2).await else { return };
            let case: Case = ($case)(&name);
            sqlx::raw_sql(B::RECORD_TABLE_BEFORE_DIGEST).execute(&pool).await.expect("earlier table");
            sqlx::raw_sql(case.fill).execute(&pool).await.expect("fill");
            assert_eq!(unique_indexes::<B>(&pool).await, ["biz_type,idem_key"]);

            let mut child = idem(&case.url, &["migrate"]).spawn().expect("idem");
            let point = $point;
            assert!(kill_when(&mut child, || point(&pool)).await, "the migration ended before the kill");
            // Cut off: the table is not yet today's (and, on MariaDB, half filled).
            assert_eq!(unique_indexes::<B>(&pool).await, ["biz_type,idem_key"], "still unique on the key");
            let halfway = $halfway;
            halfway(&pool).await;

            let finished = idem(&case.url, &["migrate"]).output().expect("idem");
            assert!(finished.status.success(), "{}", String::from_utf8_lossy(&finished.stderr));
            assert_eq!(unique_indexes::<B>(&pool).await, ["key_digest"]);
            let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_record").fetch_one(&pool).await.unwrap();
            assert_eq!(rows, ROWS, "every row kept, once");
            if let Some(right) = case.digests_right {
                let right: i64 = sqlx::query_scalar(right).fetch_one(&pool).await.unwrap();
                assert_eq!(right, ROWS, "every digest is its key's");
            }
            for key in ["k1", "k100000", "k200000"] {
                let shown = idem(&case.url, &["show", "t_up", key, "--json"]).output().expect("idem");
                let json: serde_json::Value = serde_json::from_slice(&shown.stdout).expect("json");
                assert_eq!(json["record"]["key"], key, "{key} found by its digest");
            }
            B::drop_private(pool, &name).await;
        }
    };
}

fn url_with_database(url: &str, name: &str) -> String {
    let base = url.rsplit_once('/').map_or(url, |(base, _)| base);
    format!("{base}/{name}")
}

crash_case!(
    mariadb_migration_killed_halfway_through_the_backfill_finishes,
    MySql,
    |name: &str| Case {
        fill: "INSERT INTO idem_record (biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) \
               SELECT 't_up', CONCAT('k', seq), NULL, REPEAT('0', 64), 1, '{}', 0, 0, 33000000000000 FROM seq_1_to_200000",
        digests_right: Some(
            "SELECT COUNT(*) FROM idem_record WHERE key_digest = UNHEX(LEFT(SHA2(CONCAT(biz_type, CHAR(0), idem_key), 256), 32))"
        ),
        url: url_with_database(&idempotency_testkit::mysql_url(), name),
    },
    // Some batches of the backfill committed (the column exists by then).
    |pool: &Pool<sqlx::MySql>| {
        let pool = pool.clone();
        async move {
            let filled: Result<i64, _> =
                sqlx::query_scalar("SELECT COUNT(*) FROM idem_record WHERE key_digest IS NOT NULL")
                    .fetch_one(&pool)
                    .await;
            filled.is_ok_and(|n| n > 0)
        }
    },
    |pool: &Pool<sqlx::MySql>| {
        let pool = pool.clone();
        async move {
            let filled: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_record WHERE key_digest IS NOT NULL")
                .fetch_one(&pool)
                .await
                .unwrap();
            assert!(filled > 0 && filled < ROWS, "killed halfway: {filled} of {ROWS} filled");
        }
    }
);

crash_case!(
    postgres_migration_killed_inside_its_transaction_leaves_the_table_as_it_was,
    Postgres,
    |name: &str| Case {
        fill: "INSERT INTO idem_record (biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) \
               SELECT 't_up', 'k' || g, NULL, repeat('0', 64), 1, '{}', 0, 0, 33000000000000 FROM generate_series(1, 200000) g",
        digests_right: Some(
            "SELECT COUNT(*) FROM idem_record WHERE key_digest = encode(substring(sha256(convert_to(biz_type, 'UTF8') \
             || decode('00', 'hex') || convert_to(idem_key, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid"
        ),
        url: url_with_database(&idempotency_testkit::pg_url(), name),
    },
    // The digests' UPDATE is running.
    |pool: &Pool<sqlx::Postgres>| {
        let pool = pool.clone();
        async move {
            let running: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE state = 'active' AND pid <> pg_backend_pid() \
                 AND query LIKE '%UPDATE idem_record SET key_digest%'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            running > 0
        }
    },
    |pool: &Pool<sqlx::Postgres>| {
        let pool = pool.clone();
        async move {
            // The server ends the dead client's transaction: nothing of it stays.
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let column: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM information_schema.columns WHERE table_name = 'idem_record' AND column_name = 'key_digest'",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                if column == 0 {
                    break;
                }
                assert!(Instant::now() < deadline, "the killed migration's column is still there");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
);

crash_case!(
    sqlite_migration_killed_inside_its_transaction_leaves_the_table_as_it_was,
    Sqlite,
    |name: &str| Case {
        fill: "INSERT INTO idem_record (biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) \
               WITH RECURSIVE n (i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 200000) \
               SELECT 't_up', 'k' || i, NULL, printf('%064d', 0), 1, '{}', 0, 0, 33000000000000 FROM n",
        digests_right: None,
        url: format!("sqlite:{}", Sqlite::dir().join(format!("{name}.db")).display()),
    },
    // The migration holds the write lock: it is inside its transaction.
    |pool: &Pool<sqlx::Sqlite>| {
        let pool = pool.clone();
        async move {
            let mut conn = pool.acquire().await.unwrap();
            sqlx::raw_sql("PRAGMA busy_timeout = 0").execute(&mut *conn).await.unwrap();
            let locked = sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut *conn).await.is_err();
            if !locked {
                sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
            }
            sqlx::raw_sql("PRAGMA busy_timeout = 30000").execute(&mut *conn).await.unwrap();
            locked
        }
    },
    |pool: &Pool<sqlx::Sqlite>| {
        let pool = pool.clone();
        async move {
            let tables: Vec<String> =
                sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'idem_record%'")
                    .fetch_all(&pool)
                    .await
                    .unwrap();
            assert_eq!(tables, ["idem_record"], "the killed migration's transaction rolled back");
        }
    }
);
