//! Behaviour of `#[idempotent]` on MySQL/MariaDB (`IDEM_MYSQL_URL`), with and
//! without Redis (`IDEM_REDIS_URL`).

mod common;

use sqlx::mysql::MySqlPoolOptions;

type Db = sqlx::MySql;

const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_test_ledger (
    id BIGINT AUTO_INCREMENT PRIMARY KEY, k VARCHAR(300) NOT NULL, amount BIGINT NOT NULL, KEY (k))";
const INSERT_LEDGER: &str = "INSERT INTO idem_test_ledger (k, amount) VALUES (?, ?)";
const COUNT_LEDGER: &str = "SELECT COUNT(*) FROM idem_test_ledger WHERE k = ?";
const COUNT_RECORDS: &str = "SELECT COUNT(*) FROM idem_record WHERE biz_type = ?";
const COUNT_RECORDS_KEY: &str = "SELECT COUNT(*) FROM idem_record WHERE biz_type = ? AND idem_key = ?";
/// Whether a duplicate's wait on the record is bounded by `lock_wait`.
const LOCK_WAIT_BOUNDED: bool = true;
const CORRUPT: &str = "UPDATE idem_record SET response = ? WHERE biz_type = ? AND idem_key = ?";

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

async fn prepare(pool: &sqlx::Pool<Db>) {
    sqlx::raw_sql(LEDGER_DDL).execute(pool).await.expect("ledger table");
}

include!("suite/mod.rs");
