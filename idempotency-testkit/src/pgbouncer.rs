//! A private PgBouncer in transaction pooling mode, in front of the local
//! PostgreSQL (`IDEM_PG_URL`'s host and port), for the tests of an engine
//! behind a transaction pooler (`tests/pgbouncer/`). Its own ini and
//! userlist in a temporary folder, `auth_type = trust`, any database name
//! passed through (`* = host=.. port=..`), and [`SERVER_CONNECTIONS`] (or
//! as many as asked) server connections per database: a child of the test,
//! killed (SIGKILL) when its handle drops.
//!
//! It listens on a Unix socket in its own folder, not on a TCP port: a port
//! picked free and bound later can be taken in between by another test's
//! server, and a socket of its own cannot.
//!
//! PgBouncer refuses to run as root: as root it is started with `-u
//! postgres` (it drops to that user after reading its files), so the
//! folder is left readable and its log writable by that user.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

/// Server connections PgBouncer keeps per database and user
/// (`default_pool_size`): fewer than the engine's pool, so client
/// connections take turns on them.
pub const SERVER_CONNECTIONS: u32 = 8;

/// The `pgbouncer` that runs: on the `PATH`, or where Debian puts it
/// (`/usr/sbin`, off a plain user's `PATH`). When none, prints `skipped:
/// pgbouncer not installed` (or panics under `IDEM_REQUIRE_SERVICES=1`).
fn installed() -> Option<&'static str> {
    let runs = |bin: &str| {
        Command::new(bin)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if let Some(bin) = ["pgbouncer", "/usr/sbin/pgbouncer"].into_iter().find(|bin| runs(bin)) {
        return Some(bin);
    }
    if crate::services_required() {
        panic!("pgbouncer not installed and IDEM_REQUIRE_SERVICES=1");
    }
    println!("skipped: pgbouncer not installed");
    None
}

/// The port number in the socket's name (`.s.PGSQL.<port>`): any, the
/// folder is private.
const SOCKET_PORT: u16 = 6432;

/// One `pgbouncer` child process, `pool_mode = transaction`.
pub struct PgBouncer {
    dir: PathBuf,
    child: Child,
}

impl PgBouncer {
    /// Starts one with [`SERVER_CONNECTIONS`] server connections per
    /// database; see [`PgBouncer::start_with`].
    pub fn start() -> Option<Self> {
        Self::start_with(SERVER_CONNECTIONS)
    }

    /// Starts one in front of the server of `IDEM_PG_URL`, holding at most
    /// `server_connections` per database, and waits until it accepts
    /// connections; `None` (after printing why) when `pgbouncer` is not
    /// installed.
    pub fn start_with(server_connections: u32) -> Option<Self> {
        let server = sqlx::postgres::PgConnectOptions::from_str(&crate::pg_url()).expect("postgres url");
        Self::start_to(server_connections, server.get_host(), server.get_port())
    }

    /// [`start_with`](PgBouncer::start_with), its server connections made
    /// to `host:port` (a forwarder in front of the server, say).
    pub fn start_to(server_connections: u32, host: &str, port: u16) -> Option<Self> {
        let bin = installed()?;
        let server = sqlx::postgres::PgConnectOptions::from_str(&crate::pg_url()).expect("postgres url");
        let dir = std::env::temp_dir().join(crate::unique("idem-pgbouncer"));
        std::fs::create_dir_all(&dir).expect("pgbouncer dir");
        // Readable by the user it drops to when started as root, log included.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod pgbouncer dir");
        let user = server.get_username();
        let ini = format!(
            "[databases]\n\
             * = host={host} port={server_port}\n\
             [pgbouncer]\n\
             listen_addr =\n\
             listen_port = {SOCKET_PORT}\n\
             unix_socket_dir = {dir}\n\
             auth_type = trust\n\
             auth_file = {dir}/userlist.txt\n\
             pool_mode = transaction\n\
             default_pool_size = {server_connections}\n\
             min_pool_size = 0\n\
             reserve_pool_size = 0\n\
             max_client_conn = 500\n\
             ignore_startup_parameters = extra_float_digits\n\
             logfile = {dir}/pgbouncer.log\n",
            server_port = port,
            dir = dir.display(),
        );
        std::fs::write(dir.join("pgbouncer.ini"), ini).expect("pgbouncer.ini");
        std::fs::write(dir.join("userlist.txt"), format!("\"{user}\" \"\"\n")).expect("userlist.txt");
        let mut cmd = Command::new(bin);
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            cmd.args(["-u", "postgres"]);
        }
        let child = cmd
            .arg(dir.join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn pgbouncer");
        let mut bouncer = Self { dir, child };
        bouncer.wait_listening();
        Some(bouncer)
    }

    fn wait_listening(&mut self) {
        let start = Instant::now();
        while UnixStream::connect(self.socket()).is_err() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("pgbouncer exited ({status}): {}", self.log());
            }
            assert!(start.elapsed() < Duration::from_secs(10), "pgbouncer not listening: {}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What PgBouncer logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }

    fn socket(&self) -> PathBuf {
        self.dir.join(format!(".s.PGSQL.{SOCKET_PORT}"))
    }

    /// The URL of `database` through this PgBouncer, as `IDEM_PG_URL`'s user
    /// (the socket's folder as `host`, as libpq and sqlx read it).
    pub fn url(&self, database: &str) -> String {
        let server = sqlx::postgres::PgConnectOptions::from_str(&crate::pg_url()).expect("postgres url");
        format!(
            "postgres://{}@localhost/{database}?host={}&port={SOCKET_PORT}",
            server.get_username(),
            self.dir.display()
        )
    }

    /// Connect options for `database` through this PgBouncer.
    pub fn options(&self, database: &str) -> sqlx::postgres::PgConnectOptions {
        sqlx::postgres::PgConnectOptions::from_str(&self.url(database)).expect("pgbouncer url")
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
