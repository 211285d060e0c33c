//! `cargo bench --bench overhead` (`IDEM_BENCH_QUICK=1` for a run under a
//! minute): what `#[idempotent]` costs over the transaction a caller would
//! write anyway, measured side by side in one run on MariaDB and PostgreSQL,
//! with and without Redis, and on SQLite (a file in WAL mode, without
//! Redis: its deployments' usual form), from 1 task and from 32.
//!
//! Rows: `bare` (the body in a plain transaction), `first` (a fresh key per
//! call), `replay` (a finished key again), `replay-local` (the same from the
//! engine's local cache), `storm` (100 concurrent calls on one new key;
//! executions must be 1); with one Redis node also `floor` (the first call's
//! round trips written by hand) and `floor-gate` (the same with the engine's
//! own statements), and `get` and `tcp` (one plain Redis `GET`
//! through redis-rs and on a bare socket, what a replay's round trip costs at
//! least, measured in turns with `replay` so all three see the same moments);
//! without Redis `select` (one indexed read of a replayed record in
//! autocommit, a replay's floor there, in turns with `replay` too).
//! Each row also prints the SQL statements and Redis commands per call,
//! counted in a separate pass; after the table, one line per performance
//! target: its ratio, its bound, met or not met.
//! Results also go to `target/idem-bench.json`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idempotency::{Idem, idempotent};
use serde::{Deserialize, Serialize};
use support::{drive, percentile, quick};
use tokio::sync::Barrier;

#[path = "support/mod.rs"]
mod support;

const ORDERS: i64 = 1_000;
const CONCURRENCY: usize = 32;
const STORM: usize = 100;
/// Connections per backend's pool.
const POOL: u32 = 40;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    order_id: i64,
    amount: i64,
}

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug when a bench call fails
enum BenchError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
}

impl From<idempotency::Error> for BenchError {
    fn from(e: idempotency::Error) -> Self {
        BenchError::Idem(e)
    }
}

impl From<sqlx::Error> for BenchError {
    fn from(e: sqlx::Error) -> Self {
        BenchError::Db(e)
    }
}

/// Counts the statements sqlx sends (its `sqlx::query` events) while on,
/// and among them the ends of transactions (`COMMIT`, `ROLLBACK`): sqlx does
/// not log PostgreSQL's `BEGIN`, a round trip of its own, so each
/// transaction end stands for one there.
struct StatementCounter {
    on: AtomicBool,
    count: AtomicU64,
    transaction_ends: AtomicU64,
}

static COUNTER: StatementCounter =
    StatementCounter { on: AtomicBool::new(false), count: AtomicU64::new(0), transaction_ends: AtomicU64::new(0) };

/// Finds whether an event's `summary` field is a `COMMIT` or `ROLLBACK`.
struct EndsTransaction(bool);

impl tracing::field::Visit for EndsTransaction {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "summary" {
            let v = value.trim_start().to_ascii_uppercase();
            self.0 |= v.starts_with("COMMIT") || v.starts_with("ROLLBACK");
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.record_str(field, &format!("{value:?}").replace('"', ""));
    }
}

impl tracing::Subscriber for &'static StatementCounter {
    fn register_callsite(&self, meta: &'static tracing::Metadata<'static>) -> tracing::subscriber::Interest {
        if meta.target() == "sqlx::query" {
            tracing::subscriber::Interest::sometimes()
        } else {
            tracing::subscriber::Interest::never()
        }
    }
    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        meta.target() == "sqlx::query" && self.on.load(Ordering::Relaxed)
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        self.count.fetch_add(1, Ordering::Relaxed);
        let mut ends = EndsTransaction(false);
        event.record(&mut ends);
        if ends.0 {
            self.transaction_ends.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[derive(Debug, Clone, Serialize)]
struct Row {
    backend: &'static str,
    redis: &'static str,
    mode: &'static str,
    tasks: usize,
    calls: usize,
    calls_per_sec: f64,
    p50_ms: f64,
    p99_ms: f64,
    sql_per_call: f64,
    redis_per_call: f64,
    executions: Option<usize>,
}

/// One call of a row measured in alternating slices with others.
type Call = Arc<dyn Fn(usize) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync>;

fn call<F, Fut>(f: F) -> Call
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    Arc::new(move |i| Box::pin(f(i)))
}

/// Runs `calls` calls of every row from `tasks` tasks, the rows taking
/// turns in slices of at least ten calls each, so that all see the same
/// moments of a shared machine and their ratios hold still. The order of
/// the turns changes from slice to slice (every rotation, forwards and
/// backwards): a row's first calls pay for what the row before it left
/// (on MariaDB `first` came out 5 % over `floor` with `bare` always just
/// before it, 2.4 % with the two swapped, 3.6 % with the order varied).
async fn alternating(
    tasks: usize,
    calls: usize,
    rows: Vec<(&'static str, Call)>,
) -> Vec<(&'static str, (Duration, Vec<Duration>))> {
    let slices = (calls / 10).clamp(1, 100);
    let mut totals: Vec<_> = rows.iter().map(|_| (Duration::ZERO, Vec::with_capacity(calls))).collect();
    let per_slice = calls / slices;
    for slice in 0..slices {
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.rotate_left(slice % rows.len());
        if (slice / rows.len()) % 2 == 1 {
            order.reverse();
        }
        for r in order {
            let row = rows[r].1.clone();
            // Call numbers run on across slices: a fresh key stays fresh.
            let (wall, lat) = drive(tasks, per_slice, None, move |i| row(slice * per_slice + i)).await;
            totals[r].0 += wall;
            totals[r].1.extend(lat);
        }
    }
    rows.into_iter()
        .zip(totals)
        .map(|((name, _), (wall, mut lat))| {
            lat.sort();
            (name, (wall, lat))
        })
        .collect()
}

/// One plain `HGET` per call of the result fields in `fields` (those the replays read:
/// the same result comes back), through redis-rs (`get`) and hand-written
/// on plain sockets the calling tasks own (`tcp`, no client library in
/// between): the least a replay's one Redis round trip costs.
async fn plain_gets(client: &redis::Client, tasks: usize, fields: Vec<(String, Vec<u8>)>) -> Vec<(&'static str, Call)> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let fields = Arc::new(fields);
    let redis = redis::aio::ConnectionManager::new(client.clone()).await.expect("redis");
    let f = fields.clone();
    let get = call(move |i: usize| {
        let (mut conn, (hash, field)) = (redis.clone(), f[i % f.len()].clone());
        async move {
            let found: Option<Vec<u8>> =
                redis::cmd("HGET").arg(&hash).arg(&field).query_async(&mut conn).await.expect("hget");
            assert!(found.is_some(), "{hash} holds no result");
        }
    });
    let redis::ConnectionAddr::Tcp(host, port) = client.get_connection_info().addr() else { return vec![("get", get)] };
    let mut sockets = Vec::new();
    for _ in 0..tasks {
        let socket = tokio::net::TcpStream::connect((host.as_str(), *port)).await.expect("tcp connect");
        socket.set_nodelay(true).expect("nodelay");
        sockets.push(tokio::sync::Mutex::new(tokio::io::BufReader::new(socket)));
    }
    let sockets = Arc::new(sockets);
    let tcp = call(move |i: usize| {
        let (sockets, (hash, field)) = (sockets.clone(), fields[i % fields.len()].clone());
        async move {
            let mut socket = sockets[i % sockets.len()].lock().await;
            let mut request =
                format!("*3\r\n$4\r\nHGET\r\n${}\r\n{hash}\r\n${}\r\n", hash.len(), field.len()).into_bytes();
            request.extend_from_slice(&field);
            request.extend_from_slice(b"\r\n");
            socket.get_mut().write_all(&request).await.expect("tcp write");
            // A bulk string: `$<length>\r\n`, the bytes, `\r\n`.
            let mut header = String::new();
            socket.read_line(&mut header).await.expect("tcp read");
            let length: usize = header.trim_end().strip_prefix('$').and_then(|n| n.parse().ok()).expect("bulk reply");
            let mut value = vec![0; length + 2];
            socket.read_exact(&mut value).await.expect("tcp read");
        }
    });
    vec![("get", get), ("tcp", tcp)]
}

/// Counts the commands clients send to Redis nodes from [`start`] to
/// [`stop`], through `MONITOR`: what a script runs inside Redis shows there
/// as `[0 lua]` and is no round trip. Whatever background work a counted
/// call leaves (the cache write) lands before `stop` ends the count.
///
/// [`start`]: RedisCount::start
/// [`stop`]: RedisCount::stop
struct RedisCount {
    nodes: Vec<(String, u16)>,
    readers: Vec<tokio::task::JoinHandle<u64>>,
}

impl RedisCount {
    const MARK: &str = "idem-bench-count-end";

    async fn start(nodes: &[redis::Client]) -> Self {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let mut count = RedisCount { nodes: Vec::new(), readers: Vec::new() };
        for node in nodes {
            let redis::ConnectionAddr::Tcp(host, port) = node.get_connection_info().addr() else { continue };
            let mut socket = tokio::net::TcpStream::connect((host.as_str(), *port)).await.expect("monitor connect");
            socket.write_all(b"MONITOR\r\n").await.expect("monitor");
            let mut lines = BufReader::new(socket).lines();
            assert_eq!(lines.next_line().await.expect("monitor reply").as_deref(), Some("+OK"));
            count.nodes.push((host.clone(), *port));
            count.readers.push(tokio::spawn(async move {
                let mut sent = 0;
                while let Ok(Some(line)) = lines.next_line().await {
                    if line.contains(Self::MARK) {
                        break;
                    }
                    sent += u64::from(!line.contains(" lua]"));
                }
                sent
            }));
        }
        count
    }

    /// Commands per node summed; the background work of the counted calls
    /// gets a moment to land first.
    async fn stop(self) -> u64 {
        use tokio::io::AsyncWriteExt;
        if self.nodes.is_empty() {
            return 0;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        for (host, port) in &self.nodes {
            let mut socket = tokio::net::TcpStream::connect((host.as_str(), *port)).await.expect("mark connect");
            let mark = format!("*2\r\n$4\r\nECHO\r\n${}\r\n{}\r\n", Self::MARK.len(), Self::MARK);
            socket.write_all(mark.as_bytes()).await.expect("mark");
        }
        let mut total = 0;
        for reader in self.readers {
            total += reader.await.expect("monitor reader");
        }
        total
    }
}

/// The gate's claim (it also looks for the call's result in the hot
/// windows) and cache write, for the `floor-gate` row.
static GATE_CLAIM: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../idempotency-runtime/src/gate/redis/claim.lua")));
static GATE_FINISH: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../idempotency-runtime/src/gate/redis/finish.lua")));

/// The `floor` row's cache write: the least one checked against the claim
/// does (the engine's also tells waiting duplicates, and writes into the
/// hot window's hash).
static FLOOR_FINISH: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) \
         return 1 end return 0",
    )
});

/// Which rows a runtime measures. One caller runs on a current-thread
/// runtime: on a multi-thread one, whether its idle second worker happens
/// to be awake splits a lone caller's round trips in two (on the 2-vCPU
/// machine the figures come from: 9 µs with a vCPU awake, 70 µs when both
/// had to wake), and a median over that mix is noise. Many callers, and
/// the storms, run on the multi-thread runtime.
#[derive(Clone, Copy, PartialEq)]
enum Phase {
    OneTask,
    Concurrent,
}

impl Phase {
    fn tasks(self) -> usize {
        match self {
            Phase::OneTask => 1,
            Phase::Concurrent => CONCURRENCY,
        }
    }

    fn runtime(self) -> tokio::runtime::Runtime {
        match self {
            Phase::OneTask => tokio::runtime::Builder::new_current_thread(),
            Phase::Concurrent => tokio::runtime::Builder::new_multi_thread(),
        }
        .enable_all()
        .build()
        .expect("runtime")
    }
}

/// Where the claims live in one pass of the bench.
#[derive(Clone)]
enum Claims {
    None,
    Single(redis::Client),
    Cluster(Box<redis::cluster::ClusterClient>, Vec<redis::Client>),
}

impl Claims {
    fn label(&self) -> &'static str {
        match self {
            Claims::None => "none",
            Claims::Single(_) => "redis",
            Claims::Cluster(..) => "cluster",
        }
    }

    /// The nodes whose counters tell the round trips.
    fn nodes(&self) -> Vec<redis::Client> {
        match self {
            Claims::None => Vec::new(),
            Claims::Single(c) => vec![c.clone()],
            Claims::Cluster(_, nodes) => nodes.clone(),
        }
    }
}

/// Statements and Redis commands per call, over `n` sequential calls.
async fn round_trips<F, Fut>(begin_logged: bool, redis: &[redis::Client], n: usize, call: F) -> (f64, f64)
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let redis_count = RedisCount::start(redis).await;
    COUNTER.count.store(0, Ordering::Relaxed);
    COUNTER.transaction_ends.store(0, Ordering::Relaxed);
    COUNTER.on.store(true, Ordering::Relaxed);
    for i in 0..n {
        call(i).await;
    }
    COUNTER.on.store(false, Ordering::Relaxed);
    let unlogged_begins = if begin_logged { 0 } else { COUNTER.transaction_ends.load(Ordering::Relaxed) };
    let sql = (COUNTER.count.load(Ordering::Relaxed) + unlogged_begins) as f64 / n as f64;
    let redis_cmds = redis_count.stop().await as f64 / n as f64;
    (sql, redis_cmds)
}

macro_rules! backend {
    ($module:ident, $db:ident, $name:literal, $begin_logged:literal, $url:expr, $ddl:literal, $seed:literal, $update:literal, $insert_record:literal, $insert_bounded:literal, $select_record:literal) => {
        mod $module {
            use super::*;

            /// Whether sqlx logs this backend's `BEGIN` as a statement.
            const BEGIN_LOGGED: bool = $begin_logged;
            use sqlx::{Transaction, $db};

            pub async fn bare(pool: &sqlx::Pool<$db>, order_id: i64) {
                let mut tx = pool.begin().await.expect("begin");
                sqlx::query($update).bind(order_id).execute(&mut *tx).await.expect("update");
                tx.commit().await.expect("commit");
            }

            #[idempotent(key = "<run>_<n>", ttl = "1h", biz = "bench_pay")]
            pub async fn pay(
                idem: &Idem<$db>,
                tx: &mut Transaction<'_, $db>,
                run: &str,
                n: usize,
                order_id: i64,
                #[idem(skip)] executions: &AtomicUsize,
            ) -> Result<Receipt, BenchError> {
                executions.fetch_add(1, Ordering::Relaxed);
                sqlx::query($update).bind(order_id).execute(&mut **tx).await?;
                Ok(Receipt { order_id, amount: 1999 })
            }

            /// Call `i` of a replay row: one of the ten finished keys
            /// `<run>_0` to `<run>_9` again, through `idempotency`.
            async fn replay_one(idem: &Idem<$db>, run: &str, i: usize, executions: &AtomicUsize, row: &str) {
                let n = i % 10;
                if let Err(e) = pay(idem, run, n, (n as i64 % ORDERS) + 1, executions).await {
                    panic!("{row}: {e:?}");
                }
            }

            /// The least a first call with a claim can cost, with no idempotency code
            /// at all: the claim, the body's transaction with the record
            /// insert, and the cache write spawned off the caller's path.
            /// `gate`: the statements the engine sends instead (its claim and
            /// cache-write scripts, the insert bounded by `lock_wait`) in
            /// place of a native `SET NX GET`, a plain insert and the least
            /// cache write: what is left between it and `first` is the
            /// engine's own code.
            pub async fn floor(
                pool: &sqlx::Pool<$db>,
                redis: &redis::aio::ConnectionManager,
                key: String,
                order_id: i64,
                gate: bool,
            ) {
                let redis_key = format!("idem:bench_floor:{key}");
                let mut conn = redis.clone();
                let claim = if gate {
                    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
                    GATE_CLAIM
                        .key(&redis_key)
                        .key("idem:bench_floor:results:0")
                        .key("idem:bench_floor:results:1")
                        .arg("p:token:fp")
                        .arg(30_000)
                        .arg(&key)
                        .arg(now as i64)
                        .arg(3_600_000)
                        .invoke_async(&mut conn)
                        .await
                } else {
                    redis::cmd("SET")
                        .arg(&redis_key)
                        .arg("p:token:fp")
                        .arg("NX")
                        .arg("PX")
                        .arg(30_000)
                        .arg("GET")
                        .query_async(&mut conn)
                        .await
                };
                let _: Option<String> = claim.expect("claim");
                let mut tx = pool.begin().await.expect("begin");
                sqlx::query($update).bind(order_id).execute(&mut *tx).await.expect("update");
                let now =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
                // The unique column as the engine writes it: the key's digest.
                let digest: String =
                    idempotency::key::key_digest("bench_floor", &key).iter().map(|b| format!("{b:02x}")).collect();
                let insert = if gate { $insert_bounded } else { $insert_record };
                sqlx::query(insert)
                    .bind(digest)
                    .bind("bench_floor")
                    .bind(&key)
                    .bind(None::<&str>)
                    .bind("0".repeat(64))
                    .bind(1i16)
                    .bind(r#"{"order_id":1,"amount":1999}"#)
                    .bind(now)
                    .bind(now)
                    .bind(now + 3_600_000)
                    .execute(&mut *tx)
                    .await
                    .expect("insert record");
                tx.commit().await.expect("commit");
                tokio::spawn(async move {
                    let finish = if gate {
                        GATE_FINISH
                            .key(&redis_key)
                            .key("idem:bench_floor:results:0")
                            .arg("p:token:fp")
                            .arg(&key)
                            .arg(r#"d:fp:{"order_id":1,"amount":1999}"#)
                            .arg(3_600_000)
                            .arg("1")
                            .invoke_async(&mut conn)
                            .await
                    } else {
                        FLOOR_FINISH
                            .key(&redis_key)
                            .arg("p:token:fp")
                            .arg("d:fp:{}")
                            .arg(3_600_000)
                            .invoke_async(&mut conn)
                            .await
                    };
                    let _: i64 = finish.expect("finish");
                });
            }

            pub async fn run(rows: &mut Vec<Row>, passes: &[Claims], phase: Phase) -> Option<()> {
                run_on(rows, passes, $url, $name, phase).await
            }

            /// The rows on the server at `url`, labelled `name`.
            pub async fn run_on(
                rows: &mut Vec<Row>,
                passes: &[Claims],
                url: String,
                name: &'static str,
                phase: Phase,
            ) -> Option<()> {
                let pool = sqlx::pool::PoolOptions::<$db>::new()
                    .max_connections(POOL)
                    .test_before_acquire(false)
                    .connect(&url)
                    .await
                    .map_err(|e| println!("skipped: {name} unreachable ({e})"))
                    .ok()?;
                // Every connection open before the first row: opening one (a
                // process fork on PostgreSQL) is not what a call costs, and
                // a storm's waiters would otherwise measure it.
                let mut open = Vec::with_capacity(POOL as usize);
                for _ in 0..POOL {
                    open.push(pool.acquire().await.expect("connect"));
                }
                drop(open);
                sqlx::raw_sql($ddl).execute(&pool).await.expect("orders table");
                sqlx::query($seed).bind(ORDERS).execute(&pool).await.expect("seed orders");
                let (seq_calls, conc_calls, storms) = if quick() { (600, 1_000, 5) } else { (2_000, 6_000, 20) };

                for claims in passes {
                    let builder = Idem::builder(pool.clone());
                    let idem = match claims {
                        Claims::None => builder.build(),
                        Claims::Single(c) => builder.redis(c.clone()).build(),
                        Claims::Cluster(c, _) => builder.redis_cluster((**c).clone()).build(),
                    };
                    idem.migrate().await.expect("migrate");
                    let client = claims.nodes();
                    let label = claims.label();
                    let run_id = idempotency_testkit::unique(label);
                    let executions = Arc::new(AtomicUsize::new(0));

                    let tasks = phase.tasks();
                    let calls = if tasks == 1 { seq_calls } else { conc_calls };
                    let push =
                        |rows: &mut Vec<Row>, mode, (wall, lat): (Duration, Vec<Duration>), (sql, redis_cmds)| {
                            rows.push(Row {
                                backend: name,
                                redis: label,
                                mode,
                                tasks,
                                calls: lat.len(),
                                calls_per_sec: lat.len() as f64 / wall.as_secs_f64(),
                                p50_ms: percentile(&lat, 0.50),
                                p99_ms: percentile(&lat, 0.99),
                                sql_per_call: sql,
                                redis_per_call: redis_cmds,
                                executions: None,
                            });
                        };

                    // bare, first (a fresh key per call) and, with one Redis node,
                    // floor (the same round trips hand-written) in turns, so each
                    // ratio compares rows of the same moments; bare's Redis column
                    // does not apply, and it is measured in every pass for that
                    let tag = format!("{run_id}-first{tasks}");
                    let p = pool.clone();
                    let mut turns = vec![(
                        "bare",
                        call(move |i| {
                            let p = p.clone();
                            async move { bare(&p, (i as i64 % ORDERS) + 1).await }
                        }),
                    )];
                    let (i2, t2, e2) = (idem.clone(), tag.clone(), executions.clone());
                    turns.push((
                        "first",
                        call(move |i| {
                            let (idem, tag, e) = (i2.clone(), t2.clone(), e2.clone());
                            async move {
                                pay(&idem, &tag, i, (i as i64 % ORDERS) + 1, &e).await.expect("first");
                            }
                        }),
                    ));
                    let floor_redis = match claims {
                        Claims::Single(c) => Some(redis::aio::ConnectionManager::new(c.clone()).await.expect("redis")),
                        _ => None,
                    };
                    if let Some(redis) = &floor_redis {
                        for (mode, gate) in [("floor", false), ("floor-gate", true)] {
                            let (p, r, t) = (pool.clone(), redis.clone(), format!("{tag}-{mode}"));
                            turns.push((
                                mode,
                                call(move |i| {
                                    let (p, r, key) = (p.clone(), r.clone(), format!("{t}_{i}"));
                                    async move { floor(&p, &r, key, (i as i64 % ORDERS) + 1, gate).await }
                                }),
                            ));
                        }
                    }
                    for (mode, timing) in alternating(tasks, calls, turns).await {
                        let counted = match (mode, &floor_redis) {
                            ("bare", _) => {
                                round_trips(BEGIN_LOGGED, &[], 50, |i| bare(&pool, (i as i64 % ORDERS) + 1)).await
                            }
                            ("floor" | "floor-gate", Some(redis)) => {
                                let t = format!("{tag}-{mode}count");
                                round_trips(BEGIN_LOGGED, &client, 50, |i| {
                                    floor(
                                        &pool,
                                        redis,
                                        format!("{t}_{i}"),
                                        (i as i64 % ORDERS) + 1,
                                        mode == "floor-gate",
                                    )
                                })
                                .await
                            }
                            _ => {
                                let tag_c = format!("{tag}-count");
                                round_trips(BEGIN_LOGGED, &client, 50, |i| {
                                    let (idem, tag, e) = (&idem, &tag_c, &executions);
                                    async move {
                                        pay(idem, tag, i, 1, e).await.expect("first");
                                    }
                                })
                                .await
                            }
                        };
                        push(rows, mode, timing, counted);
                    }

                    // replay: the same 10 finished keys again and again; with one
                    // Redis node in turns with plain GETs (pushed after replay-local)
                    let (i2, t2, e2) = (idem.clone(), tag.clone(), executions.clone());
                    let before = executions.load(Ordering::Relaxed);
                    let replay = call(move |i| {
                        let (idem, tag, e) = (i2.clone(), t2.clone(), e2.clone());
                        async move { replay_one(&idem, &tag, i, &e, "replay").await }
                    });
                    let mut turns = vec![("replay", replay)];
                    // select: the floor of a replay without Redis, one indexed
                    // read of the record in autocommit (by its unique digest)
                    if let Claims::None = claims {
                        let digests: Arc<Vec<String>> = Arc::new(
                            (0..10)
                                .map(|n| {
                                    let key = format!("{tag}_{n}");
                                    idempotency::key::key_digest("bench_pay", &key)
                                        .iter()
                                        .map(|b| format!("{b:02x}"))
                                        .collect()
                                })
                                .collect(),
                        );
                        let p = pool.clone();
                        turns.push((
                            "select",
                            call(move |i| {
                                let (p, digest) = (p.clone(), digests[i % digests.len()].clone());
                                async move {
                                    let found: Option<(Option<String>,)> = sqlx::query_as($select_record)
                                        .bind(digest)
                                        .fetch_optional(&p)
                                        .await
                                        .expect("select");
                                    assert!(found.is_some_and(|(r,)| r.is_some()), "no record to select");
                                }
                            }),
                        ));
                    }
                    if let Claims::Single(c) = claims {
                        let mut conn = c.get_multiplexed_async_connection().await.expect("redis");
                        // Each replayed result: its field in the hash of its window.
                        let namespace = idem.redis_namespace().await.expect("namespace").expect("migrated");
                        let mut fields = Vec::new();
                        for n in 0..10 {
                            let at = idempotency::redis_layout::locate(
                                namespace.as_str(),
                                "bench_pay",
                                &format!("{tag}_{n}"),
                            )
                            .expect("namespace");
                            let hashes: Vec<String> = redis::cmd("KEYS")
                                .arg(format!("{}*", at.results_prefix))
                                .query_async(&mut conn)
                                .await
                                .expect("keys");
                            for hash in hashes {
                                let held: bool = redis::cmd("HEXISTS")
                                    .arg(&hash)
                                    .arg(&at.field[..])
                                    .query_async(&mut conn)
                                    .await
                                    .expect("hexists");
                                if held {
                                    fields.push((hash, at.field.to_vec()));
                                    break;
                                }
                            }
                        }
                        assert_eq!(fields.len(), 10, "the replayed results in redis");
                        turns.extend(plain_gets(c, tasks, fields).await);
                    }
                    // A replay is short: from one task five times the calls, so
                    // that its median and GET's hold still from run to run
                    // (300 calls of a round trip that is 20 µs or 80 µs as the
                    // vCPUs happen to sleep gave a ratio anywhere in ±20 %).
                    let replay_calls = if tasks == 1 { calls * 5 } else { calls };
                    let mut timings = alternating(tasks, replay_calls, turns).await.into_iter();
                    let (_, timing) = timings.next().expect("replay row");
                    // pushed after replay, as get and tcp
                    let gets: Vec<_> = timings.collect();
                    assert_eq!(executions.load(Ordering::Relaxed), before, "a replay executed the body");
                    let counted =
                        round_trips(BEGIN_LOGGED, &client, 50, |i| replay_one(&idem, &tag, i, &executions, "replay"))
                            .await;
                    push(rows, "replay", timing, counted);

                    // replay-local: the same finished keys from the process's own cache
                    if !matches!(claims, Claims::Cluster(..)) {
                        let cache = idempotency::LocalCache::new(10_000, 64 << 20).max_age(Duration::from_secs(600));
                        let builder = Idem::builder(pool.clone()).local_cache(cache);
                        let local = match claims {
                            Claims::Single(c) => builder.redis(c.clone()).build(),
                            _ => builder.build(),
                        };
                        for i in 0..10 {
                            replay_one(&local, &tag, i, &executions, "warm").await;
                        }
                        let before = executions.load(Ordering::Relaxed);
                        let (l2, t2, e2) = (local.clone(), tag.clone(), executions.clone());
                        let local_calls = calls * 20;
                        let timing = drive(tasks, local_calls, None, move |i| {
                            let (idem, tag, e) = (l2.clone(), t2.clone(), e2.clone());
                            async move { replay_one(&idem, &tag, i, &e, "replay-local").await }
                        })
                        .await;
                        assert_eq!(executions.load(Ordering::Relaxed), before, "a local replay executed the body");
                        let counted = round_trips(BEGIN_LOGGED, &client, 50, |i| {
                            replay_one(&local, &tag, i, &executions, "replay-local")
                        })
                        .await;
                        push(rows, "replay-local", timing, counted);
                    }

                    // get, tcp and select: the least a replay's one round trip costs
                    for (mode, timing) in gets {
                        push(rows, mode, timing, (f64::NAN, f64::NAN));
                    }

                    // storm: 100 calls released together on one new key
                    if phase == Phase::OneTask {
                        continue;
                    }
                    let mut lat = Vec::new();
                    let mut wall = Duration::ZERO;
                    for s in 0..storms {
                        let storm_exec = Arc::new(AtomicUsize::new(0));
                        let barrier = Arc::new(Barrier::new(STORM));
                        let tag = format!("{run_id}-storm{s}");
                        let mut handles = Vec::new();
                        for _ in 0..STORM {
                            let (idem, tag, e, b) = (idem.clone(), tag.clone(), storm_exec.clone(), barrier.clone());
                            handles.push(tokio::spawn(async move {
                                b.wait().await;
                                let t = Instant::now();
                                let r = pay(&idem, &tag, 0, 1, &e).await;
                                assert!(
                                    matches!(r, Ok(_) | Err(BenchError::Idem(idempotency::Error::InProgress { .. }))),
                                    "{r:?}"
                                );
                                t.elapsed()
                            }));
                        }
                        let start = Instant::now();
                        for h in handles {
                            lat.push(h.await.expect("storm task"));
                        }
                        wall += start.elapsed();
                        let n = storm_exec.load(Ordering::Relaxed);
                        assert_eq!(n, 1, "storm {s} executed {n} times");
                    }
                    lat.sort();
                    rows.push(Row {
                        backend: name,
                        redis: label,
                        mode: "storm",
                        tasks: STORM,
                        calls: lat.len(),
                        calls_per_sec: lat.len() as f64 / wall.as_secs_f64(),
                        p50_ms: percentile(&lat, 0.50),
                        p99_ms: percentile(&lat, 0.99),
                        sql_per_call: f64::NAN,
                        redis_per_call: f64::NAN,
                        executions: Some(1),
                    });
                }
                Some(())
            }
        }
    };
}

backend!(
    mariadb,
    MySql,
    "mariadb",
    true,
    idempotency_testkit::mysql_url(),
    "CREATE TABLE IF NOT EXISTS bench_orders (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL, paid_count BIGINT NOT NULL DEFAULT 0)",
    "INSERT IGNORE INTO bench_orders (id, status) WITH RECURSIVE n (i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) SELECT i, 'PENDING' FROM n",
    "UPDATE bench_orders SET paid_count = paid_count + 1 WHERE id = ? AND status = 'PENDING'",
    "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (UNHEX(?), ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    "/*M! SET STATEMENT innodb_lock_wait_timeout = 5 FOR */ INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (UNHEX(?), ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    "SELECT response FROM idem_record WHERE key_digest = UNHEX(?)"
);

backend!(
    postgres,
    Postgres,
    "postgres",
    false,
    idempotency_testkit::pg_url(),
    "CREATE TABLE IF NOT EXISTS bench_orders (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL, paid_count BIGINT NOT NULL DEFAULT 0)",
    "INSERT INTO bench_orders (id, status) SELECT i, 'PENDING' FROM generate_series(1, $1) AS i ON CONFLICT DO NOTHING",
    "UPDATE bench_orders SET paid_count = paid_count + 1 WHERE id = $1 AND status = 'PENDING'",
    "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (CAST($1 AS uuid), $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (CAST($1 AS uuid), $2, $3, $4, $5, $6, $7, $8, $9, $10 + 0 * length(set_config('lock_timeout', '5000', true))) ON CONFLICT (key_digest) DO NOTHING",
    "SELECT response FROM idem_record WHERE key_digest = CAST($1 AS uuid)"
);

// Without Redis only (`main`), so its floor's inserts are never sent.
backend!(
    sqlite,
    Sqlite,
    "sqlite",
    false,
    sqlite_url(),
    "CREATE TABLE IF NOT EXISTS bench_orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL, paid_count INTEGER NOT NULL DEFAULT 0)",
    "INSERT OR IGNORE INTO bench_orders (id, status) WITH RECURSIVE n (i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) SELECT i, 'PENDING' FROM n",
    "UPDATE bench_orders SET paid_count = paid_count + 1 WHERE id = ? AND status = 'PENDING'",
    "-- not sent",
    "-- not sent",
    "SELECT response FROM idem_record WHERE key_digest = unhex(?)"
);

/// The SQLite database the bench writes: one file for the run, in the
/// system's temporary directory (sqlx opens it in WAL mode).
fn sqlite_url() -> String {
    format!("sqlite://{}?mode=rwc", sqlite_path().display())
}

fn sqlite_path() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("idem-bench-{}.db", std::process::id()))
}

fn ratio(rows: &[Row], backend: &str, redis: &str, tasks: usize, mode: &str) -> Option<f64> {
    let find =
        |m: &str| rows.iter().find(|r| r.backend == backend && r.redis == redis && r.tasks == tasks && r.mode == m);
    Some(find(mode)?.p50_ms / find("bare")?.p50_ms)
}

/// The performance targets, one line each: the ratio of two rows' p50
/// (same backend, claims and task count), its bound, and met or not met.
fn targets(rows: &[Row]) {
    let p50 = |backend: &str, redis: &str, tasks: usize, mode: &str| {
        rows.iter()
            .find(|r| r.backend == backend && r.redis == redis && r.tasks == tasks && r.mode == mode)
            .map(|r| r.p50_ms)
    };
    let targets: [(&str, &str, &str, &str, [f64; 2]); 3] = [
        ("replay without Redis / one indexed SELECT of the record", "none", "replay", "select", [1.3, 1.3]),
        ("replay with Redis / one HGET of its field", "redis", "replay", "get", [1.15, 1.3]),
        ("first call / the hand-written claim and record", "redis", "first", "floor", [1.10, 1.10]),
    ];
    println!();
    for (what, redis, mode, floor, bounds) in targets {
        for backend in ["mariadb", "postgres", "sqlite", "galera"] {
            for (tasks, bound) in [1, CONCURRENCY].into_iter().zip(bounds) {
                let (Some(row), Some(floor)) = (p50(backend, redis, tasks, mode), p50(backend, redis, tasks, floor))
                else {
                    continue;
                };
                let ratio = row / floor;
                let verdict = if ratio <= bound { "met" } else { "NOT met" };
                println!("target {what}, {backend}, {tasks} task(s): {ratio:.3}x (<= {bound:.2}x) {verdict}");
            }
        }
    }
    // Not a target: how much of the first call's ratio is its statements.
    for backend in ["mariadb", "postgres"] {
        for tasks in [1, CONCURRENCY] {
            let (Some(first), Some(gate)) =
                (p50(backend, "redis", tasks, "first"), p50(backend, "redis", tasks, "floor-gate"))
            else {
                continue;
            };
            println!(
                "beside: first call / the engine's own statements hand-written (floor-gate), {backend}, {tasks} task(s): {:.2}x",
                first / gate
            );
        }
    }
}

fn main() {
    tracing::subscriber::set_global_default(&COUNTER).expect("subscriber");
    let started = Instant::now();
    let mut passes = vec![Claims::None];
    let runtime = Phase::Concurrent.runtime();
    match redis::Client::open(idempotency_testkit::redis_url()) {
        Ok(c) if runtime.block_on(c.get_multiplexed_async_connection()).is_ok() => passes.push(Claims::Single(c)),
        _ => println!("skipped: redis unreachable (rows with Redis left out)"),
    }
    // A private 3-master cluster on loopback ports, stopped when dropped.
    let cluster = idempotency_testkit::servers::RedisCluster::start();
    if let Some(cluster) = &cluster {
        let nodes = cluster.urls().into_iter().map(|u| redis::Client::open(u).expect("node url")).collect();
        passes.push(Claims::Cluster(Box::new(cluster.client()), nodes));
    }
    let mut rows = Vec::new();
    for phase in [Phase::OneTask, Phase::Concurrent] {
        phase.runtime().block_on(async {
            mariadb::run(&mut rows, &passes, phase).await;
            postgres::run(&mut rows, &passes, phase).await;
            sqlite::run(&mut rows, &[Claims::None], phase).await;
        });
    }
    // A three-node MariaDB Galera cluster (about 25 s to start), started
    // once the single servers' rows are done so its nodes do not share the
    // cores with them: the same rows with the engines on its first node.
    // Full runs only, or with IDEM_BENCH_GALERA=1, so the quick run stays
    // under a minute.
    let galera = !quick() || std::env::var("IDEM_BENCH_GALERA").is_ok_and(|v| v == "1");
    if galera && let Some(galera) = idempotency_testkit::galera::Cluster::start() {
        let single: Vec<Claims> = passes.iter().filter(|p| !matches!(p, Claims::Cluster(..))).cloned().collect();
        for phase in [Phase::OneTask, Phase::Concurrent] {
            phase.runtime().block_on(mariadb::run_on(&mut rows, &single, galera.nodes[0].url(), "galera", phase));
        }
    }
    drop((cluster, runtime));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", sqlite_path().display()));
    }
    // One caller's rows, then many callers' and the storm, per backend and pass.
    let order = |r: &Row| {
        let backend = ["mariadb", "postgres", "sqlite", "galera"].iter().position(|b| *b == r.backend);
        let redis = ["none", "redis", "cluster"].iter().position(|c| *c == r.redis);
        (backend, redis, r.tasks)
    };
    rows.sort_by_key(order);

    println!(
        "\n{:<9} {:<7} {:<12} {:>5} {:>7} {:>10} {:>8} {:>8} {:>6} {:>6} {:>10} {:>10} {:>11} {:>11}",
        "backend",
        "redis",
        "mode",
        "tasks",
        "calls",
        "calls/s",
        "p50 ms",
        "p99 ms",
        "sql",
        "redis",
        "first/bare",
        "floor/bare",
        "bare/replay",
        "bare/local"
    );
    for r in &rows {
        let first = ratio(&rows, r.backend, r.redis, r.tasks, "first").filter(|_| r.mode == "bare");
        let floor = ratio(&rows, r.backend, r.redis, r.tasks, "floor").filter(|_| r.mode == "bare");
        let replay = ratio(&rows, r.backend, r.redis, r.tasks, "replay").filter(|_| r.mode == "bare").map(|x| 1.0 / x);
        let local =
            ratio(&rows, r.backend, r.redis, r.tasks, "replay-local").filter(|_| r.mode == "bare").map(|x| 1.0 / x);
        let fmt_ratio = |x: Option<f64>| x.map(|v| format!("{v:.2}x")).unwrap_or_default();
        let fmt_count = |x: f64| if x.is_nan() { "-".to_string() } else { format!("{x:.1}") };
        println!(
            "{:<9} {:<7} {:<12} {:>5} {:>7} {:>10.0} {:>8.3} {:>8.3} {:>6} {:>6} {:>10} {:>10} {:>11} {:>11}{}",
            r.backend,
            r.redis,
            r.mode,
            r.tasks,
            r.calls,
            r.calls_per_sec,
            r.p50_ms,
            r.p99_ms,
            fmt_count(r.sql_per_call),
            fmt_count(r.redis_per_call),
            fmt_ratio(first),
            fmt_ratio(floor),
            fmt_ratio(replay),
            fmt_ratio(local),
            r.executions.map(|e| format!("  executions per storm: {e}")).unwrap_or_default(),
        );
    }
    println!(
        "first/bare: how much a first call costs over the plain transaction; floor/bare: the same for the hand-written \
         round trips a first call cannot avoid (claim, record insert, spawned cache write); bare/replay: how much faster a replay is \
         (p50 latencies, same backend, claims and task count); get: one plain Redis GET through redis-rs, the least a replay's round trip costs; \
         tcp: the same GET hand-written on a plain socket, the machine's own round trip; \
         replay-local: a replay from the engine's local cache (bare/local: how much faster than bare). \
         sql, redis: round trips per call (SQLite's: statements, its BEGIN and COMMIT not counted: sqlx does not log them)."
    );

    targets(&rows);

    let json = serde_json::json!({
        "quick": quick(),
        "seconds": started.elapsed().as_secs_f64(),
        "rows": rows.iter().map(|r| {
            let mut v = serde_json::to_value(r).expect("row");
            v["first_over_bare"] = serde_json::json!(ratio(&rows, r.backend, r.redis, r.tasks, "first"));
            v["floor_over_bare"] = serde_json::json!(ratio(&rows, r.backend, r.redis, r.tasks, "floor"));
            v["bare_over_replay"] = serde_json::json!(ratio(&rows, r.backend, r.redis, r.tasks, "replay").map(|x| 1.0 / x));
            v["bare_over_replay_local"] =
                serde_json::json!(ratio(&rows, r.backend, r.redis, r.tasks, "replay-local").map(|x| 1.0 / x));
            if r.sql_per_call.is_nan() { v["sql_per_call"] = serde_json::Value::Null; v["redis_per_call"] = serde_json::Value::Null; }
            v
        }).collect::<Vec<_>>(),
    });
    let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    let path = std::path::Path::new(&dir).join("idem-bench.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json).expect("json")).expect("write json");
    println!("wrote {} in {:.1} s", path.display(), started.elapsed().as_secs_f64());

    // The chart of this run, beside the JSON and in docs/ (the performance
    // guide shows that copy).
    let svg = chart(&rows, quick(), started.elapsed().as_secs_f64());
    let chart_path = std::path::Path::new(&dir).join("idem-bench.svg");
    std::fs::write(&chart_path, &svg).expect("write svg");
    println!("wrote {}", chart_path.display());
    let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    if docs.is_dir() {
        std::fs::write(docs.join("bench.svg"), &svg).expect("write docs/bench.svg");
        println!("wrote {}", docs.join("bench.svg").display());
    }
}

/// An SVG bar chart of every row: a light bar to p99 with a dark bar to p50
/// over it, on a log scale (rows span 0.01 to 10 ms). Written by hand: no
/// plotting crate, no system libraries.
fn chart(rows: &[Row], quick: bool, seconds: f64) -> String {
    use std::fmt::Write;
    const LABEL_W: f64 = 250.0;
    const PLOT_W: f64 = 560.0;
    const VALUE_W: f64 = 130.0;
    const ROW_H: f64 = 18.0;
    const TOP: f64 = 62.0;
    let rows: Vec<&Row> = rows.iter().filter(|r| r.p50_ms > 0.0 && r.p99_ms.is_finite()).collect();
    let lo = rows.iter().map(|r| r.p50_ms).fold(f64::INFINITY, f64::min).log10().floor().min(-2.0);
    let hi = rows.iter().map(|r| r.p99_ms).fold(0.0, f64::max).log10().ceil().max(lo + 1.0);
    let x = |ms: f64| LABEL_W + (ms.max(10f64.powf(lo)).log10() - lo) / (hi - lo) * PLOT_W;
    // Rows grouped by (backend, claims), a heading line above each group.
    let mut lines: Vec<Option<&Row>> = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        if i == 0 || (rows[i - 1].backend, rows[i - 1].redis) != (r.backend, r.redis) {
            lines.push(None);
        }
        lines.push(Some(r));
    }
    let width = LABEL_W + PLOT_W + VALUE_W;
    let height = TOP + lines.len() as f64 * ROW_H + 20.0;
    let (dark, light) = ("#1f5fa8", "#a9c6ea");
    let mut svg = String::new();
    let _ = write!(
        svg,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"20\" font-size=\"14\" font-weight=\"bold\">idem bench: p50 and p99 per row, ms, log scale</text>\n\
         <text x=\"10\" y=\"38\" fill=\"#555\">{} run of {}, {seconds:.0} s (cargo bench --bench overhead --features mysql,postgres,redis)</text>\n\
         <rect x=\"{}\" y=\"11\" width=\"10\" height=\"10\" fill=\"{dark}\"/>\
         <text x=\"{}\" y=\"20\">p50</text>\
         <rect x=\"{}\" y=\"11\" width=\"10\" height=\"10\" fill=\"{light}\"/>\
         <text x=\"{}\" y=\"20\">p99</text>\n",
        if quick { "quick" } else { "full" },
        utc_date(),
        width - 110.0,
        width - 96.0,
        width - 60.0,
        width - 46.0,
    );
    // Grid: a labelled line per power of ten, faint ones at 2 and 5.
    let bottom = TOP + lines.len() as f64 * ROW_H;
    for decade in lo as i32..=hi as i32 {
        let base = 10f64.powi(decade);
        for (m, faint) in [(1.0, false), (2.0, true), (5.0, true)] {
            let v = base * m;
            if v > 10f64.powf(hi) * 1.0001 {
                break;
            }
            let gx = x(v);
            let stroke = if faint { "#eee" } else { "#ccc" };
            let _ = writeln!(
                svg,
                "<line x1=\"{gx:.1}\" y1=\"{}\" x2=\"{gx:.1}\" y2=\"{bottom}\" stroke=\"{stroke}\"/>",
                TOP - 6.0
            );
            if !faint {
                let text = if decade < 0 { format!("{:.*}", (-decade) as usize, v) } else { format!("{v:.0}") };
                let _ = writeln!(
                    svg,
                    "<text x=\"{gx:.1}\" y=\"{}\" text-anchor=\"middle\" fill=\"#555\">{text}</text>",
                    TOP - 9.0
                );
            }
        }
    }
    for (i, line) in lines.iter().enumerate() {
        let y = TOP + i as f64 * ROW_H;
        match line {
            None => {
                let r = lines[i + 1].expect("a heading comes before a row");
                let backend = match r.backend {
                    "mariadb" => "MariaDB",
                    "postgres" => "PostgreSQL",
                    "sqlite" => "SQLite",
                    "galera" => "MariaDB Galera",
                    other => other,
                };
                let claims = match r.redis {
                    "none" => "no Redis".to_string(),
                    "redis" => "claims in Redis".to_string(),
                    "cluster" => "claims in a Redis Cluster".to_string(),
                    other => format!("claims in {other}"),
                };
                let _ = writeln!(
                    svg,
                    "<text x=\"10\" y=\"{:.1}\" font-weight=\"bold\">{}, {}</text>",
                    y + 13.0,
                    escape(backend),
                    escape(&claims)
                );
            }
            Some(r) => {
                let tasks = if r.tasks == 1 { "1 task".to_string() } else { format!("{} tasks", r.tasks) };
                let _ = writeln!(
                    svg,
                    "<text x=\"24\" y=\"{:.1}\">{} ({tasks})</text>\n\
                     <rect x=\"{LABEL_W}\" y=\"{:.1}\" width=\"{:.1}\" height=\"12\" fill=\"{light}\"/>\n\
                     <rect x=\"{LABEL_W}\" y=\"{:.1}\" width=\"{:.1}\" height=\"12\" fill=\"{dark}\"/>\n\
                     <text x=\"{:.1}\" y=\"{:.1}\">{:.3} / {:.3}</text>",
                    y + 13.0,
                    escape(r.mode),
                    y + 3.0,
                    x(r.p99_ms) - LABEL_W,
                    y + 3.0,
                    x(r.p50_ms) - LABEL_W,
                    LABEL_W + PLOT_W + 8.0,
                    y + 13.0,
                    r.p50_ms,
                    r.p99_ms,
                );
            }
        }
    }
    svg.push_str("</svg>\n");
    svg
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Today's date in UTC, `YYYY-MM-DD` (days to civil date, Howard Hinnant's
/// algorithm), so the chart says when it ran without a date crate.
fn utc_date() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}
