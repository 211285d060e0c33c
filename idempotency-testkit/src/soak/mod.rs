//! The fault-injection soak and the storm, for `tests/soak.rs` and
//! `tests/cluster.rs`.
//!
//! A soak runs `calls` calls of one annotated fn over `keys` keys from
//! `tasks` tasks spread over several engines (one pool each) sharing one
//! Redis, while it injects body errors, panics, cancellations, Redis kills,
//! database connection kills and a lease shorter than a slow body. Then it
//! reconciles what callers saw with the three tables: orders (business),
//! payments (ledger) and `idem_record`.
//!
//! Keys: `calls - keys` calls repeat a key already used (30% with the
//! default sizes), half of them one of the last few keys (a concurrent
//! duplicate), half any earlier key (a late retry).
//!
//! The runs ([`soak()`], [`storm()`], [`distinct_keys`]) are generic over
//! [`SoakBackend`]: the soak's tables, tagged pools and connection killer of
//! one database; the statements that differ only in their text, and the
//! two annotated fns, are written once (`statements.rs`).

mod faults;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod reconcile;
mod report;
mod run;
mod schedule;
mod statements;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use idempotency::Idem;
use sqlx::{Pool, Transaction};

pub use faults::{INJECTED_PANIC, RedisSetup, Tag, quiet_injected_panics, redis_faults};
pub use reconcile::{CallEnd, KeyLog, Receipt, SoakError, Tables, Tally, reconcile};
pub use report::Report;
pub use run::{Ctx, Running, Storm, body, call, distinct_keys, engines, soak, storm};
#[cfg(any(feature = "mysql", feature = "postgres"))]
pub(crate) use schedule::seed_from_env;
pub use schedule::{Config, FIXED_SEEDS, Fault, Plan, Rng, fresh_seed, schedule};

use crate::TestBackend;

/// The business action every soak call performs.
pub const BIZ: &str = "soak_pay";
/// A call that has not answered after this long is a hang, not a fault.
const HANG: Duration = Duration::from_secs(60);
/// How long the slow bodies of the short-lease fn sleep (its lease: 50 ms).
const SLOW_BODY: Duration = Duration::from_millis(100);

/// A future a soak fn returns: boxed, as [`SoakBackend::pay`] picks one of
/// two annotated fns.
pub type PayFuture<'a> = Pin<Box<dyn Future<Output = Result<Receipt, SoakError>> + Send + 'a>>;

/// What the soak needs from one database beyond the suite's
/// [`TestBackend`]: its tables `soak_orders (run, k, status, paid)` and
/// `soak_payments (id, run, k, amount, exec)`, where the rows of one run
/// are found by `run` (and its `idem_record` rows by `idem_key LIKE
/// '<run>.%'`), pools whose connections the killer can find, the killer,
/// and the soak's annotated fns.
pub trait SoakBackend: TestBackend {
    /// Creates the soak's tables if missing (safe to run concurrently).
    fn create_tables(pool: &Pool<Self::Db>) -> impl Future<Output = ()> + Send;

    /// A pool of `size`; with a tag, its connections are marked so
    /// [`kill_one`](Self::kill_one) finds them. `None` when unreachable.
    fn open_tagged(tag: Option<Arc<Tag>>, size: u32) -> impl Future<Output = Option<Pool<Self::Db>>> + Send;

    /// Kills one tagged connection that is inside a transaction; whether one was.
    fn kill_one(admin: &Pool<Self::Db>, tag: &Tag, rng: &mut Rng) -> impl Future<Output = bool> + Send;

    /// Inserts `keys` pending orders `<run>.0 ..`.
    fn orders(pool: &Pool<Self::Db>, run: &str, keys: usize) -> impl Future<Output = ()> + Send;

    /// What the tables hold for `run`.
    fn tables(pool: &Pool<Self::Db>, run: &str) -> impl Future<Output = Tables> + Send;

    /// Deletes the run's rows (only after it reconciled: a failed run keeps
    /// them for a look).
    fn cleanup(pool: &Pool<Self::Db>, run: &str) -> impl Future<Output = ()> + Send;

    /// Sets the order `(run, k)` paid if it is pending; whether it was.
    fn pay_order(
        tx: &mut Transaction<'_, Self::Db>,
        run: &str,
        k: &str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Inserts a payment; its id.
    fn insert_payment(
        tx: &mut Transaction<'_, Self::Db>,
        run: &str,
        k: &str,
        amount: i64,
        exec: i64,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;

    /// One soak call of `plan` through the backend's annotated fn
    /// (`#[idempotent(key = "<k>", ttl = "1h", biz = "soak_pay")]` over
    /// [`body`]), or, with `plan.short_lease`, the same action through a
    /// claim that lives 50 ms: a slow body outlives it, and a duplicate may
    /// claim the key meanwhile.
    fn pay<'a>(idem: &'a Idem<Self::Db>, k: String, amount: i64, ctx: &'a Ctx, plan: Plan) -> PayFuture<'a> {
        if plan.short_lease {
            Box::pin(statements::pay_short_lease::<Self>(idem, k, amount, ctx, plan))
        } else {
            Box::pin(statements::pay::<Self>(idem, k, amount, ctx, plan))
        }
    }
}
