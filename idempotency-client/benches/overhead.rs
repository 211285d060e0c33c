//! What the middleware costs a request that needs no retry: the same POST
//! to a loopback server that answers at once, sent by reqwest alone, through
//! reqwest-middleware with no middleware, and through
//! `IdempotencyMiddleware` (a key made, the request copied once, the
//! answer judged, its outcome attached). Sequential requests, each client
//! on its kept-alive connection, the three interleaved; medians and 99th
//! percentiles, printed side by side.
//! No extra round trip is made: each row sends one request per POST.
//!
//! `cargo bench -p idempotency-client --bench overhead` (`IDEM_BENCH_QUICK=1`: fewer requests).

#[path = "../tests/scripted/mod.rs"]
#[allow(dead_code)]
mod scripted;

use std::time::{Duration, Instant};

use idempotency_client::{IdempotencyMiddleware, Outcome, Retries};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};

const BODY: &str = r#"{"amount":1999}"#;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let requests = if std::env::var("IDEM_BENCH_QUICK").is_ok() { 500 } else { 5_000 };
    let warm_up = requests / 10;
    let per_row = requests + warm_up;
    let server = scripted::Server::start(std::iter::repeat_n(scripted::answer(200, &[]), 3 * per_row)).await;
    let url = server.url("/orders/42/pay");

    let plain = reqwest::Client::new();
    let bare = ClientBuilder::new(reqwest::Client::new()).build();
    let keyed = ClientBuilder::new(reqwest::Client::new()).with(IdempotencyMiddleware::new(Retries::default())).build();

    // Interleaved, the first of each round taking turns: the rows meet the
    // same machine, warm caches and all.
    let mut times = [Vec::with_capacity(requests), Vec::with_capacity(requests), Vec::with_capacity(requests)];
    for round in 0..per_row {
        for turn in 0..3 {
            let row = (round + turn) % 3;
            let started = Instant::now();
            let response = match row {
                0 => plain.post(&url).body(BODY).send().await.unwrap(),
                1 => send(&bare, &url, false).await,
                _ => send(&keyed, &url, true).await,
            };
            response.bytes().await.unwrap();
            if round >= warm_up {
                times[row].push(started.elapsed());
            }
        }
    }
    for row in &mut times {
        row.sort();
    }
    let [plain_times, bare_times, keyed_times] = times;

    assert_eq!(server.seen().len(), 3 * per_row, "one request per POST, no retry");
    let keyed_seen = server.seen().iter().filter(|s| s.key().is_some()).count();
    assert_eq!(keyed_seen, per_row, "every POST of the last row keyed, and only those");

    let p50 = percentile(&plain_times, 50);
    println!("{requests} sequential POSTs each, loopback, interleaved, each client on its own connection");
    println!("{:<36} {:>10} {:>10} {:>8}", "", "p50 us", "p99 us", "p50 x");
    for (name, times) in [
        ("reqwest", &plain_times),
        ("reqwest-middleware, no middleware", &bare_times),
        ("IdempotencyMiddleware", &keyed_times),
    ] {
        let (q50, q99) = (percentile(times, 50), percentile(times, 99));
        let ratio = q50.as_secs_f64() / p50.as_secs_f64();
        println!("{name:<36} {:>10.1} {:>10.1} {ratio:>7.2}x", micros(q50), micros(q99));
    }
}

async fn send(client: &ClientWithMiddleware, url: &str, keyed: bool) -> reqwest::Response {
    let response = client.post(url).body(BODY).send().await.unwrap();
    assert_eq!(Outcome::of(&response).is_some(), keyed);
    response
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
