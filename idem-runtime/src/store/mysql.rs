//! MySQL and MariaDB.

use std::time::Duration;

use sqlx::mysql::{MySql, MySqlDatabaseError};
use sqlx::{AssertSqlSafe, Pool, Transaction};

use super::{Backend, Failure, NewRecord, Queries, bind_record, inserted, is_unique_violation, record_queries};

// `find` is a locking read: under REPEATABLE READ a plain SELECT would show
// the transaction's snapshot, not the duplicate committed since.
// Keys compare byte for byte (`ascii_bin`): the default collations ignore
// case, which would merge `Order-1` and `order-1`. Times are epoch ms.
const DDL: &str = "CREATE TABLE IF NOT EXISTS idem_record (
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

/// The insert after its `INSERT` keyword, so a bounded variant can put
/// a hint between the two.
macro_rules! into_record {
    () => {
        "INTO idem_record (biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
    };
}

const Q: Queries = Queries {
    insert: concat!("INSERT ", into_record!()),
    mark_succeeded: "UPDATE idem_record SET status = ?, response = ?, updated_at = ? WHERE biz_type = ? AND idem_key = ?",
    find: "SELECT params_hash, status, response, created_at, expires_at FROM idem_record WHERE biz_type = ? AND idem_key = ? LOCK IN SHARE MODE",
    lookup: "SELECT params_hash, status, response, created_at, expires_at FROM idem_record WHERE biz_type = ? AND idem_key = ?",
    delete_expired: "DELETE FROM idem_record WHERE biz_type = ? AND idem_key = ? AND expires_at <= ?",
    purge_expired: "DELETE FROM idem_record WHERE expires_at <= ? LIMIT ?",
};

const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
const ER_LOCK_DEADLOCK: u16 = 1213;

impl Backend for MySql {
    async fn migrate(pool: &Pool<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(DDL).execute(pool).await.map(drop)
    }

    async fn begin(pool: &Pool<Self>) -> Result<Transaction<'static, Self>, sqlx::Error> {
        pool.begin().await
    }

    async fn begin_bounded(pool: &Pool<Self>, _wait: Duration) -> Result<Transaction<'static, Self>, sqlx::Error> {
        // The bound rides on the insert itself.
        pool.begin().await
    }

    async fn insert_bounded(
        tx: &mut Transaction<'static, Self>,
        rec: &NewRecord<'_>,
        wait: Duration,
    ) -> Result<bool, sqlx::Error> {
        // A bound for this one statement, in one round trip, leaving the
        // session as it was: MariaDB runs the `/*M! ... */` comment
        // (`SET STATEMENT ... FOR`), MySQL 8 the `SET_VAR` hint; each
        // ignores the other's. Built from an integer only.
        let secs = wait.as_secs().max(1);
        let sql = format!(
            "/*M! SET STATEMENT innodb_lock_wait_timeout = {secs} FOR */ INSERT /*+ SET_VAR(innodb_lock_wait_timeout = {secs}) */ {}",
            into_record!()
        );
        let done = bind_record!(sqlx::query(AssertSqlSafe(sql)), rec).execute(&mut **tx).await;
        inserted(done.map(|d| d.rows_affected()))
    }

    record_queries!(Q);

    fn classify(error: &sqlx::Error) -> Failure {
        if is_unique_violation(error) {
            return Failure::Duplicate;
        }
        let number =
            error.as_database_error().and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>()).map(|e| e.number());
        match number {
            Some(ER_LOCK_WAIT_TIMEOUT) => Failure::LockTimeout,
            Some(ER_LOCK_DEADLOCK) => Failure::Conflict,
            _ => Failure::Other,
        }
    }
}
