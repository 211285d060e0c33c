//! Layer 2, the duplicate gate: before a call touches the database, what
//! holds its key? One vocabulary for both ways of knowing: go ahead (with a
//! [`Pass`] to settle afterwards), replay this, or busy.
//!
//! - [`redis`]: a claim in Redis, shared by every instance (feature `redis`).
//! - [`memory`]: calls running on this engine, waited for in memory; the
//!   gate whenever there is no claim (no Redis, or Redis failing).

use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::fingerprint::Hex;
use crate::store::{Backend, Db, RowKey};

pub(crate) mod local;
pub(crate) mod memory;
#[cfg(feature = "redis")]
pub(crate) mod redis;

use local::{LocalCache, LocalGate};
use memory::{Leader, MemoryGate};
#[cfg(feature = "redis")]
use redis::{ClaimGuard, RedisGate};

/// A finished call's result, as the gate hands it to a duplicate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    /// Fingerprint of the arguments stored with the result.
    pub fingerprint: Hex,
    /// The serialized result, as stored.
    pub response: String,
    /// Whether `response` is a recorded business error (`record_errors`),
    /// replayed as the fn's `Err`, rather than its value.
    pub failed: bool,
    /// When its record expires (epoch ms): no copy answers past it.
    pub expires_ms: i64,
}

/// A finished call's result as a gate hands it on: read from Redis for
/// this call alone, or shared (by the waiters here, the local cache). One
/// read alone is not put behind an `Arc`: a replay allocates nothing more
/// for it.
pub(crate) enum Replayed {
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Read(Answer),
    Shared(Arc<Answer>),
}

impl Replayed {
    /// The answer, to be kept (made an `Arc` only now, if it was read).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn shared(self) -> Arc<Answer> {
        match self {
            Replayed::Read(answer) => Arc::new(answer),
            Replayed::Shared(answer) => answer,
        }
    }
}

impl std::ops::Deref for Replayed {
    type Target = Answer;

    fn deref(&self) -> &Answer {
        match self {
            Replayed::Read(answer) => answer,
            Replayed::Shared(answer) => answer,
        }
    }
}

/// What the gate decided for one call.
pub(crate) enum Entry<'g> {
    /// Nobody holds the key: go ahead, and settle the pass afterwards.
    GoAhead(Pass<'g>),
    /// A finished call's result: replay it (or answer `KeyReused`). The
    /// source says which gate had it (for metrics).
    Replay(Replayed, crate::metrics::Source),
    /// Another call holds the key. If it may have committed since it took
    /// the key (a Redis claim outlives the commit until the cache write
    /// lands), the record knows better.
    Busy { may_have_committed: bool },
}

/// The right to run, held while the body runs.
pub(crate) enum Pass<'g> {
    /// Our Redis claim: duplicates everywhere are kept out.
    #[cfg(feature = "redis")]
    Claim(ClaimGuard),
    /// The first call of its key on this engine: duplicates here wait.
    Leader(Leader<'g>),
}

impl Pass<'_> {
    /// Whether duplicates on other instances are kept out (then the record
    /// can go in last, with the result).
    pub(crate) fn holds_claim(&self) -> bool {
        match self {
            #[cfg(feature = "redis")]
            Pass::Claim(_) => true,
            Pass::Leader(_) => false,
        }
    }

    /// The call recorded `answer`: hands it on to the duplicates (Redis in
    /// place of our claim, or the waiters here).
    pub(crate) fn finish(self, answer: &Arc<Answer>) {
        match self {
            #[cfg(feature = "redis")]
            Pass::Claim(claim) => claim.finish(answer),
            Pass::Leader(leader) => leader.finish(Arc::clone(answer)),
        }
    }

    /// The call recorded nothing: the next one may go ahead.
    pub(crate) async fn abandon(self) {
        match self {
            #[cfg(feature = "redis")]
            Pass::Claim(mut claim) => claim.release().await,
            // Dropped, it lets its waiters go on as if first.
            Pass::Leader(leader) => drop(leader),
        }
    }
}

/// The gates of one engine.
pub(crate) struct Gate {
    local: Option<LocalGate>,
    #[cfg(feature = "redis")]
    redis: Option<Arc<RedisGate>>,
    memory: MemoryGate,
}

impl Gate {
    /// The in-memory gate alone.
    pub(crate) fn memory() -> Self {
        Self {
            local: None,
            #[cfg(feature = "redis")]
            redis: None,
            memory: MemoryGate::default(),
        }
    }

    /// Checks `cache` first, before anything else.
    pub(crate) fn with_local_cache(mut self, cache: Option<LocalCache>, clock: &Arc<Clock>) -> Self {
        self.local = cache.map(|cache| LocalGate::new(cache, Arc::clone(clock)));
        self
    }

    /// Claims in Redis first; the in-memory gate when Redis cannot tell.
    #[cfg(feature = "redis")]
    pub(crate) fn redis(redis: RedisGate) -> Self {
        Self { local: None, redis: Some(Arc::new(redis)), memory: MemoryGate::default() }
    }

    /// Whether a call's claim asks Redis alone, not the database: Redis is
    /// set and its namespace known (it may still fail a call over to the
    /// in-memory gate).
    pub(crate) fn claims_in_redis_alone(&self) -> bool {
        #[cfg(feature = "redis")]
        return self.redis.as_ref().is_some_and(|redis| redis.knows_namespace());
        #[cfg(not(feature = "redis"))]
        false
    }

    /// Decides for the call `id` (its digest computed once, for the record
    /// and for Redis); `lease` bounds a Redis claim, `wait` the wait in
    /// memory for a duplicate running here; `expect_replay`: the fn's calls
    /// are mostly replays (`call/read_first.rs`), so Redis is read before
    /// it is asked to claim.
    pub(crate) async fn enter<DB: Backend>(
        &self,
        db: &Db<DB>,
        id: RowKey<'_>,
        fingerprint: &str,
        lease: Duration,
        wait: Duration,
        expect_replay: bool,
    ) -> Entry<'_> {
        let (biz, key) = (id.biz, id.key);
        if let Some(local) = &self.local
            && let Some(answer) = local.get(biz, key)
        {
            return Entry::Replay(Replayed::Shared(answer), crate::metrics::Source::Local);
        }
        #[cfg(feature = "redis")]
        if let Some(redis) = &self.redis
            && let Some(entry) = redis.enter(db, id, fingerprint, lease, expect_replay).await
        {
            return self.keep(biz, key, fingerprint, entry);
        }
        let _ = (db, fingerprint, lease, expect_replay);
        self.memory.enter(biz, key, wait).await
    }

    /// A duplicate told `Busy`, waiting until `deadline` for the running
    /// call to end: then the gate's answer again (its result, the key free
    /// to go ahead, or another call's claim). `None` while it still runs at
    /// the deadline. Only a Redis claim is waited on here: the in-memory
    /// gate waited in [`enter`](Gate::enter) already, and without a claim
    /// the unique index is the wait.
    pub(crate) async fn wait_running<DB: Backend>(
        &self,
        db: &Db<DB>,
        id: RowKey<'_>,
        fingerprint: &str,
        lease: Duration,
        deadline: tokio::time::Instant,
    ) -> Option<Entry<'_>> {
        #[cfg(feature = "redis")]
        if let Some(redis) = &self.redis {
            let entry = redis.wait_running(db, id, fingerprint, lease, deadline).await;
            return entry.map(|entry| self.keep(id.biz, id.key, fingerprint, entry));
        }
        let _ = (db, id, fingerprint, lease, deadline);
        None
    }

    /// The committed result of `(biz, key)` the local cache holds, if any;
    /// asks nobody and claims nothing.
    pub(crate) fn cached(&self, biz: &str, key: &str) -> Option<Arc<Answer>> {
        self.local.as_ref()?.get(biz, key)
    }

    /// `entry`, its result kept in the local cache (if any) when it answers
    /// these arguments: one stored for others carries just its
    /// fingerprint's prefix.
    #[cfg(feature = "redis")]
    fn keep(&self, biz: &str, key: &str, fingerprint: &str, entry: Entry<'static>) -> Entry<'static> {
        match entry {
            Entry::Replay(answer, source) if self.local.is_some() && answer.fingerprint.as_str() == fingerprint => {
                let answer = answer.shared();
                self.remember(biz, key, &answer);
                Entry::Replay(Replayed::Shared(answer), source)
            }
            entry => entry,
        }
    }

    /// A committed result of `(biz, key)`: kept in the local cache, if any.
    pub(crate) fn remember(&self, biz: &str, key: &str, answer: &Arc<Answer>) {
        if let Some(local) = &self.local {
            local.remember(biz, key, Arc::clone(answer));
        }
    }

    /// Whether a call holds `(biz, key)` right now, as far as Redis knows
    /// (a call running without a claim is invisible until it commits).
    pub(crate) async fn is_running<DB: Backend>(&self, db: &Db<DB>, biz: &str, key: &str) -> bool {
        #[cfg(feature = "redis")]
        if let Some(redis) = &self.redis {
            return redis.is_running(db, biz, key).await;
        }
        let _ = (db, biz, key);
        false
    }

    /// The namespace set on the builder, if any.
    #[cfg(feature = "redis")]
    pub(crate) fn fixed_namespace(&self) -> Option<crate::namespace::Namespace> {
        self.redis.as_ref().and_then(|redis| redis.fixed_namespace())
    }

    /// Makes the Redis gate read the namespace again (after `migrate`).
    pub(crate) fn forget_namespace(&self) {
        #[cfg(feature = "redis")]
        if let Some(redis) = &self.redis {
            redis.forget_namespace();
        }
    }

    /// The Redis side, for the engine's other Redis users (issued tokens).
    #[cfg(feature = "redis")]
    pub(crate) fn redis_gate(&self) -> Option<&Arc<RedisGate>> {
        self.redis.as_ref()
    }
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Gate");
        #[cfg(feature = "redis")]
        d.field("redis", &self.redis);
        d.finish_non_exhaustive()
    }
}
