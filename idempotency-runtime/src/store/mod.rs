//! Layer 3, the `idem_record` table: the final truth. One committed row per
//! `(biz_type, idem_key)`, inserted in the same transaction as the body,
//! found by the digest of the two ([`digest`]).
//!
//! [`record`] holds the protocol a call follows (open, commit, settle),
//! written once over [`RecordSql`]; each backend has its own file with only
//! what differs: its DDL, its SQL text, its lock-wait bounds and the way it
//! reports conflicts (by code). The statements they share in shape are
//! written once by `record_queries!`. How those statements are sent (straight,
//! or behind a pooler in transaction mode) is [`pooling`]'s, applied by the
//! same macros.

use std::future::Future;
use std::time::Duration;

use sqlx::{Pool, Transaction};

pub(crate) mod calls;
mod classify;
mod digest;
#[cfg(feature = "mysql")]
mod mysql;
pub(crate) mod opening;
pub(crate) mod outbox;
pub(crate) mod pooling;
#[cfg(feature = "postgres")]
mod postgres;
mod queries;
pub(crate) mod record;
#[cfg(feature = "sqlite")]
mod sqlite;
pub(crate) mod text;
mod tokens;
mod upgrade;

pub use classify::{ErrorClass, classify};
pub use digest::RowKey;
pub(crate) use pooling::on_pool;
pub use pooling::{Db, Pooling};
pub(crate) use queries::{NAMESPACE, Queries, record_queries};
pub use text::{Dialect, Text};
pub use tokens::{TokenId, TokenRow};
pub(crate) use tokens::{TokenQueries, token_queries};

/// `status` of a row inserted before the body ran; it turns `SUCCEEDED` in the
/// same transaction, so a committed row never holds it.
pub(crate) const PROCESSING: i16 = 0;
/// `status` of a row whose response is stored.
pub(crate) const SUCCEEDED: i16 = 1;
/// `status` of a row whose response is a declared business error
/// (`record_errors`), replayed as the fn's `Err`.
pub(crate) const FAILED: i16 = 2;

/// A row about to be inserted. Times are Unix epoch milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct NewRecord<'a> {
    pub key: RowKey<'a>,
    pub biz_no: Option<&'a str>,
    pub params_hash: &'a str,
    pub status: i16,
    pub response: Option<&'a str>,
    pub now_ms: i64,
    pub expires_ms: i64,
}

/// A committed row, as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRecord {
    pub params_hash: String,
    pub status: i16,
    pub response: Option<String>,
    pub expires_ms: i64,
}

impl StoredRecord {
    /// Whether the row answers duplicates at `now_ms`: finished (a value or
    /// a recorded error) and not expired.
    pub fn is_live(&self, now_ms: i64) -> bool {
        self.status != PROCESSING && self.expires_ms > now_ms
    }

    /// The answer it holds, if finished: the stored JSON, and whether it is
    /// a recorded business error.
    pub(crate) fn answer(&self) -> Option<(&str, bool)> {
        match (self.status, &self.response) {
            (SUCCEEDED, Some(response)) => Some((response, false)),
            (FAILED, Some(response)) => Some((response, true)),
            _ => None,
        }
    }
}

/// The columns `read_locking` and `read_plain` select, in order.
pub type RecordRow = (String, i16, Option<String>, i64);

impl From<RecordRow> for StoredRecord {
    fn from((params_hash, status, response, expires_ms): RecordRow) -> Self {
        StoredRecord { params_hash, status, response, expires_ms }
    }
}

/// A database `idempotency` can keep its records in: SQLite, MySQL/MariaDB or
/// PostgreSQL (`sqlx::Sqlite`, `sqlx::MySql`, `sqlx::Postgres`), each behind
/// its cargo feature. Sealed: implemented by `idempotency` for those three only.
/// (`HasStatementCache`: statements can be sent unnamed, behind a pooler in
/// transaction mode; see [`Builder::transaction_pooler`](crate::Builder).)
pub trait Backend:
    sqlx::Database + Sized + RecordSql + outbox::OutboxSql + calls::CallSql + sqlx::database::HasStatementCache
{
}

/// What each backend writes in its own SQL: the statements the record
/// protocol ([`record`]) is built from. Public in name only: this module is
/// private, so nothing outside the crate can name it, and so implement
/// [`Backend`] (the sealed-trait pattern).
pub trait RecordSql: sqlx::Database + Sized {
    /// Creates `idem_record`, `idem_meta` and their indexes if absent
    /// (bringing an `idem_record` of an earlier version to today's form,
    /// see [`upgrade`]), and records `namespace` in `idem_meta` unless the
    /// database holds one.
    fn migrate(db: &Db<Self>, namespace: &str) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// The namespace recorded by [`migrate`](RecordSql::migrate), if any.
    fn namespace(db: &Db<Self>) -> impl Future<Output = Result<Option<String>, sqlx::Error>> + Send;

    // Issued tokens without Redis (`crate::token::database`), in `idem_token`,
    // which `migrate` creates beside `idem_record`. Times are epoch ms.

    /// Inserts a token issued now, live (and kept) until `expires_ms`.
    /// `Ok(false)`: the primary key `(biz_type, token)` is taken.
    fn token_insert(
        db: &Db<Self>,
        id: TokenId<'_>,
        now_ms: i64,
        expires_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// The one conditional statement that consumes a token: marks it used at
    /// `now_ms` (the row kept until `used_until_ms`, to answer "already
    /// used") if it is `id.subject`'s, unused and live. `Ok(true)`: this
    /// call consumed it.
    fn token_consume(
        db: &Db<Self>,
        id: TokenId<'_>,
        now_ms: i64,
        used_until_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// The row of a token, whoever it belongs to, without locking.
    fn token_read(
        db: &Db<Self>,
        biz: &str,
        token: &str,
    ) -> impl Future<Output = Result<Option<TokenRow>, sqlx::Error>> + Send;

    /// Makes the token consumed at `used_at_ms` unused again, until its own
    /// expiry. `Ok(false)`: that consumption is not the row's (any more).
    fn token_give_back(
        db: &Db<Self>,
        id: TokenId<'_>,
        used_at_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Deletes up to `limit` tokens kept until `now_ms` or before: expired
    /// unused ones, and used ones past the time they answer "already used".
    fn token_purge_expired(
        db: &Db<Self>,
        now_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Opens the transaction the record and the body share.
    fn begin(pool: &Pool<Self>) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send {
        pool.begin()
    }

    /// Opens a transaction for a call without a Redis claim: its record
    /// statements ([`insert`](RecordSql::insert), [`read_locking`](RecordSql::read_locking),
    /// [`delete_expired`](RecordSql::delete_expired) with `Some(wait)`) may
    /// wait at most `wait` on a duplicate still in flight, until
    /// [`end_bound`](RecordSql::end_bound). A backend that bounds lock waits
    /// per transaction sets the bound here, in the same round trip as `BEGIN`;
    /// by default the bound rides on each statement (see
    /// [`bounded`](RecordSql::bounded)), or is the server's own.
    fn begin_bounded(
        pool: &Pool<Self>,
        wait: Duration,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send {
        let _ = wait;
        Self::begin(pool)
    }

    /// Ends the bound of [`begin_bounded`](RecordSql::begin_bounded) before
    /// the body runs, putting back the session's own setting, so the body's
    /// own lock waits are left alone. Nothing to end by default.
    fn end_bound(
        pooling: Pooling,
        tx: &mut Transaction<'_, Self>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send {
        let _ = (pooling, tx);
        async { Ok(()) }
    }

    /// Bounds the record statements that follow in `tx`, a transaction the
    /// caller opened (the `join` mode), as [`begin_bounded`](RecordSql::begin_bounded)
    /// bounds one of our own, until [`end_bound`](RecordSql::end_bound).
    /// Nothing to set by default (the bound rides on each statement).
    fn bound_within(
        pooling: Pooling,
        tx: &mut Transaction<'_, Self>,
        wait: Duration,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send {
        let _ = (pooling, tx, wait);
        async { Ok(()) }
    }

    /// `sql` as sent: with `Some(wait)`, a backend that bounds lock waits
    /// per statement says so in the statement itself.
    fn bounded(sql: &'static str, wait: Option<Duration>) -> sqlx::SqlStr {
        let _ = wait;
        sqlx::SqlSafeStr::into_sql_str(sql)
    }

    /// Inserts `rec`. `Ok(false)`: a committed row holds the key; the
    /// transaction stays usable.
    fn insert(
        pooling: Pooling,
        tx: &mut Transaction<'_, Self>,
        rec: &NewRecord<'_>,
        wait: Option<Duration>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Inserts `rec` after the body ran, in a transaction opened without a
    /// bound (the body's own lock waits are its own): waits at most `wait`
    /// on a duplicate still in flight, such as a `join` caller's open
    /// transaction holding the key. By default the bound rides on the
    /// statement ([`bounded`](RecordSql::bounded)); a backend that bounds
    /// per transaction sets it in the same round trip as the insert.
    fn insert_after_body(
        pooling: Pooling,
        tx: &mut Transaction<'_, Self>,
        rec: &NewRecord<'_>,
        wait: Duration,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send {
        Self::insert(pooling, tx, rec, Some(wait))
    }

    // The record rides along (`store::text`): its statement
    // and the `BEGIN` or `COMMIT` the transaction sends anyway, in one text
    // and one round trip. `None`: each statement goes alone (SQLite, which is
    // embedded: a statement is a call into the library, no round trip).

    /// The text that opens a call's transaction with `rec` (processing)
    /// inserted first: waiting at most `wait` on a duplicate in flight,
    /// the bound ended before the body, as [`begin_bounded`](RecordSql::begin_bounded)
    /// then [`insert`](RecordSql::insert) and [`end_bound`](RecordSql::end_bound)
    /// do in three. Sent as `BEGIN` (`begin_with`): its answer says only
    /// whether a transaction is open, so an insert that fails must leave
    /// none open, and fails with the unique index's error when a row holds
    /// the key.
    fn begin_inserting(db: &Db<Self>, rec: &NewRecord<'_>, wait: Duration) -> Option<Text> {
        let _ = (db, rec, wait);
        None
    }

    /// Runs `text` (several statements, in the simple protocol) in `tx`.
    fn execute_text(tx: &mut Transaction<'_, Self>, text: Text)
    -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Whether a failed [`begin_inserting`](RecordSql::begin_inserting)
    /// says this server cannot run its text at all (it then stops trying).
    fn begin_refused(error: &sqlx::Error) -> bool {
        let _ = error;
        false
    }

    /// The text that inserts `rec` after the body and commits, the insert
    /// waiting at most `wait` on a duplicate in flight. An insert the
    /// unique index refuses fails the text before its `COMMIT`, and leaves
    /// the transaction usable once [`recover_refused`](RecordSql::recover_refused)
    /// ran.
    fn insert_committing(rec: &NewRecord<'_>, wait: Duration) -> Option<Text> {
        let _ = (rec, wait);
        None
    }

    /// After [`insert_committing`](RecordSql::insert_committing) failed on
    /// the unique index: the transaction as it was before the insert.
    fn recover_refused(tx: &mut Transaction<'_, Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send {
        let _ = tx;
        async { Ok(()) }
    }

    /// The text that finishes the row this transaction inserted (as
    /// [`mark_finished`](RecordSql::mark_finished)) and commits.
    fn finish_committing(rec: &NewRecord<'_>) -> Option<Text> {
        let _ = rec;
        None
    }

    /// Marks where a body that records its declared errors starts (a
    /// savepoint after the record's insert, if any), to roll its own writes
    /// back to ([`undo_body`](RecordSql::undo_body)) and keep the record.
    fn mark_body(tx: &mut Transaction<'_, Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Rolls the body's writes back to [`mark_body`](RecordSql::mark_body).
    fn undo_body(tx: &mut Transaction<'_, Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Stores the response in the row this transaction inserted, with the
    /// status, `updated_at` and `expires_at` of `rec` (the ttl counts from
    /// the end of the body, as when the record goes in last).
    fn mark_finished(
        pooling: Pooling,
        tx: &mut Transaction<'_, Self>,
        rec: &NewRecord<'_>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Reads the latest committed row of a key inside the call's
    /// transaction: a locking read where the isolation level would otherwise
    /// show an older snapshot (MySQL's `LOCK IN SHARE MODE`).
    fn read_locking(
        pooling: Pooling,
        conn: &mut Self::Connection,
        key: RowKey<'_>,
        wait: Option<Duration>,
    ) -> impl Future<Output = Result<Option<StoredRecord>, sqlx::Error>> + Send;

    /// Reads the committed row of a key without taking or waiting on locks
    /// (a plain read, outside any transaction).
    fn read_plain(
        db: &Db<Self>,
        key: RowKey<'_>,
    ) -> impl Future<Output = Result<Option<StoredRecord>, sqlx::Error>> + Send;

    /// Deletes the row of a key if it expired at or before `now_ms`.
    fn delete_expired(
        pooling: Pooling,
        conn: &mut Self::Connection,
        key: RowKey<'_>,
        now_ms: i64,
        wait: Option<Duration>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Deletes up to `limit` expired rows (any key).
    fn purge_expired(db: &Db<Self>, now_ms: i64, limit: i64) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// How an error of this backend matters to the engine ([`classify`]).
    fn classify(error: &sqlx::Error) -> ErrorClass {
        classify(error)
    }

    /// `ident` quoted for this backend's SQL. Only for identifiers checked
    /// at compile time (layer 4's `state::Ident`): none holds a quote.
    fn quote(ident: &str) -> String;

    /// The `n`th bind placeholder (from 1).
    fn placeholder(n: usize) -> String;

    /// Rows a statement changed.
    fn rows_affected(done: &Self::QueryResult) -> u64;

    /// What makes a `SELECT` inside a transaction read the latest committed
    /// row rather than the transaction's snapshot (empty where the default
    /// isolation level already does).
    fn latest_committed_suffix() -> &'static str {
        ""
    }

    /// Whether a claimed call's `BEGIN` goes out while its claim is in
    /// flight (`call/early_begin.rs`): a round trip saved on a server.
    /// SQLite's is none, and takes the file's write lock.
    const BEGIN_BESIDE_CLAIM: bool = true;

    /// Whether the database has a clock of its own to read (a server).
    /// SQLite's file lives on this host, whose clock is the database's.
    const HAS_CLOCK: bool = true;

    /// Whether [`begin_bounded`](RecordSql::begin_bounded) itself waits for a duplicate, bounded
    /// by the database (SQLite's busy timeout): then it is sent again until the call's bound.
    const WAITS_AT_BEGIN: bool = false;

    /// The database's clock in Unix epoch microseconds (see
    /// [`crate::clock`]), read in the simple protocol: no statement is
    /// prepared, so a pooler in transaction mode passes it.
    fn clock_us(pool: &Pool<Self>) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;
}

/// The database clock's reading, for [`crate::clock::Clock`].
impl<DB: Backend> crate::clock::ClockSource for Pool<DB> {
    fn database_us(&self) -> impl Future<Output = Result<i64, sqlx::Error>> + Send {
        DB::clock_us(self)
    }
}

/// Reads the one `BIGINT` that `sql` (a constant) selects, in the simple
/// protocol.
pub(crate) async fn select_bigint<DB>(pool: &Pool<DB>, sql: &'static str) -> Result<i64, sqlx::Error>
where
    DB: sqlx::Database,
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    i64: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    use sqlx::Row;
    let row = sqlx::raw_sql(sql).fetch_one(pool).await?;
    row.try_get(0)
}

/// `verb` and the savepoint a body that records its declared errors starts
/// after, named by the transaction's nesting level: MariaDB and MySQL
/// replace a savepoint of the same name (PostgreSQL and SQLite stack them),
/// so a `record_errors` fn joined inside another's body would take the
/// outer one's name and, released, lose it. sqlx names its own savepoints
/// by level the same way.
pub(crate) fn body_savepoint<DB: sqlx::Database>(verb: &str, tx: &Transaction<'_, DB>) -> String {
    use sqlx_core::transaction::TransactionManager;
    let level = DB::TransactionManager::get_transaction_depth(&**tx);
    format!("{verb} idem_body_{level}")
}

/// An insert's answer: `Ok(true)` inserted, `Ok(false)` the key is taken
/// (a unique violation, or 0 rows under `ON CONFLICT DO NOTHING`).
pub(crate) fn inserted(result: Result<u64, sqlx::Error>) -> Result<bool, sqlx::Error> {
    match result {
        Ok(rows) => Ok(rows == 1),
        Err(e) if is_unique_violation(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The part of [`RecordSql::classify`] all backends share.
pub(crate) fn is_unique_violation(error: &sqlx::Error) -> bool {
    error.as_database_error().is_some_and(|e| e.kind() == sqlx::error::ErrorKind::UniqueViolation)
}

/// Each server's clock, read as the engines read it: within a second of
/// this host's (the servers here share its clock), and the round trip that
/// bounds a reading's error. Skipped when a server does not answer, unless
/// `IDEM_REQUIRE_SERVICES=1`.
#[cfg(all(test, any(feature = "mysql", feature = "postgres")))]
mod clock_reading {
    use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

    use sqlx::Pool;

    use super::RecordSql;

    async fn reads<DB: RecordSql>(pool: Pool<DB>, server: &str) {
        let mut best = Duration::MAX;
        for _ in 0..20 {
            let sent = Instant::now();
            let db_us = DB::clock_us(&pool).await.expect("the clock query");
            best = best.min(sent.elapsed());
            let host_us = i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros()).unwrap();
            assert!((db_us - host_us).abs() < 1_000_000, "{server}: {db_us} vs the host's {host_us}");
        }
        println!("{server}: a clock reading's round trip is {best:?} at best (its error at most half that)");
    }

    fn unreachable(service: &str, e: impl std::fmt::Display) {
        assert!(std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(), "{service} unreachable: {e}");
        eprintln!("skipped: {service} unreachable ({e})");
    }

    #[cfg(feature = "mysql")]
    #[tokio::test]
    async fn mysql_clock_is_read() {
        let url = std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
        match sqlx::mysql::MySqlPoolOptions::new().max_connections(1).connect(&url).await {
            Ok(pool) => reads(pool, "mysql").await,
            Err(e) => unreachable("mysql", e),
        }
    }

    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn postgres_clock_is_read() {
        let url = std::env::var("IDEM_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        match sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&url).await {
            Ok(pool) => reads(pool, "postgres").await,
            Err(e) => unreachable("postgres", e),
        }
    }
}
