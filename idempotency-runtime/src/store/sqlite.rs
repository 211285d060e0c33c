//! SQLite, embedded.

use sqlx::sqlite::Sqlite;
use sqlx::{Pool, Transaction};

use super::outbox::{OutboxQueries, OutboxSql, outbox_queries};

use super::{
    Backend, Db, ErrorClass, Queries, RecordSql, TokenQueries, is_unique_violation, on_pool, record_queries,
    token_queries,
};

const DDL: &str = "CREATE TABLE IF NOT EXISTS idem_record (
        id INTEGER PRIMARY KEY,
        key_digest BLOB NOT NULL UNIQUE,
        biz_type TEXT NOT NULL,
        idem_key TEXT NOT NULL,
        biz_no TEXT NULL,
        params_hash TEXT NOT NULL,
        status INTEGER NOT NULL,
        response TEXT NULL,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL,
        expires_at INTEGER NOT NULL
    );
    CREATE INDEX IF NOT EXISTS idx_idem_record_biz_no ON idem_record (biz_type, biz_no);
    CREATE INDEX IF NOT EXISTS idx_idem_record_expires_at ON idem_record (expires_at);";

const Q: Queries = Queries {
    insert: "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    mark_finished: "UPDATE idem_record SET status = ?, response = ?, updated_at = ?, expires_at = ? WHERE key_digest = ? AND biz_type = ? AND idem_key = ?",
    read_locking: "SELECT params_hash, status, response, expires_at FROM idem_record WHERE key_digest = ? AND biz_type = ? AND idem_key = ?",
    read_plain: "SELECT params_hash, status, response, expires_at FROM idem_record WHERE key_digest = ? AND biz_type = ? AND idem_key = ?",
    delete_expired: "DELETE FROM idem_record WHERE key_digest = ? AND biz_type = ? AND idem_key = ? AND expires_at <= ?",
    purge_expired: "DELETE FROM idem_record WHERE id IN (SELECT id FROM idem_record WHERE expires_at <= ? ORDER BY expires_at LIMIT ?)",
    meta_ddl: "CREATE TABLE IF NOT EXISTS idem_meta (name TEXT NOT NULL PRIMARY KEY, value TEXT NOT NULL)",
    init_namespace: "INSERT INTO idem_meta (name, value) VALUES ('namespace', ?) ON CONFLICT (name) DO NOTHING",
};

// Issued tokens without Redis (`crate::token::database`). TEXT compares
// byte for byte (BINARY collation): tokens are case-sensitive.
const TOKEN_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_token (
        biz_type TEXT NOT NULL,
        token TEXT NOT NULL,
        subject TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        expires_at INTEGER NOT NULL,
        used_at INTEGER NULL,
        keep_until INTEGER NOT NULL,
        PRIMARY KEY (biz_type, token)
    );
    CREATE INDEX IF NOT EXISTS idx_idem_token_keep_until ON idem_token (keep_until);";

const TQ: TokenQueries = TokenQueries {
    insert: "INSERT INTO idem_token (biz_type, token, subject, created_at, expires_at, used_at, keep_until) VALUES (?, ?, ?, ?, ?, NULL, ?)",
    consume: "UPDATE idem_token SET used_at = ?, keep_until = ? WHERE biz_type = ? AND token = ? AND subject = ? AND used_at IS NULL AND expires_at > ?",
    read: "SELECT subject, used_at, expires_at, keep_until FROM idem_token WHERE biz_type = ? AND token = ?",
    give_back: "UPDATE idem_token SET used_at = NULL, keep_until = expires_at WHERE biz_type = ? AND token = ? AND subject = ? AND used_at = ?",
    purge_expired: "DELETE FROM idem_token WHERE rowid IN (SELECT rowid FROM idem_token WHERE keep_until <= ? ORDER BY keep_until LIMIT ?)",
};

// Primary result codes; extended codes keep them in the low byte.
/// What SQLite's result code says of a failure (`store::classify`'s
/// table): `None` for another backend's error.
pub(super) fn class_of(error: &(dyn sqlx::error::DatabaseError + 'static)) -> Option<ErrorClass> {
    let error = error.try_downcast_ref::<sqlx::sqlite::SqliteError>()?;
    // The extended code; its low byte is the primary one.
    let code = sqlx::error::DatabaseError::code(error).and_then(|c| c.parse::<u32>().ok()).unwrap_or(0) & 0xff;
    Some(match code {
        // SQLITE_BUSY, SQLITE_LOCKED: the busy timeout passed.
        5 | 6 => ErrorClass::LockTimeout,
        // SQLITE_ERROR: in the engine's own statements, whose text is
        // fixed, a table or column that is not there (SQLite gives "no such
        // table" no code of its own); in a body, its own SQL error, final
        // all the same.
        1 => ErrorClass::Schema,
        // SQLITE_NOMEM, SQLITE_INTERRUPT, SQLITE_IOERR, SQLITE_FULL,
        // SQLITE_CANTOPEN (the file's "connection refused": a volume not
        // mounted yet), SQLITE_PROTOCOL.
        7 | 9 | 10 | 13 | 14 | 15 => ErrorClass::Transient,
        // Constraints, datatype mismatches, a read-only or corrupt file...
        _ => ErrorClass::Final,
    })
}

impl Backend for Sqlite {}

impl RecordSql for Sqlite {
    async fn migrate(db: &Db<Self>, namespace: &str) -> Result<(), sqlx::Error> {
        let mut tx = Self::begin(&db.pool).await?;
        super::upgrade::sqlite::to_key_digest(&mut tx, DDL).await?;
        sqlx::raw_sql(DDL).execute(&mut *tx).await?;
        tx.commit().await?;
        sqlx::raw_sql(Q.meta_ddl).execute(&db.pool).await?;
        sqlx::raw_sql(TOKEN_DDL).execute(&db.pool).await?;
        on_pool!(db, |on, pooling| pooling.query(Q.init_namespace).bind(namespace).execute(on).await.map(drop))
    }

    async fn begin(pool: &Pool<Self>) -> Result<Transaction<'static, Self>, sqlx::Error> {
        // Take the write lock up front: a deferred transaction that reads
        // first and writes later can fail with SQLITE_BUSY mid-body instead
        // of waiting its turn under the busy timeout. That wait is also the
        // bound on a duplicate without a claim (the default `begin_bounded`).
        pool.begin_with("BEGIN IMMEDIATE").await
    }

    record_queries!(Q);

    token_queries!(TQ);

    fn quote(ident: &str) -> String {
        // A checked identifier holds no quote character.
        format!("\"{}\"", ident)
    }

    fn placeholder(_n: usize) -> String {
        "?".to_owned()
    }

    fn rows_affected(done: &sqlx::sqlite::SqliteQueryResult) -> u64 {
        done.rows_affected()
    }

    const HAS_CLOCK: bool = false;

    const BEGIN_BESIDE_CLAIM: bool = false;

    const WAITS_AT_BEGIN: bool = true;

    // Never asked (`HAS_CLOCK` is false); SQLite reads the host's clock too.
    async fn clock_us(pool: &Pool<Self>) -> Result<i64, sqlx::Error> {
        super::select_bigint(pool, "SELECT CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER)").await
    }
}

// The transactional outbox (`crate::outbox`). AUTOINCREMENT: ids never go
// back, even after the newest rows are purged, so `id` order is queue order.
const OUTBOX_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_outbox (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        message_id TEXT NOT NULL,
        destination TEXT NOT NULL,
        aggregate_key TEXT NULL,
        payload TEXT NOT NULL,
        headers TEXT NULL,
        biz_type TEXT NULL,
        idem_key TEXT NULL,
        status INTEGER NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt_at INTEGER NOT NULL,
        last_error TEXT NULL,
        created_at INTEGER NOT NULL,
        sent_at INTEGER NULL,
        UNIQUE (message_id)
    );
    CREATE INDEX IF NOT EXISTS idx_idem_outbox_pending ON idem_outbox (status, id);
    CREATE INDEX IF NOT EXISTS idx_idem_outbox_aggregate ON idem_outbox (aggregate_key, status, id);
    CREATE INDEX IF NOT EXISTS idx_idem_outbox_sent_at ON idem_outbox (status, sent_at);";

// No row locks: the relay's `BEGIN IMMEDIATE` holds the database's write
// lock for the batch, so one relay works at a time. No aggregate rows
// either: a body's insert takes the write lock until its transaction
// ends, so the next writer's ids come after its commit.
const OQ: OutboxQueries = OutboxQueries {
    lock_aggregate: None,
    insert: "INSERT INTO idem_outbox (message_id, destination, aggregate_key, payload, headers, biz_type, idem_key, status, attempts, next_attempt_at, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, 0, 0, ?, ?) ON CONFLICT (message_id) DO NOTHING",
    pick: "SELECT id, message_id, destination, aggregate_key, payload, headers, attempts, created_at FROM idem_outbox o WHERE status = 0 AND next_attempt_at <= ? AND NOT EXISTS (SELECT 1 FROM idem_outbox p WHERE p.aggregate_key = o.aggregate_key AND p.status IN (0, 2) AND p.id < o.id) ORDER BY id LIMIT ?",
    mark_failed: "UPDATE idem_outbox SET status = ?, attempts = ?, next_attempt_at = ?, last_error = ? WHERE id = ?",
    purge_sent: "DELETE FROM idem_outbox WHERE id IN (SELECT id FROM idem_outbox WHERE status = 1 AND sent_at <= ? LIMIT ?)",
    list_dead: "SELECT id, message_id, destination, aggregate_key, payload, headers, attempts, created_at, last_error, biz_type, idem_key FROM idem_outbox WHERE status = 2 ORDER BY id LIMIT ?",
    retry_dead: "UPDATE idem_outbox SET status = 0, attempts = 0, next_attempt_at = ?, last_error = NULL WHERE message_id = ? AND status = 2",
    discard_dead: "DELETE FROM idem_outbox WHERE message_id = ? AND status = 2",
    count: "SELECT status, COUNT(*) FROM idem_outbox GROUP BY status",
};

impl OutboxSql for Sqlite {
    async fn outbox_migrate(db: &Db<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(OUTBOX_DDL).execute(&db.pool).await.map(drop)
    }

    async fn outbox_begin(pool: &Pool<Self>) -> Result<Transaction<'static, Self>, sqlx::Error> {
        pool.begin_with("BEGIN IMMEDIATE").await
    }

    async fn outbox_purge_aggregates(_db: &Db<Self>, _before_ms: i64, _limit: i64) -> Result<u64, sqlx::Error> {
        Ok(0)
    }

    outbox_queries!(OQ);
}

// Calls to outside services (`crate::steps`; tables described in
// `store::calls`). AUTOINCREMENT: a call's id is never handed out again, so
// a new call can never meet steps recorded under an old one's id.
const CALL_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_call (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        biz_type TEXT NOT NULL,
        idem_key TEXT NOT NULL,
        biz_no TEXT NULL,
        params_hash TEXT NOT NULL,
        status INTEGER NOT NULL,
        fence INTEGER NOT NULL,
        lease_until INTEGER NOT NULL,
        response TEXT NULL,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL,
        expires_at INTEGER NOT NULL,
        UNIQUE (biz_type, idem_key)
    );
    CREATE INDEX IF NOT EXISTS idx_idem_call_stuck ON idem_call (biz_type, lease_until) WHERE status = 0;
    CREATE INDEX IF NOT EXISTS idx_idem_call_expires_at ON idem_call (expires_at);
    CREATE TABLE IF NOT EXISTS idem_step (
        call_id INTEGER NOT NULL,
        step TEXT NOT NULL,
        step_key TEXT NOT NULL,
        fence INTEGER NOT NULL,
        response TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        PRIMARY KEY (call_id, step)
    );";

// One writer at a time: the step insert needs no lock clause.
const CQ: super::calls::CallQueries = super::calls::CallQueries {
    read: "SELECT id, params_hash, status, fence, lease_until, response, expires_at FROM idem_call WHERE biz_type = ? AND idem_key = ?",
    delete_expired: "DELETE FROM idem_call WHERE biz_type = ? AND idem_key = ? AND status <> 0 AND expires_at <= ?",
    take_over: "UPDATE idem_call SET fence = fence + 1, lease_until = ?, updated_at = ? WHERE id = ? AND fence = ? AND status = 0 AND lease_until <= ?",
    finish: "UPDATE idem_call SET status = ?, response = ?, updated_at = ?, expires_at = ? WHERE id = ? AND fence = ? AND status = 0",
    release: "UPDATE idem_call SET lease_until = ? WHERE id = ? AND fence = ? AND status = 0",
    discard: "DELETE FROM idem_call WHERE id = ? AND fence = ? AND status = 0",
    step_insert: "INSERT INTO idem_step (call_id, step, step_key, fence, response, created_at) SELECT id, ?, ?, fence, ?, ? FROM idem_call WHERE id = ? AND fence = ? AND status = 0",
    step_read: "SELECT response FROM idem_step WHERE call_id = ? AND step = ?",
    steps_read: "SELECT step, response FROM idem_step WHERE call_id = ?",
    steps_delete: "DELETE FROM idem_step WHERE call_id = ?",
    stuck: "SELECT idem_key, biz_no, fence, lease_until, created_at FROM idem_call WHERE biz_type = ? AND status = 0 AND lease_until <= ? ORDER BY lease_until LIMIT ?",
    purge_expired: "DELETE FROM idem_call WHERE id IN (SELECT id FROM idem_call WHERE expires_at <= ? AND status <> 0 ORDER BY expires_at LIMIT ?)",
};

impl super::calls::CallSql for Sqlite {
    async fn call_migrate(db: &Db<Self>) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(CALL_DDL).execute(&db.pool).await.map(drop)
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
            Ok(done) => Ok(Some(done.last_insert_rowid())),
            Err(e) if is_unique_violation(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    super::calls::call_queries!(CQ);
}
