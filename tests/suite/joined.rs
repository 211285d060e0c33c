//! A call inside the caller's transaction (`join`): it commits and rolls
//! back with the caller, a failing body takes back only its own writes,
//! a hostile key writes nothing, and nothing is cached before the caller's
//! commit is known. The races are in `joined_races`.

use idempotency::{Idem, LocalCache, Outcome, Status};
use idempotency_testkit::{TestBackend, redis_client, redis_holds, unique};
use sqlx::Transaction;

use super::fixture::{
    Mode, Probe, Receipt, Redis, TestError, ledger_rows, pay, pay_in, record_rows_for, redis_location, until_held,
    with_and_without_redis,
};
use super::{B, Db};

/// An engine over a database of its own name, with the local cache on
/// (so a result cached too early would show), and Redis if asked.
pub(crate) async fn engine_with_local_cache(redis: Redis) -> Option<Idem<Db>> {
    let pool = B::open(&unique("db"), 3).await?;
    B::prepare(&pool).await;
    let builder = Idem::builder(pool).local_cache(LocalCache::new(1_000, 1 << 20));
    let builder = match redis {
        Redis::On => builder.redis(redis_client().await?),
        Redis::Off | Redis::DeadPort => builder,
    };
    let idem = builder.build();
    idem.migrate().await.expect("migrate");
    Some(idem)
}

/// The caller's own business write, beside the call: a ledger row under
/// `own-<k>`.
pub(crate) async fn own_write(tx: &mut Transaction<'_, Db>, k: &str) {
    sqlx::query(B::INSERT_LEDGER).bind(format!("own-{k}")).bind(1_i64).execute(&mut **tx).await.expect("own write");
}

pub(crate) async fn own_rows(idem: &Idem<Db>, k: &str) -> i64 {
    ledger_rows(idem, &format!("own-{k}")).await
}

/// The caller commits: one execution, recorded only from the commit on;
/// every later call, joined or not, replays the same result.
async fn commits_with_its_caller(redis: Redis) {
    let Some(idem) = engine_with_local_cache(redis).await else { return };
    let probe = Probe::default();
    let k = unique("join");

    let mut tx = idem.pool().begin().await.unwrap();
    own_write(&mut tx, &k).await;
    let (first, outcome) = idempotency::observe(pay_in(&idem, &mut tx, k.clone(), 7, &probe, Mode::Ok)).await;
    let first = first.unwrap();
    assert_eq!((first.clone(), outcome), (Receipt { key: k.clone(), amount: 7, run: 1 }, Some(Outcome::Executed)));
    assert_eq!(record_rows_for(&idem, "t_pay", &k).await, 0, "not visible before the caller commits");
    assert_eq!(idem.status("t_pay", &k).await.unwrap(), Status::Absent);
    tx.commit().await.unwrap();
    assert_eq!((ledger_rows(&idem, &k).await, own_rows(&idem, &k).await), (1, 1));
    assert_eq!(record_rows_for(&idem, "t_pay", &k).await, 1);

    let mut tx = idem.pool().begin().await.unwrap();
    let (joined, outcome) = idempotency::observe(pay_in(&idem, &mut tx, k.clone(), 7, &probe, Mode::Ok)).await;
    tx.commit().await.unwrap();
    assert_eq!((joined.unwrap(), outcome), (first.clone(), Some(Outcome::Replayed)));

    let (plain, outcome) = idempotency::observe(pay(&idem, k.clone(), 7, &probe, Mode::Ok)).await;
    let plain = plain.unwrap();
    assert_eq!(serde_json::to_string(&plain).unwrap(), serde_json::to_string(&first).unwrap());
    assert_eq!(outcome, Some(Outcome::Replayed));
    // Without Redis the plain call meets the record before its body. With
    // Redis nothing was cached (the joined call never learnt of the commit),
    // so the claim lets its body run first; its record insert then meets
    // the joined row, and it rolls back and replays, as when Redis lost a
    // result.
    assert_eq!(probe.runs(), if redis == Redis::On { 2 } else { 1 });
    assert_eq!(ledger_rows(&idem, &k).await, 1, "the plain call's body never committed");

    // Now cached (locally, and in Redis): the next calls run nothing.
    assert_eq!(pay(&idem, k.clone(), 7, &probe, Mode::Ok).await.unwrap(), first);
    let mut tx = idem.pool().begin().await.unwrap();
    assert_eq!(pay_in(&idem, &mut tx, k.clone(), 7, &probe, Mode::Ok).await.unwrap(), first);
    tx.commit().await.unwrap();
    assert_eq!(probe.runs(), if redis == Redis::On { 2 } else { 1 });
    assert_eq!(record_rows_for(&idem, "t_pay", &k).await, 1);
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_joined_call_commits_with_its_caller,
    a_joined_call_commits_with_its_caller_with_redis => commits_with_its_caller
);

/// The caller rolls back: no record, no business write, nothing in Redis
/// or the local cache; the next call executes.
async fn rolls_back_with_its_caller(redis: Redis) {
    let Some(idem) = engine_with_local_cache(redis).await else { return };
    let probe = Probe::default();
    let k = unique("join-rollback");

    let mut tx = idem.pool().begin().await.unwrap();
    own_write(&mut tx, &k).await;
    let (first, outcome) = idempotency::observe(pay_in(&idem, &mut tx, k.clone(), 7, &probe, Mode::Ok)).await;
    assert_eq!((first.unwrap().run, outcome), (1, Some(Outcome::Executed)));
    tx.rollback().await.unwrap();
    assert_eq!(record_rows_for(&idem, "t_pay", &k).await, 0);
    assert_eq!((ledger_rows(&idem, &k).await, own_rows(&idem, &k).await), (0, 0));
    if redis == Redis::On {
        let client = redis_client().await.expect("redis");
        assert!(!redis_holds(&client, &redis_location(&idem, "t_pay", &k).await).await, "nothing claimed or cached");
    }

    // Both ways in execute again: the first result is gone with its caller.
    let (plain, outcome) = idempotency::observe(pay(&idem, k.clone(), 7, &probe, Mode::Ok)).await;
    assert_eq!((plain.unwrap().run, outcome), (2, Some(Outcome::Executed)));
    let k = unique("join-rollback");
    let mut tx = idem.pool().begin().await.unwrap();
    pay_in(&idem, &mut tx, k.clone(), 7, &probe, Mode::Ok).await.unwrap();
    tx.rollback().await.unwrap();
    let mut tx = idem.pool().begin().await.unwrap();
    let (joined, outcome) = idempotency::observe(pay_in(&idem, &mut tx, k.clone(), 7, &probe, Mode::Ok)).await;
    tx.commit().await.unwrap();
    assert_eq!((joined.unwrap().run, outcome), (4, Some(Outcome::Executed)));
    assert_eq!((ledger_rows(&idem, &k).await, record_rows_for(&idem, "t_pay", &k).await), (1, 1));
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_joined_call_rolls_back_with_its_caller,
    a_joined_call_rolls_back_with_its_caller_with_redis => rolls_back_with_its_caller
);

/// A body that fails, and one whose call is dropped mid-body, take back
/// their own writes only: the caller's writes before and after stay and
/// commit, and the next call executes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_joined_body_rolls_back_only_its_own_writes() {
    let Some(idem) = engine_with_local_cache(Redis::Off).await else { return };
    let probe = Probe::default();
    let k = unique("join-fail");

    let mut tx = idem.pool().begin().await.unwrap();
    own_write(&mut tx, &k).await;
    let failed = pay_in(&idem, &mut tx, k.clone(), 7, &probe, Mode::Fail).await;
    assert!(matches!(failed, Err(TestError::Body)), "{failed:?}");
    tokio::select! {
        held = pay_in(&idem, &mut tx, k.clone(), 7, &probe, Mode::HeldThenOk) => panic!("never let go: {held:?}"),
        () = until_held(&probe) => {} // dropped after its ledger row, before it returns
    }
    own_write(&mut tx, &k).await;
    tx.commit().await.unwrap();
    assert_eq!(own_rows(&idem, &k).await, 2, "the caller's writes stay");
    assert_eq!(ledger_rows(&idem, &k).await, 0, "both bodies' writes are gone");
    assert_eq!(record_rows_for(&idem, "t_pay", &k).await, 0);
    assert_eq!(probe.runs(), 2);

    let mut tx = idem.pool().begin().await.unwrap();
    let again = pay_in(&idem, &mut tx, k.clone(), 7, &probe, Mode::Ok).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(again, Receipt { key: k.clone(), amount: 7, run: 3 });
    assert_eq!((ledger_rows(&idem, &k).await, record_rows_for(&idem, "t_pay", &k).await), (1, 1));
}

/// A key breaking the rule is `InvalidKey` before anything reaches the
/// caller's transaction, which stays usable (on PostgreSQL a failed
/// statement would have aborted it) and commits its own writes only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_keys_write_nothing_in_the_callers_transaction() {
    let Some(idem) = engine_with_local_cache(Redis::Off).await else { return };
    let probe = Probe::default();
    let k = unique("join-hostile");
    let hostile = [
        String::new(),
        "has space".into(),
        "quote'); DROP TABLE idem_record; --".into(),
        "new\nline".into(),
        "ünïcode".into(),
        "nul\0byte".into(),
        "k".repeat(256),
    ];

    let mut tx = idem.pool().begin().await.unwrap();
    own_write(&mut tx, &k).await;
    for key in &hostile {
        let refused = pay_in(&idem, &mut tx, key.clone(), 7, &probe, Mode::Ok).await;
        assert!(matches!(refused, Err(TestError::Idem(idempotency::Error::InvalidKey(_)))), "{key:?}: {refused:?}");
    }
    own_write(&mut tx, &k).await;
    tx.commit().await.unwrap();
    assert_eq!(own_rows(&idem, &k).await, 2);
    assert_eq!(probe.runs(), 0);
    // Only ASCII without NUL can even be compared with the key column.
    for key in hostile.iter().filter(|key| key.is_ascii() && !key.contains('\0')) {
        assert_eq!(record_rows_for(&idem, "t_pay", key).await, 0, "{key:?}");
        assert_eq!(ledger_rows(&idem, key).await, 0, "{key:?}");
    }
}

/// The same key twice in one transaction runs once: the second call
/// replays the first from the caller's own uncommitted row, and that row
/// is cached nowhere, so after the rollback the next call executes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_twice_in_one_transaction_runs_once_and_is_never_cached() {
    let Some(idem) = engine_with_local_cache(Redis::Off).await else { return };
    let probe = Probe::default();
    let k = unique("join-twice");

    let mut tx = idem.pool().begin().await.unwrap();
    let first = pay_in(&idem, &mut tx, k.clone(), 7, &probe, Mode::Ok).await.unwrap();
    let (second, outcome) = idempotency::observe(pay_in(&idem, &mut tx, k.clone(), 7, &probe, Mode::Ok)).await;
    assert_eq!((second.unwrap(), outcome), (first, Some(Outcome::Replayed)));
    let reused = pay_in(&idem, &mut tx, k.clone(), 8, &probe, Mode::Ok).await;
    assert!(matches!(reused, Err(TestError::Idem(idempotency::Error::KeyReused { .. }))), "{reused:?}");
    assert_eq!(probe.runs(), 1);
    tx.rollback().await.unwrap();

    let mut tx = idem.pool().begin().await.unwrap();
    let (again, outcome) = idempotency::observe(pay_in(&idem, &mut tx, k.clone(), 7, &probe, Mode::Ok)).await;
    tx.commit().await.unwrap();
    assert_eq!((again.unwrap().run, outcome), (2, Some(Outcome::Executed)));
    assert_eq!((ledger_rows(&idem, &k).await, record_rows_for(&idem, "t_pay", &k).await), (1, 1));
}
