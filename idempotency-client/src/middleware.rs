//! The `reqwest-middleware` middleware: a key per logical request, kept on
//! every attempt, and the attempts of [`attempts::run`](crate::attempts).

use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

use http::{Extensions, HeaderValue, Method};
use reqwest::{Request, Response};
use reqwest_middleware::{Error, Middleware, Next};

use crate::attempts::{self, Answer, OnRetry, Retrying, Stop, Transport};
use crate::header::IDEMPOTENCY_KEY;
use crate::key;
use crate::outcome::Outcome;
use crate::retries::Retries;
use crate::verdict::{self, Verdict};

/// Makes writes safe to retry: every request with an unsafe method (POST
/// and PATCH; PUT and DELETE with [`key_method`](Self::key_method)) gets an
/// `Idempotency-Key` when it has none, made once per logical request and
/// sent again on each of its retries; a request that carries one (any
/// method) keeps it. Such requests are retried as the server's answer says
/// ([the retry table](crate#what-is-retried)), within [`Retries`]. Other
/// requests pass through untouched.
///
/// ```no_run
/// use idempotency_client::{IdempotencyMiddleware, Outcome, Retries};
///
/// # async fn pay() -> Result<(), Box<dyn std::error::Error>> {
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(IdempotencyMiddleware::new(Retries::default()))
///     .build();
/// let response = client.post("http://127.0.0.1:3000/orders/42/pay").body(r#"{"amount":1999}"#).send().await?;
/// let outcome = Outcome::of(&response).expect("a keyed request");
/// println!("{} after {} attempt(s), replayed: {}", response.status(), outcome.attempts, outcome.replayed);
/// # Ok(()) }
/// ```
///
/// Per request: a caller's own key goes in the header
/// (`.header("Idempotency-Key", key)`), other bounds in an extension
/// (`.with_extension(Retries::none())`). A failure to get any answer comes
/// back as [`GaveUp`], which names the key, so the request can be sent again
/// later and answered with what it did.
#[derive(Clone)]
pub struct IdempotencyMiddleware {
    retries: Retries,
    methods: Vec<Method>,
    on_retry: Option<OnRetry>,
}

impl std::fmt::Debug for IdempotencyMiddleware {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyMiddleware").field("retries", &self.retries).field("methods", &self.methods).finish()
    }
}

impl IdempotencyMiddleware {
    /// Keys POST and PATCH requests and retries them within `retries`.
    pub fn new(retries: Retries) -> Self {
        IdempotencyMiddleware { retries, methods: vec![Method::POST, Method::PATCH], on_retry: None }
    }

    /// Tells `hook` of every retry before its wait: the key, the attempt
    /// retried, its status (or none) and the wait. To log retries or count
    /// them; it runs on the request's task, so it must not block.
    pub fn on_retry(mut self, hook: impl Fn(&Retrying<'_>) + Send + Sync + 'static) -> Self {
        self.on_retry = Some(std::sync::Arc::new(hook));
        self
    }

    /// Keys requests of `method` too (`Method::PUT`, `Method::DELETE`: a
    /// server that makes them idempotent by key).
    pub fn key_method(mut self, method: Method) -> Self {
        if !self.methods.contains(&method) {
            self.methods.push(method);
        }
        self
    }
}

/// A keyed request that got no answer: every attempt failed to connect,
/// was cut or timed out, or failed in a way not worth repeating. The
/// request may have run: send it again with [`key`](Self::key) (say, after
/// a restart) to be answered with what it did. Comes back as
/// `reqwest_middleware::Error::Middleware`; [`GaveUp::of`] finds it.
#[derive(Debug, thiserror::Error)]
#[error(
    "gave up after {attempts} attempt(s) ({stop}); the request may have run, send it again with its Idempotency-Key to learn its outcome: {last}"
)]
#[non_exhaustive]
pub struct GaveUp {
    /// The `Idempotency-Key` every attempt carried.
    pub key: String,
    /// Attempts made.
    pub attempts: u32,
    /// Why no further attempt was made.
    pub stop: Stop,
    /// What the last attempt met.
    #[source]
    pub last: Failure,
}

impl GaveUp {
    /// The `GaveUp` in a middleware chain's error, if it is one.
    pub fn of(error: &Error) -> Option<&GaveUp> {
        match error {
            Error::Middleware(error) => error.downcast_ref::<GaveUp>(),
            Error::Reqwest(_) => None,
        }
    }
}

/// What an attempt that got no answer met.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Failure {
    /// The client's error (connect, send, a timeout of the client's own)
    /// or a later middleware's.
    #[error(transparent)]
    Transport(Error),
    /// Abandoned by [`Retries::attempt_timeout`] or [`Retries::total`]
    /// after this long.
    #[error("no answer within {} ms", .0.as_millis())]
    TimedOut(Duration),
}

/// The key this middleware made for a logical request, kept in its
/// extensions: a retry layer around this one sends the request again
/// through it, with the same extensions, and must meet the same key.
/// Matched by what the request is, so an extensions map reused for
/// another request never lends it its key.
#[derive(Clone)]
struct MadeKey {
    key: String,
    request: u64,
}

/// What a request is, for [`MadeKey`]: method, URL and body (a stream
/// counts as no body).
fn identity(request: &Request) -> u64 {
    let mut hasher = DefaultHasher::new();
    request.method().hash(&mut hasher);
    request.url().as_str().hash(&mut hasher);
    request.body().and_then(reqwest::Body::as_bytes).hash(&mut hasher);
    hasher.finish()
}

#[async_trait::async_trait]
impl Middleware for IdempotencyMiddleware {
    async fn handle(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let own = key::of_headers(request.headers()).map_err(Error::middleware)?;
        let key = match own {
            Some(key) => key,
            None if !self.methods.contains(request.method()) => return next.run(request, extensions).await,
            None => {
                let key = made_key(&request, extensions);
                let value = HeaderValue::from_str(&key).expect("a UUID is a header value");
                request.headers_mut().insert(IDEMPOTENCY_KEY, value);
                key
            }
        };
        let retries = extensions.get::<Retries>().copied().unwrap_or(self.retries);
        let mut http = Http { request: Some(request), resendable: true, next, extensions };
        let (answer, tally) = attempts::run(&retries, &mut http, &key, self.on_retry.as_ref()).await;
        let gave_up =
            |last| Error::middleware(GaveUp { key: key.clone(), attempts: tally.attempts, stop: tally.stop, last });
        match answer {
            Answer::Response(mut response) => {
                let outcome = Outcome::new(key.clone(), tally, response.headers());
                response.extensions_mut().insert(outcome);
                Ok(response)
            }
            Answer::Failed(error) => Err(gave_up(Failure::Transport(error))),
            Answer::TimedOut(after) => Err(gave_up(Failure::TimedOut(after))),
        }
    }
}

/// The key made for this logical request before, or a new one.
fn made_key(request: &Request, extensions: &mut Extensions) -> String {
    let identity = identity(request);
    if let Some(made) = extensions.get::<MadeKey>().filter(|made| made.request == identity) {
        return made.key.clone();
    }
    let key = key::new_key();
    extensions.insert(MadeKey { key: key.clone(), request: identity });
    key
}

/// One logical request's attempts through the rest of the chain.
struct Http<'a> {
    /// The request as first built; `None` once a body that cannot be copied was sent.
    request: Option<Request>,
    resendable: bool,
    next: Next<'a>,
    extensions: &'a mut Extensions,
}

/// The most of a retried answer's body read, so its connection can serve
/// the next attempt; a larger one closes it.
const DRAIN_LIMIT: usize = 64 * 1024;

impl Transport for Http<'_> {
    type Response = Response;
    type Error = Error;

    fn attempt(&mut self) -> impl Future<Output = Result<Response, Error>> + Send + '_ {
        let request = self.request.as_ref().and_then(Request::try_clone);
        let request = match request {
            Some(copy) => Some(copy),
            None => {
                self.resendable = false;
                self.request.take()
            }
        };
        let next = self.next.clone();
        let extensions = &mut *self.extensions;
        async move {
            match request {
                Some(request) => next.run(request, extensions).await,
                None => Err(Error::middleware(AlreadySent)),
            }
        }
    }

    fn can_resend(&self) -> bool {
        self.resendable
    }

    fn judge(&self, response: &Response) -> Verdict {
        verdict::of_http(response.status(), response.headers())
    }

    fn answered(&self, response: &Response) -> Option<u16> {
        Some(response.status().as_u16())
    }

    fn judge_error(&self, error: &Error) -> Verdict {
        let retry = match error {
            // Never sent, sent and cut, or no answer in time: with the key, asking again is safe.
            Error::Reqwest(e) => e.is_connect() || e.is_request() || e.is_timeout(),
            Error::Middleware(_) => false,
        };
        if retry { Verdict::Retry { after: None } } else { Verdict::Final }
    }

    async fn discard(&mut self, mut response: Response) {
        let mut read = 0;
        while let Ok(Some(chunk)) = response.chunk().await {
            read += chunk.len();
            if read > DRAIN_LIMIT {
                break;
            }
        }
    }
}

/// The loop never asks for an attempt past `can_resend() == false`.
#[derive(Debug, thiserror::Error)]
#[error("the request was sent once already and its body cannot be sent again")]
struct AlreadySent;
