//! [`Consumer`]: the one builder of every runner. What all transports
//! share is set here (concurrency, the delays, the `on_settle` hook) and
//! `run` / `run_with_id` are written once; each transport module adds its
//! constructor and its own settings on `Consumer<its Settings>`.

use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;

use super::decode::{message_id_and_payload, payload};
use super::run::{Handler, Hook, Runner, run};
use super::settle::Policy;
use super::transport::{Settle, Start, Transport};
use super::{AsIdemError, Settled};

/// A consumer runner on the transport `T`: calls a handler once per
/// delivery and settles the delivery by what the handler returned and the
/// [`Outcome`](crate::Outcome) of the `#[idempotent]` call it made. Each
/// transport module names its own: [`amqp::Consumer`](crate::amqp::Consumer)
/// is `Consumer<amqp::Settings>`, and so on; its module docs hold its
/// settlement table.
#[must_use]
pub struct Consumer<T: Transport> {
    pub(crate) transport: T,
    pub(crate) concurrency: usize,
    pub(crate) policy: Policy,
    on_settle: Option<Hook<Settled<T::Delivered>>>,
}

impl<T: Transport + Debug> Debug for Consumer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("transport", &self.transport)
            .field("concurrency", &self.concurrency)
            .field("retry_bound", &self.policy.bound)
            .field("retry_delay", &self.policy.retry_delay)
            .field("in_progress_delay", &self.policy.in_progress_delay)
            .field("storage_delay", &self.policy.storage_delay)
            .finish_non_exhaustive()
    }
}

impl<T: Transport> Consumer<T> {
    /// A runner on `transport` with a retry budget of `bound` (as the
    /// transport counts it), one delivery at a time, delays of 1 s.
    pub(crate) fn with(transport: T, bound: u64) -> Self {
        let second = Duration::from_secs(1);
        Consumer {
            transport,
            concurrency: 1,
            policy: Policy { bound, retry_delay: second, in_progress_delay: second, storage_delay: second },
            on_settle: None,
        }
    }

    /// How many deliveries are handled at once (at least 1; RabbitMQ's
    /// channel prefetch, at most 65535). Default 1: one at a time, in order.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// How long a failed delivery waits before its counted retry. Default 1 s.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.policy.retry_delay = delay;
        self
    }

    /// How long a delivery whose key is in progress elsewhere waits before
    /// it comes back, uncounted. Default 1 s.
    pub fn in_progress_delay(mut self, delay: Duration) -> Self {
        self.policy.in_progress_delay = delay;
        self
    }

    /// How long a delivery whose handler failed with `Error::Storage` (the
    /// database failed or is down) waits before it comes back, uncounted.
    /// Default 1 s.
    pub fn storage_delay(mut self, delay: Duration) -> Self {
        self.policy.storage_delay = delay;
        self
    }

    /// Called after each delivery is settled (for logs, metrics, tests).
    pub fn on_settle(mut self, hook: impl Fn(&Settled<T::Delivered>) + Send + Sync + 'static) -> Self {
        self.on_settle = Some(Arc::new(hook));
        self
    }
}

// `Start` is the crate's own: this bound is what keeps `Transport` sealed in
// practice, and users call these methods on a transport's `Consumer` alias.
#[allow(private_bounds)]
impl<T: Start> Consumer<T> {
    /// Consumes until `shutdown` resolves (or the transport fails for
    /// good: its error is returned), calling `handler` with each payload
    /// deserialized from JSON into `M`.
    ///
    /// The handler's error tells the runner, through [`AsIdemError`],
    /// whether the database was down; see the settlement table of the
    /// transport's module.
    ///
    /// On shutdown no new delivery is taken, deliveries taken but not yet
    /// handled are given back, and the runner waits for the ones being
    /// handled (including their delays) to be settled.
    pub async fn run<M, F, Fut, R, E, S>(self, shutdown: S, handler: F) -> Result<(), T::Error>
    where
        M: DeserializeOwned + Send + 'static,
        F: Fn(M) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
        R: Send + 'static,
        E: AsIdemError + Debug + Send + 'static,
        S: Future,
    {
        self.consume(shutdown, payload::<T::Settle, M>, handler).await
    }

    /// Like [`run`](Consumer::run), handing the handler the delivery's
    /// message id too, so it can key its call by the message rather than by
    /// business fields (the outbox relays set it to the event's id:
    /// `#[idempotent(key = "<message_id>", ...)]`). Where the id is: the
    /// AMQP `message_id` property, the `Nats-Msg-Id` header, the stream
    /// entry's `message_id` field, the Kafka `Idem-Message-Id` header. A
    /// delivery without one is poison: dead-lettered unhandled.
    pub async fn run_with_id<M, F, Fut, R, E, S>(self, shutdown: S, handler: F) -> Result<(), T::Error>
    where
        M: DeserializeOwned + Send + 'static,
        F: Fn(String, M) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
        R: Send + 'static,
        E: AsIdemError + Debug + Send + 'static,
        S: Future,
    {
        let handler = move |(id, message)| handler(id, message);
        self.consume(shutdown, message_id_and_payload::<T::Settle, M>, handler).await
    }

    /// Starts the transport and hands its deliveries to the core's loop.
    async fn consume<I: Send + 'static, H: Handler<I>, S: Future>(
        self,
        shutdown: S,
        decode: fn(&<T::Settle as Settle>::Delivery) -> Result<I, String>,
        handler: H,
    ) -> Result<(), T::Error> {
        let (settle, deliveries) = self.transport.start(self.concurrency).await?;
        let runner =
            Runner { transport: settle, policy: self.policy, concurrency: self.concurrency, on_settle: self.on_settle };
        run(runner, deliveries, shutdown, decode, handler).await
    }
}
