//! The servers the tests talk to: URLs from the environment, reaching them
//! (and starting one, once, when it does not answer), and what happens when
//! one stays unreachable.

use std::process::Command;
use std::sync::Once;
use std::time::Duration;

/// `IDEM_MYSQL_URL`, or the local MariaDB's `test` database.
pub fn mysql_url() -> String {
    std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// `IDEM_PG_URL`, or the local PostgreSQL's `test` database.
pub fn pg_url() -> String {
    std::env::var("IDEM_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// `IDEM_REDIS_URL`, or the local Redis.
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
    static RABBITMQ: Once = Once::new();
    static NATS: Once = Once::new();
    let (once, script) = match service {
        "mysql" => (
            &MYSQL,
            "command -v mariadbd >/dev/null && start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
        ),
        "postgres" => (
            &PG,
            "command -v pg_ctlcluster >/dev/null && pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
        ),
        "rabbitmq" => (&RABBITMQ, "command -v rabbitmq-server >/dev/null && rabbitmq-server -detached"),
        "nats" => (
            &NATS,
            "command -v nats-server >/dev/null && mkdir -p /var/lib/nats-server && start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server",
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

/// A client of the shared Redis (`IDEM_REDIS_URL`) that answered `PING`.
pub async fn redis_client() -> Option<redis::Client> {
    reach("redis", || async {
        let client = redis::Client::open(redis_url()).ok()?;
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        let pong: String = redis::cmd("PING").query_async(&mut conn).await.ok()?;
        (pong == "PONG").then_some(client)
    })
    .await
}
