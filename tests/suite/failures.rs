//! Failures and rollback: a body that fails, panics or is dropped leaves
//! nothing behind, and the next call executes; an unreachable database
//! runs nothing.

use std::sync::Arc;

use idempotency::{Idem, Status};
use idempotency_testkit::{TestBackend, redis_client, redis_holds, unique};

use super::B;
use super::fixture::{
    Mode, Probe, Receipt, Redis, TestError, engine, ledger_rows, past_the_release, pay, redis_location, until_held,
    with_and_without_redis,
};

/// A pool of one connection: had the failed call kept it, or given it back
/// inside its transaction, the calls after it could not run (or would
/// commit its write).
async fn failed_body_leaves_nothing(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 1, redis).await else { return };
    let probe = Probe::default();
    let k = unique("fail");

    let failed = pay(&idem, k.clone(), 7, &probe, Mode::Fail).await;
    assert!(matches!(failed, Err(TestError::Body)), "{failed:?}");
    assert_eq!(ledger_rows(&idem, &k).await, 0, "the business write was rolled back");
    assert_eq!(idem.status("t_pay", &k).await.unwrap(), Status::Absent);

    let again = pay(&idem, k.clone(), 7, &probe, Mode::Ok).await.unwrap();
    assert_eq!(again, Receipt { key: k.clone(), amount: 7, run: 2 });
    assert_eq!(ledger_rows(&idem, &k).await, 1);
    assert_eq!(pay(&idem, k.clone(), 7, &probe, Mode::Ok).await.unwrap(), again);
    assert_eq!(probe.runs(), 2);
}

with_and_without_redis!(
    #[tokio::test]
    failed_body_leaves_nothing_behind,
    failed_body_leaves_nothing_behind_with_redis => failed_body_leaves_nothing
);

/// A pool of one connection, as for a failed body.
async fn panicking_body_leaves_nothing(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 1, redis).await else { return };
    let probe = Arc::new(Probe::default());
    let k = unique("panic");

    let task = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay(&idem, k, 7, &probe, Mode::Panic).await })
    };
    assert!(task.await.unwrap_err().is_panic());
    assert_eq!(ledger_rows(&idem, &k).await, 0);

    let again = past_the_release(|| pay(&idem, k.clone(), 7, &probe, Mode::Ok)).await.unwrap();
    assert_eq!(again, Receipt { key: k.clone(), amount: 7, run: 2 });
    assert_eq!(ledger_rows(&idem, &k).await, 1);
    assert_eq!(pay(&idem, k.clone(), 7, &probe, Mode::Ok).await.unwrap(), again);
    assert_eq!(probe.runs(), 2);
}

with_and_without_redis!(
    #[tokio::test]
    panicking_body_leaves_nothing_behind,
    panicking_body_leaves_nothing_behind_with_redis => panicking_body_leaves_nothing
);

async fn dropped_call_leaves_nothing(redis: Redis) {
    let name = unique("db");
    // One connection: if the dropped call left it inside its transaction,
    // the calls below could not run.
    let Some(idem) = engine(&name, 1, redis).await else { return };
    let Some(observer) = engine(&name, 2, Redis::Off).await else { return };
    let probe = Probe::default();
    let k = unique("drop");

    // Dropped inside its body, between statements. (Dropped while a MySQL
    // reply is half read, sqlx may never get the connection back: sqlx#563.)
    tokio::select! {
        cut = pay(&idem, k.clone(), 9, &probe, Mode::HeldThenOk) => panic!("the call finished: {cut:?}"),
        () = until_held(&probe) => {}
    }
    assert_eq!(probe.runs(), 1);
    assert_eq!(ledger_rows(&observer, &k).await, 0);

    let next = past_the_release(|| pay(&idem, k.clone(), 9, &probe, Mode::Ok)).await.unwrap();
    assert_eq!(next, Receipt { key: k.clone(), amount: 9, run: 2 });
    assert_eq!(pay(&idem, k.clone(), 9, &probe, Mode::Ok).await.unwrap(), next);
    assert_eq!(ledger_rows(&observer, &k).await, 1);
    assert_eq!(probe.runs(), 2);
}

with_and_without_redis!(
    #[tokio::test]
    dropped_call_leaves_nothing_behind,
    dropped_call_leaves_nothing_behind_with_redis => dropped_call_leaves_nothing
);

async fn unreachable_database_is_a_storage_error(redis: Redis) {
    let mut builder = Idem::builder(B::dead_pool());
    let client = match redis {
        Redis::On => {
            let Some(client) = redis_client().await else { return };
            builder = builder.redis(client.clone());
            Some(client)
        }
        _ => None,
    };
    // The namespace is set: the database that would hold one is down.
    let namespace = idempotency::Namespace::new(&unique("nodb")).unwrap();
    let idem = builder.redis_namespace(namespace).build();
    let probe = Probe::default();
    let k = unique("nodb");
    let r = pay(&idem, k.clone(), 1, &probe, Mode::Ok).await;
    assert!(matches!(r, Err(TestError::Idem(idempotency::Error::Storage(_)))), "{r:?}");
    assert_eq!(probe.runs(), 0, "no body without a transaction");
    if let Some(client) = client {
        // The claim taken before the database failed was released.
        assert!(!redis_holds(&client, &redis_location(&idem, "t_pay", &k).await).await);
    }
}

with_and_without_redis!(
    #[tokio::test]
    unreachable_database_is_a_storage_error_and_runs_nothing,
    unreachable_database_is_a_storage_error_and_runs_nothing_with_redis => unreachable_database_is_a_storage_error
);
