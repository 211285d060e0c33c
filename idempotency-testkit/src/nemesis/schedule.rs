//! What a run does, decided by its seed: the sizes ([`Config`]), the calls
//! each engine process makes ([`calls`]), and the nemesis's cuts, one lane
//! per path ([`Lane`]).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::soak::{Plan, Rng, seed_from_env};

/// Sizes, seed and bounds of one run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Name in the printed report.
    pub label: &'static str,
    /// Engine processes (children of the test).
    pub procs: usize,
    /// First calls each process makes; retries come on top.
    pub calls_per_proc: usize,
    /// Keys shared by every process.
    pub keys: usize,
    /// Tasks calling at once in each process.
    pub tasks: usize,
    /// First call `i` of every process is due `i × interval` after the
    /// start, on the shared clock: the processes call the same stretch of
    /// keys at the same time, and one a cut held back catches up at the
    /// heal, in a burst, as clients do.
    pub interval: Duration,
    /// How long the calls may take in all before the run is a failure.
    pub deadline: Duration,
    pub seed: u64,
}

impl Config {
    /// The default-suite size: 4 processes × 700 first calls over 700
    /// keys, in about 28 s.
    pub fn short(label: &'static str) -> Self {
        Self {
            label,
            procs: 4,
            calls_per_proc: 700,
            keys: 700,
            tasks: 6,
            interval: Duration::from_millis(40),
            deadline: Duration::from_secs(90),
            seed: seed_from_env("IDEM_NEMESIS_SEED"),
        }
    }

    /// The `--ignored` size: 4 processes × 5,000 first calls over 5,000
    /// keys, in about 3 minutes.
    pub fn full(label: &'static str) -> Self {
        Self {
            calls_per_proc: 5_000,
            keys: 5_000,
            tasks: 8,
            interval: Duration::from_millis(36),
            deadline: Duration::from_secs(900),
            ..Self::short(label)
        }
    }
}

/// How many times a call that got no final answer (`InProgress`, a
/// storage error, a timeout) is sent again, each time as a new history
/// entry, after a pause that doubles from 25 ms (`retry_pause`): about
/// 3 s in all, past any claim a cut can leave behind.
pub const RETRIES: usize = 7;

/// The pause before retry `n` (from 0): 25 ms doubling up to 800 ms, with
/// up to half again at random.
pub fn retry_pause(n: usize, rng: &mut Rng) -> Duration {
    let base = 25u64 << n.min(5);
    Duration::from_millis(base + rng.below(base / 2 + 1))
}

/// The first calls of process `proc`, in order. All processes walk the
/// keys front to back at about the same pace, so most calls land on a key
/// a few others are calling about then (duplicates at the same time, on
/// other processes); a process a cut held back arrives late on keys the
/// others finished. One call in five picks any key already passed (a late
/// duplicate), one in forty passes other arguments (`KeyReused`).
pub fn calls(cfg: &Config, proc: usize) -> Vec<Plan> {
    let mut rng = stream(cfg.seed, 0xCA11 + proc as u64);
    (0..cfg.calls_per_proc)
        .map(|i| {
            let front = i * cfg.keys / cfg.calls_per_proc;
            let key = if front > 0 && rng.chance(0.2) {
                rng.below(front as u64) as usize
            } else {
                (front + rng.below(6) as usize).min(cfg.keys - 1)
            };
            // The body holds its transaction open a little: duplicates meet it.
            let sleep = Duration::from_micros(rng.below(4_000));
            Plan { reuse: rng.chance(0.025), ..Plan::ok(key, sleep) }
        })
        .collect()
}

/// A generator of its own for each `(seed, salt)`: both go through
/// splitmix64 first, since [`Rng::new`] gives seeds that differ only in
/// their lowest bit one stream.
pub(crate) fn stream(seed: u64, salt: u64) -> Rng {
    let mut z = seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    Rng::new(z ^ (z >> 31))
}

/// The path a cut is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Path {
    Redis,
    Db,
}

/// What the nemesis does to a path, and how the path heals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Cut {
    /// Nothing passes either way; at the heal the held bytes flow on.
    Blackhole,
    /// Nothing passes; at the heal every connection is reset.
    BlackholeThenReset,
    /// Requests pass, replies are held; at the heal every connection is
    /// reset (a `COMMIT` that landed is never confirmed).
    RepliesLost,
    /// Every chunk 200 ms late, each way.
    Delay,
    /// Every connection reset, and new ones refused until the heal.
    Drop,
}

impl Cut {
    pub const ALL: [Cut; 5] = [Cut::Blackhole, Cut::BlackholeThenReset, Cut::RepliesLost, Cut::Delay, Cut::Drop];
}

/// The delay of [`Cut::Delay`].
pub const DELAY: Duration = Duration::from_millis(200);

/// One cut: after `gap` of health, `cut` on `path` of `procs` for `lasts`.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub gap: Duration,
    pub path: Path,
    pub procs: Vec<usize>,
    pub cut: Cut,
    pub lasts: Duration,
}

/// The cuts of one path, one after another, drawn from the seed: the
/// same seed gives the same sequence (when each lands among the calls
/// depends on the machine's pace). The kinds come from a shuffled bag:
/// every five cuts of a lane hold each kind once.
pub struct Lane {
    path: Path,
    procs: usize,
    rng: Rng,
    bag: Vec<Cut>,
}

impl Lane {
    pub fn new(cfg: &Config, path: Path) -> Self {
        let salt = match path {
            Path::Redis => 0x0052_4544_4953,
            Path::Db => 0x0044_4154_4142,
        };
        Self { path, procs: cfg.procs, rng: stream(cfg.seed, salt), bag: Vec::new() }
    }

    /// The next cut: one process (55%), several (30%) or all of them
    /// (15%), for 0.2..2.5 s, after 0.2..1.2 s of health.
    pub fn next_event(&mut self) -> Event {
        let gap = self.rng.millis(200, 1_200);
        if self.bag.is_empty() {
            self.bag = Cut::ALL.to_vec();
            for i in (1..self.bag.len()).rev() {
                let j = self.rng.below(i as u64 + 1) as usize;
                self.bag.swap(i, j);
            }
        }
        let cut = self.bag.pop().expect("a refilled bag");
        let lasts = self.rng.millis(200, 2_500);
        let roll = self.rng.below(100);
        let mut procs: Vec<usize> = if roll < 55 || self.procs == 1 {
            vec![self.rng.below(self.procs as u64) as usize]
        } else if roll < 85 {
            // Two up to all but one.
            let n = if self.procs > 2 { 2 + self.rng.below((self.procs - 2) as u64) as usize } else { self.procs };
            let mut all: Vec<usize> = (0..self.procs).collect();
            // A partial shuffle picks `n` distinct processes.
            for i in 0..n {
                let j = i + self.rng.below((self.procs - i) as u64) as usize;
                all.swap(i, j);
            }
            all.truncate(n);
            all
        } else {
            (0..self.procs).collect()
        };
        procs.sort_unstable();
        Event { gap, path: self.path, procs, cut, lasts }
    }
}
