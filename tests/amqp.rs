//! `idempotency::amqp` end to end: RabbitMQ (`IDEM_AMQP_URL`), MariaDB
//! (`IDEM_MYSQL_URL`) and Redis (`IDEM_REDIS_URL`). Every test uses its own
//! queues, SKUs and order ids, so they run in parallel and again.

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::process::Command;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idempotency::amqp::{Action, AsIdemError, Consumer, DeadLetter, Reason, Settled};
use idempotency::{Idem, Outcome, Status, Steps, idempotent};
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{MySql, Transaction};
use tokio::sync::{Notify, mpsc, oneshot};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPaid {
    order_id: i64,
    sku: String,
    qty: i64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Deducted {
    order_id: i64,
    qty: i64,
}

/// A quantity the test handler panics on, while being called.
const PANICS: i64 = -7;

#[derive(Debug)]
#[allow(dead_code)] // the fields show in assertion messages through Debug
enum StockError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
    UnknownSku(String),
    /// A final answer ([`reserve`] records it).
    OutOfStock(OutOfStock),
}

/// What `reserve` answers when the stock is short: recorded, replayed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct OutOfStock {
    sku: String,
    short: i64,
}

impl idempotency::BusinessError for StockError {
    type Record = OutOfStock;

    fn recorded(&self) -> Option<OutOfStock> {
        match self {
            StockError::OutOfStock(out) => Some(out.clone()),
            _ => None,
        }
    }

    fn replayed(record: OutOfStock) -> Self {
        StockError::OutOfStock(record)
    }
}

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

impl AsIdemError for StockError {
    fn idem_error(&self) -> Option<&idempotency::Error> {
        match self {
            StockError::Idem(e) => Some(e),
            _ => None,
        }
    }
}

/// How many times a body started, per SKU (tests run in parallel, each on
/// its own SKUs): a body that ran and rolled back leaves no row to count.
static BODY_RUNS: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);

/// Gates the next body of a SKU waits at, as it starts.
static BODY_GATES: Mutex<Option<HashMap<String, Arc<Notify>>>> = Mutex::new(None);

fn body_runs(sku: &str) -> usize {
    BODY_RUNS.lock().unwrap().as_ref().and_then(|runs| runs.get(sku).copied()).unwrap_or(0)
}

/// The next body run for `sku` waits, once started, until the returned
/// gate is opened (`notify_one`).
fn hold_next_body(sku: &str) -> Arc<Notify> {
    let gate = Arc::new(Notify::new());
    BODY_GATES.lock().unwrap().get_or_insert_with(HashMap::new).insert(sku.to_owned(), Arc::clone(&gate));
    gate
}

/// Counts the run, then waits at the SKU's gate if one is set.
async fn body_started(sku: &str) {
    *BODY_RUNS.lock().unwrap().get_or_insert_with(HashMap::new).entry(sku.to_owned()).or_default() += 1;
    let gate = BODY_GATES.lock().unwrap().as_mut().and_then(|gates| gates.remove(sku));
    if let Some(gate) = gate {
        gate.notified().await;
    }
}

#[idempotent(key = "order_paid_<event.order_id>", ttl = "7d", biz = "t_deduct_stock")]
async fn deduct_stock(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    event: OrderPaid,
) -> Result<Deducted, StockError> {
    body_started(&event.sku).await;
    let updated = sqlx::query("UPDATE idem_amqp_stock SET qty = qty - ? WHERE sku = ?")
        .bind(event.qty)
        .bind(&event.sku)
        .execute(&mut **tx)
        .await?;
    if updated.rows_affected() == 0 {
        return Err(StockError::UnknownSku(event.sku));
    }
    sqlx::query("INSERT INTO idem_amqp_stock_moves (order_id, sku, qty) VALUES (?, ?, ?)")
        .bind(event.order_id)
        .bind(&event.sku)
        .bind(-event.qty)
        .execute(&mut **tx)
        .await?;
    Ok(Deducted { order_id: event.order_id, qty: event.qty })
}

/// An event keyed by a reference that comes from outside, so it can break
/// the key rule.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Restocked {
    reference: String,
    sku: String,
    qty: i64,
}

#[idempotent(key = "restock_<event.reference>", ttl = "7d", biz = "t_restock")]
async fn restock(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, event: Restocked) -> Result<i64, StockError> {
    body_started(&event.sku).await;
    sqlx::query("UPDATE idem_amqp_stock SET qty = qty + ? WHERE sku = ?")
        .bind(event.qty)
        .bind(&event.sku)
        .execute(&mut **tx)
        .await?;
    sqlx::query("INSERT INTO idem_amqp_stock_moves (order_id, sku, qty) VALUES (0, ?, ?)")
        .bind(&event.sku)
        .bind(event.qty)
        .execute(&mut **tx)
        .await?;
    Ok(event.qty)
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
    idempotency_testkit::skip("rabbitmq");
    None
}

/// Everything one test needs, or `None` (after a `skipped:` line).
struct Env {
    conn: Connection,
    idem: Idem<MySql>,
    redis: redis::Client,
    /// For publishing (with confirms) and inspecting.
    channel: Channel,
    names: DeadLetter,
    sku: String,
}

/// The work queue declared by `idempotency::amqp::declare_with_dead_letter`.
async fn env(stock: i64) -> Option<Env> {
    env_with(stock, FieldTable::default()).await
}

/// As [`env`]; with `queue_args`, the work queue gets them on top of the
/// dead-letter arguments (`declare_with_dead_letter` takes none), under the
/// same names.
async fn env_with(stock: i64, queue_args: FieldTable) -> Option<Env> {
    let conn = rabbitmq().await?;
    let pool = idempotency_testkit::reach("mysql", || async {
        MySqlPoolOptions::new().max_connections(8).connect(&idempotency_testkit::mysql_url()).await.ok()
    })
    .await?;
    let redis = idempotency_testkit::redis_client().await?;
    let idem = Idem::builder(pool).redis(redis.clone()).build();
    idem.migrate().await.expect("migrate");
    sqlx::raw_sql(DDL).execute(idem.pool()).await.expect("stock tables");
    let sku = idempotency_testkit::unique("sku");
    sqlx::query("INSERT INTO idem_amqp_stock (sku, qty) VALUES (?, ?)")
        .bind(&sku)
        .bind(stock)
        .execute(idem.pool())
        .await
        .expect("stock row");

    let channel = conn.create_channel().await.expect("channel");
    channel.confirm_select(ConfirmSelectOptions::default()).await.expect("confirms");
    let queue = idempotency_testkit::unique("idem.test.order.paid");
    let names = if queue_args.inner().is_empty() {
        idempotency::amqp::declare_with_dead_letter(&channel, &queue).await.expect("declare queues")
    } else {
        declare_with_args(&channel, &queue, queue_args).await
    };
    Some(Env { conn, idem, redis, channel, names, sku })
}

/// What `declare_with_dead_letter` declares, plus `extra` on the work queue.
async fn declare_with_args(channel: &Channel, queue: &str, extra: FieldTable) -> DeadLetter {
    let names = DeadLetter {
        queue: queue.to_owned(),
        exchange: format!("{queue}.dlx"),
        dead_letter_queue: format!("{queue}.dlq"),
    };
    let durable = ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() };
    channel
        .exchange_declare(names.exchange.as_str().into(), ExchangeKind::Direct, durable, FieldTable::default())
        .await
        .expect("dlx");
    channel
        .queue_declare(names.dead_letter_queue.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
        .await
        .expect("dlq");
    channel
        .queue_bind(
            names.dead_letter_queue.as_str().into(),
            names.exchange.as_str().into(),
            queue.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind dlq");
    let mut args = extra;
    args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(names.exchange.as_str().into()));
    args.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(queue.into()));
    channel.queue_declare(queue.into(), QueueDeclareOptions::durable(), args).await.expect("queue");
    names
}

/// An order id no earlier run used (records live 7 days).
fn order_id() -> i64 {
    static COUNTER: AtomicI64 = AtomicI64::new(0);
    let micros = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as i64;
    micros * 1000 + COUNTER.fetch_add(1, SeqCst) % 1000
}

type Handled<T> = Pin<Box<dyn Future<Output = Result<T, StockError>> + Send>>;

/// The handler most tests run: counts its calls, panics on [`PANICS`] while
/// being called, else deducts.
fn deducting(idem: &Idem<MySql>, calls: &Arc<AtomicUsize>) -> impl Fn(OrderPaid) -> Handled<Deducted> + use<> {
    let (idem, calls) = (idem.clone(), Arc::clone(calls));
    move |event: OrderPaid| {
        calls.fetch_add(1, SeqCst);
        if event.qty == PANICS {
            panic!("the handler panics before it returns its future");
        }
        let idem = idem.clone();
        Box::pin(async move { deduct_stock(&idem, event).await })
    }
}

/// Polls `check` every 20 ms until it holds; fails after 30 s.
async fn wait_until<F: Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Awaits `future`, failing after 30 s.
async fn within<F: Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), future).await.unwrap_or_else(|_| panic!("timed out: {what}"))
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

    /// Runs a consumer with `handler` until `done` holds for the
    /// settlements so far; closes its channel, so anything it left unacked
    /// would go back to the queue. Returns the settlements.
    async fn consume<T, F, Fut, R>(
        &self,
        configure: impl FnOnce(Consumer) -> Consumer,
        handler: F,
        done: impl Fn(&[Settled]) -> bool,
    ) -> Vec<Settled>
    where
        T: DeserializeOwned + Send + 'static,
        F: Fn(T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, StockError>> + Send + 'static,
        R: Send + 'static,
    {
        let channel = self.conn.create_channel().await.expect("consumer channel");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let consumer = configure(Consumer::new(channel.clone(), self.names.queue.clone()))
            .on_settle(move |s| tx.send(s.clone()).expect("test listens"));
        let runner = tokio::spawn(consumer.run(
            async move {
                let _ = stopped.await;
            },
            handler,
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

/// Each settlement's action and the retries its delivery carried, in the
/// order of the attempts. A retry's copy is published before the original
/// is acked, so the copy can be settled (and reported) first.
fn by_attempt(seen: &[Settled]) -> Vec<(Action, u32)> {
    let mut actions: Vec<(Action, u32)> = seen.iter().map(|s| (s.action, s.delivery.retries)).collect();
    actions.sort_by_key(|&(_, retries)| retries);
    actions
}

fn count(seen: &[Settled], f: impl Fn(&Settled) -> bool) -> usize {
    seen.iter().filter(|s| f(s)).count()
}

fn event(order_id: i64, sku: &str, qty: i64) -> Vec<u8> {
    serde_json::to_vec(&OrderPaid { order_id, sku: sku.into(), qty }).unwrap()
}

fn message_id(d: &lapin::message::Delivery) -> Option<String> {
    d.properties.message_id().as_ref().map(|s| s.to_string())
}

fn retries_header(d: &lapin::message::Delivery) -> Option<AMQPValue> {
    d.properties.headers().as_ref().and_then(|h| h.inner().get(idempotency::amqp::RETRIES_HEADER).cloned())
}

fn dead_lettered_by_the_broker(d: &lapin::message::Delivery) -> bool {
    d.properties.headers().as_ref().is_some_and(|h| h.contains_key("x-death"))
}

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
            deducting(&env.idem, &calls),
            |seen| seen.iter().any(|s| matches!(s.action, Action::DeadLetter(_))),
        )
        .await;

    assert_eq!(
        by_attempt(&seen),
        vec![(Action::Retry { count: 1 }, 0), (Action::DeadLetter(Reason::RetriesExhausted), 1)]
    );
    assert!(seen.iter().all(|s| s.outcome.is_none()), "{seen:#?}");
    assert!(seen.iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("handler panicked"))), "{seen:#?}");
    assert_eq!(calls.load(SeqCst), 2, "1 attempt + 1 retry");
    assert_eq!(body_runs(&env.sku), 0);
    assert_eq!(env.drain_dead_letters(1).await.len(), 1);
    assert_eq!(env.ready(&env.names.queue).await, 0);
    assert_eq!(env.stock().await, 100);
    env.cleanup().await;
}

/// The README's case: a consumer commits the deduction and dies before its
/// ack; the broker redelivers, and the redelivery replays instead of
/// deducting again. With 4 more duplicates: every delivery acked as a
/// replay, the body ran once, nothing dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_and_a_redelivery_deduct_once() {
    let Some(env) = env(100).await else { return };
    let order = order_id();
    for i in 1..=5 {
        env.publish(&event(order, &env.sku, 3), &format!("dup-{i}")).await;
    }

    // The doomed consumer, on its own connection, prefetch 1: its handler
    // commits the first delivery, says so, and hangs before returning, so
    // the runner never acks; then the connection goes, as in a crash.
    let doomed_conn = rabbitmq().await.expect("rabbitmq answered a moment ago");
    let (committed_tx, mut committed) = mpsc::unbounded_channel();
    let doomed = {
        let idem = env.idem.clone();
        tokio::spawn(Consumer::new(doomed_conn.create_channel().await.expect("channel"), env.names.queue.clone()).run(
            std::future::pending::<()>(),
            move |event: OrderPaid| {
                let (idem, committed) = (idem.clone(), committed_tx.clone());
                async move {
                    let deducted = deduct_stock(&idem, event).await;
                    committed.send(deducted.is_ok()).expect("test listens");
                    std::future::pending::<()>().await;
                    deducted
                }
            },
        ))
    };
    assert_eq!(within("the doomed consumer's commit", committed.recv()).await, Some(true));
    assert_eq!((body_runs(&env.sku), env.moves().await, env.stock().await), (1, 1, 97), "committed before the crash");
    assert_eq!(env.ready(&env.names.queue).await, 4, "dup-1 is held unacked");
    doomed_conn.close(320, "consumer crashed".into()).await.expect("close doomed connection");
    doomed.abort();
    let _ = doomed.await;
    wait_until("the unacked delivery is back in the queue", || async { env.ready(&env.names.queue).await == 5 }).await;

    let calls = Arc::new(AtomicUsize::new(0));
    let seen = env
        .consume(
            |c| c.concurrency(4).in_progress_delay(Duration::from_millis(50)),
            deducting(&env.idem, &calls),
            |seen| seen.len() == 5,
        )
        .await;

    assert_eq!(seen.len(), 5, "{seen:#?}");
    assert!(seen.iter().all(|s| s.action == Action::Ack && s.outcome == Some(Outcome::Replayed)), "{seen:#?}");
    let mut ids: Vec<_> = seen.iter().map(|s| s.message_id.clone().unwrap()).collect();
    ids.sort();
    assert_eq!(ids, (1..=5).map(|i| format!("dup-{i}")).collect::<Vec<_>>());
    let redelivered: Vec<_> = seen.iter().filter(|s| s.delivery.redelivered).map(|s| s.message_id.as_deref()).collect();
    assert_eq!(redelivered, vec![Some("dup-1")], "only the crashed consumer's delivery came back: {seen:#?}");
    assert_eq!(calls.load(SeqCst), 5);
    assert_eq!(body_runs(&env.sku), 1, "the body ran once, in the consumer that crashed");
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
    env.publish(&event(order, &env.sku, 2), "dup-1").await;
    env.publish(&event(order, &env.sku, 2), "dup-2").await;

    // The first body waits until the duplicate has been requeued.
    let gate = hold_next_body(&env.sku);
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = env
        .consume(
            |c| c.concurrency(2).in_progress_delay(Duration::from_millis(20)),
            deducting(&env.idem, &calls),
            |seen| {
                if seen.iter().any(|s| s.action == Action::Requeue) {
                    gate.notify_one();
                }
                count(seen, |s| s.action == Action::Ack) == 2
            },
        )
        .await;

    assert_eq!(count(&seen, |s| s.outcome == Some(Outcome::Executed)), 1, "{seen:#?}");
    assert_eq!(count(&seen, |s| s.outcome == Some(Outcome::Replayed)), 1, "{seen:#?}");
    let requeued = count(&seen, |s| s.action == Action::Requeue);
    assert!(requeued >= 1, "the duplicate arrived mid-body and was requeued: {seen:#?}");
    assert_eq!(count(&seen, |s| s.outcome == Some(Outcome::InProgress)), requeued, "{seen:#?}");
    assert_eq!(seen.len(), 2 + requeued, "acked twice, requeued the rest: {seen:#?}");
    assert_eq!(calls.load(SeqCst), 2 + requeued);
    assert_eq!(body_runs(&env.sku), 1);
    assert_eq!(env.stock().await, 98);
    assert_eq!(env.moves().await, 1);
    assert_eq!(env.ready(&env.names.queue).await, 0);
    assert!(env.drain_dead_letters(0).await.is_empty());
    env.cleanup().await;
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
    let seen = env.consume(|c| c, deducting(&env.idem, &calls), |seen| seen.len() == 3).await;

    let by_id = |id: &str| seen.iter().find(|s| s.message_id.as_deref() == Some(id)).expect(id).clone();
    assert_eq!(by_id("first").action, Action::Ack);
    assert_eq!(by_id("first").outcome, Some(Outcome::Executed));
    assert_eq!(by_id("reused").action, Action::DeadLetter(Reason::KeyReused));
    assert_eq!(by_id("reused").outcome, Some(Outcome::KeyReused));
    assert_eq!(by_id("poison").action, Action::DeadLetter(Reason::Poison));
    assert_eq!(by_id("poison").outcome, None);
    assert_eq!(seen.len(), 3, "nothing requeued: {seen:#?}");
    assert_eq!(calls.load(SeqCst), 2, "the poison message never reached the handler");
    assert_eq!(body_runs(&env.sku), 1);

    let dead = env.drain_dead_letters(2).await;
    let mut got: Vec<(String, Vec<u8>)> = dead.iter().map(|d| (message_id(d).unwrap(), d.data.clone())).collect();
    got.sort();
    assert_eq!(got, vec![("poison".to_string(), b"{not json".to_vec()), ("reused".to_string(), reused)]);
    assert!(dead.iter().all(dead_lettered_by_the_broker));
    assert_eq!(env.stock().await, 98);
    assert_eq!(env.moves().await, 1);
    assert_eq!(env.ready(&env.names.queue).await, 0);
    env.cleanup().await;
}

/// A key that breaks the key rule (here a space in a reference from the
/// event) is settled as `Rejected`: dead-lettered at once, never retried;
/// the body never runs and nothing is written, no record either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_key_is_dead_lettered_and_nothing_written() {
    let Some(env) = env(100).await else { return };
    let reference = format!("bad ref {}", idempotency_testkit::unique("r"));
    let payload =
        serde_json::to_vec(&Restocked { reference: reference.clone(), sku: env.sku.clone(), qty: 5 }).unwrap();
    env.publish(&payload, "invalid-key").await;

    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (idem, calls) = (env.idem.clone(), Arc::clone(&calls));
        move |event: Restocked| {
            calls.fetch_add(1, SeqCst);
            let idem = idem.clone();
            async move { restock(&idem, event).await }
        }
    };
    let seen = env.consume(|c| c.retry_delay(Duration::from_millis(10)), handler, |seen| !seen.is_empty()).await;

    assert_eq!(seen.len(), 1, "settled once, never retried: {seen:#?}");
    assert_eq!(seen[0].action, Action::DeadLetter(Reason::Rejected));
    assert_eq!(seen[0].outcome, Some(Outcome::Rejected));
    assert_eq!(seen[0].delivery.retries, 0);
    assert!(seen[0].error.as_deref().is_some_and(|e| e.contains("InvalidKey")), "{seen:#?}");
    assert_eq!(calls.load(SeqCst), 1);
    assert_eq!(body_runs(&env.sku), 0, "the body never ran");

    let dead = env.drain_dead_letters(1).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(message_id(&dead[0]).as_deref(), Some("invalid-key"));
    assert_eq!(dead[0].data, payload);
    assert!(dead_lettered_by_the_broker(&dead[0]));
    assert_eq!(retries_header(&dead[0]), None);
    assert_eq!(env.ready(&env.names.queue).await, 0);
    assert_eq!(env.stock().await, 100);
    assert_eq!(env.moves().await, 0);
    let records: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM idem_record WHERE biz_type = 't_restock' AND idem_key LIKE ?")
            .bind(format!("%{}", reference.trim_start_matches("bad ref ")))
            .fetch_one(env.idem.pool())
            .await
            .unwrap();
    assert_eq!(records, 0);
    env.cleanup().await;
}

/// A body that keeps failing runs exactly `max_retries + 1` times, then the
/// message is dead-lettered carrying its retry count; nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_body_is_retried_up_to_the_bound_then_dead_lettered() {
    let Some(env) = env(100).await else { return };
    let order = order_id();
    let unknown = idempotency_testkit::unique("no-such-sku");
    env.publish(&event(order, &unknown, 1), "failing").await;

    let calls = Arc::new(AtomicUsize::new(0));
    let seen = env
        .consume(
            |c| c.max_retries(2).retry_delay(Duration::from_millis(50)),
            deducting(&env.idem, &calls),
            |seen| seen.iter().any(|s| matches!(s.action, Action::DeadLetter(_))),
        )
        .await;

    assert_eq!(
        by_attempt(&seen),
        vec![
            (Action::Retry { count: 1 }, 0),
            (Action::Retry { count: 2 }, 1),
            (Action::DeadLetter(Reason::RetriesExhausted), 2),
        ]
    );
    assert!(seen.iter().all(|s| s.outcome == Some(Outcome::Failed)), "{seen:#?}");
    assert!(seen.iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("UnknownSku"))), "{seen:#?}");
    assert_eq!(calls.load(SeqCst), 3, "1 attempt + 2 retries");
    assert_eq!(body_runs(&unknown), 3);

    let dead = env.drain_dead_letters(1).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(retries_header(&dead[0]), Some(AMQPValue::LongUInt(2)));
    assert_eq!(message_id(&dead[0]).as_deref(), Some("failing"));
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

/// Regression (issue 9 item 5): a database that is down (`Error::Storage`)
/// spent the delivery's retries, so a short outage dead-lettered every
/// message consumed during it. Now the delivery waits `storage_delay`, goes
/// back uncounted as often as the outage lasts (here 3 attempts, with
/// `max_retries(1)`), and once the database answers it executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_down_is_requeued_uncounted_then_executed_once() {
    let Some(env) = env(100).await else { return };
    env.publish(&event(order_id(), &env.sku, 3), "outage").await;

    // The same Redis in front of a database that refuses connections.
    let dead_pool = MySqlPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy("mysql://root@127.0.0.1:1/test")
        .expect("lazy pool");
    let down = Idem::builder(dead_pool).redis(env.redis.clone()).build();
    const OUTAGE_ATTEMPTS: usize = 3;
    let storage_delay = Duration::from_millis(250);

    let calls = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(Mutex::new(Vec::new()));
    let handler = {
        let (up, calls, started) = (env.idem.clone(), Arc::clone(&calls), Arc::clone(&started));
        move |event: OrderPaid| {
            let attempt = calls.fetch_add(1, SeqCst);
            started.lock().unwrap().push(Instant::now());
            let idem = if attempt < OUTAGE_ATTEMPTS { down.clone() } else { up.clone() };
            async move { deduct_stock(&idem, event).await }
        }
    };
    let seen = env
        .consume(
            |c| c.max_retries(1).retry_delay(Duration::from_millis(10)).storage_delay(storage_delay),
            handler,
            |seen| seen.iter().any(|s| s.action != Action::Requeue),
        )
        .await;

    let got: Vec<(Action, Option<Outcome>, u32, bool)> =
        seen.iter().map(|s| (s.action, s.outcome, s.delivery.retries, s.delivery.redelivered)).collect();
    assert_eq!(
        got,
        vec![
            (Action::Requeue, Some(Outcome::Failed), 0, false),
            (Action::Requeue, Some(Outcome::Failed), 0, true),
            (Action::Requeue, Some(Outcome::Failed), 0, true),
            (Action::Ack, Some(Outcome::Executed), 0, true),
        ],
        "{seen:#?}"
    );
    assert!(seen[..3].iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("Storage"))), "{seen:#?}");
    assert_eq!(calls.load(SeqCst), OUTAGE_ATTEMPTS + 1);
    let started = started.lock().unwrap().clone();
    for pair in started.windows(2) {
        assert!(pair[1] - pair[0] >= storage_delay, "requeued only after storage_delay: {started:?}");
    }
    assert_eq!(body_runs(&env.sku), 1, "the body never started while the database was down");
    assert_eq!(env.stock().await, 97);
    assert_eq!(env.moves().await, 1);
    assert_eq!(env.ready(&env.names.queue).await, 0);
    assert!(env.drain_dead_letters(0).await.is_empty());
    env.cleanup().await;
}

/// Regression (issue 9 item 5): a retry copy the broker refused was given
/// back uncounted, so a queue that could not take it (full, with
/// `x-overflow = reject-publish`) sent the message round forever. Now each
/// refused copy spends a retry: the message is dead-lettered once they are
/// spent, its body having run once; the message that filled the queue is
/// then handled normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_retry_copy_is_counted_then_dead_lettered() {
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(1));
    args.insert("x-overflow".into(), AMQPValue::LongString("reject-publish".into()));
    let Some(env) = env_with(100, args).await else { return };
    let unknown = idempotency_testkit::unique("no-such-sku");
    env.publish(&event(order_id(), &unknown, 1), "failing").await;

    // While the failing body holds, its delivery is unacked (not counted by
    // `x-max-length`), and the filler takes the queue's one place.
    let gate = hold_next_body(&unknown);
    let calls = Arc::new(AtomicUsize::new(0));
    let retry_delay = Duration::from_millis(100);
    let consuming = env.consume(
        |c| c.max_retries(2).retry_delay(retry_delay),
        deducting(&env.idem, &calls),
        |seen| seen.len() == 2,
    );
    let fill_then_open = async {
        wait_until("the failing body started", || async { body_runs(&unknown) == 1 }).await;
        env.publish(&event(order_id(), &env.sku, 2), "filler").await;
        let opened = Instant::now();
        gate.notify_one();
        opened
    };
    let (seen, opened) = tokio::join!(consuming, fill_then_open);

    let got: Vec<(Option<&str>, Action, Option<Outcome>, u32)> =
        seen.iter().map(|s| (s.message_id.as_deref(), s.action, s.outcome, s.delivery.retries)).collect();
    assert_eq!(
        got,
        vec![
            (Some("failing"), Action::DeadLetter(Reason::RetriesExhausted), Some(Outcome::Failed), 0),
            (Some("filler"), Action::Ack, Some(Outcome::Executed), 0),
        ],
        "{seen:#?}"
    );
    assert!(opened.elapsed() >= retry_delay * 2, "two refused copies, each after retry_delay");
    assert_eq!(calls.load(SeqCst), 2, "the refused copies never reached the handler");
    assert_eq!((body_runs(&unknown), body_runs(&env.sku)), (1, 1));

    let dead = env.drain_dead_letters(1).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(message_id(&dead[0]).as_deref(), Some("failing"));
    assert_eq!(retries_header(&dead[0]), None, "the original, never a copy");
    assert!(dead_lettered_by_the_broker(&dead[0]));
    assert_eq!(env.ready(&env.names.queue).await, 0);
    assert_eq!(env.stock().await, 98);
    assert_eq!(env.moves().await, 1);
    env.cleanup().await;
}

/// Regression (issue 9 item 5): a handler's `Ok` was overridden by the
/// outcome of its call, so a handler that dealt with a failure itself saw
/// its delivery retried. A handler returning `Ok` is acked once, never
/// retried nor dead-lettered, whatever its call returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_returning_ok_is_acked_whatever_the_outcome() {
    let Some(env) = env(100).await else { return };
    let order = order_id();
    let unknown = idempotency_testkit::unique("no-such-sku");
    env.publish(&event(order, &env.sku, 2), "first").await;
    env.publish(&event(order, &env.sku, 5), "reused").await;
    env.publish(&event(order_id(), &unknown, 1), "failing").await;

    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (idem, calls) = (env.idem.clone(), Arc::clone(&calls));
        move |event: OrderPaid| {
            calls.fetch_add(1, SeqCst);
            let idem = idem.clone();
            async move {
                // Dealt with here (say, logged): the delivery is done.
                let _ = deduct_stock(&idem, event).await;
                Ok::<(), StockError>(())
            }
        }
    };
    let seen =
        env.consume(|c| c.max_retries(3).retry_delay(Duration::from_millis(10)), handler, |seen| seen.len() == 3).await;

    // In settlement order, which is not delivery order: a slot is freed
    // before its delivery's ack, so the next handler can finish first.
    let mut got: Vec<(Option<&str>, Action, Option<Outcome>)> =
        seen.iter().map(|s| (s.message_id.as_deref(), s.action, s.outcome)).collect();
    got.sort_by_key(|(id, _, _)| *id);
    assert_eq!(
        got,
        vec![
            (Some("failing"), Action::Ack, Some(Outcome::Failed)),
            (Some("first"), Action::Ack, Some(Outcome::Executed)),
            (Some("reused"), Action::Ack, Some(Outcome::KeyReused)),
        ],
        "{seen:#?}"
    );
    assert!(seen.iter().all(|s| s.error.is_none() && s.delivery.retries == 0 && !s.delivery.redelivered), "{seen:#?}");
    assert_eq!(calls.load(SeqCst), 3);
    assert_eq!((body_runs(&env.sku), body_runs(&unknown)), (1, 1));
    assert_eq!(env.ready(&env.names.queue).await, 0, "nothing republished");
    assert!(env.drain_dead_letters(0).await.is_empty());
    assert_eq!(env.stock().await, 98);
    assert_eq!(env.moves().await, 1);
    env.cleanup().await;
}

/// Deducts, or declines for good when the stock would go below zero: the
/// deduction rolls back and the decline is recorded (`record_errors`).
#[idempotent(key = "reserve_<event.order_id>", ttl = "7d", biz = "t_reserve", record_errors)]
async fn reserve(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, event: OrderPaid) -> Result<(), StockError> {
    body_started(&event.sku).await;
    sqlx::query("UPDATE idem_amqp_stock SET qty = qty - ? WHERE sku = ?")
        .bind(event.qty)
        .bind(&event.sku)
        .execute(&mut **tx)
        .await?;
    let left: i64 = sqlx::query_scalar("SELECT qty FROM idem_amqp_stock WHERE sku = ?")
        .bind(&event.sku)
        .fetch_one(&mut **tx)
        .await?;
    if left < 0 {
        return Err(StockError::OutOfStock(OutOfStock { sku: event.sku, short: -left }));
    }
    sqlx::query("INSERT INTO idem_amqp_stock_moves (order_id, sku, qty) VALUES (?, ?, ?)")
        .bind(event.order_id)
        .bind(&event.sku)
        .bind(-event.qty)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Regression: a handler passing on its call's recorded decline was
/// settled `Retry {1}` (outcome `Executed`), `Retry {2}` (`Replayed`), then
/// dead-lettered (`RetriesExhausted`): a handled order in the dead-letter
/// queue. The decline and a duplicate of it are each acked once
/// (`AckRecorded`, counted under `ack_recorded`), the body ran once, its
/// deduction rolled back, the decline recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recorded_decline_and_its_duplicate_are_acked_once() {
    let Some(env) = env(1).await else { return };
    idempotency_testkit::counters::install();
    let order = order_id();
    env.publish(&event(order, &env.sku, 5), "decline").await;
    env.publish(&event(order, &env.sku, 5), "duplicate").await;

    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (idem, calls) = (env.idem.clone(), Arc::clone(&calls));
        move |event: OrderPaid| {
            calls.fetch_add(1, SeqCst);
            let idem = idem.clone();
            async move { reserve(&idem, event).await }
        }
    };
    let seen =
        env.consume(|c| c.max_retries(2).retry_delay(Duration::from_millis(10)), handler, |seen| seen.len() == 2).await;

    // Handled one at a time; reported in either order (a slot is freed before the ack).
    let mut got: Vec<(Option<&str>, Action, Option<Outcome>, u32)> =
        seen.iter().map(|s| (s.message_id.as_deref(), s.action, s.outcome, s.delivery.retries)).collect();
    got.sort_by_key(|(id, ..)| *id);
    assert_eq!(
        got,
        vec![
            (Some("decline"), Action::AckRecorded, Some(Outcome::Executed), 0),
            (Some("duplicate"), Action::AckRecorded, Some(Outcome::Replayed), 0),
        ],
        "settled once each: {seen:#?}"
    );
    assert!(seen.iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("OutOfStock"))), "{seen:#?}");
    assert_eq!(calls.load(SeqCst), 2, "never retried");
    assert_eq!(body_runs(&env.sku), 1, "the duplicate replayed the decline");
    assert_eq!((env.stock().await, env.moves().await), (1, 0), "the deduction rolled back");
    let key = format!("reserve_{order}");
    let recorded = format!(r#"{{"sku":"{}","short":4}}"#, env.sku);
    assert_eq!(env.idem.status("t_reserve", &key).await.unwrap(), Status::Failed { error: recorded });
    let records: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM idem_record WHERE biz_type = 't_reserve' AND idem_key = ?")
            .bind(&key)
            .fetch_one(env.idem.pool())
            .await
            .unwrap();
    assert_eq!(records, 1);
    let counted = idempotency_testkit::counters::counted_by(
        idempotency::metrics::CONSUMER_SETTLEMENTS,
        &[("queue", env.names.queue.as_str())],
        "action",
    );
    assert_eq!(counted, HashMap::from([("ack_recorded".to_owned(), 2)]));
    assert_eq!(env.ready(&env.names.queue).await, 0, "nothing republished");
    assert!(env.drain_dead_letters(0).await.is_empty());
    env.cleanup().await;
}

/// The two-phase mode's decline: the charge is refused for good, declared
/// permanent (`Error::Permanent`), recorded in `idem_call`.
#[idempotent(key = "charge_<event.order_id>", ttl = "7d", biz = "t_charge", steps)]
async fn charge(idem: &Idem<MySql>, steps: &mut Steps<MySql>, event: OrderPaid) -> Result<(), StockError> {
    body_started(&event.sku).await;
    Err(steps.permanent(&OutOfStock { sku: event.sku, short: event.qty }).into())
}

/// A `steps` call's permanent failure is its recorded answer too (it was
/// dead-lettered as `Rejected`): the delivery and a duplicate of it are
/// each acked once (`AckRecorded`), the body ran once, the failure recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_failure_and_its_duplicate_are_acked_once() {
    let Some(env) = env(100).await else { return };
    idempotency_testkit::counters::install();
    let order = order_id();
    env.publish(&event(order, &env.sku, 7), "refused").await;
    env.publish(&event(order, &env.sku, 7), "again").await;

    let handler = {
        let idem = env.idem.clone();
        move |event: OrderPaid| {
            let idem = idem.clone();
            async move { charge(&idem, event).await }
        }
    };
    let seen =
        env.consume(|c| c.max_retries(2).retry_delay(Duration::from_millis(10)), handler, |seen| seen.len() == 2).await;

    let mut got: Vec<(Option<&str>, Action, Option<Outcome>, u32)> =
        seen.iter().map(|s| (s.message_id.as_deref(), s.action, s.outcome, s.delivery.retries)).collect();
    got.sort_by_key(|(id, ..)| *id);
    assert_eq!(
        got,
        vec![
            (Some("again"), Action::AckRecorded, Some(Outcome::Replayed), 0),
            (Some("refused"), Action::AckRecorded, Some(Outcome::Executed), 0),
        ],
        "settled once each: {seen:#?}"
    );
    assert!(seen.iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("Permanent"))), "{seen:#?}");
    assert_eq!(body_runs(&env.sku), 1, "the duplicate replayed the failure");
    let recorded: Vec<(i16, String)> =
        sqlx::query_as("SELECT status, response FROM idem_call WHERE biz_type = 't_charge' AND idem_key = ?")
            .bind(format!("charge_{order}"))
            .fetch_all(env.idem.pool())
            .await
            .unwrap();
    assert_eq!(recorded, [(2, format!(r#"{{"sku":"{}","short":7}}"#, env.sku))]);
    let counted = idempotency_testkit::counters::counted_by(
        idempotency::metrics::CONSUMER_SETTLEMENTS,
        &[("queue", env.names.queue.as_str())],
        "action",
    );
    assert_eq!(counted, HashMap::from([("ack_recorded".to_owned(), 2)]));
    assert_eq!(env.ready(&env.names.queue).await, 0, "nothing republished");
    assert!(env.drain_dead_letters(0).await.is_empty());
    env.cleanup().await;
}
