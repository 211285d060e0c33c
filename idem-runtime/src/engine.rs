//! The engine: one [`Idem`] per database, shared by every annotated fn, and
//! [`run`], the single entry point the `#[idempotent]` attribute calls.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::{Pool, Transaction};
use tracing::Instrument;

#[cfg(feature = "redis")]
use crate::claim::{self, Claim, Claims, Held, Target};
use crate::clock;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::inflight::{Entered, InFlight};
use crate::key::{validate_biz, validate_biz_no, validate_key};
use crate::namespace::Namespace;
use crate::outcome::{self, Outcome};
use crate::status::Status;
use crate::store::{Backend, Failure, NewRecord, PROCESSING, SUCCEEDED, StoredRecord};

/// How many attempts a deadlock or serialization failure before the body
/// runs gets: the first and two retries.
const CONFLICT_ATTEMPTS: u32 = 3;

/// What one annotated fn declares; built by the attribute at compile time.
#[doc(hidden)]
#[derive(Debug)]
pub struct Spec {
    /// The business action, `[a-z0-9_]{1,32}`.
    pub biz: &'static str,
    /// How long the record protects the key.
    pub ttl: Duration,
    /// How long a Redis claim lives while the body runs.
    pub lease: Duration,
}

/// The idempotency engine for one database (and optionally one Redis).
/// Cheap to clone; clones share the pool and the Redis connection.
pub struct Idem<DB: Backend> {
    inner: Arc<Inner<DB>>,
}

struct Inner<DB: Backend> {
    pool: Pool<DB>,
    #[cfg(feature = "redis")]
    claims: Option<Arc<Claims>>,
    #[cfg(feature = "redis")]
    namespace: NamespaceSlot,
    lock_wait: Duration,
    in_flight: InFlight,
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
        let mut d = f.debug_struct("Idem");
        #[cfg(feature = "redis")]
        d.field("redis", &self.inner.claims);
        d.field("lock_wait", &self.inner.lock_wait).finish_non_exhaustive()
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
    redis_timeout: Duration,
    lock_wait: Duration,
}

impl<DB: Backend> Builder<DB> {
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
    pub fn redis_timeout(mut self, timeout: Duration) -> Self {
        self.redis_timeout = timeout;
        self
    }

    /// Without a Redis claim, how long a call waits for a duplicate still
    /// running before answering `InProgress`. Default 5 s. A duplicate on
    /// this engine is waited for in memory, to the millisecond; one on
    /// another engine (another instance) on the record's unique index:
    /// PostgreSQL honours the bound to the millisecond, MariaDB in whole
    /// seconds (at least 1); SQLite uses the pool's busy timeout, and MySQL
    /// its `innodb_lock_wait_timeout` (it has no per-statement form). A call
    /// that waited in memory for a duplicate that then failed goes ahead as
    /// if first, and may wait once more on the database.
    pub fn lock_wait(mut self, wait: Duration) -> Self {
        self.lock_wait = wait;
        self
    }

    /// Builds the engine. Connects to nothing yet.
    pub fn build(self) -> Idem<DB> {
        #[cfg(feature = "redis")]
        let claims = self.redis.map(|target| Arc::new(Claims::new(target, self.redis_timeout)));
        Idem {
            inner: Arc::new(Inner {
                pool: self.pool,
                #[cfg(feature = "redis")]
                claims,
                #[cfg(feature = "redis")]
                namespace: NamespaceSlot::new(self.namespace),
                lock_wait: self.lock_wait,
                in_flight: InFlight::default(),
            }),
        }
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
            redis_timeout: Duration::from_millis(500),
            lock_wait: Duration::from_secs(5),
        }
    }

    /// An engine over `pool` with no Redis.
    pub fn new(pool: Pool<DB>) -> Self {
        Self::builder(pool).build()
    }

    /// The pool the records (and bodies) use.
    pub fn pool(&self) -> &Pool<DB> {
        &self.inner.pool
    }

    /// Creates the `idem_record` table and its indexes if absent, and
    /// `idem_meta`, where a database without a namespace gets a new random
    /// one (see [`Idem::redis_namespace`]).
    pub async fn migrate(&self) -> Result<(), Error> {
        DB::migrate(&self.inner.pool, Namespace::generate().as_str()).await?;
        // A database dropped and re-created under a running engine has a new one.
        #[cfg(feature = "redis")]
        self.inner.namespace.forget();
        Ok(())
    }

    /// The namespace this engine's Redis keys carry
    /// (`idem:<namespace>:<biz>:<key>`): the one set on the builder, else
    /// the one [`Idem::migrate`] recorded in the database (`None` before
    /// it ran). Without a namespace the engine leaves Redis alone and
    /// works on the database alone.
    pub async fn redis_namespace(&self) -> Result<Option<Namespace>, Error> {
        #[cfg(feature = "redis")]
        if let Some(namespace) = self.inner.namespace.fixed() {
            return Ok(Some(namespace));
        }
        let recorded = DB::namespace(&self.inner.pool).await?;
        Ok(recorded.and_then(|text| Namespace::new(&text).ok()))
    }

    /// Deletes up to `limit` expired records; returns how many. Run it
    /// periodically to keep the table bounded.
    pub async fn purge_expired(&self, limit: u32) -> Result<u64, Error> {
        DB::purge_expired(&self.inner.pool, now_ms(), i64::from(limit)).await.map_err(Error::Storage)
    }

    /// Where the call `(biz, key)` stands: the query behind "in progress,
    /// ask again later". The database answers first (it is the truth);
    /// a running call is seen through its Redis claim.
    pub async fn status(&self, biz: &str, key: &str) -> Result<Status, Error> {
        validate_biz(biz)?;
        validate_key(key)?;
        let recorded = match DB::lookup(&self.inner.pool, biz, key).await? {
            Some(row) if row.is_live(now_ms()) => {
                return Ok(Status::Completed { response: row.response.unwrap_or_default() });
            }
            row => row.is_some(),
        };
        Ok(match (self.is_claimed(biz, key).await, recorded) {
            (true, _) => Status::InProgress,
            (false, true) => Status::Expired,
            (false, false) => Status::Absent,
        })
    }

    #[cfg(feature = "redis")]
    async fn is_claimed(&self, biz: &str, key: &str) -> bool {
        let Some(claims) = &self.inner.claims else { return false };
        match self.inner.namespace.get(&self.inner.pool).await {
            Some(namespace) => matches!(claims.peek(&namespace, biz, key).await, Claim::Running),
            None => false,
        }
    }

    #[cfg(not(feature = "redis"))]
    async fn is_claimed(&self, _biz: &str, _key: &str) -> bool {
        false
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

/// Why a call did not return a value.
enum Failed<E> {
    Idem(Error),
    Body(E),
}

impl<E> From<Error> for Failed<E> {
    fn from(e: Error) -> Self {
        Failed::Idem(e)
    }
}

/// A finished call: its value and whether it ran now or was replayed.
struct Done<T> {
    value: T,
    outcome: Outcome,
}

/// What an `#[idempotent]` fn must return: its value is stored and replayed.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be stored and replayed by #[idempotent]",
    label = "the return type must be `Result<T, E>` with `T: Serialize + DeserializeOwned` and `E: From<idem::Error>`"
)]
pub trait Replayable {}

impl<T: Serialize + DeserializeOwned, E: From<Error>> Replayable for Result<T, E> {}

/// Puts the requirements on the return type where the user wrote it.
#[doc(hidden)]
pub fn assert_replayable<R: Replayable>() {}

/// Runs `body` once per `(spec.biz, key)`; the code the attribute writes
/// calls this. `body` gets the transaction the record is written in and
/// hands it back with its result.
#[doc(hidden)]
pub async fn run<DB, T, E, F, Fut>(
    engine: &Idem<DB>,
    spec: &'static Spec,
    key: String,
    fingerprint: Fingerprint,
    biz_no: Option<String>,
    body: F,
) -> Result<T, E>
where
    DB: Backend,
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: FnOnce(Transaction<'static, DB>) -> Fut,
    Fut: Future<Output = (Transaction<'static, DB>, Result<T, E>)>,
{
    let checked = validate_key(&key);
    // A rejected key is not logged: it may hold anything the caller sent.
    let shown_key = if checked.is_ok() { key.as_str() } else { "<invalid>" };
    let span = tracing::info_span!("idem", biz = spec.biz, key = shown_key, outcome = tracing::field::Empty);
    let result = match checked {
        Ok(()) => call(engine, spec, &key, fingerprint, biz_no.as_deref(), body).instrument(span.clone()).await,
        Err(e) => Err(e.into()),
    };
    let outcome = match &result {
        Ok(done) => done.outcome,
        Err(Failed::Idem(Error::InProgress { .. })) => Outcome::InProgress,
        Err(Failed::Idem(Error::KeyReused { .. })) => Outcome::KeyReused,
        Err(Failed::Idem(
            Error::InvalidKey(_)
            | Error::InvalidBiz
            | Error::BizNoTooLong { .. }
            | Error::Replay { .. }
            | Error::Serialize(_)
            | Error::NonFiniteFloat { .. },
        )) => Outcome::Rejected,
        Err(_) => Outcome::Failed,
    };
    span.record("outcome", outcome.as_str());
    outcome::report(outcome);
    match result {
        Ok(done) => Ok(done.value),
        Err(Failed::Idem(e)) => Err(E::from(e)),
        Err(Failed::Body(e)) => Err(e),
    }
}

/// The call, its key already checked.
async fn call<DB, T, E, F, Fut>(
    engine: &Idem<DB>,
    spec: &'static Spec,
    key: &str,
    fingerprint: Fingerprint,
    biz_no: Option<&str>,
    body: F,
) -> Result<Done<T>, Failed<E>>
where
    DB: Backend,
    T: Serialize + DeserializeOwned,
    F: FnOnce(Transaction<'static, DB>) -> Fut,
    Fut: Future<Output = (Transaction<'static, DB>, Result<T, E>)>,
{
    if let Some(no) = biz_no {
        validate_biz_no(no)?;
    }
    let fingerprint = fingerprint.finish()?;
    let call = Call { spec, key, fingerprint: &fingerprint, biz_no };

    #[cfg(feature = "redis")]
    let claims = match &engine.inner.claims {
        // Without a namespace (the database was never migrated) Redis could
        // mix this store's keys with another's: the database alone decides.
        Some(claims) => engine.inner.namespace.get(&engine.inner.pool).await.map(|ns| (claims, ns)),
        None => None,
    };
    #[cfg(feature = "redis")]
    let claim = match claims {
        None => None,
        Some((claims, namespace)) => match claims.claim(&namespace, spec.biz, key, &fingerprint, spec.lease).await {
            Claim::Acquired(held) => Some(ClaimGuard { claims: Arc::clone(claims), held: Some(held) }),
            Claim::Done { fingerprint: stored, response } => {
                let value = call.replay(&stored, &response)?;
                return Ok(Done { value, outcome: Outcome::Replayed });
            }
            Claim::Running => {
                // A call that committed but whose cache write has not landed
                // yet (or whose process died right after its commit) is
                // already in the record: answer from there.
                return match find_live(&engine.inner, &call).await? {
                    Some(row) => replay_row(&call, row).map(|r| Done { value: r.value, outcome: Outcome::Replayed }),
                    None => Err(call.in_progress().into()),
                };
            }
            Claim::Unavailable => None,
        },
    };
    #[cfg(not(feature = "redis"))]
    let claim: Option<ClaimGuard> = None;

    // Without a claim, a duplicate running in this process is waited for
    // here rather than on the unique index: the same wait, bounded alike.
    let first = match claim {
        Some(_) => None,
        None => match engine.inner.in_flight.enter(spec.biz, key, engine.inner.lock_wait).await {
            Entered::First(first) => Some(first),
            Entered::Answered(shared) => {
                let value = call.replay(&shared.fingerprint, &shared.response)?;
                return Ok(Done { value, outcome: Outcome::Replayed });
            }
            Entered::Busy => return Err(call.in_progress().into()),
        },
    };

    let recorded = match transact(&engine.inner, &call, claim.is_some(), body).await {
        Ok(recorded) => recorded,
        Err(e) => {
            if let Some(mut guard) = claim {
                guard.release().await;
            }
            return Err(e);
        }
    };
    // The stored result goes on: to the duplicates waiting here, or to Redis
    // in place of our claim (never both: waiting here means no claim).
    if let Some(first) = first {
        first.finish(fingerprint, recorded.response);
    } else if let Some(mut guard) = claim {
        guard.finish(&fingerprint, &recorded.response, recorded.expires_ms);
    }
    Ok(Done { value: recorded.value, outcome: recorded.outcome })
}

/// One call's identity, borrowed for the length of the call.
struct Call<'a> {
    spec: &'static Spec,
    key: &'a str,
    fingerprint: &'a str,
    biz_no: Option<&'a str>,
}

impl Call<'_> {
    fn record<'r>(&'r self, status: i16, response: Option<&'r str>) -> NewRecord<'r> {
        let now = now_ms();
        NewRecord {
            biz: self.spec.biz,
            key: self.key,
            biz_no: self.biz_no,
            params_hash: self.fingerprint,
            status,
            response,
            now_ms: now,
            expires_ms: now.saturating_add(i64::try_from(self.spec.ttl.as_millis()).unwrap_or(i64::MAX)),
        }
    }

    fn replay<T: DeserializeOwned>(&self, stored_fingerprint: &str, response: &str) -> Result<T, Error> {
        if stored_fingerprint != self.fingerprint {
            return Err(Error::KeyReused { biz: self.spec.biz, key: self.key.to_owned() });
        }
        serde_json::from_str(response).map_err(|source| Error::Replay {
            biz: self.spec.biz,
            key: self.key.to_owned(),
            source,
        })
    }

    fn in_progress(&self) -> Error {
        Error::InProgress { biz: self.spec.biz, key: self.key.to_owned() }
    }
}

/// The database part of a call, done: the value, its stored form, and when
/// the record expires.
struct Recorded<T> {
    value: T,
    response: String,
    expires_ms: i64,
    outcome: Outcome,
}

/// Layer 3: the record and the body in one transaction.
///
/// Without a claim the record goes in first, so a duplicate blocks on the
/// unique index before its body runs. With a claim, duplicates are already
/// kept out, so the record goes in last, response included, in one statement;
/// the unique index still arbitrates if the lease ran out meanwhile.
async fn transact<DB, T, E, F, Fut>(
    inner: &Inner<DB>,
    call: &Call<'_>,
    claimed: bool,
    body: F,
) -> Result<Recorded<T>, Failed<E>>
where
    DB: Backend,
    T: Serialize + DeserializeOwned,
    F: FnOnce(Transaction<'static, DB>) -> Fut,
    Fut: Future<Output = (Transaction<'static, DB>, Result<T, E>)>,
{
    let mut attempt = 0;
    let tx = loop {
        attempt += 1;
        let opened =
            if claimed { DB::begin(&inner.pool).await } else { DB::begin_bounded(&inner.pool, inner.lock_wait).await };
        // SQLite waits for its write lock at `BEGIN IMMEDIATE`.
        let mut tx = opened.map_err(|e| db_error::<DB, E>(call, e))?;
        if claimed {
            break tx;
        }
        let record = call.record(PROCESSING, None);
        let inserted = match insert_record(&mut tx, call, &record, Some(inner.lock_wait)).await {
            Ok(Taken::No) => DB::end_bound(&mut tx).await.map(|()| Taken::No),
            other => other,
        };
        match inserted {
            Ok(Taken::No) => break tx,
            Ok(Taken::By(row)) => {
                rollback(tx).await;
                return replay_row(call, row);
            }
            Err(e) => {
                rollback(tx).await;
                match DB::classify(&e) {
                    Failure::Conflict if attempt < CONFLICT_ATTEMPTS => continue,
                    _ => return Err(db_error::<DB, E>(call, e)),
                }
            }
        }
    };

    let (tx, result) = body(tx).await;
    let value = match result {
        Ok(value) => value,
        Err(e) => {
            rollback(tx).await;
            // A body can fail on what a duplicate left (its lease ran out, or
            // Redis lost the cached result, and it paid the order first), or
            // lose a deadlock against a duplicate that takes its locks in the
            // other order (one with a claim writes the record last, one without
            // first). If that duplicate committed, its result is the answer.
            return match settle(inner, call).await {
                Settled::Replay(row) => replay_row(call, row),
                Settled::Busy | Settled::Unknown => Err(Failed::Body(e)),
            };
        }
    };
    let (value, response) = match stored_form(&value) {
        Ok(stored) => stored,
        Err(e) => {
            rollback(tx).await;
            return Err(Error::Serialize(e).into());
        }
    };

    let record = call.record(SUCCEEDED, Some(&response));
    let expires_ms = record.expires_ms;
    let failure = match commit_record(tx, call, &record, claimed).await {
        Ok(None) => return Ok(Recorded { value, response, expires_ms, outcome: Outcome::Executed }),
        // The lease ran out and a duplicate finished first: ours is undone.
        Ok(Some(row)) => return replay_row(call, row),
        Err(e) => e,
    };
    // Our transaction is gone. If a duplicate won the conflict (or our own
    // commit landed and only its answer was lost), the committed result is
    // the answer; otherwise the call may be retried: it executes, or
    // replays whatever did commit.
    match settle(inner, call).await {
        Settled::Replay(row) => replay_row(call, row),
        Settled::Busy => Err(call.in_progress().into()),
        Settled::Unknown => Err(db_error::<DB, E>(call, failure)),
    }
}

/// What [`settle`] found.
enum Settled {
    /// A committed, live row holds the key.
    Replay(StoredRecord),
    /// A duplicate still holds the key past `lock_wait`.
    Busy,
    /// Nothing committed, or the database could not tell.
    Unknown,
}

/// After a failure once the body has run: the committed row of the key, if
/// any. Asked the way a call without a claim asks before its body (insert
/// the record in a transaction of its own, rolled back), so it waits for a
/// duplicate still committing, such as the winner of a deadlock with us;
/// a plain read right after our rollback could miss it. Bounded by
/// `lock_wait` on the key, and twice that in all: a database in trouble
/// must not hold back the call's own error for a pool's whole wait.
async fn settle<DB: Backend>(inner: &Inner<DB>, call: &Call<'_>) -> Settled {
    let probe = async {
        let mut tx = DB::begin_bounded(&inner.pool, inner.lock_wait).await?;
        let taken = insert_record(&mut tx, call, &call.record(PROCESSING, None), Some(inner.lock_wait)).await;
        rollback(tx).await;
        taken
    };
    match tokio::time::timeout(inner.lock_wait.saturating_mul(2), probe).await {
        Ok(Ok(Taken::By(row))) => Settled::Replay(row),
        Ok(Err(e)) if DB::classify(&e) == Failure::LockTimeout => Settled::Busy,
        Ok(Ok(Taken::No) | Err(_)) | Err(_) => Settled::Unknown,
    }
}

/// The result as it is stored, and read back from there: the first caller
/// gets what every replay will (a skipped field, a float that JSON cannot
/// hold), and a result that cannot replay fails before anything commits.
fn stored_form<T: Serialize + DeserializeOwned>(value: &T) -> Result<(T, String), serde_json::Error> {
    let response = serde_json::to_string(value)?;
    Ok((serde_json::from_str(&response)?, response))
}

/// Writes the finished record (inserted with a claim, completed without)
/// and commits: `Ok(None)`. `Ok(Some(row))`: a duplicate's committed row
/// holds the key, and ours is rolled back, as on `Err`.
async fn commit_record<DB: Backend>(
    mut tx: Transaction<'static, DB>,
    call: &Call<'_>,
    record: &NewRecord<'_>,
    claimed: bool,
) -> Result<Option<StoredRecord>, sqlx::Error> {
    let written = if claimed {
        insert_record(&mut tx, call, record, None).await
    } else {
        DB::mark_succeeded(&mut tx, record).await.map(|()| Taken::No)
    };
    match written {
        Ok(Taken::No) => tx.commit().await.map(|()| None),
        Ok(Taken::By(row)) => {
            rollback(tx).await;
            Ok(Some(row))
        }
        Err(e) => {
            rollback(tx).await;
            Err(e)
        }
    }
}

/// A database error as the caller sees it: a lock wait past its bound, or
/// a conflict that outlived its retries, means someone else holds the key.
fn db_error<DB: Backend, E>(call: &Call<'_>, error: sqlx::Error) -> Failed<E> {
    match DB::classify(&error) {
        Failure::LockTimeout | Failure::Conflict => call.in_progress().into(),
        _ => Error::Storage(error).into(),
    }
}

/// Whether the record insert found the key already taken.
enum Taken {
    No,
    By(StoredRecord),
}

/// Inserts the record: ours, or taken by a live committed row. An expired
/// row is replaced inside the same transaction. `wait` bounds the wait on a
/// duplicate still in flight.
async fn insert_record<DB: Backend>(
    tx: &mut Transaction<'static, DB>,
    call: &Call<'_>,
    record: &NewRecord<'_>,
    wait: Option<Duration>,
) -> Result<Taken, sqlx::Error> {
    // Each round either inserts, finds the live row, or clears an expired
    // one; a row that vanishes three times in a row is not worth chasing.
    for _ in 0..3 {
        if DB::insert(tx, record, wait).await? {
            return Ok(Taken::No);
        }
        let now = now_ms();
        match DB::find(&mut **tx, call.spec.biz, call.key, wait).await? {
            Some(row) if row.expires_ms > now => return Ok(Taken::By(row)),
            Some(_) => {
                DB::delete_expired(&mut **tx, call.spec.biz, call.key, now, wait).await?;
            }
            None => {}
        }
    }
    Err(sqlx::Error::Protocol("idem_record row of the key keeps changing".into()))
}

/// The answer a committed row gives a duplicate.
fn replay_row<T: DeserializeOwned, E>(call: &Call<'_>, row: StoredRecord) -> Result<Recorded<T>, Failed<E>> {
    let Some(response) = row.response.filter(|_| row.status == SUCCEEDED) else {
        return Err(call.in_progress().into());
    };
    let value = call.replay(&row.params_hash, &response)?;
    Ok(Recorded { value, response, expires_ms: row.expires_ms, outcome: Outcome::Replayed })
}

#[cfg(feature = "redis")]
async fn find_live<DB: Backend>(inner: &Inner<DB>, call: &Call<'_>) -> Result<Option<StoredRecord>, Error> {
    let row = DB::lookup(&inner.pool, call.spec.biz, call.key).await?;
    Ok(row.filter(|r| r.is_live(now_ms())))
}

async fn rollback<DB: Backend>(tx: Transaction<'static, DB>) {
    // A failed rollback leaves nothing to undo: the server rolls back when
    // the connection goes, and sqlx discards a connection in a broken state.
    if let Err(e) = tx.rollback().await {
        tracing::debug!(error = %e, "rollback failed");
    }
}

fn now_ms() -> i64 {
    i64::try_from(clock::now_ms()).unwrap_or(i64::MAX)
}

#[cfg(feature = "redis")]
fn remaining(expires_ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(expires_ms - now_ms()).unwrap_or(0))
}

/// Where an engine with Redis finds its namespace: set on the builder, or
/// read once from the database (again after `migrate`). While the database
/// has none, or cannot be read, Redis is left alone, and the read is tried
/// again after the Redis back-off.
#[cfg(feature = "redis")]
struct NamespaceSlot {
    fixed: Option<Namespace>,
    read: std::sync::RwLock<Option<Namespace>>,
    /// `clock::now_ms()` before which the database is not asked again.
    unreadable_until_ms: std::sync::atomic::AtomicU64,
}

#[cfg(feature = "redis")]
impl NamespaceSlot {
    fn new(fixed: Option<Namespace>) -> Self {
        Self { fixed, read: Default::default(), unreadable_until_ms: Default::default() }
    }

    fn fixed(&self) -> Option<Namespace> {
        self.fixed.clone()
    }

    fn forget(&self) {
        *self.read.write().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        self.unreadable_until_ms.store(0, std::sync::atomic::Ordering::Relaxed);
    }

    async fn get<DB: Backend>(&self, pool: &Pool<DB>) -> Option<Namespace> {
        use std::sync::atomic::Ordering::Relaxed;
        if let Some(fixed) = &self.fixed {
            return Some(fixed.clone());
        }
        if let Some(read) = &*self.read.read().unwrap_or_else(std::sync::PoisonError::into_inner) {
            return Some(read.clone());
        }
        if clock::now_ms() < self.unreadable_until_ms.load(Relaxed) {
            return None;
        }
        let why = match DB::namespace(pool).await {
            Ok(Some(text)) => match Namespace::new(&text) {
                Ok(namespace) => {
                    *self.read.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(namespace.clone());
                    return Some(namespace);
                }
                Err(e) => e.to_string(),
            },
            Ok(None) => "none recorded: run Idem::migrate, or set Builder::redis_namespace".into(),
            Err(e) => e.to_string(),
        };
        let until = clock::now_ms() + u64::try_from(claim::BACKOFF.as_millis()).unwrap_or(u64::MAX);
        if self.unreadable_until_ms.swap(until, Relaxed) == 0 {
            tracing::warn!(reason = %why, "no namespace for redis keys; idempotency continues on the database alone");
        }
        None
    }
}

/// Our Redis claim while the call runs. Dropped without being settled (a
/// panic in the body, or the call's future dropped), it releases the claim
/// from a spawned task so a retry need not wait out the lease.
#[cfg(feature = "redis")]
struct ClaimGuard {
    claims: Arc<Claims>,
    held: Option<Held>,
}

#[cfg(feature = "redis")]
impl ClaimGuard {
    /// Caches the result in place of our claim, off the caller's path: the
    /// record already holds it, and a duplicate arriving before the cache
    /// write lands reads it from there. The cached copy carries the record's
    /// expiry, so it never answers past it, however late it lands.
    fn finish(&mut self, fingerprint: &str, response: &str, expires_ms: i64) {
        let Some(held) = self.held.take() else { return };
        let done = claim::done_value(expires_ms, fingerprint, response);
        self.claims.finish_later(held, done, remaining(expires_ms));
    }

    async fn release(&mut self) {
        // Settled only once released: dropped meanwhile, `Drop` releases.
        if let Some(held) = &self.held {
            self.claims.release(held).await;
            self.held = None;
        }
    }
}

#[cfg(feature = "redis")]
impl Drop for ClaimGuard {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            self.claims.release_in_background(held);
        }
    }
}

/// Without the `redis` feature no claim is ever held.
#[cfg(not(feature = "redis"))]
enum ClaimGuard {}

#[cfg(not(feature = "redis"))]
impl ClaimGuard {
    fn finish(&mut self, _: &str, _: &str, _: i64) {
        match *self {}
    }

    async fn release(&mut self) {
        match *self {}
    }
}
