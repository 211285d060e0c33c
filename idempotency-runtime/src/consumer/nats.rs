//! NATS JetStream consumers (feature `nats`, through [`async_nats`]): the
//! same contract as the RabbitMQ runner ([`amqp`](crate::amqp)): your
//! handler is called once per message, and the message is settled by what
//! the handler returned and the [`Outcome`](crate::Outcome) of the `#[idempotent]` call it
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
//! | `Err` whose error carries no `idempotency::Error` while the handler's last call answered with a recorded business error (a `record_errors` fn's declared error, executed now or replayed); or `Err` carrying `Error::Permanent` (a `steps` call's recorded failure) | ack, once ([`Action::AckRecorded`]): that error is the message's final answer, which a retry would only replay |
//! | `Err` carrying `Error::Storage` (the database failed or is down) | nak with delay [`Consumer::storage_delay`] |
//! | `Err` carrying `Error::StorageRefused` or `Error::NotMigrated` (a database failure that recurs) | a counted retry while the budget allows, then the dead letter |
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
//! The builder, the settlement contract and the loop are the consumer
//! core's ([`crate::consumer`]), shared with every transport; this module
//! holds what JetStream does differently (a delayed nak, the
//! server's delivery count, a dead letter copied by the runner).

use std::future::poll_fn;
use std::pin::Pin;
use std::time::Duration;

pub use async_nats;
use async_nats::HeaderMap;
use async_nats::jetstream::consumer::pull::MessagesErrorKind;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, AckKind, stream};
use futures_core::Stream;

use super::transport::{DeadLettered, Deliveries, Retried, Settle, Start, Transport};
pub use super::{Action, AsIdemError, Reason};

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

/// What JetStream tells of a message ([`Settled::delivery`](crate::consumer::Settled::delivery)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Delivered {
    /// JetStream's delivery count of the message (1 on the first).
    pub count: u64,
    /// The subject it came on.
    pub subject: String,
}

/// What the runner did with one message; passed to [`Consumer::on_settle`].
pub type Settled = super::Settled<Delivered>;

/// Consumes a JetStream stream through a durable pull consumer, calling a
/// handler per message and settling each by its outcome; see the
/// [module docs](self).
pub type Consumer = super::Consumer<Settings>;

/// What a JetStream runner reads from: a durable pull consumer of a
/// stream, and where its dead letters go.
#[derive(Debug)]
pub struct Settings {
    context: jetstream::Context,
    stream: String,
    durable: String,
    filter_subject: Option<String>,
    dead_letter_subject: String,
    ack_wait: Duration,
}

impl Consumer {
    /// A runner for the durable pull consumer `durable` of `stream` (created
    /// when absent, with explicit acks), dead-lettering to `dead.<stream>`.
    pub fn new(context: jetstream::Context, stream: impl Into<String>, durable: impl Into<String>) -> Self {
        let stream = stream.into();
        let settings = Settings {
            context,
            dead_letter_subject: format!("dead.{stream}"),
            stream,
            durable: durable.into(),
            filter_subject: None,
            ack_wait: Duration::from_secs(30),
        };
        super::Consumer::with(settings, 4)
    }

    /// Only the stream's messages on this subject (for a consumer created here).
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.transport.filter_subject = Some(subject.into());
        self
    }

    /// Where dead letters go. Default `dead.<stream>`.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.transport.dead_letter_subject = subject.into();
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
        // JetStream counts in nanoseconds, at most 2^63: `Duration::MAX` is a century.
        self.transport.ack_wait = crate::clock::bounded(wait);
        self
    }
}

impl Transport for Settings {
    type Error = async_nats::Error;
    type Delivered = Delivered;
}

impl Start for Settings {
    type Settle = Jet;
    type Deliveries = JetDeliveries;

    /// Creates (or finds) the durable consumer and starts pulling.
    async fn start(self, concurrency: usize) -> Result<(Jet, JetDeliveries), async_nats::Error> {
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
        let messages = consumer.stream().max_messages_per_batch(concurrency.max(1)).messages().await?;
        tracing::info!(stream = %self.stream, durable = %self.durable, "idem nats consumer started");
        let deliveries = JetDeliveries { messages: Some(messages), client: self.context.client() };
        let jet = Jet { context: self.context, stream: self.stream, dead_letter_subject: self.dead_letter_subject };
        Ok((jet, deliveries))
    }
}

/// The settling side: the JetStream context, and where dead letters go.
pub(crate) struct Jet {
    context: jetstream::Context,
    stream: String,
    dead_letter_subject: String,
}

impl Settle for Jet {
    type Delivery = jetstream::Message;
    type Error = async_nats::Error;
    type Delivered = Delivered;

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
        message.ack_with(AckKind::Nak(Some(crate::clock::bounded(delay)))).await
    }

    async fn retry(&self, message: &jetstream::Message, delay: Duration, _: u64) -> Retried<async_nats::Error> {
        Retried::Done(message.ack_with(AckKind::Nak(Some(crate::clock::bounded(delay)))).await)
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

    fn delivered(message: &jetstream::Message) -> Delivered {
        Delivered { count: delivered(message), subject: message.subject.to_string() }
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
pub(crate) struct JetDeliveries {
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
