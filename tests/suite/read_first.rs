//! A fn whose calls are mostly replays reads before it claims: without
//! Redis its record (a finished key answered by one statement), with Redis
//! its cached result (one `HGET`, no claim script). The read never decides
//! who runs: an expired key executes again, a reused key is `KeyReused`,
//! and a fn whose calls turn into first calls stops reading.

use std::time::{Duration, Instant};

use idempotency::Idem;
use idempotency_testkit::servers::RedisServer;
use idempotency_testkit::{TestBackend, unique};

use super::fixture::{Mode, Probe, Redis, TestError, engine, expire_now, ledger_rows, pay};
use super::statements::round_trips::{counted, settled};
use super::{B, Db};
use idempotency_testkit::forwarder::Forwarder;

/// The round trips one `pay` of `k` waits for (a replay: checked to be
/// one), counted on the wire; SQLite's are calls into the library, none.
async fn round_trips_of_a_replay(idem: &Idem<Db>, link: Option<&Forwarder>, k: &str, run: usize, probe: &Probe) -> u64 {
    let before = match link {
        Some(link) => settled(link, idem.pool()).await.statements,
        None => 0,
    };
    let runs = probe.runs();
    let replay = pay(idem, k.to_owned(), 1, probe, Mode::Ok).await.expect("replay");
    assert_eq!((replay.run, probe.runs()), (run, runs), "a replay executed");
    match link {
        Some(link) => settled(link, idem.pool()).await.statements - before,
        None => 0,
    }
}

#[tokio::test]
async fn a_fn_of_replays_is_answered_by_one_read_and_stops_reading_when_calls_are_new() {
    // On a server, through a forwarder that counts the round trips.
    let (link, idem) = match counted().await {
        Some((link, pool)) => {
            let idem = Idem::builder(pool).build();
            idem.migrate().await.expect("migrate");
            (Some(link), idem)
        }
        None if B::NAME == "sqlite" => match engine(&unique("db"), 4, Redis::Off).await {
            Some(idem) => (None, idem),
            None => return,
        },
        None => return,
    };
    let link = link.as_ref();
    let probe = Probe::default();
    // Every statement prepared on the connection once (a replay reads the
    // key's row), and the fn's count at rest again after a first call.
    let warm = unique("rf_warm");
    pay(&idem, warm.clone(), 1, &probe, Mode::Ok).await.unwrap();
    pay(&idem, warm, 1, &probe, Mode::Ok).await.unwrap();
    pay(&idem, unique("rf_warm"), 1, &probe, Mode::Ok).await.unwrap();
    let k = unique("rf");
    let run = pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap().run;
    // The fn's first replay goes through the unique index: no reason yet
    // to expect a duplicate.
    let through_the_index = round_trips_of_a_replay(&idem, link, &k, run, &probe).await;
    round_trips_of_a_replay(&idem, link, &k, run, &probe).await;
    let read_first = round_trips_of_a_replay(&idem, link, &k, run, &probe).await;
    if B::NAME != "sqlite" {
        assert_eq!(through_the_index, 2, "the insert refused, the row read");
        assert_eq!(read_first, 1, "a replay once replays dominate: one read");
    }

    // New keys while it reads first: each executes (the read found
    // nothing), and two of them turn the read off again.
    for _ in 0..2 {
        let fresh = unique("rf_new");
        let receipt = pay(&idem, fresh.clone(), 1, &probe, Mode::Ok).await.unwrap();
        assert_eq!((receipt.run, ledger_rows(&idem, &fresh).await), (probe.runs(), 1));
    }
    let off_again = round_trips_of_a_replay(&idem, link, &k, run, &probe).await;
    if B::NAME != "sqlite" {
        assert_eq!(off_again, through_the_index, "after first calls, replays go through the index again");
    }
    assert_eq!(ledger_rows(&idem, &k).await, 1);
}

#[tokio::test]
async fn the_read_never_decides_who_runs() {
    let Some(idem) = engine(&unique("db"), 4, Redis::Off).await else { return };
    let probe = Probe::default();
    let k = unique("rf");
    pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap();
    for _ in 0..3 {
        assert_eq!(pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap().run, 1);
    }

    // Other arguments under the same key: refused, as through the index.
    let reused = pay(&idem, k.clone(), 2, &probe, Mode::Ok).await;
    assert!(matches!(reused, Err(TestError::Idem(idempotency::Error::KeyReused { .. }))), "{reused:?}");

    // The record expired (forced by SQL): the read finds it dead and the
    // call executes again, its record replaced.
    expire_now(&idem, "t_pay", &k).await;
    let again = pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap();
    assert_eq!((again.run, probe.runs(), ledger_rows(&idem, &k).await), (2, 2, 2));
    assert_eq!(pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap().run, 2, "the new record replays");
}

/// How many `HGET`s and `EVALSHA`s `server` has run (`INFO commandstats`;
/// the `HGET`s a script runs count too).
fn hgets_and_scripts(server: &RedisServer) -> (i64, i64) {
    let calls = server.calls();
    let of = |command: &str| calls.get(command).copied().unwrap_or(0);
    (of("hget"), of("evalsha"))
}

/// Waits until `server` holds `n` cached results: a call's result is
/// written to Redis off its path, after it answered.
async fn until_cached(server: &RedisServer, idem: &Idem<Db>, n: i64) {
    let namespace = idem.redis_namespace().await.expect("namespace").expect("migrated");
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.results_held(namespace.as_str()) < n {
        assert!(Instant::now() < deadline, "the results never landed: {}", server.results_held(namespace.as_str()));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The `HGET`s and scripts one replay of `k` sends to `server`.
async fn commands_of_a_replay(server: &RedisServer, idem: &Idem<Db>, k: &str, probe: &Probe) -> (i64, i64) {
    let (runs, (hgets, scripts)) = (probe.runs(), hgets_and_scripts(server));
    let replay = pay(idem, k.to_owned(), 1, probe, Mode::Ok).await.expect("replay");
    assert_eq!((replay.run, probe.runs()), (1, runs), "a replay executed");
    let (hgets_after, scripts_after) = hgets_and_scripts(server);
    (hgets_after - hgets, scripts_after - scripts)
}

#[tokio::test]
async fn with_redis_a_fn_of_replays_is_answered_by_one_hget_and_stops_reading_when_calls_are_new() {
    let Some(server) = RedisServer::start() else { return };
    let Some(pool) = B::open(&unique("db"), 4).await else { return };
    B::prepare(&pool).await;
    // Windows of a thousand years: the test never straddles two (the HGET
    // reads this window's hash; a result of the window before is the claim's).
    let hot_window = Duration::from_secs(1_000 * 365 * 86_400);
    let idem = Idem::builder(pool).redis(server.client()).redis_hot_window(hot_window).build();
    idem.migrate().await.expect("migrate");
    let probe = Probe::default();
    let k = unique("rf");
    pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap();
    until_cached(&server, &idem, 1).await;

    // No reason yet to expect a duplicate: the claim script finds the
    // result (its first HGET, of this window's hash).
    assert_eq!(commands_of_a_replay(&server, &idem, &k, &probe).await, (1, 1));
    assert_eq!(commands_of_a_replay(&server, &idem, &k, &probe).await, (1, 1));
    // Replays dominate: one HGET, no script.
    assert_eq!(commands_of_a_replay(&server, &idem, &k, &probe).await, (1, 0));
    assert_eq!(commands_of_a_replay(&server, &idem, &k, &probe).await, (1, 0));

    // Other arguments under the same key: refused, read the same way.
    let (hgets, scripts) = hgets_and_scripts(&server);
    let reused = pay(&idem, k.clone(), 2, &probe, Mode::Ok).await;
    assert!(matches!(reused, Err(TestError::Idem(idempotency::Error::KeyReused { .. }))), "{reused:?}");
    assert_eq!(hgets_and_scripts(&server), (hgets + 1, scripts));

    // New keys while it reads: each HGET finds nothing, the claim decides
    // and each executes; two of them turn the read off again.
    for n in 0..2 {
        let fresh = unique("rf_new");
        let (hgets, _) = hgets_and_scripts(&server);
        let receipt = pay(&idem, fresh.clone(), 1, &probe, Mode::Ok).await.unwrap();
        assert_eq!((receipt.run, ledger_rows(&idem, &fresh).await), (probe.runs(), 1));
        // Its own HGET, then the script's two (both windows).
        assert_eq!(hgets_and_scripts(&server).0, hgets + 3, "looked for first");
        until_cached(&server, &idem, 2 + n).await;
    }
    assert_eq!(commands_of_a_replay(&server, &idem, &k, &probe).await, (1, 1), "claimed again");
    assert_eq!(ledger_rows(&idem, &k).await, 1);
}
