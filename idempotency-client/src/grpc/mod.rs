//! gRPC (feature `grpc`): a tower layer for tonic clients that does what
//! [`IdempotencyMiddleware`](crate::IdempotencyMiddleware) does over HTTP,
//! the key in the `idempotency-key` metadata.
//!
//! ```ignore
//! use idempotency_client::{Retries, grpc::IdempotencyLayer};
//!
//! let channel = tonic::transport::Channel::from_static("http://127.0.0.1:50051").connect().await?;
//! let channel = tower::ServiceBuilder::new().layer(IdempotencyLayer::new(Retries::default())).service(channel);
//! let mut payments = PaymentsClient::new(channel);   // any tonic-build client
//! let reply = payments.pay(PayRequest { order_id: 42, amount: 1999 }).await;
//! let outcome = idempotency_client::grpc::outcome(&reply);   // key, attempts, replayed
//! ```
//!
//! Every call through the layer gets a key when its metadata has none (a
//! caller's own, `request.metadata_mut().insert("idempotency-key", ..)`,
//! is kept, and refused with `INVALID_ARGUMENT` before anything is sent
//! when it breaks the rule). The message is copied as it is sent (up to
//! 4 MiB, gRPC's default largest message), and the call sent again with the
//! same key as the answer says:
//!
//! | the answer | retried? |
//! |---|---|
//! | no answer: the connection refused, cut or reset, a timeout | yes |
//! | `idempotency-should-retry: true` / `false` | as it says |
//! | `UNAVAILABLE` (this crate's servers: `IDEMPOTENCY_KEY_IN_PROGRESS`, `IDEMPOTENCY_STORAGE_UNAVAILABLE`), `ABORTED` | yes, after `grpc-retry-pushback-ms` or `retry-after` when given |
//! | `RESOURCE_EXHAUSTED` with a pushback | yes |
//! | a negative `grpc-retry-pushback-ms` | no (gRPC's "do not retry") |
//! | `FAILED_PRECONDITION` (`IDEMPOTENCY_KEY_REUSED`), `INVALID_ARGUMENT`, `INTERNAL`, every other code | no |
//! | a reply message (its status follows it) | no: it is the answer |
//! | a client stream longer than 4 MiB, or still open when the answer came | never: sent once |
//!
//! What the caller learns: the answer, a reply or a `Status`, carries the
//! metadata `idem-client-key`, `idem-client-attempts` and
//! `idem-client-stop`, which [`outcome`] reads with the server's
//! `idempotent-replayed` (gRPC's errors carry metadata only). A call that
//! got no answer at all is `UNAVAILABLE` (a status made on this side, by
//! an interceptor say, stays as it is), or `DEADLINE_EXCEEDED` for an
//! attempt abandoned by
//! [`Retries::attempt_timeout`](crate::Retries::attempt_timeout) or
//! [`Retries::total`](crate::Retries::total), with the same metadata. Per
//! call, other bounds go in the request's extensions
//! (`request.extensions_mut().insert(Retries::none())`).

mod metadata;
mod tee;

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::HeaderMap;
use tonic::Status;
use tonic::body::Body;
use tonic::metadata::MetadataMap;
use tower_service::Service;

use crate::attempts::{self, Answer, OnRetry, Retrying, Transport};
use crate::header::IDEMPOTENCY_KEY;
use crate::outcome::Outcome;
use crate::retries::Retries;
use crate::verdict::{self, Verdict};
use crate::{InvalidKey, key};

/// What a service's failure is passed on as.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The layer: wraps a channel (or any service tonic clients call) in
/// [`Idempotent`].
#[derive(Clone)]
pub struct IdempotencyLayer {
    retries: Retries,
    on_retry: Option<OnRetry>,
}

impl IdempotencyLayer {
    /// Keys every call and retries it within `retries`.
    pub fn new(retries: Retries) -> Self {
        IdempotencyLayer { retries, on_retry: None }
    }

    /// Tells `hook` of every retry before its wait (`answered` is the gRPC
    /// code), as [`IdempotencyMiddleware::on_retry`](crate::IdempotencyMiddleware::on_retry) does.
    pub fn on_retry(mut self, hook: impl Fn(&Retrying<'_>) + Send + Sync + 'static) -> Self {
        self.on_retry = Some(Arc::new(hook));
        self
    }
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer").field("retries", &self.retries).finish()
    }
}

impl<S> tower_layer::Layer<S> for IdempotencyLayer {
    type Service = Idempotent<S>;

    fn layer(&self, inner: S) -> Idempotent<S> {
        Idempotent { inner, retries: self.retries, on_retry: self.on_retry.clone() }
    }
}

/// A service (a tonic `Channel`, say) whose calls are keyed and retried;
/// made by [`IdempotencyLayer`].
#[derive(Clone)]
pub struct Idempotent<S> {
    inner: S,
    retries: Retries,
    on_retry: Option<OnRetry>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for Idempotent<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotent").field("inner", &self.inner).field("retries", &self.retries).finish()
    }
}

impl<S, B> Service<http::Request<Body>> for Idempotent<S>
where
    S: Service<http::Request<Body>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Send + 'static,
{
    type Response = http::Response<B>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<B>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        // The service made ready serves this call; a clone takes its place.
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        let retries = request.extensions().get::<Retries>().copied().unwrap_or(self.retries);
        Box::pin(call(ready, retries, self.on_retry.clone(), request))
    }
}

async fn call<S, B>(
    service: S,
    retries: Retries,
    on_retry: Option<OnRetry>,
    request: http::Request<Body>,
) -> Result<http::Response<B>, BoxError>
where
    S: Service<http::Request<Body>, Response = http::Response<B>> + Send,
    S::Future: Send,
    S::Error: Into<BoxError>,
{
    let (mut head, body) = request.into_parts();
    let key = match key::of_headers(&head.headers) {
        Ok(Some(key)) => key,
        Ok(None) => {
            let key = key::new_key();
            head.headers.insert(IDEMPOTENCY_KEY, key.parse().expect("a UUID is a header value"));
            key
        }
        Err(invalid) => return Err(Box::new(refusal(&invalid))),
    };
    let copy = tee::Shared::default();
    let first = tee::prepare(body, &copy);
    let mut grpc = Grpc { service, head, first: Some(first), copy };
    let (answer, tally) = attempts::run(&retries, &mut grpc, &key, on_retry.as_ref()).await;
    match answer {
        Answer::Response(mut response) => {
            metadata::write(response.headers_mut(), &key, tally);
            Ok(response)
        }
        Answer::Failed(error) => {
            let mut status = no_answer(error, tally.attempts);
            metadata::write(status.metadata_mut().as_mut(), &key, tally);
            Err(Box::new(status))
        }
        Answer::TimedOut(after) => {
            let message =
                format!("no answer within {} ms; the call may have run, send it again with its key", after.as_millis());
            let mut status = Status::deadline_exceeded(message);
            metadata::write(status.metadata_mut().as_mut(), &key, tally);
            Err(Box::new(status))
        }
    }
}

/// The last failure as the caller's status: a status made on this side
/// as it is; anything else (refused, reset, closed before the reply)
/// `UNAVAILABLE`, gRPC's code for "the server could not be reached", which
/// tonic would answer for some of them only (`CANCELLED` for a connection
/// closed under the call, say).
fn no_answer(error: BoxError, attempts: u32) -> Status {
    match error.downcast::<Status>() {
        Ok(status) => *status,
        Err(error) => Status::unavailable(format!(
            "no reply after {attempts} attempt(s); the call may have run, send it again with its key: {error}"
        )),
    }
}

/// A caller's key the server would refuse, answered as the server would
/// (`INVALID_ARGUMENT`, `idem-code: INVALID_IDEMPOTENCY_KEY`), nothing sent.
fn refusal(invalid: &InvalidKey) -> Status {
    let mut status = Status::invalid_argument(format!("INVALID_IDEMPOTENCY_KEY: {invalid}"));
    status.metadata_mut().insert("idem-code", tonic::metadata::MetadataValue::from_static("INVALID_IDEMPOTENCY_KEY"));
    status
}

/// How a call through the layer went, from its answer: a reply's metadata
/// or a `Status`'s. `None` for an answer that did not pass the layer.
pub fn outcome<T>(answer: &Result<tonic::Response<T>, Status>) -> Option<Outcome> {
    let metadata = match answer {
        Ok(response) => response.metadata(),
        Err(status) => status.metadata(),
    };
    outcome_of(metadata)
}

/// [`outcome`] from the metadata alone.
pub fn outcome_of(metadata: &MetadataMap) -> Option<Outcome> {
    metadata::read(metadata.as_ref())
}

/// One call's attempts through the inner service.
struct Grpc<S> {
    service: S,
    head: http::request::Parts,
    /// The body as the caller made it, for the first attempt.
    first: Option<Body>,
    copy: tee::Shared,
}

impl<S, B> Transport for Grpc<S>
where
    S: Service<http::Request<Body>, Response = http::Response<B>> + Send,
    S::Future: Send,
    S::Error: Into<BoxError>,
{
    type Response = http::Response<B>;
    type Error = BoxError;

    fn attempt(&mut self) -> impl Future<Output = Result<http::Response<B>, BoxError>> + Send + '_ {
        let body = self.first.take().or_else(|| tee::lock(&self.copy).again()).unwrap_or_default();
        let request = http::Request::from_parts(self.head.clone(), body);
        let service = &mut self.service;
        async move {
            poll_fn(|cx| service.poll_ready(cx)).await.map_err(Into::into)?;
            service.call(request).await.map_err(Into::into)
        }
    }

    fn can_resend(&self) -> bool {
        tee::lock(&self.copy).again().is_some()
    }

    fn judge(&self, response: &http::Response<B>) -> Verdict {
        verdict::of_grpc(response.headers())
    }

    fn answered(&self, response: &http::Response<B>) -> Option<u16> {
        response.headers().get("grpc-status")?.to_str().ok()?.parse().ok()
    }

    fn judge_error(&self, error: &BoxError) -> Verdict {
        // A status made on this side (an interceptor's, say) is judged as an
        // answer; any other failure left the call unanswered.
        match error.downcast_ref::<Status>() {
            Some(status) => {
                let mut headers = HeaderMap::new();
                let _ = status.add_header(&mut headers);
                verdict::of_grpc(&headers)
            }
            None => Verdict::Retry { after: None },
        }
    }

    fn discard(&mut self, response: http::Response<B>) -> impl Future<Output = ()> + Send + '_ {
        drop(response);
        std::future::ready(())
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::*;

    #[test]
    fn a_refused_key_answers_as_the_server_would() {
        let invalid = crate::check_key("short").unwrap_err();
        let status = refusal(&invalid);
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.metadata().get("idem-code").unwrap(), "INVALID_IDEMPOTENCY_KEY");
        assert!(status.message().starts_with("INVALID_IDEMPOTENCY_KEY: the Idempotency-Key is invalid"));
        let mut headers = HeaderMap::new();
        status.add_header(&mut headers).unwrap();
        assert_eq!(Status::from_header_map(&headers).map(|s| s.code()), Some(Code::InvalidArgument));
        assert_eq!(verdict::of_grpc(&headers), Verdict::Final);
    }
}
