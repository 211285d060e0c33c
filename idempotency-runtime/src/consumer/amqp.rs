//! RabbitMQ consumers (feature `amqp`, through [`lapin`]): a small runner
//! that calls your handler once per delivery and settles the delivery by what
//! the handler returned and the [`Outcome`] of the `#[idempotent]` call it
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
//! carries none, by the [`Outcome`] of the last `#[idempotent]` call the
//! handler made.
//!
//! | what happened | settlement |
//! |---|---|
//! | the handler returned `Ok` (whatever the outcome of its calls: it handled them) | ack |
//! | `Err` carrying `Error::Storage` (the database failed or is down) | after [`Consumer::storage_delay`], nack with requeue; not counted as a retry |
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
//! The settlement contract and the loop are the consumer core's, shared
//! with [`nats`](crate::nats) and [`redis_streams`](crate::redis_streams);
//! this module holds what RabbitMQ does differently (a retry is a
//! republished copy carrying its count; the broker dead-letters).

/// The RabbitMQ client the runner takes its [`Channel`](lapin::Channel) from, re-exported so the
/// versions match: `idempotency::amqp::lapin::Connection::connect(..)`.
pub use lapin;
use std::fmt::Debug;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_core::Stream;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    BasicRejectOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Confirmation, ExchangeKind};
use serde::de::DeserializeOwned;

use super::decode::{message_id_and_payload, payload};
use super::run::{Runner, run};
use super::settle::Policy;
use super::{DeadLettered, Deliveries, Retried, Settlement, Transport};
use crate::outcome::Outcome;

/// The header carrying how many times a message was retried after a failure.
pub const RETRIES_HEADER: &str = "x-idem-retries";

pub use super::{AsIdemError, Reason};

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

/// How a delivery was settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Acked: the handler returned `Ok` (its call executed or replayed, or
    /// it dealt with the failure itself).
    Ack,
    /// Nacked with requeue, not counted as a retry: after
    /// [`Consumer::in_progress_delay`] when a duplicate was running (outcome
    /// `InProgress`), after [`Consumer::storage_delay`] when the database
    /// failed (`Error::Storage`).
    Requeue,
    /// Republished with `x-idem-retries` = `retries` after
    /// [`Consumer::retry_delay`], original acked.
    Retry {
        /// The retry count the copy carries.
        retries: u32,
    },
    /// Rejected without requeue, to the queue's dead-letter exchange.
    DeadLetter(Reason),
    /// Back to the queue unsettled by the handler: nacked with requeue
    /// because the runner was stopping, or left for the broker to redeliver
    /// because the channel closed before the delivery could be settled.
    Returned,
}

/// What the runner did with one delivery; passed to [`Consumer::on_settle`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Settled {
    /// The outcome of the last `#[idempotent]` call the handler made, if any.
    pub outcome: Option<Outcome>,
    /// The settlement.
    pub action: Action,
    /// The `x-idem-retries` the delivery carried (0 on the first attempt).
    pub retries: u32,
    /// Whether the broker flagged the delivery as redelivered.
    pub redelivered: bool,
    /// The message's `message_id` property, if set.
    pub message_id: Option<String>,
    /// The handler's error or panic, or why the payload was refused, as text.
    pub error: Option<String>,
}

/// Consumes one queue, calling a handler per delivery and settling each
/// delivery by its outcome; see the [module docs](self).
#[must_use]
pub struct Consumer {
    channel: Channel,
    queue: String,
    concurrency: u16,
    policy: Policy,
    on_settle: Option<super::run::Hook<Settled>>,
}

impl Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("queue", &self.queue)
            .field("concurrency", &self.concurrency)
            .field("max_retries", &self.policy.bound)
            .field("retry_delay", &self.policy.retry_delay)
            .field("in_progress_delay", &self.policy.in_progress_delay)
            .field("storage_delay", &self.policy.storage_delay)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// A runner for `queue` on `channel`. The channel is put into publisher
    /// confirm mode when the runner starts (retries are republished with
    /// confirms), and its prefetch is set to the concurrency.
    pub fn new(channel: Channel, queue: impl Into<String>) -> Self {
        let second = Duration::from_secs(1);
        Self {
            channel,
            queue: queue.into(),
            concurrency: 1,
            policy: Policy { bound: 3, retry_delay: second, in_progress_delay: second, storage_delay: second },
            on_settle: None,
        }
    }

    /// How many deliveries are handled at once (and the channel's prefetch).
    /// Default 1: one at a time, in order.
    pub fn concurrency(mut self, n: u16) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// How many times a failing delivery is retried before it is
    /// dead-lettered: `max_retries + 1` attempts in all. Default 3.
    pub fn max_retries(mut self, n: u32) -> Self {
        self.policy.bound = n.into();
        self
    }

    /// How long a failed delivery waits before its retry is published.
    /// Default 1 s.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.policy.retry_delay = delay;
        self
    }

    /// How long a delivery whose key is in progress elsewhere waits before it
    /// is requeued. Default 1 s.
    pub fn in_progress_delay(mut self, delay: Duration) -> Self {
        self.policy.in_progress_delay = delay;
        self
    }

    /// How long a delivery whose handler failed with `Error::Storage` (the
    /// database failed or is down) waits before it is requeued, uncounted.
    /// Default 1 s.
    pub fn storage_delay(mut self, delay: Duration) -> Self {
        self.policy.storage_delay = delay;
        self
    }

    /// Called after each delivery is settled (for logs, metrics, tests).
    pub fn on_settle(mut self, hook: impl Fn(&Settled) + Send + Sync + 'static) -> Self {
        self.on_settle = Some(Arc::new(hook));
        self
    }

    /// Consumes until `shutdown` resolves (or the channel fails), calling
    /// `handler` with each payload deserialized from JSON into `T`.
    ///
    /// The handler's error tells the runner, through [`AsIdemError`], whether
    /// the database was down; see the [settlement table](self).
    ///
    /// On shutdown the consumer is cancelled, deliveries not yet handled are
    /// requeued, and the runner waits for the ones being handled (including
    /// their delays) to be settled. Returns the channel's error if it failed.
    pub async fn run<T, F, Fut, R, E, S>(self, shutdown: S, handler: F) -> lapin::Result<()>
    where
        T: DeserializeOwned + Send + 'static,
        F: Fn(T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
        R: Send + 'static,
        E: AsIdemError + Debug + Send + 'static,
        S: Future,
    {
        self.consume(shutdown, payload::<Rabbit, T>, handler).await
    }

    /// Like [`run`](Consumer::run), handing the handler the message's
    /// `message_id` property too, so it can key its call by the message
    /// rather than by business fields (the outbox relay sets it to the
    /// event's id: `#[idempotent(key = "<message_id>", ...)]`). A delivery
    /// without a `message_id` is poison: dead-lettered unhandled.
    pub async fn run_with_id<T, F, Fut, R, E, S>(self, shutdown: S, handler: F) -> lapin::Result<()>
    where
        T: DeserializeOwned + Send + 'static,
        F: Fn(String, T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
        R: Send + 'static,
        E: AsIdemError + Debug + Send + 'static,
        S: Future,
    {
        let handler = move |(id, message)| handler(id, message);
        self.consume(shutdown, message_id_and_payload::<Rabbit, T>, handler).await
    }

    /// Sets the channel up (confirms, prefetch), starts consuming and hands
    /// the deliveries to the core's loop.
    async fn consume<I, F, Fut, R, E, S>(
        self,
        shutdown: S,
        decode: fn(&Delivery) -> Result<I, String>,
        handler: F,
    ) -> lapin::Result<()>
    where
        I: Send + 'static,
        F: Fn(I) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
        R: Send + 'static,
        E: AsIdemError + Debug + Send + 'static,
        S: Future,
    {
        let channel = &self.channel;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        channel.basic_qos(self.concurrency, BasicQosOptions::default()).await?;
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
        let runner = Runner {
            transport: Rabbit { channel: self.channel, queue: self.queue },
            policy: self.policy,
            concurrency: usize::from(self.concurrency),
            on_settle: self.on_settle,
        };
        run(runner, deliveries, shutdown, decode, handler).await
    }
}

/// The settling side: one channel (in confirm mode) and its queue.
pub(crate) struct Rabbit {
    channel: Channel,
    queue: String,
}

impl Transport for Rabbit {
    type Delivery = Delivery;
    type Error = lapin::Error;
    type Settled = Settled;

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

    fn settled(
        delivery: &Delivery,
        outcome: Option<Outcome>,
        settlement: Settlement,
        error: Option<String>,
    ) -> Settled {
        let action = match settlement {
            Settlement::Ack => Action::Ack,
            Settlement::Requeue => Action::Requeue,
            Settlement::Retry { count } => Action::Retry { retries: u32::try_from(count).unwrap_or(u32::MAX) },
            Settlement::DeadLetter(reason) => Action::DeadLetter(reason),
            Settlement::Returned => Action::Returned,
        };
        Settled {
            outcome,
            action,
            retries: retries_of(delivery),
            redelivered: delivery.redelivered,
            message_id: Self::message_id(delivery).map(str::to_owned),
            error,
        }
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
struct RabbitDeliveries {
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
