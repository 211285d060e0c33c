//! How a call ended, for the span and for adapters (HTTP, message queues)
//! that must answer differently for a replay, a call in progress or a
//! recorded business error.

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

/// What an adapter learns of the last call a future made: how it ended,
/// and whether its answer is a recorded business error (a `record_errors`
/// fn's declared error, or a `steps` call's permanent failure; executed
/// now or replayed). A consumer acks such an answer once instead of
/// retrying it: a retry would only replay it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Observed {
    pub(crate) outcome: Outcome,
    pub(crate) recorded_error: bool,
}

impl From<Outcome> for Observed {
    fn from(outcome: Outcome) -> Self {
        Observed { outcome, recorded_error: false }
    }
}

thread_local! {
    /// What the last call made by the observed future this thread is
    /// polling reported: swapped in and out around each of its polls, as a
    /// task local is, without a task local's lazy set-up and borrow checks
    /// (an HTTP replay polls its handler through this twice). A call outside
    /// any `observe` writes it too, and nobody reads that.
    static LAST: Cell<Option<Observed>> = const { Cell::new(None) };
}

/// Runs `future` and reports the outcome of the last `#[idempotent]` call
/// made inside it (`None` if it made none). Adapters wrap handlers in it.
pub async fn observe<F: Future>(future: F) -> (F::Output, Option<Outcome>) {
    let (output, last) = observe_call(future).await;
    (output, last.map(|last| last.outcome))
}

/// [`observe`], telling also whether the last call's answer is a recorded
/// business error: for the consumer and cron runners.
pub(crate) async fn observe_call<F: Future>(future: F) -> (F::Output, Option<Observed>) {
    let mut future = std::pin::pin!(future);
    let mut last = None;
    let output = std::future::poll_fn(|cx| poll_observed(future.as_mut(), &mut last, cx)).await;
    (output, last)
}

/// Polls `future` as [`observe`] runs it, keeping what was seen so far in
/// `last` between polls: for adapters whose future must be a named type.
pub(crate) fn poll_observed<F: Future>(
    future: std::pin::Pin<&mut F>,
    last: &mut Option<Observed>,
    cx: &mut std::task::Context<'_>,
) -> std::task::Poll<F::Output> {
    /// Puts back what an enclosing `observe` had seen, even if the poll panics.
    struct Restore(Option<Observed>);
    impl Drop for Restore {
        fn drop(&mut self) {
            LAST.set(self.0);
        }
    }
    let _outer = Restore(LAST.replace(*last));
    let poll = future.poll(cx);
    *last = LAST.get();
    poll
}

/// Tells the enclosing `observe` how the call it polls ended.
pub(crate) fn report(observed: impl Into<Observed>) {
    LAST.set(Some(observed.into()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_observer_sees_the_calls_inside_it_alone() {
        report(Outcome::Failed); // outside any observer: nobody reads it
        let (((), inner), outer) = observe(async {
            report(Outcome::Executed);
            let inner = observe(async {
                tokio::task::yield_now().await;
                report(Outcome::Replayed);
            })
            .await;
            tokio::task::yield_now().await;
            inner
        })
        .await;
        assert_eq!((inner, outer), (Some(Outcome::Replayed), Some(Outcome::Executed)));
        assert_eq!(observe(tokio::task::yield_now()).await.1, None);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn observers_polled_in_turn_on_one_thread_keep_their_own() {
        let step = |outcome: Outcome| async move {
            for _ in 0..3 {
                report(outcome);
                tokio::task::yield_now().await;
            }
        };
        let (a, b) = tokio::join!(observe(step(Outcome::Executed)), observe(step(Outcome::Replayed)));
        assert_eq!((a.1, b.1), (Some(Outcome::Executed), Some(Outcome::Replayed)));
    }

    #[test]
    fn a_poll_that_panics_gives_the_enclosing_observer_its_outcome_back() {
        LAST.set(Some(Outcome::Executed.into()));
        let mut panicking = std::pin::pin!(async {
            report(Outcome::Replayed);
            panic!("the handler panics");
        });
        let mut last = None;
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            poll_observed(panicking.as_mut(), &mut last, &mut cx)
        }));
        assert!(polled.is_err());
        assert_eq!(LAST.get(), Some(Outcome::Executed.into()));
    }

    #[tokio::test]
    async fn a_recorded_error_is_seen_as_the_last_call_reported_it() {
        let declined = Observed { outcome: Outcome::Replayed, recorded_error: true };
        let ((), last) = observe_call(async {
            report(Outcome::Executed);
            tokio::task::yield_now().await;
            report(declined);
        })
        .await;
        assert_eq!(last, Some(declined));
        // A later call decides: its own answer is not a recorded error.
        let ((), last) = observe_call(async {
            report(declined);
            tokio::task::yield_now().await;
            report(Outcome::Executed);
        })
        .await;
        assert_eq!(last, Some(Outcome::Executed.into()));
        assert_eq!(observe(async { report(declined) }).await.1, Some(Outcome::Replayed));
    }
}
