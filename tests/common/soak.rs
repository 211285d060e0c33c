//! The fault-injection soak and the storm, shared by `tests/soak.rs` and
//! `tests/cluster.rs` (each declares this file with `#[path]`; it expects
//! the target's root to hold `mod common;`).
//!
//! A soak runs `calls` calls of one annotated fn over `keys` keys from
//! `tasks` tasks spread over several engines (one pool each) sharing one
//! Redis, while it injects body errors, panics, cancellations, Redis kills,
//! database connection kills and a lease shorter than a slow body. Then it
//! reconciles what callers saw with the three tables: orders (business),
//! payments (ledger) and `idem_record`.
//!
//! Keys: `calls - keys` calls repeat a key already used (30% with the
//! default sizes), half of them one of the last few keys (a concurrent
//! duplicate), half any earlier key (a late retry).
#![allow(dead_code)] // each target uses its part

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use idem::Outcome;
use serde::{Deserialize, Serialize};

use crate::common::servers::{RedisCluster, RedisServer};

/// The business action every soak call performs.
pub const BIZ: &str = "soak_pay";
/// A call that has not answered after this long is a hang, not a fault.
const HANG: Duration = Duration::from_secs(60);
/// How long the slow bodies of the short-lease fn sleep (its lease: 50 ms).
const SLOW_BODY: Duration = Duration::from_millis(100);

/// Sizes and seed of one soak.
#[derive(Debug, Clone)]
pub struct Config {
    /// Prefix of the run's keys and name in the printed report.
    pub label: &'static str,
    pub calls: usize,
    /// Distinct keys; `calls - keys` calls repeat one.
    pub keys: usize,
    pub tasks: usize,
    pub engines: usize,
    pub pool_size: u32,
    /// How many times Redis (or one cluster node) is killed and restarted.
    pub redis_kills: usize,
    pub seed: u64,
}

impl Config {
    /// The normal-test-run size: 1,500 calls, 1,050 keys (30% duplicates).
    pub fn short(label: &'static str) -> Self {
        Self { label, calls: 1_500, keys: 1_050, tasks: 16, engines: 2, pool_size: 9, redis_kills: 2, seed: seed() }
    }

    /// The `--ignored` size: 20,000 calls, 14,000 keys (30% duplicates).
    pub fn full(label: &'static str) -> Self {
        Self { calls: 20_000, keys: 14_000, redis_kills: 6, ..Self::short(label) }
    }

    /// The `--ignored` crowd: 20,000 calls over only 2,000 keys (90% repeat
    /// a key, about ten calls per key), for the contention `full` lacks.
    pub fn crowded(label: &'static str) -> Self {
        Self { keys: 2_000, ..Self::full(label) }
    }
}

/// `IDEM_SOAK_SEED`, or one from the clock (printed, so a schedule can be replayed).
fn seed() -> u64 {
    std::env::var("IDEM_SOAK_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        nanos as u64
    })
}

/// xorshift64*: a tiny seeded generator, no dependency.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self((seed ^ 0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// `true` with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// Uniform in `lo..hi` milliseconds.
    pub fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo))
    }
}

/// What one call is told to do. Skipped from the fingerprint: a retry after
/// a fault is the same call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    None,
    /// The body writes, then returns `Err`.
    BodyError,
    /// The body writes, then panics (inside `tokio::spawn`).
    Panic,
    /// The call's future is dropped after this long.
    Cancel(Duration),
}

/// One scheduled call.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub key: usize,
    pub fault: Fault,
    /// Through the fn whose lease (50 ms) is shorter than its slow body.
    pub short_lease: bool,
    /// How long the body sleeps after its writes, inside the transaction.
    pub sleep: Duration,
    /// Same key, other arguments: must get `KeyReused` once the key is done.
    pub reuse: bool,
    /// The caller waits this long before calling: a duplicate that arrives
    /// after the claim of a slow body ran out.
    pub delay: Duration,
}

impl Plan {
    pub fn ok(key: usize, sleep: Duration) -> Self {
        Self { key, fault: Fault::None, short_lease: false, sleep, reuse: false, delay: Duration::ZERO }
    }

    /// The amount the call passes: distinct per key, and other with `reuse`.
    pub fn amount(&self) -> i64 {
        100 + self.key as i64 + i64::from(self.reuse)
    }
}

/// The whole run's calls, decided up front from the seed.
pub fn schedule(cfg: &Config, rng: &mut Rng) -> Vec<Plan> {
    // A few keys go through the short-lease fn, every call of theirs.
    let short_lease: Vec<bool> = (0..cfg.keys).map(|_| rng.chance(0.08)).collect();
    let mut plans = Vec::with_capacity(cfg.calls);
    let mut fresh = 0;
    let mut late_duplicate = None;
    for i in 0..cfg.calls {
        let (left_calls, left_keys) = (cfg.calls - i, cfg.keys - fresh);
        // Draw a repeat with the probability that uses up exactly `keys` keys.
        let repeat = fresh > 0 && (left_keys == 0 || rng.below(left_calls as u64) >= left_keys as u64);
        let late = late_duplicate.take().filter(|_| left_calls > left_keys);
        let key = if let Some(key) = late {
            key
        } else if !repeat {
            fresh += 1;
            fresh - 1
        } else if rng.chance(0.5) {
            fresh - 1 - rng.below(fresh.min(16) as u64) as usize
        } else {
            rng.below(fresh as u64) as usize
        };
        let short = short_lease[key];
        let sleep = if short && rng.chance(0.5) { SLOW_BODY } else { Duration::from_micros(rng.below(3_000)) };
        let roll = rng.below(1000);
        let fault = match roll {
            0..40 => Fault::BodyError,
            40..60 => Fault::Panic,
            60..140 => {
                // Around the call's own length: before, during or after the body.
                let span = if sleep >= SLOW_BODY { 160_000 } else { 8_000 };
                Fault::Cancel(Duration::from_micros(rng.below(span)))
            }
            _ => Fault::None,
        };
        let reuse = rng.chance(0.015);
        // A slow body outlives its 50 ms claim: send a duplicate in after it.
        let delay = if late.is_some() { rng.millis(55, 95) } else { Duration::ZERO };
        if sleep >= SLOW_BODY && rng.chance(0.7) {
            late_duplicate = Some(key);
        }
        plans.push(Plan { key, fault, short_lease: short, sleep, reuse, delay });
    }
    plans
}

/// The value the body returns: `payment_id` and `exec` differ between two
/// executions, so a second execution could not hide.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Receipt {
    pub key: String,
    pub amount: i64,
    pub payment_id: i64,
    pub exec: u64,
    pub order_updated: bool,
}

#[derive(Debug)]
#[allow(dead_code)] // the fields show in messages through Debug
pub enum SoakError {
    Idem(idem::Error),
    Db(sqlx::Error),
    Body,
}

impl From<idem::Error> for SoakError {
    fn from(e: idem::Error) -> Self {
        SoakError::Idem(e)
    }
}

impl From<sqlx::Error> for SoakError {
    fn from(e: sqlx::Error) -> Self {
        SoakError::Db(e)
    }
}

/// One run's shared state: its key prefix and what the bodies saw.
pub struct Ctx {
    pub run: String,
    /// Bodies started (each gets a new `exec` number).
    pub execs: AtomicU64,
    /// Bodies that found their order already paid (a duplicate committed first).
    pub guard_hits: AtomicU64,
    /// Bodies that started while another body of the same key was running
    /// (a lease ran out, or Redis lost the claim).
    pub overlaps: AtomicU64,
    /// Bodies that slept past the 50 ms lease.
    pub slow_bodies: AtomicU64,
    running: Mutex<HashMap<String, u32>>,
}

impl Ctx {
    pub fn new(run: String) -> Self {
        Self {
            run,
            execs: AtomicU64::new(0),
            guard_hits: AtomicU64::new(0),
            overlaps: AtomicU64::new(0),
            slow_bodies: AtomicU64::new(0),
            running: Mutex::new(HashMap::new()),
        }
    }

    pub fn key(&self, i: usize) -> String {
        format!("{}.{i}", self.run)
    }

    /// Marks a body of `key` running until the guard drops (also on panic
    /// or cancellation).
    pub fn enter(&self, key: &str) -> Running<'_> {
        let mut running = self.running.lock().unwrap();
        let n = running.entry(key.to_owned()).or_default();
        if *n > 0 {
            self.overlaps.fetch_add(1, SeqCst);
        }
        *n += 1;
        Running { ctx: self, key: key.to_owned() }
    }
}

pub struct Running<'a> {
    ctx: &'a Ctx,
    key: String,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if let Ok(mut running) = self.ctx.running.lock()
            && let Some(n) = running.get_mut(&self.key)
        {
            *n -= 1;
        }
    }
}

/// Panics the soak injects are expected: keep their messages out of the log.
pub fn quiet_injected_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let message = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str));
            let injected = message.is_some_and(|m| m.contains(INJECTED_PANIC));
            if !injected {
                default(info);
            }
        }));
    });
}

pub const INJECTED_PANIC: &str = "soak: injected panic";

/// How one call ended.
#[derive(Debug)]
pub enum CallEnd {
    Returned(Result<Receipt, SoakError>, Option<Outcome>),
    Cancelled,
    Panicked,
    Hung,
}

/// What every caller saw for one key.
#[derive(Debug, Default, Clone)]
pub struct KeyLog {
    /// JSON of the first `Ok` returned for the key.
    pub first_ok: Option<String>,
    /// Every `Ok`: the amount its call passed, and the receipt it got.
    pub oks: Vec<(i64, Receipt)>,
    /// Calls that reported `Outcome::Executed`.
    pub executed: u32,
    /// `Ok` values that differ from the first.
    pub mismatches: Vec<String>,
    pub reuse_calls: u32,
    /// The amount each call answered `KeyReused` passed.
    pub key_reused: Vec<i64>,
}

/// Counts of one soak.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    pub calls: u64,
    pub executed: u64,
    pub replayed: u64,
    pub in_progress: u64,
    pub key_reused: u64,
    /// The body returned `Err` (injected).
    pub failed: u64,
    /// `Error::Storage` from the engine.
    pub storage: u64,
    /// The body's own query failed (its connection was killed).
    pub body_db: u64,
    pub cancelled: u64,
    pub panicked: u64,
    pub hung: u64,
    /// Anything no fault explains.
    pub unexpected: Vec<String>,
}

impl Tally {
    pub fn absorb(&mut self, plan: &Plan, end: CallEnd, log: &mut KeyLog) {
        self.calls += 1;
        if plan.reuse {
            log.reuse_calls += 1;
        }
        match end {
            CallEnd::Cancelled => self.cancelled += 1,
            CallEnd::Panicked => {
                self.panicked += 1;
                if plan.fault != Fault::Panic {
                    self.unexpected.push(format!("unplanned panic: {plan:?}"));
                }
            }
            CallEnd::Hung => {
                self.hung += 1;
                self.unexpected.push(format!("no answer within {HANG:?}: {plan:?}"));
            }
            CallEnd::Returned(Ok(receipt), outcome) => {
                match outcome {
                    Some(Outcome::Executed) => {
                        self.executed += 1;
                        log.executed += 1;
                    }
                    Some(Outcome::Replayed) => self.replayed += 1,
                    other => self.unexpected.push(format!("Ok with outcome {other:?}: {receipt:?}")),
                }
                let json = serde_json::to_string(&receipt).expect("receipt json");
                log.oks.push((plan.amount(), receipt));
                match &log.first_ok {
                    None => log.first_ok = Some(json),
                    Some(first) if *first == json => {}
                    Some(_) => log.mismatches.push(json),
                }
            }
            CallEnd::Returned(Err(e), outcome) => match e {
                SoakError::Idem(idem::Error::InProgress { .. }) => self.in_progress += 1,
                SoakError::Idem(idem::Error::KeyReused { .. }) => {
                    self.key_reused += 1;
                    log.key_reused.push(plan.amount());
                }
                SoakError::Idem(idem::Error::Storage(_)) => self.storage += 1,
                SoakError::Db(_) => self.body_db += 1,
                SoakError::Body if plan.fault == Fault::BodyError => self.failed += 1,
                other => self.unexpected.push(format!("{other:?} ({outcome:?}) for {plan:?}")),
            },
        }
    }

    pub fn add(&mut self, o: Tally) {
        self.calls += o.calls;
        self.executed += o.executed;
        self.replayed += o.replayed;
        self.in_progress += o.in_progress;
        self.key_reused += o.key_reused;
        self.failed += o.failed;
        self.storage += o.storage;
        self.body_db += o.body_db;
        self.cancelled += o.cancelled;
        self.panicked += o.panicked;
        self.hung += o.hung;
        self.unexpected.extend(o.unexpected);
    }
}

/// What the database holds for a run, read back after it.
#[derive(Debug, Default)]
pub struct Tables {
    /// Payments: `(k, id, amount, exec)`.
    pub ledger: Vec<(String, i64, i64, i64)>,
    /// `idem_record` rows of the run's keys: `(idem_key, status, response)`.
    pub records: Vec<(String, i16, Option<String>)>,
    /// Orders: `(k, status, paid)`.
    pub orders: Vec<(String, String, i32)>,
}

/// Checks the tables against each other and against what callers saw;
/// returns every violation found.
pub fn reconcile(ctx: &Ctx, logs: &[KeyLog], tables: &Tables) -> Vec<String> {
    let mut bad = Vec::new();
    let mut ledger: HashMap<&str, Vec<(i64, i64, i64)>> = HashMap::new();
    for (k, id, amount, exec) in &tables.ledger {
        ledger.entry(k.as_str()).or_default().push((*id, *amount, *exec));
    }
    let records: HashMap<&str, (i16, Option<&str>)> =
        tables.records.iter().map(|(k, s, r)| (k.as_str(), (*s, r.as_deref()))).collect();
    let orders: HashMap<&str, (&str, i32)> =
        tables.orders.iter().map(|(k, s, p)| (k.as_str(), (s.as_str(), *p))).collect();

    // Ledger: at most one payment per key, and each has its record.
    for (k, rows) in &ledger {
        if rows.len() != 1 {
            bad.push(format!("{k}: {} ledger rows {rows:?}", rows.len()));
        }
        let (id, amount, exec) = rows[0];
        match records.get(k) {
            None => bad.push(format!("{k}: ledger row {id} without an idem_record row")),
            Some((status, response)) => {
                let receipt = response.and_then(|r| serde_json::from_str::<Receipt>(r).ok());
                match receipt {
                    Some(r) if *status == 1 && rows.len() == 1 => {
                        if (r.key.as_str(), r.payment_id, r.amount, r.exec as i64, r.order_updated)
                            != (*k, id, amount, exec, true)
                        {
                            bad.push(format!(
                                "{k}: record says {r:?}, ledger says id {id} amount {amount} exec {exec}"
                            ));
                        }
                    }
                    _ => bad.push(format!("{k}: record status {status}, response {response:?}")),
                }
            }
        }
        match orders.get(k) {
            Some(("PAID", 1)) => {}
            other => bad.push(format!("{k}: paid in the ledger, order is {other:?}")),
        }
    }
    // Records: succeeded, with their ledger row.
    for (k, (status, _)) in &records {
        if *status != 1 {
            bad.push(format!("{k}: idem_record status {status} (processing row left behind)"));
        }
        if !ledger.contains_key(k) {
            bad.push(format!("{k}: idem_record row without a ledger row"));
        }
    }
    // Orders: paid exactly when the ledger says so.
    for (k, (status, paid)) in &orders {
        let in_ledger = ledger.contains_key(k);
        if in_ledger != (*status == "PAID") || *paid != i32::from(in_ledger) {
            bad.push(format!("{k}: order {status} paid {paid}, ledger rows {}", ledger.get(k).map_or(0, Vec::len)));
        }
    }
    // Callers: every Ok is the first Ok, which is the stored response.
    for (i, log) in logs.iter().enumerate() {
        let k = ctx.key(i);
        if !log.mismatches.is_empty() {
            bad.push(format!("{k}: first Ok {:?}, later Ok {:?}", log.first_ok, log.mismatches));
        }
        if let Some(first) = &log.first_ok {
            match records.get(k.as_str()) {
                Some((1, Some(stored))) if *stored == first.as_str() => {}
                other => bad.push(format!("{k}: returned Ok {first}, stored {other:?}")),
            }
        }
        if log.executed > 1 {
            bad.push(format!("{k}: {} calls reported Executed", log.executed));
        }
        // The winner's amount: the stored response's, or the first Ok's
        // when nothing was stored (which the check above reports).
        let stored = match records.get(k.as_str()) {
            Some((1, Some(response))) => serde_json::from_str::<Receipt>(response).ok(),
            _ => None,
        };
        let winner = stored.as_ref().or(log.oks.first().map(|(_, r)| r)).map(|r| r.amount);
        // An Ok carries the call's key and the winner's amount, which must
        // be the call's own: other arguments are answered KeyReused.
        for (asked, r) in &log.oks {
            if r.key != k {
                bad.push(format!("{k}: Ok with a receipt for key {}", r.key));
            }
            if r.amount != *asked {
                bad.push(format!("{k}: a call with amount {asked} got Ok for amount {} (other arguments)", r.amount));
            }
            if Some(r.amount) != winner {
                bad.push(format!("{k}: Ok for amount {}, the winner's is {winner:?}", r.amount));
            }
        }
        // KeyReused is only answered from a committed result (the record),
        // and only to other arguments than the ones it stored.
        for asked in &log.key_reused {
            if winner.is_none_or(|w| w == *asked) {
                bad.push(format!("{k}: KeyReused for amount {asked}, the winner's is {winner:?}"));
            }
        }
    }
    bad
}

/// Where the soak's Redis lives, and how to hurt it.
#[derive(Clone)]
pub enum RedisSetup {
    Single(Arc<RedisServer>),
    Cluster(Arc<RedisCluster>),
}

impl RedisSetup {
    pub fn builder<DB: idem::Backend>(&self, builder: idem::Builder<DB>) -> idem::Builder<DB> {
        match self {
            RedisSetup::Single(server) => builder.redis(server.client()),
            RedisSetup::Cluster(cluster) => builder.redis_cluster(cluster.client()),
        }
    }
}

/// Kills Redis (or one cluster node) `cycles` times, spread over the run by
/// progress, each time for 150..500 ms, then starts it again (empty).
pub async fn redis_faults(
    redis: RedisSetup,
    cycles: usize,
    total: usize,
    done: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    seed: u64,
) -> usize {
    let mut rng = Rng::new(seed ^ 0x05EE_D0F4_ED15);
    let mut kills = 0;
    for j in 1..=cycles {
        let at = total * j / (cycles + 1);
        while done.load(SeqCst) < at {
            if stop.load(SeqCst) {
                return kills;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let down = rng.millis(150, 500);
        match &redis {
            RedisSetup::Single(server) => {
                let s = server.clone();
                tokio::task::spawn_blocking(move || s.kill()).await.unwrap();
                tokio::time::sleep(down).await;
                let s = server.clone();
                tokio::task::spawn_blocking(move || s.restart()).await.unwrap();
            }
            RedisSetup::Cluster(cluster) => {
                let node = rng.below(cluster.ports().len() as u64) as usize;
                let c = cluster.clone();
                tokio::task::spawn_blocking(move || c.kill_node(node)).await.unwrap();
                tokio::time::sleep(down).await;
                let c = cluster.clone();
                tokio::task::spawn_blocking(move || c.start_node(node)).await.unwrap();
            }
        }
        kills += 1;
    }
    kills
}

/// Tags the connections of the soak's pools, so that only they are killed
/// (MariaDB: their connection ids; PostgreSQL: their `application_name`).
pub struct Tag {
    pub name: String,
    pub ids: Mutex<HashSet<u64>>,
}

impl Tag {
    pub fn new(name: String) -> Self {
        Self { name, ids: Mutex::new(HashSet::new()) }
    }
}

/// The printed result of one soak.
#[derive(Debug)]
pub struct Report {
    pub tally: Tally,
    pub redis_kills: usize,
    pub db_kills: u64,
    pub execs: u64,
    pub overlaps: u64,
    pub guard_hits: u64,
    pub slow_bodies: u64,
    pub ledger_rows: usize,
    pub records: usize,
    pub keys_ok: usize,
    pub reuse_calls: u64,
    pub elapsed: Duration,
}

impl Report {
    pub fn print(&self, backend: &str, cfg: &Config) {
        let t = &self.tally;
        println!(
            "soak {label} {backend}: seed={seed} calls={calls} keys={keys} tasks={tasks} engines={engines} in {secs:.1}s\n  \
             outcomes: executed={ex} replayed={re} in_progress={ip} key_reused={kr} failed(body error)={f} \
             storage_errors={st} body_db_errors={bd} cancelled={c} panicked={p}\n  \
             faults injected: body_error={f} panic={p} cancel={c} redis_kill={rk} db_conn_kill={dk} slow_body_past_lease={sb} key_reuse_calls={ru}\n  \
             bodies started={execs} overlapping_same_key={ov} saw_order_paid={gh}; keys with Ok={ko}, ledger rows={lr}, idem_record rows={rr}",
            label = cfg.label,
            seed = cfg.seed,
            calls = t.calls,
            keys = cfg.keys,
            tasks = cfg.tasks,
            engines = cfg.engines,
            secs = self.elapsed.as_secs_f64(),
            ex = t.executed,
            re = t.replayed,
            ip = t.in_progress,
            kr = t.key_reused,
            f = t.failed,
            st = t.storage,
            bd = t.body_db,
            c = t.cancelled,
            p = t.panicked,
            rk = self.redis_kills,
            dk = self.db_kills,
            sb = self.slow_bodies,
            ru = self.reuse_calls,
            execs = self.execs,
            ov = self.overlaps,
            gh = self.guard_hits,
            ko = self.keys_ok,
            lr = self.ledger_rows,
            rr = self.records,
        );
    }

    /// Every fault kind must actually have happened, including two bodies
    /// of one key running at once (what the unique index must settle); the
    /// Redis kills, due at fixed points of progress the run always passes,
    /// all of them.
    pub fn assert_faults(&self, cfg: &Config) {
        assert_eq!(self.redis_kills, cfg.redis_kills, "Redis kills");
        let missing = self.missing_faults();
        assert!(missing.is_empty(), "never happened: {}", missing.join(", "));
    }

    /// The fault kinds this run never saw.
    pub fn missing_faults(&self) -> Vec<&'static str> {
        let t = &self.tally;
        let kinds = [
            ("body error", t.failed),
            ("panic", t.panicked),
            ("cancellation", t.cancelled),
            ("db connection kill", self.db_kills),
            ("slow body past its lease", self.slow_bodies),
            ("two bodies of one key at once", self.overlaps),
        ];
        kinds.into_iter().filter(|(_, n)| *n == 0).map(|(kind, _)| kind).collect()
    }
}

/// Writes one backend's soak, storm and helpers into `pub mod $name`.
macro_rules! soak_backend {
    ($name:ident, $db:ident, $spec:ident) => {
        pub mod $name {
            use super::$spec as spec;
            use super::*;
            use idem::{Idem, idempotent};
            use sqlx::{Transaction, $db};

            pub type Db = $db;
            pub const BACKEND: &str = stringify!($name);

            async fn body(
                tx: &mut Transaction<'_, Db>,
                k: &str,
                amount: i64,
                ctx: &Ctx,
                plan: Plan,
            ) -> Result<Receipt, SoakError> {
                let exec = ctx.execs.fetch_add(1, SeqCst) + 1;
                let _running = ctx.enter(k);
                let updated =
                    sqlx::query(spec::PAY_ORDER).bind(&ctx.run).bind(k).execute(&mut **tx).await?.rows_affected() == 1;
                if !updated {
                    ctx.guard_hits.fetch_add(1, SeqCst);
                }
                // The ledger row goes in whatever the order said: only idem
                // stands between a duplicate and a second payment.
                let payment_id: i64 = sqlx::query_scalar(spec::INSERT_PAYMENT)
                    .bind(&ctx.run)
                    .bind(k)
                    .bind(amount)
                    .bind(exec as i64)
                    .fetch_one(&mut **tx)
                    .await?;
                if plan.sleep >= SLOW_BODY {
                    ctx.slow_bodies.fetch_add(1, SeqCst);
                }
                tokio::time::sleep(plan.sleep).await;
                match plan.fault {
                    Fault::BodyError => return Err(SoakError::Body),
                    Fault::Panic => panic!("{}", INJECTED_PANIC),
                    _ => {}
                }
                Ok(Receipt { key: k.to_owned(), amount, payment_id, exec, order_updated: updated })
            }

            #[idempotent(key = "<k>", ttl = "1h", biz = "soak_pay")]
            pub async fn pay(
                idem: &Idem<Db>,
                tx: &mut Transaction<'_, Db>,
                k: String,
                amount: i64,
                #[idem(skip)] ctx: &Ctx,
                #[idem(skip)] plan: Plan,
            ) -> Result<Receipt, SoakError> {
                body(tx, &k, amount, ctx, plan).await
            }

            /// The same action through a claim that lives 50 ms: a slow
            /// body outlives it, and a duplicate may claim the key meanwhile.
            #[idempotent(key = "<k>", ttl = "1h", biz = "soak_pay", lease = "50ms")]
            pub async fn pay_short_lease(
                idem: &Idem<Db>,
                tx: &mut Transaction<'_, Db>,
                k: String,
                amount: i64,
                #[idem(skip)] ctx: &Ctx,
                #[idem(skip)] plan: Plan,
            ) -> Result<Receipt, SoakError> {
                body(tx, &k, amount, ctx, plan).await
            }

            /// One call in its own task (a panic stays there), cut by its
            /// deadline if it has one.
            pub async fn call(engine: Idem<Db>, ctx: Arc<Ctx>, plan: Plan) -> CallEnd {
                let deadline = match plan.fault {
                    Fault::Cancel(after) => after,
                    _ => HANG,
                };
                let task = tokio::spawn(async move {
                    let k = ctx.key(plan.key);
                    let amount = plan.amount();
                    let call = async {
                        if plan.short_lease {
                            pay_short_lease(&engine, k, amount, &ctx, plan).await
                        } else {
                            pay(&engine, k, amount, &ctx, plan).await
                        }
                    };
                    idem::observe(tokio::time::timeout(deadline, call)).await
                });
                match task.await {
                    Ok((Ok(result), outcome)) => CallEnd::Returned(result, outcome),
                    Ok((Err(_), _)) if deadline < HANG => CallEnd::Cancelled,
                    Ok((Err(_), _)) => CallEnd::Hung,
                    Err(e) if e.is_panic() => CallEnd::Panicked,
                    Err(e) => panic!("call task: {e}"),
                }
            }

            /// A pool whose connections are tagged, for the killer.
            pub async fn pool(tag: Option<Arc<Tag>>, size: u32) -> Option<sqlx::Pool<Db>> {
                spec::open(tag, size).await
            }

            /// `n` engines, one pool each, sharing `redis`; creates the
            /// tables. `None` when the database is unreachable.
            pub async fn engines(n: usize, size: u32, redis: &RedisSetup, tag: &Arc<Tag>) -> Option<Vec<Idem<Db>>> {
                let mut engines = Vec::new();
                for _ in 0..n {
                    let pool = pool(Some(tag.clone()), size).await?;
                    let idem = redis.builder(Idem::builder(pool)).build();
                    engines.push(idem);
                }
                spec::prepare(engines[0].pool()).await;
                engines[0].migrate().await.expect("migrate");
                Some(engines)
            }

            /// Inserts `keys` pending orders for the run.
            pub async fn orders(pool: &sqlx::Pool<Db>, run: &str, keys: usize) {
                sqlx::query(sqlx::AssertSqlSafe(spec::insert_orders(keys)))
                    .bind(run)
                    .bind(run)
                    .execute(pool)
                    .await
                    .expect("insert orders");
            }

            pub async fn tables(pool: &sqlx::Pool<Db>, run: &str) -> Tables {
                let like = format!("{run}.%");
                Tables {
                    ledger: sqlx::query_as(spec::SELECT_LEDGER).bind(run).fetch_all(pool).await.expect("ledger"),
                    records: sqlx::query_as(spec::SELECT_RECORDS)
                        .bind(BIZ)
                        .bind(&like)
                        .fetch_all(pool)
                        .await
                        .expect("records"),
                    orders: sqlx::query_as(spec::SELECT_ORDERS).bind(run).fetch_all(pool).await.expect("orders"),
                }
            }

            /// Deletes the run's rows (only after it reconciled: a failed
            /// run keeps them for a look).
            pub async fn cleanup(pool: &sqlx::Pool<Db>, run: &str) {
                let like = format!("{run}.%");
                sqlx::query(spec::DELETE_LEDGER).bind(run).execute(pool).await.expect("delete ledger");
                sqlx::query(spec::DELETE_ORDERS).bind(run).execute(pool).await.expect("delete orders");
                sqlx::query(spec::DELETE_RECORDS).bind(BIZ).bind(&like).execute(pool).await.expect("delete records");
            }

            /// Kills one of the tagged connections that is inside a
            /// transaction, every 20..150 ms, until `stop`.
            async fn db_faults(admin: sqlx::Pool<Db>, tag: Arc<Tag>, stop: Arc<AtomicBool>, seed: u64) -> u64 {
                let mut rng = Rng::new(seed ^ 0x00D8_C022);
                let mut kills = 0;
                while !stop.load(SeqCst) {
                    tokio::time::sleep(rng.millis(20, 150)).await;
                    if spec::kill_one(&admin, &tag, &mut rng).await {
                        kills += 1;
                    }
                }
                kills
            }

            /// The soak: `None` when a server is unreachable (skipped).
            pub async fn soak(cfg: &Config, redis: RedisSetup) -> Option<Report> {
                quiet_injected_panics();
                let tag = Arc::new(Tag::new(crate::common::unique(&format!("idem_{}", cfg.label))));
                let engines = engines(cfg.engines, cfg.pool_size, &redis, &tag).await?;
                let admin = pool(None, 2).await?;
                let ctx = Arc::new(Ctx::new(crate::common::unique(cfg.label)));
                orders(&admin, &ctx.run, cfg.keys).await;

                let mut rng = Rng::new(cfg.seed);
                let plans = Arc::new(schedule(cfg, &mut rng));
                let logs = Arc::new(Mutex::new(vec![KeyLog::default(); cfg.keys]));
                let (next, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
                let stop = Arc::new(AtomicBool::new(false));

                let started = Instant::now();
                let redis_task = tokio::spawn(redis_faults(
                    redis.clone(),
                    cfg.redis_kills,
                    cfg.calls,
                    done.clone(),
                    stop.clone(),
                    cfg.seed,
                ));
                let db_task = tokio::spawn(db_faults(admin.clone(), tag.clone(), stop.clone(), cfg.seed));
                let mut workers = Vec::new();
                for t in 0..cfg.tasks {
                    let engine = engines[t % engines.len()].clone();
                    let (ctx, plans, logs, next, done) =
                        (ctx.clone(), plans.clone(), logs.clone(), next.clone(), done.clone());
                    workers.push(tokio::spawn(async move {
                        let mut tally = Tally::default();
                        loop {
                            let i = next.fetch_add(1, SeqCst);
                            let Some(plan) = plans.get(i).copied() else { break };
                            tokio::time::sleep(plan.delay).await;
                            let end = call(engine.clone(), ctx.clone(), plan).await;
                            tally.absorb(&plan, end, &mut logs.lock().unwrap()[plan.key]);
                            done.fetch_add(1, SeqCst);
                        }
                        tally
                    }));
                }
                let mut tally = Tally::default();
                for w in workers {
                    tally.add(w.await.expect("worker"));
                }
                stop.store(true, SeqCst);
                let redis_kills = redis_task.await.expect("redis faults");
                let db_kills = db_task.await.expect("db faults");
                let elapsed = started.elapsed();

                let tables = tables(&admin, &ctx.run).await;
                let logs = logs.lock().unwrap().clone();
                let mut bad = reconcile(&ctx, &logs, &tables);
                bad.extend(tally.unexpected.iter().cloned());
                let report = Report {
                    keys_ok: logs.iter().filter(|l| l.first_ok.is_some()).count(),
                    reuse_calls: logs.iter().map(|l| u64::from(l.reuse_calls)).sum(),
                    tally,
                    redis_kills,
                    db_kills,
                    execs: ctx.execs.load(SeqCst),
                    overlaps: ctx.overlaps.load(SeqCst),
                    guard_hits: ctx.guard_hits.load(SeqCst),
                    slow_bodies: ctx.slow_bodies.load(SeqCst),
                    ledger_rows: tables.ledger.len(),
                    records: tables.records.len(),
                    elapsed,
                };
                report.print(BACKEND, cfg);
                assert!(
                    bad.is_empty(),
                    "soak {} {BACKEND} (run {}, seed {}): {} violations:\n{}",
                    cfg.label,
                    ctx.run,
                    cfg.seed,
                    bad.len(),
                    bad.iter().take(50).cloned().collect::<Vec<_>>().join("\n")
                );
                report.assert_faults(cfg);
                cleanup(&admin, &ctx.run).await;
                Some(report)
            }

            /// What a storm saw.
            #[derive(Debug)]
            pub struct Storm {
                pub ok: usize,
                pub in_progress: usize,
                pub all_answered: Duration,
            }

            /// `callers` calls on one new key, released together by a
            /// barrier and spread over `engines`: the body runs once, every
            /// caller gets its result or `InProgress`, and afterwards every
            /// engine replays it identically.
            pub async fn storm(engines: &[Idem<Db>], callers: usize) -> Storm {
                let ctx = Arc::new(Ctx::new(crate::common::unique("storm")));
                orders(engines[0].pool(), &ctx.run, 1).await;
                let barrier = Arc::new(tokio::sync::Barrier::new(callers));
                let plan = Plan::ok(0, Duration::from_millis(100));
                let mut tasks = Vec::new();
                for i in 0..callers {
                    let (idem, ctx, barrier) = (engines[i % engines.len()].clone(), ctx.clone(), barrier.clone());
                    tasks.push(tokio::spawn(async move {
                        barrier.wait().await;
                        let started = Instant::now();
                        let r = pay(&idem, ctx.key(0), 100, &ctx, plan).await;
                        (r, started)
                    }));
                }
                let mut results = Vec::new();
                let mut first_start: Option<Instant> = None;
                for t in tasks {
                    let (r, started) = t.await.expect("no storm call panics");
                    first_start = Some(first_start.map_or(started, |f| f.min(started)));
                    results.push(r);
                }
                let all_answered = first_start.unwrap().elapsed();
                assert_eq!(ctx.execs.load(SeqCst), 1, "the storm's body ran more than once");
                let mut first: Option<String> = None;
                let (mut ok, mut in_progress) = (0, 0);
                for r in results {
                    match r {
                        Ok(receipt) => {
                            let json = serde_json::to_string(&receipt).unwrap();
                            assert_eq!(first.get_or_insert_with(|| json.clone()), &json);
                            ok += 1;
                        }
                        Err(SoakError::Idem(idem::Error::InProgress { .. })) => in_progress += 1,
                        Err(e) => panic!("storm: unexpected {e:?}"),
                    }
                }
                assert!(ok >= 1, "nobody got the storm's result");
                let first = first.unwrap();
                for idem in engines {
                    for _ in 0..5 {
                        let (r, outcome) = idem::observe(pay(idem, ctx.key(0), 100, &ctx, plan)).await;
                        assert_eq!(outcome, Some(Outcome::Replayed));
                        assert_eq!(serde_json::to_string(&r.unwrap()).unwrap(), first);
                    }
                }
                let tables = tables(engines[0].pool(), &ctx.run).await;
                assert_eq!(tables.ledger.len(), 1, "one payment");
                assert_eq!(tables.records.len(), 1, "one record");
                assert_eq!(tables.records[0].2.as_deref(), Some(first.as_str()));
                assert_eq!(ctx.execs.load(SeqCst), 1);
                cleanup(engines[0].pool(), &ctx.run).await;
                Storm { ok, in_progress, all_answered }
            }

            /// Executes `n` distinct new keys (healthy servers: each runs
            /// once); returns the run, whose keys are `<run>.<i>`, and each
            /// key's stored response.
            pub async fn distinct_keys(engines: &[Idem<Db>], n: usize) -> (String, HashMap<String, String>) {
                let ctx = Arc::new(Ctx::new(crate::common::unique("spread")));
                orders(engines[0].pool(), &ctx.run, n).await;
                let mut tasks = Vec::new();
                for lane in 0..8 {
                    let (engines, ctx) = (engines.to_vec(), ctx.clone());
                    tasks.push(tokio::spawn(async move {
                        for i in (lane..n).step_by(8) {
                            let plan = Plan::ok(i, Duration::ZERO);
                            let idem = &engines[i % engines.len()];
                            let (r, outcome) = idem::observe(pay(idem, ctx.key(i), 100, &ctx, plan)).await;
                            assert_eq!(outcome, Some(Outcome::Executed), "{:?}", r);
                        }
                    }));
                }
                for t in tasks {
                    t.await.expect("spread task");
                }
                let tables = tables(engines[0].pool(), &ctx.run).await;
                assert_eq!((tables.ledger.len(), tables.records.len()), (n, n));
                cleanup(engines[0].pool(), &ctx.run).await;
                let responses = tables.records.into_iter().map(|(k, _, r)| (k, r.expect("a response"))).collect();
                (ctx.run.clone(), responses)
            }
        }
    };
}

/// MariaDB/MySQL: tables, SQL, tagged pools and the connection killer.
pub mod mysql_spec {
    use super::{Rng, Tag};
    use crate::common;
    use sqlx::mysql::{MySql, MySqlPoolOptions};
    use sqlx::{AssertSqlSafe, Pool};
    use std::sync::Arc;
    use std::time::Duration;

    const DDL: [&str; 2] = [
        "CREATE TABLE IF NOT EXISTS soak_orders (run VARCHAR(100) NOT NULL, k VARCHAR(255) NOT NULL, \
         status VARCHAR(16) NOT NULL, paid INT NOT NULL DEFAULT 0, PRIMARY KEY (run, k))",
        "CREATE TABLE IF NOT EXISTS soak_payments (id BIGINT AUTO_INCREMENT PRIMARY KEY, run VARCHAR(100) NOT NULL, \
         k VARCHAR(255) NOT NULL, amount BIGINT NOT NULL, exec BIGINT NOT NULL, KEY (run, k))",
    ];
    pub const PAY_ORDER: &str =
        "UPDATE soak_orders SET status = 'PAID', paid = paid + 1 WHERE run = ? AND k = ? AND status = 'PENDING'";
    pub const INSERT_PAYMENT: &str =
        "INSERT INTO soak_payments (run, k, amount, exec) VALUES (?, ?, ?, ?) RETURNING id";
    pub const SELECT_LEDGER: &str = "SELECT k, id, amount, exec FROM soak_payments WHERE run = ?";
    pub const SELECT_RECORDS: &str =
        "SELECT idem_key, status, response FROM idem_record WHERE biz_type = ? AND idem_key LIKE ?";
    pub const SELECT_ORDERS: &str = "SELECT k, status, paid FROM soak_orders WHERE run = ?";
    pub const DELETE_LEDGER: &str = "DELETE FROM soak_payments WHERE run = ?";
    pub const DELETE_ORDERS: &str = "DELETE FROM soak_orders WHERE run = ?";
    pub const DELETE_RECORDS: &str = "DELETE FROM idem_record WHERE biz_type = ? AND idem_key LIKE ?";

    /// `keys` pending orders `<run>.0 ..`, from MariaDB's sequence engine.
    pub fn insert_orders(keys: usize) -> String {
        format!(
            "INSERT INTO soak_orders (run, k, status) SELECT ?, CONCAT(?, '.', seq), 'PENDING' FROM seq_0_to_{}",
            keys - 1
        )
    }

    pub async fn prepare(pool: &Pool<MySql>) {
        for ddl in DDL {
            sqlx::raw_sql(ddl).execute(pool).await.expect("soak tables");
        }
    }

    pub async fn open(tag: Option<Arc<Tag>>, size: u32) -> Option<Pool<MySql>> {
        common::reach("mysql", || {
            let tag = tag.clone();
            async move {
                let mut options =
                    MySqlPoolOptions::new().max_connections(size).acquire_timeout(Duration::from_secs(60));
                if let Some(tag) = tag {
                    options = options.after_connect(move |conn, _| {
                        let tag = tag.clone();
                        Box::pin(async move {
                            let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()").fetch_one(&mut *conn).await?;
                            tag.ids.lock().unwrap().insert(id);
                            Ok(())
                        })
                    });
                }
                options.connect(&common::mysql_url()).await.ok()
            }
        })
        .await
    }

    /// `KILL`s one tagged connection with an open InnoDB transaction.
    pub async fn kill_one(admin: &Pool<MySql>, tag: &Tag, rng: &mut Rng) -> bool {
        let Ok(busy) = sqlx::query_scalar::<_, u64>("SELECT trx_mysql_thread_id FROM information_schema.INNODB_TRX")
            .fetch_all(admin)
            .await
        else {
            return false;
        };
        let ours: Vec<u64> = {
            let ids = tag.ids.lock().unwrap();
            busy.into_iter().filter(|id| ids.contains(id)).collect()
        };
        if ours.is_empty() {
            return false;
        }
        let id = ours[rng.below(ours.len() as u64) as usize];
        sqlx::query(AssertSqlSafe(format!("KILL {id}"))).execute(admin).await.is_ok()
    }
}

/// PostgreSQL: tables, SQL, tagged pools and the connection killer.
pub mod pg_spec {
    use super::{Rng, Tag};
    use crate::common;
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions, Postgres};
    use sqlx::{Pool, raw_sql};
    use std::str::FromStr;
    use std::sync::Arc;
    use std::time::Duration;

    const DDL: &str = "SELECT pg_advisory_xact_lock(7306232718293617);
        CREATE TABLE IF NOT EXISTS soak_orders (run VARCHAR(100) NOT NULL, k VARCHAR(255) NOT NULL,
            status VARCHAR(16) NOT NULL, paid INT NOT NULL DEFAULT 0, PRIMARY KEY (run, k));
        CREATE TABLE IF NOT EXISTS soak_payments (id BIGSERIAL PRIMARY KEY, run VARCHAR(100) NOT NULL,
            k VARCHAR(255) NOT NULL, amount BIGINT NOT NULL, exec BIGINT NOT NULL);
        CREATE INDEX IF NOT EXISTS soak_payments_run_k ON soak_payments (run, k);";
    pub const PAY_ORDER: &str =
        "UPDATE soak_orders SET status = 'PAID', paid = paid + 1 WHERE run = $1 AND k = $2 AND status = 'PENDING'";
    pub const INSERT_PAYMENT: &str =
        "INSERT INTO soak_payments (run, k, amount, exec) VALUES ($1, $2, $3, $4) RETURNING id";
    pub const SELECT_LEDGER: &str = "SELECT k, id, amount, exec FROM soak_payments WHERE run = $1";
    pub const SELECT_RECORDS: &str =
        "SELECT idem_key, status, response FROM idem_record WHERE biz_type = $1 AND idem_key LIKE $2";
    pub const SELECT_ORDERS: &str = "SELECT k, status, paid FROM soak_orders WHERE run = $1";
    pub const DELETE_LEDGER: &str = "DELETE FROM soak_payments WHERE run = $1";
    pub const DELETE_ORDERS: &str = "DELETE FROM soak_orders WHERE run = $1";
    pub const DELETE_RECORDS: &str = "DELETE FROM idem_record WHERE biz_type = $1 AND idem_key LIKE $2";

    /// `keys` pending orders `<run>.0 ..`.
    pub fn insert_orders(keys: usize) -> String {
        format!(
            "INSERT INTO soak_orders (run, k, status) SELECT $1, $2 || '.' || g, 'PENDING' FROM generate_series(0, {}) g",
            keys - 1
        )
    }

    pub async fn prepare(pool: &Pool<Postgres>) {
        // One implicit transaction: the advisory lock covers the DDL.
        raw_sql(DDL).execute(pool).await.expect("soak tables");
    }

    pub async fn open(tag: Option<Arc<Tag>>, size: u32) -> Option<Pool<Postgres>> {
        common::reach("postgres", || {
            let tag = tag.clone();
            async move {
                let mut options = PgConnectOptions::from_str(&common::pg_url()).ok()?;
                if let Some(tag) = &tag {
                    options = options.application_name(&tag.name);
                }
                PgPoolOptions::new()
                    .max_connections(size)
                    .acquire_timeout(Duration::from_secs(60))
                    .connect_with(options)
                    .await
                    .ok()
            }
        })
        .await
    }

    /// `pg_terminate_backend` on one tagged backend inside a transaction.
    pub async fn kill_one(admin: &Pool<Postgres>, tag: &Tag, _rng: &mut Rng) -> bool {
        let killed: Result<Option<bool>, _> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = $1 AND xact_start IS NOT NULL AND pid <> pg_backend_pid() \
             ORDER BY random() LIMIT 1",
        )
        .bind(&tag.name)
        .fetch_optional(admin)
        .await;
        matches!(killed, Ok(Some(true)))
    }
}

soak_backend!(mysql, MySql, mysql_spec);
soak_backend!(postgres, Postgres, pg_spec);
