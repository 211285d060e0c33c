//! NATS JetStream consumers (feature `nats`, through [`async_nats`]): the
//! same contract as the RabbitMQ runner ([`amqp`](crate::amqp)): your
//! handler is called once per message, and the message is settled by what
//! the handler returned and the [`Outcome`] of the `#[idempotent]` call it
//! made.
//!
//! ```ignore
//! let js = idempotency::nats::async_nats::jetstream::new(client);
//! idempotency::nats::declare_with_dead_letter(&js, "ORDERS", &["order.paid"]).await?;
//! idempotency::nats::Consumer::new(js, "ORDERS", "stock")
//!     .max_deliver(4)
//!     .run_with_id(tokio::signal::ctrl_c(), move |message_id: String, event: OrderPaid| {
//!         let idem = idem.clone();
//!         // #[idempotent(key = "<message_id>", ...)]: the relay's Nats-Msg-Id.
//!         async move { deduct_stock(&idem, message_id, event).await }
//!     })
//!     .await
//! ```
//!
//! How a message is settled (a handler's `Err` is judged by the
//! [`idempotency::Error`](crate::Error) it carries, through [`AsIdemError`], else
//! by the outcome of its last `#[idempotent]` call):
//!
//! | what happened | settlement |
//! |---|---|
//! | the handler returned `Ok` (its call executed or replayed, or it dealt with the failure) | ack |
//! | `Err` carrying `Error::Storage` (the database failed or is down) | nak with delay [`Consumer::storage_delay`] |
//! | `Err` carrying `Error::InProgress`, or outcome `InProgress` | nak with delay [`Consumer::in_progress_delay`] |
//! | `Err` carrying `KeyReused`, `InvalidKey` or any other `idempotency::Error` but those two, or outcome `KeyReused`/`Rejected`; a payload that does not deserialize (or, for [`Consumer::run_with_id`], no `Nats-Msg-Id`) | a copy to the dead-letter subject, then terminate (`+TERM`) |
//! | any other `Err` (the body's own), or a panic | nak with delay [`Consumer::retry_delay`], until the message's delivery count reaches [`Consumer::max_deliver`]; then dead-letter and terminate |
//!
//! Unlike the RabbitMQ runner, the count is JetStream's own delivery
//! count: a redelivery after a consumer died, and a nak for a call in
//! progress or a database that is down, count too (JetStream has no other
//! place to keep a count; the runner sets the consumer's own
//! `max_deliver` to unlimited, so the server never drops a message
//! silently: the runner decides, and dead-letters). A message is naked
//! with a delay rather than held: it holds no slot of [`Consumer::concurrency`]
//! while it waits.
//!
//! The dead-letter copy carries the message's payload and headers
//! (`Nats-Msg-Id` included, so a copy published twice is kept once) and
//! `Idem-Dead-Reason`, `Idem-Subject` and `Idem-Error`. It is published
//! through JetStream and acknowledged before the message is terminated;
//! if that fails, the message is naked and tried again later: a dead
//! letter is never lost. The dead-letter subject must belong to a stream:
//! [`declare_with_dead_letter`] declares both.
//!
//! The settlement contract and the loop are the consumer core's, shared
//! with [`amqp`](crate::amqp) and [`redis_streams`](crate::redis_streams);
//! this module holds what JetStream does differently (a delayed nak, the
//! server's delivery count, a dead letter copied by the runner).

use std::fmt::Debug;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

pub use async_nats;
use async_nats::HeaderMap;
use async_nats::jetstream::consumer::pull::MessagesErrorKind;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, AckKind, stream};
use futures_core::Stream;
use serde::de::DeserializeOwned;

use super::decode::{message_id_and_payload, payload};
use super::run::{Hook, Runner, run};
use super::settle::Policy;
pub use super::{AsIdemError, Reason};
use super::{DeadLettered, Deliveries, Retried, Settlement, Transport};
use crate::outcome::Outcome;

/// The header JetStream deduplicates on; the outbox relay sets it to the
/// event's id.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";
/// On a dead-letter copy: why ([`Reason`], as `poison`, `key_reused`, ...).
pub const DEAD_REASON_HEADER: &str = "Idem-Dead-Reason";
/// On a dead-letter copy: the subject the message had.
pub const SUBJECT_HEADER: &str = "Idem-Subject";
/// On a dead-letter copy: the handler's error, or why the payload was refused.
pub const ERROR_HEADER: &str = "Idem-Error";

/// The names [`declare_with_dead_letter`] declared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The work stream, as given.
    pub stream: String,
    /// `<stream>_DEAD`: the stream that keeps dead letters.
    pub dead_letter_stream: String,
    /// `dead.<stream>`: its subject, the runner's default dead-letter subject.
    pub dead_letter_subject: String,
}

/// Declares (or finds) the stream `stream` on `subjects`, and its
/// dead-letter stream `<stream>_DEAD` on the subject `dead.<stream>`.
/// File storage, the server's default duplicate window (2 minutes).
pub async fn declare_with_dead_letter(
    context: &jetstream::Context,
    stream: &str,
    subjects: &[&str],
) -> Result<DeadLetter, async_nats::Error> {
    let names = DeadLetter {
        stream: stream.to_owned(),
        dead_letter_stream: format!("{stream}_DEAD"),
        dead_letter_subject: format!("dead.{stream}"),
    };
    context
        .get_or_create_stream(stream::Config {
            name: names.stream.clone(),
            subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
            ..stream::Config::default()
        })
        .await?;
    context
        .get_or_create_stream(stream::Config {
            name: names.dead_letter_stream.clone(),
            subjects: vec![names.dead_letter_subject.clone()],
            ..stream::Config::default()
        })
        .await?;
    Ok(names)
}

/// How a message was settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Acked: the handler returned `Ok`.
    Ack,
    /// Naked with a delay, to come back: a call in progress elsewhere, or
    /// the database down.
    Requeue,
    /// Naked with [`Consumer::retry_delay`] after a failure; the delivery
    /// count it had.
    Retry {
        /// JetStream's delivery count of the message (1 on the first).
        delivered: u64,
    },
    /// Copied to the dead-letter subject and terminated.
    DeadLetter(Reason),
    /// Left for JetStream to deliver again: the dead-letter copy or the
    /// settlement could not be sent.
    Returned,
}

/// What the runner did with one message; passed to [`Consumer::on_settle`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Settled {
    /// The outcome of the last `#[idempotent]` call the handler made, if any.
    pub outcome: Option<Outcome>,
    /// The settlement.
    pub action: Action,
    /// JetStream's delivery count of the message (1 on the first).
    pub delivered: u64,
    /// The subject it came on.
    pub subject: String,
    /// Its `Nats-Msg-Id`, if set.
    pub message_id: Option<String>,
    /// The handler's error or panic, or why the payload was refused.
    pub error: Option<String>,
}

/// Consumes a JetStream stream through a durable pull consumer, calling a
/// handler per message and settling each by its outcome; see the
/// [module docs](self).
#[must_use]
pub struct Consumer {
    context: jetstream::Context,
    stream: String,
    durable: String,
    filter_subject: Option<String>,
    dead_letter_subject: String,
    concurrency: usize,
    ack_wait: Duration,
    policy: Policy,
    on_settle: Option<Hook<Settled>>,
}

impl Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("filter_subject", &self.filter_subject)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .field("concurrency", &self.concurrency)
            .field("max_deliver", &self.policy.bound)
            .field("ack_wait", &self.ack_wait)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// A runner for the durable pull consumer `durable` of `stream` (created
    /// when absent, with explicit acks), dead-lettering to `dead.<stream>`.
    pub fn new(context: jetstream::Context, stream: impl Into<String>, durable: impl Into<String>) -> Self {
        let stream = stream.into();
        let second = Duration::from_secs(1);
        Consumer {
            context,
            dead_letter_subject: format!("dead.{stream}"),
            stream,
            durable: durable.into(),
            filter_subject: None,
            concurrency: 1,
            ack_wait: Duration::from_secs(30),
            policy: Policy { bound: 4, retry_delay: second, in_progress_delay: second, storage_delay: second },
            on_settle: None,
        }
    }

    /// Only the stream's messages on this subject (for a consumer created here).
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subject = Some(subject.into());
        self
    }

    /// Where dead letters go. Default `dead.<stream>`.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = subject.into();
        self
    }

    /// How many messages are handled at once. Default 1: one at a time, in order.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// At which delivery a failing message is dead-lettered instead of
    /// naked (at least 1). Default 4: the first delivery and three more.
    pub fn max_deliver(mut self, n: u64) -> Self {
        self.policy.bound = n.max(1);
        self
    }

    /// How long JetStream waits for a settlement before it delivers the
    /// message again (for a consumer created here). Default 30 s; keep it
    /// above the handler's longest run.
    pub fn ack_wait(mut self, wait: Duration) -> Self {
        self.ack_wait = wait;
        self
    }

    /// The nak delay after a failure. Default 1 s.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.policy.retry_delay = delay;
        self
    }

    /// The nak delay when the key is in progress elsewhere. Default 1 s.
    pub fn in_progress_delay(mut self, delay: Duration) -> Self {
        self.policy.in_progress_delay = delay;
        self
    }

    /// The nak delay when the database failed (`Error::Storage`). Default 1 s.
    pub fn storage_delay(mut self, delay: Duration) -> Self {
        self.policy.storage_delay = delay;
        self
    }

    /// Called after each message is settled (for logs, metrics, tests).
    pub fn on_settle(mut self, hook: impl Fn(&Settled) + Send + Sync + 'static) -> Self {
        self.on_settle = Some(Arc::new(hook));
        self
    }

    /// Consumes until `shutdown` resolves (or the consumer fails), calling
    /// `handler` with each payload deserialized from JSON into `T`. On
    /// shutdown no new message is taken, and the runner waits for the ones
    /// being handled to be settled.
    pub async fn run<T, F, Fut, R, E, S>(self, shutdown: S, handler: F) -> Result<(), async_nats::Error>
    where
        T: DeserializeOwned + Send + 'static,
        F: Fn(T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
        R: Send + 'static,
        E: AsIdemError + Debug + Send + 'static,
        S: Future,
    {
        self.consume(shutdown, payload::<Jet, T>, handler).await
    }

    /// Like [`run`](Consumer::run), handing the handler the message's
    /// `Nats-Msg-Id` too, so it can key its call by the message rather than
    /// by business fields (`#[idempotent(key = "<message_id>", ...)]`). A
    /// message without one is poison: dead-lettered unhandled.
    pub async fn run_with_id<T, F, Fut, R, E, S>(self, shutdown: S, handler: F) -> Result<(), async_nats::Error>
    where
        T: DeserializeOwned + Send + 'static,
        F: Fn(String, T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
        R: Send + 'static,
        E: AsIdemError + Debug + Send + 'static,
        S: Future,
    {
        let handler = move |(id, message)| handler(id, message);
        self.consume(shutdown, message_id_and_payload::<Jet, T>, handler).await
    }

    async fn consume<I, F, Fut, R, E, S>(
        self,
        shutdown: S,
        decode: fn(&jetstream::Message) -> Result<I, String>,
        handler: F,
    ) -> Result<(), async_nats::Error>
    where
        I: Send + 'static,
        F: Fn(I) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
        R: Send + 'static,
        E: AsIdemError + Debug + Send + 'static,
        S: Future,
    {
        let stream = self.context.get_stream(&self.stream).await?;
        let config = pull::Config {
            durable_name: Some(self.durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            // The runner counts and dead-letters; the server never drops.
            max_deliver: -1,
            filter_subject: self.filter_subject.clone().unwrap_or_default(),
            ..pull::Config::default()
        };
        let consumer: PullConsumer = stream.get_or_create_consumer(&self.durable, config).await?;
        let batch = self.concurrency.max(1);
        let messages = consumer.stream().max_messages_per_batch(batch).messages().await?;
        tracing::info!(stream = %self.stream, durable = %self.durable, "idem nats consumer started");
        let deliveries = JetDeliveries { messages: Some(messages), client: self.context.client() };
        let runner = Runner {
            transport: Jet {
                context: self.context,
                stream: self.stream,
                dead_letter_subject: self.dead_letter_subject,
            },
            policy: self.policy,
            concurrency: self.concurrency,
            on_settle: self.on_settle,
        };
        run(runner, deliveries, shutdown, decode, handler).await
    }
}

/// The settling side: the JetStream context, and where dead letters go.
pub(crate) struct Jet {
    context: jetstream::Context,
    stream: String,
    dead_letter_subject: String,
}

impl Transport for Jet {
    type Delivery = jetstream::Message;
    type Error = async_nats::Error;
    type Settled = Settled;

    const NAME: &'static str = "nats";
    const MESSAGE_ID: &'static str = "Nats-Msg-Id header";
    const EXHAUSTED: Reason = Reason::DeliveriesExhausted;
    const METRIC: &'static str = crate::metrics::NATS_SETTLEMENTS;
    const METRIC_SCOPE: &'static str = "stream";

    fn scope(&self) -> &str {
        &self.stream
    }

    fn payload(message: &jetstream::Message) -> Result<&[u8], String> {
        Ok(&message.payload)
    }

    fn message_id(message: &jetstream::Message) -> Option<&str> {
        message.headers.as_ref().and_then(|h| h.get(MSG_ID_HEADER)).map(|v| v.as_str())
    }

    /// JetStream's delivery count (1 on the first).
    fn spent(message: &jetstream::Message) -> u64 {
        delivered(message)
    }

    async fn ack(&self, message: &jetstream::Message) -> Result<(), async_nats::Error> {
        message.ack().await
    }

    /// A nak with the delay: the message holds no slot while it waits (the
    /// nak counts as a delivery, as JetStream counts every one).
    async fn requeue(&self, message: &jetstream::Message, delay: Duration) -> Result<(), async_nats::Error> {
        message.ack_with(AckKind::Nak(Some(delay))).await
    }

    async fn retry(&self, message: &jetstream::Message, delay: Duration, _: u64) -> Retried<async_nats::Error> {
        Retried::Done(message.ack_with(AckKind::Nak(Some(delay))).await)
    }

    /// A copy to the dead-letter subject, stored by JetStream, then `+TERM`.
    async fn dead_letter(
        &self,
        message: &jetstream::Message,
        reason: Reason,
        error: Option<&str>,
    ) -> DeadLettered<async_nats::Error> {
        match self.copy_to_dead_letters(message, reason, error).await {
            Ok(()) => DeadLettered::Done(message.ack_with(AckKind::Term).await),
            Err(e) => DeadLettered::NotStored(e),
        }
    }

    fn settled(
        message: &jetstream::Message,
        outcome: Option<Outcome>,
        settlement: Settlement,
        error: Option<String>,
    ) -> Settled {
        let delivered = delivered(message);
        let action = match settlement {
            Settlement::Ack => Action::Ack,
            Settlement::Requeue => Action::Requeue,
            Settlement::Retry { .. } => Action::Retry { delivered },
            Settlement::DeadLetter(reason) => Action::DeadLetter(reason),
            Settlement::Returned => Action::Returned,
        };
        Settled {
            outcome,
            action,
            delivered,
            subject: message.subject.to_string(),
            message_id: Self::message_id(message).map(str::to_owned),
            error,
        }
    }
}

impl Jet {
    /// Publishes the dead-letter copy and waits for JetStream to store it.
    async fn copy_to_dead_letters(
        &self,
        message: &jetstream::Message,
        reason: Reason,
        error: Option<&str>,
    ) -> Result<(), async_nats::Error> {
        let mut headers: HeaderMap = message.headers.clone().unwrap_or_default();
        headers.insert(DEAD_REASON_HEADER, reason.as_str());
        headers.insert(SUBJECT_HEADER, message.subject.as_str());
        if let Some(error) = error {
            // Header values are one line.
            let line: String = error.chars().filter(|c| !c.is_control()).take(1000).collect();
            headers.insert(ERROR_HEADER, line.as_str());
        }
        let ack = self
            .context
            .publish_with_headers(self.dead_letter_subject.clone(), headers, message.payload.clone())
            .await?;
        ack.await?;
        Ok(())
    }
}

/// JetStream's delivery count of `message` (1 on the first).
fn delivered(message: &jetstream::Message) -> u64 {
    message.info().map(|info| u64::try_from(info.delivered).unwrap_or(1)).unwrap_or(1)
}

/// The reading side: the pull consumer's message stream, dropped on
/// shutdown (nothing taken is left unstarted: a slot is free before each
/// pull); the client, to flush the acks at the end.
struct JetDeliveries {
    messages: Option<pull::Stream>,
    client: async_nats::Client,
}

impl Deliveries for JetDeliveries {
    type Delivery = jetstream::Message;
    type Error = async_nats::Error;

    async fn next(&mut self, _room: usize) -> Option<Result<jetstream::Message, async_nats::Error>> {
        let messages = self.messages.as_mut()?;
        loop {
            match poll_fn(|cx| Pin::new(&mut *messages).poll_next(cx)).await? {
                Ok(message) => return Some(Ok(message)),
                // Missed heartbeats and failed pulls pass; the stream retries.
                Err(e)
                    if matches!(
                        e.kind(),
                        MessagesErrorKind::ConsumerDeleted | MessagesErrorKind::PushBasedConsumer
                    ) =>
                {
                    return Some(Err(e.into()));
                }
                Err(e) => tracing::warn!(error = %e, "idem nats consumer: pull failed; retrying"),
            }
        }
    }

    async fn stop(&mut self) -> Result<(), async_nats::Error> {
        self.messages = None;
        Ok(())
    }

    async fn finish(self) {
        // Acks are buffered by the client: send them before returning.
        if let Err(e) = self.client.flush().await {
            tracing::warn!(error = %e, "idem nats consumer: flushing settlements failed");
        }
    }
}
