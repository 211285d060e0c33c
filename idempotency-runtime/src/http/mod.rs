//! HTTP glue: the rules every web framework shares, and thin adapters for
//! axum (feature `axum`, [`axum`]; its items are also here at
//! `idempotency::http`) and actix-web (feature `actix`, [`actix`]).
//!
//! The framework-free part, always built, owns the contract: the
//! `Idempotency-Key` rule with its quoted form ([`IdempotencyKey`]), the
//! `Idempotency-Token` rule ([`IdempotencyToken`], [`KeyOrToken`]), the
//! principal check ([`validate_principal`]), [`Error`](crate::Error) and
//! [`TokenError`](crate::TokenError) as problem details
//! ([`ProblemDetails`]: status, `type`, `title`, `code`, `detail`,
//! `Retry-After`, `Idempotency-Should-Retry`; an application's own under
//! its own `type` URI: [`TypedProblem`]), and the replay marker ([`observe_replay`], the
//! [`header`] names). Each rule runs on raw bytes (`from_header_values`), so
//! any transport can call it; an adapter only reads its framework's
//! headers and writes its framework's responses.
//!
//! axum:
//!
//! ```ignore
//! use idempotency::http::{IdempotencyKey, replay_header};
//!
//! #[idempotent(key = "<user>:<idem_key>", ttl = "24h", biz = "http_pay", engine = app.idem)]
//! async fn pay(
//!     State(app): State<App>,
//!     tx: &mut Transaction<'_, MySql>,
//!     UserId(user): UserId,                        // the principal, passed by `check_principal`
//!     IdempotencyKey(idem_key): IdempotencyKey,    // 400 when missing or malformed
//!     Path(order_id): Path<i64>,
//!     Json(req): Json<PayReq>,
//! ) -> Result<PayResponse, ApiError> { /* ... */ }
//!
//! let app = Router::new()
//!     .route("/orders/{id}/pay", post(pay))
//!     .layer(axum::middleware::from_fn(replay_header))   // `Idempotent-Replayed: true`
//!     .with_state(state);
//! ```
//!
//! actix-web:
//!
//! ```ignore
//! use idempotency::http::IdempotencyKey;
//! use idempotency::http::actix::{Path, replay_header};
//!
//! #[idempotent(key = "<user>:<idem_key>", ttl = "24h", biz = "http_pay", engine = app.idem)]
//! async fn pay(
//!     app: web::Data<App>,
//!     tx: &mut Transaction<'_, MySql>,
//!     UserId(user): UserId,                        // the principal, passed by `check_principal`
//!     IdempotencyKey(idem_key): IdempotencyKey,    // 400 when missing or malformed
//!     Path(order_id): Path<i64>,                   // actix's `web::Path`, with a public field
//!     web::Json(req): web::Json<PayReq>,
//! ) -> Result<PayResponse, ApiError> { /* ... */ }
//!
//! App::new()
//!     .app_data(web::Data::new(state))
//!     .wrap(actix_web::middleware::from_fn(replay_header))   // `Idempotent-Replayed: true`
//!     .route("/orders/{id}/pay", web::post().to(pay))
//! ```
//!
//! What callers see:
//!
//! | situation | status | `code` |
//! |---|---|---|
//! | first call | the handler's own response | |
//! | duplicate of a finished call | the same status and body, plus `Idempotent-Replayed: true` | |
//! | duplicate while the first runs | 409, `Retry-After: 1` | `IDEMPOTENCY_KEY_IN_PROGRESS` |
//! | same key, other arguments | 422 | `IDEMPOTENCY_KEY_REUSED` |
//! | no `Idempotency-Key` header | 400 | `MISSING_IDEMPOTENCY_KEY` |
//! | header not `[A-Za-z0-9_.:-]{8,255}` (bare or quoted), badly quoted, or sent twice | 400 | `INVALID_IDEMPOTENCY_KEY` |
//! | principal with `:`, or not `[A-Za-z0-9_.-]{1,64}` (`check_principal` in your extractor) | 400 | `INVALID_PRINCIPAL` |
//! | rendered `biz_no` longer than 64 bytes | 400 | `INVALID_BIZ_NO` |
//! | an argument holds a NaN or infinite float | 422 | `NON_FINITE_NUMBER` |
//! | database unreachable | 503 | `IDEMPOTENCY_STORAGE_UNAVAILABLE` |
//! | stored result no longer deserializes / cannot serialize | 500 | `IDEMPOTENCY_REPLAY_FAILED` / `IDEMPOTENCY_SERIALIZE_FAILED` |
//! | `biz` breaks `[a-z0-9_]{1,32}` (a server bug, e.g. in `Idem::status`) | 500 | `IDEMPOTENCY_MISCONFIGURED` |
//! | a body calling outside services declared its failure permanent, unmapped by the handler (first call and every retry) | 422 | `IDEMPOTENT_REQUEST_FAILED` |
//! | `Idempotency-Token` forged, malformed, sent twice, expired, or issued to another caller ([`IdempotencyToken`], [`TokenError::Refused`](crate::TokenError::Refused)) | 403 | `IDEMPOTENCY_TOKEN_INVALID` |
//! | `Idempotency-Token` used before by this caller | as a duplicate: the first result replayed, or 409 while it runs | |
//! | both `Idempotency-Key` and `Idempotency-Token` ([`KeyOrToken`]) | 400 | `INVALID_IDEMPOTENCY_KEY` |
//! | the token store (Redis, or the database without it) unreachable | 503, `Retry-After: 1` | `IDEMPOTENCY_STORAGE_UNAVAILABLE` |
//!
//! Error bodies are `application/problem+json` (RFC 9457) with `type`,
//! `title`, `status`, `code` and `detail`, and every one carries
//! `Idempotency-Should-Retry: true` (the 409 and 503 rows, with
//! `Retry-After`) or `false` (every other row). The detail never repeats the key
//! or the principal, and never carries a byte the caller sent that is not
//! visible ASCII: an offending character shows as `':'`, or as its code
//! point (`U+0009`, `U+00E9`) when it is a control or non-ASCII character.
//!
//! Notes:
//! - **No key is ever made up on the server's side**: a request without one
//!   is refused, since a generated key would differ on every retry and
//!   protect nothing. Safe methods (`GET`, `HEAD`) need no key: simply don't
//!   take the extractor in their handlers.
//! - **Quoted keys**: the IETF draft makes `Idempotency-Key` a structured
//!   field string, so a conforming client sends `"abc-123-xyz"`. Both forms
//!   are accepted and mean the same key: the quotes are removed, and the
//!   content must keep the key rule. A quote without its closing quote as
//!   the last character, a quote or backslash escape inside, parameters
//!   after the string (`"k";p=1`) or an empty string are refused with 400
//!   `INVALID_IDEMPOTENCY_KEY` (no key needs an escape).
//! - **Scope the key to the caller** (`key = "<user>:<idem_key>"`), so one
//!   caller's header value never replays another caller's response. The
//!   principal must not contain the separator (`:`), or `a` + `b:c` and
//!   `a:b` + `c` would render the same key: check it with your
//!   adapter's `check_principal` ([`validate_principal`] without a
//!   framework) in your principal's extractor, which refuses
//!   anything but `[A-Za-z0-9_.-]{1,64}` with 400 `INVALID_PRINCIPAL`
//!   before the handler runs (map other identities, such as e-mail
//!   addresses, to an id or a hash first). The rendered key must still fit
//!   255 bytes: with a principal of `n` bytes, the header may use at most
//!   `254 - n` (190 with the longest principal); longer ones are answered
//!   400 `INVALID_IDEMPOTENCY_KEY`.
//! - The replayed response is rebuilt from the stored value with the
//!   handler's `IntoResponse`, so status and body are identical as long as
//!   that conversion depends on the value alone (`IntoResponse` in axum,
//!   `Responder` in actix-web).
//! - The replay marker (each adapter's `replay_header`, over
//!   [`observe_replay`]) sees only `#[idempotent]` calls awaited inside the
//!   handler's own task (not ones in a `tokio::spawn`ed task); with several,
//!   the last one decides.

#[cfg(feature = "actix")]
pub mod actix;
#[cfg(feature = "axum")]
pub mod axum;
mod framework;
mod key_header;
mod principal;
mod problem;
mod replay;
mod typed_problem;

#[cfg(feature = "axum")]
pub use self::axum::{
    IDEMPOTENCY_KEY, IDEMPOTENCY_TOKEN, IDEMPOTENT_REPLAYED, Problem, ReplayHeader, ReplayHeaderFuture,
    ReplayHeaderLayer, check_principal, replay_header,
};
pub use framework::{HttpStatus, RequestHeaders};
pub use key_header::{IdempotencyKey, IdempotencyToken, KeyOrToken};
pub use principal::{MAX_PRINCIPAL_LEN, validate_principal};
pub use problem::{PROBLEM_JSON, ProblemDetails};
pub use replay::observe_replay;
pub use typed_problem::TypedProblem;

/// The header names of the contract, in lower case as HTTP/2 and gRPC
/// metadata send them, and the replay marker's value.
pub mod header {
    /// The request header carrying the caller's key.
    pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
    /// The request header carrying a token the server issued
    /// ([`Idem::tokens`](crate::Idem::tokens)).
    pub const IDEMPOTENCY_TOKEN: &str = "idempotency-token";
    /// The response header set on a replayed response.
    pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
    /// The value of [`IDEMPOTENT_REPLAYED`] on a replayed response.
    pub const REPLAYED: &str = "true";
    /// The response header on every problem an adapter answers: `true`
    /// when asking again with the same key can help, `false` when it
    /// cannot ([`ProblemDetails::should_retry`](super::ProblemDetails::should_retry)).
    /// A client reads it before the status (a 409 or a 500 of the
    /// handler's own says `false`); `idempotency-client` does.
    pub const SHOULD_RETRY: &str = "idempotency-should-retry";
}
