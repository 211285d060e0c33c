//! The local replay cache: finished results kept in this process, checked
//! before Redis, so a replay costs no round trip at all (seed 002: at very
//! high request rates Redis itself becomes the bottleneck).
//!
//! It holds only committed results, each with its fingerprint (a different
//! one answers `KeyReused` exactly as from Redis or the record) and its
//! record's expiry, which it never outlives. An entry also leaves after
//! [`LocalCache::max_age`]: the inconsistency accepted between instances.
//! A record another instance forgot (an operator's `forget`) or replaced
//! after it expired may still be answered here for that long.
//!
//! Bounded by entries and by bytes ([quick_cache], a concurrent cache with a
//! weighted capacity): every entry weighs at least `max_bytes / max_entries`,
//! so the byte bound also caps the count.
//!
//! An entry's age is counted by the engine's clock unless the cache is given
//! one of its own ([`LocalCache::age_clock`]): a test moves that one by hand,
//! so `max_age` passes exactly when the test says, however slow the machine.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::Answer;
use crate::clock::Clock;

/// An optional bounded in-process cache of finished results; see
/// [`Builder::local_cache`](crate::Builder::local_cache).
#[derive(Clone)]
pub struct LocalCache {
    max_entries: usize,
    max_bytes: u64,
    max_age: Duration,
    age_clock: Option<AgeClock>,
}

/// A clock an entry's age is counted by: time since any fixed point, never
/// going back.
type AgeClock = Arc<dyn Fn() -> Duration + Send + Sync>;

impl fmt::Debug for LocalCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalCache")
            .field("max_entries", &self.max_entries)
            .field("max_bytes", &self.max_bytes)
            .field("max_age", &self.max_age)
            .field("age_clock", &self.age_clock.as_ref().map_or("the engine's", |_| "its own"))
            .finish()
    }
}

impl LocalCache {
    /// At most `max_entries` results taking at most `max_bytes` (keys,
    /// fingerprints and responses, plus a fixed overhead per entry), each
    /// kept at most 10 s (see [`max_age`](LocalCache::max_age)).
    pub fn new(max_entries: usize, max_bytes: u64) -> Self {
        LocalCache {
            max_entries: max_entries.max(1),
            max_bytes: max_bytes.max(1),
            max_age: Duration::from_secs(10),
            age_clock: None,
        }
    }

    /// How long an entry may answer, at most, whatever its record's ttl: the
    /// bound on how long this instance may replay a result another instance
    /// (or an operator) has since removed. Default 10 s.
    pub fn max_age(mut self, max_age: Duration) -> Self {
        self.max_age = max_age;
        self
    }

    /// Counts an entry's age (for [`max_age`](LocalCache::max_age)) by
    /// `clock`, the time since any fixed point, which must never go back;
    /// by default, by the engine's clock. For tests that move time by hand;
    /// a record's expiry is still judged by the engine's clock.
    pub fn age_clock(mut self, clock: impl Fn() -> Duration + Send + Sync + 'static) -> Self {
        self.age_clock = Some(Arc::new(clock));
        self
    }
}

/// Bytes an entry is counted for besides its strings.
const OVERHEAD: u64 = 96;

/// One cached result: the answer, until when its record lives (epoch ms on
/// the engine's clock), and until when its age allows it to answer (ms on
/// the age clock).
#[derive(Clone)]
struct Cached {
    answer: Arc<Answer>,
    until_ms: u64,
    young_until_ms: u64,
}

#[derive(Clone)]
struct Weight {
    floor: u64,
}

impl quick_cache::Weighter<String, Cached> for Weight {
    fn weight(&self, key: &String, cached: &Cached) -> u64 {
        let bytes = key.len() + cached.answer.fingerprint.len() + cached.answer.response.len();
        (u64::try_from(bytes).unwrap_or(u64::MAX).saturating_add(OVERHEAD)).max(self.floor)
    }
}

/// The cache itself, one per engine.
pub(crate) struct LocalGate {
    cache: quick_cache::sync::Cache<String, Cached, Weight>,
    max_age_ms: u64,
    /// The database's clock, which a record's expiry is judged by.
    clock: Arc<Clock>,
    /// What an entry's age is counted by, if not by `clock`.
    age_clock: Option<AgeClock>,
}

impl LocalGate {
    pub(crate) fn new(config: LocalCache, clock: Arc<Clock>) -> Self {
        let floor = (config.max_bytes / u64::try_from(config.max_entries).unwrap_or(u64::MAX)).max(1);
        // Each shard holds a share of the bytes, and an entry larger than a
        // shard is not kept: at least 1 MiB a shard, at most 16 shards.
        let shards = usize::try_from(config.max_bytes >> 20).unwrap_or(usize::MAX).clamp(1, 16);
        let options = quick_cache::OptionsBuilder::new()
            .estimated_items_capacity(config.max_entries)
            .weight_capacity(config.max_bytes)
            .shards(shards)
            .build()
            .expect("both capacities are set");
        LocalGate {
            cache: quick_cache::sync::Cache::with_options(
                options,
                Weight { floor },
                quick_cache::DefaultHashBuilder::default(),
                quick_cache::sync::DefaultLifecycle::default(),
            ),
            max_age_ms: u64::try_from(config.max_age.as_millis()).unwrap_or(u64::MAX),
            clock,
            age_clock: config.age_clock,
        }
    }

    /// The live result of `(biz, key)`, if this process holds one.
    pub(crate) fn get(&self, biz: &str, key: &str) -> Option<Arc<Answer>> {
        let id = id(biz, key);
        let cached = self.cache.get(&id)?;
        if self.now_ms() < cached.until_ms && self.age_ms() < cached.young_until_ms {
            return Some(cached.answer);
        }
        self.cache.remove(&id);
        None
    }

    /// Keeps a committed result until its record expires, or `max_age`.
    pub(crate) fn remember(&self, biz: &str, key: &str, answer: Arc<Answer>) {
        let now = self.now_ms();
        let until_ms = u64::try_from(answer.expires_ms).unwrap_or(0);
        let young_until_ms = self.age_ms().saturating_add(self.max_age_ms);
        if until_ms > now && self.max_age_ms > 0 {
            self.cache.insert(id(biz, key), Cached { answer, until_ms, young_until_ms });
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock.now_ms()).unwrap_or(0)
    }

    fn age_ms(&self) -> u64 {
        match &self.age_clock {
            Some(clock) => u64::try_from(clock().as_millis()).unwrap_or(u64::MAX),
            None => self.now_ms(),
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.cache.len()
    }

    #[cfg(test)]
    fn weight(&self) -> u64 {
        self.cache.weight()
    }
}

/// `biz` has no `:`, so the id is unambiguous.
fn id(biz: &str, key: &str) -> String {
    let mut id = String::with_capacity(biz.len() + 1 + key.len());
    id.push_str(biz);
    id.push(':');
    id.push_str(key);
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Hex;

    fn answer(response: &str, expires_ms: i64) -> Arc<Answer> {
        Arc::new(Answer {
            fingerprint: Hex::stored(&"f".repeat(64)),
            response: response.into(),
            failed: false,
            expires_ms,
        })
    }

    fn now() -> i64 {
        Clock::new(false).now_ms()
    }

    fn far() -> i64 {
        now() + 3_600_000
    }

    fn local(cache: LocalCache) -> LocalGate {
        LocalGate::new(cache, Arc::new(Clock::new(false)))
    }

    #[test]
    fn answers_what_it_was_given_until_the_record_expires() {
        let gate = local(LocalCache::new(100, 1 << 20));
        gate.remember("pay", "k1", answer("1", far()));
        assert_eq!(gate.get("pay", "k1").unwrap().response, "1");
        assert!(gate.get("pay", "k2").is_none());
        assert!(gate.get("refund", "k1").is_none(), "another biz, another entry");
        // The record expired: never kept, never answered.
        gate.remember("pay", "gone", answer("2", now() - 1));
        assert!(gate.get("pay", "gone").is_none());
    }

    #[test]
    fn max_age_bounds_an_entry_whatever_the_ttl() {
        let age = Arc::new(std::sync::atomic::AtomicU64::new(1_000));
        let clock = {
            let age = Arc::clone(&age);
            move || Duration::from_millis(age.load(std::sync::atomic::Ordering::SeqCst))
        };
        let gate = local(LocalCache::new(100, 1 << 20).max_age(Duration::from_millis(30)).age_clock(clock));
        gate.remember("pay", "k", answer("1", far()));
        age.store(1_029, std::sync::atomic::Ordering::SeqCst);
        assert!(gate.get("pay", "k").is_some(), "29 ms old");
        age.store(1_030, std::sync::atomic::Ordering::SeqCst);
        assert!(gate.get("pay", "k").is_none(), "past max_age");
        assert_eq!(gate.len(), 0, "the stale entry was dropped");
    }

    #[test]
    fn bounded_by_entries_and_by_bytes() {
        // 10 entries at most, whatever their size.
        let gate = local(LocalCache::new(10, 1 << 20));
        for i in 0..1_000 {
            gate.remember("pay", &format!("k{i}"), answer("1", far()));
        }
        assert!(gate.len() <= 10, "{} entries", gate.len());
        // 4 KiB at most: large responses evict each other.
        let gate = local(LocalCache::new(1_000, 4_096));
        for i in 0..100 {
            gate.remember("pay", &format!("k{i}"), answer(&"x".repeat(1_000), far()));
        }
        assert!(gate.weight() <= 4_096, "{} bytes", gate.weight());
        assert!((1..=4).contains(&gate.len()), "{} entries of about 1.2 KB", gate.len());
    }
}
