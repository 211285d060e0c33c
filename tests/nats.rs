//! `idempotency::nats`: the JetStream consumer runner's settlement contract, end
//! to end against NATS JetStream (`IDEM_NATS_URL`, default
//! 127.0.0.1:4222) and MariaDB (`IDEM_MYSQL_URL`). Every test uses its own
//! streams, SKUs and order ids, so they run in parallel and again.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::nats::async_nats::{self, HeaderMap, jetstream};
use idempotency::nats::{Action, AsIdemError, Consumer, DeadLetter, Reason, Settled};
use idempotency::{Idem, Outcome, Status, idempotent};
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

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug
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

/// Gates the next body of a SKU waits at, once started.
static GATES: Mutex<Option<HashMap<String, Arc<Notify>>>> = Mutex::new(None);

fn hold_next_body(sku: &str) -> Arc<Notify> {
    let gate = Arc::new(Notify::new());
    GATES.lock().unwrap().get_or_insert_with(HashMap::new).insert(sku.to_owned(), Arc::clone(&gate));
    gate
}

async fn body_started(sku: &str) {
    let gate = GATES.lock().unwrap().as_mut().and_then(|gates| gates.remove(sku));
    if let Some(gate) = gate {
        gate.notified().await;
    }
}

async fn deduct_in(tx: &mut Transaction<'_, MySql>, event: &OrderPaid) -> Result<(), StockError> {
    body_started(&event.sku).await;
    let updated = sqlx::query("UPDATE idem_nats_stock SET qty = qty - ? WHERE sku = ?")
        .bind(event.qty)
        .bind(&event.sku)
        .execute(&mut **tx)
        .await?;
    if updated.rows_affected() == 0 {
        return Err(StockError::UnknownSku(event.sku.clone()));
    }
    sqlx::query("INSERT INTO idem_nats_moves (order_id, sku, qty) VALUES (?, ?, ?)")
        .bind(event.order_id)
        .bind(&event.sku)
        .bind(-event.qty)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// SKUs whose next handler, once its call returned, signals and never
/// returns (its consumer dies before the ack).
static HANG_AFTER: Mutex<Option<HashMap<String, Arc<Notify>>>> = Mutex::new(None);

fn hang_after_call(sku: &str) -> Arc<Notify> {
    let signal = Arc::new(Notify::new());
    HANG_AFTER.lock().unwrap().get_or_insert_with(HashMap::new).insert(sku.to_owned(), Arc::clone(&signal));
    signal
}

async fn after_call(sku: &str) {
    let hang = HANG_AFTER.lock().unwrap().as_mut().and_then(|h| h.remove(sku));
    if let Some(signal) = hang {
        signal.notify_one();
        std::future::pending::<()>().await;
    }
}

/// Keyed by a business field.
#[idempotent(key = "order_paid_<event.order_id>", ttl = "1h", biz = "t_nats_deduct")]
async fn deduct_stock(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, event: OrderPaid) -> Result<(), StockError> {
    deduct_in(tx, &event).await
}

/// Keyed by the message's `Nats-Msg-Id`.
#[idempotent(key = "<message_id>", ttl = "1h", biz = "t_nats_deduct_id")]
async fn deduct_by_id(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    message_id: String,
    event: OrderPaid,
) -> Result<(), StockError> {
    deduct_in(tx, &event).await
}

/// How many times `reserve`'s body ran, per SKU (a decline rolls its writes back).
static RESERVE_RUNS: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);

fn reserve_runs(sku: &str) -> usize {
    RESERVE_RUNS.lock().unwrap().as_ref().and_then(|runs| runs.get(sku).copied()).unwrap_or(0)
}

/// Deducts, or declines for good when the stock would go below zero: the
/// deduction rolls back and the decline is recorded (`record_errors`).
#[idempotent(key = "reserve_<event.order_id>", ttl = "1h", biz = "t_nats_reserve", record_errors)]
async fn reserve(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, event: OrderPaid) -> Result<(), StockError> {
    *RESERVE_RUNS.lock().unwrap().get_or_insert_with(HashMap::new).entry(event.sku.clone()).or_default() += 1;
    deduct_in(tx, &event).await?;
    let left: i64 = sqlx::query_scalar("SELECT qty FROM idem_nats_stock WHERE sku = ?")
        .bind(&event.sku)
        .fetch_one(&mut **tx)
        .await?;
    if left < 0 {
        return Err(StockError::OutOfStock(OutOfStock { sku: event.sku, short: -left }));
    }
    Ok(())
}

/// Which handler a test's runner calls.
#[derive(Clone, Copy)]
enum Handling {
    /// `deduct_stock`, keyed by the order.
    Deduct,
    /// `deduct_by_id`, keyed by the message id (`run_with_id`).
    DeductById,
    /// `reserve`, which declines for good when the stock is short.
    Reserve,
}

fn nats_url() -> String {
    std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into())
}

fn skip(service: &str, e: impl std::fmt::Display) {
    assert!(std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(), "{service} unreachable: {e}");
    eprintln!("skipped: {service} unreachable ({e})");
}

fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("{prefix}{}x{}", nanos % 1_000_000_000_000, N.fetch_add(1, Ordering::Relaxed))
}

/// A test's world: the engine, JetStream, its own stream and SKU.
struct World {
    idem: Idem<MySql>,
    js: jetstream::Context,
    names: DeadLetter,
    subject: String,
    sku: String,
    /// Added to the tests' order ids: keys of earlier runs live on.
    orders: i64,
}

async fn world(stock: i64) -> Option<World> {
    let url = std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let pool = match MySqlPoolOptions::new().max_connections(8).connect(&url).await {
        Ok(pool) => pool,
        Err(e) => {
            skip("mysql", e);
            return None;
        }
    };
    let client = match async_nats::connect(nats_url()).await {
        Ok(client) => client,
        Err(e) => {
            skip("nats", e);
            return None;
        }
    };
    let idem = Idem::new(pool);
    idem.migrate().await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS idem_nats_stock (sku VARCHAR(64) PRIMARY KEY, qty BIGINT NOT NULL);
         CREATE TABLE IF NOT EXISTS idem_nats_moves (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BIGINT NOT NULL, sku VARCHAR(64) NOT NULL, qty BIGINT NOT NULL)",
    )
    .execute(idem.pool())
    .await
    .unwrap();
    let name = unique("T");
    let sku = format!("sku{name}");
    sqlx::query("INSERT INTO idem_nats_stock (sku, qty) VALUES (?, ?)")
        .bind(&sku)
        .bind(stock)
        .execute(idem.pool())
        .await
        .unwrap();
    let js = jetstream::new(client);
    let subject = format!("t.{name}.paid");
    let names = idempotency::nats::declare_with_dead_letter(&js, &name, &[subject.as_str()]).await.unwrap();
    let orders = i64::try_from(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() % 1_000_000_000_000,
    )
    .unwrap()
        * 100;
    Some(World { idem, js, names, subject, sku, orders })
}

impl World {
    fn event(&self, order_id: i64, qty: i64) -> OrderPaid {
        OrderPaid { order_id: self.orders + order_id, sku: self.sku.clone(), qty }
    }

    async fn publish(&self, payload: &[u8], msg_id: Option<&str>) {
        let mut headers = HeaderMap::new();
        if let Some(id) = msg_id {
            headers.insert("Nats-Msg-Id", id);
        }
        let ack = self.js.publish_with_headers(self.subject.clone(), headers, payload.to_vec().into()).await.unwrap();
        ack.await.unwrap();
    }

    async fn publish_event(&self, event: &OrderPaid, msg_id: &str) {
        self.publish(&serde_json::to_vec(event).unwrap(), Some(msg_id)).await;
    }

    async fn moves(&self) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM idem_nats_moves WHERE sku = ?")
            .bind(&self.sku)
            .fetch_one(self.idem.pool())
            .await
            .unwrap()
    }

    /// The dead letters so far: (reason, original subject, payload).
    async fn dead_letters(&self) -> Vec<(String, String, String)> {
        let stream = self.js.get_stream(&self.names.dead_letter_stream).await.unwrap();
        let mut out = Vec::new();
        for seq in 1.. {
            let Ok(message) = stream.get_raw_message(seq).await else { break };
            let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned()).unwrap_or_default();
            out.push((
                header(idempotency::nats::DEAD_REASON_HEADER),
                header(idempotency::nats::SUBJECT_HEADER),
                String::from_utf8_lossy(&message.payload).into_owned(),
            ));
        }
        out
    }

    async fn remove(self) {
        let _ = self.js.delete_stream(&self.names.stream).await;
        let _ = self.js.delete_stream(&self.names.dead_letter_stream).await;
    }

    /// Runs a consumer (configured by `configure`) on the world's stream;
    /// settlements arrive on the receiver.
    fn run(
        &self,
        durable: &str,
        handling: Handling,
        configure: impl FnOnce(Consumer) -> Consumer,
    ) -> (mpsc::UnboundedReceiver<Settled>, oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
        let (settled, settlements) = mpsc::unbounded_channel();
        let consumer = configure(
            Consumer::new(self.js.clone(), self.names.stream.clone(), durable)
                .retry_delay(Duration::from_millis(50))
                .in_progress_delay(Duration::from_millis(50))
                .on_settle(move |s| {
                    let _ = settled.send(s.clone());
                }),
        );
        let (stop, stopped) = oneshot::channel::<()>();
        let idem = self.idem.clone();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let task = tokio::spawn(async move {
            let result = match handling {
                Handling::DeductById => {
                    consumer
                        .run_with_id(shutdown, move |id: String, event: OrderPaid| {
                            let idem = idem.clone();
                            async move {
                                let sku = event.sku.clone();
                                let done = deduct_by_id(&idem, id, event).await;
                                after_call(&sku).await;
                                done
                            }
                        })
                        .await
                }
                Handling::Deduct => {
                    consumer
                        .run(shutdown, move |event: OrderPaid| {
                            let idem = idem.clone();
                            async move {
                                let sku = event.sku.clone();
                                let done = deduct_stock(&idem, event).await;
                                after_call(&sku).await;
                                done
                            }
                        })
                        .await
                }
                Handling::Reserve => {
                    consumer
                        .run(shutdown, move |event: OrderPaid| {
                            let idem = idem.clone();
                            async move { reserve(&idem, event).await }
                        })
                        .await
                }
            };
            result.expect("the runner ends cleanly");
        });
        (settlements, stop, task)
    }
}

/// `items` in one order, whatever order they were reported in: a delivery
/// is reported after its settlement returns, and by then the next one may
/// have been delivered and settled.
fn unordered<T: std::fmt::Debug>(mut items: Vec<T>) -> Vec<T> {
    items.sort_by_cached_key(|item| format!("{item:?}"));
    items
}

async fn next(settlements: &mut mpsc::UnboundedReceiver<Settled>) -> Settled {
    tokio::time::timeout(Duration::from_secs(30), settlements.recv())
        .await
        .expect("a settlement within 30 s")
        .expect("the runner is running")
}

async fn stop(stop: oneshot::Sender<()>, task: tokio::task::JoinHandle<()>) {
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), task).await.expect("the runner stops").expect("the runner ran");
}

fn within<F: Future>(f: F) -> tokio::time::Timeout<F> {
    tokio::time::timeout(Duration::from_secs(30), f)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executed_and_replayed_messages_are_acked() {
    let Some(w) = world(10).await else { return };
    let (mut settlements, stop_tx, task) = w.run("c", Handling::Deduct, |c| c);
    w.publish_event(&w.event(1, 2), "m1").await;
    // The same event again, under another message id: the record replays it.
    w.publish_event(&w.event(1, 2), "m2").await;
    let first = next(&mut settlements).await;
    let second = next(&mut settlements).await;
    assert_eq!((first.action, first.outcome, first.delivery.count), (Action::Ack, Some(Outcome::Executed), 1));
    assert_eq!((second.action, second.outcome), (Action::Ack, Some(Outcome::Replayed)));
    assert_eq!((first.message_id.as_deref(), second.message_id.as_deref()), (Some("m1"), Some("m2")));
    assert_eq!(w.moves().await, 1);
    stop(stop_tx, task).await;
    w.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_with_id_keys_the_call_by_the_message_id_and_a_message_without_one_is_poison() {
    let Some(w) = world(10).await else { return };
    let (mut settlements, stop_tx, task) = w.run("c", Handling::DeductById, |c| c);
    // One order, two distinct messages: keyed by message id, both execute.
    let (ida, idb) = (unique("ida"), unique("idb"));
    w.publish_event(&w.event(2, 1), &ida).await;
    w.publish_event(&w.event(2, 1), &idb).await;
    w.publish(&serde_json::to_vec(&w.event(3, 1)).unwrap(), None).await;
    let outcomes: Vec<(Action, Option<Outcome>)> =
        [next(&mut settlements).await, next(&mut settlements).await, next(&mut settlements).await]
            .iter()
            .map(|s| (s.action, s.outcome))
            .collect();
    assert_eq!(
        unordered(outcomes),
        unordered(vec![
            (Action::Ack, Some(Outcome::Executed)),
            (Action::Ack, Some(Outcome::Executed)),
            (Action::DeadLetter(Reason::Poison), None)
        ])
    );
    assert_eq!(w.moves().await, 2);
    let dead = w.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].0.as_str(), dead[0].1.as_str()), ("poison", w.subject.as_str()));
    stop(stop_tx, task).await;
    w.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unparsable_payloads_and_reused_keys_are_dead_lettered_with_their_reason() {
    let Some(w) = world(10).await else { return };
    let (mut settlements, stop_tx, task) = w.run("c", Handling::Deduct, |c| c);
    w.publish(b"{not json", Some("p1")).await;
    w.publish_event(&w.event(4, 1), "k1").await;
    // Order 4 again with another quantity: the key is reused.
    w.publish_event(&w.event(4, 3), "k2").await;
    let mut s: Vec<Settled> =
        vec![next(&mut settlements).await, next(&mut settlements).await, next(&mut settlements).await];
    s.sort_by(|a, b| a.message_id.cmp(&b.message_id));
    let ids: Vec<Option<&str>> = s.iter().map(|s| s.message_id.as_deref()).collect();
    assert_eq!(ids, [Some("k1"), Some("k2"), Some("p1")]);
    assert_eq!((s[0].action, s[0].outcome), (Action::Ack, Some(Outcome::Executed)));
    assert_eq!((s[1].action, s[1].outcome), (Action::DeadLetter(Reason::KeyReused), Some(Outcome::KeyReused)));
    assert_eq!(s[2].action, Action::DeadLetter(Reason::Poison));
    let dead = w.dead_letters().await;
    let reasons: Vec<&str> = dead.iter().map(|d| d.0.as_str()).collect();
    assert_eq!(reasons, ["poison", "key_reused"]);
    assert_eq!(dead[0].2, "{not json");
    assert_eq!(w.moves().await, 1);
    stop(stop_tx, task).await;
    w.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_body_is_naked_until_max_deliver_then_dead_lettered() {
    let Some(w) = world(10).await else { return };
    let (mut settlements, stop_tx, task) = w.run("c", Handling::Deduct, |c| c.max_deliver(3));
    let mut unknown = w.event(5, 1);
    unknown.sku = format!("{}-missing", w.sku);
    w.publish_event(&unknown, "f1").await;
    let mut s: Vec<(Action, u64)> =
        [next(&mut settlements).await, next(&mut settlements).await, next(&mut settlements).await]
            .iter()
            .map(|s| (s.action, s.delivery.count))
            .collect();
    s.sort_by_key(|&(_, count)| count);
    assert_eq!(
        s,
        [
            (Action::Retry { count: 2 }, 1),
            (Action::Retry { count: 3 }, 2),
            (Action::DeadLetter(Reason::DeliveriesExhausted), 3)
        ]
    );
    let dead = w.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].0, "deliveries_exhausted");
    stop(stop_tx, task).await;
    w.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_of_a_running_call_is_naked_and_then_replayed() {
    let Some(w) = world(10).await else { return };
    let gate = hold_next_body(&w.sku);
    let (mut settlements, stop_tx, task) = w.run("c", Handling::Deduct, |c| c.concurrency(2));
    w.publish_event(&w.event(6, 1), "r1").await;
    w.publish_event(&w.event(6, 1), "r2").await;
    // Whichever starts first holds the key; the other finds it in progress, naked.
    let busy = next(&mut settlements).await;
    assert_eq!((busy.action, busy.outcome), (Action::Requeue, Some(Outcome::InProgress)));
    let waiting = busy.message_id.clone().unwrap();
    let holder = if waiting == "r1" { "r2" } else { "r1" };
    gate.notify_one();
    let mut rest = Vec::new();
    while rest.iter().filter(|s: &&Settled| s.action == Action::Ack).count() < 2 {
        rest.push(next(&mut settlements).await);
    }
    let acked: Vec<(Option<&str>, Option<Outcome>)> =
        rest.iter().filter(|s| s.action == Action::Ack).map(|s| (s.message_id.as_deref(), s.outcome)).collect();
    assert!(acked.contains(&(Some(holder), Some(Outcome::Executed))), "{rest:?}");
    assert!(acked.contains(&(Some(waiting.as_str()), Some(Outcome::Replayed))), "{rest:?}");
    assert!(rest.iter().all(|s| s.action == Action::Ack || s.action == Action::Requeue), "{rest:?}");
    assert_eq!(w.moves().await, 1);
    stop(stop_tx, task).await;
    w.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_dropped_before_its_ack_gets_the_message_again_and_replays() {
    let Some(w) = world(10).await else { return };
    let committed = hang_after_call(&w.sku);
    let (mut first_settlements, _stop_first, first) =
        w.run("c", Handling::Deduct, |c| c.ack_wait(Duration::from_secs(1)));
    w.publish_event(&w.event(7, 1), "d1").await;
    // The call committed; the consumer dies before its ack.
    within(committed.notified()).await.expect("the call committed");
    first.abort();
    let _ = first.await;
    assert!(first_settlements.try_recv().is_err(), "nothing was settled");
    let (mut settlements, stop_tx, task) = w.run("c", Handling::Deduct, |c| c);
    let again = next(&mut settlements).await;
    assert_eq!((again.action, again.outcome, again.delivery.count), (Action::Ack, Some(Outcome::Replayed), 2));
    assert_eq!(w.moves().await, 1);
    stop(stop_tx, task).await;
    w.remove().await;
}

/// Regression: a handler passing on its call's recorded decline was naked
/// for a counted retry at each delivery, then dead-lettered
/// (`deliveries_exhausted`), each delivery only replaying the decision. The
/// decline and a duplicate of it (another message, the same order) are each
/// acked once at their first delivery (`AckRecorded`, counted under
/// `ack_recorded`); the body ran once, its deduction rolled back, the
/// decline recorded; nothing dead-lettered, nothing left to deliver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_decline_and_its_duplicate_are_acked_once() {
    let Some(w) = world(1).await else { return };
    idempotency_testkit::counters::install();
    let (mut settlements, stop_tx, task) = w.run("c", Handling::Reserve, |c| c.max_deliver(3));
    let decline = w.event(8, 5);
    w.publish_event(&decline, "n1").await;
    w.publish_event(&decline, "n2").await;
    let seen = [next(&mut settlements).await, next(&mut settlements).await];
    stop(stop_tx, task).await;
    let rest: Vec<Settled> = std::iter::from_fn(|| settlements.try_recv().ok()).collect();

    let got: Vec<(Option<&str>, Action, Option<Outcome>, u64)> =
        seen.iter().map(|s| (s.message_id.as_deref(), s.action, s.outcome, s.delivery.count)).collect();
    assert_eq!(
        unordered(got),
        unordered(vec![
            (Some("n1"), Action::AckRecorded, Some(Outcome::Executed), 1),
            (Some("n2"), Action::AckRecorded, Some(Outcome::Replayed), 1),
        ]),
        "{seen:#?}"
    );
    assert!(rest.is_empty(), "settled once each: {rest:#?}");
    assert!(seen.iter().all(|s| s.error.as_deref().is_some_and(|e| e.contains("OutOfStock"))), "{seen:#?}");
    assert_eq!(reserve_runs(&w.sku), 1, "the duplicate replayed the decline");
    assert_eq!(w.moves().await, 0, "the deduction rolled back");
    let stock: i64 = sqlx::query_scalar("SELECT qty FROM idem_nats_stock WHERE sku = ?")
        .bind(&w.sku)
        .fetch_one(w.idem.pool())
        .await
        .unwrap();
    assert_eq!(stock, 1);
    let key = format!("reserve_{}", decline.order_id);
    let recorded = format!(r#"{{"sku":"{}","short":4}}"#, w.sku);
    assert_eq!(w.idem.status("t_nats_reserve", &key).await.unwrap(), Status::Failed { error: recorded });
    assert!(w.dead_letters().await.is_empty());
    // Both acked, as the server counts: nothing pending, nothing awaiting an ack.
    let stream = w.js.get_stream(&w.names.stream).await.unwrap();
    let mut consumer: jetstream::consumer::PullConsumer = stream.get_consumer("c").await.unwrap();
    within(async {
        loop {
            let info = consumer.info().await.unwrap();
            if (info.num_pending, info.num_ack_pending, info.ack_floor.stream_sequence) == (0, 0, 2) {
                break;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("both messages acked");
    let counted = idempotency_testkit::counters::counted_by(
        idempotency::metrics::NATS_SETTLEMENTS,
        &[("stream", w.names.stream.as_str())],
        "action",
    );
    assert_eq!(counted, HashMap::from([("ack_recorded".to_owned(), 2)]));
    w.remove().await;
}
