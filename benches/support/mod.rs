//! What the benches share: quick mode, percentiles, and the loop that
//! drives calls from many tasks.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// `IDEM_BENCH_QUICK=1`: a short run.
pub fn quick() -> bool {
    std::env::var("IDEM_BENCH_QUICK").is_ok_and(|v| v == "1")
}

/// The `p` quantile of sorted latencies, in ms (NaN for none).
pub fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

/// `tasks` tasks call `call(i)` for fresh `i` until `calls` are made or
/// `stop` is set; returns (wall time, sorted latencies).
pub async fn drive<F, Fut>(
    tasks: usize,
    calls: usize,
    stop: Option<Arc<AtomicBool>>,
    call: F,
) -> (Duration, Vec<Duration>)
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let (call, next) = (Arc::new(call), Arc::new(AtomicUsize::new(0)));
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|_| {
            let (call, next, stop) = (call.clone(), next.clone(), stop.clone());
            tokio::spawn(async move {
                let mut lat = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= calls || stop.as_ref().is_some_and(|s| s.load(Ordering::Relaxed)) {
                        break lat;
                    }
                    let t = Instant::now();
                    call(i).await;
                    lat.push(t.elapsed());
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.expect("bench task"));
    }
    let wall = start.elapsed();
    all.sort();
    (wall, all)
}
