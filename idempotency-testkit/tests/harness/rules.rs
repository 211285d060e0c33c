//! The checker is not vacuous: small hand-written histories that break
//! each rule are reported, and their healthy twins are not.

use idempotency_testkit::nemesis::{Answer, Bounds, Call, Cut, Path, Verdict, Window, check};
use idempotency_testkit::soak::{Receipt, Tables};

const BOUNDS: Bounds =
    Bounds { lease_us: 1_000_000, redis_timeout_us: 500_000, grace_us: 500_000, redis_grace_us: 1_500_000 };

/// The stored result of key `k` for `amount`, payment `id`.
fn receipt(k: &str, amount: i64, id: i64) -> String {
    let r = Receipt { key: k.to_owned(), amount, payment_id: id, exec: id as u64, order_updated: true };
    serde_json::to_string(&r).unwrap()
}

/// A call of process `proc` from `start` to `end` (milliseconds).
fn call(proc: usize, k: &str, amount: i64, start: i64, end: i64, answer: Answer) -> Call {
    Call { proc, key: k.to_owned(), amount, start_us: start * 1000, end_us: end * 1000, answer, detail: None }
}

fn window(proc: usize, path: Path, start: i64, end: i64) -> Window {
    Window { proc, path, cut: Cut::Blackhole, start_us: start * 1000, end_us: end * 1000 }
}

/// Tables where each `(k, amount, id)` committed once, and `pending` keys
/// were never paid.
fn tables(committed: &[(&str, i64, i64)], pending: &[&str]) -> Tables {
    let mut t = Tables::default();
    for &(k, amount, id) in committed {
        t.ledger.push((k.to_owned(), id, amount, id));
        t.records.push((k.to_owned(), 1, Some(receipt(k, amount, id))));
        t.orders.push((k.to_owned(), "PAID".to_owned(), 1));
    }
    for k in pending {
        t.orders.push(((*k).to_owned(), "PENDING".to_owned(), 0));
    }
    t
}

fn violations(calls: &[Call], windows: &[Window], t: &Tables) -> Vec<String> {
    verdict(calls, windows, t).violations
}

fn verdict(calls: &[Call], windows: &[Window], t: &Tables) -> Verdict {
    check(calls, windows, t, &BOUNDS)
}

/// One violation, starting with `prefix`.
#[track_caller]
fn only(found: Vec<String>, prefix: &str) {
    assert_eq!(found.len(), 1, "{found:#?}");
    assert!(found[0].starts_with(prefix), "{found:#?}");
}

/// k executed at 0..10 (process 0), replayed at 20..30 (process 1).
fn healthy() -> (Vec<Call>, Tables) {
    let r = receipt("k", 100, 1);
    let calls =
        vec![call(0, "k", 100, 0, 10, Answer::Executed(r.clone())), call(1, "k", 100, 20, 30, Answer::Replayed(r))];
    (calls, tables(&[("k", 100, 1)], &[]))
}

#[test]
fn a_healthy_history_passes() {
    let (calls, t) = healthy();
    let v = verdict(&calls, &[], &t);
    assert_eq!(v.violations, Vec::<String>::new());
    assert_eq!((v.keys_shared, v.keys_concurrent, v.after_commit), (1, 0, 1));
}

#[test]
fn a_key_executed_twice_is_reported() {
    let (mut calls, mut t) = healthy();
    t.ledger.push(("k".into(), 2, 100, 2));
    let found = violations(&calls, &[], &t);
    only(found, "k: executed 2 times");
    calls[1].answer = Answer::Executed(receipt("k", 100, 1));
    let found = violations(&calls, &[], &tables(&[("k", 100, 1)], &[]));
    only(found, "k: 2 calls answered Executed");
}

#[test]
fn an_ok_without_its_committed_record_is_reported() {
    let (calls, mut t) = healthy();
    t.records.clear();
    let found = violations(&calls, &[], &t);
    assert!(found.contains(&"k: ledger row (1, 100, 1) without its record".to_owned()), "{found:#?}");
    assert_eq!(found.iter().filter(|v| v.starts_with("k: Ok without its committed record")).count(), 2, "{found:#?}");
    // Nothing committed at all, yet a caller got Ok.
    let found = violations(&calls[..1], &[], &tables(&[], &["k"]));
    only(found, "k: Ok without its committed record");
}

#[test]
fn a_replay_that_differs_from_the_committed_result_is_reported() {
    let (mut calls, t) = healthy();
    calls[1].answer = Answer::Replayed(receipt("k", 100, 7));
    let found = violations(&calls, &[], &t);
    assert_eq!(found.len(), 2, "{found:#?}");
    assert!(found[0].starts_with("k: Ok differs from the committed"), "{found:#?}");
    assert!(found[1].starts_with("k: Ok differs from the first Ok"), "{found:#?}");
}

#[test]
fn an_ok_for_other_arguments_is_reported() {
    let (mut calls, t) = healthy();
    calls[1].amount = 101;
    only(violations(&calls, &[], &t), "k: Ok for the arguments of amount Some(100)");
}

#[test]
fn a_duplicate_of_a_committed_call_answered_a_failure_is_reported() {
    let (mut calls, t) = healthy();
    // Storage after the commit, with the database path whole.
    calls.push(call(2, "k", 100, 40, 50, Answer::Storage));
    only(violations(&calls, &[], &t), "k: a duplicate of a committed call answered storage");
    // The same while its process's database path was cut: allowed.
    let cut = [window(2, Path::Db, 35, 45)];
    let v = verdict(&calls, &cut, &t);
    assert_eq!((v.violations.len(), v.failures_while_cut, v.failures_after_commit), (0, 1, 1), "{v:#?}");
    // Another process's cut, or a Redis cut, explains nothing.
    only(violations(&calls, &[window(1, Path::Db, 35, 45)], &t), "k: a duplicate of a committed");
    only(violations(&calls, &[window(2, Path::Redis, 35, 45)], &t), "k: a duplicate of a committed");
    // A replay error is never allowed, cut or not.
    calls[2].answer = Answer::Replay;
    only(violations(&calls, &cut, &t), "k: a duplicate of a committed call answered replay_error");
    calls[2].answer = Answer::BodyDb;
    only(violations(&calls, &[], &t), "k: a duplicate of a committed call answered body_db");
}

#[test]
fn a_failure_no_cut_explains_is_reported() {
    // Key j never committed; its one call failed with the path whole.
    let calls = [call(0, "j", 100, 0, 10, Answer::Timeout)];
    let t = tables(&[], &["j"]);
    only(violations(&calls, &[], &t), "j: timeout with no database path cut");
    // Sent within the grace (500 ms) after a heal: allowed; past it: not.
    assert!(violations(&calls, &[window(0, Path::Db, -1_000, -400)], &t).is_empty());
    only(violations(&calls, &[window(0, Path::Db, -1_000, -600)], &t), "j: timeout with no");
    // Beside a call of the key whose own database path was cut during
    // both (a transaction the cut left open can deadlock with ours): allowed.
    let pair = [call(0, "j", 100, 0, 10, Answer::BodyDb), call(1, "j", 100, 2, 12, Answer::Storage)];
    let v = verdict(&pair, &[window(1, Path::Db, 5, 11)], &t);
    assert_eq!((v.violations.len(), v.failures_while_cut, v.failures_by_partner), (0, 1, 1), "{v:#?}");
    // The partner's cut began after our call ended: it explains nothing.
    let found = violations(&pair, &[window(1, Path::Db, 11, 12)], &t);
    only(found, "j: body_db with no database path cut, its own or a concurrent call's");
}

#[test]
fn in_progress_with_nothing_running_is_reported() {
    let (mut calls, t) = healthy();
    // Process 2 asks while process 0 runs: allowed.
    calls.push(call(2, "k", 100, 5, 6, Answer::InProgress));
    let v = verdict(&calls, &[], &t);
    assert_eq!((v.violations.len(), v.in_progress_running), (0, 1), "{v:#?}");
    // Asked after everything ended, with no cut: nothing could hold the key.
    calls[2] = call(2, "k", 100, 35, 36, Answer::InProgress);
    only(violations(&calls, &[], &t), "k: InProgress with nothing running");
    // A Redis cut of process 0 during its call: its claim may outlive it
    // until the heal (at 10 ms) + lease + Redis timeout = 1 510 ms.
    let redis_cut = [window(0, Path::Redis, 2, 10)];
    let v = verdict(&calls, &redis_cut, &t);
    assert_eq!((v.violations.len(), v.in_progress_held), (0, 1), "{v:#?}");
    calls[2] = call(2, "k", 100, 1_509, 1_600, Answer::InProgress);
    assert!(violations(&calls, &redis_cut, &t).is_empty());
    calls[2] = call(2, "k", 100, 1_511, 1_600, Answer::InProgress);
    only(violations(&calls, &redis_cut, &t), "k: InProgress with nothing running");
    // A database cut holds the key until its heal and the grace.
    let db_cut = [window(0, Path::Db, 2, 800)];
    calls[2] = call(2, "k", 100, 1_299, 1_600, Answer::InProgress);
    assert!(violations(&calls, &db_cut, &t).is_empty());
    calls[2] = call(2, "k", 100, 1_301, 1_600, Answer::InProgress);
    only(violations(&calls, &db_cut, &t), "k: InProgress with nothing running");
    // A call that started after this one ended held nothing for it.
    let lone = [call(0, "j", 100, 0, 10, Answer::InProgress), call(1, "j", 100, 11, 20, Answer::Timeout)];
    let found = violations(&lone, &[window(1, Path::Db, 11, 20)], &tables(&[], &["j"]));
    assert_eq!(found.len(), 1, "{found:#?}");
    assert!(found[0].starts_with("j: InProgress with nothing running") && found[0].contains("\"end_us\":10000"));
}

#[test]
fn key_reused_only_for_other_arguments_than_the_committed_ones() {
    let (mut calls, t) = healthy();
    calls.push(call(2, "k", 101, 40, 41, Answer::KeyReused));
    assert!(violations(&calls, &[], &t).is_empty());
    calls[2].amount = 100;
    only(violations(&calls, &[], &t), "k: KeyReused, committed amount Some(100)");
    // Nothing committed: nothing to be reused.
    let lone = [call(0, "j", 101, 0, 1, Answer::KeyReused)];
    only(violations(&lone, &[], &tables(&[], &["j"])), "j: KeyReused, committed amount None");
}

#[test]
fn tables_that_disagree_are_reported() {
    let t = || tables(&[("k", 100, 1)], &["j"]);
    let mut processing = t();
    processing.records[0].1 = 0;
    only(violations(&[], &[], &processing), "k: record left in status 0");
    let mut unpaid_record = t();
    unpaid_record.records.push(("j".into(), 1, Some(receipt("j", 100, 9))));
    let found = violations(&[], &[], &unpaid_record);
    assert_eq!(found, ["j: record without its ledger row"], "{found:#?}");
    let mut paid_twice = t();
    paid_twice.orders[0].2 = 2;
    only(violations(&[], &[], &paid_twice), "k: order Some((\"PAID\", 2)), ledger rows 1");
    let mut disagree = t();
    disagree.ledger[0].2 = 150;
    only(violations(&[], &[], &disagree), "k: record says");
    let mut paid_without_ledger = t();
    paid_without_ledger.orders[1].1 = "PAID".into();
    only(violations(&[], &[], &paid_without_ledger), "j: order Some((\"PAID\", 0)), ledger rows 0");
}
