//! `cargo bench --bench growth` (`IDEM_BENCH_QUICK=1`: 1,000,000 live
//! records; otherwise `IDEM_BENCH_ROWS`, default 10,000,000): how the cost
//! of a call grows with the records that live, on MariaDB and PostgreSQL,
//! measured side by side in one run.
//!
//! Per backend, two private databases: one empty, one filled in SQL with N
//! live records shaped like real ones (random 38-byte keys, 150-byte
//! results). Then:
//! - `first`: first calls (a fresh random key each) from 1 and 16 tasks,
//!   in turns between the two databases so both see the same moments;
//!   p50, p99 and calls/s, big over empty;
//! - the bytes on disk per record, and those of the unique index alone;
//! - `purge`: with N/10 expired records (at most 1,000,000) added, 16 tasks
//!   of first calls for a window without a purge, then while
//!   `purge_expired(5000)` runs to the end: rows/s, and the callers' p99 in
//!   both windows; then a purge with nothing to delete, timed.
//!
//! And on a private `redis-server`: the bytes Redis holds per cached result
//! (150-byte results, `used_memory` before and after).
//!
//! `IDEM_BENCH_BUFFER_POOL_MB=N` raises MariaDB's `innodb_buffer_pool_size`
//! online for the run (put back after). Everything the run creates is
//! dropped. Results also go to `target/idem-growth.json`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idempotency::{Idem, idempotent};
use idempotency_testkit::TestBackend;
use serde::{Deserialize, Serialize};
use support::{drive, percentile, quick};

#[path = "support/mod.rs"]
mod support;

/// Connections per database's pool.
const POOL: u32 = 24;
const TASKS: [usize; 2] = [1, 16];
/// Rows one fill statement inserts.
const FILL_CHUNK: u64 = 500_000;
const PURGE_BATCH: u32 = 5_000;

/// How many live records the big database holds.
fn rows() -> u64 {
    if quick() {
        return 1_000_000;
    }
    std::env::var("IDEM_BENCH_ROWS").ok().and_then(|v| v.replace('_', "").parse().ok()).unwrap_or(10_000_000)
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    order_id: String,
    note: String,
}

/// A random-looking key per call: real keys land all over the unique index,
/// not at its end as a counter's would.
fn key(run: u64, i: u64) -> String {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    format!("{:016x}{:016x}", mix(run ^ (i << 20)), mix(i ^ (run << 32)))
}

#[derive(Debug, Clone, Serialize)]
struct FirstRow {
    backend: &'static str,
    tasks: usize,
    live: u64,
    calls: usize,
    calls_per_sec: f64,
    p50_ms: f64,
    p99_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
struct SizeRow {
    backend: &'static str,
    live: u64,
    bytes_per_record: f64,
    unique_index_bytes_per_record: f64,
}

#[derive(Debug, Clone, Serialize)]
struct PurgeRow {
    backend: &'static str,
    live: u64,
    expired: u64,
    rows_per_sec: f64,
    batch_p50_ms: f64,
    callers_p99_ms_without: f64,
    callers_p99_ms_during: f64,
    calls_per_sec_without: f64,
    calls_per_sec_during: f64,
    empty_purge_p50_ms: f64,
}

#[derive(Default, Serialize)]
struct Report {
    first: Vec<FirstRow>,
    sizes: Vec<SizeRow>,
    purge: Vec<PurgeRow>,
    redis_bytes_per_result: Option<f64>,
}

macro_rules! backend {
    ($module:ident, $backend:ty, $name:literal, $fill:literal, $expired:literal, $sizes:literal) => {
        mod $module {
            use super::*;
            use sqlx::{Pool, Transaction};

            type Db = <$backend as TestBackend>::Db;

            #[idempotent(key = "order_<k>", ttl = "24h", biz = "pay")]
            async fn pay(
                idem: &Idem<Db>,
                tx: &mut Transaction<'_, Db>,
                k: String,
            ) -> Result<Receipt, idempotency::Error> {
                let _ = tx;
                // A result of 150 bytes as JSON.
                Ok(Receipt { note: "n".repeat(125 - k.len()), order_id: k })
            }

            /// A private database (the testkit's) and an engine over it.
            async fn open(name: &str) -> Option<(Pool<Db>, Idem<Db>)> {
                let pool = <$backend as TestBackend>::open_private(name, POOL).await?;
                let idem = Idem::new(pool.clone());
                idem.migrate().await.expect("migrate");
                Some((pool, idem))
            }

            /// Inserts records `from..to` in SQL: live ones, or already expired.
            async fn fill(pool: &Pool<Db>, from: u64, to: u64, expired: bool) {
                let mut at = from;
                while at < to {
                    let end = (at + FILL_CHUNK).min(to);
                    let sql = if expired { $expired } else { $fill };
                    let sql = sql.replace("{from}", &(at + 1).to_string()).replace("{to}", &end.to_string());
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await.expect("fill");
                    at = end;
                }
            }

            /// (bytes on disk, bytes of the unique index) of `idem_record`.
            async fn sizes(pool: &Pool<Db>, name: &str) -> (f64, f64) {
                let sql = $sizes.replace("{db}", name);
                let mut rows = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).fetch_all(pool).await.expect("sizes");
                use sqlx::Row;
                let row = rows.pop().expect("a row of sizes");
                (row.get::<i64, _>(0) as f64, row.get::<i64, _>(1) as f64)
            }

            /// Waits for a fill's writes to reach the disk (at most a minute), so
            /// the calls measured next do not pay for them.
            async fn settle(pool: &Pool<Db>) {
                if $name == "postgres" {
                    sqlx::raw_sql("CHECKPOINT").execute(pool).await.expect("checkpoint");
                    return;
                }
                // Flushed eagerly while it waits, as it is after a quiet while.
                let pct: f64 =
                    sqlx::query_scalar("SELECT @@innodb_max_dirty_pages_pct").fetch_one(pool).await.expect("pct");
                sqlx::raw_sql("SET GLOBAL innodb_max_dirty_pages_pct = 0").execute(pool).await.expect("flush");
                let deadline = Instant::now() + Duration::from_secs(60);
                while Instant::now() < deadline {
                    let dirty: (String, String) =
                        sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Innodb_buffer_pool_pages_dirty'")
                            .fetch_one(pool)
                            .await
                            .expect("dirty pages");
                    if dirty.1.parse::<u64>().unwrap_or(0) < 100 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                let restore = format!("SET GLOBAL innodb_max_dirty_pages_pct = {pct}");
                sqlx::raw_sql(sqlx::AssertSqlSafe(restore)).execute(pool).await.expect("restore");
            }

            fn calls_for(tasks: usize) -> u64 {
                match (quick(), tasks) {
                    (true, 1) => 1_000,
                    (true, _) => 4_000,
                    (false, 1) => 3_000,
                    (false, _) => 16_000,
                }
            }

            pub async fn run(report: &mut Report) {
                let n = rows();
                let names = [
                    format!("idem_growth_empty_{}", std::process::id()),
                    format!("idem_growth_big_{}", std::process::id()),
                ];
                // `None`: the server is unreachable (the testkit said so).
                let Some((empty_pool, empty)) = open(&names[0]).await else { return };
                let (big_pool, big) = open(&names[1]).await.expect("the server answered a moment ago");
                let started = Instant::now();
                fill(&big_pool, 0, n, false).await;
                let analyze = if $name == "postgres" { "ANALYZE idem_record" } else { "ANALYZE TABLE idem_record" };
                sqlx::raw_sql(analyze).execute(&big_pool).await.expect("analyze");
                let fill_s = started.elapsed().as_secs_f64();
                settle(&big_pool).await;
                println!("{}: {n} live records filled in {fill_s:.1} s ({:.0} rows/s)", $name, n as f64 / fill_s);
                let (bytes, unique) = sizes(&big_pool, &names[1]).await;
                report.sizes.push(SizeRow {
                    backend: $name,
                    live: n,
                    bytes_per_record: bytes / n as f64,
                    unique_index_bytes_per_record: unique / n as f64,
                });

                // First calls, in turns: empty, big, empty, big, ...
                let turns = if quick() { 4 } else { 6 };
                for tasks in TASKS {
                    let mut lat: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
                    let mut wall = [Duration::ZERO; 2];
                    for turn in 0..turns {
                        for (side, idem) in [&empty, &big].into_iter().enumerate() {
                            let idem = idem.clone();
                            let run = ((turn * 2 + side as u64) << 8) | tasks as u64;
                            let (w, l) = drive(tasks, (calls_for(tasks) / turns) as usize, None, move |i| {
                                let idem = idem.clone();
                                async move {
                                    pay(&idem, key(run, i as u64)).await.expect("first call");
                                }
                            })
                            .await;
                            wall[side] += w;
                            lat[side].extend(l);
                        }
                    }
                    for (side, live) in [0, n].into_iter().enumerate() {
                        lat[side].sort();
                        report.first.push(FirstRow {
                            backend: $name,
                            tasks,
                            live,
                            calls: lat[side].len(),
                            calls_per_sec: lat[side].len() as f64 / wall[side].as_secs_f64(),
                            p50_ms: percentile(&lat[side], 0.50),
                            p99_ms: percentile(&lat[side], 0.99),
                        });
                    }
                }

                // The purge beside 16 tasks of first calls.
                let expired = (n / 10).min(1_000_000);
                fill(&big_pool, n, n + expired, true).await;
                sqlx::raw_sql(analyze).execute(&big_pool).await.expect("analyze");
                settle(&big_pool).await;
                let load = |run: u64, stop: Arc<AtomicBool>| {
                    let idem = big.clone();
                    drive(16, usize::MAX, Some(stop), move |i| {
                        let idem = idem.clone();
                        async move {
                            pay(&idem, key(run, i as u64)).await.expect("first call");
                        }
                    })
                };
                let window = Duration::from_secs(if quick() { 3 } else { 10 });
                let stop = Arc::new(AtomicBool::new(false));
                let without = tokio::spawn(load(1 << 40, stop.clone()));
                tokio::time::sleep(window).await;
                stop.store(true, Ordering::Relaxed);
                let (wall_without, lat_without) = without.await.expect("load");

                let stop = Arc::new(AtomicBool::new(false));
                let during = tokio::spawn(load(2 << 40, stop.clone()));
                let (mut deleted, mut batches) = (0u64, Vec::new());
                let purge_started = Instant::now();
                let limit = Duration::from_secs(if quick() { 60 } else { 300 });
                while purge_started.elapsed() < limit {
                    let t = Instant::now();
                    let done = big.purge_expired(PURGE_BATCH).await.expect("purge");
                    batches.push(t.elapsed());
                    deleted += done;
                    if done == 0 {
                        break;
                    }
                }
                let purge_s = purge_started.elapsed().as_secs_f64();
                stop.store(true, Ordering::Relaxed);
                let (wall_during, lat_during) = during.await.expect("load");
                batches.sort();
                // With nothing left to delete (skipped when the limit stopped the purge).
                let mut empty_purges = Vec::new();
                while deleted >= expired && empty_purges.len() < 20 {
                    let t = Instant::now();
                    assert_eq!(big.purge_expired(PURGE_BATCH).await.expect("purge"), 0);
                    empty_purges.push(t.elapsed());
                }
                empty_purges.sort();
                if deleted < expired {
                    println!(
                        "{}: the purge deleted {deleted} of {expired} in {purge_s:.0} s (stopped at the limit)",
                        $name
                    );
                }
                report.purge.push(PurgeRow {
                    backend: $name,
                    live: n,
                    expired,
                    rows_per_sec: deleted as f64 / purge_s,
                    batch_p50_ms: percentile(&batches, 0.50),
                    callers_p99_ms_without: percentile(&lat_without, 0.99),
                    callers_p99_ms_during: percentile(&lat_during, 0.99),
                    calls_per_sec_without: lat_without.len() as f64 / wall_without.as_secs_f64(),
                    calls_per_sec_during: lat_during.len() as f64 / wall_during.as_secs_f64(),
                    empty_purge_p50_ms: percentile(&empty_purges, 0.50),
                });

                drop((empty, big));
                <$backend as TestBackend>::drop_private(empty_pool, &names[0]).await;
                <$backend as TestBackend>::drop_private(big_pool, &names[1]).await;
            }
        }
    };
}

// Fills: 'pay' records with a key of `order_` and 32 hex digits (38 bytes),
// a 64-digit fingerprint, a 150-byte result; live ones expire in about a
// year, expired ones expired in 1970.
backend!(
    mariadb,
    idempotency_testkit::backend::MySql,
    "mariadb",
    "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) \
     SELECT UNHEX(LEFT(SHA2(CONCAT('pay', CHAR(0), 'order_', MD5(seq)), 256), 32)), 'pay', CONCAT('order_', MD5(seq)), NULL, CONCAT(MD5(seq), MD5(seq)), 1, \
     CONCAT('{\"order_id\":\"', MD5(seq), '\",\"note\":\"', REPEAT('n', 93), '\"}'), 0, 0, 33000000000000 \
     FROM seq_{from}_to_{to}",
    "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) \
     SELECT UNHEX(LEFT(SHA2(CONCAT('old', CHAR(0), 'order_', MD5(seq)), 256), 32)), 'old', CONCAT('order_', MD5(seq)), NULL, CONCAT(MD5(seq), MD5(seq)), 1, \
     CONCAT('{\"order_id\":\"', MD5(seq), '\",\"note\":\"', REPEAT('n', 93), '\"}'), 0, 0, seq \
     FROM seq_{from}_to_{to}",
    "SELECT CAST(t.data_length + t.index_length AS SIGNED), \
     CAST((SELECT stat_value * @@innodb_page_size FROM mysql.innodb_index_stats \
           WHERE database_name = '{db}' AND table_name = 'idem_record' AND index_name = 'uk_idem_record_key_digest' AND stat_name = 'size') AS SIGNED) \
     FROM information_schema.TABLES t WHERE t.table_schema = '{db}' AND t.table_name = 'idem_record'"
);

backend!(
    postgres,
    idempotency_testkit::backend::Postgres,
    "postgres",
    "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) \
     SELECT encode(substring(sha256(convert_to('pay', 'UTF8') || decode('00', 'hex') || convert_to('order_' || md5(g::text), 'UTF8')) FROM 1 FOR 16), 'hex')::uuid, 'pay', 'order_' || md5(g::text), NULL, md5(g::text) || md5(g::text), 1, \
     '{\"order_id\":\"' || md5(g::text) || '\",\"note\":\"' || repeat('n', 93) || '\"}', 0, 0, 33000000000000 \
     FROM generate_series({from}, {to}) g",
    "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) \
     SELECT encode(substring(sha256(convert_to('old', 'UTF8') || decode('00', 'hex') || convert_to('order_' || md5(g::text), 'UTF8')) FROM 1 FOR 16), 'hex')::uuid, 'old', 'order_' || md5(g::text), NULL, md5(g::text) || md5(g::text), 1, \
     '{\"order_id\":\"' || md5(g::text) || '\",\"note\":\"' || repeat('n', 93) || '\"}', 0, 0, g \
     FROM generate_series({from}, {to}) g",
    "SELECT pg_total_relation_size('idem_record'), \
     (SELECT pg_relation_size(i.indexrelid) FROM pg_index i WHERE i.indrelid = 'idem_record'::regclass \
      AND i.indisunique AND NOT i.indisprimary LIMIT 1) -- {db}"
);

/// Bytes Redis holds per cached 150-byte result, on a private server.
mod redis_memory {
    use super::*;
    use idempotency_testkit::servers::RedisServer;
    use sqlx::{Sqlite, Transaction};

    #[idempotent(key = "order_<k>", ttl = "24h", biz = "pay")]
    async fn pay(
        idem: &Idem<Sqlite>,
        tx: &mut Transaction<'_, Sqlite>,
        k: String,
    ) -> Result<Receipt, idempotency::Error> {
        let _ = tx;
        Ok(Receipt { note: "n".repeat(125 - k.len()), order_id: k })
    }

    pub async fn run(report: &mut Report) {
        let Some(redis) = RedisServer::start() else { return };
        let file = std::env::temp_dir().join(format!("idem-growth-{}.db", std::process::id()));
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&file)
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .synchronous(sqlx::sqlite::SqliteSynchronous::Off);
        let pool =
            sqlx::sqlite::SqlitePoolOptions::new().max_connections(4).connect_with(options).await.expect("sqlite");
        let namespace = idempotency::Namespace::new("growth").expect("namespace");
        let idem = Idem::builder(pool.clone()).redis(redis.client()).redis_namespace(namespace).build();
        idem.migrate().await.expect("migrate");
        pay(&idem, key(9, 0)).await.expect("warm up");
        let deadline = Instant::now() + Duration::from_secs(20);
        while redis.results_held("growth") < 1 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let calls: i64 = if quick() { 2_000 } else { 10_000 };
        let before = redis.used_memory();
        for i in 1..=calls {
            pay(&idem, key(9, i as u64)).await.expect("first call");
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while redis.results_held("growth") < calls + 1 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        report.redis_bytes_per_result = Some((redis.used_memory() - before) as f64 / calls as f64);
        drop(idem);
        pool.close().await;
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", file.display()));
        }
    }
}

/// Raises MariaDB's buffer pool online when asked to; returns the size to
/// put back.
async fn buffer_pool(mb: Option<u64>) -> Option<u64> {
    let mb = mb?;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&idempotency_testkit::mysql_url())
        .await
        .ok()?;
    let old: u64 = sqlx::query_scalar("SELECT @@innodb_buffer_pool_size").fetch_one(&pool).await.ok()?;
    let sql = format!("SET GLOBAL innodb_buffer_pool_size = {}", mb << 20);
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&pool).await.expect("buffer pool");
    println!("mariadb: innodb_buffer_pool_size {} MB -> {mb} MB for the run", old >> 20);
    Some(old)
}

async fn restore_buffer_pool(old: Option<u64>) {
    let Some(old) = old else { return };
    let pool = sqlx::mysql::MySqlPoolOptions::new().max_connections(1).connect(&idempotency_testkit::mysql_url()).await;
    if let Ok(pool) = pool {
        let sql = format!("SET GLOBAL innodb_buffer_pool_size = {old}");
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&pool).await;
    }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    let started = Instant::now();
    let mut report = Report::default();
    let raised = std::env::var("IDEM_BENCH_BUFFER_POOL_MB").ok().and_then(|v| v.parse().ok());
    runtime.block_on(async {
        let old = buffer_pool(raised).await;
        mariadb::run(&mut report).await;
        restore_buffer_pool(old).await;
        postgres::run(&mut report).await;
        redis_memory::run(&mut report).await;
    });

    println!("\nfirst calls, {} live records beside none (in turns)", rows());
    println!(
        "{:<9} {:>5} {:>10} {:>7} {:>9} {:>8} {:>8} {:>9} {:>9} {:>10}",
        "backend", "tasks", "live", "calls", "calls/s", "p50 ms", "p99 ms", "p50 big/", "p99 big/", "calls/s big/"
    );
    for r in &report.first {
        let empty = report
            .first
            .iter()
            .find(|e| e.backend == r.backend && e.tasks == r.tasks && e.live == 0)
            .expect("empty row");
        let ratios = if r.live == 0 {
            String::new()
        } else {
            format!(
                " {:>8.2}x {:>8.2}x {:>11.2}x",
                r.p50_ms / empty.p50_ms,
                r.p99_ms / empty.p99_ms,
                r.calls_per_sec / empty.calls_per_sec
            )
        };
        println!(
            "{:<9} {:>5} {:>10} {:>7} {:>9.0} {:>8.3} {:>8.3}{ratios}",
            r.backend, r.tasks, r.live, r.calls, r.calls_per_sec, r.p50_ms, r.p99_ms
        );
    }
    println!("\non disk");
    for s in &report.sizes {
        println!(
            "{:<9} {:>10} live: {:.0} bytes per record, of which the unique index {:.0} ({:.1} MB per million live records)",
            s.backend, s.live, s.bytes_per_record, s.unique_index_bytes_per_record, s.unique_index_bytes_per_record
        );
    }
    println!("\npurge_expired({PURGE_BATCH}) beside 16 tasks of first calls");
    for p in &report.purge {
        println!(
            "{:<9} {} expired among {} live: {:.0} rows/s, batch p50 {:.1} ms; callers p99 {:.2} ms without, {:.2} ms during ({:.2}x), \
             calls/s {:.0} without, {:.0} during; a purge with nothing to delete p50 {:.2} ms",
            p.backend,
            p.expired,
            p.live,
            p.rows_per_sec,
            p.batch_p50_ms,
            p.callers_p99_ms_without,
            p.callers_p99_ms_during,
            p.callers_p99_ms_during / p.callers_p99_ms_without,
            p.calls_per_sec_without,
            p.calls_per_sec_during,
            p.empty_purge_p50_ms
        );
    }
    if let Some(bytes) = report.redis_bytes_per_result {
        println!("\nredis: {bytes:.0} bytes per cached 150-byte result ({:.2}x)", bytes / 150.0);
    }

    let json = serde_json::json!({ "quick": quick(), "rows": rows(), "seconds": started.elapsed().as_secs_f64(), "report": report });
    let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    let path = std::path::Path::new(&dir).join("idem-growth.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json).expect("json")).expect("write json");
    println!("wrote {} in {:.1} s", path.display(), started.elapsed().as_secs_f64());
}
