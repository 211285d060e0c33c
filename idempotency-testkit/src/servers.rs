//! Private `redis-server` processes on their own loopback ports, for tests
//! that kill and restart Redis or need a Redis Cluster. The shared Redis
//! (6379) is never touched. Every process is a child of the test: killed
//! (SIGKILL) when its handle drops.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Whether `redis-server` and `redis-cli` can be run. When not, prints
/// `skipped: redis-server not installed` (or panics under
/// `IDEM_REQUIRE_SERVICES=1`) and returns `false`.
pub fn redis_server_installed() -> bool {
    let runs = |bin: &str| {
        Command::new(bin)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if runs("redis-server") && runs("redis-cli") {
        return true;
    }
    if crate::services_required() {
        panic!("redis-server not installed and IDEM_REQUIRE_SERVICES=1");
    }
    println!("skipped: redis-server not installed");
    false
}

/// A loopback port nobody listens on right now.
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local addr").port()
}

/// A cluster node also listens on its port + 10 000 (the cluster bus), so
/// Redis refuses ports above 55 535; the ephemeral range here reaches 60 999.
fn free_cluster_port() -> u16 {
    const BUS_OFFSET: u16 = 10_000;
    loop {
        let port = free_port();
        if port <= u16::MAX - BUS_OFFSET && TcpListener::bind(("127.0.0.1", port + BUS_OFFSET)).is_ok() {
            return port;
        }
    }
}

/// Runs one command on `port` over a fresh connection.
fn query<T: redis::FromRedisValue>(port: u16, cmd: &redis::Cmd) -> redis::RedisResult<T> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    let mut conn = client.get_connection_with_timeout(Duration::from_millis(500))?;
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    cmd.query(&mut conn)
}

fn wait_until(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < timeout, "{what} not ready after {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The process id of the `redis-server` answering on `port`, if one does.
fn server_pid(port: u16) -> Option<u32> {
    let info = query::<String>(port, redis::cmd("INFO").arg("server")).ok()?;
    info.lines().find_map(|l| l.strip_prefix("process_id:")).and_then(|v| v.trim().parse().ok())
}

/// One `redis-server` child process.
struct Process {
    port: u16,
    extra: Vec<String>,
    child: Option<Child>,
}

/// How many free ports a server is tried on: a port found free may be taken
/// by another process before the server binds it (seen as a collision,
/// never guessed), and then the next is tried.
const PORT_TRIES: usize = 5;

impl Process {
    /// Starts a server on a free port, trying another one when the port was
    /// taken in between (`port` gives the candidates).
    fn spawn_on_free_port(mut port: impl FnMut() -> u16, extra: impl Fn(u16) -> Vec<String>) -> Self {
        let mut collisions = Vec::new();
        for _ in 0..PORT_TRIES {
            let port = port();
            let mut p = Self { port, extra: extra(port), child: None };
            match p.try_start() {
                Ok(()) => return p,
                Err(collision) => collisions.push(collision),
            }
        }
        panic!("redis-server found no free port in {PORT_TRIES} tries: {collisions:?}");
    }

    /// Starts it again on its port; a port taken meanwhile fails the test.
    fn start(&mut self) {
        if let Err(collision) = self.try_start() {
            panic!("{collision}");
        }
    }

    /// Starts it and waits until it answers; `Err` when the port turned out
    /// to be taken: our child exited (it could not bind), or what answers
    /// is another process (`INFO server`'s `process_id` is not our child's).
    fn try_start(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "redis-server on {} already running", self.port);
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning"])
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        let pid = child.id();
        self.child = Some(child);
        let port = self.port;
        let mut ours = false;
        let mut exited = None;
        wait_until(&format!("redis-server on {port}"), Duration::from_secs(10), || {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                exited = Some(status);
                return true;
            }
            ours = server_pid(port) == Some(pid);
            ours
        });
        if let Some(status) = exited {
            self.child = None;
            return Err(format!("redis-server on port {port} exited at once ({status}): the port was taken"));
        }
        debug_assert!(ours);
        Ok(())
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill(); // SIGKILL: no shutdown, no save
            let _ = child.wait();
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A private single `redis-server` (no persistence): what it held is lost
/// when it is killed.
pub struct RedisServer {
    port: u16,
    process: Mutex<Process>,
}

impl RedisServer {
    /// Starts one on a free loopback port; `None` (after printing why) when
    /// `redis-server` is not installed.
    pub fn start() -> Option<Self> {
        Self::start_with(&[])
    }

    /// As [`start`](Self::start), with `extra` arguments for `redis-server`
    /// (`--rename-command GETDEL ""`: a server without that command).
    pub fn start_with(extra: &[&str]) -> Option<Self> {
        if !redis_server_installed() {
            return None;
        }
        let extra: Vec<String> = extra.iter().map(|arg| (*arg).to_owned()).collect();
        let process = Process::spawn_on_free_port(free_port, |_| extra.clone());
        Some(Self { port: process.port, process: Mutex::new(process) })
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Its loopback port.
    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).expect("redis url")
    }

    /// SIGKILL: the server vanishes mid-conversation, losing every key.
    pub fn kill(&self) {
        self.process.lock().unwrap().kill();
    }

    /// Bytes the server holds (`INFO memory`'s `used_memory`).
    pub fn used_memory(&self) -> i64 {
        let mut conn = self.client().get_connection().expect("redis");
        let info: String = redis::cmd("INFO").arg("memory").query(&mut conn).expect("INFO");
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("used_memory")
    }

    /// How many times it has run each command, by lowercase name, from one
    /// `INFO commandstats` (a blocking command counts once it has ended).
    pub fn calls(&self) -> std::collections::HashMap<String, i64> {
        let mut conn = self.client().get_connection().expect("redis");
        let info: String = redis::cmd("INFO").arg("commandstats").query(&mut conn).expect("INFO");
        info.lines()
            .filter_map(|l| l.strip_prefix("cmdstat_")?.split_once(":calls="))
            .map(|(command, rest)| (command.to_owned(), rest.split(',').next().unwrap().parse().expect("calls")))
            .collect()
    }

    /// How many results it holds for `namespace`: the fields of its result hashes.
    pub fn results_held(&self, namespace: &str) -> i64 {
        let mut conn = self.client().get_connection().expect("redis");
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(format!("idem:{{{namespace}.*}}:r*")).query(&mut conn).expect("KEYS");
        keys.iter().map(|k| redis::cmd("HLEN").arg(k).query::<i64>(&mut conn).expect("HLEN")).sum()
    }

    /// Starts it again on the same port (empty), waiting until it answers.
    /// Blocking: call it from `spawn_blocking` inside a runtime.
    pub fn restart(&self) {
        let mut p = self.process.lock().unwrap();
        p.kill();
        p.start();
    }
}

/// A 3-master Redis Cluster (no replicas) on private loopback ports; its
/// nodes are killed and its directory removed on drop.
pub struct RedisCluster {
    ports: Vec<u16>,
    dir: PathBuf,
    nodes: Vec<Mutex<Process>>,
}

impl RedisCluster {
    /// Starts three nodes, joins them with `redis-cli --cluster create` and
    /// waits for `cluster_state:ok` on each; `None` (after printing why)
    /// when `redis-server` is not installed.
    pub fn start() -> Option<Self> {
        if !redis_server_installed() {
            return None;
        }
        let dir = std::env::temp_dir().join(crate::unique("idem-cluster"));
        std::fs::create_dir_all(&dir).expect("cluster dir");
        let mut cluster = Self { ports: Vec::new(), dir: dir.clone(), nodes: Vec::new() };
        while cluster.nodes.len() < 3 {
            let taken = cluster.ports.clone();
            // Neither the same port nor one on another node's bus port.
            let port = || loop {
                let p = free_cluster_port();
                if !taken.iter().any(|&q| q == p || q.abs_diff(p) == 10_000) {
                    return p;
                }
            };
            let extra = |port: u16| {
                vec![
                    "--cluster-enabled".into(),
                    "yes".into(),
                    "--cluster-config-file".into(),
                    dir.join(format!("nodes-{port}.conf")).display().to_string(),
                    "--cluster-node-timeout".into(),
                    "5000".into(),
                    "--dir".into(),
                    dir.display().to_string(),
                ]
            };
            let node = Process::spawn_on_free_port(port, extra);
            cluster.ports.push(node.port);
            cluster.nodes.push(Mutex::new(node));
        }
        let status = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(cluster.ports.iter().map(|p| format!("127.0.0.1:{p}")))
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run redis-cli --cluster create");
        assert!(status.success(), "redis-cli --cluster create failed: {status}");
        cluster.wait_ok();
        Some(cluster)
    }

    /// Waits until every node reports `cluster_state:ok`.
    pub fn wait_ok(&self) {
        for &port in &self.ports {
            wait_until(&format!("cluster node {port}"), Duration::from_secs(30), || {
                query::<String>(port, redis::cmd("CLUSTER").arg("INFO")).is_ok_and(|i| i.contains("cluster_state:ok"))
            });
        }
    }

    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    pub fn urls(&self) -> Vec<String> {
        self.ports.iter().map(|p| format!("redis://127.0.0.1:{p}")).collect()
    }

    pub fn client(&self) -> redis::cluster::ClusterClient {
        redis::cluster::ClusterClient::new(self.urls()).expect("cluster client")
    }

    /// Runs `cmd` on node `i` alone (e.g. `DBSIZE`, `CLUSTER NODES`).
    pub fn query_node<T: redis::FromRedisValue>(&self, i: usize, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        query(self.ports[i], cmd)
    }

    /// SIGKILLs node `i`: its slots stop answering. Blocking.
    pub fn kill_node(&self, i: usize) {
        self.nodes[i].lock().unwrap().kill();
    }

    /// Starts node `i` again on its port with its `nodes-P.conf`: it comes
    /// back with its slots and no keys; waits until the cluster is ok.
    /// Blocking.
    pub fn start_node(&self, i: usize) {
        self.nodes[i].lock().unwrap().start();
        self.wait_ok();
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &self.nodes {
            if let Ok(mut n) = node.lock() {
                n.kill();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
