//! The engine: one [`Idem`] per database (and optionally one Redis), shared
//! by every annotated fn, its [`Builder`], and the calls operators make on
//! it (`migrate`, `status`, `purge_expired`).

use std::sync::Arc;
use std::time::Duration;

use sqlx::Pool;

use crate::clock::Clock;
use crate::error::Error;
use crate::gate::Gate;
use crate::gate::local::LocalCache;
#[cfg(feature = "redis")]
use crate::gate::redis::{RedisGate, Target};
use crate::key::{validate_biz, validate_key};
use crate::namespace::Namespace;
use crate::status::Status;
use crate::store::record::Records;
use crate::store::{Backend, Db, Pooling};

#[cfg(feature = "outbox")]
pub(crate) mod outbox_waker;
pub(crate) mod read_first;
pub(crate) mod token_settings;

use read_first::ReadFirst;
use token_settings as token;

/// The idempotency engine for one database (and optionally one Redis).
/// Cheap to clone; clones share the pool and the Redis connection.
pub struct Idem<DB: Backend> {
    inner: Arc<Inner<DB>>,
}

struct Inner<DB: Backend> {
    db: Db<DB>,
    /// The database's clock, shared with the gate.
    clock: Arc<Clock>,
    gate: Gate,
    /// Which fns read their record before anything else (no claim held).
    read_first: ReadFirst,
    lock_wait: Duration,
    wait: Duration,
    max_result_bytes: usize,
    tokens: token::Settings,
    /// Wakes this engine's outbox relays when a call commits events.
    #[cfg(feature = "outbox")]
    outbox: outbox_waker::Waker,
}

impl<DB: Backend> Clone for Idem<DB> {
    fn clone(&self) -> Self {
        Self { inner: Arc::clone(&self.inner) }
    }
}

/// Lets the attribute take the engine as `Idem`, `&Idem` or `Arc<Idem>`.
impl<DB: Backend> AsRef<Idem<DB>> for Idem<DB> {
    fn as_ref(&self) -> &Idem<DB> {
        self
    }
}

impl<DB: Backend> std::fmt::Debug for Idem<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idem")
            .field("gate", &self.inner.gate)
            .field("lock_wait", &self.inner.lock_wait)
            .field("pooling", &self.inner.db.pooling)
            .finish_non_exhaustive()
    }
}

/// Configures an [`Idem`]; see [`Idem::builder`].
#[must_use]
pub struct Builder<DB: Backend> {
    pool: Pool<DB>,
    #[cfg(feature = "redis")]
    redis: Option<Target>,
    #[cfg(feature = "redis")]
    namespace: Option<Namespace>,
    #[cfg(feature = "redis")]
    redis_timeout: Duration,
    #[cfg(feature = "redis")]
    redis_hot_window: Duration,
    lock_wait: Duration,
    wait: Duration,
    max_result_bytes: usize,
    local_cache: Option<LocalCache>,
    tokens: token::Settings,
    pooling: Pooling,
}

/// The longest result (its JSON, in bytes) an engine records unless told
/// otherwise: 1 MiB, which every backend stores in one statement (MySQL's
/// and MariaDB's `max_allowed_packet` is 4 MiB or more by default, 16 MiB
/// on MariaDB 10.11; PostgreSQL and SQLite take far more), and which Redis
/// and the local cache keep without strain.
pub const DEFAULT_MAX_RESULT_BYTES: usize = 1 << 20;

impl<DB: Backend> Builder<DB> {
    /// Keeps finished results in this process too, checked before Redis, so
    /// a replay costs no round trip: bounded by entries and bytes, each
    /// entry answering at most until its record expires and at most
    /// [`LocalCache::max_age`] (how long a result removed elsewhere, say by
    /// an operator, may still be answered here). Off by default.
    pub fn local_cache(mut self, cache: LocalCache) -> Self {
        self.local_cache = Some(cache);
        self
    }

    /// Claims keys in this Redis before touching the database: concurrent
    /// duplicates are turned away and finished calls replayed without a
    /// query. Optional: without it every guarantee still holds.
    #[cfg(feature = "redis")]
    pub fn redis(mut self, client: redis::Client) -> Self {
        self.redis = Some(Target::Single(client));
        self
    }

    /// Like [`Builder::redis`], for a Redis Cluster. Every operation touches
    /// one key, so no hash tags are needed.
    #[cfg(feature = "redis")]
    pub fn redis_cluster(mut self, client: redis::cluster::ClusterClient) -> Self {
        self.redis = Some(Target::Cluster(Box::new(client)));
        self
    }

    /// The namespace every Redis key of this engine carries, in place of the
    /// one [`Idem::migrate`] keeps in the database. Engines whose records
    /// live in different databases must never share one (they would replay
    /// each other's results); every engine on one database must use the same.
    #[cfg(feature = "redis")]
    pub fn redis_namespace(mut self, namespace: Namespace) -> Self {
        self.namespace = Some(namespace);
        self
    }

    /// How long one Redis operation may take before the call carries on with
    /// the database alone. Default 500 ms.
    #[cfg(feature = "redis")]
    pub fn redis_timeout(mut self, timeout: Duration) -> Self {
        self.redis_timeout = timeout;
        self
    }

    /// How long Redis keeps a finished result for fast replays: between one
    /// and two of these (results are kept in one hash per window of this
    /// length, dropped a window after it ends), and never past its record's
    /// expiry; a result replayed in the window after its own is kept a
    /// window more. Redis then holds about `calls per second × 1.5 × hot
    /// window` results, whatever the records' ttl. A duplicate arriving
    /// later takes the claim and is answered from the record: its body runs
    /// in a transaction that rolls back when the record's insert meets the
    /// committed row. Default 10 minutes; at least 1 s.
    #[cfg(feature = "redis")]
    pub fn redis_hot_window(mut self, window: Duration) -> Self {
        self.redis_hot_window = window;
        self
    }

    /// Without a Redis claim, how long a call waits for a duplicate still
    /// running before answering `InProgress`. Default 5 s. A duplicate on
    /// this engine is waited for in memory, to the millisecond; one on
    /// another engine (another instance) on the record's unique index:
    /// PostgreSQL honours the bound to the millisecond, MariaDB in whole
    /// seconds (at least 1), and MySQL waits its `innodb_lock_wait_timeout`
    /// (it has no per-statement form). SQLite waits for its write lock at
    /// `BEGIN IMMEDIATE`, for the pool's busy timeout, and asks again until
    /// this bound has passed (so it waits at least the busy timeout, and
    /// past this bound by at most one); in `join`, where the transaction is
    /// the caller's, its connection's busy timeout alone. A two-phase call
    /// (`steps`) asks phase one again at doubling intervals (10 ms to
    /// 500 ms) until this bound. A call that waited in memory for a
    /// duplicate that then failed goes ahead as if first, and may wait once
    /// more on the database.
    pub fn lock_wait(mut self, wait: Duration) -> Self {
        self.lock_wait = wait;
        self
    }

    /// How long a duplicate of a running call waits for its answer before
    /// `InProgress`, for fns that do not say (`#[idempotent(.., wait =
    /// "5s")]` does). Default zero: a duplicate that meets a running call's
    /// Redis claim answers `InProgress` at once, to ask again later. With a
    /// wait it gets the running call's answer as soon as that ends (its
    /// value, or its recorded error), told by Redis (one connection per
    /// engine, no polling; a Redis Cluster's waiters ask again at doubling
    /// intervals), and goes ahead as a first call if that one failed. A
    /// double click, or a gateway's retry a moment later, then gets the
    /// same 200 instead of a 409. Without Redis a duplicate waits already,
    /// on this engine's running call in memory or, elsewhere, on the
    /// record's unique index (a two-phase call asking phase one again), for
    /// `lock_wait`, or this, whichever is longer (see
    /// [`lock_wait`](Builder::lock_wait) for SQLite). A waiting
    /// duplicate holds its request (and, without Redis, a connection) for
    /// up to this long.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// The longest result an annotated fn may record: its JSON, in bytes.
    /// A longer one is refused before anything commits
    /// ([`Error::ResultTooLarge`], which tells the caller not to retry): the
    /// body's writes roll back and nothing is recorded, so a retry runs the
    /// body again and fails the same way (unless its result shrank).
    /// Default [`DEFAULT_MAX_RESULT_BYTES`] (1 MiB). Raising it past what the
    /// database takes in one statement (MySQL's `max_allowed_packet`) makes
    /// those results fail at the database instead
    /// ([`Error::StorageRefused`]), after the body ran.
    pub fn max_result_bytes(mut self, max: usize) -> Self {
        self.max_result_bytes = max;
        self
    }

    /// How long a consumed [token](Idem::tokens) answers
    /// [`AlreadyUsed`](crate::Consumption::AlreadyUsed) to its subject (and
    /// so lets a resubmission reach the record that replays the first
    /// result). Default 24 h; never shorter than the token's own life.
    /// Keep it at most the `ttl` of the calls keyed by tokens: past its
    /// record's expiry, a resubmission let through would run again.
    pub fn token_used_for(mut self, window: Duration) -> Self {
        self.tokens.used_for = window;
        self
    }

    /// Consumes [tokens](Idem::tokens) in Redis with a Lua script (`GET`
    /// and `DEL` in one step) instead of `GETDEL`: for Redis before 6.2,
    /// which lacks `GETDEL`. Not needed to be safe there: a server that
    /// answers that `GETDEL` is unknown switches the engine to the script
    /// by itself. Both are atomic.
    #[cfg(feature = "redis")]
    pub fn token_consume_with_lua(self, lua: bool) -> Self {
        self.tokens.set_lua(lua);
        self
    }

    /// Builds the engine. Connects to nothing yet.
    pub fn build(self) -> Idem<DB> {
        let clock = Arc::new(Clock::new(DB::HAS_CLOCK));
        #[cfg(feature = "redis")]
        let gate = match self.redis {
            Some(target) => Gate::redis(RedisGate::new(
                target,
                self.redis_timeout,
                self.namespace,
                self.redis_hot_window,
                Arc::clone(&clock),
            )),
            None => Gate::memory(),
        };
        #[cfg(not(feature = "redis"))]
        let gate = Gate::memory();
        let gate = gate.with_local_cache(self.local_cache, &clock);
        Idem {
            inner: Arc::new(Inner {
                db: Db::new(self.pool, self.pooling),
                clock,
                gate,
                read_first: Default::default(),
                lock_wait: self.lock_wait,
                wait: self.wait,
                max_result_bytes: self.max_result_bytes,
                tokens: self.tokens,
                #[cfg(feature = "outbox")]
                outbox: outbox_waker::Waker::default(),
            }),
        }
    }
}

#[cfg(feature = "postgres")]
impl Builder<sqlx::Postgres> {
    /// Says the pool reaches PostgreSQL through a pooler in transaction
    /// mode (PgBouncer's `pool_mode = transaction`, RDS Proxy, Supavisor's
    /// transaction mode), which hands a client connection a server
    /// connection for one transaction at a time. Off by default: a direct
    /// connection, or a pooler in session mode.
    ///
    /// On, the engine keeps nothing in the server's session: its
    /// statements go unnamed (sqlx's `persistent(false)`), not as named
    /// prepared statements that another transaction's server connection
    /// lacks or holds with another client's SQL; and those outside a
    /// call's transaction (the plain reads of a busy key, of
    /// [`Idem::status`] and of the namespace, tokens without Redis, the
    /// steps mode's phase one and steps, purges) run in a transaction of
    /// their own, which keeps one server connection for both of sqlx's
    /// exchanges.
    /// Each such statement costs a round trip more (Parse and Describe,
    /// then Bind and Execute), and one outside a call two more again
    /// (`BEGIN`, `COMMIT`): leave it off without such a pooler.
    ///
    /// The body's own statements are the body's: behind such a pooler
    /// send each with `.persistent(false)` (or as `sqlx::raw_sql`), as
    /// `statement_cache_capacity(0)` does not do it. State transitions
    /// (`state::advance`) and outbox rows (`outbox::queue`) written in a
    /// body follow this switch. PostgreSQL only: MySQL and SQLite have no
    /// such pooler here. See `docs/scaling-out.md`.
    pub fn transaction_pooler(mut self, on: bool) -> Self {
        self.pooling = if on { Pooling::Transaction } else { Pooling::Session };
        self
    }
}

impl<DB: Backend> Idem<DB> {
    /// Starts configuring an engine over `pool`.
    pub fn builder(pool: Pool<DB>) -> Builder<DB> {
        Builder {
            pool,
            #[cfg(feature = "redis")]
            redis: None,
            #[cfg(feature = "redis")]
            namespace: None,
            #[cfg(feature = "redis")]
            redis_timeout: Duration::from_millis(500),
            #[cfg(feature = "redis")]
            redis_hot_window: crate::gate::redis::DEFAULT_HOT_WINDOW,
            lock_wait: Duration::from_secs(5),
            wait: Duration::ZERO,
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
            local_cache: None,
            tokens: token::Settings::default(),
            pooling: Pooling::Session,
        }
    }

    /// An engine over `pool` with no Redis.
    pub fn new(pool: Pool<DB>) -> Self {
        Self::builder(pool).build()
    }

    /// The pool the records (and bodies) use.
    pub fn pool(&self) -> &Pool<DB> {
        &self.inner.db.pool
    }

    /// The pool, and how the engine's statements reach it.
    pub(crate) fn db(&self) -> &Db<DB> {
        &self.inner.db
    }

    pub(crate) fn gate(&self) -> &Gate {
        &self.inner.gate
    }

    pub(crate) fn read_first(&self) -> &ReadFirst {
        &self.inner.read_first
    }

    pub(crate) fn lock_wait(&self) -> Duration {
        self.inner.lock_wait
    }

    /// The result's JSON as a call records it, or `ResultTooLarge`.
    pub(crate) fn check_result(&self, biz: &'static str, response: &str) -> Result<(), Error> {
        let max = self.inner.max_result_bytes;
        if response.len() > max { Err(Error::ResultTooLarge { biz, len: response.len(), max }) } else { Ok(()) }
    }

    pub(crate) fn token_settings(&self) -> &token::Settings {
        &self.inner.tokens
    }

    #[cfg(feature = "outbox")]
    pub(crate) fn outbox_waker(&self) -> &outbox_waker::Waker {
        &self.inner.outbox
    }

    pub(crate) fn records(&self) -> Records<'_, DB> {
        Records { db: &self.inner.db, lock_wait: self.inner.lock_wait, clock: &self.inner.clock }
    }

    /// How long a duplicate of a call of `spec` waits for the running one:
    /// its own `wait`, else the engine's.
    pub(crate) fn wait_for(&self, spec: &crate::spec::Spec) -> Duration {
        spec.wait.unwrap_or(self.inner.wait)
    }

    /// The record table as a call of `spec` sees it: a duplicate waits on
    /// the unique index for `lock_wait`, or the call's `wait` if longer.
    pub(crate) fn records_for(&self, spec: &crate::spec::Spec) -> Records<'_, DB> {
        Records { lock_wait: self.inner.lock_wait.max(self.wait_for(spec)), ..self.records() }
    }

    /// The database's clock, as this engine reads it (see [`crate::clock`]).
    /// Read it after [`Idem::now_ms`] (or another `ready`) made it the
    /// database's.
    pub(crate) fn clock(&self) -> &Arc<Clock> {
        &self.inner.clock
    }

    /// Now on the database's clock, in Unix epoch milliseconds: waits for
    /// the engine's first reading of it, and starts a fresh reading in the
    /// background when one is due; otherwise no round trip.
    pub(crate) async fn now_ms(&self) -> i64 {
        self.clock_ready().await;
        self.inner.clock.now_ms()
    }

    /// Makes sure the engine's time is the database's (see
    /// [`now_ms`](Self::now_ms)), without reading it: for a call, which
    /// reads it only if it writes.
    pub(crate) async fn clock_ready(&self) {
        self.inner.clock.ready(&self.inner.db.pool).await;
    }

    /// Creates the `idem_record` table and its indexes if absent, and
    /// `idem_meta`, where a database without a namespace gets a new random
    /// one (see [`Idem::redis_namespace`]). With the feature `outbox`, also
    /// `idem_outbox` (see the `outbox` module).
    pub async fn migrate(&self) -> Result<(), Error> {
        DB::migrate(&self.inner.db, Namespace::generate().as_str()).await?;
        self.inner.clock.measure(&self.inner.db.pool).await;
        #[cfg(feature = "outbox")]
        DB::outbox_migrate(&self.inner.db).await?;
        // Calls to outside services (`steps`): `idem_call`, `idem_step`.
        DB::call_migrate(&self.inner.db).await?;
        // A database dropped and re-created under a running engine has a new one.
        self.inner.gate.forget_namespace();
        Ok(())
    }

    /// The namespace this engine's Redis keys carry
    /// (`idem:{<namespace>.<shard>}:...`): the one set on the builder, else
    /// the one [`Idem::migrate`] recorded in the database (`None` before
    /// it ran). Without a namespace the engine leaves Redis alone and
    /// works on the database alone.
    pub async fn redis_namespace(&self) -> Result<Option<Namespace>, Error> {
        #[cfg(feature = "redis")]
        if let Some(namespace) = self.inner.gate.fixed_namespace() {
            return Ok(Some(namespace));
        }
        let recorded = DB::namespace(&self.inner.db).await.map_err(Error::from_store)?;
        Ok(recorded.and_then(|text| Namespace::new(&text).ok()))
    }

    /// Deletes up to `limit` expired records; returns how many. Run it
    /// periodically to keep the table bounded.
    pub async fn purge_expired(&self, limit: u32) -> Result<u64, Error> {
        let now = self.now_ms().await;
        DB::purge_expired(&self.inner.db, now, i64::from(limit)).await.map_err(Error::from_store)
    }

    /// Where the call `(biz, key)` stands: the query behind "in progress,
    /// ask again later". The database answers first (it is the truth);
    /// a running call is seen through its Redis claim.
    pub async fn status(&self, biz: &str, key: &str) -> Result<Status, Error> {
        validate_biz(biz)?;
        validate_key(key)?;
        let now = self.now_ms().await;
        let recorded = match self.records().read(biz, key).await? {
            Some(row) if row.is_live(now) => {
                let failed = row.answer().is_some_and(|(_, failed)| failed);
                let stored = row.response.unwrap_or_default();
                return Ok(if failed {
                    Status::Failed { error: stored }
                } else {
                    Status::Completed { response: stored }
                });
            }
            row => row.is_some(),
        };
        Ok(match (self.inner.gate.is_running(&self.inner.db, biz, key).await, recorded) {
            (true, _) => Status::InProgress,
            (false, true) => Status::Expired,
            (false, false) => Status::Absent,
        })
    }
}

#[cfg(feature = "sqlite")]
impl Idem<sqlx::Sqlite> {
    /// An engine over a private in-memory SQLite database, migrated: the
    /// embedded default for examples and tests. One connection, so the
    /// database lives as long as the engine.
    pub async fn sqlite_memory() -> Result<Self, Error> {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect("sqlite::memory:")
            .await?;
        let idem = Self::new(pool);
        idem.migrate().await?;
        Ok(idem)
    }
}
