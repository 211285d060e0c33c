//! What the idempotency workspace's tests and bench share (never published).
//!
//! - The servers: their URLs from the environment ([`mysql_url`],
//!   [`pg_url`], [`redis_url`]), [`reach`] (starting a server once when it
//!   does not answer) and [`skip`]: an unreachable server skips a test with
//!   one printed line, or fails it under `IDEM_REQUIRE_SERVICES=1`.
//! - [`unique`] keys, so every test runs in parallel with the others.
//! - [`counters`]: the counters a test's code counted, through one global
//!   recorder (feature `metrics`).
//! - [`ManualClock`]: a clock the cron runner takes that moves only when the
//!   test moves it, and tells the test when the runners wait on it.
//! - What the shared Redis holds, read and forged by tests ([`redis_exists`],
//!   [`redis_cached_response`], [`redis_pause`], ...).
//! - [`servers`]: private `redis-server` processes and a Redis Cluster, for
//!   tests that kill, pause or spread Redis.
//! - [`backend`]: the contract the behaviour suite (`tests/suite/`) runs on,
//!   [`TestBackend`], implemented once per database.
//! - [`galera`]: a private three-node MariaDB Galera cluster; [`mariadb`]: a
//!   private MariaDB set up as a test needs (a one-node Galera too).
//! - [`kafka`]: a private Kafka-protocol broker (tansu).
//! - [`pgbouncer`]: a private PgBouncer in transaction pooling mode.
//! - [`example`]: one of the workspace's examples, run as a process
//!   (`tests/client_http.rs`, `tests/client_grpc.rs`).
//! - [`pg_cluster`]: a private PostgreSQL primary and streaming standby, and
//!   [`forwarder`]: a TCP path between clients and a server that a test can
//!   switch, cut and hold (`tests/failover/`), or silence once a client
//!   subscribes (`tests/suite/waits.rs`), that can put a distance between
//!   them (the overhead bench's rows 1 ms away), and count the round trips
//!   the clients make (`tests/suite/statements.rs`).
//! - [`soak`]: the fault-injection soak with reconciliation, and the storm
//!   (`tests/soak.rs`, `tests/cluster.rs`).
//! - [`nemesis`]: partitions on a schedule between engine processes and
//!   their servers, and the checker of the calls' history
//!   (`tests/nemesis.rs`).
//!
//! The features mirror the facade's (the root `Cargo.toml` forwards its own
//! to these): a backend's items exist when the tests were built for it.

pub mod backend;
#[cfg(feature = "metrics")]
pub mod counters;
#[cfg(feature = "cron")]
mod cron_clock;
pub mod example;
pub mod forwarder;
pub mod galera;
pub mod kafka;
pub mod logs;
pub mod mariadb;
#[cfg(all(feature = "redis", any(feature = "mysql", feature = "postgres")))]
pub mod nemesis;
pub mod pg_cluster;
#[cfg(feature = "postgres")]
pub mod pgbouncer;
mod redis_entries;
pub mod servers;
mod services;
#[cfg(feature = "redis")]
pub mod soak;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

pub use backend::TestBackend;
#[cfg(feature = "cron")]
pub use cron_clock::ManualClock;
#[cfg(feature = "redis")]
pub use redis_entries::{
    Location, redis_cached_response, redis_forget, redis_holds, redis_replace_result, redis_result,
};
pub use redis_entries::{
    redis_del, redis_exists, redis_pause, redis_pause_writes, redis_set, redis_unpause, redis_value_after,
};
pub use services::{mysql_url, pg_url, reach, redis_client, redis_url, services_required, skip};

/// A key nobody else uses: this process, this instant, a counter.
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    format!("{prefix}-{}-{nanos}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed))
}
