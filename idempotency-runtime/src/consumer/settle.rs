//! The settlement contract, once for every transport: what a handler's
//! result (`Ok`, or `Err` with the `idempotency::Error` it carries) and the outcome
//! of its last `#[idempotent]` call make of a delivery, against its retry
//! budget. The transports' settlement tables (module docs of `amqp`, `nats`,
//! `redis_streams`, `kafka`) are this function, carried out.

use std::time::Duration;

use super::Reason;
use crate::error::Error;
use crate::outcome::{Observed, Outcome};

/// What to do with a delivery, before doing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Ack,
    /// Acked although the handler returned `Err`: its error is its call's
    /// recorded answer (a declared business error, or a two-phase call's
    /// permanent failure), final, which a retry would only replay.
    AckRecorded,
    /// Back after a delay, not counted as a retry.
    Requeue(Wait),
    /// Back for a counted retry (the budget allows one).
    Retry,
    DeadLetter(Reason),
}

/// Why a requeued delivery waits, and so for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// A duplicate of the call is running elsewhere.
    InProgress,
    /// The database failed or is down: no fault of the message.
    Storage,
}

/// A delivery's retry budget: how much it spent (as the transport counts:
/// RabbitMQ its retries, NATS and Redis its deliveries) against the bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Budget {
    pub(crate) spent: u64,
    pub(crate) bound: u64,
    /// The reason a delivery is dead-lettered with once it is spent.
    pub(crate) exhausted: Reason,
}

impl Budget {
    pub(crate) fn is_spent(self) -> bool {
        self.spent >= self.bound
    }
}

/// The bound and the delays of one runner.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Policy {
    /// The retry budget's bound ([`Budget::bound`]).
    pub(crate) bound: u64,
    pub(crate) retry_delay: Duration,
    pub(crate) in_progress_delay: Duration,
    pub(crate) storage_delay: Duration,
}

impl Policy {
    pub(crate) fn delay(&self, wait: Wait) -> Duration {
        match wait {
            Wait::InProgress => self.in_progress_delay,
            Wait::Storage => self.storage_delay,
        }
    }
}

/// The settlement of a handler's result: `Ok`, or `Err` with the
/// `idempotency::Error` it carries; `last` is what its last call reported. A
/// failure is retried while the budget allows, then dead-lettered; a
/// database that is down or a call in progress elsewhere never spends the
/// budget; a recorded answer (a declared business error, executed or
/// replayed) is acked once: every retry would only replay it.
pub(crate) fn verdict(result: Result<(), Option<&Error>>, last: Option<Observed>, budget: Budget) -> Verdict {
    let carried = match result {
        // The handler dealt with whatever its calls returned.
        Ok(()) => return Verdict::Ack,
        Err(carried) => carried,
    };
    let failed = || if budget.is_spent() { Verdict::DeadLetter(budget.exhausted) } else { Verdict::Retry };
    match carried {
        Some(Error::Storage(_)) => Verdict::Requeue(Wait::Storage),
        // A failure that will recur: counted retries (the classification
        // by code may be wrong for one odd case), then the dead letter.
        Some(Error::StorageRefused(_) | Error::NotMigrated(_)) => failed(),
        Some(Error::InProgress { .. }) => Verdict::Requeue(Wait::InProgress),
        Some(Error::KeyReused { .. }) => Verdict::DeadLetter(Reason::KeyReused),
        // A two-phase call's recorded failure: its answer, as a declared
        // business error is.
        Some(Error::Permanent { .. }) => Verdict::AckRecorded,
        // `InvalidKey`, `Replay`, `Serialize` and the like: the call can
        // never succeed as sent (the engine's `Outcome::Rejected`).
        Some(_) => Verdict::DeadLetter(Reason::Rejected),
        // The handler passed on its call's recorded answer (the error type
        // holds it, not an `idempotency::Error`).
        None if last.is_some_and(|last| last.recorded_error) => Verdict::AckRecorded,
        None => match last.map(|last| last.outcome) {
            Some(Outcome::InProgress) => Verdict::Requeue(Wait::InProgress),
            Some(Outcome::KeyReused) => Verdict::DeadLetter(Reason::KeyReused),
            Some(Outcome::Rejected) => Verdict::DeadLetter(Reason::Rejected),
            Some(Outcome::Failed | Outcome::Executed | Outcome::Replayed) | None => failed(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Failure, KeyError};

    /// The verdict when the last call's answer is not a recorded error.
    fn verdict_of(result: Result<(), Option<&Error>>, outcome: Option<Outcome>, budget: Budget) -> Verdict {
        verdict(result, outcome.map(Observed::from), budget)
    }

    /// The last call's answer was a recorded business error, `outcome` (executed or replayed).
    fn recorded(outcome: Outcome) -> Option<Observed> {
        Some(Observed { outcome, recorded_error: true })
    }

    const EVERY_OUTCOME: [Option<Outcome>; 7] = [
        None,
        Some(Outcome::Executed),
        Some(Outcome::Replayed),
        Some(Outcome::InProgress),
        Some(Outcome::KeyReused),
        Some(Outcome::Rejected),
        Some(Outcome::Failed),
    ];

    /// A RabbitMQ delivery on its first attempt, `Consumer::max_retries(3)`.
    const AMQP_FIRST: Budget = Budget { spent: 0, bound: 3, exhausted: Reason::RetriesExhausted };

    /// A NATS message at its `delivered`th delivery, against `max_deliver`.
    fn nats(delivered: u64, max_deliver: u64) -> Budget {
        Budget { spent: delivered, bound: max_deliver, exhausted: Reason::DeliveriesExhausted }
    }

    fn json_error() -> serde_json::Error {
        serde_json::from_str::<u8>("x").unwrap_err()
    }

    // The RabbitMQ table (`amqp`'s module docs).

    #[test]
    fn a_handler_returning_ok_is_acked_whatever_its_calls_returned() {
        for outcome in EVERY_OUTCOME {
            assert_eq!(verdict_of(Ok(()), outcome, AMQP_FIRST), Verdict::Ack, "{outcome:?}");
        }
    }

    #[test]
    fn a_storage_error_is_requeued_uncounted_whatever_the_outcome() {
        let down = Error::Storage(sqlx::Error::PoolTimedOut);
        for outcome in EVERY_OUTCOME {
            assert_eq!(
                verdict_of(Err(Some(&down)), outcome, AMQP_FIRST),
                Verdict::Requeue(Wait::Storage),
                "{outcome:?}"
            );
        }
    }

    /// Regression: a failure that recurs (a NUL PostgreSQL refuses, a
    /// body's own constraint, missing tables) was requeued uncounted for
    /// ever, never dead-lettered. It spends the budget, then dead-letters.
    #[test]
    fn a_final_storage_error_spends_the_budget_then_dead_letters() {
        let refused = Error::StorageRefused(sqlx::Error::RowNotFound);
        let not_migrated = Error::NotMigrated(sqlx::Error::RowNotFound);
        for error in [&refused, &not_migrated] {
            for outcome in EVERY_OUTCOME {
                assert_eq!(verdict_of(Err(Some(error)), outcome, AMQP_FIRST), Verdict::Retry, "{error:?}");
                let spent = Budget { spent: 3, ..AMQP_FIRST };
                let dead = Verdict::DeadLetter(Reason::RetriesExhausted);
                assert_eq!(verdict_of(Err(Some(error)), outcome, spent), dead, "{error:?}");
                assert_eq!(
                    verdict_of(Err(Some(error)), outcome, nats(4, 4)),
                    Verdict::DeadLetter(Reason::DeliveriesExhausted)
                );
            }
        }
    }

    #[test]
    fn a_carried_error_decides_before_the_outcome() {
        let in_progress = Error::InProgress { biz: "b", key: "k".into() };
        let reused = Error::KeyReused { biz: "b", key: "k".into() };
        let replay = Error::Replay { biz: "b", key: "k".into(), source: json_error() };
        let outcome = Some(Outcome::Failed);
        assert_eq!(verdict_of(Err(Some(&in_progress)), outcome, AMQP_FIRST), Verdict::Requeue(Wait::InProgress));
        assert_eq!(verdict_of(Err(Some(&reused)), outcome, AMQP_FIRST), Verdict::DeadLetter(Reason::KeyReused));
        for rejected in [Error::InvalidKey(KeyError::Missing), replay, Error::Serialize(json_error())] {
            assert_eq!(
                verdict_of(Err(Some(&rejected)), outcome, AMQP_FIRST),
                Verdict::DeadLetter(Reason::Rejected),
                "{rejected:?}"
            );
        }
    }

    #[test]
    fn an_error_carrying_nothing_is_settled_by_the_outcome() {
        let expected = [
            Verdict::Retry,
            Verdict::Retry,
            Verdict::Retry,
            Verdict::Requeue(Wait::InProgress),
            Verdict::DeadLetter(Reason::KeyReused),
            Verdict::DeadLetter(Reason::Rejected),
            Verdict::Retry,
        ];
        for (outcome, expected) in EVERY_OUTCOME.into_iter().zip(expected) {
            assert_eq!(verdict_of(Err(None), outcome, AMQP_FIRST), expected, "{outcome:?}");
        }
    }

    // The NATS JetStream table (`nats`'s module docs); Redis Streams counts
    // the same way.

    #[test]
    fn ok_is_acked_and_errors_follow_the_amqp_table() {
        let down = Error::Storage(sqlx::Error::PoolTimedOut);
        let busy = Error::InProgress { biz: "b", key: "k".into() };
        let reused = Error::KeyReused { biz: "b", key: "k".into() };
        let invalid = Error::InvalidKey(KeyError::Missing);
        let failed = Some(Outcome::Failed);
        assert_eq!(verdict_of(Ok(()), Some(Outcome::KeyReused), nats(9, 4)), Verdict::Ack);
        assert_eq!(verdict_of(Err(Some(&down)), failed, nats(9, 4)), Verdict::Requeue(Wait::Storage));
        assert_eq!(verdict_of(Err(Some(&busy)), failed, nats(9, 4)), Verdict::Requeue(Wait::InProgress));
        assert_eq!(verdict_of(Err(Some(&reused)), failed, nats(1, 4)), Verdict::DeadLetter(Reason::KeyReused));
        assert_eq!(verdict_of(Err(Some(&invalid)), failed, nats(1, 4)), Verdict::DeadLetter(Reason::Rejected));
        assert_eq!(verdict_of(Err(None), Some(Outcome::InProgress), nats(9, 4)), Verdict::Requeue(Wait::InProgress));
        assert_eq!(verdict_of(Err(None), Some(Outcome::Rejected), nats(1, 4)), Verdict::DeadLetter(Reason::Rejected));
    }

    #[test]
    fn a_body_error_is_retried_until_max_deliver() {
        for outcome in [None, Some(Outcome::Failed), Some(Outcome::Executed), Some(Outcome::Replayed)] {
            assert_eq!(verdict_of(Err(None), outcome, nats(1, 3)), Verdict::Retry);
            assert_eq!(verdict_of(Err(None), outcome, nats(2, 3)), Verdict::Retry);
            assert_eq!(verdict_of(Err(None), outcome, nats(3, 3)), Verdict::DeadLetter(Reason::DeliveriesExhausted));
        }
    }

    // A recorded answer, on every transport's budget.

    /// Regression: a handler passing on its call's recorded business error
    /// was retried (`Retry`, `Retry`, then the dead letter), each retry only
    /// replaying the decision. It is acked once, executed or replayed,
    /// whatever is left of the budget.
    #[test]
    fn a_recorded_answer_is_acked_once_whatever_the_budget() {
        let budgets = [AMQP_FIRST, Budget { spent: 3, ..AMQP_FIRST }, nats(1, 3), nats(3, 3), nats(9, 3)];
        for budget in budgets {
            for outcome in [Outcome::Executed, Outcome::Replayed] {
                assert_eq!(
                    verdict(Err(None), recorded(outcome), budget),
                    Verdict::AckRecorded,
                    "{outcome:?} {budget:?}"
                );
            }
        }
    }

    #[test]
    fn a_handler_returning_ok_after_a_recorded_answer_is_a_plain_ack() {
        assert_eq!(verdict(Ok(()), recorded(Outcome::Executed), AMQP_FIRST), Verdict::Ack);
        assert_eq!(verdict(Ok(()), recorded(Outcome::Replayed), nats(3, 3)), Verdict::Ack);
    }

    /// What the handler's error carries came after the recorded answer:
    /// it decides, as it does before any outcome.
    #[test]
    fn a_carried_error_decides_before_a_recorded_answer() {
        let down = Error::Storage(sqlx::Error::PoolTimedOut);
        let refused = Error::StorageRefused(sqlx::Error::RowNotFound);
        let busy = Error::InProgress { biz: "b", key: "k".into() };
        let reused = Error::KeyReused { biz: "b", key: "k".into() };
        let invalid = Error::InvalidKey(KeyError::Missing);
        let last = recorded(Outcome::Replayed);
        assert_eq!(verdict(Err(Some(&down)), last, AMQP_FIRST), Verdict::Requeue(Wait::Storage));
        assert_eq!(verdict(Err(Some(&refused)), last, AMQP_FIRST), Verdict::Retry);
        assert_eq!(verdict(Err(Some(&busy)), last, nats(1, 3)), Verdict::Requeue(Wait::InProgress));
        assert_eq!(verdict(Err(Some(&reused)), last, nats(1, 3)), Verdict::DeadLetter(Reason::KeyReused));
        assert_eq!(verdict(Err(Some(&invalid)), last, AMQP_FIRST), Verdict::DeadLetter(Reason::Rejected));
    }

    /// A two-phase call's permanent failure is its recorded answer too: it
    /// was dead-lettered as `Rejected`.
    #[test]
    fn a_permanent_failure_carried_is_acked_as_a_recorded_answer() {
        let permanent =
            Error::Permanent { biz: "b", key: "k".into(), failure: Failure::from_json(r#""declined""#.into()) };
        for outcome in EVERY_OUTCOME {
            assert_eq!(verdict_of(Err(Some(&permanent)), outcome, AMQP_FIRST), Verdict::AckRecorded, "{outcome:?}");
            assert_eq!(verdict_of(Err(Some(&permanent)), outcome, nats(3, 3)), Verdict::AckRecorded, "{outcome:?}");
        }
    }
}
