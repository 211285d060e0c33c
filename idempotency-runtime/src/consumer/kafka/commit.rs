//! Sending a commit in the background with its answer coming back to the
//! task that polls the consumer, where the group's callbacks mark it
//! confirmed or failed ([`Rebalancing`](super::reader::Rebalancing)).
//!
//! rdkafka's `commit(.., CommitMode::Async)` cannot do this: librdkafka
//! reports a manual asynchronous commit only to a queue or callback given
//! with it, and rdkafka gives none, so a failed commit went unnoticed.
//! `rd_kafka_commit_queue` with the consumer's own queue delivers the
//! answer as an offset-commit event, which rdkafka's polling hands to
//! `ConsumerContext::commit_callback`.

use rdkafka::bindings::{rd_kafka_commit_queue, rd_kafka_queue_destroy, rd_kafka_queue_get_consumer};
use rdkafka::consumer::Consumer as _;
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::types::RDKafkaRespErr;

use super::book::Place;
use super::reader::{GroupConsumer, offsets};

/// Sends `commits`; the answer comes to the polling task.
pub(crate) fn in_background(consumer: &GroupConsumer, commits: &[(Place, i64)]) -> KafkaResult<()> {
    let list = offsets(commits);
    let client = consumer.client().native_ptr();
    // SAFETY: `client` is the live consumer's handle. The queue handle is
    // released at once: the commit keeps its own reference to the queue
    // until it answers; `list` is copied by librdkafka before this returns.
    let err = unsafe {
        let queue = rd_kafka_queue_get_consumer(client);
        if queue.is_null() {
            return Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::UnknownGroup));
        }
        let err = rd_kafka_commit_queue(client, list.ptr(), queue, None, std::ptr::null_mut());
        rd_kafka_queue_destroy(queue);
        err
    };
    match err {
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR => Ok(()),
        err => Err(KafkaError::ConsumerCommit(err.into())),
    }
}
