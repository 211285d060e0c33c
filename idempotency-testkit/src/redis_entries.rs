//! What a Redis holds, read and forged by tests: claims a crashed call
//! would leave, results Redis lost, cached results, and pauses. Where a
//! call's claim and result live is the engine's own layout
//! ([`idempotency::redis_layout`]), never rewritten here.

use std::time::Duration;

#[cfg(feature = "redis")]
pub use idempotency::redis_layout::Location;

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

/// Deletes `key`.
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

/// The result hashes of `at`'s shard that hold its field: (hash, bytes).
#[cfg(feature = "redis")]
async fn results(
    conn: &mut redis::aio::MultiplexedConnection,
    at: &Location,
) -> redis::RedisResult<Vec<(String, Vec<u8>)>> {
    let mut cursor = 0u64;
    let mut found = Vec::new();
    loop {
        let (next, hashes): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{}*", at.results_prefix))
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        for hash in hashes {
            let value: Option<Vec<u8>> = redis::cmd("HGET").arg(&hash).arg(&at.field[..]).query_async(conn).await?;
            if let Some(value) = value {
                found.push((hash, value));
            }
        }
        if next == 0 {
            return Ok(found);
        }
        cursor = next;
    }
}

/// The cached result of `at` (its bytes, as the engine wrote them), if any.
#[cfg(feature = "redis")]
pub async fn redis_result(client: &redis::Client, at: &Location) -> Option<Vec<u8>> {
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    results(&mut conn, at).await.expect("SCAN / HGET").into_iter().next().map(|(_, value)| value)
}

/// Polls until Redis holds a finished result of `at` (written after the
/// commit from a spawned task); returns its response.
#[cfg(feature = "redis")]
pub async fn redis_cached_response(client: &redis::Client, at: &Location) -> String {
    let start = std::time::Instant::now();
    loop {
        // A paused Redis may time out: asked again until the deadline.
        let found = match client.get_multiplexed_async_connection().await {
            Ok(mut conn) => results(&mut conn, at).await.unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        if let Some((_, value)) = found.into_iter().next() {
            let (_, _, response) = idempotency::redis_layout::parse_result(value).expect("a result the engine wrote");
            return response;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{} not cached", at.claim);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Replaces the cached result of `at` (where it is kept) by `value`.
#[cfg(feature = "redis")]
pub async fn redis_replace_result(client: &redis::Client, at: &Location, value: &[u8]) {
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let found = results(&mut conn, at).await.expect("SCAN / HGET");
    assert!(!found.is_empty(), "{} holds no result to replace", at.claim);
    for (hash, _) in found {
        let _: i64 = redis::cmd("HSET").arg(&hash).arg(&at.field[..]).arg(value).query_async(&mut conn).await.unwrap();
    }
}

/// Makes Redis lose everything of `at`: its claim and its cached result
/// (evicted, flushed, restarted).
#[cfg(feature = "redis")]
pub async fn redis_forget(client: &redis::Client, at: &Location) {
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let _: i64 = redis::cmd("DEL").arg(&at.claim).query_async(&mut conn).await.expect("DEL");
    for (hash, _) in results(&mut conn, at).await.expect("SCAN / HGET") {
        let _: i64 = redis::cmd("HDEL").arg(&hash).arg(&at.field[..]).query_async(&mut conn).await.expect("HDEL");
    }
}

/// Whether Redis holds anything of `at`: a claim or a cached result.
#[cfg(feature = "redis")]
pub async fn redis_holds(client: &redis::Client, at: &Location) -> bool {
    redis_exists(client, &at.claim).await || redis_result(client, at).await.is_some()
}

/// Makes Redis hold every command for `ms` (`CLIENT PAUSE`): answered as
/// soon as the pause has begun, so what follows is held for certain.
pub async fn redis_pause(client: &redis::Client, ms: u64) {
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let _: () = redis::cmd("CLIENT").arg("PAUSE").arg(ms).arg("ALL").query_async(&mut conn).await.expect("PAUSE");
}

/// Holds every write and every script (claims, cache writes, releases: the
/// gate's are all scripts) until [`redis_unpause`]; reads and the unpause
/// itself go on (`CLIENT PAUSE .. WRITE`). For a minute at most: a bound on
/// a test that hangs, not a duration anything waits for.
pub async fn redis_pause_writes(client: &redis::Client) {
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let _: () = redis::cmd("CLIENT").arg("PAUSE").arg(60_000).arg("WRITE").query_async(&mut conn).await.expect("PAUSE");
}

/// Ends a [`redis_pause_writes`]: the held commands run, before any command
/// sent after this returns.
pub async fn redis_unpause(client: &redis::Client) {
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let _: () = redis::cmd("CLIENT").arg("UNPAUSE").query_async(&mut conn).await.expect("UNPAUSE");
}
