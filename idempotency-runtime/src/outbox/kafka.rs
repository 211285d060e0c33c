//! The Kafka publisher of the outbox relay (features `outbox` and `kafka`):
//! each event is produced to its destination topic by an idempotent
//! producer, with the event's aggregate as the message key (so one
//! aggregate's events go to one partition, in the order the relay sends
//! them: the order their transactions committed) and the event's id in the
//! [`MESSAGE_ID_HEADER`] header, which
//! [`kafka::Consumer::run_with_id`](crate::kafka::Consumer::run_with_id)
//! keys its call by. An event counts as sent once the broker acknowledged
//! it (`acks=all`, implied by `enable.idempotence`).
//!
//! The idempotent producer drops its own retries of one send; an event the
//! relay publishes again (it died before marking it sent) is a second
//! message with the same id header, which the consumer's record replays.
//! Events without an aggregate are produced without a key (spread over the
//! partitions, in no order among themselves).

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::relay::{Confirm, Message, Publisher};
pub use crate::kafka::MESSAGE_ID_HEADER;

/// Publishes outbox events to Kafka; see the [module docs](self).
#[derive(Clone)]
pub struct KafkaPublisher {
    producer: FutureProducer,
    ack_timeout: Duration,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher").field("ack_timeout", &self.ack_timeout).finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// An idempotent producer on the brokers (and security settings) of
    /// `config`; a batch waits at most 10 s for its acknowledgements.
    pub fn new(config: &ClientConfig) -> KafkaResult<Self> {
        Self::with_ack_timeout(config, Duration::from_secs(10))
    }

    /// The same, waiting at most `ack_timeout` per batch (librdkafka's
    /// `message.timeout.ms`): the messages not acknowledged by then are
    /// unconfirmed, not counted as attempts.
    pub fn with_ack_timeout(config: &ClientConfig, ack_timeout: Duration) -> KafkaResult<Self> {
        let producer = crate::kafka::producer_config(config, ack_timeout).create()?;
        Ok(KafkaPublisher { producer, ack_timeout })
    }

    /// The producer, to flush or inspect it.
    pub fn producer(&self) -> &FutureProducer {
        &self.producer
    }
}

fn headers(message: &Message) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new_with_capacity(message.headers().len() + 1);
    for (name, value) in message.headers() {
        headers = headers.insert(Header { key: name, value: Some(value.as_bytes()) });
    }
    headers.insert(Header { key: MESSAGE_ID_HEADER, value: Some(message.id().as_bytes()) })
}

/// Whether the broker refused this message itself (it will refuse it
/// again: too large, no such topic, not allowed), rather than nobody
/// answering in time.
fn refused(e: &KafkaError) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        e,
        KafkaError::MessageProduction(
            C::MessageSizeTooLarge
                | C::InvalidMessageSize
                | C::InvalidMessage
                | C::InvalidRecord
                | C::UnknownTopicOrPartition
                | C::UnknownTopic
                | C::UnknownPartition
                | C::TopicAuthorizationFailed
                | C::ClusterAuthorizationFailed
                | C::InvalidTopic
                | C::MessageBatchTooLarge
                | C::InvalidRequiredAcks
                | C::PolicyViolation
                | C::InvalidArgument
        )
    )
}

impl Publisher for KafkaPublisher {
    async fn publish(&mut self, batch: &[Message]) -> Vec<Confirm> {
        // All handed to the producer first (it batches them per partition),
        // then every acknowledgement awaited.
        let mut pending = Vec::with_capacity(batch.len());
        for message in batch {
            let mut record: FutureRecord<'_, str, str> =
                FutureRecord::to(message.destination()).payload(message.payload()).headers(headers(message));
            if let Some(aggregate) = message.aggregate() {
                record = record.key(aggregate);
            }
            pending.push(match self.producer.send_result(record) {
                Ok(delivery) => Ok(delivery),
                Err((e, _)) if refused(&e) => Err(Confirm::Refused(format!("produce: {e}"))),
                Err((e, _)) => Err(Confirm::Unconfirmed(format!("produce: {e}"))),
            });
        }
        let deadline = crate::clock::deadline_in(self.ack_timeout.saturating_add(Duration::from_secs(1)));
        let mut answers = Vec::with_capacity(batch.len());
        for sent in pending {
            answers.push(match sent {
                Err(answer) => answer,
                Ok(delivery) => match tokio::time::timeout_at(deadline, delivery).await {
                    Ok(Ok(Ok(_))) => Confirm::Sent { duplicate: false },
                    Ok(Ok(Err((e, _)))) if refused(&e) => Confirm::Refused(format!("ack: {e}")),
                    Ok(Ok(Err((e, _)))) => Confirm::Unconfirmed(format!("ack: {e}")),
                    Ok(Err(_)) => Confirm::Unconfirmed("ack: producer dropped".to_owned()),
                    Err(_) => Confirm::Unconfirmed("ack: timed out".to_owned()),
                },
            });
        }
        answers
    }
}
