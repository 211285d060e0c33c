//! What can go wrong, as callers see it.

use std::fmt;

/// The error an `#[idempotent]` fn reports through its own error type
/// (which must implement `From<idem::Error>`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The rendered key (or an `Idempotency-Key` header) breaks the key rule:
    /// characters `[A-Za-z0-9_.:-]`, length 1..=255. Nothing was written.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(KeyError),

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

/// Why a key was rejected. Carries no copy of the key: it may hold anything
/// the caller sent, including control characters.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// No key at all (missing header, or a template rendered to nothing).
    Missing,
    /// Shorter than the minimum length.
    TooShort {
        /// Length in bytes.
        len: usize,
        /// Minimum allowed.
        min: usize,
    },
    /// Longer than the maximum length.
    TooLong {
        /// Length in bytes.
        len: usize,
        /// Maximum allowed.
        max: usize,
    },
    /// The rendered `biz_no` is longer than its column (`VARCHAR(64)`).
    BizNoTooLong {
        /// Length in bytes.
        len: usize,
        /// Maximum allowed.
        max: usize,
    },
    /// A `biz` outside `[a-z0-9_]{1,32}`.
    BadBiz,
    /// A character outside `[A-Za-z0-9_.:-]`.
    BadChar {
        /// The offending character.
        ch: char,
        /// Its byte offset.
        at: usize,
    },
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Missing => f.write_str("no key given"),
            KeyError::TooShort { len, min } => {
                write!(f, "{len} characters, at least {min} required")
            }
            KeyError::TooLong { len, max } => write!(f, "{len} bytes, at most {max} allowed"),
            KeyError::BizNoTooLong { len, max } => write!(f, "biz_no of {len} bytes, at most {max} allowed"),
            KeyError::BadBiz => f.write_str("biz must match [a-z0-9_]{1,32}"),
            KeyError::BadChar { ch, at } => {
                write!(f, "character {} at byte {at}; only A-Z a-z 0-9 _ . : - are allowed", Shown(*ch))
            }
        }
    }
}

/// A character as it may appear in a message, a log line or an HTTP
/// problem: visible ASCII quoted (`':'`), anything else only as its code
/// point (`U+000A`, `U+00E9`), so a message never carries control bytes,
/// bidi overrides or look-alikes from what a caller sent.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shown(pub(crate) char);

impl fmt::Display for Shown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            ch @ ('!'..='&' | '('..='~') => write!(f, "'{ch}'"),
            ch => write!(f, "U+{:04X}", u32::from(ch)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_characters_show_as_visible_ascii_or_code_points() {
        let shown = |ch| KeyError::BadChar { ch, at: 3 }.to_string();
        assert_eq!(shown(' '), "character U+0020 at byte 3; only A-Z a-z 0-9 _ . : - are allowed");
        assert_eq!(shown('*'), "character '*' at byte 3; only A-Z a-z 0-9 _ . : - are allowed");
        for (ch, code) in [
            ('\n', "U+000A"),
            ('\0', "U+0000"),
            ('\u{7f}', "U+007F"),
            ('é', "U+00E9"),
            ('\u{202e}', "U+202E"),
            ('\'', "U+0027"),
            ('\u{1F600}', "U+1F600"),
        ] {
            let text = shown(ch);
            assert!(text.contains(code) && text.is_ascii() && !text.chars().any(|c| c.is_ascii_control()), "{text:?}");
        }
    }
}
