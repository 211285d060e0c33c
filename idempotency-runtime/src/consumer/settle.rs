//! The settlement contract, once for every transport: what a handler's
//! result (`Ok`, or `Err` with the `idempotency::Error` it carries) and the outcome
//! of its last `#[idempotent]` call make of a delivery, against its retry
//! budget. The transports' settlement tables (module docs of `amqp`, `nats`,
//! `redis_streams`) are this function, carried out.

use std::time::Duration;

use super::Reason;
use crate::error::Error;
use crate::outcome::Outcome;

/// What to do with a delivery, before doing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Ack,
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
/// `idempotency::Error` it carries; `outcome` is that of its last call. A failure
/// is retried while the budget allows, then dead-lettered; a database that
/// is down or a call in progress elsewhere never spends the budget.
pub(crate) fn verdict(result: Result<(), Option<&Error>>, outcome: Option<Outcome>, budget: Budget) -> Verdict {
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
        // `InvalidKey`, `Replay`, `Serialize` and the like: the call can
        // never succeed as sent (the engine's `Outcome::Rejected`).
        Some(_) => Verdict::DeadLetter(Reason::Rejected),
        None => match outcome {
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
    use crate::error::KeyError;

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
            assert_eq!(verdict(Ok(()), outcome, AMQP_FIRST), Verdict::Ack, "{outcome:?}");
        }
    }

    #[test]
    fn a_storage_error_is_requeued_uncounted_whatever_the_outcome() {
        let down = Error::Storage(sqlx::Error::PoolTimedOut);
        for outcome in EVERY_OUTCOME {
            assert_eq!(verdict(Err(Some(&down)), outcome, AMQP_FIRST), Verdict::Requeue(Wait::Storage), "{outcome:?}");
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
                assert_eq!(verdict(Err(Some(error)), outcome, AMQP_FIRST), Verdict::Retry, "{error:?}");
                let spent = Budget { spent: 3, ..AMQP_FIRST };
                let dead = Verdict::DeadLetter(Reason::RetriesExhausted);
                assert_eq!(verdict(Err(Some(error)), outcome, spent), dead, "{error:?}");
                assert_eq!(
                    verdict(Err(Some(error)), outcome, nats(4, 4)),
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
        assert_eq!(verdict(Err(Some(&in_progress)), outcome, AMQP_FIRST), Verdict::Requeue(Wait::InProgress));
        assert_eq!(verdict(Err(Some(&reused)), outcome, AMQP_FIRST), Verdict::DeadLetter(Reason::KeyReused));
        for rejected in [Error::InvalidKey(KeyError::Missing), replay, Error::Serialize(json_error())] {
            assert_eq!(
                verdict(Err(Some(&rejected)), outcome, AMQP_FIRST),
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
            assert_eq!(verdict(Err(None), outcome, AMQP_FIRST), expected, "{outcome:?}");
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
        assert_eq!(verdict(Ok(()), Some(Outcome::KeyReused), nats(9, 4)), Verdict::Ack);
        assert_eq!(verdict(Err(Some(&down)), failed, nats(9, 4)), Verdict::Requeue(Wait::Storage));
        assert_eq!(verdict(Err(Some(&busy)), failed, nats(9, 4)), Verdict::Requeue(Wait::InProgress));
        assert_eq!(verdict(Err(Some(&reused)), failed, nats(1, 4)), Verdict::DeadLetter(Reason::KeyReused));
        assert_eq!(verdict(Err(Some(&invalid)), failed, nats(1, 4)), Verdict::DeadLetter(Reason::Rejected));
        assert_eq!(verdict(Err(None), Some(Outcome::InProgress), nats(9, 4)), Verdict::Requeue(Wait::InProgress));
        assert_eq!(verdict(Err(None), Some(Outcome::Rejected), nats(1, 4)), Verdict::DeadLetter(Reason::Rejected));
    }

    #[test]
    fn a_body_error_is_retried_until_max_deliver() {
        for outcome in [None, Some(Outcome::Failed), Some(Outcome::Executed), Some(Outcome::Replayed)] {
            assert_eq!(verdict(Err(None), outcome, nats(1, 3)), Verdict::Retry);
            assert_eq!(verdict(Err(None), outcome, nats(2, 3)), Verdict::Retry);
            assert_eq!(verdict(Err(None), outcome, nats(3, 3)), Verdict::DeadLetter(Reason::DeliveriesExhausted));
        }
    }
}
