//! What the Redis gate's unit tests share: the test Redis, and a server
//! that accepts connections and never answers.

/// The test Redis's URL (`IDEM_REDIS_URL`, else the local one).
pub(super) fn redis_url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A client of the test Redis, or `None` (skipped) when none answers,
/// unless `IDEM_REQUIRE_SERVICES` is set.
pub(super) async fn test_client() -> Option<redis::Client> {
    let client = redis::Client::open(redis_url()).expect("redis url");
    if let Err(e) = client.get_multiplexed_async_connection().await {
        assert!(std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(), "redis unreachable: {e}");
        eprintln!("skipped: redis unreachable ({e})");
        return None;
    }
    Some(client)
}

/// A Redis black-holed: it accepts connections and never answers. A client
/// of it, and the task holding its connections (abort it when done).
pub(super) async fn black_hole() -> (redis::Client, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let hole = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket); // read nothing, answer nothing
        }
    });
    (redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("client"), hole)
}
