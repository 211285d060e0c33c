//! Records on a multi-primary cluster: three MariaDB nodes with Galera on
//! private loopback ports (their own data directories, small buffer pools,
//! run as user `mysql`), one engine per node.
//!
//! - Two bodies of one key on two nodes, held until both ran, then both
//!   commit: Galera's certification lets one through and aborts the other
//!   with a deadlock error (at `COMMIT` or earlier); its caller replays the
//!   winner's result, never a failure.
//! - A storm of 100 calls on one key spread over the three nodes, with and
//!   without Redis: one committed execution, every answer that result or
//!   `InProgress`.
//! - A short soak with one node killed (SIGKILL) and restarted mid-run:
//!   the engines on it see errors, their retries go to the other nodes;
//!   then orders, payments and records are reconciled.
//!
//! Needs `mariadbd`, `mariadb-install-db`, `rsync` and Galera
//! (`/usr/lib/galera/libgalera_smm.so`, Debian's `galera-4`); `.ci/run`
//! installs what is missing. Without them the tests print `skipped: ...`
//! (or fail under `IDEM_REQUIRE_SERVICES=1`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use idem::{Idem, Outcome, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{MySql, Transaction};
use tokio::sync::Barrier;

const PROVIDER: &str = "/usr/lib/galera/libgalera_smm.so";
const NODES: usize = 3;

fn required() -> bool {
    std::env::var("IDEM_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

fn skip(why: &str) -> bool {
    assert!(!required(), "{why} and IDEM_REQUIRE_SERVICES=1");
    println!("skipped: {why}");
    false
}

fn installed() -> bool {
    let runs = |bin: &str| Command::new(bin).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !Path::new(PROVIDER).exists() {
        return skip("galera not installed");
    }
    for bin in ["mariadbd", "mariadb-install-db", "rsync"] {
        if !runs(bin).is_ok_and(|s| s.success()) && !Path::new("/usr/sbin/mariadbd").exists() {
            return skip(&format!("{bin} not installed"));
        }
    }
    true
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// One `mariadbd` with Galera, a child of the test (killed when dropped).
struct Node {
    cnf: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl Node {
    fn start(&mut self, new_cluster: bool) {
        let mut cmd = Command::new("mariadbd");
        cmd.arg(format!("--defaults-file={}", self.cnf.display())).arg("--user=mysql");
        if new_cluster {
            cmd.arg("--wsrep-new-cluster");
        }
        self.child = Some(cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("mariadbd"));
    }

    /// SIGKILL: the node dies mid-transaction, as a crashed server would.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.port)
    }

    fn status(&self, name: &str) -> Option<String> {
        let out = Command::new("mariadb")
            .args(["-h127.0.0.1", &format!("-P{}", self.port), "-uroot", "-N", "-B", "-e"])
            .arg(format!("SHOW STATUS LIKE '{name}'"))
            .output()
            .ok()?;
        String::from_utf8(out.stdout).ok()?.split_whitespace().nth(1).map(str::to_owned)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Three nodes in one cluster, in a temporary folder removed at the end.
struct Cluster {
    dir: PathBuf,
    nodes: Vec<Node>,
}

impl Cluster {
    fn start() -> Option<Cluster> {
        if !installed() {
            return None;
        }
        let dir = std::env::temp_dir().join(format!("idem-galera-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir).expect("cluster dir");
        let chown = |path: &Path| {
            let ok = Command::new("chown").arg("-R").arg("mysql:mysql").arg(path).status().is_ok_and(|s| s.success());
            assert!(ok, "chown mysql {}", path.display());
        };
        // The joiner's rsync runs as `mysql`: every folder on the way must let it in.
        let _ = Command::new("chmod").arg("755").arg(&dir).status();
        let gcomm: Vec<u16> = (0..NODES).map(|_| free_port()).collect();
        let address = gcomm.iter().map(|p| format!("127.0.0.1:{p}")).collect::<Vec<_>>().join(",");
        let mut nodes = Vec::new();
        for (i, gport) in gcomm.iter().enumerate() {
            let (port, ist, sst) = (free_port(), free_port(), free_port());
            let data = dir.join(format!("node{i}"));
            std::fs::create_dir_all(&data).expect("node dir");
            let cnf = dir.join(format!("node{i}.cnf"));
            std::fs::write(
                &cnf,
                format!(
                    "[mysqld]
datadir={data}/data
socket={data}/mysql.sock
pid-file={data}/mysql.pid
log-error={data}/error.log
port={port}
bind-address=127.0.0.1
skip-grant-tables
skip-name-resolve
innodb_buffer_pool_size=32M
binlog_format=ROW
default_storage_engine=InnoDB
innodb_autoinc_lock_mode=2
max_connections=200
wsrep_on=ON
wsrep_provider={PROVIDER}
wsrep_cluster_address=gcomm://{address}
wsrep_cluster_name=idem_test
wsrep_node_address=127.0.0.1
wsrep_node_name=node{i}
wsrep_provider_options=\"gmcast.listen_addr=tcp://127.0.0.1:{gport};ist.recv_addr=127.0.0.1:{ist};gcache.size=64M\"
wsrep_sst_method=rsync
wsrep_sst_receive_address=127.0.0.1:{sst}
",
                    data = data.display()
                ),
            )
            .expect("cnf");
            chown(&data);
            let installed = Command::new("mariadb-install-db")
                .arg(format!("--defaults-file={}", cnf.display()))
                .args(["--user=mysql", "--skip-test-db"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            assert!(installed, "mariadb-install-db for node {i}");
            nodes.push(Node { cnf, port, child: None });
        }
        let mut cluster = Cluster { dir, nodes };
        cluster.nodes[0].start(true);
        cluster.wait_for(0, Duration::from_secs(60));
        cluster.nodes[1].start(false);
        cluster.nodes[2].start(false);
        cluster.wait_for_size(3, Duration::from_secs(120));
        let created = Command::new("mariadb")
            .args(["-h127.0.0.1", &format!("-P{}", cluster.nodes[0].port), "-uroot", "-e"])
            .arg("CREATE DATABASE IF NOT EXISTS test")
            .status()
            .is_ok_and(|s| s.success());
        assert!(created, "create database test");
        Some(cluster)
    }

    /// Waits until node `i` serves (`wsrep_ready`).
    fn wait_for(&self, i: usize, timeout: Duration) {
        let start = Instant::now();
        while self.nodes[i].status("wsrep_ready").as_deref() != Some("ON") {
            assert!(start.elapsed() < timeout, "node {i} not ready after {timeout:?}: see {}", self.dir.display());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until every node sees `size` members and serves.
    fn wait_for_size(&self, size: usize, timeout: Duration) {
        let start = Instant::now();
        let want = size.to_string();
        let ready = |n: &Node| {
            n.status("wsrep_cluster_size").as_deref() == Some(&want) && n.status("wsrep_ready").as_deref() == Some("ON")
        };
        while !self.nodes.iter().all(ready) {
            assert!(start.elapsed() < timeout, "cluster not at size {size} after {timeout:?}: {}", self.dir.display());
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A pool on one node. `wsrep_sync_wait = 7`: reads, updates and inserts
/// first wait until this node applied every transaction committed anywhere
/// before them, so the loser of a conflict finds the winner's record.
async fn pool_on(node: &Node, max: u32) -> sqlx::Pool<MySql> {
    let options: MySqlConnectOptions = node.url().parse().expect("url");
    MySqlPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(20))
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("SET SESSION wsrep_sync_wait = 7").execute(&mut *conn).await?;
                Ok(())
            })
        })
        .connect_lazy_with(options)
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    key: String,
    amount: i64,
    node: usize,
}

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug in assertion messages
enum TestError {
    Idem(idem::Error),
    Db(sqlx::Error),
}

impl From<idem::Error> for TestError {
    fn from(e: idem::Error) -> Self {
        TestError::Idem(e)
    }
}

impl From<sqlx::Error> for TestError {
    fn from(e: sqlx::Error) -> Self {
        TestError::Db(e)
    }
}

const LEDGER: &str = "CREATE TABLE IF NOT EXISTS galera_ledger (
    id BIGINT AUTO_INCREMENT PRIMARY KEY, k VARCHAR(255) NOT NULL, amount BIGINT NOT NULL, KEY (k))";

#[idempotent(key = "<k>", ttl = "1h", biz = "galera_pay")]
async fn pay(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    k: String,
    amount: i64,
    #[idem(skip)] node: usize,
    #[idem(skip)] bodies: &AtomicUsize,
) -> Result<Receipt, TestError> {
    bodies.fetch_add(1, SeqCst);
    sqlx::query("INSERT INTO galera_ledger (k, amount) VALUES (?, ?)").bind(&k).bind(amount).execute(&mut **tx).await?;
    Ok(Receipt { key: k, amount, node })
}

/// Bodies that wait at a gate the test opens, after their insert.
struct Held {
    started: AtomicUsize,
    gate: tokio::sync::Semaphore,
}

#[idempotent(key = "<k>", ttl = "1h", biz = "galera_pay")]
async fn pay_held(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    k: String,
    amount: i64,
    #[idem(skip)] node: usize,
    #[idem(skip)] held: &Held,
) -> Result<Receipt, TestError> {
    sqlx::query("INSERT INTO galera_ledger (k, amount) VALUES (?, ?)").bind(&k).bind(amount).execute(&mut **tx).await?;
    held.started.fetch_add(1, SeqCst);
    held.gate.acquire().await.expect("gate").forget();
    Ok(Receipt { key: k, amount, node })
}

/// Two nodes insert the record of one key and run its body at once (no
/// lock spans nodes); both commit: certification lets one through and
/// aborts the other with a deadlock error, whose caller replays the winner.
async fn certification_conflict(engines: &[Idem<MySql>]) {
    let k = format!("certify-{}", free_port());
    let held = Arc::new(Held { started: AtomicUsize::new(0), gate: tokio::sync::Semaphore::new(0) });
    let calls: Vec<_> = (0..2)
        .map(|node| {
            let (idem, k, held) = (engines[node].clone(), k.clone(), held.clone());
            tokio::spawn(async move { idem::observe(pay_held(&idem, k, 9, node, &held)).await })
        })
        .collect();
    let start = Instant::now();
    while held.started.load(SeqCst) < 2 {
        assert!(start.elapsed() < Duration::from_secs(30), "both bodies never ran at once");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    held.gate.add_permits(2);
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.expect("call"));
    }
    let mut outcomes: Vec<String> = answers.iter().map(|(_, o)| format!("{o:?}")).collect();
    outcomes.sort();
    assert_eq!(outcomes, ["Some(Executed)", "Some(Replayed)"], "{answers:?}");
    let (a, b) = (answers[0].0.as_ref().expect("first"), answers[1].0.as_ref().expect("second"));
    assert_eq!(a, b, "the loser answers with the winner's result");
    assert_eq!(count(&engines[0], LEDGER_ROWS, &k).await, 1, "the loser's body was rolled back");
    assert_eq!(count(&engines[0], RECORDS, &k).await, 1);
    println!("galera certification: two bodies on two nodes, one commit, the other replayed {a:?}");
}

async fn engines(cluster: &Cluster, redis: Option<&redis::Client>) -> Vec<Idem<MySql>> {
    let mut engines = Vec::new();
    for node in &cluster.nodes {
        let builder = Idem::builder(pool_on(node, 16).await).lock_wait(Duration::from_secs(2));
        let builder = match redis {
            Some(client) => builder.redis(client.clone()),
            None => builder,
        };
        engines.push(builder.build());
    }
    engines[0].migrate().await.expect("migrate");
    sqlx::raw_sql(LEDGER).execute(engines[0].pool()).await.expect("ledger");
    engines
}

async fn count(idem: &Idem<MySql>, sql: &'static str, k: &str) -> i64 {
    sqlx::query_scalar(sql).bind(k).fetch_one(idem.pool()).await.expect("count")
}

const LEDGER_ROWS: &str = "SELECT COUNT(*) FROM galera_ledger WHERE k = ?";
const RECORDS: &str = "SELECT COUNT(*) FROM idem_record WHERE biz_type = 'galera_pay' AND idem_key = ?";

/// 100 calls on one key over the three nodes: one committed execution,
/// every answer that result or `InProgress`, never a failure.
async fn storm(engines: &[Idem<MySql>], label: &str) {
    let k = format!("storm-{label}-{}", free_port());
    let bodies = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(Barrier::new(100));
    let start = Instant::now();
    let tasks: Vec<_> = (0..100)
        .map(|i| {
            let (idem, k, bodies, barrier) = (engines[i % NODES].clone(), k.clone(), bodies.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                idem::observe(pay(&idem, k, 7, i % NODES, &bodies)).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("task"));
    }
    let elapsed = start.elapsed();
    let mut outcomes: HashMap<String, usize> = HashMap::new();
    let mut values = Vec::new();
    for (result, outcome) in &answers {
        *outcomes.entry(format!("{outcome:?}")).or_default() += 1;
        match result {
            Ok(receipt) => values.push(receipt.clone()),
            Err(TestError::Idem(idem::Error::InProgress { .. })) => {}
            Err(e) => panic!("a duplicate got a failure: {e:?}"),
        }
    }
    let executed = answers.iter().filter(|(_, o)| *o == Some(Outcome::Executed)).count();
    assert_eq!(executed, 1, "{outcomes:?}");
    assert!(values.windows(2).all(|w| w[0] == w[1]), "every caller got the committed result");
    assert_eq!(count(&engines[0], LEDGER_ROWS, &k).await, 1, "one committed business write");
    assert_eq!(count(&engines[0], RECORDS, &k).await, 1);
    println!(
        "galera storm {label}: 100 calls over {NODES} nodes in {elapsed:?}: {outcomes:?}, {} bodies ran ({} rolled back by certification or the record)",
        bodies.load(SeqCst),
        bodies.load(SeqCst) - 1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn galera_storms_and_a_soak_with_a_node_killed() {
    let Some(mut cluster) = Cluster::start() else { return };
    let engines_plain = engines(&cluster, None).await;
    certification_conflict(&engines_plain).await;
    storm(&engines_plain, "without_redis").await;
    let redis = idem_redis().await;
    if let Some(client) = &redis {
        let engines_redis = engines(&cluster, Some(client)).await;
        storm(&engines_redis, "with_redis").await;
    }

    // The soak: 600 calls over 200 keys from 12 tasks, each call retried on
    // the next node when its own fails; node 2 killed a third of the way.
    let engines = engines_plain;
    let keys: Vec<String> = (0..200).map(|i| format!("soak-{}-{i}", free_port())).collect();
    let bodies = Arc::new(AtomicUsize::new(0));
    let calls = Arc::new(AtomicUsize::new(0));
    let node_killed = Arc::new(tokio::sync::Notify::new());
    let tasks: Vec<_> = (0..12)
        .map(|t| {
            let (engines, keys, bodies, calls, killed) =
                (engines.clone(), keys.clone(), bodies.clone(), calls.clone(), node_killed.clone());
            tokio::spawn(async move {
                let mut answers: Vec<(String, Result<Receipt, String>)> = Vec::new();
                for n in 0..50 {
                    let i = (t * 50 + n) * 7 % keys.len();
                    let k = keys[i].clone();
                    let amount = (i % 5) as i64 + 1;
                    if calls.fetch_add(1, SeqCst) == 200 {
                        killed.notify_one();
                    }
                    // Retried on the next node after a storage error (a dead
                    // node), as a load balancer would.
                    let mut answer = Err(String::new());
                    for attempt in 0..(NODES * 3) {
                        let node = (t + attempt) % NODES;
                        match pay(&engines[node], k.clone(), amount, node, &bodies).await {
                            Ok(r) => {
                                answer = Ok(r);
                                break;
                            }
                            Err(TestError::Idem(idem::Error::InProgress { .. })) => {
                                tokio::time::sleep(Duration::from_millis(50)).await;
                                answer = Err("in progress".into());
                            }
                            Err(e) => answer = Err(format!("{e:?}")),
                        }
                    }
                    answers.push((k, answer));
                }
                answers
            })
        })
        .collect();
    node_killed.notified().await;
    cluster.nodes[2].kill();
    let killed_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.nodes[2].start(false);
    let mut answers = Vec::new();
    for task in tasks {
        answers.extend(task.await.expect("soak task"));
    }
    cluster.wait_for_size(3, Duration::from_secs(120));
    println!("galera soak: node 2 killed and back in the cluster after {:?}", killed_at.elapsed());

    // Reconcile through node 0 (every node holds everything now).
    let check = &engines[0];
    let mut oks: HashMap<String, Vec<Receipt>> = HashMap::new();
    let mut failed = 0;
    for (k, answer) in &answers {
        match answer {
            Ok(r) => oks.entry(k.clone()).or_default().push(r.clone()),
            Err(_) => failed += 1,
        }
    }
    let mut mismatches = Vec::new();
    for k in &keys {
        let (ledger, records) = (count(check, LEDGER_ROWS, k).await, count(check, RECORDS, k).await);
        if ledger != records || ledger > 1 {
            mismatches.push(format!("{k}: {ledger} ledger rows, {records} records"));
        }
        if let Some(receipts) = oks.get(k) {
            if ledger != 1 {
                mismatches.push(format!("{k}: answered Ok but {ledger} ledger rows"));
            }
            if !receipts.windows(2).all(|w| w[0] == w[1]) {
                mismatches.push(format!("{k}: different answers {receipts:?}"));
            }
            let stored: Option<String> =
                sqlx::query_scalar("SELECT response FROM idem_record WHERE biz_type = 'galera_pay' AND idem_key = ?")
                    .bind(k)
                    .fetch_optional(check.pool())
                    .await
                    .expect("response");
            if stored != Some(serde_json::to_string(&receipts[0]).expect("json")) {
                mismatches.push(format!("{k}: stored {stored:?}, answered {:?}", receipts[0]));
            }
        }
    }
    println!(
        "galera soak: {} calls, {} keys answered Ok, {failed} calls without an answer after retries, {} bodies ran, mismatches {}",
        answers.len(),
        oks.len(),
        bodies.load(SeqCst),
        mismatches.len()
    );
    assert!(mismatches.is_empty(), "{mismatches:#?}");
    assert!(oks.len() >= keys.len() * 9 / 10, "most keys were answered: {}", oks.len());
}

async fn idem_redis() -> Option<redis::Client> {
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let client = redis::Client::open(url).ok()?;
    client.get_multiplexed_async_connection().await.ok().map(|_| client)
}
