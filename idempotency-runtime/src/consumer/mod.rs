//! The consumer runners, on one core: one builder, [`Consumer`], generic
//! over the transport, and one settlement contract. RabbitMQ
//! ([`amqp`]), NATS JetStream ([`nats`]), Redis
//! Streams ([`redis_streams`]) and Kafka
//! ([`kafka`]) each hold only what differs: how a delivery is
//! read, acked, retried and dead-lettered, and the settings of that
//! transport (a [`Transport`]). Everything else lives here:
//!
//! - `builder`: [`Consumer`]: the settings every runner shares (concurrency,
//!   the delays, the `on_settle` hook) and `run` / `run_with_id`.
//! - `settled`: [`Action`] and [`Settled`]: what the hook is told.
//! - `settle`: the settlement contract, an outcome or error becoming ack
//!   (a recorded answer too: acked once), an uncounted delayed requeue, a
//!   counted retry or a dead letter; the retry budget; the delays.
//! - `run`: the loop: take a delivery when a slot is free, call the handler
//!   in a task of its own (a panic is a failure), settle, report (logs,
//!   metrics, the `on_settle` hook), and stop on shutdown.
//! - `decode`: a payload (JSON) and a message id becoming the handler's
//!   argument, or a poison message.
//! - `transport`: the traits a transport implements (sealed).
//!
//! The core never asks which transport it drives: where they differ (a
//! retry republished with a counter or left to the server's delivery
//! count, a dead letter by the broker or copied by the runner), the trait
//! says it.

mod builder;
pub(crate) mod decode;
pub(crate) mod run;
pub(crate) mod settle;
mod settled;
pub(crate) mod transport;

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "redis-streams")]
pub mod redis_streams;

pub use builder::Consumer;
pub use settled::{Action, Settled};
pub use transport::Transport;

use crate::error::Error;

/// What a consumer runner asks of a handler's error: the
/// [`idempotency::Error`](Error) it carries, if any, so that a database that is
/// down (`Error::Storage`) is waited out instead of spending the message's
/// retries; see the settlement tables of each transport's module. One
/// trait for every runner.
///
/// Implemented for `idempotency::Error` itself and for
/// `Box<dyn std::error::Error + Send + Sync>` (which finds one anywhere in
/// its `source()` chain). For your own error type, return the `idempotency::Error`
/// it wraps:
///
/// ```ignore
/// impl idempotency::consumer::AsIdemError for StockError {
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
/// last `#[idempotent]` call (acked once if that call's answer was a
/// recorded business error: the handler passed it on), and otherwise
/// retried, counted.
#[diagnostic::on_unimplemented(
    message = "the consumer cannot look inside `{Self}` for an `idempotency::Error`",
    label = "the handler's error type must implement `idempotency::consumer::AsIdemError` (re-exported by every transport: `idempotency::amqp::AsIdemError`, ...)",
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
    /// entry's `message_id` field, the Kafka `Idem-Message-Id` header).
    Poison,
    /// The key was already used with other arguments.
    KeyReused,
    /// Invalid key, unreplayable stored result, or unserializable argument.
    Rejected,
    /// RabbitMQ, Kafka: still failing after `Consumer::max_retries` retries
    /// (a retry copy the broker refused counts as one).
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The `action` labels of the settlement metrics, as the metrics table
    /// in `metrics.rs` lists them.
    #[test]
    fn settlements_are_counted_under_their_metric_labels() {
        let labels: Vec<&str> = [
            Action::Ack,
            Action::AckRecorded,
            Action::Requeue,
            Action::Retry { count: 7 },
            Action::Returned,
            Action::DeadLetter(Reason::Poison),
            Action::DeadLetter(Reason::KeyReused),
            Action::DeadLetter(Reason::Rejected),
            Action::DeadLetter(Reason::RetriesExhausted),
            Action::DeadLetter(Reason::DeliveriesExhausted),
        ]
        .into_iter()
        .map(Action::label)
        .collect();
        assert_eq!(
            labels,
            [
                "ack",
                "ack_recorded",
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
