//! A payment provider on loopback, as payment providers behave: `POST
//! /charges` with an `Idempotency-Key` header makes one charge per key and
//! answers a repeated key with the first answer (`Idempotent-Replayed:
//! true`), a key still in flight with 409. It counts charges and requests
//! per key and per order, and can be told to decline an order, to fail the
//! next requests (503, no charge) or to answer slowly.
//!
//! The client side ([`ProviderClient`]) is what the child processes use.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

/// A charge request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChargeRequest {
    pub amount: i64,
    /// The merchant's reference: what reconciliation counts charges by.
    pub order: String,
}

/// The provider's answer, as the caller records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderCharge {
    pub id: String,
    pub amount: i64,
    pub declined: bool,
}

#[derive(Default)]
struct Ledger {
    /// Answers by idempotency key; `None` while the first request runs.
    answers: HashMap<String, Option<ProviderCharge>>,
    charges_by_order: HashMap<String, u32>,
    requests_by_order: HashMap<String, u32>,
    declined_orders: Vec<String>,
    slow_orders: HashMap<String, Duration>,
    fail_next: HashMap<String, u32>,
    next_id: u64,
}

/// The running provider: its address and its books.
#[derive(Clone)]
pub struct Provider {
    pub addr: SocketAddr,
    ledger: Arc<Mutex<Ledger>>,
}

impl Provider {
    /// Serves on a free loopback port, on the current runtime.
    pub async fn start() -> Provider {
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let app = axum::Router::new().route("/charges", axum::routing::post(charge)).with_state(ledger.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the provider");
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.expect("provider serves") });
        Provider { addr, ledger }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Charges actually made for `order` (a replayed key makes none).
    pub fn charges(&self, order: &str) -> u32 {
        self.ledger.lock().unwrap().charges_by_order.get(order).copied().unwrap_or(0)
    }

    /// Requests received for `order`, replays and refusals included.
    pub fn requests(&self, order: &str) -> u32 {
        self.ledger.lock().unwrap().requests_by_order.get(order).copied().unwrap_or(0)
    }

    pub fn decline(&self, order: &str) {
        self.ledger.lock().unwrap().declined_orders.push(order.to_owned());
    }

    /// Requests for `order` answer only after `delay` (the charge made first).
    pub fn slow(&self, order: &str, delay: Duration) {
        self.ledger.lock().unwrap().slow_orders.insert(order.to_owned(), delay);
    }

    /// The next `n` requests for `order` fail with 503 before charging.
    pub fn fail_next(&self, order: &str, n: u32) {
        self.ledger.lock().unwrap().fail_next.insert(order.to_owned(), n);
    }
}

async fn charge(
    State(ledger): State<Arc<Mutex<Ledger>>>,
    headers: HeaderMap,
    Json(request): Json<ChargeRequest>,
) -> Response {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned) else {
        return (StatusCode::BAD_REQUEST, "Idempotency-Key required").into_response();
    };
    let (charge, delay) = {
        let mut ledger = ledger.lock().unwrap();
        *ledger.requests_by_order.entry(request.order.clone()).or_default() += 1;
        match ledger.answers.get(&key) {
            Some(Some(answer)) => {
                let mut response = Json(answer.clone()).into_response();
                response.headers_mut().insert("idempotent-replayed", "true".parse().unwrap());
                return response;
            }
            Some(None) => return (StatusCode::CONFLICT, "a request with this key is in flight").into_response(),
            None => {}
        }
        if let Some(n) = ledger.fail_next.get_mut(&request.order).filter(|n| **n > 0) {
            *n -= 1;
            return (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response();
        }
        ledger.next_id += 1;
        let declined = ledger.declined_orders.contains(&request.order);
        let charge = ProviderCharge { id: format!("ch_{}", ledger.next_id), amount: request.amount, declined };
        if !declined {
            *ledger.charges_by_order.entry(request.order.clone()).or_default() += 1;
        }
        ledger.answers.insert(key.clone(), None);
        (charge, ledger.slow_orders.get(&request.order).copied())
    };
    if let Some(delay) = delay {
        tokio::time::sleep(delay).await;
    }
    ledger.lock().unwrap().answers.insert(key, Some(charge.clone()));
    Json(charge).into_response()
}

/// The calling side: one charge request with an idempotency key.
pub struct ProviderClient {
    url: String,
    http: reqwest::Client,
}

impl ProviderClient {
    pub fn new(url: String) -> Self {
        ProviderClient { url, http: reqwest::Client::new() }
    }

    /// `Err` for anything but an answer: refused, in flight, unreachable.
    pub async fn charge(&self, idempotency_key: &str, order: &str, amount: i64) -> Result<ProviderCharge, String> {
        let body = serde_json::to_string(&ChargeRequest { amount, order: order.to_owned() }).unwrap();
        let response = self
            .http
            .post(format!("{}/charges", self.url))
            .header("idempotency-key", idempotency_key)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| format!("provider unreachable: {e}"))?;
        let status = response.status();
        let bytes = response.bytes().await.map_err(|e| format!("provider answer lost: {e}"))?;
        if !status.is_success() {
            return Err(format!("provider answered {status}: {}", String::from_utf8_lossy(&bytes)));
        }
        serde_json::from_slice(&bytes).map_err(|e| format!("provider answer unreadable: {e}"))
    }
}
