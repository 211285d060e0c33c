//! How the engine's own statements reach the database: straight, or
//! through a pooler in transaction mode (PgBouncer's `pool_mode =
//! transaction`, RDS Proxy, Supavisor's transaction mode), where a client
//! connection holds a server connection for one transaction only.
//!
//! Two of sqlx's habits break there, and [`Pooling::Transaction`] avoids both:
//! - a named prepared statement (`sqlx_s_N`, cached or not) lives in the
//!   server connection that prepared it, which the client's next
//!   transaction may not get, or gets with another client's `sqlx_s_N`
//!   in it: every statement goes unnamed (`persistent(false)`);
//! - sqlx sends an unnamed statement in two exchanges (Parse, Describe,
//!   Sync; then Bind, Execute, Sync), and outside a transaction the pooler
//!   may hand the second to another server connection: a statement outside
//!   the call's transaction runs in a transaction of its own
//!   ([`on_pool!`]), which keeps its server connection throughout.
//!
//! Nothing else lives in the session: the record's lock-wait bound is
//! `SET LOCAL`, gone at the end of its transaction. A direct connection
//! keeps sqlx's defaults ([`Pooling::Session`]): cached named statements,
//! one exchange each, so its round trips stay as they are.

use std::future::Future;

use sqlx::database::HasStatementCache;
use sqlx::query::{Query, QueryAs, QueryScalar};
use sqlx::{Database, FromRow, IntoArguments, Pool, SqlSafeStr, Transaction};

/// How long the server connection behind one of the pool's connections
/// stays the same: the whole session (a direct connection, or a pooler in
/// session mode), or one transaction (a pooler in transaction mode).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Pooling {
    #[default]
    Session,
    Transaction,
}

impl Pooling {
    /// Whether statements may be prepared once and kept on the connection
    /// (sqlx's `persistent`).
    pub(crate) fn persistent(self) -> bool {
        self == Pooling::Session
    }
}

// The one place the engine's prepared statements are made: each is sent as
// this pooling allows. `sqlx::query` and its kin are refused everywhere else
// in this crate (`clippy.toml`'s `disallowed-methods`), so a new statement
// cannot forget the pooler (the outbox's aggregate lock once did, and failed
// one call in five behind PgBouncer). `sqlx::raw_sql` (the simple protocol:
// nothing prepared, one exchange) needs no such care.
#[allow(clippy::disallowed_methods)]
impl Pooling {
    /// `sqlx::query`, sent as this pooling allows.
    pub(crate) fn query<'q, DB: Database + HasStatementCache>(
        self,
        sql: impl SqlSafeStr,
    ) -> Query<'q, DB, DB::Arguments> {
        sqlx::query(sql).persistent(self.persistent())
    }

    /// `sqlx::query_as`, sent as this pooling allows.
    pub(crate) fn query_as<'q, DB, O>(self, sql: impl SqlSafeStr) -> QueryAs<'q, DB, O, DB::Arguments>
    where
        DB: Database + HasStatementCache,
        O: for<'r> FromRow<'r, DB::Row>,
    {
        sqlx::query_as(sql).persistent(self.persistent())
    }

    /// `sqlx::query_scalar`, sent as this pooling allows.
    pub(crate) fn query_scalar<'q, DB, O>(self, sql: impl SqlSafeStr) -> QueryScalar<'q, DB, O, DB::Arguments>
    where
        DB: Database + HasStatementCache,
        (O,): for<'r> FromRow<'r, DB::Row>,
    {
        sqlx::query_scalar(sql).persistent(self.persistent())
    }

    /// `sqlx::query_with`, sent as this pooling allows.
    pub(crate) fn query_with<'q, DB, A>(self, sql: impl SqlSafeStr, arguments: A) -> Query<'q, DB, A>
    where
        DB: Database + HasStatementCache,
        A: IntoArguments<DB>,
    {
        sqlx::query_with(sql, arguments).persistent(self.persistent())
    }

    /// `sqlx::query_as_with`, sent as this pooling allows.
    pub(crate) fn query_as_with<'q, DB, O, A>(self, sql: impl SqlSafeStr, arguments: A) -> QueryAs<'q, DB, O, A>
    where
        DB: Database + HasStatementCache,
        A: IntoArguments<DB>,
        O: for<'r> FromRow<'r, DB::Row>,
    {
        sqlx::query_as_with(sql, arguments).persistent(self.persistent())
    }
}

/// The engine's database: its pool, and how its statements reach it.
#[derive(Debug)]
pub struct Db<DB: sqlx::Database> {
    pub pool: Pool<DB>,
    pub pooling: Pooling,
    /// Whether the server runs the text that opens a call's transaction
    /// with its record (`RecordSql::begin_inserting`): until it refuses
    /// one (MySQL has no compound statement outside a stored program).
    pub(crate) begin_rides: std::sync::atomic::AtomicBool,
}

impl<DB: sqlx::Database> Db<DB> {
    pub(crate) fn new(pool: Pool<DB>, pooling: Pooling) -> Self {
        Db { pool, pooling, begin_rides: std::sync::atomic::AtomicBool::new(true) }
    }
}

/// Ends the transaction [`on_pool!`] ran one statement in: committed when
/// the statement succeeded, else rolled back, its error kept.
pub(crate) async fn finish<DB: sqlx::Database, T>(
    tx: Transaction<'static, DB>,
    done: Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    match done {
        Ok(value) => tx.commit().await.map(|()| value),
        Err(e) => {
            if let Err(rollback) = tx.rollback().await {
                tracing::debug!(error = %rollback, "rollback failed");
            }
            Err(e)
        }
    }
}

/// Runs one statement outside any call's transaction, as the `$db`'s
/// pooling allows: `$statement` is written once, on the executor `$on`,
/// made with `$pooling.query(..)` (or its kin). Straight on the pool in
/// session pooling (exactly one statement, as without this macro); in a
/// transaction of its own in transaction pooling. Inside an `async fn`
/// returning `Result<_, sqlx::Error>`.
macro_rules! on_pool {
    ($db:expr, |$on:ident, $pooling:ident| $statement:expr) => {{
        let db: &$crate::store::pooling::Db<_> = $db;
        match db.pooling {
            $crate::store::pooling::Pooling::Session => {
                let ($on, $pooling) = (&db.pool, $crate::store::pooling::Pooling::Session);
                $statement
            }
            $crate::store::pooling::Pooling::Transaction => {
                let mut tx = $crate::store::opening::begin(&db.pool).await?;
                let done = {
                    let ($on, $pooling) = (&mut *tx, $crate::store::pooling::Pooling::Transaction);
                    $statement
                };
                $crate::store::pooling::finish(tx, done).await
            }
        }
    }};
}
pub(crate) use on_pool;

tokio::task_local! {
    /// The pooling of the engine whose body runs in this task, for the
    /// statements `idempotency` writes on a body's own transaction
    /// ([`state`](crate::state) transitions, [`outbox`](crate::outbox) rows).
    static BODY: Pooling;
}

/// Runs a body (or anything that writes `idempotency`'s statements on the call's
/// transaction) with its engine's pooling known to [`in_body`]. Session
/// pooling, the default, sets nothing.
pub(crate) async fn around_body<F: Future>(pooling: Pooling, body: F) -> F::Output {
    match pooling {
        Pooling::Session => body.await,
        Pooling::Transaction => BODY.scope(pooling, body).await,
    }
}

/// The pooling of the engine whose body runs here; session pooling
/// outside any body.
pub(crate) fn in_body() -> Pooling {
    BODY.try_with(|pooling| *pooling).unwrap_or_default()
}
