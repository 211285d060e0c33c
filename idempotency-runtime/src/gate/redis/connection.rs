//! The engine's Redis connection (one node or a cluster), the timeout every
//! operation runs under, and the back-off after a failure: Redis failing
//! (no connection, no answer in time, a server that cannot serve anyone:
//! loading, busy, failing over, out of memory) makes the operation report
//! [`Missed::Failed`], logs a warning once, and leaves Redis alone for
//! [`BACKOFF`] (claims then go to the database alone).
//!
//! An error about the operation alone (a script's error, a key of another
//! type: [`refused_alone`]) is [`Missed::Refused`] and backs nothing off:
//! the server answered at once, so the next operation costs no timeout, and
//! what one key holds says nothing of the others. That operation's call goes
//! to the database alone; every other call keeps its Redis.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{FromRedisValue, Script, ScriptInvocation};
use tokio::sync::OnceCell;

use crate::clock;

/// How long Redis is skipped after it failed.
pub const BACKOFF: Duration = Duration::from_secs(1);

/// Where the claims live.
pub(crate) enum Target {
    Single(redis::Client),
    Cluster(Box<ClusterClient>),
}

#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// Why a Redis operation gave no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Missed {
    /// Not sent: Redis failed recently and is being left alone.
    Skipped,
    /// Sent, and it failed or timed out: it may or may not have run.
    Failed,
    /// Answered with an error about this operation alone ([`refused_alone`]):
    /// it did not complete, and Redis goes on serving the others.
    Refused,
}

/// Whether `reply` came from the server (a value or its refusal): a
/// refused operation is not tried again, it would be refused again.
pub(crate) fn answered<T>(reply: &Result<T, Missed>) -> bool {
    !matches!(reply, Err(Missed::Skipped | Missed::Failed))
}

/// Whether an operation is skipped while Redis is backing off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backoff {
    Respect,
    Ignore,
}

/// What another user of the engine's Redis (issued tokens, `crate::token`)
/// got back for one operation.
#[derive(Debug)]
pub(crate) enum Reply<T> {
    /// The server's answer.
    Value(T),
    /// The server answered with an error of its own (`ERR ...`, such as an
    /// unknown command): Redis is up, the operation did not run.
    Refused(redis::RedisError),
    /// No answer within the timeout, or the connection failed: the
    /// operation may or may not have run.
    Unreachable,
}

/// The connection, made on first use, and its health.
pub(crate) struct Link {
    target: Target,
    connection: OnceCell<Connection>,
    pub(crate) timeout: Duration,
    /// `clock::monotonic_ms()` before which Redis is not tried; 0 when
    /// healthy (a back-off is this process's own business: no other
    /// instance judges it).
    down_until_ms: AtomicU64,
    /// `clock::monotonic_ms()` before which a refusal is not logged again.
    quiet_until_ms: AtomicU64,
}

impl Link {
    pub(crate) fn new(target: Target, timeout: Duration) -> Self {
        Link {
            target,
            connection: OnceCell::new(),
            timeout,
            down_until_ms: AtomicU64::new(0),
            quiet_until_ms: AtomicU64::new(0),
        }
    }

    pub(crate) fn kind(&self) -> &'static str {
        match self.target {
            Target::Single(_) => "single",
            Target::Cluster(_) => "cluster",
        }
    }

    /// Whether Redis is being left alone after a failure.
    #[cfg(test)]
    pub(crate) fn backing_off(&self) -> bool {
        self.down_until_ms.load(Ordering::Relaxed) != 0
    }

    /// How long until the back-off ends (zero when healthy).
    pub(crate) fn backoff_left(&self) -> Duration {
        let down_until = self.down_until_ms.load(Ordering::Relaxed);
        Duration::from_millis(down_until.saturating_sub(clock::monotonic_ms()))
    }

    /// Runs `cmd`, an `EVALSHA` of `script` ([`evalsha`](super::scripts::evalsha)),
    /// loading the script first when the server has not (a restarted or
    /// failed-over node, a `SCRIPT FLUSH`).
    pub(crate) async fn eval<T: FromRedisValue>(
        &self,
        script: &Script,
        cmd: &redis::Cmd,
        backoff: Backoff,
    ) -> Result<T, Missed> {
        self.guarded(backoff, |mut c| async move {
            match cmd.query_async(&mut c).await {
                Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                    script.load_async(&mut c).await?;
                    cmd.query_async(&mut c).await
                }
                answered => answered,
            }
        })
        .await
    }

    /// Sends one command.
    pub(crate) async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd, backoff: Backoff) -> Result<T, Missed> {
        self.guarded(backoff, |mut c| async move { cmd.query_async(&mut c).await }).await
    }

    /// Runs one Redis operation under the timeout and (unless told to
    /// ignore it) the back-off.
    async fn guarded<T, F, Fut>(&self, backoff: Backoff, op: F) -> Result<T, Missed>
    where
        F: FnOnce(ConnectionHandle) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        // The clock is read only while backing off: healthy, the bound is 0.
        let down_until = self.down_until_ms.load(Ordering::Relaxed);
        if backoff == Backoff::Respect && down_until != 0 && clock::monotonic_ms() < down_until {
            return Err(Missed::Skipped);
        }
        let attempt = async {
            let conn = self.connection().await?;
            op(ConnectionHandle(conn)).await
        };
        let failure = match tokio::time::timeout(self.timeout, attempt).await {
            Ok(Ok(value)) => {
                // Read first: a write on every call would bounce the cache line between cores.
                if self.down_until_ms.load(Ordering::Relaxed) != 0 && self.down_until_ms.swap(0, Ordering::Relaxed) != 0
                {
                    tracing::info!("redis answers again; idempotency claims resume");
                    crate::metrics::redis_recovered();
                }
                return Ok(value);
            }
            Ok(Err(e)) if refused_alone(&e) => {
                self.log_refusal(&e);
                return Err(Missed::Refused);
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {:?}", self.timeout),
        };
        let until = clock::monotonic_ms() + millis(BACKOFF);
        if self.down_until_ms.swap(until, Ordering::Relaxed) == 0 {
            tracing::warn!(error = %failure, "redis unavailable; idempotency continues on the database alone");
            crate::metrics::redis_degraded();
        }
        Err(Missed::Failed)
    }

    /// Logs a refusal, at most once per [`BACKOFF`]: one key's bad entry
    /// can be met by every call of that key.
    fn log_refusal(&self, e: &redis::RedisError) {
        let now = clock::monotonic_ms();
        let quiet_until = self.quiet_until_ms.load(Ordering::Relaxed);
        if now >= quiet_until
            && self
                .quiet_until_ms
                .compare_exchange(quiet_until, now + millis(BACKOFF), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(error = %e, "redis refused an idempotency operation; its call continues on the database alone");
        }
    }

    async fn connection(&self) -> redis::RedisResult<Connection> {
        // Boxed: made once, its future would otherwise sit in every
        // operation's future, and so in every call's.
        let conn = self.connection.get_or_try_init(|| Box::pin(self.connect())).await?;
        Ok(conn.clone())
    }

    async fn connect(&self) -> redis::RedisResult<Connection> {
        match &self.target {
            Target::Single(client) => {
                // Lazy: connects on first use and reconnects by itself.
                // No response timeout of its own: `guarded` bounds each
                // operation already, and a second timer per operation
                // is not free (registering one wakes tokio's driver
                // through a syscall). Its timeout would not reconnect
                // either: redis-rs reconnects on a dropped connection,
                // not on a slow answer.
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(None)
                    .set_number_of_retries(1);
                ConnectionManager::new_lazy_with_config(client.clone(), config).map(Connection::Single)
            }
            Target::Cluster(client) => client.get_async_connection().await.map(Connection::Cluster),
        }
    }

    /// Sends `cmd` for the engine's other Redis users (issued tokens). Tried
    /// even while claims back off: they have no database to fall back on,
    /// so a try costs at most a timeout.
    pub(crate) async fn send<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> Reply<T> {
        self.lent(|mut c| async move { cmd.query_async(&mut c).await }).await
    }

    /// Runs `call` for the engine's other Redis users, as [`Link::send`].
    pub(crate) async fn send_script<T: FromRedisValue>(&self, call: &ScriptInvocation<'_>) -> Reply<T> {
        self.lent(|mut c| async move { call.invoke_async(&mut c).await }).await
    }

    async fn lent<T, F, Fut>(&self, op: F) -> Reply<T>
    where
        F: FnOnce(ConnectionHandle) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        // A refusal is an answer: Redis is up, and claims need not back off.
        let answered = self.guarded(Backoff::Ignore, |c| refusal_is_an_answer(op(c))).await;
        match answered {
            Ok(Ok(value)) => Reply::Value(value),
            Ok(Err(refused)) => Reply::Refused(refused),
            Err(_) => Reply::Unreachable,
        }
    }
}

/// `op`'s result, with the server's own refusal (`ERR ...`, such as an
/// unknown command or option) as an answer: Redis is up, the operation did
/// not run, and claims need not back off.
async fn refusal_is_an_answer<T>(
    op: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> redis::RedisResult<Result<T, redis::RedisError>> {
    match op.await {
        Ok(value) => Ok(Ok(value)),
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError) => Ok(Err(e)),
        Err(e) => Err(e),
    }
}

/// Whether `e` is the server refusing this one operation for what it
/// touches: an `ERR` (a script's runtime error among them), a key of
/// another type (`WRONGTYPE`), an aborted `EXEC`, keys in several slots, or
/// an answer of a type the caller did not expect. Everything else says the
/// server cannot serve now (no connection or answer, `LOADING`, `BUSY`,
/// `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `READONLY`, `OOM`, `MISCONF`,
/// `NOPERM`, and codes not known here): a failure, which backs off.
pub(crate) fn refused_alone(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    match e.kind() {
        ErrorKind::Server(ServerErrorKind::ResponseError | ServerErrorKind::ExecAbort | ServerErrorKind::CrossSlot) => {
            true
        }
        ErrorKind::UnexpectedReturnType => true,
        ErrorKind::Extension => e.code() == Some("WRONGTYPE"),
        _ => false,
    }
}

/// A cloned connection, usable as `redis::aio::ConnectionLike`.
struct ConnectionHandle(Connection);

impl redis::aio::ConnectionLike for ConnectionHandle {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        match &mut self.0 {
            Connection::Single(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match &mut self.0 {
            Connection::Single(c) => c.req_packed_commands(cmd, offset, count),
            Connection::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match &self.0 {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::super::testing::test_client;
    use super::*;

    /// A link to the test Redis, or `None` (skipped) when none answers,
    /// unless `IDEM_REQUIRE_SERVICES` is set.
    async fn test_link() -> Option<Link> {
        Some(Link::new(Target::Single(test_client().await?), Duration::from_secs(5)))
    }

    /// Regression (issue 32.5): an error about one operation (a key of
    /// another type, a script's runtime error) is a refusal: nothing backs
    /// off, and the next operation is sent. A failure (nothing listening)
    /// backs off, and the next operation is skipped.
    #[tokio::test]
    async fn a_refusal_is_no_outage_and_a_failure_is() {
        let Some(link) = test_link().await else { return };
        let key = format!("idem:t_refusal:{}", crate::random::token());
        let mut set = redis::cmd("SET");
        set.arg(&key).arg("x").arg("PX").arg(60_000);
        let _: () = link.query(&set, Backoff::Respect).await.expect("SET");

        let mut hget = redis::cmd("HGET");
        hget.arg(&key).arg("f");
        let wrong_type: Result<Option<String>, Missed> = link.query(&hget, Backoff::Respect).await;
        assert_eq!(wrong_type, Err(Missed::Refused));
        let mut script_error = redis::cmd("EVAL");
        script_error.arg("local a = string.byte(ARGV[1], 2, 7) return a + 1").arg(0).arg("d");
        let script_error: Result<i64, Missed> = link.query(&script_error, Backoff::Respect).await;
        assert_eq!(script_error, Err(Missed::Refused), "arithmetic on nil: what a short result did to the claim");
        assert!(!link.backing_off());
        let mut get = redis::cmd("GET");
        get.arg(&key);
        let after: Result<Option<String>, Missed> = link.query(&get, Backoff::Respect).await;
        assert_eq!(after, Ok(Some("x".into())), "sent at once");
        let _: Result<i64, Missed> = link.query(redis::cmd("DEL").arg(&key), Backoff::Respect).await;

        let dead =
            Link::new(Target::Single(redis::Client::open("redis://127.0.0.1:1").unwrap()), Duration::from_secs(5));
        let failed: Result<Option<String>, Missed> = dead.query(&get, Backoff::Respect).await;
        assert_eq!(failed, Err(Missed::Failed));
        assert!(dead.backing_off());
        let skipped: Result<Option<String>, Missed> = dead.query(&get, Backoff::Respect).await;
        assert_eq!(skipped, Err(Missed::Skipped));
    }
}
