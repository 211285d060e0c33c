//! The `idem_record` table: the final truth. One committed row per
//! `(biz_type, idem_key)`, inserted in the same transaction as the body.
//!
//! Each backend has its own file with its DDL, its SQL and the way it reports
//! conflicts; the queries they share in shape are written once by
//! `record_queries!`.

use std::future::Future;
use std::time::Duration;

use sqlx::{Pool, Transaction};

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

#[doc(hidden)]
/// `status` of a row inserted before the body ran; it turns `SUCCEEDED` in the
/// same transaction, so a committed row never holds it.
pub const PROCESSING: i16 = 0;
#[doc(hidden)]
/// `status` of a row whose response is stored.
pub const SUCCEEDED: i16 = 1;

#[doc(hidden)]
/// A row about to be inserted. Times are Unix epoch milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct NewRecord<'a> {
    pub biz: &'a str,
    pub key: &'a str,
    pub biz_no: Option<&'a str>,
    pub params_hash: &'a str,
    pub status: i16,
    pub response: Option<&'a str>,
    pub now_ms: i64,
    pub expires_ms: i64,
}

#[doc(hidden)]
/// A committed row, as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRecord {
    pub params_hash: String,
    pub status: i16,
    pub response: Option<String>,
    pub expires_ms: i64,
}

impl StoredRecord {
    /// Whether the row answers duplicates at `now_ms`: finished and not expired.
    pub fn is_live(&self, now_ms: i64) -> bool {
        self.status == SUCCEEDED && self.expires_ms > now_ms
    }
}

#[doc(hidden)]
/// The columns `find` and `lookup` select, in order.
pub type RecordRow = (String, i16, Option<String>, i64);

impl From<RecordRow> for StoredRecord {
    fn from((params_hash, status, response, expires_ms): RecordRow) -> Self {
        StoredRecord { params_hash, status, response, expires_ms }
    }
}

/// How a database error matters to the engine. Decided by error kind and
/// code, never by message text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The unique index on `(biz_type, idem_key)` refused the row.
    Duplicate,
    /// A lock wait ran past its bound: someone else holds the key.
    LockTimeout,
    /// Deadlock or serialization failure: the transaction may be retried.
    Conflict,
    /// Anything else.
    Other,
}

/// A database `idem` can keep its records in: SQLite, MySQL/MariaDB or
/// PostgreSQL, each behind its cargo feature.
pub trait Backend: sqlx::Database + Sized {
    /// Creates `idem_record`, `idem_meta` and their indexes if absent, and
    /// records `namespace` in `idem_meta` unless the database holds one.
    #[doc(hidden)]
    fn migrate(pool: &Pool<Self>, namespace: &str) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// The namespace recorded by [`migrate`](Backend::migrate), if any.
    #[doc(hidden)]
    fn namespace(pool: &Pool<Self>) -> impl Future<Output = Result<Option<String>, sqlx::Error>> + Send;

    /// Opens the transaction the record and the body share.
    #[doc(hidden)]
    fn begin(pool: &Pool<Self>) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send {
        pool.begin()
    }

    /// Opens a transaction for a call without a Redis claim: its record
    /// statements ([`insert`](Backend::insert), [`find`](Backend::find),
    /// [`delete_expired`](Backend::delete_expired) with `Some(wait)`) may
    /// wait at most `wait` on a duplicate still in flight, until
    /// [`end_bound`](Backend::end_bound). A backend that bounds lock waits
    /// per transaction sets the bound here, in the same round trip as `BEGIN`;
    /// by default the bound rides on each statement (see
    /// [`bounded`](Backend::bounded)), or is the server's own.
    #[doc(hidden)]
    fn begin_bounded(
        pool: &Pool<Self>,
        wait: Duration,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send {
        let _ = wait;
        Self::begin(pool)
    }

    /// Ends the bound of [`begin_bounded`](Backend::begin_bounded) before
    /// the body runs, putting back the session's own setting, so the body's
    /// own lock waits are left alone. Nothing to end by default.
    #[doc(hidden)]
    fn end_bound(tx: &mut Transaction<'static, Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send {
        let _ = tx;
        async { Ok(()) }
    }

    /// `sql` as sent: with `Some(wait)`, a backend that bounds lock waits
    /// per statement says so in the statement itself.
    #[doc(hidden)]
    fn bounded(sql: &'static str, wait: Option<Duration>) -> sqlx::SqlStr {
        let _ = wait;
        sqlx::SqlSafeStr::into_sql_str(sql)
    }

    /// Inserts `rec`. `Ok(false)`: a committed row holds the key; the
    /// transaction stays usable.
    #[doc(hidden)]
    fn insert(
        tx: &mut Transaction<'static, Self>,
        rec: &NewRecord<'_>,
        wait: Option<Duration>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Stores the response in the row this transaction inserted, with the
    /// status, `updated_at` and `expires_at` of `rec` (the ttl counts from
    /// the end of the body, as when the record goes in last).
    #[doc(hidden)]
    fn mark_succeeded(
        tx: &mut Transaction<'static, Self>,
        rec: &NewRecord<'_>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Reads the latest committed row of a key (a locking read where the
    /// isolation level would otherwise show an older snapshot).
    #[doc(hidden)]
    fn find(
        conn: &mut Self::Connection,
        biz: &str,
        key: &str,
        wait: Option<Duration>,
    ) -> impl Future<Output = Result<Option<StoredRecord>, sqlx::Error>> + Send;

    /// Reads the committed row of a key without waiting on locks (a plain
    /// read: for status queries, never inside the call's transaction).
    #[doc(hidden)]
    fn lookup(
        pool: &Pool<Self>,
        biz: &str,
        key: &str,
    ) -> impl Future<Output = Result<Option<StoredRecord>, sqlx::Error>> + Send;

    /// Deletes the row of a key if it expired at or before `now_ms`.
    #[doc(hidden)]
    fn delete_expired(
        conn: &mut Self::Connection,
        biz: &str,
        key: &str,
        now_ms: i64,
        wait: Option<Duration>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Deletes up to `limit` expired rows (any key).
    #[doc(hidden)]
    fn purge_expired(
        pool: &Pool<Self>,
        now_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// How an error of this backend matters to the engine.
    #[doc(hidden)]
    fn classify(error: &sqlx::Error) -> Failure;
}

/// SQL of the statements every backend runs in the same shape.
pub(crate) struct Queries {
    pub insert: &'static str,
    pub mark_succeeded: &'static str,
    pub find: &'static str,
    pub lookup: &'static str,
    pub delete_expired: &'static str,
    pub purge_expired: &'static str,
    /// Creates `idem_meta`: one row per setting, such as the namespace.
    pub meta_ddl: &'static str,
    /// Records the namespace unless one is recorded (binds: the namespace).
    pub init_namespace: &'static str,
}

/// The statement reading the namespace back; the same on every backend.
pub(crate) const NAMESPACE: &str = "SELECT value FROM idem_meta WHERE name = 'namespace'";

/// Writes the [`Backend`] methods that differ only in SQL text.
macro_rules! record_queries {
    ($q:expr) => {
        async fn insert(
            tx: &mut ::sqlx::Transaction<'static, Self>,
            rec: &$crate::store::NewRecord<'_>,
            wait: Option<::std::time::Duration>,
        ) -> Result<bool, ::sqlx::Error> {
            let sql = Self::bounded($q.insert, wait);
            // Placeholders in column order: biz_type, idem_key, biz_no, params_hash,
            // status, response, created_at, updated_at, expires_at.
            let done = ::sqlx::query(sql)
                .bind(rec.biz)
                .bind(rec.key)
                .bind(rec.biz_no)
                .bind(rec.params_hash)
                .bind(rec.status)
                .bind(rec.response)
                .bind(rec.now_ms)
                .bind(rec.now_ms)
                .bind(rec.expires_ms)
                .execute(&mut **tx)
                .await;
            $crate::store::inserted(done.map(|d| d.rows_affected()))
        }

        async fn mark_succeeded(
            tx: &mut ::sqlx::Transaction<'static, Self>,
            rec: &$crate::store::NewRecord<'_>,
        ) -> Result<(), ::sqlx::Error> {
            ::sqlx::query($q.mark_succeeded)
                .bind(rec.status)
                .bind(rec.response)
                .bind(rec.now_ms)
                .bind(rec.expires_ms)
                .bind(rec.biz)
                .bind(rec.key)
                .execute(&mut **tx)
                .await
                .map(drop)
        }

        async fn find(
            conn: &mut Self::Connection,
            biz: &str,
            key: &str,
            wait: Option<::std::time::Duration>,
        ) -> Result<Option<$crate::store::StoredRecord>, ::sqlx::Error> {
            let sql = Self::bounded($q.find, wait);
            let row: Option<$crate::store::RecordRow> =
                ::sqlx::query_as(sql).bind(biz).bind(key).fetch_optional(&mut *conn).await?;
            Ok(row.map(Into::into))
        }

        async fn lookup(
            pool: &::sqlx::Pool<Self>,
            biz: &str,
            key: &str,
        ) -> Result<Option<$crate::store::StoredRecord>, ::sqlx::Error> {
            let row: Option<$crate::store::RecordRow> =
                ::sqlx::query_as($q.lookup).bind(biz).bind(key).fetch_optional(pool).await?;
            Ok(row.map(Into::into))
        }

        async fn delete_expired(
            conn: &mut Self::Connection,
            biz: &str,
            key: &str,
            now_ms: i64,
            wait: Option<::std::time::Duration>,
        ) -> Result<u64, ::sqlx::Error> {
            let sql = Self::bounded($q.delete_expired, wait);
            let done = ::sqlx::query(sql).bind(biz).bind(key).bind(now_ms).execute(&mut *conn).await?;
            Ok(done.rows_affected())
        }

        async fn namespace(pool: &::sqlx::Pool<Self>) -> Result<Option<String>, ::sqlx::Error> {
            ::sqlx::query_scalar($crate::store::NAMESPACE).fetch_optional(pool).await
        }

        async fn purge_expired(pool: &::sqlx::Pool<Self>, now_ms: i64, limit: i64) -> Result<u64, ::sqlx::Error> {
            let done = ::sqlx::query($q.purge_expired).bind(now_ms).bind(limit).execute(pool).await?;
            Ok(done.rows_affected())
        }
    };
}
pub(crate) use record_queries;

/// An insert's answer: `Ok(true)` inserted, `Ok(false)` the key is taken
/// (a unique violation, or 0 rows under `ON CONFLICT DO NOTHING`).
pub(crate) fn inserted(result: Result<u64, sqlx::Error>) -> Result<bool, sqlx::Error> {
    match result {
        Ok(rows) => Ok(rows == 1),
        Err(e) if is_unique_violation(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The part of [`Backend::classify`] all backends share.
pub(crate) fn is_unique_violation(error: &sqlx::Error) -> bool {
    error.as_database_error().is_some_and(|e| e.kind() == sqlx::error::ErrorKind::UniqueViolation)
}
