//! The settling side: an ack is the message's offset settled in the book
//! (and the group's offset committed as far as nothing before it is still
//! unsettled); a delay is the message held back in the book, its offset
//! and its key kept; a retry is a copy on the retry topic carrying its
//! count, produced (and acknowledged by the broker) before the original is
//! settled (while it waits, it counts as held for the fetch pause, and a
//! stop or a revocation gives it back unsettled); a dead letter likewise,
//! on the dead-letter topic with the reason in its headers, and without
//! the payload, or as a bare pointer to the original, when the whole
//! message is refused for its size.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::Message as _;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::book::Received;
use super::commit;
use super::error::RunError;
use super::reader::{GroupConsumer, Shared};
use super::{
    DEAD_DROPPED_HEADER, DEAD_ERROR_HEADER, DEAD_OFFSET_HEADER, DEAD_PARTITION_HEADER, DEAD_REASON_HEADER,
    DEAD_TOPIC_HEADER, Delivered, headers,
};
use crate::consumer::Reason;
use crate::consumer::transport::{DeadLettered, Retried, Settle};

/// The longest handler error a pointer-only dead letter carries (bytes).
const POINTER_ERROR_BYTES: usize = 1024;

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

/// What a dead-letter copy leaves out when the whole message cannot be
/// stored: each step is tried when the one before was refused for its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trim {
    /// The whole message: key, payload, headers, and the runner's.
    Nothing,
    /// The key and headers, and the runner's.
    Payload,
    /// The runner's headers only (the reason, where the message was, the
    /// error cut to [`POINTER_ERROR_BYTES`]): a pointer to the original.
    AllButThePointer,
}

impl Trim {
    /// The next copy to try once this one was refused for its size.
    fn smaller(self) -> Option<Trim> {
        match self {
            Trim::Nothing => Some(Trim::Payload),
            Trim::Payload => Some(Trim::AllButThePointer),
            Trim::AllButThePointer => None,
        }
    }

    /// What [`DEAD_DROPPED_HEADER`] says, and the metric's label.
    fn dropped(self) -> Option<&'static str> {
        match self {
            Trim::Nothing => None,
            Trim::Payload => Some("payload"),
            Trim::AllButThePointer => Some("key,payload,headers"),
        }
    }
}

/// Whether the broker or the producer refused a copy for its size, which
/// the same bytes will always be.
fn too_large(e: &KafkaError) -> bool {
    matches!(
        e,
        KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge | RDKafkaErrorCode::MessageBatchTooLarge)
    )
}

/// `text` cut to at most `max` bytes on a character boundary.
fn cut(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Counts a message as held while it waits out its retry (and its copy is
/// produced): fetching pauses on it as on a message not yet started.
struct Retrying<'a>(&'a Shared);

impl<'a> Retrying<'a> {
    fn begin(shared: &'a Shared) -> Self {
        shared.book().retry_began();
        shared.recount.notify_one();
        Retrying(shared)
    }
}

impl Drop for Retrying<'_> {
    fn drop(&mut self) {
        self.0.book().retry_ended();
        self.0.recount.notify_one();
    }
}

impl Settle for Group {
    type Delivery = Received;
    type Error = RunError;
    type Delivered = Delivered;

    const NAME: &'static str = "kafka";
    const MESSAGE_ID: &'static str = "message id header (UTF-8)";
    const EXHAUSTED: Reason = Reason::RetriesExhausted;
    const METRIC: &'static str = crate::metrics::KAFKA_SETTLEMENTS;
    const METRIC_SCOPE: &'static str = "topic";

    fn scope(&self) -> &str {
        &self.topic
    }

    /// The payload; none (poison) when the headers are malformed too.
    fn payload(received: &Received) -> Result<&[u8], String> {
        if let Some(why) = &received.malformed {
            return Err(why.clone());
        }
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

    async fn ack(&self, received: &Received) -> Result<(), RunError> {
        self.done(received)
    }

    /// Held back in the book: it starts again once the delay has passed,
    /// its offset uncommitted and its key's later messages waiting.
    async fn requeue(&self, received: &Received, delay: Duration) -> Result<(), RunError> {
        self.shared.book().requeue(received.clone(), crate::clock::deadline_in(delay));
        self.shared.ready.notify_one();
        self.shared.recount.notify_one();
        Ok(())
    }

    /// After the delay, a copy to the retry topic with the count in its
    /// header; once the broker has it, the original is settled. Counted as
    /// held meanwhile; given back unsettled when the runner stops or the
    /// partition is revoked first (its next owner gets it).
    async fn retry(&self, received: &Received, delay: Duration, count: u64) -> Retried<RunError> {
        let _held = Retrying::begin(&self.shared);
        if !self.shared.wait_out(received, delay).await {
            return Retried::Returned;
        }
        let count = count.to_string();
        let copy = headers::copy_with(
            &received.fields,
            received.message.headers(),
            &[&self.retries_header],
            &[(&self.retries_header, count.as_bytes())],
        );
        let (key, payload) = (received.message.key(), received.message.payload());
        match self.produce(&self.retry_topic, key, payload, copy).await {
            Ok(()) => Retried::Done(self.done(received)),
            Err(e) => Retried::Refused(format!("retry copy not produced to {}: {e}", self.retry_topic)),
        }
    }

    /// A copy to the dead-letter topic, with why and where it was in its
    /// headers; once the broker has it, the original is settled. A copy
    /// refused for its size is tried again at once without the payload,
    /// then as a pointer (the runner's headers only): at most three copies,
    /// and the smallest is stored wherever the broker takes anything. Any
    /// other refusal: not stored (the message comes back after the retry
    /// delay; a dead letter is never lost).
    async fn dead_letter(&self, received: &Received, reason: Reason, error: Option<&str>) -> DeadLettered<RunError> {
        let mut trim = Trim::Nothing;
        loop {
            match self.dead_copy(received, reason, error, trim).await {
                Ok(()) => {
                    if let Some(dropped) = trim.dropped() {
                        let message = &received.message;
                        tracing::warn!(topic = %message.topic(), partition = message.partition(), offset = message.offset(),
                            dropped, dead_letter_topic = %self.dead_letter_topic,
                            "idem kafka consumer: the whole message was too large for the dead-letter topic; stored without it");
                        crate::metrics::kafka_dead_letter_trimmed(&self.topic, dropped);
                    }
                    return DeadLettered::Done(self.done(received));
                }
                Err(e) => match trim.smaller().filter(|_| too_large(&e)) {
                    Some(smaller) => trim = smaller,
                    None => return DeadLettered::NotStored(e.into()),
                },
            }
        }
    }
}

impl Group {
    /// The message's offset settled, and the group's offset committed as
    /// far as the book allows (never for a partition no longer ours).
    fn done(&self, received: &Received) -> Result<(), RunError> {
        {
            // Under the book's lock: a revocation cannot come between the
            // check that the partition is ours and the commit.
            let mut book = self.shared.book();
            if let Some((place, at)) = book.settle(received) {
                // Sent in the background; its answer comes to the polling
                // task. One refused at once is sent again later, as a failed one.
                if let Err(e) = commit::in_background(&*self.consumer, &[(place.clone(), at)]) {
                    book.commit_failed(&place);
                    tracing::warn!(error = %e, topic = %place.0, partition = place.1, offset = at,
                        "idem kafka consumer: commit not sent; it is sent again");
                }
            }
        }
        // Its key's next message may be ready now.
        self.shared.ready.notify_one();
        Ok(())
    }

    /// The dead-letter copy of `received` with `trim` left out, produced.
    async fn dead_copy(
        &self,
        received: &Received,
        reason: Reason,
        error: Option<&str>,
        trim: Trim,
    ) -> Result<(), KafkaError> {
        let message = &received.message;
        let (partition, offset) = (message.partition().to_string(), message.offset().to_string());
        let mut extra: Vec<(&str, &[u8])> = vec![
            (DEAD_REASON_HEADER, reason.as_str().as_bytes()),
            (DEAD_TOPIC_HEADER, message.topic().as_bytes()),
            (DEAD_PARTITION_HEADER, partition.as_bytes()),
            (DEAD_OFFSET_HEADER, offset.as_bytes()),
        ];
        if let Some(error) = error {
            let error = if trim == Trim::AllButThePointer { cut(error, POINTER_ERROR_BYTES) } else { error };
            extra.push((DEAD_ERROR_HEADER, error.as_bytes()));
        }
        if let Some(dropped) = trim.dropped() {
            extra.push((DEAD_DROPPED_HEADER, dropped.as_bytes()));
        }
        let ours = [
            DEAD_REASON_HEADER,
            DEAD_TOPIC_HEADER,
            DEAD_PARTITION_HEADER,
            DEAD_OFFSET_HEADER,
            DEAD_ERROR_HEADER,
            DEAD_DROPPED_HEADER,
        ];
        let (key, payload, copy) = match trim {
            Trim::Nothing => (
                message.key(),
                message.payload(),
                headers::copy_with(&received.fields, message.headers(), &ours, &extra),
            ),
            Trim::Payload => {
                (message.key(), None, headers::copy_with(&received.fields, message.headers(), &ours, &extra))
            }
            Trim::AllButThePointer => (None, None, headers::copy_with(&[], None, &[], &extra)),
        };
        self.produce(&self.dead_letter_topic, key, payload, copy).await
    }

    /// Produces a copy to `topic` and waits for the broker's acknowledgement.
    async fn produce(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: OwnedHeaders,
    ) -> Result<(), KafkaError> {
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(headers);
        if let Some(key) = key {
            record = record.key(key);
        }
        if let Some(payload) = payload {
            record = record.payload(payload);
        }
        self.producer.send(record, self.produce_timeout).await.map(drop).map_err(|(e, _)| e)
    }
}
