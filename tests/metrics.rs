//! Metrics read through a recorder: a known sequence of calls gives exact
//! counts by biz and outcome, replays by source (Redis, memory, database),
//! one Redis degraded period (begun and ended), the claims released from
//! the background, and the cron runner's slots. SQLite (a file) and Redis
//! (through a proxy the test can cut).
//!
//! One test: the recorder is global, and the Redis metrics carry no label a
//! second test could keep apart.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use idempotency::{Idem, Namespace, idempotent};
use idempotency_testkit::unique;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, Transaction};
use tokio::sync::{mpsc, oneshot};

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug in assertion messages
enum PayError {
    Idem(idempotency::Error),
    Declined,
}

impl From<idempotency::Error> for PayError {
    fn from(e: idempotency::Error) -> Self {
        PayError::Idem(e)
    }
}

/// What a body does: answer, fail, or say it started and wait to be let go.
enum Body {
    Ok,
    Fail,
    Held(mpsc::UnboundedSender<()>, oneshot::Receiver<()>),
}

macro_rules! pay_fn {
    ($name:ident, $biz:tt) => {
        #[idempotent(key = "<key>", ttl = "1h", biz = $biz)]
        async fn $name(
            idem: &Idem<Sqlite>,
            tx: &mut Transaction<'_, Sqlite>,
            key: String,
            amount: i64,
            #[idem(skip)] body: Body,
        ) -> Result<i64, PayError> {
            let _ = &tx;
            match body {
                Body::Ok => Ok(amount),
                Body::Fail => Err(PayError::Declined),
                Body::Held(started, go) => {
                    let _ = started.send(());
                    let _ = go.await;
                    Ok(amount)
                }
            }
        }
    };
}
pay_fn!(pay_redis, "m_redis");
pay_fn!(pay_memory, "m_memory");
pay_fn!(pay_cron, "m_cron");

/// What the recorder saw, summed over snapshots (a snapshot resets what it
/// reads: counters and gauges alike, so a gauge's increments and decrements
/// add up to its value).
#[derive(Default)]
struct Seen(HashMap<(String, Vec<(String, String)>), f64>);

impl Seen {
    fn take(&mut self, snapshotter: &Snapshotter) {
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let key = key.key();
            let mut labels: Vec<(String, String)> =
                key.labels().map(|l| (l.key().to_owned(), l.value().to_owned())).collect();
            labels.sort();
            let add = match value {
                DebugValue::Counter(n) => n as f64,
                DebugValue::Gauge(g) => g.into_inner(),
                DebugValue::Histogram(values) => values.len() as f64,
            };
            *self.0.entry((key.name().to_owned(), labels)).or_default() += add;
        }
    }

    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let mut labels: Vec<(String, String)> = labels.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect();
        labels.sort();
        self.0.get(&(name.to_owned(), labels)).copied().unwrap_or(0.0)
    }

    /// Every series of `name` whose labels include `label`, as `(other labels, value)`.
    fn series(&self, name: &str, label: (&str, &str)) -> Vec<(Vec<(String, String)>, f64)> {
        let mut found: Vec<_> = self
            .0
            .iter()
            .filter(|((n, labels), v)| {
                n == name && **v != 0.0 && labels.iter().any(|(k, v)| k == label.0 && v == label.1)
            })
            .map(|((_, labels), v)| (labels.iter().filter(|(k, _)| k != label.0).cloned().collect::<Vec<_>>(), *v))
            .collect();
        found.sort_by(|a, b| a.0.cmp(&b.0));
        found
    }
}

/// A TCP proxy in front of Redis that the test can cut (every connection
/// dropped, new ones refused) and restore.
struct Proxy {
    port: u16,
    up: Arc<AtomicBool>,
    links: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Proxy {
    async fn start(target: String) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let up = Arc::new(AtomicBool::new(true));
        let links = Arc::new(Mutex::new(Vec::new()));
        let (up2, links2) = (up.clone(), links.clone());
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !up2.load(Ordering::SeqCst) {
                    continue; // dropped: the connection is refused
                }
                let target = target.clone();
                let link = tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                links2.lock().unwrap().push(link.abort_handle());
            }
        });
        Proxy { port, up, links }
    }

    fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }

    fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

/// Polls `done` over fresh snapshots, for up to 10 s.
async fn until(seen: &mut Seen, snapshotter: &Snapshotter, what: &str, done: impl Fn(&Seen) -> bool) {
    let start = std::time::Instant::now();
    loop {
        seen.take(snapshotter);
        if done(seen) {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{what}: not within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn sqlite_pool(name: &str) -> (sqlx::SqlitePool, std::path::PathBuf) {
    let dir = std::env::temp_dir().join("idem-tests");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(format!("{}.db", unique(name)));
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(5));
    let pool = SqlitePoolOptions::new().max_connections(4).connect_with(options).await.expect("sqlite file");
    (pool, path)
}

#[tokio::test(flavor = "current_thread")]
async fn a_known_sequence_of_calls_counts_exactly() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().expect("the only recorder of this test binary");
    idempotency::metrics::describe();
    let mut seen = Seen::default();

    let Some(redis) = idempotency_testkit::redis_client().await else { return };
    let redis_addr = idempotency_testkit::redis_url().trim_start_matches("redis://").trim_end_matches('/').to_owned();
    let proxy = Proxy::start(redis_addr).await;
    let namespace = unique("m").replace('-', "_");
    let (pool, path) = sqlite_pool("metrics").await;
    let idem = Idem::builder(pool.clone())
        .redis(redis::Client::open(format!("redis://127.0.0.1:{}", proxy.port)).unwrap())
        .redis_namespace(Namespace::new(&namespace).unwrap())
        .redis_timeout(Duration::from_millis(300))
        .build();
    idem.migrate().await.expect("migrate");
    let cached = |key: &str| idempotency::redis_layout::locate(&namespace, "m_redis", key).unwrap();
    let ok = |key: &str, amount| pay_redis(&idem, key.to_owned(), amount, Body::Ok);

    // Executed, then replayed from Redis once the cached result landed.
    assert_eq!(ok("k1", 1).await.unwrap(), 1);
    idempotency_testkit::redis_cached_response(&redis, &cached("k1")).await;
    assert_eq!(ok("k1", 1).await.unwrap(), 1);
    // Key reused, rejected (invalid key), failed (the body's error).
    assert!(matches!(ok("k1", 2).await, Err(PayError::Idem(idempotency::Error::KeyReused { .. }))));
    assert!(matches!(ok("bad key", 1).await, Err(PayError::Idem(idempotency::Error::InvalidKey(_)))));
    assert!(matches!(pay_redis(&idem, "k2".into(), 1, Body::Fail).await, Err(PayError::Declined)));
    // In progress: a duplicate while the first holds the claim.
    let (started, mut started_rx) = mpsc::unbounded_channel();
    let (go, held) = oneshot::channel();
    let first = tokio::spawn({
        let idem = idem.clone();
        async move { pay_redis(&idem, "k3".into(), 3, Body::Held(started, held)).await }
    });
    started_rx.recv().await.expect("first started");
    assert!(matches!(ok("k3", 3).await, Err(PayError::Idem(idempotency::Error::InProgress { .. }))));
    go.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), 3);

    // A call dropped while its body runs: its claim is released from the
    // background (and the call, never ended, is not counted).
    let (started, mut started_rx) = mpsc::unbounded_channel();
    let (_keep, held) = oneshot::channel::<()>();
    let dropped = tokio::spawn({
        let idem = idem.clone();
        async move { pay_redis(&idem, "k4".into(), 4, Body::Held(started, held)).await }
    });
    started_rx.recv().await.expect("k4 started");
    dropped.abort();
    until(&mut seen, &snapshotter, "background release", |s| s.get("idem_background_releases_total", &[]) == 1.0).await;

    // Redis cut: one call goes on with the database alone (its unanswered
    // claim is released from the background); Redis restored, the period ends.
    proxy.cut();
    assert_eq!(ok("k5", 5).await.unwrap(), 5);
    proxy.restore();
    seen.take(&snapshotter);
    assert_eq!(seen.get("idem_redis_degraded_total", &[]), 1.0);
    until(&mut seen, &snapshotter, "redis recovered", |s| s.get("idem_redis_degraded", &[]) == 0.0).await;
    // Replayed from the database: Redis lost the cached result of k1. (After
    // the cut: k5 claims only while the fn's calls are not mostly replays;
    // a fn of replays reads first, and a failed read sends no claim.)
    idempotency_testkit::redis_forget(&redis, &cached("k1")).await;
    assert_eq!(ok("k1", 1).await.unwrap(), 1);

    // Without Redis, a duplicate on the same engine waits in memory and
    // takes the first call's result. On this single-threaded runtime the
    // spawned duplicate runs up to its wait before the test goes on.
    let local = Idem::new(pool.clone());
    let (started, mut started_rx) = mpsc::unbounded_channel();
    let (go, held) = oneshot::channel();
    let first = tokio::spawn({
        let local = local.clone();
        async move { pay_memory(&local, "m1".into(), 7, Body::Held(started, held)).await }
    });
    started_rx.recv().await.expect("m1 started");
    let waiter = tokio::spawn({
        let local = local.clone();
        async move { pay_memory(&local, "m1".into(), 7, Body::Ok).await }
    });
    for _ in 0..3 {
        tokio::task::yield_now().await;
    }
    go.send(()).unwrap();
    assert_eq!((first.await.unwrap().unwrap(), waiter.await.unwrap().unwrap()), (7, 7));

    seen.take(&snapshotter);
    let by_outcome = seen.series("idem_calls_total", ("biz", "m_redis"));
    let outcomes = |pairs: &[(&str, f64)]| -> Vec<(Vec<(String, String)>, f64)> {
        pairs.iter().map(|(o, n)| (vec![("outcome".to_owned(), (*o).to_owned())], *n)).collect()
    };
    assert_eq!(
        by_outcome,
        outcomes(&[
            ("executed", 3.0),
            ("failed", 1.0),
            ("in_progress", 1.0),
            ("key_reused", 1.0),
            ("rejected", 1.0),
            ("replayed", 2.0)
        ])
    );
    // Every call ended was timed, under its outcome.
    assert_eq!(seen.series("idem_call_duration_seconds", ("biz", "m_redis")), by_outcome);
    let sources = seen.series("idem_replays_total", ("biz", "m_redis"));
    let source = |pairs: &[(&str, f64)]| -> Vec<(Vec<(String, String)>, f64)> {
        pairs.iter().map(|(o, n)| (vec![("source".to_owned(), (*o).to_owned())], *n)).collect()
    };
    assert_eq!(sources, source(&[("database", 1.0), ("redis", 1.0)]));
    assert_eq!(seen.series("idem_calls_total", ("biz", "m_memory")), outcomes(&[("executed", 1.0), ("replayed", 1.0)]));
    assert_eq!(seen.series("idem_replays_total", ("biz", "m_memory")), source(&[("memory", 1.0)]));
    assert_eq!(seen.get("idem_background_releases_total", &[]), 2.0, "the dropped call and the unanswered claim");
    assert_eq!(seen.get("idem_redis_degraded_total", &[]), 1.0);
    assert_eq!(seen.get("idem_redis_degraded", &[]), 0.0);

    // The cron runner, on a clock the test moves: resumed after a slot 10 s
    // back with a 2 s window, it skips the 8 old slots, catches up the 2
    // recent ones, and runs the next on time; its metric counts exactly
    // what it reported.
    let reports = Arc::new(Mutex::new(HashMap::<&'static str, f64>::new()));
    let log = reports.clone();
    let (on_time, mut on_time_rx) = tokio::sync::watch::channel(false);
    let whole_second = SystemTime::UNIX_EPOCH
        + Duration::from_secs(SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs());
    let clock = idempotency_testkit::ManualClock::new(whole_second + Duration::from_millis(500));
    let runner = idempotency::cron::Runner::new(&local, "m_cron_job", "* * * * * *")
        .unwrap()
        .clock(clock.clone())
        .catch_up(Duration::from_secs(2))
        .resume_after(whole_second - Duration::from_secs(10))
        .on_slot(move |r| {
            *log.lock().unwrap().entry(r.outcome.as_str()).or_default() += 1.0;
            if !r.slot.is_catch_up() {
                on_time.send_replace(true);
            }
        });
    let local2 = local.clone();
    let run = runner.run(
        async move {
            let _ = on_time_rx.wait_for(|c| *c).await;
        },
        move |slot| {
            let local = local2.clone();
            async move { pay_cron(&local, format!("slot_{}", slot.unix_secs()), 1, Body::Ok).await }
        },
    );
    let next_slot = async {
        // Caught up, it waits for the next slot: it comes.
        assert_eq!(clock.sleepers(1).await, [whole_second + Duration::from_secs(1)]);
        clock.set(whole_second + Duration::from_secs(1));
    };
    tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(run, next_slot) }).await.expect("cron hung");
    seen.take(&snapshotter);
    let reported = reports.lock().unwrap().clone();
    assert_eq!(reported, HashMap::from([("skipped", 8.0), ("executed", 3.0)]));
    let counted: HashMap<String, f64> = seen
        .series("idem_cron_slots_total", ("job", "m_cron_job"))
        .into_iter()
        .map(|(l, n)| (l[0].1.clone(), n))
        .collect();
    let reported: HashMap<String, f64> = reported.into_iter().map(|(o, n)| (o.to_owned(), n)).collect();
    assert_eq!(counted, reported);

    let _ = std::fs::remove_file(path);
}
