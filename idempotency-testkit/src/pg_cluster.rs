//! A private PostgreSQL primary and its streaming standby on loopback
//! ports, for the failover test (`tests/failover/`): made with `initdb` and
//! `pg_basebackup -R` (a physical replication slot), the standby streaming
//! through a [`Forwarder`] the test can hold (a stalled replication link),
//! in [`Replication::Synchronous`] mode (`synchronous_commit = on`, the
//! standby in `synchronous_standby_names`) or [`Replication::Asynchronous`].
//!
//! Each server is a child process in a process group of its own, so
//! [`PgCluster::kill_primary`] SIGKILLs the postmaster and every backend at
//! once, as when a machine is lost (a postmaster killed alone leaves its
//! backends running for a moment). The servers run as user `postgres` when
//! the test runs as root (PostgreSQL refuses root), in a temporary folder
//! removed on drop; dropping the cluster kills whatever still runs. Every
//! wait is bounded. [`PgCluster::start`] prints `skipped: ...` and returns
//! `None` when the binaries are missing (or panics under
//! `IDEM_REQUIRE_SERVICES=1`).
//!
//! The binaries: `IDEM_PG_BIN`, or the newest `/usr/lib/postgresql/*/bin`
//! holding `initdb`, `postgres` and `pg_basebackup` (Debian's
//! `postgresql-15` and `postgresql-client-15`).

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Row};

use crate::forwarder::Forwarder;

/// The standby's name: its `application_name`, its replication slot, and
/// the primary's `synchronous_standby_names` in synchronous mode.
const STANDBY: &str = "standby1";
/// The longest any step of starting, promoting or checking may take.
const STEP: Duration = Duration::from_secs(60);

/// How the primary waits for its standby at commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replication {
    /// `synchronous_commit = on`, `synchronous_standby_names = 'standby1'`:
    /// `COMMIT` answers once the standby has flushed the commit.
    Synchronous,
    /// `COMMIT` answers once the primary alone has flushed it.
    Asynchronous,
}

/// One `postgres` server: a data directory, a port, a child process.
pub struct Server {
    data: PathBuf,
    log: PathBuf,
    port: u16,
    settings: Vec<String>,
    child: Option<Child>,
}

impl Server {
    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its `postgres` database, directly (not through any forwarder).
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// A small pool on it, for the test's own questions.
    pub async fn admin(&self) -> PgPool {
        let options = PgConnectOptions::from_str(&self.url()).expect("url").application_name("idem-pg-admin");
        PgPoolOptions::new().max_connections(2).acquire_timeout(Duration::from_secs(5)).connect_lazy_with(options)
    }

    fn start(&mut self, user: Option<(u32, u32)>, bin: &Path) {
        assert!(self.child.is_none(), "server on {} already running", self.port);
        let log = std::fs::File::create(&self.log).expect("server log");
        let mut cmd = Command::new(bin.join("postgres"));
        cmd.arg("-D").arg(&self.data);
        for setting in &self.settings {
            cmd.arg("-c").arg(setting);
        }
        as_user(&mut cmd, user);
        // Its own process group: the backends it forks join it, and one
        // signal to the group takes them all.
        cmd.process_group(0).stdin(Stdio::null()).stdout(log.try_clone().expect("log")).stderr(log);
        self.child = Some(cmd.spawn().expect("spawn postgres"));
    }

    /// SIGKILL to the server's whole process group: postmaster, backends,
    /// WAL writer and sender die at the same instant, nothing is flushed.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let group = format!("-{}", child.id());
            let killed = Command::new("kill").args(["-KILL", "--", &group]).status().is_ok_and(|s| s.success());
            if !killed {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }

    /// Starts it on a free port, and on another one when the port turned
    /// out to be taken before the server bound it (detected for sure: see
    /// [`Server::wait_ready`]).
    async fn launch(&mut self, user: Option<(u32, u32)>, bin: &Path) {
        let mut collisions = Vec::new();
        for _ in 0..PORT_TRIES {
            let port = free_port();
            self.port = port;
            self.settings.retain(|s| !s.starts_with("port="));
            self.settings.push(format!("port={port}"));
            self.start(user, bin);
            if self.wait_ready().await {
                return;
            }
            collisions.push(port);
        }
        panic!("postgres found no free port in {PORT_TRIES} tries ({collisions:?}): see {}", self.log.display());
    }

    /// Waits until the server answers: `true` once the one answering on
    /// its port is this one (its `data_directory`), `false` if our child
    /// exited first (it could not bind its port).
    async fn wait_ready(&mut self) -> bool {
        let start = Instant::now();
        let data = self.data.display().to_string();
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(_)) = child.try_wait()
            {
                self.child = None;
                return false;
            }
            let options = PgConnectOptions::from_str(&self.url()).expect("url");
            let answered = PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(2))
                .connect_with(options)
                .await;
            if let Ok(pool) = answered {
                let dir: Option<String> = sqlx::query_scalar("SHOW data_directory").fetch_one(&pool).await.ok();
                pool.close().await;
                if dir.as_deref() == Some(data.as_str()) {
                    return true;
                }
            }
            assert!(
                start.elapsed() < STEP,
                "postgres on {} not ready after {STEP:?}: see {}",
                self.port,
                self.log.display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A primary and its streaming standby.
pub struct PgCluster {
    dir: PathBuf,
    mode: Replication,
    /// The server clients write to until it is killed.
    pub primary: Server,
    /// The server promoted when the primary is lost.
    pub standby: Server,
    /// The standby's replication connection to the primary.
    link: Forwarder,
}

impl PgCluster {
    /// Makes both servers, starts them and waits until the standby streams
    /// (and, in synchronous mode, is the primary's synchronous standby).
    pub async fn start(mode: Replication) -> Option<PgCluster> {
        let bin = binaries()?;
        // PostgreSQL refuses to run as root: then it runs as `postgres`.
        let user = if std::fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0) == 0 {
            match uid_gid("postgres") {
                Some(ids) => Some(ids),
                None => return skipped("user postgres (PostgreSQL refuses to run as root)"),
            }
        } else {
            None
        };
        let dir = std::env::temp_dir().join(crate::unique("idem-pg"));
        std::fs::create_dir_all(&dir).expect("cluster dir");
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).expect("chown cluster dir");
        }
        let server = |name: &str, settings: Vec<String>| Server {
            data: dir.join(name),
            log: dir.join(format!("{name}.log")),
            port: settings.iter().find_map(|s| s.strip_prefix("port=")).and_then(|p| p.parse().ok()).expect("port"),
            settings,
            child: None,
        };

        // Ports: `launch` picks each (port 0 until then).
        let synchronous = if mode == Replication::Synchronous { STANDBY } else { "" };
        let mut primary =
            server("primary", common_settings(0).chain([format!("synchronous_standby_names={synchronous}")]).collect());
        let mut initdb = Command::new(bin.join("initdb"));
        initdb.arg("-D").arg(&primary.data).args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"]);
        run_blocking(&mut initdb, user, &dir, "initdb").await;
        primary.launch(user, &bin).await;
        let primary_port = primary.port;
        let admin = primary.admin().await;
        sqlx::query("SELECT pg_create_physical_replication_slot($1)")
            .bind(STANDBY)
            .execute(&admin)
            .await
            .expect("replication slot");
        admin.close().await;

        // The standby's copy, and its link to the primary through a
        // forwarder the test can hold. It never waits for a standby of its
        // own once promoted (`synchronous_standby_names` empty). Once its
        // primary is gone it retries every 100 ms, not the default 5 s: one
        // run's promotion waited out those 5 s.
        let link = Forwarder::start(primary_port).await;
        let conninfo =
            format!("primary_conninfo=host=127.0.0.1 port={} user=postgres application_name={STANDBY}", link.port());
        let mut standby = server(
            "standby",
            common_settings(0)
                .chain([
                    "synchronous_standby_names=".to_owned(),
                    conninfo,
                    format!("primary_slot_name={STANDBY}"),
                    "wal_retrieve_retry_interval=100ms".to_owned(),
                ])
                .collect(),
        );
        let mut backup = Command::new(bin.join("pg_basebackup"));
        backup
            .args(["-h", "127.0.0.1", "-p", &primary_port.to_string(), "-U", "postgres", "-D"])
            .arg(&standby.data)
            .args(["-R", "-S", STANDBY, "-X", "stream", "--no-sync"]);
        run_blocking(&mut backup, user, &dir, "pg_basebackup").await;
        standby.launch(user, &bin).await;

        let cluster = PgCluster { dir, mode, primary, standby, link };
        cluster.wait_streaming().await;
        Some(cluster)
    }

    /// How the primary waits for the standby.
    pub fn mode(&self) -> Replication {
        self.mode
    }

    /// The standby's replication connection: hold it to stall the standby.
    pub fn replication_link(&self) -> &Forwarder {
        &self.link
    }

    /// Waits until the primary reports the standby streaming, in the sync
    /// state the mode asks for.
    async fn wait_streaming(&self) {
        let want = if self.mode == Replication::Synchronous { "sync" } else { "async" };
        let admin = self.primary.admin().await;
        let start = Instant::now();
        loop {
            let state: Option<(String, String)> = sqlx::query_as(
                "SELECT state::text, sync_state::text FROM pg_stat_replication WHERE application_name = $1",
            )
            .bind(STANDBY)
            .fetch_optional(&admin)
            .await
            .ok()
            .flatten();
            if state.as_ref().is_some_and(|(s, sync)| s == "streaming" && sync == want) {
                break;
            }
            assert!(
                start.elapsed() < STEP,
                "standby not streaming ({want}) after {STEP:?}: {state:?}, see {}",
                self.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        admin.close().await;
    }

    /// Bytes of WAL the primary has written that the standby has not
    /// reported flushed (`None` when the standby is not connected).
    pub async fn standby_lag_bytes(&self) -> Option<i64> {
        let admin = self.primary.admin().await;
        let lag = sqlx::query(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), flush_lsn)::bigint FROM pg_stat_replication WHERE application_name = $1",
        )
        .bind(STANDBY)
        .fetch_optional(&admin)
        .await
        .ok()
        .flatten()
        .and_then(|row| row.try_get::<Option<i64>, _>(0).ok().flatten());
        admin.close().await;
        lag
    }

    /// How many backends of `application_name` are running a statement on
    /// the primary (a `COMMIT` waiting for the synchronous standby is one).
    pub async fn busy_backends(&self, application_name: &str) -> i64 {
        let admin = self.primary.admin().await;
        let busy = sqlx::query_scalar(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1 AND state = 'active'",
        )
        .bind(application_name)
        .fetch_one(&admin)
        .await
        .expect("pg_stat_activity");
        admin.close().await;
        busy
    }

    /// How many backends of `application_name` wait in a `COMMIT` for the
    /// synchronous standby to confirm it (`wait_event = 'SyncRep'`).
    pub async fn commits_waiting_for_standby(&self, application_name: &str) -> i64 {
        let admin = self.primary.admin().await;
        let waiting = sqlx::query_scalar(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event = 'SyncRep'",
        )
        .bind(application_name)
        .fetch_one(&admin)
        .await
        .expect("pg_stat_activity");
        admin.close().await;
        waiting
    }

    /// SIGKILLs the primary's whole process group.
    pub fn kill_primary(&mut self) {
        self.primary.kill();
    }

    /// Promotes the standby (`pg_promote`, waiting until it accepts
    /// writes) and cuts its now useless replication link.
    pub async fn promote_standby(&self) {
        let admin = self.standby.admin().await;
        let promoted: bool = sqlx::query_scalar("SELECT pg_promote(true, $1)")
            .bind(STEP.as_secs() as i32)
            .fetch_one(&admin)
            .await
            .expect("pg_promote");
        assert!(promoted, "standby not promoted within {STEP:?}: see {}", self.dir.display());
        let start = Instant::now();
        while sqlx::query_scalar::<_, bool>("SELECT pg_is_in_recovery()").fetch_one(&admin).await.expect("recovery") {
            assert!(start.elapsed() < STEP, "standby still in recovery after {STEP:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        admin.close().await;
        self.link.cut();
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        self.primary.kill();
        self.standby.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Settings both servers share: loopback TCP only, small, durable.
fn common_settings(port: u16) -> impl Iterator<Item = String> {
    [
        format!("port={port}"),
        "listen_addresses=127.0.0.1".to_owned(),
        "unix_socket_directories=".to_owned(),
        "shared_buffers=32MB".to_owned(),
        "max_connections=100".to_owned(),
        "wal_level=replica".to_owned(),
        "max_wal_senders=4".to_owned(),
        "max_replication_slots=4".to_owned(),
        "hot_standby=on".to_owned(),
        "fsync=on".to_owned(),
        "synchronous_commit=on".to_owned(),
    ]
    .into_iter()
}

fn skipped<T>(what: &str) -> Option<T> {
    if crate::services_required() {
        panic!("{what} missing and IDEM_REQUIRE_SERVICES=1");
    }
    println!("skipped: {what} missing");
    None
}

/// The folder holding `initdb`, `postgres` and `pg_basebackup`.
fn binaries() -> Option<PathBuf> {
    let complete = |dir: &Path| ["initdb", "postgres", "pg_basebackup"].iter().all(|b| dir.join(b).exists());
    if let Ok(dir) = std::env::var("IDEM_PG_BIN") {
        let dir = PathBuf::from(dir);
        return if complete(&dir) {
            Some(dir)
        } else {
            skipped(&format!("initdb/postgres/pg_basebackup in {}", dir.display()))
        };
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| Some((entry.file_name().to_str()?.parse().ok()?, entry.path().join("bin"))))
        .filter(|(_, bin)| complete(bin))
        .collect();
    found.sort();
    match found.pop() {
        Some((_, bin)) => Some(bin),
        None => skipped("PostgreSQL server binaries (initdb, postgres, pg_basebackup)"),
    }
}

/// A user's uid and gid, from `/etc/passwd`.
fn uid_gid(name: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    let line = passwd.lines().find(|l| l.split(':').next() == Some(name))?;
    let mut fields = line.split(':').skip(2);
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
}

fn as_user(cmd: &mut Command, user: Option<(u32, u32)>) {
    if let Some((uid, gid)) = user {
        // std drops the supplementary groups when root changes uid.
        cmd.uid(uid).gid(gid);
    }
}

/// Runs a setup command to its end off the runtime's threads.
async fn run_blocking(cmd: &mut Command, user: Option<(u32, u32)>, dir: &Path, what: &'static str) {
    as_user(cmd, user);
    let log = std::fs::File::create(dir.join(format!("{what}.log"))).expect("setup log");
    cmd.current_dir(dir).stdin(Stdio::null()).stdout(log.try_clone().expect("log")).stderr(log);
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{what}: {e}"));
    let status = tokio::task::spawn_blocking(move || child.wait()).await.expect("join").expect("wait");
    assert!(status.success(), "{what} failed ({status}): see {}", dir.join(format!("{what}.log")).display());
}

/// A loopback port nobody listens on right now.
/// How many free ports a server is tried on (see [`Server::launch`]).
const PORT_TRIES: usize = 5;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}
