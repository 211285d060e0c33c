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

use sqlx::{Pool, Transaction};

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

/// The engine's database: its pool, and how its statements reach it.
#[derive(Debug)]
pub struct Db<DB: sqlx::Database> {
    pub pool: Pool<DB>,
    pub pooling: Pooling,
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
/// sent with `.persistent($persistent)`. Straight on the pool in session
/// pooling (exactly one statement, as without this macro); in a transaction
/// of its own in transaction pooling. Inside an `async fn` returning
/// `Result<_, sqlx::Error>`.
macro_rules! on_pool {
    ($db:expr, |$on:ident, $persistent:ident| $statement:expr) => {{
        let db: &$crate::store::pooling::Db<Self> = $db;
        match db.pooling {
            $crate::store::pooling::Pooling::Session => {
                let ($on, $persistent) = (&db.pool, true);
                $statement
            }
            $crate::store::pooling::Pooling::Transaction => {
                let mut tx = db.pool.begin().await?;
                let done = {
                    let ($on, $persistent) = (&mut *tx, false);
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
