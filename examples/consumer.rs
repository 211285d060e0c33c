//! `cargo run --example consumer --features amqp,mysql,sqlite,redis`
//!
//! Consumes `order.paid` events from RabbitMQ (`IDEM_AMQP_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672`) and deducts stock once per order,
//! however many times the event is delivered. MariaDB when `IDEM_MYSQL_URL` is
//! set, else in-memory SQLite; Redis when `IDEM_REDIS_URL` is set.
//!
//! The Kafka variant: `IDEM_KAFKA_BROKERS=127.0.0.1:9092 cargo run --example
//! consumer --features amqp,mysql,sqlite,redis,kafka` consumes the topic
//! `order.paid` as the group `stock` instead (the same handler, the same
//! builder: only the constructor differs).
//!
//! At start it publishes a few demo events itself — duplicates, a key reused
//! with another quantity, a poison message, an unknown SKU that keeps
//! failing — prints how each delivery was settled, the stock, the ledger and
//! the dead-letter queue (or topic), and exits.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotency::amqp::Consumer;
use idempotency::consumer::{Action, Settled};
use idempotency::{Idem, Outcome, idempotent};
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueuePurgeOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};
use sqlx::{MySql, Sqlite, Transaction};
use tokio::sync::Notify;

const QUEUE: &str = "order.paid";

/// The event, as the order service publishes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPaid {
    order_id: i64,
    sku: String,
    qty: i64,
}

/// What a deduction returns (and what a duplicate replays).
#[derive(Debug, Serialize, Deserialize)]
struct Deducted {
    order_id: i64,
    sku: String,
    qty: i64,
}

#[derive(Debug)]
enum StockError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
    UnknownSku(String),
}

impl std::fmt::Display for StockError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StockError::Idem(e) => write!(f, "{e}"),
            StockError::Db(e) => write!(f, "database: {e}"),
            StockError::UnknownSku(sku) => write!(f, "unknown sku {sku}"),
        }
    }
}

impl std::error::Error for StockError {}

impl From<idempotency::Error> for StockError {
    fn from(e: idempotency::Error) -> Self {
        StockError::Idem(e)
    }
}

impl From<sqlx::Error> for StockError {
    fn from(e: sqlx::Error) -> Self {
        StockError::Db(e)
    }
}

/// What the consumer settles by: a database that is down (`Storage`) is
/// waited out and requeued without spending a retry; a reused or invalid
/// key goes to the dead-letter queue; the body's own errors are retried.
impl idempotency::amqp::AsIdemError for StockError {
    fn idem_error(&self) -> Option<&idempotency::Error> {
        match self {
            StockError::Idem(e) => Some(e),
            StockError::Db(_) | StockError::UnknownSku(_) => None,
        }
    }
}

/// The annotated fn, once per backend (the SQL is the same).
macro_rules! deduct_stock {
    ($name:ident, $db:ty) => {
        /// Deducts the stock of one paid order, once per `order_id`.
        #[idempotent(key = "order_paid_<event.order_id>", ttl = "7d", biz = "deduct_stock")]
        async fn $name(
            idem: &Idem<$db>,
            tx: &mut Transaction<'_, $db>,
            event: OrderPaid,
        ) -> Result<Deducted, StockError> {
            let updated = sqlx::query("UPDATE stock SET qty = qty - ? WHERE sku = ?")
                .bind(event.qty)
                .bind(&event.sku)
                .execute(&mut **tx)
                .await?;
            if updated.rows_affected() == 0 {
                // Rolled back, retried up to the bound, then dead-lettered.
                return Err(StockError::UnknownSku(event.sku));
            }
            sqlx::query("INSERT INTO stock_moves (order_id, sku, qty) VALUES (?, ?, ?)")
                .bind(event.order_id)
                .bind(&event.sku)
                .bind(-event.qty)
                .execute(&mut **tx)
                .await?;
            Ok(Deducted { order_id: event.order_id, sku: event.sku, qty: event.qty })
        }
    };
}

deduct_stock!(deduct_stock_mysql, MySql);
deduct_stock!(deduct_stock_sqlite, Sqlite);

/// `(sku, qty)`.
type Stock = (String, i64);
/// `(order_id, sku, qty)`.
type Move = (i64, String, i64);

#[derive(Clone)]
enum Store {
    MySql(Idem<MySql>),
    Sqlite(Idem<Sqlite>),
}

impl Store {
    async fn open() -> Result<Self, Box<dyn std::error::Error>> {
        let redis = match std::env::var("IDEM_REDIS_URL") {
            Ok(url) => Some(redis::Client::open(url)?),
            Err(_) => None,
        };
        if let Ok(url) = std::env::var("IDEM_MYSQL_URL") {
            let mut builder = Idem::builder(sqlx::MySqlPool::connect(&url).await?);
            if let Some(client) = redis {
                builder = builder.redis(client);
            }
            let idem = builder.build();
            idem.migrate().await?;
            sqlx::raw_sql(
                "CREATE TABLE IF NOT EXISTS stock (sku VARCHAR(64) PRIMARY KEY, qty BIGINT NOT NULL);
                 CREATE TABLE IF NOT EXISTS stock_moves (id BIGINT AUTO_INCREMENT PRIMARY KEY,
                     order_id BIGINT NOT NULL, sku VARCHAR(64) NOT NULL, qty BIGINT NOT NULL);
                 INSERT IGNORE INTO stock (sku, qty) VALUES ('SKU-A', 100), ('SKU-B', 100);",
            )
            .execute(idem.pool())
            .await?;
            println!("store: MariaDB{}", if std::env::var("IDEM_REDIS_URL").is_ok() { " + Redis" } else { "" });
            return Ok(Store::MySql(idem));
        }
        let idem = Idem::sqlite_memory().await?;
        // Claims in front of the same in-memory database, when Redis is configured.
        let idem = match redis {
            Some(client) => Idem::builder(idem.pool().clone()).redis(client).build(),
            None => idem,
        };
        sqlx::raw_sql(
            "CREATE TABLE stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL);
             CREATE TABLE stock_moves (id INTEGER PRIMARY KEY, order_id INTEGER NOT NULL, sku TEXT NOT NULL,
                 qty INTEGER NOT NULL);
             INSERT INTO stock (sku, qty) VALUES ('SKU-A', 100), ('SKU-B', 100);",
        )
        .execute(idem.pool())
        .await?;
        println!("store: in-memory SQLite{}", if std::env::var("IDEM_REDIS_URL").is_ok() { " + Redis" } else { "" });
        Ok(Store::Sqlite(idem))
    }

    async fn deduct(&self, event: OrderPaid) -> Result<Deducted, StockError> {
        match self {
            Store::MySql(idem) => deduct_stock_mysql(idem, event).await,
            Store::Sqlite(idem) => deduct_stock_sqlite(idem, event).await,
        }
    }

    async fn report(&self, orders: &[i64]) -> Result<(), sqlx::Error> {
        let list = orders.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        // Built from integers only.
        let moves_sql = format!("SELECT order_id, sku, qty FROM stock_moves WHERE order_id IN ({list}) ORDER BY id");
        let (stock, moves): (Vec<Stock>, Vec<Move>) = match self {
            Store::MySql(idem) => (
                sqlx::query_as("SELECT sku, qty FROM stock ORDER BY sku").fetch_all(idem.pool()).await?,
                sqlx::query_as(sqlx::AssertSqlSafe(moves_sql)).fetch_all(idem.pool()).await?,
            ),
            Store::Sqlite(idem) => (
                sqlx::query_as("SELECT sku, qty FROM stock ORDER BY sku").fetch_all(idem.pool()).await?,
                sqlx::query_as(sqlx::AssertSqlSafe(moves_sql)).fetch_all(idem.pool()).await?,
            ),
        };
        println!("stock: {stock:?}");
        println!("stock_moves of this run ({} rows): {moves:?}", moves.len());
        Ok(())
    }
}

fn describe<D>(s: &Settled<D>) -> String {
    let what = match s.action {
        Action::Ack => "ack".to_string(),
        Action::Requeue if s.outcome == Some(Outcome::InProgress) => "in progress elsewhere -> requeued".to_string(),
        Action::Requeue => "database unavailable -> requeued, not counted".to_string(),
        Action::Retry { count } => format!("failed -> retry #{count} republished"),
        Action::DeadLetter(reason) => format!("dead-lettered ({reason:?})"),
        other => format!("{other:?}"),
    };
    let outcome = s.outcome.map_or("-", |o| o.as_str());
    let error = s.error.as_deref().map(|e| format!("  [{e}]")).unwrap_or_default();
    format!("{:<7} outcome {outcome:<10} {what}{error}", s.message_id.as_deref().unwrap_or("?"))
}

/// The demo events: (message id, payload) for orders `base + 1..=3`.
fn demo_events(base: i64) -> Vec<(&'static str, Vec<u8>)> {
    let event = |n: i64, sku: &str, qty: i64| {
        serde_json::to_vec(&OrderPaid { order_id: base + n, sku: sku.into(), qty }).expect("serializable")
    };
    vec![
        ("evt-1", event(1, "SKU-A", 2)),
        ("evt-2", event(1, "SKU-A", 2)), // duplicate: replayed
        ("evt-3", event(2, "SKU-B", 1)),
        ("evt-4", event(1, "SKU-A", 2)),  // duplicate again
        ("evt-5", event(2, "SKU-B", 5)),  // same order, other qty: key reused
        ("evt-6", b"{not json".to_vec()), // poison
        ("evt-7", event(3, "SKU-X", 1)),  // unknown SKU: fails every time
    ]
}

/// The Kafka variant: the same events and handler on a topic.
#[cfg(feature = "kafka")]
async fn kafka(brokers: &str, store: Store, base: i64) -> Result<(), Box<dyn std::error::Error>> {
    use idempotency::kafka::rdkafka::ClientConfig;
    use idempotency::kafka::rdkafka::message::{Header, OwnedHeaders};
    use idempotency::kafka::rdkafka::producer::{FutureProducer, FutureRecord};

    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers);
    let names = idempotency::kafka::declare_with_dead_letter(&config, QUEUE, "stock", 3, 1).await?;
    let producer: FutureProducer = config.create()?;
    let demo = demo_events(base);
    for (id, payload) in &demo {
        // The order id as the message key: one order's events stay in order.
        let key = serde_json::from_slice::<OrderPaid>(payload).map(|e| e.order_id.to_string()).unwrap_or_default();
        let headers =
            OwnedHeaders::new().insert(Header { key: idempotency::kafka::MESSAGE_ID_HEADER, value: Some(*id) });
        let record = FutureRecord::to(QUEUE).key(&key).payload(payload).headers(headers);
        producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e)?;
    }
    println!("produced {} events to `{QUEUE}`", demo.len());
    let expected = demo.len() + 2;
    let (count, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(Notify::new()));
    let notify = Arc::clone(&done);
    let handler_store = store.clone();
    idempotency::kafka::Consumer::new(config.clone(), QUEUE, "stock")
        .concurrency(4)
        .max_retries(2)
        .retry_delay(Duration::from_millis(200))
        .in_progress_delay(Duration::from_millis(200))
        .on_settle(move |s| {
            println!("{}  ({}/{} @{})", describe(s), s.delivery.topic, s.delivery.partition, s.delivery.offset);
            if count.fetch_add(1, Ordering::SeqCst) + 1 == expected {
                notify.notify_one();
            }
        })
        .run(
            async move {
                let _ = tokio::time::timeout(Duration::from_secs(60), done.notified()).await;
            },
            move |event: OrderPaid| {
                let store = handler_store.clone();
                async move { store.deduct(event).await }
            },
        )
        .await?;
    store.report(&[base + 1, base + 2, base + 3]).await?;
    println!("dead letters go to the topic `{}` with their reason in `Idem-Dead-Reason`", names.dead_letter_topic);
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Order ids from the clock, so a rerun against MariaDB deducts again
    // instead of replaying the last run.
    let base = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs() as i64 * 10;
    #[cfg(feature = "kafka")]
    if let Ok(brokers) = std::env::var("IDEM_KAFKA_BROKERS") {
        return kafka(&brokers, Store::open().await?, base).await;
    }
    let url = std::env::var("IDEM_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".into());
    let conn = match Connection::connect(&url, ConnectionProperties::default()).await {
        Ok(conn) => conn,
        Err(e) => {
            eprintln!("RabbitMQ at {url} is not answering ({e}); start it with `rabbitmq-server -detached`");
            std::process::exit(1);
        }
    };
    let store = Store::open().await?;

    // The queue, its dead-letter exchange `order.paid.dlx` and queue `order.paid.dlq`.
    let channel = conn.create_channel().await?;
    let names = idempotency::amqp::declare_with_dead_letter(&channel, QUEUE).await?;
    channel.queue_purge(QUEUE.into(), QueuePurgeOptions::default()).await?;
    channel.queue_purge(names.dead_letter_queue.as_str().into(), QueuePurgeOptions::default()).await?;

    let demo = demo_events(base);
    let publisher = conn.create_channel().await?;
    publisher.confirm_select(ConfirmSelectOptions::default()).await?;
    for (id, payload) in &demo {
        let props = BasicProperties::default().with_message_id((*id).into()).with_delivery_mode(2);
        publisher.basic_publish("".into(), QUEUE.into(), BasicPublishOptions::default(), payload, props).await?.await?;
    }
    println!("published {} events to `{QUEUE}`", demo.len());

    // 7 first deliveries + 2 retries of evt-7 = 9 settlements.
    let expected = demo.len() + 2;
    let settled = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(Notify::new());
    let (count, notify) = (Arc::clone(&settled), Arc::clone(&done));
    let shutdown = {
        let done = Arc::clone(&done);
        async move {
            let _ = tokio::time::timeout(Duration::from_secs(10), done.notified()).await;
        }
    };
    let handler_store = store.clone();
    Consumer::new(conn.create_channel().await?, QUEUE)
        .max_retries(2)
        .retry_delay(Duration::from_millis(200))
        .in_progress_delay(Duration::from_millis(200))
        .storage_delay(Duration::from_secs(1))
        .on_settle(move |s| {
            println!("{}", describe(s));
            if count.fetch_add(1, Ordering::SeqCst) + 1 == expected {
                notify.notify_one();
            }
        })
        .run(shutdown, move |event: OrderPaid| {
            let store = handler_store.clone();
            async move { store.deduct(event).await }
        })
        .await?;

    store.report(&[base + 1, base + 2, base + 3]).await?;
    // Dead-lettering happens in the broker after the reject: wait (up to 5 s)
    // for the 3 the demo sends there (evt-5, evt-6, evt-7).
    let mut dead = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while dead.len() < 3 && tokio::time::Instant::now() < deadline {
        while let Some(msg) =
            channel.basic_get(names.dead_letter_queue.as_str().into(), BasicGetOptions::default()).await?
        {
            let id = msg.delivery.properties.message_id().as_ref().map(|s| s.to_string()).unwrap_or_default();
            dead.push(format!("{id}: {}", String::from_utf8_lossy(&msg.delivery.data)));
            msg.delivery.ack(BasicAckOptions::default()).await?;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("dead-letter queue `{}` ({} messages):", names.dead_letter_queue, dead.len());
    for line in dead {
        println!("  {line}");
    }
    conn.close(200, "bye".into()).await?;
    Ok(())
}
