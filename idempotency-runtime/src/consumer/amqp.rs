//! RabbitMQ consumers (feature `amqp`, through [`lapin`]): a small runner
//! that calls your handler once per delivery and settles the delivery by what
//! the handler returned and the [`Outcome`](crate::Outcome) of the `#[idempotent]` call it
//! made.
//!
//! ```ignore
//! # use idempotency::{Idem, idempotent};
//! # use sqlx::{Sqlite, Transaction};
//! #[derive(Debug)]
//! enum StockError { Idem(idempotency::Error), UnknownSku(String) }
//! # impl From<idempotency::Error> for StockError { fn from(e: idempotency::Error) -> Self { StockError::Idem(e) } }
//! // Lets the runner see an `idempotency::Error` inside (a database that is down is retried uncounted).
//! impl idempotency::amqp::AsIdemError for StockError {
//!     fn idem_error(&self) -> Option<&idempotency::Error> {
//!         match self { StockError::Idem(e) => Some(e), _ => None }
//!     }
//! }
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct OrderPaid { order_id: u64, sku: String, qty: i64 }
//!
//! #[idempotent(key = "order_paid_<event.order_id>", ttl = "7d", biz = "deduct_stock")]
//! async fn deduct_stock(idem: &Idem<Sqlite>, tx: &mut Transaction<'_, Sqlite>, event: OrderPaid)
//!     -> Result<(), StockError>
//! { /* UPDATE stock ... */ Ok(()) }
//!
//! # async fn demo(idem: Idem<Sqlite>, channel: lapin::Channel) -> Result<(), lapin::Error> {
//! idempotency::amqp::declare_with_dead_letter(&channel, "order.paid").await?;
//! idempotency::amqp::Consumer::new(channel, "order.paid")
//!     .max_retries(3)
//!     .run(tokio::signal::ctrl_c(), move |event: OrderPaid| {
//!         let idem = idem.clone();
//!         async move { deduct_stock(&idem, event).await }
//!     })
//!     .await
//! # }
//! ```
//!
//! How a delivery is settled. A handler's `Err` is judged by the
//! [`idempotency::Error`](crate::Error) it carries ([`AsIdemError`]); one that
//! carries none, by the [`Outcome`](crate::Outcome) of the last `#[idempotent]` call the
//! handler made.
//!
//! | what happened | settlement |
//! |---|---|
//! | the handler returned `Ok` (whatever the outcome of its calls: it handled them) | ack |
//! | `Err` whose error carries no `idempotency::Error` while the handler's last call answered with a recorded business error (a `record_errors` fn's declared error, executed now or replayed); or `Err` carrying `Error::Permanent` (a `steps` call's recorded failure) | ack, once ([`Action::AckRecorded`]): that error is the message's final answer, which a retry would only replay |
//! | `Err` carrying `Error::Storage` (the database failed or is down) | after [`Consumer::storage_delay`], nack with requeue; not counted as a retry |
//! | `Err` carrying `Error::StorageRefused` or `Error::NotMigrated` (a database failure that recurs) | a counted retry while the budget allows, then the dead letter |
//! | `Err` carrying `Error::InProgress`, or outcome `InProgress` (a duplicate is running elsewhere) | after [`Consumer::in_progress_delay`], nack with requeue; not counted as a retry |
//! | `Err` carrying any other `idempotency::Error` (`KeyReused`, `InvalidKey`, `Replay`, `Serialize`: the call can never succeed as sent), or outcome `KeyReused` or `Rejected` | reject without requeue: to the dead-letter queue |
//! | the payload does not deserialize into the handler's argument, or ([`Consumer::run_with_id`]) the message has no `message_id` (a poison message) | reject without requeue: to the dead-letter queue |
//! | any other `Err` (the body's own error; outcome `Failed`, `Executed`, `Replayed` or no call), or a panic | retry: after [`Consumer::retry_delay`], a copy with header `x-idem-retries` incremented is published to the queue and the original acked; once [`Consumer::max_retries`] retries are spent, reject to the dead-letter queue |
//! | a retry copy the broker refuses (nack: say a full queue with `x-overflow = reject-publish`), or whose publish fails while the channel stays open | the retry counts as spent; the next one is tried after [`Consumer::retry_delay`], and once none is left, reject to the dead-letter queue |
//!
//! Why a republished copy and not `nack(requeue)`: a requeued message keeps
//! its headers, so it cannot carry a retry count; and `x-delivery-count`
//! exists only on quorum queues. The copy goes to the default exchange with
//! the queue's name as routing key, so it reaches this queue only (not every
//! queue bound to the original exchange). The copy is confirmed by the broker
//! before the original is acked (the runner puts its channel in publisher
//! confirm mode); a crash in between leaves both, and the key makes the
//! duplicate harmless. A redelivery by the broker (a consumer that died
//! before acking) does not count as a retry.
//!
//! A database that is down is no fault of the message: its deliveries wait
//! and come back, uncounted, for as long as the outage lasts, rather than
//! spending their retries and ending in the dead-letter queue.
//!
//! A delivery waiting out a delay stays unacked, so it holds one prefetch
//! slot (prefetch = [`Consumer::concurrency`]) until it is settled.
//!
//! Dead-lettering uses the queue's own `x-dead-letter-exchange`: a queue
//! declared without one drops rejected messages.
//! [`declare_with_dead_letter`] declares the queue together with its
//! dead-letter exchange and queue.
//!
//! The builder, the settlement contract and the loop are the consumer
//! core's ([`crate::consumer`]), shared with every transport; this module
//! holds what RabbitMQ does differently (a retry is a republished copy
//! carrying its count; the broker dead-letters).

/// The RabbitMQ client the runner takes its [`Channel`] from, re-exported so the
/// versions match: `idempotency::amqp::lapin::Connection::connect(..)`.
pub use lapin;
use std::future::poll_fn;
use std::pin::Pin;
use std::time::Duration;

use futures_core::Stream;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    BasicRejectOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Confirmation, ExchangeKind};

use super::transport::{DeadLettered, Deliveries, Retried, Settle, Start, Transport};

/// The header carrying how many times a message was retried after a failure.
pub const RETRIES_HEADER: &str = "x-idem-retries";

pub use super::{Action, AsIdemError, Reason};

/// The names [`declare_with_dead_letter`] declared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The work queue, as given.
    pub queue: String,
    /// `<queue>.dlx`: a direct exchange, the queue's `x-dead-letter-exchange`.
    pub exchange: String,
    /// `<queue>.dlq`: where rejected messages of `queue` end up.
    pub dead_letter_queue: String,
}

/// Declares the durable `queue` with a dead-letter exchange `<queue>.dlx`
/// (direct, durable) and a durable dead-letter queue `<queue>.dlq` bound to
/// it with the routing key `<queue>`. Idempotent; fails (and the broker
/// closes the channel) if `queue` already exists with other arguments.
pub async fn declare_with_dead_letter(channel: &Channel, queue: &str) -> lapin::Result<DeadLetter> {
    let names = DeadLetter {
        queue: queue.to_owned(),
        exchange: format!("{queue}.dlx"),
        dead_letter_queue: format!("{queue}.dlq"),
    };
    let durable = ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() };
    channel
        .exchange_declare(names.exchange.as_str().into(), ExchangeKind::Direct, durable, FieldTable::default())
        .await?;
    channel
        .queue_declare(names.dead_letter_queue.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
        .await?;
    channel
        .queue_bind(
            names.dead_letter_queue.as_str().into(),
            names.exchange.as_str().into(),
            queue.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut args = FieldTable::default();
    args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(names.exchange.as_str().into()));
    args.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(queue.into()));
    channel.queue_declare(queue.into(), QueueDeclareOptions::durable(), args).await?;
    Ok(names)
}

/// What RabbitMQ tells of a delivery ([`Settled::delivery`](crate::consumer::Settled::delivery)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Delivered {
    /// The `x-idem-retries` the delivery carried (0 on the first attempt).
    pub retries: u32,
    /// Whether the broker flagged the delivery as redelivered.
    pub redelivered: bool,
}

/// What the runner did with one delivery; passed to [`Consumer::on_settle`].
pub type Settled = super::Settled<Delivered>;

/// Consumes one queue, calling a handler per delivery and settling each
/// delivery by its outcome; see the [module docs](self).
pub type Consumer = super::Consumer<Settings>;

/// What a RabbitMQ runner reads from: a channel and a queue.
#[derive(Debug)]
pub struct Settings {
    channel: Channel,
    queue: String,
}

impl Consumer {
    /// A runner for `queue` on `channel`. The channel is put into publisher
    /// confirm mode when the runner starts (retries are republished with
    /// confirms), and its prefetch is set to the concurrency.
    pub fn new(channel: Channel, queue: impl Into<String>) -> Self {
        super::Consumer::with(Settings { channel, queue: queue.into() }, 3)
    }

    /// How many times a failing delivery is retried before it is
    /// dead-lettered: `max_retries + 1` attempts in all. Default 3.
    pub fn max_retries(mut self, n: u32) -> Self {
        self.policy.bound = n.into();
        self
    }
}

impl Transport for Settings {
    type Error = lapin::Error;
    type Delivered = Delivered;
}

impl Start for Settings {
    type Settle = Rabbit;
    type Deliveries = RabbitDeliveries;

    /// Sets the channel up (confirms, prefetch) and starts consuming.
    async fn start(self, concurrency: usize) -> lapin::Result<(Rabbit, RabbitDeliveries)> {
        let channel = &self.channel;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        let prefetch = u16::try_from(concurrency).unwrap_or(u16::MAX);
        channel.basic_qos(prefetch, BasicQosOptions::default()).await?;
        let consumer = channel
            .basic_consume(
                self.queue.as_str().into(),
                ShortString::from(""),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        tracing::info!(queue = %self.queue, tag = %consumer.tag(), "idem consumer started");
        let deliveries = RabbitDeliveries { channel: self.channel.clone(), consumer };
        Ok((Rabbit { channel: self.channel, queue: self.queue }, deliveries))
    }
}

/// The settling side: one channel (in confirm mode) and its queue.
pub(crate) struct Rabbit {
    channel: Channel,
    queue: String,
}

impl Settle for Rabbit {
    type Delivery = Delivery;
    type Error = lapin::Error;
    type Delivered = Delivered;

    const NAME: &'static str = "amqp";
    const MESSAGE_ID: &'static str = "message_id property";
    const EXHAUSTED: Reason = Reason::RetriesExhausted;
    const METRIC: &'static str = crate::metrics::CONSUMER_SETTLEMENTS;
    const METRIC_SCOPE: &'static str = "queue";

    fn scope(&self) -> &str {
        &self.queue
    }

    fn payload(delivery: &Delivery) -> Result<&[u8], String> {
        Ok(&delivery.data)
    }

    fn message_id(delivery: &Delivery) -> Option<&str> {
        delivery.properties.message_id().as_ref().map(|id| id.as_str())
    }

    fn spent(delivery: &Delivery) -> u64 {
        retries_of(delivery).into()
    }

    async fn ack(&self, delivery: &Delivery) -> lapin::Result<()> {
        delivery.ack(BasicAckOptions::default()).await.map(drop)
    }

    /// Holds the delivery (unacked: it keeps its prefetch slot) for the
    /// delay, then nacks it with requeue.
    async fn requeue(&self, delivery: &Delivery, delay: Duration) -> lapin::Result<()> {
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        delivery.nack(BasicNackOptions { multiple: false, requeue: true }).await.map(drop)
    }

    /// After the delay, publishes a copy carrying `count` in its header and
    /// acks the original once the broker confirmed the copy.
    async fn retry(&self, delivery: &Delivery, delay: Duration, count: u64) -> Retried<lapin::Error> {
        tokio::time::sleep(delay).await;
        match self.republish(delivery, u32::try_from(count).unwrap_or(u32::MAX)).await {
            Ok(true) => Retried::Done(delivery.ack(BasicAckOptions::default()).await.map(drop)),
            Ok(false) => Retried::Refused("retry copy refused by the broker".to_owned()),
            Err(e) if self.channel.status().connected() => Retried::Refused(format!("retry copy not published: {e}")),
            Err(e) => Retried::Lost(e),
        }
    }

    /// Rejects without requeue: the queue's dead-letter exchange takes it.
    async fn dead_letter(&self, delivery: &Delivery, _: Reason, _: Option<&str>) -> DeadLettered<lapin::Error> {
        DeadLettered::Done(delivery.reject(BasicRejectOptions { requeue: false }).await.map(drop))
    }

    fn delivered(delivery: &Delivery) -> Delivered {
        Delivered { retries: retries_of(delivery), redelivered: delivery.redelivered }
    }
}

impl Rabbit {
    /// Publishes a copy of `delivery` to this queue with `retries` in its
    /// header; `Ok(true)` once the broker confirmed it. The copy goes to the
    /// default exchange with the queue's name as routing key: to this queue
    /// only, not to every queue bound to the original exchange.
    async fn republish(&self, delivery: &Delivery, retries: u32) -> lapin::Result<bool> {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        headers.insert(RETRIES_HEADER.into(), AMQPValue::LongUInt(retries));
        let properties = delivery.properties.clone().with_headers(headers);
        let confirm = self
            .channel
            .basic_publish(
                ShortString::from(""),
                self.queue.as_str().into(),
                BasicPublishOptions::default(),
                &delivery.data,
                properties,
            )
            .await?
            .await?;
        Ok(matches!(confirm, Confirmation::Ack(_)))
    }
}

/// The reading side: lapin's consumer, cancelled on shutdown (the
/// deliveries it still yields are then requeued by the core).
pub(crate) struct RabbitDeliveries {
    channel: Channel,
    consumer: lapin::Consumer,
}

impl Deliveries for RabbitDeliveries {
    type Delivery = Delivery;
    type Error = lapin::Error;

    async fn next(&mut self, _room: usize) -> Option<lapin::Result<Delivery>> {
        // The prefetch (the concurrency) already bounds what the broker sends.
        poll_fn(|cx| Pin::new(&mut self.consumer).poll_next(cx)).await
    }

    async fn stop(&mut self) -> lapin::Result<()> {
        self.channel.basic_cancel(self.consumer.tag(), BasicCancelOptions::default()).await
    }

    async fn finish(self) {}
}

/// The `x-idem-retries` header, 0 when absent or not a non-negative integer.
fn retries_of(delivery: &Delivery) -> u32 {
    let Some(value) = delivery.properties.headers().as_ref().and_then(|h| h.inner().get(RETRIES_HEADER)) else {
        return 0;
    };
    let n: i128 = match value {
        AMQPValue::ShortShortInt(v) => (*v).into(),
        AMQPValue::ShortShortUInt(v) => (*v).into(),
        AMQPValue::ShortInt(v) => (*v).into(),
        AMQPValue::ShortUInt(v) => (*v).into(),
        AMQPValue::LongInt(v) => (*v).into(),
        AMQPValue::LongUInt(v) => (*v).into(),
        AMQPValue::LongLongInt(v) => (*v).into(),
        _ => 0,
    };
    u32::try_from(n).unwrap_or(if n < 0 { 0 } else { u32::MAX })
}
