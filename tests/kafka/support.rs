//! What the Kafka tests share: a test's world (its broker, gated or not,
//! its database, its topics), the stock handlers, a runner in a task of its
//! own with its settlements and events, and reading and writing records as
//! the broker holds them (header names as bytes included).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::ffi::{CStr, CString};

use idempotency::kafka::rdkafka::bindings as rd;
use idempotency::kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use idempotency::kafka::rdkafka::message::{BorrowedMessage, Header, OwnedHeaders};
use idempotency::kafka::rdkafka::producer::{BaseProducer, FutureProducer, FutureRecord, Producer as _};
use idempotency::kafka::rdkafka::types::RDKafkaRespErr;
use idempotency::kafka::rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};
use idempotency::kafka::{Consumer, DeadLetter, Event, RunError, Settled};
use idempotency::{Idem, idempotent};
use idempotency_testkit::kafka::{Gate, Tansu};
use serde::{Deserialize, Serialize};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{MySql, Pool, Transaction};
use tokio::sync::{Notify, mpsc, oneshot};

/// A hang becomes a failure after this; nothing waits for it to pass.
pub const BOUND: Duration = Duration::from_secs(90);

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderPaid {
    pub order_id: i64,
    pub sku: String,
    pub qty: i64,
}

/// The handlers' error: boxed, so the runner finds an `idempotency::Error`
/// in it through `AsIdemError` (a database down is waited out).
pub type StockError = Box<dyn std::error::Error + Send + Sync>;

pub async fn deduct_in(tx: &mut Transaction<'_, MySql>, event: &OrderPaid) -> Result<(), StockError> {
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
pub async fn deduct_stock(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    event: OrderPaid,
) -> Result<(), StockError> {
    deduct_in(tx, &event).await
}

/// Keyed by the message's `Idem-Message-Id` (the outbox relay's event id).
#[idempotent(key = "<message_id>", ttl = "1h", biz = "t_kafka_deduct_id")]
pub async fn deduct_by_id(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    message_id: String,
    event: OrderPaid,
) -> Result<(), StockError> {
    deduct_in(tx, &event).await
}

/// A MariaDB database of the test's own, with the stock tables; `None` (a
/// skip) when MariaDB is unreachable.
pub async fn database(name: &str) -> Option<Pool<MySql>> {
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

pub async fn drop_database(name: &str) {
    if let Ok(admin) = MySqlPoolOptions::new().max_connections(1).connect(&idempotency_testkit::mysql_url()).await {
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {name}"))).execute(&admin).await;
    }
}

/// A test's world: its broker, its database, its topic and group.
pub struct World {
    pub broker: Tansu,
    /// The gate every client reaches the broker through, when started gated.
    pub gate: Option<Gate>,
    pub db: String,
    pub idem: Idem<MySql>,
    pub topic: String,
    pub group: String,
    pub names: DeadLetter,
    pub producer: FutureProducer,
}

/// `None` (after printing why) when tansu or MariaDB is missing.
pub async fn world(partitions: i32, redis: bool) -> Option<World> {
    let broker = Tansu::start()?;
    world_on(broker, None, partitions, redis).await
}

/// The same with a [`Gate`] between every client and the broker.
pub async fn gated_world(partitions: i32) -> Option<World> {
    let (broker, gate) = Tansu::start_gated()?;
    world_on(broker, Some(gate), partitions, false).await
}

async fn world_on(broker: Tansu, gate: Option<Gate>, partitions: i32, redis: bool) -> Option<World> {
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
    Some(World { broker, gate, db, idem, topic, group, names, producer })
}

pub fn client_config(bootstrap: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", bootstrap);
    config
}

impl World {
    pub fn config(&self) -> ClientConfig {
        client_config(&self.broker.bootstrap())
    }

    /// A consumer's settings: tansu completes a group's join after half the
    /// members' session timeout, 22.5 s at librdkafka's default of 45 s; 10 s
    /// joins in 5, heartbeats each second keeping a loaded machine's
    /// members in the group.
    pub fn consumer_config(&self) -> ClientConfig {
        let mut config = self.config();
        config.set("session.timeout.ms", "10000").set("heartbeat.interval.ms", "1000");
        config
    }

    pub fn consumer(&self) -> Consumer {
        Consumer::new(self.consumer_config(), &self.topic, &self.group)
    }

    /// Produces `payload` to `partition` with `key`, and the headers given.
    pub async fn produce(&self, partition: i32, key: &str, payload: &[u8], headers: &[(&str, &str)]) {
        let headers =
            headers.iter().fold(OwnedHeaders::new(), |h, (k, v)| h.insert(Header { key: k, value: Some(*v) }));
        let record = FutureRecord::to(&self.topic).partition(partition).key(key).payload(payload).headers(headers);
        self.producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
    }

    pub async fn produce_event(&self, partition: i32, event: &OrderPaid) {
        let key = event.order_id.to_string();
        self.produce(partition, &key, &serde_json::to_vec(event).unwrap(), &[]).await;
    }

    /// Rows of `moves` per order id.
    pub async fn moves(&self) -> BTreeMap<i64, i64> {
        let rows: Vec<(i64, i64)> = sqlx::query_as("SELECT order_id, COUNT(*) FROM moves GROUP BY order_id")
            .fetch_all(self.idem.pool())
            .await
            .unwrap();
        rows.into_iter().collect()
    }

    /// Committed records of `biz`.
    pub async fn records(&self, biz: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM idem_record WHERE biz_type = ? AND status = 1")
            .bind(biz)
            .fetch_one(self.idem.pool())
            .await
            .unwrap()
    }

    /// The first `expected` messages of `topic` as the broker holds them,
    /// by partition and offset. (Read by count: tansu 0.6's high watermark
    /// can lag its last message by one.)
    pub fn read_topic(&self, topic: &str, expected: usize) -> Vec<Read> {
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
            let raw = raw_headers(&message);
            let headers = raw
                .iter()
                .map(|(k, v)| {
                    let lossy = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
                    (lossy(k), lossy(v.as_deref().unwrap_or_default()))
                })
                .collect();
            out.push(Read {
                partition: message.partition(),
                offset: message.offset(),
                key: message.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                headers,
                raw_headers: raw,
                payload: message.payload().map(|p| String::from_utf8_lossy(p).into_owned()).unwrap_or_default(),
                null_payload: message.payload().is_none(),
            });
        }
        out.sort_by_key(|r| (r.partition, r.offset));
        out
    }

    /// The group's committed offset per partition of `topic`, as the broker
    /// holds it (`None`: nothing committed).
    pub fn committed(&self, topic: &str, partitions: i32) -> Vec<Option<i64>> {
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
    pub fn await_committed(&self, topic: &str, expected: &[Option<i64>]) {
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

    pub async fn remove(self) {
        drop_database(&self.db).await;
    }
}

/// A fetched message's headers through librdkafka's own API, names as
/// bytes (rdkafka's `Headers` unwraps a name that is not UTF-8).
pub fn raw_headers(message: &BorrowedMessage<'_>) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
    let mut list: *mut rd::rd_kafka_headers_t = std::ptr::null_mut();
    // SAFETY: the live message `message` borrows; its header list lives as long.
    let err = unsafe { rd::rd_kafka_message_headers(message.ptr(), &mut list) };
    if err != RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR {
        return Vec::new();
    }
    // SAFETY: a live list, read while `message` lives.
    let count = unsafe { rd::rd_kafka_header_cnt(list) };
    (0..count)
        .map(|idx| {
            let (mut name, mut value, mut size) = (std::ptr::null(), std::ptr::null(), 0usize);
            // SAFETY: `idx < count`; librdkafka writes pointers into the live list.
            let err = unsafe { rd::rd_kafka_header_get_all(list, idx, &mut name, &mut value, &mut size) };
            assert_eq!(err, RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR);
            // SAFETY: a NUL-terminated name, `size` bytes of value (null: none).
            let name = unsafe { CStr::from_ptr(name) }.to_bytes().to_vec();
            let value =
                (!value.is_null()).then(|| unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) }.to_vec());
            (name, value)
        })
        .collect()
}

/// Produces a record through librdkafka's own API, which takes header
/// names as bytes (rdkafka's `OwnedHeaders` takes `&str` only): what a
/// client in another language may write. Waits until it is delivered.
pub fn produce_raw(w: &World, partition: i32, key: &[u8], payload: &[u8], headers: &[(&[u8], &[u8])]) {
    use rd::rd_kafka_vtype_t as t;
    let producer: BaseProducer = w.config().create().unwrap();
    let topic = CString::new(w.topic.clone()).unwrap();
    let names: Vec<CString> = headers.iter().map(|(name, _)| CString::new(*name).unwrap()).collect();
    let vu = |vtype: t, u: rd::rd_kafka_vu_s__bindgen_ty_1| rd::rd_kafka_vu_t { vtype, u };
    let mem = |bytes: &[u8]| rd::rd_kafka_vu_s__bindgen_ty_1 {
        mem: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 { ptr: bytes.as_ptr() as *mut _, size: bytes.len() },
    };
    let mut vus = vec![
        vu(t::RD_KAFKA_VTYPE_TOPIC, rd::rd_kafka_vu_s__bindgen_ty_1 { cstr: topic.as_ptr() }),
        vu(t::RD_KAFKA_VTYPE_PARTITION, rd::rd_kafka_vu_s__bindgen_ty_1 { i32_: partition }),
        // RD_KAFKA_MSG_F_COPY: librdkafka copies the key and payload.
        vu(t::RD_KAFKA_VTYPE_MSGFLAGS, rd::rd_kafka_vu_s__bindgen_ty_1 { i: 0x2 }),
        vu(t::RD_KAFKA_VTYPE_KEY, mem(key)),
        vu(t::RD_KAFKA_VTYPE_VALUE, mem(payload)),
    ];
    for (name, (_, value)) in names.iter().zip(headers) {
        let header = rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_2 {
            name: name.as_ptr(),
            val: value.as_ptr().cast(),
            size: value.len() as isize,
        };
        vus.push(vu(t::RD_KAFKA_VTYPE_HEADER, rd::rd_kafka_vu_s__bindgen_ty_1 { header }));
    }
    // SAFETY: a live producer, and values that outlive the call (librdkafka
    // copies the header names and values, and the key and payload under
    // RD_KAFKA_MSG_F_COPY).
    let error = unsafe { rd::rd_kafka_produceva(producer.client().native_ptr(), vus.as_ptr(), vus.len()) };
    assert!(error.is_null(), "produceva refused the record");
    producer.flush(Duration::from_secs(30)).unwrap();
}

/// One message as the broker holds it.
#[derive(Debug, Clone)]
pub struct Read {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<String>,
    /// Names and values, lossy: for reading the runner's own headers.
    pub headers: Vec<(String, String)>,
    /// Names and values as the broker holds them.
    pub raw_headers: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    pub payload: String,
    pub null_payload: bool,
}

impl Read {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// A runner in a task of its own: its settlements, its events, and how to
/// stop it.
pub struct Running {
    pub settlements: mpsc::UnboundedReceiver<Settled>,
    pub events: mpsc::UnboundedReceiver<Event>,
    pub stop: oneshot::Sender<()>,
    pub task: tokio::task::JoinHandle<Result<(), RunError>>,
}

impl Running {
    pub fn start<F, Fut>(consumer: Consumer, handler: F) -> Self
    where
        F: Fn(OrderPaid) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), StockError>> + Send + 'static,
    {
        Self::logged(consumer, handler, Log::default())
    }

    /// Also writes `settled <offset>` into `log` as each settles.
    pub fn logged<F, Fut>(consumer: Consumer, handler: F, log: Log) -> Self
    where
        F: Fn(OrderPaid) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), StockError>> + Send + 'static,
    {
        Self::observed(consumer, handler, log, |_| {})
    }

    /// Also calls `hook` with each event, on the runner's polling task,
    /// before the test hears of it (what the hook records is there when the
    /// test sees the event).
    pub fn observed<F, Fut>(
        consumer: Consumer,
        handler: F,
        log: Log,
        hook: impl Fn(&Event) + Send + Sync + 'static,
    ) -> Self
    where
        F: Fn(OrderPaid) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), StockError>> + Send + 'static,
    {
        let (tx, settlements) = mpsc::unbounded_channel();
        let (events_tx, events) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let consumer = consumer
            .on_settle(move |s| {
                log.lock().unwrap().push(format!("settled {}", s.delivery.offset));
                let _ = tx.send(s.clone());
            })
            .on_event(move |e| {
                hook(e);
                let _ = events_tx.send(e.clone());
            });
        let task = tokio::spawn(consumer.run(
            async {
                stopped.await.ok();
            },
            handler,
        ));
        Running { settlements, events, stop, task }
    }

    /// The runner's events until one `pick` takes (the others passed over).
    pub async fn event<T>(&mut self, mut pick: impl FnMut(&Event) -> Option<T>) -> T {
        let start = Instant::now();
        loop {
            let left = BOUND.saturating_sub(start.elapsed());
            let event = tokio::time::timeout(left, self.events.recv()).await.expect("no such event in time");
            if let Some(found) = pick(&event.expect("runner gone")) {
                return found;
            }
        }
    }

    pub async fn next(&mut self) -> Settled {
        tokio::time::timeout(BOUND, self.settlements.recv()).await.expect("no settlement in time").expect("runner gone")
    }

    pub async fn take(&mut self, n: usize) -> Vec<Settled> {
        let mut seen = Vec::new();
        while seen.len() < n {
            seen.push(self.next().await);
        }
        seen
    }

    pub async fn stop(self) -> Vec<Settled> {
        let Running { mut settlements, stop, task, .. } = self;
        let _ = stop.send(());
        tokio::time::timeout(BOUND, task).await.expect("the runner did not stop").unwrap().expect("the runner failed");
        let mut rest = Vec::new();
        while let Ok(s) = settlements.try_recv() {
            rest.push(s);
        }
        rest
    }
}

pub fn event(order_id: i64, sku: &str, qty: i64) -> OrderPaid {
    OrderPaid { order_id, sku: sku.to_owned(), qty }
}

pub fn deducting(
    idem: &Idem<MySql>,
) -> impl Fn(OrderPaid) -> std::pin::Pin<Box<dyn Future<Output = Result<(), StockError>> + Send>> + Send + Sync + 'static
{
    let idem = idem.clone();
    move |e| {
        let idem = idem.clone();
        Box::pin(async move { deduct_stock(&idem, e).await })
    }
}

/// What the handlers and the hook saw, in order.
pub type Log = Arc<Mutex<Vec<String>>>;

/// Handlers that signal once their call returned and wait for a release
/// before returning (their message settles only then).
#[derive(Clone, Default)]
pub struct Holds {
    pub called: Arc<Mutex<Vec<i64>>>,
    pub signal: Arc<Notify>,
    pub release: Arc<Notify>,
    pub held: Arc<Mutex<Vec<i64>>>,
}

impl Holds {
    pub fn handler(
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

    pub async fn await_called(&self, n: usize) {
        let start = Instant::now();
        while self.called.lock().unwrap().len() < n {
            assert!(start.elapsed() < BOUND, "held calls never returned");
            let _ = tokio::time::timeout(Duration::from_secs(1), self.signal.notified()).await;
        }
    }
}
