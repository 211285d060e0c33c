//! The engine behind [`idempotency`](https://docs.rs/idempotency): key rule, fingerprints,
//! the duplicate gates (Redis claim, in-memory wait), the `idem_record`
//! store, and the single entry point the `#[idempotent]` attribute calls.
//! Use it through the `idempotency` crate.
//!
//! Calls go one way: entry point ([`__private::run`], or the adapters in
//! `http`, `grpc` and `consumer`) → call flow (`call`) → gate (`gate`) → record
//! protocol (`store::record`) → backend (`store::{sqlite, mysql, postgres}`).
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(not(any(feature = "sqlite", feature = "mysql", feature = "postgres")))]
compile_error!(
    "idem keeps its records in a database: enable at least one of the features `sqlite`, `mysql`, `postgres`"
);

mod business_error;
mod call;
mod clock;
#[cfg(any(feature = "amqp", feature = "nats", feature = "redis-streams", feature = "kafka"))]
pub mod consumer;
#[cfg(feature = "cron")]
pub mod cron;
mod engine;
mod error;
mod failure_log;
mod fingerprint;
#[cfg(fuzzing)]
mod fuzz;
mod gate;
#[cfg(feature = "tonic")]
pub mod grpc;
pub mod http;
pub mod key;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(not(feature = "metrics"))]
mod metrics;
mod namespace;
#[cfg(feature = "outbox")]
pub mod outbox;
mod outcome;
mod prebuilt;
mod random;
mod retention;
mod spec;
pub mod state;
mod status;
pub mod steps;
mod store;
mod stored_json;
pub mod token;

pub use business_error::BusinessError;
// The consumer runners live in one folder around their shared core; each
// transport is also reachable at the root.
#[cfg(feature = "amqp")]
pub use consumer::amqp;
#[cfg(feature = "kafka")]
pub use consumer::kafka;
#[cfg(feature = "nats")]
pub use consumer::nats;
#[cfg(feature = "redis-streams")]
pub use consumer::redis_streams;
pub use engine::{Builder, DEFAULT_MAX_RESULT_BYTES, Idem};
pub use error::{Error, KeyError};
pub use gate::local::LocalCache;
pub use key::MAX_BIZ_NO_LEN;
pub use namespace::{InvalidNamespace, Namespace};
pub use outcome::{Outcome, observe};
pub use status::Status;
pub use steps::{Failure, StepKey, Steps, StuckCall};
pub use store::Backend;
pub use stored_json::StoredJson;
pub use token::{Consumption, IssuedToken, SpentToken, TokenError, Tokens};

/// Not a stable API: where Redis keeps claims and cached results, for the
/// `idem` tool and the tests, which read and forge them.
#[doc(hidden)]
#[cfg(feature = "redis")]
pub mod redis_layout {
    use crate::gate::redis::layout;
    use crate::namespace::{InvalidNamespace, Namespace};

    /// Where one `(biz, key)` of a namespace lives in Redis.
    #[derive(Debug, Clone)]
    pub struct Location {
        /// The claim's key (a string: `p:<owner>:<fingerprint>` while a call runs).
        pub claim: String,
        /// The call's field in the result hashes.
        pub field: [u8; 16],
        /// What the result hashes of the call's shard are named: this, then the window.
        pub results_prefix: String,
    }

    /// Where `(biz, key)` lives in `namespace`.
    pub fn locate(namespace: &str, biz: &str, key: &str) -> Result<Location, InvalidNamespace> {
        let place = layout::Place::of(&Namespace::new(namespace)?, biz, key);
        let results = place.results(0);
        let results_prefix = results[..results.len() - 1].to_owned();
        Ok(Location { claim: place.claim, field: place.field, results_prefix })
    }

    /// A cached result's bytes read back: its record's expiry (epoch ms),
    /// its fingerprint's first 16 bytes in hex, and the response.
    pub fn parse_result(value: Vec<u8>) -> Option<(i64, String, String)> {
        layout::parse_result(value).map(|r| (r.expires_ms, r.fingerprint_prefix_hex().as_str().to_owned(), r.response))
    }

    /// The bytes a result hash keeps for a finished call.
    pub fn result_value(expires_ms: i64, fingerprint: &str, response: &str) -> Vec<u8> {
        layout::result_value(expires_ms, fingerprint, response, false)
    }

    /// A claim's value, with a fresh owner token.
    pub fn claim_value(fingerprint: &str) -> String {
        layout::claim_value(fingerprint)
    }
}

/// Not a stable API: what the code written by `#[idempotent]` calls.
#[doc(hidden)]
pub mod __private {
    pub use crate::call::joined::run_joined;
    pub use crate::call::run;
    pub use crate::call::typed::{Body, Replayable};
    pub use crate::fingerprint::Fingerprint;
    pub use crate::key::render;
    pub use crate::prebuilt::flows as prebuilt_flows;
    pub use crate::spec::Spec;
    pub use crate::steps::run_steps;
}

/// Not a stable API: the doors the fuzz targets in `fuzz/` open onto the
/// parsers of outside bytes; only in builds with `--cfg fuzzing`.
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod __fuzz {
    pub use crate::fuzz::*;
}
