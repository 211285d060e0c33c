//! The contract between the behaviour suite (`tests/suite/`) and a
//! database: everything the suite needs that differs between backends, in
//! one trait, implemented once per backend. A backend target names its
//! implementation once (`type SuiteBackend = idempotency_testkit::backend::MySql;`)
//! and the suite reaches it as `B` (`B::open(..)`, `B::INSERT_LEDGER`).
//!
//! SQL comes in each backend's own placeholders (`?` or `$1`). The tables
//! it names: `idem_test_ledger (k, amount)`, the business write of the
//! suite's bodies, created by [`TestBackend::prepare`]; `idem_record`, the
//! engine's own; `idem_classify`, two rows (ids 1 and 2) a body can lock.

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

use std::future::Future;

#[cfg(feature = "mysql")]
pub use mysql::MySql;
#[cfg(feature = "postgres")]
pub use postgres::Postgres;
#[cfg(feature = "sqlite")]
pub use sqlite::Sqlite;
use sqlx::Pool;

/// One database the suite runs on.
pub trait TestBackend: Send + Sync + 'static {
    /// The sqlx database; `idempotency` has a record store for it.
    type Db: idempotency::Backend;

    /// The service's name in messages and for [`crate::reach`]: `sqlite`,
    /// `mysql`, `postgres`.
    const NAME: &'static str;

    /// Inserts a ledger row: binds `k`, `amount`.
    const INSERT_LEDGER: &'static str;
    /// Counts the ledger rows of a key: binds `k`.
    const COUNT_LEDGER: &'static str;
    /// Counts the `idem_record` rows of one pair: binds `biz_type`, `idem_key`.
    const COUNT_RECORDS_KEY: &'static str;
    /// Deletes the `idem_record` row of one pair: binds `biz_type`, `idem_key`.
    const DELETE_RECORD: &'static str;
    /// Overwrites a record's stored response: binds `response`, `biz_type`, `idem_key`.
    const CORRUPT: &'static str;
    /// Reads a record's `biz_no`: binds `biz_type`, `idem_key`.
    const BIZ_NO: &'static str;
    /// Creates `idem_record` as versions before the key digest did (unique
    /// on `(biz_type, idem_key)`, no `key_digest`), with its indexes (raw SQL).
    const RECORD_TABLE_BEFORE_DIGEST: &'static str;
    /// Inserts a row into that table: binds `biz_type`, `idem_key`, `biz_no`,
    /// `params_hash`, `status`, `response`, `created_at`, `updated_at`, `expires_at`.
    const INSERT_RECORD_BEFORE_DIGEST: &'static str;
    /// The columns of each unique index of `idem_record` but its primary
    /// key, one row each, comma-separated in index order.
    const RECORD_UNIQUE_INDEXES: &'static str;
    /// Creates `idem_classify (id, v)` with rows 1 and 2, if missing (raw SQL,
    /// several statements): a business row two bodies can lock.
    const LOCKABLE_ROWS_DDL: &'static str;

    /// Whether a duplicate's wait on the record is bounded by `lock_wait`
    /// (SQLite's is the busy timeout instead).
    const LOCK_WAIT_BOUNDED: bool;
    /// One writer at a time: a second transaction waits for the first to end
    /// (SQLite), so nothing deadlocks.
    const ONE_WRITER: bool;

    /// A pool of up to `max_connections`, `None` (after printing `skipped:
    /// ...`, or failing under `IDEM_REQUIRE_SERVICES=1`) when the server is
    /// unreachable. Servers share their `test` database between tests;
    /// SQLite opens a file of its own per `name`.
    fn open(name: &str, max_connections: u32) -> impl Future<Output = Option<Pool<Self::Db>>> + Send;

    /// A database of its own, for a test that must see every row of
    /// `idem_record`, and a pool of up to `max_connections` on it; `name` is
    /// a plain identifier (`[a-z0-9_]`).
    fn open_private(name: &str, max_connections: u32) -> impl Future<Output = Option<Pool<Self::Db>>> + Send;

    /// Closes a database [`open_private`](Self::open_private) made and drops
    /// it (SQLite: deletes its files).
    fn drop_private(pool: Pool<Self::Db>, name: &str) -> impl Future<Output = ()> + Send;

    /// A pool whose database cannot be reached: every acquire fails within
    /// two seconds.
    fn dead_pool() -> Pool<Self::Db>;

    /// Creates `idem_test_ledger` if missing (safe to run concurrently).
    fn prepare(pool: &Pool<Self::Db>) -> impl Future<Output = ()> + Send;
}
