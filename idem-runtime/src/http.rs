//! HTTP glue for axum handlers (feature `axum`): the `Idempotency-Key`
//! extractor, [`Error`] as an `application/problem+json` response, and the
//! [`replay_header`] middleware that marks replayed responses.
//!
//! ```ignore
//! use axum::{Json, Router, extract::{Path, State}, middleware, routing::post};
//! use idem::http::{IdempotencyKey, replay_header};
//!
//! #[idempotent(key = "<user>:<idem_key>", ttl = "24h", biz = "http_pay", engine = app.idem)]
//! async fn pay(
//!     State(app): State<App>,
//!     tx: &mut Transaction<'_, MySql>,
//!     UserId(user): UserId,                        // the authenticated principal
//!     IdempotencyKey(idem_key): IdempotencyKey,    // 400 when missing or malformed
//!     Path(order_id): Path<i64>,
//!     Json(req): Json<PayReq>,
//! ) -> Result<PayResponse, ApiError> { /* ... */ }
//!
//! let app = Router::new()
//!     .route("/orders/{id}/pay", post(pay))
//!     .layer(middleware::from_fn(replay_header))   // `Idempotent-Replayed: true`
//!     .with_state(state);
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
//! | header not `[A-Za-z0-9_.:-]{8,255}`, or sent twice | 400 | `INVALID_IDEMPOTENCY_KEY` |
//! | database unreachable | 503 | `IDEMPOTENCY_STORAGE_UNAVAILABLE` |
//! | stored result no longer deserializes / cannot serialize | 500 | `IDEMPOTENCY_REPLAY_FAILED` / `IDEMPOTENCY_SERIALIZE_FAILED` |
//!
//! Error bodies are `application/problem+json` (RFC 9457) with `type`,
//! `title`, `status`, `code` and `detail`; the detail never repeats the key.
//!
//! Notes:
//! - **No key is ever made up on the server's side**: a request without one
//!   is refused, since a generated key would differ on every retry and
//!   protect nothing. Safe methods (`GET`, `HEAD`) need no key: simply don't
//!   take the extractor in their handlers.
//! - **Scope the key to the caller** (`key = "<user>:<idem_key>"`), so one
//!   caller's header value never replays another caller's response. The
//!   principal must not contain the separator (`:`), or `a` + `b:c` and
//!   `a:b` + `c` would render the same key; and the rendered key must still
//!   fit 255 bytes (with a principal of `n` bytes, the header may use at most
//!   `254 - n`; longer ones are answered 400 `INVALID_IDEMPOTENCY_KEY`).
//! - The replayed response is rebuilt from the stored value with the
//!   handler's `IntoResponse`, so status and body are identical as long as
//!   that conversion depends on the value alone.
//! - [`replay_header`] sees only `#[idempotent]` calls awaited inside the
//!   handler's own task (not ones in a `tokio::spawn`ed task); with several,
//!   the last one decides.

use axum::extract::{FromRequestParts, Request};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::{HeaderName, HeaderValue, StatusCode, header};
use serde::{Deserialize, Serialize};

use crate::error::{Error, KeyError};
use crate::key::validate_header_key;
use crate::outcome::{Outcome, observe};

/// The request header carrying the caller's key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The response header set on a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// The media type of error bodies.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The request's `Idempotency-Key` header, checked against
/// `[A-Za-z0-9_.:-]{8,255}`. As an extractor it refuses the request with
/// 400 (`MISSING_IDEMPOTENCY_KEY` or `INVALID_IDEMPOTENCY_KEY`) before the
/// handler runs; nothing is written for such a request.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct IdempotencyKey(pub String);

impl IdempotencyKey {
    /// Reads and checks the key from request headers.
    pub fn from_headers(headers: &http::HeaderMap) -> Result<Self, Problem> {
        let mut values = headers.get_all(&IDEMPOTENCY_KEY).iter();
        let Some(value) = values.next() else {
            return Err(Problem::missing_key());
        };
        if values.next().is_some() {
            // Two keys for one request: neither can be trusted to be "the" key.
            return Err(Problem::invalid_key("the Idempotency-Key header was sent more than once".into()));
        }
        let Ok(text) = value.to_str() else {
            return Err(Problem::invalid_key(
                "the key holds non-ASCII bytes; only A-Z a-z 0-9 _ . : - are allowed".into(),
            ));
        };
        match validate_header_key(text) {
            Ok(()) => Ok(IdempotencyKey(text.to_owned())),
            Err(Error::InvalidKey(KeyError::Missing)) => Err(Problem::missing_key()),
            Err(e) => Err(Problem::from(&e)),
        }
    }

    /// The key as sent.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Self::from_headers(&parts.headers)
    }
}

/// An `application/problem+json` error response (RFC 9457) with a stable
/// `code`. Built from an [`Error`] (`Problem::from(&error)`), or by the
/// [`IdempotencyKey`] extractor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The HTTP status.
    pub status: StatusCode,
    /// Stable, machine-readable code, e.g. `IDEMPOTENCY_KEY_REUSED`.
    pub code: &'static str,
    /// Short summary of the kind of problem.
    pub title: &'static str,
    /// What happened this time (never the key itself).
    pub detail: String,
    /// Seconds for a `Retry-After` header, when asking again may help.
    pub retry_after: Option<u32>,
}

/// The JSON body of a [`Problem`].
#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'a str,
    status: u16,
    code: &'a str,
    detail: &'a str,
}

impl Problem {
    fn new(status: StatusCode, code: &'static str, title: &'static str, detail: String) -> Self {
        Problem { status, code, title, detail, retry_after: None }
    }

    fn missing_key() -> Self {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "MISSING_IDEMPOTENCY_KEY",
            "Idempotency-Key header required",
            "send an Idempotency-Key header of 8 to 255 characters from A-Z a-z 0-9 _ . : -, \
             and the same value again when retrying"
                .into(),
        )
    }

    fn invalid_key(detail: String) -> Self {
        Problem::new(StatusCode::BAD_REQUEST, "INVALID_IDEMPOTENCY_KEY", "Invalid idempotency key", detail)
    }

    /// The `type` URI: `urn:idem:problem:` and the code in kebab case.
    pub fn type_uri(&self) -> String {
        format!("urn:idem:problem:{}", self.code.to_ascii_lowercase().replace('_', "-"))
    }

    /// The JSON body, as sent.
    pub fn body(&self) -> String {
        let body = Body {
            kind: self.type_uri(),
            title: self.title,
            status: self.status.as_u16(),
            code: self.code,
            detail: &self.detail,
        };
        serde_json::to_string(&body).expect("a problem body serializes")
    }
}

impl From<&Error> for Problem {
    fn from(error: &Error) -> Self {
        match error {
            Error::InvalidKey(reason) => Problem::invalid_key(format!(
                "the idempotency key is invalid ({reason}); keys are 8 to 255 characters from A-Z a-z 0-9 _ . : -"
            )),
            Error::InProgress { .. } => Problem {
                retry_after: Some(1),
                ..Problem::new(
                    StatusCode::CONFLICT,
                    "IDEMPOTENCY_KEY_IN_PROGRESS",
                    "Request with this idempotency key is in progress",
                    "a request with the same idempotency key is still being processed; \
                     retry later with the same key to receive its result"
                        .into(),
                )
            },
            Error::KeyReused { .. } => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "IDEMPOTENCY_KEY_REUSED",
                "Idempotency key reused with another request",
                "this idempotency key was already used for a request with other parameters; \
                 use a new key for a new request"
                    .into(),
            ),
            Error::Storage(_) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "IDEMPOTENCY_STORAGE_UNAVAILABLE",
                "Idempotency storage unavailable",
                "the request could not be completed; retry with the same key: it runs once, or answers with what was recorded".into(),
            ),
            Error::Replay { .. } => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "IDEMPOTENCY_REPLAY_FAILED",
                "Stored response cannot be replayed",
                "the request was already processed, but its stored response can no longer be read".into(),
            ),
            Error::Serialize(_) => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "IDEMPOTENCY_SERIALIZE_FAILED",
                "Request cannot be made idempotent",
                "the request or its result could not be serialized; nothing was written".into(),
            ),
        }
    }
}

impl From<Error> for Problem {
    fn from(error: Error) -> Self {
        Problem::from(&error)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut response = (self.status, self.body()).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// The response for an [`Error`]; see the table in the [module docs](self).
impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let problem = Problem::from(&self);
        if problem.status.is_server_error() {
            // The body hides the cause from the caller; the log keeps it.
            tracing::error!(error = %self, "idempotent request failed");
        }
        problem.into_response()
    }
}

impl Error {
    /// The HTTP status this error answers with.
    pub fn status_code(&self) -> StatusCode {
        Problem::from(self).status
    }
}

/// Middleware for `axum::middleware::from_fn`: runs the handler inside
/// [`observe`] and adds `Idempotent-Replayed: true` when its
/// `#[idempotent]` call replayed a stored result. A call that executed (or
/// failed) gets no such header.
///
/// ```ignore
/// Router::new().route("/orders/{id}/pay", post(pay)).layer(axum::middleware::from_fn(idem::http::replay_header))
/// ```
pub async fn replay_header(request: Request, next: Next) -> Response {
    let (mut response, outcome) = observe(next.run(request)).await;
    if outcome == Some(Outcome::Replayed) {
        response.headers_mut().insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    fn key_from(values: &[&[u8]]) -> Result<IdempotencyKey, Problem> {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(&IDEMPOTENCY_KEY, HeaderValue::from_bytes(v).unwrap());
        }
        IdempotencyKey::from_headers(&headers)
    }

    fn code(values: &[&[u8]]) -> &'static str {
        match key_from(values) {
            Ok(k) => panic!("{k:?} accepted"),
            Err(p) => {
                assert_eq!(p.status, StatusCode::BAD_REQUEST);
                p.code
            }
        }
    }

    #[test]
    fn accepts_keys_of_8_to_255_characters() {
        assert_eq!(key_from(&[b"abcdefgh"]).unwrap().as_str(), "abcdefgh");
        let long = "A0_.:-".repeat(42) + "abc";
        assert_eq!(long.len(), 255);
        assert_eq!(key_from(&[long.as_bytes()]).unwrap().0, long);
        assert_eq!(key_from(&[b"9f1c2e4a-7b7e-4c1d-a1d4-2b6f0f1e9a10"]).unwrap().0.len(), 36);
    }

    #[test]
    fn refuses_missing_and_malformed_keys() {
        assert_eq!(code(&[]), "MISSING_IDEMPOTENCY_KEY");
        assert_eq!(code(&[b""]), "MISSING_IDEMPOTENCY_KEY");
        let too_long = "k".repeat(256);
        for bad in [&b"a b"[..], b"{x}", b"abcdefg", too_long.as_bytes(), b"abcdefgh\xff", b"abcd efgh", b"abcdefgh/"] {
            assert_eq!(code(&[bad]), "INVALID_IDEMPOTENCY_KEY", "{:?}", String::from_utf8_lossy(bad));
        }
        assert_eq!(code(&[b"abcdefgh", b"abcdefgh"]), "INVALID_IDEMPOTENCY_KEY");
    }

    #[test]
    fn problem_details_never_repeat_the_key() {
        let key = "secret-key-value-{x}";
        let problem = key_from(&[key.as_bytes()]).unwrap_err();
        assert!(!problem.body().contains("secret-key-value"), "{}", problem.body());
        let reused = Error::KeyReused { biz: "pay", key: "u1:secret-key-value".into() };
        let in_progress = Error::InProgress { biz: "pay", key: "u1:secret-key-value".into() };
        for e in [reused, in_progress] {
            assert!(!Problem::from(&e).body().contains("secret"));
        }
    }

    fn parts(error: Error) -> (StatusCode, serde_json::Value, HeaderMap) {
        let problem = Problem::from(&error);
        let body: serde_json::Value = serde_json::from_str(&problem.body()).unwrap();
        let response = error.into_response();
        assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        assert_eq!(response.status(), problem.status);
        assert_eq!(body["status"], problem.status.as_u16());
        assert_eq!(body["code"], problem.code);
        assert_eq!(body["type"], problem.type_uri());
        assert!(body["title"].as_str().is_some_and(|t| !t.is_empty()));
        assert!(body["detail"].as_str().is_some_and(|d| !d.is_empty()));
        (response.status(), body, response.headers().clone())
    }

    #[test]
    fn errors_answer_with_their_status_and_code() {
        let json_error = || serde_json::from_str::<u8>("x").unwrap_err();
        let (status, body, headers) = parts(Error::InProgress { biz: "pay", key: "k".into() });
        assert_eq!((status, body["code"].as_str()), (StatusCode::CONFLICT, Some("IDEMPOTENCY_KEY_IN_PROGRESS")));
        assert_eq!(headers[header::RETRY_AFTER], "1");
        assert_eq!(body["type"], "urn:idem:problem:idempotency-key-in-progress");

        let cases = [
            (Error::KeyReused { biz: "pay", key: "k".into() }, 422, "IDEMPOTENCY_KEY_REUSED"),
            (Error::InvalidKey(KeyError::BadChar { ch: ' ', at: 1 }), 400, "INVALID_IDEMPOTENCY_KEY"),
            (Error::Storage(sqlx::Error::PoolTimedOut), 503, "IDEMPOTENCY_STORAGE_UNAVAILABLE"),
            (Error::Replay { biz: "pay", key: "k".into(), source: json_error() }, 500, "IDEMPOTENCY_REPLAY_FAILED"),
            (Error::Serialize(json_error()), 500, "IDEMPOTENCY_SERIALIZE_FAILED"),
        ];
        for (error, status, code) in cases {
            let (got, body, headers) = parts(error);
            assert_eq!((got.as_u16(), body["code"].as_str()), (status, Some(code)));
            assert!(headers.get(header::RETRY_AFTER).is_none());
        }
    }

    #[test]
    fn storage_details_stay_out_of_the_body() {
        let error = Error::Storage(sqlx::Error::Protocol("password=hunter2".into()));
        assert!(!Problem::from(&error).body().contains("hunter2"));
    }
}
