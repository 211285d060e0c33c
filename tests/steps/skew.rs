//! One clock decides, the database's: child processes under libfaketime
//! (`faketime -f +10m` / `-10m`, Debian's package `faketime`) against a
//! process on the true clock, all on one key, with a 5-minute ttl and calls
//! about a second apart in real time. Expiry, leases and the expiry carried
//! by a cached result are stamped and judged by the database's clock, so a
//! skewed instance neither runs a finished call again nor takes over a live
//! one. On MariaDB and PostgreSQL, with and without Redis, plain and
//! two-phase (`steps`).
//!
//! The processes are the harness of [`crate::crash`]: this binary again,
//! told by its environment what to call.

use std::time::Duration;

use idempotency::{Idem, Steps, idempotent};
use sqlx::Transaction;

use crate::crash::{Bench, ChildConfig, ChildError, DbKind, Fns, Mode, Proc, Receipt, in_parallel, stop_at};
use crate::provider::{ProviderCharge, ProviderClient};
use crate::support::{TestDb, unique};

const STEPS_BIZ: &str = "skew_steps";
const PLAIN_BIZ: &str = "skew_plain";

/// The two-phase mode with a lease of 30 s: far longer than any of these
/// calls takes in real time, far shorter than the skew.
#[idempotent(key = "<key>", ttl = "5m", biz = "skew_steps", lease = "30s", steps)]
pub(crate) async fn pay_steps<DB: TestDb>(
    idem: &Idem<DB>,
    steps: &mut Steps<DB>,
    #[idem(skip)] provider: &ProviderClient,
    key: &str,
    amount: i64,
) -> Result<Receipt, ChildError> {
    let charge: ProviderCharge = steps
        .step("charge", |step_key| async move {
            let charge = provider.charge(step_key.as_str(), key, amount).await.map_err(ChildError::Provider)?;
            stop_at("after_provider").await;
            Ok::<_, ChildError>(charge)
        })
        .await?;
    let tx = steps.transaction().await?;
    DB::insert_payment(tx, key, &charge.id, amount).await?;
    Ok(Receipt { key: key.to_owned(), charge_id: charge.id, amount })
}

/// The plain mode, ttl 5 min.
#[idempotent(key = "<key>", ttl = "5m", biz = "skew_plain", lease = "30s")]
pub(crate) async fn pay_plain<DB: TestDb>(
    idem: &Idem<DB>,
    tx: &mut Transaction<'_, DB>,
    #[idem(skip)] provider: &ProviderClient,
    key: &str,
    amount: i64,
) -> Result<Receipt, ChildError> {
    let charge = provider.charge(&format!("plain-{key}"), key, amount).await.map_err(ChildError::Provider)?;
    DB::insert_payment(tx, key, &charge.id, amount).await?;
    Ok(Receipt { key: key.to_owned(), charge_id: charge.id, amount })
}

/// Whether `faketime` runs here; without it the test skips (or fails under
/// `IDEM_REQUIRE_SERVICES=1`: `.ci/run` installs it).
fn faketime_installed() -> bool {
    let runs = std::process::Command::new("faketime").args(["-f", "+0", "true"]).status().is_ok_and(|s| s.success());
    if !runs {
        assert!(
            std::env::var("IDEM_REQUIRE_SERVICES").map_or(true, |v| v != "1"),
            "faketime not installed (Debian package `faketime`) and IDEM_REQUIRE_SERVICES=1"
        );
        println!("skipped: faketime not installed");
    }
    runs
}

/// A child calling the fns above with its clock `offset` from the true one
/// (`+0`: the true clock, no faketime).
fn config(bench: &Bench, db: DbKind, redis: bool, mode: Mode, key: &str, offset: &str) -> ChildConfig {
    let faketime = (offset != "+0").then(|| offset.to_owned());
    ChildConfig { fns: Fns::Skew, faketime, ..bench.config(db, redis, mode, key) }
}

fn biz(mode: Mode) -> &'static str {
    match mode {
        Mode::Steps => STEPS_BIZ,
        Mode::Plain => PLAIN_BIZ,
    }
}

/// A call on `first`'s clock, then, a second later, the same call on
/// `second`'s: the second replays the first's result, and the body (and
/// the provider) ran once. One of the clocks is the true one.
fn finished_call_replays(bench: &Bench, db: DbKind, redis: bool, mode: Mode, first: &str, second: &str) {
    let key = unique("skew-done");
    let first_answer = Proc::spawn(&config(bench, db, redis, mode, &key, first)).answered();
    std::thread::sleep(Duration::from_secs(1));
    let second_answer = Proc::spawn(&config(bench, db, redis, mode, &key, second)).answered();

    let scene = format!("{mode:?} on {db:?}, redis {redis}: {first} then {second}");
    assert!(first_answer.answer.starts_with("ok {"), "{scene}: {first_answer:?}");
    assert_eq!(second_answer.answer, first_answer.answer, "{scene}: the second call must replay the first");
    let books = bench.books_of(db, mode, biz(mode), &key);
    let record = match mode {
        Mode::Steps => Some((1, 1)),
        Mode::Plain => Some((1, 0)),
    };
    assert_eq!(books.payments, 1, "{scene}: the body ran twice");
    assert_eq!(books.record, record, "{scene}");
    assert_eq!(bench.provider.requests(&key), 1, "{scene}: the provider was called again");
}

/// A two-phase call held after the provider answered (its lease of 30 s
/// running in real time) on `holder`'s clock; the same call on `other`'s:
/// `InProgress`, never a takeover, and the provider asked once. Then the
/// holder finishes and its result stands.
fn live_call_is_not_taken_over(bench: &Bench, db: DbKind, redis: bool, holder: &str, other: &str) {
    let key = unique("skew-live");
    let mut held = Proc::spawn(&ChildConfig {
        stop: Some("after_provider".into()),
        ..config(bench, db, redis, Mode::Steps, &key, holder)
    });
    held.expect("IDEM-STOP after_provider");
    let duplicate = Proc::spawn(&config(bench, db, redis, Mode::Steps, &key, other)).answered();

    let scene = format!("steps on {db:?}, redis {redis}: held on {holder}, called on {other}");
    assert_eq!(duplicate.answer, "in_progress", "{scene}: a live call was taken over");
    assert_eq!(bench.provider.requests(&key), 1, "{scene}: the provider was called a second time");
    held.go();
    let finished = held.answered();
    assert!(finished.answer.starts_with("ok {"), "{scene}: {finished:?}");
    let books = bench.books_of(db, Mode::Steps, STEPS_BIZ, &key);
    assert_eq!((books.payments, books.record), (1, Some((1, 1))), "{scene}: {books:?}");
    assert_eq!(bench.provider.requests(&key), 1, "{scene}");
}

/// Every case, on each database that answers, with and without Redis.
#[test]
fn skewed_clocks() {
    if crate::crash::child_process() || !faketime_installed() {
        return;
    }
    let bench = Bench::new("skew::skewed_clocks");
    let bench = &bench;
    let mut jobs: Vec<Box<dyn FnOnce() + Send + '_>> = Vec::new();
    for (db, redis) in bench.setups() {
        for mode in [Mode::Plain, Mode::Steps] {
            // Ahead: it would judge the record (and the cached copy) expired.
            jobs.push(Box::new(move || finished_call_replays(bench, db, redis, mode, "+0", "+10m")));
            // Behind: its record would be expired for everyone else.
            jobs.push(Box::new(move || finished_call_replays(bench, db, redis, mode, "-10m", "+0")));
        }
        // Behind, holding: the true clock would find its lease over.
        jobs.push(Box::new(move || live_call_is_not_taken_over(bench, db, redis, "-10m", "+0")));
        // On the true clock, holding: an instance ahead would find its lease over.
        jobs.push(Box::new(move || live_call_is_not_taken_over(bench, db, redis, "+0", "+10m")));
    }
    println!("skewed clocks: {} cases on {:?}", jobs.len(), bench.setups());
    in_parallel(4, jobs);
}
