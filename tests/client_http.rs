//! The client half against a real server of this crate: `idempotency-client`
//! paying through the HTTP example (`examples/http.rs` and its business
//! part `examples/shop/`, run as the process a user runs) on a MariaDB
//! database of its own. The test stands between the three with two
//! forwarders (`idempotency_testkit::forwarder`): `front` between the
//! client and the server, which loses answers; `db` between the server and
//! MariaDB, which takes the database down. Each case counts what ran: the
//! `payments` rows (one per execution of the body) and the committed
//! `idem_record` rows, exactly.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_client::{Failure, GaveUp, IdempotencyMiddleware, Outcome, Retries, Retrying, Stop, new_key};
use idempotency_testkit::example::Example;
use idempotency_testkit::forwarder::{Forwarder, Hold};
use reqwest_middleware::ClientWithMiddleware;
use sqlx::MySqlPool;
use tokio::time::Instant;

/// The example server on a database of its own, and the two forwarders.
struct Shop {
    _server: Example,
    server_port: u16,
    front: Forwarder,
    db: Arc<Forwarder>,
    mysql_port: u16,
    /// The test's own view of the shop's database.
    pool: MySqlPool,
    admin: MySqlPool,
    database: String,
}

impl Shop {
    async fn open() -> Option<Shop> {
        Shop::open_with(None).await
    }

    /// With the Redis claim: a duplicate of a running call is told 409 at
    /// once (without it, it waits for the running call up to the engine's
    /// 5 s first).
    async fn open_with_redis() -> Option<Shop> {
        if idempotency_testkit::redis_client().await.is_none() {
            idempotency_testkit::skip("redis");
            return None;
        }
        Shop::open_with(Some(&idempotency_testkit::redis_url())).await
    }

    async fn open_with(redis: Option<&str>) -> Option<Shop> {
        let url = idempotency_testkit::mysql_url();
        let connect = || async { MySqlPool::connect(&url).await.ok() };
        let Some(admin) = idempotency_testkit::reach("mysql", connect).await else {
            idempotency_testkit::skip("mysql");
            return None;
        };
        let (server, _) = url.rsplit_once('/').expect("a database in the URL");
        let mysql_port = server.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).unwrap_or(3306);
        let database = idempotency_testkit::unique("idem_client").replace('-', "_");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&admin)
            .await
            .expect("a database");
        let db = Arc::new(Forwarder::start(mysql_port).await);
        let through_db = server.replace(&format!(":{mysql_port}"), &format!(":{}", db.port()));
        let example_url = format!("{through_db}/{database}");
        let features = idempotency_testkit::facade_features!();
        let mut env = vec![("IDEM_HTTP_ADDR", "127.0.0.1:0"), ("IDEM_MYSQL_URL", example_url.as_str())];
        env.extend(redis.map(|url| ("IDEM_REDIS_URL", url)));
        let (example, listening) =
            Example::start("http", &["examples/http.rs", "examples/shop"], &features, &env, "listening on http://")
                .await;
        let addr = listening.split_whitespace().next().expect("an address");
        let server_port = addr.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).expect("a port");
        let front = Forwarder::start(server_port).await;
        let pool = MySqlPool::connect(&format!("{server}/{database}")).await.expect("the shop's database");
        Some(Shop { _server: example, server_port, front, db, mysql_port, pool, admin, database })
    }

    fn pay_url(&self, order: i64) -> String {
        format!("http://127.0.0.1:{}/orders/{order}/pay", self.front.port())
    }

    /// Executions of the payment: its `payments` rows.
    async fn payments(&self, order: i64) -> i64 {
        let sql = "SELECT COUNT(*) FROM payments WHERE order_id = ?";
        sqlx::query_scalar(sql).bind(order).fetch_one(&self.pool).await.expect(sql)
    }

    async fn payment_id(&self, order: i64) -> i64 {
        let sql = "SELECT id FROM payments WHERE order_id = ?";
        sqlx::query_scalar(sql).bind(order).fetch_one(&self.pool).await.expect(sql)
    }

    /// The committed records' keys (`<user>:<Idempotency-Key>`).
    async fn records(&self) -> Vec<String> {
        let sql = "SELECT idem_key FROM idem_record WHERE biz_type = 'http_pay' AND status = 1 ORDER BY id";
        sqlx::query_scalar(sql).fetch_all(&self.pool).await.expect(sql)
    }

    async fn close(self) {
        let Shop { _server, pool, admin, database, .. } = self;
        drop(_server);
        pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {database}"))).execute(&admin).await.expect("dropped");
    }
}

/// The retries the hook told of: (attempt, answered, wait, when).
type Told = Arc<Mutex<Vec<(u32, Option<u16>, Duration, Instant)>>>;

fn client(retries: Retries, told: &Told, also: impl Fn(&Retrying<'_>) + Send + Sync + 'static) -> ClientWithMiddleware {
    let told = Arc::clone(told);
    let middleware = IdempotencyMiddleware::new(retries).on_retry(move |retrying| {
        told.lock().unwrap().push((retrying.attempt, retrying.answered, retrying.wait, Instant::now()));
        also(retrying);
    });
    reqwest_middleware::ClientBuilder::new(reqwest::Client::new()).with(middleware).build()
}

/// One payment request as the example takes it.
fn pay(client: &ClientWithMiddleware, url: String, user: &str, amount: i64) -> reqwest_middleware::RequestBuilder {
    client
        .post(url)
        .header("X-User-Id", user)
        .header("Content-Type", "application/json")
        .body(format!(r#"{{"amount":{amount}}}"#))
}

/// The answer's status, outcome and body.
async fn read(response: reqwest::Response) -> (u16, Outcome, serde_json::Value) {
    let outcome = Outcome::of(&response).expect("a keyed request").clone();
    let status = response.status().as_u16();
    let body = response.bytes().await.expect("a body");
    let body = serde_json::from_slice(&body).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&body)));
    (status, outcome, body)
}

/// Bounds a wait for an event: a hang fails the test instead.
async fn within<T>(what: &str, event: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), event).await.unwrap_or_else(|_| panic!("{what} did not happen"))
}

/// The answer lost after the server committed: the client sees the
/// connection cut, asks again with the same key, and is answered with the
/// replay, told so. One payment, one record.
#[tokio::test]
async fn an_answer_lost_after_the_commit_is_replayed() {
    let Some(shop) = Shop::open().await else { return };
    let told = Told::default();
    let client = client(Retries::default(), &told, |_| {});
    let mut answered = shop.front.held_replies();
    shop.front.hold(Hold::Replies);
    let paying = tokio::spawn(pay(&client, shop.pay_url(42), "alice", 1999).send());
    within("the server's answer", answered.wait_for(|bytes| *bytes > 0)).await.unwrap();
    assert_eq!((shop.payments(42).await, shop.records().await.len()), (1, 1), "committed before it answered");
    shop.front.switch(shop.server_port); // the held answer's connection cut; new ones flow
    let response = within("the retry", paying).await.unwrap().expect("answered");
    let (status, outcome, body) = read(response).await;
    assert_eq!((status, outcome.attempts, outcome.replayed, outcome.stop), (200, 2, true, Stop::Final));
    assert_eq!(body["payment_id"], shop.payment_id(42).await);
    assert_eq!(body["amount"], 1999);
    let told = told.lock().unwrap().clone();
    assert_eq!(told.iter().map(|t| (t.0, t.1)).collect::<Vec<_>>(), [(1, None)], "one retry, after no answer");
    assert_eq!(shop.payments(42).await, 1);
    assert_eq!(shop.records().await, [format!("alice:{}", outcome.key)]);
    shop.close().await;
}

/// A duplicate sent while the first runs (the same logical request from two
/// places: one key): 409 with `Retry-After: 1`, waited out, then the first
/// call's answer, replayed. The first is held in its body by a row lock the
/// test takes on the order; the server claims keys in Redis, so the
/// duplicate is told at once.
#[tokio::test]
async fn a_duplicate_while_the_first_runs_waits_then_gets_the_first_answer() {
    let Some(shop) = Shop::open_with_redis().await else { return };
    let mut lock = shop.pool.begin().await.unwrap();
    sqlx::query("SELECT status FROM orders WHERE id = 43 FOR UPDATE").execute(&mut *lock).await.unwrap();
    let told = Told::default();
    let (conflict, mut conflicted) = tokio::sync::mpsc::unbounded_channel();
    let client = client(Retries::default(), &told, move |retrying| {
        let _ = conflict.send(retrying.answered);
    });
    let key = new_key();
    let send = || {
        let request = pay(&client, shop.pay_url(43), "alice", 1999).header("Idempotency-Key", &key).send();
        tokio::spawn(async move {
            let response = request.await.expect("answered");
            (read(response).await, Instant::now())
        })
    };
    let (first, second) = (send(), send());
    assert_eq!(within("a 409", conflicted.recv()).await, Some(Some(409)), "the duplicate is told to come back");
    lock.commit().await.unwrap(); // the first call's body goes on
    let (first, second) = (within("the first", first).await.unwrap(), within("the second", second).await.unwrap());
    let mut answers = [first, second];
    answers.sort_by_key(|((_, outcome, _), _)| outcome.attempts);
    let [((status, ran, body), _), ((dup_status, waited, dup_body), done)] = answers;
    assert_eq!((status, ran.attempts, ran.replayed), (200, 1, false));
    assert_eq!((dup_status, waited.replayed, waited.key.as_str()), (200, true, key.as_str()));
    assert!(waited.attempts >= 2, "{waited:?}");
    assert_eq!(body, dup_body, "the first call's answer");
    let told = told.lock().unwrap().clone();
    let (attempt, answered, wait, at) = told[0];
    assert_eq!((attempt, answered), (1, Some(409)));
    assert!(wait >= Duration::from_secs(1) && done - at >= wait, "Retry-After honoured: {wait:?}, {:?}", done - at);
    assert_eq!((shop.payments(43).await, shop.records().await.len()), (1, 1));
    shop.close().await;
}

/// The database down, then back: 503 `IDEMPOTENCY_STORAGE_UNAVAILABLE`,
/// asked again after its `Retry-After` until it commits, once. The
/// database comes back when the client is told of the 503, before it waits.
#[tokio::test]
async fn the_database_down_then_back_commits_once() {
    let Some(shop) = Shop::open().await else { return };
    shop.db.cut();
    let told = Told::default();
    let (db, mysql) = (Arc::clone(&shop.db), shop.mysql_port);
    let client = client(Retries::default(), &told, move |retrying| {
        if retrying.answered == Some(503) {
            db.switch(mysql);
        }
    });
    let response = within("the payment", pay(&client, shop.pay_url(44), "alice", 1999).send()).await.unwrap();
    let (status, outcome, body) = read(response).await;
    assert_eq!((status, outcome.attempts, outcome.replayed), (200, 2, false));
    assert_eq!(body["payment_id"], shop.payment_id(44).await);
    let told = told.lock().unwrap().clone();
    assert_eq!((told.len(), told[0].0, told[0].1), (1, 1, Some(503)));
    assert!(told[0].2 >= Duration::from_secs(1), "after Retry-After: {:?}", told[0].2);
    assert_eq!((shop.payments(44).await, shop.records().await.len()), (1, 1));
    shop.close().await;
}

/// Answers a retry cannot change come back at once, after one attempt:
/// 422 `IDEMPOTENCY_KEY_REUSED`, 400 `INVALID_PRINCIPAL`, 401, 404, the
/// shop's own 409 `ORDER_ALREADY_PAID` (no `Retry-After`, and
/// `Idempotency-Should-Retry: false`), and 500 `IDEMPOTENCY_NOT_MIGRATED`;
/// a caller's key that breaks the rule is refused before anything is sent.
#[tokio::test]
async fn refusals_come_back_at_once() {
    let Some(shop) = Shop::open().await else { return };
    let told = Told::default();
    let client = client(Retries::default(), &told, |_| {});
    let key = new_key();
    let first = pay(&client, shop.pay_url(45), "alice", 1999).header("Idempotency-Key", &key).send().await.unwrap();
    assert_eq!(first.status(), 200);
    let cases = [
        (pay(&client, shop.pay_url(45), "alice", 5).header("Idempotency-Key", &key), 422, "IDEMPOTENCY_KEY_REUSED"),
        (pay(&client, shop.pay_url(45), "alice:x", 1999), 400, "INVALID_PRINCIPAL"),
        (client.post(shop.pay_url(45)).header("Content-Type", "application/json").body("{}"), 401, "UNAUTHENTICATED"),
        (pay(&client, shop.pay_url(10_001), "alice", 1999), 404, "ORDER_NOT_FOUND"),
        (pay(&client, shop.pay_url(45), "bob", 1999), 409, "ORDER_ALREADY_PAID"),
    ];
    for (request, status, code) in cases {
        let response = request.send().await.expect("answered");
        let retry = response.headers().get("idempotency-should-retry").map(|v| v.to_str().unwrap().to_owned());
        let (got, outcome, body) = read(response).await;
        assert_eq!((got, body["code"].as_str(), outcome.attempts, outcome.stop), (status, Some(code), 1, Stop::Final));
        if code.starts_with("IDEMPOTENCY") || code == "INVALID_PRINCIPAL" || code == "ORDER_ALREADY_PAID" {
            assert_eq!(retry.as_deref(), Some("false"), "{code}");
        }
    }
    let refused = pay(&client, shop.pay_url(46), "alice", 1999).header("Idempotency-Key", "short").send().await;
    let Err(reqwest_middleware::Error::Middleware(error)) = refused else { panic!("{refused:?}") };
    assert!(error.downcast_ref::<idempotency_client::InvalidKey>().is_some(), "{error}");
    sqlx::raw_sql("DROP TABLE idem_record").execute(&shop.pool).await.unwrap();
    let response = pay(&client, shop.pay_url(46), "alice", 1999).send().await.unwrap();
    let (status, outcome, body) = read(response).await;
    assert_eq!((status, body["code"].as_str(), outcome.attempts), (500, Some("IDEMPOTENCY_NOT_MIGRATED"), 1));
    assert!(told.lock().unwrap().is_empty(), "nothing was asked again");
    assert_eq!((shop.payments(45).await, shop.payments(46).await), (1, 0));
    shop.close().await;
}

/// With the database down for good: the attempts stop at their count, or
/// at their total time, and the last answer (503) is handed back; an
/// answer that never comes is given up at the total, with the key. Nothing
/// is written.
#[tokio::test]
async fn attempts_stop_at_their_count_and_their_time() {
    let Some(shop) = Shop::open().await else { return };
    shop.db.cut();
    let told = Told::default();
    let by_count = client(Retries::default().max_attempts(3), &told, |_| {});
    let response = within("three attempts", pay(&by_count, shop.pay_url(47), "alice", 1999).send()).await.unwrap();
    let (status, outcome, body) = read(response).await;
    assert_eq!((status, body["code"].as_str()), (503, Some("IDEMPOTENCY_STORAGE_UNAVAILABLE")));
    assert_eq!((outcome.attempts, outcome.stop), (3, Stop::Attempts));
    assert_eq!(told.lock().unwrap().len(), 2);

    let total = Duration::from_secs(2);
    let by_time = client(Retries::default().total(total), &Told::default(), |_| {});
    let started = Instant::now();
    let response = within("the total", pay(&by_time, shop.pay_url(47), "alice", 1999).send()).await.unwrap();
    let elapsed = started.elapsed();
    let (status, outcome, _) = read(response).await;
    assert_eq!((status, outcome.stop), (503, Stop::Time));
    assert!((1..=2).contains(&outcome.attempts) && elapsed < total, "{outcome:?} in {elapsed:?}");

    shop.front.hold(Hold::Everything);
    let started = Instant::now();
    let error = within("the total", pay(&by_time, shop.pay_url(47), "alice", 1999).send()).await.unwrap_err();
    let gave_up = GaveUp::of(&error).expect("a GaveUp");
    assert_eq!((gave_up.attempts, gave_up.stop), (1, Stop::Time));
    assert!(matches!(gave_up.last, Failure::TimedOut(t) if t == total), "{gave_up}");
    assert!(started.elapsed() >= total);
    // Cut, not released: the held request must never reach the server now.
    shop.front.switch(shop.server_port);
    assert_eq!((shop.payments(47).await, shop.records().await.len()), (0, 0));
    shop.close().await;
}

/// Two logical requests never share a key, even the same payment sent
/// twice: each gets its own record; the second payment of one order is
/// answered by the order's own state (layer 4) with the caller's payment,
/// run but writing no second payment.
#[tokio::test]
async fn logical_requests_never_share_a_key() {
    let Some(shop) = Shop::open().await else { return };
    let client = client(Retries::default(), &Told::default(), |_| {});
    let mut keys = Vec::new();
    for order in [48, 49, 49] {
        let response = pay(&client, shop.pay_url(order), "alice", 1999).send().await.unwrap();
        let (status, outcome, body) = read(response).await;
        assert_eq!((status, outcome.attempts, outcome.replayed), (200, 1, false));
        assert_eq!(body["payment_id"], shop.payment_id(order).await);
        keys.push(format!("alice:{}", outcome.key));
    }
    assert_eq!(shop.records().await, keys);
    assert_eq!(keys.iter().collect::<std::collections::HashSet<_>>().len(), 3);
    assert_eq!((shop.payments(48).await, shop.payments(49).await), (1, 1));
    shop.close().await;
}

/// What the restarting client process runs (`IDEM_CLIENT_CHILD` =
/// `<url> <key>`): one payment with that key, then its answer on one line.
async fn child_pays(task: &str) {
    let (url, key) = task.split_once(' ').expect("<url> <key>");
    let client = client(Retries::default(), &Told::default(), |_| {});
    let response = pay(&client, url.to_owned(), "alice", 1999).header("Idempotency-Key", key).send().await.unwrap();
    let (status, outcome, body) = read(response).await;
    println!("answered {status} {} {} {body}", outcome.attempts, outcome.replayed);
}

/// A key of the caller's own (stored with the order) kept across a client
/// restart: the first client process is killed (SIGKILL) after the server
/// committed and before the answer reached it; a new process sends the
/// same key and is answered with the replay. One payment, one record.
#[tokio::test]
async fn a_callers_key_is_kept_across_a_client_restart() {
    const TEST: &str = "a_callers_key_is_kept_across_a_client_restart";
    if let Ok(task) = std::env::var("IDEM_CLIENT_CHILD") {
        return child_pays(&task).await;
    }
    let Some(shop) = Shop::open().await else { return };
    let key = new_key();
    let task = format!("{} {key}", shop.pay_url(50));
    let client_process = || {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env("IDEM_CLIENT_CHILD", &task)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("a client process")
    };
    let mut answered = shop.front.held_replies();
    shop.front.hold(Hold::Replies);
    let mut first = client_process();
    within("the server's answer", answered.wait_for(|bytes| *bytes > 0)).await.unwrap();
    first.kill().expect("SIGKILL");
    first.wait().unwrap();
    assert_eq!((shop.payments(50).await, shop.records().await.len()), (1, 1));
    shop.front.switch(shop.server_port);
    // Waited for off the runtime's thread, which serves the forwarders.
    let second = client_process();
    let second = within("the second client", tokio::task::spawn_blocking(|| second.wait_with_output())).await;
    let second = second.unwrap().expect("its output");
    let output = String::from_utf8_lossy(&second.stdout);
    let line = output.lines().find_map(|l| l.split_once("answered ").map(|(_, a)| a)).expect(&output);
    let payment = shop.payment_id(50).await;
    assert!(line.starts_with("200 1 true {"), "one attempt, a replay: {line}");
    assert!(line.contains(&format!("\"payment_id\":{payment}")), "{line}");
    assert_eq!(shop.payments(50).await, 1);
    assert_eq!(shop.records().await, [format!("alice:{key}")]);
    shop.close().await;
}

/// The guide's example (`examples/client.rs`, both halves in one process
/// and a network that loses the first answer) pays twice and charges
/// once, as docs/client.md shows it.
#[tokio::test]
async fn the_guides_example_pays_twice_and_charges_once() {
    let printed = Example::run("client", &["examples/client.rs"], &idempotency_testkit::facade_features!(), &[]).await;
    let lines: Vec<&str> = printed.lines().collect();
    let receipt = r#"200 {"order_id":42,"amount":1999,"payment_id":1}"#;
    assert_eq!(
        lines,
        [
            format!("pay:       {receipt} after 2 attempts, replayed: true (the first answer was lost)"),
            format!("pay again: {receipt} after 1 attempt, replayed: true"),
            "charges:   1".to_owned(),
        ]
    );
}

/// The client's header names are the server's.
#[test]
fn both_halves_name_the_headers_alike() {
    use idempotency::http::header;
    use idempotency_client::header as client;
    assert_eq!(
        [client::IDEMPOTENCY_KEY, client::IDEMPOTENT_REPLAYED, client::REPLAYED, client::SHOULD_RETRY],
        [header::IDEMPOTENCY_KEY, header::IDEMPOTENT_REPLAYED, header::REPLAYED, header::SHOULD_RETRY]
    );
}
