//! The nemesis's proxy does what each cut says, to open connections too:
//! checked against an echo server on loopback that counts what reached it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use idempotency_testkit::nemesis::proxy::{Mode, Proxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

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

const SHORT: Duration = Duration::from_millis(300);

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
    assert_eq!(ask(&mut conn, b'a', SHORT).await.unwrap().unwrap(), b'a');

    // Black hole: nothing reaches the server; at the heal it flows on.
    proxy.set(Mode::Blackhole);
    assert!(ask(&mut conn, b'b', SHORT).await.is_none());
    assert_eq!(received.load(SeqCst), 1, "a black-holed request reached the server");
    proxy.set(Mode::Pass);
    assert_eq!(read_one(&mut conn, SHORT).await.unwrap().unwrap(), b'b');

    // Delay: 200 ms each way.
    proxy.set(Mode::Delay(Duration::from_millis(200)));
    let sent = Instant::now();
    assert_eq!(ask(&mut conn, b'c', Duration::from_secs(2)).await.unwrap().unwrap(), b'c');
    let took = sent.elapsed();
    assert!(took >= Duration::from_millis(400) && took < Duration::from_millis(1500), "{took:?}");
    proxy.set(Mode::Pass);

    // Replies lost: the requests land, their answers never come; the reset
    // at the heal ends the connections, the held replies undelivered (on
    // sixteen at once: whether a held reply slips out is a race).
    let mut more = Vec::new();
    for _ in 0..15 {
        more.push(TcpStream::connect(("127.0.0.1", proxy.port())).await.unwrap());
    }
    proxy.set(Mode::BlackholeReplies);
    assert!(ask(&mut conn, b'd', SHORT).await.is_none());
    for other in &mut more {
        assert!(ask(other, b'd', Duration::from_millis(10)).await.is_none());
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(received.load(SeqCst), 3 + 16, "the requests reached the server");
    proxy.reset_all(Mode::Pass);
    was_reset(read_one(&mut conn, SHORT).await);
    for other in &mut more {
        was_reset(read_one(other, SHORT).await);
    }

    // Drop: open connections reset, new ones refused until the heal.
    let mut conn = TcpStream::connect(("127.0.0.1", proxy.port())).await.unwrap();
    assert_eq!(ask(&mut conn, b'e', SHORT).await.unwrap().unwrap(), b'e');
    proxy.reset_all(Mode::Refuse);
    was_reset(read_one(&mut conn, SHORT).await);
    let mut refused = TcpStream::connect(("127.0.0.1", proxy.port())).await.unwrap();
    was_reset(ask(&mut refused, b'f', SHORT).await);
    proxy.set(Mode::Pass);
    let mut conn = TcpStream::connect(("127.0.0.1", proxy.port())).await.unwrap();
    assert_eq!(ask(&mut conn, b'g', SHORT).await.unwrap().unwrap(), b'g');
}
