//! Where declared errors meet other features: an error that cannot
//! replay, `record_errors` nested three deep in the caller's transaction,
//! and a deploy that takes `record_errors` away.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use idempotency::{BusinessError, Idem, Outcome, Status, idempotent};
use idempotency_testkit::{TestBackend, unique};
use serde::{Deserialize, Serialize};
use sqlx::Transaction;

use super::{BIZ, Card, Declined, PayError, body, declined, engine, pay, rows};
use crate::suite::fixture::{Redis, ledger_rows, redis_location, with_and_without_redis};
use crate::suite::{B, Db};

/// A declared error whose record does not read back: a field written
/// never, and required when read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Unreadable {
    #[serde(skip_serializing)]
    code: u32,
}

#[derive(Debug)]
#[allow(dead_code)] // the fields show in assertion messages through Debug
enum LossyError {
    Declined(Unreadable),
    Idem(idempotency::Error),
}

impl From<idempotency::Error> for LossyError {
    fn from(e: idempotency::Error) -> Self {
        LossyError::Idem(e)
    }
}

impl BusinessError for LossyError {
    type Record = Unreadable;
    fn recorded(&self) -> Option<Unreadable> {
        match self {
            LossyError::Declined(record) => Some(record.clone()),
            LossyError::Idem(_) => None,
        }
    }
    fn replayed(record: Unreadable) -> Self {
        LossyError::Declined(record)
    }
}

async fn lossy_body(tx: &mut Transaction<'_, Db>, runs: &AtomicUsize, k: &str) -> Result<u8, LossyError> {
    runs.fetch_add(1, SeqCst);
    let ledger = sqlx::query(B::INSERT_LEDGER).bind(k).bind(1_i64).execute(&mut **tx).await;
    ledger.map_err(|e| LossyError::Idem(idempotency::Error::from(e)))?;
    Err(LossyError::Declined(Unreadable { code: 7 }))
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_declined", record_errors)]
async fn decline_lossily(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    #[idem(skip)] runs: &AtomicUsize,
    k: String,
) -> Result<u8, LossyError> {
    lossy_body(tx, runs, &k).await
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_declined", join, record_errors)]
async fn decline_lossily_in(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    #[idem(skip)] runs: &AtomicUsize,
    k: String,
) -> Result<u8, LossyError> {
    lossy_body(tx, runs, &k).await
}

fn is_unstorable(answer: &Result<u8, LossyError>) -> bool {
    matches!(answer, Err(LossyError::Idem(idempotency::Error::Serialize(_))))
}

/// Regression: a declared error that does not read back was committed
/// (status `Failed`), its caller told `Error::Replay`, and the next call ran
/// the body again. Like a value that cannot replay, it is refused before
/// anything commits: a final error (`Rejected`), nothing recorded, nothing
/// cached, every call the same.
async fn an_unreadable_decline(redis: Redis) {
    let Some(idem) = engine(redis, false).await else { return };
    let (runs, k) = (AtomicUsize::new(0), unique("lossy"));
    for call in 1..=2 {
        let (answer, outcome) = idempotency::observe(decline_lossily(&idem, &runs, k.clone())).await;
        assert!(is_unstorable(&answer), "call {call}: {answer:?}");
        assert_eq!(outcome, Some(Outcome::Rejected), "call {call}");
        assert_eq!(rows(&idem, &k).await, (0, 0), "call {call}");
    }
    assert_eq!(runs.load(SeqCst), 2, "nothing recorded: each call is a first call");
    if redis == Redis::On {
        let at = redis_location(&idem, BIZ, &k).await;
        let client = idempotency_testkit::redis_client().await.unwrap();
        assert_eq!(idempotency_testkit::redis_result(&client, &at).await, None, "nothing cached");
    }
    // In the caller's transaction: the caller's own writes stay usable.
    let mut caller = idem.pool().begin().await.unwrap();
    let joined = decline_lossily_in(&idem, &mut caller, &runs, k.clone()).await;
    assert!(is_unstorable(&joined), "{joined:?}");
    sqlx::query(B::INSERT_LEDGER).bind(format!("own-{k}")).bind(1_i64).execute(&mut *caller).await.unwrap();
    caller.commit().await.unwrap();
    assert_eq!(rows(&idem, &k).await, (0, 0));
    assert_eq!(ledger_rows(&idem, &format!("own-{k}")).await, 1);
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_declared_error_that_cannot_replay_is_refused_before_it_commits,
    a_declared_error_that_cannot_replay_is_refused_before_it_commits_with_redis => an_unreadable_decline
);

/// Which levels of a three-deep nesting decline: level one is a call of
/// its own whose body calls a joined fn (level two), whose body calls
/// another (level three). Each writes its ledger row, calls the next, then
/// declines or returns its level.
#[derive(Debug, Clone, Copy)]
struct Declining([bool; 3]);

/// A level's own write: its ledger row.
async fn level(tx: &mut Transaction<'_, Db>, runs: &AtomicUsize, k: &str, at: usize) -> Result<(), PayError> {
    runs.fetch_add(1, SeqCst);
    sqlx::query(B::INSERT_LEDGER).bind(format!("{k}-{at}")).bind(1_i64).execute(&mut **tx).await?;
    Ok(())
}

/// A level's ending: its inner call's decline is that call's answer, not
/// this level's; any other error passes on.
fn end_level(at: usize, plan: Declining, inner: Option<Result<usize, PayError>>) -> Result<usize, PayError> {
    if let Some(Err(e)) = inner
        && !matches!(e, PayError::Declined(_))
    {
        return Err(e);
    }
    if plan.0[at - 1] {
        return Err(PayError::Declined(Declined { reason: format!("level {at}"), run: at }));
    }
    Ok(at)
}

#[idempotent(key = "<k>-1", ttl = "1h", biz = "t_declined", record_errors)]
async fn level_one(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    #[idem(skip)] runs: &AtomicUsize,
    #[idem(skip)] plan: Declining,
    k: String,
) -> Result<usize, PayError> {
    level(tx, runs, &k, 1).await?;
    let inner = level_two(idem, tx, runs, plan, k.clone()).await;
    end_level(1, plan, Some(inner))
}

#[idempotent(key = "<k>-2", ttl = "1h", biz = "t_declined", join, record_errors)]
async fn level_two(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    #[idem(skip)] runs: &AtomicUsize,
    #[idem(skip)] plan: Declining,
    k: String,
) -> Result<usize, PayError> {
    level(tx, runs, &k, 2).await?;
    let inner = level_three(idem, tx, runs, plan, k.clone()).await;
    end_level(2, plan, Some(inner))
}

#[idempotent(key = "<k>-3", ttl = "1h", biz = "t_declined", join, record_errors)]
async fn level_three(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    #[idem(skip)] runs: &AtomicUsize,
    #[idem(skip)] plan: Declining,
    k: String,
) -> Result<usize, PayError> {
    level(tx, runs, &k, 3).await?;
    end_level(3, plan, None)
}

/// What a level left: its record's status (`'v'` a value, `'f'` a recorded
/// error, `'-'` none) and whether its ledger row committed.
async fn left(idem: &Idem<Db>, k: &str, at: usize) -> (char, bool) {
    let status = match idem.status(BIZ, &format!("{k}-{at}")).await.unwrap() {
        Status::Completed { .. } => 'v',
        Status::Failed { .. } => 'f',
        Status::Absent => '-',
        other => panic!("level {at}: {other:?}"),
    };
    (status, ledger_rows(idem, &format!("{k}-{at}")).await == 1)
}

/// Regression: a decline after a joined `record_errors` call was lost on
/// MariaDB (status `Absent`, a retry ran the body again): both levels named
/// their savepoint `idem_body`, MariaDB replaced the outer one, and the
/// inner release removed it. Named per nesting level now; three levels
/// deep, each declining or not, every backend: a level's decline undoes its
/// own body (its ledger row and every level inside it) and keeps its record.
async fn nested_declines(redis: Redis) {
    let Some(idem) = engine(redis, false).await else { return };
    // (which levels decline, what each level leaves: record, ledger row)
    let cases = [
        ([true, false, false], [('f', false), ('-', false), ('-', false)]),
        ([false, true, true], [('v', true), ('f', false), ('-', false)]),
        ([false, false, true], [('v', true), ('v', true), ('f', false)]),
        ([true, true, true], [('f', false), ('-', false), ('-', false)]),
        ([false, false, false], [('v', true), ('v', true), ('v', true)]),
    ];
    for (declining, expected) in cases {
        let (runs, k) = (AtomicUsize::new(0), unique("nested"));
        let plan = Declining(declining);
        let first = level_one(&idem, &runs, plan, k.clone()).await;
        assert_eq!(first.is_err(), declining[0], "{declining:?}: {first:?}");
        let mut found = Vec::new();
        for at in 1..=3 {
            found.push(left(&idem, &k, at).await);
        }
        assert_eq!(found, expected, "{declining:?}");
        assert_eq!(runs.load(SeqCst), 3, "{declining:?}");
        // The retry replays level one's answer: no body runs again.
        let again = level_one(&idem, &runs, plan, k.clone()).await;
        assert_eq!(format!("{again:?}"), format!("{first:?}"), "{declining:?}");
        assert_eq!(runs.load(SeqCst), 3, "{declining:?}: replayed");
    }
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    declines_nested_three_deep_each_keep_their_own_record,
    declines_nested_three_deep_each_keep_their_own_record_with_redis => nested_declines
);

/// The same fn after a deploy that took `record_errors` away again.
#[idempotent(key = "<k>", ttl = "1h", biz = "t_declined")]
async fn pay_unrecorded(
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

/// A deploy that takes `record_errors` off a fn (a rollback of the deploy
/// that put it on): its recorded declines answer `Error::Replay` (a final
/// error, 500 over HTTP) until they expire, and the body does not run
/// again. (docs/operations.md, "Rolling upgrades of the crate".)
async fn record_errors_taken_away(redis: Redis) {
    let Some(idem) = engine(redis, false).await else { return };
    let (runs, k) = (AtomicUsize::new(0), unique("unrecorded"));
    declined(pay(&idem, &runs, Card::Declined, k.clone(), 7).await);
    let (after, outcome) = idempotency::observe(pay_unrecorded(&idem, &runs, Card::Accepted, k.clone(), 7)).await;
    assert!(matches!(after, Err(PayError::Idem(idempotency::Error::Replay { .. }))), "{after:?}");
    assert_eq!(outcome, Some(Outcome::Rejected));
    assert_eq!(runs.load(SeqCst), 1, "the body did not run again");
    assert!(matches!(idem.status(BIZ, &k).await.unwrap(), Status::Failed { .. }));
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_fn_that_loses_record_errors_answers_its_declines_as_replay_errors,
    a_fn_that_loses_record_errors_answers_its_declines_as_replay_errors_with_redis => record_errors_taken_away
);
