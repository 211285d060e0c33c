//! The outbox's figures, on this machine's servers (MariaDB, RabbitMQ,
//! NATS JetStream), release build:
//!
//! - publish throughput of one relay (and of two) per broker: events queued
//!   beforehand, timed until the last is marked sent;
//! - commit-to-consume latency, p50 and p99: pay calls at a steady pace,
//!   each event's time from the call's return (its commit) to the start of
//!   the consumer's handler, through one relay (woken by the commit) and the
//!   consumer runner.
//!
//! ```sh
//! cargo bench --bench outbox --features outbox,amqp,nats,mysql
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency::nats::async_nats::{self, jetstream};
use idempotency::outbox::nats::NatsPublisher;
use idempotency::outbox::rabbit::RabbitPublisher;
use idempotency::outbox::{Event, MessageId, Publisher, Relay};
use idempotency::{Idem, idempotent};
use idempotency_testkit::mysql_url;
use lapin::options::QueueDeleteOptions;
use lapin::{Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{MySql, Pool, Transaction};
use tokio::sync::oneshot;

const THROUGHPUT_EVENTS: usize = 10_000;
const LATENCY_CALLS: i64 = 1_000;
const LATENCY_PACE: Duration = Duration::from_millis(4);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPaid {
    order_id: i64,
}

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug
enum BenchError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
}

impl From<idempotency::Error> for BenchError {
    fn from(e: idempotency::Error) -> Self {
        BenchError::Idem(e)
    }
}

impl From<sqlx::Error> for BenchError {
    fn from(e: sqlx::Error) -> Self {
        BenchError::Db(e)
    }
}

impl idempotency::amqp::AsIdemError for BenchError {
    fn idem_error(&self) -> Option<&idempotency::Error> {
        match self {
            BenchError::Idem(e) => Some(e),
            BenchError::Db(_) => None,
        }
    }
}

#[idempotent(key = "order_<order_id>", ttl = "1h", biz = "bench_pay")]
async fn pay(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    order_id: i64,
    destination: String,
) -> Result<i64, BenchError> {
    sqlx::query("INSERT INTO bench_payments (order_id) VALUES (?)").bind(order_id).execute(&mut **tx).await?;
    idempotency::outbox::queue(
        tx,
        Event::json(destination, &OrderPaid { order_id })?.aggregate(format!("order-{order_id}")),
    )
    .await?;
    Ok(order_id)
}

#[idempotent(key = "<message_id>", ttl = "1h", biz = "bench_consume")]
async fn consume(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    message_id: String,
    event: OrderPaid,
) -> Result<(), BenchError> {
    sqlx::query("INSERT INTO bench_moves (order_id) VALUES (?)").bind(event.order_id).execute(&mut **tx).await?;
    Ok(())
}

fn amqp_url() -> String {
    std::env::var("IDEM_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

fn nats_url() -> String {
    std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into())
}

/// A fresh database for one measurement.
async fn database(name: &str) -> Idem<MySql> {
    let admin = MySqlPoolOptions::new().max_connections(1).connect(&mysql_url()).await.expect("mariadb");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS bench_{name}; CREATE DATABASE bench_{name}")))
        .execute(&admin)
        .await
        .unwrap();
    let options: MySqlConnectOptions = mysql_url().parse().unwrap();
    let pool: Pool<MySql> = MySqlPoolOptions::new()
        .max_connections(16)
        .connect_with(options.database(&format!("bench_{name}")))
        .await
        .unwrap();
    sqlx::raw_sql(
        "CREATE TABLE bench_payments (order_id BIGINT PRIMARY KEY);
         CREATE TABLE bench_moves (order_id BIGINT NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let idem = Idem::new(pool);
    idem.migrate().await.unwrap();
    idem
}

async fn drop_database(idem: Idem<MySql>, name: &str) {
    idem.pool().close().await;
    let admin = MySqlPoolOptions::new().max_connections(1).connect(&mysql_url()).await.unwrap();
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE bench_{name}"))).execute(&admin).await;
}

/// Queues `n` events (500 per transaction), each its own aggregate.
async fn fill(idem: &Idem<MySql>, destination: &str, n: usize) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        let mut tx = idem.pool().begin().await.unwrap();
        for i in chunk {
            let id = MessageId::derive("bench_fill", &format!("e{i}"), 0).unwrap();
            let event = Event::raw(destination, format!("{{\"order_id\":{i}}}")).aggregate(format!("order-{i}")).id(id);
            idempotency::outbox::queue(&mut tx, event).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
}

/// Events per second `relays` relays publish through `publisher()`.
async fn throughput<P, F, Fut>(name: &str, destination: &str, relays: usize, batch: u32, publisher: F) -> f64
where
    P: Publisher + 'static,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = P>,
{
    let idem = database(name).await;
    fill(&idem, destination, THROUGHPUT_EVENTS).await;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..relays {
        let mut stopped = stopped.clone();
        let relay = Relay::new(&idem, publisher().await).batch_size(batch).poll_interval(Duration::from_millis(20));
        tasks.push(tokio::spawn(relay.run(async move {
            let _ = stopped.wait_for(|s| *s).await;
        })));
    }
    loop {
        if idem.outbox().counts().await.unwrap().pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = start.elapsed();
    let _ = stop.send(true);
    for t in tasks {
        t.await.unwrap();
    }
    drop_database(idem, name).await;
    THROUGHPUT_EVENTS as f64 / elapsed.as_secs_f64()
}

/// Commit-to-consume latencies, sorted (ms).
type Latencies = Vec<f64>;

/// When an order's call returned, and when the handler started on its event.
type Seen = (Option<Instant>, Option<Instant>);

/// Times of each order.
#[derive(Default)]
struct Clock {
    seen: Mutex<HashMap<i64, Seen>>,
}

impl Clock {
    fn committed(&self, order: i64) {
        self.seen.lock().unwrap().entry(order).or_default().0 = Some(Instant::now());
    }

    fn consumed(&self, order: i64) {
        let mut seen = self.seen.lock().unwrap();
        let entry = seen.entry(order).or_default();
        if entry.1.is_none() {
            entry.1 = Some(Instant::now());
        }
    }

    fn latencies(&self) -> Latencies {
        let seen = self.seen.lock().unwrap();
        let mut ms: Vec<f64> = seen
            .values()
            .filter_map(|(c, r)| Some(r.as_ref()?.saturating_duration_since(*c.as_ref()?).as_secs_f64() * 1000.0))
            .collect();
        ms.sort_by(f64::total_cmp);
        ms
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Paces `LATENCY_CALLS` pay calls; waits for every event to be consumed.
async fn paced_calls(idem: &Idem<MySql>, destination: &str, clock: &Arc<Clock>) {
    let mut tick = tokio::time::interval(LATENCY_PACE);
    let mut calls = Vec::new();
    for order in 1..=LATENCY_CALLS {
        tick.tick().await;
        let (idem, destination, clock) = (idem.clone(), destination.to_owned(), clock.clone());
        calls.push(tokio::spawn(async move {
            pay(&idem, order, destination).await.unwrap();
            clock.committed(order);
        }));
    }
    for c in calls {
        c.await.unwrap();
    }
    let start = Instant::now();
    while clock.latencies().len() < LATENCY_CALLS as usize {
        assert!(start.elapsed() < Duration::from_secs(60), "events not consumed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn rabbit_latency() -> Latencies {
    let idem = database("lat_rabbit").await;
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default()).await.expect("rabbitmq");
    let channel = conn.create_channel().await.unwrap();
    let queue = "bench.outbox.latency";
    let _ = channel.queue_delete(queue.into(), QueueDeleteOptions::default()).await;
    idempotency::amqp::declare_with_dead_letter(&channel, queue).await.unwrap();
    let clock = Arc::new(Clock::default());
    let (stop_relay, relay_stopped) = oneshot::channel::<()>();
    let relay = tokio::spawn(Relay::new(&idem, RabbitPublisher::new(amqp_url())).run(async move {
        let _ = relay_stopped.await;
    }));
    let (stop_consumer, consumer_stopped) = oneshot::channel::<()>();
    let (engine, seen) = (idem.clone(), clock.clone());
    let consumer = tokio::spawn(
        idempotency::amqp::Consumer::new(conn.create_channel().await.unwrap(), queue).concurrency(4).run_with_id(
            async move {
                let _ = consumer_stopped.await;
            },
            move |id: String, event: OrderPaid| {
                seen.consumed(event.order_id);
                let idem = engine.clone();
                async move { consume(&idem, id, event).await }
            },
        ),
    );
    paced_calls(&idem, queue, &clock).await;
    let _ = stop_consumer.send(());
    consumer.await.unwrap().unwrap();
    let _ = stop_relay.send(());
    relay.await.unwrap();
    let _ = channel.queue_delete(queue.into(), QueueDeleteOptions::default()).await;
    drop_database(idem, "lat_rabbit").await;
    clock.latencies()
}

async fn nats_latency() -> Latencies {
    let idem = database("lat_nats").await;
    let client = async_nats::connect(nats_url()).await.expect("nats");
    let js = jetstream::new(client.clone());
    let _ = js.delete_stream("BENCH_OUTBOX").await;
    idempotency::nats::declare_with_dead_letter(&js, "BENCH_OUTBOX", &["bench.outbox.latency"]).await.unwrap();
    let clock = Arc::new(Clock::default());
    let (stop_relay, relay_stopped) = oneshot::channel::<()>();
    let relay = tokio::spawn(Relay::new(&idem, NatsPublisher::new(client.clone())).run(async move {
        let _ = relay_stopped.await;
    }));
    let (stop_consumer, consumer_stopped) = oneshot::channel::<()>();
    let (engine, seen) = (idem.clone(), clock.clone());
    let consumer =
        tokio::spawn(idempotency::nats::Consumer::new(js.clone(), "BENCH_OUTBOX", "bench").concurrency(4).run_with_id(
            async move {
                let _ = consumer_stopped.await;
            },
            move |id: String, event: OrderPaid| {
                seen.consumed(event.order_id);
                let idem = engine.clone();
                async move { consume(&idem, id, event).await }
            },
        ));
    paced_calls(&idem, "bench.outbox.latency", &clock).await;
    let _ = stop_consumer.send(());
    consumer.await.unwrap().unwrap();
    let _ = stop_relay.send(());
    relay.await.unwrap();
    let _ = js.delete_stream("BENCH_OUTBOX").await;
    let _ = js.delete_stream("BENCH_OUTBOX_DEAD").await;
    drop_database(idem, "lat_nats").await;
    clock.latencies()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: then
    // only check that it builds.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    println!("outbox bench: {THROUGHPUT_EVENTS} events queued beforehand, MariaDB, release build");
    println!("| relay | batch | relays | events/s |");
    println!("|---|---|---|---|");
    for (relays, batch) in [(1, 100), (1, 500), (2, 100)] {
        let queue = format!("bench.outbox.t{relays}x{batch}");
        let conn = Connection::connect(&amqp_url(), ConnectionProperties::default()).await.expect("rabbitmq");
        let channel = conn.create_channel().await.unwrap();
        let _ = channel.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await;
        idempotency::amqp::declare_with_dead_letter(&channel, &queue).await.unwrap();
        let rate = throughput(&format!("t_rabbit_{relays}_{batch}"), &queue, relays, batch, || async {
            RabbitPublisher::new(amqp_url())
        })
        .await;
        println!("| RabbitMQ (confirms) | {batch} | {relays} | {rate:.0} |");
        let _ = channel.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await;
        let _ = channel.queue_delete(format!("{queue}.dlq").as_str().into(), QueueDeleteOptions::default()).await;

        let client = async_nats::connect(nats_url()).await.expect("nats");
        let js = jetstream::new(client.clone());
        let stream = format!("BENCH_T{relays}X{batch}");
        let subject = format!("bench.outbox.t{relays}x{batch}");
        let _ = js.delete_stream(&stream).await;
        idempotency::nats::declare_with_dead_letter(&js, &stream, &[subject.as_str()]).await.unwrap();
        let rate = throughput(&format!("t_nats_{relays}_{batch}"), &subject, relays, batch, || async {
            NatsPublisher::new(client.clone())
        })
        .await;
        println!("| NATS JetStream (Nats-Msg-Id) | {batch} | {relays} | {rate:.0} |");
        let _ = js.delete_stream(&stream).await;
        let _ = js.delete_stream(format!("{stream}_DEAD")).await;
    }
    println!();
    println!(
        "commit-to-consume, {LATENCY_CALLS} pay calls every {LATENCY_PACE:?}, one relay woken by the commit, consumer concurrency 4"
    );
    println!("| broker | p50 ms | p99 ms | max ms |");
    println!("|---|---|---|---|");
    let rabbit = rabbit_latency().await;
    println!(
        "| RabbitMQ | {:.2} | {:.2} | {:.2} |",
        percentile(&rabbit, 0.5),
        percentile(&rabbit, 0.99),
        percentile(&rabbit, 1.0)
    );
    let nats = nats_latency().await;
    println!(
        "| NATS JetStream | {:.2} | {:.2} | {:.2} |",
        percentile(&nats, 0.5),
        percentile(&nats, 0.99),
        percentile(&nats, 1.0)
    );
}
