//! Behind PgBouncer, the rest of what sends SQL: the outbox (events with and
//! without an aggregate, queued by 8 callers at once on 3 server
//! connections), its relays to RabbitMQ and to NATS with their purges, and
//! calls that `join` the caller's transaction.
//!
//! Regression: the aggregate's lock (`store/outbox.rs`) was sent as a named
//! statement, and about one call in five failed behind the pooler (`42P05
//! prepared statement "sqlx_s_1" already exists`, `26000 ... does not
//! exist`); the relay's purge of aggregate rows ran on the pool as one too.

use std::collections::{BTreeMap, BTreeSet};

use idempotency::outbox::{Event, Relay, queue};

use super::*;

/// As the defect was measured: 8 callers on a pool of 8, 3 server connections.
const SERVERS: u32 = 3;
const CALLERS: usize = 8;
const CALLS_EACH: usize = 8;
/// Aggregates the events with one are spread over.
const AGGREGATES: usize = 4;

/// Queues two events: one of aggregate `aggregate`, one without.
#[idempotent(key = "<k>", ttl = "1h", biz = "pgb_ship")]
async fn ship(
    idem: &Idem<Postgres>,
    tx: &mut Transaction<'_, Postgres>,
    #[idem(skip)] runs: &AtomicUsize,
    k: String,
    destination: String,
    aggregate: String,
) -> Result<usize, TestError> {
    let run = runs.fetch_add(1, SeqCst) + 1;
    let with = Event::raw(destination.clone(), format!("{{\"k\":\"{k}\",\"aggregate\":true}}")).aggregate(aggregate);
    queue(tx, with).await?;
    queue(tx, Event::raw(destination, format!("{{\"k\":\"{k}\",\"aggregate\":false}}"))).await?;
    Ok(run)
}

/// Where a relay publishes, and what it received, in order.
trait Broker {
    type Publisher: idempotency::outbox::Publisher + 'static;
    fn destination(&self) -> String;
    async fn publisher(&self) -> Self::Publisher;
    /// The message ids received, in the order they were published.
    async fn received(&self, expected: usize) -> Vec<String>;
    async fn cleanup(&self);
}

/// 64 calls from 8 callers at once, each queueing an event with an
/// aggregate and one without: every call executes once, nothing fails.
/// Then `relay` publishes all 128 (each aggregate's in the order of its
/// ids), and purges the sent rows and the aggregate rows, all behind the pooler.
async fn outbox_through<B: Broker>(broker: B, redis: bool) {
    let Some(behind) = Behind::start_with(SERVERS).await else { return };
    let builder = Idem::builder(behind.pool_of(CALLERS as u32).await).transaction_pooler(true);
    let idem = if redis {
        let Some(client) = redis_client().await else { return };
        builder.redis(client).build()
    } else {
        builder.build()
    };
    idem.migrate().await.expect("migrate");
    let runs = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(Barrier::new(CALLERS));
    let prefix = unique("ship");
    let callers: Vec<_> = (0..CALLERS)
        .map(|caller| {
            let (idem, runs, barrier, prefix, destination) =
                (idem.clone(), runs.clone(), barrier.clone(), prefix.clone(), broker.destination());
            tokio::spawn(async move {
                barrier.wait().await;
                let mut outcomes = Vec::new();
                for call in 0..CALLS_EACH {
                    let n = caller * CALLS_EACH + call;
                    let (k, aggregate) = (format!("{prefix}-{n}"), format!("{prefix}-agg-{}", n % AGGREGATES));
                    let (result, outcome) =
                        idempotency::observe(ship(&idem, &runs, k.clone(), destination.clone(), aggregate)).await;
                    result.unwrap_or_else(|e| panic!("{k}: {e:?}"));
                    outcomes.push(outcome);
                }
                outcomes
            })
        })
        .collect();
    for caller in callers {
        let outcomes = caller.await.expect("no caller panics");
        assert!(outcomes.iter().all(|o| *o == Some(Outcome::Executed)), "{outcomes:?}");
    }
    let calls = CALLERS * CALLS_EACH;
    assert_eq!(runs.load(SeqCst), calls);
    assert_eq!(behind.scalar("SELECT COUNT(*) FROM idem_outbox WHERE status = 0").await, 2 * calls as i64);
    assert_eq!(behind.scalar("SELECT COUNT(*) FROM idem_outbox_aggregate").await, AGGREGATES as i64);

    // The ids each aggregate's events were queued under, in id order.
    let rows: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT message_id, aggregate_key FROM idem_outbox ORDER BY id")
            .fetch_all(&behind.direct)
            .await
            .expect("outbox rows");
    let mut queued: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (id, aggregate) in &rows {
        if let Some(aggregate) = aggregate {
            queued.entry(aggregate.clone()).or_default().push(id.clone());
        }
    }

    let relay = Relay::new(&idem, broker.publisher().await)
        .poll_interval(Duration::from_millis(20))
        .retention(Duration::ZERO)
        .purge(Duration::ZERO, 1000);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));
    // Sent and purged: no outbox row and no aggregate row left.
    let start = Instant::now();
    while behind.scalar("SELECT COUNT(*) FROM idem_outbox").await
        + behind.scalar("SELECT COUNT(*) FROM idem_outbox_aggregate").await
        > 0
    {
        assert!(start.elapsed() < Duration::from_secs(60), "the relay did not send and purge everything");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    task.await.expect("relay task");

    let received = broker.received(rows.len()).await;
    let distinct: BTreeSet<_> = received.iter().collect();
    let expected: BTreeSet<_> = rows.iter().map(|(id, _)| id).collect();
    assert_eq!(distinct, expected, "each event once");
    assert_eq!(received.len(), rows.len(), "no event twice");
    for (aggregate, ids) in &queued {
        let order: Vec<_> = received.iter().filter(|id| ids.contains(id)).cloned().collect();
        assert_eq!(&order, ids, "{aggregate} out of order");
    }
    broker.cleanup().await;
    behind.finish().await;
}

mod rabbit {
    use idempotency::amqp::lapin::options::{BasicGetOptions, QueueDeleteOptions};
    use idempotency::amqp::lapin::{Channel, Connection, ConnectionProperties};
    use idempotency::outbox::rabbit::RabbitPublisher;

    use super::*;

    pub(super) const URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

    pub(super) struct Rabbit {
        queue: String,
        channel: Channel,
    }

    impl Rabbit {
        pub(super) async fn new() -> Option<Self> {
            let conn =
                reach("rabbitmq", || async { Connection::connect(URL, ConnectionProperties::default()).await.ok() })
                    .await?;
            let channel = conn.create_channel().await.expect("channel");
            let queue = unique("pgb.ship");
            idempotency::amqp::declare_with_dead_letter(&channel, &queue).await.expect("declare");
            Some(Rabbit { queue, channel })
        }
    }

    impl Broker for Rabbit {
        type Publisher = RabbitPublisher;

        fn destination(&self) -> String {
            self.queue.clone()
        }

        async fn publisher(&self) -> RabbitPublisher {
            RabbitPublisher::new(URL)
        }

        async fn received(&self, expected: usize) -> Vec<String> {
            let mut ids = Vec::new();
            // All were confirmed before they were marked sent: the queue holds them.
            while let Some(got) = self
                .channel
                .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .expect("basic_get")
            {
                ids.push(got.delivery.properties.message_id().as_ref().expect("message id").to_string());
                assert!(ids.len() <= expected, "more messages than events");
            }
            ids
        }

        async fn cleanup(&self) {
            for queue in [self.queue.clone(), format!("{}.dlq", self.queue)] {
                let _ = self.channel.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await;
            }
        }
    }
}

mod nats {
    use idempotency::nats::async_nats::{self, jetstream};
    use idempotency::outbox::nats::NatsPublisher;

    use super::*;

    const URL: &str = "nats://127.0.0.1:4222";

    pub(super) struct Nats {
        client: async_nats::Client,
        js: jetstream::Context,
        stream: String,
        subject: String,
    }

    impl Nats {
        pub(super) async fn new() -> Option<Self> {
            let client = reach("nats", || async { async_nats::connect(URL).await.ok() }).await?;
            let js = jetstream::new(client.clone());
            let stream = unique("PGB").replace(['-', '.'], "_");
            let subject = format!("pgb.ship.{stream}");
            idempotency::nats::declare_with_dead_letter(&js, &stream, &[subject.as_str()]).await.expect("declare");
            Some(Nats { client, js, stream, subject })
        }
    }

    impl Broker for Nats {
        type Publisher = NatsPublisher;

        fn destination(&self) -> String {
            self.subject.clone()
        }

        async fn publisher(&self) -> NatsPublisher {
            NatsPublisher::new(self.client.clone())
        }

        async fn received(&self, expected: usize) -> Vec<String> {
            let stream = self.js.get_stream(&self.stream).await.expect("stream");
            let mut ids = Vec::new();
            for seq in 1..=expected as u64 + 1 {
                let Ok(message) = stream.get_raw_message(seq).await else { break };
                ids.push(message.headers.get("Nats-Msg-Id").expect("Nats-Msg-Id").as_str().to_owned());
            }
            ids
        }

        async fn cleanup(&self) {
            for stream in [self.stream.clone(), format!("{}_DEAD", self.stream)] {
                let _ = self.js.delete_stream(&stream).await;
            }
        }
    }
}

async fn outbox_to_rabbitmq(redis: bool) {
    let Some(broker) = rabbit::Rabbit::new().await else { return };
    outbox_through(broker, redis).await;
}

async fn outbox_to_nats(redis: bool) {
    let Some(broker) = nats::Nats::new().await else { return };
    outbox_through(broker, redis).await;
}

with_and_without_redis!(outbox_with_aggregates_relayed_to_rabbitmq_behind_pgbouncer, outbox_with_aggregates_relayed_to_rabbitmq_behind_pgbouncer_with_redis => outbox_to_rabbitmq);
with_and_without_redis!(outbox_with_aggregates_relayed_to_nats_behind_pgbouncer, outbox_with_aggregates_relayed_to_nats_behind_pgbouncer_with_redis => outbox_to_nats);

/// Records the key inside the caller's transaction.
#[idempotent(key = "<k>", ttl = "1h", biz = "pgb_join", join)]
async fn book(
    idem: &Idem<Postgres>,
    tx: &mut Transaction<'_, Postgres>,
    #[idem(skip)] runs: &AtomicUsize,
    k: String,
) -> Result<usize, TestError> {
    let run = runs.fetch_add(1, SeqCst) + 1;
    sqlx::query("INSERT INTO pgb_ledger (k, amount) VALUES ($1, 1)")
        .persistent(false)
        .bind(&k)
        .execute(&mut **tx)
        .await?;
    Ok(run)
}

/// `join` behind the pooler, 20 keys at once: each called in a transaction
/// the caller commits, then again in another; the body runs once per key,
/// the second call replays the first's result; one rolled back by its
/// caller leaves nothing, and runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn join_calls_behind_pgbouncer() {
    const KEYS: usize = 20;
    let Some(behind) = Behind::start().await else { return };
    let Some(idem) = behind.engine(false, true).await else { return };
    idem.migrate().await.expect("migrate");
    let runs = Arc::new(AtomicUsize::new(0));
    let prefix = unique("join");
    let tasks: Vec<_> = (0..KEYS)
        .map(|i| {
            let (idem, runs, k) = (idem.clone(), runs.clone(), format!("{prefix}-{i}"));
            tokio::spawn(async move {
                // Rolled back by its caller: nothing stays.
                let mut tx = idem.pool().begin().await.expect("begin");
                let (ran, outcome) = idempotency::observe(book(&idem, &mut tx, &runs, k.clone())).await;
                ran.expect("rolled-back call");
                assert_eq!(outcome, Some(Outcome::Executed));
                tx.rollback().await.expect("rollback");
                let mut tx = idem.pool().begin().await.expect("begin");
                let first = book(&idem, &mut tx, &runs, k.clone()).await.expect("first call");
                tx.commit().await.expect("commit");
                let mut tx = idem.pool().begin().await.expect("begin");
                let (again, outcome) = idempotency::observe(book(&idem, &mut tx, &runs, k.clone())).await;
                tx.commit().await.expect("commit");
                assert_eq!((again.expect("replay"), outcome), (first, Some(Outcome::Replayed)));
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("no task panics");
    }
    assert_eq!(runs.load(SeqCst), 2 * KEYS, "once rolled back, once committed, per key");
    assert_eq!(behind.scalar("SELECT COUNT(*) FROM pgb_ledger").await, KEYS as i64);
    assert_eq!(
        behind.scalar("SELECT COUNT(*) FROM idem_record WHERE biz_type = 'pgb_join' AND status = 1").await,
        KEYS as i64
    );
    behind.finish().await;
}
