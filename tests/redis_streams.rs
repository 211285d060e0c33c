//! `idem::redis_streams` end to end: the shared Redis (`IDEM_REDIS_URL`),
//! MariaDB (`IDEM_MYSQL_URL`), and for the outage a private `redis-server`.
//! Every test uses its own stream, SKUs and order ids, so they run in
//! parallel and again; the streams are deleted at the end.
//!
//! The settlement table row by row (each asserting the exact Redis state:
//! acked, pending with which delivery count, the dead-letter entry and its
//! fields), duplicates and a redelivery, a consumer process killed with
//! SIGKILL between its commit and its `XACK` (another takes the entry over
//! and replays), a stop in the middle of a read, Redis down and back, and
//! the whole path through an outbox relay with duplicates and kills,
//! reconciled.

use std::collections::HashMap;
use std::future::Future;
use std::io::{BufRead, BufReader};
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idem::redis_streams::{Action, AsIdemError, Consumer, Reason, Settled};
use idem::{Idem, Outcome, idempotent};
use redis::aio::MultiplexedConnection;
use redis::{RedisResult, Value};
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
#[allow(dead_code)] // shown through Debug
enum StockError {
    Idem(idem::Error),
    Db(sqlx::Error),
    UnknownSku(String),
    RolledBack,
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

impl AsIdemError for StockError {
    fn idem_error(&self) -> Option<&idem::Error> {
        match self {
            StockError::Idem(e) => Some(e),
            _ => None,
        }
    }
}

/// How many times a body started, per SKU (a body that ran and rolled back
/// leaves no row to count).
static BODY_RUNS: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);
/// Gates the next body of a SKU waits at, once started.
static BODY_GATES: Mutex<Option<HashMap<String, Arc<Notify>>>> = Mutex::new(None);

fn body_runs(sku: &str) -> usize {
    BODY_RUNS.lock().unwrap().as_ref().and_then(|runs| runs.get(sku).copied()).unwrap_or(0)
}

fn hold_next_body(sku: &str) -> Arc<Notify> {
    let gate = Arc::new(Notify::new());
    BODY_GATES.lock().unwrap().get_or_insert_with(HashMap::new).insert(sku.to_owned(), Arc::clone(&gate));
    gate
}

async fn body_started(sku: &str) {
    *BODY_RUNS.lock().unwrap().get_or_insert_with(HashMap::new).entry(sku.to_owned()).or_default() += 1;
    let gate = BODY_GATES.lock().unwrap().as_mut().and_then(|gates| gates.remove(sku));
    if let Some(gate) = gate {
        gate.notified().await;
    }
}

#[idempotent(key = "order_paid_<event.order_id>", ttl = "7d", biz = "t_rs_deduct")]
async fn deduct_stock(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    event: OrderPaid,
) -> Result<Deducted, StockError> {
    deduct_in(tx, event).await
}

/// Keyed by the entry's message id field, not by business fields.
#[idempotent(key = "<message_id>", ttl = "7d", biz = "t_rs_deduct_id")]
async fn deduct_by_id(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    message_id: String,
    event: OrderPaid,
) -> Result<Deducted, StockError> {
    let _ = &message_id;
    deduct_in(tx, event).await
}

/// The deduction both keyings share: the stock and a move, or `UnknownSku`.
async fn deduct_in(tx: &mut Transaction<'_, MySql>, event: OrderPaid) -> Result<Deducted, StockError> {
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
struct Restocked {
    reference: String,
    sku: String,
    qty: i64,
}

#[idempotent(key = "restock_<event.reference>", ttl = "7d", biz = "t_rs_restock")]
async fn restock(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, event: Restocked) -> Result<i64, StockError> {
    body_started(&event.sku).await;
    sqlx::query("UPDATE idem_rs_stock SET qty = qty + ? WHERE sku = ?")
        .bind(event.qty)
        .bind(&event.sku)
        .execute(&mut **tx)
        .await?;
    Ok(event.qty)
}

const DDL: &str = "CREATE TABLE IF NOT EXISTS idem_rs_stock (sku VARCHAR(64) PRIMARY KEY, qty BIGINT NOT NULL);
    CREATE TABLE IF NOT EXISTS idem_rs_moves (id BIGINT AUTO_INCREMENT PRIMARY KEY,
        order_id BIGINT NOT NULL, sku VARCHAR(64) NOT NULL, qty BIGINT NOT NULL, KEY (sku), KEY (order_id))";

/// An order id no earlier run used (records live 7 days).
fn order_id() -> i64 {
    static COUNTER: AtomicI64 = AtomicI64::new(0);
    let micros = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as i64;
    micros * 1000 + COUNTER.fetch_add(1, SeqCst) % 1000
}

fn event(order_id: i64, sku: &str, qty: i64) -> Vec<u8> {
    serde_json::to_vec(&OrderPaid { order_id, sku: sku.into(), qty }).unwrap()
}

/// Awaits `future`, failing after 30 s.
async fn within<F: Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), future).await.unwrap_or_else(|_| panic!("timed out: {what}"))
}

// ---------------------------------------------------------------- the world of one test

/// A stream of its own on the shared Redis, an engine on MariaDB with the
/// Redis gate, a SKU of its own.
struct World {
    idem: Idem<MySql>,
    client: redis::Client,
    conn: MultiplexedConnection,
    stream: String,
    dead: String,
    sku: String,
}

const GROUP: &str = "stock";

async fn mysql_engine(client: Option<&redis::Client>) -> Option<Idem<MySql>> {
    let pool = idem_testkit::reach("mysql", || async {
        MySqlPoolOptions::new().max_connections(8).connect(&idem_testkit::mysql_url()).await.ok()
    })
    .await?;
    Some(engine_on(pool, client).await)
}

/// An engine on `pool` (migrated, with the stock tables), with `client` as its gate.
async fn engine_on(pool: sqlx::Pool<MySql>, client: Option<&redis::Client>) -> Idem<MySql> {
    let builder = Idem::builder(pool);
    let idem = match client {
        Some(client) => builder.redis(client.clone()).build(),
        None => builder.build(),
    };
    idem.migrate().await.expect("migrate");
    sqlx::raw_sql(DDL).execute(idem.pool()).await.expect("stock tables");
    idem
}

async fn world(stock: i64) -> Option<World> {
    let client = idem_testkit::redis_client().await?;
    let idem = mysql_engine(Some(&client)).await?;
    Some(world_on(idem, client, stock).await)
}

async fn world_on(idem: Idem<MySql>, client: redis::Client, stock: i64) -> World {
    let sku = idem_testkit::unique("rs-sku");
    sqlx::query("INSERT INTO idem_rs_stock (sku, qty) VALUES (?, ?)")
        .bind(&sku)
        .bind(stock)
        .execute(idem.pool())
        .await
        .expect("stock row");
    let conn = client.get_multiplexed_async_connection().await.expect("redis connection");
    let stream = idem_testkit::unique("idem-test-rs");
    let dead = format!("{stream}:dead");
    World { idem, client, conn, stream, dead, sku }
}

/// One pending entry as `XPENDING <stream> <group> - + N` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pending {
    id: String,
    consumer: String,
    idle_ms: u64,
    delivered: u64,
}

impl World {
    fn conn(&self) -> MultiplexedConnection {
        self.conn.clone()
    }

    /// `XADD` with these fields; the entry's id.
    async fn add(&self, fields: &[(&str, &[u8])]) -> String {
        add_to(&mut self.conn(), &self.stream, fields).await
    }

    /// An `OrderPaid` entry with a message id.
    async fn add_event(&self, order: i64, qty: i64, message_id: &str) -> String {
        self.add(&[("message_id", message_id.as_bytes()), ("payload", &event(order, &self.sku, qty))]).await
    }

    async fn pending(&self) -> Vec<Pending> {
        pending_of(&mut self.conn(), &self.stream).await
    }

    /// The dead-letter stream's entries: id and fields (values as text).
    async fn dead_letters(&self) -> Vec<HashMap<String, String>> {
        let reply: Value =
            redis::cmd("XRANGE").arg(&self.dead).arg("-").arg("+").query_async(&mut self.conn()).await.unwrap();
        entries(&reply).into_iter().map(|(_, fields)| fields).collect()
    }

    async fn length(&self, stream: &str) -> u64 {
        redis::cmd("XLEN").arg(stream).query_async(&mut self.conn()).await.unwrap()
    }

    async fn stock(&self) -> i64 {
        sqlx::query_scalar("SELECT qty FROM idem_rs_stock WHERE sku = ?")
            .bind(&self.sku)
            .fetch_one(self.idem.pool())
            .await
            .unwrap()
    }

    async fn moves(&self) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM idem_rs_moves WHERE sku = ?")
            .bind(&self.sku)
            .fetch_one(self.idem.pool())
            .await
            .unwrap()
    }

    /// A consumer of the world's stream with quick delays and claims,
    /// configured further by `configure`.
    fn consumer(&self, name: &str) -> Consumer {
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
    fn run(&self, consumer: Consumer, by_id: bool) -> Running {
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

    async fn remove(self) {
        let _: () = redis::cmd("DEL").arg(&self.stream).arg(&self.dead).query_async(&mut self.conn()).await.unwrap();
    }
}

async fn add_to(conn: &mut MultiplexedConnection, stream: &str, fields: &[(&str, &[u8])]) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (field, value) in fields {
        cmd.arg(*field).arg(*value);
    }
    cmd.query_async(conn).await.expect("XADD")
}

async fn pending_of(conn: &mut MultiplexedConnection, stream: &str) -> Vec<Pending> {
    let rows: Vec<(String, String, u64, u64)> =
        redis::cmd("XPENDING").arg(stream).arg(GROUP).arg("-").arg("+").arg(1000).query_async(conn).await.unwrap();
    rows.into_iter().map(|(id, consumer, idle_ms, delivered)| Pending { id, consumer, idle_ms, delivered }).collect()
}

/// `[[id, [field, value, ...]], ...]` as ids and text fields.
fn entries(reply: &Value) -> Vec<(String, HashMap<String, String>)> {
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
struct Running {
    settlements: mpsc::UnboundedReceiver<Settled>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<redis::RedisResult<()>>,
    calls: Arc<AtomicUsize>,
}

type RunFuture = Pin<Box<dyn Future<Output = redis::RedisResult<()>> + Send>>;
type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

fn spawn_consumer(consumer: Consumer, run: impl FnOnce(Shutdown, Consumer) -> RunFuture + Send + 'static) -> Running {
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
    fn with_calls(mut self, calls: Arc<AtomicUsize>) -> Self {
        self.calls = calls;
        self
    }

    async fn next(&mut self) -> Settled {
        within("a settlement", self.settlements.recv()).await.expect("the runner is alive")
    }

    /// Settlements until `done` holds for them.
    async fn until(&mut self, done: impl Fn(&[Settled]) -> bool) -> Vec<Settled> {
        let mut seen = Vec::new();
        while !done(&seen) {
            seen.push(self.next().await);
        }
        seen
    }

    /// Stops the runner, waits for it to end cleanly; what it settled meanwhile.
    async fn stop(mut self) -> Vec<Settled> {
        let _ = self.stop.take().expect("not stopped yet").send(());
        within("the runner's stop", self.task).await.expect("runner task").expect("the runner ends cleanly");
        let mut rest = Vec::new();
        while let Ok(s) = self.settlements.try_recv() {
            rest.push(s);
        }
        rest
    }
}

fn actions(seen: &[Settled]) -> Vec<(Action, Option<Outcome>, u64)> {
    seen.iter().map(|s| (s.action, s.outcome, s.delivered)).collect()
}

// ---------------------------------------------------------------- duplicates and a redelivery

/// The README's case on Redis Streams: a consumer commits the deduction and
/// dies before its `XACK`; another consumer of the group takes the entry
/// over (`XAUTOCLAIM`) and replays instead of deducting again. With 4 more
/// duplicates: every entry acked as a replay, the body ran once, nothing
/// pending, nothing dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_and_a_redelivery_deduct_once() {
    let Some(w) = world(100).await else { return };
    let order = order_id();
    let mut ids = Vec::new();
    for i in 1..=5 {
        ids.push(w.add_event(order, 3, &format!("dup-{i}")).await);
    }

    // The doomed consumer, one entry at a time: its handler commits the first
    // entry, says so, and hangs before returning, so the runner never acks.
    let (committed_tx, mut committed) = mpsc::unbounded_channel();
    let doomed = {
        let idem = w.idem.clone();
        tokio::spawn(w.consumer("doomed").run(std::future::pending::<()>(), move |event: OrderPaid| {
            let (idem, committed) = (idem.clone(), committed_tx.clone());
            async move {
                let deducted = deduct_stock(&idem, event).await;
                committed.send(deducted.is_ok()).expect("test listens");
                std::future::pending::<()>().await;
                deducted
            }
        }))
    };
    assert_eq!(within("the doomed consumer's commit", committed.recv()).await, Some(true));
    assert_eq!((body_runs(&w.sku), w.moves().await, w.stock().await), (1, 1, 97), "committed before the crash");
    doomed.abort();
    let _ = doomed.await;
    let pending = w.pending().await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(
        (pending[0].id.as_str(), pending[0].consumer.as_str(), pending[0].delivered),
        (ids[0].as_str(), "doomed", 1)
    );

    let mut survivor = w.run(w.consumer("survivor").concurrency(4), false);
    let seen = survivor.until(|seen| seen.len() == 5).await;
    let rest = survivor.stop().await;

    assert!(rest.is_empty(), "{rest:#?}");
    assert!(seen.iter().all(|s| s.action == Action::Ack && s.outcome == Some(Outcome::Replayed)), "{seen:#?}");
    let mut got: Vec<(String, u64)> = seen.iter().map(|s| (s.message_id.clone().unwrap(), s.delivered)).collect();
    got.sort();
    let expected: Vec<(String, u64)> = (1..=5).map(|i| (format!("dup-{i}"), if i == 1 { 2 } else { 1 })).collect();
    assert_eq!(got, expected, "only the dead consumer's entry came back, claimed: its second delivery");
    let taken_over = seen.iter().find(|s| s.delivered == 2).unwrap();
    assert_eq!(taken_over.entry_id, ids[0]);
    assert_eq!(body_runs(&w.sku), 1, "the body ran once, in the consumer that died");
    assert_eq!((w.stock().await, w.moves().await), (97, 1));
    assert_eq!(w.pending().await, vec![], "every entry acked");
    assert_eq!(w.length(&w.dead).await, 0);
    w.remove().await;
}

// ---------------------------------------------------------------- a consumer process killed before XACK

/// Set in a child's environment: what it consumes, as JSON.
const CHILD_ENV: &str = "IDEM_REDIS_STREAMS_CHILD";

#[derive(Debug, Serialize, Deserialize)]
struct ChildConfig {
    stream: String,
    redis_url: String,
}

/// The child's entry: does nothing unless the parent set [`CHILD_ENV`].
/// It consumes as `child`; once its call committed it prints
/// `IDEM-STOP after_commit` and waits, never acking, to be killed there.
#[test]
fn child_process() {
    let Ok(config) = std::env::var(CHILD_ENV) else { return };
    let config: ChildConfig = serde_json::from_str(&config).expect("child config");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async move {
        let client = redis::Client::open(config.redis_url).unwrap();
        let idem = mysql_engine(Some(&client)).await.expect("mysql answers");
        let _ = Consumer::new(client, config.stream, GROUP)
            .consumer_name("child")
            .run(std::future::pending::<()>(), move |event: OrderPaid| {
                let idem = idem.clone();
                async move {
                    let deducted = deduct_stock(&idem, event).await;
                    println!("IDEM-STOP after_commit {}", deducted.is_ok());
                    std::future::pending::<()>().await;
                    deducted
                }
            })
            .await;
    });
}

/// A consumer process killed with SIGKILL after its call committed and
/// before its `XACK`: its entry stays pending in its name; once idle for
/// `claim_idle`, the other consumer takes it over with `XAUTOCLAIM` (its
/// second delivery) and replays: the body ran once, the entry is acked,
/// nothing is pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_after_its_commit_and_before_xack_is_taken_over_and_replays() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let Some(w) = world(100).await else { return };
    let order = order_id();
    let entry = w.add_event(order, 4, "killed-1").await;

    let config = ChildConfig { stream: w.stream.clone(), redis_url: idem_testkit::redis_url() };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_process", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, serde_json::to_string(&config).unwrap())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the child");
    let stdout = child.stdout.take().unwrap();
    let marker = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout).lines().map_while(Result::ok).find_map(|line| {
            line.find("IDEM-STOP after_commit ").map(|at| line[at + "IDEM-STOP after_commit ".len()..].to_owned())
        })
    });
    let committed = within("the child's commit", marker).await.unwrap();
    assert_eq!(committed.as_deref(), Some("true"), "the child's call committed");
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    let killed_at = Instant::now();
    assert_eq!((w.moves().await, w.stock().await), (1, 96), "committed by the child");
    let pending = w.pending().await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(
        (pending[0].id.as_str(), pending[0].consumer.as_str(), pending[0].delivered),
        (entry.as_str(), "child", 1)
    );

    let claim_idle = Duration::from_millis(800);
    let mut survivor = w.run(w.consumer("survivor").claim_idle(claim_idle), false);
    let taken = survivor.next().await;
    let taken_after = killed_at.elapsed();
    let rest = survivor.stop().await;

    assert!(rest.is_empty(), "{rest:#?}");
    assert_eq!((taken.action, taken.outcome, taken.delivered), (Action::Ack, Some(Outcome::Replayed), 2));
    assert_eq!((taken.entry_id.as_str(), taken.message_id.as_deref()), (entry.as_str(), Some("killed-1")));
    assert_eq!(body_runs(&w.sku), 0, "the body never ran here: it replayed the child's result");
    assert_eq!((w.moves().await, w.stock().await), (1, 96), "deducted once");
    assert_eq!(w.pending().await, vec![], "acked");
    assert_eq!(w.length(&w.dead).await, 0);
    println!("taken over {taken_after:?} after the kill (claim_idle {claim_idle:?})");
    w.remove().await;
}

// ---------------------------------------------------------------- the settlement table, row by row

/// Row "the handler returned `Ok`": acked whatever its call returned (an
/// execution, a reused key, a body error it dealt with); never retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_returning_ok_is_acked_whatever_the_outcome() {
    let Some(w) = world(100).await else { return };
    let order = order_id();
    let unknown = idem_testkit::unique("no-such-sku");
    w.add_event(order, 2, "first").await;
    w.add_event(order, 5, "reused").await;
    w.add(&[("message_id", b"failing"), ("payload", &event(order_id(), &unknown, 1))]).await;

    let idem = w.idem.clone();
    let mut running = spawn_consumer(w.consumer("c"), move |shutdown, consumer| {
        Box::pin(consumer.run(shutdown, move |event: OrderPaid| {
            let idem = idem.clone();
            async move {
                // Dealt with here (say, logged): the entry is done.
                let _ = deduct_stock(&idem, event).await;
                Ok::<(), StockError>(())
            }
        }))
    });
    let seen = running.until(|seen| seen.len() == 3).await;
    let rest = running.stop().await;

    // In the order handled; one entry's settlement may finish after the next one's.
    let mut got: Vec<(Option<&str>, Action, Option<Outcome>, u64)> =
        seen.iter().map(|s| (s.message_id.as_deref(), s.action, s.outcome, s.delivered)).collect();
    got.sort_by_key(|(id, ..)| ["first", "reused", "failing"].iter().position(|want| Some(*want) == *id));
    assert_eq!(
        got,
        vec![
            (Some("first"), Action::Ack, Some(Outcome::Executed), 1),
            (Some("reused"), Action::Ack, Some(Outcome::KeyReused), 1),
            (Some("failing"), Action::Ack, Some(Outcome::Failed), 1),
        ]
    );
    assert!(rest.is_empty() && seen.iter().all(|s| s.error.is_none()), "{seen:#?} {rest:#?}");
    assert_eq!(w.pending().await, vec![]);
    assert_eq!(w.length(&w.dead).await, 0);
    assert_eq!((w.stock().await, w.moves().await), (98, 1));
    w.remove().await;
}

/// Row "`Error::Storage`": the entry is left pending with its delivery
/// count put back (`XCLAIM ... RETRYCOUNT 0`) and idle so that it comes back
/// after `storage_delay`; it does so as often as the outage lasts (here 3
/// times with `max_deliver(2)`), always at delivery 1, then executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_down_is_left_pending_uncounted_then_executed_once() {
    let Some(w) = world(100).await else { return };
    let entry = w.add_event(order_id(), 3, "outage").await;
    let dead_pool = MySqlPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy("mysql://root@127.0.0.1:1/test")
        .expect("lazy pool");
    let down = Idem::builder(dead_pool).redis(w.client.clone()).build();
    const OUTAGE_ATTEMPTS: usize = 3;
    let storage_delay = Duration::from_millis(600);
    let claim_idle = Duration::from_millis(1500);

    let calls = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(Mutex::new(Vec::new()));
    let (up, handler_calls, handler_started) = (w.idem.clone(), Arc::clone(&calls), Arc::clone(&started));
    let consumer = w.consumer("c").max_deliver(2).claim_idle(claim_idle).storage_delay(storage_delay);
    let mut running = spawn_consumer(consumer, move |shutdown, consumer| {
        Box::pin(consumer.run(shutdown, move |event: OrderPaid| {
            let attempt = handler_calls.fetch_add(1, SeqCst);
            handler_started.lock().unwrap().push(Instant::now());
            let idem = if attempt < OUTAGE_ATTEMPTS { down.clone() } else { up.clone() };
            async move { deduct_stock(&idem, event).await }
        }))
    });
    let first = running.next().await;
    // Right after the first requeue: pending, delivered 0 (the claim makes it 1
    // again), idle as if delivered claim_idle - storage_delay ago.
    let pending = w.pending().await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!((pending[0].id.as_str(), pending[0].delivered), (entry.as_str(), 0), "{pending:?}");
    let expected_idle = (claim_idle - storage_delay).as_millis() as u64;
    assert!((expected_idle..expected_idle + 400).contains(&pending[0].idle_ms), "{pending:?}");
    let mut seen = vec![first];
    seen.extend(running.until(|seen| seen.iter().any(|s| s.action != Action::Requeue)).await);
    let rest = running.stop().await;

    assert_eq!(
        actions(&seen),
        vec![
            (Action::Requeue, Some(Outcome::Failed), 1),
            (Action::Requeue, Some(Outcome::Failed), 1),
            (Action::Requeue, Some(Outcome::Failed), 1),
            (Action::Ack, Some(Outcome::Executed), 1),
        ],
        "{seen:#?}"
    );
    assert!(rest.is_empty(), "{rest:#?}");
    assert!(seen[..3].iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("Storage"))), "{seen:#?}");
    assert_eq!(calls.load(SeqCst), OUTAGE_ATTEMPTS + 1);
    let started = started.lock().unwrap().clone();
    for pair in started.windows(2) {
        assert!(pair[1] - pair[0] >= storage_delay, "back only after storage_delay: {started:?}");
    }
    assert_eq!(body_runs(&w.sku), 1, "the body never started while the database was down");
    assert_eq!((w.stock().await, w.moves().await), (97, 1));
    assert_eq!(w.pending().await, vec![]);
    assert_eq!(w.length(&w.dead).await, 0);
    w.remove().await;
}

/// Row "`InProgress`": a duplicate handled while the first is in its body
/// is left pending uncounted, comes back at delivery 1 still, and is acked
/// as a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_during_the_body_is_left_pending_uncounted_then_replayed() {
    let Some(w) = world(100).await else { return };
    let order = order_id();
    w.add_event(order, 2, "dup-1").await;
    w.add_event(order, 2, "dup-2").await;

    let gate = hold_next_body(&w.sku);
    let mut running = w.run(w.consumer("c").concurrency(2), false);
    let busy = running.next().await;
    assert_eq!((busy.action, busy.outcome, busy.delivered), (Action::Requeue, Some(Outcome::InProgress), 1));
    let pending = w.pending().await;
    let waiting = pending.iter().find(|p| p.id == busy.entry_id).expect("still pending");
    assert_eq!(waiting.delivered, 0, "put back uncounted: {pending:?}");
    gate.notify_one();
    let seen = running.until(|seen| seen.iter().filter(|s| s.action == Action::Ack).count() == 2).await;
    let rest = running.stop().await;

    let acked: Vec<(Option<&str>, Option<Outcome>, u64)> = seen
        .iter()
        .filter(|s| s.action == Action::Ack)
        .map(|s| (s.message_id.as_deref(), s.outcome, s.delivered))
        .collect();
    let holder = if busy.message_id.as_deref() == Some("dup-1") { "dup-2" } else { "dup-1" };
    assert!(acked.contains(&(Some(holder), Some(Outcome::Executed), 1)), "{seen:#?}");
    assert!(acked.contains(&(busy.message_id.as_deref(), Some(Outcome::Replayed), 1)), "uncounted: {seen:#?}");
    assert!(rest.is_empty() && seen.iter().all(|s| matches!(s.action, Action::Ack | Action::Requeue)), "{seen:#?}");
    assert_eq!(body_runs(&w.sku), 1);
    assert_eq!((w.stock().await, w.moves().await), (98, 1));
    assert_eq!(w.pending().await, vec![]);
    assert_eq!(w.length(&w.dead).await, 0);
    w.remove().await;
}

/// Rows "`KeyReused`" and "poison": a reused key, a payload that is not
/// JSON and an entry without a payload field are copied to the dead-letter
/// stream (their fields and the reason) and acked, once each; the first
/// order is deducted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_reused_and_poison_are_dead_lettered_with_their_reason_and_acked() {
    let Some(w) = world(100).await else { return };
    let order = order_id();
    let reused = event(order, &w.sku, 5);
    w.add_event(order, 2, "first").await;
    let reused_id = w.add(&[("message_id", b"reused"), ("payload", &reused)]).await;
    let bad_json = w.add(&[("message_id", b"bad-json"), ("payload", b"{not json")]).await;
    let no_payload = w.add(&[("message_id", b"no-payload"), ("data", b"{}")]).await;

    let mut running = w.run(w.consumer("c"), false);
    let seen = running.until(|seen| seen.len() == 4).await;
    let calls = Arc::clone(&running.calls);
    let rest = running.stop().await;

    let by_id = |id: &str| seen.iter().find(|s| s.message_id.as_deref() == Some(id)).expect(id).clone();
    assert_eq!((by_id("first").action, by_id("first").outcome), (Action::Ack, Some(Outcome::Executed)));
    assert_eq!(
        (by_id("reused").action, by_id("reused").outcome),
        (Action::DeadLetter(Reason::KeyReused), Some(Outcome::KeyReused))
    );
    assert_eq!((by_id("bad-json").action, by_id("bad-json").outcome), (Action::DeadLetter(Reason::Poison), None));
    assert_eq!(by_id("no-payload").action, Action::DeadLetter(Reason::Poison));
    assert_eq!(by_id("no-payload").error.as_deref(), Some("no payload field"));
    assert!(rest.is_empty(), "nothing else: {rest:#?}");
    assert_eq!(calls.load(SeqCst), 2, "poison never reached the handler");
    assert_eq!(body_runs(&w.sku), 1);

    let dead = w.dead_letters().await;
    let mut dead = dead;
    dead.sort_by(|a, b| a["idem_entry_id"].cmp(&b["idem_entry_id"]));
    let summary: Vec<(&str, &str, &str, &str)> = dead
        .iter()
        .map(|d| {
            (
                d["message_id"].as_str(),
                d["idem_dead_reason"].as_str(),
                d["idem_entry_id"].as_str(),
                d["idem_delivered"].as_str(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("reused", "key_reused", reused_id.as_str(), "1"),
            ("bad-json", "poison", bad_json.as_str(), "1"),
            ("no-payload", "poison", no_payload.as_str(), "1"),
        ]
    );
    assert!(dead.iter().all(|d| d["idem_stream"] == w.stream), "{dead:?}");
    assert_eq!(dead[0]["payload"].as_bytes(), reused.as_slice(), "the original fields");
    assert_eq!((dead[1]["payload"].as_str(), dead[2]["data"].as_str()), ("{not json", "{}"));
    assert!(dead[0]["idem_error"].contains("KeyReused") && dead[1]["idem_error"].starts_with("payload: "), "{dead:?}");
    assert_eq!(w.pending().await, vec![], "all acked");
    assert_eq!((w.stock().await, w.moves().await), (98, 1));
    w.remove().await;
}

/// Row "invalid key" (`Rejected`): dead-lettered at once, never retried;
/// the body never runs, nothing is written, no record either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_key_is_dead_lettered_and_nothing_written() {
    let Some(w) = world(100).await else { return };
    let reference = format!("bad ref {}", idem_testkit::unique("r"));
    let payload = serde_json::to_vec(&Restocked { reference: reference.clone(), sku: w.sku.clone(), qty: 5 }).unwrap();
    let entry = w.add(&[("payload", &payload)]).await;

    let idem = w.idem.clone();
    let mut running = spawn_consumer(w.consumer("c"), move |shutdown, consumer| {
        Box::pin(consumer.run(shutdown, move |event: Restocked| {
            let idem = idem.clone();
            async move { restock(&idem, event).await }
        }))
    });
    let settled = running.next().await;
    let rest = running.stop().await;

    assert_eq!(
        (settled.action, settled.outcome, settled.delivered),
        (Action::DeadLetter(Reason::Rejected), Some(Outcome::Rejected), 1)
    );
    assert!(settled.error.as_deref().is_some_and(|e| e.contains("InvalidKey")), "{settled:#?}");
    assert!(rest.is_empty(), "never retried: {rest:#?}");
    assert_eq!(body_runs(&w.sku), 0, "the body never ran");
    let dead = w.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0]["idem_dead_reason"].as_str(), dead[0]["idem_entry_id"].as_str()), ("rejected", entry.as_str()));
    assert_eq!(dead[0]["payload"].as_bytes(), payload.as_slice());
    assert_eq!(w.pending().await, vec![]);
    assert_eq!((w.stock().await, w.moves().await), (100, 0));
    let records: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM idem_record WHERE biz_type = 't_rs_restock' AND idem_key LIKE ?")
            .bind(format!("%{}", reference.trim_start_matches("bad ref ")))
            .fetch_one(w.idem.pool())
            .await
            .unwrap();
    assert_eq!(records, 0);
    w.remove().await;
}

/// Row "the body's own error": left pending to come back after
/// `retry_delay`, each claim counting a delivery, until the count reaches
/// `max_deliver`; then dead-lettered with `deliveries_exhausted` and acked.
/// The body ran `max_deliver` times; nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_body_is_retried_until_max_deliver_then_dead_lettered() {
    let Some(w) = world(100).await else { return };
    let unknown = idem_testkit::unique("no-such-sku");
    let order = order_id();
    let entry = w.add(&[("message_id", b"failing"), ("payload", &event(order, &unknown, 1))]).await;
    let retry_delay = Duration::from_millis(300);

    let mut running = w.run(w.consumer("c").max_deliver(3).retry_delay(retry_delay), false);
    let first = running.next().await;
    let pending = w.pending().await;
    assert_eq!((pending.len(), pending[0].delivered), (1, 1), "counted: {pending:?}");
    let mut seen = vec![first];
    seen.extend(running.until(|seen| seen.iter().any(|s| matches!(s.action, Action::DeadLetter(_)))).await);
    let rest = running.stop().await;

    assert_eq!(
        actions(&seen),
        vec![
            (Action::Retry { delivered: 1 }, Some(Outcome::Failed), 1),
            (Action::Retry { delivered: 2 }, Some(Outcome::Failed), 2),
            (Action::DeadLetter(Reason::DeliveriesExhausted), Some(Outcome::Failed), 3),
        ]
    );
    assert!(rest.is_empty(), "{rest:#?}");
    assert!(seen.iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("UnknownSku"))), "{seen:#?}");
    assert_eq!(body_runs(&unknown), 3, "max_deliver attempts");
    let dead = w.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (dead[0]["idem_dead_reason"].as_str(), dead[0]["idem_entry_id"].as_str(), dead[0]["idem_delivered"].as_str()),
        ("deliveries_exhausted", entry.as_str(), "3")
    );
    assert_eq!(w.pending().await, vec![]);
    let moves: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_rs_moves WHERE order_id = ?")
        .bind(order)
        .fetch_one(w.idem.pool())
        .await
        .unwrap();
    assert_eq!(moves, 0);
    w.remove().await;
}

/// Row "a panic": a handler that panics while being called fails like any
/// other: retried up to `max_deliver`, then dead-lettered; never left
/// unsettled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_panicking_is_retried_then_dead_lettered() {
    let Some(w) = world(100).await else { return };
    w.add_event(order_id(), PANICS, "panics").await;

    let mut running = w.run(w.consumer("c").max_deliver(2), false);
    let seen = running.until(|seen| seen.iter().any(|s| matches!(s.action, Action::DeadLetter(_)))).await;
    let calls = Arc::clone(&running.calls);
    let rest = running.stop().await;

    assert_eq!(
        actions(&seen),
        vec![(Action::Retry { delivered: 1 }, None, 1), (Action::DeadLetter(Reason::DeliveriesExhausted), None, 2)]
    );
    assert!(rest.is_empty(), "{rest:#?}");
    assert!(seen.iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("handler panicked"))), "{seen:#?}");
    assert_eq!(calls.load(SeqCst), 2);
    assert_eq!(body_runs(&w.sku), 0);
    let dead = w.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert!(dead[0]["idem_error"].contains("handler panicked"), "{dead:?}");
    assert_eq!(w.pending().await, vec![]);
    assert_eq!(w.stock().await, 100);
    w.remove().await;
}

/// `run_with_id` keys the call by the entry's `message_id` field: a copy of
/// one event appended again (a new entry id) replays instead of executing;
/// an entry without the field, or with one that is not UTF-8, is poison.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_with_id_keys_by_the_message_id_field_and_an_entry_without_one_is_poison() {
    let Some(w) = world(100).await else { return };
    let message_id = idem_testkit::unique("m").replace('-', "_");
    let order = order_id();
    let first = w.add(&[("message_id", message_id.as_bytes()), ("payload", &event(order, &w.sku, 1))]).await;
    let copy = w.add(&[("message_id", message_id.as_bytes()), ("payload", &event(order, &w.sku, 1))]).await;
    w.add(&[("payload", &event(order_id(), &w.sku, 1))]).await;
    w.add(&[("message_id", &[0xff, 0xfe]), ("payload", &event(order_id(), &w.sku, 1))]).await;

    let mut running = w.run(w.consumer("c"), true);
    let seen = running.until(|seen| seen.len() == 4).await;
    let rest = running.stop().await;

    // In entry order (one entry's settlement may finish after the next one's).
    let mut seen = seen;
    seen.sort_by(|a, b| a.entry_id.cmp(&b.entry_id));
    let got: Vec<(Action, Option<Outcome>, Option<&str>)> =
        seen.iter().map(|s| (s.action, s.outcome, s.message_id.as_deref())).collect();
    assert_eq!(
        got,
        vec![
            (Action::Ack, Some(Outcome::Executed), Some(message_id.as_str())),
            (Action::Ack, Some(Outcome::Replayed), Some(message_id.as_str())),
            (Action::DeadLetter(Reason::Poison), None, None),
            (Action::DeadLetter(Reason::Poison), None, None),
        ]
    );
    assert_eq!((seen[0].entry_id.as_str(), seen[1].entry_id.as_str()), (first.as_str(), copy.as_str()));
    assert!(seen[2..].iter().all(|s| s.error.as_deref() == Some("no message id field (UTF-8)")), "{seen:#?}");
    assert!(rest.is_empty(), "{rest:#?}");
    assert_eq!(body_runs(&w.sku), 1);
    assert_eq!((w.stock().await, w.moves().await), (99, 1));
    assert_eq!(w.length(&w.dead).await, 2);
    assert_eq!(w.pending().await, vec![]);
    w.remove().await;
}

/// A stop while a read is in flight: the runner waits for the read, and an
/// entry it brought (delivered by Redis, not started) is given back
/// uncounted and claimable at once (`Returned`); the next consumer takes it
/// at delivery 1 still and executes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_mid_read_gives_back_what_the_read_brought_uncounted() {
    let Some(w) = world(100).await else { return };
    // Claims far apart: the reads block for the longest time (1 s).
    let mut running = w.run(w.consumer("stopping").claim_interval(Duration::from_secs(30)), false);
    // The group exists once the first read ran; wait for it, and into the next block.
    within("the group", async {
        loop {
            let groups: RedisResult<Value> =
                redis::cmd("XINFO").arg("GROUPS").arg(&w.stream).query_async(&mut w.conn()).await;
            if groups.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stop = running.stop.take().unwrap();
    let _ = stop.send(());
    let entry = w.add_event(order_id(), 1, "mid-read").await;
    within("the runner's stop", &mut running.task).await.expect("runner task").expect("clean stop");
    let returned = running.settlements.try_recv().expect("the entry the read brought was settled");
    assert_eq!((returned.action, returned.outcome, returned.delivered), (Action::Returned, None, 1));
    assert_eq!(returned.entry_id, entry);
    assert_eq!(running.calls.load(SeqCst), 0, "never started");
    let pending = w.pending().await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!((pending[0].delivered, pending[0].consumer.as_str()), (0, "stopping"), "uncounted: {pending:?}");
    assert!(pending[0].idle_ms >= 1500, "claimable at once: {pending:?}");

    let mut next = w.run(w.consumer("next"), false);
    let taken = next.next().await;
    let rest = next.stop().await;
    assert_eq!((taken.action, taken.outcome, taken.delivered), (Action::Ack, Some(Outcome::Executed), 1));
    assert!(rest.is_empty(), "{rest:#?}");
    assert_eq!(w.pending().await, vec![]);
    assert_eq!(w.moves().await, 1);
    w.remove().await;
}

// ---------------------------------------------------------------- Redis down and back

/// Counts the runner's "Redis failed; waiting" warnings per stream: each
/// is one failed read (installed once, for the whole test binary).
fn failed_reads(stream: &str) -> usize {
    FAILED_READS.lock().unwrap().as_ref().and_then(|reads| reads.get(stream).copied()).unwrap_or(0)
}

static FAILED_READS: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);

struct FailedReads;

#[derive(Default)]
struct WarningFields {
    stream: Option<String>,
    message: String,
}

impl tracing::field::Visit for WarningFields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "stream" {
            self.stream = Some(value.to_owned());
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => self.message = format!("{value:?}"),
            "stream" => self.stream = Some(format!("{value:?}")),
            _ => {}
        }
    }
}

impl tracing::Subscriber for FailedReads {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        metadata.is_event() && *metadata.level() == tracing::Level::WARN
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = WarningFields::default();
        event.record(&mut fields);
        if let (Some(stream), true) = (fields.stream, fields.message.contains("Redis failed; waiting")) {
            *FAILED_READS.lock().unwrap().get_or_insert_with(HashMap::new).entry(stream).or_default() += 1;
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// A fake Redis on loopback that answers every command with `-LOADING`
/// (as a Redis does while it loads its data set): the commands it got.
async fn loading_redis() -> (u16, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let commands = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&commands);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let counter = Arc::clone(&counter);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = socket.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                    // A command is an array: one `*` line each (the test's names hold none).
                    let got = buf[..n].split(|b| *b == b'\n').filter(|line| line.first() == Some(&b'*')).count();
                    counter.fetch_add(got, SeqCst);
                    let reply = "-LOADING Redis is loading the dataset in memory\r\n".repeat(got);
                    if socket.write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, commands)
}

/// A Redis that answers but cannot serve (`LOADING`) is waited out with a
/// back-off, not hammered: a handful of commands in 3 s, not thousands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_cannot_serve_is_not_hammered() {
    let (port, commands) = loading_redis().await;
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let running = spawn_consumer(Consumer::new(client, "idem-test-rs-loading", GROUP), |shutdown, consumer| {
        Box::pin(consumer.run(shutdown, |_: OrderPaid| async { Ok::<(), StockError>(()) }))
    });
    let window = Duration::from_secs(3);
    tokio::time::sleep(window).await;
    let sent = commands.load(SeqCst);
    let rest = running.stop().await;
    println!("commands to a loading Redis in {window:?}: {sent}");
    assert!(rest.is_empty(), "{rest:#?}");
    // 50 ms, doubling up to 2 s: about 6 tries in 3 s (and the connection's own set-up).
    assert!((2..=20).contains(&sent), "{sent} commands in {window:?}");
}

/// Redis killed under a running consumer: it waits (a few failed reads,
/// not a busy loop) and, once a Redis answers again on that port (empty:
/// the stream and the group are gone), creates the group again and goes on
/// consuming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_is_waited_out_without_a_busy_loop_then_consumption_resumes() {
    let Some(server) = idem_testkit::servers::RedisServer::start() else { return };
    let server = Arc::new(server);
    let Some(idem) = mysql_engine(None).await else { return };
    let sku = idem_testkit::unique("rs-sku");
    sqlx::query("INSERT INTO idem_rs_stock (sku, qty) VALUES (?, 100)").bind(&sku).execute(idem.pool()).await.unwrap();
    let _ = tracing::subscriber::set_global_default(FailedReads);
    let stream = idem_testkit::unique("idem-test-rs-down");
    let mut direct = server.client().get_multiplexed_async_connection().await.unwrap();

    let consumer = Consumer::new(server.client(), stream.clone(), GROUP)
        .consumer_name("c")
        .claim_interval(Duration::from_millis(100));
    let handler_idem = idem.clone();
    let mut running = spawn_consumer(consumer, move |shutdown, consumer| {
        Box::pin(consumer.run(shutdown, move |event: OrderPaid| {
            let idem = handler_idem.clone();
            async move { deduct_stock(&idem, event).await }
        }))
    });
    add_to(&mut direct, &stream, &[("payload", &event(order_id(), &sku, 1))]).await;
    let before = running.next().await;
    assert_eq!((before.action, before.outcome), (Action::Ack, Some(Outcome::Executed)));

    let killer = Arc::clone(&server);
    tokio::task::spawn_blocking(move || killer.kill()).await.unwrap();
    let outage = Duration::from_secs(4);
    let at_kill = failed_reads(&stream);
    tokio::time::sleep(outage).await;
    let tries = failed_reads(&stream) - at_kill;
    let restarter = Arc::clone(&server);
    tokio::task::spawn_blocking(move || restarter.restart()).await.unwrap();
    let mut direct = server.client().get_multiplexed_async_connection().await.unwrap();
    let entry = add_to(&mut direct, &stream, &[("payload", &event(order_id(), &sku, 2))]).await;
    let resumed_at = Instant::now();
    let after = running.next().await;
    let resumed_in = resumed_at.elapsed();
    let rest = running.stop().await;

    println!("failed reads during a {outage:?} outage: {tries}; consuming again {resumed_in:?} after Redis came back");
    // Its reads fail and are tried again (the connection's own reconnecting
    // holds them up): at least one, at most the back-off's 7 in 5 s.
    assert!((1..=8).contains(&tries), "{tries} failed reads in {outage:?}");
    assert_eq!(
        (after.action, after.outcome, after.entry_id.as_str()),
        (Action::Ack, Some(Outcome::Executed), entry.as_str())
    );
    assert!(rest.is_empty(), "{rest:#?}");
    assert!(resumed_in < Duration::from_secs(10), "{resumed_in:?}");
    let pending: Vec<Value> = redis::cmd("XPENDING")
        .arg(&stream)
        .arg(GROUP)
        .arg("-")
        .arg("+")
        .arg(10)
        .query_async(&mut direct)
        .await
        .unwrap();
    assert!(pending.is_empty(), "{pending:?}");
    let moves: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_rs_moves WHERE sku = ?")
        .bind(&sku)
        .fetch_one(idem.pool())
        .await
        .unwrap();
    assert_eq!(moves, 2);
}

// ---------------------------------------------------------------- end to end through an outbox relay

/// Publishes outbox messages to a Redis stream (`XADD <stream> * message_id
/// <id> payload <json>`): what a Redis Streams relay is. Faults: every
/// `duplicate_every`th message is appended twice (a copy with a new entry
/// id), and when `crash_next` is set, the batch is published and the relay
/// then never returns (its task is aborted before it marks the rows sent:
/// they are published again).
struct StreamPublisher {
    conn: MultiplexedConnection,
    stream: String,
    counts: Arc<RelayCounts>,
    crash_next: Arc<AtomicBool>,
    crashed: Arc<Notify>,
}

#[derive(Default)]
struct RelayCounts {
    appended: AtomicU64,
    duplicated: AtomicU64,
    crashed_messages: AtomicU64,
    crashes: AtomicU64,
}

const DUPLICATE_EVERY: u64 = 7;

impl idem::outbox::Publisher for StreamPublisher {
    async fn publish(&mut self, batch: &[idem::outbox::Message]) -> Vec<idem::outbox::Confirm> {
        let mut answers = Vec::new();
        for message in batch {
            let fields: [(&str, &[u8]); 2] =
                [("message_id", message.id().as_bytes()), ("payload", message.payload().as_bytes())];
            let mut cmd = redis::cmd("XADD");
            cmd.arg(&self.stream).arg("*");
            for (f, v) in fields {
                cmd.arg(f).arg(v);
            }
            match cmd.query_async::<String>(&mut self.conn).await {
                Ok(_) => {
                    let n = self.counts.appended.fetch_add(1, SeqCst) + 1;
                    if n % DUPLICATE_EVERY == 0 && cmd.query_async::<String>(&mut self.conn).await.is_ok() {
                        self.counts.duplicated.fetch_add(1, SeqCst);
                    }
                    answers.push(idem::outbox::Confirm::Sent { duplicate: false });
                }
                Err(e) => answers.push(idem::outbox::Confirm::Unconfirmed(e.to_string())),
            }
        }
        if self.crash_next.swap(false, SeqCst) {
            self.counts.crashes.fetch_add(1, SeqCst);
            self.counts.crashed_messages.fetch_add(batch.len() as u64, SeqCst);
            self.crashed.notify_one();
            std::future::pending::<()>().await;
        }
        answers
    }
}

#[idempotent(key = "order_<order_id>_pay", ttl = "1h", biz = "t_rs_pay")]
async fn pay(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    order_id: i64,
    sku: String,
    stream: String,
    roll_back: bool,
) -> Result<i64, StockError> {
    sqlx::query("INSERT INTO idem_rs_payments (order_id, sku) VALUES (?, ?)")
        .bind(order_id)
        .bind(&sku)
        .execute(&mut **tx)
        .await?;
    let paid = OrderPaid { order_id, sku, qty: 1 };
    idem::outbox::queue(tx, idem::outbox::Event::json(stream, &paid)?.aggregate(format!("order-{order_id}"))).await?;
    if roll_back {
        return Err(StockError::RolledBack);
    }
    Ok(order_id)
}

/// What the consumers saw.
#[derive(Default)]
struct Seen {
    executed: AtomicU64,
    replayed: AtomicU64,
    in_progress: AtomicU64,
    other: AtomicU64,
    kills: AtomicU64,
}

/// The whole path on Redis Streams: pay calls (each order paid three times
/// at once) queue `order.paid` in their transaction; an outbox relay appends
/// the events to the stream (duplicating some, crashing between publish and
/// mark-sent so that a batch goes out again); two consumers (killed after a
/// commit and before the `XACK`, and replaced) deduct stock keyed by the
/// message id. Then it reconciles: every payment's effect exactly once,
/// none for a rolled-back body, the outbox sent, nothing pending, no dead
/// letter, every extra copy replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_through_an_outbox_relay_with_duplicates_and_kills_every_effect_once() {
    let started = Instant::now();
    // A database of the run's own: the outbox's counts are the run's alone.
    let Some(client) = idem_testkit::redis_client().await else { return };
    let Some(admin) = idem_testkit::reach("mysql", || async {
        MySqlPoolOptions::new().max_connections(1).connect(&idem_testkit::mysql_url()).await.ok()
    })
    .await
    else {
        return;
    };
    let database = format!("rs_e2e_{}", order_id());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}"))).execute(&admin).await.unwrap();
    let options: sqlx::mysql::MySqlConnectOptions = idem_testkit::mysql_url().parse().unwrap();
    let pool = MySqlPoolOptions::new().max_connections(12).connect_with(options.database(&database)).await.unwrap();
    let w = world_on(engine_on(pool, Some(&client)).await, client, 1_000_000).await;
    sqlx::raw_sql("CREATE TABLE idem_rs_payments (order_id BIGINT PRIMARY KEY, sku VARCHAR(64) NOT NULL)")
        .execute(w.idem.pool())
        .await
        .unwrap();
    const ORDERS: i64 = 500;
    const KILLS: u64 = 5;
    // Ids no other call takes: `order_id` steps 1000 per microsecond.
    let base = order_id();
    let rolled_back = move |order: i64| (order - base) % 10 == 3;
    let payer = Idem::builder(w.idem.pool().clone()).build();

    // The relay, supervised: one that crashed is replaced.
    let counts = Arc::new(RelayCounts::default());
    let crash_next = Arc::new(AtomicBool::new(false));
    let stop_all = Arc::new(AtomicBool::new(false));
    let relay = {
        let (payer, client, stream, counts, crash_next, stop_all) =
            (payer.clone(), w.client.clone(), w.stream.clone(), counts.clone(), crash_next.clone(), stop_all.clone());
        tokio::spawn(async move {
            loop {
                let crashed = Arc::new(Notify::new());
                let publisher = StreamPublisher {
                    conn: client.get_multiplexed_async_connection().await.unwrap(),
                    stream: stream.clone(),
                    counts: counts.clone(),
                    crash_next: crash_next.clone(),
                    crashed: crashed.clone(),
                };
                let relay =
                    idem::outbox::Relay::new(&payer, publisher).batch_size(20).poll_interval(Duration::from_millis(50));
                let stop_flag = stop_all.clone();
                let mut task = tokio::spawn(relay.run(async move {
                    while !stop_flag.load(SeqCst) {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }));
                tokio::select! {
                    _ = &mut task => return,
                    () = crashed.notified() => {
                        task.abort();
                        let _ = task.await;
                    }
                }
            }
        })
    };

    // Two consumers, supervised: one killed before its XACK is replaced
    // (under a new name: its entry is taken over by XAUTOCLAIM).
    let seen = Arc::new(Seen::default());
    let kill_armed = Arc::new(AtomicBool::new(false));
    let mut supervisors = Vec::new();
    for c in 0..2 {
        let (idem, client, stream, seen, kill_armed, stop_all) =
            (w.idem.clone(), w.client.clone(), w.stream.clone(), seen.clone(), kill_armed.clone(), stop_all.clone());
        supervisors.push(tokio::spawn(async move {
            for life in 0.. {
                let killed = Arc::new(Notify::new());
                let (stop_tx, stop_rx) = oneshot::channel::<()>();
                let consumer = Consumer::new(client.clone(), stream.clone(), GROUP)
                    .consumer_name(format!("e2e-{c}-{life}"))
                    .concurrency(4)
                    .claim_idle(Duration::from_millis(700))
                    .claim_interval(Duration::from_millis(50))
                    .in_progress_delay(Duration::from_millis(50))
                    .retry_delay(Duration::from_millis(50));
                let (idem, seen, kill_armed, killed_in) =
                    (idem.clone(), seen.clone(), kill_armed.clone(), killed.clone());
                let mut task = tokio::spawn(consumer.run_with_id(
                    async move {
                        let _ = stop_rx.await;
                    },
                    move |id: String, event: OrderPaid| {
                        let (idem, seen, kill_armed, killed) =
                            (idem.clone(), seen.clone(), kill_armed.clone(), killed_in.clone());
                        async move {
                            let (done, outcome) = idem::observe(deduct_by_id(&idem, id, event)).await;
                            if done.is_ok() && outcome == Some(Outcome::Executed) && kill_armed.swap(false, SeqCst) {
                                seen.kills.fetch_add(1, SeqCst);
                                killed.notify_one();
                                std::future::pending::<()>().await;
                            }
                            match outcome {
                                Some(Outcome::Executed) => seen.executed.fetch_add(1, SeqCst),
                                Some(Outcome::Replayed) => seen.replayed.fetch_add(1, SeqCst),
                                Some(Outcome::InProgress) => seen.in_progress.fetch_add(1, SeqCst),
                                _ => seen.other.fetch_add(1, SeqCst),
                            };
                            done
                        }
                    },
                ));
                let stopping = {
                    let stop_all = stop_all.clone();
                    async move {
                        while !stop_all.load(SeqCst) {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                };
                tokio::select! {
                    () = killed.notified() => {
                        // Dead before its XACK: its entries stay pending in its name.
                        task.abort();
                        let _ = task.await;
                    }
                    () = stopping => {
                        let _ = stop_tx.send(());
                        within("a consumer's stop", &mut task).await.unwrap().unwrap();
                        return;
                    }
                }
            }
        }));
    }

    // The pay calls: every order three times at once; every tenth rolled back.
    let mut kills_armed = 0;
    for chunk in (0..ORDERS).collect::<Vec<_>>().chunks(20) {
        let mut calls = tokio::task::JoinSet::new();
        for &i in chunk {
            let order = base + i;
            for _ in 0..3 {
                let (payer, sku, stream) = (payer.clone(), w.sku.clone(), w.stream.clone());
                calls.spawn(async move { pay(&payer, order, sku, stream, rolled_back(order)).await });
            }
        }
        while let Some(done) = calls.join_next().await {
            match done.unwrap() {
                Ok(_) | Err(StockError::RolledBack) | Err(StockError::Idem(idem::Error::InProgress { .. })) => {}
                Err(e) => panic!("pay: {e:?}"),
            }
        }
        // The faults, spread over the run.
        if chunk[0] % 60 == 20 {
            crash_next.store(true, SeqCst);
        }
        if chunk[0] % 60 == 40 && kills_armed < KILLS {
            kill_armed.store(true, SeqCst);
            kills_armed += 1;
        }
    }
    // A duplicate that met its first call in progress is paid again now (replays).
    for i in 0..ORDERS {
        let order = base + i;
        if !rolled_back(order) {
            pay(&payer, order, w.sku.clone(), w.stream.clone(), false).await.expect("paid");
        }
    }
    let expected: i64 = (0..ORDERS).filter(|i| !rolled_back(base + i)).count() as i64;

    // Every payment's move, every entry acked, the outbox sent.
    let stream = w.stream.clone();
    let mut conn = w.conn();
    within("every effect, nothing pending, the outbox sent", async {
        loop {
            let moves: i64 = sqlx::query_scalar("SELECT COUNT(DISTINCT order_id) FROM idem_rs_moves WHERE sku = ?")
                .bind(&w.sku)
                .fetch_one(w.idem.pool())
                .await
                .unwrap();
            let pending = pending_of(&mut conn, &stream).await.len();
            let outbox = payer.outbox().counts().await.unwrap();
            if moves >= expected && pending == 0 && outbox.pending == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    stop_all.store(true, SeqCst);
    for s in supervisors {
        within("a consumer's supervisor", s).await.unwrap();
    }
    within("the relay", relay).await.unwrap();

    // Reconcile.
    let payments: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_rs_payments WHERE sku = ?")
        .bind(&w.sku)
        .fetch_one(w.idem.pool())
        .await
        .unwrap();
    let moves: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_rs_moves WHERE sku = ?")
        .bind(&w.sku)
        .fetch_one(w.idem.pool())
        .await
        .unwrap();
    let orphans: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM idem_rs_moves m LEFT JOIN idem_rs_payments p ON p.order_id = m.order_id WHERE m.sku = ? AND p.order_id IS NULL",
    )
    .bind(&w.sku)
    .fetch_one(w.idem.pool())
    .await
    .unwrap();
    let outbox = payer.outbox().counts().await.unwrap();
    let entries = w.length(&w.stream).await;
    let appended = counts.appended.load(SeqCst) + counts.duplicated.load(SeqCst);
    let (executed, replayed, kills) = (seen.executed.load(SeqCst), seen.replayed.load(SeqCst), seen.kills.load(SeqCst));
    println!(
        "redis streams end to end: {payments} payments, {entries} entries ({} duplicated, {} crashed-batch messages in {} crashes), \
         {executed} executed + {kills} killed after commit, {replayed} replayed, {} in progress, {:.1} s",
        counts.duplicated.load(SeqCst),
        counts.crashed_messages.load(SeqCst),
        counts.crashes.load(SeqCst),
        seen.in_progress.load(SeqCst),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(payments, expected, "every order paid or rolled back");
    assert_eq!((moves, orphans), (payments, 0), "exactly one stock move per payment, none without one");
    assert_eq!(w.stock().await, 1_000_000 - payments);
    assert_eq!((outbox.pending, outbox.dead), (0, 0));
    assert_eq!(outbox.sent as i64, payments, "one event per payment, none for a rolled-back body");
    assert_eq!(entries, appended, "the stream holds every copy appended");
    assert!(counts.crashes.load(SeqCst) >= 1 && counts.duplicated.load(SeqCst) >= 1 && kills == KILLS, "faults");
    assert_eq!(seen.other.load(SeqCst), 0, "every delivery executed, replayed or in progress");
    assert_eq!(executed + kills, payments as u64, "one execution per payment");
    assert!(executed + replayed >= entries, "every entry executed or replayed: {executed} + {replayed} < {entries}");
    assert!(replayed >= entries - payments as u64 + kills, "every extra copy and every killed delivery replayed");
    assert_eq!(pending_of(&mut w.conn(), &w.stream).await, vec![], "nothing pending");
    assert_eq!(w.length(&w.dead).await, 0, "no dead letter");
    assert!(started.elapsed() < Duration::from_secs(60));
    w.idem.pool().close().await;
    w.remove().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {database}"))).execute(&admin).await.unwrap();
}
