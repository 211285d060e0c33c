//! A private MariaDB server on a loopback port, with `[mysqld]` settings of
//! the test's own, optionally a one-node Galera cluster: for tests that need
//! a server set up otherwise than the shared one (and may `SET GLOBAL` on
//! it). A child of the test, killed (SIGKILL) when its handle drops; its
//! data lives in a temporary folder removed then.
//!
//! Needs what [`crate::galera`] needs (`mariadbd`, `mariadb-install-db`,
//! `mariadb`; Galera for a Galera node); runs as user `mysql`. `start`
//! prints `skipped: ...` and returns `None` when something is missing (or
//! panics under `IDEM_REQUIRE_SERVICES=1`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PROVIDER: &str = "/usr/lib/galera/libgalera_smm.so";

/// How many times a server is started on ports found free: one may be taken
/// by another process before the server binds it (it exits saying so), and
/// then others are tried.
const PORT_TRIES: usize = 5;

/// One private `mariadbd`.
pub struct MariaDb {
    dir: PathBuf,
    port: u16,
    child: Child,
}

fn runs(bin: &str) -> bool {
    Command::new(bin).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

impl MariaDb {
    /// Starts a server with `settings` (lines of its `[mysqld]` section,
    /// `max_allowed_packet=1M`), a one-node Galera cluster when `galera`,
    /// and waits until it serves, with an empty database `test`.
    pub fn start(settings: &[&str], galera: bool) -> Option<MariaDb> {
        for bin in ["mariadbd", "mariadb-install-db", "mariadb"] {
            if !runs(bin) {
                crate::skip(&format!("{bin} not installed"));
                return None;
            }
        }
        if galera && !Path::new(PROVIDER).exists() {
            crate::skip("galera not installed");
            return None;
        }
        let mut collisions = Vec::new();
        for _ in 0..PORT_TRIES {
            match Self::try_start(settings, galera) {
                Ok(server) => {
                    assert!(server.client("CREATE DATABASE test").is_some(), "create database test");
                    return Some(server);
                }
                Err(collision) => collisions.push(collision),
            }
        }
        panic!("mariadbd found no free port in {PORT_TRIES} tries: {collisions:?}");
    }

    /// Starts one server on ports free a moment ago; `Err` when one of them
    /// was taken before the server bound it (it exits saying so).
    fn try_start(settings: &[&str], galera: bool) -> Result<MariaDb, String> {
        let free_port = || std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        let port = free_port();
        let dir = std::env::temp_dir().join(crate::unique("idem-mariadb"));
        let data = dir.join("data");
        std::fs::create_dir_all(&data).expect("mariadb dir");
        let _ = Command::new("chmod").arg("755").arg(&dir).status();
        let wsrep = if galera {
            let gport = free_port();
            format!(
                "wsrep_on=ON\nwsrep_provider={PROVIDER}\nwsrep_cluster_address=gcomm://\nwsrep_cluster_name=idem_one\n\
                 wsrep_node_address=127.0.0.1\nwsrep_provider_options=\"gmcast.listen_addr=tcp://127.0.0.1:{gport}\"\n\
                 binlog_format=ROW\ninnodb_autoinc_lock_mode=2\n"
            )
        } else {
            String::new()
        };
        let cnf = dir.join("my.cnf");
        std::fs::write(
            &cnf,
            format!(
                "[mysqld]\ndatadir={data}\nsocket={dir}/mysql.sock\npid-file={dir}/mysql.pid\nlog-error={dir}/error.log\n\
                 port={port}\nbind-address=127.0.0.1\nskip-grant-tables\nskip-name-resolve\ninnodb_buffer_pool_size=32M\n\
                 default_storage_engine=InnoDB\n{wsrep}{}\n",
                settings.join("\n"),
                data = data.display(),
                dir = dir.display(),
            ),
        )
        .expect("my.cnf");
        let owned = Command::new("chown").arg("-R").arg("mysql:mysql").arg(&dir).status().is_ok_and(|s| s.success());
        assert!(owned, "chown mysql {}", dir.display());
        let installed = Command::new("mariadb-install-db")
            .arg(format!("--defaults-file={}", cnf.display()))
            .args(["--user=mysql", "--skip-test-db"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(installed, "mariadb-install-db in {}", dir.display());
        let mut cmd = Command::new("mariadbd");
        cmd.arg(format!("--defaults-file={}", cnf.display())).arg("--user=mysql");
        if galera {
            cmd.arg("--wsrep-new-cluster");
        }
        let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("mariadbd");
        let mut server = MariaDb { dir, port, child };
        server.wait_serving(galera)?;
        Ok(server)
    }

    /// Waits until it answers (a Galera node: until `wsrep_ready`), told
    /// from another server on its port by its data directory; `Err` when
    /// it exited because a port was taken.
    fn wait_serving(&mut self, galera: bool) -> Result<(), String> {
        let start = Instant::now();
        let ready = if galera {
            "(SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'WSREP_READY')"
        } else {
            "'ON'"
        };
        let probe = format!("SELECT @@datadir, {ready}");
        let data = self.dir.join("data");
        let ours = |out: &str| {
            let mut fields = out.trim_end().split('\t');
            let dir = fields.next().map(|d| Path::new(d.trim_end_matches('/')).to_path_buf());
            dir.as_deref() == Some(data.as_path()) && fields.next() == Some("ON")
        };
        loop {
            if self.client(&probe).is_some_and(|out| ours(&out)) {
                return Ok(());
            }
            let log = || std::fs::read_to_string(self.dir.join("error.log")).unwrap_or_default();
            if let Ok(Some(status)) = self.child.try_wait() {
                let log = log();
                if log.contains("Address already in use") {
                    return Err(format!("mariadbd on port {} exited ({status}): a port was taken", self.port));
                }
                panic!("mariadbd exited ({status}): {log}");
            }
            assert!(start.elapsed() < Duration::from_secs(90), "mariadbd not serving: {}", log());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Runs `sql` through the `mariadb` client; its output, if it succeeded.
    pub fn client(&self, sql: &str) -> Option<String> {
        let out = Command::new("mariadb")
            .args(["-h127.0.0.1", &format!("-P{}", self.port), "-uroot", "-N", "-B", "-e", sql])
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Its `test` database.
    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.port)
    }
}

impl Drop for MariaDb {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
