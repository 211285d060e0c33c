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

    /// Text the engine stores as given (`biz_no`; an outbox event's
    /// destination, aggregate or payload) holds a NUL character, which
    /// PostgreSQL's text refuses: refused on every backend alike, before
    /// anything is written. Over HTTP: 400 `INVALID_TEXT`.
    #[error("{field} holds a NUL character (byte {at}), which database text cannot hold; nothing was written")]
    InvalidText {
        /// What holds it: `biz_no`, `destination`, `aggregate`, `payload`.
        field: &'static str,
        /// Its byte offset.
        at: usize,
    },

    /// The result's JSON is longer than the engine stores
    /// ([`Builder::max_result_bytes`](crate::Builder::max_result_bytes)):
    /// the body's writes were rolled back and nothing was recorded. The same
    /// call fails the same way, so it must not be retried as is; a retry
    /// runs the body again (with whatever it does outside its transaction)
    /// and fails again unless its result shrank. Over HTTP: 500.
    #[error("the result of `{biz}` is {len} bytes of JSON, more than the {max} stored; nothing was recorded")]
    ResultTooLarge {
        /// The business action.
        biz: &'static str,
        /// The JSON's length in bytes.
        len: usize,
        /// The engine's bound.
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

    /// The database failed for a reason that passes: the connection was
    /// lost or refused, the pool timed out, a deadlock or serialization
    /// failure, a lock wait past its bound, a server read-only, shutting
    /// down or out of connections. Retrying the same call later is safe: the
    /// retry executes, or replays the result if this call's transaction did
    /// commit (a connection lost during `COMMIT` leaves that unknown).
    /// Over HTTP: 503 with `Retry-After`.
    #[error("idempotency storage failed: {0}")]
    Storage(#[source] sqlx::Error),

    /// The database refused the call for a reason that will recur: data it
    /// cannot store (a NUL in PostgreSQL text, a value too long, a packet
    /// past `max_allowed_packet`), a constraint (other than the record's own
    /// unique index, which decides duplicates), SQL it cannot run, a missing
    /// privilege. Nothing was committed; the same call fails the same way,
    /// so it must not be retried as is. A body's `sqlx::Error` converted
    /// with `?` lands here too when it is of this kind (the code decides,
    /// per backend: `docs/guarantees.md`). Over HTTP: 500, no `Retry-After`.
    #[error("the database refused the call (it would fail the same way again): {0}")]
    StorageRefused(#[source] sqlx::Error),

    /// The engine's tables are missing or of an earlier version: `migrate`
    /// has not run on this database. Run [`Idem::migrate`](crate::Idem::migrate)
    /// at start-up (or `idem migrate`). Nothing was written. Over HTTP: 500.
    #[error(
        "the idempotency tables are missing or out of date: run `Idem::migrate` at start-up, or `idem migrate` ({0})"
    )]
    NotMigrated(#[source] sqlx::Error),

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
    /// (`InProgress`, `Storage`); every other error recurs until something
    /// else changes (the request, the data, the server's code or tables).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::InProgress { .. } | Error::Storage(_))
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
