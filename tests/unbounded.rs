//! `Duration::MAX` for the settings of the entry points around the engine
//! means "no bound", never a panic (an instant past what the clock counts)
//! nor a value the server refuses: an outbox relay and its NATS, RabbitMQ
//! and Kafka publishers (`ack_timeout`, `confirm_timeout`, `poll_interval`,
//! `retry_backoff`, `retention`, `purge`), and NATS, Redis Streams and
//! Kafka consumers (`ack_wait`, `claim_idle`, `claim_interval`, the three
//! delays) each carry an event end to end. The engine's own settings are in
//! the behaviour suite (`tests/suite/unbounded.rs`, `waits.rs`). NATS
//! JetStream (`IDEM_NATS_URL`), RabbitMQ (`IDEM_AMQP_URL`), the shared Redis
//! and a private tansu broker; the engines on SQLite in memory.

use std::time::Duration;

use idempotency::nats::async_nats::{self, jetstream};
use idempotency::outbox::{Event, Relay, nats::NatsPublisher};
use idempotency::{Idem, idempotent};
use idempotency_testkit::unique;
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, Transaction};
use tokio::sync::{mpsc, oneshot};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Paid {
    order: String,
}

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug
enum AppError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
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

impl idempotency::consumer::AsIdemError for AppError {
    fn idem_error(&self) -> Option<&idempotency::Error> {
        match self {
            AppError::Idem(e) => Some(e),
            AppError::Db(_) => None,
        }
    }
}

/// Queues `paid` on `subject`, in the call's transaction.
#[idempotent(key = "<order>", ttl = "1h", biz = "t_unbounded_pay")]
async fn pay(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    order: String,
    #[idem(skip)] subject: &str,
) -> Result<(), AppError> {
    idempotency::outbox::queue(tx, Event::json(subject, &Paid { order: order.clone() })?).await?;
    Ok(())
}

/// The consumers' handler, keyed by the message id.
#[idempotent(key = "<message_id>", ttl = "1h", biz = "t_unbounded_take")]
async fn take(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    message_id: String,
    paid: Paid,
) -> Result<String, AppError> {
    let _ = (tx, &message_id);
    Ok(paid.order)
}

/// Awaits `future`, failing after 30 s (only against a hang).
async fn within<F: std::future::Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), future).await.unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// Regression (issue 52.4): a NATS outbox publisher with
/// `ack_timeout(Duration::MAX)` and a relay purging every `Duration::MAX`
/// panicked ("overflow when adding duration to instant"). With every
/// setting of the relay, its publisher and a NATS consumer at
/// `Duration::MAX`, a queued event is published, confirmed and consumed;
/// both stop when told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_relay_and_consumer_with_every_duration_at_max() {
    let url = std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let Some(client) = idempotency_testkit::reach("nats", || async { async_nats::connect(&url).await.ok() }).await
    else {
        return;
    };
    let js = jetstream::new(client.clone());
    let name = unique("UNBOUNDED").replace('-', "_");
    let subject = format!("t.unbounded.{name}");
    idempotency::nats::declare_with_dead_letter(&js, &name, &[subject.as_str()]).await.expect("stream");
    let (payments, stock) = (Idem::sqlite_memory().await.unwrap(), Idem::sqlite_memory().await.unwrap());

    let (stop_relay, relay_stopped) = oneshot::channel::<()>();
    let publisher = NatsPublisher::new(client.clone()).ack_timeout(Duration::MAX);
    let relay = Relay::new(&payments, publisher)
        .poll_interval(Duration::MAX)
        .retry_backoff(Duration::MAX, Duration::MAX)
        .retention(Duration::MAX)
        .purge(Duration::MAX, 100);
    let stats = relay.stats();
    let relay = tokio::spawn(relay.run(async move {
        let _ = relay_stopped.await;
    }));

    let (settled, mut settlements) = mpsc::unbounded_channel();
    let (stop_consumer, consumer_stopped) = oneshot::channel::<()>();
    let handler_engine = stock.clone();
    let consumer = tokio::spawn(
        idempotency::nats::Consumer::new(js.clone(), name.clone(), "taker")
            .ack_wait(Duration::MAX)
            .retry_delay(Duration::MAX)
            .in_progress_delay(Duration::MAX)
            .storage_delay(Duration::MAX)
            .on_settle(move |s| {
                let _ = settled.send((s.action, s.delivery.count));
            })
            .run_with_id(
                async move {
                    let _ = consumer_stopped.await;
                },
                move |message_id: String, paid: Paid| {
                    let idem = handler_engine.clone();
                    async move { take(&idem, message_id, paid).await }
                },
            ),
    );

    pay(&payments, unique("order"), &subject).await.expect("paid");
    let (action, count) = within("the event consumed", settlements.recv()).await.expect("a settlement");
    assert_eq!((action, count), (idempotency::consumer::Action::Ack, 1));
    assert!(stats.published() >= 1, "the relay counts it published");
    let _ = stop_consumer.send(());
    within("the consumer stops", consumer).await.unwrap().expect("the consumer ends cleanly");
    let _ = stop_relay.send(());
    within("the relay stops", relay).await.expect("the relay did not panic");
    let _ = js.delete_stream(&name).await;
    let _ = js.delete_stream(format!("{name}_DEAD")).await;
}

/// Regression (issue 52.4): a Redis Streams consumer with
/// `claim_idle(Duration::MAX)` asked Redis for a min-idle-time it refuses
/// and ended with that error before taking anything; `claim_interval(MAX)`
/// panicked once a claim pass was done. With both and the delays at
/// `Duration::MAX`, an entry is taken and acked, and the consumer stops
/// cleanly when told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_consumer_with_every_duration_at_max() {
    let Some(client) = idempotency_testkit::redis_client().await else { return };
    let stock = Idem::sqlite_memory().await.unwrap();
    let stream = unique("t_unbounded_stream");
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let payload = serde_json::to_string(&Paid { order: unique("order") }).unwrap();
    let _: String = redis::cmd("XADD")
        .arg(&stream)
        .arg("*")
        .arg("message_id")
        .arg(unique("m"))
        .arg("payload")
        .arg(&payload)
        .query_async(&mut conn)
        .await
        .unwrap();

    let (settled, mut settlements) = mpsc::unbounded_channel();
    let (stop, stopped) = oneshot::channel::<()>();
    let mut consumer = tokio::spawn(
        idempotency::redis_streams::Consumer::new(client.clone(), stream.clone(), "taker")
            .claim_idle(Duration::MAX)
            .claim_interval(Duration::MAX)
            .retry_delay(Duration::MAX)
            .in_progress_delay(Duration::MAX)
            .storage_delay(Duration::MAX)
            .on_settle(move |s| {
                let _ = settled.send(s.action);
            })
            .run_with_id(
                async move {
                    let _ = stopped.await;
                },
                move |message_id: String, paid: Paid| {
                    let idem = stock.clone();
                    async move { take(&idem, message_id, paid).await }
                },
            ),
    );
    let action = tokio::select! {
        action = within("the entry consumed", settlements.recv()) => action.expect("a settlement"),
        ended = &mut consumer => panic!("the consumer ended before taking the entry: {ended:?}"),
    };
    assert_eq!(action, idempotency::consumer::Action::Ack);
    let _ = stop.send(());
    within("the consumer stops", consumer).await.unwrap().expect("the consumer ends cleanly");
    let _: i64 = redis::cmd("DEL").arg(&stream).query_async(&mut conn).await.unwrap();
}

/// Regression (issue 52.4): a RabbitMQ outbox publisher with
/// `confirm_timeout(Duration::MAX)` panicked at its first batch. The event
/// is published and confirmed; the relay stops when told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_relay_with_a_confirm_timeout_at_max() {
    use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::FieldTable;
    use lapin::{Connection, ConnectionProperties};
    let url = std::env::var("IDEM_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".into());
    let Some(conn) = idempotency_testkit::reach("rabbitmq", || async {
        Connection::connect(&url, ConnectionProperties::default()).await.ok()
    })
    .await
    else {
        return;
    };
    let channel = conn.create_channel().await.unwrap();
    let queue = unique("t.unbounded");
    channel.queue_declare(queue.as_str().into(), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
    let payments = Idem::sqlite_memory().await.unwrap();
    let publisher = idempotency::outbox::rabbit::RabbitPublisher::new(url.clone()).confirm_timeout(Duration::MAX);
    let relay = Relay::new(&payments, publisher).purge(Duration::MAX, 100);
    let stats = relay.stats();
    let (stop, stopped) = oneshot::channel::<()>();
    let relay = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));
    pay(&payments, unique("order"), &queue).await.expect("paid");
    within("the event published", async {
        while stats.published() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let _ = stop.send(());
    within("the relay stops", relay).await.expect("the relay did not panic");
    let held = channel.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
    assert_eq!(held, 1, "the queue held the event");
}

/// Regression (issue 52.4): a Kafka consumer with
/// `in_progress_delay(Duration::MAX)` panicked when it held a delivery
/// back, and a Kafka outbox publisher with an `ack_timeout` of
/// `Duration::MAX` at its first batch. The event is produced and
/// confirmed; its delivery, answered `InProgress`, is held back (settled
/// `Requeue`, not delivered again); the consumer and the relay stop when
/// told. A private tansu broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_relay_and_consumer_with_delays_at_max() {
    use idempotency::kafka::rdkafka::ClientConfig;
    let Some(broker) = idempotency_testkit::kafka::Tansu::start() else { return };
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", broker.bootstrap());
    idempotency::kafka::declare_with_dead_letter(&config, "orders", "stock", 1, 1).await.expect("topics");
    let payments = Idem::sqlite_memory().await.unwrap();
    let publisher = idempotency::outbox::kafka::KafkaPublisher::with_ack_timeout(&config, Duration::MAX).unwrap();
    let relay = Relay::new(&payments, publisher).purge(Duration::MAX, 100);
    let stats = relay.stats();
    let (stop_relay, relay_stopped) = oneshot::channel::<()>();
    let relay = tokio::spawn(relay.run(async move {
        let _ = relay_stopped.await;
    }));

    let (settled, mut settlements) = mpsc::unbounded_channel();
    let (stop_consumer, consumer_stopped) = oneshot::channel::<()>();
    let consumer = tokio::spawn(
        idempotency::kafka::Consumer::new(config.clone(), "orders", "stock")
            .in_progress_delay(Duration::MAX)
            .storage_delay(Duration::MAX)
            .retry_delay(Duration::MAX)
            .on_settle(move |s| {
                let _ = settled.send(s.action);
            })
            .run(
                async move {
                    let _ = consumer_stopped.await;
                },
                |_: Paid| async {
                    Err::<(), _>(AppError::Idem(idempotency::Error::InProgress { biz: "t", key: "k".into() }))
                },
            ),
    );
    pay(&payments, unique("order"), "orders").await.expect("paid");
    let action = within("the delivery settled", settlements.recv()).await.expect("a settlement");
    assert_eq!(action, idempotency::consumer::Action::Requeue);
    assert!(stats.published() >= 1, "the relay counts it published");
    let _ = stop_consumer.send(());
    within("the consumer stops", consumer).await.unwrap().expect("the consumer ends cleanly");
    assert!(settlements.try_recv().is_err(), "held back, not delivered again");
    let _ = stop_relay.send(());
    within("the relay stops", relay).await.expect("the relay did not panic");
}
