//! Declared business errors: an `Err` that is the answer, not a failure.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// An error type some of whose errors are final business answers ("card
/// declined", "insufficient funds"): with `#[idempotent(.., record_errors)]`
/// such an error is recorded like a value, and every duplicate gets the same
/// `Err` (over HTTP the same status and body, `Idempotent-Replayed: true`),
/// byte for byte, without the body running again. The body's own writes are
/// rolled back (to a savepoint taken before it ran); the record commits.
///
/// Every other error (a database failure, anything `recorded` answers
/// `None` for) is not recorded: it rolls back and the next call executes,
/// as without `record_errors`.
///
/// Only the part that is the answer is stored, so the error type itself
/// need not serialize (it may hold a `sqlx::Error`):
///
/// ```
/// # use idempotency_runtime as idempotency;
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Debug, Clone, Serialize, Deserialize)]
/// enum Declined { Card { reason: String }, InsufficientFunds }
///
/// #[derive(Debug)]
/// enum PayError {
///     Declined(Declined),
///     Idem(idempotency::Error),
///     Db(sqlx::Error),
/// }
///
/// impl idempotency::BusinessError for PayError {
///     type Record = Declined;
///     fn recorded(&self) -> Option<Declined> {
///         match self {
///             PayError::Declined(declined) => Some(declined.clone()),
///             _ => None,
///         }
///     }
///     fn replayed(record: Declined) -> Self {
///         PayError::Declined(record)
///     }
/// }
/// # impl From<idempotency::Error> for PayError {
/// #     fn from(e: idempotency::Error) -> Self { PayError::Idem(e) }
/// # }
/// ```
///
/// The first caller gets its error read back from the record too
/// (`replayed(recorded())`), so it gets exactly what every duplicate will.
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not say which of its errors are recorded",
    label = "`record_errors` needs the fn's error type to implement `idempotency::BusinessError`",
    note = "implement `idempotency::BusinessError` for `{Self}`: `recorded` picks the errors that are final answers, `replayed` rebuilds one from its record"
)]
pub trait BusinessError: Sized {
    /// What is recorded of a final error, and replayed: the answer itself.
    type Record: Serialize + DeserializeOwned;

    /// `Some` for an error that is a final answer, to record and replay;
    /// `None` for a failure (it rolls back; the next call executes).
    fn recorded(&self) -> Option<Self::Record>;

    /// The error a replay answers with.
    fn replayed(record: Self::Record) -> Self;
}
