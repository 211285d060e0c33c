//! What only the code `#[idempotent]` writes uses: the static [`Spec`] of
//! an annotated fn. (That its value can be stored and replayed is checked
//! where its `Body` is made: `call/typed.rs`.)

use std::time::Duration;

/// What one annotated fn declares; built by the attribute at compile time.
#[derive(Debug)]
pub struct Spec {
    /// The business action, `[a-z0-9_]{1,32}`.
    pub biz: &'static str,
    /// How long the record protects the key.
    pub ttl: Duration,
    /// How long a Redis claim lives while the body runs.
    pub lease: Duration,
    /// How long a duplicate waits for a running call's answer before
    /// `InProgress`; `None`: the engine's default (`Builder::wait`).
    pub wait: Option<Duration>,
    /// Whether declared business errors are recorded (`record_errors`):
    /// the body runs after a savepoint, to roll back to.
    pub record_errors: bool,
}
