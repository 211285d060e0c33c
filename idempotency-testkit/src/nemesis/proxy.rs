//! A TCP proxy on loopback that the nemesis turns like a tap: one per
//! process and path (process → Redis, process → database), so a cut
//! harms one process's view of one server and nobody else.
//!
//! A mode applies at once to every connection, the open ones included
//! (a pool's connections are long-lived: cutting only new ones would cut
//! nothing):
//!
//! - [`Mode::Pass`]: bytes flow.
//! - [`Mode::Blackhole`]: connections stay open (new ones are accepted),
//!   and nothing is forwarded either way; what was sent waits in the
//!   proxy and in the kernel's buffers, and flows on after the heal, as
//!   TCP's retransmissions would deliver it.
//! - [`Mode::BlackholeReplies`]: requests reach the server, its replies
//!   are held: a `COMMIT` or a `SET` lands and its caller never hears.
//! - [`Mode::Delay`]: every chunk goes on this long after it was read,
//!   in both directions.
//! - [`Mode::Refuse`]: new connections are reset as soon as accepted.
//!
//! [`Proxy::reset_all`] resets (RST) every open connection on both sides:
//! what a cut that lasted past TCP's patience ends with.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

/// What the proxy does with bytes right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pass,
    Blackhole,
    BlackholeReplies,
    Delay(Duration),
    Refuse,
}

/// The mode, and how many times every connection was reset: a connection
/// opened before the latest reset ends.
#[derive(Debug, Clone, Copy)]
struct Tap {
    mode: Mode,
    resets: u64,
}

/// One direction of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Client to server: requests.
    Up,
    /// Server to client: replies.
    Down,
}

/// Bytes through a proxy so far, over all its connections: what it read
/// from each side, and what it passed on (the difference is held, or was
/// dropped by a reset). Its tests wait on these rather than on time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Read from clients.
    pub requests_in: u64,
    /// Written to the server.
    pub requests_out: u64,
    /// Read from the server.
    pub replies_in: u64,
    /// Written to clients.
    pub replies_out: u64,
}

#[derive(Debug, Default)]
struct Counters([AtomicU64; 4]);

impl Counters {
    /// The counter of bytes read (`false`) or written (`true`) in `direction`.
    fn of(&self, direction: Direction, written: bool) -> &AtomicU64 {
        &self.0[usize::from(direction == Direction::Down) * 2 + usize::from(written)]
    }
}

/// A proxy listening on a free loopback port, forwarding to `upstream`;
/// it stops (and drops its connections) when its runtime stops or its
/// handle drops.
pub struct Proxy {
    port: u16,
    tap: Arc<watch::Sender<Tap>>,
    counters: Arc<Counters>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Starts forwarding to `upstream`, in [`Mode::Pass`].
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind a proxy port");
        let port = listener.local_addr().expect("proxy address").port();
        let tap = Arc::new(watch::Sender::new(Tap { mode: Mode::Pass, resets: 0 }));
        let counters = Arc::new(Counters::default());
        let accept = tokio::spawn(accept_loop(listener, upstream, tap.clone(), counters.clone()));
        Proxy { port, tap, counters, accept }
    }

    /// The bytes through this proxy so far.
    pub fn counts(&self) -> Counts {
        let get = |direction, written| self.counters.of(direction, written).load(Ordering::SeqCst);
        Counts {
            requests_in: get(Direction::Up, false),
            requests_out: get(Direction::Up, true),
            replies_in: get(Direction::Down, false),
            replies_out: get(Direction::Down, true),
        }
    }

    /// The port clients connect to (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn set(&self, mode: Mode) {
        self.tap.send_modify(|tap| tap.mode = mode);
    }

    /// Resets every open connection, and sets `then` for what comes next.
    pub fn reset_all(&self, then: Mode) {
        self.tap.send_modify(|tap| {
            tap.resets += 1;
            tap.mode = then;
        });
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Connections end with the sender: their watch reports it closed.
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    tap: Arc<watch::Sender<Tap>>,
    counters: Arc<Counters>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else { continue };
        let now = *tap.borrow();
        if now.mode == Mode::Refuse {
            reset(client);
            continue;
        }
        let watch = tap.subscribe();
        let counters = counters.clone();
        tokio::spawn(async move {
            // Loopback: the upstream answers at once, or is gone for good.
            let Ok(server) = TcpStream::connect(upstream).await else {
                reset(client);
                return;
            };
            connection(client, server, watch, now.resets, &counters).await;
        });
    }
}

/// Forwards both ways until both sides close or the connection is reset.
async fn connection(
    mut client: TcpStream,
    mut server: TcpStream,
    mut watch: watch::Receiver<Tap>,
    born: u64,
    counters: &Counters,
) {
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        let up = pump(client_read, server_write, watch.clone(), Direction::Up, born, counters);
        let down = pump(server_read, client_write, watch.clone(), Direction::Down, born, counters);
        let reset_seen = async {
            loop {
                if watch.borrow_and_update().resets != born || watch.changed().await.is_err() {
                    return;
                }
            }
        };
        tokio::select! {
            _ = async { tokio::join!(up, down) } => {}
            () = reset_seen => {}
        }
    }
    // Whichever branch ended it: a reset resets, both ways.
    if watch.borrow().resets != born {
        reset(client);
        reset(server);
    }
}

/// Copies one direction chunk by chunk, each chunk let through only when
/// the mode allows it; shuts the writing side down on end of file. A
/// reset (a connection born before it) forwards nothing more, not even
/// what it held: the heal that resets must not deliver a held reply.
async fn pump<R, W>(
    mut from: R,
    mut to: W,
    mut watch: watch::Receiver<Tap>,
    direction: Direction,
    born: u64,
    counters: &Counters,
) where
    R: AsyncReadExt + Unpin,
    W: AsyncWriteExt + Unpin,
{
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let read_at = Instant::now();
        counters.of(direction, false).fetch_add(n as u64, Ordering::SeqCst);
        loop {
            let tap = *watch.borrow_and_update();
            if tap.resets != born {
                return;
            }
            let held = match tap.mode {
                Mode::Blackhole => true,
                Mode::BlackholeReplies => direction == Direction::Down,
                Mode::Delay(by) => {
                    tokio::time::sleep_until(read_at + by).await;
                    false
                }
                Mode::Pass | Mode::Refuse => false,
            };
            if !held {
                break;
            }
            if watch.changed().await.is_err() {
                return;
            }
        }
        // A reset may have come during a delay.
        if watch.borrow().resets != born {
            return;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            break;
        }
        counters.of(direction, true).fetch_add(n as u64, Ordering::SeqCst);
    }
    let _ = to.shutdown().await;
}

/// Closes with RST rather than FIN: the peer sees the connection reset.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}
