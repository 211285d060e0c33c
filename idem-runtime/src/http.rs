//! HTTP glue for axum handlers (feature `axum`): the `Idempotency-Key`
//! extractor, [`check_principal`] for the caller that scopes keys, [`Error`]
//! as an `application/problem+json` response, and the [`replay_header`]
//! middleware that marks replayed responses.
//!
//! ```ignore
//! use axum::{Json, Router, extract::{Path, State}, middleware, routing::post};
//! use idem::http::{IdempotencyKey, replay_header};
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
//! | header not `[A-Za-z0-9_.:-]{8,255}` (bare or quoted), badly quoted, or sent twice | 400 | `INVALID_IDEMPOTENCY_KEY` |
//! | principal with `:`, or not `[A-Za-z0-9_.-]{1,64}` ([`check_principal`] in your extractor) | 400 | `INVALID_PRINCIPAL` |
//! | rendered `biz_no` longer than 64 bytes | 400 | `INVALID_BIZ_NO` |
//! | an argument holds a NaN or infinite float | 422 | `NON_FINITE_NUMBER` |
//! | database unreachable | 503 | `IDEMPOTENCY_STORAGE_UNAVAILABLE` |
//! | stored result no longer deserializes / cannot serialize | 500 | `IDEMPOTENCY_REPLAY_FAILED` / `IDEMPOTENCY_SERIALIZE_FAILED` |
//! | `biz` breaks `[a-z0-9_]{1,32}` (a server bug, e.g. in `Idem::status`) | 500 | `IDEMPOTENCY_MISCONFIGURED` |
//! | a body calling outside services declared its failure permanent, unmapped by the handler (first call and every retry) | 422 | `IDEMPOTENT_REQUEST_FAILED` |
//! | `Idempotency-Token` forged, malformed, sent twice, expired, or issued to another caller ([`IdempotencyToken`], [`TokenError::Refused`]) | 403 | `IDEMPOTENCY_TOKEN_INVALID` |
//! | `Idempotency-Token` used before by this caller | as a duplicate: the first result replayed, or 409 while it runs | |
//! | both `Idempotency-Key` and `Idempotency-Token` ([`KeyOrToken`]) | 400 | `INVALID_IDEMPOTENCY_KEY` |
//! | the token store (Redis, or the database without it) unreachable | 503, `Retry-After: 1` | `IDEMPOTENCY_STORAGE_UNAVAILABLE` |
//!
//! Error bodies are `application/problem+json` (RFC 9457) with `type`,
//! `title`, `status`, `code` and `detail`. The detail never repeats the key
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
//!   `a:b` + `c` would render the same key: check it with
//!   [`check_principal`] in your principal's extractor, which refuses
//!   anything but `[A-Za-z0-9_.-]{1,64}` with 400 `INVALID_PRINCIPAL`
//!   before the handler runs (map other identities, such as e-mail
//!   addresses, to an id or a hash first). The rendered key must still fit
//!   255 bytes: with a principal of `n` bytes, the header may use at most
//!   `254 - n` (190 with the longest principal); longer ones are answered
//!   400 `INVALID_IDEMPOTENCY_KEY`.
//! - The replayed response is rebuilt from the stored value with the
//!   handler's `IntoResponse`, so status and body are identical as long as
//!   that conversion depends on the value alone.
//! - [`replay_header`] sees only `#[idempotent]` calls awaited inside the
//!   handler's own task (not ones in a `tokio::spawn`ed task); with several,
//!   the last one decides.

use axum::extract::{FromRequestParts, OptionalFromRequestParts, Request};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::{HeaderName, HeaderValue, StatusCode, header};
use serde::{Deserialize, Serialize};

use idem_rules::Shown;

use crate::error::{Error, KeyError};
use crate::key::{MAX_KEY_LEN, is_key_char, validate_header_key};
use crate::outcome::{Outcome, observe};
use crate::token::{TokenError, is_well_formed};

/// The request header carrying the caller's key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The response header set on a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// The media type of error bodies.
pub const PROBLEM_JSON: &str = "application/problem+json";
/// The request header carrying a token the server issued
/// ([`Idem::tokens`](crate::Idem::tokens)).
pub const IDEMPOTENCY_TOKEN: HeaderName = HeaderName::from_static("idempotency-token");

/// The request's `Idempotency-Key` header, checked against
/// `[A-Za-z0-9_.:-]{8,255}`, bare (`abc-123-xyz`) or as a structured-field
/// string (`"abc-123-xyz"`, unquoted here: both are the same key). As an
/// extractor it refuses the request with 400 (`MISSING_IDEMPOTENCY_KEY` or
/// `INVALID_IDEMPOTENCY_KEY`) before the handler runs; nothing is written
/// for such a request.
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
            return Err(Problem::invalid_key(format!(
                "the Idempotency-Key header holds bytes that are not visible ASCII; {KEY_RULE}"
            )));
        };
        let Some(quoted) = text.strip_prefix('"') else {
            return match validate_header_key(text) {
                Ok(()) => Ok(IdempotencyKey(text.to_owned())),
                Err(Error::InvalidKey(KeyError::Missing)) => Err(Problem::missing_key()),
                Err(Error::InvalidKey(reason)) => Err(Problem::invalid_header_key(&reason)),
                Err(e) => Err(Problem::from(&e)),
            };
        };
        // A structured-field string: `"`, then characters where `\` escapes
        // `"` or `\`, then `"`. No key character needs an escape, so any
        // quote or backslash inside is refused rather than decoded.
        let Some(inner) = quoted.strip_suffix('"') else {
            return Err(Problem::invalid_key(format!(
                "the Idempotency-Key header opens a quoted string that does not end with its closing quote; {KEY_RULE}"
            )));
        };
        if inner.contains(['"', '\\']) {
            return Err(Problem::invalid_key(format!(
                "the quoted Idempotency-Key holds a quote or a backslash escape; {KEY_RULE}"
            )));
        }
        match validate_header_key(inner) {
            Ok(()) => Ok(IdempotencyKey(inner.to_owned())),
            Err(Error::InvalidKey(KeyError::Missing)) => {
                Err(Problem::invalid_key(format!("the quoted Idempotency-Key is empty; {KEY_RULE}")))
            }
            // Offsets count from the header's first byte, the opening quote.
            Err(Error::InvalidKey(KeyError::BadChar { ch, at })) => {
                Err(Problem::invalid_header_key(&KeyError::BadChar { ch, at: at + 1 }))
            }
            Err(Error::InvalidKey(reason)) => Err(Problem::invalid_header_key(&reason)),
            Err(e) => Err(Problem::from(&e)),
        }
    }

    /// The key, unquoted.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What a key may be, for details: the header's rule.
const KEY_RULE: &str = "keys are 8 to 255 characters from A-Z a-z 0-9 _ . : -, bare or in double quotes";

/// Longest principal [`check_principal`] accepts: with the `:` separator it
/// leaves a header key 190 bytes of the 255 a rendered key may hold.
pub const MAX_PRINCIPAL_LEN: usize = 64;

/// Checks a principal (the authenticated caller) that scopes keys in a
/// template such as `key = "<user>:<idem_key>"`: `[A-Za-z0-9_.-]{1,64}`,
/// the key characters without the `:` separator, so that no two pairs of
/// principal and header key render the same key (`a` + `b:c` and `a:b` +
/// `c` would). Refused: 400 `INVALID_PRINCIPAL`, whose detail names the
/// offending character (as its code point when not visible ASCII) but never
/// repeats the principal. Call it in your principal's extractor, so such a
/// request is refused before the handler runs and nothing is written:
///
/// ```ignore
/// impl<S: Send + Sync> FromRequestParts<S> for UserId {
///     type Rejection = Response;
///
///     async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Response> {
///         let user = authenticate(parts)?;                 // 401 for no caller
///         idem::http::check_principal(&user).map_err(IntoResponse::into_response)?;
///         Ok(UserId(user))
///     }
/// }
/// ```
pub fn check_principal(principal: &str) -> Result<(), Problem> {
    let why = if principal.is_empty() {
        "it is empty".to_owned()
    } else if principal.len() > MAX_PRINCIPAL_LEN {
        format!("it is {} bytes long", principal.len())
    } else if let Some((at, ch)) = principal.char_indices().find(|&(_, c)| c == ':' || !is_key_char(c)) {
        format!("it holds {} at byte {at}", Shown(ch))
    } else {
        return Ok(());
    };
    Err(Problem::new(
        StatusCode::BAD_REQUEST,
        "INVALID_PRINCIPAL",
        "Caller identity cannot scope an idempotency key",
        format!(
            "the caller's identity cannot scope an idempotency key: {why}; it must be 1 to {MAX_PRINCIPAL_LEN} \
             characters from A-Z a-z 0-9 _ . - (`:` separates it from the key)"
        ),
    ))
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Self::from_headers(&parts.headers)
    }
}

/// The request's `Idempotency-Token` header: a token the server issued
/// ([`Idem::tokens`](crate::Idem::tokens)), bare or as a structured-field
/// string (`"..."`). Checked for shape only (32 characters of base64url);
/// whether it was issued, to whom, and whether it is used is for
/// [`Tokens::redeem`](crate::Tokens::redeem) to say. A header that cannot
/// be a token (or is sent twice) is refused like a forged token: 403
/// `IDEMPOTENCY_TOKEN_INVALID`, before the handler runs. As an extractor it
/// requires the header (403 without it too); take `Option<IdempotencyToken>`
/// where it is one way among others, or [`KeyOrToken`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct IdempotencyToken(pub String);

impl IdempotencyToken {
    /// Reads and checks the token from request headers: `Ok(None)` when
    /// there is none.
    pub fn from_headers(headers: &http::HeaderMap) -> Result<Option<Self>, Problem> {
        let mut values = headers.get_all(&IDEMPOTENCY_TOKEN).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(Problem::token_invalid());
        }
        let text = value.to_str().unwrap_or_default();
        let token = text.strip_prefix('"').and_then(|quoted| quoted.strip_suffix('"')).unwrap_or(text);
        if is_well_formed(token) { Ok(Some(IdempotencyToken(token.to_owned()))) } else { Err(Problem::token_invalid()) }
    }

    /// The token, unquoted.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyToken {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Self::from_headers(&parts.headers)?.ok_or_else(Problem::token_invalid)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyToken {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Option<Self>, Self::Rejection> {
        Self::from_headers(&parts.headers)
    }
}

/// Either way a request may name its call: a client's `Idempotency-Key`,
/// or an `Idempotency-Token` the server issued. Neither: 400
/// `MISSING_IDEMPOTENCY_KEY`; both: 400 `INVALID_IDEMPOTENCY_KEY` (which
/// one counts would be a guess); a malformed key: 400 as for
/// [`IdempotencyKey`]; a malformed token: 403 as for [`IdempotencyToken`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyOrToken {
    /// The client's key.
    Key(IdempotencyKey),
    /// The token the server issued.
    Token(IdempotencyToken),
}

impl KeyOrToken {
    /// Reads and checks either header.
    pub fn from_headers(headers: &http::HeaderMap) -> Result<Self, Problem> {
        let has_key = headers.contains_key(&IDEMPOTENCY_KEY);
        match IdempotencyToken::from_headers(headers)? {
            Some(_) if has_key => {
                Err(Problem::invalid_key("send either an Idempotency-Key or an Idempotency-Token, not both".into()))
            }
            Some(token) => Ok(KeyOrToken::Token(token)),
            None if has_key => IdempotencyKey::from_headers(headers).map(KeyOrToken::Key),
            None => Err(Problem::new(
                StatusCode::BAD_REQUEST,
                "MISSING_IDEMPOTENCY_KEY",
                "Idempotency-Key or Idempotency-Token header required",
                "send the Idempotency-Token the server issued for this form, or an Idempotency-Key header of \
                 8 to 255 characters from A-Z a-z 0-9 _ . : -, and the same value again when retrying"
                    .into(),
            )),
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for KeyOrToken {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Self::from_headers(&parts.headers)
    }
}

/// An `application/problem+json` error response (RFC 9457) with a stable
/// `code`. Built from an [`Error`] (`Problem::from(&error)`), by the
/// [`IdempotencyKey`] extractor, or by [`check_principal`].
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

    /// The header breaks the key rule. `reason` shows an offending character
    /// only as visible ASCII or a code point (see `KeyError`'s `Display`).
    fn invalid_header_key(reason: &KeyError) -> Self {
        Problem::invalid_key(format!("the Idempotency-Key header is invalid ({reason}); {KEY_RULE}"))
    }

    /// A token that is forged, malformed, expired, or issued to another
    /// caller: 403 `IDEMPOTENCY_TOKEN_INVALID`, alike for all (the caller
    /// learns nothing about other callers' tokens).
    pub fn token_invalid() -> Self {
        Problem::new(
            StatusCode::FORBIDDEN,
            "IDEMPOTENCY_TOKEN_INVALID",
            "Idempotency token invalid",
            "the Idempotency-Token is unknown, expired, or was issued to another caller; \
             ask for a new one; nothing was written"
                .into(),
        )
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
            // Not the client's key: the `biz_no` comes from the request's
            // arguments, the `biz` from the server's code.
            Error::BizNoTooLong { len, max } => Problem::new(
                StatusCode::BAD_REQUEST,
                "INVALID_BIZ_NO",
                "Business number too long",
                format!("the request's business number is {len} bytes long, at most {max} are allowed; nothing was written"),
            ),
            Error::InvalidBiz => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "IDEMPOTENCY_MISCONFIGURED",
                "Idempotency misconfigured on the server",
                "the server names this action in a way idempotency does not accept; nothing was written".into(),
            ),
            // The key as the fn rendered it, the caller's scope included.
            Error::InvalidKey(reason) => Problem::invalid_key(format!(
                "the idempotency key, with the scope the server adds to it, is invalid ({reason}); \
                 the whole must be at most {MAX_KEY_LEN} characters from A-Z a-z 0-9 _ . : -"
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
            Error::NonFiniteFloat { .. } => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "NON_FINITE_NUMBER",
                "Request holds a number that is not finite",
                "a number in the request is NaN or infinite, which cannot be told apart from no number; \
                 nothing was written"
                    .into(),
            ),
            // The handler's own error type usually answers this one; the
            // recorded failure is the application's to show, not this layer's.
            Error::Permanent { .. } => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "IDEMPOTENT_REQUEST_FAILED",
                "Request failed permanently",
                "the request failed for good and its failure was recorded; \
                 a retry with the same key gets this answer again"
                    .into(),
            ),
            Error::InvalidStep { .. } => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "IDEMPOTENCY_MISCONFIGURED",
                "Idempotency misconfigured on the server",
                "the server calls an outside service in a way idempotency does not accept; nothing was called".into(),
            ),
        }
    }
}

impl From<Error> for Problem {
    fn from(error: Error) -> Self {
        Problem::from(&error)
    }
}

impl From<&TokenError> for Problem {
    fn from(error: &TokenError) -> Self {
        match error {
            TokenError::Refused(_) => Problem::token_invalid(),
            TokenError::InvalidSubject { .. } => Problem::new(
                StatusCode::BAD_REQUEST,
                "INVALID_PRINCIPAL",
                "Caller identity cannot hold an idempotency token",
                format!(
                    "the caller's identity cannot hold an idempotency token; it must be 1 to {MAX_PRINCIPAL_LEN} \
                     characters from A-Z a-z 0-9 _ . -"
                ),
            ),
            TokenError::Unavailable(_) | TokenError::Storage(_) => Problem {
                retry_after: Some(1),
                ..Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "IDEMPOTENCY_STORAGE_UNAVAILABLE",
                    "Idempotency storage unavailable",
                    "the idempotency token could not be checked or issued; retry with the same token: \
                     nothing was decided"
                        .into(),
                )
            },
            TokenError::Random(_) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "IDEMPOTENCY_TOKEN_UNAVAILABLE",
                "Idempotency token cannot be issued",
                "no idempotency token could be issued right now; ask again later".into(),
            ),
            // `biz` or ttl: the server's code, not the request.
            TokenError::InvalidBiz | TokenError::InvalidTtl => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "IDEMPOTENCY_MISCONFIGURED",
                "Idempotency misconfigured on the server",
                "the server names this action or its token lifetime in a way idempotency does not accept; \
                 nothing was written"
                    .into(),
            ),
        }
    }
}

impl From<TokenError> for Problem {
    fn from(error: TokenError) -> Self {
        Problem::from(&error)
    }
}

/// The response for a [`TokenError`]: 403 `IDEMPOTENCY_TOKEN_INVALID` for
/// a refused token, 503 when its store is unavailable (see the table in
/// the [module docs](self)).
impl IntoResponse for TokenError {
    fn into_response(self) -> Response {
        let problem = Problem::from(&self);
        if problem.status.is_server_error() {
            tracing::error!(error = %self, "idempotency token failed");
        }
        problem.into_response()
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
    fn quoted_keys_are_the_same_keys_unquoted() {
        assert_eq!(key_from(&[b"\"abcdefgh\""]).unwrap(), key_from(&[b"abcdefgh"]).unwrap());
        assert_eq!(key_from(&[b"\"abcdefgh\""]).unwrap().as_str(), "abcdefgh");
        let long = "A0_.:-".repeat(42) + "abc";
        assert_eq!(key_from(&[format!("\"{long}\"").as_bytes()]).unwrap().0, long);
        let uuid = "9f1c2e4a-7b7e-4c1d-a1d4-2b6f0f1e9a10";
        assert_eq!(key_from(&[format!("\"{uuid}\"").as_bytes()]).unwrap().0, uuid);
    }

    #[test]
    fn refuses_bad_quoting_and_what_the_rule_refuses_inside_quotes() {
        let too_long = format!("\"{}\"", "k".repeat(256));
        let cases: [&[u8]; 13] = [
            b"\"",
            b"\"\"",
            b"\"abcdefgh",
            b"abcdefgh\"",
            b"\"abcd\"efgh\"",
            b"\"abcd\\\"efgh\"",
            b"\"abcd\\efgh\"",
            b"\"abcdefgh\";p=1",
            b"\"abcdefgh\" ",
            b"\"abcd efgh\"",
            b"\"abcdefg\"",
            b"\"abcdefgh/\"",
            too_long.as_bytes(),
        ];
        for bad in cases {
            assert_eq!(code(&[bad]), "INVALID_IDEMPOTENCY_KEY", "{:?}", String::from_utf8_lossy(bad));
        }
        let detail = |value: &[u8]| key_from(&[value]).unwrap_err().detail;
        assert_eq!(
            detail(b"\"abcdefgh"),
            format!(
                "the Idempotency-Key header opens a quoted string that does not end with its closing quote; {KEY_RULE}"
            )
        );
        assert_eq!(
            detail(b"\"abcd\\\"efgh\""),
            format!("the quoted Idempotency-Key holds a quote or a backslash escape; {KEY_RULE}")
        );
        assert_eq!(detail(b"\"\""), format!("the quoted Idempotency-Key is empty; {KEY_RULE}"));
        // The offset counts from the header's first byte, the opening quote.
        assert_eq!(
            detail(b"\"abcd efgh\""),
            format!(
                "the Idempotency-Key header is invalid (character U+0020 at byte 5; only A-Z a-z 0-9 _ . : - are allowed); {KEY_RULE}"
            )
        );
    }

    /// Every detail is visible ASCII: no control byte, no byte >= 0x80, and
    /// none of the caller's text beyond one visible ASCII character.
    fn assert_shows_no_raw_bytes(problem: &Problem, raw: &str) {
        let body = problem.body();
        assert!(problem.detail.bytes().all(|b| b.is_ascii_graphic() || b == b' ') && body.is_ascii(), "{body}");
        assert!(!body.contains(raw), "{body}");
    }

    #[test]
    fn details_never_echo_raw_bytes() {
        // Header values that reach the key rule hold visible ASCII or tabs.
        let tab = key_from(&[b"abcd\tefgh"]).unwrap_err();
        assert!(tab.detail.contains("character U+0009 at byte 4"), "{}", tab.detail);
        assert_shows_no_raw_bytes(&tab, "abcd\tefgh");
        let quoted_tab = key_from(&[b"\"abcd\tefgh\""]).unwrap_err();
        assert!(quoted_tab.detail.contains("character U+0009 at byte 5"), "{}", quoted_tab.detail);
        for raw in [&b"abcd\xffefgh"[..], "clé-12345678".as_bytes(), b"\"abcd\xc3\xa9efgh\"", b"\"\xe2\x80\xaeabcdefgh"]
        {
            let problem = key_from(&[raw]).unwrap_err();
            assert_eq!(problem.code, "INVALID_IDEMPOTENCY_KEY");
            assert_eq!(
                problem.detail,
                format!("the Idempotency-Key header holds bytes that are not visible ASCII; {KEY_RULE}")
            );
            assert_shows_no_raw_bytes(&problem, "abcd");
        }
        // Keys rendered by the fn may hold anything its arguments held.
        for (ch, code) in
            [('\n', "U+000A"), ('\0', "U+0000"), ('é', "U+00E9"), ('\u{202e}', "U+202E"), ('\u{7f}', "U+007F")]
        {
            let problem = Problem::from(&Error::InvalidKey(KeyError::BadChar { ch, at: 7 }));
            assert!(problem.detail.contains(&format!("character {code} at byte 7")), "{}", problem.detail);
            assert_shows_no_raw_bytes(&problem, &ch.to_string());
        }
    }

    #[test]
    fn principals_without_the_separator_pass() {
        for good in ["alice", "u-1.a_B9", &"p".repeat(MAX_PRINCIPAL_LEN)] {
            assert_eq!(check_principal(good), Ok(()), "{good:?}");
        }
    }

    #[test]
    fn principals_that_could_merge_keys_are_refused() {
        let rule = "it must be 1 to 64 characters from A-Z a-z 0-9 _ . - (`:` separates it from the key)";
        let too_long = "p".repeat(MAX_PRINCIPAL_LEN + 1);
        let cases = [
            ("alice:bob", "it holds ':' at byte 5"),
            (":", "it holds ':' at byte 0"),
            ("", "it is empty"),
            (too_long.as_str(), "it is 65 bytes long"),
            ("al ice", "it holds U+0020 at byte 2"),
            ("alice@example", "it holds '@' at byte 5"),
            ("zoë", "it holds U+00EB at byte 2"),
            ("a\u{202e}b", "it holds U+202E at byte 1"),
            ("a\tb", "it holds U+0009 at byte 1"),
        ];
        for (principal, why) in cases {
            let problem = check_principal(principal).unwrap_err();
            assert_eq!((problem.status, problem.code), (StatusCode::BAD_REQUEST, "INVALID_PRINCIPAL"), "{principal:?}");
            assert_eq!(problem.detail, format!("the caller's identity cannot scope an idempotency key: {why}; {rule}"));
            assert_eq!(problem.type_uri(), "urn:idem:problem:invalid-principal");
            if principal.len() > 1 {
                assert_shows_no_raw_bytes(&problem, principal);
            }
        }
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
            (Error::InvalidKey(KeyError::TooLong { len: 300, max: 255 }), 400, "INVALID_IDEMPOTENCY_KEY"),
            (Error::BizNoTooLong { len: 65, max: 64 }, 400, "INVALID_BIZ_NO"),
            (Error::InvalidBiz, 500, "IDEMPOTENCY_MISCONFIGURED"),
            (Error::NonFiniteFloat { arg: "amount" }, 422, "NON_FINITE_NUMBER"),
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

    /// Regression: a bad `biz_no` or `biz` was answered "the idempotency key
    /// is invalid", blaming the client's key for the server's arguments.
    #[test]
    fn biz_errors_do_not_blame_the_key() {
        let biz_no = Problem::from(&Error::BizNoTooLong { len: 65, max: 64 });
        assert_eq!(
            biz_no.detail,
            "the request's business number is 65 bytes long, at most 64 are allowed; nothing was written"
        );
        let biz = Problem::from(&Error::InvalidBiz);
        let float = Problem::from(&Error::NonFiniteFloat { arg: "amount" });
        for problem in [biz_no, biz, float] {
            assert!(!problem.detail.contains("key") && !problem.title.contains("key"), "{problem:?}");
            assert!(!problem.detail.contains("amount"), "{problem:?}");
        }
    }

    fn token_from(values: &[&[u8]]) -> Result<Option<IdempotencyToken>, Problem> {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(&IDEMPOTENCY_TOKEN, HeaderValue::from_bytes(v).unwrap());
        }
        IdempotencyToken::from_headers(&headers)
    }

    #[test]
    fn token_headers_are_checked_for_shape_and_refused_as_forged() {
        let token = "AbCdEfGhIjKlMnOpQrStUvWxYz0123-_";
        assert_eq!(token_from(&[token.as_bytes()]).unwrap().unwrap().as_str(), token);
        assert_eq!(token_from(&[format!("\"{token}\"").as_bytes()]).unwrap().unwrap().as_str(), token);
        assert_eq!(token_from(&[]).unwrap(), None);
        let short = &token[1..];
        let long = format!("{token}A");
        let plus = token.replace('-', "+");
        for bad in [
            &b""[..],
            short.as_bytes(),
            long.as_bytes(),
            plus.as_bytes(),
            b"\"",
            b"AbCdEfGhIjKlMnOpQrStUvWxYz0123-\xff",
        ] {
            let problem = token_from(&[bad]).unwrap_err();
            assert_eq!((problem.status, problem.code), (StatusCode::FORBIDDEN, "IDEMPOTENCY_TOKEN_INVALID"));
            assert_shows_no_raw_bytes(&problem, "AbCdEfGh");
        }
        assert_eq!(token_from(&[token.as_bytes(), token.as_bytes()]).unwrap_err().code, "IDEMPOTENCY_TOKEN_INVALID");
    }

    #[test]
    fn key_or_token_takes_exactly_one() {
        let token = "AbCdEfGhIjKlMnOpQrStUvWxYz0123-_";
        let mut headers = HeaderMap::new();
        assert_eq!(KeyOrToken::from_headers(&headers).unwrap_err().code, "MISSING_IDEMPOTENCY_KEY");
        headers.insert(&IDEMPOTENCY_KEY, HeaderValue::from_static("abcdefgh"));
        assert_eq!(KeyOrToken::from_headers(&headers).unwrap(), KeyOrToken::Key(IdempotencyKey("abcdefgh".into())));
        headers.insert(&IDEMPOTENCY_TOKEN, HeaderValue::from_static(token));
        assert_eq!(KeyOrToken::from_headers(&headers).unwrap_err().code, "INVALID_IDEMPOTENCY_KEY");
        headers.remove(&IDEMPOTENCY_KEY);
        assert_eq!(KeyOrToken::from_headers(&headers).unwrap(), KeyOrToken::Token(IdempotencyToken(token.into())));
        headers.insert(&IDEMPOTENCY_TOKEN, HeaderValue::from_static("forged"));
        assert_eq!(KeyOrToken::from_headers(&headers).unwrap_err().status, StatusCode::FORBIDDEN);
    }

    #[test]
    fn token_errors_answer_with_their_status_and_code() {
        use crate::token::Refusal;
        let cases = [
            (TokenError::Refused(Refusal::Unknown), 403, "IDEMPOTENCY_TOKEN_INVALID"),
            (TokenError::Refused(Refusal::OtherSubject), 403, "IDEMPOTENCY_TOKEN_INVALID"),
            (TokenError::Unavailable("redis did not answer in time"), 503, "IDEMPOTENCY_STORAGE_UNAVAILABLE"),
            (TokenError::Storage(sqlx::Error::PoolTimedOut), 503, "IDEMPOTENCY_STORAGE_UNAVAILABLE"),
            (TokenError::InvalidSubject { len: 65 }, 400, "INVALID_PRINCIPAL"),
            (TokenError::InvalidBiz, 500, "IDEMPOTENCY_MISCONFIGURED"),
            (TokenError::InvalidTtl, 500, "IDEMPOTENCY_MISCONFIGURED"),
        ];
        for (error, status, code) in cases {
            let problem = Problem::from(&error);
            assert_eq!((problem.status.as_u16(), problem.code), (status, code), "{error:?}");
            let response = error.into_response();
            assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
            assert_eq!(response.headers().get(header::RETRY_AFTER).is_some(), status == 503);
        }
        // Both refusals read the same: nothing tells another caller's token from a forged one.
        assert_eq!(
            Problem::from(&TokenError::Refused(Refusal::Unknown)),
            Problem::from(&TokenError::Refused(Refusal::OtherSubject))
        );
    }

    #[test]
    fn storage_details_stay_out_of_the_body() {
        let error = Error::Storage(sqlx::Error::Protocol("password=hunter2".into()));
        assert!(!Problem::from(&error).body().contains("hunter2"));
    }
}
