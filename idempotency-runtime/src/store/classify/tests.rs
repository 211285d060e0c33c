//! Every row of the failure table (`docs/guarantees.md`, "What a failure
//! answers"), provoked on the servers of this machine (`IDEM_MYSQL_URL`,
//! `IDEM_PG_URL`; SQLite in a temporary file): each error's class by code,
//! and what a caller is told of it (`Error::from` for a body's statement,
//! `Error::from_store` for the engine's own). Skipped when a server does not
//! answer, unless `IDEM_REQUIRE_SERVICES=1`.

#[cfg(any(feature = "mysql", feature = "postgres"))]
use std::time::Duration;

use sqlx::Executor;
#[cfg(any(feature = "mysql", feature = "postgres"))]
use sqlx::Pool;

use super::{ErrorClass, classify};
use crate::error::Error;
#[cfg(any(feature = "mysql", feature = "postgres"))]
use crate::store::Pooling;

/// `error` is of `class`, and a caller is told to retry it exactly when
/// the class passes.
#[track_caller]
fn is(error: sqlx::Error, class: ErrorClass) {
    assert_eq!(classify(&error), class, "{error:?}");
    let retry = matches!(class, ErrorClass::Transient | ErrorClass::LockTimeout | ErrorClass::Conflict);
    let told = Error::from(error);
    assert_eq!(told.is_retryable(), retry, "{told:?}");
    match class {
        ErrorClass::Transient | ErrorClass::LockTimeout | ErrorClass::Conflict => {
            assert!(matches!(told, Error::Storage(_)), "{told:?}")
        }
        ErrorClass::Duplicate | ErrorClass::Schema | ErrorClass::Final => {
            assert!(matches!(told, Error::StorageRefused(_)), "{told:?}")
        }
    }
}

/// `error`, raised by one of the engine's own statements: a missing table
/// or column is `NotMigrated`, and final.
#[track_caller]
fn engine_table_missing(error: sqlx::Error) {
    assert_eq!(classify(&error), ErrorClass::Schema, "{error:?}");
    let told = Error::from_store(error);
    assert!(matches!(told, Error::NotMigrated(_)) && !told.is_retryable(), "{told:?}");
    assert!(told.to_string().contains("migrate"), "{told}");
}

#[cfg(any(feature = "mysql", feature = "postgres"))]
fn unreachable(service: &str, e: impl std::fmt::Display) {
    assert!(std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(), "{service} unreachable: {e}");
    eprintln!("skipped: {service} unreachable ({e})");
}

async fn fails<'e, E: Executor<'e>>(on: E, sql: &'static str) -> sqlx::Error {
    match sqlx::raw_sql(sql).execute(on).await {
        Ok(_) => panic!("`{sql}` succeeded"),
        Err(e) => e,
    }
}

/// Neither the network nor the pool is the call's fault, whatever the backend.
#[cfg(all(feature = "postgres", feature = "sqlite"))]
#[tokio::test]
async fn a_refused_connection_and_a_pool_timeout_pass() {
    let refused = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(5))
        .connect("postgres://postgres@127.0.0.1:1/test")
        .await
        .unwrap_err();
    is(refused, ErrorClass::Transient);
    let file = std::env::temp_dir().join(format!("idem-classify-pool-{}.db", crate::random::token()));
    let options = sqlx::sqlite::SqliteConnectOptions::new().filename(&file).create_if_missing(true);
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(100))
        .connect_with(options)
        .await
        .unwrap();
    let held = pool.acquire().await.unwrap();
    is(pool.acquire().await.unwrap_err(), ErrorClass::Transient);
    drop(held);
    pool.close().await;
    is(pool.acquire().await.unwrap_err(), ErrorClass::Transient);
    let _ = std::fs::remove_file(file);
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_failures_are_classified_by_code() {
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    let file = std::env::temp_dir().join(format!("idem-classify-{}.db", crate::random::token()));
    let options = SqliteConnectOptions::new().filename(&file).create_if_missing(true);
    let pool = SqlitePoolOptions::new().max_connections(2).connect_with(options.clone()).await.expect("sqlite");
    sqlx::raw_sql(
        "CREATE TABLE idem_classify (id INT PRIMARY KEY, v INT NOT NULL);
         CREATE TABLE idem_classify_strict (v INTEGER) STRICT;
         INSERT INTO idem_classify VALUES (1, 0), (2, 0)",
    )
    .execute(&pool)
    .await
    .expect("ddl");

    // A body's own constraint, data, SQL: final.
    is(fails(&pool, "INSERT INTO idem_classify VALUES (1, 0)").await, ErrorClass::Duplicate);
    is(fails(&pool, "INSERT INTO idem_classify VALUES (3, NULL)").await, ErrorClass::Final);
    is(fails(&pool, "INSERT INTO idem_classify_strict VALUES ('not a number')").await, ErrorClass::Final);
    is(fails(&pool, "SELEC 1").await, ErrorClass::Schema);
    // The engine's table missing: `migrate` has not run.
    engine_table_missing(fails(&pool, "SELECT status FROM idem_record").await);

    // The write lock held past the busy timeout: a lock wait.
    let mut holder = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    sqlx::raw_sql("UPDATE idem_classify SET v = v + 1 WHERE id = 1").execute(&mut *holder).await.unwrap();
    let mut other = pool.acquire().await.unwrap().detach();
    sqlx::raw_sql("PRAGMA busy_timeout = 100").execute(&mut other).await.unwrap();
    is(fails(&mut other, "UPDATE idem_classify SET v = v + 1 WHERE id = 2").await, ErrorClass::LockTimeout);
    drop((holder, other));

    // A file that cannot be opened: the file's "connection refused".
    let nowhere = SqliteConnectOptions::new().filename(file.with_extension("missing").join("db"));
    is(SqlitePoolOptions::new().connect_with(nowhere).await.unwrap_err(), ErrorClass::Transient);

    // A file opened read-only stays so: final.
    let read_only = SqlitePoolOptions::new().connect_with(options.read_only(true)).await.unwrap();
    is(fails(&read_only, "UPDATE idem_classify SET v = 0").await, ErrorClass::Final);
    read_only.close().await;
    pool.close().await;
    let _ = std::fs::remove_file(file);
}

#[cfg(feature = "mysql")]
mod mysql {
    use sqlx::mysql::{MySql, MySqlConnectOptions, MySqlPoolOptions};

    use super::*;

    fn url() -> String {
        std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
    }

    async fn pool() -> Option<Pool<MySql>> {
        match MySqlPoolOptions::new().max_connections(4).connect(&url()).await {
            Ok(pool) => Some(pool),
            Err(e) => {
                unreachable("mysql", e);
                None
            }
        }
    }

    // A table per test: the two run at once, and one's locks must not
    // hold the other's statements.
    const DDL: &str =
        "CREATE TABLE IF NOT EXISTS idem_classify_rows (id INT PRIMARY KEY, v INT NOT NULL, s VARCHAR(8) NULL);
        INSERT IGNORE INTO idem_classify_rows (id, v) VALUES (1, 0), (2, 0)";
    const DDL_FINAL: &str =
        "CREATE TABLE IF NOT EXISTS idem_classify_final (id INT PRIMARY KEY, v INT NOT NULL, s VARCHAR(8) NULL);
        INSERT IGNORE INTO idem_classify_final (id, v) VALUES (1, 0), (2, 0)";

    /// A body's own constraint, data, SQL and privileges: final; the
    /// engine's missing table: `NotMigrated`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn what_recurs_is_final() {
        let Some(pool) = pool().await else { return };
        sqlx::raw_sql(DDL_FINAL).execute(&pool).await.expect("ddl");
        is(fails(&pool, "INSERT INTO idem_classify_final (id, v) VALUES (1, 0)").await, ErrorClass::Duplicate);
        is(fails(&pool, "INSERT INTO idem_classify_final (id, v) VALUES (3, NULL)").await, ErrorClass::Final);
        // 1406: data too long (strict mode, MariaDB's default).
        is(
            fails(&pool, "UPDATE idem_classify_final SET s = 'longer than eight' WHERE id = 1").await,
            ErrorClass::Final,
        );
        is(fails(&pool, "SELEC 1").await, ErrorClass::Final);
        engine_table_missing(fails(&pool, "SELECT status FROM idem_record_never_created").await);
        engine_table_missing(fails(&pool, "SELECT no_such_column FROM idem_classify_final").await);

        // 1153: a packet over max_allowed_packet (the measured case: a
        // result too large for MariaDB, 503 and a body run on every retry).
        let max: i64 = sqlx::raw_sql("SELECT CAST(@@max_allowed_packet AS SIGNED)")
            .fetch_one(&pool)
            .await
            .map(|row| {
                use sqlx::Row;
                row.get::<i64, _>(0)
            })
            .unwrap();
        let huge = "x".repeat(usize::try_from(max).unwrap() + 1024);
        let mut conn = pool.acquire().await.unwrap().detach();
        let over = Pooling::Session.query::<MySql>("SELECT LENGTH(?)").bind(huge).execute(&mut conn).await.unwrap_err();
        is(over, ErrorClass::Final);

        // 1142: a table this user may not read.
        sqlx::raw_sql(
            "CREATE DATABASE IF NOT EXISTS idem_classify_private;
             CREATE TABLE IF NOT EXISTS idem_classify_private.t (id INT PRIMARY KEY);
             CREATE USER IF NOT EXISTS 'idem_classify_limited'@'%';
             GRANT SELECT ON test.* TO 'idem_classify_limited'@'%'",
        )
        .execute(&pool)
        .await
        .expect("limited user");
        let limited: MySqlConnectOptions =
            url().parse::<MySqlConnectOptions>().unwrap().username("idem_classify_limited");
        let limited = MySqlPoolOptions::new().max_connections(1).connect_with(limited).await.expect("limited user");
        is(fails(&limited, "SELECT id FROM idem_classify_private.t").await, ErrorClass::Final);
        limited.close().await;
    }

    /// Lock waits, deadlocks, a read-only transaction, a killed statement,
    /// too many connections: they pass.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn what_passes_is_transient() {
        let Some(pool) = pool().await else { return };
        sqlx::raw_sql(DDL).execute(&pool).await.expect("ddl");

        // 1205 and 1213.
        let mut a = pool.begin().await.unwrap();
        sqlx::raw_sql("UPDATE idem_classify_rows SET v = v + 1 WHERE id = 1").execute(&mut *a).await.unwrap();
        let mut b = pool.acquire().await.unwrap().detach();
        sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = 1").execute(&mut b).await.unwrap();
        is(fails(&mut b, "UPDATE idem_classify_rows SET v = v + 1 WHERE id = 1").await, ErrorClass::LockTimeout);
        drop(b);
        let mut b = pool.begin().await.unwrap();
        sqlx::raw_sql("UPDATE idem_classify_rows SET v = v + 1 WHERE id = 2").execute(&mut *b).await.unwrap();
        let a_id = connection_id(&mut a).await;
        let mut a_waits = tokio::spawn(async move {
            let r = sqlx::raw_sql("UPDATE idem_classify_rows SET v = v + 1 WHERE id = 2").execute(&mut *a).await;
            (a, r)
        });
        // `a` waits on `b`'s row: then `b` closes the circle.
        tokio::select! {
            () = wait_until_waiting(&pool, a_id) => {}
            // Seen twice under the full suite's load: `a` never shown waiting
            // (both transactions running); this tells how its statement ended.
            ended = &mut a_waits => panic!("`a` got past `b`'s row lock without waiting: {:?}", ended.unwrap().1.map(drop)),
        }
        let b_result = sqlx::raw_sql("UPDATE idem_classify_rows SET v = v + 1 WHERE id = 1").execute(&mut *b).await;
        let (a, a_result) = a_waits.await.unwrap();
        let deadlock = match (a_result, b_result) {
            (Err(e), _) | (_, Err(e)) => e,
            (Ok(_), Ok(_)) => panic!("no deadlock"),
        };
        is(deadlock, ErrorClass::Conflict);
        // Ended now, not on the connections' next use: the survivor holds both rows.
        let _ = a.rollback().await;
        let _ = b.rollback().await;

        // 1792: a write in a read-only transaction (a server turned read-only answers 1290).
        let mut read_only = pool.begin_with("START TRANSACTION READ ONLY").await.unwrap();
        is(fails(&mut *read_only, "UPDATE idem_classify_rows SET v = 0 WHERE id = 1").await, ErrorClass::Transient);
        let _ = read_only.rollback().await;

        // 1317: a statement killed while it runs (MariaDB raises it for an
        // interrupted SLEEP too; MySQL would return 1).
        let mut victim = pool.acquire().await.unwrap().detach();
        let victim_id = connection_id(&mut victim).await;
        let sleeping =
            tokio::spawn(async move { sqlx::raw_sql("SELECT SLEEP(30)").execute(&mut victim).await.map(drop) });
        let start = std::time::Instant::now();
        loop {
            let running: i64 = Pooling::Session
                .query_scalar(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ? AND INFO = 'SELECT SLEEP(30)'",
                )
                .bind(victim_id)
                .fetch_one(&pool)
                .await
                .unwrap();
            if running > 0 {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "the statement never ran");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL QUERY {victim_id}"))).execute(&pool).await.unwrap();
        is(sleeping.await.unwrap().unwrap_err(), ErrorClass::Transient);

        // 1226 / 1203: past the user's connection limit.
        sqlx::raw_sql(
            "CREATE USER IF NOT EXISTS 'idem_classify_one'@'%' WITH MAX_USER_CONNECTIONS 1;
             GRANT SELECT ON test.* TO 'idem_classify_one'@'%'",
        )
        .execute(&pool)
        .await
        .expect("user with one connection");
        let one: MySqlConnectOptions = url().parse::<MySqlConnectOptions>().unwrap().username("idem_classify_one");
        let first = sqlx::ConnectOptions::connect(&one).await.expect("the first connection");
        let second = sqlx::ConnectOptions::connect(&one).await.map(drop).unwrap_err();
        is(second, ErrorClass::Transient);
        drop(first);
    }

    async fn connection_id(conn: &mut sqlx::MySqlConnection) -> i64 {
        use sqlx::Row;
        sqlx::raw_sql("SELECT CAST(CONNECTION_ID() AS SIGNED)").fetch_one(conn).await.unwrap().get(0)
    }

    /// Until connection `id` waits on a row lock: the event the test needs,
    /// polled on the server's own view.
    async fn wait_until_waiting(pool: &Pool<MySql>, id: i64) {
        let start = std::time::Instant::now();
        loop {
            let waiting: i64 = Pooling::Session
                .query_scalar(
                    "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT' AND trx_mysql_thread_id = ?",
                )
                .bind(id)
                .fetch_one(pool)
                .await
                .unwrap();
            if waiting > 0 {
                return;
            }
            if start.elapsed() > Duration::from_secs(30) {
                let trx: Vec<(String, i64)> = Pooling::Session
                    .query_as(
                        "SELECT trx_state, CAST(trx_mysql_thread_id AS SIGNED) FROM information_schema.INNODB_TRX",
                    )
                    .fetch_all(pool)
                    .await
                    .unwrap();
                let threads: Vec<(i64, String, Option<String>, Option<String>)> = Pooling::Session
                    .query_as(
                        "SELECT CAST(ID AS SIGNED), COMMAND, STATE, INFO FROM information_schema.PROCESSLIST WHERE DB = 'test'",
                    )
                    .fetch_all(pool)
                    .await
                    .unwrap();
                panic!("connection {id} never waited on a lock: {trx:?}; threads: {threads:?}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions, Postgres};

    use super::*;

    fn url() -> String {
        std::env::var("IDEM_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
    }

    async fn pool() -> Option<Pool<Postgres>> {
        match PgPoolOptions::new().max_connections(4).connect(&url()).await {
            Ok(pool) => Some(pool),
            Err(e) => {
                unreachable("postgres", e);
                None
            }
        }
    }

    const DDL: &str = "SELECT pg_advisory_xact_lock(7306232718293614);
        CREATE TABLE IF NOT EXISTS idem_classify (id INT PRIMARY KEY, v INT NOT NULL);
        INSERT INTO idem_classify VALUES (1, 0), (2, 0) ON CONFLICT DO NOTHING;
        DO $$ BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'idem_classify_limited') THEN
                CREATE ROLE idem_classify_limited LOGIN CONNECTION LIMIT 1;
            END IF;
        END $$";

    /// A body's own constraint, data, SQL and privileges: final; the
    /// engine's missing table: `NotMigrated`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn what_recurs_is_final() {
        let Some(pool) = pool().await else { return };
        sqlx::raw_sql(DDL).execute(&pool).await.expect("ddl");
        is(fails(&pool, "INSERT INTO idem_classify VALUES (1, 0)").await, ErrorClass::Duplicate);
        is(fails(&pool, "INSERT INTO idem_classify VALUES (3, NULL)").await, ErrorClass::Final);
        // 22021: a NUL in text (the measured case: 503 on every try, a
        // message requeued for ever).
        let nul = Pooling::Session.query::<Postgres>("SELECT $1::TEXT").bind("a\0b").execute(&pool).await.unwrap_err();
        is(nul, ErrorClass::Final);
        is(fails(&pool, "SELEC 1").await, ErrorClass::Final);
        engine_table_missing(fails(&pool, "SELECT status FROM idem_record_never_created").await);
        engine_table_missing(fails(&pool, "SELECT no_such_column FROM idem_classify").await);
        // 42501: a table this role may not read.
        let mut tx = pool.begin().await.unwrap();
        sqlx::raw_sql("SET LOCAL ROLE idem_classify_limited").execute(&mut *tx).await.unwrap();
        is(fails(&mut *tx, "SELECT v FROM idem_classify").await, ErrorClass::Final);
    }

    /// Lock waits, deadlocks, serialization failures, a read-only
    /// transaction, a terminated backend, too many connections: they pass.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn what_passes_is_transient() {
        let Some(pool) = pool().await else { return };
        sqlx::raw_sql(DDL).execute(&pool).await.expect("ddl");

        // 55P03 and 40P01.
        let mut a = pool.begin().await.unwrap();
        sqlx::raw_sql("UPDATE idem_classify SET v = v + 1 WHERE id = 1").execute(&mut *a).await.unwrap();
        let mut b = pool.begin().await.unwrap();
        sqlx::raw_sql("SET LOCAL lock_timeout = 100").execute(&mut *b).await.unwrap();
        is(fails(&mut *b, "UPDATE idem_classify SET v = v + 1 WHERE id = 1").await, ErrorClass::LockTimeout);
        drop(b);
        let mut b = pool.begin().await.unwrap();
        sqlx::raw_sql("UPDATE idem_classify SET v = v + 1 WHERE id = 2").execute(&mut *b).await.unwrap();
        let a_pid = backend_pid(&mut a).await;
        let a_waits = tokio::spawn(async move {
            let r = sqlx::raw_sql("UPDATE idem_classify SET v = v + 1 WHERE id = 2").execute(&mut *a).await;
            (a, r)
        });
        wait_until_blocked(&pool, a_pid).await;
        let b_result = sqlx::raw_sql("UPDATE idem_classify SET v = v + 1 WHERE id = 1").execute(&mut *b).await;
        let (a, a_result) = a_waits.await.unwrap();
        let deadlock = match (a_result, b_result) {
            (Err(e), _) | (_, Err(e)) => e,
            (Ok(_), Ok(_)) => panic!("no deadlock"),
        };
        is(deadlock, ErrorClass::Conflict);
        // Ended now, not on the connections' next use: the survivor holds both rows.
        let _ = a.rollback().await;
        let _ = b.rollback().await;

        // 40001: two serializable transactions that read what the other writes.
        let serializable = "BEGIN ISOLATION LEVEL SERIALIZABLE";
        let (mut a, mut b) =
            (pool.begin_with(serializable).await.unwrap(), pool.begin_with(serializable).await.unwrap());
        for tx in [&mut a, &mut b] {
            sqlx::raw_sql("SELECT SUM(v) FROM idem_classify").execute(&mut **tx).await.unwrap();
        }
        sqlx::raw_sql("UPDATE idem_classify SET v = v + 1 WHERE id = 1").execute(&mut *a).await.unwrap();
        sqlx::raw_sql("UPDATE idem_classify SET v = v + 1 WHERE id = 2").execute(&mut *b).await.unwrap();
        a.commit().await.unwrap();
        is(b.commit().await.unwrap_err(), ErrorClass::Conflict);

        // 25006: a write in a read-only transaction (as on a standby).
        let mut read_only = pool.begin_with("BEGIN READ ONLY").await.unwrap();
        is(fails(&mut *read_only, "UPDATE idem_classify SET v = 0 WHERE id = 1").await, ErrorClass::Transient);
        let _ = read_only.rollback().await;

        // 57P01 (or the connection closed under it): a backend terminated,
        // as by a server shutting down.
        let mut victim = pool.acquire().await.unwrap().detach();
        let pid = backend_pid(&mut victim).await;
        Pooling::Session.query::<Postgres>("SELECT pg_terminate_backend($1)").bind(pid).execute(&pool).await.unwrap();
        is(fails(&mut victim, "SELECT 1").await, ErrorClass::Transient);

        // 53300: past the role's connection limit.
        let limited: PgConnectOptions = url().parse::<PgConnectOptions>().unwrap().username("idem_classify_limited");
        let first = sqlx::ConnectOptions::connect(&limited).await.expect("the first connection");
        let second = sqlx::ConnectOptions::connect(&limited).await.map(drop).unwrap_err();
        is(second, ErrorClass::Transient);
        drop(first);
    }

    async fn backend_pid(conn: &mut sqlx::PgConnection) -> i32 {
        use sqlx::Row;
        sqlx::raw_sql("SELECT pg_backend_pid()").fetch_one(conn).await.unwrap().get(0)
    }

    /// Until backend `pid` waits on a lock, as the server shows it.
    async fn wait_until_blocked(pool: &Pool<Postgres>, pid: i32) {
        let start = std::time::Instant::now();
        loop {
            let waiting: Option<String> = Pooling::Session
                .query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(pid)
                .fetch_optional(pool)
                .await
                .unwrap()
                .flatten();
            if waiting.as_deref() == Some("Lock") {
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "backend {pid} never waited on a lock");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
