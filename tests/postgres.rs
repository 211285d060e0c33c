//! Behaviour of `#[idempotent]` on PostgreSQL (`IDEM_PG_URL`), with and
//! without Redis (`IDEM_REDIS_URL`).

mod common;

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

type Db = sqlx::Postgres;

const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_test_ledger (
    id BIGSERIAL PRIMARY KEY, k VARCHAR(300) NOT NULL, amount BIGINT NOT NULL)";
const INSERT_LEDGER: &str = "INSERT INTO idem_test_ledger (k, amount) VALUES ($1, $2)";
const COUNT_LEDGER: &str = "SELECT COUNT(*) FROM idem_test_ledger WHERE k = $1";
const COUNT_RECORDS_KEY: &str = "SELECT COUNT(*) FROM idem_record WHERE biz_type = $1 AND idem_key = $2";
/// Whether a duplicate's wait on the record is bounded by `lock_wait`.
const LOCK_WAIT_BOUNDED: bool = true;
/// One writer at a time: a second transaction waits for the first to end.
const ONE_WRITER: bool = false;
/// Two rows to lock, for the error-classification test.
const CLASSIFY_DDL: &str = "SELECT pg_advisory_xact_lock(7306232718293614); CREATE TABLE IF NOT EXISTS idem_classify (id INT PRIMARY KEY, v INT NOT NULL); INSERT INTO idem_classify VALUES (1, 0), (2, 0) ON CONFLICT DO NOTHING";
const DELETE_RECORD: &str = "DELETE FROM idem_record WHERE biz_type = $1 AND idem_key = $2";
const CORRUPT: &str = "UPDATE idem_record SET response = $1 WHERE biz_type = $2 AND idem_key = $3";
const BIZ_NO: &str = "SELECT biz_no FROM idem_record WHERE biz_type = $1 AND idem_key = $2";

async fn open(_name: &str, max_connections: u32) -> Option<sqlx::Pool<Db>> {
    common::reach("postgres", || async {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(std::time::Duration::from_secs(60))
            .connect(&common::pg_url())
            .await
            .ok()
    })
    .await
}

/// A database of its own, for a test that must see every row of
/// `idem_record`; `name` is a plain identifier (`[a-z0-9_]`).
async fn open_private(name: &str) -> Option<sqlx::Pool<Db>> {
    let admin = open(name, 1).await?;
    let create = sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"));
    sqlx::raw_sql(create).execute(&admin).await.expect("create database");
    admin.close().await;
    let options = PgConnectOptions::from_str(&common::pg_url()).expect("postgres url").database(name);
    Some(PgPoolOptions::new().max_connections(2).connect_with(options).await.expect("private database"))
}

/// Drops a database `open_private` made.
async fn drop_private(pool: sqlx::Pool<Db>, name: &str) {
    pool.close().await;
    let admin = open(name, 1).await.expect("postgres");
    let drop = sqlx::AssertSqlSafe(format!("DROP DATABASE {name} WITH (FORCE)"));
    sqlx::raw_sql(drop).execute(&admin).await.expect("drop database");
}

/// A pool whose server never answers (nothing listens on port 1).
fn dead_pool() -> sqlx::Pool<Db> {
    PgPoolOptions::new()
        .acquire_timeout(std::time::Duration::from_secs(2))
        .connect_lazy("postgres://postgres@127.0.0.1:1/test")
        .expect("lazy pool")
}

async fn prepare(pool: &sqlx::Pool<Db>) {
    // Concurrent CREATE TABLE IF NOT EXISTS can collide in the catalog.
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock(7306232718293612)").execute(&mut *tx).await.expect("lock");
    sqlx::raw_sql(LEDGER_DDL).execute(&mut *tx).await.expect("ledger table");
    tx.commit().await.expect("commit");
}

include!("suite/mod.rs");

#[idempotent(key = "<k>", ttl = "1h", biz = "t_pg_lock_timeout")]
async fn lock_timeout_in_body(idem: &Idem<Db>, tx: &mut Transaction<'_, Db>, k: String) -> Result<String, TestError> {
    Ok(sqlx::query_scalar("SHOW lock_timeout").fetch_one(&mut **tx).await?)
}

/// Regression: the record's lock-wait bound is put back to the session's own
/// `lock_timeout` (not the server default) before the body runs.
#[tokio::test]
async fn the_body_sees_the_sessions_own_lock_timeout() {
    let Some(pool) = common::reach("postgres", || async {
        PgPoolOptions::new()
            .max_connections(1)
            .after_connect(|conn, _| {
                Box::pin(async move { sqlx::raw_sql("SET lock_timeout = '2s'").execute(conn).await.map(drop) })
            })
            .connect(&common::pg_url())
            .await
            .ok()
    })
    .await
    else {
        return;
    };
    let idem = Idem::builder(pool).lock_wait(Duration::from_millis(700)).build();
    idem.migrate().await.expect("migrate");
    assert_eq!(lock_timeout_in_body(&idem, common::unique("pglock")).await.unwrap(), "2s");
}
