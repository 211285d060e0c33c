//! What a runner tells the `on_settle` hook of each delivery, in one
//! vocabulary for every transport; the transport adds what only it knows
//! (its counts, where the delivery was) in [`Settled::delivery`].

use super::Reason;
use crate::outcome::Outcome;

/// How a delivery was settled. What each means on the wire is the
/// transport's (see the settlement table in its module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Acked: the handler returned `Ok` (its call executed or replayed, or
    /// it dealt with the failure itself).
    Ack,
    /// Acked, once, although the handler returned `Err`: its last call's
    /// answer was a recorded business error (a `record_errors` fn's
    /// declared error, or a `steps` call's `Error::Permanent`), executed
    /// now or replayed ([`Settled::outcome`] says which). That error is the
    /// message's final answer; a retry would only replay it. The handler's
    /// error is in [`Settled::error`].
    AckRecorded,
    /// Given back to come again after a delay, not counted as a retry: a
    /// duplicate was running elsewhere (`InProgress`, after
    /// [`Consumer::in_progress_delay`](super::Consumer::in_progress_delay)),
    /// or the database failed (`Error::Storage`, after
    /// [`Consumer::storage_delay`](super::Consumer::storage_delay)).
    Requeue,
    /// Given back for a counted retry after
    /// [`Consumer::retry_delay`](super::Consumer::retry_delay).
    Retry {
        /// The retry's number in the transport's own count: the retry
        /// header of the copy (RabbitMQ `x-idem-retries`, Kafka
        /// `Idem-Retries`), or the delivery it comes back as (NATS, Redis
        /// Streams: the delivery count it had, plus one).
        count: u64,
    },
    /// Dead-lettered, and why.
    DeadLetter(Reason),
    /// Back unsettled by the handler: the runner was stopping, the
    /// connection went, its partition was revoked (Kafka: a retry still
    /// waiting out its delay), or the dead-letter copy could not be stored;
    /// the transport delivers it again.
    Returned,
}

impl Action {
    /// The `action` label of the settlement metrics.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Action::Ack => "ack",
            Action::AckRecorded => "ack_recorded",
            Action::Requeue => "requeue",
            Action::Retry { .. } => "retry",
            Action::Returned => "returned",
            Action::DeadLetter(Reason::Poison) => "dead_letter_poison",
            Action::DeadLetter(Reason::KeyReused) => "dead_letter_key_reused",
            Action::DeadLetter(Reason::Rejected) => "dead_letter_rejected",
            Action::DeadLetter(Reason::RetriesExhausted) => "dead_letter_retries_exhausted",
            Action::DeadLetter(Reason::DeliveriesExhausted) => "dead_letter_deliveries_exhausted",
        }
    }
}

/// What the runner did with one delivery; passed to
/// [`Consumer::on_settle`](super::Consumer::on_settle). `D` is what the
/// transport tells of the delivery (each transport module names it
/// `Delivered`, and `Settled` for this type with it).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Settled<D> {
    /// The outcome of the last `#[idempotent]` call the handler made, if any.
    pub outcome: Option<Outcome>,
    /// The settlement.
    pub action: Action,
    /// The delivery's message id, if it carries one (what
    /// [`Consumer::run_with_id`](super::Consumer::run_with_id) hands over).
    pub message_id: Option<String>,
    /// The handler's error or panic, or why the payload was refused, as text.
    pub error: Option<String>,
    /// What the transport tells of the delivery: its counts, where it was.
    pub delivery: D,
}
