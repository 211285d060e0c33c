//! The middleware against a scripted HTTP server (`scripted/`): what it
//! sends on each attempt, which answers it asks again, how long it waits,
//! and what the caller is told. The same cases against a real server of
//! the `idempotency` crate are the workspace's `tests/client_http.rs`.

mod scripted;

use std::time::Duration;

use idempotency_client::{Failure, GaveUp, IdempotencyMiddleware, Outcome, Retries, Stop, check_key, new_key};
use reqwest::Method;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use scripted::{Server, Step, answer};

/// No waits between attempts unless the server asks for one.
fn quick() -> Retries {
    Retries::default().backoff(Duration::ZERO, Duration::ZERO)
}

fn client(retries: Retries) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new()).with(IdempotencyMiddleware::new(retries)).build()
}

const NOW: (&str, &str) = ("retry-after", "0");

/// The keys the attempts carried, in order.
fn keys(server: &Server) -> Vec<String> {
    server.seen().iter().map(|s| s.key().expect("every attempt keyed").to_owned()).collect()
}

#[tokio::test]
async fn one_key_on_every_attempt_of_one_request() {
    let server =
        Server::start([Step::Cut, answer(503, &[NOW]), answer(409, &[NOW]), answer(502, &[]), answer(200, &[])]).await;
    let response = client(quick()).post(server.url("/pay")).body("{\"amount\":1999}").send().await.expect("answered");
    assert_eq!(response.status(), 200);
    let outcome = Outcome::of(&response).expect("keyed").clone();
    let keys = keys(&server);
    assert_eq!(keys.len(), 5, "a cut, 503, 409 with Retry-After, 502, then 200");
    assert!(keys.iter().all(|k| *k == outcome.key), "{keys:?}");
    assert_eq!(check_key(&outcome.key), Ok(outcome.key.as_str()));
    assert_eq!((outcome.attempts, outcome.replayed, outcome.stop), (5, false, Stop::Final));
    assert!(server.seen().iter().all(|s| s.body == b"{\"amount\":1999}" && s.method == "POST"));
}

#[tokio::test]
async fn logical_requests_never_share_a_key() {
    const REQUESTS: usize = 20;
    let server = Server::start(std::iter::repeat_n(answer(200, &[]), REQUESTS)).await;
    let client = client(quick());
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(REQUESTS));
    let sends: Vec<_> = (0..REQUESTS)
        .map(|_| {
            let (client, barrier, url) = (client.clone(), barrier.clone(), server.url("/pay"));
            // The same body to the same URL: still one logical request each.
            tokio::spawn(async move {
                barrier.wait().await;
                let response = client.post(url).body("same").send().await.expect("answered");
                Outcome::of(&response).expect("keyed").key.clone()
            })
        })
        .collect();
    let mut told = std::collections::HashSet::new();
    for send in sends {
        told.insert(send.await.unwrap());
    }
    let sent: std::collections::HashSet<String> = keys(&server).into_iter().collect();
    assert_eq!((told.len(), sent), (REQUESTS, told));
}

#[tokio::test]
async fn refusals_are_handed_back_at_once() {
    let refusals = [
        answer(400, &[("idempotency-should-retry", "false")]),
        answer(422, &[("idempotency-should-retry", "false")]),
        answer(500, &[("idempotency-should-retry", "false")]),
        answer(500, &[]),
        answer(404, &[]),
        answer(409, &[]),
        answer(503, &[("idempotency-should-retry", "false")]),
    ];
    let expected: Vec<u16> = refusals.iter().map(|s| if let Step::Answer(n, ..) = s { *n } else { 0 }).collect();
    let server = Server::start(refusals).await;
    let client = client(quick());
    for (i, status) in expected.iter().enumerate() {
        let response = client.post(server.url("/pay")).send().await.expect("answered");
        assert_eq!(response.status(), *status);
        let outcome = Outcome::of(&response).expect("keyed");
        assert_eq!((outcome.attempts, outcome.stop), (1, Stop::Final), "{status}");
        assert_eq!(server.seen().len(), i + 1, "{status} was not asked again");
    }
}

#[tokio::test]
async fn retry_after_is_waited_out() {
    let server = Server::start([answer(503, &[("retry-after", "1")]), answer(200, &[])]).await;
    let response = client(quick()).post(server.url("/pay")).send().await.expect("answered");
    assert_eq!(Outcome::of(&response).unwrap().attempts, 2);
    let gap = server.seen()[1].at - server.answered()[0];
    assert!(gap >= Duration::from_secs(1), "asked again {gap:?} after a Retry-After of 1 s");
}

#[tokio::test]
async fn a_retry_after_past_the_bound_is_handed_back() {
    let server = Server::start([answer(503, &[("retry-after", "3600")])]).await;
    let response = client(quick()).post(server.url("/pay")).send().await.expect("answered");
    assert_eq!(response.status(), 503);
    assert_eq!(Outcome::of(&response).unwrap().stop, Stop::RetryAfterTooLong(Duration::from_secs(3600)));
    assert_eq!(server.seen().len(), 1);
}

#[tokio::test]
async fn attempts_are_bounded_by_count() {
    let server = Server::start(std::iter::repeat_n(answer(503, &[]), 3)).await;
    let response = client(quick().max_attempts(3)).post(server.url("/pay")).send().await.expect("answered");
    assert_eq!(response.status(), 503, "the last answer, handed back");
    let outcome = Outcome::of(&response).unwrap();
    assert_eq!((outcome.attempts, outcome.stop), (3, Stop::Attempts));
    assert_eq!(server.seen().len(), 3);
}

#[tokio::test]
async fn attempts_are_bounded_by_time() {
    let server = Server::start([Step::Hang]).await;
    let started = tokio::time::Instant::now();
    let error = client(quick().total(Duration::from_secs(2))).post(server.url("/pay")).send().await.unwrap_err();
    let elapsed = started.elapsed();
    let gave_up = GaveUp::of(&error).expect("a GaveUp");
    assert_eq!((gave_up.attempts, gave_up.stop), (1, Stop::Time));
    assert!(matches!(gave_up.last, Failure::TimedOut(t) if t == Duration::from_secs(2)), "{gave_up}");
    assert!(elapsed >= Duration::from_secs(2) && elapsed < Duration::from_secs(30), "{elapsed:?}");
    assert_eq!(gave_up.key, keys(&server)[0]);
}

#[tokio::test]
async fn a_hung_attempt_is_abandoned_and_sent_again() {
    let server = Server::start([Step::Hang, answer(200, &[("idempotent-replayed", "true")])]).await;
    let retries = quick().attempt_timeout(Duration::from_secs(1));
    let response = client(retries).post(server.url("/pay")).send().await.expect("answered");
    let outcome = Outcome::of(&response).unwrap();
    assert_eq!((outcome.attempts, outcome.replayed), (2, true));
    let keys = keys(&server);
    assert_eq!(keys[0], keys[1]);
}

#[tokio::test]
async fn unanswered_requests_give_up_with_their_key() {
    // Nobody listens: refused every time.
    let port = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().port();
    let error = client(quick().max_attempts(3)).post(format!("http://127.0.0.1:{port}/pay")).send().await.unwrap_err();
    let gave_up = GaveUp::of(&error).expect("a GaveUp");
    assert_eq!((gave_up.attempts, gave_up.stop), (3, Stop::Attempts));
    assert!(matches!(&gave_up.last, Failure::Transport(e) if e.is_connect()), "{gave_up}");
    assert_eq!(check_key(&gave_up.key), Ok(gave_up.key.as_str()));
    assert!(error.to_string().contains("gave up after 3 attempt(s) (no attempts left)"), "{error}");
}

#[tokio::test]
async fn a_stream_body_is_sent_once_and_the_caller_told_why() {
    let server = Server::start([answer(503, &[]), Step::Cut]).await;
    let client = client(quick());
    let stream = || {
        let chunks: Vec<Result<&'static str, std::io::Error>> = vec![Ok("{\"amount\":"), Ok("1999}")];
        reqwest::Body::wrap_stream(futures_util::stream::iter(chunks))
    };
    let response = client.post(server.url("/pay")).body(stream()).send().await.expect("answered");
    assert_eq!(response.status(), 503);
    assert_eq!(Outcome::of(&response).unwrap().stop, Stop::NotResendable);
    let error = client.post(server.url("/pay")).body(stream()).send().await.unwrap_err();
    let gave_up = GaveUp::of(&error).expect("a GaveUp");
    assert_eq!((gave_up.attempts, gave_up.stop), (1, Stop::NotResendable));
    let seen = server.seen();
    assert_eq!(seen.len(), 2, "each sent once");
    assert_eq!(seen[0].body, b"{\"amount\":1999}");
    assert_ne!(seen[0].key(), seen[1].key());
}

#[tokio::test]
async fn a_callers_key_is_kept_and_a_bad_one_refused_before_sending() {
    let server = Server::start([Step::Cut, answer(200, &[]), answer(200, &[])]).await;
    let client = client(quick());
    let key = new_key();
    let response = client.post(server.url("/pay")).header("Idempotency-Key", &key).send().await.unwrap();
    assert_eq!(Outcome::of(&response).unwrap().key, key);
    let quoted = client.post(server.url("/pay")).header("Idempotency-Key", "\"order-42-pay\"").send().await.unwrap();
    assert_eq!(Outcome::of(&quoted).unwrap().key, "order-42-pay");
    assert_eq!(keys(&server), [key.clone(), key, "\"order-42-pay\"".into()], "sent as the caller wrote it");
    for bad in ["short", "order 42 pay", "\"order-42-pay"] {
        let error = client.post(server.url("/pay")).header("Idempotency-Key", bad).send().await.unwrap_err();
        let reqwest_middleware::Error::Middleware(error) = error else { panic!("{error}") };
        let invalid = error.downcast_ref::<idempotency_client::InvalidKey>().expect("InvalidKey");
        assert!(invalid.to_string().ends_with("nothing was sent"), "{invalid}");
    }
    assert_eq!(server.seen().len(), 3, "nothing sent for the bad keys");
}

#[tokio::test]
async fn safe_methods_pass_through_and_put_is_keyed_on_request() {
    let server = Server::start([answer(503, &[]), answer(503, &[]), Step::Cut, answer(200, &[])]).await;
    let response = client(quick()).get(server.url("/orders/42")).send().await.unwrap();
    assert!((response.status(), Outcome::of(&response)) == (reqwest::StatusCode::SERVICE_UNAVAILABLE, None));
    let response = client(quick()).put(server.url("/orders/42")).send().await.unwrap();
    assert!(Outcome::of(&response).is_none(), "PUT is not keyed by default");
    let keyed = ClientBuilder::new(reqwest::Client::new())
        .with(IdempotencyMiddleware::new(quick()).key_method(Method::PUT))
        .build();
    let response = keyed.put(server.url("/orders/42")).send().await.unwrap();
    assert_eq!(Outcome::of(&response).unwrap().attempts, 2);
    let seen = server.seen();
    assert_eq!((seen[0].key(), seen[1].key()), (None, None));
    assert_eq!(seen[2].key(), seen[3].key());
}

#[tokio::test]
async fn bounds_per_request_from_its_extensions() {
    let server = Server::start([answer(503, &[]), answer(503, &[])]).await;
    let response = client(quick()).post(server.url("/pay")).with_extension(Retries::none()).send().await.unwrap();
    assert_eq!(Outcome::of(&response).unwrap().stop, Stop::Attempts);
    assert_eq!(server.seen().len(), 1);
}

/// reqwest-retry's loop around or inside this middleware: every attempt of
/// one request carries one key, and the next request another.
#[tokio::test]
async fn reqwest_retry_keeps_the_key_in_either_order() {
    use reqwest_retry::RetryTransientMiddleware;
    use reqwest_retry::policies::ExponentialBackoff;
    let policy = ExponentialBackoff::builder().retry_bounds(Duration::ZERO, Duration::ZERO).build_with_max_retries(2);
    let ours = || IdempotencyMiddleware::new(Retries::none());
    let outside = ClientBuilder::new(reqwest::Client::new())
        .with(ours())
        .with(RetryTransientMiddleware::new_with_policy(policy))
        .build();
    let inside = ClientBuilder::new(reqwest::Client::new())
        .with(RetryTransientMiddleware::new_with_policy(policy))
        .with(ours())
        .build();
    for client in [outside, inside] {
        let server = Server::start([answer(503, &[]), answer(503, &[]), answer(200, &[]), answer(200, &[])]).await;
        for _ in 0..2 {
            let response = client.post(server.url("/pay")).body("same").send().await.unwrap();
            assert_eq!(response.status(), 200);
        }
        let keys = keys(&server);
        assert_eq!(keys.len(), 4);
        assert!(keys[0] == keys[1] && keys[1] == keys[2], "one request's three attempts: {keys:?}");
        assert_ne!(keys[2], keys[3], "the next request");
    }
}
