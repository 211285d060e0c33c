//! Run a write operation **once per business action**, however many times it
//! is delivered: double clicks, gateway retries, message redelivery, cron
//! jobs firing on several instances, webhooks called again.
//!
//! ```no_run
//! use idempotency::{Idem, idempotent};
//! use sqlx::{Sqlite, Transaction};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Receipt { order_id: u64, amount: i64 }
//!
//! #[derive(Debug)]
//! enum PayError { Idem(idempotency::Error), Db(sqlx::Error) }
//! impl From<idempotency::Error> for PayError { fn from(e: idempotency::Error) -> Self { PayError::Idem(e) } }
//! impl From<sqlx::Error> for PayError { fn from(e: sqlx::Error) -> Self { PayError::Db(e) } }
//!
//! #[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay")]
//! async fn pay(idem: &Idem<Sqlite>, tx: &mut Transaction<'_, Sqlite>, order_id: u64, amount: i64)
//!     -> Result<Receipt, PayError>
//! {
//!     sqlx::query("UPDATE orders SET status = 'PAID' WHERE id = ? AND status = 'PENDING'")
//!         .bind(order_id as i64)
//!         .execute(&mut **tx)
//!         .await?;
//!     Ok(Receipt { order_id, amount })
//! }
//!
//! # async fn demo() -> Result<(), PayError> {
//! let idem = Idem::sqlite_memory().await?;
//! let first = pay(&idem, 42, 1999).await?;   // runs the body
//! let again = pay(&idem, 42, 1999).await?;   // replays the stored result
//! # Ok(()) }
//! ```
//!
//! A service builds its engine once, at start-up, over its own pool
//! ([`Idem::builder`]; [`Idem::new`] without Redis), and runs
//! [`Idem::migrate`] before the first call: it creates the engine's tables
//! when absent (or the operator runs `idem migrate`). Without them every
//! call fails with [`Error::NotMigrated`], which says so.
//!
//! ```no_run
//! # #[cfg(all(feature = "mysql", feature = "redis"))]
//! # async fn start() -> Result<(), Box<dyn std::error::Error>> {
//! use idempotency::Idem;
//!
//! let pool = sqlx::MySqlPool::connect("mysql://root@127.0.0.1:3306/test").await?;
//! let redis = redis::Client::open("redis://127.0.0.1:6379")?; // optional: the fast path
//! let idem = Idem::builder(pool).redis(redis).build();
//! idem.migrate().await?; // at every start: creates the engine's tables if absent
//! // clone `idem` into your handlers, consumers and jobs: clones share the pool and Redis
//! # Ok(()) }
//! ```
//!
//! How one call goes, and what each layer decides:
//!
//! 1. The key is rendered from the template and checked
//!    (`[A-Za-z0-9_.:-]{1,255}`, else [`Error::InvalidKey`]); the arguments
//!    are fingerprinted (SHA-256 of a canonical JSON).
//! 2. With Redis ([`Builder::redis`], feature `redis`), the key is claimed
//!    with an owner token no other call holds. A finished call with the
//!    same fingerprint is replayed from Redis without a query; a running
//!    one answers [`Error::InProgress`]; another fingerprint,
//!    [`Error::KeyReused`].
//!    Without a claim, a duplicate of a call running on the same engine
//!    waits for it in memory (up to [`Builder::lock_wait`]) and takes its
//!    result; duplicates elsewhere meet at the unique index.
//! 3. A transaction opens; the body runs in it, and a row goes into
//!    `idem_record` — unique on the digest of `(biz_type, idem_key)`, the
//!    final truth —
//!    with the serialized result. Commit, then the result is cached in Redis.
//! 4. A body that returns `Err`, panics or is dropped rolls back: nothing is
//!    recorded, and the next call with the key executes. A fn marked
//!    `record_errors` records the errors its type declares final
//!    ([`BusinessError`]: "declined") like values, and replays them.
//!
//! Redis is an accelerator: down, slow or flushed, every guarantee holds
//! through the database; only speed is lost.
//!
//! A fn marked `join` runs inside a transaction its caller holds instead
//! (a savepoint around the body, the record committing with the caller),
//! and `#[idempotent]` works on methods of `#[async_trait]` impls.
//!
//! The attribute's reference is [`idempotent`]: a row for every argument
//! and parameter option (`#[idem(skip)]`, `#[idem(skip_if_default)]`), key
//! templates, durations, the return type, and the code it writes. The engine's settings are
//! on [`Builder`]. Until the crate is on docs.rs, `cargo doc -p idempotency
//! --open` (with the features you use, e.g. `--features mysql,redis,axum`)
//! renders this reference from a checkout.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use idempotency_macros::{State, idempotent};
#[cfg(feature = "amqp")]
pub use idempotency_runtime::amqp;
/// The consumer runners' shared builder ([`consumer::Consumer`]), settlement
/// vocabulary and error trait; each transport has its module (`amqp`,
/// `nats`, `redis_streams`, `kafka`).
#[cfg(any(feature = "amqp", feature = "nats", feature = "redis-streams", feature = "kafka"))]
pub use idempotency_runtime::consumer;
#[cfg(feature = "cron")]
pub use idempotency_runtime::cron;
/// gRPC glue for tonic (feature `tonic`): the key from `idempotency-key`
/// metadata, `idempotency::Error` as `tonic::Status`, replays marked in the
/// response metadata.
#[cfg(feature = "tonic")]
pub use idempotency_runtime::grpc;
/// HTTP glue: the key, token and principal rules and problem details for
/// any framework; adapters for axum (feature `axum`) and actix-web
/// (feature `actix`, `idempotency::http::actix`).
pub use idempotency_runtime::http;
#[cfg(feature = "kafka")]
pub use idempotency_runtime::kafka;
#[cfg(feature = "metrics")]
pub use idempotency_runtime::metrics;
#[cfg(feature = "nats")]
pub use idempotency_runtime::nats;
#[cfg(feature = "outbox")]
pub use idempotency_runtime::outbox;
#[cfg(feature = "redis-streams")]
pub use idempotency_runtime::redis_streams;
pub use idempotency_runtime::{
    Backend, Builder, BusinessError, DEFAULT_MAX_RESULT_BYTES, Error, Idem, InvalidNamespace, KeyError, LocalCache,
    Namespace, Outcome, Status, StoredJson, col, observe, state, transition,
};

/// Key rules, shared with entry points that take keys from outside
/// (e.g. an `Idempotency-Key` header). The attribute checks its templates
/// against the same rules at compile time.
pub mod key {
    pub use idempotency_runtime::key::{
        MAX_BIZ_NO_LEN, MAX_KEY_LEN, MIN_HEADER_KEY_LEN, key_digest, validate_biz_no, validate_header_key,
        validate_key, validate_text,
    };
}

/// Issued one-time tokens ([`Idem::tokens`]): the rules a token and its
/// subject follow, and why one is refused.
pub use idempotency_runtime::token;
pub use idempotency_runtime::{Consumption, IssuedToken, SpentToken, TokenError, Tokens};

/// Calls to outside services (`#[idempotent(..., steps)]`): phases, fencing,
/// recovery. The step context is [`Steps`].
pub use idempotency_runtime::steps;
pub use idempotency_runtime::{Failure, StepKey, Steps, StuckCall};

/// Not a stable API: where Redis keeps claims and cached results (the
/// tests read and forge them).
#[doc(hidden)]
#[cfg(feature = "redis")]
pub use idempotency_runtime::redis_layout;

/// Not a stable API: what the code written by `#[idempotent]` calls.
#[doc(hidden)]
pub mod __private {
    pub use idempotency_runtime::__private::*;
}
