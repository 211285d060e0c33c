//! What the consumer runners ([`amqp`](crate::amqp), [`nats`](crate::nats))
//! share: how they look inside a handler's error.

use crate::error::Error;

/// What a consumer runner asks of a handler's error: the
/// [`idem::Error`](Error) it carries, if any, so that a database that is
/// down (`Error::Storage`) is waited out instead of spending the message's
/// retries; see the settlement tables of [`amqp`](crate::amqp) and
/// [`nats`](crate::nats). One trait for both runners.
///
/// Implemented for `idem::Error` itself and for
/// `Box<dyn std::error::Error + Send + Sync>` (which finds one anywhere in
/// its `source()` chain). For your own error type, return the `idem::Error`
/// it wraps:
///
/// ```ignore
/// impl idem::amqp::AsIdemError for StockError {
///     fn idem_error(&self) -> Option<&idem::Error> {
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
    message = "the consumer cannot look inside `{Self}` for an `idem::Error`",
    label = "the handler's error type must implement `AsIdemError` (`idem::amqp::AsIdemError`, the same trait as `idem::nats::AsIdemError`)",
    note = "implement it for `{Self}`: return the `idem::Error` it wraps, or `None`"
)]
pub trait AsIdemError {
    /// The `idem::Error` this error is or wraps, if any.
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
