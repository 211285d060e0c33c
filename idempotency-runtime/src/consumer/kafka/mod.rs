//! Kafka consumers (feature `kafka`, through [`rdkafka`] 0.39, librdkafka
//! built from source and linked statically): one consumer of a consumer
//! group, your handler called once per message, and the message settled by
//! what the handler returned and the [`Outcome`](crate::Outcome) of the
//! `#[idempotent]` call it made: the same contract as the other runners, on
//! the same core and builder ([`crate::consumer`]).
//!
//! ```ignore
//! use idempotency::kafka::rdkafka::ClientConfig;
//! let mut config = ClientConfig::new();
//! config.set("bootstrap.servers", "127.0.0.1:9092");
//! idempotency::kafka::declare_with_dead_letter(&config, "order.paid", "stock", 6, 3).await?;
//! idempotency::kafka::Consumer::new(config, "order.paid", "stock")
//!     .concurrency(8)
//!     .max_retries(3)
//!     .run(tokio::signal::ctrl_c(), move |event: OrderPaid| {
//!         let idem = idem.clone();
//!         // #[idempotent(key = "order_paid_<event.order_id>", ...)]: business fields, never the offset
//!         async move { deduct_stock(&idem, event).await }
//!     })
//!     .await
//! ```
//!
//! The key comes from the event's business fields, or, with
//! [`Consumer::run_with_id`], from the message's [`MESSAGE_ID_HEADER`]
//! (the outbox relay to Kafka sets it to the event's id). Never from the
//! offset: a copy of one event produced again (a producer that retried, a
//! relay that crashed before marking it sent, a retry copy) has another.
//!
//! Kafka has no per-message acknowledgement: a group only commits, per
//! partition, the offset it resumes from. How each settlement maps:
//!
//! | what happened | settlement |
//! |---|---|
//! | the handler returned `Ok` (its call executed or replayed, or it dealt with the failure) | settled: the partition's offset is committed up to the lowest message not yet settled (never past one still running or waiting) |
//! | `Err` whose error carries no `idempotency::Error` while the handler's last call answered with a recorded business error (a `record_errors` fn's declared error, executed now or replayed); or `Err` carrying `Error::Permanent` (a `steps` call's recorded failure) | settled as an `Ok` is, once ([`Action::AckRecorded`]): that error is the message's final answer, which a retry would only replay |
//! | `Err` carrying `Error::Storage` (the database failed or is down) | held in the runner for [`Consumer::storage_delay`], then handled again; not counted, its offset not committed past, its key's later messages waiting |
//! | `Err` carrying `Error::InProgress`, or outcome `InProgress` | held for [`Consumer::in_progress_delay`] the same way, not counted |
//! | `Err` carrying `Error::StorageRefused` or `Error::NotMigrated` (a database failure that recurs) | as the body's own `Err` below: counted retries, then the dead letter |
//! | `Err` carrying `KeyReused`, `InvalidKey` or any other `idempotency::Error` but those, or outcome `KeyReused`/`Rejected`; a payload that does not deserialize (or, for [`Consumer::run_with_id`], no UTF-8 message id header); a header whose name is not UTF-8 | a copy to the dead-letter topic (its key, payload and headers, with [`DEAD_REASON_HEADER`], [`DEAD_ERROR_HEADER`], [`DEAD_TOPIC_HEADER`], [`DEAD_PARTITION_HEADER`], [`DEAD_OFFSET_HEADER`]), acknowledged by the broker, then settled |
//! | any other `Err` (the body's own), or a panic | after [`Consumer::retry_delay`], a copy to the retry topic with [`RETRIES_HEADER`] one higher, acknowledged by the broker, then settled; once [`Consumer::max_retries`] retries are spent, dead-lettered |
//! | a copy the broker does not take (retry) | the retry counts as spent, the next is tried |
//! | a dead-letter copy refused for its size | tried again at once without the payload, then as a pointer (the runner's headers only, [`DEAD_DROPPED_HEADER`] saying what is missing): logged and counted, then settled |
//! | a dead-letter copy the broker does not take for another reason | held and tried again after the retry delay (a dead letter is never lost) |
//! | taken but not started when the runner stops; held, or waiting out its retry, when its partition is revoked or the runner stops | not settled, not committed: the group's next owner of the partition gets it from the committed offset |
//!
//! **Order.** Messages of one key (the Kafka message key) in one partition
//! are handled one at a time, in offset order: a later one waits until the
//! earlier one settled, including while the earlier one waits out a delay.
//! Messages of other keys (and keyless ones) run beside them, up to
//! [`Consumer::concurrency`]. A message sent to the retry topic leaves that
//! order: its key's later messages go on while it waits for its retry.
//! Keeping it would stop the key, and the partition's commits, for the whole
//! retry budget, and keep the count only in memory (lost with the process,
//! so a message that kills its consumer would go round forever); the retry
//! topic keeps the count in the message, survives a crash, and lets the
//! partition go on. The retries of one key stay in order among themselves
//! (the copy keeps the key).
//!
//! **Topics.** The runner subscribes to the topic and to its retry topic
//! (default `<topic>.<group>.retry`: the group's own, so two groups on one
//! topic never handle each other's retries); dead letters go to
//! `<topic>.<group>.dead`. [`declare_with_dead_letter`] creates all three.
//! Copies are produced by an idempotent producer (`enable.idempotence`,
//! acknowledged by all in-sync replicas). [`RETRIES_HEADER`] is read on the
//! retry topic only: on the topic itself it is not the runner's (a
//! dead-letter copy replayed there gets its whole budget again).
//!
//! **Commits.** An offset counts as committed once the broker confirmed it;
//! a commit that failed is sent again with the partition's next settlement,
//! and at the latest on revocation or stop, which wait for the answer
//! ([`Consumer::commit_timeout`]).
//!
//! **Memory.** A task of the runner polls the consumer all the time
//! (heartbeats, rebalances and commit answers are served while handlers
//! run). Fetching pauses while the runner holds four messages per slot
//! that are not running (ready, behind their key, waiting out a delay or
//! their retry) and resumes at two; the pause is recounted on every
//! assignment change.
//!
//! **Rebalances.** Partitions are revoked and assigned in the group's
//! callbacks, served by the polling task. On a revocation the runner
//! commits what was settled of those partitions (nothing when librdkafka
//! reports them lost: the group moved on without this consumer), and
//! forgets what it held of them; a handler
//! still running on a revoked partition finishes, but its settlement
//! commits nothing (the partition is another consumer's now; an offset
//! committed by a former owner could move the group's offset back). The new
//! owner gets the message again from the committed offset, and its call
//! waits for the running one (`InProgress`, a delay) and replays it: one
//! execution.
//!
//! The runner sets on its consumer `group.id`, `enable.auto.commit=false`,
//! `enable.auto.offset.store=false`, and `auto.offset.reset=earliest`
//! unless the configuration sets it; everything else (brokers, security,
//! timeouts) comes from the [`ClientConfig`] given.
//!
//! **Records from any producer.** Header names are read as bytes (rdkafka's
//! own reading panics on one that is not UTF-8); such a message is poison.
//! A panic in the runner's polling task (the [`Consumer::on_event`] hook
//! runs there) ends [`Consumer::run`] with [`RunError::Panicked`].
//!
//! Tested against tansu 0.6, a Kafka-protocol broker (see the messaging
//! guide), not against Apache Kafka itself.

pub(crate) mod book;
mod commit;
mod error;
mod event;
pub(crate) mod headers;
pub(crate) mod reader;
pub(crate) mod settler;

use std::sync::Arc;
use std::time::Duration;

pub use rdkafka;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::FromClientConfigAndContext;
use rdkafka::consumer::Consumer as _;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::producer::FutureProducer;
use rdkafka::types::RDKafkaErrorCode;

pub use self::error::RunError;
pub use self::event::Event;
use self::reader::{Reader, Reading, Rebalancing, Shared};
use self::settler::Group;
use super::transport::{Start, Transport};
pub use super::{Action, AsIdemError, Reason};

/// The header the message id is read from ([`Consumer::run_with_id`]), unless
/// [`Consumer::message_id_header`] says otherwise; the outbox relay to Kafka
/// sets it to the event's id.
pub const MESSAGE_ID_HEADER: &str = "Idem-Message-Id";
/// The header carrying how many times a message was retried (a decimal
/// number; absent or not one: 0).
pub const RETRIES_HEADER: &str = "Idem-Retries";
/// On a dead-letter copy: why ([`Reason::as_str`]: `poison`, `key_reused`, ...).
pub const DEAD_REASON_HEADER: &str = "Idem-Dead-Reason";
/// On a dead-letter copy: the handler's error, or why the payload was refused.
pub const DEAD_ERROR_HEADER: &str = "Idem-Error";
/// On a dead-letter copy: the topic the message was in.
pub const DEAD_TOPIC_HEADER: &str = "Idem-Topic";
/// On a dead-letter copy: its partition there (decimal).
pub const DEAD_PARTITION_HEADER: &str = "Idem-Partition";
/// On a dead-letter copy: its offset there (decimal).
pub const DEAD_OFFSET_HEADER: &str = "Idem-Offset";
/// On a dead-letter copy stored without parts of the message (refused for
/// its size as a whole): what it lacks, `payload` or `key,payload,headers`.
pub const DEAD_DROPPED_HEADER: &str = "Idem-Dropped";

/// What Kafka tells of a message ([`Settled::delivery`](crate::consumer::Settled::delivery)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Delivered {
    /// The topic it was in: the topic, or the retry topic.
    pub topic: String,
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// The [`RETRIES_HEADER`] it carried (0 on a first attempt).
    pub retries: u64,
}

/// What the runner did with one message; passed to [`Consumer::on_settle`].
pub type Settled = super::Settled<Delivered>;

/// Consumes a Kafka topic as one consumer of a group, calling a handler per
/// message and settling each by its outcome; see the [module docs](self).
pub type Consumer = super::Consumer<Settings>;

/// What a Kafka runner reads from: the client configuration, the topic, the
/// group, its retry and dead-letter topics.
#[derive(Debug)]
pub struct Settings {
    config: ClientConfig,
    topic: String,
    group: String,
    retry_topic: String,
    dead_letter_topic: String,
    message_id_header: String,
    produce_timeout: Duration,
    commit_timeout: Duration,
    on_event: Option<event::Hook>,
}

/// The names [`declare_with_dead_letter`] created (or found).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The work topic, as given.
    pub topic: String,
    /// `<topic>.<group>.retry`: the group's retry topic.
    pub retry_topic: String,
    /// `<topic>.<group>.dead`: the group's dead-letter topic.
    pub dead_letter_topic: String,
}

/// The retry and dead-letter topics of `group` on `topic`.
fn names(topic: &str, group: &str) -> DeadLetter {
    DeadLetter {
        topic: topic.to_owned(),
        retry_topic: format!("{topic}.{group}.retry"),
        dead_letter_topic: format!("{topic}.{group}.dead"),
    }
}

/// Creates `topic` and `group`'s retry and dead-letter topics on it, each
/// with `partitions` partitions and `replication` replicas; topics that
/// exist already are kept as they are.
pub async fn declare_with_dead_letter(
    config: &ClientConfig,
    topic: &str,
    group: &str,
    partitions: i32,
    replication: i32,
) -> KafkaResult<DeadLetter> {
    let names = names(topic, group);
    let admin: AdminClient<DefaultClientContext> = config.create()?;
    let topics: Vec<NewTopic<'_>> = [&names.topic, &names.retry_topic, &names.dead_letter_topic]
        .into_iter()
        .map(|name| NewTopic::new(name, partitions, TopicReplication::Fixed(replication)))
        .collect();
    for created in admin.create_topics(&topics, &AdminOptions::new()).await? {
        match created {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => {
                tracing::warn!(topic = %name, error = %code, "idem kafka: topic not created");
                return Err(KafkaError::AdminOp(code));
            }
        }
    }
    Ok(names)
}

impl Consumer {
    /// A runner for `topic` as a consumer of `group`, on the brokers (and
    /// security settings) of `config`; retries go to
    /// `<topic>.<group>.retry`, dead letters to `<topic>.<group>.dead`.
    pub fn new(config: ClientConfig, topic: impl Into<String>, group: impl Into<String>) -> Self {
        let (topic, group) = (topic.into(), group.into());
        let names = names(&topic, &group);
        let settings = Settings {
            config,
            topic,
            group,
            retry_topic: names.retry_topic,
            dead_letter_topic: names.dead_letter_topic,
            message_id_header: MESSAGE_ID_HEADER.to_owned(),
            produce_timeout: Duration::from_secs(30),
            commit_timeout: Duration::from_secs(30),
            on_event: None,
        };
        super::Consumer::with(settings, 3)
    }

    /// How many times a failing message is retried before it is
    /// dead-lettered: `max_retries + 1` attempts in all. Default 3.
    pub fn max_retries(mut self, n: u32) -> Self {
        self.policy.bound = n.into();
        self
    }

    /// Where retry copies go (and are consumed from). Default `<topic>.<group>.retry`.
    pub fn retry_topic(mut self, topic: impl Into<String>) -> Self {
        self.transport.retry_topic = topic.into();
        self
    }

    /// Where dead letters go. Default `<topic>.<group>.dead`.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.transport.dead_letter_topic = topic.into();
        self
    }

    /// The header holding the message id ([`run_with_id`](Self::run_with_id)).
    /// Default [`MESSAGE_ID_HEADER`].
    pub fn message_id_header(mut self, name: impl Into<String>) -> Self {
        self.transport.message_id_header = name.into();
        self
    }

    /// How long a retry or dead-letter copy may wait for the broker's
    /// acknowledgement (librdkafka's `message.timeout.ms`). Default 30 s.
    pub fn produce_timeout(mut self, timeout: Duration) -> Self {
        self.transport.produce_timeout = timeout;
        self
    }

    /// How long the commit on a revocation, and the one when the runner
    /// stops, wait for the broker's answer (librdkafka's own wait has no
    /// bound: with the brokers gone, a stop would never return). What is
    /// not committed comes back to the partition's next owner. Default 30 s.
    pub fn commit_timeout(mut self, timeout: Duration) -> Self {
        self.transport.commit_timeout = timeout;
        self
    }

    /// Called with each [`Event`] of the runner's own: partitions assigned
    /// and revoked, commits confirmed or failed, fetching paused and
    /// resumed. Called on the task that polls the consumer: keep it short
    /// (the group's heartbeats wait for it). A panic in it ends
    /// [`run`](Self::run) with [`RunError::Panicked`].
    pub fn on_event(mut self, hook: impl Fn(&Event) + Send + Sync + 'static) -> Self {
        self.transport.on_event = Some(event::Hook(Arc::new(hook)));
        self
    }
}

impl Settings {
    /// The consumer's configuration: the given one, with the settings the
    /// runner relies on.
    fn consumer_config(&self) -> ClientConfig {
        let mut config = self.config.clone();
        config.set("group.id", &self.group);
        config.set("enable.auto.commit", "false");
        config.set("enable.auto.offset.store", "false");
        if config.get("auto.offset.reset").is_none() {
            config.set("auto.offset.reset", "earliest");
        }
        config
    }
}

/// The producer's configuration for retry and dead-letter copies (and the
/// outbox relay): the brokers and security settings of `config`, without a
/// consumer's, idempotent.
pub(crate) fn producer_config(config: &ClientConfig, timeout: Duration) -> ClientConfig {
    let mut config = config.clone();
    for consumer_only in [
        "group.id",
        "group.instance.id",
        "enable.auto.commit",
        "enable.auto.offset.store",
        "auto.offset.reset",
        "auto.commit.interval.ms",
        "session.timeout.ms",
        "max.poll.interval.ms",
        "partition.assignment.strategy",
    ] {
        config.remove(consumer_only);
    }
    config.set("enable.idempotence", "true");
    config.set("message.timeout.ms", timeout.as_millis().clamp(1, i32::MAX as u128).to_string());
    config
}

impl Transport for Settings {
    type Error = RunError;
    type Delivered = Delivered;
}

impl Start for Settings {
    type Settle = Group;
    type Deliveries = Reader;

    /// Joins the group on the topic and its retry topic, and starts polling.
    async fn start(self, concurrency: usize) -> Result<(Group, Reader), RunError> {
        let shared = Arc::new(Shared::new(concurrency.max(1), self.commit_timeout, self.on_event.clone()));
        let rebalancing = Rebalancing { shared: Arc::clone(&shared) };
        let consumer = Arc::new(reader::GroupConsumer::from_config_and_context(&self.consumer_config(), rebalancing)?);
        consumer.subscribe(&[&self.topic, &self.retry_topic])?;
        let producer: FutureProducer = producer_config(&self.config, self.produce_timeout).create()?;
        tracing::info!(topic = %self.topic, group = %self.group, "idem kafka consumer started");
        let reading = Reading {
            message_id_header: self.message_id_header,
            retries_header: RETRIES_HEADER.to_owned(),
            retry_topic: self.retry_topic.clone(),
        };
        let reader = Reader::new(Arc::clone(&consumer), Arc::clone(&shared), reading);
        let group = Group {
            consumer,
            producer,
            shared,
            topic: self.topic,
            retry_topic: self.retry_topic,
            dead_letter_topic: self.dead_letter_topic,
            retries_header: RETRIES_HEADER.to_owned(),
            produce_timeout: self.produce_timeout,
        };
        Ok((group, reader))
    }
}
