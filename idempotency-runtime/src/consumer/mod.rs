//! The consumer runners' one core: how a handler's result settles a
//! delivery, written once for every transport. RabbitMQ ([`amqp`](crate::amqp)),
//! NATS JetStream ([`nats`](crate::nats)) and Redis Streams
//! ([`redis_streams`](crate::redis_streams)) each implement [`Transport`]
//! (how to read a delivery and carry out a settlement) and [`Deliveries`]
//! (where deliveries come from); everything else lives here:
//!
//! - `settle`: the settlement contract, an outcome or error becoming ack,
//!   an uncounted delayed requeue, a counted retry or a dead letter; the
//!   retry budget; the delays.
//! - `run`: the loop: take a delivery when a slot is free, call the handler
//!   in a task of its own (a panic is a failure), settle, report (logs,
//!   metrics, the `on_settle` hook), and stop on shutdown.
//! - `decode`: a payload (JSON) and a message id becoming the handler's
//!   argument, or a poison message.
//!
//! The core never asks which transport it drives: where they differ (a
//! retry republished with a counter or left to the server's delivery
//! count, a dead letter by the broker or copied by the runner), the trait
//! says it.

pub(crate) mod decode;
pub(crate) mod run;
pub(crate) mod settle;

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "redis-streams")]
pub mod redis_streams;

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use crate::error::Error;
use crate::outcome::Outcome;

/// What a consumer runner asks of a handler's error: the
/// [`idempotency::Error`](Error) it carries, if any, so that a database that is
/// down (`Error::Storage`) is waited out instead of spending the message's
/// retries; see the settlement tables of [`amqp`](crate::amqp),
/// [`nats`](crate::nats) and [`redis_streams`](crate::redis_streams). One
/// trait for every runner.
///
/// Implemented for `idempotency::Error` itself and for
/// `Box<dyn std::error::Error + Send + Sync>` (which finds one anywhere in
/// its `source()` chain). For your own error type, return the `idempotency::Error`
/// it wraps:
///
/// ```ignore
/// impl idempotency::amqp::AsIdemError for StockError {
///     fn idem_error(&self) -> Option<&idempotency::Error> {
///         match self {
///             StockError::Idem(e) => Some(e),
///             _ => None,
///         }
///     }
/// }
/// ```
///
/// An error that carries none is settled by the outcome of the handler's
/// last `#[idempotent]` call, and otherwise retried, counted.
#[diagnostic::on_unimplemented(
    message = "the consumer cannot look inside `{Self}` for an `idempotency::Error`",
    label = "the handler's error type must implement `AsIdemError` (`idempotency::amqp::AsIdemError`, the same trait as `idempotency::nats::AsIdemError` and `idempotency::redis_streams::AsIdemError`)",
    note = "implement it for `{Self}`: return the `idempotency::Error` it wraps, or `None`"
)]
pub trait AsIdemError {
    /// The `idempotency::Error` this error is or wraps, if any.
    fn idem_error(&self) -> Option<&Error>;
}

impl AsIdemError for Error {
    fn idem_error(&self) -> Option<&Error> {
        Some(self)
    }
}

impl AsIdemError for Box<dyn std::error::Error + Send + Sync> {
    fn idem_error(&self) -> Option<&Error> {
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(self.as_ref());
        while let Some(e) = next {
            if let Some(found) = e.downcast_ref::<Error>() {
                return Some(found);
            }
            next = e.source();
        }
        None
    }
}

/// Why a delivery was dead-lettered: one vocabulary for every runner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reason {
    /// The payload did not deserialize into the handler's argument (or,
    /// for `Consumer::run_with_id`, the message had no message id: the
    /// AMQP `message_id` property, the `Nats-Msg-Id` header, the stream
    /// entry's `message_id` field).
    Poison,
    /// The key was already used with other arguments.
    KeyReused,
    /// Invalid key, unreplayable stored result, or unserializable argument.
    Rejected,
    /// RabbitMQ: still failing after `Consumer::max_retries` retries (a
    /// retry copy the broker refused counts as one).
    RetriesExhausted,
    /// NATS JetStream, Redis Streams: still failing at its
    /// `Consumer::max_deliver`th delivery.
    DeliveriesExhausted,
}

impl Reason {
    /// The name on a dead-letter copy (`poison`, `key_reused`, `rejected`,
    /// `retries_exhausted`, `deliveries_exhausted`).
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Poison => "poison",
            Reason::KeyReused => "key_reused",
            Reason::Rejected => "rejected",
            Reason::RetriesExhausted => "retries_exhausted",
            Reason::DeliveriesExhausted => "deliveries_exhausted",
        }
    }
}

/// What the core did with a delivery; each transport names it in its own
/// public `Action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settlement {
    /// Acked.
    Ack,
    /// Given back after a delay, uncounted.
    Requeue,
    /// Given back for a counted retry; `count` is the retry's number
    /// (the budget spent once it runs).
    Retry { count: u64 },
    /// Dead-lettered.
    DeadLetter(Reason),
    /// Back unsettled: the runner was stopping, the connection went, or
    /// the dead-letter copy could not be stored.
    Returned,
}

impl Settlement {
    /// The `action` label of the settlement metrics.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Settlement::Ack => "ack",
            Settlement::Requeue => "requeue",
            Settlement::Retry { .. } => "retry",
            Settlement::Returned => "returned",
            Settlement::DeadLetter(Reason::Poison) => "dead_letter_poison",
            Settlement::DeadLetter(Reason::KeyReused) => "dead_letter_key_reused",
            Settlement::DeadLetter(Reason::Rejected) => "dead_letter_rejected",
            Settlement::DeadLetter(Reason::RetriesExhausted) => "dead_letter_retries_exhausted",
            Settlement::DeadLetter(Reason::DeliveriesExhausted) => "dead_letter_deliveries_exhausted",
        }
    }
}

/// How a counted retry went.
pub(crate) enum Retried<E> {
    /// Given back for its retry; the result of settling the original.
    Done(Result<(), E>),
    /// The transport refused the retry (RabbitMQ: a copy the broker did not
    /// take); why. The retry counts as spent and the next is tried.
    #[cfg_attr(not(feature = "amqp"), allow(dead_code))]
    Refused(String),
    /// The connection went, and the delivery with it: the broker delivers
    /// it again.
    #[cfg_attr(not(feature = "amqp"), allow(dead_code))]
    Lost(E),
}

/// How a dead letter went.
pub(crate) enum DeadLettered<E> {
    /// Dead-lettered; the result of settling the original.
    Done(Result<(), E>),
    /// The dead-letter copy was not stored: the delivery is given back
    /// rather than lost.
    #[cfg_attr(not(any(feature = "nats", feature = "redis-streams")), allow(dead_code))]
    NotStored(E),
}

/// What differs between transports on the settling side: a delivery's
/// parts, and how each settlement is carried out. Shared by the tasks of
/// one runner.
pub(crate) trait Transport: Send + Sync + 'static {
    /// One delivery, as the transport hands it over.
    type Delivery: Send + Sync + 'static;
    /// The transport's error.
    type Error: Display + Send + 'static;
    /// What the `on_settle` hook receives.
    type Settled: Send + 'static;

    /// For logs: `amqp`, `nats`, `redis_streams`.
    const NAME: &'static str;
    /// Where the message id is, for the poison text (`no {MESSAGE_ID}`).
    const MESSAGE_ID: &'static str;
    /// Why a delivery whose retry budget is spent is dead-lettered.
    const EXHAUSTED: Reason;
    /// The settlement counter's name, and the label naming its queue or stream.
    const METRIC: &'static str;
    const METRIC_SCOPE: &'static str;

    /// The queue or stream this runner consumes (logs, metrics).
    fn scope(&self) -> &str;
    /// The payload, or why there is none.
    fn payload(delivery: &Self::Delivery) -> Result<&[u8], String>;
    /// The message id, if the delivery carries one.
    fn message_id(delivery: &Self::Delivery) -> Option<&str>;
    /// How much of the retry budget the delivery has spent: RabbitMQ its
    /// `x-idem-retries`, NATS and Redis its delivery count.
    fn spent(delivery: &Self::Delivery) -> u64;

    fn ack(&self, delivery: &Self::Delivery) -> impl Future<Output = Result<(), Self::Error>> + Send;
    /// Gives the delivery back to come again after `delay` without
    /// spending its budget (`Duration::ZERO`: at once).
    fn requeue(
        &self,
        delivery: &Self::Delivery,
        delay: Duration,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
    /// Gives the delivery back to come again after `delay` as retry number
    /// `count`.
    fn retry(
        &self,
        delivery: &Self::Delivery,
        delay: Duration,
        count: u64,
    ) -> impl Future<Output = Retried<Self::Error>> + Send;
    /// Dead-letters the delivery; `error` is the handler's, or why the
    /// payload was refused.
    fn dead_letter(
        &self,
        delivery: &Self::Delivery,
        reason: Reason,
        error: Option<&str>,
    ) -> impl Future<Output = DeadLettered<Self::Error>> + Send;
    /// What the hook is told.
    fn settled(
        delivery: &Self::Delivery,
        outcome: Option<Outcome>,
        settlement: Settlement,
        error: Option<String>,
    ) -> Self::Settled;
}

/// Where a runner's deliveries come from (owned by its loop).
pub(crate) trait Deliveries: Send {
    type Delivery: Send + 'static;
    type Error: Send + 'static;

    /// The next delivery; `None` once the source ended (after [`stop`](Self::stop):
    /// once it has handed back everything it had taken), `Some(Err)` when it
    /// failed for good. `room` is how many deliveries could start now (at
    /// least 1): a source that fetches in batches takes no more. Dropped
    /// mid-way (the runner stopping), it loses nothing.
    fn next(&mut self, room: usize) -> impl Future<Output = Option<Result<Self::Delivery, Self::Error>>> + Send;
    /// Stops taking deliveries; what [`next`](Self::next) still yields is
    /// given back unhandled.
    fn stop(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send;
    /// After the last delivery was settled (NATS: flush the acks).
    fn finish(self) -> impl Future<Output = ()> + Send;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `action` labels of the settlement metrics, as the metrics table
    /// in `metrics.rs` lists them.
    #[test]
    fn settlements_are_counted_under_their_metric_labels() {
        let labels: Vec<&str> = [
            Settlement::Ack,
            Settlement::Requeue,
            Settlement::Retry { count: 7 },
            Settlement::Returned,
            Settlement::DeadLetter(Reason::Poison),
            Settlement::DeadLetter(Reason::KeyReused),
            Settlement::DeadLetter(Reason::Rejected),
            Settlement::DeadLetter(Reason::RetriesExhausted),
            Settlement::DeadLetter(Reason::DeliveriesExhausted),
        ]
        .into_iter()
        .map(Settlement::label)
        .collect();
        assert_eq!(
            labels,
            [
                "ack",
                "requeue",
                "retry",
                "returned",
                "dead_letter_poison",
                "dead_letter_key_reused",
                "dead_letter_rejected",
                "dead_letter_retries_exhausted",
                "dead_letter_deliveries_exhausted",
            ]
        );
    }

    #[test]
    fn a_boxed_error_finds_the_idem_error_in_its_source_chain() {
        #[derive(Debug)]
        struct Wrapper(Error);
        impl std::fmt::Display for Wrapper {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("wrapped")
            }
        }
        impl std::error::Error for Wrapper {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }

        let direct: Box<dyn std::error::Error + Send + Sync> = Box::new(Error::Storage(sqlx::Error::PoolTimedOut));
        assert!(matches!(direct.idem_error(), Some(Error::Storage(_))));
        let wrapped: Box<dyn std::error::Error + Send + Sync> =
            Box::new(Wrapper(Error::Storage(sqlx::Error::PoolTimedOut)));
        assert!(matches!(wrapped.idem_error(), Some(Error::Storage(_))));
        let other: Box<dyn std::error::Error + Send + Sync> = "no idem error here".into();
        assert!(other.idem_error().is_none());
    }
}
