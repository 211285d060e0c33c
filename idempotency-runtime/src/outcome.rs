//! How a call ended, for the span and for adapters (HTTP, message queues)
//! that must answer differently for a replay or a call in progress.

use std::cell::Cell;
use std::future::Future;

use crate::error::Error;

/// How one `#[idempotent]` call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The body ran and its result was recorded.
    Executed,
    /// A finished call's result was returned again.
    Replayed,
    /// Another call held the key: `Error::InProgress`.
    InProgress,
    /// The key was used with other arguments: `Error::KeyReused`.
    KeyReused,
    /// The call can never succeed as sent: an invalid key, `biz` or
    /// `biz_no`, an argument holding a non-finite float, a result that no
    /// longer deserializes, or one that cannot be serialized.
    Rejected,
    /// The body returned `Err`, or the database failed: nothing was
    /// recorded, and the same call may succeed later.
    Failed,
}

impl Outcome {
    /// The name in the call's tracing span: `executed`, `replayed`,
    /// `in_progress`, `key_reused`, `rejected` or `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::Replayed => "replayed",
            Outcome::InProgress => "in_progress",
            Outcome::KeyReused => "key_reused",
            Outcome::Rejected => "rejected",
            Outcome::Failed => "failed",
        }
    }

    /// How a call that ended with `error` from the engine ended.
    pub(crate) fn of(error: &Error) -> Outcome {
        match error {
            Error::InProgress { .. } => Outcome::InProgress,
            Error::KeyReused { .. } => Outcome::KeyReused,
            // Nothing was recorded: `Storage` may succeed later, the others
            // fail again (consumers spend their retries on them, then
            // dead-letter).
            Error::Storage(_) | Error::StorageRefused(_) | Error::NotMigrated(_) => Outcome::Failed,
            // A recorded failure, seen again: only a replay reports it as an error.
            Error::Permanent { .. } => Outcome::Replayed,
            Error::InvalidKey(_)
            | Error::InvalidBiz
            | Error::BizNoTooLong { .. }
            | Error::InvalidText { .. }
            | Error::ResultTooLarge { .. }
            | Error::NonFiniteFloat { .. }
            | Error::Replay { .. }
            | Error::Serialize(_)
            | Error::InvalidStep { .. } => Outcome::Rejected,
        }
    }
}

tokio::task_local! {
    static LAST: Cell<Option<Outcome>>;
}

/// Runs `future` and reports the outcome of the last `#[idempotent]` call
/// made inside it (`None` if it made none). Adapters wrap handlers in it.
pub async fn observe<F: Future>(future: F) -> (F::Output, Option<Outcome>) {
    LAST.scope(Cell::new(None), async move {
        let output = future.await;
        (output, LAST.with(Cell::get))
    })
    .await
}

/// Polls `future` as [`observe`] runs it, keeping the outcome seen so far
/// in `last` between polls: for adapters whose future must be a named type.
pub(crate) fn poll_observed<F: Future>(
    future: std::pin::Pin<&mut F>,
    last: &mut Option<Outcome>,
    cx: &mut std::task::Context<'_>,
) -> std::task::Poll<F::Output> {
    let (poll, seen) = LAST.sync_scope(Cell::new(*last), || {
        let poll = future.poll(cx);
        (poll, LAST.with(Cell::get))
    });
    *last = seen;
    poll
}

pub(crate) fn report(outcome: Outcome) {
    // Outside `observe` there is nobody to tell.
    let _ = LAST.try_with(|last| last.set(Some(outcome)));
}
