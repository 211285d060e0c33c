//! End to end over HTTP: an axum app with an `#[idempotent]` handler, bound to
//! an ephemeral port, driven by a real client (reqwest). MariaDB with and
//! without Redis, and SQLite without Redis.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router, middleware};
use idem::http::{IdempotencyKey, replay_header};
use idem::{Idem, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::Transaction;
use tokio::sync::Barrier;

#[derive(Debug, Serialize, Deserialize)]
struct PayReq {
    amount: i64,
}

#[derive(Debug, Serialize, Deserialize)]
struct PayResponse {
    order_id: i64,
    user: String,
    amount: i64,
    payment_id: i64,
}

impl IntoResponse for PayResponse {
    fn into_response(self) -> Response {
        (StatusCode::OK, Json(self)).into_response()
    }
}

#[derive(Debug)]
enum ApiError {
    Idem(idem::Error),
    NotPayable,
}

impl From<idem::Error> for ApiError {
    fn from(e: idem::Error) -> Self {
        ApiError::Idem(e)
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        ApiError::Idem(e.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Idem(e) => e.into_response(),
            ApiError::NotPayable => {
                let mut r = (StatusCode::CONFLICT, r#"{"code":"ORDER_NOT_PAYABLE"}"#).into_response();
                r.headers_mut().insert("content-type", HeaderValue::from_static("application/problem+json"));
                r
            }
        }
    }
}

struct UserId(String);

impl<S: Send + Sync> FromRequestParts<S> for UserId {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, StatusCode> {
        let user = parts.headers.get("x-user-id").and_then(|v| v.to_str().ok()).unwrap_or_default();
        let valid = !user.is_empty() && user.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if valid { Ok(UserId(user.to_owned())) } else { Err(StatusCode::UNAUTHORIZED) }
    }
}

macro_rules! pay_service {
    ($module:ident, $db:ty) => {
        mod $module {
            use super::*;

            #[derive(Clone)]
            pub struct App {
                pub idem: Idem<$db>,
            }

            #[idempotent(key = "<user>:<idem_key>", ttl = "1h", biz = "http_test_pay", engine = app.idem)]
            async fn pay(
                State(app): State<App>,
                tx: &mut Transaction<'_, $db>,
                UserId(user): UserId,
                IdempotencyKey(idem_key): IdempotencyKey,
                Path(order_id): Path<i64>,
                Json(req): Json<PayReq>,
            ) -> Result<PayResponse, ApiError> {
                let paid = sqlx::query("UPDATE http_orders SET status = 'PAID' WHERE id = ? AND status = 'PENDING'")
                    .bind(order_id)
                    .execute(&mut **tx)
                    .await?;
                if paid.rows_affected() == 0 {
                    return Err(ApiError::NotPayable);
                }
                // Long enough for duplicates to arrive while it runs.
                tokio::time::sleep(Duration::from_millis(200)).await;
                sqlx::query("INSERT INTO http_payments (order_id, user_id, amount) VALUES (?, ?, ?)")
                    .bind(order_id)
                    .bind(&user)
                    .bind(req.amount)
                    .execute(&mut **tx)
                    .await?;
                let payment_id: i64 = sqlx::query_scalar("SELECT MAX(id) FROM http_payments WHERE order_id = ?")
                    .bind(order_id)
                    .fetch_one(&mut **tx)
                    .await?;
                Ok(PayResponse { order_id, user, amount: req.amount, payment_id })
            }

            pub fn router(idem: Idem<$db>) -> Router {
                Router::new()
                    .route("/orders/{id}/pay", post(pay))
                    .layer(middleware::from_fn(replay_header))
                    .with_state(App { idem })
            }
        }
    };
}

pay_service!(on_mysql, sqlx::MySql);
pay_service!(on_sqlite, sqlx::Sqlite);

/// The database behind a running app, for the assertions.
#[derive(Clone)]
enum Db {
    My(sqlx::MySqlPool),
    Lite(sqlx::SqlitePool),
}

impl Db {
    async fn scalar(&self, sql: &'static str, bind: &str) -> i64 {
        match self {
            Db::My(pool) => sqlx::query_scalar(sql).bind(bind).fetch_one(pool).await,
            Db::Lite(pool) => sqlx::query_scalar(sql).bind(bind).fetch_one(pool).await,
        }
        .expect(sql)
    }

    async fn scalar_by_id(&self, sql: &'static str, bind: i64) -> i64 {
        match self {
            Db::My(pool) => sqlx::query_scalar(sql).bind(bind).fetch_one(pool).await,
            Db::Lite(pool) => sqlx::query_scalar(sql).bind(bind).fetch_one(pool).await,
        }
        .expect(sql)
    }

    /// A new `PENDING` order; ids come from the table, so runs never collide.
    async fn new_order(&self) -> i64 {
        const SQL: &str = "INSERT INTO http_orders (status) VALUES ('PENDING')";
        match self {
            Db::My(pool) => {
                let id = sqlx::query(SQL).execute(pool).await.expect(SQL).last_insert_id();
                i64::try_from(id).unwrap()
            }
            Db::Lite(pool) => sqlx::query(SQL).execute(pool).await.expect(SQL).last_insert_rowid(),
        }
    }

    async fn ledger_rows(&self, order_id: i64) -> i64 {
        self.scalar_by_id("SELECT COUNT(*) FROM http_payments WHERE order_id = ?", order_id).await
    }

    async fn ledger_rows_of(&self, user: &str) -> i64 {
        self.scalar("SELECT COUNT(*) FROM http_payments WHERE user_id = ?", user).await
    }

    /// `idem_record` rows of this test's action whose key starts with `user:`
    /// (users are alphanumeric, so `LIKE` sees no wildcard in them).
    async fn records_of(&self, user: &str) -> i64 {
        let sql = match self {
            Db::My(_) => {
                "SELECT COUNT(*) FROM idem_record WHERE biz_type = 'http_test_pay' AND idem_key LIKE CONCAT(?, ':%')"
            }
            Db::Lite(_) => {
                "SELECT COUNT(*) FROM idem_record WHERE biz_type = 'http_test_pay' AND idem_key LIKE ? || ':%'"
            }
        };
        self.scalar(sql, user).await
    }
}

/// Serves `router` on an ephemeral port; returns its base URL.
async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    format!("http://{addr}")
}

async fn mysql_app(with_redis: bool) -> Option<(String, Db)> {
    let pool = common::reach("mysql", || async {
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(60))
            .connect(&common::mysql_url())
            .await
            .ok()
    })
    .await?;
    let mut builder = Idem::builder(pool.clone());
    if with_redis {
        builder = builder.redis(common::redis_client().await?);
    }
    let idem = builder.build();
    idem.migrate().await.expect("migrate");
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS http_orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, status VARCHAR(16) NOT NULL);
         CREATE TABLE IF NOT EXISTS http_payments (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BIGINT NOT NULL,
             user_id VARCHAR(100) NOT NULL, amount BIGINT NOT NULL, KEY (order_id), KEY (user_id));",
    )
    .execute(&pool)
    .await
    .expect("tables");
    Some((serve(on_mysql::router(idem)).await, Db::My(pool)))
}

async fn sqlite_app() -> (String, Db) {
    let dir = std::env::temp_dir().join("idem-tests");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.join(format!("{}.db", common::unique("http"))))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(options)
        .await
        .expect("sqlite file");
    let idem = Idem::new(pool.clone());
    idem.migrate().await.expect("migrate");
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS http_orders (id INTEGER PRIMARY KEY AUTOINCREMENT, status TEXT NOT NULL);
         CREATE TABLE IF NOT EXISTS http_payments (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id INTEGER NOT NULL,
             user_id TEXT NOT NULL, amount INTEGER NOT NULL);",
    )
    .execute(&pool)
    .await
    .expect("tables");
    (serve(on_sqlite::router(idem)).await, Db::Lite(pool))
}

/// One answer, read whole.
struct Answer {
    status: u16,
    replayed: Option<String>,
    retry_after: Option<String>,
    content_type: String,
    body: Vec<u8>,
}

impl Answer {
    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    fn code(&self) -> String {
        self.json()["code"].as_str().unwrap_or_default().to_owned()
    }
}

async fn send(
    client: &reqwest::Client,
    base: &str,
    order: i64,
    user: Option<&str>,
    key: Option<&str>,
    amount: i64,
) -> Answer {
    let mut request = client
        .post(format!("{base}/orders/{order}/pay"))
        .header("content-type", "application/json")
        .body(format!(r#"{{"amount":{amount}}}"#));
    if let Some(user) = user {
        request = request.header("x-user-id", user);
    }
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = request.send().await.expect("request");
    let header = |name: &str| response.headers().get(name).map(|v| v.to_str().unwrap().to_owned());
    let (status, replayed, retry_after) =
        (response.status().as_u16(), header("idempotent-replayed"), header("retry-after"));
    let content_type = header("content-type").unwrap_or_default();
    let body = response.bytes().await.expect("body").to_vec();
    Answer { status, replayed, retry_after, content_type, body }
}

/// Every behaviour of the table in DESIGN.md, over HTTP.
async fn scenario(base: &str, db: &Db) {
    let client = reqwest::Client::new();
    let user = common::unique("u").replace('-', "x");
    let key = common::unique("key");
    let order = db.new_order().await;

    // 50 identical requests released at once: one execution.
    let barrier = Arc::new(Barrier::new(50));
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let (client, base, user, key, barrier) =
            (client.clone(), base.to_owned(), user.clone(), key.clone(), Arc::clone(&barrier));
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            send(&client, &base, order, Some(&user), Some(&key), 1999).await
        }));
    }
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("task"));
    }
    assert_eq!(db.ledger_rows(order).await, 1, "exactly one payment");
    let ok: Vec<&Answer> = answers.iter().filter(|a| a.status == 200).collect();
    let busy: Vec<&Answer> = answers.iter().filter(|a| a.status == 409).collect();
    assert_eq!(
        ok.len() + busy.len(),
        50,
        "only 200 or 409: {:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    let first: Vec<&&Answer> = ok.iter().filter(|a| a.replayed.is_none()).collect();
    assert_eq!(first.len(), 1, "exactly one response executed (no replay header)");
    let body = first[0].body.clone();
    let paid = first[0].json();
    assert_eq!(
        (paid["order_id"].as_i64(), paid["user"].as_str(), paid["amount"].as_i64()),
        (Some(order), Some(&*user), Some(1999))
    );
    for a in &ok {
        assert_eq!(a.body, body, "every 200 carries the same body");
        assert!(a.replayed.is_none() || a.replayed.as_deref() == Some("true"));
    }
    for a in &busy {
        assert_eq!(a.code(), "IDEMPOTENCY_KEY_IN_PROGRESS");
        assert_eq!(a.content_type, "application/problem+json");
        assert_eq!(a.retry_after.as_deref(), Some("1"));
    }

    // A retry after completion: the same bytes, marked as replayed.
    let again = send(&client, base, order, Some(&user), Some(&key), 1999).await;
    assert_eq!((again.status, again.replayed.as_deref()), (200, Some("true")));
    assert_eq!(again.body, body, "byte-identical replay");

    // The same key with another amount.
    let reused = send(&client, base, order, Some(&user), Some(&key), 5).await;
    assert_eq!((reused.status, reused.code().as_str()), (422, "IDEMPOTENCY_KEY_REUSED"));
    assert_eq!(reused.content_type, "application/problem+json");
    assert!(reused.replayed.is_none());
    assert!(!String::from_utf8_lossy(&reused.body).contains(&key), "the key is never echoed");
    assert_eq!(db.ledger_rows(order).await, 1);

    // Another user sending the same header value runs their own request:
    // on the same (now paid) order the body runs and refuses...
    let other = common::unique("v").replace('-', "x");
    let theirs = send(&client, base, order, Some(&other), Some(&key), 1999).await;
    assert_eq!((theirs.status, theirs.code().as_str(), theirs.replayed.as_deref()), (409, "ORDER_NOT_PAYABLE", None));
    // ...and on an order of their own it pays it, with their own payment.
    let their_order = db.new_order().await;
    let theirs = send(&client, base, their_order, Some(&other), Some(&key), 1999).await;
    assert_eq!((theirs.status, theirs.replayed.as_deref()), (200, None));
    let theirs = theirs.json();
    assert_eq!((theirs["order_id"].as_i64(), theirs["user"].as_str()), (Some(their_order), Some(&*other)));
    assert_ne!(theirs["payment_id"], paid["payment_id"]);
    assert_eq!(db.ledger_rows(their_order).await, 1);
    assert_eq!(db.records_of(&other).await, 1, "the refused request recorded nothing");

    // Without a key, with a malformed key, without a user: refused, nothing written.
    let clean = common::unique("w").replace('-', "x");
    let fresh = db.new_order().await;
    let missing = send(&client, base, fresh, Some(&clean), None, 1999).await;
    assert_eq!((missing.status, missing.code().as_str()), (400, "MISSING_IDEMPOTENCY_KEY"));
    assert_eq!(missing.content_type, "application/problem+json");
    let too_long = "k".repeat(256);
    for bad in ["a b", too_long.as_str(), "{x}", "abcdefg"] {
        let answer = send(&client, base, fresh, Some(&clean), Some(bad), 1999).await;
        assert_eq!((answer.status, answer.code().as_str()), (400, "INVALID_IDEMPOTENCY_KEY"), "{bad:?}");
        assert_eq!(answer.content_type, "application/problem+json");
        let problem = answer.json();
        assert_eq!(problem["status"], 400);
        assert!(problem["type"].is_string() && problem["title"].is_string() && problem["detail"].is_string());
        if bad.len() > 3 {
            assert!(!String::from_utf8_lossy(&answer.body).contains(bad), "the key is never echoed");
        }
    }
    let anonymous = send(&client, base, fresh, None, Some(&common::unique("key")), 1999).await;
    assert_eq!(anonymous.status, 401);
    assert_eq!(db.ledger_rows(fresh).await, 0, "nothing paid for refused requests");
    assert_eq!(db.ledger_rows_of(&clean).await, 0);
    assert_eq!(db.records_of(&clean).await, 0, "no idem_record row for refused requests");
    assert_eq!(db.records_of(&user).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_with_redis() {
    let Some((base, db)) = mysql_app(true).await else { return };
    scenario(&base, &db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_without_redis() {
    let Some((base, db)) = mysql_app(false).await else { return };
    scenario(&base, &db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_without_redis() {
    let (base, db) = sqlite_app().await;
    scenario(&base, &db).await;
}
