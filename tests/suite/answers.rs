//! What a caller is told, and so whether it retries (`docs/guarantees.md`,
//! "What a failure answers"), through the engine, with and without Redis: a
//! body's own SQL the database refuses is final (`StorageRefused`, not
//! retryable) and writes nothing; a NUL in `biz_no` is refused before any
//! write on every backend alike (PostgreSQL's text refuses it; the others
//! would have stored it); a result over `max_result_bytes` is final and
//! rolls the body back; an engine whose tables were never made names
//! `migrate`; a pool that times out says retry. The classification of every
//! code is `idempotency-runtime`'s `store::classify` tests.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use idempotency::{Error, Idem, Outcome, idempotent};
use idempotency_testkit::{TestBackend, unique};
use sqlx::Transaction;

use super::fixture::{Redis, engine, ledger_rows, record_rows_for, with_and_without_redis};
use super::{B, Db};

const BIZ: &str = "t_answers";

/// How the body misbehaves.
#[derive(Clone, Copy, Debug)]
enum Body {
    /// Writes its ledger row, then breaks its own NOT NULL constraint.
    BreaksItsConstraint,
    /// Writes its ledger row, then sends SQL the database cannot parse.
    SendsBadSql,
    /// Writes its ledger row and returns `len` bytes.
    Returns(usize),
}

/// The error type is the engine's own: `?` converts the body's
/// `sqlx::Error` by its code.
#[idempotent(key = "<k>", ttl = "1h", biz = "t_answers", biz_no = "<no>")]
async fn call(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    #[idem(skip)] runs: &AtomicUsize,
    #[idem(skip)] body: Body,
    k: String,
    no: String,
) -> Result<String, Error> {
    runs.fetch_add(1, SeqCst);
    sqlx::query(B::INSERT_LEDGER).bind(&k).bind(1_i64).execute(&mut **tx).await?;
    match body {
        Body::BreaksItsConstraint => {
            sqlx::query(B::INSERT_LEDGER).bind(&k).bind(None::<i64>).execute(&mut **tx).await?;
        }
        Body::SendsBadSql => {
            sqlx::raw_sql("SELEC 1").execute(&mut **tx).await?;
        }
        Body::Returns(len) => return Ok("x".repeat(len)),
    }
    Ok("unreachable".into())
}

/// Calls `body` three times, as a retrying caller would: each answer is
/// `Err` of the kind `expected` says, none retryable; the body's writes
/// never stay.
async fn refused_every_time(idem: &Idem<Db>, body: Body, expected: fn(&Error) -> bool) -> usize {
    let runs = AtomicUsize::new(0);
    let k = unique("answers");
    for _ in 0..3 {
        let (answer, outcome) = idempotency::observe(call(idem, &runs, body, k.clone(), "order-1".into())).await;
        let error = answer.expect_err("refused");
        assert!(expected(&error), "{body:?}: {error:?}");
        assert!(!error.is_retryable(), "{body:?}: {error:?} says retry");
        assert_ne!(outcome, Some(Outcome::Executed));
    }
    assert_eq!((ledger_rows(idem, &k).await, record_rows_for(idem, BIZ, &k).await), (0, 0), "{body:?} left rows");
    runs.load(SeqCst)
}

async fn a_bodys_own_refused_sql_is_final(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 3, redis).await else { return };
    let refused = |e: &Error| matches!(e, Error::StorageRefused(_));
    assert_eq!(refused_every_time(&idem, Body::BreaksItsConstraint, refused).await, 3);
    assert_eq!(refused_every_time(&idem, Body::SendsBadSql, refused).await, 3);
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_bodys_own_refused_sql_is_final_not_retryable,
    a_bodys_own_refused_sql_is_final_not_retryable_with_redis => a_bodys_own_refused_sql_is_final
);

/// Regression: a result over the bound is refused before commit (the body's
/// writes roll back) and says do not retry; a retry runs the body again and
/// is refused again. One at the bound is recorded and replays.
async fn a_result_over_the_bound_is_final(redis: Redis) {
    let Some(pool) = B::open(&unique("db"), 3).await else { return };
    B::prepare(&pool).await;
    let builder = Idem::builder(pool).max_result_bytes(1000);
    let idem = match redis {
        Redis::On => {
            let Some(client) = idempotency_testkit::redis_client().await else { return };
            builder.redis(client).build()
        }
        _ => builder.build(),
    };
    idem.migrate().await.expect("migrate");
    // 1001 bytes of JSON: the string and its two quotes.
    let too_large = |e: &Error| matches!(e, Error::ResultTooLarge { biz: BIZ, len: 1001, max: 1000 });
    assert_eq!(refused_every_time(&idem, Body::Returns(999), too_large).await, 3);

    let (runs, k) = (AtomicUsize::new(0), unique("answers-fits"));
    let first = call(&idem, &runs, Body::Returns(998), k.clone(), "order-1".into()).await.expect("recorded");
    let (again, outcome) =
        idempotency::observe(call(&idem, &runs, Body::Returns(998), k.clone(), "order-1".into())).await;
    assert_eq!((again.expect("replayed"), outcome), (first, Some(Outcome::Replayed)));
    assert_eq!((runs.load(SeqCst), ledger_rows(&idem, &k).await), (1, 1));
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_result_over_max_result_bytes_is_final_and_rolled_back,
    a_result_over_max_result_bytes_is_final_and_rolled_back_with_redis => a_result_over_the_bound_is_final
);

/// Regression: a NUL in `biz_no` (PostgreSQL refused it on every try, 503
/// each time, and a consumer requeued the message for ever) is refused
/// before Redis or the database is touched, on every backend alike.
async fn a_nul_in_biz_no_is_refused_up_front(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 3, redis).await else { return };
    let (runs, k) = (AtomicUsize::new(0), unique("answers-nul"));
    for _ in 0..2 {
        let answer = call(&idem, &runs, Body::Returns(1), k.clone(), "order\u{0}1".into()).await;
        assert!(matches!(answer, Err(Error::InvalidText { field: "biz_no", at: 5 })), "{answer:?}");
        assert!(!answer.unwrap_err().is_retryable());
    }
    assert_eq!((runs.load(SeqCst), record_rows_for(&idem, BIZ, &k).await), (0, 0));
    if redis == Redis::On {
        let at = super::fixture::redis_location(&idem, BIZ, &k).await;
        let client = idempotency_testkit::redis_client().await.expect("redis");
        assert!(!idempotency_testkit::redis_exists(&client, &at.claim).await, "no claim was taken");
    }
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_nul_in_biz_no_is_refused_before_any_write,
    a_nul_in_biz_no_is_refused_before_any_write_with_redis => a_nul_in_biz_no_is_refused_up_front
);

/// An engine over a database `migrate` never ran on: its first call answers
/// `NotMigrated`, which names `migrate`, not a retryable storage failure.
async fn tables_never_made(redis: Redis) {
    let name = unique("nomig").replace('-', "_");
    let Some(pool) = B::open_private(&name, 2).await else { return };
    B::prepare(&pool).await;
    let builder = Idem::builder(pool.clone());
    let idem = match redis {
        Redis::On => {
            let Some(client) = idempotency_testkit::redis_client().await else { return };
            builder.redis(client).build()
        }
        _ => builder.build(),
    };
    let runs = AtomicUsize::new(0);
    let answer = call(&idem, &runs, Body::Returns(1), unique("answers"), "order-1".into()).await;
    let error = answer.expect_err("no tables");
    assert!(matches!(error, Error::NotMigrated(_)), "{error:?}");
    assert!(!error.is_retryable() && error.to_string().contains("migrate"), "{error}");
    drop(idem);
    B::drop_private(pool, &name).await;
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    an_engine_never_migrated_says_to_run_migrate,
    an_engine_never_migrated_says_to_run_migrate_with_redis => tables_never_made
);

/// A pool that cannot be reached says retry (`Storage`), and nothing ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_says_retry() {
    let idem = Idem::new(B::dead_pool());
    let runs = AtomicUsize::new(0);
    let error = call(&idem, &runs, Body::Returns(1), unique("answers"), "order-1".into()).await.expect_err("dead");
    assert!(matches!(error, Error::Storage(_)) && error.is_retryable(), "{error:?}");
    assert_eq!(runs.load(SeqCst), 0);
}
