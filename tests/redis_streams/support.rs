//! What the Redis Streams tests share: the stock service (its events,
//! errors and `#[idempotent]` handlers), one test's world (a stream of its
//! own on the shared Redis, an engine on MariaDB) and a running consumer.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotency::redis_streams::{Action, AsIdemError, Consumer, Settled};
use idempotency::{Idem, Outcome, idempotent};
use redis::Value;
use redis::aio::MultiplexedConnection;
use serde::{Deserialize, Serialize};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{MySql, Transaction};
use tokio::sync::{Notify, mpsc, oneshot};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct OrderPaid {
    pub(crate) order_id: i64,
    pub(crate) sku: String,
    pub(crate) qty: i64,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Deducted {
    pub(crate) order_id: i64,
    pub(crate) qty: i64,
}

/// A quantity the test handler panics on, while being called.
pub(crate) const PANICS: i64 = -7;

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug
pub(crate) enum StockError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
    UnknownSku(String),
    RolledBack,
    /// A final answer ([`reserve`] records it).
    OutOfStock(OutOfStock),
}

/// What `reserve` answers when the stock is short: recorded, replayed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct OutOfStock {
    pub(crate) sku: String,
    pub(crate) short: i64,
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

/// How many times a body started, per SKU (a body that ran and rolled back
/// leaves no row to count).
pub(crate) static BODY_RUNS: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);
/// Gates the next body of a SKU waits at, once started.
pub(crate) static BODY_GATES: Mutex<Option<HashMap<String, Arc<Notify>>>> = Mutex::new(None);

pub(crate) fn body_runs(sku: &str) -> usize {
    BODY_RUNS.lock().unwrap().as_ref().and_then(|runs| runs.get(sku).copied()).unwrap_or(0)
}

pub(crate) fn hold_next_body(sku: &str) -> Arc<Notify> {
    let gate = Arc::new(Notify::new());
    BODY_GATES.lock().unwrap().get_or_insert_with(HashMap::new).insert(sku.to_owned(), Arc::clone(&gate));
    gate
}

pub(crate) async fn body_started(sku: &str) {
    *BODY_RUNS.lock().unwrap().get_or_insert_with(HashMap::new).entry(sku.to_owned()).or_default() += 1;
    let gate = BODY_GATES.lock().unwrap().as_mut().and_then(|gates| gates.remove(sku));
    if let Some(gate) = gate {
        gate.notified().await;
    }
}

#[idempotent(key = "order_paid_<event.order_id>", ttl = "7d", biz = "t_rs_deduct")]
pub(crate) async fn deduct_stock(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    event: OrderPaid,
) -> Result<Deducted, StockError> {
    deduct_in(tx, event).await
}

/// Keyed by the entry's message id field, not by business fields.
#[idempotent(key = "<message_id>", ttl = "7d", biz = "t_rs_deduct_id")]
pub(crate) async fn deduct_by_id(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    message_id: String,
    event: OrderPaid,
) -> Result<Deducted, StockError> {
    let _ = &message_id;
    deduct_in(tx, event).await
}

/// Deducts, or declines for good when the stock would go below zero: the
/// deduction rolls back and the decline is recorded (`record_errors`).
#[idempotent(key = "reserve_<event.order_id>", ttl = "7d", biz = "t_rs_reserve", record_errors)]
pub(crate) async fn reserve(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    event: OrderPaid,
) -> Result<Deducted, StockError> {
    let sku = event.sku.clone();
    let deducted = deduct_in(tx, event).await?;
    let left: i64 =
        sqlx::query_scalar("SELECT qty FROM idem_rs_stock WHERE sku = ?").bind(&sku).fetch_one(&mut **tx).await?;
    if left < 0 {
        return Err(StockError::OutOfStock(OutOfStock { sku, short: -left }));
    }
    Ok(deducted)
}

/// The deduction both keyings share: the stock and a move, or `UnknownSku`.
pub(crate) async fn deduct_in(tx: &mut Transaction<'_, MySql>, event: OrderPaid) -> Result<Deducted, StockError> {
    body_started(&event.sku).await;
    let updated = sqlx::query("UPDATE idem_rs_stock SET qty = qty - ? WHERE sku = ?")
        .bind(event.qty)
        .bind(&event.sku)
        .execute(&mut **tx)
        .await?;
    if updated.rows_affected() == 0 {
        return Err(StockError::UnknownSku(event.sku));
    }
    sqlx::query("INSERT INTO idem_rs_moves (order_id, sku, qty) VALUES (?, ?, ?)")
        .bind(event.order_id)
        .bind(&event.sku)
        .bind(-event.qty)
        .execute(&mut **tx)
        .await?;
    Ok(Deducted { order_id: event.order_id, qty: event.qty })
}

/// An event keyed by a reference from outside, so it can break the key rule.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Restocked {
    pub(crate) reference: String,
    pub(crate) sku: String,
    pub(crate) qty: i64,
}

#[idempotent(key = "restock_<event.reference>", ttl = "7d", biz = "t_rs_restock")]
pub(crate) async fn restock(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    event: Restocked,
) -> Result<i64, StockError> {
    body_started(&event.sku).await;
    sqlx::query("UPDATE idem_rs_stock SET qty = qty + ? WHERE sku = ?")
        .bind(event.qty)
        .bind(&event.sku)
        .execute(&mut **tx)
        .await?;
    Ok(event.qty)
}

pub(crate) const DDL: &str =
    "CREATE TABLE IF NOT EXISTS idem_rs_stock (sku VARCHAR(64) PRIMARY KEY, qty BIGINT NOT NULL);
    CREATE TABLE IF NOT EXISTS idem_rs_moves (id BIGINT AUTO_INCREMENT PRIMARY KEY,
        order_id BIGINT NOT NULL, sku VARCHAR(64) NOT NULL, qty BIGINT NOT NULL, KEY (sku), KEY (order_id))";

/// An order id no earlier run used (records live 7 days).
pub(crate) fn order_id() -> i64 {
    static COUNTER: AtomicI64 = AtomicI64::new(0);
    let micros = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as i64;
    micros * 1000 + COUNTER.fetch_add(1, SeqCst) % 1000
}

pub(crate) fn event(order_id: i64, sku: &str, qty: i64) -> Vec<u8> {
    serde_json::to_vec(&OrderPaid { order_id, sku: sku.into(), qty }).unwrap()
}

/// Awaits `future`, failing after 30 s.
pub(crate) async fn within<F: Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), future).await.unwrap_or_else(|_| panic!("timed out: {what}"))
}

// ---------------------------------------------------------------- the world of one test

/// A stream of its own on the shared Redis, an engine on MariaDB with the
/// Redis gate, a SKU of its own.
pub(crate) struct World {
    pub(crate) idem: Idem<MySql>,
    pub(crate) client: redis::Client,
    pub(crate) conn: MultiplexedConnection,
    pub(crate) stream: String,
    pub(crate) dead: String,
    pub(crate) sku: String,
}

pub(crate) const GROUP: &str = "stock";

pub(crate) async fn mysql_engine(client: Option<&redis::Client>) -> Option<Idem<MySql>> {
    let pool = idempotency_testkit::reach("mysql", || async {
        MySqlPoolOptions::new().max_connections(8).connect(&idempotency_testkit::mysql_url()).await.ok()
    })
    .await?;
    Some(engine_on(pool, client).await)
}

/// An engine on `pool` (migrated, with the stock tables), with `client` as its gate.
pub(crate) async fn engine_on(pool: sqlx::Pool<MySql>, client: Option<&redis::Client>) -> Idem<MySql> {
    let builder = Idem::builder(pool);
    let idem = match client {
        Some(client) => builder.redis(client.clone()).build(),
        None => builder.build(),
    };
    idem.migrate().await.expect("migrate");
    sqlx::raw_sql(DDL).execute(idem.pool()).await.expect("stock tables");
    idem
}

pub(crate) async fn world(stock: i64) -> Option<World> {
    let client = idempotency_testkit::redis_client().await?;
    let idem = mysql_engine(Some(&client)).await?;
    Some(world_on(idem, client, stock).await)
}

pub(crate) async fn world_on(idem: Idem<MySql>, client: redis::Client, stock: i64) -> World {
    let sku = idempotency_testkit::unique("rs-sku");
    sqlx::query("INSERT INTO idem_rs_stock (sku, qty) VALUES (?, ?)")
        .bind(&sku)
        .bind(stock)
        .execute(idem.pool())
        .await
        .expect("stock row");
    let conn = client.get_multiplexed_async_connection().await.expect("redis connection");
    let stream = idempotency_testkit::unique("idem-test-rs");
    let dead = format!("{stream}:dead");
    World { idem, client, conn, stream, dead, sku }
}

/// One pending entry as `XPENDING <stream> <group> - + N` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pending {
    pub(crate) id: String,
    pub(crate) consumer: String,
    pub(crate) idle_ms: u64,
    pub(crate) delivered: u64,
}

impl World {
    pub(crate) fn conn(&self) -> MultiplexedConnection {
        self.conn.clone()
    }

    /// `XADD` with these fields; the entry's id.
    pub(crate) async fn add(&self, fields: &[(&str, &[u8])]) -> String {
        add_to(&mut self.conn(), &self.stream, fields).await
    }

    /// An `OrderPaid` entry with a message id.
    pub(crate) async fn add_event(&self, order: i64, qty: i64, message_id: &str) -> String {
        self.add(&[("message_id", message_id.as_bytes()), ("payload", &event(order, &self.sku, qty))]).await
    }

    pub(crate) async fn pending(&self) -> Vec<Pending> {
        pending_of(&mut self.conn(), &self.stream).await
    }

    /// The dead-letter stream's entries: id and fields (values as text).
    pub(crate) async fn dead_letters(&self) -> Vec<HashMap<String, String>> {
        let reply: Value =
            redis::cmd("XRANGE").arg(&self.dead).arg("-").arg("+").query_async(&mut self.conn()).await.unwrap();
        entries(&reply).into_iter().map(|(_, fields)| fields).collect()
    }

    pub(crate) async fn length(&self, stream: &str) -> u64 {
        redis::cmd("XLEN").arg(stream).query_async(&mut self.conn()).await.unwrap()
    }

    pub(crate) async fn stock(&self) -> i64 {
        sqlx::query_scalar("SELECT qty FROM idem_rs_stock WHERE sku = ?")
            .bind(&self.sku)
            .fetch_one(self.idem.pool())
            .await
            .unwrap()
    }

    pub(crate) async fn moves(&self) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM idem_rs_moves WHERE sku = ?")
            .bind(&self.sku)
            .fetch_one(self.idem.pool())
            .await
            .unwrap()
    }

    /// A consumer of the world's stream with quick delays and claims,
    /// configured further by `configure`.
    pub(crate) fn consumer(&self, name: &str) -> Consumer {
        Consumer::new(self.client.clone(), self.stream.clone(), GROUP)
            .consumer_name(name)
            .claim_idle(Duration::from_millis(1500))
            .claim_interval(Duration::from_millis(50))
            .retry_delay(Duration::from_millis(100))
            .in_progress_delay(Duration::from_millis(100))
            .storage_delay(Duration::from_millis(100))
    }

    /// Runs `consumer` with the deducting handler (`by_id`: keyed by the
    /// message id); settlements arrive on the receiver.
    pub(crate) fn run(&self, consumer: Consumer, by_id: bool) -> Running {
        let idem = self.idem.clone();
        let calls = Arc::new(AtomicUsize::new(0));
        let handler_calls = Arc::clone(&calls);
        spawn_consumer(consumer, move |shutdown, consumer| {
            Box::pin(async move {
                if by_id {
                    consumer
                        .run_with_id(shutdown, move |id: String, event: OrderPaid| {
                            handler_calls.fetch_add(1, SeqCst);
                            let idem = idem.clone();
                            async move { deduct_by_id(&idem, id, event).await }
                        })
                        .await
                } else {
                    consumer
                        .run(shutdown, move |event: OrderPaid| {
                            handler_calls.fetch_add(1, SeqCst);
                            if event.qty == PANICS {
                                panic!("the handler panics before it returns its future");
                            }
                            let idem = idem.clone();
                            async move { deduct_stock(&idem, event).await }
                        })
                        .await
                }
            })
        })
        .with_calls(calls)
    }

    pub(crate) async fn remove(self) {
        let _: () = redis::cmd("DEL").arg(&self.stream).arg(&self.dead).query_async(&mut self.conn()).await.unwrap();
    }
}

pub(crate) async fn add_to(conn: &mut MultiplexedConnection, stream: &str, fields: &[(&str, &[u8])]) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (field, value) in fields {
        cmd.arg(*field).arg(*value);
    }
    cmd.query_async(conn).await.expect("XADD")
}

pub(crate) async fn pending_of(conn: &mut MultiplexedConnection, stream: &str) -> Vec<Pending> {
    let rows: Vec<(String, String, u64, u64)> =
        redis::cmd("XPENDING").arg(stream).arg(GROUP).arg("-").arg("+").arg(1000).query_async(conn).await.unwrap();
    rows.into_iter().map(|(id, consumer, idle_ms, delivered)| Pending { id, consumer, idle_ms, delivered }).collect()
}

/// `[[id, [field, value, ...]], ...]` as ids and text fields.
pub(crate) fn entries(reply: &Value) -> Vec<(String, HashMap<String, String>)> {
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        other => format!("{other:?}"),
    };
    let Value::Array(rows) = reply else { panic!("not entries: {reply:?}") };
    rows.iter()
        .map(|row| {
            let Value::Array(parts) = row else { panic!("not an entry: {row:?}") };
            let Value::Array(flat) = &parts[1] else { panic!("no fields: {row:?}") };
            (text(&parts[0]), flat.chunks(2).map(|kv| (text(&kv[0]), text(&kv[1]))).collect())
        })
        .collect()
}

/// A running consumer: its settlements, how to stop it, its task.
pub(crate) struct Running {
    pub(crate) settlements: mpsc::UnboundedReceiver<Settled>,
    pub(crate) stop: Option<oneshot::Sender<()>>,
    pub(crate) task: tokio::task::JoinHandle<redis::RedisResult<()>>,
    pub(crate) calls: Arc<AtomicUsize>,
}

pub(crate) type RunFuture = Pin<Box<dyn Future<Output = redis::RedisResult<()>> + Send>>;
pub(crate) type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

pub(crate) fn spawn_consumer(
    consumer: Consumer,
    run: impl FnOnce(Shutdown, Consumer) -> RunFuture + Send + 'static,
) -> Running {
    let (settled, settlements) = mpsc::unbounded_channel();
    let consumer = consumer.on_settle(move |s| {
        let _ = settled.send(s.clone());
    });
    let (stop, stopped) = oneshot::channel::<()>();
    let shutdown: Shutdown = Box::pin(async move {
        let _ = stopped.await;
    });
    let task = tokio::spawn(run(shutdown, consumer));
    Running { settlements, stop: Some(stop), task, calls: Arc::default() }
}

impl Running {
    pub(crate) fn with_calls(mut self, calls: Arc<AtomicUsize>) -> Self {
        self.calls = calls;
        self
    }

    pub(crate) async fn next(&mut self) -> Settled {
        within("a settlement", self.settlements.recv()).await.expect("the runner is alive")
    }

    /// Settlements until `done` holds for them.
    pub(crate) async fn until(&mut self, done: impl Fn(&[Settled]) -> bool) -> Vec<Settled> {
        let mut seen = Vec::new();
        while !done(&seen) {
            seen.push(self.next().await);
        }
        seen
    }

    /// Stops the runner, waits for it to end cleanly; what it settled meanwhile.
    pub(crate) async fn stop(mut self) -> Vec<Settled> {
        let _ = self.stop.take().expect("not stopped yet").send(());
        within("the runner's stop", self.task).await.expect("runner task").expect("the runner ends cleanly");
        let mut rest = Vec::new();
        while let Ok(s) = self.settlements.try_recv() {
            rest.push(s);
        }
        rest
    }
}

pub(crate) fn actions(seen: &[Settled]) -> Vec<(Action, Option<Outcome>, u64)> {
    seen.iter().map(|s| (s.action, s.outcome, s.delivery.count)).collect()
}
