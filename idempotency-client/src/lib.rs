//! The caller's half of exactly once. A server of the
//! [`idempotency`](https://docs.rs/idempotency) crate runs a request once
//! per `Idempotency-Key` and answers every repeat with the first result; this
//! crate makes the client keep its half: **one key per logical request, made
//! before the first attempt and sent again on every retry**, and retries
//! decided by what the server answered.
//!
//! - [`IdempotencyMiddleware`], a [`reqwest-middleware`](reqwest_middleware)
//!   middleware for HTTP;
//! - [`grpc::IdempotencyLayer`] (feature `grpc`), a tower layer for tonic
//!   clients, the key in the `idempotency-key` metadata.
//!
//! ```no_run
//! use idempotency_client::{IdempotencyMiddleware, Outcome, Retries};
//!
//! # async fn pay() -> Result<(), Box<dyn std::error::Error>> {
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotencyMiddleware::new(Retries::default()))
//!     .build();
//! // One logical request: one key, however many attempts it takes.
//! let response = client
//!     .post("http://127.0.0.1:3000/orders/42/pay")
//!     .header("X-User-Id", "alice")
//!     .header("Content-Type", "application/json")
//!     .body(r#"{"amount":1999}"#)
//!     .send()
//!     .await?;
//! let outcome = Outcome::of(&response).expect("POST is keyed");
//! println!("{}: {} attempt(s), replayed: {}", outcome.key, outcome.attempts, outcome.replayed);
//! # Ok(()) }
//! ```
//!
//! ## What is retried
//!
//! | the answer | retried? |
//! |---|---|
//! | no answer: connection refused or cut, a timeout | yes: the key makes it safe (the request may have run) |
//! | `Idempotency-Should-Retry: true` / `false` (this crate's servers send it on every error they answer) | as it says |
//! | 503 (`IDEMPOTENCY_STORAGE_UNAVAILABLE`), 429, 502, 504 | yes |
//! | 409 with `Retry-After` (`IDEMPOTENCY_KEY_IN_PROGRESS`) | yes, then the first call's answer |
//! | any other 5xx with `Retry-After` | yes |
//! | 400, 422 (`IDEMPOTENCY_KEY_REUSED`), other 4xx, a 409 without `Retry-After` | no |
//! | 500 without `Retry-After` (`IDEMPOTENCY_STORAGE_REFUSED`, `IDEMPOTENCY_NOT_MIGRATED`), other 5xx | no |
//! | 1xx to 3xx, a replay (`Idempotent-Replayed: true`) | no: it is the answer |
//! | a request whose body is a stream | never: sent once ([`Stop::NotResendable`]) |
//!
//! Each retry waits `Retry-After` when the server gives one (up to
//! [`Retries::max_retry_after`]), else an exponential backoff with full
//! jitter; attempts are bounded by count and by total time ([`Retries`]).
//! The decision reads the status and headers only, never the body. gRPC's
//! codes: [`grpc`].
//!
//! ## What the caller learns
//!
//! A response carries its [`Outcome`]: the key, the attempts it took,
//! whether the server **replayed** a stored result, and why it stopped.
//! No answer at all is a [`GaveUp`] error with the key and the attempts:
//! the request may have run, and sending it again with that key (now, or
//! after a restart) is answered with what it did.
//!
//! ## A key of your own
//!
//! Send `Idempotency-Key` yourself to keep one key across restarts: make it
//! with [`new_key`], store it with the business object (the order), and
//! send it on every try, this process's and the next one's. A key that
//! breaks the server's rule is refused before anything is sent
//! ([`InvalidKey`]).
//!
//! ## With another retry layer
//!
//! One retry loop is enough; to use `reqwest-retry`'s, give this middleware
//! [`Retries::none`] and attach it either side: attached first (outside),
//! it keys the request once and the retry layer resends the copy; attached
//! after (inside), it finds the key it made in the request's extensions on
//! each resend. Either way every attempt carries the same key. A retry
//! layer that rebuilds requests from scratch (a new `RequestBuilder` per
//! try) makes a new logical request each time: give it your own key.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod attempts;
#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
pub mod grpc;
mod key;
mod middleware;
mod outcome;
mod retries;
mod verdict;

pub use attempts::{Retrying, Stop};
pub use key::{InvalidKey, check as check_key, new_key};
pub use middleware::{Failure, GaveUp, IdempotencyMiddleware};
pub use outcome::Outcome;
pub use retries::Retries;

/// The header names of the contract, as this crate's servers spell them
/// (lower case, as HTTP/2 and gRPC metadata send them).
pub mod header {
    /// The request header carrying the key.
    pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
    /// The response header marking a replayed result.
    pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
    /// Its value on a replay.
    pub const REPLAYED: &str = "true";
    /// The server's own word on an error: `true` when asking again with
    /// the same key can help, `false` when it cannot.
    pub const SHOULD_RETRY: &str = "idempotency-should-retry";
}
