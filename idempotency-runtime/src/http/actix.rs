//! actix-web (feature `actix`): the same contract as axum's, over the
//! framework-free rules of [`http`](super): [`IdempotencyKey`],
//! [`IdempotencyToken`] and [`KeyOrToken`] as extractors
//! (`FromRequest`), [`check_principal`], [`Error`], [`TokenError`] and
//! [`Problem`] as `application/problem+json` responses (`ResponseError`),
//! the [`replay_header`] middleware, and a [`Path`] extractor whose value
//! a handler can destructure (actix's own `web::Path` keeps its field
//! private, so its value could not reach the key or the fingerprint).
//!
//! ```ignore
//! use actix_web::{App, HttpServer, middleware::from_fn, web};
//! use idempotency::http::IdempotencyKey;
//! use idempotency::http::actix::{Path, replay_header};
//!
//! #[idempotent(key = "<user>:<idem_key>", ttl = "24h", biz = "http_pay", engine = app.idem)]
//! async fn pay(
//!     app: web::Data<App>,
//!     tx: &mut Transaction<'_, MySql>,
//!     UserId(user): UserId,                        // the principal, passed by `check_principal`
//!     IdempotencyKey(idem_key): IdempotencyKey,    // 400 when missing or malformed
//!     Path(order_id): Path<i64>,
//!     web::Json(req): web::Json<PayReq>,
//! ) -> Result<PayResponse, ApiError> { /* ... */ } // PayResponse: Responder; ApiError: ResponseError
//!
//! HttpServer::new(move || {
//!     App::new()
//!         .app_data(web::Data::new(state.clone()))
//!         .wrap(from_fn(replay_header))            // `Idempotent-Replayed: true`
//!         .route("/orders/{id}/pay", web::post().to(pay))
//! })
//! ```
//!
//! One difference to axum: actix-web turns any failed extractor inside an
//! `Option` into `None`, so `Option<IdempotencyToken>` would take a forged
//! token for none at all; take [`KeyOrToken`], or read
//! `IdempotencyToken::from_headers(request.headers())`.

use std::future::{Ready, ready};

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{FromRequest, HttpRequest, HttpResponse, Responder, ResponseError, web};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::framework::{HttpStatus, RequestHeaders, sealed};
use super::{IdempotencyKey, IdempotencyToken, KeyOrToken, PROBLEM_JSON, ProblemDetails, TypedProblem, observe_replay};
use crate::engine::Idem;
use crate::error::Error;
use crate::store::Backend;
use crate::stored_json::StoredJson;
use crate::token::TokenError;

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
/// `code`, as actix-web answers it (`ResponseError`, `Responder`). Built
/// from an [`Error`] (`Problem::from(&error)`), by the extractors, or by
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
        self.get_all(known(name)).map(HeaderValue::as_bytes)
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
/// impl FromRequest for UserId {
///     type Error = actix_web::Error;
///     type Future = Ready<Result<Self, actix_web::Error>>;
///
///     fn from_request(request: &HttpRequest, _: &mut Payload) -> Self::Future {
///         ready(authenticate(request).and_then(|user| {     // 401 for no caller
///             idempotency::http::actix::check_principal(&user)?;
///             Ok(UserId(user))
///         }))
///     }
/// }
/// ```
pub fn check_principal(principal: &str) -> Result<(), Problem> {
    super::validate_principal(principal).map_err(ProblemDetails::convert)
}

impl FromRequest for IdempotencyKey {
    type Error = Problem;
    type Future = Ready<Result<Self, Problem>>;

    fn from_request(request: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(Self::from_headers(request.headers()))
    }
}

/// Requires the header: 403 without it too (see [`IdempotencyToken`]).
impl FromRequest for IdempotencyToken {
    type Error = Problem;
    type Future = Ready<Result<Self, Problem>>;

    fn from_request(request: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(Self::from_headers(request.headers()).and_then(|token| token.ok_or_else(Problem::token_invalid)))
    }
}

impl FromRequest for KeyOrToken {
    type Error = Problem;
    type Future = Ready<Result<Self, Problem>>;

    fn from_request(request: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(Self::from_headers(request.headers()))
    }
}

/// Lets the attribute take the engine straight from actix-web's app data:
/// `engine = idem` with a parameter `idem: web::Data<Idem<DB>>`.
impl<DB: Backend> AsRef<Idem<DB>> for web::Data<Idem<DB>> {
    fn as_ref(&self) -> &Idem<DB> {
        self.get_ref()
    }
}

/// actix-web's `web::Path`, with its value public, so that a handler can
/// take it apart (`Path(order_id): Path<i64>`) and `#[idempotent]` sees the
/// value itself: in its key template and in the fingerprint. Refusals are
/// `web::Path`'s (404 by default, or its `PathConfig`'s).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Path<T>(pub T);

impl<T: DeserializeOwned> FromRequest for Path<T> {
    type Error = actix_web::Error;
    type Future = Ready<Result<Self, actix_web::Error>>;

    fn from_request(request: &HttpRequest, payload: &mut Payload) -> Self::Future {
        // `web::Path` extracts at once (its future is ready).
        let path = web::Path::<T>::from_request(request, payload).into_inner();
        ready(path.map(|path| Path(path.into_inner())))
    }
}

/// The response a problem makes: its status, the JSON body as
/// `application/problem+json`, `Retry-After` when asking again may help,
/// and `Idempotency-Should-Retry` saying whether it can.
fn respond(problem: &Problem) -> HttpResponse {
    respond_with(problem, problem.body())
}

/// As [`respond`], `body` in place of the problem's own.
fn respond_with(problem: &Problem, body: String) -> HttpResponse {
    let mut response = HttpResponse::build(problem.status);
    response.insert_header((header::CONTENT_TYPE, PROBLEM_JSON));
    if let Some(seconds) = problem.retry_after {
        response.insert_header((header::RETRY_AFTER, seconds));
    }
    response.insert_header((SHOULD_RETRY, if problem.should_retry() { "true" } else { "false" }));
    response.body(body)
}

/// A problem under the application's own `type` URI.
impl ResponseError for TypedProblem<StatusCode> {
    fn status_code(&self) -> StatusCode {
        self.problem.status
    }

    fn error_response(&self) -> HttpResponse {
        respond_with(&self.problem, self.body())
    }
}

impl Responder for TypedProblem<StatusCode> {
    type Body = BoxBody;

    fn respond_to(self, _: &HttpRequest) -> HttpResponse {
        self.error_response()
    }
}

impl ResponseError for Problem {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        respond(self)
    }
}

impl Responder for Problem {
    type Body = BoxBody;

    fn respond_to(self, _: &HttpRequest) -> HttpResponse {
        respond(&self)
    }
}

/// The response for an [`Error`]; see the table in the [module docs](super).
impl ResponseError for Error {
    fn status_code(&self) -> StatusCode {
        Problem::from(self).status
    }

    fn error_response(&self) -> HttpResponse {
        respond(&ProblemDetails::answering(self).convert())
    }
}

/// `200 OK`, `application/json`, the stored bytes as they are. A value no
/// call stored yet is written as JSON (one that has no JSON form: the
/// engine's 500 problem, as its call would have answered).
impl<T: Serialize> Responder for StoredJson<T> {
    type Body = BoxBody;

    fn respond_to(self, _: &HttpRequest) -> HttpResponse {
        match self.into_body() {
            Ok(body) => HttpResponse::Ok().content_type("application/json").body(body),
            Err(e) => Error::Serialize(e).error_response(),
        }
    }
}

/// The response for a [`TokenError`]: 403 `IDEMPOTENCY_TOKEN_INVALID` for
/// a refused token, 503 when its store is unavailable.
impl ResponseError for TokenError {
    fn status_code(&self) -> StatusCode {
        Problem::from(self).status
    }

    fn error_response(&self) -> HttpResponse {
        respond(&ProblemDetails::answering_token(self).convert())
    }
}

/// Middleware for `actix_web::middleware::from_fn`: runs the handler inside
/// [`observe_replay`] and adds `Idempotent-Replayed: true` when its
/// `#[idempotent]` call replayed a stored result. A call that executed (or
/// failed) gets no such header.
///
/// ```ignore
/// App::new().wrap(actix_web::middleware::from_fn(idempotency::http::actix::replay_header))
/// ```
pub async fn replay_header(
    request: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let (response, replayed) = observe_replay(next.call(request)).await;
    let mut response = response?;
    if replayed {
        response.headers_mut().insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static(super::header::REPLAYED));
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::KeyError;
    use actix_web::test::TestRequest;

    fn headers_of(response: &HttpResponse) -> (u16, Option<String>, Option<String>) {
        let header = |name: HeaderName| response.headers().get(name).map(|v| v.to_str().unwrap().to_owned());
        (response.status().as_u16(), header(header::CONTENT_TYPE), header(header::RETRY_AFTER))
    }

    #[tokio::test]
    async fn stored_json_answers_its_stored_bytes() {
        let request = TestRequest::default().to_http_request();
        let stored = r#"{ "id": 7, "note": "caf\u00e9" }"#;
        let read: StoredJson<serde_json::Value> = serde_json::from_str(stored).unwrap();
        let response = read.respond_to(&request);
        assert_eq!(headers_of(&response), (200, Some("application/json".into()), None));
        assert_eq!(actix_web::body::to_bytes(response.into_body()).await.unwrap(), stored.as_bytes());
        let response = StoredJson::new(vec![1, 2]).respond_to(&request);
        assert_eq!(actix_web::body::to_bytes(response.into_body()).await.unwrap(), "[1,2]".as_bytes());
        let keyed_by_bytes = std::collections::BTreeMap::from([(vec![1u8], 1)]);
        let response = StoredJson::new(keyed_by_bytes).respond_to(&request);
        assert_eq!(headers_of(&response), (500, Some(PROBLEM_JSON.into()), None));
    }

    #[test]
    fn errors_answer_as_the_core_says() {
        let json_error = || serde_json::from_str::<u8>("x").unwrap_err();
        let cases = [
            (Error::InProgress { biz: "pay", key: "k".into() }, 409, Some("1")),
            (Error::KeyReused { biz: "pay", key: "k".into() }, 422, None),
            (Error::InvalidKey(KeyError::BadChar { ch: ' ', at: 1 }), 400, None),
            (Error::BizNoTooLong { len: 65, max: 64 }, 400, None),
            (Error::InvalidBiz, 500, None),
            (Error::NonFiniteFloat { arg: "amount" }, 422, None),
            (Error::Storage(sqlx::Error::PoolTimedOut), 503, Some("1")),
            (Error::StorageRefused(sqlx::Error::RowNotFound), 500, None),
            (Error::NotMigrated(sqlx::Error::RowNotFound), 500, None),
            (Error::Replay { biz: "pay", key: "k".into(), source: json_error() }, 500, None),
            (Error::Serialize(json_error()), 500, None),
        ];
        for (error, status, retry_after) in cases {
            let core = ProblemDetails::<u16>::from(&error);
            assert_eq!(ResponseError::status_code(&error).as_u16(), status, "{error:?}");
            let response = ResponseError::error_response(&error);
            assert_eq!(
                headers_of(&response),
                (core.status, Some(PROBLEM_JSON.to_owned()), retry_after.map(str::to_owned))
            );
            let should_retry = response.headers().get(SHOULD_RETRY).map(|v| v.to_str().unwrap());
            assert_eq!(should_retry, Some(if retry_after.is_some() { "true" } else { "false" }), "{error:?}");
            assert_eq!(core.status, status);
        }
        use crate::token::Refusal;
        for (error, status) in [
            (TokenError::Refused(Refusal::OtherSubject), 403),
            (TokenError::Unavailable("redis did not answer in time"), 503),
            (TokenError::InvalidSubject { len: 65 }, 400),
        ] {
            let response = ResponseError::error_response(&error);
            let retry_after = (status == 503).then(|| "1".to_owned());
            assert_eq!(headers_of(&response), (status, Some(PROBLEM_JSON.to_owned()), retry_after), "{error:?}");
        }
    }

    fn request(headers: &[(&str, &str)]) -> HttpRequest {
        let mut request = TestRequest::default();
        for &(name, value) in headers {
            request = request.append_header((name, value));
        }
        request.to_http_request()
    }

    #[test]
    fn extractors_answer_as_the_core_says() {
        let key = |headers: &[(&str, &str)]| IdempotencyKey::extract(&request(headers)).into_inner();
        assert_eq!(key(&[("idempotency-key", "\"abcdefgh\"")]).unwrap(), IdempotencyKey("abcdefgh".into()));
        let refused: [&[(&str, &str)]; 3] =
            [&[], &[("idempotency-key", "abc")], &[("idempotency-key", "abcdefgh"), ("idempotency-key", "x")]];
        for headers in refused {
            let core = IdempotencyKey::from_header_values(headers.iter().map(|&(_, v)| v.as_bytes())).unwrap_err();
            assert_eq!(key(headers).unwrap_err(), core.convert::<StatusCode>());
        }

        let token = "AbCdEfGhIjKlMnOpQrStUvWxYz0123-_";
        let either = |headers: &[(&str, &str)]| KeyOrToken::extract(&request(headers)).into_inner();
        assert_eq!(either(&[("idempotency-token", token)]).unwrap(), KeyOrToken::Token(IdempotencyToken(token.into())));
        assert_eq!(either(&[("idempotency-token", "forged")]).unwrap_err().status, StatusCode::FORBIDDEN);
        let both = either(&[("idempotency-token", token), ("idempotency-key", "abcdefgh")]).unwrap_err();
        assert_eq!((both.status, both.code), (StatusCode::BAD_REQUEST, "INVALID_IDEMPOTENCY_KEY"));
        let required = IdempotencyToken::extract(&request(&[])).into_inner().unwrap_err();
        assert_eq!(required, Problem::token_invalid());
    }
}
