//! The faults the soak injects from outside the calls: Redis (or one
//! cluster node) killed and restarted, database connections killed, and the
//! panics bodies throw kept out of the log.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use super::{Rng, SoakBackend};
use crate::servers::{RedisCluster, RedisServer};

/// Panics the soak injects are expected: keep their messages out of the log.
pub fn quiet_injected_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let message = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str));
            let injected = message.is_some_and(|m| m.contains(INJECTED_PANIC));
            if !injected {
                default(info);
            }
        }));
    });
}

/// What an injected panic says (and how the quiet hook knows it).
pub const INJECTED_PANIC: &str = "soak: injected panic";

/// Where the soak's Redis lives, and how to hurt it.
#[derive(Clone)]
pub enum RedisSetup {
    Single(Arc<RedisServer>),
    Cluster(Arc<RedisCluster>),
}

impl RedisSetup {
    pub fn builder<DB: idempotency::Backend>(&self, builder: idempotency::Builder<DB>) -> idempotency::Builder<DB> {
        match self {
            RedisSetup::Single(server) => builder.redis(server.client()),
            RedisSetup::Cluster(cluster) => builder.redis_cluster(cluster.client()),
        }
    }
}

/// Kills Redis (or one cluster node) `cycles` times, spread over the run by
/// progress, each time for 150..500 ms, then starts it again (empty).
pub async fn redis_faults(
    redis: RedisSetup,
    cycles: usize,
    total: usize,
    done: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    seed: u64,
) -> usize {
    let mut rng = Rng::new(seed ^ 0x05EE_D0F4_ED15);
    let mut kills = 0;
    for j in 1..=cycles {
        let at = total * j / (cycles + 1);
        while done.load(SeqCst) < at {
            if stop.load(SeqCst) {
                return kills;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let down = rng.millis(150, 500);
        match &redis {
            RedisSetup::Single(server) => {
                let s = server.clone();
                tokio::task::spawn_blocking(move || s.kill()).await.unwrap();
                tokio::time::sleep(down).await;
                let s = server.clone();
                tokio::task::spawn_blocking(move || s.restart()).await.unwrap();
            }
            RedisSetup::Cluster(cluster) => {
                let node = rng.below(cluster.ports().len() as u64) as usize;
                let c = cluster.clone();
                tokio::task::spawn_blocking(move || c.kill_node(node)).await.unwrap();
                tokio::time::sleep(down).await;
                let c = cluster.clone();
                tokio::task::spawn_blocking(move || c.start_node(node)).await.unwrap();
            }
        }
        kills += 1;
    }
    kills
}

/// Tags the connections of the soak's pools, so that only they are killed
/// (MariaDB: their connection ids; PostgreSQL: their `application_name`).
pub struct Tag {
    pub name: String,
    pub ids: Mutex<HashSet<u64>>,
}

impl Tag {
    pub fn new(name: String) -> Self {
        Self { name, ids: Mutex::new(HashSet::new()) }
    }
}

/// Kills one of the tagged connections that is inside a transaction, every
/// 20..150 ms, until `stop`.
pub(super) async fn db_faults<B: SoakBackend>(
    admin: sqlx::Pool<B::Db>,
    tag: Arc<Tag>,
    stop: Arc<AtomicBool>,
    seed: u64,
) -> u64 {
    let mut rng = Rng::new(seed ^ 0x00D8_C022);
    let mut kills = 0;
    while !stop.load(SeqCst) {
        tokio::time::sleep(rng.millis(20, 150)).await;
        if B::kill_one(&admin, &tag, &mut rng).await {
            kills += 1;
        }
    }
    kills
}
