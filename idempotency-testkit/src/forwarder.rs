//! A TCP forwarder of the test's own on a loopback port: the one path
//! between clients and a server that a test can switch, cut and hold, the
//! way a virtual IP, a proxy or a network fails in production.
//!
//! - [`Forwarder::switch`]: new connections go to another port; every open
//!   connection is cut (a failover moves the address, and what was open on
//!   the old server is gone).
//! - [`Forwarder::cut`]: every open connection is cut and new ones are
//!   closed at once (the server unreachable).
//! - [`Forwarder::hold`]: bytes stop flowing in one or both directions
//!   without closing anything (a stalled network): with [`Hold::Replies`]
//!   requests still arrive and run, their answers never come back; with
//!   [`Hold::Everything`] nothing moves until the hold ends.
//! - [`Forwarder::silence_subscribers`]: a Redis connection that subscribes
//!   (its client sent `SUBSCRIBE`) goes silent for good from then on, both
//!   ways, closing nothing: what a NAT or a load balancer that dropped an
//!   idle connection, or a host gone, looks like to a pub/sub client.
//!   Connections that never subscribe flow as before.
//!
//! Bytes already read when a hold begins are held too, so nothing crosses a
//! held direction after [`Forwarder::hold`] returns; [`Forwarder::held_replies`]
//! counts the reply bytes a hold caught (the event "the server answered",
//! for a test that then loses the answer). Needs a tokio runtime; dropping
//! the forwarder cuts everything.
//!
//! [`Forwarder::requests`] counts what clients sent (each read of a
//! client's bytes passed on: a request, as a client writes one at a time),
//! so a test can wait until a client it watches has asked the server again.
//!
//! Started with [`Forwarder::start_with`], it also puts a distance between
//! client and server ([`Path::delay`], each way: a database in another zone)
//! and counts the round trips the clients make ([`Path::count`],
//! [`Forwarder::turns`]).

mod delay;
mod turns;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

pub use delay::promptly;
use turns::{Counts, Turn};
pub use turns::{Protocol, Turns};

/// How long a new connection may take to reach the target.
const CONNECT: Duration = Duration::from_secs(2);

/// Which bytes stop flowing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// Both directions flow.
    Nothing,
    /// Client to server flows; server to client is held.
    Replies,
    /// Neither direction flows.
    Everything,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Requests,
    Replies,
}

impl Hold {
    fn blocks(self, direction: Direction) -> bool {
        match self {
            Hold::Nothing => false,
            Hold::Replies => direction == Direction::Replies,
            Hold::Everything => true,
        }
    }
}

/// Where connections go now. A connection lives as long as the `epoch` it
/// was opened in: bumping it cuts every open one.
#[derive(Clone, Copy)]
struct Route {
    target: Option<u16>,
    hold: Hold,
    epoch: u64,
    /// Connections that subscribed are held both ways.
    silence_subscribers: bool,
}

impl Route {
    fn blocks(&self, direction: Direction, subscriber: bool) -> bool {
        self.hold.blocks(direction) || (self.silence_subscribers && subscriber)
    }
}

/// The Redis command whose sight makes a connection a subscriber.
const SUBSCRIBE: &[u8] = b"SUBSCRIBE";

/// What a forwarder does to the bytes besides passing them on.
#[derive(Clone, Copy, Debug, Default)]
pub struct Path {
    /// Added to every byte each way (so twice to a round trip).
    pub delay: Duration,
    /// Count the clients' round trips, framed as this protocol.
    pub count: Option<Protocol>,
}

/// The forwarder: a listener on `127.0.0.1:port()` and its connections.
pub struct Forwarder {
    port: u16,
    route: watch::Sender<Route>,
    held: watch::Sender<u64>,
    /// Reads of clients' bytes passed on so far.
    requests: watch::Sender<u64>,
    accept: JoinHandle<()>,
    /// Connections seen subscribing so far.
    subscribers: Arc<AtomicUsize>,
    /// Round trips counted so far (with [`Path::count`]).
    counts: Arc<Counts>,
}

impl Forwarder {
    /// Listens on a free loopback port, forwarding to `127.0.0.1:target`.
    pub async fn start(target: u16) -> Forwarder {
        Self::start_with(target, Path::default()).await
    }

    /// [`start`](Forwarder::start), with a delay or a count on the path.
    pub async fn start_with(target: u16, path: Path) -> Forwarder {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind forwarder");
        let port = listener.local_addr().expect("forwarder addr").port();
        let (route, watching) =
            watch::channel(Route { target: Some(target), hold: Hold::Nothing, epoch: 0, silence_subscribers: false });
        let held = watch::Sender::new(0);
        let requests = watch::Sender::new(0);
        let subscribers = Arc::new(AtomicUsize::new(0));
        let counts = Arc::new(Counts::default());
        let seen = Seen {
            subscriber: Arc::default(),
            subscribers: Arc::clone(&subscribers),
            requests: requests.clone(),
            counting: None,
        };
        let accept = tokio::spawn(accept_loop(listener, watching, held.clone(), seen, path, counts.clone()));
        Forwarder { port, route, held, requests, accept, subscribers, counts }
    }

    /// The round trips counted so far on every connection (all zero
    /// unless started with [`Path::count`]).
    pub fn turns(&self) -> Turns {
        self.counts.read()
    }

    /// The reply bytes caught by a hold so far, server to client, on every
    /// connection (never reset): `wait_for(|n| *n > before)` waits for a
    /// server to answer behind [`Hold::Replies`].
    pub fn held_replies(&self) -> watch::Receiver<u64> {
        self.held.subscribe()
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Cuts every open connection and sends new ones to `target`, flowing.
    pub fn switch(&self, target: u16) {
        self.route.send_modify(|r| *r = Route { target: Some(target), hold: Hold::Nothing, epoch: r.epoch + 1, ..*r });
    }

    /// Cuts every open connection; new ones are closed as soon as accepted.
    pub fn cut(&self) {
        self.route.send_modify(|r| *r = Route { target: None, hold: Hold::Nothing, epoch: r.epoch + 1, ..*r });
    }

    /// Holds (or, with [`Hold::Nothing`], releases) bytes on every open and
    /// new connection, closing none.
    pub fn hold(&self, hold: Hold) {
        self.route.send_modify(|r| r.hold = hold);
    }

    /// From now on, every connection that has subscribed, or subscribes,
    /// goes silent both ways (its `SUBSCRIBE` held too), closing nothing.
    pub fn silence_subscribers(&self) {
        self.route.send_modify(|r| r.silence_subscribers = true);
    }

    /// How many connections were seen sending `SUBSCRIBE` so far (the
    /// proxy's own view: a test waits for a subscription it silenced).
    pub fn subscribers(&self) -> usize {
        self.subscribers.load(Ordering::SeqCst)
    }

    /// How many times bytes from clients were read and passed on: one per
    /// request a client sends and waits on (pipelined or split requests may
    /// count together or apart). Watch it to wait until a client asked again.
    pub fn requests(&self) -> watch::Receiver<u64> {
        self.requests.subscribe()
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

/// `forwarder` is what every connection counts into: a fresh connection
/// gets its own `subscriber` flag, and its own count of turns.
async fn accept_loop(
    listener: TcpListener,
    route: watch::Receiver<Route>,
    held: watch::Sender<u64>,
    forwarder: Seen,
    path: Path,
    counts: Arc<Counts>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else { continue };
        let now = *route.borrow();
        let Some(target) = now.target else {
            drop(client);
            continue;
        };
        let counting = path
            .count
            .map(|protocol| Counting { turn: Arc::new(Mutex::new(Turn::new(protocol))), counts: Arc::clone(&counts) });
        let seen = Seen { subscriber: Arc::default(), counting, ..forwarder.clone() };
        tokio::spawn(connection(client, target, route.clone(), now.epoch, path.delay, held.clone(), seen));
    }
}

/// What a connection has shown of itself: whether it subscribed; and the
/// forwarder's counts it adds to.
#[derive(Clone)]
struct Seen {
    subscriber: Arc<AtomicBool>,
    subscribers: Arc<AtomicUsize>,
    requests: watch::Sender<u64>,
    counting: Option<Counting>,
}

/// A connection's round trips, as its two directions see them.
#[derive(Clone)]
struct Counting {
    turn: Arc<Mutex<Turn>>,
    counts: Arc<Counts>,
}

impl Counting {
    fn saw(&self, direction: Direction, bytes: &[u8]) {
        let mut turn = self.turn.lock().expect("turn");
        match direction {
            Direction::Requests => turn.sent(bytes),
            Direction::Replies => turn.answered(&self.counts),
        }
    }
}

impl Seen {
    fn subscriber(&self) -> bool {
        self.subscriber.load(Ordering::SeqCst)
    }

    /// Looks for `SUBSCRIBE` in what the client sent (`tail`: the end of
    /// what it sent before, as a command may straddle two reads).
    fn look(&self, tail: &mut Vec<u8>, read: &[u8]) {
        if self.subscriber() {
            return;
        }
        tail.extend_from_slice(read);
        if tail.windows(SUBSCRIBE.len()).any(|w| w.eq_ignore_ascii_case(SUBSCRIBE)) {
            self.subscriber.store(true, Ordering::SeqCst);
            self.subscribers.fetch_add(1, Ordering::SeqCst);
        }
        let keep = tail.len().saturating_sub(SUBSCRIBE.len() - 1);
        tail.drain(..keep);
    }
}

async fn connection(
    client: TcpStream,
    target: u16,
    route: watch::Receiver<Route>,
    epoch: u64,
    delay: Duration,
    held: watch::Sender<u64>,
    seen: Seen,
) {
    let Ok(Ok(server)) = tokio::time::timeout(CONNECT, TcpStream::connect(("127.0.0.1", target))).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    // Either side ending (or a cut) ends both: dropping the halves closes
    // the sockets, and the peers see the connection gone.
    let requests =
        Pump { direction: Direction::Requests, route: route.clone(), epoch, delay, held: None, seen: seen.clone() };
    let replies = Pump { direction: Direction::Replies, route, epoch, delay, held: Some(held), seen };
    tokio::select! {
        () = requests.run(client_read, server_write) => {}
        () = replies.run(server_read, client_write) => {}
    }
}

/// One direction of a connection. With `held`, it reads while the
/// direction is held too and counts there the bytes caught.
struct Pump {
    direction: Direction,
    route: watch::Receiver<Route>,
    epoch: u64,
    /// Held this long from the moment each chunk was read.
    delay: Duration,
    held: Option<watch::Sender<u64>>,
    seen: Seen,
}

impl Pump {
    /// Copies bytes one way while the route lets them, until either side
    /// ends or the connection's epoch is over; with a delay, each chunk goes
    /// on that long after it was read (a writer of its own keeps the order).
    async fn run(mut self, mut from: OwnedReadHalf, mut to: OwnedWriteHalf) {
        let mut buf = vec![0u8; 16 * 1024];
        let mut tail = Vec::new();
        if self.delay.is_zero() {
            while let Some(n) = self.read(&mut from, &mut buf, &mut tail).await {
                if !self.write(&mut to, &buf[..n]).await {
                    return;
                }
            }
            return;
        }
        let (queue, mut queued) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
        let mut writing = self.clone_for_writing();
        let writer = async {
            while let Some((due, bytes)) = queued.recv().await {
                delay::until(due).await;
                // A hold that began while the bytes were on their way holds them.
                if !flowing(&mut writing.route, writing.direction, writing.epoch, &writing.seen).await
                    || !writing.write(&mut to, &bytes).await
                {
                    return;
                }
            }
        };
        // The reader owns the queue's sender: when its side ends, the writer
        // still sends what is on its way (a client that writes and closes at
        // once), then ends.
        let reader = async move {
            while let Some(n) = self.read(&mut from, &mut buf, &mut tail).await {
                if queue.send((Instant::now() + self.delay, buf[..n].to_vec())).is_err() {
                    return;
                }
            }
        };
        tokio::select! {
            () = writer => {}
            () = async { reader.await; std::future::pending::<()>().await } => {}
        }
    }

    fn clone_for_writing(&self) -> Pump {
        Pump {
            direction: self.direction,
            route: self.route.clone(),
            epoch: self.epoch,
            delay: self.delay,
            held: None,
            seen: self.seen.clone(),
        }
    }

    /// The next chunk's length in `buf`, read (and counted) while the route
    /// lets it flow; `None` once either side ends or the epoch is over.
    async fn read(&mut self, from: &mut OwnedReadHalf, buf: &mut [u8], tail: &mut Vec<u8>) -> Option<usize> {
        let (direction, epoch) = (self.direction, self.epoch);
        loop {
            // A counting pump reads on while held (one buffer's worth, kept
            // until the hold ends), so that a hold sees what it catches.
            let open = match self.held {
                Some(_) => self.route.borrow_and_update().epoch == epoch,
                None => flowing(&mut self.route, direction, epoch, &self.seen).await,
            };
            if !open {
                return None;
            }
            let n = tokio::select! {
                read = from.read(buf) => match read {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => n,
                },
                // A hold or a cut while waiting for bytes: look again.
                changed = self.route.changed() => match changed {
                    Ok(()) => continue,
                    Err(_) => return None,
                },
            };
            if let Some(held) = &self.held
                && self.route.borrow().hold.blocks(direction)
            {
                held.send_modify(|bytes| *bytes += n as u64);
            }
            if direction == Direction::Requests {
                self.seen.look(tail, &buf[..n]);
            }
            if let Some(counting) = &self.seen.counting {
                counting.saw(direction, &buf[..n]);
            }
            // Bytes read when a hold began are held too.
            return flowing(&mut self.route, direction, epoch, &self.seen).await.then_some(n);
        }
    }

    /// Writes `bytes` unless the connection's epoch ends first; `false`
    /// when the connection is over.
    async fn write(&self, to: &mut OwnedWriteHalf, bytes: &[u8]) -> bool {
        let mut watching = self.route.clone();
        let written = tokio::select! {
            written = to.write_all(bytes) => written.is_ok(),
            () = cut(&mut watching, self.epoch) => false,
        };
        if written && self.direction == Direction::Requests {
            self.seen.requests.send_modify(|count| *count += 1);
        }
        written
    }
}

/// Waits until `direction` may flow; `false` once the epoch is over.
async fn flowing(route: &mut watch::Receiver<Route>, direction: Direction, epoch: u64, seen: &Seen) -> bool {
    loop {
        let now = *route.borrow_and_update();
        if now.epoch != epoch {
            return false;
        }
        if !now.blocks(direction, seen.subscriber()) {
            return true;
        }
        if route.changed().await.is_err() {
            return false;
        }
    }
}

/// Returns once the epoch is over (a write to a peer that stopped reading
/// must not outlive a cut).
async fn cut(route: &mut watch::Receiver<Route>, epoch: u64) {
    while route.borrow_and_update().epoch == epoch {
        if route.changed().await.is_err() {
            return;
        }
    }
}
