//! What a transport implements for the core: [`Transport`] and [`Start`],
//! its settings, which start the two sides of a runner; [`Settle`], the
//! settling side (a delivery's parts, and how each settlement is carried
//! out); and [`Deliveries`], the reading side. Only `Transport` is
//! nameable from outside, and it is sealed.

use std::fmt::{Debug, Display};
use std::future::Future;
use std::time::Duration;

use super::Reason;

/// The transport a [`Consumer`](super::Consumer) runs on: its settings
/// (`amqp::Settings`, `nats::Settings`, `redis_streams::Settings`,
/// `kafka::Settings`), from
/// which a runner starts. Sealed: implemented by this crate's transports
/// only.
pub trait Transport: sealed::Sealed + Send + Sized + 'static {
    /// The error a runner ends with: the transport client's.
    type Error: Display + Send + 'static;
    /// What the transport tells the `on_settle` hook of a delivery
    /// ([`Settled::delivery`](super::Settled::delivery)).
    type Delivered: Debug + Clone + Send + 'static;
}

mod sealed {
    /// Only what starts as a transport of this crate is one.
    pub trait Sealed {}

    #[allow(private_bounds)]
    impl<T: super::Start> Sealed for T {}
}

/// How a transport's settings start a runner: the transport set up for
/// `concurrency` deliveries at once, its settling and its reading side.
pub(crate) trait Start: Transport {
    type Settle: Settle<Error = Self::Error, Delivered = Self::Delivered>;
    type Deliveries: Deliveries<Delivery = <Self::Settle as Settle>::Delivery, Error = Self::Error>;

    fn start(
        self,
        concurrency: usize,
    ) -> impl Future<Output = Result<(Self::Settle, Self::Deliveries), Self::Error>> + Send;
}

/// How a counted retry went.
pub(crate) enum Retried<E> {
    /// Given back for its retry; the result of settling the original.
    Done(Result<(), E>),
    /// The transport refused the retry (RabbitMQ: a copy the broker did not
    /// take); why. The retry counts as spent and the next is tried.
    #[cfg_attr(not(any(feature = "amqp", feature = "kafka")), allow(dead_code))]
    Refused(String),
    /// The connection went, and the delivery with it: the broker delivers
    /// it again.
    #[cfg_attr(not(feature = "amqp"), allow(dead_code))]
    Lost(E),
    /// Given back unsettled before its retry (Kafka: the runner stopped or
    /// the partition was revoked while it waited out the delay): the
    /// transport delivers it again, with the count it had.
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    Returned,
}

/// How a dead letter went.
pub(crate) enum DeadLettered<E> {
    /// Dead-lettered; the result of settling the original.
    Done(Result<(), E>),
    /// The dead-letter copy was not stored: the delivery is given back
    /// rather than lost.
    #[cfg_attr(not(any(feature = "nats", feature = "redis-streams")), allow(dead_code))]
    NotStored(E),
}

/// What differs between transports on the settling side: a delivery's
/// parts, and how each settlement is carried out. Shared by the tasks of
/// one runner.
pub(crate) trait Settle: Send + Sync + 'static {
    /// One delivery, as the transport hands it over.
    type Delivery: Send + Sync + 'static;
    /// The transport's error.
    type Error: Display + Send + 'static;
    /// What the `on_settle` hook is told of a delivery besides the common parts.
    type Delivered: Send + 'static;

    /// For logs: `amqp`, `nats`, `redis_streams`, `kafka`.
    const NAME: &'static str;
    /// Where the message id is, for the poison text (`no {MESSAGE_ID}`).
    const MESSAGE_ID: &'static str;
    /// Why a delivery whose retry budget is spent is dead-lettered.
    const EXHAUSTED: Reason;
    /// The settlement counter's name, and the label naming its queue or stream.
    const METRIC: &'static str;
    const METRIC_SCOPE: &'static str;

    /// The queue or stream this runner consumes (logs, metrics).
    fn scope(&self) -> &str;
    /// The payload, or why there is none.
    fn payload(delivery: &Self::Delivery) -> Result<&[u8], String>;
    /// The message id, if the delivery carries one.
    fn message_id(delivery: &Self::Delivery) -> Option<&str>;
    /// How much of the retry budget the delivery has spent: RabbitMQ and
    /// Kafka their retry header, NATS and Redis the delivery count.
    fn spent(delivery: &Self::Delivery) -> u64;
    /// What the hook is told of the delivery.
    fn delivered(delivery: &Self::Delivery) -> Self::Delivered;

    fn ack(&self, delivery: &Self::Delivery) -> impl Future<Output = Result<(), Self::Error>> + Send;
    /// Gives the delivery back to come again after `delay` without
    /// spending its budget (`Duration::ZERO`: at once).
    fn requeue(
        &self,
        delivery: &Self::Delivery,
        delay: Duration,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
    /// Gives the delivery back to come again after `delay` as retry number
    /// `count`.
    fn retry(
        &self,
        delivery: &Self::Delivery,
        delay: Duration,
        count: u64,
    ) -> impl Future<Output = Retried<Self::Error>> + Send;
    /// Dead-letters the delivery; `error` is the handler's, or why the
    /// payload was refused.
    fn dead_letter(
        &self,
        delivery: &Self::Delivery,
        reason: Reason,
        error: Option<&str>,
    ) -> impl Future<Output = DeadLettered<Self::Error>> + Send;
}

/// Where a runner's deliveries come from (owned by its loop).
pub(crate) trait Deliveries: Send {
    type Delivery: Send + 'static;
    type Error: Send + 'static;

    /// The next delivery; `None` once the source ended (after [`stop`](Self::stop):
    /// once it has handed back everything it had taken), `Some(Err)` when it
    /// failed for good. `room` is how many deliveries could start now (at
    /// least 1): a source that fetches in batches takes no more. Dropped
    /// mid-way (the runner stopping), it loses nothing.
    fn next(&mut self, room: usize) -> impl Future<Output = Option<Result<Self::Delivery, Self::Error>>> + Send;
    /// Stops taking deliveries; what [`next`](Self::next) still yields is
    /// given back unhandled.
    fn stop(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send;
    /// After the last delivery was settled (NATS: flush the acks).
    fn finish(self) -> impl Future<Output = ()> + Send;
}
