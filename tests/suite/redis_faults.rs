//! Redis slow, paused, forgetful or corrupt: claims whose answer came too
//! late or whose call was dropped are released, work that met the back-off
//! is retried, a result Redis lost is replayed from the record, and an
//! entry the gate did not write is a miss.

use std::sync::Arc;
use std::time::Duration;

use idempotency::{Idem, Outcome, Status};
use idempotency_testkit::servers::RedisServer;
use idempotency_testkit::{
    Location, TestBackend, redis_cached_response, redis_client, redis_forget, redis_pause, redis_pause_writes,
    redis_result, redis_unpause, redis_value_after, unique,
};

use super::fixture::{
    Mode, Probe, Receipt, Redis, TestError, engine, engine_on_private_redis, ledger_rows, pay, redis_location,
    until_held, until_started,
};
use super::{B, Db};

/// Regression: when Redis answers too late, the claim script may still have
/// run; that claim is released so retries do not wait out the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_whose_answer_came_too_late_is_released() {
    let Some((server, idem)) = engine_on_private_redis(Duration::from_millis(100)).await else { return };
    let probe = Probe::default();

    // Redis holds scripts until the call is over: our claim waits in its
    // queue, times out on our side, then runs.
    redis_pause_writes(&server.client()).await;
    let k = unique("late");
    let started = std::time::Instant::now();
    let failed = pay(&idem, k.clone(), 2, &probe, Mode::Fail).await;
    assert!(matches!(failed, Err(TestError::Body)), "{failed:?}");
    assert!(started.elapsed() >= Duration::from_millis(100), "the claim timed out (the pause held it)");
    redis_unpause(&server.client()).await;

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

    // Redis holds scripts until the call was dropped: its claim cannot
    // have been answered.
    redis_pause_writes(&server.client()).await;
    let k = unique("dropped");
    let dropped = tokio::time::timeout(Duration::from_millis(100), pay(&idem, k.clone(), 2, &probe, Mode::Ok)).await;
    assert!(dropped.is_err(), "the call was still waiting for Redis: {dropped:?}");
    assert_eq!(probe.runs(), 0, "its body never started");
    redis_unpause(&server.client()).await;

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

/// An engine on a private Redis whose hot window is longer than the clock
/// has run: every result of the test lives in window 0's hash, so a test
/// forges entries exactly where the engine reads and writes them. Its
/// generous Redis timeout keeps a loaded machine from backing Redis off.
async fn engine_in_window_zero() -> Option<(RedisServer, Idem<Db>)> {
    let server = RedisServer::start()?;
    let pool = B::open(&unique("db"), 4).await?;
    B::prepare(&pool).await;
    let idem = Idem::builder(pool)
        .redis(server.client())
        .redis_timeout(Duration::from_secs(10))
        .redis_hot_window(Duration::from_secs(1_000 * 365 * 86_400))
        .build();
    idem.migrate().await.expect("migrate");
    let warm = unique("warm");
    pay(&idem, warm.clone(), 1, &Probe::default(), Mode::Ok).await.unwrap();
    // Gated through Redis from the first call: its result is cached, in window 0.
    let at = redis_location(&idem, "t_pay", &warm).await;
    redis_cached_response(&server.client(), &at).await;
    let mut conn = server.client().get_multiplexed_async_connection().await.expect("redis");
    let in_zero: bool =
        redis::cmd("HEXISTS").arg(window_zero(&at)).arg(&at.field[..]).query_async(&mut conn).await.unwrap();
    assert!(in_zero, "the engine keeps its results in window 0");
    Some((server, idem))
}

/// Window 0's result hash of `at`'s shard.
fn window_zero(at: &Location) -> String {
    format!("{}0", at.results_prefix)
}

/// `EVALSHA` calls that failed so far (`INFO commandstats`): a script's
/// error counts there, an error it caught does not.
async fn failed_scripts(client: &redis::Client) -> u64 {
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.expect("INFO");
    let line = info.lines().find(|l| l.starts_with("cmdstat_evalsha:")).expect("evalsha ran");
    let failed = line.split(',').find_map(|f| f.strip_prefix("failed_calls=")).expect("failed_calls");
    failed.parse().expect("a count")
}

/// Whether a call on another key takes its claim in Redis: while its body
/// is held, the server holds a `p:` claim under its key (a call that met a
/// back-off would go to the database alone, and leave none).
async fn another_call_claims_in_redis(idem: &Idem<Db>, client: &redis::Client) -> bool {
    let probe = Arc::new(Probe::default());
    let k = unique("neighbour");
    let held = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay(&idem, k, 1, &probe, Mode::HeldThenOk).await })
    };
    until_held(&probe).await;
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let claim: Option<String> =
        redis::cmd("GET").arg(redis_location(idem, "t_pay", &k).await.claim).query_async(&mut conn).await.unwrap();
    probe.open();
    held.await.unwrap().unwrap();
    claim.is_some_and(|c| c.starts_with("p:"))
}

/// Regression (issue 32.5): one result-hash value shorter than the claim
/// script read made the script fail; the engine took that for Redis down
/// and went to the database alone for a second, for every key, and every
/// call of the bad key did it again. Now whatever the gate did not write
/// (too short, another tag, a response that is not UTF-8, a result hash of
/// another type), forged where the call reads it, is a miss: a new key's
/// call runs, a finished key's duplicate replays its record (its body
/// rolled back: one ledger row), the bad entry is replaced by the call's
/// result, no claim script fails (`INFO commandstats`), and the next call
/// on another key still claims in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_cached_result_is_a_miss_not_an_outage() {
    let Some((server, idem)) = engine_in_window_zero().await else { return };
    let client = server.client();
    let probe = Probe::default();
    let conn = client.get_multiplexed_async_connection().await.expect("redis");
    let failed_before = failed_scripts(&client).await;
    let head = idempotency::redis_layout::result_value(i64::MAX >> 16, &"0".repeat(64), "");
    let mut not_utf8 = idempotency::redis_layout::result_value(i64::MAX >> 16, &"0".repeat(64), "{");
    not_utf8.push(0xff);
    let shapes: [(&str, Option<Vec<u8>>); 5] = [
        ("cut short", Some(head[..4].to_vec())),
        ("empty", Some(Vec::new())),
        ("another tag", Some([&b"x"[..], &head[1..], b"{}"].concat())),
        ("a response that is not UTF-8", Some(not_utf8)),
        ("a result hash of another type", None),
    ];
    let forge = |at: Location, bad: Option<Vec<u8>>| {
        let mut conn = conn.clone();
        async move {
            let hash = window_zero(&at);
            let _: () = match bad {
                Some(bytes) => redis::cmd("HSET").arg(&hash).arg(&at.field[..]).arg(bytes).query_async(&mut conn).await,
                None => redis::cmd("SET").arg(&hash).arg("x").query_async(&mut conn).await,
            }
            .expect("forge");
        }
    };
    // The bad entry is dropped, and the call's own result takes its place
    // once its cache write lands (in a hash again, where a string was).
    let holds_the_result = |what: &'static str, at: Location, receipt: Receipt| {
        let client = client.clone();
        async move {
            let response = serde_json::to_string(&receipt).unwrap();
            let start = std::time::Instant::now();
            loop {
                let held = redis_result(&client, &at).await;
                let read = held.clone().and_then(idempotency::redis_layout::parse_result);
                if read.is_some_and(|(_, _, cached)| cached == response) {
                    return;
                }
                assert!(start.elapsed() < Duration::from_secs(30), "{what}: Redis holds {held:?}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };

    for (what, bad) in shapes {
        // No record: the call runs, once.
        let k = unique("corrupt_new");
        let at = redis_location(&idem, "t_pay", &k).await;
        forge(at.clone(), bad.clone()).await;
        let runs = probe.runs();
        let (first, outcome) = idempotency::observe(pay(&idem, k.clone(), 3, &probe, Mode::Ok)).await;
        let first = first.unwrap_or_else(|e| panic!("{what}: {e:?}"));
        assert_eq!((outcome, probe.runs()), (Some(Outcome::Executed), runs + 1), "{what}");
        assert!(another_call_claims_in_redis(&idem, &client).await, "{what}: Redis gates the other keys");
        holds_the_result(what, at, first).await;

        // A finished call: its duplicate replays the record.
        let k = unique("corrupt_done");
        let at = redis_location(&idem, "t_pay", &k).await;
        let first = pay(&idem, k.clone(), 4, &probe, Mode::Ok).await.unwrap();
        redis_cached_response(&client, &at).await; // its cache write landed
        forge(at.clone(), bad).await;
        let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 4, &probe, Mode::Ok)).await;
        assert_eq!((again.unwrap(), outcome), (first.clone(), Some(Outcome::Replayed)), "{what}");
        // With a claim the record goes in last: the duplicate's body ran,
        // met the record and rolled back.
        assert_eq!(ledger_rows(&idem, &k).await, 1, "{what}");
        assert!(another_call_claims_in_redis(&idem, &client).await, "{what}: Redis gates the other keys");
        holds_the_result(what, at, first).await;
    }
    assert_eq!(failed_scripts(&client).await, failed_before, "no claim script failed");
}
