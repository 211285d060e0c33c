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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

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
}

impl Forwarder {
    /// Listens on a free loopback port, forwarding to `127.0.0.1:target`.
    pub async fn start(target: u16) -> Forwarder {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind forwarder");
        let port = listener.local_addr().expect("forwarder addr").port();
        let (route, watching) =
            watch::channel(Route { target: Some(target), hold: Hold::Nothing, epoch: 0, silence_subscribers: false });
        let held = watch::Sender::new(0);
        let requests = watch::Sender::new(0);
        let subscribers = Arc::new(AtomicUsize::new(0));
        let seen =
            Seen { subscriber: Arc::default(), subscribers: Arc::clone(&subscribers), requests: requests.clone() };
        let accept = tokio::spawn(accept_loop(listener, watching, held.clone(), seen));
        Forwarder { port, route, held, requests, accept, subscribers }
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
/// gets its own `subscriber` flag.
async fn accept_loop(listener: TcpListener, route: watch::Receiver<Route>, held: watch::Sender<u64>, forwarder: Seen) {
    loop {
        let Ok((client, _)) = listener.accept().await else { continue };
        let now = *route.borrow();
        let Some(target) = now.target else {
            drop(client);
            continue;
        };
        let seen = Seen { subscriber: Arc::default(), ..forwarder.clone() };
        tokio::spawn(connection(client, target, route.clone(), now.epoch, held.clone(), seen));
    }
}

/// What a connection has shown of itself: whether it subscribed; and the
/// forwarder's counts it adds to.
#[derive(Clone)]
struct Seen {
    subscriber: Arc<AtomicBool>,
    subscribers: Arc<AtomicUsize>,
    requests: watch::Sender<u64>,
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
    tokio::select! {
        () = pump(client_read, server_write, Direction::Requests, route.clone(), epoch, None, seen.clone()) => {}
        () = pump(server_read, client_write, Direction::Replies, route, epoch, Some(held), seen) => {}
    }
}

/// Copies bytes one way while the route lets them, until either side ends
/// or the connection's epoch is over; with `held`, reads while the
/// direction is held too and counts there the bytes caught.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    direction: Direction,
    mut route: watch::Receiver<Route>,
    epoch: u64,
    held: Option<watch::Sender<u64>>,
    seen: Seen,
) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut tail = Vec::new();
    loop {
        // A counting pump reads on while held (one buffer's worth, kept
        // until the hold ends), so that a hold sees what it catches.
        let open = match held {
            Some(_) => route.borrow_and_update().epoch == epoch,
            None => flowing(&mut route, direction, epoch, &seen).await,
        };
        if !open {
            return;
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            // A hold or a cut while waiting for bytes: look again.
            changed = route.changed() => match changed {
                Ok(()) => continue,
                Err(_) => return,
            },
        };
        if let Some(held) = &held
            && route.borrow().hold.blocks(direction)
        {
            held.send_modify(|bytes| *bytes += n as u64);
        }
        if direction == Direction::Requests {
            seen.look(&mut tail, &buf[..n]);
        }
        if !flowing(&mut route, direction, epoch, &seen).await {
            return;
        }
        let mut watching = route.clone();
        tokio::select! {
            written = to.write_all(&buf[..n]) => if written.is_err() { return },
            () = cut(&mut watching, epoch) => return,
        }
        if direction == Direction::Requests {
            seen.requests.send_modify(|count| *count += 1);
        }
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
