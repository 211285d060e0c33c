//! The gate with a Redis claim, shared by every instance: fast rejection of
//! concurrent duplicates and fast replay of finished calls; never the final
//! truth (Redis can lose keys).
//!
//! One Redis key per idempotency key, `idem:<namespace>:<biz>:<key>` (the
//! namespace names the record store: see [`crate::namespace`]), holding
//! either `p:<token>:<fingerprint>` (a call is running; expires with its
//! lease) or `d:<expires_ms>:<fingerprint>:<response>` (finished). A finished
//! result carries its record's absolute expiry: a copy read at or after it is
//! a miss, however late the write that set it landed. Every command and
//! script touches exactly that one key, so Redis Cluster routes it.
//!
//! A claim is one native `SET key claim NX PX lease GET` (Redis 7.0 and
//! later): it takes the key or hands back what holds it, a replay's whole
//! cost. The claim script does the same in Lua for the two cases `SET`
//! cannot: a server that refuses `NX` with `GET` (learnt once), and a
//! finished result our clock says has expired while Redis still keeps it.
//!
//! Redis failing in any way (refused, timed out, erroring) degrades to the
//! database alone: the operation reports [`Found::Unavailable`], a warning is
//! logged once, and Redis is left alone for [`BACKOFF`] before being tried again.
//!
//! Work left for later (a release or a cache write whose answer was lost or
//! skipped) runs in background tasks, at most one per claim and at most
//! [`MAX_BACKGROUND`] per engine at once; past that a claim is left to its
//! lease.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{FromRedisValue, Script, ScriptInvocation};
use tokio::sync::OnceCell;

use sqlx::Pool;

use super::{Answer, Entry, Pass};
use crate::clock;
use crate::namespace::Namespace;
use crate::random::push_token;
use crate::store::Backend;

/// How long Redis is skipped after it failed.
pub const BACKOFF: Duration = Duration::from_secs(1);
/// How many times work left for later (a release, a cache write) is tried
/// before giving up and leaving the claim to its lease.
const LATER_TRIES: usize = 20;
/// Most background tasks (releases and cache writes left for later) one
/// engine runs at once. With Redis black-holed, every claim sent before the
/// first timeout leaves one; past the bound, claims end with their lease.
pub const MAX_BACKGROUND: usize = 256;

// GET and SET NX in one step, as `SET NX GET` does, and one thing more: a
// finished result past its expiry (ARGV[3], the caller's clock, the one
// the record's expiry is compared with) counts as absent and is replaced.
// The reply is the value found, or nil when the claim is ours. Our own
// value counts as ours: a client that resends after a lost reply (the
// cluster client does) finds it.
const CLAIM: &str = r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then return false end
if v then
  local expires = string.match(v, '^d:(%d+):')
  if not expires or tonumber(expires) > tonumber(ARGV[3]) then return v end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false";

// Compare-and-delete: only the owner of the claim may drop it.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0";

// Compare-and-set: turn our own claim into the finished result.
const FINISH: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0";

/// What the claim script found.
#[derive(Debug)]
pub(crate) enum Found {
    /// We hold the key until the lease runs out.
    Ours(HeldClaim),
    /// A finished call left its result.
    Finished(Answer),
    /// Another call holds the key.
    Running,
    /// Redis is absent or failing: carry on with the database alone.
    Unavailable,
}

/// Why a Redis operation gave no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Missed {
    /// Not sent: Redis failed recently and is being left alone.
    Skipped,
    /// Sent, and it failed or timed out: it may or may not have run.
    Failed,
}

/// Whether an operation is skipped while Redis is backing off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backoff {
    Respect,
    Ignore,
}

/// A claim we own: the Redis key and the exact value we set.
#[derive(Debug, Clone)]
pub(crate) struct HeldClaim {
    key: String,
    value: String,
}

/// Where the claims live.
pub(crate) enum Target {
    Single(redis::Client),
    Cluster(Box<ClusterClient>),
}

#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// The Redis side of an engine: one node or a cluster.
pub(crate) struct RedisGate {
    target: Target,
    namespace: NamespaceSlot,
    connection: OnceCell<Connection>,
    timeout: Duration,
    /// `clock::now_ms()` before which Redis is not tried; 0 when healthy.
    down_until_ms: AtomicU64,
    /// Background tasks running now; at most [`MAX_BACKGROUND`].
    background: AtomicUsize,
    /// The server refused `SET NX GET` (before Redis 7.0): claims go
    /// through the claim script.
    claim_by_script: AtomicBool,
    claim: Script,
    release: Script,
    finish: Script,
}

impl std::fmt::Debug for RedisGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.target {
            Target::Single(_) => "single",
            Target::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisGate").field("target", &kind).field("timeout", &self.timeout).finish()
    }
}

impl RedisGate {
    pub(crate) fn new(target: Target, timeout: Duration, namespace: Option<Namespace>) -> Self {
        Self {
            target,
            namespace: NamespaceSlot::new(namespace),
            connection: OnceCell::new(),
            timeout,
            down_until_ms: AtomicU64::new(0),
            background: AtomicUsize::new(0),
            claim_by_script: AtomicBool::new(false),
            claim: Script::new(CLAIM),
            release: Script::new(RELEASE),
            finish: Script::new(FINISH),
        }
    }

    /// The gate's answer for `(biz, key)`: our claim, a finished result, or
    /// busy (someone holds the claim; it may have committed since). `None`
    /// when Redis cannot tell: no namespace yet, or Redis failing.
    pub(crate) async fn enter<DB: Backend>(
        self: &Arc<Self>,
        pool: &Pool<DB>,
        biz: &str,
        key: &str,
        fingerprint: &str,
        lease: Duration,
    ) -> Option<Entry<'static>> {
        // Without a namespace (the database was never migrated) Redis could
        // mix this store's keys with another's: the database alone decides.
        let namespace = self.namespace.get(pool).await?;
        match self.claim(&namespace, biz, key, fingerprint, lease).await {
            Found::Ours(held) => {
                Some(Entry::GoAhead(Pass::Claim(ClaimGuard { gate: Arc::clone(self), held: Some(held) })))
            }
            Found::Finished(answer) => Some(Entry::Replay(Arc::new(answer), crate::metrics::Source::Redis)),
            Found::Running => Some(Entry::Busy { may_have_committed: true }),
            Found::Unavailable => None,
        }
    }

    /// Whether a call holds the claim of `(biz, key)` right now.
    pub(crate) async fn is_running<DB: Backend>(&self, pool: &Pool<DB>, biz: &str, key: &str) -> bool {
        match self.namespace.get(pool).await {
            Some(namespace) => matches!(self.peek(&namespace, biz, key).await, Found::Running),
            None => false,
        }
    }

    /// The namespace set on the builder, if any.
    pub(crate) fn fixed_namespace(&self) -> Option<Namespace> {
        self.namespace.fixed.clone()
    }

    /// Reads the namespace from the database again on the next call.
    pub(crate) fn forget_namespace(&self) {
        self.namespace.forget();
    }

    /// Claims `key` for `lease`, or reports what holds it.
    async fn claim(
        self: &Arc<Self>,
        namespace: &Namespace,
        biz: &str,
        key: &str,
        fingerprint: &str,
        lease: Duration,
    ) -> Found {
        let held = HeldClaim { key: redis_key(namespace, biz, key), value: claim_value(fingerprint) };
        let mut unanswered = Unanswered { claims: self, held: Some(held) };
        let answer = match &unanswered.held {
            Some(held) => self.send_claim(held, lease).await,
            None => Err(Missed::Skipped),
        };
        if matches!(answer, Err(Missed::Failed)) {
            return Found::Unavailable; // `unanswered` releases what may have landed
        }
        match (answer, unanswered.held.take()) {
            (Ok(None), Some(held)) => Found::Ours(held),
            (Ok(Some(holder)), _) => holder,
            _ => Found::Unavailable, // skipped while Redis backs off: never sent
        }
    }

    /// Sends the claim `held`: `None` when the key is ours, else what
    /// [`parse`] makes of the value that holds it.
    async fn send_claim(&self, held: &HeldClaim, lease: Duration) -> Result<Option<Found>, Missed> {
        let refused = if self.claim_by_script.load(Ordering::Relaxed) {
            None
        } else {
            // Sized up front: seven arguments would grow both buffers a few times.
            let mut set = redis::Cmd::with_capacity(7, held.key.len() + held.value.len() + 32);
            set.arg("SET").arg(&held.key).arg(&held.value).arg("NX").arg("PX").arg(millis(lease)).arg("GET");
            // Bytes, not a `String`: a value that is not UTF-8 is someone
            // else's, not a failed reply (see `parse`).
            let sent = |mut c: ConnectionHandle| {
                refusal_is_an_answer(async move { set.query_async::<Option<Vec<u8>>>(&mut c).await })
            };
            match self.guarded(Backoff::Respect, sent).await? {
                // Our own value: sent again after a lost reply.
                Ok(Some(found)) if found == held.value.as_bytes() => return Ok(None),
                Ok(Some(found)) => match parse(found, clock::now_ms()) {
                    // Expired by our clock, not yet by Redis's: the script replaces it.
                    Found::Unavailable => None,
                    holder => return Ok(Some(holder)),
                },
                Ok(None) => return Ok(None),
                Err(refused) => Some(refused),
            }
        };
        let mut call = self.claim.key(&held.key);
        call.arg(&held.value).arg(millis(lease)).arg(clock::now_ms());
        let found = self.run::<Option<Vec<u8>>>(&call, Backoff::Respect).await?;
        // The script answered where `SET` was refused: the server does not
        // know `NX` with `GET`, and is not asked again.
        if let Some(refused) = refused
            && !self.claim_by_script.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(error = %refused, "redis refused SET NX GET (before 7.0?); claims go through a Lua script from now on");
        }
        Ok(found.map(|found| parse(found, clock::now_ms())))
    }

    /// Drops our claim so the next call may execute (after a failed body).
    /// Unanswered, or skipped while Redis backs off, it is retried off the
    /// caller's path rather than left to run out its lease.
    async fn release(self: &Arc<Self>, held: &HeldClaim) {
        if self.release_with(held, Backoff::Respect).await.is_err() {
            self.release_unanswered(held.clone());
        }
    }

    /// Releases `held` from a background task (see [`MAX_BACKGROUND`]):
    /// at once, and like an unanswered one if that fails.
    fn release_in_background(self: &Arc<Self>, held: HeldClaim) {
        self.spawn_later(|claims| async move {
            crate::metrics::background_release();
            if claims.release_with(&held, Backoff::Respect).await.is_err() {
                claims.release_after_failure(&held).await;
            }
        });
    }

    /// Releases, from a background task, a claim whose answer (or whose
    /// release's answer) was lost.
    fn release_unanswered(self: &Arc<Self>, held: HeldClaim) {
        self.spawn_later(|claims| async move {
            crate::metrics::background_release();
            claims.release_after_failure(&held).await
        });
    }

    async fn release_with(&self, held: &HeldClaim, backoff: Backoff) -> Result<i64, Missed> {
        let mut call = self.release.key(&held.key);
        call.arg(&held.value);
        self.run::<i64>(&call, backoff).await
    }

    async fn release_after_failure(&self, held: &HeldClaim) {
        // Two answered releases, a timeout apart, within about a lease's
        // worth of tries: the first may still overtake the late claim.
        let mut answered = 0;
        for _ in 0..LATER_TRIES {
            self.pause_before_retry().await;
            if self.release_with(held, Backoff::Ignore).await.is_ok() {
                answered += 1;
                if answered == 2 {
                    return;
                }
            }
        }
    }

    /// Replaces our claim by the finished result ([`done_value`]), kept
    /// for `ttl`, from a background task: the record already holds it, and
    /// a duplicate arriving before the write lands reads it from there. A
    /// write skipped by the back-off or left unanswered is tried again, so
    /// the claim does not live out its lease (each duplicate meanwhile
    /// would cost a lookup, and answer `InProgress` once the record expired).
    fn finish_later(self: &Arc<Self>, held: HeldClaim, done: String, ttl: Duration) {
        self.spawn_later(move |claims| async move {
            let write = |backoff| {
                let mut call = claims.finish.key(&held.key);
                call.arg(&held.value).arg(&done).arg(millis(ttl));
                let claims = &claims;
                async move { claims.run::<i64>(&call, backoff).await }
            };
            if write(Backoff::Respect).await.is_ok() {
                return;
            }
            for _ in 0..LATER_TRIES {
                claims.pause_before_retry().await;
                // Compare-and-set on our own token with an absolute expiry
                // inside the value: landing late, or twice, is harmless.
                if write(Backoff::Ignore).await.is_ok() {
                    return;
                }
            }
        });
    }

    /// Waits a timeout, and longer if Redis is backing off.
    async fn pause_before_retry(&self) {
        let down_until = self.down_until_ms.load(Ordering::Relaxed);
        let backing_off = Duration::from_millis(down_until.saturating_sub(clock::now_ms()));
        tokio::time::sleep(self.timeout.max(backing_off)).await;
    }

    /// Runs `task` in the background unless [`MAX_BACKGROUND`] already run.
    fn spawn_later<F, Fut>(self: &Arc<Self>, task: F)
    where
        F: FnOnce(Arc<Self>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        if self.background.fetch_add(1, Ordering::Relaxed) >= MAX_BACKGROUND {
            self.background.fetch_sub(1, Ordering::Relaxed);
            tracing::debug!("too much redis work left for later; a claim ends with its lease");
            return;
        }
        // Counted down however the task ends, even dropped with its runtime.
        struct Slot(Arc<RedisGate>);
        impl Drop for Slot {
            fn drop(&mut self) {
                self.0.background.fetch_sub(1, Ordering::Relaxed);
            }
        }
        let slot = Slot(Arc::clone(self));
        let task = task(Arc::clone(self));
        spawn_detached(async move {
            let _slot = slot;
            task.await;
        });
    }

    /// Background tasks running now.
    #[cfg(test)]
    pub(crate) fn background(&self) -> usize {
        self.background.load(Ordering::Relaxed)
    }

    /// Reads what Redis holds for `key`, for status queries.
    async fn peek(&self, namespace: &Namespace, biz: &str, key: &str) -> Found {
        let mut cmd = redis::cmd("GET");
        cmd.arg(redis_key(namespace, biz, key));
        let got: Result<Option<Vec<u8>>, Missed> =
            self.guarded(Backoff::Respect, |mut c| async move { cmd.query_async(&mut c).await }).await;
        match got {
            Ok(Some(found)) => parse(found, clock::now_ms()),
            Ok(None) | Err(_) => Found::Unavailable,
        }
    }

    async fn run<T: FromRedisValue>(&self, call: &ScriptInvocation<'_>, backoff: Backoff) -> Result<T, Missed> {
        self.guarded(backoff, |mut c| async move { call.invoke_async(&mut c).await }).await
    }

    /// Runs one Redis operation under the timeout and (unless told to
    /// ignore it) the back-off.
    async fn guarded<T, F, Fut>(&self, backoff: Backoff, op: F) -> Result<T, Missed>
    where
        F: FnOnce(ConnectionHandle) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        // The clock is read only while backing off: healthy, the bound is 0.
        let down_until = self.down_until_ms.load(Ordering::Relaxed);
        if backoff == Backoff::Respect && down_until != 0 && clock::now_ms() < down_until {
            return Err(Missed::Skipped);
        }
        let attempt = async {
            let conn = self.connection().await?;
            op(ConnectionHandle(conn)).await
        };
        let failure = match tokio::time::timeout(self.timeout, attempt).await {
            Ok(Ok(value)) => {
                // Read first: a write on every call would bounce the cache line between cores.
                if self.down_until_ms.load(Ordering::Relaxed) != 0 && self.down_until_ms.swap(0, Ordering::Relaxed) != 0
                {
                    tracing::info!("redis answers again; idempotency claims resume");
                    crate::metrics::redis_recovered();
                }
                return Ok(value);
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {:?}", self.timeout),
        };
        let until = clock::now_ms() + millis(BACKOFF);
        if self.down_until_ms.swap(until, Ordering::Relaxed) == 0 {
            tracing::warn!(error = %failure, "redis unavailable; idempotency continues on the database alone");
            crate::metrics::redis_degraded();
        }
        Err(Missed::Failed)
    }

    async fn connection(&self) -> redis::RedisResult<Connection> {
        let conn = self
            .connection
            .get_or_try_init(|| async {
                match &self.target {
                    Target::Single(client) => {
                        // Lazy: connects on first use and reconnects by itself.
                        // No response timeout of its own: `guarded` bounds each
                        // operation already, and a second timer per operation
                        // is not free (registering one wakes tokio's driver
                        // through a syscall). Its timeout would not reconnect
                        // either: redis-rs reconnects on a dropped connection,
                        // not on a slow answer.
                        let config = ConnectionManagerConfig::new()
                            .set_connection_timeout(Some(self.timeout))
                            .set_response_timeout(None)
                            .set_number_of_retries(1);
                        ConnectionManager::new_lazy_with_config(client.clone(), config).map(Connection::Single)
                    }
                    Target::Cluster(client) => client.get_async_connection().await.map(Connection::Cluster),
                }
            })
            .await?;
        Ok(conn.clone())
    }
}

/// What another user of the engine's Redis (issued tokens, `crate::token`)
/// got back for one operation.
#[derive(Debug)]
pub(crate) enum Reply<T> {
    /// The server's answer.
    Value(T),
    /// The server answered with an error of its own (`ERR ...`, such as an
    /// unknown command): Redis is up, the operation did not run.
    Refused(redis::RedisError),
    /// No answer within the timeout, or the connection failed: the
    /// operation may or may not have run.
    Unreachable,
}

/// The gate's connection, timeout and namespace, lent to the engine's other
/// Redis users. Their operations are tried even while claims back off:
/// they have no database to fall back on, so a try costs at most a timeout.
impl RedisGate {
    /// The namespace this engine's Redis keys carry, if known yet.
    pub(crate) async fn namespace<DB: Backend>(&self, pool: &Pool<DB>) -> Option<Namespace> {
        self.namespace.get(pool).await
    }

    /// Sends `cmd` under the gate's timeout.
    pub(crate) async fn send<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> Reply<T> {
        self.lent(|mut c| async move { cmd.query_async(&mut c).await }).await
    }

    /// Runs `call` (EVALSHA, EVAL when the script is not loaded) under the
    /// gate's timeout.
    pub(crate) async fn send_script<T: FromRedisValue>(&self, call: &ScriptInvocation<'_>) -> Reply<T> {
        self.lent(|mut c| async move { call.invoke_async(&mut c).await }).await
    }

    async fn lent<T, F, Fut>(&self, op: F) -> Reply<T>
    where
        F: FnOnce(ConnectionHandle) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        // A refusal is an answer: Redis is up, and claims need not back off.
        let answered = self.guarded(Backoff::Ignore, |c| refusal_is_an_answer(op(c))).await;
        match answered {
            Ok(Ok(value)) => Reply::Value(value),
            Ok(Err(refused)) => Reply::Refused(refused),
            Err(_) => Reply::Unreachable,
        }
    }
}

/// A claim sent but not answered. Dropped so (the answer failed or timed
/// out, or the caller's future was dropped while waiting), the script may
/// still run and set our claim: it is released off the caller's path and
/// past the back-off, and retried until Redis answers, since a release that
/// overtakes the late claim (say, on a fresh connection) deletes nothing.
/// Compare-and-delete on our own token: repeating it is harmless.
struct Unanswered<'a> {
    claims: &'a Arc<RedisGate>,
    held: Option<HeldClaim>,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            self.claims.release_unanswered(held);
        }
    }
}

/// A cloned connection, usable as `redis::aio::ConnectionLike`.
struct ConnectionHandle(Connection);

impl redis::aio::ConnectionLike for ConnectionHandle {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        match &mut self.0 {
            Connection::Single(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match &mut self.0 {
            Connection::Single(c) => c.req_packed_commands(cmd, offset, count),
            Connection::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match &self.0 {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

/// Our claim while the call runs. Dropped without being settled (a panic
/// in the body, or the call's future dropped), it releases the claim from a
/// background task so a retry need not wait out the lease.
pub(crate) struct ClaimGuard {
    gate: Arc<RedisGate>,
    held: Option<HeldClaim>,
}

impl ClaimGuard {
    /// Caches the result in place of our claim, off the caller's path: the
    /// record already holds it, and a duplicate arriving before the cache
    /// write lands reads it from there. The cached copy carries the record's
    /// expiry, so it never answers past it, however late it lands.
    pub(crate) fn finish(mut self, answer: &Answer) {
        let expires_ms = answer.expires_ms;
        let Some(held) = self.held.take() else { return };
        let done = done_value(expires_ms, &answer.fingerprint, &answer.response);
        let ttl = Duration::from_millis(u64::try_from(expires_ms).unwrap_or(0).saturating_sub(clock::now_ms()));
        self.gate.finish_later(held, done, ttl);
    }

    /// Releases the claim so the next call may execute.
    pub(crate) async fn release(&mut self) {
        // Settled only once released: dropped meanwhile, `Drop` releases.
        if let Some(held) = &self.held {
            self.gate.release(held).await;
            self.held = None;
        }
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            self.gate.release_in_background(held);
        }
    }
}

/// Where the gate finds its namespace: set on the builder, or read once
/// from the database (again after `migrate`). While the database has none,
/// or cannot be read, Redis is left alone, and the read is tried again after
/// the Redis back-off.
struct NamespaceSlot {
    fixed: Option<Namespace>,
    read: std::sync::RwLock<Option<Namespace>>,
    /// `clock::now_ms()` before which the database is not asked again.
    unreadable_until_ms: AtomicU64,
}

impl NamespaceSlot {
    fn new(fixed: Option<Namespace>) -> Self {
        Self { fixed, read: Default::default(), unreadable_until_ms: AtomicU64::new(0) }
    }

    fn forget(&self) {
        *self.read.write().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        self.unreadable_until_ms.store(0, Ordering::Relaxed);
    }

    async fn get<DB: Backend>(&self, pool: &Pool<DB>) -> Option<Namespace> {
        if let Some(fixed) = &self.fixed {
            return Some(fixed.clone());
        }
        if let Some(read) = &*self.read.read().unwrap_or_else(std::sync::PoisonError::into_inner) {
            return Some(read.clone());
        }
        if clock::now_ms() < self.unreadable_until_ms.load(Ordering::Relaxed) {
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
        if self.unreadable_until_ms.swap(clock::now_ms() + millis(BACKOFF), Ordering::Relaxed) == 0 {
            tracing::warn!(reason = %why, "no namespace for redis keys; idempotency continues on the database alone");
        }
        None
    }
}

/// `op`'s result, with the server's own refusal (`ERR ...`, such as an
/// unknown command or option) as an answer: Redis is up, the operation did
/// not run, and claims need not back off.
async fn refusal_is_an_answer<T>(
    op: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> redis::RedisResult<Result<T, redis::RedisError>> {
    match op.await {
        Ok(value) => Ok(Ok(value)),
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError) => Ok(Err(e)),
        Err(e) => Err(e),
    }
}

/// The value a finished call leaves in Redis; [`parse`] reads it back.
pub(crate) fn done_value(expires_ms: i64, fingerprint: &str, response: &str) -> String {
    format!("d:{expires_ms}:{fingerprint}:{response}")
}

/// Runs `task` on the current runtime; outside one there is nothing to run
/// it on, and it is dropped (a claim then ends with its lease).
fn spawn_detached(task: impl std::future::Future<Output = ()> + Send + 'static) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(task);
    }
}

/// What a Redis value says at `now_ms`. A finished result past its expiry
/// is no answer at all.
pub(crate) fn parse(found: Vec<u8>, now_ms: u64) -> Found {
    // Not UTF-8: not a value we wrote, so someone else's. Read as a
    // `String` by the command, it failed the reply, which backed off every
    // key's claims. The bytes become the `String` in place.
    let Ok(found) = String::from_utf8(found) else { return Found::Running };
    // `d:<expires>:<fingerprint>:<response>`; `p:...`, or a value we did not
    // write: either way someone else's.
    let done = found.strip_prefix("d:").and_then(|rest| rest.split_once(':')).and_then(|(expires, rest)| {
        let (fingerprint, response) = rest.split_once(':')?;
        // As `done_value` writes it, an `i64`, or not ours.
        let expires = decimal(expires)?;
        Some((expires, i64::try_from(expires).ok()?, fingerprint, found.len() - response.len()))
    });
    let Some((expires, expires_ms, fingerprint, response_at)) = done else { return Found::Running };
    if expires <= now_ms {
        return Found::Unavailable;
    }
    let fingerprint = fingerprint.to_owned();
    // The response is the value's tail: it stays in the reply's buffer.
    let mut response = found;
    response.drain(..response_at);
    Found::Finished(Answer { fingerprint, response, expires_ms })
}

/// A number as idem writes it into a Redis value: decimal digits, no
/// sign, no leading zero. `str::parse` also takes `+5` and `05`, which idem
/// never writes: read as numbers, such foreign values would pass for ours.
pub(crate) fn decimal(text: &str) -> Option<u64> {
    let canonical =
        !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) && (text == "0" || !text.starts_with('0'));
    if canonical { text.parse().ok() } else { None }
}

/// The Redis key of `(biz, key)` in `namespace`. Neither the namespace nor
/// `biz` holds a `:`, so no two triples share a Redis key.
fn redis_key(namespace: &Namespace, biz: &str, key: &str) -> String {
    // `concat` sizes its one allocation first; `format!` grows as it goes.
    ["idem:", namespace.as_str(), ":", biz, ":", key].concat()
}

/// A claim's value, `p:<owner token>:<fingerprint>`, in one allocation.
pub(crate) fn claim_value(fingerprint: &str) -> String {
    let mut value = String::with_capacity(2 + 32 + 1 + fingerprint.len());
    value.push_str("p:");
    push_token(&mut value);
    value.push(':');
    value.push_str(fingerprint);
    value
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::token;

    #[test]
    fn parses_values() {
        match parse(done_value(2_000, "abc", "{\"x\":\"a:b\"}").into_bytes(), 1_999) {
            Found::Finished(Answer { fingerprint, response, expires_ms: 2_000 }) => {
                assert_eq!(fingerprint, "abc");
                assert_eq!(response, "{\"x\":\"a:b\"}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(parse(done_value(2_000, "abc", "1").into_bytes(), 2_000), Found::Unavailable), "expired");
        assert!(
            matches!(parse(done_value(2_000, "abc", "").into_bytes(), 0), Found::Finished(Answer { response, .. }) if response.is_empty())
        );
        for theirs in ["p:t:f", "garbage", "d:abc:1", "d:12", "d:12:f", "d:-1:f:r", ""] {
            assert!(matches!(parse(theirs.into(), 0), Found::Running), "{theirs}");
        }
        for theirs in [&b"d:99999999999999:f:\xff"[..], b"\xfe", b"p:\xc3:f"] {
            assert!(matches!(parse(theirs.to_vec(), 0), Found::Running), "{theirs:?}");
        }
    }

    /// Regression (found by fuzzing: `fuzz/`, target `redis_cached_value`):
    /// an expiry with a sign, a leading zero or past `i64` read as a live
    /// result, though the engine never writes one (and the claim script's
    /// `%d+` takes no sign): only the value the engine would have written
    /// reads as its result.
    #[test]
    fn only_canonical_expiries_read_as_results() {
        for theirs in
            ["d:+99999999999999:f:r", "d:099999999999999:f:r", "d:9223372036854775808:f:r", "d: 99999999999999:f:r"]
        {
            assert!(matches!(parse(theirs.into(), 0), Found::Running), "{theirs}");
        }
        assert!(matches!(parse("d:9223372036854775807:f:r".into(), 0), Found::Finished(_)));
    }

    /// Against a real Redis; skipped when none answers, unless
    /// `IDEM_REQUIRE_SERVICES` is set.
    #[test]
    fn claim_script_counts_our_own_value_as_ours() {
        let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let conn = redis::Client::open(url).and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)));
        let mut conn = match conn {
            Ok(conn) => conn,
            Err(e) => {
                assert!(std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(), "redis unreachable: {e}");
                eprintln!("skipped: redis unreachable ({e})");
                return;
            }
        };
        let key = format!("idem:t_unit:{}", token());
        let script = Script::new(CLAIM);
        let now = clock::now_ms();
        let claim = |conn: &mut redis::Connection, value: &str| -> Option<String> {
            script.key(&key).arg(value).arg(60_000).arg(now).invoke(conn).expect("claim script")
        };
        assert_eq!(claim(&mut conn, "p:ours:f"), None, "taken");
        assert_eq!(claim(&mut conn, "p:ours:f"), None, "sent again after a lost reply: still ours");
        assert_eq!(claim(&mut conn, "p:theirs:f").as_deref(), Some("p:ours:f"), "someone else's is reported");

        // A finished result is reported until its expiry, and is absent from then on.
        let live = done_value(i64::try_from(now + 1).unwrap(), "f", "1");
        let _: () = redis::cmd("SET").arg(&key).arg(&live).query(&mut conn).expect("SET");
        assert_eq!(claim(&mut conn, "p:ours:f").as_deref(), Some(live.as_str()), "live result reported");
        let expired = done_value(i64::try_from(now).unwrap(), "f", "1");
        let _: () = redis::cmd("SET").arg(&key).arg(&expired).query(&mut conn).expect("SET");
        assert_eq!(claim(&mut conn, "p:ours:f"), None, "an expired result is no answer: the claim is ours");
        let now_held: String = redis::cmd("GET").arg(&key).query(&mut conn).expect("GET");
        assert_eq!(now_held, "p:ours:f");
        let _: i64 = redis::cmd("DEL").arg(&key).query(&mut conn).expect("DEL");
    }

    fn redis_url() -> String {
        std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
    }

    /// A connection to the test Redis, or `None` (skipped) when none
    /// answers, unless `IDEM_REQUIRE_SERVICES` is set.
    async fn test_redis() -> Option<redis::aio::MultiplexedConnection> {
        let client = redis::Client::open(redis_url()).expect("redis url");
        match client.get_multiplexed_async_connection().await {
            Ok(conn) => Some(conn),
            Err(e) => {
                assert!(std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(), "redis unreachable: {e}");
                eprintln!("skipped: redis unreachable ({e})");
                None
            }
        }
    }

    /// Every answer of a claim through `SET NX GET`: ours, our own value
    /// sent again, someone else's claim, a live result, and an expired
    /// result Redis still keeps (replaced through the script).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_through_set_nx_get() {
        let Some(mut conn) = test_redis().await else { return };
        let gate = Arc::new(RedisGate::new(
            Target::Single(redis::Client::open(redis_url()).unwrap()),
            Duration::from_secs(2),
            None,
        ));
        let namespace = Namespace::new("t_unit").unwrap();
        let (biz, key) = ("t_setget", token());
        let redis_key = redis_key(&namespace, biz, &key);
        let lease = Duration::from_secs(60);
        let get = |conn: &mut redis::aio::MultiplexedConnection| {
            let mut conn = conn.clone();
            let redis_key = redis_key.clone();
            async move { redis::cmd("GET").arg(&redis_key).query_async::<Option<String>>(&mut conn).await.unwrap() }
        };

        let Found::Ours(held) = gate.claim(&namespace, biz, &key, "fp", lease).await else { panic!("not ours") };
        assert_eq!(get(&mut conn).await.as_deref(), Some(held.value.as_str()));
        assert!(matches!(gate.send_claim(&held, lease).await, Ok(None)), "our own value sent again is ours");
        assert!(matches!(gate.claim(&namespace, biz, &key, "fp", lease).await, Found::Running));

        let live = done_value(i64::try_from(clock::now_ms() + 60_000).unwrap(), "fp", "{\"a\":1}");
        let _: () = redis::cmd("SET").arg(&redis_key).arg(&live).query_async(&mut conn).await.unwrap();
        match gate.claim(&namespace, biz, &key, "fp", lease).await {
            Found::Finished(answer) => assert_eq!(answer.response, "{\"a\":1}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(get(&mut conn).await.as_deref(), Some(live.as_str()), "a finished result is left alone");

        // Expired by our clock, kept by Redis for another minute.
        let expired = done_value(i64::try_from(clock::now_ms() - 1).unwrap(), "fp", "1");
        let _: () =
            redis::cmd("SET").arg(&redis_key).arg(&expired).arg("PX").arg(60_000).query_async(&mut conn).await.unwrap();
        let Found::Ours(held) = gate.claim(&namespace, biz, &key, "fp", lease).await else {
            panic!("expired, not ours")
        };
        assert_eq!(get(&mut conn).await.as_deref(), Some(held.value.as_str()), "the expired result is replaced");
        assert!(!gate.claim_by_script.load(Ordering::Relaxed), "Redis 7 takes SET NX GET");
        let _: i64 = redis::cmd("DEL").arg(&redis_key).query_async(&mut conn).await.unwrap();
    }

    /// Regression (found by fuzzing: `fuzz/`, target `redis_cached_value`):
    /// a value at a claim's key that is not UTF-8 failed the conversion of
    /// the reply, which the gate took for a failing Redis: every key's
    /// claims backed off, and this one went to the database alone. Such a
    /// value is someone else's: the key is busy, Redis healthy.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_value_that_is_not_utf8_is_someone_elses() {
        let Some(mut conn) = test_redis().await else { return };
        let gate = Arc::new(RedisGate::new(
            Target::Single(redis::Client::open(redis_url()).unwrap()),
            Duration::from_secs(2),
            None,
        ));
        let namespace = Namespace::new("t_unit").unwrap();
        let (biz, key) = ("t_bytes", token());
        let redis_key = redis_key(&namespace, biz, &key);
        let foreign: &[u8] = b"d:99999999999999:fp:\xff\xfe";
        let _: () =
            redis::cmd("SET").arg(&redis_key).arg(foreign).arg("PX").arg(60_000).query_async(&mut conn).await.unwrap();
        let lease = Duration::from_secs(60);
        let found = gate.claim(&namespace, biz, &key, "fp", lease).await;
        assert!(matches!(found, Found::Running), "through SET NX GET: {found:?}");
        assert_eq!(gate.down_until_ms.load(Ordering::Relaxed), 0, "Redis taken for failing");
        gate.claim_by_script.store(true, Ordering::Relaxed);
        let found = gate.claim(&namespace, biz, &key, "fp", lease).await;
        assert!(matches!(found, Found::Running), "through the script: {found:?}");
        assert!(matches!(gate.peek(&namespace, biz, &key).await, Found::Running), "peeked");
        assert_eq!(gate.down_until_ms.load(Ordering::Relaxed), 0, "Redis taken for failing");
        let kept: Vec<u8> = redis::cmd("GET").arg(&redis_key).query_async(&mut conn).await.unwrap();
        assert_eq!(kept, foreign, "someone else's value is left alone");
        let _: i64 = redis::cmd("DEL").arg(&redis_key).query_async(&mut conn).await.unwrap();
    }

    /// A proxy to the test Redis that makes it refuse `SET` with both `NX`
    /// and `GET` as servers before 7.0 do (`ERR syntax error`): it adds an
    /// argument no `SET` knows. Everything else passes untouched.
    async fn proxy_refusing_set_nx_get(upstream: String) -> u16 {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(&upstream).await.expect("upstream");
                let (client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                tokio::spawn(async move { tokio::io::copy(&mut server_read, &mut client_write).await });
                tokio::spawn(async move {
                    // Requests are arrays of bulk strings: `*n`, then `$len` and the bytes, n times.
                    let mut reader = BufReader::new(client_read);
                    let mut line = String::new();
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let n: usize = line.trim_end().trim_start_matches('*').parse().expect("array header");
                        let mut args = Vec::with_capacity(n);
                        for _ in 0..n {
                            line.clear();
                            reader.read_line(&mut line).await.expect("bulk header");
                            let len: usize = line.trim_end().trim_start_matches('$').parse().expect("bulk length");
                            let mut arg = vec![0; len + 2];
                            reader.read_exact(&mut arg).await.expect("bulk");
                            arg.truncate(len);
                            args.push(arg);
                        }
                        let upper: Vec<Vec<u8>> = args.iter().map(|a| a.to_ascii_uppercase()).collect();
                        let has = |word: &[u8]| upper.iter().skip(3).any(|a| a == word);
                        if upper.first().is_some_and(|c| c == b"SET") && has(b"NX") && has(b"GET") {
                            args.push(b"REFUSED_BEFORE_7".to_vec());
                        }
                        let mut request = format!("*{}\r\n", args.len()).into_bytes();
                        for arg in &args {
                            request.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
                            request.extend_from_slice(arg);
                            request.extend_from_slice(b"\r\n");
                        }
                        if server_write.write_all(&request).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        port
    }

    /// On a server that refuses `SET NX GET`, the first claim is taken
    /// through the script, the refusal is learnt (no back-off: Redis is
    /// up), and every later claim goes straight to the script.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_through_the_script_where_set_nx_get_is_refused() {
        let Some(mut conn) = test_redis().await else { return };
        let client = redis::Client::open(redis_url()).unwrap();
        let redis::ConnectionAddr::Tcp(host, port) = client.get_connection_info().addr().clone() else { return };
        let proxy = proxy_refusing_set_nx_get(format!("{host}:{port}")).await;
        let through = redis::Client::open(format!("redis://127.0.0.1:{proxy}")).unwrap();
        let mut refused = through.get_multiplexed_async_connection().await.unwrap();
        let probe = redis::cmd("SET")
            .arg("t_unit_probe")
            .arg("v")
            .arg("NX")
            .arg("GET")
            .query_async::<Option<String>>(&mut refused)
            .await;
        assert!(probe.is_err_and(|e| e.to_string().contains("syntax")), "the proxy refuses SET NX GET");

        let gate = Arc::new(RedisGate::new(Target::Single(through), Duration::from_secs(2), None));
        let namespace = Namespace::new("t_unit").unwrap();
        let lease = Duration::from_secs(60);
        let (first, second) = (token(), token());
        let Found::Ours(held) = gate.claim(&namespace, "t_old", &first, "fp", lease).await else { panic!("not ours") };
        assert!(gate.claim_by_script.load(Ordering::Relaxed), "the refusal is learnt");
        assert_eq!(gate.down_until_ms.load(Ordering::Relaxed), 0, "a refusal is no outage");
        let held_now: Option<String> = redis::cmd("GET").arg(&held.key).query_async(&mut conn).await.unwrap();
        assert_eq!(held_now, Some(held.value.clone()));
        assert!(matches!(gate.claim(&namespace, "t_old", &first, "fp", lease).await, Found::Running));
        let Found::Ours(other) = gate.claim(&namespace, "t_old", &second, "fp", lease).await else {
            panic!("not ours")
        };
        for key in [&held.key, &other.key] {
            let _: i64 = redis::cmd("DEL").arg(key).query_async(&mut conn).await.unwrap();
        }
    }

    /// Regression: with Redis black-holed (it accepts connections and never
    /// answers), every claim sent before the first timeout leaves a release
    /// for later; at most `MAX_BACKGROUND` of them run at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn background_work_is_bounded_when_redis_never_answers() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let hole = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket); // read nothing, answer nothing
            }
        });
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("client");
        let claims = Arc::new(RedisGate::new(Target::Single(client), Duration::from_millis(300), None));
        let namespace = Namespace::new("t_unit").unwrap();
        let tasks_before = tokio::runtime::Handle::current().metrics().num_alive_tasks();

        let calls = 4 * MAX_BACKGROUND;
        let barrier = Arc::new(tokio::sync::Barrier::new(calls));
        let mut set = tokio::task::JoinSet::new();
        for i in 0..calls {
            let (claims, namespace, barrier) = (Arc::clone(&claims), namespace.clone(), Arc::clone(&barrier));
            set.spawn(async move {
                barrier.wait().await;
                claims.claim(&namespace, "t_hole", &format!("k{i}"), "f", Duration::from_secs(30)).await
            });
        }
        let mut unavailable = 0;
        while let Some(claim) = set.join_next().await {
            unavailable += usize::from(matches!(claim.expect("claim task"), Found::Unavailable));
        }
        assert_eq!(unavailable, calls, "no claim was answered");
        let left = claims.background();
        let tasks_after = tokio::runtime::Handle::current().metrics().num_alive_tasks();
        assert_eq!(left, MAX_BACKGROUND, "the releases left for later hit the bound, and stop there");
        assert!(
            tasks_after <= tasks_before + MAX_BACKGROUND + 4,
            "{tasks_after} tasks alive after {calls} unanswered claims ({tasks_before} before)"
        );
        hole.abort();
    }
}
