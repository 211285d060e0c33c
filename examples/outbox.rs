//! Events that leave iff the body commits: a payment service queues
//! `order.paid` in its body's transaction, a relay publishes it to NATS
//! JetStream with the event's id as `Nats-Msg-Id`, and a stock service
//! consumes it with an `#[idempotent]` handler keyed by that id.
//!
//! Needs `nats-server -js` on 127.0.0.1:4222 (or `IDEM_NATS_URL`); both
//! services keep their tables in SQLite, in memory.
//!
//! ```sh
//! cargo run --example outbox --features outbox,nats
//! ```

use std::time::{Duration, Instant};

use idempotency::nats::async_nats::{self, jetstream};
use idempotency::outbox::{Event, Relay, nats::NatsPublisher};
use idempotency::{Idem, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, Transaction};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPaid {
    order_id: i64,
    sku: String,
    qty: i64,
}

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug and Display
enum AppError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
    CardDeclined,
}

impl From<idempotency::Error> for AppError {
    fn from(e: idempotency::Error) -> Self {
        AppError::Idem(e)
    }
}

impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        AppError::Db(e)
    }
}

impl std::fmt::Display for AppError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

impl std::error::Error for AppError {}

impl idempotency::nats::AsIdemError for AppError {
    fn idem_error(&self) -> Option<&idempotency::Error> {
        match self {
            AppError::Idem(e) => Some(e),
            _ => None,
        }
    }
}

const SUBJECT: &str = "example.order.paid";

/// The payment: marks the order paid and queues `order.paid`, in one
/// transaction. A declined card fails the body after queueing: the
/// transaction rolls back, and the event with it.
#[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay")]
async fn pay(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    order_id: i64,
    card_ok: bool,
) -> Result<i64, AppError> {
    sqlx::query("UPDATE orders SET status = 'PAID' WHERE id = ? AND status = 'PENDING'")
        .bind(order_id)
        .execute(&mut **tx)
        .await?;
    let paid = OrderPaid { order_id, sku: "book".into(), qty: 1 };
    let id =
        idempotency::outbox::queue(tx, Event::json(SUBJECT, &paid)?.aggregate(format!("order-{order_id}"))).await?;
    println!("pay {order_id}: queued {id}");
    if !card_ok {
        return Err(AppError::CardDeclined);
    }
    Ok(order_id)
}

/// The stock service's handler, keyed by the message id: a copy of an
/// event (a relay's re-publish, a redelivery) replays instead of deducting
/// twice.
#[idempotent(key = "<message_id>", ttl = "7d", biz = "deduct_stock")]
async fn deduct_stock(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    message_id: String,
    event: OrderPaid,
) -> Result<(), AppError> {
    sqlx::query("UPDATE stock SET qty = qty - ? WHERE sku = ?")
        .bind(event.qty)
        .bind(&event.sku)
        .execute(&mut **tx)
        .await?;
    println!("stock: order {} deducted (message {message_id})", event.order_id);
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let url = std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let client = async_nats::connect(&url).await.map_err(|e| format!("NATS at {url}: {e} (start nats-server -js)"))?;
    let js = jetstream::new(client.clone());
    idempotency::nats::declare_with_dead_letter(&js, "EXAMPLE_ORDERS", &[SUBJECT]).await?;

    // Two services, two databases.
    let payments = Idem::sqlite_memory().await?;
    sqlx::raw_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL); INSERT INTO orders VALUES (1, 'PENDING'), (2, 'PENDING')")
        .execute(payments.pool())
        .await?;
    let stock = Idem::sqlite_memory().await?;
    sqlx::raw_sql(
        "CREATE TABLE stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL); INSERT INTO stock VALUES ('book', 10)",
    )
    .execute(stock.pool())
    .await?;

    // The relay: woken by the payment engine's commits, else every second.
    let (stop_relay, relay_stopped) = tokio::sync::oneshot::channel::<()>();
    let relay = tokio::spawn(Relay::new(&payments, NatsPublisher::new(client.clone())).run(async move {
        let _ = relay_stopped.await;
    }));

    // The consumer: a durable pull consumer, settled by the handler's outcome.
    let (stop_consumer, consumer_stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer_engine = stock.clone();
    let consumer = tokio::spawn(
        idempotency::nats::Consumer::new(js.clone(), "EXAMPLE_ORDERS", "stock")
            .on_settle(|s| println!("consumer: {:?} ({:?}), delivery {}", s.action, s.outcome, s.delivery.count))
            .run_with_id(
                async move {
                    let _ = consumer_stopped.await;
                },
                move |message_id: String, event: OrderPaid| {
                    let idem = consumer_engine.clone();
                    async move { deduct_stock(&idem, message_id, event).await }
                },
            ),
    );

    pay(&payments, 1, true).await?;
    pay(&payments, 1, true).await?; // a double click: replayed, nothing queued again
    match pay(&payments, 2, false).await {
        Err(AppError::CardDeclined) => println!("pay 2: declined; its event was rolled back with it"),
        other => println!("pay 2: {other:?}"),
    }

    // Wait (bounded) for the stock service to see order 1.
    let start = Instant::now();
    let qty = loop {
        let qty: i64 = sqlx::query_scalar("SELECT qty FROM stock WHERE sku = 'book'").fetch_one(stock.pool()).await?;
        if qty < 10 || start.elapsed() > Duration::from_secs(10) {
            break qty;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let counts = payments.outbox().counts().await?;
    println!("stock of 'book': {qty} (was 10); outbox: {counts:?}; after {:?}", start.elapsed());

    let _ = stop_consumer.send(());
    consumer.await??;
    let _ = stop_relay.send(());
    relay.await?;
    let _ = js.delete_stream("EXAMPLE_ORDERS").await;
    let _ = js.delete_stream("EXAMPLE_ORDERS_DEAD").await;
    Ok(())
}
