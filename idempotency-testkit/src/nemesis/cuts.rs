//! The nemesis at work: one lane per path takes its next [`Event`], waits
//! out the gap, turns the proxies of the chosen processes, waits out the
//! cut, heals, and records each process's [`Window`] as it really was.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::history::{Window, now_us};
use super::proxy::{Mode, Proxy};
use super::schedule::{Cut, DELAY, Event, Lane, Path};

/// One process's two paths.
pub struct Paths {
    pub redis: Proxy,
    pub db: Proxy,
}

impl Paths {
    fn on(&self, path: Path) -> &Proxy {
        match path {
            Path::Redis => &self.redis,
            Path::Db => &self.db,
        }
    }
}

/// What the nemesis did: each event (with its start, µs) and each window.
#[derive(Default)]
pub struct Log {
    pub events: Vec<(i64, Event)>,
    pub windows: Vec<Window>,
}

/// Runs `lane` against `paths` until `stop`; a cut under way when `stop`
/// comes is healed at once.
pub async fn run_lane(mut lane: Lane, paths: Arc<Vec<Paths>>, stop: Arc<AtomicBool>, log: Arc<Mutex<Log>>, t0: i64) {
    loop {
        let event = lane.next_event();
        if !sleep_unless(event.gap, &stop).await {
            return;
        }
        let start_us = now_us();
        for &p in &event.procs {
            cut(paths[p].on(event.path), event.cut);
        }
        println!(
            "nemesis +{:.3}s {:?} of processes {:?}: {:?} for {} ms",
            (start_us - t0) as f64 / 1e6,
            event.path,
            event.procs,
            event.cut,
            event.lasts.as_millis()
        );
        sleep_unless(event.lasts, &stop).await;
        for &p in &event.procs {
            heal(paths[p].on(event.path), event.cut);
        }
        let end_us = now_us();
        let mut log = log.lock().unwrap();
        for &proc in &event.procs {
            log.windows.push(Window { proc, path: event.path, cut: event.cut, start_us, end_us });
        }
        log.events.push((start_us, event));
    }
}

fn cut(proxy: &Proxy, cut: Cut) {
    match cut {
        Cut::Blackhole | Cut::BlackholeThenReset => proxy.set(Mode::Blackhole),
        Cut::RepliesLost => proxy.set(Mode::BlackholeReplies),
        Cut::Delay => proxy.set(Mode::Delay(DELAY)),
        Cut::Drop => proxy.reset_all(Mode::Refuse),
    }
}

fn heal(proxy: &Proxy, cut: Cut) {
    match cut {
        Cut::Blackhole | Cut::Delay | Cut::Drop => proxy.set(Mode::Pass),
        Cut::BlackholeThenReset | Cut::RepliesLost => proxy.reset_all(Mode::Pass),
    }
}

/// Sleeps `d`, in steps, unless `stop` comes first; whether it slept it all.
async fn sleep_unless(d: Duration, stop: &AtomicBool) -> bool {
    let step = Duration::from_millis(10);
    let mut left = d;
    while !left.is_zero() {
        if stop.load(SeqCst) {
            return false;
        }
        let now = left.min(step);
        tokio::time::sleep(now).await;
        left -= now;
    }
    !stop.load(SeqCst)
}
