//! What can go wrong, as callers see it.

// Defined beside the key rule in `idempotency-rules`; `idempotency::KeyError` is this.
pub use idempotency_rules::KeyError;

use std::fmt;

use serde::de::DeserializeOwned;

/// The error an `#[idempotent]` fn reports through its own error type
/// (which must implement `From<idempotency::Error>`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The rendered key (or an `Idempotency-Key` header) breaks the key rule:
    /// characters `[A-Za-z0-9_.:-]`, length 1..=255. Nothing was written.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(KeyError),

    /// A `biz` outside `[a-z0-9_]{1,32}`: a mistake in the server's code,
    /// since the attribute checks its own `biz` at compile time (say, a name
    /// passed to [`Idem::status`](crate::Idem::status)). Nothing was written.
    /// Over HTTP: 500 `IDEMPOTENCY_MISCONFIGURED`.
    #[error("invalid biz: it must match [a-z0-9_]{{1,{max}}}", max = idempotency_rules::MAX_BIZ_LEN)]
    InvalidBiz,

    /// The rendered `biz_no` is longer than its column (`VARCHAR(64)`): the
    /// call is refused before Redis or the database is touched, and nothing
    /// was written. Over HTTP: 400 `INVALID_BIZ_NO`.
    #[error("biz_no too long: {len} bytes, at most {max} allowed")]
    BizNoTooLong {
        /// Length in bytes.
        len: usize,
        /// Maximum allowed.
        max: usize,
    },

    /// Another call with the same key is running right now. Ask again later;
    /// once it finishes, the same call replays its result.
    #[error("idempotency key `{key}` of `{biz}` is in progress")]
    InProgress {
        /// The business action.
        biz: &'static str,
        /// The rendered key.
        key: String,
    },

    /// The key was already used by a call with other arguments.
    #[error("idempotency key `{key}` of `{biz}` was already used with other arguments")]
    KeyReused {
        /// The business action.
        biz: &'static str,
        /// The rendered key.
        key: String,
    },

    /// The database failed or could not be reached. Retrying is safe: the
    /// retry executes, or replays the result if this call's transaction did
    /// commit (a connection lost during `COMMIT` leaves that unknown).
    #[error("idempotency storage failed: {0}")]
    Storage(#[source] sqlx::Error),

    /// The stored result no longer deserializes into the fn's return type
    /// (the type changed since it was stored, or the row was edited).
    #[error("stored response of `{biz}` key `{key}` cannot be replayed: {source}")]
    Replay {
        /// The business action.
        biz: &'static str,
        /// The rendered key.
        key: String,
        /// Why deserialization failed.
        #[source]
        source: serde_json::Error,
    },

    /// An argument or the result could not be serialized to JSON, or the
    /// result could not be read back from it (say, a float NaN, which JSON
    /// stores as `null`): nothing was committed.
    #[error("cannot serialize for idempotency: {0}")]
    Serialize(#[source] serde_json::Error),

    /// An argument holds a float that is NaN or infinite (at any depth: a
    /// field, a map value, an element, an `Option`). JSON has no form for
    /// one (serde_json writes `null`), so `Some(f64::NAN)`, `Some(f64::INFINITY)`
    /// and `None` would share a fingerprint and replay each other's results;
    /// the call is refused instead, before Redis or the database is touched.
    /// Nothing was written. Over HTTP: 422 `NON_FINITE_NUMBER`.
    #[error("argument `{arg}` holds a float that is NaN or infinite, which has no JSON form to fingerprint")]
    NonFiniteFloat {
        /// The parameter's name, as written in the fn.
        arg: &'static str,
    },

    /// A body calling outside services (`steps` mode) declared its failure
    /// permanent with [`Steps::permanent`](crate::Steps::permanent) (a
    /// declined card): the failure is recorded with the key, and every
    /// retry gets it again, byte for byte, without running anything.
    #[error("`{biz}` key `{key}` failed permanently: {failure}")]
    Permanent {
        /// The business action.
        biz: &'static str,
        /// The rendered key.
        key: String,
        /// What the body recorded.
        failure: Failure,
    },

    /// A step of a body in `steps` mode was refused before it ran: its name
    /// breaks `[a-z0-9_]{1,32}`, it was used twice in one call, or it came
    /// after the final transaction opened. A mistake in the body; nothing
    /// was called. Over HTTP: 500 `IDEMPOTENCY_MISCONFIGURED`.
    #[error("step `{name}` refused: {reason}")]
    InvalidStep {
        /// The step's name, as given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl Error {
    /// `true` when the same call may succeed if simply tried again later
    /// (`InProgress`, `Storage`).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::InProgress { .. } | Error::Storage(_))
    }
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Storage(e)
    }
}

/// A failure a body declared permanent ([`Steps::permanent`](crate::Steps::permanent)), as
/// recorded: JSON, replayed byte for byte in [`Error::Permanent`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    json: String,
}

impl Failure {
    pub(crate) fn from_json(json: String) -> Self {
        Failure { json }
    }

    /// The failure as recorded.
    pub fn as_json(&self) -> &str {
        &self.json
    }

    /// The failure as the type the body declared it with.
    pub fn decode<P: DeserializeOwned>(&self) -> Result<P, serde_json::Error> {
        serde_json::from_str(&self.json)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.json)
    }
}
