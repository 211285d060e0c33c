//! Partitions on a schedule, checked by a history (`tests/nemesis.rs`),
//! in the way of Jepsen's nemeses and checkers, with real servers on this
//! machine only.
//!
//! Several engine processes (children of the test: the test binary run
//! again, `child`) each have their own `Idem` over one private database
//! and one private `redis-server`, and reach both through TCP proxies of
//! the parent's ([`proxy`]), one per process and path. They call one
//! annotated fn whose body pays an order and writes a ledger row in the
//! call's transaction; the keys overlap across processes ([`calls`]).
//! Meanwhile the nemesis (`cuts`) follows a seeded schedule ([`Lane`]):
//! it black-holes, delays, loses the replies of, or resets the paths of
//! one, several or all processes to Redis and to the database, and heals
//! them. Every call is appended to its process's history (key, arguments,
//! answer, start and end on the machine's clock, [`history`]); the
//! [`checker`] holds the history and the nemesis's windows against the
//! final tables. [`run()`] does it all and prints the counts of every
//! nemesis event and every answer ([`Summary`]).

pub mod checker;
mod child;
mod children;
mod cuts;
pub mod history;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
pub mod proxy;
mod report;
mod run;
mod schedule;

use std::time::Duration;

use sqlx::Pool;

pub use checker::{Bounds, Verdict, check};
pub use child::{LEASE, child_process};
pub use history::{Answer, Call, Window};
pub use report::Summary;
pub use run::run;
pub use schedule::{Config, Cut, DELAY, Event, Lane, Path, RETRIES, calls};

use crate::soak::SoakBackend;

/// How long an engine process's call waits for a pooled connection.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the nemesis needs from a database beyond the soak's: where the
/// server listens (the proxies forward there), and a pool that reaches one
/// of its databases through a proxy.
pub trait NemesisBackend: SoakBackend {
    /// The server's host and port, from its URL.
    fn server() -> (String, u16);

    /// A pool of `size` on `database`, reached at `127.0.0.1:port`; it
    /// connects when first used.
    fn pool_via(port: u16, database: &str, size: u32) -> Pool<Self::Db>;
}
