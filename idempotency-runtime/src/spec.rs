//! What only the code `#[idempotent]` writes uses: the static [`Spec`] of
//! an annotated fn, and the check that its return type can be replayed.

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::Error;

/// What one annotated fn declares; built by the attribute at compile time.
#[derive(Debug)]
pub struct Spec {
    /// The business action, `[a-z0-9_]{1,32}`.
    pub biz: &'static str,
    /// How long the record protects the key.
    pub ttl: Duration,
    /// How long a Redis claim lives while the body runs.
    pub lease: Duration,
}

/// What an `#[idempotent]` fn must return: its value is stored and replayed.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be stored and replayed by #[idempotent]",
    label = "the return type must be `Result<T, E>` with `T: Serialize + DeserializeOwned` and `E: From<idempotency::Error>`"
)]
pub trait Replayable {}

impl<T: Serialize + DeserializeOwned, E: From<Error>> Replayable for Result<T, E> {}

/// Puts the requirements on the return type where the user wrote it.
pub fn assert_replayable<R: Replayable>() {}
