//! `idempotency::redis_streams` end to end: the shared Redis (`IDEM_REDIS_URL`),
//! MariaDB (`IDEM_MYSQL_URL`), and for the outage a private `redis-server`.
//! Every test uses its own stream, SKUs and order ids, so they run in
//! parallel and again; the streams are deleted at the end.
//!
//! The settlement table row by row (each asserting the exact Redis state:
//! acked, pending with which delivery count, the dead-letter entry and its
//! fields), duplicates and a redelivery, a consumer process killed with
//! SIGKILL between its commit and its `XACK` (another takes the entry over
//! and replays), a stop in the middle of a read, Redis down and back, and
//! the whole path through an outbox relay with duplicates and kills,
//! reconciled.

mod end_to_end;
mod outage;
mod support;
mod table;
mod takeover;
