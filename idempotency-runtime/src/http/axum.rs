//! axum (feature `axum`): the extractors, [`check_principal`], errors as
//! responses and the [`replay_header`] middleware, over the framework-free
//! rules of [`http`](super). Every item here is also at `idempotency::http`
//! itself (`idempotency::http::replay_header`, `idempotency::http::Problem`).
//!
//! ```ignore
//! use axum::{Json, Router, extract::{Path, State}, middleware, routing::post};
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
//!     .layer(middleware::from_fn(replay_header))   // `Idempotent-Replayed: true`
//!     .with_state(state);
//! ```

use axum::extract::{FromRequestParts, OptionalFromRequestParts, Request};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};

use super::framework::{HttpStatus, RequestHeaders, sealed};
use super::{IdempotencyKey, IdempotencyToken, KeyOrToken, PROBLEM_JSON, ProblemDetails, TypedProblem, observe_replay};
use crate::error::Error;
use crate::stored_json::StoredJson;
use crate::token::TokenError;

const JSON: &str = "application/json";

/// The request header carrying the caller's key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static(super::header::IDEMPOTENCY_KEY);
/// The response header set on a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static(super::header::IDEMPOTENT_REPLAYED);
/// The request header carrying a token the server issued
/// ([`Idem::tokens`](crate::Idem::tokens)).
pub const IDEMPOTENCY_TOKEN: HeaderName = HeaderName::from_static(super::header::IDEMPOTENCY_TOKEN);
/// `Idempotency-Should-Retry`, on every problem answered.
const SHOULD_RETRY: HeaderName = HeaderName::from_static(super::header::SHOULD_RETRY);

/// An `application/problem+json` error response (RFC 9457) with a stable
/// `code`, as axum answers it. Built from an [`Error`]
/// (`Problem::from(&error)`), by the [`IdempotencyKey`] extractor, or by
/// [`check_principal`].
pub type Problem = ProblemDetails<StatusCode>;

impl sealed::Sealed for StatusCode {}

impl HttpStatus for StatusCode {
    fn from_code(code: u16) -> Self {
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    fn code(self) -> u16 {
        self.as_u16()
    }
}

/// Our header names, made once: looked up by a `&str`, a name is parsed
/// (lower-cased, checked) on every request.
fn known(name: &'static str) -> HeaderName {
    match name {
        super::header::IDEMPOTENCY_KEY => IDEMPOTENCY_KEY,
        super::header::IDEMPOTENCY_TOKEN => IDEMPOTENCY_TOKEN,
        other => HeaderName::from_static(other),
    }
}

impl sealed::Sealed for HeaderMap {}

impl RequestHeaders for HeaderMap {
    type Status = StatusCode;

    fn header_values(&self, name: &'static str) -> impl Iterator<Item = &[u8]> {
        self.get_all(known(name)).iter().map(HeaderValue::as_bytes)
    }
}

/// Checks a principal (the authenticated caller) that scopes keys in a
/// template such as `key = "<user>:<idem_key>"`; the rule is
/// [`validate_principal`](super::validate_principal)'s:
/// `[A-Za-z0-9_.-]{1,64}`, else 400 `INVALID_PRINCIPAL`. Call it in your
/// principal's extractor, so such a request is refused before the handler
/// runs and nothing is written:
///
/// ```ignore
/// impl<S: Send + Sync> FromRequestParts<S> for UserId {
///     type Rejection = Response;
///
///     async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Response> {
///         let user = authenticate(parts)?;                 // 401 for no caller
///         idempotency::http::check_principal(&user).map_err(IntoResponse::into_response)?;
///         Ok(UserId(user))
///     }
/// }
/// ```
pub fn check_principal(principal: &str) -> Result<(), Problem> {
    super::validate_principal(principal).map_err(ProblemDetails::convert)
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Self::from_headers(&parts.headers)
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

impl<S: Send + Sync> FromRequestParts<S> for KeyOrToken {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Self::from_headers(&parts.headers)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = self.body();
        respond(&self, body)
    }
}

/// A problem under the application's own `type` URI.
impl IntoResponse for TypedProblem<StatusCode> {
    fn into_response(self) -> Response {
        respond(&self.problem, self.body())
    }
}

/// `problem`'s status and `Retry-After`, and `body` as `application/problem+json`.
fn respond(problem: &Problem, body: String) -> Response {
    let mut response = (problem.status, body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    if let Some(seconds) = problem.retry_after {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    headers.insert(SHOULD_RETRY, HeaderValue::from_static(if problem.should_retry() { "true" } else { "false" }));
    response
}

/// The response for an [`Error`]; see the table in the [module docs](super).
impl IntoResponse for Error {
    fn into_response(self) -> Response {
        ProblemDetails::answering(&self).convert::<StatusCode>().into_response()
    }
}

/// `200 OK`, `application/json`, the stored bytes as they are. A value no
/// call stored yet is written as JSON (one that has no JSON form: the
/// engine's 500 problem, as its call would have answered).
impl<T: serde::Serialize> IntoResponse for StoredJson<T> {
    fn into_response(self) -> Response {
        match self.into_body() {
            Ok(body) => ([(header::CONTENT_TYPE, HeaderValue::from_static(JSON))], body).into_response(),
            Err(e) => Error::Serialize(e).into_response(),
        }
    }
}

/// The response for a [`TokenError`]: 403 `IDEMPOTENCY_TOKEN_INVALID` for
/// a refused token, 503 when its store is unavailable (see the table in
/// the [module docs](super)).
impl IntoResponse for TokenError {
    fn into_response(self) -> Response {
        ProblemDetails::answering_token(&self).convert::<StatusCode>().into_response()
    }
}

impl Error {
    /// The HTTP status this error answers with.
    pub fn status_code(&self) -> StatusCode {
        Problem::from(self).status
    }
}

/// Middleware for `axum::middleware::from_fn`: runs the handler inside
/// [`observe_replay`] and adds `Idempotent-Replayed: true` when its
/// `#[idempotent]` call replayed a stored result. A call that executed (or
/// failed) gets no such header. [`ReplayHeaderLayer`] does the same
/// without `from_fn`'s boxed future and cloned service per request.
///
/// ```ignore
/// Router::new().route("/orders/{id}/pay", post(pay)).layer(axum::middleware::from_fn(idempotency::http::replay_header))
/// ```
pub async fn replay_header(request: Request, next: Next) -> Response {
    let (mut response, replayed) = observe_replay(next.run(request)).await;
    if replayed {
        response.headers_mut().insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static(super::header::REPLAYED));
    }
    response
}

/// [`replay_header`] as a tower layer: `Idempotent-Replayed: true` on a
/// response whose handler's `#[idempotent]` call replayed a stored result,
/// with nothing allocated per request (`from_fn` boxes a future and clones
/// the service on each).
///
/// ```ignore
/// Router::new().route("/orders/{id}/pay", post(pay)).layer(idempotency::http::ReplayHeaderLayer)
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplayHeaderLayer;

impl<S> tower_layer::Layer<S> for ReplayHeaderLayer {
    type Service = ReplayHeader<S>;

    fn layer(&self, inner: S) -> ReplayHeader<S> {
        ReplayHeader { inner }
    }
}

/// The service of [`ReplayHeaderLayer`]; or, made with [`ReplayHeader::new`],
/// around a whole `Router`, which costs nothing per request (a
/// `Router::layer` wraps each route, and axum clones and boxes a layered
/// route on every request it serves).
///
/// ```ignore
/// let app = ReplayHeader::new(router);
/// axum::serve(listener, axum::ServiceExt::<axum::extract::Request>::into_make_service(app)).await?;
/// ```
#[derive(Debug, Clone)]
pub struct ReplayHeader<S> {
    inner: S,
}

impl<S> ReplayHeader<S> {
    /// Marks the replays of `inner`'s responses.
    pub fn new(inner: S) -> Self {
        ReplayHeader { inner }
    }
}

impl<S, B> tower_service::Service<http::Request<B>> for ReplayHeader<S>
where
    S: tower_service::Service<http::Request<B>, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = ReplayHeaderFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        ReplayHeaderFuture { inner: self.inner.call(request), last: None }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`ReplayHeader`]: the handler's, observed.
    pub struct ReplayHeaderFuture<F> {
        #[pin]
        inner: F,
        last: Option<crate::outcome::Observed>,
    }
}

impl<F, E> std::future::Future for ReplayHeaderFuture<F>
where
    F: std::future::Future<Output = Result<Response, E>>,
{
    type Output = Result<Response, E>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let this = self.project();
        let mut response = std::task::ready!(crate::outcome::poll_observed(this.inner, this.last, cx))?;
        if this.last.is_some_and(|last| last.outcome == crate::outcome::Outcome::Replayed) {
            response.headers_mut().insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static(super::header::REPLAYED));
        }
        std::task::Poll::Ready(Ok(response))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::KeyError;

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

    #[tokio::test]
    async fn stored_json_answers_its_stored_bytes() {
        let body = |response: Response| axum::body::to_bytes(response.into_body(), usize::MAX);
        // As stored by another writer: spacing and escapes stay.
        let stored = r#"{ "id": 7, "note": "caf\u00e9" }"#;
        let read: StoredJson<serde_json::Value> = serde_json::from_str(stored).unwrap();
        let response = read.into_response();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(body(response).await.unwrap(), stored.as_bytes());
        // Not stored yet: written as JSON; without a JSON form: the engine's 500.
        assert_eq!(body(StoredJson::new(vec![1, 2]).into_response()).await.unwrap(), "[1,2]".as_bytes());
        let keyed_by_bytes = std::collections::BTreeMap::from([(vec![1u8], 1)]);
        let response = StoredJson::new(keyed_by_bytes).into_response();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
    }

    #[test]
    fn errors_answer_with_their_status_and_code() {
        let json_error = || serde_json::from_str::<u8>("x").unwrap_err();
        let (status, body, headers) = parts(Error::InProgress { biz: "pay", key: "k".into() });
        assert_eq!((status, body["code"].as_str()), (StatusCode::CONFLICT, Some("IDEMPOTENCY_KEY_IN_PROGRESS")));
        assert_eq!(headers[header::RETRY_AFTER], "1");
        assert_eq!(headers[SHOULD_RETRY], "true");
        assert_eq!(body["type"], "urn:idem:problem:idempotency-key-in-progress");

        let cases = [
            (Error::KeyReused { biz: "pay", key: "k".into() }, 422, "IDEMPOTENCY_KEY_REUSED"),
            (Error::InvalidKey(KeyError::BadChar { ch: ' ', at: 1 }), 400, "INVALID_IDEMPOTENCY_KEY"),
            (Error::InvalidKey(KeyError::TooLong { len: 300, max: 255 }), 400, "INVALID_IDEMPOTENCY_KEY"),
            (Error::BizNoTooLong { len: 65, max: 64 }, 400, "INVALID_BIZ_NO"),
            (Error::InvalidBiz, 500, "IDEMPOTENCY_MISCONFIGURED"),
            (Error::NonFiniteFloat { arg: "amount" }, 422, "NON_FINITE_NUMBER"),
            (Error::Storage(sqlx::Error::PoolTimedOut), 503, "IDEMPOTENCY_STORAGE_UNAVAILABLE"),
            (Error::StorageRefused(sqlx::Error::RowNotFound), 500, "IDEMPOTENCY_STORAGE_REFUSED"),
            (Error::NotMigrated(sqlx::Error::RowNotFound), 500, "IDEMPOTENCY_NOT_MIGRATED"),
            (Error::Replay { biz: "pay", key: "k".into(), source: json_error() }, 500, "IDEMPOTENCY_REPLAY_FAILED"),
            (Error::Serialize(json_error()), 500, "IDEMPOTENCY_SERIALIZE_FAILED"),
        ];
        for (error, status, code) in cases {
            let (got, body, headers) = parts(error);
            assert_eq!((got.as_u16(), body["code"].as_str()), (status, Some(code)));
            // Only a failure that passes says when to come back, and to come back at all.
            assert_eq!(headers.get(header::RETRY_AFTER).is_some(), status == 503, "{code}");
            assert_eq!(headers[SHOULD_RETRY], if status == 503 { "true" } else { "false" }, "{code}");
        }
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
}
