//! Redis memory is bounded by the hot window, not by the ttl: on a private
//! `redis-server`, 5 000 finished calls with a 150-byte result (ttl 24 h)
//! cost at most twice the result's bytes each (`used_memory` before and
//! after, all results landed), and with a hot window of a second they leave
//! Redis (a 24 h ttl notwithstanding): memory = rate × hot window, whatever
//! the ttl.

use std::time::{Duration, Instant};

use idempotency::{Idem, idempotent};
use idempotency_testkit::servers::RedisServer;
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, Transaction};

const CALLS: usize = 5_000;
/// Long enough for every result of the run to be held at once.
const HOT_LONG: Duration = Duration::from_secs(120);
/// Short enough to watch the results leave.
const HOT_SHORT: Duration = Duration::from_secs(1);

#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    order_id: u64,
    note: String,
}

#[idempotent(key = "order_<order_id>", ttl = "24h", biz = "t_memory")]
async fn pay(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    order_id: u64,
) -> Result<Receipt, idempotency::Error> {
    let _ = tx;
    // A result of 150 bytes as JSON, whatever the id's width.
    let note = "n".repeat(150 - 23 - order_id.to_string().len());
    Ok(Receipt { order_id, note })
}

async fn engine(redis: &RedisServer, file: &std::path::Path, namespace: &str, hot: Duration) -> Idem<Sqlite> {
    // No fsync per commit: the database here only keeps the records.
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(file)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .synchronous(sqlx::sqlite::SqliteSynchronous::Off);
    let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(4).connect_with(options).await.expect("sqlite");
    let namespace = idempotency::Namespace::new(namespace).unwrap();
    let idem = Idem::builder(pool).redis(redis.client()).redis_namespace(namespace).redis_hot_window(hot).build();
    idem.migrate().await.expect("migrate");
    pay(&idem, 0).await.expect("warm up: the scripts loaded");
    idem
}

async fn until_held(redis: &RedisServer, namespace: &str, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while redis.results_held(namespace) < n {
        assert!(Instant::now() < deadline, "the results never all landed: {}", redis.results_held(namespace));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_results_cost_at_most_twice_their_bytes_and_leave_with_the_hot_window() {
    let Some(redis) = RedisServer::start() else { return };
    let file = std::env::temp_dir().join(format!("idem-memory-{}.db", idempotency_testkit::unique("m")));
    let idem = engine(&redis, &file, "mem_long", HOT_LONG).await;
    until_held(&redis, "mem_long", 1).await;

    let before = redis.used_memory();
    for order_id in 1..=CALLS as u64 {
        let receipt = pay(&idem, order_id).await.expect("call");
        assert_eq!(serde_json::to_string(&receipt).unwrap().len(), 150);
    }
    until_held(&redis, "mem_long", CALLS as i64 + 1).await;
    let per_result = (redis.used_memory() - before) as f64 / CALLS as f64;
    println!(
        "redis memory: {CALLS} results of 150 bytes: {per_result:.0} bytes each ({:.2}x the result)",
        per_result / 150.0
    );
    // The results' hashes are all this run added: claims are gone once
    // their results landed.
    assert!(per_result <= 300.0, "{per_result:.0} bytes per cached result, over twice its 150 bytes");

    // With a hot window of 1 s, the results leave Redis (long before their
    // 24 h ttl); older duplicates come from the record. Waited for, not
    // slept on: the bound only turns "kept for the ttl" into a failure.
    let short = engine(&redis, &file, "mem_short", HOT_SHORT).await;
    for order_id in 1..=200 {
        pay(&short, order_id).await.expect("call");
    }
    until_held(&redis, "mem_short", 1).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while redis.results_held("mem_short") > 0 {
        assert!(Instant::now() < deadline, "results outlived the hot window: {}", redis.results_held("mem_short"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (again, outcome) = idempotency::observe(pay(&short, 7)).await;
    assert_eq!((again.unwrap().order_id, outcome), (7, Some(idempotency::Outcome::Replayed)));
    let _ = std::fs::remove_file(file);
}
