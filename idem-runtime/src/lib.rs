//! The engine behind [`idem`](https://docs.rs/idem): key rule, fingerprints,
//! the duplicate gates (Redis claim, in-memory wait), the `idem_record`
//! store, and the single entry point the `#[idempotent]` attribute calls.
//! Use it through the `idem` crate.
//!
//! Calls go one way: entry point ([`__private::run`], or the adapters in
//! `http` and `amqp`) → call flow (`call`) → gate (`gate`) → record
//! protocol (`store::record`) → backend (`store::{sqlite, mysql, postgres}`).
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(not(any(feature = "sqlite", feature = "mysql", feature = "postgres")))]
compile_error!(
    "idem keeps its records in a database: enable at least one of the features `sqlite`, `mysql`, `postgres`"
);

#[cfg(feature = "amqp")]
pub mod amqp;
mod call;
mod clock;
#[cfg(any(feature = "amqp", feature = "nats"))]
mod consumer;
#[cfg(feature = "cron")]
pub mod cron;
mod engine;
mod error;
mod fingerprint;
#[cfg(fuzzing)]
mod fuzz;
mod gate;
#[cfg(feature = "axum")]
pub mod http;
pub mod key;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(not(feature = "metrics"))]
mod metrics;
mod namespace;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "outbox")]
pub mod outbox;
mod outcome;
mod random;
mod spec;
pub mod state;
mod status;
pub mod steps;
mod store;
pub mod token;

pub use engine::{Builder, Idem};
pub use error::{Error, KeyError};
pub use gate::local::LocalCache;
pub use key::MAX_BIZ_NO_LEN;
pub use namespace::{InvalidNamespace, Namespace};
pub use outcome::{Outcome, observe};
pub use status::Status;
pub use steps::{Failure, StepKey, Steps, StuckCall};
pub use store::Backend;
pub use token::{Consumption, IssuedToken, SpentToken, TokenError, Tokens};

/// Not a stable API: what the code written by `#[idempotent]` calls.
#[doc(hidden)]
pub mod __private {
    pub use crate::call::run;
    pub use crate::fingerprint::Fingerprint;
    pub use crate::spec::{Replayable, Spec, assert_replayable};
    pub use crate::steps::run_steps;
}

/// Not a stable API: the doors the fuzz targets in `fuzz/` open onto the
/// parsers of outside bytes; only in builds with `--cfg fuzzing`.
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod __fuzz {
    pub use crate::fuzz::*;
}
