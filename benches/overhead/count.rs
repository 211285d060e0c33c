//! Round trips per call, counted rather than guessed: the statements sqlx
//! logs (a `tracing` subscriber) and the commands Redis sees (`MONITOR`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Counts the statements sqlx sends (its `sqlx::query` events) while on,
/// and among them the ends of transactions (`COMMIT`, `ROLLBACK`): sqlx does
/// not log PostgreSQL's `BEGIN`, a round trip of its own, so each
/// transaction end stands for one there.
pub struct StatementCounter {
    on: AtomicBool,
    count: AtomicU64,
    transaction_ends: AtomicU64,
}

pub static COUNTER: StatementCounter =
    StatementCounter { on: AtomicBool::new(false), count: AtomicU64::new(0), transaction_ends: AtomicU64::new(0) };

/// Finds whether an event's `summary` field is a `COMMIT` or `ROLLBACK`.
struct EndsTransaction(bool);

impl tracing::field::Visit for EndsTransaction {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "summary" {
            let v = value.trim_start().to_ascii_uppercase();
            self.0 |= v.starts_with("COMMIT") || v.starts_with("ROLLBACK");
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.record_str(field, &format!("{value:?}").replace('"', ""));
    }
}

impl tracing::Subscriber for &'static StatementCounter {
    fn register_callsite(&self, meta: &'static tracing::Metadata<'static>) -> tracing::subscriber::Interest {
        if meta.target() == "sqlx::query" {
            tracing::subscriber::Interest::sometimes()
        } else {
            tracing::subscriber::Interest::never()
        }
    }
    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        meta.target() == "sqlx::query" && self.on.load(Ordering::Relaxed)
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        self.count.fetch_add(1, Ordering::Relaxed);
        let mut ends = EndsTransaction(false);
        event.record(&mut ends);
        if ends.0 {
            self.transaction_ends.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
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

/// Statements and Redis commands per call, over `n` sequential calls.
pub async fn round_trips<F, Fut>(begin_logged: bool, redis: &[redis::Client], n: usize, call: F) -> (f64, f64)
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let redis_count = RedisCount::start(redis).await;
    COUNTER.count.store(0, Ordering::Relaxed);
    COUNTER.transaction_ends.store(0, Ordering::Relaxed);
    COUNTER.on.store(true, Ordering::Relaxed);
    for i in 0..n {
        call(i).await;
    }
    COUNTER.on.store(false, Ordering::Relaxed);
    let unlogged_begins = if begin_logged { 0 } else { COUNTER.transaction_ends.load(Ordering::Relaxed) };
    let sql = (COUNTER.count.load(Ordering::Relaxed) + unlogged_begins) as f64 / n as f64;
    let redis_cmds = redis_count.stop().await as f64 / n as f64;
    (sql, redis_cmds)
}
