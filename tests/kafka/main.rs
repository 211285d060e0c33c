//! `idempotency::kafka`: the Kafka consumer runner and the outbox relay to
//! Kafka, end to end against a real Kafka-protocol broker (tansu, a private
//! one per test: `idempotency_testkit::kafka`, behind a gate that fails the
//! coordinator's requests where a test needs it) and MariaDB
//! (`IDEM_MYSQL_URL`, a database per test). Each test waits for what it
//! names (the runner's `on_settle` and `on_event` hooks, a handler's
//! signal, the broker's own committed offsets and topics), and ends by
//! reconciling the business table, the record table and the topics.
//!
//! - `table`: the settlement table, commits held at the lowest unsettled
//!   message, a key's order, a database down waited out.
//! - `rebalance`: partitions revoked mid-handling, revoked while fetching
//!   was paused, and lost.
//! - `crash`: a consumer process SIGKILLed mid-handling.
//! - `hostile`: records a real cluster carries: a header name that is not
//!   UTF-8, a dead-letter copy replayed into the topic, a message too large
//!   to dead-letter whole; a panic in the runner's polling task.
//! - `bounds`: memory while retries wait; a commit the coordinator fails.
//! - `recorded`: a recorded decline and its duplicate, settled once.
//! - `outbox`: the outbox relay to Kafka, end to end.

mod bounds;
mod crash;
mod hostile;
mod outbox;
mod rebalance;
mod recorded;
mod support;
mod table;
