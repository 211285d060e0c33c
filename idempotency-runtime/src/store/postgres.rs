//! PostgreSQL.

use std::time::Duration;

use sqlx::postgres::Postgres;
use sqlx::{AssertSqlSafe, Pool, Transaction};

use super::outbox::{OutboxQueries, OutboxSql, outbox_queries};

use super::{
    Backend, Db, Dialect, ErrorClass, NewRecord, Pooling, Queries, RecordSql, Text, TokenQueries, on_pool,
    record_queries, token_queries,
};

// Concurrent `CREATE TABLE IF NOT EXISTS` can still collide in the catalog,
// so migrations take a transaction-scoped advisory lock first.
const MIGRATE_LOCK: &str = "SELECT pg_advisory_xact_lock(7306232718293611)";
const DDL: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS idem_record (
        id BIGSERIAL PRIMARY KEY,
        key_digest uuid NOT NULL,
        biz_type VARCHAR(32) NOT NULL,
        idem_key VARCHAR(255) NOT NULL,
        biz_no VARCHAR(64) NULL,
        params_hash CHAR(64) NOT NULL,
        status SMALLINT NOT NULL,
        response TEXT NULL,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL,
        expires_at BIGINT NOT NULL,
        CONSTRAINT uk_idem_record_key_digest UNIQUE (key_digest)
    )",
    "CREATE INDEX IF NOT EXISTS idx_idem_record_biz_no ON idem_record (biz_type, biz_no)",
    "CREATE INDEX IF NOT EXISTS idx_idem_record_expires_at ON idem_record (expires_at)",
];

// `ON CONFLICT DO NOTHING`: a unique violation would abort the whole
// transaction, body included; this way a taken key reports 0 rows and the
// transaction can still replace an expired row.
// Purges walk the expiry index (`ORDER BY expires_at`) and delete by the ids
// found (`= ANY (ARRAY(..))`; `IN (subquery)` is planned as a hash join over
// a scan of the whole table): a batch reads only expired rows, and one with
// nothing to delete is one index probe however many records live. A row a
// call holds (`SKIP LOCKED`) is left for the next batch.
//
// Their plan must not depend on what the planner knows. Planned without
// the values (the generic plan a prepared statement may switch to after
// five runs, the only one under `plan_cache_mode = force_generic_plan`),
// `expires_at <= $1` is taken to match a third of the table and `LIMIT $2` a
// tenth of that; once the table outgrows `effective_cache_size` a
// sequential scan and a sort looked cheaper than the walk (2.3 M records:
// 0.3-0.9 s and 105-134 k buffers a batch, deleted or not). So the bounds
// and the limit are sub-selects, unknown to every plan, custom or generic,
// with statistics or without: a range between two unknown bounds (the
// lower one, `$1 - 2^62`, holds for every row) is taken to be narrow
// (0.5 %), a tenth of it is fetched, and the walk wins at any size. A
// lower bound alone, the values known, left a never-analyzed table's
// custom plan reading all expired rows to sort them (docs/performance.md,
// "The purge's plans").
const Q: Queries = Queries {
    insert: "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON CONFLICT (key_digest) DO NOTHING",
    mark_finished: "UPDATE idem_record SET status = $1, response = $2, updated_at = $3, expires_at = $4 WHERE key_digest = $5 AND biz_type = $6 AND idem_key = $7",
    read_locking: "SELECT params_hash, status, response, expires_at FROM idem_record WHERE key_digest = $1 AND biz_type = $2 AND idem_key = $3",
    read_plain: "SELECT params_hash, status, response, expires_at FROM idem_record WHERE key_digest = $1 AND biz_type = $2 AND idem_key = $3",
    delete_expired: "DELETE FROM idem_record WHERE key_digest = $1 AND biz_type = $2 AND idem_key = $3 AND expires_at <= $4",
    purge_expired: "DELETE FROM idem_record WHERE id = ANY (ARRAY(SELECT id FROM idem_record WHERE expires_at > (SELECT $1::bigint - 4611686018427387904) AND expires_at <= (SELECT $1::bigint) ORDER BY expires_at LIMIT (SELECT $2::bigint) FOR UPDATE SKIP LOCKED))",
    meta_ddl: "CREATE TABLE IF NOT EXISTS idem_meta (name VARCHAR(64) PRIMARY KEY, value VARCHAR(255) NOT NULL)",
    init_namespace: "INSERT INTO idem_meta (name, value) VALUES ('namespace', $1) ON CONFLICT (name) DO NOTHING",
};

// The record's insert after the body, under a Redis claim (`insert_after_body`):
// the transaction was opened without a bound, and a `SET LOCAL` of its own
// would cost a round trip on every first call, so the bound is set by the
// statement itself (`$11`: ms), while its row's values are computed: before
// the row meets the unique index. It holds for the rest of the transaction,
// which only commits. (In a CTE of its own, a volatile call is materialized:
// 5-8 us more per insert and commit than here.)
const INSERT_AFTER_BODY: &str = "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10 + 0 * length(set_config('lock_timeout', CAST($11 AS TEXT), true))) ON CONFLICT (key_digest) DO NOTHING";

// Issued tokens without Redis (`crate::token::database`).
const TOKEN_DDL: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS idem_token (
        biz_type VARCHAR(32) NOT NULL,
        token CHAR(32) NOT NULL,
        subject VARCHAR(64) NOT NULL,
        created_at BIGINT NOT NULL,
        expires_at BIGINT NOT NULL,
        used_at BIGINT NULL,
        keep_until BIGINT NOT NULL,
        CONSTRAINT pk_idem_token PRIMARY KEY (biz_type, token)
    )",
    "CREATE INDEX IF NOT EXISTS idx_idem_token_keep_until ON idem_token (keep_until)",
];

// The purge as the records' (`Q`): by `ctid`, the table has no id.
const TQ: TokenQueries = TokenQueries {
    insert: "INSERT INTO idem_token (biz_type, token, subject, created_at, expires_at, used_at, keep_until) VALUES ($1, $2, $3, $4, $5, NULL, $6) ON CONFLICT (biz_type, token) DO NOTHING",
    consume: "UPDATE idem_token SET used_at = $1, keep_until = $2 WHERE biz_type = $3 AND token = $4 AND subject = $5 AND used_at IS NULL AND expires_at > $6",
    read: "SELECT subject, used_at, expires_at, keep_until FROM idem_token WHERE biz_type = $1 AND token = $2",
    give_back: "UPDATE idem_token SET used_at = NULL, keep_until = expires_at WHERE biz_type = $1 AND token = $2 AND subject = $3 AND used_at = $4",
    purge_expired: "DELETE FROM idem_token WHERE ctid = ANY (ARRAY(SELECT ctid FROM idem_token WHERE keep_until > (SELECT $1::bigint - 4611686018427387904) AND keep_until <= (SELECT $1::bigint) ORDER BY keep_until LIMIT (SELECT $2::bigint) FOR UPDATE SKIP LOCKED))",
};

/// A migration's transaction, holding the migration lock.
async fn migration(db: &Db<Postgres>) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    let mut tx = db.pool.begin().await?;
    db.pooling.query(MIGRATE_LOCK).execute(&mut *tx).await?;
    Ok(tx)
}

/// A lock-wait bound as `lock_timeout` takes it: ms, at most `i32::MAX`.
fn lock_wait_ms(wait: Duration) -> i64 {
    i64::try_from(wait.as_millis().clamp(1, i32::MAX as u128)).unwrap_or(i64::from(i32::MAX))
}

/// Bounds lock waits for the rest of the transaction (`is_local`), after
/// saving the session's own value for [`RecordSql::end_bound`]. Built from
/// an integer only; `lock_timeout` takes at most `i32::MAX` ms (24 days).
fn set_lock_bound(wait: Duration) -> String {
    let ms = wait.as_millis().clamp(1, i32::MAX as u128);
    format!(
        "SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true); \
         SET LOCAL lock_timeout = {ms}"
    )
}

/// What PostgreSQL's SQLSTATE says of a failure (`store::classify`'s
/// table): `None` for another backend's error.
pub(super) fn class_of(error: &(dyn sqlx::error::DatabaseError + 'static)) -> Option<ErrorClass> {
    let error = error.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?;
    let code = error.code();
    Some(match code {
        // lock_not_available: a lock wait past `lock_timeout`.
        "55P03" => ErrorClass::LockTimeout,
        // deadlock_detected, serialization_failure.
        "40P01" | "40001" => ErrorClass::Conflict,
        // undefined_table, undefined_column.
        "42P01" | "42703" => ErrorClass::Schema,
        // The connection (class 08); the server shutting down, restarting
        // or refusing connections for now (57P01-57P03); a statement
        // cancelled or timed out (57014); out of resources (class 53: too
        // many connections, disk full, out of memory); a read-only server
        // (a standby, or one in recovery: 25006); the system and its I/O
        // (class 58); a commit whose outcome is unknown (40003).
        "57P01" | "57P02" | "57P03" | "57014" | "25006" | "40003" => ErrorClass::Transient,
        _ if code.starts_with("08") || code.starts_with("53") || code.starts_with("58") => ErrorClass::Transient,
        // Data exceptions (22), constraints (23), syntax and access (42)...
        _ => ErrorClass::Final,
    })
}

impl Backend for Postgres {}

impl RecordSql for Postgres {
    async fn migrate(db: &Db<Self>, namespace: &str) -> Result<(), sqlx::Error> {
        let mut tx = migration(db).await?;
        for ddl in DDL {
            sqlx::raw_sql(ddl).execute(&mut *tx).await?;
        }
        super::upgrade::postgres::to_key_digest(&mut tx).await?;
        sqlx::raw_sql(Q.meta_ddl).execute(&mut *tx).await?;
        for ddl in TOKEN_DDL {
            sqlx::raw_sql(ddl).execute(&mut *tx).await?;
        }
        db.pooling.query(Q.init_namespace).bind(namespace).execute(&mut *tx).await?;
        tx.commit().await
    }

    async fn begin_bounded(pool: &Pool<Self>, wait: Duration) -> Result<Transaction<'static, Self>, sqlx::Error> {
        // Sent with `BEGIN`, the bound costs no round trip of its own.
        pool.begin_with(AssertSqlSafe(format!("BEGIN; {}", set_lock_bound(wait)))).await
    }

    async fn bound_within(pooling: Pooling, tx: &mut Transaction<'_, Self>, wait: Duration) -> Result<(), sqlx::Error> {
        // Simple protocol (several statements, nothing prepared), which a
        // pooler in transaction mode passes too. In the caller's savepoint:
        // rolling it back undoes the bound as well.
        let _ = pooling;
        sqlx::raw_sql(AssertSqlSafe(set_lock_bound(wait))).execute(&mut **tx).await.map(drop)
    }

    async fn end_bound(pooling: Pooling, tx: &mut Transaction<'_, Self>) -> Result<(), sqlx::Error> {
        pooling
            .query("SELECT set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true)")
            .execute(&mut **tx)
            .await
            .map(drop)
    }

    fn begin_inserting(db: &Db<Self>, rec: &NewRecord<'_>, wait: Duration) -> Option<Text> {
        let _ = db;
        Some(Dialect::Postgres.begin_inserting(rec, lock_wait_ms(wait)))
    }

    fn insert_committing(rec: &NewRecord<'_>, wait: Duration) -> Option<Text> {
        Some(Dialect::Postgres.insert_committing(rec, lock_wait_ms(wait)))
    }

    /// Back to the savepoint the text set before its insert.
    async fn recover_refused(tx: &mut Transaction<'_, Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql("ROLLBACK TO SAVEPOINT idem_record").execute(&mut **tx).await.map(drop)
    }

    fn finish_committing(rec: &NewRecord<'_>) -> Option<Text> {
        Some(Dialect::Postgres.finish_committing(rec))
    }

    async fn insert_after_body(
        pooling: Pooling,
        tx: &mut Transaction<'_, Self>,
        rec: &super::NewRecord<'_>,
        wait: Duration,
    ) -> Result<bool, sqlx::Error> {
        let ms = lock_wait_ms(wait);
        let done = pooling
            .query(INSERT_AFTER_BODY)
            .bind(rec.key.digest)
            .bind(rec.key.biz)
            .bind(rec.key.key)
            .bind(rec.biz_no)
            .bind(rec.params_hash)
            .bind(rec.status)
            .bind(rec.response)
            .bind(rec.now_ms)
            .bind(rec.now_ms)
            .bind(rec.expires_ms)
            .bind(ms)
            .execute(&mut **tx)
            .await;
        super::inserted(done.map(|d| d.rows_affected()))
    }

    record_queries!(Q);

    token_queries!(TQ);

    fn quote(ident: &str) -> String {
        // A checked identifier holds no quote character.
        format!("\"{}\"", ident)
    }

    fn placeholder(n: usize) -> String {
        format!("${n}")
    }

    fn rows_affected(done: &sqlx::postgres::PgQueryResult) -> u64 {
        done.rows_affected()
    }

    // `clock_timestamp()`, not `now()`: the time of the statement, not of
    // its transaction's start.
    async fn clock_us(pool: &Pool<Self>) -> Result<i64, sqlx::Error> {
        super::select_bigint(pool, "SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::BIGINT").await
    }
}

// The transactional outbox (`crate::outbox`), created under the migration lock.
const OUTBOX_DDL: [&str; 6] = [
    "CREATE TABLE IF NOT EXISTS idem_outbox (
        id BIGSERIAL PRIMARY KEY,
        message_id CHAR(32) NOT NULL,
        destination VARCHAR(255) NOT NULL,
        aggregate_key VARCHAR(255) NULL,
        payload TEXT NOT NULL,
        headers TEXT NULL,
        biz_type VARCHAR(32) NULL,
        idem_key VARCHAR(255) NULL,
        status SMALLINT NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt_at BIGINT NOT NULL,
        last_error VARCHAR(1024) NULL,
        created_at BIGINT NOT NULL,
        sent_at BIGINT NULL,
        CONSTRAINT uk_idem_outbox_message_id UNIQUE (message_id)
    )",
    "CREATE INDEX IF NOT EXISTS idx_idem_outbox_pending ON idem_outbox (status, id)",
    "CREATE INDEX IF NOT EXISTS idx_idem_outbox_aggregate ON idem_outbox (aggregate_key, status, id)",
    "CREATE INDEX IF NOT EXISTS idx_idem_outbox_sent_at ON idem_outbox (status, sent_at)",
    // One row per aggregate, locked by each event's insert (`store::outbox`).
    "CREATE TABLE IF NOT EXISTS idem_outbox_aggregate (
        aggregate_key VARCHAR(255) PRIMARY KEY,
        queued BIGINT NOT NULL,
        created_at BIGINT NOT NULL
    )",
    "CREATE INDEX IF NOT EXISTS idx_idem_outbox_aggregate_created_at ON idem_outbox_aggregate (created_at)",
];

// `purge_sent` walks `(status, sent_at)` as the records' purge walks its
// index (`Q`: bounds and limit unknown to every plan).
//
// `FOR UPDATE OF o`: only the batch's rows are locked; the `NOT EXISTS`
// is a plain read, so a row another relay holds still counts as pending
// and holds back the later rows of its aggregate.
//
// `lock_aggregate` waits, on a row another writer holds or has just
// inserted, until that writer ends (READ COMMITTED; under REPEATABLE READ
// the second writer fails with a serialization error instead).
const OQ: OutboxQueries = OutboxQueries {
    lock_aggregate: Some(
        "INSERT INTO idem_outbox_aggregate AS a (aggregate_key, queued, created_at) VALUES ($1, 1, $2) ON CONFLICT (aggregate_key) DO UPDATE SET queued = a.queued + 1",
    ),
    insert: "INSERT INTO idem_outbox (message_id, destination, aggregate_key, payload, headers, biz_type, idem_key, status, attempts, next_attempt_at, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, 0, 0, $8, $9) ON CONFLICT (message_id) DO NOTHING",
    pick: "SELECT id, message_id, destination, aggregate_key, payload, headers, attempts, created_at FROM idem_outbox o WHERE status = 0 AND next_attempt_at <= $1 AND NOT EXISTS (SELECT 1 FROM idem_outbox p WHERE p.aggregate_key = o.aggregate_key AND p.status IN (0, 2) AND p.id < o.id) ORDER BY id LIMIT $2 FOR UPDATE OF o SKIP LOCKED",
    mark_failed: "UPDATE idem_outbox SET status = $1, attempts = $2, next_attempt_at = $3, last_error = $4 WHERE id = $5",
    purge_sent: "DELETE FROM idem_outbox WHERE id = ANY (ARRAY(SELECT id FROM idem_outbox WHERE status = 1 AND sent_at > (SELECT $1::bigint - 4611686018427387904) AND sent_at <= (SELECT $1::bigint) ORDER BY sent_at LIMIT (SELECT $2::bigint)))",
    list_dead: "SELECT id, message_id, destination, aggregate_key, payload, headers, attempts, created_at, last_error, biz_type, idem_key FROM idem_outbox WHERE status = 2 ORDER BY id LIMIT $1",
    retry_dead: "UPDATE idem_outbox SET status = 0, attempts = 0, next_attempt_at = $1, last_error = NULL WHERE message_id = $2 AND status = 2",
    discard_dead: "DELETE FROM idem_outbox WHERE message_id = $1 AND status = 2",
    count: "SELECT status, COUNT(*) FROM idem_outbox GROUP BY status",
};

impl OutboxSql for Postgres {
    async fn outbox_migrate(db: &Db<Self>) -> Result<(), sqlx::Error> {
        let mut tx = migration(db).await?;
        for ddl in OUTBOX_DDL {
            sqlx::raw_sql(ddl).execute(&mut *tx).await?;
        }
        tx.commit().await
    }

    async fn outbox_begin(pool: &Pool<Self>) -> Result<Transaction<'static, Self>, sqlx::Error> {
        pool.begin().await
    }

    async fn outbox_purge_aggregates(db: &Db<Self>, before_ms: i64, limit: i64) -> Result<u64, sqlx::Error> {
        // `SKIP LOCKED`: a row a writer holds is left for a later purge. By
        // key, as the records' purge by id (`Q`): `IN (subquery)` was planned
        // as a hash semi join over a scan of the whole table.
        on_pool!(db, |on, pooling| {
            let done = pooling.query("DELETE FROM idem_outbox_aggregate WHERE aggregate_key = ANY (ARRAY(SELECT aggregate_key FROM idem_outbox_aggregate WHERE created_at > (SELECT $1::bigint - 4611686018427387904) AND created_at <= (SELECT $1::bigint) ORDER BY created_at LIMIT (SELECT $2::bigint) FOR UPDATE SKIP LOCKED))")
                .bind(before_ms)
                .bind(limit)
                .execute(on);
            done.await.map(|d| d.rows_affected())
        })
    }

    outbox_queries!(OQ);
}

// Calls to outside services (`crate::steps`; tables described in
// `store::calls`), created under the migration lock. The stuck scan's
// index is partial: it holds processing calls only.
const CALL_DDL: [&str; 4] = [
    "CREATE TABLE IF NOT EXISTS idem_call (
        id BIGSERIAL PRIMARY KEY,
        biz_type VARCHAR(32) NOT NULL,
        idem_key VARCHAR(255) NOT NULL,
        biz_no VARCHAR(64) NULL,
        params_hash CHAR(64) NOT NULL,
        status SMALLINT NOT NULL,
        fence BIGINT NOT NULL,
        lease_until BIGINT NOT NULL,
        response TEXT NULL,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL,
        expires_at BIGINT NOT NULL,
        CONSTRAINT uk_idem_call_biz_key UNIQUE (biz_type, idem_key)
    )",
    "CREATE INDEX IF NOT EXISTS idx_idem_call_stuck ON idem_call (biz_type, lease_until) WHERE status = 0",
    "CREATE INDEX IF NOT EXISTS idx_idem_call_expires_at ON idem_call (expires_at)",
    "CREATE TABLE IF NOT EXISTS idem_step (
        call_id BIGINT NOT NULL,
        step VARCHAR(32) NOT NULL,
        step_key CHAR(64) NOT NULL,
        fence BIGINT NOT NULL,
        response TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        CONSTRAINT pk_idem_step PRIMARY KEY (call_id, step)
    )",
];

// The purge as the records' (`Q`).
//
// The step insert reads the call `FOR SHARE`: a takeover waits for it, and
// it waits for a takeover and then finds the new fence (READ COMMITTED
// re-checks the row it waited for).
const CQ: super::calls::CallQueries = super::calls::CallQueries {
    read: "SELECT id, params_hash, status, fence, lease_until, response, expires_at FROM idem_call WHERE biz_type = $1 AND idem_key = $2",
    delete_expired: "DELETE FROM idem_call WHERE biz_type = $1 AND idem_key = $2 AND status <> 0 AND expires_at <= $3",
    take_over: "UPDATE idem_call SET fence = fence + 1, lease_until = $1, updated_at = $2 WHERE id = $3 AND fence = $4 AND status = 0 AND lease_until <= $5",
    finish: "UPDATE idem_call SET status = $1, response = $2, updated_at = $3, expires_at = $4 WHERE id = $5 AND fence = $6 AND status = 0",
    release: "UPDATE idem_call SET lease_until = $1 WHERE id = $2 AND fence = $3 AND status = 0",
    discard: "DELETE FROM idem_call WHERE id = $1 AND fence = $2 AND status = 0",
    step_insert: "INSERT INTO idem_step (call_id, step, step_key, fence, response, created_at) SELECT id, $1, $2, fence, $3, $4 FROM idem_call WHERE id = $5 AND fence = $6 AND status = 0 FOR SHARE",
    step_read: "SELECT response FROM idem_step WHERE call_id = $1 AND step = $2",
    steps_read: "SELECT step, response FROM idem_step WHERE call_id = $1",
    steps_delete: "DELETE FROM idem_step WHERE call_id = $1",
    stuck: "SELECT idem_key, biz_no, fence, lease_until, created_at FROM idem_call WHERE biz_type = $1 AND status = 0 AND lease_until <= $2 ORDER BY lease_until LIMIT $3",
    purge_expired: "DELETE FROM idem_call WHERE id = ANY (ARRAY(SELECT id FROM idem_call WHERE expires_at > (SELECT $1::bigint - 4611686018427387904) AND expires_at <= (SELECT $1::bigint) AND status <> 0 ORDER BY expires_at LIMIT (SELECT $2::bigint) FOR UPDATE SKIP LOCKED))",
};

impl super::calls::CallSql for Postgres {
    async fn call_migrate(db: &Db<Self>) -> Result<(), sqlx::Error> {
        let mut tx = migration(db).await?;
        for ddl in CALL_DDL {
            sqlx::raw_sql(ddl).execute(&mut *tx).await?;
        }
        tx.commit().await
    }

    async fn call_insert(db: &Db<Self>, call: &super::calls::NewCall<'_>) -> Result<Option<i64>, sqlx::Error> {
        // `ON CONFLICT DO NOTHING`: a taken key returns no row.
        on_pool!(db, |on, pooling| {
            pooling.query_scalar("INSERT INTO idem_call (biz_type, idem_key, biz_no, params_hash, status, fence, lease_until, response, created_at, updated_at, expires_at) VALUES ($1, $2, $3, $4, 0, 1, $5, NULL, $6, $7, $8) ON CONFLICT (biz_type, idem_key) DO NOTHING RETURNING id")
                .bind(call.biz)
                .bind(call.key)
                .bind(call.biz_no)
                .bind(call.params_hash)
                .bind(call.lease_until_ms)
                .bind(call.now_ms)
                .bind(call.now_ms)
                .bind(call.expires_ms)
                .fetch_optional(on)
                .await
        })
    }

    super::calls::call_queries!(CQ);
}
