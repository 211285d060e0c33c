//! A private three-node MariaDB Galera cluster on loopback ports, for the
//! Galera test and the bench's cluster rows. Every node is a child process
//! killed (SIGKILL) when its handle drops; the data lives in a temporary
//! folder removed at the end.
//!
//! Needs `mariadbd`, `mariadb-install-db`, `mariadb`, `rsync` and Galera
//! (`/usr/lib/galera/libgalera_smm.so`, Debian's `galera-4`); the servers
//! run as user `mysql` (as root, the joiner's rsync daemon drops to `nobody`
//! and the state transfer fails). [`Cluster::start`] prints `skipped: ...`
//! and returns `None` when something is missing (or panics under
//! `IDEM_REQUIRE_SERVICES=1`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PROVIDER: &str = "/usr/lib/galera/libgalera_smm.so";
/// Nodes in a cluster.
pub const NODES: usize = 3;

fn skip(why: &str) -> bool {
    super::skip(why);
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

/// A loopback port nobody listens on right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// One `mariadbd` with Galera, a child of the test (killed when dropped).
pub struct Node {
    cnf: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl Node {
    /// Starts the node (the first of a new cluster with `new_cluster`).
    pub fn start(&mut self, new_cluster: bool) {
        let mut cmd = Command::new("mariadbd");
        cmd.arg(format!("--defaults-file={}", self.cnf.display())).arg("--user=mysql");
        if new_cluster {
            cmd.arg("--wsrep-new-cluster");
        }
        self.child = Some(cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("mariadbd"));
    }

    /// SIGKILL: the node dies mid-transaction, as a crashed server would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Its `test` database.
    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.port)
    }

    /// A `SHOW STATUS` value, through the `mariadb` client.
    pub fn status(&self, name: &str) -> Option<String> {
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
pub struct Cluster {
    dir: PathBuf,
    /// The nodes, in the order they joined.
    pub nodes: Vec<Node>,
}

impl Cluster {
    /// Starts three nodes and waits until they form one cluster (about 25 s).
    pub fn start() -> Option<Cluster> {
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
    pub fn wait_for(&self, i: usize, timeout: Duration) {
        let start = Instant::now();
        while self.nodes[i].status("wsrep_ready").as_deref() != Some("ON") {
            assert!(start.elapsed() < timeout, "node {i} not ready after {timeout:?}: see {}", self.dir.display());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until every node sees `size` members and serves.
    pub fn wait_for_size(&self, size: usize, timeout: Duration) {
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
