//! What a database failure means, by code, never by message text: to the
//! engine (a duplicate, a lock wait past its bound, a conflict to retry) and
//! to the caller, who is told whether to retry ([`Error::Storage`]) or not
//! ([`Error::StorageRefused`], [`Error::NotMigrated`]). The codes are each
//! backend's (`class_of` in `sqlite.rs`, `mysql.rs`, `postgres.rs`); the
//! table they make is in `docs/guarantees.md`, "What a failure answers".

use crate::error::Error;

/// How a database error matters to the engine, and what the caller is
/// told to do next. Decided by error kind and code ([`classify`]), never by
/// message text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// A unique index refused the row: the record's own (a duplicate), or,
    /// in a body, one of its tables' (final).
    Duplicate,
    /// A lock wait ran past its bound: someone else holds the key.
    LockTimeout,
    /// Deadlock or serialization failure: the transaction may be retried.
    Conflict,
    /// No fault of the call, gone if tried again later: the connection or
    /// the pool, a server shutting down, restarting, read-only or out of
    /// connections or resources.
    Transient,
    /// A table or column the statement names is not there: for the
    /// engine's own statements, its tables are missing or of an earlier
    /// version (`migrate` has not run).
    Schema,
    /// Anything else the database refused (bad data, a constraint, SQL it
    /// cannot run, a privilege): the same call fails the same way.
    Final,
}

/// How `error` matters, whichever backend compiled in raised it: by its
/// SQLSTATE or error number (each backend's `class_of`), or by what sqlx
/// reports beside the database (the connection, the pool). The table is in
/// `docs/guarantees.md` ("What a failure answers").
pub fn classify(error: &sqlx::Error) -> ErrorClass {
    match error {
        sqlx::Error::Database(e) => {
            if e.kind() == sqlx::error::ErrorKind::UniqueViolation {
                return ErrorClass::Duplicate;
            }
            #[cfg(feature = "postgres")]
            if let Some(class) = super::postgres::class_of(&**e) {
                return class;
            }
            #[cfg(feature = "mysql")]
            if let Some(class) = super::mysql::class_of(&**e) {
                return class;
            }
            #[cfg(feature = "sqlite")]
            if let Some(class) = super::sqlite::class_of(&**e) {
                return class;
            }
            ErrorClass::Final
        }
        // The network, the connection, the pool: no fault of the call.
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::BeginFailed => ErrorClass::Transient,
        // Decoding, encoding, configuration, a missing row or column in what
        // a body read: its own mistake, made again on every try.
        _ => ErrorClass::Final,
    }
}

/// A body's database failure as the caller is told it, by `classify`:
/// transient failures are `Storage` (retry the same call later), lock waits
/// and conflicts too; everything else is `StorageRefused` (do not retry it
/// as is). Bodies convert their `sqlx::Error`s with `?` through this.
/// Inside a call, the failure is noted for the log line its end writes
/// (`failure_log`): the body's error type may hide it from the flow.
impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        let class = classify(&e);
        let error = Error::of_class(e, class);
        if let Error::Storage(cause) | Error::StorageRefused(cause) = &error {
            crate::failure_log::note(cause, error.is_retryable());
        }
        error
    }
}

impl Error {
    /// A failure of one of the engine's own statements: as for a body's,
    /// except that a missing table or column is one of the engine's, which
    /// `migrate` creates (`NotMigrated`). Not noted: the flow holds it.
    pub(crate) fn from_store(e: sqlx::Error) -> Self {
        match classify(&e) {
            ErrorClass::Schema => Error::NotMigrated(e),
            class => Error::of_class(e, class),
        }
    }

    /// What the caller is told of a failure of `class`: retry, or not.
    fn of_class(e: sqlx::Error, class: ErrorClass) -> Self {
        match class {
            ErrorClass::Transient | ErrorClass::LockTimeout | ErrorClass::Conflict => Error::Storage(e),
            ErrorClass::Duplicate | ErrorClass::Schema | ErrorClass::Final => Error::StorageRefused(e),
        }
    }
}

/// Each row of the table, provoked on the real servers of this machine.
#[cfg(test)]
mod tests;
