//! The floor of an HTTP replay (`benches/http/replay.sh`): a plain axum
//! handler for `POST /orders/{id}/pay` that reads its JSON body and answers
//! one Redis `HGET`'s JSON, no idempotency code at all. What the example's
//! replay is measured against.
//!
//! Environment: `IDEM_HTTP_ADDR` (default `127.0.0.1:3001`), `IDEM_REDIS_URL`
//! (default `redis://127.0.0.1:6379`).

use axum::extract::{Path, State};
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;

/// Where the answer lives: one field of one hash, as a replay's result.
const HASH: &str = "idem-bench:http-floor";
/// A result as large as the example's payment answer.
const ANSWER: &str = r#"{"payment_id":1,"order_id":42,"amount":1999,"status":"PAID","paid_by":"alice"}"#;

#[derive(Deserialize)]
struct PayReq {
    #[allow(dead_code)] // parsed as the example's handler parses it
    amount: i64,
}

async fn pay(
    State(redis): State<redis::aio::ConnectionManager>,
    Path(order_id): Path<i64>,
    Json(_req): Json<PayReq>,
) -> impl IntoResponse {
    let mut conn = redis;
    let found: Option<String> = redis::cmd("HGET").arg(HASH).arg(order_id).query_async(&mut conn).await.ok().flatten();
    ([(header::CONTENT_TYPE, "application/json")], found.unwrap_or_default())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("IDEM_HTTP_ADDR").unwrap_or_else(|_| "127.0.0.1:3001".into());
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let redis = redis::aio::ConnectionManager::new(redis::Client::open(url)?).await?;
    let mut conn = redis.clone();
    for order_id in 1..=100 {
        let () = redis::cmd("HSET").arg(HASH).arg(order_id).arg(ANSWER).query_async(&mut conn).await?;
    }
    let router = Router::new().route("/orders/{id}/pay", post(pay)).with_state(redis);
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router).await?;
    Ok(())
}
