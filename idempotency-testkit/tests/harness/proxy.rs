//! The nemesis's proxy does what each cut says, to open connections too:
//! checked against an echo server on loopback that counts what reached it,
//! and by the proxy's own counts. Each step waits for the bytes it names
//! to arrive (or to be held, as the proxy counts them), never for time to
//! pass; a window in which nothing may arrive only shortens a check that
//! cannot fail by chance.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use idempotency_testkit::nemesis::proxy::{Counts, Mode, Proxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long something that must arrive may take: only a hang takes that long.
const ARRIVES: Duration = Duration::from_secs(30);
/// How long a reader listens for something that must not come.
const SILENCE: Duration = Duration::from_millis(100);

/// An echo server; the count of bytes that reached it.
async fn echo() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let received = Arc::new(AtomicUsize::new(0));
    let count = received.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n) = conn.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    count.fetch_add(n, SeqCst);
                    if conn.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    (addr, received)
}

/// Sends `byte` and waits up to `wait` for its echo: `Some(Ok)` echoed,
/// `Some(Err)` the connection failed, `None` nothing came.
async fn ask(conn: &mut TcpStream, byte: u8, wait: Duration) -> Option<std::io::Result<u8>> {
    if let Err(e) = conn.write_all(&[byte]).await {
        return Some(Err(e));
    }
    read_one(conn, wait).await
}

async fn read_one(conn: &mut TcpStream, wait: Duration) -> Option<std::io::Result<u8>> {
    let mut one = [0u8; 1];
    match tokio::time::timeout(wait, conn.read(&mut one)).await {
        Err(_) => None,
        Ok(Ok(0)) => Some(Err(std::io::ErrorKind::UnexpectedEof.into())),
        Ok(Ok(_)) => Some(Ok(one[0])),
        Ok(Err(e)) => Some(Err(e)),
    }
}

/// Waits until `done` holds; fails the test after [`ARRIVES`].
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < ARRIVES, "{what}: not in {ARRIVES:?}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The connection was reset (RST), not closed.
#[track_caller]
fn was_reset(heard: Option<std::io::Result<u8>>) {
    match heard {
        Some(Err(e)) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
        other => panic!("expected a reset, heard {other:?}"),
    }
}

#[tokio::test]
async fn each_mode_holds_delays_loses_or_resets_open_connections() {
    let (server, received) = echo().await;
    let proxy = Proxy::start(server).await;
    let mut conn = TcpStream::connect(("127.0.0.1", proxy.port())).await.unwrap();
    assert_eq!(ask(&mut conn, b'a', ARRIVES).await.unwrap().unwrap(), b'a');

    // Black hole: the proxy takes the request in and holds it, nothing
    // reaches the server; at the heal it flows on.
    proxy.set(Mode::Blackhole);
    conn.write_all(b"b").await.unwrap();
    until("the proxy took the black-holed request in", || proxy.counts().requests_in == 2).await;
    assert_eq!(proxy.counts().requests_out, 1, "a black-holed request was passed on");
    assert!(read_one(&mut conn, SILENCE).await.is_none(), "an answer through a black hole");
    assert_eq!(received.load(SeqCst), 1, "a black-holed request reached the server");
    proxy.set(Mode::Pass);
    assert_eq!(read_one(&mut conn, ARRIVES).await.unwrap().unwrap(), b'b');

    // Delay: 200 ms each way, so the echo takes at least 400 ms.
    proxy.set(Mode::Delay(Duration::from_millis(200)));
    let sent = Instant::now();
    assert_eq!(ask(&mut conn, b'c', ARRIVES).await.unwrap().unwrap(), b'c');
    let took = sent.elapsed();
    assert!(took >= Duration::from_millis(400), "{took:?}");
    proxy.set(Mode::Pass);
    let before = proxy.counts();
    assert_eq!(before, Counts { requests_in: 3, requests_out: 3, replies_in: 3, replies_out: 3 });

    // Replies lost, on sixteen connections at once: the requests land, the
    // server's answers reach the proxy and stay there; the reset at the
    // heal ends the connections, the held replies undelivered.
    let mut more = Vec::new();
    for _ in 0..15 {
        more.push(TcpStream::connect(("127.0.0.1", proxy.port())).await.unwrap());
    }
    proxy.set(Mode::BlackholeReplies);
    conn.write_all(b"d").await.unwrap();
    for other in &mut more {
        other.write_all(b"d").await.unwrap();
    }
    until("the sixteen requests reached the server", || received.load(SeqCst) == 3 + 16).await;
    until("the sixteen replies reached the proxy", || proxy.counts().replies_in == 3 + 16).await;
    assert_eq!(proxy.counts().replies_out, 3, "a held reply was delivered");
    assert!(read_one(&mut conn, SILENCE).await.is_none(), "a held reply arrived");
    proxy.reset_all(Mode::Pass);
    was_reset(read_one(&mut conn, ARRIVES).await);
    for other in &mut more {
        was_reset(read_one(other, ARRIVES).await);
    }
    assert_eq!(proxy.counts().replies_out, 3, "the reset delivered a held reply");

    // Drop: open connections reset, new ones refused until the heal.
    let mut conn = TcpStream::connect(("127.0.0.1", proxy.port())).await.unwrap();
    assert_eq!(ask(&mut conn, b'e', ARRIVES).await.unwrap().unwrap(), b'e');
    proxy.reset_all(Mode::Refuse);
    was_reset(read_one(&mut conn, ARRIVES).await);
    let mut refused = TcpStream::connect(("127.0.0.1", proxy.port())).await.unwrap();
    was_reset(ask(&mut refused, b'f', ARRIVES).await);
    proxy.set(Mode::Pass);
    let mut conn = TcpStream::connect(("127.0.0.1", proxy.port())).await.unwrap();
    assert_eq!(ask(&mut conn, b'g', ARRIVES).await.unwrap().unwrap(), b'g');
}
