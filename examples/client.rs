//! `cargo run --example client --features axum,sqlite`
//!
//! Pays twice over a flaky network and charges once: both halves in one
//! program, no servers needed. An axum server pays orders once per
//! `Idempotency-Key` (SQLite in memory); between it and the client, a
//! network that loses the first answer after the server sent it. The
//! client (`idempotency-client`'s middleware on reqwest) makes the key
//! before paying and stores it with the order, as an application does:
//!
//! ```text
//! pay:       200 {"order_id":42,"amount":1999,"payment_id":1} after 2 attempts, replayed: true (the first answer was lost)
//! pay again: 200 {"order_id":42,"amount":1999,"payment_id":1} after 1 attempt, replayed: true
//! charges:   1
//! ```
//!
//! The first payment ran once; its answer never arrived, so the middleware
//! sent the request again with the same key and got the stored answer. The
//! second payment (the user pressing "Pay" again, or the app resuming after
//! a restart) sends the key stored with the order and is answered the
//! same. Guide: docs/client.md.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotency::http::{IdempotencyKey, ReplayHeaderLayer};
use idempotency::{Idem, idempotent};
use idempotency_client::{IdempotencyMiddleware, Outcome, Retries, new_key};
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, Transaction};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

#[derive(Serialize, Deserialize)]
struct PayReq {
    amount: i64,
}

#[derive(Serialize, Deserialize)]
struct Receipt {
    order_id: i64,
    amount: i64,
    payment_id: i64,
}

impl IntoResponse for Receipt {
    fn into_response(self) -> Response {
        Json(self).into_response()
    }
}

/// The server half: one payment per key; a repeat is answered with the
/// stored receipt, marked `Idempotent-Replayed: true`.
#[idempotent(key = "<idem_key>", ttl = "24h", biz = "client_pay", engine = idem)]
async fn pay(
    State(idem): State<Idem<Sqlite>>,
    tx: &mut Transaction<'_, Sqlite>,
    IdempotencyKey(idem_key): IdempotencyKey,
    Path(order_id): Path<i64>,
    Json(req): Json<PayReq>,
) -> Result<Receipt, idempotency::Error> {
    let payment = sqlx::query("INSERT INTO payments (order_id, amount) VALUES (?, ?)")
        .bind(order_id)
        .bind(req.amount)
        .execute(&mut **tx)
        .await?;
    Ok(Receipt { order_id, amount: req.amount, payment_id: payment.last_insert_rowid() })
}

/// A network that loses the next answer when told to: the request reaches
/// the server, which runs it and answers, and the connection drops before
/// a byte of the answer gets through.
async fn flaky_network(listener: TcpListener, server: SocketAddr, lose_next: Arc<AtomicBool>) {
    while let Ok((client, _)) = listener.accept().await {
        let lose = lose_next.swap(false, Ordering::SeqCst);
        tokio::spawn(async move {
            let Ok(mut upstream) = TcpStream::connect(server).await else { return };
            let mut client = client;
            if !lose {
                let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                return;
            }
            let (mut client_read, client_write) = client.into_split();
            let (mut server_read, mut server_write) = upstream.into_split();
            let request = tokio::spawn(async move { tokio::io::copy(&mut client_read, &mut server_write).await });
            let mut first_byte = [0u8; 1];
            let _ = server_read.read(&mut first_byte).await; // the server answered: it ran the payment
            request.abort();
            drop(client_write); // and the answer is lost
        });
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The server half.
    let idem = Idem::sqlite_memory().await?;
    sqlx::raw_sql(
        "CREATE TABLE payments (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id INTEGER NOT NULL, amount INTEGER NOT NULL)",
    )
    .execute(idem.pool())
    .await?;
    let app = Router::new().route("/orders/{id}/pay", post(pay)).layer(ReplayHeaderLayer).with_state(idem.clone());
    let server = TcpListener::bind("127.0.0.1:0").await?;
    let server_addr = server.local_addr()?;
    tokio::spawn(async move { axum::serve(server, app).await });

    // The network between the halves.
    let network = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/orders/42/pay", network.local_addr()?);
    let lose_next = Arc::new(AtomicBool::new(true));
    tokio::spawn(flaky_network(network, server_addr, Arc::clone(&lose_next)));

    // The client half: the key made once and stored with the order.
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(IdempotencyMiddleware::new(Retries::default()))
        .build();
    let order_key = new_key();
    for (what, note) in [("pay:      ", " (the first answer was lost)"), ("pay again:", "")] {
        let response = client
            .post(&url)
            .header("Idempotency-Key", &order_key)
            .header("Content-Type", "application/json")
            .body(r#"{"amount":1999}"#)
            .send()
            .await?;
        let outcome = Outcome::of(&response).cloned().expect("a keyed request");
        let status = response.status().as_u16();
        let body = response.text().await?;
        let attempts =
            if outcome.attempts == 1 { "1 attempt".to_owned() } else { format!("{} attempts", outcome.attempts) };
        let note = if outcome.attempts > 1 { note } else { "" };
        println!("{what} {status} {body} after {attempts}, replayed: {}{note}", outcome.replayed);
    }
    let charges: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payments").fetch_one(idem.pool()).await?;
    println!("charges:   {charges}");
    Ok(())
}
