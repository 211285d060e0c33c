//! RabbitMQ consumers (feature `amqp`, through [`lapin`]): a small runner
//! that calls your handler once per delivery and settles the delivery by what
//! the handler returned and the [`Outcome`] of the `#[idempotent]` call it
//! made.
//!
//! ```ignore
//! # use idem::{Idem, idempotent};
//! # use sqlx::{Sqlite, Transaction};
//! #[derive(Debug)]
//! enum StockError { Idem(idem::Error), UnknownSku(String) }
//! # impl From<idem::Error> for StockError { fn from(e: idem::Error) -> Self { StockError::Idem(e) } }
//! // Lets the runner see an `idem::Error` inside (a database that is down is retried uncounted).
//! impl idem::amqp::AsIdemError for StockError {
//!     fn idem_error(&self) -> Option<&idem::Error> {
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
//! idem::amqp::declare_with_dead_letter(&channel, "order.paid").await?;
//! idem::amqp::Consumer::new(channel, "order.paid")
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
//! [`idem::Error`](crate::Error) it carries ([`AsIdemError`]); one that
//! carries none, by the [`Outcome`] of the last `#[idempotent]` call the
//! handler made.
//!
//! | what happened | settlement |
//! |---|---|
//! | the handler returned `Ok` (whatever the outcome of its calls: it handled them) | ack |
//! | `Err` carrying `Error::Storage` (the database failed or is down) | after [`Consumer::storage_delay`], nack with requeue; not counted as a retry |
//! | `Err` carrying `Error::InProgress`, or outcome `InProgress` (a duplicate is running elsewhere) | after [`Consumer::in_progress_delay`], nack with requeue; not counted as a retry |
//! | `Err` carrying any other `idem::Error` (`KeyReused`, `InvalidKey`, `Replay`, `Serialize`: the call can never succeed as sent), or outcome `KeyReused` or `Rejected` | reject without requeue: to the dead-letter queue |
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

use std::fmt::Debug;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::Poll;
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
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::error::Error;
use crate::outcome::{Outcome, observe};

/// The header carrying how many times a message was retried after a failure.
pub const RETRIES_HEADER: &str = "x-idem-retries";

pub use crate::consumer::AsIdemError;

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

/// Why a delivery was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reason {
    /// The payload did not deserialize into the handler's argument (or,
    /// for [`Consumer::run_with_id`], the message had no `message_id`).
    Poison,
    /// The key was already used with other arguments.
    KeyReused,
    /// Invalid key, unreplayable stored result, or unserializable argument.
    Rejected,
    /// Still failing after [`Consumer::max_retries`] retries (a retry copy
    /// the broker refused counts as one).
    RetriesExhausted,
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

type Hook = Arc<dyn Fn(&Settled) + Send + Sync>;

/// Consumes one queue, calling a handler per delivery and settling each
/// delivery by its outcome; see the [module docs](self).
#[must_use]
pub struct Consumer {
    channel: Channel,
    queue: String,
    concurrency: u16,
    max_retries: u32,
    retry_delay: Duration,
    in_progress_delay: Duration,
    storage_delay: Duration,
    on_settle: Option<Hook>,
}

impl Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("queue", &self.queue)
            .field("concurrency", &self.concurrency)
            .field("max_retries", &self.max_retries)
            .field("retry_delay", &self.retry_delay)
            .field("in_progress_delay", &self.in_progress_delay)
            .field("storage_delay", &self.storage_delay)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// A runner for `queue` on `channel`. The channel is put into publisher
    /// confirm mode when the runner starts (retries are republished with
    /// confirms), and its prefetch is set to the concurrency.
    pub fn new(channel: Channel, queue: impl Into<String>) -> Self {
        Self {
            channel,
            queue: queue.into(),
            concurrency: 1,
            max_retries: 3,
            retry_delay: Duration::from_secs(1),
            in_progress_delay: Duration::from_secs(1),
            storage_delay: Duration::from_secs(1),
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
        self.max_retries = n;
        self
    }

    /// How long a failed delivery waits before its retry is published.
    /// Default 1 s.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// How long a delivery whose key is in progress elsewhere waits before it
    /// is requeued. Default 1 s.
    pub fn in_progress_delay(mut self, delay: Duration) -> Self {
        self.in_progress_delay = delay;
        self
    }

    /// How long a delivery whose handler failed with `Error::Storage` (the
    /// database failed or is down) waits before it is requeued, uncounted.
    /// Default 1 s.
    pub fn storage_delay(mut self, delay: Duration) -> Self {
        self.storage_delay = delay;
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
        self.consume(shutdown, payload::<T>, handler).await
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
        self.consume(shutdown, message_id_and_payload::<T>, move |(id, message)| handler(id, message)).await
    }

    /// The runner: each delivery is decoded by `decode` (an `Err` is
    /// poison) and handed to `handler`.
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
        let mut consumer = channel
            .basic_consume(
                self.queue.as_str().into(),
                ShortString::from(""),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        tracing::info!(queue = %self.queue, tag = %consumer.tag(), "idem consumer started");

        let settings = Arc::new(Settings {
            channel: self.channel.clone(),
            queue: self.queue.clone(),
            max_retries: self.max_retries,
            retry_delay: self.retry_delay,
            in_progress_delay: self.in_progress_delay,
            storage_delay: self.storage_delay,
            on_settle: self.on_settle.clone(),
        });
        let handler = Arc::new(handler);
        let permits = Arc::new(Semaphore::new(usize::from(self.concurrency)));
        let mut tasks = JoinSet::new();
        let mut shutdown = pin!(shutdown);
        let mut stopping = false;
        let mut failure = None;

        loop {
            while let Some(joined) = tasks.try_join_next() {
                report_panic(joined);
            }
            let next = poll_fn(|cx| {
                if !stopping && shutdown.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(None);
                }
                Pin::new(&mut consumer).poll_next(cx).map(Some)
            })
            .await;
            let delivery = match next {
                None => {
                    stopping = true;
                    tracing::info!(queue = %self.queue, "idem consumer stopping");
                    if let Err(e) = channel.basic_cancel(consumer.tag(), BasicCancelOptions::default()).await {
                        failure = Some(e);
                        break;
                    }
                    continue;
                }
                Some(None) => break,
                Some(Some(Err(e))) => {
                    failure = Some(e);
                    break;
                }
                Some(Some(Ok(delivery))) => delivery,
            };
            if stopping {
                let settled = Settled::new(&delivery, None, Action::Returned, None);
                settle(&settings, delivery.nack(BasicNackOptions { multiple: false, requeue: true }).await, settled);
                continue;
            }
            let permit = Arc::clone(&permits).acquire_owned().await.expect("the semaphore is never closed");
            let settings = Arc::clone(&settings);
            let handler = Arc::clone(&handler);
            tasks.spawn(async move {
                handle(&settings, delivery, decode, handler, permit).await;
            });
        }
        while let Some(joined) = tasks.join_next().await {
            report_panic(joined);
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// A delivery's task ended by a panic of ours (a handler's own panic is
/// caught in its task and settled as a failure): say so rather than drop it.
fn report_panic(joined: Result<(), tokio::task::JoinError>) {
    if let Err(e) = joined {
        tracing::error!(error = %e, "idem consumer: a delivery's task panicked; it returns to the queue when the channel closes");
    }
}

/// What every delivery's task of one runner needs: the channel, the queue
/// and the settlement settings.
struct Settings {
    channel: Channel,
    queue: String,
    max_retries: u32,
    retry_delay: Duration,
    in_progress_delay: Duration,
    storage_delay: Duration,
    on_settle: Option<Hook>,
}

impl Settled {
    fn new(delivery: &Delivery, outcome: Option<Outcome>, action: Action, error: Option<String>) -> Self {
        Settled {
            outcome,
            action,
            retries: retries_of(delivery),
            redelivered: delivery.redelivered,
            message_id: delivery.properties.message_id().as_ref().map(|id| id.as_str().to_owned()),
            error,
        }
    }
}

/// What to do with a delivery, before doing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Ack,
    Requeue(Wait),
    Retry,
    DeadLetter(Reason),
}

/// Why a requeued delivery waits, and so for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    InProgress,
    Storage,
}

/// The settlement of a handler's result: `Ok`, or `Err` with the
/// `idem::Error` it carries; `outcome` is that of its last call.
fn verdict(result: Result<(), Option<&Error>>, outcome: Option<Outcome>) -> Verdict {
    let carried = match result {
        // The handler dealt with whatever its calls returned.
        Ok(()) => return Verdict::Ack,
        Err(carried) => carried,
    };
    match carried {
        Some(Error::Storage(_)) => Verdict::Requeue(Wait::Storage),
        Some(Error::InProgress { .. }) => Verdict::Requeue(Wait::InProgress),
        Some(Error::KeyReused { .. }) => Verdict::DeadLetter(Reason::KeyReused),
        // `InvalidKey`, `Replay`, `Serialize` and the like: the call can
        // never succeed as sent (the engine's `Outcome::Rejected`).
        Some(_) => Verdict::DeadLetter(Reason::Rejected),
        None => match outcome {
            Some(Outcome::InProgress) => Verdict::Requeue(Wait::InProgress),
            Some(Outcome::KeyReused) => Verdict::DeadLetter(Reason::KeyReused),
            Some(Outcome::Rejected) => Verdict::DeadLetter(Reason::Rejected),
            Some(Outcome::Failed | Outcome::Executed | Outcome::Replayed) | None => Verdict::Retry,
        },
    }
}

/// The payload as JSON.
fn payload<T: DeserializeOwned>(delivery: &Delivery) -> Result<T, String> {
    serde_json::from_slice(&delivery.data).map_err(|e| format!("payload: {e}"))
}

/// The `message_id` property and the payload as JSON.
pub(crate) fn message_id_and_payload<T: DeserializeOwned>(delivery: &Delivery) -> Result<(String, T), String> {
    let id = delivery.properties.message_id().as_ref().map(|id| id.as_str().to_owned());
    let id = id.ok_or_else(|| "no message_id property".to_owned())?;
    Ok((id, payload(delivery)?))
}

async fn handle<I, F, Fut, R, E>(
    settings: &Settings,
    delivery: Delivery,
    decode: fn(&Delivery) -> Result<I, String>,
    handler: Arc<F>,
    permit: tokio::sync::OwnedSemaphorePermit,
) where
    I: Send + 'static,
    F: Fn(I) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<R, E>> + Send + 'static,
    R: Send + 'static,
    E: AsIdemError + Debug + Send + 'static,
{
    let (verdict, outcome, error) = match decode(&delivery) {
        Err(e) => (Verdict::DeadLetter(Reason::Poison), None, Some(e)),
        Ok(message) => {
            // Its own task, so a panic in the handler (in the call itself or
            // in its future) becomes a failure instead of a delivery that is
            // never settled.
            let call = tokio::spawn(async move { observe(handler(message)).await });
            match call.await {
                Ok((Ok(_), outcome)) => (verdict(Ok(()), outcome), outcome, None),
                Ok((Err(e), outcome)) => (verdict(Err(e.idem_error()), outcome), outcome, Some(format!("{e:?}"))),
                Err(join) => (Verdict::Retry, None, Some(format!("handler panicked: {join}"))),
            }
        }
    };
    drop(permit);

    let (action, result) = match verdict {
        Verdict::Ack => (Action::Ack, delivery.ack(BasicAckOptions::default()).await),
        Verdict::DeadLetter(reason) => dead_letter(&delivery, reason).await,
        Verdict::Requeue(wait) => {
            tokio::time::sleep(match wait {
                Wait::InProgress => settings.in_progress_delay,
                Wait::Storage => settings.storage_delay,
            })
            .await;
            (Action::Requeue, delivery.nack(BasicNackOptions { multiple: false, requeue: true }).await)
        }
        Verdict::Retry => retry(settings, &delivery).await,
    };
    let settled = Settled::new(&delivery, outcome, action, error);
    settle(settings, result, settled);
}

async fn dead_letter(delivery: &Delivery, reason: Reason) -> (Action, lapin::Result<bool>) {
    (Action::DeadLetter(reason), delivery.reject(BasicRejectOptions { requeue: false }).await)
}

/// Republishes a copy carrying the next retry count and acks the original;
/// dead-letters it once its retries are spent. A copy the broker refuses
/// spends its retry too: given back uncounted, a message the queue cannot
/// take (it is full, with `reject-publish`) would go round forever.
async fn retry(settings: &Settings, delivery: &Delivery) -> (Action, lapin::Result<bool>) {
    let mut retries = retries_of(delivery);
    while retries < settings.max_retries {
        tokio::time::sleep(settings.retry_delay).await;
        retries += 1;
        match republish(settings, delivery, retries).await {
            Ok(true) => return (Action::Retry { retries }, delivery.ack(BasicAckOptions::default()).await),
            Ok(false) => {
                tracing::warn!(queue = %settings.queue, retries, "retry copy refused by the broker; the retry is spent");
            }
            Err(e) if settings.channel.status().connected() => {
                tracing::warn!(queue = %settings.queue, retries, error = %e, "retry copy not published; retry spent");
            }
            // The channel is gone, and the delivery with it: the broker
            // redelivers the message, with the count it had.
            Err(e) => return (Action::Returned, Err(e)),
        }
    }
    dead_letter(delivery, Reason::RetriesExhausted).await
}

/// Publishes a copy of `delivery` to this queue with `retries` in its header;
/// `Ok(true)` once the broker confirmed it.
async fn republish(settings: &Settings, delivery: &Delivery, retries: u32) -> lapin::Result<bool> {
    let mut headers = delivery.properties.headers().clone().unwrap_or_default();
    headers.insert(RETRIES_HEADER.into(), AMQPValue::LongUInt(retries));
    let properties = delivery.properties.clone().with_headers(headers);
    let confirm = settings
        .channel
        .basic_publish(
            ShortString::from(""),
            settings.queue.as_str().into(),
            BasicPublishOptions::default(),
            &delivery.data,
            properties,
        )
        .await?
        .await?;
    Ok(matches!(confirm, Confirmation::Ack(_)))
}

fn settle(settings: &Settings, result: lapin::Result<bool>, settled: Settled) {
    match result {
        Ok(_) => {
            tracing::debug!(queue = %settings.queue, action = ?settled.action, outcome = ?settled.outcome, "settled");
        }
        // The channel is gone: the broker redelivers the message.
        Err(e) => tracing::warn!(queue = %settings.queue, action = ?settled.action, error = %e, "settling failed"),
    }
    if let Some(action_error) = &settled.error {
        tracing::warn!(queue = %settings.queue, action = ?settled.action, error = %action_error, "delivery not done");
    }
    crate::metrics::consumer_settled(&settings.queue, settled.action);
    if let Some(hook) = &settings.on_settle {
        hook(&settled);
    }
}

/// The `x-idem-retries` header, 0 when absent or not a non-negative integer.
pub(crate) fn retries_of(delivery: &Delivery) -> u32 {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::KeyError;

    const EVERY_OUTCOME: [Option<Outcome>; 7] = [
        None,
        Some(Outcome::Executed),
        Some(Outcome::Replayed),
        Some(Outcome::InProgress),
        Some(Outcome::KeyReused),
        Some(Outcome::Rejected),
        Some(Outcome::Failed),
    ];

    fn json_error() -> serde_json::Error {
        serde_json::from_str::<u8>("x").unwrap_err()
    }

    #[test]
    fn a_handler_returning_ok_is_acked_whatever_its_calls_returned() {
        for outcome in EVERY_OUTCOME {
            assert_eq!(verdict(Ok(()), outcome), Verdict::Ack, "{outcome:?}");
        }
    }

    #[test]
    fn a_storage_error_is_requeued_uncounted_whatever_the_outcome() {
        let down = Error::Storage(sqlx::Error::PoolTimedOut);
        for outcome in EVERY_OUTCOME {
            assert_eq!(verdict(Err(Some(&down)), outcome), Verdict::Requeue(Wait::Storage), "{outcome:?}");
        }
    }

    #[test]
    fn a_carried_error_decides_before_the_outcome() {
        let in_progress = Error::InProgress { biz: "b", key: "k".into() };
        let reused = Error::KeyReused { biz: "b", key: "k".into() };
        let replay = Error::Replay { biz: "b", key: "k".into(), source: json_error() };
        let outcome = Some(Outcome::Failed);
        assert_eq!(verdict(Err(Some(&in_progress)), outcome), Verdict::Requeue(Wait::InProgress));
        assert_eq!(verdict(Err(Some(&reused)), outcome), Verdict::DeadLetter(Reason::KeyReused));
        for rejected in [Error::InvalidKey(KeyError::Missing), replay, Error::Serialize(json_error())] {
            assert_eq!(verdict(Err(Some(&rejected)), outcome), Verdict::DeadLetter(Reason::Rejected), "{rejected:?}");
        }
    }

    #[test]
    fn an_error_carrying_nothing_is_settled_by_the_outcome() {
        let expected = [
            Verdict::Retry,
            Verdict::Retry,
            Verdict::Retry,
            Verdict::Requeue(Wait::InProgress),
            Verdict::DeadLetter(Reason::KeyReused),
            Verdict::DeadLetter(Reason::Rejected),
            Verdict::Retry,
        ];
        for (outcome, expected) in EVERY_OUTCOME.into_iter().zip(expected) {
            assert_eq!(verdict(Err(None), outcome), expected, "{outcome:?}");
        }
    }

    #[test]
    fn a_boxed_error_finds_the_idem_error_in_its_source_chain() {
        #[derive(Debug)]
        struct Wrapper(Error);
        impl std::fmt::Display for Wrapper {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("wrapped")
            }
        }
        impl std::error::Error for Wrapper {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }

        let direct: Box<dyn std::error::Error + Send + Sync> = Box::new(Error::Storage(sqlx::Error::PoolTimedOut));
        assert!(matches!(direct.idem_error(), Some(Error::Storage(_))));
        let wrapped: Box<dyn std::error::Error + Send + Sync> =
            Box::new(Wrapper(Error::Storage(sqlx::Error::PoolTimedOut)));
        assert!(matches!(wrapped.idem_error(), Some(Error::Storage(_))));
        let other: Box<dyn std::error::Error + Send + Sync> = "no idem error here".into();
        assert!(other.idem_error().is_none());
    }
}
