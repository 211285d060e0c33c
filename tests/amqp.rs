//! `idem::amqp` end to end: RabbitMQ (`IDEM_AMQP_URL`), MariaDB
//! (`IDEM_MYSQL_URL`) and Redis (`IDEM_REDIS_URL`). Every test uses its own
//! queues, SKUs and order ids, so they run in parallel and again.

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idem::amqp::{Action, Consumer, DeadLetter, Reason, Settled};
use idem::{Idem, Outcome, idempotent};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{MySql, Transaction};
use tokio::sync::{mpsc, oneshot};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPaid {
    order_id: i64,
    sku: String,
    qty: i64,
    /// How long the body takes (tests of a duplicate arriving mid-body).
    #[serde(default)]
    slow_ms: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Deducted {
    order_id: i64,
    qty: i64,
}

/// A quantity the test handler panics on, while being called.
const PANICS: i64 = -7;

/// A handler that panics while being called, before it returns its future,
/// fails like any other: retried up to the bound, then dead-lettered; the
/// delivery is never left unsettled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_panicking_before_its_future_is_retried_then_dead_lettered() {
    let Some(env) = env(100).await else { return };
    env.publish(&event(order_id(), &env.sku, PANICS), "panics").await;

    let calls = Arc::new(AtomicUsize::new(0));
    let seen = env
        .consume(
            |c| c.max_retries(1).retry_delay(Duration::from_millis(50)),
            Arc::clone(&calls),
            |seen| seen.iter().any(|s| matches!(s.action, Action::DeadLetter(_))),
        )
        .await;

    let actions: Vec<(Action, u32)> = seen.iter().map(|s| (s.action, s.retries)).collect();
    assert_eq!(actions, vec![(Action::Retry { retries: 1 }, 0), (Action::DeadLetter(Reason::RetriesExhausted), 1)]);
    assert!(seen.iter().all(|s| s.outcome.is_none()), "{seen:#?}");
    assert!(seen.iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("handler panicked"))), "{seen:#?}");
    assert_eq!(calls.load(SeqCst), 2, "1 attempt + 1 retry");
    assert_eq!(env.drain_dead_letters(1).await.len(), 1);
    assert_eq!(env.ready(&env.names.queue).await, 0);
    assert_eq!(env.stock().await, 100);
    env.cleanup().await;
}

#[derive(Debug)]
#[allow(dead_code)] // the fields show in assertion messages through Debug
enum StockError {
    Idem(idem::Error),
    Db(sqlx::Error),
    UnknownSku(String),
}

impl From<idem::Error> for StockError {
    fn from(e: idem::Error) -> Self {
        StockError::Idem(e)
    }
}

impl From<sqlx::Error> for StockError {
    fn from(e: sqlx::Error) -> Self {
        StockError::Db(e)
    }
}

#[idempotent(key = "order_paid_<event.order_id>", ttl = "7d", biz = "t_deduct_stock")]
async fn deduct_stock(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    event: OrderPaid,
) -> Result<Deducted, StockError> {
    let updated = sqlx::query("UPDATE idem_amqp_stock SET qty = qty - ? WHERE sku = ?")
        .bind(event.qty)
        .bind(&event.sku)
        .execute(&mut **tx)
        .await?;
    if updated.rows_affected() == 0 {
        return Err(StockError::UnknownSku(event.sku));
    }
    tokio::time::sleep(Duration::from_millis(event.slow_ms)).await;
    sqlx::query("INSERT INTO idem_amqp_stock_moves (order_id, sku, qty) VALUES (?, ?, ?)")
        .bind(event.order_id)
        .bind(&event.sku)
        .bind(-event.qty)
        .execute(&mut **tx)
        .await?;
    Ok(Deducted { order_id: event.order_id, qty: event.qty })
}

const DDL: &str = "CREATE TABLE IF NOT EXISTS idem_amqp_stock (sku VARCHAR(64) PRIMARY KEY, qty BIGINT NOT NULL);
    CREATE TABLE IF NOT EXISTS idem_amqp_stock_moves (id BIGINT AUTO_INCREMENT PRIMARY KEY,
        order_id BIGINT NOT NULL, sku VARCHAR(64) NOT NULL, qty BIGINT NOT NULL, KEY (order_id))";

fn amqp_url() -> String {
    std::env::var("IDEM_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".into())
}

/// Connects to RabbitMQ, starting it once (`rabbitmq-server -detached`) and
/// waiting up to ~30 s if it does not answer; else `skipped: rabbitmq
/// unreachable` (a failure under `IDEM_REQUIRE_SERVICES=1`).
async fn rabbitmq() -> Option<Connection> {
    if let Ok(conn) = Connection::connect(&amqp_url(), ConnectionProperties::default()).await {
        return Some(conn);
    }
    static START: Once = Once::new();
    START.call_once(|| {
        let _ = Command::new("sh")
            .arg("-c")
            .arg("(command -v rabbitmq-server >/dev/null && rabbitmq-server -detached) >/dev/null 2>&1")
            .status();
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Ok(conn) = Connection::connect(&amqp_url(), ConnectionProperties::default()).await {
            return Some(conn);
        }
    }
    common::skip("rabbitmq");
    None
}

/// Everything one test needs, or `None` (after a `skipped:` line).
struct Env {
    conn: Connection,
    idem: Idem<MySql>,
    /// For publishing (with confirms) and inspecting.
    channel: Channel,
    names: DeadLetter,
    sku: String,
}

async fn env(stock: i64) -> Option<Env> {
    let conn = rabbitmq().await?;
    let pool = common::reach("mysql", || async {
        MySqlPoolOptions::new().max_connections(8).connect(&common::mysql_url()).await.ok()
    })
    .await?;
    let redis = common::redis_client().await?;
    let idem = Idem::builder(pool).redis(redis).build();
    idem.migrate().await.expect("migrate");
    sqlx::raw_sql(DDL).execute(idem.pool()).await.expect("stock tables");
    let sku = common::unique("sku");
    sqlx::query("INSERT INTO idem_amqp_stock (sku, qty) VALUES (?, ?)")
        .bind(&sku)
        .bind(stock)
        .execute(idem.pool())
        .await
        .expect("stock row");

    let channel = conn.create_channel().await.expect("channel");
    channel.confirm_select(ConfirmSelectOptions::default()).await.expect("confirms");
    let names = idem::amqp::declare_with_dead_letter(&channel, &common::unique("idem.test.order.paid"))
        .await
        .expect("declare queues");
    Some(Env { conn, idem, channel, names, sku })
}

/// An order id no earlier run used (records live 7 days).
fn order_id() -> i64 {
    static COUNTER: AtomicI64 = AtomicI64::new(0);
    let micros = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as i64;
    micros * 1000 + COUNTER.fetch_add(1, SeqCst) % 1000
}

impl Env {
    async fn publish(&self, payload: &[u8], id: &str) {
        let props = BasicProperties::default().with_message_id(id.into()).with_delivery_mode(2);
        let confirm = self
            .channel
            .basic_publish("".into(), self.names.queue.as_str().into(), BasicPublishOptions::default(), payload, props)
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert!(confirm.is_ack(), "broker did not confirm {id}");
    }

    /// Runs a consumer (the handler calls `deduct_stock`) until `done` holds
    /// for the settlements so far; closes its channel, so anything it left
    /// unacked would go back to the queue. Returns the settlements.
    async fn consume(
        &self,
        configure: impl FnOnce(Consumer) -> Consumer,
        calls: Arc<AtomicUsize>,
        done: impl Fn(&[Settled]) -> bool,
    ) -> Vec<Settled> {
        let channel = self.conn.create_channel().await.expect("consumer channel");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let consumer = configure(Consumer::new(channel.clone(), self.names.queue.clone()))
            .on_settle(move |s| tx.send(s.clone()).expect("test listens"));
        let idem = self.idem.clone();
        let runner = tokio::spawn(consumer.run(
            async move {
                let _ = stopped.await;
            },
            move |event: OrderPaid| {
                let idem = idem.clone();
                calls.fetch_add(1, SeqCst);
                if event.qty == PANICS {
                    panic!("the handler panics before it returns its future");
                }
                async move { deduct_stock(&idem, event).await }
            },
        ));
        let mut seen = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !done(&seen) {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(s)) => seen.push(s),
                _ => panic!("timed out; settlements so far: {seen:#?}"),
            }
        }
        stop.send(()).expect("runner alive");
        runner.await.expect("runner task").expect("runner");
        // Anything settled after `done` held would show here.
        while let Ok(s) = rx.try_recv() {
            seen.push(s);
        }
        channel.close(200, "done".into()).await.expect("close consumer channel");
        seen
    }

    /// Ready messages in `queue` (unacked ones are not counted).
    async fn ready(&self, queue: &str) -> u32 {
        let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
        self.channel.queue_declare(queue.into(), passive, FieldTable::default()).await.expect("passive").message_count()
    }

    /// Takes every message out of the dead-letter queue: waits (up to 10 s)
    /// for the `expected` ones, since dead-lettering happens in the broker
    /// after the reject, then 300 ms more so that any beyond them show too.
    async fn drain_dead_letters(&self, expected: usize) -> Vec<lapin::message::Delivery> {
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while out.len() < expected && tokio::time::Instant::now() < deadline {
            self.take_dead_letters(&mut out).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.take_dead_letters(&mut out).await;
        out
    }

    async fn take_dead_letters(&self, out: &mut Vec<lapin::message::Delivery>) {
        while let Some(msg) = self
            .channel
            .basic_get(self.names.dead_letter_queue.as_str().into(), BasicGetOptions::default())
            .await
            .expect("basic_get")
        {
            msg.delivery.ack(BasicAckOptions::default()).await.expect("ack dead letter");
            out.push(msg.delivery);
        }
    }

    async fn stock(&self) -> i64 {
        sqlx::query_scalar("SELECT qty FROM idem_amqp_stock WHERE sku = ?")
            .bind(&self.sku)
            .fetch_one(self.idem.pool())
            .await
            .expect("stock")
    }

    async fn moves(&self) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM idem_amqp_stock_moves WHERE sku = ?")
            .bind(&self.sku)
            .fetch_one(self.idem.pool())
            .await
            .expect("moves")
    }

    async fn cleanup(self) {
        let ch = &self.channel;
        ch.queue_delete(self.names.queue.as_str().into(), QueueDeleteOptions::default()).await.expect("delete queue");
        ch.queue_delete(self.names.dead_letter_queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .expect("delete dlq");
        ch.exchange_delete(self.names.exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .expect("delete dlx");
        let _ = self.conn.close(200, "bye".into()).await;
    }
}

fn count(seen: &[Settled], f: impl Fn(&Settled) -> bool) -> usize {
    seen.iter().filter(|s| f(s)).count()
}

fn event(order_id: i64, sku: &str, qty: i64) -> Vec<u8> {
    serde_json::to_vec(&OrderPaid { order_id, sku: sku.into(), qty, slow_ms: 0 }).unwrap()
}

/// The same event 5 times, one of them also delivered to a consumer that
/// went away before acking (so the broker redelivers it): deducted once,
/// every delivery acked, nothing dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_and_a_redelivery_deduct_once() {
    let Some(env) = env(100).await else { return };
    let order = order_id();
    for i in 1..=5 {
        env.publish(&event(order, &env.sku, 3), &format!("dup-{i}")).await;
    }

    // A consumer receives the first delivery and its channel closes unacked.
    {
        let ch = env.conn.create_channel().await.expect("channel");
        ch.basic_qos(1, BasicQosOptions::default()).await.expect("qos");
        let mut doomed = ch
            .basic_consume(
                env.names.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let first = std::future::poll_fn(|cx| futures_core_next(&mut doomed, cx)).await;
        let first = first.expect("a delivery").expect("ok delivery");
        assert!(!first.redelivered);
        assert_eq!(first.properties.message_id().as_ref().map(|s| s.as_str()), Some("dup-1"));
        ch.close(200, "dropped before ack".into()).await.expect("close");
    }

    let calls = Arc::new(AtomicUsize::new(0));
    let seen = env
        .consume(
            |c| c.concurrency(4).in_progress_delay(Duration::from_millis(50)),
            Arc::clone(&calls),
            |seen| count(seen, |s| s.action == Action::Ack) == 5,
        )
        .await;

    assert_eq!(count(&seen, |s| s.action == Action::Ack), 5, "{seen:#?}");
    assert_eq!(count(&seen, |s| s.outcome == Some(Outcome::Executed)), 1, "{seen:#?}");
    assert_eq!(count(&seen, |s| s.outcome == Some(Outcome::Replayed)), 4, "{seen:#?}");
    // Only InProgress may have caused anything else (requeued, then acked).
    assert!(seen.iter().all(|s| matches!(s.action, Action::Ack | Action::Requeue)), "{seen:#?}");
    assert!(
        seen.iter().any(|s| s.redelivered && s.message_id.as_deref() == Some("dup-1")),
        "the dropped delivery came back: {seen:#?}"
    );
    assert_eq!(env.stock().await, 97);
    assert_eq!(env.moves().await, 1);
    assert_eq!(env.ready(&env.names.queue).await, 0, "every delivery acked");
    assert!(env.drain_dead_letters(0).await.is_empty());
    env.cleanup().await;
}

/// A duplicate delivered while the first is still in its body is requeued
/// (not acked, not dead-lettered), comes back, and is acked as a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_during_the_body_is_requeued_then_replayed() {
    let Some(env) = env(100).await else { return };
    let order = order_id();
    let slow = serde_json::to_vec(&OrderPaid { order_id: order, sku: env.sku.clone(), qty: 2, slow_ms: 600 }).unwrap();
    env.publish(&slow, "slow-1").await;
    env.publish(&slow, "slow-2").await;

    let calls = Arc::new(AtomicUsize::new(0));
    let seen = env
        .consume(
            |c| c.concurrency(2).in_progress_delay(Duration::from_millis(100)),
            Arc::clone(&calls),
            |seen| count(seen, |s| s.action == Action::Ack) == 2,
        )
        .await;

    assert_eq!(count(&seen, |s| s.outcome == Some(Outcome::Executed)), 1, "{seen:#?}");
    assert_eq!(count(&seen, |s| s.outcome == Some(Outcome::Replayed)), 1, "{seen:#?}");
    let requeued = count(&seen, |s| s.action == Action::Requeue);
    assert!(requeued >= 1, "the duplicate arrived mid-body and was requeued: {seen:#?}");
    assert_eq!(count(&seen, |s| s.outcome == Some(Outcome::InProgress)), requeued, "{seen:#?}");
    assert_eq!(calls.load(SeqCst), 2 + requeued);
    assert_eq!(env.stock().await, 98);
    assert_eq!(env.moves().await, 1);
    assert_eq!(env.ready(&env.names.queue).await, 0);
    assert!(env.drain_dead_letters(0).await.is_empty());
    env.cleanup().await;
}

/// Polls lapin's consumer stream once (the test has no StreamExt).
fn futures_core_next(
    consumer: &mut lapin::Consumer,
    cx: &mut std::task::Context<'_>,
) -> std::task::Poll<Option<lapin::Result<lapin::message::Delivery>>> {
    futures_core::Stream::poll_next(std::pin::Pin::new(consumer), cx)
}

/// A poison message and a key reused with another quantity both end in the
/// dead-letter queue, once each; the first order is deducted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_and_key_reused_are_dead_lettered() {
    let Some(env) = env(100).await else { return };
    let order = order_id();
    let reused = event(order, &env.sku, 5);
    env.publish(&event(order, &env.sku, 2), "first").await;
    env.publish(&reused, "reused").await;
    env.publish(b"{not json", "poison").await;

    let calls = Arc::new(AtomicUsize::new(0));
    let seen = env.consume(|c| c, Arc::clone(&calls), |seen| seen.len() == 3).await;

    let by_id = |id: &str| seen.iter().find(|s| s.message_id.as_deref() == Some(id)).expect(id).clone();
    assert_eq!(by_id("first").action, Action::Ack);
    assert_eq!(by_id("first").outcome, Some(Outcome::Executed));
    assert_eq!(by_id("reused").action, Action::DeadLetter(Reason::KeyReused));
    assert_eq!(by_id("reused").outcome, Some(Outcome::KeyReused));
    assert_eq!(by_id("poison").action, Action::DeadLetter(Reason::Poison));
    assert_eq!(by_id("poison").outcome, None);
    assert_eq!(seen.len(), 3, "nothing requeued: {seen:#?}");
    assert_eq!(calls.load(SeqCst), 2, "the poison message never reached the handler");

    let dead = env.drain_dead_letters(2).await;
    let mut got: Vec<(String, Vec<u8>)> =
        dead.iter().map(|d| (d.properties.message_id().as_ref().unwrap().to_string(), d.data.clone())).collect();
    got.sort();
    assert_eq!(got, vec![("poison".to_string(), b"{not json".to_vec()), ("reused".to_string(), reused)]);
    for d in &dead {
        let headers = d.properties.headers().as_ref().expect("headers");
        assert!(headers.contains_key("x-death"), "dead-lettered by the broker: {headers:?}");
    }
    assert_eq!(env.stock().await, 98);
    assert_eq!(env.moves().await, 1);
    assert_eq!(env.ready(&env.names.queue).await, 0);
    env.cleanup().await;
}

/// A body that keeps failing runs exactly `max_retries + 1` times, then the
/// message is dead-lettered carrying its retry count; nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_body_is_retried_up_to_the_bound_then_dead_lettered() {
    let Some(env) = env(100).await else { return };
    let order = order_id();
    let unknown = common::unique("no-such-sku");
    env.publish(&event(order, &unknown, 1), "failing").await;

    let calls = Arc::new(AtomicUsize::new(0));
    let seen = env
        .consume(
            |c| c.max_retries(2).retry_delay(Duration::from_millis(50)),
            Arc::clone(&calls),
            |seen| seen.iter().any(|s| matches!(s.action, Action::DeadLetter(_))),
        )
        .await;

    let actions: Vec<(Action, u32)> = seen.iter().map(|s| (s.action, s.retries)).collect();
    assert_eq!(
        actions,
        vec![
            (Action::Retry { retries: 1 }, 0),
            (Action::Retry { retries: 2 }, 1),
            (Action::DeadLetter(Reason::RetriesExhausted), 2),
        ]
    );
    assert!(seen.iter().all(|s| s.outcome == Some(Outcome::Failed)), "{seen:#?}");
    assert!(seen.iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("UnknownSku"))), "{seen:#?}");
    assert_eq!(calls.load(SeqCst), 3, "1 attempt + 2 retries");

    let dead = env.drain_dead_letters(1).await;
    assert_eq!(dead.len(), 1);
    let retries =
        dead[0].properties.headers().as_ref().and_then(|h| h.inner().get(idem::amqp::RETRIES_HEADER).cloned());
    assert_eq!(retries, Some(AMQPValue::LongUInt(2)));
    assert_eq!(dead[0].properties.message_id().as_ref().map(|s| s.as_str()), Some("failing"));
    assert_eq!(env.ready(&env.names.queue).await, 0);
    assert_eq!(env.stock().await, 100);
    let moves: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_amqp_stock_moves WHERE order_id = ?")
        .bind(order)
        .fetch_one(env.idem.pool())
        .await
        .unwrap();
    assert_eq!(moves, 0);
    env.cleanup().await;
}
