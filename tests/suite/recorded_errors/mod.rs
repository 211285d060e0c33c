//! Declared business errors (`record_errors`, `BusinessError`): a final
//! `Err` ("declined") is recorded like a value and replayed to every
//! duplicate, byte for byte, without the body running again; the body's own
//! writes roll back to a savepoint while the record commits. An error the
//! type does not declare final keeps today's behaviour: nothing recorded, the
//! next call executes. With and without Redis, with the local cache, and in
//! `join` mode.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use idempotency::{BusinessError, Idem, LocalCache, Outcome, Status, idempotent};
use idempotency_testkit::{TestBackend, unique};
use serde::{Deserialize, Serialize};
use sqlx::Transaction;

use super::fixture::{Redis, ledger_rows, record_rows_for, redis_location, with_and_without_redis};
use super::{B, Db};

const BIZ: &str = "t_declined";

/// The answer a declined payment is: what is recorded and replayed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Declined {
    reason: String,
    /// Which execution of the body declined: a second would say 2.
    run: usize,
}

#[derive(Debug)]
#[allow(dead_code)] // the fields show in assertion messages through Debug
enum PayError {
    Declined(Declined),
    /// A failure that passes: never recorded.
    Unavailable,
    Idem(idempotency::Error),
    Db(sqlx::Error),
}

impl From<idempotency::Error> for PayError {
    fn from(e: idempotency::Error) -> Self {
        PayError::Idem(e)
    }
}

impl From<sqlx::Error> for PayError {
    fn from(e: sqlx::Error) -> Self {
        PayError::Db(e)
    }
}

impl BusinessError for PayError {
    type Record = Declined;
    fn recorded(&self) -> Option<Declined> {
        match self {
            PayError::Declined(declined) => Some(declined.clone()),
            _ => None,
        }
    }
    fn replayed(record: Declined) -> Self {
        PayError::Declined(record)
    }
}

/// How the body ends, after writing its ledger row.
#[derive(Debug, Clone, Copy)]
enum Card {
    Accepted,
    Declined,
    Unavailable,
}

async fn body(tx: &mut Transaction<'_, Db>, runs: &AtomicUsize, k: &str, card: Card) -> Result<usize, PayError> {
    let run = runs.fetch_add(1, SeqCst) + 1;
    sqlx::query(B::INSERT_LEDGER).bind(k).bind(1_i64).execute(&mut **tx).await?;
    match card {
        Card::Accepted => Ok(run),
        Card::Declined => Err(PayError::Declined(Declined { reason: "insufficient \"funds\" \u{e9}".into(), run })),
        Card::Unavailable => Err(PayError::Unavailable),
    }
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_declined", record_errors)]
async fn pay(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    #[idem(skip)] runs: &AtomicUsize,
    #[idem(skip)] card: Card,
    k: String,
    amount: i64,
) -> Result<usize, PayError> {
    let _ = amount;
    body(tx, runs, &k, card).await
}

/// The same in the caller's transaction: the same `biz`, key and
/// arguments, so each replays the other's record.
#[idempotent(key = "<k>", ttl = "1h", biz = "t_declined", join, record_errors)]
async fn pay_in(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    #[idem(skip)] runs: &AtomicUsize,
    #[idem(skip)] card: Card,
    k: String,
    amount: i64,
) -> Result<usize, PayError> {
    let _ = amount;
    body(tx, runs, &k, card).await
}

/// An engine over the target's backend: with Redis, and the local cache.
async fn engine(redis: Redis, local: bool) -> Option<Idem<Db>> {
    let pool = B::open(&unique("db"), 8).await?;
    B::prepare(&pool).await;
    let mut builder = Idem::builder(pool);
    if local {
        builder = builder.local_cache(LocalCache::new(1_000, 1 << 20));
    }
    if redis == Redis::On {
        builder = builder.redis(idempotency_testkit::redis_client().await?);
    }
    let idem = builder.build();
    idem.migrate().await.expect("migrate");
    Some(idem)
}

/// `pay` for duplicates that wait for a running call's answer (in memory, on
/// the unique index, or told by Redis) instead of answering `InProgress`:
/// the same `biz`, key and arguments, so each replays the other's record.
#[idempotent(key = "<k>", ttl = "1h", biz = "t_declined", record_errors, wait = "30s")]
async fn pay_waiting(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    #[idem(skip)] runs: &AtomicUsize,
    #[idem(skip)] card: Card,
    k: String,
    amount: i64,
) -> Result<usize, PayError> {
    let _ = amount;
    body(tx, runs, &k, card).await
}

/// What `k` left: its committed ledger rows and its records.
async fn rows(idem: &Idem<Db>, k: &str) -> (i64, i64) {
    (ledger_rows(idem, k).await, record_rows_for(idem, BIZ, k).await)
}

fn declined(answer: Result<usize, PayError>) -> Declined {
    match answer {
        Err(PayError::Declined(declined)) => declined,
        other => panic!("not declined: {other:?}"),
    }
}

/// A declined call is recorded: the first caller gets the error read back
/// from its record, every duplicate the same (the body not run again),
/// with an outcome of `Replayed`; the body's ledger row is rolled back and
/// the record stays, `Status::Failed`. Other arguments: `KeyReused`.
async fn declined_is_recorded(redis: Redis, local: bool) {
    let Some(idem) = engine(redis, local).await else { return };
    let (runs, k) = (AtomicUsize::new(0), unique("declined"));
    let (first, outcome) = idempotency::observe(pay(&idem, &runs, Card::Declined, k.clone(), 7)).await;
    let first = declined(first);
    assert_eq!((first.run, outcome), (1, Some(Outcome::Executed)));
    for _ in 0..3 {
        // A duplicate that would now be accepted still gets the recorded answer.
        let (again, outcome) = idempotency::observe(pay(&idem, &runs, Card::Accepted, k.clone(), 7)).await;
        let again = declined(again);
        assert_eq!(serde_json::to_string(&again).unwrap(), serde_json::to_string(&first).unwrap());
        assert_eq!(outcome, Some(Outcome::Replayed));
    }
    assert_eq!(runs.load(SeqCst), 1, "the body ran once");
    assert_eq!(rows(&idem, &k).await, (0, 1));
    let status = idem.status(BIZ, &k).await.unwrap();
    assert_eq!(status, Status::Failed { error: serde_json::to_string(&first).unwrap() });
    let reused = pay(&idem, &runs, Card::Accepted, k.clone(), 8).await;
    assert!(matches!(reused, Err(PayError::Idem(idempotency::Error::KeyReused { .. }))), "{reused:?}");
    if redis == Redis::On {
        // Redis holds the answer as a recorded error (tag `f`), for fast replays.
        let at = redis_location(&idem, BIZ, &k).await;
        let client = idempotency_testkit::redis_client().await.unwrap();
        let cached = idempotency_testkit::redis_result(&client, &at).await.expect("cached in Redis");
        assert_eq!(cached[0], b'f', "{cached:?}");
    }
}

async fn declined_without_local_cache(redis: Redis) {
    declined_is_recorded(redis, false).await;
}

async fn declined_with_local_cache(redis: Redis) {
    declined_is_recorded(redis, true).await;
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_declared_error_is_recorded_and_replayed,
    a_declared_error_is_recorded_and_replayed_with_redis => declined_without_local_cache
);

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_declared_error_is_replayed_from_the_local_cache,
    a_declared_error_is_replayed_from_the_local_cache_with_redis => declined_with_local_cache
);

/// An error the type does not declare final is not recorded: rolled back,
/// and the next call executes (and may succeed).
async fn undeclared_is_not_recorded(redis: Redis) {
    let Some(idem) = engine(redis, false).await else { return };
    let (runs, k) = (AtomicUsize::new(0), unique("unavailable"));
    let (failed, outcome) = idempotency::observe(pay(&idem, &runs, Card::Unavailable, k.clone(), 7)).await;
    assert!(matches!(failed, Err(PayError::Unavailable)), "{failed:?}");
    assert_eq!(outcome, Some(Outcome::Failed));
    assert_eq!(rows(&idem, &k).await, (0, 0));
    let retried = pay_waiting(&idem, &runs, Card::Accepted, k.clone(), 7).await;
    assert_eq!(retried.unwrap(), 2, "the retry ran the body");
    assert_eq!(rows(&idem, &k).await, (1, 1));
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    an_undeclared_error_is_not_recorded,
    an_undeclared_error_is_not_recorded_with_redis => undeclared_is_not_recorded
);

/// Ten callers at once on one key whose body declines: the body runs once,
/// all ten get the same recorded error.
async fn concurrent_duplicates_of_a_decline(redis: Redis) {
    const CALLERS: usize = 10;
    let Some(idem) = engine(redis, false).await else { return };
    let (runs, k) = (Arc::new(AtomicUsize::new(0)), unique("declined-storm"));
    let barrier = Arc::new(tokio::sync::Barrier::new(CALLERS));
    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            let (idem, runs, k, barrier) = (idem.clone(), runs.clone(), k.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                pay_waiting(&idem, &runs, Card::Declined, k.clone(), 7).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for caller in callers {
        answers.push(serde_json::to_string(&declined(caller.await.unwrap())).unwrap());
    }
    assert_eq!(runs.load(SeqCst), 1, "the body ran once");
    assert!(answers.iter().all(|a| *a == answers[0]), "{answers:?}");
    assert_eq!(rows(&idem, &k).await, (0, 1));
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    concurrent_duplicates_of_a_decline_all_get_it,
    concurrent_duplicates_of_a_decline_all_get_it_with_redis => concurrent_duplicates_of_a_decline
);

/// In `join` mode: the body's writes roll back, the caller's stay, and the
/// record commits with the caller; a duplicate (plain or joined) replays the
/// error. A caller that rolls back takes the record with it.
async fn joined_decline(redis: Redis) {
    let Some(idem) = engine(redis, true).await else { return };
    let (runs, k) = (AtomicUsize::new(0), unique("declined-join"));

    let mut rolled_back = idem.pool().begin().await.unwrap();
    declined(pay_in(&idem, &mut rolled_back, &runs, Card::Declined, k.clone(), 7).await);
    rolled_back.rollback().await.unwrap();
    assert_eq!(record_rows_for(&idem, BIZ, &k).await, 0, "the record went with the caller's rollback");

    let mut caller = idem.pool().begin().await.unwrap();
    sqlx::query(B::INSERT_LEDGER).bind(format!("own-{k}")).bind(1_i64).execute(&mut *caller).await.unwrap();
    let (first, outcome) = idempotency::observe(pay_in(&idem, &mut caller, &runs, Card::Declined, k.clone(), 7)).await;
    let first = declined(first);
    assert_eq!((first.run, outcome), (2, Some(Outcome::Executed)));
    caller.commit().await.unwrap();
    assert_eq!(ledger_rows(&idem, &format!("own-{k}")).await, 1, "the caller's own write stays");
    assert_eq!(rows(&idem, &k).await, (0, 1));

    let mut other = idem.pool().begin().await.unwrap();
    let (joined, outcome) = idempotency::observe(pay_in(&idem, &mut other, &runs, Card::Accepted, k.clone(), 7)).await;
    other.commit().await.unwrap();
    assert_eq!((declined(joined), outcome), (first.clone(), Some(Outcome::Replayed)));
    let (plain, outcome) = idempotency::observe(pay(&idem, &runs, Card::Accepted, k.clone(), 7)).await;
    assert_eq!((declined(plain), outcome), (first, Some(Outcome::Replayed)));
    // With a Redis claim (a joined call caches nothing there) the plain
    // call's body runs, and rolls back when its record meets the joined one.
    assert_eq!(runs.load(SeqCst), if redis == Redis::On { 3 } else { 2 });
    assert_eq!(ledger_rows(&idem, &k).await, 0);
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_joined_decline_is_recorded_with_the_callers_commit,
    a_joined_decline_is_recorded_with_the_callers_commit_with_redis => joined_decline
);

mod seams;
