//! Checking a run: what each call ended with ([`CallEnd`]), what callers
//! saw per key ([`KeyLog`]) and in total ([`Tally`]), what the tables hold
//! ([`Tables`]), and [`reconcile`], which holds them against each other.

use std::collections::HashMap;

use idempotency::Outcome;
use serde::{Deserialize, Serialize};

use super::{Ctx, Fault, HANG, Plan};

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
    Idem(idempotency::Error),
    Db(sqlx::Error),
    Body,
}

impl From<idempotency::Error> for SoakError {
    fn from(e: idempotency::Error) -> Self {
        SoakError::Idem(e)
    }
}

impl From<sqlx::Error> for SoakError {
    fn from(e: sqlx::Error) -> Self {
        SoakError::Db(e)
    }
}

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
                SoakError::Idem(idempotency::Error::InProgress { .. }) => self.in_progress += 1,
                SoakError::Idem(idempotency::Error::KeyReused { .. }) => {
                    self.key_reused += 1;
                    log.key_reused.push(plan.amount());
                }
                SoakError::Idem(idempotency::Error::Storage(_)) => self.storage += 1,
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
