//! The printed result of one run (counts of every nemesis event and every
//! answer, and what the checker allowed), and the check that the run
//! really went through what it was meant to.

use std::collections::BTreeMap;
use std::time::Duration;

use super::checker::Verdict;
use super::schedule::{Config, Cut, Path};

/// What one run did and found.
#[derive(Debug, Default)]
pub struct Summary {
    pub backend: &'static str,
    pub calls: usize,
    /// Nemesis events by path and kind.
    pub events: BTreeMap<(Path, Cut), u64>,
    /// Nemesis events by how many processes they cut at once.
    pub widths: BTreeMap<usize, u64>,
    /// Process-path windows (an event on three processes is three).
    pub windows: usize,
    pub verdict: Verdict,
    pub ledger_rows: usize,
    pub records: usize,
    pub elapsed: Duration,
}

impl Summary {
    pub fn print(&self, cfg: &Config) {
        let events = |path: Path| {
            let line: Vec<String> = Cut::ALL
                .iter()
                .map(|cut| format!("{cut:?}={}", self.events.get(&(path, *cut)).copied().unwrap_or(0)))
                .collect();
            line.join(" ")
        };
        let widths: Vec<String> = self.widths.iter().map(|(n, count)| format!("{n}={count}")).collect();
        let answers: Vec<String> = self.verdict.answers.iter().map(|(kind, n)| format!("{kind}={n}")).collect();
        let v = &self.verdict;
        println!(
            "nemesis {label} {backend}: seed={seed} processes={procs} tasks={tasks} first calls={first} keys={keys}; \
             {calls} calls in {secs:.1}s\n  \
             nemesis events: redis: {redis}\n                  db: {db}\n  \
             processes cut at once: {widths}; process-path windows={windows}\n  \
             answers: {answers}\n  \
             allowed: in_progress while another ran={ipr}, within a hold={iph}; storage failures while its db path \
             was cut={fc} (to duplicates of committed calls={fac}), beside a call whose db path was cut={fbp}\n  \
             keys called by several processes={shared}, by two at once={conc}; calls after their key committed={after}\n  \
             tables: ledger rows={ledger}, idem_record rows={records}; violations={bad}",
            label = cfg.label,
            backend = self.backend,
            seed = cfg.seed,
            procs = cfg.procs,
            tasks = cfg.tasks,
            first = cfg.procs * cfg.calls_per_proc,
            keys = cfg.keys,
            calls = self.calls,
            secs = self.elapsed.as_secs_f64(),
            redis = events(Path::Redis),
            db = events(Path::Db),
            widths = widths.join(" "),
            windows = self.windows,
            answers = answers.join(" "),
            ipr = v.in_progress_running,
            iph = v.in_progress_held,
            fc = v.failures_while_cut,
            fac = v.failures_after_commit,
            fbp = v.failures_by_partner,
            shared = v.keys_shared,
            conc = v.keys_concurrent,
            after = v.after_commit,
            ledger = self.ledger_rows,
            records = self.records,
            bad = v.violations.len(),
        );
    }

    /// What the run never went through: a kind of cut on a path, cuts of
    /// one and of several processes at once, duplicates across processes
    /// at the same time and after a commit, other arguments refused,
    /// failures while cut.
    pub fn missing(&self) -> Vec<String> {
        let mut missing = Vec::new();
        for path in [Path::Redis, Path::Db] {
            for cut in Cut::ALL {
                if !self.events.contains_key(&(path, cut)) {
                    missing.push(format!("{cut:?} on {path:?}"));
                }
            }
        }
        let v = &self.verdict;
        let answer = |kind: &str| v.answers.get(kind).copied().unwrap_or(0);
        let seen = [
            ("a cut of one process", self.widths.get(&1).copied().unwrap_or(0)),
            ("a cut of several processes", self.widths.range(2..).map(|(_, n)| n).sum()),
            ("an execution", answer("executed")),
            ("a replay", answer("replayed")),
            ("KeyReused", answer("key_reused")),
            ("two processes calling one key at once", v.keys_concurrent),
            ("a call after its key committed", v.after_commit),
            ("a storage failure while cut", v.failures_while_cut),
        ];
        missing.extend(seen.into_iter().filter(|(_, n)| *n == 0).map(|(what, _)| what.to_owned()));
        missing
    }
}
