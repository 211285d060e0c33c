//! What an HTTP caller is answered where issue 34 changed it, on axum with
//! MariaDB: a duplicate storm that waits (`wait = "5s"`) instead of 409s,
//! across two engine processes; a declared business error replayed with
//! the same status and body (a problem in the application's namespace),
//! plus `Idempotent-Replayed: true`; and a handler's database failure,
//! answered 500 and logged once, with its cause.
//!
//! The second process is this test binary again, running the same test
//! with `IDEM_HTTP_ANSWERS_SERVER` set: it serves and prints its address
//! (`listening <addr>`) until it is killed.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router, middleware};
use idempotency::http::{IdempotencyKey, Problem, replay_header};
use idempotency::{BusinessError, Idem, idempotent};
use idempotency_testkit::{mysql_url, reach, redis_client, unique};
use serde::{Deserialize, Serialize};
use sqlx::{MySql, Transaction};

const SERVER_ROLE: &str = "IDEM_HTTP_ANSWERS_SERVER";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Paid {
    key: String,
    /// Drawn by the body: two executions could never answer alike.
    nonce: String,
}

impl IntoResponse for Paid {
    fn into_response(self) -> Response {
        (StatusCode::OK, Json(self)).into_response()
    }
}

/// A card the processor declined: the answer, recorded and replayed.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Declined {
    reason: String,
    nonce: String,
}

#[derive(Debug)]
enum ApiError {
    Declined(Declined),
    Idem(idempotency::Error),
}

impl From<idempotency::Error> for ApiError {
    fn from(e: idempotency::Error) -> Self {
        ApiError::Idem(e)
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        ApiError::Idem(e.into())
    }
}

impl BusinessError for ApiError {
    type Record = Declined;
    fn recorded(&self) -> Option<Declined> {
        match self {
            ApiError::Declined(declined) => Some(declined.clone()),
            ApiError::Idem(_) => None,
        }
    }
    fn replayed(record: Declined) -> Self {
        ApiError::Declined(record)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Declined(Declined { reason, nonce }) => {
                let detail = format!("{reason} ({nonce})");
                let title = "Payment declined";
                Problem {
                    status: StatusCode::PAYMENT_REQUIRED,
                    code: "PAYMENT_DECLINED",
                    title,
                    detail,
                    retry_after: None,
                }
                .with_type("https://shop.example/problems/payment-declined")
                .into_response()
            }
            ApiError::Idem(e) => e.into_response(),
        }
    }
}

#[derive(Clone)]
struct App {
    idem: Idem<MySql>,
    /// Requests to `/pay` that reached this server.
    entered: Arc<AtomicUsize>,
    /// `pay`'s body holds until this turns true (`POST /release`): every
    /// duplicate meets it running.
    release: Arc<tokio::sync::watch::Sender<bool>>,
}

fn nonce() -> String {
    format!("{:x}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos())
}

#[idempotent(key = "<idem_key>", ttl = "1h", biz = "http_storm", engine = app.idem, wait = "5s")]
async fn pay(
    State(app): State<App>,
    tx: &mut Transaction<'_, MySql>,
    IdempotencyKey(idem_key): IdempotencyKey,
) -> Result<Paid, ApiError> {
    sqlx::query("INSERT INTO idem_test_ledger (k, amount) VALUES (?, 1)").bind(&idem_key).execute(&mut **tx).await?;
    let _ = app.release.subscribe().wait_for(|released| *released).await;
    Ok(Paid { key: idem_key, nonce: nonce() })
}

/// Executions of `charge`'s body in this process.
static CHARGES: AtomicUsize = AtomicUsize::new(0);

#[idempotent(key = "<idem_key>", ttl = "1h", biz = "http_declined", engine = app.idem, record_errors)]
async fn charge(
    State(app): State<App>,
    tx: &mut Transaction<'_, MySql>,
    IdempotencyKey(idem_key): IdempotencyKey,
) -> Result<Paid, ApiError> {
    CHARGES.fetch_add(1, SeqCst);
    sqlx::query("INSERT INTO idem_test_ledger (k, amount) VALUES (?, 1)").bind(&idem_key).execute(&mut **tx).await?;
    Err(ApiError::Declined(Declined { reason: "insufficient funds".into(), nonce: nonce() }))
}

/// Inserts a column its table, made earlier in another shape, does not have.
#[idempotent(key = "<idem_key>", ttl = "1h", biz = "http_broken", engine = app.idem)]
async fn broken(
    State(app): State<App>,
    tx: &mut Transaction<'_, MySql>,
    IdempotencyKey(idem_key): IdempotencyKey,
) -> Result<Paid, ApiError> {
    sqlx::query("INSERT INTO idem_test_ledger (k, amount, user_id) VALUES (?, 1, 'alice')")
        .bind(&idem_key)
        .execute(&mut **tx)
        .await?;
    Ok(Paid { key: idem_key, nonce: nonce() })
}

async fn engine(redis: bool) -> Option<Idem<MySql>> {
    let pool = reach("mysql", || async {
        sqlx::mysql::MySqlPoolOptions::new().max_connections(32).connect(&mysql_url()).await.ok()
    })
    .await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS idem_test_ledger (id BIGINT AUTO_INCREMENT PRIMARY KEY, k VARCHAR(300) NOT NULL, amount BIGINT NOT NULL, KEY (k))",
    )
    .execute(&pool)
    .await
    .expect("ledger");
    let builder = Idem::builder(pool);
    let idem = if redis { builder.redis(redis_client().await?).build() } else { builder.build() };
    idem.migrate().await.expect("migrate");
    Some(idem)
}

async fn serve(idem: Idem<MySql>) -> String {
    let app = App { idem, entered: Arc::default(), release: Arc::new(tokio::sync::watch::Sender::new(false)) };
    let entered = app.entered.clone();
    let router = Router::new()
        .route(
            "/pay",
            post(pay).layer(middleware::from_fn(move |request: axum::extract::Request, next: middleware::Next| {
                entered.fetch_add(1, SeqCst);
                next.run(request)
            })),
        )
        .route("/charge", post(charge))
        .route("/entered", get(|State(app): State<App>| async move { app.entered.load(SeqCst).to_string() }))
        .route(
            "/release",
            post(|State(app): State<App>| async move {
                app.release.send_replace(true);
            }),
        )
        .layer(middleware::from_fn(replay_header))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    format!("http://{addr}")
}

/// The other engine process: this binary, serving until killed.
struct OtherProcess {
    child: std::process::Child,
    base: String,
}

impl OtherProcess {
    fn start(test: &str, redis: bool) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(SERVER_ROLE, if redis { "redis" } else { "database" })
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the other process");
        let stdout = child.stdout.take().expect("its stdout");
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
        let base = loop {
            let line = lines.next().expect("the other process ended before it listened").expect("a line");
            // libtest prints the test's name on the same line first.
            if let Some((_, base)) = line.split_once("listening ") {
                break base.trim().to_owned();
            }
        };
        OtherProcess { child, base }
    }
}

impl Drop for OtherProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// In the other process: serve, say where, and stay until killed.
async fn serve_until_killed(role: &str) {
    let Some(idem) = engine(role == "redis").await else { panic!("the other process found no servers") };
    let base = serve(idem).await;
    println!("listening {base}");
    std::future::pending::<()>().await;
}

/// 100 identical requests at once, half to each of two engine processes,
/// against a body held until all 100 have reached their server, with a 5 s
/// wait: 100 × 200, identical bodies, one execution. Without the wait,
/// every duplicate that met the running call in Redis is answered 409
/// (without Redis, duplicates wait on the record's unique index anyway).
async fn storm(test: &str, redis: bool) {
    const REQUESTS: usize = 100;
    if let Ok(role) = std::env::var(SERVER_ROLE) {
        return serve_until_killed(&role).await;
    }
    let Some(idem) = engine(redis).await else { return };
    let here = serve(idem.clone()).await;
    let other = OtherProcess::start(test, redis);
    let client = reqwest::Client::new();
    let key = unique("storm-key");
    let barrier = Arc::new(tokio::sync::Barrier::new(REQUESTS));
    let requests: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let base = if i % 2 == 0 { here.clone() } else { other.base.clone() };
            let (client, key, barrier) = (client.clone(), key.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let response =
                    client.post(format!("{base}/pay")).header("Idempotency-Key", &key).send().await.expect("answered");
                (response.status().as_u16(), response.text().await.expect("a body"))
            })
        })
        .collect();
    let bases = [here, other.base.clone()];
    let started = std::time::Instant::now();
    loop {
        let mut entered = 0;
        for base in &bases {
            let count = client.get(format!("{base}/entered")).send().await.expect("entered").text().await.unwrap();
            entered += count.parse::<usize>().expect("a count");
        }
        if entered == REQUESTS {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "{entered} of {REQUESTS} requests arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for base in &bases {
        client.post(format!("{base}/release")).send().await.expect("released");
    }
    let mut answers = Vec::new();
    for request in requests {
        answers.push(tokio::time::timeout(Duration::from_secs(60), request).await.expect("no hang").unwrap());
    }
    let statuses: Vec<u16> = answers.iter().map(|(status, _)| *status).collect();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert!(answers.iter().all(|(_, body)| *body == answers[0].1), "{answers:?}");
    let executions: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_test_ledger WHERE k = ?")
        .bind(&key)
        .fetch_one(idem.pool())
        .await
        .unwrap();
    assert_eq!(executions, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_storm_of_100_waits_for_one_execution_across_two_processes() {
    storm("http_answers::a_storm_of_100_waits_for_one_execution_across_two_processes", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_storm_of_100_waits_for_one_execution_across_two_processes_with_redis() {
    storm("http_answers::a_storm_of_100_waits_for_one_execution_across_two_processes_with_redis", true).await;
}

/// A declined charge answers 402 with its body; the same request again gets
/// the same status and the same bytes, marked `Idempotent-Replayed: true`,
/// and the body ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_error_replays_with_its_status_and_body() {
    for redis in [false, true] {
        let Some(idem) = engine(redis).await else { return };
        let charges = CHARGES.load(SeqCst);
        let base = serve(idem.clone()).await;
        let client = reqwest::Client::new();
        let key = unique("declined-key");
        let mut answers = Vec::new();
        for _ in 0..3 {
            let response = client.post(format!("{base}/charge")).header("Idempotency-Key", &key).send().await.unwrap();
            let replayed = response.headers().get("idempotent-replayed").map(|v| v.to_str().unwrap().to_owned());
            let kind =
                response.headers().get("content-type").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
            answers.push((response.status().as_u16(), replayed, response.text().await.unwrap(), kind));
        }
        assert_eq!((answers[0].0, answers[0].1.as_deref(), answers[0].3.as_str()), (402, None, PROBLEM), "{answers:?}");
        // The application's own problem type, not the crate's `urn:idem:problem:`.
        let detail = answers[0].2.split(r#""detail":""#).nth(1).and_then(|d| d.strip_suffix(r#""}"#)).unwrap_or("");
        assert!(detail.starts_with("insufficient funds ("), "{answers:?}");
        let expected = format!(
            r#"{{"type":"https://shop.example/problems/payment-declined","title":"Payment declined","status":402,"code":"PAYMENT_DECLINED","detail":"{detail}"}}"#
        );
        assert_eq!(answers[0].2, expected);
        for again in &answers[1..] {
            assert_eq!(
                (again.0, again.1.as_deref(), &again.2, again.3.as_str()),
                (402, Some("true"), &answers[0].2, PROBLEM),
                "{answers:?}"
            );
        }
        let executions: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_test_ledger WHERE k = ?")
            .bind(&key)
            .fetch_one(idem.pool())
            .await
            .unwrap();
        assert_eq!(executions, 0, "the body's write rolled back, redis: {redis}");
        assert_eq!(CHARGES.load(SeqCst), charges + 1, "the body ran once, redis: {redis}");
    }
}

const PROBLEM: &str = "application/problem+json";

/// A handler whose insert meets a table of another shape answers 500
/// `IDEMPOTENCY_STORAGE_REFUSED`, and its cause is logged once: by the call
/// (`biz`, the SQLSTATE, the database's message), not again by the
/// response, and without the key. Called as axum calls it, on this thread.
#[tokio::test(flavor = "current_thread")]
async fn a_handlers_database_failure_is_logged_once_with_its_cause() {
    let Some(idem) = engine(false).await else { return };
    let app = App { idem, entered: Arc::default(), release: Arc::new(tokio::sync::watch::Sender::new(false)) };
    let key = unique("broken-key");
    let logs = idempotency_testkit::logs::Logs::default();
    let response = {
        let _guard = tracing::subscriber::set_default(logs.clone());
        broken(State(app), IdempotencyKey(key.clone())).await.into_response()
    };
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
    assert!(String::from_utf8_lossy(&body).contains(r#""code":"IDEMPOTENCY_STORAGE_REFUSED""#), "{body:?}");
    assert!(!String::from_utf8_lossy(&body).contains("user_id"), "the cause stays out of the answer");

    let lines = logs.lines();
    let failed: Vec<_> = lines.iter().filter(|line| line.level <= tracing::Level::WARN).collect();
    assert_eq!(failed.len(), 1, "{lines:?}");
    let line = failed[0];
    assert_eq!(line.level, tracing::Level::ERROR);
    assert_eq!(
        line.field("message"),
        "idempotent call failed on the database; the caller is told not to retry",
        "{line:?}"
    );
    assert_eq!((line.field("biz"), line.field("by"), line.field("code")), ("http_broken", "body", "42S22"));
    assert!(line.field("error").contains("1054 (42S22): Unknown column 'user_id'"), "{line:?}");
    assert!(!line.text().contains(&key), "{line:?}");
}
