//! The behaviour suite every database target runs (`tests/sqlite.rs`,
//! `tests/mysql.rs`, `tests/postgres.rs`), one module per theme. A target
//! declares `mod suite;` and names its backend once:
//!
//! ```ignore
//! mod suite;
//! type SuiteBackend = idempotency_testkit::backend::MySql;
//! ```
//!
//! Everything the suite needs from a database (its sqlx type, SQL in its
//! placeholders, opening and dropping databases, a dead pool, whether it
//! has one writer) is that type's [`TestBackend`] impl, reached here as
//! [`B`]; the annotated fns are written against [`Db`], its sqlx database.
//! Every test uses its own keys, so all run in parallel.

pub(crate) mod fixture;

mod answers;
mod deadlocks;
mod deploy_results;
mod deploy_signature;
mod early_begin;
mod expiry;
mod failure_log;
mod failures;
mod joined;
mod joined_races;
mod keys;
mod leases;
mod namespaces;
mod read_first;
mod recorded_errors;
mod redis_faults;
mod replay;
mod riding;
mod statements;
mod status;
mod storms;
mod trait_methods;
mod unbounded;
mod upgrade;
mod waits;

use idempotency_testkit::TestBackend;

/// The target's backend (see the module docs).
pub(crate) use crate::SuiteBackend as B;

/// The target's sqlx database.
pub(crate) type Db = <B as TestBackend>::Db;
