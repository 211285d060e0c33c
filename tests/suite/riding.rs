//! The record's statements riding with `BEGIN` and `COMMIT` (one text
//! each, `store/text.rs`), as an engine sends them where its database is at
//! least half a millisecond away: the contract holds there too. Each engine
//! reaches its server through a forwarder that holds every byte 0.5 ms each
//! way (the rest of the suite runs on loopback, where the statements go
//! bound, one by one).

use idempotency::Idem;
use idempotency_testkit::forwarder::Forwarder;
use idempotency_testkit::{redis_client, unique};

use super::Db;
use super::fixture::{
    Mode, Probe, Redis, TestError, expire_now, ledger_rows, pay, record_rows_for, until_expired, with_and_without_redis,
};
use super::statements::round_trips::far;
use super::storms::storm;

/// An engine 1 ms from its database (and from Redis, if any, on loopback).
async fn far_engine(redis: Redis, connections: u32) -> Option<(Forwarder, Idem<Db>)> {
    let (link, pool) = far(connections).await?;
    let builder = Idem::builder(pool);
    let idem = match redis {
        Redis::On => builder.redis(redis_client().await?).build(),
        _ => builder.build(),
    };
    idem.migrate().await.expect("migrate");
    Some((link, idem))
}

/// A first call and its replays; other arguments under its key; its record
/// expired (forced by SQL): it runs again, its expired row replaced in the
/// same transaction as the body (under a claim, the insert the unique index
/// refused is taken back to its savepoint on PostgreSQL, the body's writes
/// kept), and that record replays.
async fn contract(redis: Redis) {
    let Some((_link, idem)) = far_engine(redis, 2).await else { return };
    let probe = Probe::default();
    let k = unique("ride");
    let first = pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap();
    for _ in 0..3 {
        assert_eq!(pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap(), first);
    }
    let reused = pay(&idem, k.clone(), 2, &probe, Mode::Ok).await;
    assert!(matches!(reused, Err(TestError::Idem(idempotency::Error::KeyReused { .. }))), "{reused:?}");
    assert_eq!((probe.runs(), ledger_rows(&idem, &k).await), (1, 1));

    expire_now(&idem, "t_pay", &k).await;
    until_expired(&idem, "t_pay", &k).await;
    let again = pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap();
    assert_eq!(again.run, 2, "executed again after expiry");
    assert_eq!(pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap(), again);
    assert_eq!(ledger_rows(&idem, &k).await, 2, "both bodies' writes committed");
    assert_eq!(record_rows_for(&idem, "t_pay", &k).await, 1, "the expired row was replaced");

    // A failing body leaves nothing, and a retry runs.
    let k = unique("ride_fail");
    assert!(matches!(pay(&idem, k.clone(), 1, &probe, Mode::Fail).await, Err(TestError::Body)));
    assert_eq!((ledger_rows(&idem, &k).await, record_rows_for(&idem, "t_pay", &k).await), (0, 0));
    let retried = pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap();
    assert_eq!((retried.run, ledger_rows(&idem, &k).await), (probe.runs(), 1));
}

with_and_without_redis!(
    #[tokio::test]
    a_far_engine_keeps_the_contract,
    a_far_engine_keeps_the_contract_with_redis => contract
);

/// Callers on two engines, both far, one key at once: the one whose
/// record went in first runs; the others wait on the unique index (their
/// `BEGIN` text's insert) or on the claim, and replay it.
async fn storm_far(redis: Redis) {
    let Some((_a_link, a)) = far_engine(redis, 6).await else { return };
    let Some((_b_link, b)) = far_engine(redis, 6).await else { return };
    storm(vec![a, b], 24).await;
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_storm_over_two_far_engines_runs_once,
    a_storm_over_two_far_engines_runs_once_with_redis => storm_far
);
