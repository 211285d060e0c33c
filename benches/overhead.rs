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
//! Each row also prints the SQL round trips and Redis commands per call,
//! counted in a separate pass (`overhead/count.rs`); after the table, one
//! line per performance target: its ratio, its bound, met or not met.
//! Results also go to `target/idem-bench.json`.
//!
//! At a distance (`overhead/distance.rs`): the same rows on MariaDB and
//! PostgreSQL (from one task; in a full run from 32 too) with every round
//! trip to the database and to Redis 1 ms longer, the testkit's forwarder
//! holding each byte 0.5 ms each way (rows `mariadb+1ms`, `postgres+1ms`),
//! as a managed database or another zone is from its callers
//! (`IDEM_BENCH_ONLY=distance`: those rows alone).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idempotency::{Idem, idempotent};
use serde::{Deserialize, Serialize};
use support::{drive, percentile, quick};
use tokio::sync::Barrier;

#[path = "overhead/backends.rs"]
mod backends;
#[path = "overhead/count.rs"]
mod count;
#[path = "overhead/distance.rs"]
mod distance;
#[path = "overhead/report.rs"]
mod report;
#[path = "support/mod.rs"]
mod support;

use backends::{mariadb, postgres, sqlite, sqlite_path};
use count::round_trips;

const ORDERS: i64 = 1_000;
const CONCURRENCY: usize = 32;
const STORM: usize = 100;
/// Connections per backend's pool.
const POOL: u32 = 40;

/// Calls a counting pass makes before it counts (statements prepared on
/// the counted connection, the fn's count of replays settled).
const WARM: usize = 5;

/// How many calls each row makes.
#[derive(Clone, Copy)]
pub struct Scale {
    pub seq_calls: usize,
    pub conc_calls: usize,
    pub storms: usize,
    /// A replay row's calls from one task, per call of the other rows.
    pub replays_per_call: usize,
    /// Whether to measure the local cache's replay.
    pub local: bool,
    /// Calls a pass counting the round trips counts.
    pub counted: usize,
}

impl Scale {
    /// The rows on the servers at hand (loopback): quick or full.
    pub fn at_hand() -> Self {
        if quick() {
            Scale { seq_calls: 600, conc_calls: 1_000, storms: 5, replays_per_call: 5, local: true, counted: 50 }
        } else {
            Scale { seq_calls: 2_000, conc_calls: 6_000, storms: 20, replays_per_call: 5, local: true, counted: 50 }
        }
    }

    /// The rows at a distance, where every round trip takes a millisecond
    /// or more: fewer calls (each takes milliseconds), no storm, no local
    /// cache (it makes no round trip).
    pub fn at_a_distance() -> Self {
        if quick() {
            Scale { seq_calls: 200, conc_calls: 320, storms: 0, replays_per_call: 2, local: false, counted: 10 }
        } else {
            Scale { seq_calls: 400, conc_calls: 1_280, storms: 0, replays_per_call: 2, local: false, counted: 20 }
        }
    }
}

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

fn main() {
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
    // `IDEM_BENCH_ONLY=distance`: the rows at a distance alone.
    let only_far = std::env::var("IDEM_BENCH_ONLY").is_ok_and(|v| v == "distance");
    for phase in [Phase::OneTask, Phase::Concurrent].into_iter().filter(|_| !only_far) {
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
    let galera = !only_far && (!quick() || std::env::var("IDEM_BENCH_GALERA").is_ok_and(|v| v == "1"));
    if galera && let Some(galera) = idempotency_testkit::galera::Cluster::start() {
        let single: Vec<Claims> = passes.iter().filter(|p| !matches!(p, Claims::Cluster(..))).cloned().collect();
        for phase in [Phase::OneTask, Phase::Concurrent] {
            let url = galera.nodes[0].url();
            phase.runtime().block_on(mariadb::run_on(&mut rows, &single, url, "galera", phase, Scale::at_hand()));
        }
    }
    // The same rows with every round trip a millisecond longer.
    distance::run(&mut rows, &passes);
    drop((cluster, runtime));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", sqlite_path().display()));
    }
    report::table(&mut rows);
    report::targets(&rows);
    report::write(&rows, started);
}
