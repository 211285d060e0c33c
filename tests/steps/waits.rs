//! Regression: a two-phase call's duplicate on another instance, with no
//! Redis claim to keep it out, answered `InProgress` at once, whatever its
//! `wait`. It now waits within its bound (`wait`, or `lock_wait` if
//! longer), asking phase one again at doubling intervals (the running
//! call's row is committed: there is no lock to wait on), as the count of
//! what its own pool was asked shows, and gets the running call's answer:
//! its value, its permanent failure, or the call itself once the first
//! one's lease ended (forced by SQL). Without a wait it answers
//! `InProgress` once `lock_wait` passed, having asked again meanwhile. On
//! SQLite, MariaDB and PostgreSQL; bodies held at gates, so every overlap
//! is certain.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use idempotency::{Error, Idem, Outcome, StepKey, Steps, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::Pool;
use sqlx::pool::PoolOptions;
use tokio::sync::{Semaphore, watch};

use crate::support::{Connected, TestDb, engine, unique};

const BIZ: &str = "steps_waits";

/// The other instance's `lock_wait`: short, so the wait without `wait` ends soon.
const LOCK_WAIT: Duration = Duration::from_secs(1);

/// Only against a hang.
const BOUND: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Paid {
    key: String,
    charge: String,
    run: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Declined {
    charge: String,
}

#[derive(Debug)]
pub enum WaitError {
    Idem(Error),
    Db(#[allow(dead_code)] sqlx::Error),
}

impl From<Error> for WaitError {
    fn from(e: Error) -> Self {
        WaitError::Idem(e)
    }
}

impl From<sqlx::Error> for WaitError {
    fn from(e: sqlx::Error) -> Self {
        WaitError::Db(e)
    }
}

/// What the bodies of one key share: their runs, the outside calls, and a
/// gate the first run stops at (after its step: before declining, or
/// before its final transaction) until the test opens it.
pub struct Gate {
    runs: AtomicU64,
    outside: AtomicU64,
    decline: AtomicBool,
    holds: AtomicBool,
    held: watch::Sender<bool>,
    open: Semaphore,
}

impl Gate {
    fn holding(decline: bool) -> Arc<Self> {
        Arc::new(Gate {
            runs: AtomicU64::new(0),
            outside: AtomicU64::new(0),
            decline: AtomicBool::new(decline),
            holds: AtomicBool::new(true),
            held: watch::Sender::new(false),
            open: Semaphore::new(0),
        })
    }

    async fn stop(&self) {
        if self.holds.swap(false, SeqCst) {
            self.held.send_replace(true);
            self.open.acquire().await.expect("open").forget();
        }
    }

    async fn until_held(&self) {
        let mut held = self.held.subscribe();
        tokio::time::timeout(BOUND, held.wait_for(|h| *h)).await.expect("the first call is held").expect("held");
    }

    async fn charge(&self, key: StepKey) -> Result<String, WaitError> {
        self.outside.fetch_add(1, SeqCst);
        Ok(format!("ch-{}", &key.as_str()[..12]))
    }
}

async fn body<DB: TestDb>(steps: &mut Steps<DB>, gate: &Gate, key: &str) -> Result<Paid, WaitError> {
    let run = gate.runs.fetch_add(1, SeqCst) + 1;
    let charge: String = steps.step("charge", |step_key| gate.charge(step_key)).await?;
    gate.stop().await;
    if gate.decline.load(SeqCst) {
        return Err(steps.permanent(&Declined { charge }).into());
    }
    let tx = steps.transaction().await?;
    DB::insert_payment(tx, key, &charge, 7).await?;
    Ok(Paid { key: key.to_owned(), charge, run })
}

#[idempotent(key = "<key>", ttl = "1h", biz = "steps_waits", steps, wait = "30s")]
async fn pay_waiting<DB: TestDb>(
    idem: &Idem<DB>,
    steps: &mut Steps<DB>,
    #[idem(skip)] gate: &Gate,
    key: &str,
) -> Result<Paid, WaitError> {
    body(steps, gate, key).await
}

#[idempotent(key = "<key>", ttl = "1h", biz = "steps_waits", steps)]
async fn pay<DB: TestDb>(
    idem: &Idem<DB>,
    steps: &mut Steps<DB>,
    #[idem(skip)] gate: &Gate,
    key: &str,
) -> Result<Paid, WaitError> {
    body(steps, gate, key).await
}

type Answered = (Result<Paid, WaitError>, Option<Outcome>);

/// Two instances over one database, no Redis: the first over the test's
/// pool, the other over a pool of its own that counts each connection it
/// hands out (a question to the database).
struct Fleet<DB: TestDb> {
    first: Idem<DB>,
    other: Idem<DB>,
    asked: watch::Sender<u64>,
    _db: Connected<DB>,
}

impl<DB: TestDb> Fleet<DB> {
    async fn new() -> Option<Self> {
        let db = DB::connect().await?;
        let first = engine(db.pool.clone(), false).await?;
        let asked = watch::Sender::new(0);
        let (on_acquire, on_connect) = (asked.clone(), asked.clone());
        let own: Pool<DB> = PoolOptions::new()
            .max_connections(2)
            .before_acquire(move |_, _| {
                on_acquire.send_modify(|n| *n += 1);
                Box::pin(async { Ok(true) })
            })
            .after_connect(move |_, _| {
                on_connect.send_modify(|n| *n += 1);
                Box::pin(async { Ok(()) })
            })
            .connect_lazy_with((*db.pool.connect_options()).clone());
        let other = Idem::builder(own).lock_wait(LOCK_WAIT).build();
        Some(Fleet { first, other, asked, _db: db })
    }

    /// The first call of `key`, held at its gate.
    async fn hold_first(&self, key: &str, gate: &Arc<Gate>) -> tokio::task::JoinHandle<Answered> {
        let (idem, gate_, key) = (self.first.clone(), Arc::clone(gate), key.to_owned());
        let first = tokio::spawn(async move { idempotency::observe(pay_waiting(&idem, &gate_, &key)).await });
        gate.until_held().await;
        first
    }

    /// A duplicate of `key` on the other instance (with `wait`, or not),
    /// once it asked phase one three times more than a call that does not
    /// wait asks in all (the clock, one insert, one read).
    async fn waiting_duplicate(&self, key: &str, gate: &Arc<Gate>, wait: bool) -> tokio::task::JoinHandle<Answered> {
        let before = *self.asked.borrow();
        let (idem, gate, key) = (self.other.clone(), Arc::clone(gate), key.to_owned());
        let duplicate = tokio::spawn(async move {
            match wait {
                true => idempotency::observe(pay_waiting(&idem, &gate, &key)).await,
                false => idempotency::observe(pay(&idem, &gate, &key)).await,
            }
        });
        let mut asked = self.asked.subscribe();
        let asked_again = tokio::time::timeout(BOUND, asked.wait_for(|n| *n >= before + 6)).await;
        asked_again.expect("the duplicate asked phase one again").expect("counted");
        duplicate
    }
}

async fn answered(call: tokio::task::JoinHandle<Answered>, what: &str) -> Answered {
    tokio::time::timeout(BOUND, call).await.unwrap_or_else(|_| panic!("{what} hung")).expect("a call")
}

/// With `wait`, the duplicate waits while the first call runs and then
/// replays its value: the body and the outside call once, one payment.
pub async fn a_duplicate_elsewhere_waits_for_the_value<DB: TestDb>() {
    let Some(fleet) = Fleet::<DB>::new().await else { return };
    let (key, gate) = (unique("steps-wait-value"), Gate::holding(false));
    let first = fleet.hold_first(&key, &gate).await;
    let duplicate = fleet.waiting_duplicate(&key, &gate, true).await;
    assert!(!duplicate.is_finished(), "the duplicate answered while the first ran");
    gate.open.add_permits(1);
    let (paid, outcome) = answered(first, "the first call").await;
    let paid = paid.expect("the first call's value");
    assert_eq!((paid.run, outcome), (1, Some(Outcome::Executed)));
    let (again, outcome) = answered(duplicate, "the duplicate").await;
    assert_eq!((again.expect("the replayed value"), outcome), (paid, Some(Outcome::Replayed)));
    assert_eq!((gate.runs.load(SeqCst), gate.outside.load(SeqCst)), (1, 1));
    assert_eq!(DB::payments(fleet.first.pool(), &key).await, 1);
}

/// With `wait`, the duplicate of a call that then declines for good gets
/// that permanent failure, byte for byte, the body not run again.
pub async fn a_duplicate_elsewhere_waits_for_the_permanent_failure<DB: TestDb>() {
    let Some(fleet) = Fleet::<DB>::new().await else { return };
    let (key, gate) = (unique("steps-wait-declined"), Gate::holding(true));
    let first = fleet.hold_first(&key, &gate).await;
    let duplicate = fleet.waiting_duplicate(&key, &gate, true).await;
    assert!(!duplicate.is_finished(), "the duplicate answered while the first ran");
    gate.open.add_permits(1);
    let (declined, outcome) = answered(first, "the first call").await;
    let Err(WaitError::Idem(Error::Permanent { failure, .. })) = declined else { panic!("{declined:?}") };
    assert_eq!(outcome, Some(Outcome::Executed));
    let (again, outcome) = answered(duplicate, "the duplicate").await;
    let Err(WaitError::Idem(Error::Permanent { failure: replayed, .. })) = again else { panic!("{again:?}") };
    assert_eq!((replayed.as_json(), outcome), (failure.as_json(), Some(Outcome::Replayed)));
    assert_eq!((gate.runs.load(SeqCst), gate.outside.load(SeqCst)), (1, 1));
    assert_eq!(DB::payments(fleet.first.pool(), &key).await, 0);
}

/// With `wait`, once the first call's lease ends (forced by SQL) the
/// waiting duplicate takes the call over: its step answered from its
/// record, it commits; the first, let go, is fenced off and answers the
/// new owner's value.
pub async fn a_duplicate_elsewhere_takes_over_once_the_lease_ended<DB: TestDb>() {
    let Some(fleet) = Fleet::<DB>::new().await else { return };
    let (key, gate) = (unique("steps-wait-lease"), Gate::holding(false));
    let first = fleet.hold_first(&key, &gate).await;
    let duplicate = fleet.waiting_duplicate(&key, &gate, true).await;
    assert!(!duplicate.is_finished(), "the duplicate answered while the first ran");
    let row = format!("biz_type = '{BIZ}' AND idem_key = '{key}'");
    DB::force(fleet.first.pool(), format!("UPDATE idem_call SET lease_until = 0 WHERE {row}")).await;
    let (taken, outcome) = answered(duplicate, "the duplicate").await;
    let taken = taken.expect("the new owner's value");
    assert_eq!((taken.run, outcome), (2, Some(Outcome::Executed)));
    gate.open.add_permits(1);
    let (zombie, outcome) = answered(first, "the first call").await;
    assert_eq!((zombie.expect("the new owner's value"), outcome), (taken, Some(Outcome::Replayed)));
    assert_eq!(gate.outside.load(SeqCst), 1, "the step answered from its record");
    assert_eq!(DB::payments(fleet.first.pool(), &key).await, 1);
}

/// Without `wait`, the duplicate asks again for `lock_wait` (as a plain
/// call waits on the unique index), then answers `InProgress` while the
/// first still runs.
pub async fn without_a_wait_a_duplicate_elsewhere_answers_in_progress_after_lock_wait<DB: TestDb>() {
    let Some(fleet) = Fleet::<DB>::new().await else { return };
    let (key, gate) = (unique("steps-wait-none"), Gate::holding(false));
    let first = fleet.hold_first(&key, &gate).await;
    let started = Instant::now();
    let duplicate = fleet.waiting_duplicate(&key, &gate, false).await;
    let (busy, outcome) = answered(duplicate, "the duplicate").await;
    assert!(matches!(busy, Err(WaitError::Idem(Error::InProgress { .. }))), "{busy:?}");
    assert_eq!(outcome, Some(Outcome::InProgress));
    let took = started.elapsed();
    assert!(took < LOCK_WAIT + Duration::from_secs(10), "InProgress after {took:?}");
    assert!(!first.is_finished(), "the first call still runs");
    gate.open.add_permits(1);
    assert_eq!(answered(first, "the first call").await.1, Some(Outcome::Executed));
    assert_eq!(gate.runs.load(SeqCst), 1);
}

/// One `#[tokio::test]` per database for each test (no Redis: a claim
/// would keep the duplicate out before phase one).
macro_rules! on_every_database {
    ($($test:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() { super::$test::<sqlx::Sqlite>().await })*
        }
        mod mysql {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() { super::$test::<sqlx::MySql>().await })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() { super::$test::<sqlx::Postgres>().await })*
        }
    };
}

on_every_database!(
    a_duplicate_elsewhere_waits_for_the_value,
    a_duplicate_elsewhere_waits_for_the_permanent_failure,
    a_duplicate_elsewhere_takes_over_once_the_lease_ended,
    without_a_wait_a_duplicate_elsewhere_answers_in_progress_after_lock_wait,
);
