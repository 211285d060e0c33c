//! A claimed call's transaction, opened while its claim is in flight.
//!
//! With a Redis claim a first call made two round trips before its body:
//! the claim, then `BEGIN`. Neither needs the other's answer, so `BEGIN`
//! goes out beside the claim, and the call waits for the slower of the two.
//! A call the claim turns away (a replay, a duplicate of a running call)
//! rolls its transaction back off its path. So that duplicates cost the
//! database little, only fns whose recent calls all ran open early
//! (`read_first`'s counter at rest), and only on a server: SQLite's `BEGIN
//! IMMEDIATE` is no round trip but takes the file's write lock, which a
//! duplicate must not hold.
//!
//! Nothing here decides who runs: the claim does, and the unique index
//! after it. `BEGIN` takes no lock and starts no snapshot on either server
//! (a snapshot starts at the first read), so the body sees what it saw
//! when the transaction opened after the claim.

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::task::Poll;

use sqlx::{Pool, Transaction};

use super::typed::BoxFuture;
use crate::store::Backend;
use crate::store::record::rollback;

type Opened<DB> = Result<Transaction<'static, DB>, sqlx::Error>;

/// A transaction on its way, or open.
pub(crate) struct EarlyBegin<DB: Backend> {
    state: State<DB>,
}

enum State<DB: Backend> {
    Opening(BoxFuture<'static, Opened<DB>>),
    Opened(Opened<DB>),
    Taken,
}

/// Whether `pool` has a connection for an early `BEGIN` without a wait: one
/// idle, or room for one more. Behind other calls' turns it saves nothing.
pub(crate) fn lends_at_once<DB: Backend>(pool: &Pool<DB>) -> bool {
    pool.num_idle() > 0 || pool.size() < pool.options().get_max_connections()
}

impl<DB: Backend> EarlyBegin<DB> {
    /// Starts opening a transaction on `pool` (sent when first polled).
    pub(crate) fn start(pool: &Pool<DB>) -> Self {
        let pool = pool.clone();
        Self { state: State::Opening(Box::pin(async move { DB::begin(&pool).await })) }
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

    /// The transaction, for the call its claim let through.
    pub(crate) async fn take(mut self) -> Opened<DB> {
        match std::mem::replace(&mut self.state, State::Taken) {
            State::Opening(opening) => opening.await,
            State::Opened(opened) => opened,
            State::Taken => unreachable!("taken once, by value"),
        }
    }
}

/// Not taken: rolled back in the background. A `BEGIN` already sent is
/// answered first (a connection dropped mid-statement would go back to
/// the pool inside a transaction nobody knows of).
impl<DB: Backend> Drop for EarlyBegin<DB> {
    fn drop(&mut self) {
        let undo: BoxFuture<'static, ()> = match std::mem::replace(&mut self.state, State::Taken) {
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
