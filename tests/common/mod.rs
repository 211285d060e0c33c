//! Shared by the per-backend test targets: reaching (and if need be starting)
//! the servers, and unique keys so tests run in parallel.
#![allow(dead_code)]

pub mod servers;

use std::process::Command;
use std::sync::Once;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub fn mysql_url() -> String {
    std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

pub fn pg_url() -> String {
    std::env::var("IDEM_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

pub fn redis_url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// `IDEM_REQUIRE_SERVICES=1` turns an unreachable server into a failure.
pub fn services_required() -> bool {
    std::env::var("IDEM_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

/// Reports a missing server: one visible line, or a failure when required.
pub fn skip(service: &str) {
    if services_required() {
        panic!("{service} unreachable and IDEM_REQUIRE_SERVICES=1");
    }
    println!("skipped: {service} unreachable");
}

/// The machine's start commands; each runs at most once per test process.
fn start(service: &str) {
    static MYSQL: Once = Once::new();
    static PG: Once = Once::new();
    static REDIS: Once = Once::new();
    let (once, script) = match service {
        "mysql" => (
            &MYSQL,
            "command -v mariadbd >/dev/null && start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
        ),
        "postgres" => (
            &PG,
            "command -v pg_ctlcluster >/dev/null && pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
        ),
        _ => (
            &REDIS,
            "command -v redis-server >/dev/null && redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save '' --appendonly no",
        ),
    };
    once.call_once(|| {
        let _ = Command::new("sh").arg("-c").arg(format!("({script}) >/dev/null 2>&1")).status();
    });
}

/// Tries `connect` for a while, starting the service once if it does not answer.
pub async fn reach<T, F, Fut>(service: &str, mut connect: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    if let Some(t) = connect().await {
        return Some(t);
    }
    start(service);
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if let Some(t) = connect().await {
            return Some(t);
        }
    }
    skip(service);
    None
}

pub async fn redis_client() -> Option<redis::Client> {
    reach("redis", || async {
        let client = redis::Client::open(redis_url()).ok()?;
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        let pong: String = redis::cmd("PING").query_async(&mut conn).await.ok()?;
        (pong == "PONG").then_some(client)
    })
    .await
}

/// Whether Redis holds `key`.
pub async fn redis_exists(client: &redis::Client, key: &str) -> bool {
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    redis::cmd("EXISTS").arg(key).query_async(&mut conn).await.expect("EXISTS")
}

/// Sets `key` to `value` for `ttl_ms` (tests that forge what a crashed call left).
pub async fn redis_set(client: &redis::Client, key: &str, value: &str, ttl_ms: u64) {
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let _: () = redis::cmd("SET").arg(key).arg(value).arg("PX").arg(ttl_ms).query_async(&mut conn).await.expect("SET");
}

/// Deletes `key` (tests where Redis lost what it held).
pub async fn redis_del(client: &redis::Client, key: &str) {
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let _: i64 = redis::cmd("DEL").arg(key).query_async(&mut conn).await.expect("DEL");
}

/// Polls `key` until it is gone or `deadline` passes; what it held last.
/// A paused Redis may time out a `GET`, or the connection's own set-up:
/// both are tried again.
pub async fn redis_value_after(client: &redis::Client, key: &str, deadline: Duration) -> Option<String> {
    let start = std::time::Instant::now();
    loop {
        let value: redis::RedisResult<Option<String>> = match client.get_multiplexed_async_connection().await {
            Ok(mut conn) => redis::cmd("GET").arg(key).query_async(&mut conn).await,
            Err(e) => Err(e),
        };
        match value {
            Ok(None) => return None,
            Ok(Some(v)) if start.elapsed() > deadline => return Some(v),
            Err(e) if start.elapsed() > deadline => panic!("GET {key}: {e}"),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Polls `key` until it holds a finished result (`d:<expires_ms>:<fingerprint>:<response>`,
/// written after the commit from a spawned task); returns the response part.
pub async fn redis_cached_response(client: &redis::Client, key: &str) -> String {
    let start = std::time::Instant::now();
    loop {
        // A paused Redis may time out the `GET`: asked again until the deadline.
        let value: Option<String> = match client.get_multiplexed_async_connection().await {
            Ok(mut conn) => redis::cmd("GET").arg(key).query_async(&mut conn).await.unwrap_or(None),
            Err(_) => None,
        };
        let done = value.as_deref().and_then(|v| v.strip_prefix("d:"));
        // `d:<expires_ms>:<fingerprint>:<response>`
        if let Some((_, response)) = done.and_then(|v| v.split_once(':')).and_then(|(_, v)| v.split_once(':')) {
            return response.to_owned();
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{key} not cached: {value:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Makes Redis hold every command for `ms` (`CLIENT PAUSE`): answered as
/// soon as the pause has begun, so what follows is held for certain.
pub async fn redis_pause(client: &redis::Client, ms: u64) {
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let _: () = redis::cmd("CLIENT").arg("PAUSE").arg(ms).arg("ALL").query_async(&mut conn).await.expect("PAUSE");
}

/// A key nobody else uses: this process, this instant, a counter.
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    format!("{prefix}-{}-{nanos}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed))
}
