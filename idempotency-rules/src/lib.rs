//! The rules of [`idempotency`](https://docs.rs/idempotency) that both its attribute
//! (at compile time) and its runtime (per call) enforce, kept in one place so
//! the two cannot drift: the key alphabet and lengths, the `biz` and
//! `biz_no` columns, the Redis namespace, SQL identifiers, and durations. Use them through
//! the `idempotency` crate.
//!
//! No dependencies: `idempotency-macros` builds on it as much as `idempotency-runtime`.
#![warn(missing_docs)]

mod biz;
mod duration;
mod identifier;
mod key;
mod namespace;
mod shown;

pub use biz::{MAX_BIZ_LEN, MAX_BIZ_NO_LEN, is_valid_biz};
pub use duration::{DurationError, MAX_DURATION_MS, parse_duration};
pub use identifier::{MAX_IDENTIFIER_LEN, is_sql_identifier};
pub use key::{KeyError, MAX_KEY_LEN, MIN_HEADER_KEY_LEN, check_key, is_key_char};
pub use namespace::{MAX_NAMESPACE_LEN, is_valid_namespace};
pub use shown::Shown;
