//! Time, as every instance must agree on it: the database's clock.
//!
//! Expiry, leases and the expiry a cached result carries are stamped by one
//! instance and judged by another, so they must come from one clock. Each
//! engine reads the database's clock when it first needs the time, and
//! again every [`REFRESH`] in the background, and in between counts on from
//! that reading with this process's monotonic clock: the time a call uses
//! costs no round trip, and the instance's own wall clock (skewed, stepped
//! by NTP, faked) plays no part.
//!
//! A reading is taken as the best of [`SAMPLES`] queries (the one with the
//! shortest round trip), and placed at the middle of that round trip: it is
//! off by at most half of it, plus what the monotonic clock drifts before
//! the next reading. SQLite has no clock of its own (its file lives on this
//! host): there, the host's wall clock is the database's.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How often the offset to the database's clock is measured again.
pub(crate) const REFRESH: Duration = Duration::from_secs(60);
/// How long after a failed reading the next one is tried.
const RETRY: Duration = Duration::from_secs(1);
/// Queries per reading; the one with the shortest round trip counts.
const SAMPLES: usize = 3;
/// Longest a reading may take: a database that does not answer must not
/// hold back a call that Redis could answer (the call then counts on the
/// host's clock, or the last reading, and tries again after [`RETRY`]).
const READING_TIMEOUT: Duration = Duration::from_secs(1);
/// An offset from this host's clock past which a reading is logged as a warning.
const SKEW_WARNING: Duration = Duration::from_secs(1);
/// `measured_at_us` before the first reading.
const NEVER: i64 = i64::MIN;

/// The longest wait, lease or expiry set from a user's duration: a century
/// (the longest duration an attribute takes). A longer one, up to
/// `Duration::MAX`, means "no bound", and is this: past the life of any
/// process or record, and within what every clock, timer and server counts
/// (`Instant + Duration::MAX` panics; Redis refuses an expiry past 2^63 ms,
/// NATS a delay past 2^63 ns).
pub(crate) const NO_BOUND: Duration = Duration::from_millis(idempotency_rules::MAX_DURATION_MS);

/// `d`, at most [`NO_BOUND`].
pub(crate) fn bounded(d: Duration) -> Duration {
    d.min(NO_BOUND)
}

/// The instant `d` after `from` on the monotonic clock, at most [`NO_BOUND`]
/// after it: a deadline from a user's duration never overflows.
pub(crate) fn after(from: tokio::time::Instant, d: Duration) -> tokio::time::Instant {
    from + bounded(d)
}

/// The instant `d` from now (see [`after`]).
pub(crate) fn deadline_in(d: Duration) -> tokio::time::Instant {
    after(tokio::time::Instant::now(), d)
}

/// How a waiter that asks again paces its questions until its deadline: a
/// two-phase call's duplicate asking phase one, SQLite's `BEGIN IMMEDIATE`
/// after its busy timeout. As a Redis Cluster's waiters ask their claim:
/// after 10 ms, doubling to 500 ms.
pub(crate) struct AskingAgain {
    pause: Duration,
    deadline: tokio::time::Instant,
}

impl AskingAgain {
    const FIRST: Duration = Duration::from_millis(10);
    const LAST: Duration = Duration::from_millis(500);

    /// Questions until `deadline`.
    pub(crate) fn until(deadline: tokio::time::Instant) -> Self {
        AskingAgain { pause: Self::FIRST, deadline }
    }

    /// Sleeps until the next question: after the next pause, or after
    /// `sooner` if shorter, never past the deadline (the last question is
    /// asked at it). `false`, at once, once the deadline has passed: ask no more.
    pub(crate) async fn pause(&mut self, sooner: Option<Duration>) -> bool {
        let now = tokio::time::Instant::now();
        if now >= self.deadline {
            return false;
        }
        let pause = sooner.map_or(self.pause, |sooner| sooner.min(self.pause));
        tokio::time::sleep_until((now + pause).min(self.deadline)).await;
        self.pause = (self.pause * 2).min(Self::LAST);
        true
    }
}

/// Microseconds on this process's monotonic clock, from a fixed start.
pub(crate) fn monotonic_us() -> i64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    i64::try_from(start.elapsed().as_micros()).unwrap_or(i64::MAX)
}

/// Milliseconds on this process's monotonic clock: for local waits and
/// back-offs, which no other instance judges.
#[cfg(feature = "redis")]
pub(crate) fn monotonic_ms() -> u64 {
    u64::try_from(monotonic_us() / 1000).unwrap_or(0)
}

/// This host's wall clock, in Unix epoch microseconds (0 before the epoch).
fn system_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// This host's wall clock in Unix epoch milliseconds: for the few stamps
/// made where no engine is at hand (an event queued outside a call).
#[cfg(feature = "outbox")]
pub(crate) fn host_ms() -> i64 {
    system_us() / 1000
}

/// Nanoseconds since the Unix epoch on this host's clock (0 if the clock is
/// set before it): entropy for random draws, never a time anyone judges.
pub fn now_nanos() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

/// One engine's view of the database's clock.
#[derive(Debug)]
pub(crate) struct Clock {
    /// Whether the database has a clock of its own to read (not SQLite).
    remote: bool,
    /// Database time minus monotonic time, in microseconds. Until the
    /// first reading, the host's wall clock stands in.
    offset_us: AtomicI64,
    /// Monotonic time of the last reading (or failed attempt), or [`NEVER`].
    measured_at_us: AtomicI64,
    /// Whether the last attempt failed (then retried after [`RETRY`]).
    failed: AtomicBool,
    /// A reading is under way (in the background, or the first one).
    measuring: AtomicBool,
    /// Serializes the first reading, so a storm of first calls sends it once.
    first: tokio::sync::Mutex<()>,
    /// The last reading's round trip, in microseconds (`NEVER` before one):
    /// how far away the database is, for the record protocol
    /// (`store::record`, whose statements ride along only where a round
    /// trip costs more than planning a text).
    round_trip_us: AtomicI64,
}

impl Clock {
    /// A clock read from the database (`remote`), or the host's own.
    pub(crate) fn new(remote: bool) -> Self {
        Clock {
            remote,
            offset_us: AtomicI64::new(system_us() - monotonic_us()),
            measured_at_us: AtomicI64::new(NEVER),
            failed: AtomicBool::new(false),
            measuring: AtomicBool::new(false),
            first: tokio::sync::Mutex::new(()),
            round_trip_us: AtomicI64::new(NEVER),
        }
    }

    /// The round trip of the last reading of the database's clock (the
    /// best of its samples); `None` before one, and for SQLite.
    pub(crate) fn round_trip(&self) -> Option<Duration> {
        let us = self.round_trip_us.load(Ordering::Relaxed);
        (us >= 0).then(|| Duration::from_micros(us.unsigned_abs()))
    }

    /// Now, in Unix epoch milliseconds on the database's clock (as far as
    /// the last reading tells; see [`Clock::ready`]).
    pub(crate) fn now_ms(&self) -> i64 {
        if !self.remote {
            return system_us() / 1000;
        }
        monotonic_us().saturating_add(self.offset_us.load(Ordering::Relaxed)) / 1000
    }

    /// Whether a reading is due: never taken, older than [`REFRESH`], or
    /// failed more than [`RETRY`] ago. One atomic load on the hot path.
    fn due(&self, now_us: i64) -> bool {
        let at = self.measured_at_us.load(Ordering::Relaxed);
        if at == NEVER {
            return true;
        }
        let every = if self.failed.load(Ordering::Relaxed) { RETRY } else { REFRESH };
        now_us.saturating_sub(at) >= i64::try_from(every.as_micros()).unwrap_or(i64::MAX)
    }

    /// Records a reading taken between monotonic `sent_us` and `received_us`
    /// of `db_us` (database time, epoch µs), unless a fresher one is in.
    fn record(&self, sent_us: i64, received_us: i64, db_us: i64) {
        let offset = db_us - (sent_us + (received_us - sent_us) / 2);
        let uncertainty = (received_us - sent_us) / 2;
        let skew = offset - (system_us() - monotonic_us());
        self.offset_us.store(offset, Ordering::Relaxed);
        self.round_trip_us.store(received_us - sent_us, Ordering::Relaxed);
        self.failed.store(false, Ordering::Relaxed);
        self.measured_at_us.store(received_us, Ordering::Relaxed);
        let skew_ms = skew / 1000;
        if skew.unsigned_abs() >= SKEW_WARNING.as_micros() as u64 {
            tracing::warn!(
                skew_ms,
                "this host's clock differs from the database's; idem stamps and judges expiry and leases by the database's"
            );
        } else {
            tracing::debug!(skew_ms, uncertainty_us = uncertainty, "idem: database clock read");
        }
    }

    fn record_failure(&self, error: &dyn std::fmt::Display) {
        if !self.failed.swap(true, Ordering::Relaxed) {
            tracing::warn!(%error, "idem: the database's clock could not be read; counting on from the last reading");
        }
        self.measured_at_us.store(monotonic_us(), Ordering::Relaxed);
    }
}

/// Reads the database's clock for [`Clock`]: the one query a backend adds
/// for it, in the simple protocol (nothing prepared, so poolers in
/// transaction mode pass it). `Ok(None)`: the backend has no clock of its
/// own (SQLite).
pub(crate) trait ClockSource {
    /// The database's time, in Unix epoch microseconds.
    fn database_us(&self) -> impl std::future::Future<Output = Result<i64, sqlx::Error>> + Send;
}

impl Clock {
    /// Makes sure the time is the database's: waits for the first reading
    /// (once per engine; a storm of first calls waits for one), and starts
    /// a new one in the background when due. Costs one atomic load when
    /// nothing is due.
    pub(crate) async fn ready<S>(self: &std::sync::Arc<Self>, source: &S)
    where
        S: ClockSource + Clone + Send + Sync + 'static,
    {
        if !self.remote || !self.due(monotonic_us()) {
            return;
        }
        if self.measured_at_us.load(Ordering::Relaxed) == NEVER {
            let _first = self.first.lock().await;
            if self.measured_at_us.load(Ordering::Relaxed) == NEVER {
                self.measure(source).await;
            }
            return;
        }
        if self.measuring.swap(true, Ordering::Relaxed) {
            return;
        }
        let (clock, source) = (std::sync::Arc::clone(self), source.clone());
        let refresh = async move {
            clock.measure(&source).await;
            clock.measuring.store(false, Ordering::Relaxed);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(refresh)),
            Err(_) => self.measuring.store(false, Ordering::Relaxed),
        }
    }

    /// Takes a reading now: the best of [`SAMPLES`] round trips.
    pub(crate) async fn measure<S: ClockSource>(&self, source: &S) {
        if !self.remote {
            return;
        }
        let samples = async {
            let mut best: Option<(i64, i64, i64)> = None;
            for _ in 0..SAMPLES {
                let sent = monotonic_us();
                let db = source.database_us().await?;
                let received = monotonic_us();
                if best.is_none_or(|(s, r, _)| received - sent < r - s) {
                    best = Some((sent, received, db));
                }
            }
            Ok::<_, sqlx::Error>(best)
        };
        match tokio::time::timeout(READING_TIMEOUT, samples).await {
            Ok(Ok(Some((sent, received, db)))) => self.record(sent, received, db),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => self.record_failure(&e),
            Err(_) => self.record_failure(&format_args!("no answer within {READING_TIMEOUT:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reading_sits_at_the_middle_of_its_round_trip() {
        let clock = Clock::new(true);
        let sent = monotonic_us();
        // The database is ten minutes ahead; the round trip took 2 ms.
        let db = system_us() + 600_000_000 + 1_000;
        clock.record(sent, sent + 2_000, db);
        let ahead = clock.now_ms() - system_us() / 1000;
        assert!((599_990..=600_010).contains(&ahead), "{ahead}");
    }

    #[test]
    fn a_local_clock_is_the_hosts() {
        let clock = Clock::new(false);
        assert!((clock.now_ms() - system_us() / 1000).abs() <= 1);
    }

    #[test]
    fn readings_are_due_first_then_every_refresh() {
        let clock = Clock::new(true);
        let now = monotonic_us();
        assert!(clock.due(now));
        clock.record(now, now, system_us());
        assert!(!clock.due(now + 1_000_000));
        assert!(clock.due(now + i64::try_from(REFRESH.as_micros()).unwrap()));
    }
}
