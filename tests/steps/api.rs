//! The two-phase mode in one process, on SQLite, MariaDB and PostgreSQL,
//! with and without Redis: an outside service in memory that counts its
//! calls and can decline or hold one, and bodies held at gates so every
//! overlap is certain (no sleeps raced against work).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::{Error, Idem, Outcome, StepKey, Steps, idempotent};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::support::{CallState, Connected, TestDb, engine, unique};

const BIZ: &str = "steps_api";
const BIZ_SHORT: &str = "steps_api_short";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    key: String,
    charge_id: String,
    amount: i64,
}

/// What the service answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    id: String,
    amount: i64,
    declined: bool,
}

#[derive(Debug)]
pub enum TestError {
    Idem(Error),
    Db(#[allow(dead_code)] sqlx::Error),
    /// The body's own failure, not permanent.
    Transient,
}

impl From<Error> for TestError {
    fn from(e: Error) -> Self {
        TestError::Idem(e)
    }
}

impl From<sqlx::Error> for TestError {
    fn from(e: sqlx::Error) -> Self {
        TestError::Db(e)
    }
}

/// A point a body or the service stops at until the test lets it go.
#[derive(Default)]
pub struct Hold {
    reached: Notify,
    release: Notify,
}

impl Hold {
    async fn stop_here(&self) {
        self.reached.notify_one();
        self.release.notified().await;
    }
}

/// An outside service in memory with idempotency keys: one charge per key
/// (a repeated key answers the charge made first), every request counted.
#[derive(Default)]
pub struct FakeProvider {
    charges: Mutex<HashMap<String, Charge>>,
    requests: AtomicUsize,
    decline: AtomicBool,
    /// The next request stops after the charge is made, before answering.
    hold: Mutex<Option<Arc<Hold>>>,
}

impl FakeProvider {
    async fn charge(&self, key: StepKey, amount: i64) -> Result<Charge, TestError> {
        self.requests.fetch_add(1, Ordering::SeqCst);
        let charge = {
            let mut charges = self.charges.lock().unwrap();
            let n = charges.len();
            let declined = self.decline.load(Ordering::SeqCst);
            charges.entry(key.into()).or_insert_with(|| Charge { id: format!("ch_{n}"), amount, declined }).clone()
        };
        let hold = self.hold.lock().unwrap().take();
        if let Some(hold) = hold {
            hold.stop_here().await;
        }
        Ok(charge)
    }

    fn charges(&self) -> usize {
        self.charges.lock().unwrap().len()
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

/// What a body does besides its step, as the test says.
#[derive(Default)]
pub struct Script {
    fail_before_step: AtomicBool,
    fail_after_step: AtomicBool,
    hold_before_final: Mutex<Option<Arc<Hold>>>,
}

#[idempotent(key = "<key>", ttl = "1h", biz = "steps_api", biz_no = "<order>", steps)]
async fn charge<DB: TestDb>(
    idem: &Idem<DB>,
    steps: &mut Steps<DB>,
    #[idem(skip)] provider: &FakeProvider,
    #[idem(skip)] script: &Script,
    key: &str,
    order: u64,
    amount: i64,
) -> Result<Receipt, TestError> {
    body(steps, provider, script, key, amount).await
}

/// The same with a short lease, for takeovers.
#[idempotent(key = "<key>", ttl = "1h", biz = "steps_api_short", biz_no = "<order>", lease = "400ms", steps)]
async fn charge_short<DB: TestDb>(
    idem: &Idem<DB>,
    steps: &mut Steps<DB>,
    #[idem(skip)] provider: &FakeProvider,
    #[idem(skip)] script: &Script,
    key: &str,
    order: u64,
    amount: i64,
) -> Result<Receipt, TestError> {
    body(steps, provider, script, key, amount).await
}

async fn body<DB: TestDb>(
    steps: &mut Steps<DB>,
    provider: &FakeProvider,
    script: &Script,
    key: &str,
    amount: i64,
) -> Result<Receipt, TestError> {
    if script.fail_before_step.swap(false, Ordering::SeqCst) {
        return Err(TestError::Transient);
    }
    let charge: Charge = steps.step("charge", |step_key| provider.charge(step_key, amount)).await?;
    if charge.declined {
        return Err(steps.permanent(&charge).into());
    }
    if script.fail_after_step.swap(false, Ordering::SeqCst) {
        return Err(TestError::Transient);
    }
    let hold = script.hold_before_final.lock().unwrap().take();
    if let Some(hold) = hold {
        hold.stop_here().await;
    }
    let tx = steps.transaction().await?;
    DB::insert_payment(tx, key, &charge.id, amount).await?;
    Ok(Receipt { key: key.to_owned(), charge_id: charge.id, amount })
}

/// How a body misuses its steps.
#[derive(Clone, Copy)]
pub enum Misuse {
    BadName,
    SameNameTwice,
    StepAfterTransaction,
}

#[idempotent(key = "<key>", ttl = "1h", biz = "steps_api_misuse", steps)]
async fn misuse<DB: TestDb>(
    idem: &Idem<DB>,
    steps: &mut Steps<DB>,
    #[idem(skip)] provider: &FakeProvider,
    #[idem(skip)] how: Misuse,
    key: &str,
) -> Result<u64, TestError> {
    match how {
        Misuse::BadName => {
            steps.step("Charge!", |k| provider.charge(k, 1)).await?;
        }
        Misuse::SameNameTwice => {
            steps.step("charge", |k| provider.charge(k, 1)).await?;
            steps.step("charge", |k| provider.charge(k, 1)).await?;
        }
        Misuse::StepAfterTransaction => {
            steps.transaction().await?;
            steps.step("charge", |k| provider.charge(k, 1)).await?;
        }
    }
    Ok(1)
}

/// Two engines on one database (and Redis, if any): `other` stands for
/// another instance, so a duplicate meets the first call in the database,
/// not in this engine's memory.
struct Fixture<DB: TestDb> {
    idem: Idem<DB>,
    other: Idem<DB>,
    provider: Arc<FakeProvider>,
    script: Arc<Script>,
    _db: Connected<DB>,
}

impl<DB: TestDb> Fixture<DB> {
    async fn new(redis: bool) -> Option<Self> {
        let db = DB::connect().await?;
        let idem = engine(db.pool.clone(), redis).await?;
        let other = engine(db.pool.clone(), redis).await?;
        Some(Fixture { idem, other, provider: Arc::default(), script: Arc::default(), _db: db })
    }

    async fn call(&self, biz: &str, key: &str) -> Option<CallState> {
        DB::call(self.idem.pool(), biz, key).await
    }

    /// `charge_short` on another task, with its own handles.
    fn spawn_short(&self, key: &str) -> tokio::task::JoinHandle<(Result<Receipt, TestError>, Option<Outcome>)> {
        let (idem, provider, script, key) =
            (self.idem.clone(), self.provider.clone(), self.script.clone(), key.to_owned());
        tokio::spawn(async move { idempotency::observe(charge_short(&idem, &provider, &script, &key, 7, 1999)).await })
    }

    /// `charge_short` on the other engine, again until it is no longer
    /// `InProgress` (the first call's lease running out).
    async fn retry_short(&self, key: &str) -> (Result<Receipt, TestError>, Option<Outcome>) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let answer =
                idempotency::observe(charge_short(&self.other, &self.provider, &self.script, key, 7, 1999)).await;
            if !matches!(answer.0, Err(TestError::Idem(Error::InProgress { .. }))) {
                return answer;
            }
            assert!(tokio::time::Instant::now() < deadline, "still in progress after 20 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap()
}

/// One outside call per key: the first call runs the step and commits the
/// payment with the record; a second call replays the stored result without
/// calling the service; the steps are gone once the call finished.
pub async fn a_step_runs_once_and_replays<DB: TestDb>(redis: bool) {
    let Some(f) = Fixture::<DB>::new(redis).await else { return };
    let key = unique("once");
    let (first, outcome) = idempotency::observe(charge(&f.idem, &f.provider, &f.script, &key, 7, 1999)).await;
    let first = first.unwrap();
    assert_eq!(outcome, Some(Outcome::Executed));
    assert_eq!((first.key.as_str(), first.charge_id.as_str(), first.amount), (key.as_str(), "ch_0", 1999));
    for engine in [&f.idem, &f.other] {
        let (again, outcome) = idempotency::observe(charge(engine, &f.provider, &f.script, &key, 7, 1999)).await;
        assert_eq!(json(&again.unwrap()), json(&first));
        assert_eq!(outcome, Some(Outcome::Replayed));
    }
    assert_eq!((f.provider.charges(), f.provider.requests()), (1, 1));
    assert_eq!(DB::payments(f.idem.pool(), &key).await, 1);
    let call = f.call(BIZ, &key).await.unwrap();
    assert_eq!((call.status, call.fence, call.biz_no.as_deref()), (1, 1, Some("7")));
    assert_eq!(call.response.as_deref(), Some(json(&first).as_str()));
    assert_eq!(DB::steps(f.idem.pool(), BIZ, &key).await, 0, "a finished call keeps no steps");
    let reused = charge(&f.idem, &f.provider, &f.script, &key, 7, 2000).await.unwrap_err();
    assert!(matches!(reused, TestError::Idem(Error::KeyReused { .. })), "{reused:?}");
}

/// A body failing after its step (not permanently) rolls back its
/// transaction, keeps the recorded step and hands the key on at once: the
/// call is listed as stuck, and the next call takes it over (fence 2) and
/// resumes without calling the service again.
pub async fn a_failure_keeps_the_steps_for_the_retry<DB: TestDb>(redis: bool) {
    let Some(f) = Fixture::<DB>::new(redis).await else { return };
    let key = unique("transient");
    f.script.fail_after_step.store(true, Ordering::SeqCst);
    let failed = charge(&f.idem, &f.provider, &f.script, &key, 7, 1999).await.unwrap_err();
    assert!(matches!(failed, TestError::Transient), "{failed:?}");
    let call = f.call(BIZ, &key).await.unwrap();
    assert_eq!((call.status, call.fence), (0, 1));
    assert_eq!(DB::steps(f.idem.pool(), BIZ, &key).await, 1);
    assert_eq!(DB::payments(f.idem.pool(), &key).await, 0);
    let stuck = f.idem.stuck_calls(BIZ, 10_000).await.unwrap();
    let ours = stuck.iter().find(|s| s.key == key).expect("listed as stuck");
    assert_eq!((ours.biz_no.as_deref(), ours.fence), (Some("7"), 1));

    // The completer's job: the same call again.
    let (done, outcome) = idempotency::observe(charge(&f.other, &f.provider, &f.script, &key, 7, 1999)).await;
    assert_eq!(done.unwrap().charge_id, "ch_0");
    assert_eq!(outcome, Some(Outcome::Executed));
    assert_eq!((f.provider.charges(), f.provider.requests()), (1, 1), "the step replayed from its record");
    let call = f.call(BIZ, &key).await.unwrap();
    assert_eq!((call.status, call.fence), (1, 2));
    assert_eq!(DB::payments(f.idem.pool(), &key).await, 1);
    assert!(!f.idem.stuck_calls(BIZ, 10_000).await.unwrap().iter().any(|s| s.key == key));
}

/// A body failing before any step reached outside leaves no call behind:
/// nothing to recover, and the next call starts afresh.
pub async fn a_failure_before_any_step_leaves_nothing<DB: TestDb>(redis: bool) {
    let Some(f) = Fixture::<DB>::new(redis).await else { return };
    let key = unique("early");
    f.script.fail_before_step.store(true, Ordering::SeqCst);
    let failed = charge(&f.idem, &f.provider, &f.script, &key, 7, 1999).await.unwrap_err();
    assert!(matches!(failed, TestError::Transient), "{failed:?}");
    assert_eq!(f.call(BIZ, &key).await, None);
    assert_eq!(f.provider.requests(), 0);
    charge(&f.idem, &f.provider, &f.script, &key, 7, 1999).await.unwrap();
    assert_eq!(f.call(BIZ, &key).await.map(|c| (c.status, c.fence)), Some((1, 1)));
}

/// A failure declared permanent is recorded (status 2) with what the body
/// wrote, and every retry gets it again, byte for byte, without calling the
/// service.
pub async fn a_permanent_failure_is_replayed<DB: TestDb>(redis: bool) {
    let Some(f) = Fixture::<DB>::new(redis).await else { return };
    let key = unique("declined");
    f.provider.decline.store(true, Ordering::SeqCst);
    let mut failures = Vec::new();
    for (engine, expected) in
        [(&f.idem, Outcome::Executed), (&f.idem, Outcome::Replayed), (&f.other, Outcome::Replayed)]
    {
        let (answer, outcome) = idempotency::observe(charge(engine, &f.provider, &f.script, &key, 7, 1999)).await;
        let Err(TestError::Idem(Error::Permanent { failure, .. })) = answer else { panic!("{answer:?}") };
        assert_eq!(outcome, Some(expected));
        let charge: Charge = failure.decode().unwrap();
        assert!(charge.declined);
        failures.push(failure.as_json().to_owned());
    }
    assert!(failures.iter().all(|f| *f == failures[0]), "{failures:?}");
    assert_eq!(f.provider.requests(), 1);
    let call = f.call(BIZ, &key).await.unwrap();
    assert_eq!((call.status, call.response.as_deref()), (2, Some(failures[0].as_str())));
    assert_eq!(DB::payments(f.idem.pool(), &key).await, 0);
}

/// While the first call runs (held inside its step), a duplicate from another instance
/// answers `InProgress` (at a Redis claim at once, else past `lock_wait`: `waits.rs`), and
/// one with other arguments `KeyReused` (`InProgress` at a Redis claim); once it finishes,
/// the duplicate replays it.
pub async fn a_live_lease_answers_in_progress<DB: TestDb>(redis: bool) {
    let Some(f) = Fixture::<DB>::new(redis).await else { return };
    let key = unique("live");
    let hold = Arc::new(Hold::default());
    *f.provider.hold.lock().unwrap() = Some(hold.clone());
    let (idem, provider, script, k) = (f.idem.clone(), f.provider.clone(), f.script.clone(), key.clone());
    let first = tokio::spawn(async move { charge(&idem, &provider, &script, &k, 7, 1999).await });
    hold.reached.notified().await;
    let busy = charge(&f.other, &f.provider, &f.script, &key, 7, 1999).await.unwrap_err();
    assert!(matches!(busy, TestError::Idem(Error::InProgress { .. })), "{busy:?}");
    // Redis's claim turns any duplicate away as it runs, as in the plain
    // mode; the database compares the arguments before anything else.
    let reused = charge(&f.other, &f.provider, &f.script, &key, 7, 5).await.unwrap_err();
    if redis {
        assert!(matches!(reused, TestError::Idem(Error::InProgress { .. })), "{reused:?}");
    } else {
        assert!(matches!(reused, TestError::Idem(Error::KeyReused { .. })), "{reused:?}");
    }
    hold.release.notify_one();
    let first = first.await.unwrap().unwrap();
    let again = charge(&f.other, &f.provider, &f.script, &key, 7, 1999).await.unwrap();
    assert_eq!(json(&again), json(&first));
    assert_eq!(f.provider.requests(), 1);
}

/// A call held past its lease after its step was recorded is taken over by
/// another instance (fence 2), which replays the step and commits. Let go,
/// the first call is fenced off: its final transaction commits nothing, and
/// it answers with the new owner's result.
pub async fn a_zombie_cannot_commit<DB: TestDb>(redis: bool) {
    let Some(f) = Fixture::<DB>::new(redis).await else { return };
    let key = unique("zombie");
    let hold = Arc::new(Hold::default());
    *f.script.hold_before_final.lock().unwrap() = Some(hold.clone());
    let first = f.spawn_short(&key);
    hold.reached.notified().await;

    let (taken, outcome) = f.retry_short(&key).await;
    let taken = taken.unwrap();
    assert_eq!(outcome, Some(Outcome::Executed));
    assert_eq!(f.provider.requests(), 1, "the recorded step is replayed, not called");
    assert_eq!(f.call(BIZ_SHORT, &key).await.map(|c| (c.status, c.fence)), Some((1, 2)));

    hold.release.notify_one();
    let (zombie, outcome) = first.await.unwrap();
    assert_eq!(json(&zombie.unwrap()), json(&taken), "the zombie answers with the new owner's result");
    assert_eq!(outcome, Some(Outcome::Replayed));
    assert_eq!(DB::payments(f.idem.pool(), &key).await, 1, "the zombie's payment was rolled back");
    assert_eq!(f.call(BIZ_SHORT, &key).await.map(|c| (c.status, c.fence)), Some((1, 2)));
}

/// Regression: a finished call past its expiry answered as if it were
/// live. Every expiry and lease here is forced by SQL, never waited for.
/// The first call, held before its final transaction, loses its lease;
/// another instance takes the call over and finishes; that result then
/// expires. Let go, the first call is fenced off and answers `InProgress`
/// (the result it would replay has expired), not the expired result. With
/// Redis, a duplicate that meets a claim (a new owner about to replace the
/// expired call) reads the expired row and answers `InProgress` too, with
/// these arguments or others (not the old result, nor `KeyReused`). The
/// next call then runs afresh.
pub async fn an_expired_call_never_answers<DB: TestDb>(redis: bool) {
    let Some(f) = Fixture::<DB>::new(redis).await else { return };
    let pool = f.idem.pool();
    let key = unique("expiring");
    let row = format!("biz_type = '{BIZ}' AND idem_key = '{key}'");
    let claim = if redis {
        let namespace = f.idem.redis_namespace().await.unwrap().expect("migrated");
        Some(idempotency::redis_layout::locate(namespace.as_str(), BIZ, &key).expect("a valid namespace"))
    } else {
        None
    };
    let redis_client = || redis::Client::open(crate::support::redis_url()).expect("redis url");
    let hold = Arc::new(Hold::default());
    *f.script.hold_before_final.lock().unwrap() = Some(hold.clone());
    let first = {
        let (idem, provider, script, k) = (f.idem.clone(), f.provider.clone(), f.script.clone(), key.clone());
        tokio::spawn(async move { idempotency::observe(charge(&idem, &provider, &script, &k, 7, 1999)).await })
    };
    hold.reached.notified().await;

    // Its lease ends (and its claim), and another instance takes over.
    DB::force(pool, format!("UPDATE idem_call SET lease_until = 0 WHERE {row}")).await;
    if let Some(at) = &claim {
        idempotency_testkit::redis_del(&redis_client(), &at.claim).await;
    }
    let (taken, outcome) = idempotency::observe(charge(&f.other, &f.provider, &f.script, &key, 7, 1999)).await;
    taken.unwrap();
    assert_eq!(outcome, Some(Outcome::Executed));
    assert_eq!(f.call(BIZ, &key).await.map(|c| (c.status, c.fence)), Some((1, 2)));

    // Its result expires; the first call, let go, is fenced off.
    DB::force(pool, format!("UPDATE idem_call SET expires_at = 0 WHERE {row}")).await;
    hold.release.notify_one();
    let (zombie, outcome) = first.await.unwrap();
    assert!(matches!(zombie, Err(TestError::Idem(Error::InProgress { .. }))), "{zombie:?}");
    assert_eq!(outcome, Some(Outcome::InProgress));

    if let Some(at) = &claim {
        // A new owner's claim, before it replaced the expired row; the
        // result Redis kept is gone (its hot window ended).
        let client = redis_client();
        idempotency_testkit::redis_forget(&client, at).await;
        idempotency_testkit::redis_set(&client, &at.claim, "p:new-owner", 600_000).await;
        for amount in [1999, 5] {
            let duplicate = charge(&f.other, &f.provider, &f.script, &key, 7, amount).await;
            assert!(matches!(duplicate, Err(TestError::Idem(Error::InProgress { .. }))), "{amount}: {duplicate:?}");
        }
        idempotency_testkit::redis_del(&client, &at.claim).await;
    }
    let (again, outcome) = idempotency::observe(charge(&f.idem, &f.provider, &f.script, &key, 7, 5)).await;
    assert_eq!((again.unwrap().amount, outcome), (5, Some(Outcome::Executed)), "the expired call counts as absent");
    assert_eq!(DB::payments(pool, &key).await, 2, "the taken-over call's payment, and the new call's");
}

/// A call held after the service answered, before its step was recorded,
/// is taken over: the new owner calls the service again with the same step
/// key (one charge, two requests) and commits. Let go, the first call's step
/// record is fenced off and it answers with the new owner's result.
pub async fn a_fenced_step_is_not_recorded<DB: TestDb>(redis: bool) {
    let Some(f) = Fixture::<DB>::new(redis).await else { return };
    let key = unique("fenced-step");
    let hold = Arc::new(Hold::default());
    *f.provider.hold.lock().unwrap() = Some(hold.clone());
    let first = f.spawn_short(&key);
    hold.reached.notified().await;

    let (taken, _) = f.retry_short(&key).await;
    let taken = taken.unwrap();
    assert_eq!((f.provider.charges(), f.provider.requests()), (1, 2));

    hold.release.notify_one();
    let (zombie, outcome) = first.await.unwrap();
    assert_eq!(json(&zombie.unwrap()), json(&taken));
    assert_eq!(outcome, Some(Outcome::Replayed));
    assert_eq!(DB::payments(f.idem.pool(), &key).await, 1);
    assert_eq!(DB::steps(f.idem.pool(), BIZ_SHORT, &key).await, 0);
}

/// Misused steps are refused before anything is called: a name outside the
/// rule, a name used twice, a step after the final transaction opened.
pub async fn misused_steps_are_refused<DB: TestDb>(redis: bool) {
    let Some(f) = Fixture::<DB>::new(redis).await else { return };
    for (how, calls, reason) in [
        (Misuse::BadName, 0, "[a-z0-9_]{1,32}"),
        (Misuse::SameNameTwice, 1, "used once per call"),
        (Misuse::StepAfterTransaction, 0, "final transaction is open"),
    ] {
        let provider = FakeProvider::default();
        let key = unique("misuse");
        let refused = misuse(&f.idem, &provider, how, &key).await.unwrap_err();
        let TestError::Idem(Error::InvalidStep { reason: said, .. }) = refused else { panic!("{refused:?}") };
        assert!(said.contains(reason), "{said}");
        assert_eq!(provider.requests(), calls);
    }
}

/// Declares one `#[tokio::test]` per backend (and Redis) for each test.
macro_rules! on_every_backend {
    ($($test:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() { super::$test::<sqlx::Sqlite>(false).await })*
        }
        mod mysql {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() { super::$test::<sqlx::MySql>(false).await })*
        }
        mod mysql_redis {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() { super::$test::<sqlx::MySql>(true).await })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() { super::$test::<sqlx::Postgres>(false).await })*
        }
        mod postgres_redis {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() { super::$test::<sqlx::Postgres>(true).await })*
        }
    };
}

on_every_backend!(
    a_step_runs_once_and_replays,
    a_failure_keeps_the_steps_for_the_retry,
    a_failure_before_any_step_leaves_nothing,
    a_permanent_failure_is_replayed,
    a_live_lease_answers_in_progress,
    a_zombie_cannot_commit,
    a_fenced_step_is_not_recorded,
    an_expired_call_never_answers,
    misused_steps_are_refused,
);

/// `migrate` creates the call tables once and again without harm, and the
/// recovery calls refuse a bad `biz` like every other admin call.
#[tokio::test]
async fn migrate_twice_and_recovery_checks_biz() {
    let Some(f) = Fixture::<sqlx::Sqlite>::new(false).await else { return };
    f.idem.migrate().await.unwrap();
    f.idem.migrate().await.unwrap();
    assert!(matches!(f.idem.stuck_calls("Bad-Biz", 10).await, Err(Error::InvalidBiz)));
    assert_eq!(f.idem.stuck_calls(BIZ, 10).await.unwrap(), Vec::new());
    assert_eq!(f.idem.purge_expired_calls(10).await.unwrap(), 0);
}

/// A finished call past its ttl counts as absent (the next call runs
/// afresh, under a new call id, and its old steps can never answer) and is
/// purged; a call in `processing` never expires: it waits to be resumed.
#[tokio::test]
async fn expired_calls_run_afresh_and_processing_ones_are_kept() {
    let Some(f) = Fixture::<sqlx::Sqlite>::new(false).await else { return };
    let pool = f.idem.pool();
    let (done, stuck) = (unique("expired"), unique("stuck"));
    charge(&f.idem, &f.provider, &f.script, &done, 7, 1999).await.unwrap();
    f.script.fail_after_step.store(true, Ordering::SeqCst);
    charge(&f.idem, &f.provider, &f.script, &stuck, 8, 1999).await.unwrap_err();
    sqlx::query("UPDATE idem_call SET expires_at = 0").execute(pool).await.unwrap();

    assert_eq!(f.idem.purge_expired_calls(10).await.unwrap(), 1);
    assert_eq!(f.call(BIZ, &done).await, None);
    assert_eq!(f.call(BIZ, &stuck).await.map(|c| (c.status, c.fence)), Some((0, 1)));

    sqlx::query("UPDATE idem_call SET expires_at = 0").execute(pool).await.unwrap();
    let again = charge(&f.idem, &f.provider, &f.script, &done, 7, 1999).await.unwrap();
    assert_eq!(f.provider.requests(), 3, "the expired key ran afresh");
    assert_eq!(again.charge_id, "ch_0", "and the provider replayed its charge to the same step key");
    assert_eq!(
        <sqlx::Sqlite as TestDb>::payments(pool, &done).await,
        2,
        "a new call after the ttl, as in the plain mode"
    );
    // The processing one resumes from its step, ttl or not.
    charge(&f.idem, &f.provider, &f.script, &stuck, 8, 1999).await.unwrap();
    assert_eq!(f.provider.requests(), 3);
    assert_eq!(f.call(BIZ, &stuck).await.map(|c| (c.status, c.fence)), Some((1, 2)));
}
