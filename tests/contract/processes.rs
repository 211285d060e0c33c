//! Servers a test process starts once, on first use, for all its cells (a
//! Redis Cluster, a PgBouncer), and stops when its cells are done: their
//! handles kill their children when dropped, and a `static` is never
//! dropped, so `main` calls [`stop_all`] before it exits.

use std::future::Future;
use std::sync::Arc;

use idempotency_testkit::pgbouncer::PgBouncer;
use idempotency_testkit::servers::RedisCluster;
use tokio::sync::Mutex;

/// This process's Redis Cluster.
pub static CLUSTER: Started<RedisCluster> = Started::new();
/// This process's PgBouncer, and the pool through it.
pub static PGBOUNCER: Started<(PgBouncer, sqlx::PgPool)> = Started::new();

/// A server started at most once: `None` inside when it could not be.
pub struct Started<T> {
    slot: Mutex<Option<Option<Arc<T>>>>,
}

impl<T> Started<T> {
    pub const fn new() -> Self {
        Started { slot: Mutex::const_new(None) }
    }

    /// The server, started by `start` the first time.
    pub async fn get(&self, start: impl Future<Output = Option<T>>) -> Option<Arc<T>> {
        let mut slot = self.slot.lock().await;
        if slot.is_none() {
            *slot = Some(start.await.map(Arc::new));
        }
        slot.as_ref().expect("tried").clone()
    }

    /// Drops this process's handle: the server stops once no cell holds it.
    fn stop(&self) {
        if let Ok(mut slot) = self.slot.try_lock() {
            *slot = Some(None);
        }
    }
}

/// Stops every server this process started.
pub fn stop_all() {
    CLUSTER.stop();
    PGBOUNCER.stop();
}
