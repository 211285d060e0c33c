//! NATS JetStream consumers (feature `nats`, through [`async_nats`]): the
//! same contract as the RabbitMQ runner ([`amqp`](crate::amqp)): your
//! handler is called once per message, and the message is settled by what
//! the handler returned and the [`Outcome`] of the `#[idempotent]` call it
//! made.
//!
//! ```ignore
//! let js = idem::nats::async_nats::jetstream::new(client);
//! idem::nats::declare_with_dead_letter(&js, "ORDERS", &["order.paid"]).await?;
//! idem::nats::Consumer::new(js, "ORDERS", "stock")
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
//! [`idem::Error`](crate::Error) it carries, through [`AsIdemError`], else
//! by the outcome of its last `#[idempotent]` call):
//!
//! | what happened | settlement |
//! |---|---|
//! | the handler returned `Ok` (its call executed or replayed, or it dealt with the failure) | ack |
//! | `Err` carrying `Error::Storage` (the database failed or is down) | nak with delay [`Consumer::storage_delay`] |
//! | `Err` carrying `Error::InProgress`, or outcome `InProgress` | nak with delay [`Consumer::in_progress_delay`] |
//! | `Err` carrying `KeyReused`, `InvalidKey` or any other `idem::Error` but those two, or outcome `KeyReused`/`Rejected`; a payload that does not deserialize (or, for [`Consumer::run_with_id`], no `Nats-Msg-Id`) | a copy to the dead-letter subject, then terminate (`+TERM`) |
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

use std::fmt::Debug;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

pub use async_nats;
use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, AckKind, stream};
use futures_core::Stream;
use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

pub use crate::consumer::AsIdemError;
use crate::error::Error;
use crate::outcome::{Outcome, observe};

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

/// Why a message was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reason {
    /// The payload did not deserialize into the handler's argument (or,
    /// for [`Consumer::run_with_id`], the message had no `Nats-Msg-Id`).
    Poison,
    /// The key was already used with other arguments.
    KeyReused,
    /// Invalid key, unreplayable stored result, or unserializable argument.
    Rejected,
    /// Still failing at its [`Consumer::max_deliver`]th delivery.
    DeliveriesExhausted,
}

impl Reason {
    /// The name in [`DEAD_REASON_HEADER`].
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Poison => "poison",
            Reason::KeyReused => "key_reused",
            Reason::Rejected => "rejected",
            Reason::DeliveriesExhausted => "deliveries_exhausted",
        }
    }
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

type Hook = Arc<dyn Fn(&Settled) + Send + Sync>;

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
    max_deliver: u64,
    ack_wait: Duration,
    retry_delay: Duration,
    in_progress_delay: Duration,
    storage_delay: Duration,
    on_settle: Option<Hook>,
}

impl Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("filter_subject", &self.filter_subject)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .field("concurrency", &self.concurrency)
            .field("max_deliver", &self.max_deliver)
            .field("ack_wait", &self.ack_wait)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// A runner for the durable pull consumer `durable` of `stream` (created
    /// when absent, with explicit acks), dead-lettering to `dead.<stream>`.
    pub fn new(context: jetstream::Context, stream: impl Into<String>, durable: impl Into<String>) -> Self {
        let stream = stream.into();
        Consumer {
            context,
            dead_letter_subject: format!("dead.{stream}"),
            stream,
            durable: durable.into(),
            filter_subject: None,
            concurrency: 1,
            max_deliver: 4,
            ack_wait: Duration::from_secs(30),
            retry_delay: Duration::from_secs(1),
            in_progress_delay: Duration::from_secs(1),
            storage_delay: Duration::from_secs(1),
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
        self.max_deliver = n.max(1);
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
        self.retry_delay = delay;
        self
    }

    /// The nak delay when the key is in progress elsewhere. Default 1 s.
    pub fn in_progress_delay(mut self, delay: Duration) -> Self {
        self.in_progress_delay = delay;
        self
    }

    /// The nak delay when the database failed (`Error::Storage`). Default 1 s.
    pub fn storage_delay(mut self, delay: Duration) -> Self {
        self.storage_delay = delay;
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
        self.consume(shutdown, payload::<T>, handler).await
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
        self.consume(shutdown, message_id_and_payload::<T>, move |(id, message)| handler(id, message)).await
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
        let mut messages = consumer.stream().max_messages_per_batch(batch).messages().await?;
        tracing::info!(stream = %self.stream, durable = %self.durable, "idem nats consumer started");

        let settings = Arc::new(Settings {
            stream: self.stream.clone(),
            context: self.context.clone(),
            dead_letter_subject: self.dead_letter_subject.clone(),
            max_deliver: self.max_deliver,
            retry_delay: self.retry_delay,
            in_progress_delay: self.in_progress_delay,
            storage_delay: self.storage_delay,
            on_settle: self.on_settle.clone(),
        });
        let handler = Arc::new(handler);
        let permits = Arc::new(Semaphore::new(self.concurrency));
        let mut tasks = JoinSet::new();
        let mut shutdown = pin!(shutdown);
        let mut failure = None;
        loop {
            while let Some(joined) = tasks.try_join_next() {
                report_panic(joined);
            }
            // A permit first: no message is taken that cannot start at once.
            let permit = {
                let acquire = pin!(Arc::clone(&permits).acquire_owned());
                let mut acquire = acquire;
                let got = poll_fn(|cx| {
                    if shutdown.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(None);
                    }
                    acquire.as_mut().poll(cx).map(Some)
                })
                .await;
                match got {
                    None => break,
                    Some(permit) => permit.expect("the semaphore is never closed"),
                }
            };
            let next = poll_fn(|cx| {
                if shutdown.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(None);
                }
                Pin::new(&mut messages).poll_next(cx).map(Some)
            })
            .await;
            let message = match next {
                None => break,
                Some(None) => break,
                Some(Some(Err(e))) => {
                    use async_nats::jetstream::consumer::pull::MessagesErrorKind as Kind;
                    // Missed heartbeats and failed pulls pass; the stream retries.
                    if matches!(e.kind(), Kind::ConsumerDeleted | Kind::PushBasedConsumer) {
                        failure = Some(e.into());
                        break;
                    }
                    tracing::warn!(error = %e, "idem nats consumer: pull failed; retrying");
                    continue;
                }
                Some(Some(Ok(message))) => message,
            };
            let settings = Arc::clone(&settings);
            let handler = Arc::clone(&handler);
            tasks.spawn(async move {
                handle(&settings, message, decode, handler, permit).await;
            });
        }
        tracing::info!(stream = %self.stream, durable = %self.durable, "idem nats consumer stopping");
        drop(messages);
        while let Some(joined) = tasks.join_next().await {
            report_panic(joined);
        }
        // Acks are buffered by the client: send them before returning.
        if let Err(e) = self.context.client().flush().await {
            tracing::warn!(error = %e, "idem nats consumer: flushing settlements failed");
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

fn report_panic(joined: Result<(), tokio::task::JoinError>) {
    if let Err(e) = joined {
        tracing::error!(error = %e, "idem nats consumer: a message's task panicked; JetStream delivers it again after ack_wait");
    }
}

struct Settings {
    stream: String,
    context: jetstream::Context,
    dead_letter_subject: String,
    max_deliver: u64,
    retry_delay: Duration,
    in_progress_delay: Duration,
    storage_delay: Duration,
    on_settle: Option<Hook>,
}

/// What to do with a message, before doing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Ack,
    Requeue(Wait),
    Retry,
    DeadLetter(Reason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    InProgress,
    Storage,
}

/// The settlement of a handler's result (`Ok`, or `Err` with the
/// `idem::Error` it carries), its last call's outcome, and the delivery
/// count against the bound.
fn verdict(result: Result<(), Option<&Error>>, outcome: Option<Outcome>, delivered: u64, max_deliver: u64) -> Verdict {
    let carried = match result {
        Ok(()) => return Verdict::Ack,
        Err(carried) => carried,
    };
    let failed = || {
        if delivered >= max_deliver { Verdict::DeadLetter(Reason::DeliveriesExhausted) } else { Verdict::Retry }
    };
    match carried {
        Some(Error::Storage(_)) => Verdict::Requeue(Wait::Storage),
        Some(Error::InProgress { .. }) => Verdict::Requeue(Wait::InProgress),
        Some(Error::KeyReused { .. }) => Verdict::DeadLetter(Reason::KeyReused),
        Some(_) => Verdict::DeadLetter(Reason::Rejected),
        None => match outcome {
            Some(Outcome::InProgress) => Verdict::Requeue(Wait::InProgress),
            Some(Outcome::KeyReused) => Verdict::DeadLetter(Reason::KeyReused),
            Some(Outcome::Rejected) => Verdict::DeadLetter(Reason::Rejected),
            _ => failed(),
        },
    }
}

fn payload<T: DeserializeOwned>(message: &jetstream::Message) -> Result<T, String> {
    serde_json::from_slice(&message.payload).map_err(|e| format!("payload: {e}"))
}

pub(crate) fn message_id(message: &jetstream::Message) -> Option<String> {
    message.headers.as_ref().and_then(|h| h.get(MSG_ID_HEADER)).map(|v| v.as_str().to_owned())
}

pub(crate) fn message_id_and_payload<T: DeserializeOwned>(message: &jetstream::Message) -> Result<(String, T), String> {
    let id = message_id(message).ok_or_else(|| format!("no {MSG_ID_HEADER} header"))?;
    Ok((id, payload(message)?))
}

/// How many times JetStream has delivered `message` (from its reply
/// subject), 1 when it does not say.
pub(crate) fn delivered(message: &jetstream::Message) -> u64 {
    message.info().map(|info| u64::try_from(info.delivered).unwrap_or(1)).unwrap_or(1)
}

async fn handle<I, F, Fut, R, E>(
    settings: &Settings,
    message: jetstream::Message,
    decode: fn(&jetstream::Message) -> Result<I, String>,
    handler: Arc<F>,
    permit: tokio::sync::OwnedSemaphorePermit,
) where
    I: Send + 'static,
    F: Fn(I) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<R, E>> + Send + 'static,
    R: Send + 'static,
    E: AsIdemError + Debug + Send + 'static,
{
    let delivered = delivered(&message);
    let (verdict, outcome, error) = match decode(&message) {
        Err(e) => (Verdict::DeadLetter(Reason::Poison), None, Some(e)),
        Ok(input) => {
            // Its own task: a panic becomes a failure, not a message never settled.
            let call = tokio::spawn(async move { observe(handler(input)).await });
            match call.await {
                Ok((Ok(_), outcome)) => (Verdict::Ack, outcome, None),
                Ok((Err(e), outcome)) => (
                    verdict(Err(e.idem_error()), outcome, delivered, settings.max_deliver),
                    outcome,
                    Some(format!("{e:?}")),
                ),
                Err(join) => (
                    verdict(Err(None), None, delivered, settings.max_deliver),
                    None,
                    Some(format!("handler panicked: {join}")),
                ),
            }
        }
    };
    drop(permit);

    let nak = |delay: Duration| message.ack_with(AckKind::Nak(Some(delay)));
    let (action, result) = match verdict {
        Verdict::Ack => (Action::Ack, message.ack().await),
        Verdict::Requeue(wait) => {
            let delay = match wait {
                Wait::InProgress => settings.in_progress_delay,
                Wait::Storage => settings.storage_delay,
            };
            (Action::Requeue, nak(delay).await)
        }
        Verdict::Retry => (Action::Retry { delivered }, nak(settings.retry_delay).await),
        Verdict::DeadLetter(reason) => match dead_letter(settings, &message, reason, error.as_deref()).await {
            Ok(()) => (Action::DeadLetter(reason), message.ack_with(AckKind::Term).await),
            Err(e) => {
                tracing::warn!(error = %e, subject = %settings.dead_letter_subject,
                    "idem nats consumer: dead-letter copy not stored; the message comes back");
                (Action::Returned, nak(settings.retry_delay).await)
            }
        },
    };
    if let Err(e) = result {
        tracing::warn!(action = ?action, error = %e, "idem nats consumer: settling failed; JetStream delivers it again");
    }
    if let Some(action_error) = &error {
        tracing::warn!(action = ?action, error = %action_error, "idem nats consumer: message not done");
    }
    let settled = Settled {
        outcome,
        action,
        delivered,
        subject: message.subject.to_string(),
        message_id: message_id(&message),
        error,
    };
    crate::metrics::nats_settled(&settings.stream, action);
    if let Some(hook) = &settings.on_settle {
        hook(&settled);
    }
}

/// Publishes the dead-letter copy and waits for JetStream to store it.
async fn dead_letter(
    settings: &Settings,
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
    let ack = settings
        .context
        .publish_with_headers(settings.dead_letter_subject.clone(), headers, message.payload.clone())
        .await?;
    ack.await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::KeyError;

    #[test]
    fn ok_is_acked_and_errors_follow_the_amqp_table() {
        let down = Error::Storage(sqlx::Error::PoolTimedOut);
        let busy = Error::InProgress { biz: "b", key: "k".into() };
        let reused = Error::KeyReused { biz: "b", key: "k".into() };
        let invalid = Error::InvalidKey(KeyError::Missing);
        let failed = Some(Outcome::Failed);
        assert_eq!(verdict(Ok(()), Some(Outcome::KeyReused), 9, 4), Verdict::Ack);
        assert_eq!(verdict(Err(Some(&down)), failed, 9, 4), Verdict::Requeue(Wait::Storage));
        assert_eq!(verdict(Err(Some(&busy)), failed, 9, 4), Verdict::Requeue(Wait::InProgress));
        assert_eq!(verdict(Err(Some(&reused)), failed, 1, 4), Verdict::DeadLetter(Reason::KeyReused));
        assert_eq!(verdict(Err(Some(&invalid)), failed, 1, 4), Verdict::DeadLetter(Reason::Rejected));
        assert_eq!(verdict(Err(None), Some(Outcome::InProgress), 9, 4), Verdict::Requeue(Wait::InProgress));
        assert_eq!(verdict(Err(None), Some(Outcome::Rejected), 1, 4), Verdict::DeadLetter(Reason::Rejected));
    }

    #[test]
    fn a_body_error_is_retried_until_max_deliver() {
        for outcome in [None, Some(Outcome::Failed), Some(Outcome::Executed), Some(Outcome::Replayed)] {
            assert_eq!(verdict(Err(None), outcome, 1, 3), Verdict::Retry);
            assert_eq!(verdict(Err(None), outcome, 2, 3), Verdict::Retry);
            assert_eq!(verdict(Err(None), outcome, 3, 3), Verdict::DeadLetter(Reason::DeliveriesExhausted));
        }
    }
}
