//! The checker: holds the history of every call ([`Call`]) and the cuts
//! ([`Window`]) against the final tables, and names every violation.
//!
//! The tables (per key):
//! - executed at most once: at most one ledger row;
//! - nothing committed without its record, nor a record without its
//!   ledger row; no record left `processing`; the record's stored result
//!   is the ledger row's (payment id, amount, execution);
//! - the order is paid exactly when the ledger has its row, once.
//!
//! The history (per key):
//! - at most one call answered `Executed`;
//! - no `Ok` without its committed record: an `Ok`'s bytes are the
//!   record's stored response, byte for byte (so every replay equals the
//!   committed result), and its call passed the record's arguments;
//! - `KeyReused` only when the committed record holds other arguments;
//! - no duplicate answered with a failure: once some call of the key got
//!   `Ok` (the commit is visible from then on), every later call is `Ok`,
//!   `InProgress` or `KeyReused`, or a storage failure (`Storage`, the
//!   body's own query failing, no answer within the deadline) while its
//!   own process's database path was cut ([`Window::touches`], with
//!   `grace` after the heal);
//! - no failure the cuts do not explain, on any key: the same storage
//!   failures only while the call's own database path was cut, or beside
//!   a call of the key whose process's database path was cut during both
//!   (its transaction, left open on the server, can deadlock with this
//!   one: a contention the engine cannot settle); never a `Replay` error
//!   or anything else;
//! - `InProgress` only while a call could have been running: another call
//!   `a` of the key started before this one ended, and this one started
//!   before `a`'s hold ended. `a`'s hold ends with `a`, unless a cut of
//!   `a`'s process touched it: a database cut can keep `a`'s transaction
//!   (and its row lock) open on the server until the heal (plus `grace`);
//!   a Redis cut can leave `a`'s claim behind, or land it late (a `SET`
//!   held by the cut arrives at the heal), and a claim lives at most its
//!   `lease`: `a`'s hold then ends `lease + redis_timeout` after the
//!   later of `a`'s end and the heal. A Redis cut counts as touching `a`
//!   up to `redis_grace` after its heal: the engine leaves Redis alone
//!   for a back-off after a failure, so a release can be skipped then.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::history::{Answer, Call, Window};
use super::schedule::Path;
use crate::soak::{Receipt, Tables};

/// The engine's time bounds the rules allow for.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// The annotated fn's claim lease.
    pub lease_us: i64,
    /// The engine's Redis timeout.
    pub redis_timeout_us: i64,
    /// How long after a database heal a failure may still surface.
    pub grace_us: i64,
    /// How long after a Redis heal a release may still be skipped.
    pub redis_grace_us: i64,
}

/// What the checker found: the violations, and counts of what it allowed.
#[derive(Debug, Default)]
pub struct Verdict {
    pub violations: Vec<String>,
    /// Answers by kind.
    pub answers: BTreeMap<&'static str, u64>,
    /// `InProgress` while another call of the key was running.
    pub in_progress_running: u64,
    /// `InProgress` after the other call ended, within its hold.
    pub in_progress_held: u64,
    /// Storage failures while the process's database path was cut.
    pub failures_while_cut: u64,
    /// ... of which to a duplicate of a committed call.
    pub failures_after_commit: u64,
    /// Storage failures beside a concurrent call whose database path was cut.
    pub failures_by_partner: u64,
    /// Keys called by more than one process.
    pub keys_shared: u64,
    /// Keys with calls of two processes running at once.
    pub keys_concurrent: u64,
    /// Calls sent after their key committed.
    pub after_commit: u64,
}

/// Checks `calls` and `windows` against `tables`.
pub fn check(calls: &[Call], windows: &[Window], tables: &Tables, bounds: &Bounds) -> Verdict {
    let mut verdict = Verdict::default();
    let truth = Truth::of(tables);
    check_tables(&truth, &mut verdict.violations);
    let cuts = Cuts::of(windows);
    let mut by_key: BTreeMap<&str, Vec<&Call>> = BTreeMap::new();
    for call in calls {
        *verdict.answers.entry(call.answer.kind()).or_default() += 1;
        by_key.entry(call.key.as_str()).or_default().push(call);
    }
    for (key, mut calls) in by_key {
        calls.sort_by_key(|c| (c.start_us, c.end_us));
        check_key(key, &calls, &truth, &cuts, bounds, &mut verdict);
    }
    verdict
}

/// The final tables, by key.
struct Truth<'t> {
    ledger: HashMap<&'t str, Vec<(i64, i64, i64)>>,
    records: HashMap<&'t str, (i16, Option<&'t str>)>,
    orders: HashMap<&'t str, (&'t str, i32)>,
}

impl<'t> Truth<'t> {
    fn of(tables: &'t Tables) -> Self {
        let mut ledger: HashMap<&str, Vec<_>> = HashMap::new();
        for (k, id, amount, exec) in &tables.ledger {
            ledger.entry(k.as_str()).or_default().push((*id, *amount, *exec));
        }
        let records = tables.records.iter().map(|(k, s, r)| (k.as_str(), (*s, r.as_deref()))).collect();
        let orders = tables.orders.iter().map(|(k, s, p)| (k.as_str(), (s.as_str(), *p))).collect();
        Self { ledger, records, orders }
    }

    /// The committed result of `key`.
    fn committed(&self, key: &str) -> Option<&'t str> {
        match self.records.get(key) {
            Some((1, Some(response))) => Some(response),
            _ => None,
        }
    }

    /// The amount the committed result was made for.
    fn committed_amount(&self, key: &str) -> Option<i64> {
        self.committed(key).and_then(|r| serde_json::from_str::<Receipt>(r).ok()).map(|r| r.amount)
    }
}

fn check_tables(truth: &Truth<'_>, bad: &mut Vec<String>) {
    let keys: BTreeSet<&str> =
        truth.ledger.keys().chain(truth.records.keys()).chain(truth.orders.keys()).copied().collect();
    for k in keys {
        let rows = truth.ledger.get(k).map_or(&[][..], Vec::as_slice);
        if rows.len() > 1 {
            bad.push(format!("{k}: executed {} times: ledger rows {rows:?}", rows.len()));
        }
        match (truth.records.get(k), rows.first()) {
            (None, None) => {}
            (None, Some(row)) => bad.push(format!("{k}: ledger row {row:?} without its record")),
            (Some((status, _)), _) if *status != 1 => bad.push(format!("{k}: record left in status {status}")),
            (Some(_), None) => bad.push(format!("{k}: record without its ledger row")),
            (Some((_, response)), Some(&(id, amount, exec))) => {
                let receipt = response.and_then(|r| serde_json::from_str::<Receipt>(r).ok());
                let agrees = receipt.as_ref().is_some_and(|r| {
                    (r.key.as_str(), r.payment_id, r.amount, r.exec as i64, r.order_updated)
                        == (k, id, amount, exec, true)
                });
                if !agrees {
                    bad.push(format!("{k}: record says {response:?}, ledger says id {id} amount {amount} exec {exec}"));
                }
            }
        }
        let paid = truth.orders.get(k).copied();
        let expected = if rows.is_empty() { ("PENDING", 0) } else { ("PAID", 1) };
        if paid != Some(expected) {
            bad.push(format!("{k}: order {paid:?}, ledger rows {}", rows.len()));
        }
    }
}

/// The cuts, by process and path.
struct Cuts<'w> {
    by: HashMap<(usize, Path), Vec<&'w Window>>,
}

impl<'w> Cuts<'w> {
    fn of(windows: &'w [Window]) -> Self {
        let mut by: HashMap<(usize, Path), Vec<&Window>> = HashMap::new();
        for w in windows {
            by.entry((w.proc, w.path)).or_default().push(w);
        }
        Self { by }
    }

    /// The cuts of `proc`'s `path` touching `[start, end]` (`grace` after their heal).
    fn touching(&self, proc: usize, path: Path, start: i64, end: i64, grace: i64) -> impl Iterator<Item = &&'w Window> {
        self.by.get(&(proc, path)).into_iter().flatten().filter(move |w| w.touches(start, end, grace))
    }

    /// Whether `call`'s own database path was cut while it ran.
    fn db_cut(&self, call: &Call, bounds: &Bounds) -> bool {
        self.touching(call.proc, Path::Db, call.start_us, call.end_us, bounds.grace_us).next().is_some()
    }

    /// A call of the key running beside `call` while its own process's
    /// database path was cut: its transaction, left open on the server by
    /// the cut, can deadlock with `call`'s or be waited for past the bound.
    fn cut_partner<'c>(&self, call: &Call, calls: &[&'c Call], bounds: &Bounds) -> Option<&'c Call> {
        calls.iter().copied().find(|a| {
            !std::ptr::eq(*a, call)
                && a.start_us < call.end_us
                && self
                    .touching(a.proc, Path::Db, a.start_us, a.end_us, bounds.grace_us)
                    .any(|w| w.touches(call.start_us, call.end_us, bounds.grace_us))
        })
    }

    /// Until when `call` may have held its key (see the module's docs).
    fn hold_end(&self, call: &Call, bounds: &Bounds) -> i64 {
        let mut end = call.end_us;
        for w in self.touching(call.proc, Path::Db, call.start_us, call.end_us, bounds.grace_us) {
            end = end.max(w.end_us + bounds.grace_us);
        }
        for w in self.touching(call.proc, Path::Redis, call.start_us, call.end_us, bounds.redis_grace_us) {
            end = end.max(call.end_us.max(w.end_us) + bounds.lease_us + bounds.redis_timeout_us);
        }
        end
    }
}

/// A history line, as it is in the process's file.
fn line(call: &Call) -> String {
    serde_json::to_string(call).expect("a call's json")
}

fn check_key(key: &str, calls: &[&Call], truth: &Truth<'_>, cuts: &Cuts<'_>, bounds: &Bounds, verdict: &mut Verdict) {
    let bad = &mut verdict.violations;
    let committed = truth.committed(key);
    let committed_amount = truth.committed_amount(key);
    let executed: Vec<&&Call> = calls.iter().filter(|c| matches!(c.answer, Answer::Executed(_))).collect();
    if executed.len() > 1 {
        let lines: Vec<String> = executed.iter().map(|c| line(c)).collect();
        bad.push(format!("{key}: {} calls answered Executed:\n  {}", executed.len(), lines.join("\n  ")));
    }
    let first_ok = calls.iter().find_map(|c| c.answer.ok());
    // The commit is visible to every call sent after the first Ok ended.
    let committed_by = calls.iter().filter(|c| c.answer.ok().is_some()).map(|c| c.end_us).min();
    let procs: BTreeSet<usize> = calls.iter().map(|c| c.proc).collect();
    verdict.keys_shared += u64::from(procs.len() > 1);
    let concurrent = calls.iter().enumerate().any(|(i, a)| {
        calls[i + 1..].iter().any(|b| b.proc != a.proc && b.start_us < a.end_us && a.start_us < b.end_us)
    });
    verdict.keys_concurrent += u64::from(concurrent);

    for call in calls {
        let after_commit = committed_by.is_some_and(|t| call.start_us > t);
        verdict.after_commit += u64::from(after_commit);
        match &call.answer {
            Answer::Executed(json) | Answer::Replayed(json) => {
                match committed {
                    None => bad.push(format!("{key}: Ok without its committed record: {}", line(call))),
                    Some(stored) if stored != json => {
                        bad.push(format!("{key}: Ok differs from the committed {stored}: {}", line(call)));
                    }
                    Some(_) => {}
                }
                if first_ok.is_some_and(|first| first != json) {
                    bad.push(format!("{key}: Ok differs from the first Ok {first_ok:?}: {}", line(call)));
                }
                let amount = serde_json::from_str::<Receipt>(json).ok().map(|r| r.amount);
                if amount != Some(call.amount) {
                    bad.push(format!("{key}: Ok for the arguments of amount {amount:?}: {}", line(call)));
                }
            }
            Answer::KeyReused => {
                if committed_amount.is_none_or(|a| a == call.amount) {
                    bad.push(format!("{key}: KeyReused, committed amount {committed_amount:?}: {}", line(call)));
                }
            }
            Answer::InProgress => {
                let holder = calls.iter().find(|a| {
                    !std::ptr::eq(**a, *call) && a.start_us < call.end_us && call.start_us < cuts.hold_end(a, bounds)
                });
                match holder {
                    Some(a) if call.start_us < a.end_us => verdict.in_progress_running += 1,
                    Some(_) => verdict.in_progress_held += 1,
                    None => bad.push(format!("{key}: InProgress with nothing running: {}", line(call))),
                }
            }
            Answer::Storage | Answer::BodyDb | Answer::Timeout if cuts.db_cut(call, bounds) => {
                verdict.failures_while_cut += 1;
                verdict.failures_after_commit += u64::from(after_commit);
            }
            failure if after_commit => {
                let kind = failure.kind();
                bad.push(format!("{key}: a duplicate of a committed call answered {kind}: {}", line(call)));
            }
            Answer::Storage | Answer::BodyDb | Answer::Timeout if cuts.cut_partner(call, calls, bounds).is_some() => {
                verdict.failures_by_partner += 1;
            }
            failure => {
                let kind = failure.kind();
                let around: Vec<String> = calls
                    .iter()
                    .filter(|a| !std::ptr::eq(**a, *call) && a.start_us < call.end_us && call.start_us < a.end_us)
                    .map(|a| line(a))
                    .collect();
                bad.push(format!(
                    "{key}: {kind} with no database path cut, its own or a concurrent call's: {}\n  concurrent: {}",
                    line(call),
                    around.join("\n  concurrent: ")
                ));
            }
        }
    }
}
