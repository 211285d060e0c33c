//! Layer 2: the Redis claim. Fast rejection of concurrent duplicates and fast
//! replay of finished calls; never the final truth (Redis can lose keys).
//!
//! One Redis key per idempotency key, `idem:<biz>:<key>`, holding either
//! `p:<token>:<fingerprint>` (a call is running; expires with its lease) or
//! `d:<fingerprint>:<response>` (finished; expires with the record).
//! Every script touches exactly that one key, so Redis Cluster routes it.
//!
//! Redis failing in any way (refused, timed out, erroring) degrades to the
//! database alone: the operation reports [`Claim::Unavailable`], a warning is
//! logged once, and Redis is left alone for [`BACKOFF`] before being tried again.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{FromRedisValue, Script, ScriptInvocation};
use tokio::sync::OnceCell;

use crate::clock;

/// How long Redis is skipped after it failed.
pub const BACKOFF: Duration = Duration::from_secs(1);
/// How many times a claim whose answer was lost is released before giving
/// up and leaving it to its lease.
const RELEASE_TRIES: usize = 20;

// GET and SET NX in one step; the reply is the value found, or nil when
// the claim is ours. Our own value counts as ours: a client that resends
// the script after a lost reply (the cluster client does) finds it.
const CLAIM: &str = r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then return false end
if v then return v end
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

/// What the claim step found.
#[derive(Debug)]
pub enum Claim {
    /// We hold the key until the lease runs out.
    Acquired(Held),
    /// A finished call left its result.
    Done {
        /// Fingerprint of that call's arguments.
        fingerprint: String,
        /// Its serialized result.
        response: String,
    },
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
pub struct Held {
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
pub struct Claims {
    target: Target,
    connection: OnceCell<Connection>,
    timeout: Duration,
    /// `clock::now_ms()` before which Redis is not tried; 0 when healthy.
    down_until_ms: AtomicU64,
    claim: Script,
    release: Script,
    finish: Script,
}

impl std::fmt::Debug for Claims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.target {
            Target::Single(_) => "single",
            Target::Cluster(_) => "cluster",
        };
        f.debug_struct("Claims").field("target", &kind).field("timeout", &self.timeout).finish()
    }
}

impl Claims {
    pub(crate) fn new(target: Target, timeout: Duration) -> Self {
        Self {
            target,
            connection: OnceCell::new(),
            timeout,
            down_until_ms: AtomicU64::new(0),
            claim: Script::new(CLAIM),
            release: Script::new(RELEASE),
            finish: Script::new(FINISH),
        }
    }

    /// Claims `key` for `lease`, or reports what holds it.
    pub async fn claim(self: &Arc<Self>, biz: &str, key: &str, fingerprint: &str, lease: Duration) -> Claim {
        let held = Held { key: redis_key(biz, key), value: format!("p:{}:{fingerprint}", token()) };
        let mut call = self.claim.key(&held.key);
        call.arg(&held.value).arg(millis(lease));
        let mut unanswered = Unanswered { claims: self, held: Some(held) };
        let answer = self.run::<Option<String>>(&call, Backoff::Respect).await;
        if matches!(answer, Err(Missed::Failed)) {
            return Claim::Unavailable; // `unanswered` releases what may have landed
        }
        match (answer, unanswered.held.take()) {
            (Ok(None), Some(held)) => Claim::Acquired(held),
            (Ok(Some(found)), _) => parse(&found),
            _ => Claim::Unavailable, // skipped while Redis backs off: never sent
        }
    }

    /// Drops our claim so the next call may execute (after a failed body).
    /// Unanswered, or skipped while Redis backs off, it is retried off the
    /// caller's path rather than left to run out its lease.
    pub async fn release(self: &Arc<Self>, held: &Held) {
        if self.release_with(held, Backoff::Respect).await.is_err() {
            let (claims, held) = (Arc::clone(self), held.clone());
            spawn_detached(async move { claims.release_after_failure(&held).await });
        }
    }

    async fn release_with(&self, held: &Held, backoff: Backoff) -> Result<i64, Missed> {
        let mut call = self.release.key(&held.key);
        call.arg(&held.value);
        self.run::<i64>(&call, backoff).await
    }

    async fn release_after_failure(&self, held: &Held) {
        // Two answered releases, a timeout apart, within about a lease's
        // worth of tries: the first may still overtake the late claim.
        let mut answered = 0;
        for _ in 0..RELEASE_TRIES {
            tokio::time::sleep(self.timeout).await;
            if self.release_with(held, Backoff::Ignore).await.is_ok() {
                answered += 1;
                if answered == 2 {
                    return;
                }
            }
        }
    }

    /// Replaces our claim by the finished result ([`done_value`]), kept for `ttl`.
    pub async fn finish(&self, held: &Held, done: String, ttl: Duration) {
        let mut call = self.finish.key(&held.key);
        call.arg(&held.value).arg(done).arg(millis(ttl));
        let _ = self.run::<i64>(&call, Backoff::Respect).await;
    }

    /// Reads what Redis holds for `key`, for status queries.
    pub async fn peek(&self, biz: &str, key: &str) -> Claim {
        let mut cmd = redis::cmd("GET");
        cmd.arg(redis_key(biz, key));
        let got: Result<Option<String>, Missed> =
            self.guarded(Backoff::Respect, |mut c| async move { cmd.query_async(&mut c).await }).await;
        match got {
            Ok(Some(found)) => parse(&found),
            Ok(None) | Err(_) => Claim::Unavailable,
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
        if backoff == Backoff::Respect && clock::now_ms() < self.down_until_ms.load(Ordering::Relaxed) {
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
                }
                return Ok(value);
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {:?}", self.timeout),
        };
        let until = clock::now_ms() + millis(BACKOFF);
        if self.down_until_ms.swap(until, Ordering::Relaxed) == 0 {
            tracing::warn!(error = %failure, "redis unavailable; idempotency continues on the database alone");
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
                        let config = ConnectionManagerConfig::new()
                            .set_connection_timeout(Some(self.timeout))
                            .set_response_timeout(Some(self.timeout))
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

/// A claim sent but not answered. Dropped so (the answer failed or timed
/// out, or the caller's future was dropped while waiting), the script may
/// still run and set our claim: it is released off the caller's path and
/// past the back-off, and retried until Redis answers, since a release that
/// overtakes the late claim (say, on a fresh connection) deletes nothing.
/// Compare-and-delete on our own token: repeating it is harmless.
struct Unanswered<'a> {
    claims: &'a Arc<Claims>,
    held: Option<Held>,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else { return };
        let claims = Arc::clone(self.claims);
        spawn_detached(async move { claims.release_after_failure(&held).await });
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

/// The value a finished call leaves in Redis; [`parse`] reads it back.
pub(crate) fn done_value(fingerprint: &str, response: &str) -> String {
    format!("d:{fingerprint}:{response}")
}

/// Runs `task` on the current runtime; outside one there is nothing to run
/// it on, and it is dropped (a claim then ends with its lease).
pub(crate) fn spawn_detached(task: impl std::future::Future<Output = ()> + Send + 'static) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(task);
    }
}

fn parse(found: &str) -> Claim {
    if let Some((fingerprint, response)) = found.strip_prefix("d:").and_then(|rest| rest.split_once(':')) {
        return Claim::Done { fingerprint: fingerprint.to_owned(), response: response.to_owned() };
    }
    // `p:...`, or a value we did not write: either way someone else's.
    Claim::Running
}

fn redis_key(biz: &str, key: &str) -> String {
    format!("idem:{biz}:{key}")
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// 128 bits that no other claim holds: a per-process random seed (from the
/// OS, through std's `RandomState`), the time and a counter.
fn token() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::OnceLock;
    static SEED: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let seed = SEED.get_or_init(Default::default);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut a = seed.build_hasher();
    a.write_u64(n);
    a.write_u128(clock::now_nanos());
    let mut b = seed.build_hasher();
    b.write_u64(!n);
    b.write_u64(a.finish());
    format!("{:016x}{:016x}", a.finish(), b.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_values() {
        match parse(&done_value("abc", "{\"x\":\"a:b\"}")) {
            Claim::Done { fingerprint, response } => {
                assert_eq!(fingerprint, "abc");
                assert_eq!(response, "{\"x\":\"a:b\"}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(parse("p:t:f"), Claim::Running));
        assert!(matches!(parse("garbage"), Claim::Running));
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
        let mut claim = |value: &str| -> Option<String> {
            script.key(&key).arg(value).arg(60_000).invoke(&mut conn).expect("claim script")
        };
        assert_eq!(claim("p:ours:f"), None, "taken");
        assert_eq!(claim("p:ours:f"), None, "sent again after a lost reply: still ours");
        assert_eq!(claim("p:theirs:f").as_deref(), Some("p:ours:f"), "someone else's is reported");
        let _: i64 = redis::cmd("DEL").arg(&key).query(&mut conn).expect("DEL");
    }

    #[test]
    fn tokens_do_not_repeat() {
        let set: std::collections::HashSet<_> = (0..10_000).map(|_| token()).collect();
        assert_eq!(set.len(), 10_000);
        assert!(set.iter().all(|t| t.len() == 32));
    }
}
