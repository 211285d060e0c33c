//! A clock for the cron runner that moves only when the test moves it
//! ([`ManualClock`]): slots come exactly when the test says, and the test
//! moves time on only once every runner waits on the clock, so nothing
//! depends on how fast the machine is.
//!
//! ```ignore
//! let clock = ManualClock::new(start);
//! let runner = Runner::new(&idem, "tick", "* * * * * *")?.clock(clock.clone());
//! tokio::spawn(runner.run(shutdown, job));
//! clock.sleepers(1).await;          // the runner settled what was due and waits
//! clock.set(next_slot);             // the next slot comes
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime};

use idempotency::cron::{Clock, ClockFuture};
use tokio::sync::watch;

/// How long [`ManualClock::sleepers`] waits for the runners to settle
/// before it fails the test: only a hang takes that long.
const SETTLE_BOUND: Duration = Duration::from_secs(30);

/// A clock standing still until the test [`set`](ManualClock::set)s or
/// [`advance`](ManualClock::advance)s it; clones share one time.
#[derive(Clone)]
pub struct ManualClock {
    state: watch::Sender<State>,
}

struct State {
    now: SystemTime,
    /// The tasks waiting on the clock: id → the time each waits for.
    sleepers: BTreeMap<u64, SystemTime>,
    next_id: u64,
}

impl ManualClock {
    /// A clock reading `start` until moved.
    pub fn new(start: SystemTime) -> Self {
        let (state, _) = watch::channel(State { now: start, sleepers: BTreeMap::new(), next_id: 0 });
        ManualClock { state }
    }

    /// What the clock reads.
    pub fn time(&self) -> SystemTime {
        self.state.borrow().now
    }

    /// Moves the clock to `to` and wakes every task waiting for `to` or
    /// earlier; those are no longer counted as sleepers from here on.
    /// Panics if `to` is before what the clock reads: it never goes back.
    pub fn set(&self, to: SystemTime) {
        self.state.send_modify(|s| {
            assert!(to >= s.now, "a manual clock never goes back ({:?} to {to:?})", s.now);
            s.now = to;
            s.sleepers.retain(|_, at| *at > to);
        });
    }

    /// Moves the clock on by `by` (see [`set`](ManualClock::set)).
    pub fn advance(&self, by: Duration) {
        self.set(self.time() + by);
    }

    /// Waits until exactly `n` tasks wait on the clock (the runners have
    /// settled everything due and sleep), and returns the times they wait
    /// for, earliest first. Fails the test when that has not happened
    /// within 30 s (a hang, or a runner the test believes stopped).
    pub async fn sleepers(&self, n: usize) -> Vec<SystemTime> {
        let mut rx = self.state.subscribe();
        let settled = rx.wait_for(|s| s.sleepers.len() == n);
        match tokio::time::timeout(SETTLE_BOUND, settled).await {
            Ok(Ok(state)) => {
                let mut at: Vec<SystemTime> = state.sleepers.values().copied().collect();
                at.sort();
                at
            }
            Ok(Err(_)) => unreachable!("the clock holds its own sender"),
            Err(_) => panic!("{n} sleepers expected on the manual clock; {:?} after {SETTLE_BOUND:?}", self),
        }
    }

    /// Sleeps until the clock reads `at`, counted among the sleepers.
    async fn wait_for(&self, at: SystemTime) {
        let mut id = 0;
        let registered = self.state.send_if_modified(|s| {
            if s.now >= at {
                return false;
            }
            id = s.next_id;
            s.next_id += 1;
            s.sleepers.insert(id, at);
            true
        });
        if !registered {
            return;
        }
        // Dropped before its time (a shutdown came first): no longer a sleeper.
        let _leave = Leave { clock: self, id };
        let mut rx = self.state.subscribe();
        let _ = rx.wait_for(|s| !s.sleepers.contains_key(&id)).await;
    }
}

/// Takes a sleeper off the clock when its wait ends or is dropped.
struct Leave<'a> {
    clock: &'a ManualClock,
    id: u64,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.clock.state.send_if_modified(|s| s.sleepers.remove(&self.id).is_some());
    }
}

impl Clock for ManualClock {
    fn now(&self) -> ClockFuture<'_, SystemTime> {
        Box::pin(std::future::ready(self.time()))
    }

    fn sleep_until(&self, at: SystemTime) -> ClockFuture<'_, ()> {
        Box::pin(self.wait_for(at))
    }
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.state.borrow();
        f.debug_struct("ManualClock").field("now", &s.now).field("sleepers", &s.sleepers).finish()
    }
}
