//! MySQL and MariaDB.

use std::time::Duration;

use sqlx::mysql::{MySql, MySqlDatabaseError};
use sqlx::{AssertSqlSafe, Pool, SqlSafeStr, SqlStr};

use super::outbox::{OutboxQueries, OutboxSql, outbox_queries};

use super::{
    Backend, Db, Dialect, ErrorClass, NewRecord, Queries, RecordSql, Text, TokenQueries, is_unique_violation, on_pool,
    record_queries, token_queries,
};

// `read_locking` is a locking read: under REPEATABLE READ a plain SELECT would show
// the transaction's snapshot, not the duplicate committed since.
// Keys compare byte for byte (`ascii_bin`): the default collations ignore
// case, which would merge `Order-1` and `order-1`. Times are epoch ms.
// Unique on the key's digest (`store::digest`), checked against the full key.
const DDL: &str = "CREATE TABLE IF NOT EXISTS idem_record (
    id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT PRIMARY KEY,
    key_digest BINARY(16) NOT NULL,
    biz_type VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    idem_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    biz_no VARCHAR(64) NULL,
    params_hash CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    status SMALLINT NOT NULL,
    response LONGTEXT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    UNIQUE KEY uk_idem_record_key_digest (key_digest),
    KEY idx_idem_record_biz_no (biz_type, biz_no),
    KEY idx_idem_record_expires_at (expires_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4";

// Purges walk the expiry index (`ORDER BY expires_at`), oldest first.
const Q: Queries = Queries {
    insert: "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    mark_finished: "UPDATE idem_record SET status = ?, response = ?, updated_at = ?, expires_at = ? WHERE key_digest = ? AND biz_type = ? AND idem_key = ?",
    read_locking: "SELECT params_hash, status, response, expires_at FROM idem_record WHERE key_digest = ? AND biz_type = ? AND idem_key = ? LOCK IN SHARE MODE",
    read_plain: "SELECT params_hash, status, response, expires_at FROM idem_record WHERE key_digest = ? AND biz_type = ? AND idem_key = ?",
    delete_expired: "DELETE FROM idem_record WHERE key_digest = ? AND biz_type = ? AND idem_key = ? AND expires_at <= ?",
    purge_expired: "DELETE FROM idem_record WHERE expires_at <= ? ORDER BY expires_at LIMIT ?",
    meta_ddl: "CREATE TABLE IF NOT EXISTS idem_meta (
        name VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
        value VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL
    ) ENGINE = InnoDB",
    init_namespace: "INSERT INTO idem_meta (name, value) VALUES ('namespace', ?) ON DUPLICATE KEY UPDATE name = name",
};

// Issued tokens without Redis (`crate::token::database`). Tokens are
// case-sensitive (base64url): `ascii_bin`, or `aB` and `Ab` would be one token.
const TOKEN_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_token (
    biz_type VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    token CHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    subject VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    used_at BIGINT NULL,
    keep_until BIGINT NOT NULL,
    PRIMARY KEY (biz_type, token),
    KEY idx_idem_token_keep_until (keep_until)
) ENGINE = InnoDB";

const TQ: TokenQueries = TokenQueries {
    insert: "INSERT INTO idem_token (biz_type, token, subject, created_at, expires_at, used_at, keep_until) VALUES (?, ?, ?, ?, ?, NULL, ?)",
    consume: "UPDATE idem_token SET used_at = ?, keep_until = ? WHERE biz_type = ? AND token = ? AND subject = ? AND used_at IS NULL AND expires_at > ?",
    read: "SELECT subject, used_at, expires_at, keep_until FROM idem_token WHERE biz_type = ? AND token = ?",
    give_back: "UPDATE idem_token SET used_at = NULL, keep_until = expires_at WHERE biz_type = ? AND token = ? AND subject = ? AND used_at = ?",
    purge_expired: "DELETE FROM idem_token WHERE keep_until <= ? ORDER BY keep_until LIMIT ?",
};

/// The largest `innodb_lock_wait_timeout` the server takes (2^30 s).
const MAX_LOCK_WAIT_SECS: u64 = 1 << 30;

/// A lock-wait bound as `innodb_lock_wait_timeout` takes it: whole
/// seconds, at least 1.
fn lock_wait_secs(wait: Duration) -> i64 {
    i64::try_from(wait.as_secs().clamp(1, MAX_LOCK_WAIT_SECS)).unwrap_or(1 << 30)
}
/// What MySQL's or MariaDB's error number says of a failure
/// (`store::classify`'s table): `None` for another backend's error.
pub(super) fn class_of(error: &(dyn sqlx::error::DatabaseError + 'static)) -> Option<ErrorClass> {
    let number = error.try_downcast_ref::<MySqlDatabaseError>()?.number();
    Some(match number {
        // ER_LOCK_WAIT_TIMEOUT.
        1205 => ErrorClass::LockTimeout,
        // ER_LOCK_DEADLOCK (also a Galera certification failure).
        1213 => ErrorClass::Conflict,
        // ER_NO_SUCH_TABLE, ER_BAD_FIELD_ERROR.
        1146 | 1054 => ErrorClass::Schema,
        // Too many connections (ER_CON_COUNT_ERROR, ER_TOO_MANY_USER_CONNECTIONS,
        // ER_USER_LIMIT_REACHED); the server shutting down or dropping the
        // connection (ER_SERVER_SHUTDOWN, ER_ABORTING_CONNECTION,
        // ER_CONNECTION_KILLED, ER_NET_* 1154-1161); a read-only server
        // (ER_OPTION_PREVENTS_STATEMENT under --read-only, ER_READ_ONLY_MODE,
        // ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION); a statement interrupted
        // or past its time (ER_QUERY_INTERRUPTED, MariaDB's ER_STATEMENT_TIMEOUT,
        // MySQL's ER_QUERY_TIMEOUT); out of resources (ER_DISK_FULL,
        // ER_OUTOFMEMORY, ER_OUT_OF_RESOURCES, ER_TOO_MANY_CONCURRENT_TRXS);
        // a Galera node not ready yet (ER_UNKNOWN_COM_ERROR); a client
        // dropped for inactivity (MySQL's 4031).
        1040
        | 1203
        | 1226
        | 1053
        | 1152
        | 1927
        | 1154..=1161
        | 1290
        | 1836
        | 1792
        | 1317
        | 1969
        | 3024
        | 1021
        | 1037
        | 1041
        | 1637
        | 1047
        | 4031 => ErrorClass::Transient,
        // Data too long or wrong (1406, 1366), a packet over
        // max_allowed_packet (1153), constraints, syntax, privileges...
        _ => ErrorClass::Final,
    })
}

impl Backend for MySql {}

impl RecordSql for MySql {
    async fn migrate(db: &Db<Self>, namespace: &str) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(DDL).execute(&db.pool).await?;
        super::upgrade::mysql::to_key_digest(&db.pool).await?;
        sqlx::raw_sql(Q.meta_ddl).execute(&db.pool).await?;
        sqlx::raw_sql(TOKEN_DDL).execute(&db.pool).await?;
        on_pool!(db, |on, pooling| pooling.query(Q.init_namespace).bind(namespace).execute(on).await.map(drop))
    }

    /// MariaDB bounds one statement with `SET STATEMENT ... FOR`, written in
    /// a `/*M! */` comment that only MariaDB runs: the session's own setting
    /// is never touched, even if the call is dropped halfway. MySQL has no
    /// per-statement form for this InnoDB variable (its `SET_VAR` hint does
    /// not accept it) and waits `innodb_lock_wait_timeout` instead. Whole
    /// seconds, at least 1; built from an integer only.
    fn bounded(sql: &'static str, wait: Option<Duration>) -> SqlStr {
        match wait {
            Some(wait) => {
                let secs = lock_wait_secs(wait);
                AssertSqlSafe(format!("/*M! SET STATEMENT innodb_lock_wait_timeout = {secs} FOR */ {sql}"))
                    .into_sql_str()
            }
            None => sql.into_sql_str(),
        }
    }

    /// MariaDB's compound statement (`store::text`), until the server
    /// refuses it: MySQL has none outside a stored program, and its calls
    /// then open and insert one by one.
    fn begin_inserting(db: &Db<Self>, rec: &NewRecord<'_>, wait: Duration) -> Option<Text> {
        db.begin_rides
            .load(std::sync::atomic::Ordering::Relaxed)
            .then(|| Dialect::MySql.begin_inserting(rec, lock_wait_secs(wait)))
    }

    /// ER_PARSE_ERROR: the compound statement is not this server's syntax
    /// (nothing of the text ran).
    fn begin_refused(error: &sqlx::Error) -> bool {
        let number = error.as_database_error().and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>());
        number.is_some_and(|e| e.number() == 1064)
    }

    fn insert_committing(rec: &NewRecord<'_>, wait: Duration) -> Option<Text> {
        Some(Dialect::MySql.insert_committing(rec, lock_wait_secs(wait)))
    }

    fn finish_committing(rec: &NewRecord<'_>) -> Option<Text> {
        Some(Dialect::MySql.finish_committing(rec))
    }

    record_queries!(Q);

    token_queries!(TQ);

    fn quote(ident: &str) -> String {
        // A checked identifier holds no quote character.
        format!("`{}`", ident)
    }

    fn placeholder(_n: usize) -> String {
        "?".to_owned()
    }

    fn rows_affected(done: &sqlx::mysql::MySqlQueryResult) -> u64 {
        done.rows_affected()
    }

    /// Under REPEATABLE READ a plain `SELECT` shows the transaction's
    /// snapshot, which may predate the update that just beat us.
    fn latest_committed_suffix() -> &'static str {
        " LOCK IN SHARE MODE"
    }

    // UTC_TIMESTAMP and a fixed epoch: no session time zone takes part.
    async fn clock_us(pool: &Pool<Self>) -> Result<i64, sqlx::Error> {
        super::select_bigint(pool, "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))").await
    }
}

// The transactional outbox (`crate::outbox`). Signed `id`: it is read back.
// Aggregates and destinations compare byte for byte (`utf8mb4_bin`).
const OUTBOX_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_outbox (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    message_id CHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    destination VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    aggregate_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    payload LONGTEXT NOT NULL,
    headers TEXT NULL,
    biz_type VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin NULL,
    idem_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NULL,
    status SMALLINT NOT NULL,
    attempts INT NOT NULL DEFAULT 0,
    next_attempt_at BIGINT NOT NULL,
    last_error VARCHAR(1024) NULL,
    created_at BIGINT NOT NULL,
    sent_at BIGINT NULL,
    UNIQUE KEY uk_idem_outbox_message_id (message_id),
    KEY idx_idem_outbox_pending (status, id),
    KEY idx_idem_outbox_aggregate (aggregate_key, status, id),
    KEY idx_idem_outbox_sent_at (status, sent_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4";

// One row per aggregate, locked by each event's insert (`store::outbox`).
// The key is the primary key: the upsert's lock is on that record only,
// no gap, so writers of other aggregates never wait for it.
const OUTBOX_AGGREGATE_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_outbox_aggregate (
    aggregate_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL PRIMARY KEY,
    queued BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    KEY idx_idem_outbox_aggregate_created_at (created_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4";

// `pick` locks its rows only (`outbox_begin` reads committed: no gap locks);
// its `NOT EXISTS` is a plain read, so a row another relay holds still
// counts as pending and holds back the later rows of its aggregate.
// `lock_aggregate` changes the row each time (`queued + 1`): Galera
// certifies written rows only, so two nodes queueing for one aggregate at
// once conflict at commit instead of interleaving their ids.
const OQ: OutboxQueries = OutboxQueries {
    lock_aggregate: Some(
        "INSERT INTO idem_outbox_aggregate (aggregate_key, queued, created_at) VALUES (?, 1, ?) ON DUPLICATE KEY UPDATE queued = queued + 1",
    ),
    insert: "INSERT INTO idem_outbox (message_id, destination, aggregate_key, payload, headers, biz_type, idem_key, status, attempts, next_attempt_at, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, 0, 0, ?, ?) ON DUPLICATE KEY UPDATE message_id = message_id",
    pick: "SELECT id, message_id, destination, aggregate_key, payload, headers, attempts, created_at FROM idem_outbox o WHERE status = 0 AND next_attempt_at <= ? AND NOT EXISTS (SELECT 1 FROM idem_outbox p WHERE p.aggregate_key = o.aggregate_key AND p.status IN (0, 2) AND p.id < o.id) ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED",
    mark_failed: "UPDATE idem_outbox SET status = ?, attempts = ?, next_attempt_at = ?, last_error = ? WHERE id = ?",
    purge_sent: "DELETE FROM idem_outbox WHERE status = 1 AND sent_at <= ? ORDER BY sent_at LIMIT ?",
    list_dead: "SELECT id, message_id, destination, aggregate_key, payload, headers, attempts, created_at, last_error, biz_type, idem_key FROM idem_outbox WHERE status = 2 ORDER BY id LIMIT ?",
    retry_dead: "UPDATE idem_outbox SET status = 0, attempts = 0, next_attempt_at = ?, last_error = NULL WHERE message_id = ? AND status = 2",
    discard_dead: "DELETE FROM idem_outbox WHERE message_id = ? AND status = 2",
    count: "SELECT status, COUNT(*) FROM idem_outbox GROUP BY status",
};

impl OutboxSql for MySql {
    async fn outbox_migrate(db: &Db<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(OUTBOX_DDL).execute(&db.pool).await?;
        sqlx::raw_sql(OUTBOX_AGGREGATE_DDL).execute(&db.pool).await.map(drop)
    }

    async fn outbox_begin(pool: &Pool<Self>) -> Result<sqlx::Transaction<'static, Self>, sqlx::Error> {
        // Applies to the next transaction only.
        pool.begin_with("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; BEGIN").await
    }

    /// Picks the rows with `SKIP LOCKED`, then deletes them by key, reading
    /// committed: a range `DELETE` would wait for any writer holding a row
    /// in its range, or the row just past it (repeatable read's next-key
    /// lock), and a writer creating an aggregate's row holds just that one.
    async fn outbox_purge_aggregates(db: &Db<Self>, before_ms: i64, limit: i64) -> Result<u64, sqlx::Error> {
        let mut tx = Self::outbox_begin(&db.pool).await?;
        let keys: Vec<String> = db.pooling.query_scalar("SELECT aggregate_key FROM idem_outbox_aggregate WHERE created_at <= ? ORDER BY created_at LIMIT ? FOR UPDATE SKIP LOCKED")
            .bind(before_ms)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        if keys.is_empty() {
            tx.commit().await?;
            return Ok(0);
        }
        // Built from placeholders only.
        let list = vec!["?"; keys.len()].join(", ");
        let sql = format!("DELETE FROM idem_outbox_aggregate WHERE aggregate_key IN ({list})");
        let mut delete = db.pooling.query(AssertSqlSafe(sql));
        for key in &keys {
            delete = delete.bind(key);
        }
        let done = delete.execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    outbox_queries!(OQ);
}

// Calls to outside services (`crate::steps`; tables described in
// `store::calls`). Signed ids: they are read back. Keys and step names
// compare byte for byte (`ascii_bin`), as in `idem_record`.
const CALL_DDL: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS idem_call (
        id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
        biz_type VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
        idem_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
        biz_no VARCHAR(64) NULL,
        params_hash CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
        status SMALLINT NOT NULL,
        fence BIGINT NOT NULL,
        lease_until BIGINT NOT NULL,
        response LONGTEXT NULL,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL,
        expires_at BIGINT NOT NULL,
        UNIQUE KEY uk_idem_call_biz_key (biz_type, idem_key),
        KEY idx_idem_call_stuck (biz_type, status, lease_until),
        KEY idx_idem_call_expires_at (expires_at)
    ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4",
    "CREATE TABLE IF NOT EXISTS idem_step (
        call_id BIGINT NOT NULL,
        step VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
        step_key CHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
        fence BIGINT NOT NULL,
        response LONGTEXT NOT NULL,
        created_at BIGINT NOT NULL,
        PRIMARY KEY (call_id, step)
    ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4",
];

// The step insert reads the call with a shared lock (`LOCK IN SHARE MODE`,
// said outright rather than left to the isolation level): a takeover
// waits for it, and it waits for a takeover and then sees the new fence.
const CQ: super::calls::CallQueries = super::calls::CallQueries {
    read: "SELECT id, params_hash, status, fence, lease_until, response, expires_at FROM idem_call WHERE biz_type = ? AND idem_key = ?",
    delete_expired: "DELETE FROM idem_call WHERE biz_type = ? AND idem_key = ? AND status <> 0 AND expires_at <= ?",
    take_over: "UPDATE idem_call SET fence = fence + 1, lease_until = ?, updated_at = ? WHERE id = ? AND fence = ? AND status = 0 AND lease_until <= ?",
    finish: "UPDATE idem_call SET status = ?, response = ?, updated_at = ?, expires_at = ? WHERE id = ? AND fence = ? AND status = 0",
    release: "UPDATE idem_call SET lease_until = ? WHERE id = ? AND fence = ? AND status = 0",
    discard: "DELETE FROM idem_call WHERE id = ? AND fence = ? AND status = 0",
    step_insert: "INSERT INTO idem_step (call_id, step, step_key, fence, response, created_at) SELECT id, ?, ?, fence, ?, ? FROM idem_call WHERE id = ? AND fence = ? AND status = 0 LOCK IN SHARE MODE",
    step_read: "SELECT response FROM idem_step WHERE call_id = ? AND step = ?",
    steps_read: "SELECT step, response FROM idem_step WHERE call_id = ?",
    steps_delete: "DELETE FROM idem_step WHERE call_id = ?",
    stuck: "SELECT idem_key, biz_no, fence, lease_until, created_at FROM idem_call WHERE biz_type = ? AND status = 0 AND lease_until <= ? ORDER BY lease_until LIMIT ?",
    purge_expired: "DELETE FROM idem_call WHERE expires_at <= ? AND status <> 0 ORDER BY expires_at LIMIT ?",
};

impl super::calls::CallSql for MySql {
    async fn call_migrate(db: &Db<Self>) -> Result<(), sqlx::Error> {
        for ddl in CALL_DDL {
            sqlx::raw_sql(ddl).execute(&db.pool).await?;
        }
        Ok(())
    }

    async fn call_insert(db: &Db<Self>, call: &super::calls::NewCall<'_>) -> Result<Option<i64>, sqlx::Error> {
        let done = on_pool!(db, |on, pooling| {
            pooling.query("INSERT INTO idem_call (biz_type, idem_key, biz_no, params_hash, status, fence, lease_until, response, created_at, updated_at, expires_at) VALUES (?, ?, ?, ?, 0, 1, ?, NULL, ?, ?, ?)")
                .bind(call.biz)
                .bind(call.key)
                .bind(call.biz_no)
                .bind(call.params_hash)
                .bind(call.lease_until_ms)
                .bind(call.now_ms)
                .bind(call.now_ms)
                .bind(call.expires_ms)
                .execute(on)
                .await
        });
        match done {
            Ok(done) => Ok(Some(i64::try_from(done.last_insert_id()).unwrap_or(i64::MAX))),
            Err(e) if is_unique_violation(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    super::calls::call_queries!(CQ);
}
