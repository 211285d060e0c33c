//! PostgreSQL behind PgBouncer in transaction pooling mode: an engine built
//! with `transaction_pooler(true)`, its pool of 16 connections through a
//! private PgBouncer (`idempotency_testkit::pgbouncer`) that holds 8 server
//! connections, so client connections take turns on server connections
//! between transactions. Every case with and without Redis: `migrate` on a
//! fresh database, a storm on one key, 200 keys called twice, and what else
//! runs outside a call's transaction (status, tokens, the steps mode,
//! purges); in [`features`], what else sends SQL (the outbox and its relays,
//! `join`). Each test has a database of its own.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use idempotency::state::{Advanced, advance};
use idempotency::{Consumption, Idem, Outcome, Status, Steps, idempotent, transition};
use idempotency_testkit::forwarder::{Forwarder, Path};
use idempotency_testkit::pgbouncer::{PgBouncer, SERVER_CONNECTIONS};
use idempotency_testkit::{pg_url, reach, redis_client, unique};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, Postgres};
use sqlx::{AssertSqlSafe, Transaction};
use tokio::sync::{Barrier, Notify};

/// The engine's pool through PgBouncer: twice its server connections.
const POOL: u32 = 16;
/// Orders the bodies pay: ids `0..=ORDERS`, all `PENDING` at first.
const ORDERS: i64 = 200;
const SCHEMA: &str =
    "CREATE TABLE pgb_ledger (id BIGSERIAL PRIMARY KEY, k VARCHAR(300) NOT NULL, amount BIGINT NOT NULL);
    CREATE TABLE pgb_orders (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL);
    INSERT INTO pgb_orders SELECT i, 'PENDING' FROM generate_series(0, 200) AS i";

#[derive(Clone, Copy, Debug, PartialEq, Eq, idempotency::State)]
#[state(table = "pgb_orders", id = "id", column = "status")]
#[state(transitions(Pending -> Paid))]
enum OrderStatus {
    Pending,
    Paid,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    key: String,
    order: i64,
    /// Which body, counted over the test, produced it.
    run: usize,
    /// Whether the body moved the order from `PENDING` to `PAID`.
    moved: bool,
    note: String,
}

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug in assertion messages
enum TestError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
}

impl From<idempotency::Error> for TestError {
    fn from(e: idempotency::Error) -> Self {
        TestError::Idem(e)
    }
}

impl From<sqlx::Error> for TestError {
    fn from(e: sqlx::Error) -> Self {
        TestError::Db(e)
    }
}

#[idempotent(key = "<k>", ttl = "1h", biz = "pgb_pay")]
async fn pay(
    idem: &Idem<Postgres>,
    tx: &mut Transaction<'_, Postgres>,
    #[idem(skip)] runs: &AtomicUsize,
    k: String,
    order: i64,
) -> Result<Receipt, TestError> {
    let run = runs.fetch_add(1, SeqCst) + 1;
    // The body's own statements go unnamed behind a transaction pooler.
    sqlx::query("INSERT INTO pgb_ledger (k, amount) VALUES ($1, $2)")
        .persistent(false)
        .bind(&k)
        .bind(order)
        .execute(&mut **tx)
        .await?;
    let moved = advance(transition!(OrderStatus: Pending -> Paid)).run(&mut **tx, order).await?;
    tokio::time::sleep(Duration::from_millis(20)).await;
    Ok(Receipt { key: k, order, run, moved: moved == Advanced::Applied, note: "café, 東京 ✓".into() })
}

/// Records the test expires by SQL (`outside_a_call`): a long ttl, so
/// nothing has to happen within a short one.
#[idempotent(key = "<k>", ttl = "1h", biz = "pgb_short")]
async fn short_lived(idem: &Idem<Postgres>, tx: &mut Transaction<'_, Postgres>, k: String) -> Result<i64, TestError> {
    Ok(sqlx::query_scalar("SELECT 7::BIGINT").persistent(false).fetch_one(&mut **tx).await?)
}

#[idempotent(key = "<k>", ttl = "1h", biz = "pgb_steps", steps)]
async fn charge(
    idem: &Idem<Postgres>,
    steps: &mut Steps<Postgres>,
    #[idem(skip)] calls: &AtomicUsize,
    k: String,
) -> Result<String, TestError> {
    let charge: String = steps
        .step("charge", |step_key| async move {
            calls.fetch_add(1, SeqCst);
            Ok::<_, TestError>(format!("ch_{}", &step_key.as_str()[..12]))
        })
        .await?;
    let tx = steps.transaction().await?;
    sqlx::query("INSERT INTO pgb_ledger (k, amount) VALUES ($1, 1)")
        .persistent(false)
        .bind(&k)
        .execute(&mut **tx)
        .await?;
    Ok(charge)
}

#[idempotent(key = "<k>", ttl = "1h", biz = "pgb_held")]
async fn held(
    idem: &Idem<Postgres>,
    tx: &mut Transaction<'_, Postgres>,
    #[idem(skip)] started: &Notify,
    #[idem(skip)] release: &Notify,
    k: String,
) -> Result<i64, TestError> {
    started.notify_one();
    release.notified().await;
    Ok(sqlx::query_scalar("SELECT 1::BIGINT").persistent(false).fetch_one(&mut **tx).await?)
}

/// A database of its own, reached straight (`direct`, to read what was
/// committed) and through a private PgBouncer.
struct Behind {
    bouncer: PgBouncer,
    name: String,
    direct: PgPool,
    /// Between PgBouncer and the server, when the database is far.
    _far: Option<Forwarder>,
}

impl Behind {
    /// `None` (the test skips) when PostgreSQL or `pgbouncer` is missing.
    async fn start() -> Option<Self> {
        Self::start_with(SERVER_CONNECTIONS).await
    }

    /// Behind a PgBouncer holding `server_connections`.
    async fn start_with(server_connections: u32) -> Option<Self> {
        Self::start_at(server_connections, Duration::ZERO).await
    }

    /// Behind a PgBouncer whose server is `each_way` away (a forwarder
    /// holding every byte that long each way between them).
    async fn start_at(server_connections: u32, each_way: Duration) -> Option<Self> {
        let admin =
            reach("postgres", || async { PgPoolOptions::new().max_connections(1).connect(&pg_url()).await.ok() })
                .await?;
        let server = PgConnectOptions::from_str(&pg_url()).expect("postgres url");
        let (bouncer, far) = if each_way.is_zero() {
            (PgBouncer::start_with(server_connections)?, None)
        } else {
            let far = Forwarder::start_with(server.get_port(), Path { delay: each_way, count: None }).await;
            (PgBouncer::start_to(server_connections, "127.0.0.1", far.port())?, Some(far))
        };
        let name = unique("pgb").replace('-', "_");
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&admin).await.expect("create database");
        admin.close().await;
        let options = PgConnectOptions::from_str(&pg_url()).expect("postgres url").database(&name);
        let direct = PgPoolOptions::new().max_connections(2).connect_with(options).await.expect("direct pool");
        sqlx::raw_sql(SCHEMA).execute(&direct).await.expect("schema");
        Some(Self { bouncer, name, direct, _far: far })
    }

    /// A pool of [`POOL`] connections through PgBouncer.
    async fn pool(&self) -> PgPool {
        self.pool_of(POOL).await
    }

    /// A pool of `size` connections through PgBouncer.
    async fn pool_of(&self, size: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(self.bouncer.options(&self.name))
            .await
            .expect("pool through pgbouncer")
    }

    /// An engine behind PgBouncer; `None` (skipped) when Redis is wanted
    /// and does not answer.
    async fn engine(&self, redis: bool, pooler: bool) -> Option<Idem<Postgres>> {
        let builder = Idem::builder(self.pool().await).transaction_pooler(pooler);
        Some(if redis { builder.redis(redis_client().await?).build() } else { builder.build() })
    }

    async fn scalar(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.direct).await.expect(sql)
    }

    /// The response stored for `key` of `pay`.
    async fn stored(&self, key: &str) -> String {
        sqlx::query_scalar("SELECT response FROM idem_record WHERE biz_type = 'pgb_pay' AND idem_key = $1")
            .bind(key)
            .fetch_one(&self.direct)
            .await
            .expect("stored response")
    }

    async fn finish(self) {
        self.direct.close().await;
        let admin = PgPoolOptions::new().max_connections(1).connect(&pg_url()).await.expect("postgres");
        let drop = AssertSqlSafe(format!("DROP DATABASE {} WITH (FORCE)", self.name));
        sqlx::raw_sql(drop).execute(&admin).await.expect("drop database");
    }
}

/// `pay` until it answers: a duplicate seen running (`InProgress`, with a
/// Redis claim) asks again. Anything else is a failure of the test.
async fn pay_answered(idem: &Idem<Postgres>, runs: &AtomicUsize, k: &str, order: i64) -> (Receipt, Outcome) {
    let start = Instant::now();
    loop {
        let (result, outcome) = idempotency::observe(pay(idem, runs, k.to_owned(), order)).await;
        match result {
            Ok(receipt) => return (receipt, outcome.expect("an outcome")),
            Err(TestError::Idem(idempotency::Error::InProgress { .. }))
                if start.elapsed() < Duration::from_secs(30) =>
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("{k}: {e:?}"),
        }
    }
}

macro_rules! with_and_without_redis {
    ($without:ident, $with:ident => $case:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $without() {
            $case(false).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $with() {
            $case(true).await;
        }
    };
}

/// `migrate` on a fresh database through PgBouncer, twice, and four at
/// once: the tables exist, and the namespace recorded first stays.
async fn migrate_twice(redis: bool) {
    let Some(behind) = Behind::start().await else { return };
    let Some(idem) = behind.engine(redis, true).await else { return };
    idem.migrate().await.expect("first migrate");
    let first = idem.redis_namespace().await.expect("namespace").expect("recorded");
    idem.migrate().await.expect("second migrate");
    let mut migrations = Vec::new();
    for _ in 0..4 {
        let idem = behind.engine(redis, true).await.expect("engine");
        migrations.push(tokio::spawn(async move { idem.migrate().await }));
    }
    for migration in migrations {
        migration.await.unwrap().expect("concurrent migrate");
    }
    let tables = behind
        .scalar(
            "SELECT COUNT(*) FROM pg_tables WHERE schemaname = 'public' \
             AND tablename IN ('idem_record', 'idem_meta', 'idem_token', 'idem_call', 'idem_step')",
        )
        .await;
    assert_eq!(tables, 5);
    assert_eq!(behind.scalar("SELECT COUNT(*) FROM idem_meta").await, 1);
    assert_eq!(idem.redis_namespace().await.expect("namespace").expect("recorded"), first);
    behind.finish().await;
}

with_and_without_redis!(migrate_runs_twice_behind_pgbouncer, migrate_runs_twice_behind_pgbouncer_with_redis => migrate_twice);

/// 50 callers on one key behind a barrier, over five engines (five
/// instances: without Redis they meet at the unique index, not in one
/// engine's memory), each of whose pool connections has run calls before:
/// the body runs once, one call executes, 49 replay, and all 50 answers are
/// byte for byte the stored response.
async fn storm(redis: bool) {
    storm_at(redis, Duration::ZERO).await;
}

/// [`storm`] with the server 1 ms from PgBouncer: the engines' record
/// rides with `BEGIN` and `COMMIT` (texts, which the pooler passes as it
/// passes any simple query).
async fn storm_far(redis: bool) {
    storm_at(redis, Duration::from_micros(500)).await;
}

async fn storm_at(redis: bool, each_way: Duration) {
    const CALLERS: usize = 50;
    const ENGINES: usize = 5;
    let Some(behind) = Behind::start_at(SERVER_CONNECTIONS, each_way).await else { return };
    let mut engines = Vec::new();
    for _ in 0..ENGINES {
        let Some(idem) = behind.engine(redis, true).await else { return };
        engines.push(idem);
    }
    engines[0].migrate().await.expect("migrate");
    let runs = Arc::new(AtomicUsize::new(0));
    // Every connection of every pool in use at once, on keys of its own.
    let warm: Vec<_> = (0..ENGINES * POOL as usize)
        .map(|i| {
            let (idem, runs, k) = (engines[i % ENGINES].clone(), runs.clone(), unique("warm"));
            tokio::spawn(async move { pay_answered(&idem, &runs, &k, i as i64 + 1).await.1 })
        })
        .collect();
    for task in warm {
        assert_eq!(task.await.expect("no task panics"), Outcome::Executed);
    }
    let warmed = runs.swap(0, SeqCst);
    let barrier = Arc::new(Barrier::new(CALLERS));
    let k = unique("storm");
    let tasks: Vec<_> = (0..CALLERS)
        .map(|i| {
            let (idem, runs, barrier, k) = (engines[i % ENGINES].clone(), runs.clone(), barrier.clone(), k.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                pay_answered(&idem, &runs, &k, 0).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("no task panics"));
    }
    assert_eq!(runs.load(SeqCst), 1, "the body ran {} times", runs.load(SeqCst));
    let executed = answers.iter().filter(|(_, outcome)| *outcome == Outcome::Executed).count();
    assert_eq!(executed, 1);
    assert!(answers.iter().all(|(_, outcome)| matches!(outcome, Outcome::Executed | Outcome::Replayed)));
    let stored = behind.stored(&k).await;
    for (receipt, _) in &answers {
        assert_eq!(serde_json::to_string(receipt).unwrap(), stored);
    }
    assert!(answers[0].0.moved);
    let ledger = sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM pgb_ledger WHERE k = $1").bind(&k);
    assert_eq!(ledger.fetch_one(&behind.direct).await.unwrap(), 1);
    assert_eq!(behind.scalar("SELECT COUNT(*) FROM pgb_ledger").await, warmed as i64 + 1);
    assert_eq!(behind.scalar("SELECT COUNT(*) FROM pgb_orders WHERE id = 0 AND status = 'PAID'").await, 1);
    behind.finish().await;
}

with_and_without_redis!(storm_of_50_runs_once_behind_pgbouncer, storm_of_50_runs_once_behind_pgbouncer_with_redis => storm);
with_and_without_redis!(storm_of_50_runs_once_behind_pgbouncer_1_ms_from_the_server, storm_of_50_runs_once_behind_pgbouncer_1_ms_from_the_server_with_redis => storm_far);

/// 200 keys called at once, then all again at once: each body once (each
/// first call executes, each second replays the stored bytes), each order
/// moved once, one ledger row per key.
async fn keys_twice(redis: bool) {
    let Some(behind) = Behind::start().await else { return };
    let Some(idem) = behind.engine(redis, true).await else { return };
    idem.migrate().await.expect("migrate");
    let runs = Arc::new(AtomicUsize::new(0));
    let prefix = unique("key");
    let round = |expected: Outcome| {
        let barrier = Arc::new(Barrier::new(ORDERS as usize));
        let tasks: Vec<_> = (1..=ORDERS)
            .map(|order| {
                let (idem, runs, barrier, k) =
                    (idem.clone(), runs.clone(), barrier.clone(), format!("{prefix}-{order}"));
                tokio::spawn(async move {
                    barrier.wait().await;
                    let (receipt, outcome) = pay_answered(&idem, &runs, &k, order).await;
                    assert_eq!(outcome, expected, "{k}");
                    receipt
                })
            })
            .collect();
        async move {
            let mut receipts = Vec::new();
            for task in tasks {
                receipts.push(task.await.expect("no task panics"));
            }
            receipts
        }
    };
    let first = round(Outcome::Executed).await;
    let again = round(Outcome::Replayed).await;
    assert_eq!(runs.load(SeqCst), ORDERS as usize);
    for (one, two) in first.iter().zip(&again) {
        assert!(one.moved, "{one:?}");
        let stored = behind.stored(&one.key).await;
        assert_eq!(serde_json::to_string(one).unwrap(), stored);
        assert_eq!(serde_json::to_string(two).unwrap(), stored);
    }
    assert_eq!(behind.scalar("SELECT COUNT(*) FROM pgb_ledger").await, ORDERS);
    assert_eq!(behind.scalar("SELECT COUNT(DISTINCT k) FROM pgb_ledger").await, ORDERS);
    assert_eq!(behind.scalar("SELECT COUNT(*) FROM pgb_orders WHERE status = 'PAID'").await, ORDERS);
    behind.finish().await;
}

with_and_without_redis!(keys_called_twice_run_once_behind_pgbouncer, keys_called_twice_run_once_behind_pgbouncer_with_redis => keys_twice);

/// What runs outside a call's transaction, 20 of each at once: `status`,
/// tokens (in the database without Redis), the steps mode's phase one and
/// step records, and the purges of expired records and calls.
async fn outside_a_call(redis: bool) {
    const N: usize = 20;
    let Some(behind) = Behind::start().await else { return };
    let Some(idem) = behind.engine(redis, true).await else { return };
    idem.migrate().await.expect("migrate");
    let prefix = unique("out");
    let all = |n: usize| (0..n).map(|i| format!("{prefix}-{i}")).collect::<Vec<_>>();

    // Tokens: each consumed once, then already used.
    let mut tasks = Vec::new();
    for subject in all(N) {
        let idem = idem.clone();
        tasks.push(tokio::spawn(async move {
            let tokens = idem.tokens();
            let issued = tokens.issue("pgb_tok", &subject, Duration::from_secs(600)).await.expect("issue");
            let spent = tokens.consume("pgb_tok", &subject, &issued.token).await.expect("consume");
            assert!(matches!(spent, Consumption::Consumed(_)), "{spent:?}");
            let again = tokens.consume("pgb_tok", &subject, &issued.token).await.expect("consume again");
            assert!(matches!(again, Consumption::AlreadyUsed), "{again:?}");
        }));
    }
    // The steps mode: each step called once, the second call replays.
    let calls = Arc::new(AtomicUsize::new(0));
    for k in all(N) {
        let (idem, calls) = (idem.clone(), calls.clone());
        tasks.push(tokio::spawn(async move {
            let first = charge(&idem, &calls, k.clone()).await.expect("steps call");
            let (again, outcome) = idempotency::observe(charge(&idem, &calls, k.clone())).await;
            assert_eq!(again.expect("replay"), first);
            assert_eq!(outcome, Some(Outcome::Replayed));
        }));
    }
    // Short-lived records, then their status.
    for k in all(N) {
        let idem = idem.clone();
        tasks.push(tokio::spawn(async move {
            let k = format!("{k}-short");
            assert_eq!(short_lived(&idem, k.clone()).await.expect("short call"), 7);
            let status = idem.status("pgb_short", &k).await.expect("status");
            assert_eq!(status, Status::Completed { response: "7".into() });
        }));
    }
    for task in tasks {
        task.await.expect("no task panics");
    }
    assert_eq!(calls.load(SeqCst), N);
    assert_eq!(behind.scalar("SELECT COUNT(*) FROM pgb_ledger").await, N as i64);

    // Purges: the expired records go, the live ones stay. The short ones
    // expire now, by SQL.
    let expired = sqlx::raw_sql("UPDATE idem_record SET expires_at = 1 WHERE biz_type = 'pgb_short'")
        .execute(&behind.direct)
        .await
        .expect("expire");
    assert_eq!(expired.rows_affected(), N as u64);
    let k = format!("{prefix}-0-short");
    assert_eq!(idem.status("pgb_short", &k).await.expect("status"), Status::Expired);
    assert_eq!(idem.purge_expired(1000).await.expect("purge"), N as u64);
    assert_eq!(idem.status("pgb_short", &k).await.expect("status"), Status::Absent);
    assert_eq!(idem.purge_expired_calls(1000).await.expect("purge calls"), 0);
    assert_eq!(idem.tokens().purge_expired(1000).await.expect("purge tokens"), 0);
    assert!(idem.stuck_calls("pgb_steps", 10).await.expect("stuck calls").is_empty());
    assert_eq!(behind.scalar("SELECT COUNT(*) FROM idem_record").await, 0);
    assert_eq!(behind.scalar("SELECT COUNT(*) FROM idem_call").await, N as i64);
    behind.finish().await;
}

with_and_without_redis!(outside_a_call_behind_pgbouncer, outside_a_call_behind_pgbouncer_with_redis => outside_a_call);

/// Regression: the record's lock-wait bound (`SET LOCAL lock_timeout`)
/// holds in its transaction behind PgBouncer and leaves no server
/// connection with it. Without Redis, a duplicate on another engine waits
/// on the unique index for at most its `lock_wait`, then answers
/// `InProgress`; afterwards every one of the 8 server connections shows
/// the server's own `lock_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_lock_wait_bound_stays_in_its_transaction_behind_pgbouncer() {
    const WAIT: Duration = Duration::from_millis(300);
    let Some(behind) = Behind::start().await else { return };
    let own: String = sqlx::query_scalar("SHOW lock_timeout").fetch_one(&behind.direct).await.expect("show");
    let engine = |pool| Idem::builder(pool).transaction_pooler(true).lock_wait(WAIT).build();
    let (a, b) = (engine(behind.pool().await), engine(behind.pool().await));
    a.migrate().await.expect("migrate");
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let k = unique("held");
    let first = {
        let (a, started, release, k) = (a.clone(), started.clone(), release.clone(), k.clone());
        tokio::spawn(async move { held(&a, &started, &release, k).await })
    };
    started.notified().await;
    let start = Instant::now();
    let duplicate = held(&b, &Notify::new(), &Notify::new(), k.clone()).await;
    let waited = start.elapsed();
    assert!(matches!(duplicate, Err(TestError::Idem(idempotency::Error::InProgress { .. }))), "{duplicate:?}");
    // At least the bound; the upper one only turns a hang into a failure.
    assert!(waited >= WAIT && waited < Duration::from_secs(30), "waited {waited:?}");
    release.notify_one();
    assert_eq!(first.await.unwrap().expect("first call"), 1);

    let barrier = Arc::new(Barrier::new(SERVER_CONNECTIONS as usize));
    let shows: Vec<_> = (0..SERVER_CONNECTIONS)
        .map(|_| {
            let (pool, barrier) = (a.pool().clone(), barrier.clone());
            tokio::spawn(async move {
                let mut tx = pool.begin().await.expect("begin");
                let shown: String =
                    sqlx::query_scalar("SHOW lock_timeout").persistent(false).fetch_one(&mut *tx).await.expect("show");
                // All at once: each holds a server connection of its own.
                barrier.wait().await;
                shown
            })
        })
        .collect();
    for show in shows {
        assert_eq!(show.await.unwrap(), own);
    }
    behind.finish().await;
}

/// PgBouncer holds the server connections it was given, however many
/// clients: the cases above really share 8 of them among 16.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_holds_eight_server_connections() {
    let Some(behind) = Behind::start().await else { return };
    let Some(idem) = behind.engine(false, true).await else { return };
    let mut held = Vec::new();
    for _ in 0..SERVER_CONNECTIONS {
        let mut tx = idem.pool().begin().await.expect("begin");
        sqlx::raw_sql("SELECT 1").execute(&mut *tx).await.expect("select");
        held.push(tx);
    }
    let ninth = async {
        let mut tx = idem.pool().begin().await.expect("begin");
        sqlx::raw_sql("SELECT 1").execute(&mut *tx).await.map(|_| tx)
    };
    assert!(tokio::time::timeout(Duration::from_millis(500), ninth).await.is_err(), "a ninth server connection");
    drop(held);
    behind.finish().await;
}

mod features;
