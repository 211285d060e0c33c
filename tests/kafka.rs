//! `idempotency::kafka`: the Kafka consumer runner and the outbox relay to
//! Kafka, end to end against a real Kafka-protocol broker (tansu, a private
//! one per test: `idempotency_testkit::kafka`) and MariaDB (`IDEM_MYSQL_URL`,
//! a database per test). Each test waits for what it names (the runner's
//! `on_settle` hook, a handler's signal, the broker's own committed offsets
//! and topics), and ends by reconciling the business table, the record
//! table and the topics.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency::kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use idempotency::kafka::rdkafka::message::{Header, Headers, OwnedHeaders};
use idempotency::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idempotency::kafka::rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};
use idempotency::kafka::{Action, Consumer, DeadLetter, Reason, Settled};
use idempotency::outbox::{Event, Relay, kafka::KafkaPublisher};
use idempotency::{Idem, Outcome, idempotent};
use idempotency_testkit::kafka::Tansu;
use serde::{Deserialize, Serialize};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{MySql, Pool, Transaction};
use tokio::sync::{Notify, mpsc, oneshot};

/// A hang becomes a failure after this; nothing waits for it to pass.
const BOUND: Duration = Duration::from_secs(90);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPaid {
    order_id: i64,
    sku: String,
    qty: i64,
}

/// The handlers' error: boxed, so the runner finds an `idempotency::Error`
/// in it through `AsIdemError` (a database down is waited out).
type StockError = Box<dyn std::error::Error + Send + Sync>;

async fn deduct_in(tx: &mut Transaction<'_, MySql>, event: &OrderPaid) -> Result<(), StockError> {
    let updated = sqlx::query("UPDATE stock SET qty = qty - ? WHERE sku = ?")
        .bind(event.qty)
        .bind(&event.sku)
        .execute(&mut **tx)
        .await?;
    if updated.rows_affected() == 0 {
        return Err(format!("unknown sku {}", event.sku).into());
    }
    sqlx::query("INSERT INTO moves (order_id, sku, qty) VALUES (?, ?, ?)")
        .bind(event.order_id)
        .bind(&event.sku)
        .bind(-event.qty)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Keyed by business fields, never by the offset.
#[idempotent(key = "order_paid_<event.order_id>", ttl = "1h", biz = "t_kafka_deduct")]
async fn deduct_stock(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, event: OrderPaid) -> Result<(), StockError> {
    deduct_in(tx, &event).await
}

/// Keyed by the message's `Idem-Message-Id` (the outbox relay's event id).
#[idempotent(key = "<message_id>", ttl = "1h", biz = "t_kafka_deduct_id")]
async fn deduct_by_id(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    message_id: String,
    event: OrderPaid,
) -> Result<(), StockError> {
    deduct_in(tx, &event).await
}

/// A MariaDB database of the test's own, with the stock tables; `None` (a
/// skip) when MariaDB is unreachable.
async fn database(name: &str) -> Option<Pool<MySql>> {
    let url = idempotency_testkit::mysql_url();
    let admin = idempotency_testkit::reach("mysql", || async {
        MySqlPoolOptions::new().max_connections(1).connect(&url).await.ok()
    })
    .await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&admin).await.unwrap();
    let options: MySqlConnectOptions = url.parse().unwrap();
    let pool = MySqlPoolOptions::new().max_connections(8).connect_with(options.database(name)).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE stock (sku VARCHAR(64) PRIMARY KEY, qty BIGINT NOT NULL);
         CREATE TABLE moves (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BIGINT NOT NULL, sku VARCHAR(64) NOT NULL, qty BIGINT NOT NULL);
         INSERT INTO stock VALUES ('sku-1', 1000)",
    )
    .execute(&pool)
    .await
    .unwrap();
    Some(pool)
}

async fn drop_database(name: &str) {
    if let Ok(admin) = MySqlPoolOptions::new().max_connections(1).connect(&idempotency_testkit::mysql_url()).await {
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {name}"))).execute(&admin).await;
    }
}

/// A test's world: its broker, its database, its topic and group.
struct World {
    broker: Tansu,
    db: String,
    idem: Idem<MySql>,
    topic: String,
    group: String,
    names: DeadLetter,
    producer: FutureProducer,
}

/// `None` (after printing why) when tansu or MariaDB is missing.
async fn world(partitions: i32, redis: bool) -> Option<World> {
    let broker = Tansu::start()?;
    let db = format!("kafka_{}", idempotency_testkit::unique("t").replace('-', "_"));
    let pool = database(&db).await?;
    let idem = match redis {
        true => Idem::builder(pool).redis(redis::Client::open(idempotency_testkit::redis_url()).unwrap()).build(),
        false => Idem::new(pool),
    };
    idem.migrate().await.unwrap();
    let (topic, group) = ("orders".to_owned(), "stock".to_owned());
    let config = client_config(&broker.bootstrap());
    let names = idempotency::kafka::declare_with_dead_letter(&config, &topic, &group, partitions, 1).await.unwrap();
    let producer: FutureProducer = config.create().unwrap();
    Some(World { broker, db, idem, topic, group, names, producer })
}

fn client_config(bootstrap: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", bootstrap);
    config
}

impl World {
    fn config(&self) -> ClientConfig {
        client_config(&self.broker.bootstrap())
    }

    fn consumer(&self) -> Consumer {
        Consumer::new(self.config(), &self.topic, &self.group)
    }

    /// Produces `payload` to `partition` with `key`, and the headers given.
    async fn produce(&self, partition: i32, key: &str, payload: &[u8], headers: &[(&str, &str)]) {
        let headers =
            headers.iter().fold(OwnedHeaders::new(), |h, (k, v)| h.insert(Header { key: k, value: Some(*v) }));
        let record = FutureRecord::to(&self.topic).partition(partition).key(key).payload(payload).headers(headers);
        self.producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
    }

    async fn produce_event(&self, partition: i32, event: &OrderPaid) {
        let key = event.order_id.to_string();
        self.produce(partition, &key, &serde_json::to_vec(event).unwrap(), &[]).await;
    }

    /// Rows of `moves` per order id.
    async fn moves(&self) -> BTreeMap<i64, i64> {
        let rows: Vec<(i64, i64)> = sqlx::query_as("SELECT order_id, COUNT(*) FROM moves GROUP BY order_id")
            .fetch_all(self.idem.pool())
            .await
            .unwrap();
        rows.into_iter().collect()
    }

    /// Committed records of `biz`.
    async fn records(&self, biz: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM idem_record WHERE biz_type = ? AND status = 1")
            .bind(biz)
            .fetch_one(self.idem.pool())
            .await
            .unwrap()
    }

    /// The first `expected` messages of `topic` as the broker holds them,
    /// by partition and offset. (Read by count: tansu 0.6's high watermark
    /// can lag its last message by one.)
    fn read_topic(&self, topic: &str, expected: usize) -> Vec<Read> {
        let mut config = self.config();
        config.set("group.id", "reader").set("enable.auto.commit", "false");
        let reader: BaseConsumer = config.create().unwrap();
        let metadata = reader.fetch_metadata(Some(topic), Duration::from_secs(10)).unwrap();
        let mut list = TopicPartitionList::new();
        for partition in metadata.topics()[0].partitions() {
            list.add_partition_offset(topic, partition.id(), Offset::Beginning).unwrap();
        }
        reader.assign(&list).unwrap();
        let start = Instant::now();
        let mut out = Vec::new();
        while out.len() < expected {
            assert!(start.elapsed() < BOUND, "{topic}: {} messages of {expected}: {out:?}", out.len());
            let Some(message) = reader.poll(Duration::from_millis(200)) else { continue };
            let message = message.unwrap();
            let headers = message
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| (h.key.to_owned(), String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned()))
                        .collect()
                })
                .unwrap_or_default();
            out.push(Read {
                partition: message.partition(),
                offset: message.offset(),
                key: message.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                headers,
                payload: message.payload().map(|p| String::from_utf8_lossy(p).into_owned()).unwrap_or_default(),
            });
        }
        out.sort_by_key(|r| (r.partition, r.offset));
        out
    }

    /// The group's committed offset per partition of `topic`, as the broker
    /// holds it (`None`: nothing committed).
    fn committed(&self, topic: &str, partitions: i32) -> Vec<Option<i64>> {
        let mut config = self.config();
        config.set("group.id", &self.group).set("enable.auto.commit", "false");
        let reader: BaseConsumer = config.create().unwrap();
        let mut list = TopicPartitionList::new();
        for p in 0..partitions {
            list.add_partition(topic, p);
        }
        let committed = reader.committed_offsets(list, Duration::from_secs(10)).unwrap();
        (0..partitions)
            .map(|p| match committed.find_partition(topic, p).unwrap().offset() {
                Offset::Offset(at) => Some(at),
                _ => None,
            })
            .collect()
    }

    /// Waits until the group's committed offsets of `topic` are `expected`.
    fn await_committed(&self, topic: &str, expected: &[Option<i64>]) {
        let start = Instant::now();
        loop {
            let now = self.committed(topic, i32::try_from(expected.len()).unwrap());
            if now == expected {
                return;
            }
            assert!(start.elapsed() < BOUND, "committed offsets of {topic}: {now:?}, never {expected:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    async fn remove(self) {
        drop_database(&self.db).await;
    }
}

/// One message as the broker holds it.
#[derive(Debug, Clone)]
struct Read {
    partition: i32,
    offset: i64,
    key: Option<String>,
    headers: Vec<(String, String)>,
    payload: String,
}

impl Read {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// A runner in a task of its own: its settlements, and how to stop it.
struct Running {
    settlements: mpsc::UnboundedReceiver<Settled>,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    fn start<F, Fut>(consumer: Consumer, handler: F) -> Self
    where
        F: Fn(OrderPaid) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), StockError>> + Send + 'static,
    {
        Self::logged(consumer, handler, Log::default())
    }

    /// Also writes `settled <offset>` into `log` as each settles.
    fn logged<F, Fut>(consumer: Consumer, handler: F, log: Log) -> Self
    where
        F: Fn(OrderPaid) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), StockError>> + Send + 'static,
    {
        let (tx, settlements) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let consumer = consumer.on_settle(move |s| {
            log.lock().unwrap().push(format!("settled {}", s.delivery.offset));
            let _ = tx.send(s.clone());
        });
        let task = tokio::spawn(async move {
            consumer
                .run(
                    async {
                        stopped.await.ok();
                    },
                    handler,
                )
                .await
                .expect("the runner ended with an error");
        });
        Running { settlements, stop, task }
    }

    async fn next(&mut self) -> Settled {
        tokio::time::timeout(BOUND, self.settlements.recv()).await.expect("no settlement in time").expect("runner gone")
    }

    async fn take(&mut self, n: usize) -> Vec<Settled> {
        let mut seen = Vec::new();
        while seen.len() < n {
            seen.push(self.next().await);
        }
        seen
    }

    async fn stop(self) -> Vec<Settled> {
        let Running { mut settlements, stop, task } = self;
        let _ = stop.send(());
        tokio::time::timeout(BOUND, task).await.expect("the runner did not stop").unwrap();
        let mut rest = Vec::new();
        while let Ok(s) = settlements.try_recv() {
            rest.push(s);
        }
        rest
    }
}

fn event(order_id: i64, sku: &str, qty: i64) -> OrderPaid {
    OrderPaid { order_id, sku: sku.to_owned(), qty }
}

fn deducting(
    idem: &Idem<MySql>,
) -> impl Fn(OrderPaid) -> std::pin::Pin<Box<dyn Future<Output = Result<(), StockError>> + Send>> + Send + Sync + 'static
{
    let idem = idem.clone();
    move |e| {
        let idem = idem.clone();
        Box::pin(async move { deduct_stock(&idem, e).await })
    }
}

/// The settlement table on Kafka: an ack, a replay, a key reused, poison,
/// and a failing body retried through the retry topic (with its count) and
/// then dead-lettered with the reason in its headers; the offsets committed
/// to the end of both topics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_of_the_settlement_table_on_kafka() {
    let Some(w) = world(1, true).await else { return };
    w.produce_event(0, &event(1, "sku-1", 2)).await;
    w.produce_event(0, &event(1, "sku-1", 2)).await; // a copy: same key, same arguments
    w.produce_event(0, &event(2, "sku-1", 3)).await;
    w.produce_event(0, &event(2, "sku-1", 4)).await; // the key reused with other arguments
    w.produce(0, "poison", b"{not json", &[]).await;
    w.produce_event(0, &event(3, "no-such-sku", 1)).await; // the body fails every time
    let consumer = w.consumer().concurrency(4).max_retries(1).retry_delay(Duration::from_millis(20));
    let mut running = Running::start(consumer, deducting(&w.idem));
    let mut seen = running.take(7).await;
    running.stop().await;
    seen.sort_by_key(|s| (s.delivery.topic.clone(), s.delivery.offset));
    let table: Vec<(&str, i64, Action, Option<Outcome>, u64)> = seen
        .iter()
        .map(|s| (s.delivery.topic.as_str(), s.delivery.offset, s.action, s.outcome, s.delivery.retries))
        .collect();
    let retry = w.names.retry_topic.as_str();
    assert_eq!(
        table,
        vec![
            ("orders", 0, Action::Ack, Some(Outcome::Executed), 0),
            ("orders", 1, Action::Ack, Some(Outcome::Replayed), 0),
            ("orders", 2, Action::Ack, Some(Outcome::Executed), 0),
            ("orders", 3, Action::DeadLetter(Reason::KeyReused), Some(Outcome::KeyReused), 0),
            ("orders", 4, Action::DeadLetter(Reason::Poison), None, 0),
            ("orders", 5, Action::Retry { count: 1 }, Some(Outcome::Failed), 0),
            (retry, 0, Action::DeadLetter(Reason::RetriesExhausted), Some(Outcome::Failed), 1),
        ],
        "{seen:#?}"
    );

    // Reconciled: the business table, the records, the topics.
    assert_eq!(w.moves().await, BTreeMap::from([(1, 1), (2, 1)]));
    assert_eq!(w.records("t_kafka_deduct").await, 2);
    let retries = w.read_topic(retry, 1);
    assert_eq!((retries[0].key.as_deref(), retries[0].header("Idem-Retries")), (Some("3"), Some("1")));
    let dead = w.read_topic(&w.names.dead_letter_topic, 3);
    let mut dead: Vec<(&str, &str, &str, &str)> = dead
        .iter()
        .map(|d| {
            (
                d.header(idempotency::kafka::DEAD_REASON_HEADER).unwrap(),
                d.header(idempotency::kafka::DEAD_TOPIC_HEADER).unwrap(),
                d.header(idempotency::kafka::DEAD_OFFSET_HEADER).unwrap(),
                d.payload.as_str(),
            )
        })
        .collect();
    dead.sort();
    assert_eq!(
        dead,
        vec![
            ("key_reused", "orders", "3", r#"{"order_id":2,"sku":"sku-1","qty":4}"#),
            ("poison", "orders", "4", "{not json"),
            ("retries_exhausted", retry, "0", r#"{"order_id":3,"sku":"no-such-sku","qty":1}"#),
        ]
    );
    w.await_committed("orders", &[Some(6)]);
    w.await_committed(retry, &[Some(1)]);
    w.remove().await;
}

/// What the handlers and the hook saw, in order.
type Log = Arc<Mutex<Vec<String>>>;

/// Offsets are committed only up to the lowest message not yet settled,
/// and a later message of a key waits for the earlier one, while other keys
/// go on beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_stop_at_the_lowest_unsettled_message_and_a_key_keeps_its_order() {
    let Some(w) = world(1, true).await else { return };
    // Offsets 0 and 2 share the key "a"; 1 has "b".
    for (order, key) in [(10, "a"), (11, "b"), (12, "a")] {
        let payload = serde_json::to_vec(&event(order, "sku-1", 1)).unwrap();
        w.produce(0, key, &payload, &[]).await;
    }
    let log: Log = Arc::default();
    let gate = Arc::new(Notify::new());
    let (started_tx, mut started) = mpsc::unbounded_channel::<i64>();
    let handler = {
        let (idem, log, gate) = (w.idem.clone(), Arc::clone(&log), Arc::clone(&gate));
        move |e: OrderPaid| {
            let (idem, log, gate, started_tx) = (idem.clone(), Arc::clone(&log), Arc::clone(&gate), started_tx.clone());
            async move {
                log.lock().unwrap().push(format!("start {}", e.order_id));
                let _ = started_tx.send(e.order_id);
                if e.order_id == 10 {
                    gate.notified().await;
                }
                deduct_stock(&idem, e).await
            }
        }
    };
    let mut running = Running::logged(w.consumer().concurrency(3), handler, Arc::clone(&log));
    // 10 is held; 11 (another key) runs and settles beside it.
    let mut first = vec![started.recv().await.unwrap(), started.recv().await.unwrap()];
    first.sort();
    assert_eq!(first, [10, 11]);
    let b = running.next().await;
    assert_eq!((b.delivery.offset, b.action), (1, Action::Ack));
    // The broker's view once that settlement's commit landed: still at 0,
    // the message still running.
    w.await_committed("orders", &[Some(0)]);
    assert!(started.try_recv().is_err(), "12 started while 10, of its key, had not settled");
    gate.notify_one();
    let rest = running.take(2).await;
    assert_eq!(
        rest.iter().map(|s| (s.delivery.offset, s.action)).collect::<Vec<_>>(),
        [(0, Action::Ack), (2, Action::Ack)]
    );
    w.await_committed("orders", &[Some(3)]);
    running.stop().await;
    let log = log.lock().unwrap().clone();
    let settled_10 = log.iter().position(|l| l == "settled 0").unwrap();
    let start_12 = log.iter().position(|l| l == "start 12").unwrap();
    assert!(settled_10 < start_12, "12 started before 10 settled: {log:?}");
    assert_eq!(w.moves().await, BTreeMap::from([(10, 1), (11, 1), (12, 1)]));
    assert_eq!(w.records("t_kafka_deduct").await, 3);
    w.remove().await;
}

/// A database down (`Error::Storage`) is waited out in the runner: the
/// message comes back after `storage_delay`, uncounted (no retry copy, its
/// retry header still 0), its offset not committed past, and its key's
/// next message waiting, while another key goes on; once the database
/// answers it executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_down_is_waited_out_uncounted_holding_its_key_and_the_commit() {
    let Some(w) = world(1, true).await else { return };
    // Offsets 0 and 1 share the key "a"; 2 has "b".
    for (order, key) in [(20, "a"), (21, "a"), (22, "b")] {
        w.produce(0, key, &serde_json::to_vec(&event(order, "sku-1", 1)).unwrap(), &[]).await;
    }
    let down = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let log: Log = Arc::default();
    let handler = {
        let (idem, down, log) = (w.idem.clone(), Arc::clone(&down), Arc::clone(&log));
        move |e: OrderPaid| {
            let (idem, down, log) = (idem.clone(), Arc::clone(&down), Arc::clone(&log));
            async move {
                log.lock().unwrap().push(format!("start {}", e.order_id));
                if e.order_id == 20 && down.load(std::sync::atomic::Ordering::SeqCst) {
                    let e: StockError = Box::new(idempotency::Error::Storage(sqlx::Error::PoolTimedOut));
                    return Err(e);
                }
                deduct_stock(&idem, e).await
            }
        }
    };
    let consumer = w.consumer().concurrency(3).storage_delay(Duration::from_millis(100));
    let mut running = Running::logged(consumer, handler, Arc::clone(&log));
    let mut seen = Vec::new();
    while !(seen.iter().any(|s: &Settled| s.delivery.offset == 0) && seen.iter().any(|s| s.delivery.offset == 2)) {
        seen.push(running.next().await);
    }
    // "b" settled beside it; the commit stays at the waiting message.
    w.await_committed("orders", &[Some(0)]);
    down.store(false, std::sync::atomic::Ordering::SeqCst);
    while !seen.iter().any(|s| s.delivery.offset == 1) {
        seen.push(running.next().await);
    }
    running.stop().await;
    let of = |offset: i64| -> Vec<(Action, Option<Outcome>, u64)> {
        seen.iter().filter(|s| s.delivery.offset == offset).map(|s| (s.action, s.outcome, s.delivery.retries)).collect()
    };
    let waits = of(0);
    let (last, requeues) = waits.split_last().unwrap();
    assert!(!requeues.is_empty(), "{waits:?}");
    assert!(requeues.iter().all(|r| *r == (Action::Requeue, None, 0)), "uncounted: {waits:?}");
    assert_eq!(*last, (Action::Ack, Some(Outcome::Executed), 0));
    assert_eq!(of(1), [(Action::Ack, Some(Outcome::Executed), 0)]);
    assert_eq!(of(2), [(Action::Ack, Some(Outcome::Executed), 0)]);
    let log = log.lock().unwrap().clone();
    let settled_0 = log.iter().rposition(|l| l == "settled 0").unwrap();
    let start_21 = log.iter().position(|l| l == "start 21").unwrap();
    assert!(settled_0 < start_21, "21 started before 20, of its key, settled: {log:?}");
    w.await_committed("orders", &[Some(3)]);
    assert_eq!(w.moves().await, BTreeMap::from([(20, 1), (21, 1), (22, 1)]));
    assert_eq!(w.records("t_kafka_deduct").await, 3);
    w.remove().await;
}

/// Handlers that signal once their call returned and wait for a release
/// before returning (their message settles only then).
#[derive(Clone, Default)]
struct Holds {
    called: Arc<Mutex<Vec<i64>>>,
    signal: Arc<Notify>,
    release: Arc<Notify>,
    held: Arc<Mutex<Vec<i64>>>,
}

impl Holds {
    fn handler(
        &self,
        idem: &Idem<MySql>,
    ) -> impl Fn(OrderPaid) -> std::pin::Pin<Box<dyn Future<Output = Result<(), StockError>> + Send>> + Send + Sync + 'static
    {
        let (idem, holds) = (idem.clone(), self.clone());
        move |e| {
            let (idem, holds) = (idem.clone(), holds.clone());
            Box::pin(async move {
                let order = e.order_id;
                let hold = holds.held.lock().unwrap().contains(&order);
                let result = deduct_stock(&idem, e).await;
                if hold {
                    holds.held.lock().unwrap().retain(|o| *o != order);
                    holds.called.lock().unwrap().push(order);
                    holds.signal.notify_one();
                    holds.release.notified().await;
                }
                result
            })
        }
    }

    async fn await_called(&self, n: usize) {
        let start = Instant::now();
        while self.called.lock().unwrap().len() < n {
            assert!(start.elapsed() < BOUND, "held calls never returned");
            let _ = tokio::time::timeout(Duration::from_secs(1), self.signal.notified()).await;
        }
    }
}

/// Partitions revoked while their messages are being handled, one of them
/// handed to another consumer that gets the same message: one execution
/// each, both consumers settle (the new owners replay), and the former
/// owner's settlements commit nothing: an offset it committed would move
/// the group's offset back behind what the new owners committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_revoked_mid_handling_executes_once_and_its_former_owner_commits_nothing() {
    let Some(w) = world(2, true).await else { return };
    // Per partition: a message held in its first consumer's handler (after
    // its call committed), then one that runs freely.
    for (partition, held, free) in [(0, 1, 3), (1, 2, 4)] {
        w.produce_event(partition, &event(held, "sku-1", 1)).await;
        w.produce_event(partition, &event(free, "sku-1", 1)).await;
    }
    let holds = Holds::default();
    holds.held.lock().unwrap().extend([1, 2]);
    let fast = |c: Consumer| c.concurrency(4).in_progress_delay(Duration::from_millis(50));
    let mut a = Running::start(fast(w.consumer()), holds.handler(&w.idem));
    holds.await_called(2).await;
    // 3 and 4 settle beside the held ones; nothing commits past 1 and 2.
    let a_free = a.take(2).await;
    assert!(a_free.iter().all(|s| s.action == Action::Ack && s.outcome == Some(Outcome::Executed)), "{a_free:#?}");
    w.await_committed("orders", &[Some(0), Some(0)]);

    // A second consumer joins: both partitions are revoked from the first,
    // one comes back to it and one goes to the newcomer; each gets the
    // messages again from offset 0 and replays them.
    let mut b = Running::start(fast(w.consumer()), holds.handler(&w.idem));
    let mut replays = Vec::new();
    let start = Instant::now();
    while replays.len() < 4 {
        assert!(start.elapsed() < BOUND, "replays: {replays:#?}");
        tokio::select! {
            Some(s) = a.settlements.recv() => replays.push(("a", s)),
            Some(s) = b.settlements.recv() => replays.push(("b", s)),
        }
        replays.retain(|(_, s)| s.action != Action::Requeue);
    }
    assert!(
        replays.iter().all(|(_, s)| s.action == Action::Ack && s.outcome == Some(Outcome::Replayed)),
        "{replays:#?}"
    );
    let by_b: Vec<i32> = replays.iter().filter(|(who, _)| *who == "b").map(|(_, s)| s.delivery.partition).collect();
    assert_eq!(by_b.len(), 2, "the newcomer took one partition: {replays:#?}");
    assert_eq!(by_b[0], by_b[1]);
    w.await_committed("orders", &[Some(2), Some(2)]);

    // The first consumer's held handlers return now: its settlements are of
    // an assignment that is gone, and commit nothing.
    holds.release.notify_waiters();
    let late = a.take(2).await;
    assert!(late.iter().all(|s| s.action == Action::Ack && s.outcome == Some(Outcome::Executed)), "{late:#?}");
    // Stopping flushes its commits (a final synchronous one after them).
    a.stop().await;
    b.stop().await;
    assert_eq!(w.committed("orders", 2), [Some(2), Some(2)], "a former owner moved the group's offset back");
    assert_eq!(w.moves().await, BTreeMap::from([(1, 1), (2, 1), (3, 1), (4, 1)]));
    assert_eq!(w.records("t_kafka_deduct").await, 4);
    assert_eq!(
        w.read_topic("orders", 4).iter().map(|r| (r.partition, r.offset)).collect::<Vec<_>>(),
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    );
    w.remove().await;
}

/// The child process of the crash test: a consumer of the broker and
/// database named in its environment; it prints what it does, and with
/// `IDEM_KAFKA_CHILD_HANG` it hangs after its call returned (never acks).
#[test]
#[ignore = "the crash test's consumer process: run by that test, as a child"]
fn kafka_child_consumer() {
    let Ok(bootstrap) = std::env::var("IDEM_KAFKA_CHILD_BOOTSTRAP") else { return };
    let db = std::env::var("IDEM_KAFKA_CHILD_DB").unwrap();
    let hang = std::env::var("IDEM_KAFKA_CHILD_HANG").is_ok();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async move {
        let options: MySqlConnectOptions = idempotency_testkit::mysql_url().parse().unwrap();
        let pool = MySqlPoolOptions::new().max_connections(4).connect_with(options.database(&db)).await.unwrap();
        let idem = Idem::new(pool);
        let handler = move |e: OrderPaid| {
            let idem = idem.clone();
            async move {
                let result = deduct_stock(&idem, e).await;
                println!("called");
                if hang {
                    println!("hanging");
                    std::future::pending::<()>().await;
                }
                result
            }
        };
        let mut config = client_config(&bootstrap);
        // A killed member leaves the group once its session times out.
        config.set("session.timeout.ms", "6000");
        Consumer::new(config, "orders", "stock")
            .on_settle(|s| println!("settled {:?} {:?} {}", s.action, s.outcome, s.delivery.offset))
            .run(std::future::pending::<()>(), handler)
            .await
            .unwrap();
    });
}

/// A consumer process spawned from this test binary, its stdout lines sent
/// to a channel.
fn spawn_child(w: &World, hang: bool) -> (Child, std::sync::mpsc::Receiver<String>) {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args(["kafka_child_consumer", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("IDEM_KAFKA_CHILD_BOOTSTRAP", w.broker.bootstrap())
        .env("IDEM_KAFKA_CHILD_DB", &w.db)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if hang {
        command.env("IDEM_KAFKA_CHILD_HANG", "1");
    }
    let mut child = command.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

fn await_line(lines: &std::sync::mpsc::Receiver<String>, prefix: &str) -> String {
    let start = Instant::now();
    loop {
        let left = BOUND.saturating_sub(start.elapsed());
        let line = lines.recv_timeout(left).unwrap_or_else(|_| panic!("no line starting {prefix:?} in time"));
        if line.starts_with(prefix) {
            return line;
        }
    }
}

/// A consumer process SIGKILLed after its call committed and before its
/// message settled: restarted, it gets the message again from the
/// committed offset, and the call replays: one execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_mid_handling_gets_the_message_again_and_it_executes_once() {
    let Some(w) = world(1, false).await else { return };
    w.produce_event(0, &event(7, "sku-1", 5)).await;
    let (mut first, lines) = spawn_child(&w, true);
    await_line(&lines, "hanging");
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();
    assert_eq!(w.moves().await, BTreeMap::from([(7, 1)]), "the call committed before the kill");
    assert_eq!(w.committed("orders", 1), [None], "nothing was settled, nothing committed");

    let (mut second, lines) = spawn_child(&w, false);
    let settled = await_line(&lines, "settled");
    assert_eq!(settled, "settled Ack Some(Replayed) 0");
    w.await_committed("orders", &[Some(1)]);
    second.kill().unwrap();
    second.wait().unwrap();
    assert_eq!(w.moves().await, BTreeMap::from([(7, 1)]));
    assert_eq!(w.records("t_kafka_deduct").await, 1);
    let stock: i64 =
        sqlx::query_scalar("SELECT qty FROM stock WHERE sku = 'sku-1'").fetch_one(w.idem.pool()).await.unwrap();
    assert_eq!(stock, 995);
    w.remove().await;
}

/// Pays an order and queues its event, in one transaction.
#[idempotent(key = "pay_<order_id>", ttl = "1h", biz = "t_kafka_pay")]
async fn pay(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    order_id: i64,
    sku: String,
    qty: i64,
) -> Result<(), StockError> {
    let event = OrderPaid { order_id, sku, qty };
    let aggregate = format!("customer-{}", order_id % 3);
    idempotency::outbox::queue(tx, Event::json("orders", &event)?.aggregate(aggregate)).await?;
    Ok(())
}

/// A publisher whose first batch reaches the broker and then never
/// returns: its relay dies between publish and mark-sent.
struct DiesAfterFirstBatch {
    inner: KafkaPublisher,
    published: Arc<Notify>,
    /// How many messages the batch it died after held.
    batch: Arc<std::sync::atomic::AtomicUsize>,
    died: bool,
}

impl idempotency::outbox::Publisher for DiesAfterFirstBatch {
    async fn publish(&mut self, batch: &[idempotency::outbox::Message]) -> Vec<idempotency::outbox::Confirm> {
        let answers = self.inner.publish(batch).await;
        if !self.died {
            self.died = true;
            self.batch.store(batch.len(), std::sync::atomic::Ordering::SeqCst);
            self.published.notify_one();
            std::future::pending::<()>().await;
        }
        answers
    }
}

/// The outbox guide's end-to-end test on Kafka: bodies queue their events in
/// their transactions; a relay produces a first batch (one event of each of
/// the three aggregates; the aggregate as the
/// key, the event id in `Idem-Message-Id`, an idempotent producer) and dies
/// before marking it sent; a second relay produces everything pending, that
/// batch again; a consumer keyed by the event id deducts once per event and
/// replays the copies; one aggregate's events are handled in the order they
/// were queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_relay_to_kafka_end_to_end() {
    let Some(w) = world(3, true).await else { return };
    const ORDERS: usize = 30;
    for order in 1..=ORDERS as i64 {
        pay(&w.idem, order, "sku-1".to_owned(), 1).await.unwrap();
        pay(&w.idem, order, "sku-1".to_owned(), 1).await.unwrap(); // a duplicate call queues nothing new
    }
    // The first relay: its first batch produced, then it dies unmarked.
    let published = Arc::new(Notify::new());
    let dying = DiesAfterFirstBatch {
        inner: KafkaPublisher::new(&w.config()).unwrap(),
        published: Arc::clone(&published),
        batch: Arc::default(),
        died: false,
    };
    let first_batch = Arc::clone(&dying.batch);
    // On a pool of its own, closed once it died: the server rolls back what
    // its connection held (the batch's row locks) at once.
    let options: MySqlConnectOptions = idempotency_testkit::mysql_url().parse().unwrap();
    let own = MySqlPoolOptions::new().max_connections(2).connect_with(options.database(&w.db)).await.unwrap();
    let engine = Idem::new(own.clone());
    let first = tokio::spawn(Relay::new(&engine, dying).run(std::future::pending::<()>()));
    tokio::time::timeout(BOUND, published.notified()).await.expect("the first batch produced");
    first.abort();
    let _ = first.await;
    drop(engine);
    own.close().await;
    // One event per aggregate in a batch: three.
    let copied = first_batch.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(copied, 3);

    let publisher = KafkaPublisher::new(&w.config()).unwrap();
    let (relay_stop, relay_stopped) = oneshot::channel::<()>();
    let (marked_tx, mut marked) = mpsc::unbounded_channel::<usize>();
    let relay = Relay::new(&w.idem, publisher).poll_interval(Duration::from_millis(50)).on_batch(move |report| {
        if report.committed {
            let _ = marked_tx.send(report.sent);
        }
    });
    let relay = tokio::spawn(relay.run(async {
        relay_stopped.await.ok();
    }));

    // (aggregate, order, message id), as the handlers were called.
    let handled: Arc<Mutex<Vec<(String, i64, String)>>> = Arc::default();
    let (tx, mut settlements) = mpsc::unbounded_channel::<Settled>();
    let (stop, stopped) = oneshot::channel::<()>();
    let idem = w.idem.clone();
    let log = Arc::clone(&handled);
    let consumer = w.consumer().concurrency(4).on_settle(move |s| {
        let _ = tx.send(s.clone());
    });
    let task = tokio::spawn(async move {
        consumer
            .run_with_id(
                async {
                    stopped.await.ok();
                },
                move |message_id: String, e: OrderPaid| {
                    let (idem, log) = (idem.clone(), Arc::clone(&log));
                    async move {
                        let aggregate = format!("customer-{}", e.order_id % 3);
                        log.lock().unwrap().push((aggregate, e.order_id, message_id.clone()));
                        deduct_by_id(&idem, message_id, e).await
                    }
                },
            )
            .await
            .unwrap();
    });
    let mut acked = Vec::new();
    while acked.len() < ORDERS + copied {
        let Ok(Some(s)) = tokio::time::timeout(BOUND, settlements.recv()).await else {
            let got: Vec<_> =
                acked.iter().map(|s: &Settled| (s.delivery.partition, s.delivery.offset, s.outcome)).collect();
            panic!("{} settlements of {}: {got:?}", acked.len(), ORDERS + copied);
        };
        assert_eq!(s.action, Action::Ack, "{s:#?}");
        acked.push(s);
    }
    let _ = stop.send(());
    task.await.unwrap();
    // Every event marked sent by the second relay (its batches committed).
    let mut sent_marked = 0;
    while sent_marked < ORDERS {
        sent_marked += tokio::time::timeout(BOUND, marked.recv()).await.expect("marks in time").unwrap();
    }
    let _ = relay_stop.send(());
    relay.await.unwrap();

    // Reconciled: every order paid once, its event sent, consumed once, its
    // copy replayed.
    let outcomes = |o: Outcome| acked.iter().filter(|s| s.outcome == Some(o)).count();
    assert_eq!((outcomes(Outcome::Executed), outcomes(Outcome::Replayed)), (ORDERS, copied));
    let sent: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_outbox WHERE sent_at IS NOT NULL")
        .fetch_one(w.idem.pool())
        .await
        .unwrap();
    assert_eq!(sent, ORDERS as i64);
    assert_eq!(w.records("t_kafka_pay").await, ORDERS as i64);
    assert_eq!(w.records("t_kafka_deduct_id").await, ORDERS as i64);
    assert_eq!(w.moves().await, (1..=ORDERS as i64).map(|o| (o, 1)).collect::<BTreeMap<_, _>>());
    let ids: Vec<String> =
        sqlx::query_scalar("SELECT message_id FROM idem_outbox ORDER BY id").fetch_all(w.idem.pool()).await.unwrap();
    let messages = w.read_topic("orders", ORDERS + copied);
    let mut consumed: Vec<(i32, i64)> = acked.iter().map(|s| (s.delivery.partition, s.delivery.offset)).collect();
    consumed.sort();
    assert_eq!(consumed, messages.iter().map(|m| (m.partition, m.offset)).collect::<Vec<_>>());
    let mut copies: HashMap<&str, usize> = HashMap::new();
    for m in &messages {
        let e: OrderPaid = serde_json::from_str(&m.payload).unwrap();
        assert_eq!(m.key.as_deref(), Some(format!("customer-{}", e.order_id % 3).as_str()), "{m:?}");
        let id = m.header("Idem-Message-Id").unwrap();
        assert!(ids.iter().any(|known| known == id), "{m:?}");
        *copies.entry(id).or_default() += 1;
    }
    assert_eq!(copies.len(), ORDERS);
    assert_eq!(copies.values().filter(|n| **n == 2).count(), copied, "{copies:?}");
    // Per aggregate, the first time each event was handled: in queue order.
    let handled = handled.lock().unwrap().clone();
    let mut firsts: HashMap<String, Vec<i64>> = HashMap::new();
    let mut seen_ids = std::collections::HashSet::new();
    for (aggregate, order, id) in handled {
        if seen_ids.insert(id) {
            firsts.entry(aggregate).or_default().push(order);
        }
    }
    for (aggregate, orders) in &firsts {
        let mut sorted = orders.clone();
        sorted.sort();
        assert_eq!(orders, &sorted, "{aggregate}'s events out of order");
    }
    // Committed to the end of every partition that got messages.
    let ends: Vec<Option<i64>> =
        (0..3).map(|p| messages.iter().filter(|m| m.partition == p).map(|m| m.offset + 1).max()).collect();
    w.await_committed("orders", &ends);
    w.remove().await;
}

// ---------------------------------------------------------------- a recorded answer

/// What `reserve` answers when the stock is short: recorded, replayed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct OutOfStock {
    sku: String,
    short: i64,
}

/// `reserve`'s error: the decline (a final answer), or a failure. The
/// handler boxes it into a [`StockError`], as the other handlers' errors.
#[derive(Debug)]
enum ReserveError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
    OutOfStock(OutOfStock),
}

impl std::fmt::Display for ReserveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

/// Its `idempotency::Error` in the source chain, where a boxed error is searched.
impl std::error::Error for ReserveError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReserveError::Idem(e) => Some(e),
            ReserveError::Db(e) => Some(e),
            ReserveError::OutOfStock(_) => None,
        }
    }
}

impl From<idempotency::Error> for ReserveError {
    fn from(e: idempotency::Error) -> Self {
        ReserveError::Idem(e)
    }
}

impl From<sqlx::Error> for ReserveError {
    fn from(e: sqlx::Error) -> Self {
        ReserveError::Db(e)
    }
}

impl idempotency::BusinessError for ReserveError {
    type Record = OutOfStock;

    fn recorded(&self) -> Option<OutOfStock> {
        match self {
            ReserveError::OutOfStock(out) => Some(out.clone()),
            _ => None,
        }
    }

    fn replayed(record: OutOfStock) -> Self {
        ReserveError::OutOfStock(record)
    }
}

/// How many times `reserve`'s body ran (a decline rolls its writes back).
static RESERVE_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Deducts, or declines for good when the stock would go below zero: the
/// deduction rolls back and the decline is recorded (`record_errors`).
#[idempotent(key = "reserve_<event.order_id>", ttl = "1h", biz = "t_kafka_reserve", record_errors)]
async fn reserve(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, event: OrderPaid) -> Result<(), ReserveError> {
    RESERVE_RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    sqlx::query("UPDATE stock SET qty = qty - ? WHERE sku = ?")
        .bind(event.qty)
        .bind(&event.sku)
        .execute(&mut **tx)
        .await?;
    let left: i64 =
        sqlx::query_scalar("SELECT qty FROM stock WHERE sku = ?").bind(&event.sku).fetch_one(&mut **tx).await?;
    if left < 0 {
        return Err(ReserveError::OutOfStock(OutOfStock { sku: event.sku, short: -left }));
    }
    Ok(())
}

/// Regression: a handler passing on its call's recorded decline was
/// retried through the retry topic, then dead-lettered, each retry only
/// replaying the decision. The decline and a duplicate of it are each
/// settled once as a recorded answer (`AckRecorded`, counted under
/// `ack_recorded`), nothing copied to the retry or dead-letter topic, the
/// offsets committed past both; the body ran once, its deduction rolled
/// back, the decline recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_decline_and_its_duplicate_are_settled_once() {
    let Some(w) = world(1, true).await else { return };
    idempotency_testkit::counters::install();
    w.produce_event(0, &event(9, "sku-1", 5000)).await;
    w.produce_event(0, &event(9, "sku-1", 5000)).await; // a copy: same key, same arguments
    let consumer = w.consumer().max_retries(2).retry_delay(Duration::from_millis(20));
    let reserving = {
        let idem = w.idem.clone();
        move |e: OrderPaid| {
            let idem = idem.clone();
            async move { reserve(&idem, e).await.map_err(StockError::from) }
        }
    };
    let mut running = Running::start(consumer, reserving);
    let mut seen = running.take(2).await;
    let rest = running.stop().await;
    seen.sort_by_key(|s| s.delivery.offset);
    let table: Vec<(&str, i64, Action, Option<Outcome>, u64)> = seen
        .iter()
        .map(|s| (s.delivery.topic.as_str(), s.delivery.offset, s.action, s.outcome, s.delivery.retries))
        .collect();
    assert_eq!(
        table,
        vec![
            ("orders", 0, Action::AckRecorded, Some(Outcome::Executed), 0),
            ("orders", 1, Action::AckRecorded, Some(Outcome::Replayed), 0),
        ],
        "{seen:#?}"
    );
    assert!(rest.is_empty(), "settled once each: {rest:#?}");
    assert!(seen.iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("OutOfStock"))), "{seen:#?}");
    assert_eq!(RESERVE_RUNS.load(std::sync::atomic::Ordering::SeqCst), 1, "the copy replayed the decline");
    assert_eq!(w.moves().await, BTreeMap::new());
    let stock: i64 =
        sqlx::query_scalar("SELECT qty FROM stock WHERE sku = 'sku-1'").fetch_one(w.idem.pool()).await.unwrap();
    assert_eq!(stock, 1000, "the deduction rolled back");
    let recorded = r#"{"sku":"sku-1","short":4000}"#.to_owned();
    assert_eq!(
        w.idem.status("t_kafka_reserve", "reserve_9").await.unwrap(),
        idempotency::Status::Failed { error: recorded }
    );
    let records: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_record WHERE biz_type = 't_kafka_reserve'")
        .fetch_one(w.idem.pool())
        .await
        .unwrap();
    assert_eq!(records, 1);
    w.await_committed("orders", &[Some(2)]);
    let counted = idempotency_testkit::counters::counted_by(
        idempotency::metrics::KAFKA_SETTLEMENTS,
        &[("topic", "orders")],
        "action",
    );
    // Other tests of this process settle on a topic of the same name (each on its own broker).
    assert_eq!(counted.get("ack_recorded"), Some(&2), "{counted:?}");
    w.remove().await;
}
