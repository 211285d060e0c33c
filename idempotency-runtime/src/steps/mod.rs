//! Calls to outside services: the two-phase mode, `#[idempotent(..., steps)]`.
//!
//! The plain mode makes a body *commit* once. A body that charges a card,
//! sends an e-mail or calls another service can still make that call twice:
//! when two bodies overlap (a lease ran out, Redis lost the claim) or when a
//! process dies after the call and before its commit. This mode records the
//! progress of such a call in phases, as payment providers' own
//! idempotency keys do:
//!
//! 1. **Phase one** commits a `processing` row in `idem_call`, with a
//!    fencing token (`fence`) and a lease, in a statement of its own, before
//!    the body runs: from then on the key is owned, visibly, in the database.
//! 2. **Steps**: each outside call is a named step,
//!    `steps.step("charge", |step_key| ...)`. Its `step_key` is derived from
//!    `(biz, key, step name)` alone, the same in every attempt, and is meant
//!    to go to the service as *its* idempotency key. The step's result is
//!    recorded in `idem_step` in a small transaction of its own, right after
//!    the service answered, so a failure or a crash later on keeps it: a
//!    retry gets it back without calling the service again.
//! 3. **Final transaction**: the body's local writes
//!    ([`Steps::transaction`]) and the record marked succeeded, committed
//!    together, only if the fence is still ours.
//!
//! What a later call with the key finds:
//!
//! | the call | the answer |
//! |---|---|
//! | succeeded | its result, replayed (from Redis, or the row) |
//! | failed with an error declared [permanent](Steps::permanent) | that failure, replayed: [`Error::Permanent`] |
//! | `processing`, lease running | [`Error::InProgress`] |
//! | `processing`, lease over (its owner died, hangs, or failed) | taken over: a new fence, and the body runs again, each recorded step answering from the record |
//! | arguments differ | [`Error::KeyReused`] |
//!
//! A step that started but whose result was not recorded (the process died
//! while the service answered) **is called again, with the same
//! `step_key`**: only the service's own deduplication of that key makes the
//! second call harmless. Send it.
//!
//! A call whose lease ran out and whose key was taken over is *fenced off*:
//! its step records and its final transaction change nothing, and it answers
//! with the new owner's outcome (or `InProgress` while that one runs).
//!
//! Recovery without a client: [`Idem::stuck_calls`](crate::Idem::stuck_calls)
//! lists the calls of a `biz` stuck in `processing` past their lease, for an
//! application to call again (a "completer" loop).
//!
//! [`Error::Permanent`]: crate::Error::Permanent
//! [`Error::InProgress`]: crate::Error::InProgress
//! [`Error::KeyReused`]: crate::Error::KeyReused

mod call;
mod context;
mod protocol;
mod recovery;

pub use crate::error::Failure;
pub use call::run_steps;
pub use context::{StepKey, Steps};
pub use recovery::StuckCall;
