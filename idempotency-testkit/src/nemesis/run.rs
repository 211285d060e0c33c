//! One run, from the parent: a private database and `redis-server`, two
//! proxies per engine process, the processes, the nemesis's two lanes
//! while they call, then the history and the tables through the checker.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency::Idem;

use super::NemesisBackend;
use super::checker::{Bounds, check};
use super::child::{LEASE, Orders};
use super::children::EngineProcess;
use super::cuts::{Log, Paths, run_lane};
use super::history::{self, Call, now_us};
use super::proxy::Proxy;
use super::report::Summary;
use super::schedule::{Config, Lane, Path};
use crate::servers::RedisServer;

/// The key prefix of every run (each has a database of its own).
const RUN: &str = "nemesis";

/// What the checker allows for, from the engine's own settings.
const BOUNDS: Bounds = Bounds {
    lease_us: LEASE.as_micros() as i64,
    // `Builder::redis_timeout`'s default.
    redis_timeout_us: 500_000,
    grace_us: 500_000,
    // The Redis back-off (1 s) after the timeout.
    redis_grace_us: 1_500_000,
};

/// Runs `cfg` on `B`, the engine processes being this binary's `child_test`
/// run again (the calling test, which starts with [`super::child_process`]). `None` when a server is
/// missing (skipped). Panics on any violation, naming the history lines;
/// the database and the history files are then kept for a look.
pub async fn run<B: NemesisBackend>(cfg: &Config, child_test: &str) -> Option<Summary> {
    let redis = RedisServer::start()?;
    let db_name = crate::unique("idem_nemesis").replace('-', "_");
    let admin = B::open_private(&db_name, 2).await?;
    B::create_tables(&admin).await;
    Idem::new(admin.clone()).migrate().await.expect("migrate");
    B::orders(&admin, RUN, cfg.keys).await;
    let dir = std::env::temp_dir().join(&db_name);
    std::fs::create_dir_all(&dir).expect("history directory");

    let (host, port) = B::server();
    let db_addr: SocketAddr = (host.as_str(), port).to_socket_addrs().expect("database address").next().unwrap();
    let redis_addr = SocketAddr::from(([127, 0, 0, 1], redis.port()));
    let mut paths = Vec::new();
    for _ in 0..cfg.procs {
        paths.push(Paths { redis: Proxy::start(redis_addr).await, db: Proxy::start(db_addr).await });
    }
    let history = |p: usize| dir.join(format!("p{p}.jsonl"));
    let children: Vec<EngineProcess> = (0..cfg.procs)
        .map(|proc| {
            let orders = Orders {
                backend: B::NAME.to_owned(),
                proc,
                db_port: paths[proc].db.port(),
                db_name: db_name.clone(),
                redis_port: paths[proc].redis.port(),
                run: RUN.to_owned(),
                seed: cfg.seed,
                procs: cfg.procs,
                calls_per_proc: cfg.calls_per_proc,
                keys: cfg.keys,
                tasks: cfg.tasks,
                interval_us: cfg.interval.as_micros() as i64,
                history: history(proc),
            };
            EngineProcess::spawn(child_test, &orders)
        })
        .collect();
    let paths = Arc::new(paths);
    println!("nemesis {} {}: seed {} (IDEM_NEMESIS_SEED replays the schedule)", cfg.label, B::NAME, cfg.seed);

    // Every process starts on the same instant, a little ahead.
    let (children, t0) = blocking(move || {
        let mut children = children;
        let ready_by = Instant::now() + Duration::from_secs(60);
        for child in &mut children {
            child.expect("IDEM-READY", ready_by);
        }
        let t0 = now_us() + 100_000;
        for child in &mut children {
            child.go(t0);
        }
        (children, t0)
    })
    .await;
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(Log::default()));
    let lanes = [Path::Redis, Path::Db]
        .map(|path| tokio::spawn(run_lane(Lane::new(cfg, path), paths.clone(), stop.clone(), log.clone(), t0)));
    let done_by = started + cfg.deadline;
    let made: usize = blocking(move || {
        children
            .into_iter()
            .map(|mut child| {
                let made = child.expect("IDEM-DONE ", done_by);
                child.exited();
                made.parse::<usize>().expect("a count of calls")
            })
            .sum()
    })
    .await;
    stop.store(true, SeqCst);
    for lane in lanes {
        lane.await.expect("a nemesis lane");
    }
    let elapsed = started.elapsed();

    let calls: Vec<Call> = (0..cfg.procs).flat_map(|p| history::read(&history(p))).collect();
    assert_eq!(calls.len(), made, "every call the processes made is in their history");
    let log = std::mem::take(&mut *log.lock().unwrap());
    let windows_file = dir.join("nemesis.jsonl");
    let lines: Vec<String> = log.windows.iter().map(|w| serde_json::to_string(w).unwrap()).collect();
    std::fs::write(&windows_file, lines.join("\n")).expect("write the nemesis's windows");
    let tables = B::tables(&admin, RUN).await;
    let verdict = check(&calls, &log.windows, &tables, &BOUNDS);
    let mut summary = Summary {
        backend: B::NAME,
        calls: calls.len(),
        windows: log.windows.len(),
        ledger_rows: tables.ledger.len(),
        records: tables.records.len(),
        elapsed,
        ..Summary::default()
    };
    for (_, event) in &log.events {
        *summary.events.entry((event.path, event.cut)).or_default() += 1;
        *summary.widths.entry(event.procs.len()).or_default() += 1;
    }
    summary.verdict = verdict;
    summary.print(cfg);
    let bad = &summary.verdict.violations;
    assert!(
        bad.is_empty(),
        "nemesis {} {} (seed {}): {} violations; database {db_name} and histories {} kept:\n{}",
        cfg.label,
        B::NAME,
        cfg.seed,
        bad.len(),
        dir.display(),
        bad.iter().take(40).cloned().collect::<Vec<_>>().join("\n")
    );
    B::drop_private(admin, &db_name).await;
    remove(dir);
    let missing = summary.missing();
    assert!(missing.is_empty(), "the run never went through: {}", missing.join(", "));
    Some(summary)
}

/// Runs blocking work (waiting on processes) off the runtime.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(work).await {
        Ok(value) => value,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

fn remove(dir: PathBuf) {
    let _ = std::fs::remove_dir_all(dir);
}
