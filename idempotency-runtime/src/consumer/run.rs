//! The loop every runner runs: take a delivery when a slot is free, call
//! the handler in a task of its own (a panic becomes a failure rather than
//! a delivery never settled), settle it by [`verdict`], report it (logs,
//! metrics, the `on_settle` hook), and on shutdown stop taking deliveries,
//! give back what was taken but not started, and wait for the rest.

use std::fmt::Debug;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinError, JoinSet};

use super::settle::{Budget, Policy, Verdict, verdict};
use super::transport::{DeadLettered, Deliveries, Retried, Settle};
use super::{Action, AsIdemError, Reason, Settled};
use crate::outcome::{Outcome, observe_call};

/// A handler as the loop calls it: the user's `Fn(I) -> impl Future<Output
/// = Result<R, E>>`, its value dropped (the handler dealt with it).
pub(crate) trait Handler<I>: Send + Sync + 'static {
    type Error: AsIdemError + Debug + Send + 'static;

    fn call(&self, input: I) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static;
}

impl<I, F, Fut, R, E> Handler<I> for F
where
    F: Fn(I) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<R, E>> + Send + 'static,
    R: Send + 'static,
    E: AsIdemError + Debug + Send + 'static,
{
    type Error = E;

    fn call(&self, input: I) -> impl Future<Output = Result<(), E>> + Send + 'static {
        let call = self(input);
        async move { call.await.map(drop) }
    }
}

/// The `on_settle` hook.
pub(crate) type Hook<S> = Arc<dyn Fn(&S) + Send + Sync>;

/// One runner: its transport, its policy, its hook.
pub(crate) struct Runner<T: Settle> {
    pub(crate) transport: T,
    pub(crate) policy: Policy,
    /// How many deliveries are handled at once (at least 1).
    pub(crate) concurrency: usize,
    pub(crate) on_settle: Option<Hook<Settled<T::Delivered>>>,
}

/// What every delivery's task shares.
struct Shared<T: Settle> {
    transport: T,
    policy: Policy,
    on_settle: Option<Hook<Settled<T::Delivered>>>,
}

/// Runs until `shutdown` resolves or `deliveries` fails (its error is
/// returned): each delivery is decoded by `decode` (an `Err` is poison)
/// and handed to `handler`.
pub(crate) async fn run<T, D, I, H, S>(
    runner: Runner<T>,
    mut deliveries: D,
    shutdown: S,
    decode: fn(&T::Delivery) -> Result<I, String>,
    handler: H,
) -> Result<(), T::Error>
where
    T: Settle,
    D: Deliveries<Delivery = T::Delivery, Error = T::Error>,
    I: Send + 'static,
    H: Handler<I>,
    S: Future,
{
    let Runner { transport, policy, concurrency, on_settle } = runner;
    let shared = Arc::new(Shared { transport, policy, on_settle });
    let handler = Arc::new(handler);
    let permits = Arc::new(Semaphore::new(concurrency.max(1)));
    let mut tasks = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    let mut stopping = false;
    let mut failure = None;
    loop {
        while let Some(joined) = tasks.try_join_next() {
            report_panic::<T>(joined);
        }
        if stopping {
            // Taken before the stop, never started: back, unhandled.
            match deliveries.next(1).await {
                None => break,
                Some(Err(e)) => {
                    failure = Some(e);
                    break;
                }
                Some(Ok(delivery)) => {
                    let result = shared.transport.requeue(&delivery, Duration::ZERO).await;
                    finish(&shared, &delivery, None, Action::Returned, result, None);
                    continue;
                }
            }
        }
        // A slot first: no delivery is taken that cannot start at once.
        let Some(permit) = until(shutdown.as_mut(), Arc::clone(&permits).acquire_owned()).await else {
            stopping = true;
            if let Err(e) = stop::<T, D>(&shared, &mut deliveries).await {
                failure = Some(e);
                break;
            }
            continue;
        };
        let permit = permit.expect("the semaphore is never closed");
        let room = permits.available_permits() + 1;
        let delivery = match until(shutdown.as_mut(), deliveries.next(room)).await {
            None => {
                stopping = true;
                if let Err(e) = stop::<T, D>(&shared, &mut deliveries).await {
                    failure = Some(e);
                    break;
                }
                continue;
            }
            Some(None) => break,
            Some(Some(Err(e))) => {
                failure = Some(e);
                break;
            }
            Some(Some(Ok(delivery))) => delivery,
        };
        let shared = Arc::clone(&shared);
        let handler = Arc::clone(&handler);
        tasks.spawn(async move { handle(&shared, delivery, decode, handler, permit).await });
    }
    while let Some(joined) = tasks.join_next().await {
        report_panic::<T>(joined);
    }
    deliveries.finish().await;
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// `future`'s output, or `None` once `shutdown` resolved first. Called only
/// until `shutdown` resolved (it is not polled again after that).
async fn until<S: Future, F: Future>(mut shutdown: Pin<&mut S>, future: F) -> Option<F::Output> {
    let mut future = pin!(future);
    poll_fn(|cx| {
        if shutdown.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        future.as_mut().poll(cx).map(Some)
    })
    .await
}

async fn stop<T: Settle, D: Deliveries<Error = T::Error>>(
    shared: &Shared<T>,
    deliveries: &mut D,
) -> Result<(), T::Error> {
    tracing::info!(transport = T::NAME, source = %shared.transport.scope(), "idem consumer stopping");
    deliveries.stop().await
}

/// A delivery's task ended by a panic of ours (a handler's own panic is
/// caught in its task and settled as a failure): say so rather than drop it.
fn report_panic<T: Settle>(joined: Result<(), JoinError>) {
    if let Err(e) = joined {
        tracing::error!(transport = T::NAME, error = %e,
            "idem consumer: a delivery's task panicked; the delivery comes back once the transport redelivers it");
    }
}

async fn handle<T: Settle, I: Send + 'static, H: Handler<I>>(
    shared: &Shared<T>,
    delivery: T::Delivery,
    decode: fn(&T::Delivery) -> Result<I, String>,
    handler: Arc<H>,
    permit: OwnedSemaphorePermit,
) {
    let budget = Budget { spent: T::spent(&delivery), bound: shared.policy.bound, exhausted: T::EXHAUSTED };
    let (verdict, outcome, error) = match decode(&delivery) {
        Err(e) => (Verdict::DeadLetter(Reason::Poison), None, Some(e)),
        Ok(input) => {
            // Its own task, so a panic in the handler (in the call itself or
            // in its future) becomes a failure instead of a delivery that is
            // never settled.
            let call = tokio::spawn(async move { observe_call(handler.call(input)).await });
            match call.await {
                Ok((Ok(()), last)) => (Verdict::Ack, last.map(|last| last.outcome), None),
                Ok((Err(e), last)) => {
                    (verdict(Err(e.idem_error()), last, budget), last.map(|last| last.outcome), Some(format!("{e:?}")))
                }
                Err(join) => (verdict(Err(None), None, budget), None, Some(format!("handler panicked: {join}"))),
            }
        }
    };
    // A delivery waiting out a delay holds no slot.
    drop(permit);

    let transport = &shared.transport;
    let (settlement, result) = match verdict {
        Verdict::Ack => (Action::Ack, transport.ack(&delivery).await),
        Verdict::AckRecorded => (Action::AckRecorded, transport.ack(&delivery).await),
        Verdict::Requeue(wait) => (Action::Requeue, transport.requeue(&delivery, shared.policy.delay(wait)).await),
        Verdict::Retry => retry(shared, &delivery, budget, error.as_deref()).await,
        Verdict::DeadLetter(reason) => dead_letter(shared, &delivery, reason, error.as_deref()).await,
    };
    finish(shared, &delivery, outcome, settlement, result, error);
}

/// Retries while the budget allows: a retry the transport refuses spends
/// its share too (given back uncounted, a message the queue cannot take
/// would go round forever); once spent, the delivery is dead-lettered.
async fn retry<T: Settle>(
    shared: &Shared<T>,
    delivery: &T::Delivery,
    mut budget: Budget,
    error: Option<&str>,
) -> (Action, Result<(), T::Error>) {
    while !budget.is_spent() {
        let count = budget.spent + 1;
        match shared.transport.retry(delivery, shared.policy.retry_delay, count).await {
            Retried::Done(result) => return (Action::Retry { count }, result),
            Retried::Refused(why) => {
                tracing::warn!(transport = T::NAME, source = %shared.transport.scope(), retries = count,
                    "{why}; the retry is spent");
                budget.spent = count;
            }
            // The connection is gone, and the delivery with it: the
            // transport delivers it again, with the count it had.
            Retried::Lost(e) => return (Action::Returned, Err(e)),
            Retried::Returned => return (Action::Returned, Ok(())),
        }
    }
    dead_letter(shared, delivery, budget.exhausted, error).await
}

/// Dead-letters the delivery; if its copy is not stored, gives it back
/// after the retry delay: a dead letter is never lost.
async fn dead_letter<T: Settle>(
    shared: &Shared<T>,
    delivery: &T::Delivery,
    reason: Reason,
    error: Option<&str>,
) -> (Action, Result<(), T::Error>) {
    match shared.transport.dead_letter(delivery, reason, error).await {
        DeadLettered::Done(result) => (Action::DeadLetter(reason), result),
        DeadLettered::NotStored(e) => {
            tracing::warn!(transport = T::NAME, source = %shared.transport.scope(), error = %e,
                "idem consumer: dead-letter copy not stored; the delivery comes back");
            (Action::Returned, shared.transport.requeue(delivery, shared.policy.retry_delay).await)
        }
    }
}

/// Logs the settlement, counts it, and tells the hook.
fn finish<T: Settle>(
    shared: &Shared<T>,
    delivery: &T::Delivery,
    outcome: Option<Outcome>,
    settlement: Action,
    result: Result<(), T::Error>,
    error: Option<String>,
) {
    let scope = shared.transport.scope();
    let action = settlement.label();
    match result {
        Ok(()) => tracing::debug!(transport = T::NAME, source = %scope, action, outcome = ?outcome, "settled"),
        // The connection is gone: the transport delivers it again.
        Err(e) => tracing::warn!(transport = T::NAME, source = %scope, action, error = %e,
            "idem consumer: settling failed; the delivery comes back"),
    }
    match &error {
        // Done: the error is the answer its call recorded.
        Some(error) if settlement == Action::AckRecorded => tracing::info!(transport = T::NAME, source = %scope,
            action, outcome = ?outcome, error = %error, "idem consumer: acked the recorded answer the handler returned"),
        Some(error) => {
            tracing::warn!(transport = T::NAME, source = %scope, action, error = %error, "idem consumer: delivery not done")
        }
        None => {}
    }
    crate::metrics::consumer_settled(T::METRIC, T::METRIC_SCOPE, scope, action);
    if let Some(hook) = &shared.on_settle {
        hook(&Settled {
            outcome,
            action: settlement,
            message_id: T::message_id(delivery).map(str::to_owned),
            error,
            delivery: T::delivered(delivery),
        });
    }
}
