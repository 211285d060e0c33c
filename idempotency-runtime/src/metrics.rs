//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (feature
//! `metrics`): nothing is recorded until the application installs a
//! recorder (for Prometheus, `metrics-exporter-prometheus`). Without the
//! feature every hook below is an empty inline function and the timer has
//! no size: the call path pays nothing.
//!
//! | name | kind | labels | counts |
//! |---|---|---|---|
//! | `idem_calls_total` | counter | `biz`, `outcome` | every call that ended: `executed`, `replayed`, `in_progress`, `key_reused`, `rejected`, `failed` |
//! | `idem_call_duration_seconds` | histogram | `biz`, `outcome` | the same calls, from entry to answer |
//! | `idem_replays_total` | counter | `biz`, `source` | replayed calls, by where the result came from: `redis` (the cached result), `memory` (a duplicate running on the same engine, waited for), `database` (the record), `local` (the engine's local replay cache) |
//! | `idem_redis_degraded_total` | counter | | periods in which Redis failed and calls went on with the database alone (begun) |
//! | `idem_redis_degraded` | gauge | | engines in such a period now |
//! | `idem_background_releases_total` | counter | | claims released from a background task (the call panicked or was dropped, or the claim's or its release's answer was lost) |
//! | `idem_consumer_settlements_total` | counter | `queue`, `action` | deliveries settled by the RabbitMQ consumer runner: `ack`, `ack_recorded` (the handler's `Err` was its call's recorded business error: acked once), `requeue`, `retry`, `returned`, `dead_letter_poison`, `dead_letter_key_reused`, `dead_letter_rejected`, `dead_letter_retries_exhausted` |
//! | `idem_nats_settlements_total` | counter | `stream`, `action` | messages settled by the NATS JetStream consumer runner: `ack`, `ack_recorded`, `requeue`, `retry`, `returned`, `dead_letter_poison`, `dead_letter_key_reused`, `dead_letter_rejected`, `dead_letter_deliveries_exhausted` |
//! | `idem_redis_stream_settlements_total` | counter | `stream`, `action` | entries settled by the Redis Streams consumer runner: the same actions as NATS |
//! | `idem_kafka_settlements_total` | counter | `topic`, `action` | messages settled by the Kafka consumer runner: the same actions as RabbitMQ |
//! | `idem_kafka_dead_letters_trimmed_total` | counter | `topic`, `dropped` | dead letters of the Kafka consumer runner stored without parts of the message, refused whole for its size: `payload`, or `key,payload,headers` (a pointer to the original) |
//! | `idem_outbox_messages_total` | counter | `result` | outbox messages each relay batch handled, by the broker's answer: `sent`, `duplicate` (sent, dropped by the broker as a copy), `refused` (to be retried), `dead`, `unconfirmed` (no answer, left pending), `unmarked` (confirmed, but the marks did not commit: published again) |
//! | `idem_outbox_batches_total` | counter | | relay batches that took rows |
//! | `idem_cron_slots_total` | counter | `job`, `outcome` | slots settled by the cron runner: `executed`, `done_elsewhere`, `declined` (the job's call recorded a business error: the slot is done), `declined_elsewhere`, `in_progress_elsewhere`, `failed`, `cancelled`, `skipped` |
//!
//! A call whose future is dropped, or whose body panics, never ends, so it
//! is not counted (its claim, if any, shows in the background releases).
//! Call [`describe`] once after installing the recorder to give each metric
//! its help text and unit.

use crate::outcome::Outcome;

/// Where a replayed result came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// This process's local replay cache.
    Local,
    /// The finished call's result cached in Redis.
    #[cfg(feature = "redis")]
    Redis,
    /// A duplicate running on the same engine, waited for in memory.
    Memory,
    /// The committed record.
    Database,
}

impl Source {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn as_str(self) -> &'static str {
        match self {
            #[cfg(feature = "redis")]
            Source::Redis => "redis",
            Source::Local => "local",
            Source::Memory => "memory",
            Source::Database => "database",
        }
    }
}

/// `idem_calls_total{biz, outcome}`.
#[cfg(feature = "metrics")]
pub const CALLS: &str = "idem_calls_total";
/// `idem_call_duration_seconds{biz, outcome}`.
#[cfg(feature = "metrics")]
pub const CALL_DURATION: &str = "idem_call_duration_seconds";
/// `idem_replays_total{biz, source}`.
#[cfg(feature = "metrics")]
pub const REPLAYS: &str = "idem_replays_total";
/// `idem_redis_degraded_total`.
#[cfg(feature = "metrics")]
pub const REDIS_DEGRADED_PERIODS: &str = "idem_redis_degraded_total";
/// `idem_redis_degraded`.
#[cfg(feature = "metrics")]
pub const REDIS_DEGRADED_NOW: &str = "idem_redis_degraded";
/// `idem_background_releases_total`.
#[cfg(feature = "metrics")]
pub const BACKGROUND_RELEASES: &str = "idem_background_releases_total";
/// `idem_consumer_settlements_total{queue, action}`.
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub const CONSUMER_SETTLEMENTS: &str = "idem_consumer_settlements_total";
/// `idem_cron_slots_total{job, outcome}`.
#[cfg(feature = "metrics")]
pub const CRON_SLOTS: &str = "idem_cron_slots_total";
/// `idem_nats_settlements_total{stream, action}`.
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub const NATS_SETTLEMENTS: &str = "idem_nats_settlements_total";
/// `idem_kafka_settlements_total{topic, action}`.
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub const KAFKA_SETTLEMENTS: &str = "idem_kafka_settlements_total";
/// `idem_kafka_dead_letters_trimmed_total{topic, dropped}`.
#[cfg(all(feature = "metrics", feature = "kafka"))]
pub const KAFKA_DEAD_LETTERS_TRIMMED: &str = "idem_kafka_dead_letters_trimmed_total";
/// `idem_redis_stream_settlements_total{stream, action}`.
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub const REDIS_STREAM_SETTLEMENTS: &str = "idem_redis_stream_settlements_total";
/// `idem_outbox_messages_total{result}`.
#[cfg(feature = "metrics")]
pub const OUTBOX_MESSAGES: &str = "idem_outbox_messages_total";
/// `idem_outbox_batches_total`.
#[cfg(feature = "metrics")]
pub const OUTBOX_BATCHES: &str = "idem_outbox_batches_total";

/// Gives every metric above its help text and unit, in the installed
/// recorder. Optional: metrics record without it.
#[cfg(feature = "metrics")]
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(CALLS, Unit::Count, "Idempotent calls that ended, by biz and outcome.");
    describe_histogram!(CALL_DURATION, Unit::Seconds, "Time from entry to answer of idempotent calls.");
    describe_counter!(REPLAYS, Unit::Count, "Replayed calls, by biz and where the result came from.");
    describe_counter!(
        REDIS_DEGRADED_PERIODS,
        Unit::Count,
        "Periods in which Redis failed and calls used the database alone."
    );
    describe_gauge!(REDIS_DEGRADED_NOW, Unit::Count, "Engines whose Redis is failing now.");
    describe_counter!(BACKGROUND_RELEASES, Unit::Count, "Redis claims released from a background task.");
    describe_counter!(
        CONSUMER_SETTLEMENTS,
        Unit::Count,
        "Deliveries settled by the consumer runner, by queue and action."
    );
    describe_counter!(CRON_SLOTS, Unit::Count, "Slots settled by the cron runner, by job and outcome.");
    describe_counter!(
        NATS_SETTLEMENTS,
        Unit::Count,
        "Messages settled by the NATS JetStream consumer runner, by stream and action."
    );
    describe_counter!(
        KAFKA_SETTLEMENTS,
        Unit::Count,
        "Messages settled by the Kafka consumer runner, by topic and action."
    );
    #[cfg(feature = "kafka")]
    describe_counter!(
        KAFKA_DEAD_LETTERS_TRIMMED,
        Unit::Count,
        "Dead letters of the Kafka consumer runner stored without parts of the message, by topic and what was dropped."
    );
    describe_counter!(
        REDIS_STREAM_SETTLEMENTS,
        Unit::Count,
        "Entries settled by the Redis Streams consumer runner, by stream and action."
    );
    describe_counter!(
        OUTBOX_MESSAGES,
        Unit::Count,
        "Outbox messages handled by relay batches, by the broker's answer."
    );
    describe_counter!(OUTBOX_BATCHES, Unit::Count, "Outbox relay batches that took rows.");
}

/// When a call began; no size without the feature.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timer {
    #[cfg(feature = "metrics")]
    started: std::time::Instant,
}

impl Timer {
    #[inline]
    pub(crate) fn start() -> Self {
        Timer {
            #[cfg(feature = "metrics")]
            started: std::time::Instant::now(),
        }
    }
}

/// A call ended with `outcome`; `source` says where a replay came from.
#[inline]
pub(crate) fn call_finished(biz: &'static str, outcome: Outcome, source: Option<Source>, timer: Timer) {
    #[cfg(feature = "metrics")]
    {
        let outcome_label = outcome.as_str();
        metrics::counter!(CALLS, "biz" => biz, "outcome" => outcome_label).increment(1);
        metrics::histogram!(CALL_DURATION, "biz" => biz, "outcome" => outcome_label)
            .record(timer.started.elapsed().as_secs_f64());
        if outcome == Outcome::Replayed
            && let Some(source) = source
        {
            metrics::counter!(REPLAYS, "biz" => biz, "source" => source.as_str()).increment(1);
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (biz, outcome, source, timer);
}

/// Redis began failing for an engine: calls go on with the database alone.
#[cfg(feature = "redis")]
#[inline]
pub(crate) fn redis_degraded() {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!(REDIS_DEGRADED_PERIODS).increment(1);
        metrics::gauge!(REDIS_DEGRADED_NOW).increment(1.0);
    }
}

/// Redis answers an engine again.
#[cfg(feature = "redis")]
#[inline]
pub(crate) fn redis_recovered() {
    #[cfg(feature = "metrics")]
    metrics::gauge!(REDIS_DEGRADED_NOW).decrement(1.0);
}

/// A background task began releasing a claim.
#[cfg(feature = "redis")]
#[inline]
pub(crate) fn background_release() {
    #[cfg(feature = "metrics")]
    metrics::counter!(BACKGROUND_RELEASES).increment(1);
}

/// A consumer runner settled a delivery of the queue or stream `scope`:
/// `counter{scope_label = scope, action}`. The runners pass plain labels, so
/// this module names none of their types.
#[cfg(any(feature = "amqp", feature = "nats", feature = "redis-streams", feature = "kafka"))]
#[inline]
pub(crate) fn consumer_settled(counter: &'static str, scope_label: &'static str, scope: &str, action: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(counter, scope_label => scope.to_owned(), "action" => action).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (counter, scope_label, scope, action);
}

/// The Kafka runner stored a dead letter of `topic` without `dropped`
/// (its whole message was refused for its size).
#[cfg(feature = "kafka")]
#[inline]
pub(crate) fn kafka_dead_letter_trimmed(topic: &str, dropped: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(KAFKA_DEAD_LETTERS_TRIMMED, "topic" => topic.to_owned(), "dropped" => dropped).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (topic, dropped);
}

/// An outbox relay finished a batch that took rows: how many messages
/// ended each way (`sent`, `duplicate`, `refused`, `dead`, `unconfirmed`,
/// `unmarked`). Plain labels: this module names none of the relay's types.
#[cfg(feature = "outbox")]
#[inline]
pub(crate) fn outbox_batch(results: &[(&'static str, usize)]) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!(OUTBOX_BATCHES).increment(1);
        for &(result, n) in results {
            if n > 0 {
                metrics::counter!(OUTBOX_MESSAGES, "result" => result).increment(n as u64);
            }
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = results;
}

/// The cron runner settled a slot of `job`.
#[cfg(feature = "cron")]
#[inline]
pub(crate) fn cron_settled(job: &str, outcome: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(CRON_SLOTS, "job" => job.to_owned(), "outcome" => outcome).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (job, outcome);
}
