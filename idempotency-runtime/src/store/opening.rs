//! A transaction on its way: `BEGIN` sent, its answer awaited, and never
//! dropped half-way. sqlx, dropped between sending `BEGIN` and reading its
//! answer, hands the connection back to the pool inside the transaction,
//! unknown to it: the pool's next borrower then runs its statements in it,
//! and they are never committed (`tests/suite/early_begin.rs` shows it on
//! MariaDB and PostgreSQL). A caller's future is dropped whenever its caller
//! gives up (a timeout, a client gone), so every `BEGIN` on a call's path
//! goes through here: dropped before its answer, an [`Opening`] is answered
//! and rolled back on a task of its own.

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

use sqlx::{Pool, Transaction};

use super::{Backend, ErrorClass};
use crate::clock::AskingAgain;

type Opened<DB> = Result<Transaction<'static, DB>, sqlx::Error>;
type Begin<DB> = std::pin::Pin<Box<dyn Future<Output = Opened<DB>> + Send>>;

/// A transaction on its way, or open.
pub(crate) struct Opening<DB: Backend> {
    state: State<DB>,
}

enum State<DB: Backend> {
    Opening(Begin<DB>),
    Opened(Opened<DB>),
    Taken,
}

/// Opens a transaction on `pool` ([`Backend::begin`]), whole even if the
/// caller's future is dropped.
pub(crate) async fn begin<DB: Backend>(pool: &Pool<DB>) -> Opened<DB> {
    Opening::begin(pool).take().await
}

/// [`Backend::begin_bounded`], whole even if the caller's future is dropped.
/// Where the wait for a duplicate is the `BEGIN`'s own and the database
/// bounds it (SQLite: `BEGIN IMMEDIATE`, the pool's busy timeout), a `BEGIN`
/// that timed out is sent again at doubling intervals until `wait` has
/// passed: the call waits the longer of the two, as it does on a server.
/// (Each try is whole; only the last may end past `wait`, by at most one
/// busy timeout.)
pub(crate) async fn begin_bounded<DB: Backend>(pool: &Pool<DB>, wait: Duration) -> Opened<DB> {
    let mut asking = DB::WAITS_AT_BEGIN.then(|| AskingAgain::until(crate::clock::deadline_in(wait)));
    loop {
        let pool = pool.clone();
        let opened = whole(async move { DB::begin_bounded(&pool, wait).await }).await;
        match (&opened, &mut asking) {
            (Err(e), Some(asking)) if DB::classify(e) == ErrorClass::LockTimeout => {
                if !asking.pause(None).await {
                    return opened;
                }
            }
            _ => return opened,
        }
    }
}

/// `begin` (any opening of a transaction), whole even if the caller's
/// future is dropped.
pub(crate) async fn whole<DB: Backend>(begin: impl Future<Output = Opened<DB>> + Send + 'static) -> Opened<DB> {
    Opening::new(Box::pin(begin)).take().await
}

impl<DB: Backend> Opening<DB> {
    fn new(begin: Begin<DB>) -> Self {
        Self { state: State::Opening(begin) }
    }

    /// Starts opening a transaction on `pool` (sent when first polled).
    pub(crate) fn begin(pool: &Pool<DB>) -> Self {
        let pool = pool.clone();
        Self::new(Box::pin(async move { DB::begin(&pool).await }))
    }

    /// Runs `work` to its end while the transaction opens beside it.
    pub(crate) async fn beside<F: Future>(&mut self, work: F) -> F::Output {
        let mut work = pin!(work);
        poll_fn(|cx| {
            if let State::Opening(opening) = &mut self.state
                && let Poll::Ready(opened) = opening.as_mut().poll(cx)
            {
                self.state = State::Opened(opened);
            }
            work.as_mut().poll(cx)
        })
        .await
    }

    /// The transaction, once open. Dropped while it waits, the opening
    /// goes on in the background (see [`Drop`]).
    pub(crate) async fn take(&mut self) -> Opened<DB> {
        if let State::Opening(opening) = &mut self.state {
            let opened = opening.as_mut().await;
            self.state = State::Opened(opened);
        }
        match std::mem::replace(&mut self.state, State::Taken) {
            State::Opened(opened) => opened,
            State::Opening(_) | State::Taken => Err(sqlx::Error::Protocol("a transaction taken twice".into())),
        }
    }
}

/// Not taken: rolled back in the background, a `BEGIN` already sent
/// answered first.
impl<DB: Backend> Drop for Opening<DB> {
    fn drop(&mut self) {
        let undo: std::pin::Pin<Box<dyn Future<Output = ()> + Send>> =
            match std::mem::replace(&mut self.state, State::Taken) {
                State::Opening(opening) => Box::pin(async move {
                    if let Ok(tx) = opening.await {
                        rollback(tx).await;
                    }
                }),
                State::Opened(Ok(tx)) => Box::pin(rollback(tx)),
                State::Opened(Err(_)) | State::Taken => return,
            };
        // Outside a runtime nothing can run it: it is dropped, as sqlx's
        // futures are when their caller's is.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(undo);
        }
    }
}

/// Rolls `tx` back. A failed rollback leaves nothing to undo: the server
/// rolls back when the connection goes, and sqlx discards a connection in a
/// broken state.
pub(crate) async fn rollback<DB: Backend>(tx: Transaction<'_, DB>) {
    if let Err(e) = tx.rollback().await {
        tracing::debug!(error = %e, "rollback failed");
    }
}
