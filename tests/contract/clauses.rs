//! The contract, the "What callers see" table of `docs/guarantees.md`, as
//! eight clauses, each written once against the entry-point vocabulary
//! ([`Answer`]) and run in every cell. Each clause uses keys of its own and
//! fresh engines, and asserts exact outcomes: the answers, the body's runs,
//! the rows left behind.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Barrier;

use crate::backends::Store;
use crate::entries::Answer;
use crate::fns::{Declined, Paid};
use crate::rig::{Engine, Place, Rig};
use crate::script::{BOUND, Ending, Runs, Script, within};
use crate::table::{Combo, Mode};

/// Identical calls in a storm.
const STORM: usize = 6;

/// A waiting duplicate is told the first call's answer as that one ends,
/// long before its own bound (`wait = "30s"`): one that waits its bound
/// out (it missed the end) fails here.
const TOLD: Duration = Duration::from_secs(20);

/// How far past its bound a duplicate may answer `InProgress` on a loaded
/// machine: generous, it only catches a wait that overruns its bound.
const SLACK: Duration = Duration::from_secs(10);

/// The clauses: number, name.
pub const CLAUSES: [(u8, &str); 8] = [
    (1, "a first call executes"),
    (2, "an identical replay"),
    (3, "a storm runs once"),
    (4, "the same key with other arguments"),
    (5, "a body error records nothing"),
    (6, "a declared error replays"),
    (7, "a duplicate of a running call waits, or answers in progress"),
    (8, "redis failing mid-call changes nothing"),
];

/// Whether clause `n` applies to `combo`, and why not.
pub fn applies(n: u8, combo: Combo) -> Result<(), &'static str> {
    match n {
        8 if !combo.gate.has_redis() => Err("no redis to fail"),
        _ => Ok(()),
    }
}

/// Runs clause `n` of `rig`'s cell; `false` when it was skipped (a server unreachable).
pub async fn run<F: Store>(n: u8, rig: Arc<Rig<F>>) -> bool {
    let Some(engine) = rig.engine().await else { return false };
    match n {
        1 => first_call(&rig, &engine).await,
        2 => identical_replay(&rig, &engine).await,
        3 => storm(&rig, &engine).await,
        4 => other_arguments(&rig, &engine).await,
        5 => body_error(&rig, &engine).await,
        6 => declared_error(&rig, &engine).await,
        7 => running_duplicate(&rig, &engine).await,
        8 => redis_fails(&rig, &engine).await,
        _ => unreachable!("eight clauses"),
    }
    true
}

fn script(runs: &Arc<Runs>, ending: Ending) -> Arc<Script> {
    Arc::new(Script::new(runs, ending))
}

/// A value answered by the execution itself: its bytes, checked against
/// what `key`'s `run`th body returns.
fn executed<F: Store>(engine: &Engine<F>, key: &str, answer: Answer, run: u64) -> String {
    let Answer::Value { bytes, replayed: false } = answer else { panic!("not an execution's value: {answer}") };
    let paid: Paid = serde_json::from_str(&bytes).expect("a value");
    assert_eq!(paid, Paid { key: engine.entry.record_key(key), amount: 7, run }, "{bytes}");
    bytes
}

/// A replay of `bytes`, marked so.
fn replayed_value(answer: Answer, bytes: &str) {
    assert_eq!(answer, Answer::Value { bytes: bytes.to_owned(), replayed: true });
}

/// What `key` left: its rows (all, finished), what the finished one
/// stores, and its ledger rows.
async fn left<F: Store>(rig: &Rig<F>, engine: &Engine<F>, key: &str) -> (i64, i64, Option<String>, i64) {
    let rows = rig.rows(engine, key).await;
    (rows.all, rows.finished, rows.stored, rig.ledger(engine, key).await)
}

/// One finished record storing `bytes` and `ledger` ledger rows. (A steps
/// call's row is its `idem_call` row.)
async fn recorded<F: Store>(rig: &Rig<F>, engine: &Engine<F>, key: &str, bytes: &str, ledger: i64) {
    assert_eq!(left(rig, engine, key).await, (1, 1, Some(bytes.to_owned()), ledger));
}

/// Nothing finished, no ledger row; no row at all but in steps mode, which
/// keeps a call that reached outside (its step recorded) for the retry.
async fn nothing_recorded<F: Store>(rig: &Rig<F>, engine: &Engine<F>, key: &str) {
    let (all, finished, stored, ledger) = left(rig, engine, key).await;
    assert_eq!((finished, stored, ledger), (0, None, 0), "nothing finished, no ledger row");
    if rig.combo.mode != Mode::Steps {
        assert_eq!(all, 0, "no record at all");
    }
}

/// Clause 1: a first call executes: its value, the body once, one record row
/// storing that value, one ledger row.
async fn first_call<F: Store>(rig: &Rig<F>, engine: &Engine<F>) {
    let (key, runs) = (rig.key("first"), Arc::default());
    let answer = engine.entry.call(&key, 7, script(&runs, Ending::Value)).await;
    let bytes = executed(engine, &key, answer, 1);
    assert_eq!(runs.body(), 1);
    recorded(rig, engine, &key, &bytes, 1).await;
}

/// Clause 2: an identical call replays the same bytes, marked replayed, the body
/// not run again: on the same instance, and on another.
async fn identical_replay<F: Store>(rig: &Rig<F>, engine: &Engine<F>) {
    let (key, runs) = (rig.key("replay"), Arc::default());
    let bytes = executed(engine, &key, engine.entry.call(&key, 7, script(&runs, Ending::Value)).await, 1);
    replayed_value(engine.entry.call(&key, 7, script(&runs, Ending::Value)).await, &bytes);
    let other = rig.engine().await.expect("the same servers");
    replayed_value(other.entry.call(&key, 7, script(&runs, Ending::Value)).await, &bytes);
    assert_eq!(runs.body(), 1, "the body ran once");
    recorded(rig, engine, &key, &bytes, 1).await;
}

/// Clause 3: identical calls released at once by a barrier run the body once:
/// one executes, every other answers its value (or `InProgress`, only where
/// no wait applies); then a retry replays it.
async fn storm<F: Store>(rig: &Rig<F>, engine: &Engine<F>) {
    let (key, runs) = (rig.key("storm"), Arc::default());
    let barrier = Arc::new(Barrier::new(STORM));
    let calls: Vec<_> = (0..STORM)
        .map(|_| {
            let script = Arc::new(Script::new(&runs, Ending::Value).arriving(&barrier));
            tokio::spawn(engine.entry.call(&key, 7, script))
        })
        .collect();
    let mut answers = Vec::new();
    for call in calls {
        let told = tokio::time::timeout(TOLD, call).await;
        answers.push(told.expect("a storm's call answers (a waiter is told when the first ends)").expect("a call"));
    }
    let firsts: Vec<&Answer> = answers.iter().filter(|a| matches!(a, Answer::Value { replayed: false, .. })).collect();
    assert_eq!(firsts.len(), 1, "one execution: {answers:?}");
    let bytes = executed(engine, &key, firsts[0].clone(), 1);
    let waits = rig.combo.options.wait();
    for answer in &answers {
        match answer {
            Answer::Value { bytes: b, .. } => assert_eq!(*b, bytes, "{answers:?}"),
            Answer::InProgress if !waits => {}
            other => panic!("{other} in a storm: {answers:?}"),
        }
    }
    assert_eq!(runs.body(), 1, "the body ran once");
    replayed_value(engine.entry.call(&key, 7, script(&runs, Ending::Value)).await, &bytes);
    recorded(rig, engine, &key, &bytes, 1).await;
}

/// Clause 4: the same key with other arguments: `KeyReused`, nothing runs,
/// nothing written.
async fn other_arguments<F: Store>(rig: &Rig<F>, engine: &Engine<F>) {
    let (key, runs) = (rig.key("reused"), Arc::default());
    let bytes = executed(engine, &key, engine.entry.call(&key, 7, script(&runs, Ending::Value)).await, 1);
    assert_eq!(engine.entry.call(&key, 8, script(&runs, Ending::Value)).await, Answer::KeyReused);
    assert_eq!(runs.body(), 1, "nothing ran");
    recorded(rig, engine, &key, &bytes, 1).await;
}

/// Clause 5: a body's own error records nothing: no record, no ledger row; the
/// retry executes (in steps mode, its recorded step not called again).
async fn body_error<F: Store>(rig: &Rig<F>, engine: &Engine<F>) {
    let (key, runs) = (rig.key("failed"), Arc::default());
    assert_eq!(engine.entry.call(&key, 7, script(&runs, Ending::Fails)).await, Answer::BodyFailed);
    nothing_recorded(rig, engine, &key).await;
    let bytes = executed(engine, &key, engine.entry.call(&key, 7, script(&runs, Ending::Value)).await, 2);
    assert_eq!(runs.body(), 2);
    recorded(rig, engine, &key, &bytes, 1).await;
    if rig.combo.mode == Mode::Steps {
        assert_eq!(runs.outside(), 1, "the step answered from its record");
    }
}

/// Clause 6: a declared error replays: recorded (`record_errors`; in steps mode
/// `Steps::permanent`), replayed byte for byte to a duplicate that would
/// now succeed, on this instance and another, the body once, its writes
/// gone. Without `record_errors` it is clause 5: nothing recorded, the
/// retry executes.
async fn declared_error<F: Store>(rig: &Rig<F>, engine: &Engine<F>) {
    let (key, runs) = (rig.key("declined"), Arc::default());
    let first = engine.entry.call(&key, 7, script(&runs, Ending::Declines)).await;
    if rig.combo.mode != Mode::Steps && !rig.combo.options.record_errors() {
        assert!(matches!(first, Answer::BodyFailed | Answer::Declined { replayed: false, .. }), "{first}");
        nothing_recorded(rig, engine, &key).await;
        let bytes = executed(engine, &key, engine.entry.call(&key, 7, script(&runs, Ending::Value)).await, 2);
        assert_eq!(runs.body(), 2);
        return recorded(rig, engine, &key, &bytes, 1).await;
    }
    let Answer::Declined { bytes, replayed: false } = first else { panic!("not a recorded decline: {first}") };
    let declined: Declined = serde_json::from_str(&bytes).expect("a decline");
    assert_eq!(declined.run, 1, "{bytes}");
    let again = Answer::Declined { bytes: bytes.clone(), replayed: true };
    assert_eq!(engine.entry.call(&key, 7, script(&runs, Ending::Value)).await, again);
    let other = rig.engine().await.expect("the same servers");
    assert_eq!(other.entry.call(&key, 7, script(&runs, Ending::Value)).await, again);
    assert_eq!(runs.body(), 1, "the body ran once");
    recorded(rig, engine, &key, &bytes, 0).await;
    if rig.combo.mode == Mode::Steps {
        assert_eq!(runs.outside(), 1);
    }
}

/// Clause 7: a duplicate of a running call (the first held in its body until the
/// clause opens it), on the same instance and on another (an engine over a
/// pool of its own, as another process has): with `wait`, each waits (as
/// the servers, its pool or its own future show) and gets the first's
/// value once the first is let go; without, each answers `InProgress` while
/// the first still runs, within its bound. Then a retry replays. A failure
/// names the instance.
async fn running_duplicate<F: Store>(rig: &Rig<F>, engine: &Engine<F>) {
    let (key, runs) = (rig.key("running"), Arc::default());
    let held = Arc::new(Script::new(&runs, Ending::Value).held());
    let first = tokio::spawn(engine.entry.call(&key, 7, Arc::clone(&held)));
    held.until_held().await;
    let other = rig.instance().await.expect("the same servers");
    let places = [(Place::Same, engine), (Place::Other, &other)];
    let bytes = if rig.combo.options.wait() {
        // One after the other, each seen waiting; then both told.
        let mut waiting = Vec::new();
        for (nth, (place, on)) in (1..).zip(places) {
            let (script, before) = (script(&runs, Ending::Value), on.asked());
            let duplicate = tokio::spawn(on.entry.call(&key, 7, Arc::clone(&script)));
            rig.until_waiting(place, on, &key, &script, before, nth).await;
            assert!(!duplicate.is_finished(), "{place}: the duplicate answered while the first ran");
            waiting.push((place, duplicate));
        }
        held.release();
        let bytes = executed(engine, &key, within("the first call", first).await.expect("a call"), 1);
        for (place, duplicate) in waiting {
            let told = tokio::time::timeout(TOLD, duplicate).await;
            let answer = told.unwrap_or_else(|_| panic!("{place}: the waiter is told when the first call ends"));
            let expected = Answer::Value { bytes: bytes.clone(), replayed: true };
            assert_eq!(answer.expect("a call"), expected, "{place}: the waiter's answer");
        }
        bytes
    } else {
        // Both at once: each answers within its own bound.
        let duplicates: Vec<_> = places
            .map(|(place, on)| {
                let call = on.entry.call(&key, 7, script(&runs, Ending::Value));
                (place, Instant::now(), tokio::spawn(call))
            })
            .into_iter()
            .collect();
        for (place, started, duplicate) in duplicates {
            let answer = within(&format!("{place}: the duplicate answers"), duplicate).await.expect("a call");
            assert_eq!(answer, Answer::InProgress, "{place}: the duplicate's answer");
            let (took, bound) = (started.elapsed(), rig.in_progress_bound(place) + SLACK);
            assert!(took < bound, "{place}: InProgress after {took:?}, past {bound:?}");
        }
        assert!(!first.is_finished(), "the first call still runs");
        held.release();
        executed(engine, &key, within("the first call", first).await.expect("a call"), 1)
    };
    other.close().await;
    replayed_value(engine.entry.call(&key, 7, script(&runs, Ending::Value)).await, &bytes);
    assert_eq!(runs.body(), 1, "the body ran once");
    recorded(rig, engine, &key, &bytes, 1).await;
}

/// Clause 8: Redis failing while the body runs changes nothing: the call commits
/// once and answers its value; the duplicate after it replays it (from
/// the database, or the local cache).
async fn redis_fails<F: Store>(rig: &Rig<F>, engine: &Engine<F>) {
    let (key, runs) = (rig.key("cut"), Arc::default());
    let held = Arc::new(Script::new(&runs, Ending::Value).held());
    let first = tokio::spawn(engine.entry.call(&key, 7, Arc::clone(&held)));
    held.until_held().await;
    engine.path.as_ref().expect("a path to redis").cut();
    held.release();
    let bytes = executed(engine, &key, within("the first call", first).await.expect("a call"), 1);
    let after = tokio::time::timeout(BOUND, engine.entry.call(&key, 7, script(&runs, Ending::Value)));
    replayed_value(after.await.expect("the duplicate answers"), &bytes);
    assert_eq!(runs.body(), 1, "the body ran once");
    recorded(rig, engine, &key, &bytes, 1).await;
}
