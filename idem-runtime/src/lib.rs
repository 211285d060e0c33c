//! The engine behind [`idem`](https://docs.rs/idem): key rule, fingerprints,
//! the Redis claim, the `idem_record` store, and the single entry point the
//! `#[idempotent]` attribute calls. Use it through the `idem` crate.
#![warn(missing_docs)]

#[cfg(not(any(feature = "sqlite", feature = "mysql", feature = "postgres")))]
compile_error!(
    "idem keeps its records in a database: enable at least one of the features `sqlite`, `mysql`, `postgres`"
);

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "redis")]
mod claim;
mod clock;
mod engine;
mod error;
pub mod fingerprint;
#[cfg(feature = "axum")]
pub mod http;
mod inflight;
pub mod key;
pub mod namespace;
pub mod outcome;
mod random;
mod status;
pub mod store;

pub use engine::{Builder, Idem, Replayable, Spec, assert_replayable, run};
pub use error::{Error, KeyError};
pub use fingerprint::Fingerprint;
pub use key::MAX_BIZ_NO_LEN;
pub use namespace::{InvalidNamespace, Namespace};
pub use outcome::{Outcome, observe};
pub use status::Status;
pub use store::Backend;
