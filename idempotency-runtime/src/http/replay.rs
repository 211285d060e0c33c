//! The replay marker: how an adapter learns that a handler's
//! `#[idempotent]` call replayed a stored result, so that it can mark the
//! response `Idempotent-Replayed: true`.

use std::future::Future;

use crate::outcome::{Outcome, observe};

/// Runs a handler's future and tells whether its last `#[idempotent]` call
/// (awaited inside this future, not in a spawned task) replayed a stored
/// result. A call that executed or failed, or no call at all, is `false`.
pub async fn observe_replay<F: Future>(handler: F) -> (F::Output, bool) {
    let (output, outcome) = observe(handler).await;
    (output, outcome == Some(Outcome::Replayed))
}
