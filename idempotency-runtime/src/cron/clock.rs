//! The time a runner fires slots by: what it reads as now, and how it
//! waits for a later time. A runner built from an engine takes the
//! engine's (the database's clock, which the records' expiry is judged
//! by); [`Runner::host_clock`](super::Runner::host_clock) takes this
//! host's; [`Runner::clock`](super::Runner::clock) any other, such as a
//! test's clock that only moves when the test moves it.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The future a [`Clock`] answers with.
pub type ClockFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A clock a cron runner fires slots by: [`now`](Clock::now) decides which
/// slots are due, [`sleep_until`](Clock::sleep_until) waits for the next
/// one (and for the jitter and the shutdown grace).
///
/// Implement it to drive a runner in tests: a clock that stands still
/// until the test moves it makes every slot come exactly when the test
/// says, however slow the machine.
pub trait Clock: Send + Sync + 'static {
    /// Now on this clock.
    fn now(&self) -> ClockFuture<'_, SystemTime>;

    /// Resolves once this clock reads `at` or later (at once if it does
    /// already). The runner reads [`now`](Clock::now) again after it, so
    /// waking a little early costs another wait, not a wrong decision.
    fn sleep_until(&self, at: SystemTime) -> ClockFuture<'_, ()>;
}

/// The longest single wait of the built-in clocks: a wait of hours is
/// taken in steps, each judged against the clock read afresh (the
/// database's, which the engine reads again every minute; this host's,
/// which NTP may step).
const LONGEST_WAIT: Duration = Duration::from_secs(60);

/// Sleeps until `now()` reads `at`, in steps of at most [`LONGEST_WAIT`].
async fn sleep_until_by<F, Fut>(now: F, at: SystemTime)
where
    F: Fn() -> Fut,
    Fut: Future<Output = SystemTime>,
{
    loop {
        match at.duration_since(now().await) {
            Ok(left) if !left.is_zero() => tokio::time::sleep(left.min(LONGEST_WAIT)).await,
            _ => return,
        }
    }
}

/// The database's clock, as the engine reads it (see `crate::clock`): no
/// round trip per reading, the engine counts on from its last one.
pub(super) struct DatabaseClock<DB: crate::Backend>(pub(super) crate::Idem<DB>);

impl<DB: crate::Backend> DatabaseClock<DB> {
    async fn read(&self) -> SystemTime {
        let ms = self.0.now_ms().await;
        match u64::try_from(ms) {
            Ok(ms) => UNIX_EPOCH + Duration::from_millis(ms),
            // A database clock before 1970 is no clock to fire by.
            Err(_) => SystemTime::now(),
        }
    }
}

impl<DB: crate::Backend> Clock for DatabaseClock<DB> {
    fn now(&self) -> ClockFuture<'_, SystemTime> {
        Box::pin(self.read())
    }

    fn sleep_until(&self, at: SystemTime) -> ClockFuture<'_, ()> {
        Box::pin(sleep_until_by(|| self.read(), at))
    }
}

/// This host's wall clock.
pub(super) struct HostClock;

impl Clock for HostClock {
    fn now(&self) -> ClockFuture<'_, SystemTime> {
        Box::pin(std::future::ready(SystemTime::now()))
    }

    fn sleep_until(&self, at: SystemTime) -> ClockFuture<'_, ()> {
        Box::pin(sleep_until_by(|| std::future::ready(SystemTime::now()), at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_host_clock_sleeps_until_its_time() {
        let at = SystemTime::now() + Duration::from_millis(30);
        HostClock.sleep_until(at).await;
        assert!(HostClock.now().await >= at);
        // A time passed already: at once.
        let passed = SystemTime::now() - Duration::from_secs(5);
        tokio::time::timeout(Duration::from_secs(10), HostClock.sleep_until(passed)).await.expect("at once");
    }
}
