//! Redis slow, paused or forgetful: claims whose answer came too late or
//! whose call was dropped are released, work that met the back-off is
//! retried, and a result Redis lost is replayed from the record.

use std::sync::Arc;
use std::time::Duration;

use idempotency::Status;
use idempotency_testkit::{redis_cached_response, redis_client, redis_forget, redis_pause, redis_value_after, unique};

use super::fixture::{
    Mode, Probe, Redis, TestError, engine, engine_on_private_redis, ledger_rows, pay, redis_location, until_held,
    until_started,
};

/// Regression: when Redis answers too late, the claim script may still have
/// run; that claim is released so retries do not wait out the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_whose_answer_came_too_late_is_released() {
    let Some((server, idem)) = engine_on_private_redis(Duration::from_millis(100)).await else { return };
    let probe = Probe::default();

    // Redis holds commands for 1.5 s: our claim waits in its queue, times
    // out on our side, then runs.
    redis_pause(&server.client(), 1_500).await;
    let k = unique("late");
    let started = std::time::Instant::now();
    let failed = pay(&idem, k.clone(), 2, &probe, Mode::Fail).await;
    assert!(matches!(failed, Err(TestError::Body)), "{failed:?}");
    assert!(started.elapsed() >= Duration::from_millis(100), "the claim timed out (the pause held it)");

    // The release follows within a few Redis timeouts; the lease is 30 s.
    let left =
        redis_value_after(&server.client(), &redis_location(&idem, "t_pay", &k).await.claim, Duration::from_secs(15))
            .await;
    assert_eq!(left, None, "the late claim was released");
}

/// Regression: a call dropped while its claim is on the way to Redis (its
/// client gave up) may still have claimed the key; that claim is released
/// rather than left for the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_of_a_call_dropped_while_redis_is_slow_is_released() {
    let Some((server, idem)) = engine_on_private_redis(Duration::from_secs(2)).await else { return };
    let probe = Probe::default();

    redis_pause(&server.client(), 600).await;
    let k = unique("dropped");
    let dropped = tokio::time::timeout(Duration::from_millis(100), pay(&idem, k.clone(), 2, &probe, Mode::Ok)).await;
    assert!(dropped.is_err(), "the call was still waiting for Redis: {dropped:?}");
    assert_eq!(probe.runs(), 0, "its body never started");

    // After the pause the claim lands; it is gone well before its 30 s lease.
    let left =
        redis_value_after(&server.client(), &redis_location(&idem, "t_pay", &k).await.claim, Duration::from_secs(15))
            .await;
    assert_eq!(left, None, "the dropped call's claim was released");
    let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 2, &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap().run, outcome), (1, Some(idempotency::Outcome::Executed)));
}

/// Regression: a failed body's release that meets the Redis back-off (another
/// call's Redis operation just timed out) is retried, not skipped: the
/// claim would otherwise answer `InProgress` to every retry for the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_during_the_redis_back_off_is_retried() {
    let Some((server, idem)) = engine_on_private_redis(Duration::from_millis(200)).await else { return };
    let probe = Arc::new(Probe::default());

    let k = unique("backoff");
    let held = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay(&idem, k, 2, &probe, Mode::HeldThenFail).await })
    };
    until_started(&probe, 1).await; // it holds its claim
    // Another Redis operation times out (a status query: it needs no write
    // lock, which SQLite's held transaction keeps): Redis is left alone for
    // the next second.
    redis_pause(&server.client(), 1_500).await;
    let started = std::time::Instant::now();
    let status = idem.status("t_pay", &unique("other")).await.unwrap();
    assert_eq!(status, Status::Absent);
    assert!(started.elapsed() >= Duration::from_millis(200), "the status query timed out (the pause held it)");
    // The held body fails inside that second; its release meets the back-off.
    probe.open();
    assert!(matches!(held.await.unwrap(), Err(TestError::Body)));

    let left =
        redis_value_after(&server.client(), &redis_location(&idem, "t_pay", &k).await.claim, Duration::from_secs(15))
            .await;
    assert_eq!(left, None, "the failed call's claim was released");
}

/// Regression: a cache write that meets the Redis back-off (another call's
/// Redis operation just timed out) is tried again later, so the claim does
/// not live out its 30 s lease: the key soon holds the finished result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_write_during_the_back_off_is_retried() {
    let Some((server, idem)) = engine_on_private_redis(Duration::from_millis(200)).await else { return };
    let probe = Arc::new(Probe::default());
    let k = unique("finish_backoff");
    let held = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay(&idem, k, 2, &probe, Mode::HeldThenOk).await })
    };
    until_held(&probe).await;
    redis_pause(&server.client(), 1_000).await;
    let started = std::time::Instant::now();
    assert_eq!(idem.status("t_pay", &unique("other")).await.unwrap(), Status::Absent);
    assert!(started.elapsed() >= Duration::from_millis(200), "the status query timed out (the pause held it)");
    // Within the back-off: the cache write is skipped at first.
    probe.open();
    let first = held.await.unwrap().unwrap();
    let cached = redis_cached_response(&server.client(), &redis_location(&idem, "t_pay", &k).await).await;
    assert_eq!(cached, serde_json::to_string(&first).unwrap());
    let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 2, &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap(), outcome), (first, Some(idempotency::Outcome::Replayed)));
    assert_eq!(probe.runs(), 1);
}

/// Regression: with a claim the record goes in last, so when Redis lost a
/// finished call's cached result, a duplicate runs its body; if that body
/// fails on what the first call left (an order already paid), the caller
/// still gets the first result, not the body's error.
#[tokio::test]
async fn duplicate_whose_body_fails_after_redis_lost_the_result_replays() {
    let Some(idem) = engine(&unique("db"), 4, Redis::On).await else { return };
    let Some(client) = redis_client().await else { return };
    let probe = Probe::default();
    let k = unique("lost");
    let first = pay(&idem, k.clone(), 5, &probe, Mode::Ok).await.unwrap();
    redis_forget(&client, &redis_location(&idem, "t_pay", &k).await).await; // evicted, flushed, restarted

    let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 5, &probe, Mode::Fail)).await;
    assert_eq!((again.unwrap(), outcome), (first, Some(idempotency::Outcome::Replayed)));
    redis_forget(&client, &redis_location(&idem, "t_pay", &k).await).await;
    let reused = pay(&idem, k.clone(), 6, &probe, Mode::Fail).await;
    assert!(matches!(reused, Err(TestError::Idem(idempotency::Error::KeyReused { .. }))), "{reused:?}");
    assert_eq!(probe.runs(), 3, "both duplicates ran their bodies, which failed");
    assert_eq!(ledger_rows(&idem, &k).await, 1);
}

/// A Redis that forgot the gate's scripts (restarted, failed over, `SCRIPT
/// FLUSH`) answers `NOSCRIPT`: the claim, the cache write and the release
/// each load their script again and go on, so Redis keeps gating (no fall
/// back to the database alone). `number_of_cached_scripts` shows which
/// script each step loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_redis_forgot_are_loaded_again() {
    let Some((server, idem)) = engine_on_private_redis(Duration::from_secs(2)).await else { return };
    let probe = Arc::new(Probe::default());
    let mut conn = server.client().get_multiplexed_async_connection().await.expect("redis");
    let flush = |mut conn: redis::aio::MultiplexedConnection| async move {
        let _: () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut conn).await.expect("SCRIPT FLUSH");
    };
    let cached_scripts = |mut conn: redis::aio::MultiplexedConnection| async move {
        let info: String = redis::cmd("INFO").arg("memory").query_async(&mut conn).await.expect("INFO");
        let line = info.lines().find_map(|l| l.strip_prefix("number_of_cached_scripts:")).expect("script count");
        line.trim().parse::<u32>().expect("a count")
    };

    // Every cache write before this point has landed (the engine's warm-up
    // call's went before this one's).
    let settled = unique("forgot_before");
    pay(&idem, settled.clone(), 1, &probe, Mode::Ok).await.unwrap();
    redis_cached_response(&server.client(), &redis_location(&idem, "t_pay", &settled).await).await;

    // The claim: held in Redis while the body runs.
    flush(conn.clone()).await;
    let k = unique("forgot");
    let held = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay(&idem, k, 2, &probe, Mode::HeldThenOk).await })
    };
    until_held(&probe).await;
    let at = redis_location(&idem, "t_pay", &k).await;
    let claim: Option<String> = redis::cmd("GET").arg(&at.claim).query_async(&mut conn).await.expect("GET");
    assert!(claim.is_some_and(|c| c.starts_with("p:")), "the claim is in Redis");
    assert_eq!(cached_scripts(conn.clone()).await, 1, "the claim script, loaded again");

    // The cache write, forgotten while the body ran.
    flush(conn.clone()).await;
    probe.open();
    let first = held.await.unwrap().unwrap();
    assert_eq!(redis_cached_response(&server.client(), &at).await, serde_json::to_string(&first).unwrap());
    assert_eq!(cached_scripts(conn.clone()).await, 1, "the cache write's script, loaded again");

    // A replay, from Redis.
    flush(conn.clone()).await;
    let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 2, &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap(), outcome), (first, Some(idempotency::Outcome::Replayed)));
    assert_eq!(cached_scripts(conn.clone()).await, 1, "the claim script, loaded again");

    // The release of a failed call: a retry goes ahead at once.
    flush(conn.clone()).await;
    let failing = unique("forgot_fail");
    assert!(matches!(pay(&idem, failing.clone(), 3, &probe, Mode::Fail).await, Err(TestError::Body)));
    assert_eq!(cached_scripts(conn.clone()).await, 2, "the claim's and the release's scripts");
    let claim = redis_location(&idem, "t_pay", &failing).await.claim;
    let left: Option<String> = redis::cmd("GET").arg(&claim).query_async(&mut conn).await.expect("GET");
    assert_eq!(left, None, "released on the caller's path");
    let (retried, outcome) = idempotency::observe(pay(&idem, failing, 3, &probe, Mode::Ok)).await;
    assert_eq!((retried.unwrap().run, outcome), (4, Some(idempotency::Outcome::Executed)));
    assert_eq!(probe.runs(), 4, "two first calls, the failed one and its retry");
}
