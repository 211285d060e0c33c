//! `cargo run --example provider`: a payment through an outside service,
//! with `#[idempotent(..., steps)]`. Embedded SQLite, and a payment
//! provider on loopback that honours `Idempotency-Key` and counts charges.
//!
//! Printed, in order: a charge and its replay (one request at the
//! provider); a declined card, recorded and replayed as a permanent failure;
//! a call that dies after the provider charged and before the step was
//! recorded, left stuck in `processing`; and a completer loop that finds it
//! once its lease ran out and drives it to the end: the provider is asked
//! again with the same step key, and charges nothing new.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::{Idem, StepKey, Steps, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::Sqlite;

#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    order_id: u64,
    charge_id: String,
    amount: i64,
}

/// What the provider answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Charge {
    id: String,
    declined: Option<String>,
}

/// Recorded for good: retries get it again, the card is not tried again.
#[derive(Debug, Serialize, Deserialize)]
struct Declined {
    order_id: u64,
    reason: String,
}

#[derive(Debug)]
enum ChargeError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
    Provider(String),
}

impl std::fmt::Display for ChargeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChargeError::Idem(e) => write!(f, "{e}"),
            ChargeError::Db(e) => write!(f, "database: {e}"),
            ChargeError::Provider(e) => write!(f, "provider: {e}"),
        }
    }
}

impl std::error::Error for ChargeError {}

impl From<idempotency::Error> for ChargeError {
    fn from(e: idempotency::Error) -> Self {
        ChargeError::Idem(e)
    }
}

impl From<sqlx::Error> for ChargeError {
    fn from(e: sqlx::Error) -> Self {
        ChargeError::Db(e)
    }
}

/// One outside call (a step), then the local write (the final transaction,
/// committed with the record only while this call still owns the key). Its
/// lease is longer than the engine's `lock_wait` (5 s), how long a retry
/// waits for a running call before `InProgress`: the completer below is
/// what finishes a dead one here.
#[idempotent(key = "order_<order_id>_charge", ttl = "24h", biz = "charge", biz_no = "<order_id>", lease = "6s", steps)]
async fn charge(
    idem: &Idem<Sqlite>,
    steps: &mut Steps<Sqlite>,
    #[idem(skip)] provider: &ProviderClient,
    order_id: u64,
    amount: i64,
) -> Result<Receipt, ChargeError> {
    let charge: Charge = steps.step("charge", |step_key| provider.charge(step_key, order_id, amount)).await?;
    if let Some(reason) = charge.declined {
        return Err(steps.permanent(&Declined { order_id, reason }).into());
    }
    let tx = steps.transaction().await?;
    sqlx::query("UPDATE orders SET status = 'PAID', charge_id = ? WHERE id = ? AND status = 'PENDING'")
        .bind(&charge.id)
        .bind(order_id as i64)
        .execute(&mut **tx)
        .await?;
    Ok(Receipt { order_id, charge_id: charge.id, amount })
}

/// Recovery without a client: the calls stuck in `processing` past their
/// lease, driven to the end with the arguments found again from `biz_no`.
async fn complete_stuck(idem: &Idem<Sqlite>, provider: &ProviderClient) -> Result<usize, ChargeError> {
    let stuck = idem.stuck_calls("charge", 100).await?;
    for call in &stuck {
        let order_id: u64 = call.biz_no.as_deref().and_then(|no| no.parse().ok()).expect("biz_no is the order id");
        let amount: i64 = sqlx::query_scalar("SELECT amount FROM orders WHERE id = ?")
            .bind(order_id as i64)
            .fetch_one(idem.pool())
            .await?;
        match charge(idem, provider, order_id, amount).await {
            Ok(receipt) => println!("  completer: {} (fence {}) done: {receipt:?}", call.key, call.fence + 1),
            Err(e) => println!("  completer: {} not done yet: {e}", call.key),
        }
    }
    Ok(stuck.len())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let provider = ProviderClient::start().await;
    let idem = Idem::sqlite_memory().await?;
    sqlx::raw_sql(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL, status TEXT NOT NULL, charge_id TEXT);
         INSERT INTO orders (id, amount, status) VALUES (1, 1999, 'PENDING'), (2, 500, 'PENDING'), (3, 4200, 'PENDING')",
    )
    .execute(idem.pool())
    .await?;

    println!("1. a charge, then the same call again:");
    let first = charge(&idem, &provider, 1, 1999).await?;
    let again = charge(&idem, &provider, 1, 1999).await?;
    println!("  first: {first:?}\n  again: {again:?} (replayed)");
    println!("  requests at the provider for order 1: {}", provider.requests("1"));

    println!("2. a declined card, then the same call again:");
    provider.decline_amount(500);
    for _ in 0..2 {
        match charge(&idem, &provider, 2, 500).await {
            Err(ChargeError::Idem(idempotency::Error::Permanent { failure, .. })) => {
                let declined: Declined = failure.decode()?;
                println!("  failed for good: {declined:?}");
            }
            other => println!("  unexpected: {other:?}"),
        }
    }
    println!("  requests at the provider for order 2: {}", provider.requests("2"));

    println!("3. a call that dies after the provider charged, before the step was recorded:");
    provider.hang_after_next_answer();
    let died = tokio::time::timeout(Duration::from_millis(500), charge(&idem, &provider, 3, 4200)).await;
    println!("  the call: {}", if died.is_err() { "gone (its future dropped, as if the process died)" } else { "?" });
    println!("  charges at the provider for order 3: {}", provider.charges("3"));
    let retry = charge(&idem, &provider, 3, 4200).await.map(|r| r.charge_id);
    println!("  right away, a retry (it waits 5 s for the running call, whose lease runs on): {retry:?}");

    println!("4. the completer loop, every 500 ms:");
    loop {
        let found = complete_stuck(&idem, &provider).await?;
        let paid: String = sqlx::query_scalar("SELECT status FROM orders WHERE id = 3").fetch_one(idem.pool()).await?;
        if found > 0 && paid == "PAID" {
            break;
        }
        println!("  nothing stuck past its lease yet");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "  order 3: {} requests at the provider (the second with the same step key), {} charge",
        provider.requests("3"),
        provider.charges("3")
    );
    Ok(())
}

// ---- A payment provider on loopback, and its client --------------------

#[derive(Default)]
struct Books {
    /// Answers by idempotency key.
    answers: HashMap<String, Charge>,
    charges: HashMap<String, u32>,
    requests: HashMap<String, u32>,
    declined_amount: Option<i64>,
}

#[derive(Serialize, Deserialize)]
struct ChargeRequest {
    order: String,
    amount: i64,
}

/// Talks to the provider; here it also starts it and reads its books.
struct ProviderClient {
    url: String,
    http: reqwest::Client,
    books: Arc<Mutex<Books>>,
    hang: AtomicBool,
}

impl ProviderClient {
    async fn start() -> ProviderClient {
        use axum::extract::State;
        use axum::http::HeaderMap;

        async fn serve(
            State(books): State<Arc<Mutex<Books>>>,
            headers: HeaderMap,
            axum::Json(request): axum::Json<ChargeRequest>,
        ) -> axum::Json<Charge> {
            let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
            let mut books = books.lock().unwrap();
            *books.requests.entry(request.order.clone()).or_default() += 1;
            if let Some(answer) = books.answers.get(&key) {
                return axum::Json(answer.clone()); // a key seen before: the first answer
            }
            let declined = (books.declined_amount == Some(request.amount)).then(|| "insufficient_funds".to_owned());
            if declined.is_none() {
                *books.charges.entry(request.order.clone()).or_default() += 1;
            }
            let answer = Charge { id: format!("ch_{}", books.answers.len() + 1), declined };
            books.answers.insert(key, answer.clone());
            axum::Json(answer)
        }

        let books = Arc::new(Mutex::new(Books::default()));
        let app = axum::Router::new().route("/charges", axum::routing::post(serve)).with_state(books.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a loopback port");
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        ProviderClient { url, http: reqwest::Client::new(), books, hang: AtomicBool::new(false) }
    }

    /// One charge, keyed by the step's key; the order goes as the
    /// merchant's reference.
    async fn charge(&self, step_key: StepKey, order_id: u64, amount: i64) -> Result<Charge, ChargeError> {
        let body = serde_json::to_string(&ChargeRequest { order: order_id.to_string(), amount }).unwrap();
        let response = self
            .http
            .post(format!("{}/charges", self.url))
            .header("idempotency-key", step_key.as_str())
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| ChargeError::Provider(e.to_string()))?;
        let bytes = response.bytes().await.map_err(|e| ChargeError::Provider(e.to_string()))?;
        let charge = serde_json::from_slice(&bytes).map_err(|e| ChargeError::Provider(e.to_string()))?;
        if self.hang.swap(false, Ordering::SeqCst) {
            std::future::pending::<()>().await; // the process "dies" here
        }
        Ok(charge)
    }

    fn decline_amount(&self, amount: i64) {
        self.books.lock().unwrap().declined_amount = Some(amount);
    }

    fn hang_after_next_answer(&self) {
        self.hang.store(true, Ordering::SeqCst);
    }

    fn requests(&self, order: &str) -> u32 {
        self.books.lock().unwrap().requests.get(order).copied().unwrap_or(0)
    }

    fn charges(&self, order: &str) -> u32 {
        self.books.lock().unwrap().charges.get(order).copied().unwrap_or(0)
    }
}
