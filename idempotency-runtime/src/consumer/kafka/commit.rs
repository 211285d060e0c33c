//! Commits, through librdkafka's `rd_kafka_commit_queue`: the one commit
//! call that says where its answer goes.
//!
//! - [`in_background`]: the answer comes to the task that polls the
//!   consumer, where the group's callbacks mark the offset confirmed or
//!   failed ([`Rebalancing`](super::reader::Rebalancing)). rdkafka's
//!   `commit(.., CommitMode::Async)` cannot: librdkafka reports a manual
//!   asynchronous commit only to a queue or callback given with it, and
//!   rdkafka gives none, so a failed commit went unnoticed.
//! - [`and_wait`]: the answer is waited for, at most a bound (a revocation,
//!   the stop). rdkafka's `CommitMode::Sync` waits without one: with the
//!   brokers gone, a runner's stop never returned.

use std::time::Duration;

use rdkafka::bindings::{
    rd_kafka_commit_queue, rd_kafka_event_destroy, rd_kafka_event_error, rd_kafka_event_topic_partition_list,
    rd_kafka_queue_destroy, rd_kafka_queue_get_consumer, rd_kafka_queue_new, rd_kafka_queue_poll, rd_kafka_queue_t,
};
use rdkafka::consumer::{Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{Offset, TopicPartitionList};

use super::book::Place;

/// A partition list of offsets to commit.
fn offsets(commits: &[(Place, i64)]) -> TopicPartitionList {
    let mut list = TopicPartitionList::with_capacity(commits.len());
    for ((topic, partition), at) in commits {
        // Always valid: the offset is one the broker handed over.
        let _ = list.add_partition_offset(topic, *partition, Offset::Offset(*at));
    }
    list
}

/// Sends `commits`; the answer comes to the polling task as a commit event.
pub(crate) fn in_background<C: ConsumerContext, K: Consumer<C>>(
    consumer: &K,
    commits: &[(Place, i64)],
) -> KafkaResult<()> {
    let client = consumer.client().native_ptr();
    // SAFETY: a live client; the handle to its consumer queue is released
    // after the call (the commit keeps its own reference to the queue until
    // it answers).
    unsafe {
        let queue = rd_kafka_queue_get_consumer(client);
        if queue.is_null() {
            return Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::UnknownGroup));
        }
        let sent = send(consumer, commits, queue);
        rd_kafka_queue_destroy(queue);
        sent
    }
}

/// Commits `commits` and waits at most `timeout` for the broker's answer:
/// `Ok` once every partition is confirmed.
pub(crate) fn and_wait<C: ConsumerContext, K: Consumer<C>>(
    consumer: &K,
    commits: &[(Place, i64)],
    timeout: Duration,
) -> KafkaResult<()> {
    let client = consumer.client().native_ptr();
    let timeout_ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
    // SAFETY: a live client; a queue of our own, polled here and then
    // released (an answer that comes later is dropped with it); the event
    // read before it is destroyed.
    unsafe {
        let queue = rd_kafka_queue_new(client);
        if let Err(e) = send(consumer, commits, queue) {
            rd_kafka_queue_destroy(queue);
            return Err(e);
        }
        let event = rd_kafka_queue_poll(queue, timeout_ms);
        let answer = if event.is_null() {
            Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::OperationTimedOut))
        } else {
            let mut err = rd_kafka_event_error(event);
            let list = rd_kafka_event_topic_partition_list(event);
            if err == RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR && !list.is_null() && !(*list).elems.is_null() {
                let elements = std::slice::from_raw_parts((*list).elems, (*list).cnt.max(0) as usize);
                if let Some(failed) = elements.iter().find(|e| e.err != RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR) {
                    err = failed.err;
                }
            }
            rd_kafka_event_destroy(event);
            match err {
                RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR => Ok(()),
                err => Err(KafkaError::ConsumerCommit(err.into())),
            }
        };
        rd_kafka_queue_destroy(queue);
        answer
    }
}

/// Sends `commits` with their answer to `queue`.
///
/// # Safety
/// `queue` is a live queue of `consumer`'s client.
unsafe fn send<C: ConsumerContext, K: Consumer<C>>(
    consumer: &K,
    commits: &[(Place, i64)],
    queue: *mut rd_kafka_queue_t,
) -> KafkaResult<()> {
    let list = offsets(commits);
    // SAFETY: the caller's promise; librdkafka copies `list` before returning.
    let err =
        unsafe { rd_kafka_commit_queue(consumer.client().native_ptr(), list.ptr(), queue, None, std::ptr::null_mut()) };
    match err {
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR => Ok(()),
        err => Err(KafkaError::ConsumerCommit(err.into())),
    }
}
