//! What the caller learns of a keyed request: its key, the attempts it
//! took, whether the answer was a replay, and why it was the last. HTTP
//! keeps it in the response's extensions; gRPC, whose errors reach the
//! caller as a `Status` with metadata only, in metadata of the answer
//! (`grpc/metadata.rs`).

use http::HeaderMap;

use crate::attempts::{Stop, Tally};
use crate::header::{IDEMPOTENT_REPLAYED, REPLAYED};

/// How a keyed request went: on an HTTP response ([`Outcome::of`]), on a
/// gRPC answer ([`grpc::outcome`](crate::grpc::outcome)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Outcome {
    /// The `Idempotency-Key` every attempt carried (unquoted).
    pub key: String,
    /// Attempts made, this one included.
    pub attempts: u32,
    /// The server answered with a stored result (`Idempotent-Replayed:
    /// true`): the request had run before, by an earlier attempt or an
    /// earlier logical request with the same key.
    pub replayed: bool,
    /// Why this answer is the last: [`Stop::Final`], or the bound that
    /// stopped retries of an answer that asked for them.
    pub stop: Stop,
}

impl Outcome {
    pub(crate) fn new(key: String, tally: Tally, headers: &HeaderMap) -> Self {
        let replayed = headers.get(IDEMPOTENT_REPLAYED).is_some_and(|v| v == REPLAYED);
        Outcome { key, attempts: tally.attempts, replayed, stop: tally.stop }
    }

    /// The outcome of a response the middleware handed back; `None` for a
    /// request it did not key.
    pub fn of(response: &reqwest::Response) -> Option<&Outcome> {
        response.extensions().get::<Outcome>()
    }
}
