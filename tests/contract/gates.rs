//! The gate a cell's engines get, each over a path of its own a clause can
//! cut: one Redis (the shared one) or the local cache over it, reached
//! through a forwarder per engine; a Redis Cluster (one per test process,
//! started on first use) reached through a forwarder per node and engine,
//! the cluster client told to connect through them (`node_address_map`).
//! Cutting an engine's path is Redis failing for that engine alone.

use std::collections::HashMap;
use std::sync::Arc;

use idempotency::{Builder, LocalCache};
use idempotency_testkit::forwarder::Forwarder;
use idempotency_testkit::servers::RedisCluster;
use redis::cluster::{ClusterClientBuilder, NodeAddress};
use tokio::sync::OnceCell;

use crate::script::{BOUND, within};
use crate::table::Gate;

/// One engine's way to Redis.
pub struct Path {
    forwarders: Vec<Forwarder>,
}

impl Path {
    /// Redis fails for this engine: every connection cut, new ones refused.
    pub fn cut(&self) {
        for forwarder in &self.forwarders {
            forwarder.cut();
        }
    }

    /// The requests the engine sent Redis so far.
    pub fn asked(&self) -> u64 {
        self.forwarders.iter().map(|f| *f.requests().borrow()).sum()
    }

    /// Until the engine sent Redis `count` requests in all (`what` names the wait).
    pub async fn until_asked(&self, count: u64, what: &str) {
        let mut watching: Vec<_> = self.forwarders.iter().map(Forwarder::requests).collect();
        within(what, async {
            loop {
                let sum: u64 = watching.iter_mut().map(|w| *w.borrow_and_update()).sum();
                if sum >= count {
                    return;
                }
                let changes = watching.iter_mut().map(|w| Box::pin(w.changed()));
                let _ = futures_select_any(changes.collect()).await;
            }
        })
        .await;
    }
}

/// Resolves when any of `futures` does.
async fn futures_select_any<F: std::future::Future + Unpin>(mut futures: Vec<F>) -> F::Output {
    std::future::poll_fn(|cx| {
        for f in &mut futures {
            if let std::task::Poll::Ready(out) = std::pin::Pin::new(f).poll(cx) {
                return std::task::Poll::Ready(out);
            }
        }
        std::task::Poll::Pending
    })
    .await
}

/// A connection of the test's own to `client`'s Redis, with generous
/// timeouts (redis's defaults, 1 s to connect and 500 ms an answer, trip on
/// a loaded machine).
pub async fn test_connection(client: &redis::Client) -> redis::aio::MultiplexedConnection {
    let generous =
        redis::AsyncConnectionConfig::new().set_connection_timeout(Some(BOUND)).set_response_timeout(Some(BOUND));
    client.get_multiplexed_async_connection_with_config(&generous).await.expect("the test's redis connection")
}

/// The port of the shared Redis (`IDEM_REDIS_URL`), once it answers.
async fn shared_redis_port() -> Option<u16> {
    static PORT: OnceCell<Option<u16>> = OnceCell::const_new();
    *PORT
        .get_or_init(|| async {
            let client = idempotency_testkit::redis_client().await?;
            match client.get_connection_info().addr() {
                redis::ConnectionAddr::Tcp(_, port) => Some(*port),
                other => panic!("the forwarders reach Redis over TCP on loopback, not {other:?}"),
            }
        })
        .await
}

/// This process's Redis Cluster, started on first use.
async fn cluster() -> Option<Arc<RedisCluster>> {
    crate::processes::CLUSTER
        .get(async { tokio::task::spawn_blocking(RedisCluster::start).await.expect("start the cluster") })
        .await
}

/// `builder` with `gate`, over a path of its own; `None` (after `skipped:
/// ...`) when Redis does not answer.
pub async fn attach<DB: idempotency::Backend>(gate: Gate, builder: Builder<DB>) -> Option<(Builder<DB>, Option<Path>)> {
    match gate {
        Gate::NoRedis => Some((builder, None)),
        Gate::Redis | Gate::LocalCache => {
            let forwarder = Forwarder::start(shared_redis_port().await?).await;
            let client = redis::Client::open(format!("redis://127.0.0.1:{}", forwarder.port())).expect("redis url");
            let mut builder = builder.redis(client);
            if gate == Gate::LocalCache {
                builder = builder.local_cache(LocalCache::new(1_000, 1 << 20));
            }
            Some((builder, Some(Path { forwarders: vec![forwarder] })))
        }
        Gate::Cluster => {
            let cluster = cluster().await?;
            let mut forwarders = Vec::new();
            let mut through = HashMap::new();
            for &port in cluster.ports() {
                let forwarder = Forwarder::start(port).await;
                through.insert(NodeAddress::new("127.0.0.1", port), NodeAddress::new("127.0.0.1", forwarder.port()));
                forwarders.push(forwarder);
            }
            let urls = forwarders.iter().map(|f| format!("redis://127.0.0.1:{}", f.port()));
            let client = ClusterClientBuilder::new(urls).node_address_map(through).build().expect("cluster client");
            Some((builder.redis_cluster(client), Some(Path { forwarders })))
        }
    }
}
