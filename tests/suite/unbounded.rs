//! `Duration::MAX` for an engine's settings means "no bound", never a
//! panic (an instant past what the clock counts) nor an expiry Redis
//! refuses: `lock_wait`, `redis_timeout`, the hot window, the local cache's
//! age and the tokens' `used_for` each do what the longest setting does, as
//! does `wait` for a call in steps mode. (`wait` for a plain call is in
//! `waits.rs`.)

use std::sync::Arc;
use std::time::Duration;

use idempotency::{Consumption, Idem, LocalCache, Outcome, Steps, idempotent};
use idempotency_testkit::servers::RedisServer;
use idempotency_testkit::{TestBackend, redis_cached_response, redis_client, redis_pause, unique};

use super::fixture::{Mode, Probe, TestError, ledger_rows, lent, pay, redis_location, until, until_held};
use super::{B, Db};

/// `lock_wait(Duration::MAX)`: a duplicate on this engine waits in memory,
/// one on another engine on the record's unique index (its transaction
/// open), until the first call commits; both replay it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_wait_of_duration_max_waits_for_the_first_call() {
    let Some(pool) = B::open(&unique("db"), 8).await else { return };
    B::prepare(&pool).await;
    let engine = || Idem::builder(pool.clone()).lock_wait(Duration::MAX).build();
    let (a, b) = (engine(), engine());
    a.migrate().await.expect("migrate");
    let (probe, k) = (Arc::new(Probe::default()), unique("lock-max"));
    let spawn = |idem: &Idem<Db>, mode| {
        let (idem, k, probe) = (idem.clone(), k.clone(), Arc::clone(&probe));
        tokio::spawn(async move { idempotency::observe(pay(&idem, k, 3, &probe, mode)).await })
    };
    let first = spawn(&a, Mode::HeldThenOk);
    until_held(&probe).await;
    let here = spawn(&a, Mode::Ok);
    let elsewhere = spawn(&b, Mode::Ok);
    until("the other engine's duplicate waits in its transaction", || lent(&b) == 1).await;
    assert!(!here.is_finished() && !elsewhere.is_finished());
    probe.open();
    let (first, outcome) = first.await.unwrap();
    let first = first.expect("the first call");
    assert_eq!(outcome, Some(Outcome::Executed));
    for duplicate in [here, elsewhere] {
        let (answered, outcome) = duplicate.await.unwrap();
        assert_eq!((answered.expect("replayed"), outcome), (first.clone(), Some(Outcome::Replayed)));
    }
    assert_eq!((probe.runs(), ledger_rows(&a, &k).await), (1, 1));
}

/// `redis_timeout(Duration::MAX)`: a call waits for Redis however long it
/// takes: paused for a while, Redis still claims the call (its result is
/// cached there, which a call on the database alone never does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_timeout_of_duration_max_waits_for_redis() {
    let Some(server) = RedisServer::start() else { return };
    let Some(pool) = B::open(&unique("db"), 4).await else { return };
    B::prepare(&pool).await;
    let idem = Idem::builder(pool).redis(server.client()).redis_timeout(Duration::MAX).build();
    idem.migrate().await.expect("migrate");
    let probe = Probe::default();
    pay(&idem, unique("warm"), 1, &probe, Mode::Ok).await.expect("warm");

    let k = unique("timeout-max");
    // Past the default timeout (500 ms): a bounded call would go on alone.
    redis_pause(&server.client(), 1_500).await;
    let (first, outcome) = idempotency::observe(pay(&idem, k.clone(), 2, &probe, Mode::Ok)).await;
    let first = first.expect("the call");
    assert_eq!(outcome, Some(Outcome::Executed));
    let cached = redis_cached_response(&server.client(), &redis_location(&idem, "t_pay", &k).await).await;
    assert_eq!(cached, serde_json::to_string(&first).unwrap(), "claimed and cached through Redis");
    let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 2, &probe, Mode::Ok)).await;
    assert_eq!((again.expect("replayed"), outcome), (first, Some(Outcome::Replayed)));
}

/// Regression (issue 52.4): `redis_hot_window(Duration::MAX)` overflowed
/// the result hash's expiry at the first claim. It keeps results for a
/// century (within what Redis takes): cached, and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_window_of_duration_max_keeps_results() {
    let Some(client) = redis_client().await else { return };
    let Some(pool) = B::open(&unique("db"), 4).await else { return };
    B::prepare(&pool).await;
    let idem = Idem::builder(pool).redis(client.clone()).redis_hot_window(Duration::MAX).build();
    idem.migrate().await.expect("migrate");
    let (probe, k) = (Probe::default(), unique("hot-max"));
    let first = pay(&idem, k.clone(), 2, &probe, Mode::Ok).await.expect("the call");
    let at = redis_location(&idem, "t_pay", &k).await;
    assert_eq!(redis_cached_response(&client, &at).await, serde_json::to_string(&first).unwrap());
    let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 2, &probe, Mode::Ok)).await;
    assert_eq!((again.expect("replayed"), outcome), (first, Some(Outcome::Replayed)));
    assert_eq!(probe.runs(), 1);
    idempotency_testkit::redis_forget(&client, &at).await;
}

/// `LocalCache::max_age(Duration::MAX)`: an entry answers until its record
/// expires, however old (by an age clock moved past any bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_cache_age_of_duration_max_answers_until_the_record_expires() {
    let Some(pool) = B::open(&unique("db"), 4).await else { return };
    B::prepare(&pool).await;
    let age = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let clock = Arc::clone(&age);
    let cache = LocalCache::new(100, 1 << 20)
        .max_age(Duration::MAX)
        .age_clock(move || Duration::from_secs(clock.load(std::sync::atomic::Ordering::SeqCst)));
    let idem = Idem::builder(pool).local_cache(cache).build();
    idem.migrate().await.expect("migrate");
    let (probe, k) = (Probe::default(), unique("age-max"));
    let first = pay(&idem, k.clone(), 2, &probe, Mode::Ok).await.expect("the call");
    // A thousand years on: older than any bound but none.
    age.store(1_000 * 365 * 86_400, std::sync::atomic::Ordering::SeqCst);
    // Answered from this process: the record is gone from the database.
    let deleted = sqlx::query(B::DELETE_RECORD).bind("t_pay").bind(&k).execute(idem.pool()).await.unwrap();
    assert_eq!(deleted.rows_affected(), 1);
    let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 2, &probe, Mode::Ok)).await;
    assert_eq!((again.expect("replayed from the local cache"), outcome), (first, Some(Outcome::Replayed)));
    assert_eq!(probe.runs(), 1);
}

/// Regression (issue 52.4): `token_used_for(Duration::MAX)` marked a
/// consumed token used in Redis with an expiry Redis refuses, so its owner
/// key still said "issued". It is marked used, for a century.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_used_for_duration_max_are_marked_used() {
    let Some(server) = RedisServer::start() else { return };
    let Some(pool) = B::open(&unique("db"), 4).await else { return };
    B::prepare(&pool).await;
    let idem = Idem::builder(pool).redis(server.client()).token_used_for(Duration::MAX).build();
    idem.migrate().await.expect("migrate");
    let tokens = idem.tokens();
    let issued = tokens.issue("t_tok", "alice", Duration::from_secs(3_600)).await.expect("issued");
    assert!(matches!(tokens.consume("t_tok", "alice", &issued.token).await, Ok(Consumption::Consumed(_))));
    let mut conn = server.client().get_multiplexed_async_connection().await.unwrap();
    let owners: Vec<String> = redis::cmd("KEYS").arg("*tok.owner*").query_async(&mut conn).await.unwrap();
    assert_eq!(owners.len(), 1, "{owners:?}");
    let value: String = redis::cmd("GET").arg(&owners[0]).query_async(&mut conn).await.unwrap();
    assert!(value.starts_with("u:"), "marked used: {value}");
    let pttl: i64 = redis::cmd("PTTL").arg(&owners[0]).query_async(&mut conn).await.unwrap();
    assert!(pttl > 50 * 365 * 86_400_000, "kept for a century: {pttl} ms");
    assert!(matches!(tokens.consume("t_tok", "alice", &issued.token).await, Ok(Consumption::AlreadyUsed)));
}

/// A call in steps mode, its one step counted.
#[idempotent(key = "<k>", ttl = "1h", biz = "t_steps_max", steps)]
async fn charge(
    idem: &Idem<Db>,
    steps: &mut Steps<Db>,
    k: String,
    #[idem(skip)] probe: &Probe,
) -> Result<usize, TestError> {
    let _ = &k;
    let run = steps
        .step("charge", |_| async {
            Ok::<_, TestError>(probe.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1)
        })
        .await?;
    Ok(run)
}

/// Regression (issue 52.4): in steps mode every call on an engine with
/// `wait(Duration::MAX)` panicked ("overflow when adding duration to
/// instant"): the call runs its step once, and a second call replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steps_call_with_a_wait_of_duration_max_runs_and_replays() {
    let Some(client) = redis_client().await else { return };
    let Some(pool) = B::open(&unique("db"), 4).await else { return };
    B::prepare(&pool).await;
    let idem = Idem::builder(pool).redis(client).wait(Duration::MAX).build();
    idem.migrate().await.expect("migrate");
    let (probe, k) = (Probe::default(), unique("steps-max"));
    let (first, outcome) = idempotency::observe(charge(&idem, k.clone(), &probe)).await;
    assert_eq!((first.expect("ran"), outcome), (1, Some(Outcome::Executed)));
    let (again, outcome) = idempotency::observe(charge(&idem, k.clone(), &probe)).await;
    assert_eq!((again.expect("replayed"), outcome), (1, Some(Outcome::Replayed)));
    assert_eq!(probe.runs(), 1);
}
