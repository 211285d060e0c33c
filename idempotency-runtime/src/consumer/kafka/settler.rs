//! The settling side: an ack is the message's offset settled in the book
//! (and the group's offset committed as far as nothing before it is still
//! unsettled); a delay is the message held back in the book, its offset
//! and its key kept; a retry is a copy on the retry topic carrying its
//! count, produced (and acknowledged by the broker) before the original is
//! settled; a dead letter likewise, on the dead-letter topic with the
//! reason in its headers.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::Message as _;
use rdkafka::consumer::{CommitMode, Consumer as _};
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::book::Received;
use super::reader::{GroupConsumer, Shared, offsets};
use super::{
    DEAD_ERROR_HEADER, DEAD_OFFSET_HEADER, DEAD_PARTITION_HEADER, DEAD_REASON_HEADER, DEAD_TOPIC_HEADER, Delivered,
    headers,
};
use crate::consumer::Reason;
use crate::consumer::transport::{DeadLettered, Retried, Settle};

pub(crate) struct Group {
    pub(crate) consumer: Arc<GroupConsumer>,
    pub(crate) producer: FutureProducer,
    pub(crate) shared: Arc<Shared>,
    pub(crate) topic: String,
    pub(crate) retry_topic: String,
    pub(crate) dead_letter_topic: String,
    pub(crate) retries_header: String,
    pub(crate) produce_timeout: Duration,
}

impl Settle for Group {
    type Delivery = Received;
    type Error = KafkaError;
    type Delivered = Delivered;

    const NAME: &'static str = "kafka";
    const MESSAGE_ID: &'static str = "message id header (UTF-8)";
    const EXHAUSTED: Reason = Reason::RetriesExhausted;
    const METRIC: &'static str = crate::metrics::KAFKA_SETTLEMENTS;
    const METRIC_SCOPE: &'static str = "topic";

    fn scope(&self) -> &str {
        &self.topic
    }

    fn payload(received: &Received) -> Result<&[u8], String> {
        received.message.payload().ok_or_else(|| "no payload".to_owned())
    }

    fn message_id(received: &Received) -> Option<&str> {
        received.message_id.as_deref()
    }

    /// The retry header's count (0 on a first attempt).
    fn spent(received: &Received) -> u64 {
        received.retries
    }

    fn delivered(received: &Received) -> Delivered {
        Delivered {
            topic: received.message.topic().to_owned(),
            partition: received.message.partition(),
            offset: received.message.offset(),
            retries: received.retries,
        }
    }

    async fn ack(&self, received: &Received) -> Result<(), KafkaError> {
        self.done(received)
    }

    /// Held back in the book: it starts again once the delay has passed,
    /// its offset uncommitted and its key's later messages waiting.
    async fn requeue(&self, received: &Received, delay: Duration) -> Result<(), KafkaError> {
        self.shared.book().requeue(received.clone(), crate::clock::deadline_in(delay));
        self.shared.ready.notify_one();
        Ok(())
    }

    /// After the delay, a copy to the retry topic with the count in its
    /// header; once the broker has it, the original is settled.
    async fn retry(&self, received: &Received, delay: Duration, count: u64) -> Retried<KafkaError> {
        tokio::time::sleep(delay).await;
        let count = count.to_string();
        let copy = headers::copy_with(
            received.message.headers(),
            &[&self.retries_header],
            &[(&self.retries_header, count.as_bytes())],
        );
        match self.produce(&self.retry_topic, received, copy).await {
            Ok(()) => Retried::Done(self.done(received)),
            Err(e) => Retried::Refused(format!("retry copy not produced to {}: {e}", self.retry_topic)),
        }
    }

    /// A copy to the dead-letter topic, with why and where it was in its
    /// headers; once the broker has it, the original is settled.
    async fn dead_letter(&self, received: &Received, reason: Reason, error: Option<&str>) -> DeadLettered<KafkaError> {
        let message = &received.message;
        let (partition, offset) = (message.partition().to_string(), message.offset().to_string());
        let mut extra: Vec<(&str, &[u8])> = vec![
            (DEAD_REASON_HEADER, reason.as_str().as_bytes()),
            (DEAD_TOPIC_HEADER, message.topic().as_bytes()),
            (DEAD_PARTITION_HEADER, partition.as_bytes()),
            (DEAD_OFFSET_HEADER, offset.as_bytes()),
        ];
        if let Some(error) = error {
            extra.push((DEAD_ERROR_HEADER, error.as_bytes()));
        }
        let dropped =
            [DEAD_REASON_HEADER, DEAD_TOPIC_HEADER, DEAD_PARTITION_HEADER, DEAD_OFFSET_HEADER, DEAD_ERROR_HEADER];
        let copy = headers::copy_with(message.headers(), &dropped, &extra);
        match self.produce(&self.dead_letter_topic, received, copy).await {
            Ok(()) => DeadLettered::Done(self.done(received)),
            Err(e) => DeadLettered::NotStored(e),
        }
    }
}

impl Group {
    /// The message's offset settled, and the group's offset committed as
    /// far as the book allows (never for a partition no longer ours).
    fn done(&self, received: &Received) -> Result<(), KafkaError> {
        let result = {
            // Under the book's lock: a revocation cannot come between the
            // check that the partition is ours and the commit.
            let mut book = self.shared.book();
            match book.settle(received) {
                Some(commit) => self.consumer.commit(&offsets(&[commit]), CommitMode::Async),
                None => Ok(()),
            }
        };
        // Its key's next message may be ready now.
        self.shared.ready.notify_one();
        result
    }

    /// Produces a copy of the message (its key and payload) to `topic` and
    /// waits for the broker's acknowledgement.
    async fn produce(
        &self,
        topic: &str,
        received: &Received,
        headers: rdkafka::message::OwnedHeaders,
    ) -> Result<(), KafkaError> {
        let message = &received.message;
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(headers);
        if let Some(key) = message.key() {
            record = record.key(key);
        }
        if let Some(payload) = message.payload() {
            record = record.payload(payload);
        }
        self.producer.send(record, self.produce_timeout).await.map(drop).map_err(|(e, _)| e)
    }
}
