//! What Redis holds of a call (its claim, its cached result), at
//! `IDEM_REDIS_URL`, read and deleted by the engine's own layout. Built
//! with the feature `redis`; without it [`RedisStore`] has no value, so
//! the commands' Redis branches compile and never run, and a Redis URL is
//! refused with the feature to build ([`crate::drivers`]).

use crate::Failure;
use crate::cli::Given;

/// Where one `(biz, key)` lives in Redis.
#[derive(Debug, Clone)]
// Without Redis, no value is made and only the claim's name is printed.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub struct Location {
    /// The claim's key (a string: `p:<owner>:<fingerprint>` while a call runs).
    pub claim: String,
    /// The call's field in the result hashes.
    pub field: [u8; 16],
    /// What the result hashes of the call's shard are named: this, then the window.
    pub results_prefix: String,
}

#[cfg(feature = "redis")]
pub use with_redis::RedisStore;
#[cfg(not(feature = "redis"))]
pub use without_redis::RedisStore;

#[cfg(feature = "redis")]
mod with_redis {
    use std::time::Duration;

    use super::{Given, Location};
    use crate::Failure;

    /// The Redis of the claims and cached results.
    pub struct RedisStore {
        client: redis::Client,
        from: &'static str,
    }

    impl RedisStore {
        /// A client for `url` (connected at its first use).
        pub fn open(url: &Given) -> Result<RedisStore, Failure> {
            let client = redis::Client::open(url.value.as_str()).map_err(|e| format!("{}: {e}", url.from))?;
            Ok(RedisStore { client, from: url.from })
        }

        /// The client, for an engine.
        pub fn client(&self) -> redis::Client {
            self.client.clone()
        }

        /// Where `(biz, key)` lives in `namespace`.
        pub fn locate(&self, namespace: &str, biz: &str, key: &str) -> Result<Location, Failure> {
            let at = idempotency_runtime::redis_layout::locate(namespace, biz, key)
                .map_err(|e| format!("namespace: {e}"))?;
            Ok(Location { claim: at.claim, field: at.field, results_prefix: at.results_prefix })
        }

        /// A cached result's expiry (epoch ms), if `value` is one.
        pub fn result_expiry(&self, value: &[u8]) -> Option<i64> {
            idempotency_runtime::redis_layout::parse_result(value.to_vec()).map(|(expires_at, ..)| expires_at)
        }

        async fn conn(&self) -> Result<redis::aio::MultiplexedConnection, Failure> {
            let conn = tokio::time::timeout(Duration::from_secs(5), self.client.get_multiplexed_async_connection())
                .await
                .map_err(|_| format!("{}: no answer within 5 s", self.from))?
                .map_err(|e| format!("{}: {e}", self.from))?;
            Ok(conn)
        }

        /// What Redis holds at `key`, and for how long (ms; -1 without expiry).
        pub async fn get(&self, key: &str) -> Result<Option<(Vec<u8>, i64)>, Failure> {
            let mut conn = self.conn().await?;
            let (value, ttl): (Option<Vec<u8>>, i64) =
                redis::pipe().cmd("GET").arg(key).cmd("PTTL").arg(key).query_async(&mut conn).await?;
            Ok(value.map(|v| (v, ttl)))
        }

        /// The result hashes that hold a cached result of `at`, with its
        /// bytes. The hashes of one shard are few (two windows live at a
        /// time), and so are the keys a `SCAN` walks: results share hashes.
        /// A hash's name is any key with the prefix, kept as bytes (it may
        /// not be UTF-8) and shown escaped.
        pub async fn results(&self, at: &Location) -> Result<Vec<(Vec<u8>, Vec<u8>)>, Failure> {
            let mut conn = self.conn().await?;
            let (mut cursor, mut found) = (0u64, Vec::new());
            loop {
                let (next, hashes): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(format!("{}*", at.results_prefix))
                    .arg("COUNT")
                    .arg(1000)
                    .query_async(&mut conn)
                    .await?;
                for hash in hashes {
                    let value: Option<Vec<u8>> =
                        redis::cmd("HGET").arg(&hash).arg(&at.field[..]).query_async(&mut conn).await?;
                    found.extend(value.map(|v| (hash, v)));
                }
                if next == 0 {
                    return Ok(found);
                }
                cursor = next;
            }
        }

        /// Deletes `key`; whether it existed.
        pub async fn del(&self, key: &str) -> Result<bool, Failure> {
            let mut conn = self.conn().await?;
            let n: i64 = redis::cmd("DEL").arg(key).query_async(&mut conn).await?;
            Ok(n > 0)
        }

        /// Deletes `at`'s cached result from `hash`; whether it was there.
        pub async fn hdel(&self, hash: &[u8], at: &Location) -> Result<bool, Failure> {
            let mut conn = self.conn().await?;
            let n: i64 = redis::cmd("HDEL").arg(hash).arg(&at.field[..]).query_async(&mut conn).await?;
            Ok(n > 0)
        }
    }
}

#[cfg(not(feature = "redis"))]
mod without_redis {
    use super::{Given, Location};
    use crate::Failure;

    /// No Redis in this build: no value of this type exists.
    pub enum RedisStore {}

    impl RedisStore {
        pub fn open(url: &Given) -> Result<RedisStore, Failure> {
            Err(crate::drivers::left_out(url.from, "redis").into())
        }

        pub fn locate(&self, _: &str, _: &str, _: &str) -> Result<Location, Failure> {
            match *self {}
        }

        pub fn result_expiry(&self, _: &[u8]) -> Option<i64> {
            match *self {}
        }

        pub async fn get(&self, _: &str) -> Result<Option<(Vec<u8>, i64)>, Failure> {
            match *self {}
        }

        pub async fn results(&self, _: &Location) -> Result<Vec<(Vec<u8>, Vec<u8>)>, Failure> {
            match *self {}
        }

        pub async fn del(&self, _: &str) -> Result<bool, Failure> {
            match *self {}
        }

        pub async fn hdel(&self, _: &[u8], _: &Location) -> Result<bool, Failure> {
            match *self {}
        }
    }
}

/// Opens the Redis of `url`, when one is given.
pub fn open(url: Option<&Given>) -> Result<Option<RedisStore>, Failure> {
    url.map(RedisStore::open).transpose()
}
