//! The printed result of one soak, and the check that every fault kind it
//! was meant to inject actually happened.

use std::time::Duration;

use super::{Config, Tally};

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
