//! The gate with a Redis claim, shared by every instance: fast rejection of
//! concurrent duplicates and fast replay of finished calls; never the final
//! truth (Redis can lose keys).
//!
//! A call's claim and its finished result live where [`layout`] says: the
//! claim in a key of its own for the call's lease, the result in a hash of
//! the current window for the hot window ([`Builder::redis_hot_window`](crate::Builder::redis_hot_window)),
//! so Redis holds `rate × hot window` results whatever the records' ttl;
//! older duplicates find their answer in the record. A claim is one script
//! ([`scripts`]): the result if one is cached and live, else what holds the
//! claim, else the claim is ours. Every script touches the keys of one call,
//! which share a hash tag, so Redis Cluster routes it.
//!
//! Redis failing in any way degrades to the database alone ([`connection`]);
//! releases and result writes whose answer was lost are left to background
//! tasks ([`later`]). An entry the gate did not write (corrupt, truncated,
//! of another type) is absent: the claim script drops it and claims, and a
//! result whose response it could not check is dropped by a second claim
//! ([`RedisGate::claim`]). One bad entry never takes Redis from other keys.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use super::{Answer, Entry, Pass, Replayed};
use crate::clock::{self, AskingAgain, Clock};
use crate::fingerprint::Hex;
use crate::namespace::Namespace;
use crate::store::{Backend, Db, RowKey};

mod connection;
mod later;
pub(crate) mod layout;
mod scripts;
#[cfg(test)]
mod testing;
mod waiters;

pub use connection::BACKOFF;
use connection::{Backoff, Link, Missed, millis};
pub(crate) use connection::{Reply, Target};
#[cfg(test)]
use later::MAX_BACKGROUND;
use later::Unanswered;
#[cfg(test)]
use layout::parse_result;
use layout::{Place, ResultsName, claim_value, read_result, result_value, results_ttl_ms, window_of};
use scripts::{Scripts, evalsha};
use waiters::Heard;

/// How long a finished result stays in Redis for fast replays unless set
/// otherwise: between one and two of these ([`layout`]).
pub const DEFAULT_HOT_WINDOW: Duration = Duration::from_secs(10 * 60);

/// What the claim found.
#[derive(Debug)]
enum Found {
    /// We hold the key until the lease runs out.
    Ours(HeldClaim),
    /// A finished call left its result.
    Finished(Answer),
    /// Another call holds the key.
    Running,
    /// Redis is absent or failing: carry on with the database alone.
    Unavailable,
}

/// A claim we own: where the call lives, and the exact value we set.
#[derive(Debug, Clone)]
pub(crate) struct HeldClaim {
    place: Place,
    value: String,
}

/// The Redis side of an engine: one node or a cluster.
pub(crate) struct RedisGate {
    link: Link,
    namespace: NamespaceSlot,
    /// How long a finished result is kept for fast replays.
    hot_window: Duration,
    /// Background tasks running now; at most [`MAX_BACKGROUND`].
    background: AtomicUsize,
    scripts: Scripts,
    /// Duplicates waiting for a running call here (one Redis node; a
    /// cluster's waiters ask again at intervals).
    waiters: Option<waiters::Waiters>,
    /// The database's clock, which a cached result's expiry is judged by.
    clock: Arc<Clock>,
}

impl std::fmt::Debug for RedisGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisGate")
            .field("target", &self.link.kind())
            .field("timeout", &self.link.timeout)
            .field("hot_window", &self.hot_window)
            .finish()
    }
}

impl RedisGate {
    pub(crate) fn new(
        target: Target,
        timeout: Duration,
        namespace: Option<Namespace>,
        hot_window: Duration,
        clock: Arc<Clock>,
    ) -> Self {
        let waiters = match &target {
            Target::Single(client) => Some(waiters::Waiters::new(client.clone(), timeout)),
            Target::Cluster(_) => None,
        };
        Self {
            link: Link::new(target, timeout),
            namespace: NamespaceSlot::new(namespace),
            hot_window: hot_window.clamp(Duration::from_secs(1), clock::NO_BOUND),
            background: AtomicUsize::new(0),
            scripts: Scripts::new(),
            waiters,
            clock,
        }
    }

    /// The gate's answer for `(biz, key)`: our claim, a finished result, or
    /// busy (someone holds the claim; it may have committed since). `None`
    /// when Redis cannot tell: no namespace yet, or Redis failing.
    /// `expect_replay`: the fn's calls are mostly replays, so its result is
    /// looked for with one `HGET` before the claim script ([`Self::peek`]).
    pub(crate) async fn enter<DB: Backend>(
        self: &Arc<Self>,
        db: &Db<DB>,
        id: RowKey<'_>,
        fingerprint: &str,
        lease: Duration,
        expect_replay: bool,
    ) -> Option<Entry<'static>> {
        // Without a namespace (the database was never migrated) Redis could
        // mix this store's keys with another's: the database alone decides.
        let namespace = self.namespace.get(db).await?;
        let field = id.digest_bytes();
        if expect_replay && let Some(answer) = self.peek(&namespace, &field, fingerprint).await {
            return Some(Entry::Replay(Replayed::Read(answer), crate::metrics::Source::Redis));
        }
        let place = Place::at(&namespace, id.biz, id.key, field);
        // Boxed: inline, the claim's future (its retries, its release if
        // dropped) would add 400 bytes to every call's, replays' too, which
        // are moved as they are built; a claim costs a round trip anyway.
        match Box::pin(self.claim(place, fingerprint, lease)).await {
            Found::Ours(held) => {
                Some(Entry::GoAhead(Pass::Claim(ClaimGuard { gate: Arc::clone(self), held: Some(held) })))
            }
            Found::Finished(answer) => Some(Entry::Replay(Replayed::Read(answer), crate::metrics::Source::Redis)),
            Found::Running => Some(Entry::Busy { may_have_committed: true }),
            Found::Unavailable => None,
        }
    }

    /// A duplicate of a running call, waiting until `deadline` for it to
    /// end: then what the claim says (its result, the key free, or another
    /// call's claim, waited on in turn). `None` while it still runs at the
    /// deadline, or when Redis cannot tell. Told of the end on one Redis
    /// node (`waiters`); asking again at doubling intervals on a cluster.
    pub(crate) async fn wait_running<DB: Backend>(
        self: &Arc<Self>,
        db: &Db<DB>,
        id: RowKey<'_>,
        fingerprint: &str,
        lease: Duration,
        deadline: tokio::time::Instant,
    ) -> Option<Entry<'static>> {
        let namespace = self.namespace.get(db).await?;
        let claim = Place::at(&namespace, id.biz, id.key, id.digest_bytes()).claim;
        let mut subscription = self.waiters.as_ref().map(|waiters| waiters.subscribe(&claim));
        // Confirmed by Redis first: an end after the question below is heard.
        let mut listening = match &mut subscription {
            Some(subscription) => subscription.confirmed(deadline).await,
            None => false,
        };
        let mut asking = AskingAgain::until(deadline);
        loop {
            match self.enter(db, id, fingerprint, lease, false).await? {
                Entry::Busy { .. } => {}
                settled => return Some(settled),
            }
            let heard = match &mut subscription {
                Some(subscription) if listening => subscription.heard(deadline).await,
                _ if asking.pause(None).await && tokio::time::Instant::now() < deadline => Heard::Ended,
                _ => Heard::Deadline,
            };
            match heard {
                Heard::Ended => {}
                // Ask at intervals from here.
                Heard::Lost => listening = false,
                // One last question: it may have ended just now.
                Heard::Deadline => {
                    return match self.enter(db, id, fingerprint, lease, false).await? {
                        Entry::Busy { .. } => None,
                        settled => Some(settled),
                    };
                }
            }
        }
    }

    /// `'1'` when duplicates may wait here (told by the scripts on the
    /// claim key's channel), `'0'` on a cluster, whose waiters poll.
    pub(crate) fn publish(&self) -> &'static str {
        if self.waiters.is_some() { "1" } else { "0" }
    }

    /// Whether a call holds the claim of `(biz, key)` right now.
    pub(crate) async fn is_running<DB: Backend>(&self, db: &Db<DB>, biz: &str, key: &str) -> bool {
        let Some(namespace) = self.namespace.get(db).await else { return false };
        let mut get = redis::cmd("GET");
        get.arg(Place::of(&namespace, biz, key).claim);
        let held: Result<Option<Vec<u8>>, Missed> = self.link.query(&get, Backoff::Respect).await;
        matches!(held, Ok(Some(value)) if value.starts_with(b"p:"))
    }

    /// Whether the namespace is known: a claim then asks Redis alone (the
    /// first read of it takes a connection of the pool).
    pub(crate) fn knows_namespace(&self) -> bool {
        self.namespace.known()
    }

    /// The namespace set on the builder, if any.
    pub(crate) fn fixed_namespace(&self) -> Option<Namespace> {
        self.namespace.fixed.clone()
    }

    /// Reads the namespace from the database again on the next call.
    pub(crate) fn forget_namespace(&self) {
        self.namespace.forget();
    }

    /// The namespace this engine's Redis keys carry, if known yet (for the
    /// engine's other Redis users: issued tokens).
    pub(crate) async fn namespace<DB: Backend>(&self, db: &Db<DB>) -> Option<Namespace> {
        self.namespace.get(db).await
    }

    /// Sends `cmd` for the engine's other Redis users (see [`Link::send`]).
    pub(crate) async fn send<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Reply<T> {
        self.link.send(cmd).await
    }

    /// Runs `call` for the engine's other Redis users (see [`Link::send`]).
    pub(crate) async fn send_script<T: redis::FromRedisValue>(&self, call: &redis::ScriptInvocation<'_>) -> Reply<T> {
        self.link.send_script(call).await
    }

    /// A live result of `place` in this window's hash, read with one native
    /// `HGET`: Redis does a fraction of the claim script's work, and the
    /// reply is the floor's. Anything else (no result, an expired or
    /// unreadable one, Redis failing) is `None`, and the claim decides as
    /// if this had not been asked; so is a result of the window before,
    /// which the claim script finds and copies into this window's hash for
    /// the next read. A wrong guess costs one round trip.
    async fn peek(&self, namespace: &Namespace, field: &[u8; 16], fingerprint: &str) -> Option<Answer> {
        let now = self.clock.now_ms();
        let name = ResultsName { namespace, field, window: window_of(now, self.hot_window) };
        // Sized once: grown an argument at a time, the command reallocated thrice.
        let mut hget = redis::Cmd::with_capacity(3, 4 + name.len() + field.len());
        hget.arg("HGET").arg(name).arg(&field[..]);
        let value: Option<Vec<u8>> = self.link.query(&hget, Backoff::Respect).await.ok()?;
        match read(value?, fingerprint) {
            Ok(Found::Finished(answer)) if answer.expires_ms > now => Some(answer),
            _ => None,
        }
    }

    /// Claims the call at `place` for `lease`, or reports what holds it.
    ///
    /// A result the script answered but whose bytes cannot be read (the
    /// script checks their shape, not that the response is UTF-8) is no
    /// answer: the claim is sent again with those bytes, which the script
    /// then drops as absent. Sent again twice at most (it reads two
    /// windows' hashes); past that the call goes to the database alone.
    async fn claim(self: &Arc<Self>, place: Place, fingerprint: &str, lease: Duration) -> Found {
        let held = HeldClaim { place, value: claim_value(fingerprint) };
        let mut unanswered = Unanswered { claims: self, held: Some(held) };
        let mut unreadable = None;
        for _ in 0..3 {
            let answer = match &unanswered.held {
                Some(held) => self.send_claim(held, lease, unreadable.as_deref()).await,
                None => Err(Missed::Skipped),
            };
            match answer {
                Err(Missed::Failed) => return Found::Unavailable, // `unanswered` releases what may have landed
                // Skipped while Redis backs off (never sent), or refused:
                // the script ran no further than the error, and sets the
                // claim last.
                Err(Missed::Skipped | Missed::Refused) => break,
                Ok(None) => match unanswered.held.take() {
                    Some(held) => return Found::Ours(held),
                    None => break,
                },
                Ok(Some(value)) => match read(value, fingerprint) {
                    Ok(found) => {
                        unanswered.held = None;
                        return found;
                    }
                    Err(bytes) => unreadable = Some(bytes),
                },
            }
        }
        unanswered.held = None;
        Found::Unavailable
    }

    /// Sends the claim `held`: `None` when the key is ours, else the bytes
    /// that hold it. `unreadable`: bytes a previous answer held that cannot
    /// be read, for the script to drop.
    async fn send_claim(
        &self,
        held: &HeldClaim,
        lease: Duration,
        unreadable: Option<&[u8]>,
    ) -> Result<Option<Vec<u8>>, Missed> {
        let now = self.clock.now_ms();
        let [current, previous] = held.place.results_at(now, self.hot_window);
        let mut call = evalsha(&self.scripts.claim, &[&held.place.claim, &current, &previous]);
        let ttl = results_ttl_ms(now, self.hot_window);
        call.arg(&held.value).arg(millis(lease)).arg(&held.place.field[..]).arg(now).arg(ttl);
        if let Some(bytes) = unreadable {
            call.arg(bytes);
        }
        self.link.eval(&self.scripts.claim, &call, Backoff::Respect).await
    }
}

/// What the claim script answered, for a caller with `fingerprint`: someone
/// else's claim, or a finished result (under the caller's fingerprint if it
/// was stored for the same arguments, else under the stored one's prefix,
/// so that the caller answers `KeyReused`). `Err` hands back bytes the gate
/// did not write.
fn read(value: Vec<u8>, fingerprint: &str) -> Result<Found, Vec<u8>> {
    if value.starts_with(b"p:") {
        return Ok(Found::Running);
    }
    let stored = read_result(value)?;
    let fingerprint =
        if stored.is_for(fingerprint) { Hex::stored(fingerprint) } else { stored.fingerprint_prefix_hex() };
    let (response, failed, expires_ms) = (stored.response, stored.failed, stored.expires_ms);
    Ok(Found::Finished(Answer { fingerprint, response, failed, expires_ms }))
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
    /// record already holds it, and a duplicate arriving before the write
    /// lands reads it from there. The cached copy carries the record's
    /// expiry, so it never answers past it, however late it lands.
    pub(crate) fn finish(mut self, answer: &Answer) {
        let Some(held) = self.held.take() else { return };
        let done = result_value(answer.expires_ms, &answer.fingerprint, &answer.response, answer.failed);
        let field = held.place.field;
        self.gate.finish_later(held, field, done);
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
    /// `clock::monotonic_ms()` before which the database is not asked again.
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

    fn known(&self) -> bool {
        self.fixed.is_some() || self.read.read().unwrap_or_else(std::sync::PoisonError::into_inner).is_some()
    }

    async fn get<DB: Backend>(&self, db: &Db<DB>) -> Option<Namespace> {
        if let Some(fixed) = &self.fixed {
            return Some(fixed.clone());
        }
        if let Some(read) = &*self.read.read().unwrap_or_else(std::sync::PoisonError::into_inner) {
            return Some(read.clone());
        }
        if clock::monotonic_ms() < self.unreadable_until_ms.load(Ordering::Relaxed) {
            return None;
        }
        // Boxed: read once per engine, this query's future would otherwise
        // sit in every call's future (and be copied with it on each call).
        let why = match Box::pin(DB::namespace(db)).await {
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
        if self.unreadable_until_ms.swap(clock::monotonic_ms() + millis(BACKOFF), Ordering::Relaxed) == 0 {
            tracing::warn!(reason = %why, "no namespace for redis keys; idempotency continues on the database alone");
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{black_hole, redis_url, test_client};
    use super::*;
    use crate::random::token;

    const FP: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    const OTHER_FP: &str = "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210";

    /// The host's clock: these tests stamp and judge on one host.
    fn local_clock() -> Arc<Clock> {
        Arc::new(Clock::new(false))
    }

    /// A connection to the test Redis, or `None` (skipped) when none
    /// answers, unless `IDEM_REQUIRE_SERVICES` is set.
    async fn test_redis() -> Option<redis::aio::MultiplexedConnection> {
        Some(test_client().await?.get_multiplexed_async_connection().await.expect("redis"))
    }

    fn gate(hot_window: Duration) -> Arc<RedisGate> {
        let target = Target::Single(redis::Client::open(redis_url()).unwrap());
        Arc::new(RedisGate::new(target, Duration::from_secs(2), None, hot_window, local_clock()))
    }

    async fn hset(conn: &mut redis::aio::MultiplexedConnection, hash: &str, field: &[u8], value: &[u8]) {
        let _: i64 = redis::cmd("HSET").arg(hash).arg(field).arg(value).query_async(conn).await.unwrap();
        let _: i64 = redis::cmd("PEXPIRE").arg(hash).arg(60_000).query_async(conn).await.unwrap();
    }

    async fn del(conn: &mut redis::aio::MultiplexedConnection, keys: &[&str]) {
        let _: i64 = redis::cmd("DEL").arg(keys).query_async(conn).await.unwrap();
    }

    /// Every answer of the claim script: ours, our own value sent again,
    /// someone else's claim, a live result in this window's hash and in the
    /// one before (copied into this window's), a result stored for other
    /// arguments, and an expired result (no answer: the claim is ours).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_and_replays_through_the_script() {
        let Some(mut conn) = test_redis().await else { return };
        // Windows of a thousand years: the test never straddles two.
        let hot = Duration::from_secs(1_000 * 365 * 86_400);
        let gate = gate(hot);
        let namespace = Namespace::new("t_unit").unwrap();
        let (biz, key) = ("t_claim", token());
        let place = Place::of(&namespace, biz, &key);
        let now = local_clock().now_ms();
        let [current, previous] = place.results_at(now, hot);
        let lease = Duration::from_secs(60);
        let get = |conn: &mut redis::aio::MultiplexedConnection| {
            let mut conn = conn.clone();
            let claim = place.claim.clone();
            async move { redis::cmd("GET").arg(&claim).query_async::<Option<String>>(&mut conn).await.unwrap() }
        };

        let Found::Ours(held) = gate.claim(Place::of(&namespace, biz, &key), FP, lease).await else {
            panic!("not ours")
        };
        assert_eq!(get(&mut conn).await.as_deref(), Some(held.value.as_str()));
        assert!(matches!(gate.send_claim(&held, lease, None).await, Ok(None)), "our own value sent again is ours");
        assert!(matches!(gate.claim(Place::of(&namespace, biz, &key), FP, lease).await, Found::Running));

        // A live result answers, from this window's hash or the one before;
        // the claim is left alone.
        for hash in [&current, &previous] {
            hset(&mut conn, hash, &place.field, &result_value(now + 60_000, FP, "{\"a\":1}", false)).await;
            match gate.claim(Place::of(&namespace, biz, &key), FP, lease).await {
                Found::Finished(answer) => {
                    assert_eq!((answer.response.as_str(), answer.fingerprint.as_str()), ("{\"a\":1}", FP));
                    assert_eq!(answer.expires_ms, now + 60_000);
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(get(&mut conn).await.as_deref(), Some(held.value.as_str()), "the claim is left alone");
            // Found in the window before: this window's hash has it now, for one HGET.
            let copied: Option<Vec<u8>> =
                redis::cmd("HGET").arg(&current).arg(&place.field[..]).query_async(&mut conn).await.unwrap();
            assert_eq!(copied, Some(result_value(now + 60_000, FP, "{\"a\":1}", false)), "{hash}");
            let pttl: i64 = redis::cmd("PTTL").arg(&current).query_async(&mut conn).await.unwrap();
            assert!(pttl > 0, "{pttl}");
            // Other arguments get the stored fingerprint's prefix: `KeyReused`.
            match gate.claim(Place::of(&namespace, biz, &key), OTHER_FP, lease).await {
                Found::Finished(answer) => assert_eq!(answer.fingerprint.as_str(), &FP[..32]),
                other => panic!("{other:?}"),
            }
            del(&mut conn, &[&current, &previous]).await;
        }

        // Expired by the database's clock, still kept by Redis: no answer.
        del(&mut conn, &[&place.claim]).await;
        hset(&mut conn, &current, &place.field, &result_value(now - 1, FP, "1", false)).await;
        let Found::Ours(held) = gate.claim(Place::of(&namespace, biz, &key), FP, lease).await else {
            panic!("expired, not ours")
        };
        assert_eq!(get(&mut conn).await.as_deref(), Some(held.value.as_str()));
        del(&mut conn, &[&place.claim, &current]).await;
    }

    /// Regression (issue 32.5): a result value shorter than the claim
    /// script read made it fail, and the failure backed Redis off for every
    /// call. Whatever the gate did not write at a call's places is absent:
    /// the claim is ours, the bad entry is gone, Redis is not backed off.
    /// Each shape in this window's hash and in the one before.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn results_the_gate_did_not_write_are_absent_and_dropped() {
        let Some(mut conn) = test_redis().await else { return };
        let hot = Duration::from_secs(60);
        let gate = gate(hot);
        // Its own namespace: no other test's results share its hashes.
        let namespace = Namespace::new(&format!("t_bad_results.{}", token())).unwrap();
        let lease = Duration::from_secs(60);
        let now = local_clock().now_ms();
        let live = result_value(now + 60_000, FP, "{\"a\":1}", false);
        let mut not_utf8 = live.clone();
        not_utf8.push(0xff);
        let mut other_tag = live.clone();
        other_tag[0] = b'x';
        let shapes: [(&str, Vec<u8>); 7] = [
            ("empty", Vec::new()),
            ("the tag alone", b"d".to_vec()),
            ("the expiry cut short", live[..4].to_vec()),
            ("one byte short of a fingerprint", live[..22].to_vec()),
            ("another tag", other_tag),
            ("a claim's bytes", b"p:owner:fp".to_vec()),
            ("a response that is not UTF-8", not_utf8),
        ];
        for (what, bytes) in shapes {
            for window in [0, 1] {
                let place = Place::of(&namespace, "t_bad", &token());
                let hash = &place.results_at(now, hot)[window];
                hset(&mut conn, hash, &place.field, &bytes).await;
                let held = match gate.claim(place.clone(), FP, lease).await {
                    Found::Ours(held) => held,
                    other => panic!("{what}, window -{window}: {other:?}"),
                };
                let claim: Option<String> = redis::cmd("GET").arg(&place.claim).query_async(&mut conn).await.unwrap();
                assert_eq!(claim.as_deref(), Some(held.value.as_str()), "{what}: claimed in Redis");
                let left: Option<Vec<u8>> =
                    redis::cmd("HGET").arg(hash).arg(&place.field[..]).query_async(&mut conn).await.unwrap();
                assert_eq!(left, None, "{what}, window -{window}: dropped");
                assert!(!gate.link.backing_off(), "{what}: Redis is not backed off");
                del(&mut conn, &[&place.claim]).await;
            }
        }

        // A result hash of another type: dropped, so the claim and then the
        // result written in its place go through.
        let place = Place::of(&namespace, "t_bad", &token());
        let [current, _] = place.results_at(now, hot);
        let _: () =
            redis::cmd("SET").arg(&current).arg("x").arg("PX").arg(60_000).query_async(&mut conn).await.unwrap();
        let Found::Ours(held) = gate.claim(place.clone(), FP, lease).await else { panic!("another type, not ours") };
        let kind: String = redis::cmd("TYPE").arg(&current).query_async(&mut conn).await.unwrap();
        assert_eq!(kind, "none", "the string where a result hash goes is dropped");
        // Again where the cache write goes, after the claim.
        let _: () =
            redis::cmd("SET").arg(&current).arg("x").arg("PX").arg(60_000).query_async(&mut conn).await.unwrap();
        let guard = ClaimGuard { gate: Arc::clone(&gate), held: Some(held) };
        guard.finish(&Answer {
            fingerprint: Hex::stored(FP),
            response: "{\"b\":2}".into(),
            failed: false,
            expires_ms: now + 60_000,
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !matches!(gate.claim(place.clone(), FP, lease).await, Found::Finished(_)) {
            assert!(std::time::Instant::now() < deadline, "the result never replaced the string");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!gate.link.backing_off());
        del(&mut conn, &[&current]).await;
    }

    /// What holds a claim key without being a claim (not `p:`, such as an
    /// earlier layout's result; no lease; a key of another type) is absent:
    /// the claim is ours. A release meeting a key of another type deletes
    /// nothing and is answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claim_keys_the_gate_did_not_write_are_absent() {
        let Some(mut conn) = test_redis().await else { return };
        let gate = gate(Duration::from_secs(60));
        let namespace = Namespace::new(&format!("t_bad_claims.{}", token())).unwrap();
        let lease = Duration::from_secs(60);
        for (what, value, ttl) in
            [("a result of the layout before", "d:1796212228629:ab:{}", Some(60_000)), ("no lease", "p:owner:fp", None)]
        {
            let place = Place::of(&namespace, "t_bad", &token());
            let mut set = redis::cmd("SET");
            set.arg(&place.claim).arg(value);
            if let Some(ttl) = ttl {
                set.arg("PX").arg(ttl);
            }
            let _: () = set.query_async(&mut conn).await.unwrap();
            let Found::Ours(held) = gate.claim(place.clone(), FP, lease).await else { panic!("{what}: not ours") };
            let claim: Option<String> = redis::cmd("GET").arg(&place.claim).query_async(&mut conn).await.unwrap();
            assert_eq!(claim.as_deref(), Some(held.value.as_str()), "{what}");
            let pttl: i64 = redis::cmd("PTTL").arg(&place.claim).query_async(&mut conn).await.unwrap();
            assert!(pttl > 0, "{what}: with our lease ({pttl})");
            del(&mut conn, &[&place.claim]).await;
        }

        let place = Place::of(&namespace, "t_bad", &token());
        hset(&mut conn, &place.claim, b"f", b"v").await;
        let Found::Ours(held) = gate.claim(place.clone(), FP, lease).await else { panic!("another type: not ours") };
        let claim: Option<String> = redis::cmd("GET").arg(&place.claim).query_async(&mut conn).await.unwrap();
        assert_eq!(claim.as_deref(), Some(held.value.as_str()));
        // Our claim replaced by a hash: the release leaves it alone and is
        // answered (nothing is left to retry in the background).
        del(&mut conn, &[&place.claim]).await;
        hset(&mut conn, &place.claim, b"f", b"v").await;
        gate.release(&held).await;
        assert_eq!(gate.background(), 0, "the release was answered");
        let kind: String = redis::cmd("TYPE").arg(&place.claim).query_async(&mut conn).await.unwrap();
        assert_eq!(kind, "hash", "not ours to delete");
        assert!(!gate.link.backing_off());
        del(&mut conn, &[&place.claim]).await;
    }

    /// A finished call's claim turns into its result in this window's hash,
    /// which expires one hot window after the window ends; the claim key is
    /// gone, and the next claim replays it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_finished_claim_becomes_a_result_in_the_windows_hash() {
        let Some(mut conn) = test_redis().await else { return };
        let hot = Duration::from_secs(60);
        let gate = gate(hot);
        let namespace = Namespace::new("t_unit").unwrap();
        let (biz, key) = ("t_finish", token());
        let lease = Duration::from_secs(60);
        let Found::Ours(held) = gate.claim(Place::of(&namespace, biz, &key), FP, lease).await else {
            panic!("not ours")
        };
        let place = held.place.clone();
        let guard = ClaimGuard { gate: Arc::clone(&gate), held: Some(held) };
        let now = local_clock().now_ms();
        guard.finish(&Answer {
            fingerprint: Hex::stored(FP),
            response: "{\"b\":2}".into(),
            failed: false,
            expires_ms: now + 3_600_000,
        });
        let hash = place.results(layout::window_of(now, hot));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let value: Option<Vec<u8>> =
                redis::cmd("HGET").arg(&hash).arg(&place.field[..]).query_async(&mut conn).await.unwrap();
            if let Some(value) = value {
                assert_eq!(parse_result(value).unwrap().response, "{\"b\":2}");
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the result never landed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let exists: i64 = redis::cmd("EXISTS").arg(&place.claim).query_async(&mut conn).await.unwrap();
        assert_eq!(exists, 0, "the claim key is gone");
        let ttl: i64 = redis::cmd("PTTL").arg(&hash).query_async(&mut conn).await.unwrap();
        assert!((60_000 - 1_000..=120_000).contains(&ttl), "{ttl}");
        assert!(matches!(gate.claim(Place::of(&namespace, biz, &key), FP, lease).await, Found::Finished(_)));
        let _: i64 = redis::cmd("HDEL").arg(&hash).arg(&place.field[..]).query_async(&mut conn).await.unwrap();
    }

    /// Regression: with Redis black-holed (it accepts connections and never
    /// answers), every claim sent before the first timeout leaves a release
    /// for later; at most `MAX_BACKGROUND` of them run at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn background_work_is_bounded_when_redis_never_answers() {
        let (client, hole) = black_hole().await;
        let claims = Arc::new(RedisGate::new(
            Target::Single(client),
            Duration::from_millis(300),
            None,
            DEFAULT_HOT_WINDOW,
            local_clock(),
        ));
        let namespace = Namespace::new("t_unit").unwrap();
        let tasks_before = tokio::runtime::Handle::current().metrics().num_alive_tasks();

        let calls = 4 * MAX_BACKGROUND;
        let barrier = Arc::new(tokio::sync::Barrier::new(calls));
        let mut set = tokio::task::JoinSet::new();
        for i in 0..calls {
            let (claims, namespace, barrier) = (Arc::clone(&claims), namespace.clone(), Arc::clone(&barrier));
            set.spawn(async move {
                barrier.wait().await;
                claims.claim(Place::of(&namespace, "t_hole", &format!("k{i}")), "f", Duration::from_secs(30)).await
            });
        }
        let mut unavailable = 0;
        while let Some(claim) = set.join_next().await {
            unavailable += usize::from(matches!(claim.expect("claim task"), Found::Unavailable));
        }
        assert_eq!(unavailable, calls, "no claim was answered");
        assert!(claims.link.backing_off());
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
