//! The history checker: every attempt the clients recorded, against what
//! the promoted server holds once the run is over (its ledger and its
//! `idem_record` rows).
//!
//! - An `Ok` answer *survived* when the promoted server's record holds
//!   exactly its bytes; otherwise it is an acknowledged call that lost its
//!   record.
//! - A key *executed twice* when two executions of it were seen: two
//!   different receipts answered, or a ledger row of another attempt than
//!   an answered one.
//! - An attempt whose body ran to the end and then failed (or whose own
//!   commit came back through the engine's probe) had its record write or
//!   `COMMIT` in flight; when its ledger row is on the promoted server, its
//!   `COMMIT` went through and only the answer was lost: that call must end
//!   replaying this very execution.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use idempotency::Outcome;
use sqlx::PgPool;

use crate::load::{Answer, Attempt, BIZ, Kind, Phase, Receipt};

/// What the promoted server holds.
pub struct Tables {
    /// Per key: the attempts whose ledger rows committed.
    ledger: HashMap<String, Vec<u64>>,
    /// Per key: status and response of its record.
    records: HashMap<String, (i16, Option<String>)>,
}

impl Tables {
    pub async fn read(pool: &PgPool) -> Tables {
        let mut ledger: HashMap<String, Vec<u64>> = HashMap::new();
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT k, attempt FROM failover_ledger").fetch_all(pool).await.expect("ledger");
        for (k, attempt) in rows {
            ledger.entry(k).or_default().push(attempt as u64);
        }
        let rows: Vec<(String, i16, Option<String>)> =
            sqlx::query_as("SELECT idem_key, status, response FROM idem_record WHERE biz_type = $1")
                .bind(BIZ)
                .fetch_all(pool)
                .await
                .expect("records");
        let records = rows.into_iter().map(|(k, status, response)| (k, (status, response))).collect();
        Tables { ledger, records }
    }

    fn response(&self, key: &str) -> Option<&str> {
        self.records.get(key).and_then(|(_, r)| r.as_deref())
    }

    fn ledger(&self, key: &str) -> &[u64] {
        self.ledger.get(key).map_or(&[], Vec::as_slice)
    }
}

/// What the run found. Lists hold one line per case, to show.
#[derive(Default)]
pub struct Findings {
    pub calls: usize,
    pub attempts: usize,
    /// Attempts by what they got: `executed`, `replayed`, `retried: <error>`, ...
    pub answers: BTreeMap<String, usize>,
    /// `Executed` answers by the phase they arrived in.
    pub executions_by_phase: BTreeMap<Phase, usize>,
    /// Calls whose last attempt is not `Ok`.
    pub unanswered: Vec<String>,
    pub acks: usize,
    /// `Ok` answers whose bytes are not the promoted server's record.
    pub lost_acks: Vec<String>,
    /// Those, by the phase they arrived in.
    pub lost_acks_by_phase: BTreeMap<Phase, usize>,
    /// Keys whose lost acks those are.
    pub lost_ack_keys: usize,
    /// Keys with two executions seen.
    pub doubles: Vec<String>,
    /// Keys answered with two different receipts.
    pub divergent: usize,
    /// Attempts that failed after their body ran (record write or `COMMIT` in flight).
    pub after_body: usize,
    /// Of those, the ones whose `COMMIT` went through (ledger row on the promoted server).
    pub commit_answer_lost: usize,
    /// Of those, the calls that ended replaying that execution.
    pub commit_answer_lost_replayed: usize,
    /// Calls whose `COMMIT` went through and that did not end replaying it.
    pub not_replayed: Vec<String>,
    /// Rows that disagree on the promoted server (two ledger rows, a ledger
    /// row without its record, a record left `processing`).
    pub table_mismatches: Vec<String>,
    /// Late duplicates by outcome.
    pub late: BTreeMap<String, usize>,
    /// Late duplicates of keys that lost an acknowledged record, by outcome
    /// (`executed`: the key ran again; `replayed`: Redis still held the lost
    /// result).
    pub late_on_lost: BTreeMap<String, usize>,
}

fn label(answer: &Answer) -> String {
    match answer {
        Answer::Ok(_, outcome) => format!("{outcome:?}").to_lowercase(),
        Answer::Retryable(class, _) => format!("retried: {class}"),
        Answer::Final(e) => format!("final: {e}"),
    }
}

/// Checks `history` against `tables`.
pub fn check(history: &[Attempt], tables: &Tables) -> Findings {
    let mut f = Findings { attempts: history.len(), ..Findings::default() };
    let mut calls: BTreeMap<u64, Vec<&Attempt>> = BTreeMap::new();
    for a in history {
        calls.entry(a.call).or_default().push(a);
        *f.answers.entry(label(&a.answer)).or_default() += 1;
    }
    f.calls = calls.len();
    let mut receipts: HashMap<&str, BTreeSet<&Receipt>> = HashMap::new();
    let mut lost_keys = BTreeSet::new();
    for a in history {
        let Answer::Ok(receipt, outcome) = &a.answer else { continue };
        f.acks += 1;
        if *outcome == Outcome::Executed {
            *f.executions_by_phase.entry(a.ended).or_default() += 1;
        }
        receipts.entry(&a.key).or_default().insert(receipt);
        let bytes = serde_json::to_string(receipt).expect("json");
        if tables.response(&a.key) != Some(bytes.as_str()) {
            lost_keys.insert(a.key.as_str());
            *f.lost_acks_by_phase.entry(a.ended).or_default() += 1;
            f.lost_acks.push(format!("{}; the promoted server holds {:?}", a.line(), tables.response(&a.key)));
        }
    }
    f.lost_ack_keys = lost_keys.len();

    for attempts in calls.values_mut() {
        attempts.sort_by_key(|a| a.id);
        let last = attempts.last().expect("an attempt");
        if !matches!(last.answer, Answer::Ok(..)) {
            f.unanswered.push(format!("after {} attempts, {}", attempts.len(), last.line()));
        }
        if last.kind == Kind::Late {
            *f.late.entry(label(&last.answer)).or_default() += 1;
            if lost_keys.contains(last.key.as_str()) {
                *f.late_on_lost.entry(label(&last.answer)).or_default() += 1;
            }
        }
        for a in attempts.iter().filter(|a| a.body_done) {
            let own_commit_probed = matches!(&a.answer, Answer::Ok(r, Outcome::Replayed) if r.attempt == a.id);
            if !(matches!(a.answer, Answer::Retryable(..)) || own_commit_probed) {
                continue;
            }
            f.after_body += 1;
            if !tables.ledger(&a.key).contains(&a.id) {
                continue;
            }
            f.commit_answer_lost += 1;
            match &last.answer {
                Answer::Ok(r, Outcome::Replayed) if r.attempt == a.id => f.commit_answer_lost_replayed += 1,
                _ => f.not_replayed.push(format!("{} went through; the call ended: {}", a.line(), last.line())),
            }
        }
    }

    let keys: BTreeSet<&str> =
        tables.ledger.keys().chain(tables.records.keys()).map(String::as_str).chain(receipts.keys().copied()).collect();
    for key in keys {
        let ledger = tables.ledger(key);
        let mut executions: BTreeSet<u64> = ledger.iter().copied().collect();
        let answered = receipts.get(key);
        executions.extend(answered.into_iter().flatten().map(|r| r.attempt));
        if executions.len() > 1 {
            f.doubles.push(format!("{key}: executions {executions:?}, ledger rows {ledger:?}"));
        }
        if answered.is_some_and(|r| r.len() > 1) {
            f.divergent += 1;
        }
        let record = tables.records.get(key);
        let succeeded = record.is_some_and(|(status, response)| *status == 1 && response.is_some());
        if ledger.len() > 1 || (ledger.len() == 1) != succeeded || record.is_some() && !succeeded {
            f.table_mismatches.push(format!("{key}: ledger {ledger:?}, record {record:?}"));
        }
    }
    f
}

impl Findings {
    /// The figures, in a few lines.
    pub fn print(&self, run: &str) {
        println!("failover {run}: {} calls, {} attempts; answers {:?}", self.calls, self.attempts, self.answers);
        println!("failover {run}: executions answered by phase {:?}", self.executions_by_phase);
        println!(
            "failover {run}: {} Ok answers, {} lost their record ({} keys); {} keys executed twice ({} answered with two receipts); {} unanswered calls; {} table mismatches",
            self.acks,
            self.lost_acks.len(),
            self.lost_ack_keys,
            self.doubles.len(),
            self.divergent,
            self.unanswered.len(),
            self.table_mismatches.len()
        );
        println!(
            "failover {run}: {} attempts failed after their body ran; {} of them had their COMMIT go through (answer lost), {} of those calls ended replaying it",
            self.after_body, self.commit_answer_lost, self.commit_answer_lost_replayed
        );
        println!("failover {run}: lost acks by the phase they were answered in {:?}", self.lost_acks_by_phase);
        println!(
            "failover {run}: late duplicates {:?}; of those on keys that lost a record {:?}",
            self.late, self.late_on_lost
        );
        for (what, lines) in [
            ("lost ack", &self.lost_acks),
            ("executed twice", &self.doubles),
            ("unanswered", &self.unanswered),
            ("not replayed", &self.not_replayed),
            ("table mismatch", &self.table_mismatches),
        ] {
            for line in lines.iter().take(3) {
                println!("failover {run}: {what}: {line}");
            }
        }
    }
}
