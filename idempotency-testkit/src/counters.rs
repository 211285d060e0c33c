//! Counters read through one global debugging recorder (feature `metrics`):
//! installed by the first call in the process, shared by every test in it.
//! A snapshot takes (and resets) what it reads, so each is summed into one
//! table under a lock: one test's read never takes another's counts, and
//! tests keep theirs apart by a label of their own (a queue, a stream).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// A counter's name and its labels, sorted.
type Key = (String, Vec<(String, String)>);

struct Counters {
    snapshotter: Snapshotter,
    seen: Mutex<HashMap<Key, u64>>,
}

fn counters() -> &'static Counters {
    static COUNTERS: OnceLock<Counters> = OnceLock::new();
    COUNTERS.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().expect("idempotency_testkit::counters installs the only metrics recorder of its process");
        Counters { snapshotter, seen: Mutex::default() }
    })
}

/// Installs the recorder, once per process: call it before the code under
/// test counts (a count made before is lost).
pub fn install() {
    counters();
}

/// Every counter named `name` whose labels include `labels`, summed since
/// [`install`], by the value of its label `by` (say `action`).
pub fn counted_by(name: &str, labels: &[(&str, &str)], by: &str) -> HashMap<String, u64> {
    let counters = counters();
    let mut seen = counters.seen.lock().expect("no test panics holding the counters");
    for (key, _, _, value) in counters.snapshotter.snapshot().into_vec() {
        if let DebugValue::Counter(value) = value {
            let key = key.key();
            let mut labels: Vec<(String, String)> =
                key.labels().map(|l| (l.key().to_owned(), l.value().to_owned())).collect();
            labels.sort();
            *seen.entry((key.name().to_owned(), labels)).or_default() += value;
        }
    }
    let mut out = HashMap::new();
    for ((counter, counter_labels), value) in seen.iter() {
        let has = |(k, v): &(&str, &str)| counter_labels.iter().any(|(ck, cv)| ck == k && cv == v);
        if counter == name && labels.iter().all(has) {
            let group = counter_labels.iter().find(|(k, _)| k == by).map(|(_, v)| v.clone()).unwrap_or_default();
            *out.entry(group).or_default() += value;
        }
    }
    out.retain(|_, value| *value > 0);
    out
}
