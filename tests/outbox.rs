//! `idempotency::outbox` without a broker: queueing in the body's transaction,
//! message ids, and the relay's rules (order, back-off, dead rows, purge,
//! wake-up) through a recording publisher. On SQLite, MariaDB
//! (`IDEM_MYSQL_URL`) and PostgreSQL (`IDEM_PG_URL`); each test gets a
//! database (or schema) of its own, dropped at the end.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency::outbox::{Confirm, Event, Message, MessageId, Publisher, Relay};
use idempotency::{Backend, Idem, idempotent};
use sqlx::{MySql, Pool, Postgres, Sqlite, Transaction};
use tokio::sync::oneshot;

fn skip(service: &str, e: impl std::fmt::Display) {
    assert!(std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(), "{service} unreachable: {e}");
    eprintln!("skipped: {service} unreachable ({e})");
}

fn unique() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    format!("{:012x}", h.finish() & 0xffff_ffff_ffff)
}

/// Drops a test's database (or schema, or file).
type Cleanup = Box<dyn FnOnce() -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// An engine on a database of its own; dropping it does not clean up,
/// `Fresh::drop_db` does.
struct Fresh<DB: Backend> {
    idem: Idem<DB>,
    cleanup: Option<Cleanup>,
}

impl<DB: Backend> Fresh<DB> {
    async fn drop_db(mut self) {
        self.idem.pool().close().await;
        if let Some(cleanup) = self.cleanup.take() {
            cleanup().await;
        }
    }
}

async fn fresh_sqlite() -> Option<Fresh<Sqlite>> {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    let file = std::env::temp_dir().join(format!("idem-outbox-{}.db", unique()));
    let options = SqliteConnectOptions::new()
        .filename(&file)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool = SqlitePoolOptions::new().max_connections(8).connect_with(options).await.expect("sqlite");
    let idem = Idem::new(pool);
    idem.migrate().await.expect("migrate");
    let cleanup = move || -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", file.display()));
            }
        })
    };
    Some(Fresh { idem, cleanup: Some(Box::new(cleanup)) })
}

async fn fresh_mysql() -> Option<Fresh<MySql>> {
    use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
    let url = std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let admin = match MySqlPoolOptions::new().max_connections(1).connect(&url).await {
        Ok(pool) => pool,
        Err(e) => {
            skip("mysql", e);
            return None;
        }
    };
    let db = format!("idem_outbox_{}", unique());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}"))).execute(&admin).await.expect("create db");
    let options: MySqlConnectOptions = url.parse().expect("url");
    let pool = MySqlPoolOptions::new().max_connections(8).connect_with(options.database(&db)).await.expect("mysql");
    let idem = Idem::new(pool);
    idem.migrate().await.expect("migrate");
    let cleanup = move || -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {db}"))).execute(&admin).await;
            admin.close().await;
        })
    };
    Some(Fresh { idem, cleanup: Some(Box::new(cleanup)) })
}

async fn fresh_postgres() -> Option<Fresh<Postgres>> {
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    let url = std::env::var("IDEM_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let admin = match PgPoolOptions::new().max_connections(1).connect(&url).await {
        Ok(pool) => pool,
        Err(e) => {
            skip("postgres", e);
            return None;
        }
    };
    let schema = format!("idem_outbox_{}", unique());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}"))).execute(&admin).await.expect("schema");
    let options: PgConnectOptions = url.parse().expect("url");
    let options = options.options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new().max_connections(8).connect_with(options).await.expect("postgres");
    let idem = Idem::new(pool);
    idem.migrate().await.expect("migrate");
    let cleanup = move || -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE"))).execute(&admin).await;
            admin.close().await;
        })
    };
    Some(Fresh { idem, cleanup: Some(Box::new(cleanup)) })
}

/// Waits until `check` holds, polling; fails after `limit`.
async fn until<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < limit, "gave up after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// What the recording publisher does with a destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Confirm,
    Refuse,
    Silence,
}

/// A confirmed message: destination, aggregate, payload.
type Published = (String, Option<String>, String);

/// Confirms (records), refuses or leaves unanswered each message, by
/// destination; clones share the log.
#[derive(Clone, Default)]
struct Recorder {
    log: Arc<Mutex<Vec<Published>>>,
    answers: Arc<Mutex<HashMap<String, Answer>>>,
    attempts: Arc<AtomicUsize>,
    /// Holds each batch this long before answering (several relays overlap).
    slow: Arc<AtomicBool>,
}

impl Recorder {
    fn answer(&self, destination: &str, answer: Answer) {
        self.answers.lock().unwrap().insert(destination.to_owned(), answer);
    }

    /// (destination, aggregate, payload) of every confirmed message, in order.
    fn log(&self) -> Vec<Published> {
        self.log.lock().unwrap().clone()
    }

    fn payloads(&self, destination: &str) -> Vec<String> {
        self.log().into_iter().filter(|(d, _, _)| d == destination).map(|(_, _, p)| p).collect()
    }
}

impl Publisher for Recorder {
    async fn publish(&mut self, batch: &[Message]) -> Vec<Confirm> {
        if self.slow.load(SeqCst) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let answers = self.answers.lock().unwrap().clone();
        let mut log = self.log.lock().unwrap();
        batch
            .iter()
            .map(|m| {
                self.attempts.fetch_add(1, SeqCst);
                match answers.get(m.destination()).copied().unwrap_or(Answer::Confirm) {
                    Answer::Confirm => {
                        log.push((
                            m.destination().to_owned(),
                            m.aggregate().map(str::to_owned),
                            m.payload().to_owned(),
                        ));
                        Confirm::Sent { duplicate: false }
                    }
                    Answer::Refuse => Confirm::Refused("refused by the test".into()),
                    Answer::Silence => Confirm::Unconfirmed("no answer in the test".into()),
                }
            })
            .collect()
    }
}

/// Runs `relay` until the returned sender is dropped or fired.
fn spawn_relay<DB: Backend, P: Publisher + 'static>(
    relay: Relay<DB, P>,
) -> (oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let (stop, stopped) = oneshot::channel::<()>();
    let handle = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));
    (stop, handle)
}

async fn stop(relay: (oneshot::Sender<()>, tokio::task::JoinHandle<()>)) {
    let _ = relay.0.send(());
    tokio::time::timeout(Duration::from_secs(30), relay.1).await.expect("relay stops").expect("relay ran");
}

/// Queues one event with an id of its own, outside any call, and commits.
async fn seed<DB: Backend>(idem: &Idem<DB>, destination: &str, aggregate: Option<&str>, payload: &str) -> MessageId {
    let id = MessageId::derive("t_seed", &format!("{destination}.{payload}"), 0).unwrap();
    let mut tx = idem.pool().begin().await.unwrap();
    let mut event = Event::raw(destination, payload.to_owned()).id(id.clone());
    if let Some(aggregate) = aggregate {
        event = event.aggregate(aggregate);
    }
    idempotency::outbox::queue(&mut tx, event).await.unwrap();
    tx.commit().await.unwrap();
    id
}

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug in failures
enum TestError {
    Idem(idempotency::Error),
    Planned,
}

impl From<idempotency::Error> for TestError {
    fn from(e: idempotency::Error) -> Self {
        TestError::Idem(e)
    }
}

/// The annotated fns and the tests that need them, per backend.
macro_rules! call_tests {
    ($name:ident, $db:ty, $fresh:ident) => {
        mod $name {
            use super::*;

            /// Queues `order.paid` then `order.audit`; fails after queueing
            /// when `fail` is set.
            #[idempotent(key = "order_<order>", ttl = "1h", biz = "t_pay")]
            async fn pay(
                idem: &Idem<$db>,
                tx: &mut Transaction<'_, $db>,
                order: i64,
                fail: bool,
            ) -> Result<i64, TestError> {
                let paid = serde_json::json!({ "order": order });
                idempotency::outbox::queue(tx, Event::json("order.paid", &paid)?.aggregate(format!("order-{order}"))).await?;
                idempotency::outbox::queue(tx, Event::json("order.audit", &paid)?.header("x-source", "test")).await?;
                if fail {
                    return Err(TestError::Planned);
                }
                Ok(order)
            }

            type Row = (String, String, Option<String>, String, Option<String>, Option<String>, Option<String>, i16);

            async fn rows(pool: &Pool<$db>) -> Vec<Row> {
                sqlx::query_as(
                    "SELECT message_id, destination, aggregate_key, payload, headers, biz_type, idem_key, status FROM idem_outbox ORDER BY id",
                )
                .fetch_all(pool)
                .await
                .unwrap()
            }

            fn id(key: &str, position: u32) -> String {
                MessageId::derive("t_pay", key, position).unwrap().to_string()
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn queued_events_commit_with_the_body_under_the_calls_ids() {
                let Some(fresh) = $fresh().await else { return };
                assert_eq!(pay(&fresh.idem, 7, false).await.unwrap(), 7);
                let rows = rows(fresh.idem.pool()).await;
                let paid = r#"{"order":7}"#.to_owned();
                let call = (Some("t_pay".to_owned()), Some("order_7".to_owned()));
                assert_eq!(
                    rows,
                    vec![
                        (id("order_7", 0), "order.paid".into(), Some("order-7".into()), paid.clone(), None, call.0.clone(), call.1.clone(), 0),
                        (id("order_7", 1), "order.audit".into(), None, paid, Some(r#"{"x-source":"test"}"#.into()), call.0, call.1, 0),
                    ]
                );
                fresh.drop_db().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_rolled_back_body_leaves_no_event_and_its_rerun_queues_the_same_ids() {
                let Some(fresh) = $fresh().await else { return };
                assert!(matches!(pay(&fresh.idem, 8, true).await, Err(TestError::Planned)));
                assert!(rows(fresh.idem.pool()).await.is_empty(), "a rolled-back body's events stayed");
                assert_eq!(pay(&fresh.idem, 8, false).await.unwrap(), 8);
                let ids: Vec<String> = rows(fresh.idem.pool()).await.into_iter().map(|r| r.0).collect();
                assert_eq!(ids, vec![id("order_8", 0), id("order_8", 1)]);
                fresh.drop_db().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_replayed_call_queues_nothing() {
                let Some(fresh) = $fresh().await else { return };
                assert_eq!(pay(&fresh.idem, 9, false).await.unwrap(), 9);
                assert_eq!(pay(&fresh.idem, 9, false).await.unwrap(), 9);
                assert_eq!(rows(fresh.idem.pool()).await.len(), 2);
                fresh.drop_db().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn outside_a_call_an_event_needs_its_own_id_and_an_id_is_queued_once() {
                let Some(fresh) = $fresh().await else { return };
                let mut tx = fresh.idem.pool().begin().await.unwrap();
                let missing = idempotency::outbox::queue(&mut tx, Event::raw("x", "{}")).await;
                assert!(matches!(missing, Err(idempotency::Error::InvalidKey(idempotency::KeyError::Missing))), "{missing:?}");
                let long = idempotency::outbox::queue(&mut tx, Event::raw("x".repeat(256), "{}")).await;
                assert!(matches!(long, Err(idempotency::Error::InvalidKey(idempotency::KeyError::TooLong { len: 256, .. }))), "{long:?}");
                let given = MessageId::derive("t_import", "batch_1", 0).unwrap();
                let first = idempotency::outbox::queue(&mut tx, Event::raw("x", "1").id(given.clone())).await.unwrap();
                let again = idempotency::outbox::queue(&mut tx, Event::raw("x", "2").id(given.clone())).await.unwrap();
                tx.commit().await.unwrap();
                assert_eq!((first, again), (given.clone(), given.clone()));
                let rows = rows(fresh.idem.pool()).await;
                assert_eq!(rows.len(), 1);
                assert_eq!((rows[0].0.as_str(), rows[0].3.as_str(), &rows[0].5), (given.as_str(), "1", &None));
                fresh.drop_db().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_commit_wakes_an_idle_relay_before_its_poll() {
                let Some(fresh) = $fresh().await else { return };
                let recorder = Recorder::default();
                seed(&fresh.idem, "warm", None, "w").await;
                let relay = spawn_relay(Relay::new(&fresh.idem, recorder.clone()).poll_interval(Duration::from_secs(3600)));
                // Its first batch takes the one row; then it would sleep an hour.
                until("the first batch", Duration::from_secs(10), || async { recorder.log().len() == 1 }).await;
                pay(&fresh.idem, 10, false).await.unwrap();
                until("the woken relay to publish", Duration::from_secs(10), || async { recorder.log().len() == 3 }).await;
                stop(relay).await;
                fresh.drop_db().await;
            }
        }
    };
}

call_tests!(sqlite_calls, Sqlite, fresh_sqlite);
call_tests!(mysql_calls, MySql, fresh_mysql);
call_tests!(postgres_calls, Postgres, fresh_postgres);

/// A refused event backs off, dies after `max_attempts`, and holds back
/// the rest of its aggregate until discarded; other aggregates go on.
async fn refused_events_die_and_hold_their_aggregate<DB: Backend>(fresh: Fresh<DB>) {
    let idem = &fresh.idem;
    let recorder = Recorder::default();
    recorder.answer("bad", Answer::Refuse);
    let bad = seed(idem, "bad", Some("a"), "a1").await;
    seed(idem, "good", Some("a"), "a2").await;
    seed(idem, "good", Some("b"), "b1").await;
    let relay = Relay::new(idem, recorder.clone())
        .poll_interval(Duration::from_millis(20))
        .max_attempts(3)
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(40));
    let stats = relay.stats();
    let relay = spawn_relay(relay);
    // The relay counts after its commit: the rows are marked by then.
    until("the refused event to die", Duration::from_secs(20), || async { stats.dead() == 1 }).await;
    until("b1 sent", Duration::from_secs(10), || async { stats.published() == 1 }).await;
    assert_eq!(recorder.payloads("good"), ["b1"]);
    assert_eq!((stats.refused(), stats.dead()), (3, 1));
    let dead = idem.outbox().dead(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].message_id.as_str(), dead[0].attempts), (bad.as_str(), 3));
    assert_eq!(dead[0].last_error.as_deref(), Some("refused by the test"));
    // a2 waits behind the dead a1: c1, queued after it, goes out in a batch
    // that would have taken a2 too (it comes first in id order).
    seed(idem, "good", Some("c"), "c1").await;
    until("c1 sent", Duration::from_secs(10), || async { stats.published() == 2 }).await;
    assert_eq!(recorder.payloads("good"), ["b1", "c1"], "a2 left before the dead a1");
    let counts = idem.outbox().counts().await.unwrap();
    assert_eq!((counts.pending, counts.sent, counts.dead), (1, 2, 1));
    // Retried while the broker still refuses: dead again after 3 more.
    assert!(idem.outbox().retry_dead(bad.as_str()).await.unwrap());
    until("dead again", Duration::from_secs(20), || async { stats.dead() == 2 }).await;
    assert!(idem.outbox().discard_dead(bad.as_str()).await.unwrap());
    assert!(!idem.outbox().discard_dead(bad.as_str()).await.unwrap());
    until("a2 after the discard", Duration::from_secs(10), || async {
        recorder.payloads("good") == ["b1", "c1", "a2"]
    })
    .await;
    stop(relay).await;
    fresh.drop_db().await;
}

/// An event the broker does not answer stays pending, its attempts
/// uncounted, and goes out once the broker answers.
async fn unanswered_events_stay_pending_uncounted<DB: Backend>(fresh: Fresh<DB>) {
    let idem = &fresh.idem;
    let recorder = Recorder::default();
    recorder.answer("flaky", Answer::Silence);
    seed(idem, "flaky", None, "f1").await;
    let relay = Relay::new(idem, recorder.clone())
        .poll_interval(Duration::from_millis(10))
        .max_attempts(2)
        .retry_backoff(Duration::from_millis(5), Duration::from_millis(20));
    let stats = relay.stats();
    let relay = spawn_relay(relay);
    until("five unanswered attempts", Duration::from_secs(20), || async { stats.unconfirmed() >= 5 }).await;
    let counts = idem.outbox().counts().await.unwrap();
    assert_eq!((counts.pending, counts.dead, stats.refused()), (1, 0, 0));
    recorder.answer("flaky", Answer::Confirm);
    until("f1 sent", Duration::from_secs(20), || async { idem.outbox().counts().await.unwrap().sent == 1 }).await;
    assert_eq!(recorder.payloads("flaky"), ["f1"]);
    stop(relay).await;
    fresh.drop_db().await;
}

/// Two relays at once: every event published once, and each aggregate's
/// events in the order queued.
async fn two_relays_publish_each_event_once_in_aggregate_order<DB: Backend>(fresh: Fresh<DB>) {
    const AGGREGATES: usize = 8;
    const PER_AGGREGATE: usize = 25;
    let idem = &fresh.idem;
    let recorder = Recorder::default();
    recorder.slow.store(true, SeqCst);
    let relays: Vec<_> = (0..2)
        .map(|_| spawn_relay(Relay::new(idem, recorder.clone()).batch_size(7).poll_interval(Duration::from_millis(5))))
        .collect();
    // Queued while the relays run, a few transactions at a time.
    let mut queued = Vec::new();
    for seq in 0..PER_AGGREGATE {
        for agg in 0..AGGREGATES {
            queued.push((format!("agg{agg}"), seq));
        }
    }
    for chunk in queued.chunks(10) {
        let mut tx = idem.pool().begin().await.unwrap();
        for (agg, seq) in chunk {
            let id = MessageId::derive("t_order", &format!("{agg}.{seq}"), 0).unwrap();
            let event = Event::raw("ordered", format!("{agg}:{seq}")).aggregate(agg.clone()).id(id);
            idempotency::outbox::queue(&mut tx, event).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    let total = AGGREGATES * PER_AGGREGATE;
    until("every event", Duration::from_secs(60), || async { recorder.log().len() >= total }).await;
    for relay in relays {
        stop(relay).await;
    }
    let log = recorder.log();
    assert_eq!(log.len(), total, "an event was published twice");
    let distinct: HashSet<&String> = log.iter().map(|(_, _, p)| p).collect();
    assert_eq!(distinct.len(), total);
    let mut last: HashMap<String, usize> = HashMap::new();
    for (_, aggregate, payload) in &log {
        let aggregate = aggregate.clone().unwrap();
        let seq: usize = payload.rsplit(':').next().unwrap().parse().unwrap();
        let expected = last.get(&aggregate).map_or(0, |s| s + 1);
        assert_eq!(seq, expected, "{aggregate}: {seq} published after {:?}", last.get(&aggregate));
        last.insert(aggregate, seq);
    }
    assert_eq!(idem.outbox().counts().await.unwrap().sent, total as u64);
    fresh.drop_db().await;
}

/// Sent rows are purged once past the retention; pending and dead rows never.
async fn sent_rows_are_purged_after_the_retention<DB: Backend>(fresh: Fresh<DB>) {
    let idem = &fresh.idem;
    let recorder = Recorder::default();
    recorder.answer("stuck", Answer::Silence);
    for i in 0..5 {
        seed(idem, "done", None, &format!("d{i}")).await;
    }
    seed(idem, "stuck", None, "s").await;
    let relay = Relay::new(idem, recorder.clone()).poll_interval(Duration::from_millis(10));
    let relay = spawn_relay(relay);
    until("five sent", Duration::from_secs(20), || async { idem.outbox().counts().await.unwrap().sent == 5 }).await;
    stop(relay).await;
    // Not yet past a retention of an hour.
    assert_eq!(idem.outbox().purge_sent(Duration::from_secs(3600), 100).await.unwrap(), 0);
    // A relay purges by itself, in batches of 2.
    let relay = Relay::new(idem, recorder.clone()).retention(Duration::ZERO).purge(Duration::from_millis(10), 2);
    let stats = relay.stats();
    let relay = spawn_relay(relay);
    until("the purge", Duration::from_secs(20), || async { stats.purged() == 5 }).await;
    stop(relay).await;
    let counts = idem.outbox().counts().await.unwrap();
    assert_eq!((counts.pending, counts.sent, counts.dead), (1, 0, 0));
    fresh.drop_db().await;
}

macro_rules! relay_tests {
    ($name:ident, $fresh:ident) => {
        mod $name {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn refused_events_die_and_hold_their_aggregate() {
                let Some(fresh) = $fresh().await else { return };
                super::refused_events_die_and_hold_their_aggregate(fresh).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn unanswered_events_stay_pending_uncounted() {
                let Some(fresh) = $fresh().await else { return };
                super::unanswered_events_stay_pending_uncounted(fresh).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn two_relays_publish_each_event_once_in_aggregate_order() {
                let Some(fresh) = $fresh().await else { return };
                super::two_relays_publish_each_event_once_in_aggregate_order(fresh).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sent_rows_are_purged_after_the_retention() {
                let Some(fresh) = $fresh().await else { return };
                super::sent_rows_are_purged_after_the_retention(fresh).await;
            }
        }
    };
}

relay_tests!(sqlite_relay, fresh_sqlite);
relay_tests!(mysql_relay, fresh_mysql);
relay_tests!(postgres_relay, fresh_postgres);

/// Holds its first batch until released, after saying it has it.
#[derive(Clone, Default)]
struct Holding {
    entered: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::Notify>,
    held: Arc<AtomicBool>,
}

impl Publisher for Holding {
    async fn publish(&mut self, batch: &[Message]) -> Vec<Confirm> {
        if !self.held.swap(true, SeqCst) {
            self.entered.notify_one();
            self.release.notified().await;
        }
        vec![Confirm::Sent { duplicate: false }; batch.len()]
    }
}

/// A batch in flight (its rows locked while the broker confirms) does not
/// hold back bodies queueing new events: row locks only (MySQL reads
/// committed in the relay's transaction, so no gap lock covers the new
/// rows). Not on SQLite, whose relay holds the write lock by design.
async fn a_batch_in_flight_does_not_hold_back_bodies_queueing<DB: Backend>(fresh: Fresh<DB>) {
    let idem = &fresh.idem;
    seed(idem, "held", None, "h1").await;
    let holding = Holding::default();
    let relay = spawn_relay(Relay::new(idem, holding.clone()).poll_interval(Duration::from_millis(10)));
    tokio::time::timeout(Duration::from_secs(10), holding.entered.notified()).await.expect("the relay took the batch");
    let queued = tokio::time::timeout(Duration::from_secs(5), seed(idem, "held", None, "h2")).await;
    assert!(queued.is_ok(), "a body queueing an event waited for the relay's batch");
    holding.release.notify_one();
    until("both sent", Duration::from_secs(10), || async { idem.outbox().counts().await.unwrap().sent == 2 }).await;
    stop(relay).await;
    fresh.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_batch_in_flight_does_not_hold_back_bodies_queueing() {
    let Some(fresh) = fresh_mysql().await else { return };
    a_batch_in_flight_does_not_hold_back_bodies_queueing(fresh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_batch_in_flight_does_not_hold_back_bodies_queueing() {
    let Some(fresh) = fresh_postgres().await else { return };
    a_batch_in_flight_does_not_hold_back_bodies_queueing(fresh).await;
}

/// A body in `steps` mode queues in its final transaction, under ids
/// derived from its call, as a plain body does.
#[idempotent(key = "order_<order>_charge", ttl = "1h", biz = "t_charge", steps)]
async fn charge(idem: &Idem<Sqlite>, steps: &mut idempotency::Steps<Sqlite>, order: i64) -> Result<i64, TestError> {
    let tx = steps.transaction().await?;
    idempotency::outbox::queue(tx, Event::raw("order.charged", format!("{{\"order\":{order}}}"))).await?;
    Ok(order)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steps_mode_body_queues_under_its_calls_ids() {
    let Some(fresh) = fresh_sqlite().await else { return };
    assert_eq!(charge(&fresh.idem, 11).await.unwrap(), 11);
    assert_eq!(charge(&fresh.idem, 11).await.unwrap(), 11);
    let ids: Vec<String> =
        sqlx::query_scalar("SELECT message_id FROM idem_outbox").fetch_all(fresh.idem.pool()).await.unwrap();
    assert_eq!(ids, vec![MessageId::derive("t_charge", "order_11_charge", 0).unwrap().to_string()]);
    fresh.drop_db().await;
}

/// One aggregate's order under overlapping writers and two relays.
#[path = "outbox/order.rs"]
mod order;

/// A relay dropped while its batch's `BEGIN` is unanswered.
#[path = "outbox/dropped.rs"]
mod dropped;
