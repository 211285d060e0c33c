//! The outbox relay to Kafka, end to end with a relay that dies.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::kafka::{Action, Settled};
use idempotency::outbox::{Event, Relay, kafka::KafkaPublisher};
use idempotency::{Idem, Outcome, idempotent};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{MySql, Transaction};
use tokio::sync::{Notify, mpsc, oneshot};

use crate::support::*;

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
