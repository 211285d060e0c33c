//! The whole path, once, under faults: HTTP pay calls (with duplicates,
//! through `idempotency::http`'s `Idempotency-Key`) whose bodies queue an
//! `order.paid` event → two outbox relays → the broker →
//! two consumers whose `#[idempotent]` handler deducts stock and writes a
//! stock move. Per broker: RabbitMQ (`IDEM_AMQP_URL`) and NATS JetStream
//! (`IDEM_NATS_URL`), on MariaDB (`IDEM_MYSQL_URL`, a database per run).
//!
//! Faults during the run: a relay aborted between publish and mark-sent
//! (its batch is published again), the relays' broker connection cut
//! mid-batch (through a proxy of the test's own), a consumer dropped after
//! its call committed and before its ack (the broker delivers again), and
//! bodies rolled back after queueing (their events must never leave).
//! Then the counts are reconciled across the tables and the broker, and
//! printed. `*_short` run in the normal suite; `soak_*` are `--ignored`.

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use idempotency::http::IdempotencyKey;
use idempotency::outbox::{Confirm, Event, Message, Publisher, Relay};
use idempotency::{Idem, Outcome, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{MySql, Pool, Transaction};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;

// ---------------------------------------------------------------- the two services

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPaid {
    order_id: i64,
    sku: String,
    qty: i64,
}

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug
enum AppError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
    RolledBack,
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

impl idempotency::amqp::AsIdemError for AppError {
    fn idem_error(&self) -> Option<&idempotency::Error> {
        match self {
            AppError::Idem(e) => Some(e),
            _ => None,
        }
    }
}

const SKU: &str = "sku-1";

/// The payment service: records the payment and queues `order.paid` in the
/// same transaction; `roll_back` fails the body after queueing.
#[idempotent(key = "<idem_key>", ttl = "1h", biz = "e2e_pay")]
async fn pay(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    idem_key: String,
    order_id: i64,
    amount: i64,
    destination: String,
    roll_back: bool,
) -> Result<i64, AppError> {
    sqlx::query("INSERT INTO e2e_payments (order_id, amount) VALUES (?, ?)")
        .bind(order_id)
        .bind(amount)
        .execute(&mut **tx)
        .await?;
    let event = OrderPaid { order_id, sku: SKU.to_owned(), qty: 1 };
    idempotency::outbox::queue(tx, Event::json(destination, &event)?.aggregate(format!("order-{order_id}"))).await?;
    if roll_back {
        return Err(AppError::RolledBack);
    }
    Ok(order_id)
}

/// The payment service's HTTP front: `POST /orders/{id}/pay/{decline}`
/// with an `Idempotency-Key` header (the client sends one per order, the
/// same on every retry).
#[derive(Clone)]
struct PayApp {
    idem: Idem<MySql>,
    destination: String,
}

async fn pay_http(
    State(app): State<PayApp>,
    IdempotencyKey(key): IdempotencyKey,
    Path((order_id, decline)): Path<(i64, bool)>,
) -> (StatusCode, String) {
    match pay(&app.idem, key, order_id, 100 + order_id, app.destination.clone(), decline).await {
        Ok(order) => (StatusCode::OK, order.to_string()),
        Err(AppError::RolledBack) => (StatusCode::PAYMENT_REQUIRED, "declined".into()),
        Err(AppError::Idem(idempotency::Error::InProgress { .. })) => (StatusCode::CONFLICT, "in progress".into()),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e:?}")),
    }
}

/// Serves the payment service on an ephemeral port; its base URL.
async fn serve(app: PayApp) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let router = Router::new().route("/orders/{id}/pay/{decline}", post(pay_http)).with_state(app);
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    base
}

/// One HTTP pay call: its status.
async fn pay_over_http(client: &reqwest::Client, base: &str, order: i64, decline: bool) -> StatusCode {
    let response = client
        .post(format!("{base}/orders/{order}/pay/{decline}"))
        .header("Idempotency-Key", format!("order-{order}-pay"))
        .send()
        .await
        .expect("the payment service answers");
    StatusCode::from_u16(response.status().as_u16()).unwrap()
}

/// The stock service, keyed by the event's message id.
#[idempotent(key = "<message_id>", ttl = "1h", biz = "e2e_deduct")]
async fn deduct(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    message_id: String,
    event: OrderPaid,
) -> Result<(), AppError> {
    sqlx::query("UPDATE e2e_stock SET qty = qty - ? WHERE sku = ?")
        .bind(event.qty)
        .bind(&event.sku)
        .execute(&mut **tx)
        .await?;
    sqlx::query("INSERT INTO e2e_moves (order_id, message_id, qty) VALUES (?, ?, ?)")
        .bind(event.order_id)
        .bind(&message_id)
        .bind(-event.qty)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

// ---------------------------------------------------------------- plumbing

fn skip(service: &str, e: impl std::fmt::Display) {
    assert!(std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(), "{service} unreachable: {e}");
    eprintln!("skipped: {service} unreachable ({e})");
}

fn unique() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("{}{:x}", std::process::id(), nanos % (1 << 40))
}

/// A MariaDB database of the run's own, with the services' tables.
async fn database(name: &str) -> Option<(Pool<MySql>, Pool<MySql>)> {
    let url = std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let admin = match MySqlPoolOptions::new().max_connections(1).connect(&url).await {
        Ok(pool) => pool,
        Err(e) => {
            skip("mysql", e);
            return None;
        }
    };
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE e2e_{name}"))).execute(&admin).await.unwrap();
    let options: MySqlConnectOptions = url.parse().unwrap();
    let options = options.database(&format!("e2e_{name}"));
    let pay_pool = MySqlPoolOptions::new().max_connections(12).connect_with(options.clone()).await.unwrap();
    let stock_pool = MySqlPoolOptions::new().max_connections(6).connect_with(options).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE e2e_payments (order_id BIGINT PRIMARY KEY, amount BIGINT NOT NULL);
         CREATE TABLE e2e_stock (sku VARCHAR(32) PRIMARY KEY, qty BIGINT NOT NULL);
         CREATE TABLE e2e_moves (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BIGINT NOT NULL, message_id CHAR(32) NOT NULL, qty BIGINT NOT NULL);
         INSERT INTO e2e_stock VALUES ('sku-1', 1000000)",
    )
    .execute(&pay_pool)
    .await
    .unwrap();
    Some((pay_pool, stock_pool))
}

async fn drop_database(name: &str) {
    let url = std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    if let Ok(admin) = MySqlPoolOptions::new().max_connections(1).connect(&url).await {
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE e2e_{name}"))).execute(&admin).await;
    }
}

/// A TCP proxy on loopback in front of a broker, which the test can cut:
/// every connection at once, once `cut_after` more bytes went upstream.
#[derive(Clone)]
struct Proxy {
    port: u16,
    budget: Arc<AtomicU64>,
    armed: Arc<AtomicBool>,
    generation: Arc<AtomicU64>,
    cuts: Arc<AtomicUsize>,
}

impl Proxy {
    async fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = Proxy {
            port: listener.local_addr().unwrap().port(),
            budget: Arc::default(),
            armed: Arc::default(),
            generation: Arc::default(),
            cuts: Arc::default(),
        };
        let p = proxy.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else { continue };
                let p = p.clone();
                tokio::spawn(async move { p.pipe(client, server).await });
            }
        });
        proxy
    }

    /// Cuts every connection once `bytes` more went from a client upstream.
    fn cut_after(&self, bytes: u64) {
        self.budget.store(bytes, SeqCst);
        self.armed.store(true, SeqCst);
    }

    async fn pipe(&self, client: TcpStream, server: TcpStream) {
        let generation = self.generation.load(SeqCst);
        let (mut cr, mut cw) = client.into_split();
        let (mut sr, mut sw) = server.into_split();
        let this = self.clone();
        let up = async move {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = match cr.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if this.generation.load(SeqCst) != generation {
                    return;
                }
                let mut n_ok = n;
                if this.armed.load(SeqCst) {
                    let left = this.budget.load(SeqCst);
                    if (n as u64) >= left {
                        // Let part of this write through, then cut everything.
                        n_ok = left as usize;
                        this.armed.store(false, SeqCst);
                        this.generation.fetch_add(1, SeqCst);
                        this.cuts.fetch_add(1, SeqCst);
                        let _ = sw.write_all(&buf[..n_ok]).await;
                        return;
                    }
                    this.budget.fetch_sub(n as u64, SeqCst);
                }
                if sw.write_all(&buf[..n_ok]).await.is_err() {
                    return;
                }
            }
        };
        let this = self.clone();
        let down = async move {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = match sr.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if this.generation.load(SeqCst) != generation || cw.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        };
        let generations = self.generation.clone();
        let watch = async move {
            while generations.load(SeqCst) == generation {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        // Whichever ends first ends the pair: both sockets close.
        tokio::select! {
            () = up => {}
            () = down => {}
            () = watch => {}
        }
    }
}

/// Wraps a publisher: counts what the broker confirmed, and can abort its
/// relay between publish and mark-sent (it signals, then never returns;
/// the supervisor aborts the relay's task).
struct Faulty<P> {
    inner: P,
    counts: Arc<BrokerCounts>,
    crash_next: Arc<AtomicBool>,
    crashed: Arc<Notify>,
}

#[derive(Default)]
struct BrokerCounts {
    attempts: AtomicU64,
    published: AtomicU64,
    duplicates: AtomicU64,
    crashed_batches: AtomicU64,
    crashed_messages: AtomicU64,
}

impl<P: Publisher> Publisher for Faulty<P> {
    async fn publish(&mut self, batch: &[Message]) -> Vec<Confirm> {
        self.counts.attempts.fetch_add(batch.len() as u64, SeqCst);
        let answers = self.inner.publish(batch).await;
        for answer in &answers {
            if let Confirm::Sent { duplicate } = answer {
                self.counts.published.fetch_add(1, SeqCst);
                self.counts.duplicates.fetch_add(u64::from(*duplicate), SeqCst);
            }
        }
        let sent = answers.iter().filter(|a| matches!(a, Confirm::Sent { .. })).count() as u64;
        if sent > 0 && self.crash_next.swap(false, SeqCst) {
            self.counts.crashed_batches.fetch_add(1, SeqCst);
            self.counts.crashed_messages.fetch_add(sent, SeqCst);
            self.crashed.notify_one();
            std::future::pending::<()>().await;
        }
        answers
    }
}

/// What the consumers saw.
#[derive(Default)]
struct ConsumerCounts {
    executed: AtomicU64,
    replayed: AtomicU64,
    /// A copy met the first one still running: naked/requeued, then replayed.
    in_progress: AtomicU64,
    other: AtomicU64,
    started: AtomicU64,
    settled: AtomicU64,
    killed: AtomicU64,
    orders: Mutex<Vec<i64>>,
}

/// Makes the next delivery (on whichever consumer) hang once its call
/// committed: that consumer is then killed before its ack. `armed` is
/// shared; `fired` is the consumer's own, so its supervisor kills it.
#[derive(Default)]
struct KillSwitch {
    armed: Arc<AtomicBool>,
    fired: Notify,
}

/// The handler both runners call: the call, counted; hangs when the kill
/// switch is armed.
async fn handle(
    idem: Idem<MySql>,
    counts: Arc<ConsumerCounts>,
    kill: Arc<KillSwitch>,
    message_id: String,
    event: OrderPaid,
) -> Result<(), AppError> {
    counts.started.fetch_add(1, SeqCst);
    counts.orders.lock().unwrap().push(event.order_id);
    let (done, outcome) = idempotency::observe(deduct(&idem, message_id, event)).await;
    // Only a delivery that executed is killed: the count below adds the
    // killed ones to the executions (a replayed copy that died would not be one).
    if done.is_ok() && outcome == Some(Outcome::Executed) && kill.armed.swap(false, SeqCst) {
        counts.killed.fetch_add(1, SeqCst);
        kill.fired.notify_one();
        std::future::pending::<()>().await;
    }
    match outcome {
        Some(Outcome::Executed) => counts.executed.fetch_add(1, SeqCst),
        Some(Outcome::Replayed) => counts.replayed.fetch_add(1, SeqCst),
        Some(Outcome::InProgress) => counts.in_progress.fetch_add(1, SeqCst),
        _ => counts.other.fetch_add(1, SeqCst),
    };
    counts.settled.fetch_add(1, SeqCst);
    done
}

/// The run's size and faults.
#[derive(Debug, Clone, Copy)]
struct Plan {
    orders: i64,
    duplicates: usize,
    /// Every how many orders one is rolled back after queueing.
    roll_back_every: i64,
    /// How many times each fault is injected, spread over the run.
    faults: usize,
    batch_size: u32,
}

const SHORT: Plan = Plan { orders: 300, duplicates: 3, roll_back_every: 10, faults: 1, batch_size: 20 };
const SOAK: Plan = Plan { orders: 20_000, duplicates: 3, roll_back_every: 10, faults: 30, batch_size: 50 };

/// One broker, as the harness drives it.
trait Broker: Send + Sync + 'static {
    type Publisher: Publisher + 'static;
    /// Where the events go (routing key or subject).
    fn destination(&self) -> String;
    /// A publisher through `proxy`.
    fn publisher(&self, proxy: u16) -> impl Future<Output = Self::Publisher> + Send;
    /// Runs one consumer until its task is aborted (or `stop` fires).
    fn consumer(
        &self,
        idem: Idem<MySql>,
        counts: Arc<ConsumerCounts>,
        kill: Arc<KillSwitch>,
        stop: oneshot::Receiver<()>,
    ) -> impl Future<Output = Running> + Send;
    /// Nothing left in the broker for the consumers (ready or unacked).
    fn drained(&self) -> impl Future<Output = bool> + Send;
    /// Messages the broker holds for the consumers' stream, if it keeps them.
    fn stored(&self) -> impl Future<Output = Option<u64>> + Send;
    /// Dead letters the consumers made.
    fn dead_letters(&self) -> impl Future<Output = u64> + Send;
    fn upstream_port(&self) -> u16;
    fn cleanup(&self) -> impl Future<Output = ()> + Send;
}

/// A running consumer: its task and how to end it.
struct Running {
    task: JoinHandle<()>,
    /// Drops its connection (RabbitMQ: the unacked delivery goes back at once).
    sever: Box<dyn FnOnce() -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send>,
}

/// The counts of one run, printed and reconciled.
#[derive(Debug, Default)]
#[allow(dead_code)] // printed through Debug
struct Report {
    calls: u64,
    call_errors_rolled_back: u64,
    payments: u64,
    events_queued: u64,
    events_sent: u64,
    /// Messages handed to the broker, every attempt counted.
    publish_attempts: u64,
    /// Of those, confirmed (NATS: duplicates included).
    published: u64,
    /// Attempts beyond one per event: after a crash, a cut, a lost confirm.
    republished: u64,
    /// NATS: copies the server dropped (`Nats-Msg-Id` within its window).
    deduplicated_by_broker: u64,
    /// NATS: messages the stream holds (each event once).
    stored_by_broker: Option<u64>,
    deduplicated_by_consumer: u64,
    consumer_executions: u64,
    dead_rows: u64,
    dead_letters: u64,
    stock_moves: u64,
    relay_crashes: u64,
    connection_cuts: u64,
    consumer_kills: u64,
    unconfirmed: u64,
    seconds: f64,
}

async fn within<F: Future<Output = bool>>(what: &str, limit: Duration, mut check: impl FnMut() -> F) {
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < limit, "gave up after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn scalar(pool: &Pool<MySql>, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// The end-to-end run on `broker`, then the reconciliation.
async fn end_to_end<B: Broker>(broker: Arc<B>, name: &str, plan: Plan) -> Report {
    let started = Instant::now();
    let Some((pay_pool, stock_pool)) = database(name).await else { return Report::default() };
    let payer = Idem::builder(pay_pool.clone()).build();
    payer.migrate().await.unwrap();
    let stock = Idem::new(stock_pool.clone());
    let proxy = Proxy::start(broker.upstream_port()).await;
    let counts = Arc::new(BrokerCounts::default());
    let consumer_counts = Arc::new(ConsumerCounts::default());
    let stop_all = Arc::new(AtomicBool::new(false));

    // Two relays, supervised: one aborted between publish and mark is replaced.
    let crash_next = Arc::new(AtomicBool::new(false));
    let mut relay_supervisors = Vec::new();
    let unconfirmed = Arc::new(AtomicU64::new(0));
    for _ in 0..2 {
        let (broker, proxy_port) = (broker.clone(), proxy.port);
        let (payer, counts, crash_next, stop_all, unconfirmed) =
            (payer.clone(), counts.clone(), crash_next.clone(), stop_all.clone(), unconfirmed.clone());
        relay_supervisors.push(tokio::spawn(async move {
            loop {
                let crashed = Arc::new(Notify::new());
                let inner = broker.publisher(proxy_port).await;
                let publisher =
                    Faulty { inner, counts: counts.clone(), crash_next: crash_next.clone(), crashed: crashed.clone() };
                let relay = Relay::new(&payer, publisher)
                    .batch_size(plan.batch_size)
                    .poll_interval(Duration::from_millis(50))
                    .retry_backoff(Duration::from_millis(20), Duration::from_millis(500));
                let stats = relay.stats();
                let stop_flag = stop_all.clone();
                let mut task = tokio::spawn(relay.run(async move {
                    while !stop_flag.load(SeqCst) {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }));
                tokio::select! {
                    _ = &mut task => {
                        unconfirmed.fetch_add(stats.unconfirmed(), SeqCst);
                        return;
                    }
                    () = crashed.notified() => {
                        task.abort();
                        let _ = task.await;
                        unconfirmed.fetch_add(stats.unconfirmed(), SeqCst);
                    }
                }
            }
        }));
    }

    // Two consumers, supervised: one killed before its ack is replaced.
    let kill_armed = Arc::new(AtomicBool::new(false));
    let mut consumer_supervisors = Vec::new();
    for _ in 0..2 {
        let kill = Arc::new(KillSwitch { armed: kill_armed.clone(), fired: Notify::new() });
        let (broker, stock, consumer_counts, stop_all) =
            (broker.clone(), stock.clone(), consumer_counts.clone(), stop_all.clone());
        consumer_supervisors.push(tokio::spawn(async move {
            loop {
                let (stop_tx, stop_rx) = oneshot::channel();
                let running = broker.consumer(stock.clone(), consumer_counts.clone(), kill.clone(), stop_rx).await;
                let Running { mut task, sever } = running;
                let stop_flag = stop_all.clone();
                let stopping = async move {
                    while !stop_flag.load(SeqCst) {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                };
                tokio::select! {
                    () = kill.fired.notified() => {
                        // Dropped before its ack: the broker delivers again.
                        task.abort();
                        let _ = task.await;
                        sever().await;
                        drop(stop_tx);
                    }
                    () = stopping => {
                        let _ = stop_tx.send(());
                        let _ = tokio::time::timeout(Duration::from_secs(30), &mut task).await;
                        task.abort();
                        sever().await;
                        return;
                    }
                    _ = &mut task => {
                        sever().await;
                        return;
                    }
                }
            }
        }));
    }

    // The calls, over HTTP: every order paid `duplicates` times at once; some roll back.
    let destination = broker.destination();
    let base = serve(PayApp { idem: payer.clone(), destination: destination.clone() }).await;
    let client = reqwest::Client::new();
    let every = plan.roll_back_every;
    let rolled_back = move |order: i64| order % every == 3;
    let mut calls = 0u64;
    let mut rolled_back_errors = 0u64;
    let fault_every = (plan.orders / (plan.faults as i64 + 1)).max(1);
    let mut order = 1;
    while order <= plan.orders {
        let chunk_end = (order + 20).min(plan.orders + 1);
        let mut set = tokio::task::JoinSet::new();
        for o in order..chunk_end {
            for _ in 0..plan.duplicates {
                let (client, base) = (client.clone(), base.clone());
                set.spawn(async move { pay_over_http(&client, &base, o, rolled_back(o)).await });
            }
        }
        while let Some(done) = set.join_next().await {
            calls += 1;
            match done.unwrap() {
                StatusCode::OK | StatusCode::CONFLICT => {}
                StatusCode::PAYMENT_REQUIRED => rolled_back_errors += 1,
                other => panic!("pay answered {other}"),
            }
        }
        // The faults, spread over the run.
        for o in order..chunk_end {
            if o % fault_every == 0 {
                match (o / fault_every) % 3 {
                    0 => crash_next.store(true, SeqCst),
                    1 => proxy.cut_after(3000),
                    _ => kill_armed.store(true, SeqCst),
                }
            }
        }
        order = chunk_end;
    }
    // A duplicate that met its first call in progress is paid again now
    // (replays): every order not rolled back is paid.
    for o in 1..=plan.orders {
        if !rolled_back(o) {
            assert_eq!(pay_over_http(&client, &base, o, false).await, StatusCode::OK);
        }
    }
    // Each fault at least once, even in a short run.
    crash_next.store(true, SeqCst);
    for o in plan.orders + 1..=plan.orders + 5 {
        assert_eq!(pay_over_http(&client, &base, o, false).await, StatusCode::OK);
        calls += 1;
    }
    let total_orders = plan.orders + 5;
    let expected_payments = (1..=total_orders).filter(|o| !rolled_back(*o) || *o > plan.orders).count() as i64;

    within("every payment's stock move", Duration::from_secs(120), || async {
        scalar(&stock_pool, "SELECT COUNT(DISTINCT order_id) FROM e2e_moves").await >= expected_payments
    })
    .await;
    if counts.crashed_batches.load(SeqCst) == 0
        || proxy.cuts.load(SeqCst) == 0
        || consumer_counts.killed.load(SeqCst) == 0
    {
        // A fault still armed (the run was quicker than it): fire each once more.
        if counts.crashed_batches.load(SeqCst) == 0 {
            crash_next.store(true, SeqCst);
        }
        if proxy.cuts.load(SeqCst) == 0 {
            proxy.cut_after(1500);
        }
        if consumer_counts.killed.load(SeqCst) == 0 {
            kill_armed.store(true, SeqCst);
        }
    }
    for o in total_orders + 1..=total_orders + 30 {
        assert_eq!(pay_over_http(&client, &base, o, false).await, StatusCode::OK);
        calls += 1;
    }
    let total_orders = total_orders + 30;
    let expected_payments = expected_payments + 30;
    within("every payment's stock move", Duration::from_secs(120), || async {
        scalar(&stock_pool, "SELECT COUNT(DISTINCT order_id) FROM e2e_moves").await >= expected_payments
    })
    .await;
    within("the outbox sent", Duration::from_secs(120), || async {
        payer.outbox().counts().await.unwrap().pending == 0
    })
    .await;
    within("the broker drained", Duration::from_secs(120), || async {
        broker.drained().await
            && consumer_counts.started.load(SeqCst)
                == consumer_counts.settled.load(SeqCst) + consumer_counts.killed.load(SeqCst)
    })
    .await;
    stop_all.store(true, SeqCst);
    for s in relay_supervisors.into_iter().chain(consumer_supervisors) {
        tokio::time::timeout(Duration::from_secs(60), s).await.expect("stopped in time").unwrap();
    }

    // Reconcile.
    let outbox = payer.outbox().counts().await.unwrap();
    let payments = scalar(&pay_pool, "SELECT COUNT(*) FROM e2e_payments").await;
    let events = scalar(&pay_pool, "SELECT COUNT(*) FROM idem_outbox").await;
    let paid_events =
        scalar(&pay_pool, "SELECT COUNT(*) FROM idem_outbox o JOIN e2e_payments p ON o.aggregate_key = CONCAT('order-', p.order_id) WHERE o.status = 1").await;
    let moves = scalar(&stock_pool, "SELECT COUNT(*) FROM e2e_moves").await;
    let moved_orders = scalar(&stock_pool, "SELECT COUNT(DISTINCT order_id) FROM e2e_moves").await;
    let orphan_moves = scalar(
        &stock_pool,
        "SELECT COUNT(*) FROM e2e_moves m LEFT JOIN e2e_payments p ON p.order_id = m.order_id WHERE p.order_id IS NULL",
    )
    .await;
    let stock_left = scalar(&stock_pool, "SELECT qty FROM e2e_stock").await;
    let rolled_back_orders: HashSet<i64> = (1..=plan.orders).filter(|o| rolled_back(*o)).collect();
    let delivered_rolled_back =
        consumer_counts.orders.lock().unwrap().iter().filter(|o| rolled_back_orders.contains(o)).count();
    let report = Report {
        calls,
        call_errors_rolled_back: rolled_back_errors,
        payments: payments as u64,
        events_queued: events as u64,
        events_sent: outbox.sent,
        published: counts.published.load(SeqCst),
        publish_attempts: counts.attempts.load(SeqCst),
        republished: counts.attempts.load(SeqCst).saturating_sub(events as u64),
        stored_by_broker: broker.stored().await,
        deduplicated_by_broker: counts.duplicates.load(SeqCst),
        deduplicated_by_consumer: consumer_counts.replayed.load(SeqCst),
        consumer_executions: moves as u64,
        dead_rows: outbox.dead,
        dead_letters: broker.dead_letters().await,
        stock_moves: moves as u64,
        relay_crashes: counts.crashed_batches.load(SeqCst),
        connection_cuts: proxy.cuts.load(SeqCst) as u64,
        consumer_kills: consumer_counts.killed.load(SeqCst),
        unconfirmed: unconfirmed.load(SeqCst),
        seconds: started.elapsed().as_secs_f64(),
    };
    println!("{name}: {report:#?}");

    assert_eq!(payments, expected_payments, "payments");
    assert_eq!(
        payments as u64 + rolled_back_orders.len() as u64,
        total_orders as u64,
        "every order paid or rolled back"
    );
    assert_eq!(events, payments, "exactly one order.paid row per payment, none for a rolled-back body");
    assert_eq!(paid_events, payments, "every payment's event published and marked sent");
    assert_eq!((outbox.pending, outbox.dead, report.dead_letters), (0, 0, 0), "nothing pending or dead");
    assert_eq!(moves, payments, "exactly one stock move per payment");
    assert_eq!(moved_orders, payments, "one move per paid order");
    assert_eq!(orphan_moves, 0, "no stock move without a payment");
    assert_eq!(delivered_rolled_back, 0, "an event of a rolled-back body left the database");
    assert_eq!(stock_left, 1_000_000 - payments, "stock");
    assert_eq!(consumer_counts.other.load(SeqCst), 0, "every delivery executed, replayed or in progress");
    assert_eq!(consumer_counts.executed.load(SeqCst) + report.consumer_kills, payments as u64, "executions");
    assert!(report.published >= events as u64, "published {} < events {events}", report.published);
    if let Some(stored) = report.stored_by_broker {
        assert_eq!(stored, events as u64, "the stream holds each event once: {report:?}");
    }
    assert!(
        report.relay_crashes >= 1 && report.connection_cuts >= 1 && report.consumer_kills >= 1,
        "faults: {report:?}"
    );
    // The crashed batches went out again: dropped by the broker (NATS) or
    // replayed by the consumer (RabbitMQ); the killed consumer's delivery too.
    let crashed = counts.crashed_messages.load(SeqCst);
    assert!(
        report.deduplicated_by_broker + report.deduplicated_by_consumer >= crashed + report.consumer_kills,
        "re-published copies not deduplicated: {report:?}, crashed {crashed}"
    );
    broker.cleanup().await;
    pay_pool.close().await;
    stock_pool.close().await;
    drop_database(name).await;
    report
}

// ---------------------------------------------------------------- RabbitMQ

mod rabbit {
    use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::FieldTable;
    use lapin::{Connection, ConnectionProperties};

    use super::*;

    pub fn url() -> String {
        std::env::var("IDEM_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
    }

    pub struct Rabbit {
        pub queue: String,
        pub admin: lapin::Channel,
    }

    impl Rabbit {
        pub async fn new(name: &str) -> Option<Rabbit> {
            let conn = match Connection::connect(&url(), ConnectionProperties::default()).await {
                Ok(conn) => conn,
                Err(e) => {
                    skip("rabbitmq", e);
                    return None;
                }
            };
            let admin = conn.create_channel().await.unwrap();
            let queue = format!("e2e.{name}");
            idempotency::amqp::declare_with_dead_letter(&admin, &queue).await.unwrap();
            Some(Rabbit { queue, admin })
        }

        async fn count(&self, queue: &str) -> u32 {
            let passive = QueueDeclareOptions { passive: true, durable: true, ..QueueDeclareOptions::default() };
            match self.admin.queue_declare(queue.into(), passive, FieldTable::default()).await {
                Ok(q) => q.message_count(),
                Err(_) => u32::MAX,
            }
        }
    }

    impl Broker for Rabbit {
        type Publisher = idempotency::outbox::rabbit::RabbitPublisher;

        fn destination(&self) -> String {
            self.queue.clone()
        }

        async fn publisher(&self, proxy: u16) -> Self::Publisher {
            idempotency::outbox::rabbit::RabbitPublisher::new(format!("amqp://guest:guest@127.0.0.1:{proxy}/%2f"))
                .confirm_timeout(Duration::from_secs(3))
        }

        async fn consumer(
            &self,
            idem: Idem<MySql>,
            counts: Arc<ConsumerCounts>,
            kill: Arc<KillSwitch>,
            stop: oneshot::Receiver<()>,
        ) -> Running {
            let conn = Connection::connect(&url(), ConnectionProperties::default()).await.unwrap();
            let channel = conn.create_channel().await.unwrap();
            let queue = self.queue.clone();
            let task = tokio::spawn(async move {
                let shutdown = async move {
                    let _ = stop.await;
                };
                let _ = idempotency::amqp::Consumer::new(channel, queue)
                    .retry_delay(Duration::from_millis(50))
                    .in_progress_delay(Duration::from_millis(50))
                    .run_with_id(shutdown, move |id: String, event: OrderPaid| {
                        handle(idem.clone(), counts.clone(), kill.clone(), id, event)
                    })
                    .await;
            });
            let sever = Box::new(move || -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
                Box::pin(async move {
                    let _ = conn.close(200, "e2e".into()).await;
                })
            });
            Running { task, sever }
        }

        async fn drained(&self) -> bool {
            self.count(&self.queue).await == 0
        }

        async fn stored(&self) -> Option<u64> {
            // A queue forgets acked messages.
            None
        }

        async fn dead_letters(&self) -> u64 {
            u64::from(self.count(&format!("{}.dlq", self.queue)).await)
        }

        fn upstream_port(&self) -> u16 {
            5672
        }

        async fn cleanup(&self) {
            for q in [self.queue.clone(), format!("{}.dlq", self.queue)] {
                let _ = self.admin.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
            }
        }
    }
}

// ---------------------------------------------------------------- NATS JetStream

mod nats {
    use idempotency::nats::async_nats::{self, jetstream};

    use super::*;

    pub fn url() -> String {
        std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into())
    }

    pub struct Nats {
        pub js: jetstream::Context,
        pub names: idempotency::nats::DeadLetter,
        pub subject: String,
    }

    impl Nats {
        pub async fn new(name: &str) -> Option<Nats> {
            let client = match async_nats::connect(url()).await {
                Ok(client) => client,
                Err(e) => {
                    skip("nats", e);
                    return None;
                }
            };
            let js = jetstream::new(client);
            let stream = format!("E2E{name}");
            let subject = format!("e2e.{name}.paid");
            let names = idempotency::nats::declare_with_dead_letter(&js, &stream, &[subject.as_str()]).await.unwrap();
            Some(Nats { js, names, subject })
        }
    }

    impl Broker for Nats {
        type Publisher = idempotency::outbox::nats::NatsPublisher;

        fn destination(&self) -> String {
            self.subject.clone()
        }

        async fn publisher(&self, proxy: u16) -> Self::Publisher {
            let client = async_nats::ConnectOptions::new()
                .reconnect_delay_callback(|n| Duration::from_millis(50 * (n as u64).min(10)))
                .connect(format!("127.0.0.1:{proxy}"))
                .await
                .unwrap();
            idempotency::outbox::nats::NatsPublisher::new(client).ack_timeout(Duration::from_secs(3))
        }

        async fn consumer(
            &self,
            idem: Idem<MySql>,
            counts: Arc<ConsumerCounts>,
            kill: Arc<KillSwitch>,
            stop: oneshot::Receiver<()>,
        ) -> Running {
            let client = async_nats::connect(url()).await.unwrap();
            let js = jetstream::new(client.clone());
            let stream = self.names.stream.clone();
            let task = tokio::spawn(async move {
                let shutdown = async move {
                    let _ = stop.await;
                };
                let _ = idempotency::nats::Consumer::new(js, stream, "stock")
                    .ack_wait(Duration::from_secs(2))
                    .retry_delay(Duration::from_millis(50))
                    .in_progress_delay(Duration::from_millis(50))
                    .run_with_id(shutdown, move |id: String, event: OrderPaid| {
                        handle(idem.clone(), counts.clone(), kill.clone(), id, event)
                    })
                    .await;
            });
            let sever = Box::new(move || -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
                Box::pin(async move {
                    drop(client);
                })
            });
            Running { task, sever }
        }

        async fn drained(&self) -> bool {
            let Ok(stream) = self.js.get_stream(&self.names.stream).await else { return false };
            match stream.consumer_info("stock").await {
                Ok(info) => info.num_pending == 0 && info.num_ack_pending == 0,
                Err(_) => false,
            }
        }

        async fn stored(&self) -> Option<u64> {
            let mut stream = self.js.get_stream(&self.names.stream).await.ok()?;
            stream.info().await.ok().map(|i| i.state.messages)
        }

        async fn dead_letters(&self) -> u64 {
            match self.js.get_stream(&self.names.dead_letter_stream).await {
                Ok(mut stream) => stream.info().await.map(|i| i.state.messages).unwrap_or(u64::MAX),
                Err(_) => u64::MAX,
            }
        }

        fn upstream_port(&self) -> u16 {
            url().rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(4222)
        }

        async fn cleanup(&self) {
            let _ = self.js.delete_stream(&self.names.stream).await;
            let _ = self.js.delete_stream(&self.names.dead_letter_stream).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_end_to_end_short() {
    let name = format!("r{}", unique());
    let Some(broker) = rabbit::Rabbit::new(&name).await else { return };
    end_to_end(Arc::new(broker), &name, SHORT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_end_to_end_short() {
    let name = format!("n{}", unique());
    let Some(broker) = nats::Nats::new(&name).await else { return };
    end_to_end(Arc::new(broker), &name, SHORT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak: a few minutes; run with --ignored"]
async fn soak_rabbitmq_end_to_end() {
    let name = format!("rs{}", unique());
    let Some(broker) = rabbit::Rabbit::new(&name).await else { return };
    end_to_end(Arc::new(broker), &name, SOAK).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak: a few minutes; run with --ignored"]
async fn soak_nats_end_to_end() {
    let name = format!("ns{}", unique());
    let Some(broker) = nats::Nats::new(&name).await else { return };
    end_to_end(Arc::new(broker), &name, SOAK).await;
}

// ---------------------------------------------------------------- each publisher on the wire

/// Queues `(destination, payload)` events with ids of their own; returns the ids.
async fn seed(idem: &Idem<MySql>, events: &[(&str, &str)]) -> Vec<String> {
    let mut tx = idem.pool().begin().await.unwrap();
    let mut ids = Vec::new();
    for (i, (destination, payload)) in events.iter().enumerate() {
        let id = idempotency::outbox::MessageId::derive("e2e_seed", &format!("s{}_{i}", unique()), 0).unwrap();
        let event = Event::raw(*destination, *payload).header("x-test", "yes").id(id.clone());
        idempotency::outbox::queue(&mut tx, event).await.unwrap();
        ids.push(id.to_string());
    }
    tx.commit().await.unwrap();
    ids
}

/// Runs `relay` until the outbox holds `sent` sent and `dead` dead rows;
/// if it never does, the failure shows each batch the relay made and when.
async fn relay_until<P: Publisher + 'static>(idem: &Idem<MySql>, relay: Relay<MySql, P>, sent: u64, dead: u64) {
    let started = Instant::now();
    let batches = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&batches);
    let relay = relay.on_batch(move |report| seen.lock().unwrap().push((started.elapsed(), report.clone())));
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));
    let limit = Duration::from_secs(30);
    loop {
        let counts = idem.outbox().counts().await.unwrap();
        if counts.sent == sent && counts.dead == dead {
            break;
        }
        if started.elapsed() >= limit {
            let rows = idem.outbox().dead(10).await.unwrap();
            let batches = batches.lock().unwrap().clone();
            panic!(
                "gave up after {limit:?} waiting for the relay's marks: {counts:?}; dead {rows:?}; batches {batches:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_relay_sends_message_ids_and_refuses_unroutable_events_until_dead() {
    use lapin::options::{BasicAckOptions, BasicGetOptions};
    let name = format!("w{}", unique());
    let Some(broker) = rabbit::Rabbit::new(&name).await else { return };
    let Some((pool, other)) = database(&name).await else { return };
    other.close().await;
    let idem = Idem::new(pool);
    idem.migrate().await.unwrap();
    let nowhere = format!("e2e.nowhere.{name}");
    let ids = seed(&idem, &[(&broker.queue, "{\"n\":1}"), (&broker.queue, "{\"n\":2}"), (&nowhere, "{}")]).await;
    let publisher = idempotency::outbox::rabbit::RabbitPublisher::new(rabbit::url());
    let relay = Relay::new(&idem, publisher)
        .max_attempts(2)
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(20));
    relay_until(&idem, relay, 2, 1).await;
    for (id, payload) in ids.iter().zip(["{\"n\":1}", "{\"n\":2}"]) {
        let got = broker
            .admin
            .basic_get(broker.queue.as_str().into(), BasicGetOptions::default())
            .await
            .unwrap()
            .expect("a message");
        let props = &got.delivery.properties;
        assert_eq!(props.message_id().as_ref().map(|s| s.as_str()), Some(id.as_str()));
        assert_eq!(props.delivery_mode(), &Some(2));
        assert_eq!(props.content_type().as_ref().map(|s| s.as_str()), Some("application/json"));
        let header = props.headers().as_ref().and_then(|h| h.inner().get("x-test").cloned());
        assert_eq!(header, Some(lapin::types::AMQPValue::LongString("yes".into())));
        assert_eq!(std::str::from_utf8(&got.delivery.data).unwrap(), payload);
        got.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    let dead = idem.outbox().dead(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].message_id.as_str(), dead[0].attempts), (ids[2].as_str(), 2));
    assert!(dead[0].last_error.as_deref().unwrap_or("").contains("NO_ROUTE"), "{:?}", dead[0].last_error);
    broker.cleanup().await;
    idem.pool().close().await;
    drop_database(&name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_relay_sends_msg_ids_the_stream_drops_a_republished_copy_and_a_subject_without_stream_dies() {
    let name = format!("v{}", unique());
    let Some(broker) = nats::Nats::new(&name).await else { return };
    let Some((pool, other)) = database(&name).await else { return };
    other.close().await;
    let idem = Idem::new(pool);
    idem.migrate().await.unwrap();
    let nowhere = format!("e2e.nowhere.{name}");
    let ids = seed(&idem, &[(&broker.subject, "{\"n\":1}"), (&broker.subject, "{\"n\":2}"), (&nowhere, "{}")]).await;
    let client = idempotency::nats::async_nats::connect(nats::url()).await.unwrap();
    let relay = Relay::new(&idem, idempotency::outbox::nats::NatsPublisher::new(client.clone()))
        .max_attempts(2)
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(20));
    relay_until(&idem, relay, 2, 1).await;
    let stream = broker.js.get_stream(&broker.names.stream).await.unwrap();
    for (seq, (id, payload)) in ids.iter().zip(["{\"n\":1}", "{\"n\":2}"]).enumerate() {
        let message = stream.get_raw_message(seq as u64 + 1).await.unwrap();
        assert_eq!(message.headers.get("Nats-Msg-Id").map(|v| v.as_str()), Some(id.as_str()));
        assert_eq!(message.headers.get("x-test").map(|v| v.as_str()), Some("yes"));
        assert_eq!(std::str::from_utf8(&message.payload).unwrap(), payload);
    }
    let dead = idem.outbox().dead(10).await.unwrap();
    assert_eq!((dead.len(), dead[0].message_id.as_str()), (1, ids[2].as_str()));
    // A relay that lost its marks publishes again: the stream drops the copy.
    sqlx::query("UPDATE idem_outbox SET status = 0 WHERE message_id = ?")
        .bind(&ids[0])
        .execute(idem.pool())
        .await
        .unwrap();
    let relay = Relay::new(&idem, idempotency::outbox::nats::NatsPublisher::new(client));
    let stats = relay.stats();
    relay_until(&idem, relay, 2, 1).await;
    assert_eq!((stats.published(), stats.duplicates()), (1, 1));
    assert_eq!(broker.stored().await, Some(2));
    broker.cleanup().await;
    idem.pool().close().await;
    drop_database(&name).await;
}
