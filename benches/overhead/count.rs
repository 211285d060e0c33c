//! Round trips per call, counted rather than guessed: the SQL round trips a
//! caller waits for, counted on the wire by a forwarder between a pool of
//! one connection and the server (`idempotency_testkit::forwarder`: a
//! client's turn is one round trip, whatever it carries; the pool's ping of
//! a connection given back, and the `ROLLBACK` a dropped transaction queued
//! before it, are counted apart as the pool's), and the commands Redis sees
//! (`MONITOR`).

use std::time::Duration;

use idempotency_testkit::forwarder::{Forwarder, Path, Protocol, Turns};

/// A pool of one connection to a server through a counting forwarder: the
/// counting passes run their calls on it.
pub struct Counted<DB: sqlx::Database> {
    link: Forwarder,
    pub pool: sqlx::Pool<DB>,
}

impl<DB: sqlx::Database> Counted<DB> {
    /// Reaches the server `url` names (its port on loopback) through a new
    /// forwarder, counting as `protocol`.
    pub async fn to(url: &str, protocol: Protocol) -> Self {
        let link = Forwarder::start_with(port_of(url), Path { count: Some(protocol), ..Path::default() }).await;
        let options = sqlx::pool::PoolOptions::<DB>::new().max_connections(1).test_before_acquire(false);
        let pool = options.connect(&through(url, link.port())).await.expect("through the counting forwarder");
        Counted { link, pool }
    }

    /// The turns so far, once the connection is back in the pool (its
    /// ping done).
    async fn settled(&self) -> Turns {
        let start = std::time::Instant::now();
        while self.pool.num_idle() as u32 != self.pool.size() {
            assert!(start.elapsed() < Duration::from_secs(30), "the counted connection never came back");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.link.turns()
    }
}

/// The port of the server `url` names.
pub fn port_of(url: &str) -> u16 {
    let address = url.rsplit_once('@').map_or(url.split_once("://").expect("a url").1, |(_, a)| a);
    let host_port = address.split(['/', '?']).next().expect("an address");
    host_port.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).expect("a port")
}

/// `url` with its host and port replaced by `127.0.0.1:port`, over plain
/// TCP (a forwarder reads PostgreSQL's messages; MariaDB has no TLS here).
pub fn through(url: &str, port: u16) -> String {
    let (scheme, rest) = url.split_once("://").expect("a url");
    let user = rest.rsplit_once('@').map_or(String::new(), |(u, _)| format!("{u}@"));
    let address = rest.rsplit_once('@').map_or(rest, |(_, a)| a);
    let database = address.split_once('/').map_or("", |(_, d)| d).split('?').next().unwrap_or("");
    let tls = if scheme.starts_with("postgres") { "?sslmode=disable" } else { "" };
    format!("{scheme}://{user}127.0.0.1:{port}/{database}{tls}")
}

/// Counts the commands clients send to Redis nodes from [`start`] to
/// [`stop`], through `MONITOR`: what a script runs inside Redis shows there
/// as `[0 lua]` and is no round trip. Whatever background work a counted
/// call leaves (the cache write) lands before `stop` ends the count.
///
/// [`start`]: RedisCount::start
/// [`stop`]: RedisCount::stop
struct RedisCount {
    nodes: Vec<(String, u16)>,
    readers: Vec<tokio::task::JoinHandle<u64>>,
}

impl RedisCount {
    const MARK: &str = "idem-bench-count-end";

    async fn start(nodes: &[redis::Client]) -> Self {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let mut count = RedisCount { nodes: Vec::new(), readers: Vec::new() };
        for node in nodes {
            let redis::ConnectionAddr::Tcp(host, port) = node.get_connection_info().addr() else { continue };
            let mut socket = tokio::net::TcpStream::connect((host.as_str(), *port)).await.expect("monitor connect");
            socket.write_all(b"MONITOR\r\n").await.expect("monitor");
            let mut lines = BufReader::new(socket).lines();
            assert_eq!(lines.next_line().await.expect("monitor reply").as_deref(), Some("+OK"));
            count.nodes.push((host.clone(), *port));
            count.readers.push(tokio::spawn(async move {
                let mut sent = 0;
                while let Ok(Some(line)) = lines.next_line().await {
                    if line.contains(Self::MARK) {
                        break;
                    }
                    sent += u64::from(!line.contains(" lua]"));
                }
                sent
            }));
        }
        count
    }

    /// Commands per node summed; the background work of the counted calls
    /// gets a moment to land first.
    async fn stop(self) -> u64 {
        use tokio::io::AsyncWriteExt;
        if self.nodes.is_empty() {
            return 0;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        for (host, port) in &self.nodes {
            let mut socket = tokio::net::TcpStream::connect((host.as_str(), *port)).await.expect("mark connect");
            let mark = format!("*2\r\n$4\r\nECHO\r\n${}\r\n{}\r\n", Self::MARK.len(), Self::MARK);
            socket.write_all(mark.as_bytes()).await.expect("mark");
        }
        let mut total = 0;
        for reader in self.readers {
            total += reader.await.expect("monitor reader");
        }
        total
    }
}

/// Round trips per call over `n` sequential calls, after `warm` uncounted
/// ones (statements prepared on the connection, a fn's count of replays
/// settled): the SQL ones a caller waits for (NaN without a counted pool,
/// SQLite's: a statement there is a call into the library), and the Redis
/// commands (background cache writes included).
pub async fn round_trips<DB, F, Fut>(
    sql: Option<&Counted<DB>>,
    redis: &[redis::Client],
    warm: usize,
    n: usize,
    call: F,
) -> (f64, f64)
where
    DB: sqlx::Database,
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for i in 0..warm {
        call(n + i).await;
    }
    let redis_count = RedisCount::start(redis).await;
    let before = match sql {
        Some(counted) => Some(counted.settled().await),
        None => None,
    };
    for i in 0..n {
        call(i).await;
    }
    let sql = match (sql, before) {
        (Some(counted), Some(before)) => (counted.settled().await - before).statements as f64 / n as f64,
        _ => f64::NAN,
    };
    let redis_cmds = redis_count.stop().await as f64 / n as f64;
    (sql, redis_cmds)
}
