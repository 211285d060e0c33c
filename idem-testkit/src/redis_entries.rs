//! What a Redis holds, read and forged by tests: entries a crashed call
//! would leave, entries Redis lost, cached results, and pauses.

use std::time::Duration;

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
