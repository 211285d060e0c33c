//! How often and how long to try: the bounds of one logical request and the
//! waits between its attempts (exponential backoff with full jitter, or the
//! server's `Retry-After` when it gives one).

use std::time::Duration;

/// The bounds and waits of one logical request's attempts.
///
/// ```
/// use std::time::Duration;
/// use idempotency_client::Retries;
///
/// let retries = Retries::default()       // 5 attempts within 30 s
///     .max_attempts(8)
///     .total(Duration::from_secs(60))
///     .attempt_timeout(Duration::from_secs(10));
/// # let _ = retries;
/// ```
///
/// Between attempts it waits a random time between zero and
/// `base × 2^(retry − 1)`, at most `max_backoff` (full jitter: clients that
/// failed together do not come back together), or, when the server said
/// when to come back (`Retry-After`, gRPC's `grpc-retry-pushback-ms`), at
/// least that long. A server asking for more than `max_retry_after` is
/// taken at its word: its answer is handed back rather than asked again
/// sooner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retries {
    pub(crate) max_attempts: u32,
    pub(crate) total: Duration,
    pub(crate) attempt_timeout: Option<Duration>,
    pub(crate) base: Duration,
    pub(crate) max_backoff: Duration,
    pub(crate) max_retry_after: Duration,
}

impl Default for Retries {
    /// 5 attempts within 30 s, backoff from 250 ms up to 5 s, a
    /// `Retry-After` of up to 10 s honoured, no timeout per attempt beyond
    /// the total (and the client's own).
    fn default() -> Self {
        Retries {
            max_attempts: 5,
            total: Duration::from_secs(30),
            attempt_timeout: None,
            base: Duration::from_millis(250),
            max_backoff: Duration::from_secs(5),
            max_retry_after: Duration::from_secs(10),
        }
    }
}

impl Retries {
    /// One attempt and no retry: the key alone (to compose with another
    /// retry layer, which then keeps the key: see the crate's docs).
    pub fn none() -> Self {
        Retries { max_attempts: 1, ..Retries::default() }
    }

    /// At most `n` attempts in all, the first included (at least 1).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// The time all attempts and waits may take together, from the first
    /// attempt's start: no attempt starts and no wait ends past it, and an
    /// attempt still running then is abandoned.
    pub fn total(mut self, total: Duration) -> Self {
        self.total = total;
        self
    }

    /// The time one attempt may take before it is abandoned and, the
    /// request having perhaps run, tried again with the same key.
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    /// The first retry's backoff ceiling (doubled for each retry after it)
    /// and the largest ceiling.
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.base = base;
        self.max_backoff = max.max(base);
        self
    }

    /// The longest `Retry-After` honoured; a server asking for more gets
    /// its answer handed back to the caller.
    pub fn max_retry_after(mut self, max: Duration) -> Self {
        self.max_retry_after = max;
        self
    }

    /// The ceiling of the backoff before retry number `retry` (1 for the
    /// first retry).
    pub(crate) fn ceiling(&self, retry: u32) -> Duration {
        let doublings = retry.saturating_sub(1).min(31);
        self.base.saturating_mul(1 << doublings).min(self.max_backoff)
    }
}

/// A small xorshift64* generator for the jitter, seeded from the operating
/// system once per logical request: the jitter needs spread, not secrecy.
pub(crate) struct Jitter(u64);

impl Jitter {
    pub(crate) fn seeded() -> Self {
        let mut seed = [0u8; 8];
        crate::key::fill_random(&mut seed);
        Jitter(u64::from_le_bytes(seed) | 1) // never zero, xorshift's fixed point
    }

    #[cfg(test)]
    pub(crate) fn from_seed(seed: u64) -> Self {
        Jitter(seed | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A uniform duration in `[0, ceiling]`.
    pub(crate) fn up_to(&mut self, ceiling: Duration) -> Duration {
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(((u128::from(self.next()) * (u128::from(nanos) + 1)) >> 64) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceilings_double_up_to_the_maximum() {
        let retries = Retries::default().backoff(Duration::from_millis(100), Duration::from_secs(1));
        let ceilings: Vec<_> = (1..=6).map(|r| retries.ceiling(r).as_millis()).collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(retries.ceiling(u32::MAX), Duration::from_secs(1), "no overflow");
    }

    #[test]
    fn jitter_spreads_over_the_whole_range_and_stays_in_it() {
        let mut jitter = Jitter::from_seed(7);
        let ceiling = Duration::from_millis(1000);
        let draws: Vec<Duration> = (0..10_000).map(|_| jitter.up_to(ceiling)).collect();
        assert!(draws.iter().all(|d| *d <= ceiling));
        // Each tenth of the range gets its share (1000 expected; a fixed seed).
        for tenth in 0..10u32 {
            let (low, high) = (ceiling * tenth / 10, ceiling * (tenth + 1) / 10);
            let n = draws.iter().filter(|d| **d >= low && **d < high).count();
            assert!((850..1150).contains(&n), "tenth {tenth}: {n}");
        }
        assert_eq!(jitter.up_to(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn bounds_never_reach_zero_attempts() {
        assert_eq!(Retries::default().max_attempts(0).max_attempts, 1);
        assert_eq!(Retries::none().max_attempts, 1);
    }
}
