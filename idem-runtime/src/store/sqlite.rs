//! SQLite, embedded.

use sqlx::sqlite::Sqlite;
use sqlx::{Pool, Transaction};

use super::{
    Backend, ErrorClass, Queries, RecordSql, TokenQueries, is_unique_violation, record_queries, token_queries,
};

const DDL: &str = "CREATE TABLE IF NOT EXISTS idem_record (
        id INTEGER PRIMARY KEY,
        biz_type TEXT NOT NULL,
        idem_key TEXT NOT NULL,
        biz_no TEXT NULL,
        params_hash TEXT NOT NULL,
        status INTEGER NOT NULL,
        response TEXT NULL,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL,
        expires_at INTEGER NOT NULL,
        UNIQUE (biz_type, idem_key)
    );
    CREATE INDEX IF NOT EXISTS idx_idem_record_biz_no ON idem_record (biz_type, biz_no);
    CREATE INDEX IF NOT EXISTS idx_idem_record_expires_at ON idem_record (expires_at);";

const Q: Queries = Queries {
    insert: "INSERT INTO idem_record (biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
    mark_succeeded: "UPDATE idem_record SET status = ?, response = ?, updated_at = ?, expires_at = ? WHERE biz_type = ? AND idem_key = ?",
    read_locking: "SELECT params_hash, status, response, expires_at FROM idem_record WHERE biz_type = ? AND idem_key = ?",
    read_plain: "SELECT params_hash, status, response, expires_at FROM idem_record WHERE biz_type = ? AND idem_key = ?",
    delete_expired: "DELETE FROM idem_record WHERE biz_type = ? AND idem_key = ? AND expires_at <= ?",
    purge_expired: "DELETE FROM idem_record WHERE id IN (SELECT id FROM idem_record WHERE expires_at <= ? LIMIT ?)",
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
    purge_expired: "DELETE FROM idem_token WHERE rowid IN (SELECT rowid FROM idem_token WHERE keep_until <= ? LIMIT ?)",
};

// Primary result codes; extended codes keep them in the low byte.
const SQLITE_BUSY: u32 = 5;
const SQLITE_LOCKED: u32 = 6;

impl Backend for Sqlite {}

impl RecordSql for Sqlite {
    async fn migrate(pool: &Pool<Self>, namespace: &str) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(DDL).execute(pool).await?;
        sqlx::raw_sql(Q.meta_ddl).execute(pool).await?;
        sqlx::raw_sql(TOKEN_DDL).execute(pool).await?;
        sqlx::query(Q.init_namespace).bind(namespace).execute(pool).await.map(drop)
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

    fn quote(ident: crate::state::Ident) -> String {
        // A checked identifier holds no quote character.
        format!("\"{}\"", ident.as_str())
    }

    fn placeholder(_n: usize) -> String {
        "?".to_owned()
    }

    fn rows_affected(done: &sqlx::sqlite::SqliteQueryResult) -> u64 {
        done.rows_affected()
    }

    fn classify(error: &sqlx::Error) -> ErrorClass {
        if is_unique_violation(error) {
            return ErrorClass::Duplicate;
        }
        let code = error.as_database_error().and_then(|e| e.code()).and_then(|c| c.parse::<u32>().ok());
        match code.map(|c| c & 0xff) {
            Some(SQLITE_BUSY | SQLITE_LOCKED) => ErrorClass::LockTimeout,
            _ => ErrorClass::Other,
        }
    }
}
