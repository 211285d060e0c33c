//! Behaviour of `#[idempotent]` on MySQL/MariaDB (`IDEM_MYSQL_URL`), with and
//! without Redis (`IDEM_REDIS_URL`).

mod common;

use std::str::FromStr;

use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};

type Db = sqlx::MySql;

const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_test_ledger (
    id BIGINT AUTO_INCREMENT PRIMARY KEY, k VARCHAR(300) NOT NULL, amount BIGINT NOT NULL, KEY (k))";
const INSERT_LEDGER: &str = "INSERT INTO idem_test_ledger (k, amount) VALUES (?, ?)";
const COUNT_LEDGER: &str = "SELECT COUNT(*) FROM idem_test_ledger WHERE k = ?";
const COUNT_RECORDS_KEY: &str = "SELECT COUNT(*) FROM idem_record WHERE biz_type = ? AND idem_key = ?";
/// Whether a duplicate's wait on the record is bounded by `lock_wait`.
const LOCK_WAIT_BOUNDED: bool = true;
/// One writer at a time: a second transaction waits for the first to end.
const ONE_WRITER: bool = false;
/// Two rows to lock, for the error-classification test.
const CLASSIFY_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_classify (id INT PRIMARY KEY, v INT NOT NULL); INSERT IGNORE INTO idem_classify VALUES (1, 0), (2, 0)";
const DELETE_RECORD: &str = "DELETE FROM idem_record WHERE biz_type = ? AND idem_key = ?";
const CORRUPT: &str = "UPDATE idem_record SET response = ? WHERE biz_type = ? AND idem_key = ?";
const BIZ_NO: &str = "SELECT biz_no FROM idem_record WHERE biz_type = ? AND idem_key = ?";

async fn open(_name: &str, max_connections: u32) -> Option<sqlx::Pool<Db>> {
    common::reach("mysql", || async {
        MySqlPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(std::time::Duration::from_secs(60))
            .connect(&common::mysql_url())
            .await
            .ok()
    })
    .await
}

/// A database of its own, for a test that must see every row of
/// `idem_record`; `name` is a plain identifier (`[a-z0-9_]`).
async fn open_private(name: &str) -> Option<sqlx::Pool<Db>> {
    let admin = open(name, 1).await?;
    let create = sqlx::AssertSqlSafe(format!("CREATE DATABASE `{name}`"));
    sqlx::raw_sql(create).execute(&admin).await.expect("create database");
    admin.close().await;
    let options = MySqlConnectOptions::from_str(&common::mysql_url()).expect("mysql url").database(name);
    Some(MySqlPoolOptions::new().max_connections(2).connect_with(options).await.expect("private database"))
}

/// Drops a database `open_private` made.
async fn drop_private(pool: sqlx::Pool<Db>, name: &str) {
    pool.close().await;
    let admin = open(name, 1).await.expect("mysql");
    let drop = sqlx::AssertSqlSafe(format!("DROP DATABASE `{name}`"));
    sqlx::raw_sql(drop).execute(&admin).await.expect("drop database");
}

/// A pool whose server never answers (nothing listens on port 1).
fn dead_pool() -> sqlx::Pool<Db> {
    MySqlPoolOptions::new()
        .acquire_timeout(std::time::Duration::from_secs(2))
        .connect_lazy("mysql://root@127.0.0.1:1/test")
        .expect("lazy pool")
}

async fn prepare(pool: &sqlx::Pool<Db>) {
    sqlx::raw_sql(LEDGER_DDL).execute(pool).await.expect("ledger table");
}

include!("suite/mod.rs");
