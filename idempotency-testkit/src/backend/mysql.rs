//! MySQL/MariaDB (`IDEM_MYSQL_URL`).

use std::str::FromStr;
use std::time::Duration;

use sqlx::Pool;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};

use super::TestBackend;
use crate::{mysql_url, reach};

/// MySQL/MariaDB: the server's `test` database, private ones beside it.
pub struct MySql;

const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_test_ledger (
    id BIGINT AUTO_INCREMENT PRIMARY KEY, k VARCHAR(300) NOT NULL, amount BIGINT NOT NULL, KEY (k))";

impl TestBackend for MySql {
    type Db = sqlx::MySql;

    const NAME: &'static str = "mysql";

    const INSERT_LEDGER: &'static str = "INSERT INTO idem_test_ledger (k, amount) VALUES (?, ?)";
    const COUNT_LEDGER: &'static str = "SELECT COUNT(*) FROM idem_test_ledger WHERE k = ?";
    // By the unique digest, computed by the server from `(biz, key)`: a
    // statement by `biz_type` and `idem_key` alone would scan (and, for a
    // write, lock) every row of the shared table.
    const COUNT_RECORDS_KEY: &'static str =
        "SELECT COUNT(*) FROM idem_record WHERE key_digest = UNHEX(LEFT(SHA2(CONCAT(?, CHAR(0), ?), 256), 32))";
    const DELETE_RECORD: &'static str =
        "DELETE FROM idem_record WHERE key_digest = UNHEX(LEFT(SHA2(CONCAT(?, CHAR(0), ?), 256), 32))";
    const CORRUPT: &'static str =
        "UPDATE idem_record SET response = ? WHERE key_digest = UNHEX(LEFT(SHA2(CONCAT(?, CHAR(0), ?), 256), 32))";
    const BIZ_NO: &'static str =
        "SELECT biz_no FROM idem_record WHERE key_digest = UNHEX(LEFT(SHA2(CONCAT(?, CHAR(0), ?), 256), 32))";
    const RECORD_TABLE_BEFORE_DIGEST: &'static str = "CREATE TABLE idem_record (
        id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT PRIMARY KEY,
        biz_type VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
        idem_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
        biz_no VARCHAR(64) NULL,
        params_hash CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
        status SMALLINT NOT NULL,
        response LONGTEXT NULL,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL,
        expires_at BIGINT NOT NULL,
        UNIQUE KEY uk_idem_record_biz_key (biz_type, idem_key),
        KEY idx_idem_record_biz_no (biz_type, biz_no),
        KEY idx_idem_record_expires_at (expires_at)
    ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4";
    const INSERT_RECORD_BEFORE_DIGEST: &'static str = "INSERT INTO idem_record (biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)";
    const RECORD_UNIQUE_INDEXES: &'static str = "SELECT CAST(GROUP_CONCAT(COLUMN_NAME ORDER BY SEQ_IN_INDEX) AS CHAR) FROM information_schema.STATISTICS \
        WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'idem_record' AND NON_UNIQUE = 0 AND INDEX_NAME <> 'PRIMARY' GROUP BY INDEX_NAME";
    const LOCKABLE_ROWS_DDL: &'static str = "CREATE TABLE IF NOT EXISTS idem_classify (id INT PRIMARY KEY, v INT NOT NULL); INSERT IGNORE INTO idem_classify VALUES (1, 0), (2, 0)";

    const LOCK_WAIT_BOUNDED: bool = true;
    const ONE_WRITER: bool = false;

    async fn open(_name: &str, max_connections: u32) -> Option<Pool<sqlx::MySql>> {
        reach(Self::NAME, || async {
            MySqlPoolOptions::new()
                .max_connections(max_connections)
                .acquire_timeout(Duration::from_secs(60))
                .connect(&mysql_url())
                .await
                .ok()
        })
        .await
    }

    async fn open_private(name: &str, max_connections: u32) -> Option<Pool<sqlx::MySql>> {
        let admin = Self::open(name, 1).await?;
        let create = sqlx::AssertSqlSafe(format!("CREATE DATABASE `{name}`"));
        sqlx::raw_sql(create).execute(&admin).await.expect("create database");
        admin.close().await;
        let options = MySqlConnectOptions::from_str(&mysql_url()).expect("mysql url").database(name);
        Some(
            MySqlPoolOptions::new()
                .max_connections(max_connections)
                .connect_with(options)
                .await
                .expect("private database"),
        )
    }

    async fn drop_private(pool: Pool<sqlx::MySql>, name: &str) {
        pool.close().await;
        let admin = Self::open(name, 1).await.expect("mysql");
        let drop = sqlx::AssertSqlSafe(format!("DROP DATABASE `{name}`"));
        sqlx::raw_sql(drop).execute(&admin).await.expect("drop database");
    }

    /// Nothing listens on port 1.
    fn dead_pool() -> Pool<sqlx::MySql> {
        MySqlPoolOptions::new()
            .acquire_timeout(Duration::from_secs(2))
            .connect_lazy("mysql://root@127.0.0.1:1/test")
            .expect("lazy pool")
    }

    async fn prepare(pool: &Pool<sqlx::MySql>) {
        sqlx::raw_sql(LEDGER_DDL).execute(pool).await.expect("ledger table");
    }
}
