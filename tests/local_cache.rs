//! The local replay cache on SQLite, MariaDB and PostgreSQL, with Redis:
//! it answers without Redis or the database, refuses other arguments with
//! `KeyReused` exactly as they do, never outlives its record or its
//! `max_age`, and never holds a running or failed call.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use idempotency::{Idem, LocalCache, Outcome, idempotent};
use idempotency_testkit::TestBackend;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    key: String,
    amount: i64,
    run: usize,
}

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug in assertion messages
enum TestError {
    Idem(idempotency::Error),
    Body,
}

impl From<idempotency::Error> for TestError {
    fn from(e: idempotency::Error) -> Self {
        TestError::Idem(e)
    }
}

/// Counts body runs; a body fails while `fail` is set and waits at `gate`
/// while `hold` is set.
struct Probe {
    runs: AtomicUsize,
    fail: std::sync::atomic::AtomicBool,
    hold: std::sync::atomic::AtomicBool,
    held: AtomicUsize,
    gate: tokio::sync::Semaphore,
}

impl Default for Probe {
    fn default() -> Self {
        Probe {
            runs: AtomicUsize::new(0),
            fail: Default::default(),
            hold: Default::default(),
            held: AtomicUsize::new(0),
            gate: tokio::sync::Semaphore::new(0),
        }
    }
}

impl Probe {
    async fn body(&self, key: String, amount: i64) -> Result<Receipt, TestError> {
        let run = self.runs.fetch_add(1, SeqCst) + 1;
        if self.hold.load(SeqCst) {
            self.held.fetch_add(1, SeqCst);
            self.gate.acquire().await.expect("gate").forget();
        }
        if self.fail.load(SeqCst) {
            return Err(TestError::Body);
        }
        Ok(Receipt { key, amount, run })
    }
}

fn unique(prefix: &str) -> String {
    use std::sync::atomic::AtomicU64;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("{prefix}-{}-{nanos}-{}", std::process::id(), NEXT.fetch_add(1, SeqCst))
}

fn required() -> bool {
    std::env::var("IDEM_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

async fn redis() -> Option<redis::Client> {
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let client = redis::Client::open(url).ok()?;
    match client.get_multiplexed_async_connection().await {
        Ok(_) => Some(client),
        Err(e) => {
            assert!(!required(), "redis unreachable: {e}");
            println!("skipped: redis unreachable ({e})");
            None
        }
    }
}

/// Deletes every Redis key of `(biz, key)` on `idem`'s namespace.
async fn forget_in_redis(client: &redis::Client, namespace: &str, biz: &str, key: &str) {
    let at = idempotency::redis_layout::locate(namespace, biz, key).expect("namespace");
    idempotency_testkit::redis_forget(client, &at).await;
}

macro_rules! local_cache_suite {
    ($backend:ident, $db:ty, $delete:expr, $connect:expr) => {
        mod $backend {
            use super::*;

            type Db = $db;

            #[idempotent(key = "<k>", ttl = "1h", biz = "t_local")]
            async fn pay(
                idem: &Idem<Db>,
                k: String,
                amount: i64,
                #[idem(skip)] probe: &Probe,
            ) -> Result<Receipt, TestError> {
                probe.body(k, amount).await
            }

            #[idempotent(key = "<k>", ttl = "1s", biz = "t_local_ttl")]
            async fn pay_short_ttl(
                idem: &Idem<Db>,
                k: String,
                amount: i64,
                #[idem(skip)] probe: &Probe,
            ) -> Result<Receipt, TestError> {
                probe.body(k, amount).await
            }

            async fn engine(cache: LocalCache) -> Option<(Idem<Db>, redis::Client)> {
                let client = redis().await?;
                let connect: fn() -> _ = $connect;
                let pool = match connect().await {
                    Ok(pool) => pool,
                    Err(e) => {
                        assert!(!required(), "{} unreachable: {e}", stringify!($backend));
                        println!("skipped: {} unreachable ({e})", stringify!($backend));
                        return None;
                    }
                };
                let idem = Idem::builder(pool).redis(client.clone()).local_cache(cache).build();
                idem.migrate().await.expect("migrate");
                Some((idem, client))
            }

            async fn forget_record(idem: &Idem<Db>, biz: &str, k: &str) {
                sqlx::query($delete).bind(biz).bind(k).execute(idem.pool()).await.expect("delete record");
            }

            /// Redis and the record both lose the key: the local copy still
            /// answers, byte for byte, and other arguments get `KeyReused`.
            #[tokio::test]
            async fn replays_locally_and_refuses_other_arguments() {
                let Some((idem, client)) =
                    engine(LocalCache::new(1_000, 1 << 20).max_age(Duration::from_secs(60))).await
                else {
                    return;
                };
                let namespace = idem.redis_namespace().await.unwrap().unwrap();
                let probe = Probe::default();
                let k = unique("local");
                let first = pay(&idem, k.clone(), 5, &probe).await.unwrap();
                forget_in_redis(&client, namespace.as_str(), "t_local", &k).await;
                forget_record(&idem, "t_local", &k).await;

                let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 5, &probe)).await;
                assert_eq!((again.unwrap(), outcome), (first.clone(), Some(Outcome::Replayed)));
                let (reused, outcome) = idempotency::observe(pay(&idem, k.clone(), 6, &probe)).await;
                assert!(matches!(reused, Err(TestError::Idem(idempotency::Error::KeyReused { .. }))), "{reused:?}");
                assert_eq!(outcome, Some(Outcome::KeyReused));
                assert_eq!(probe.runs.load(SeqCst), 1, "answered from the local cache alone");

                // Another engine (another instance) has no local copy: it executes.
                let other = Idem::builder(idem.pool().clone()).redis(client.clone()).build();
                let (elsewhere, outcome) = idempotency::observe(pay(&other, k.clone(), 5, &probe)).await;
                assert_eq!((elsewhere.unwrap().run, outcome), (2, Some(Outcome::Executed)));
            }

            /// A local copy answers no longer than its record's ttl.
            #[tokio::test]
            async fn never_outlives_the_record() {
                let Some((idem, _client)) =
                    engine(LocalCache::new(1_000, 1 << 20).max_age(Duration::from_secs(3_600))).await
                else {
                    return;
                };
                let probe = Probe::default();
                let k = unique("local_ttl");
                // Cached here (`replays_locally_and_refuses_other_arguments`
                // shows a copy answers); no second call is asserted to come
                // within the 1 s ttl, which a loaded machine may not meet.
                pay_short_ttl(&idem, k.clone(), 5, &probe).await.unwrap();
                let start = std::time::Instant::now();
                while idem.status("t_local_ttl", &k).await.unwrap() != idempotency::Status::Expired {
                    assert!(start.elapsed() < Duration::from_secs(30), "the record never expired");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let (again, outcome) = idempotency::observe(pay_short_ttl(&idem, k.clone(), 5, &probe)).await;
                assert_eq!((again.unwrap().run, outcome), (2, Some(Outcome::Executed)));
            }

            /// `max_age` bounds how long a forgotten record is still answered
            /// here: counted on a clock the test moves, so the replay inside
            /// `max_age` and the execution past it do not depend on how fast
            /// the calls run.
            #[tokio::test]
            async fn max_age_bounds_a_forgotten_record() {
                let age = Arc::new(std::sync::atomic::AtomicU64::new(0));
                let clock = {
                    let age = age.clone();
                    move || Duration::from_millis(age.load(SeqCst))
                };
                let cache = LocalCache::new(1_000, 1 << 20).max_age(Duration::from_millis(300)).age_clock(clock);
                let Some((idem, client)) = engine(cache).await else {
                    return;
                };
                let namespace = idem.redis_namespace().await.unwrap().unwrap();
                let probe = Probe::default();
                let k = unique("local_forget");
                pay(&idem, k.clone(), 5, &probe).await.unwrap();
                // An operator forgets the key everywhere but in this process.
                forget_in_redis(&client, namespace.as_str(), "t_local", &k).await;
                forget_record(&idem, "t_local", &k).await;
                age.store(299, SeqCst);
                let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 5, &probe)).await;
                assert_eq!(outcome, Some(Outcome::Replayed), "still in the local cache 299 ms on");
                assert_eq!(again.unwrap().run, 1);
                age.store(300, SeqCst);
                let (after, outcome) = idempotency::observe(pay(&idem, k.clone(), 5, &probe)).await;
                assert_eq!((after.unwrap().run, outcome), (2, Some(Outcome::Executed)), "max_age passed");
            }

            /// A running call is never in the cache (a duplicate answers
            /// `InProgress`), nor is a failed one (the retry executes).
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn holds_neither_running_nor_failed_calls() {
                let Some((idem, _client)) = engine(LocalCache::new(1_000, 1 << 20)).await else { return };
                let probe = Arc::new(Probe::default());
                let k = unique("local_running");
                probe.hold.store(true, SeqCst);
                let first = {
                    let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
                    tokio::spawn(async move { pay(&idem, k, 5, &probe).await })
                };
                let start = std::time::Instant::now();
                while probe.held.load(SeqCst) == 0 {
                    assert!(start.elapsed() < Duration::from_secs(30), "the body never started");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let busy = pay(&idem, k.clone(), 5, &probe).await;
                assert!(matches!(busy, Err(TestError::Idem(idempotency::Error::InProgress { .. }))), "{busy:?}");
                probe.hold.store(false, SeqCst);
                probe.fail.store(true, SeqCst);
                probe.gate.add_permits(1);
                assert!(matches!(first.await.unwrap(), Err(TestError::Body)));

                // The failed call's claim is released from a task: ask until it is.
                probe.fail.store(false, SeqCst);
                let start = std::time::Instant::now();
                let retried = loop {
                    match pay(&idem, k.clone(), 5, &probe).await {
                        Err(TestError::Idem(idempotency::Error::InProgress { .. })) => {
                            assert!(start.elapsed() < Duration::from_secs(10), "the claim was never released");
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        other => break other,
                    }
                };
                assert_eq!(retried.unwrap().run, 2, "the failed call left nothing behind");
            }
        }
    };
}

local_cache_suite!(sqlite, sqlx::Sqlite, "DELETE FROM idem_record WHERE biz_type = ? AND idem_key = ?", || async {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    let file = std::env::temp_dir().join(format!("{}.db", unique("idem-local")));
    let options = SqliteConnectOptions::new()
        .filename(file)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    SqlitePoolOptions::new().max_connections(4).connect_with(options).await
});

local_cache_suite!(mysql, sqlx::MySql, <idempotency_testkit::backend::MySql as TestBackend>::DELETE_RECORD, || async {
    let url = std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    sqlx::mysql::MySqlPoolOptions::new().max_connections(4).connect(&url).await
});

local_cache_suite!(
    postgres,
    sqlx::Postgres,
    <idempotency_testkit::backend::Postgres as TestBackend>::DELETE_RECORD,
    || async {
        let url = std::env::var("IDEM_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        sqlx::postgres::PgPoolOptions::new().max_connections(4).connect(&url).await
    }
);
