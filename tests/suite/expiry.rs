//! Expiry: an expired record lets the next call execute, and a cached
//! result written late never outlives its record.

use std::sync::Arc;
use std::time::Duration;

use idempotency_testkit::{redis_cached_response, redis_pause, unique};

use super::fixture::{
    Mode, Probe, Redis, engine, engine_on_private_redis, expire_now, ledger_rows, pay, pay_short_ttl, record_rows_for,
    redis_location, until_expired, until_held, with_and_without_redis,
};

/// A long ttl, the expiry forced (`expire_now`): the replay before it and
/// the execution after it do not depend on how fast the calls run.
async fn expired_record_executes_again(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = unique("ttl");
    let first = pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap();
    assert_eq!(pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap(), first);
    expire_now(&idem, "t_pay", &k).await;
    until_expired(&idem, "t_pay", &k).await;
    let second = pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap();
    assert_eq!(second.run, 2, "executed again after expiry");
    assert_eq!(pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap(), second);
    assert_eq!(ledger_rows(&idem, &k).await, 2);
    assert_eq!(record_rows_for(&idem, "t_pay", &k).await, 1, "the expired row was replaced");
}

with_and_without_redis!(
    #[tokio::test]
    expired_record_lets_the_next_call_execute,
    expired_record_lets_the_next_call_execute_with_redis => expired_record_executes_again
);

/// Regression: a cached result written late (Redis paused while the cache
/// write waited) carries its record's expiry: once the record expired, the
/// copy is a miss and the next call executes, rather than replaying it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_result_written_late_does_not_outlive_its_record() {
    let Some((server, idem)) = engine_on_private_redis(Duration::from_secs(10)).await else { return };
    let probe = Arc::new(Probe::default());
    let k = unique("late_cache");
    let first = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay_short_ttl(&idem, k, &probe, Mode::HeldThenOk).await })
    };
    until_held(&probe).await;
    // The cache write after the commit waits 2.5 s in Redis; the record
    // (ttl 1 s) expires meanwhile.
    redis_pause(&server.client(), 2_500).await;
    probe.open();
    let first = first.await.unwrap().unwrap();
    let at = redis_location(&idem, "t_ttl", &k).await;
    let cached = redis_cached_response(&server.client(), &at).await;
    assert_eq!(cached, serde_json::to_string(&first).unwrap(), "the late write landed");
    until_expired(&idem, "t_ttl", &k).await;

    let (again, outcome) = idempotency::observe(pay_short_ttl(&idem, k.clone(), &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap().run, outcome), (2, Some(idempotency::Outcome::Executed)), "the stale copy was a miss");
    assert_eq!(ledger_rows(&idem, &k).await, 2);
}
