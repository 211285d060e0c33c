//! The black-box contract every HTTP adapter is held to, run against a
//! real server on loopback with a real client (reqwest): `tests/http.rs`
//! serves it with axum, `tests/actix.rs` with actix-web, each declaring
//! this module and the same test list (`contract_tests!`). What is
//! expected comes from the framework-free core (`idempotency::http`), so both
//! frameworks must answer the same statuses, bodies and headers, byte for
//! byte. MariaDB with and without Redis, and SQLite without Redis; a
//! database that is down; a business number that does not fit its column.
//!
//! A framework implements [`Framework`]: it serves `POST /orders/{id}/pay`
//! (an `#[idempotent]` handler keyed `<user>:<idem_key>`, biz
//! `http_test_pay`, its body [`charge!`], the caller from `X-User-Id`: none
//! is 401 with an empty body, one that cannot scope a key is refused by
//! `check_principal`; replays marked by its `replay_header`) and
//! `POST /refs/{reference}` (biz `http_test_book`, `biz_no` the reference).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idempotency::Idem;
use idempotency::http::{IdempotencyKey, ProblemDetails, validate_principal};
use reqwest::header::HeaderValue;
use serde::{Deserialize, Serialize};
use tokio::sync::{Barrier, mpsc, watch};

#[derive(Debug, Serialize, Deserialize)]
pub struct PayReq {
    pub amount: i64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct PayResponse {
    pub order_id: i64,
    pub user: String,
    pub amount: i64,
    pub payment_id: i64,
}

/// The handler's error: the engine's, or the order's own state (answered
/// 409 `{"code":"ORDER_NOT_PAYABLE"}` as `application/problem+json`).
#[derive(Debug)]
pub enum ApiError {
    Idem(idempotency::Error),
    NotPayable,
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

/// What a refused order answers, in every framework.
pub const NOT_PAYABLE_BODY: &str = r#"{"code":"ORDER_NOT_PAYABLE"}"#;

/// The caller, from `X-User-Id` (each framework's extractor).
pub struct UserId(pub String);

/// Where a payment's body waits until the test opens it, so duplicates
/// certainly arrive while it runs.
pub struct Gate {
    open: watch::Sender<bool>,
}

impl Gate {
    pub fn new(open: bool) -> Arc<Self> {
        Arc::new(Gate { open: watch::Sender::new(open) })
    }

    pub fn open(&self) {
        self.open.send_replace(true);
    }

    pub async fn pass(&self) {
        let mut open = self.open.subscribe();
        // Bounded: a test that never opens it fails on its answers instead of hanging.
        let _ = tokio::time::timeout(Duration::from_secs(30), open.wait_for(|open| *open)).await;
    }
}

/// The payment itself, in the call's transaction: MariaDB and SQLite take
/// the same SQL. `$tx: &mut Transaction`, `$gate: &Gate`, `$user: String`.
#[macro_export]
macro_rules! charge {
    ($tx:ident, $gate:expr, $user:ident, $order_id:ident, $req:ident) => {{
        let paid = sqlx::query("UPDATE http_orders SET status = 'PAID' WHERE id = ? AND status = 'PENDING'")
            .bind($order_id)
            .execute(&mut **$tx)
            .await?;
        if paid.rows_affected() == 0 {
            return Err($crate::http_contract::ApiError::NotPayable);
        }
        $gate.pass().await;
        sqlx::query("INSERT INTO http_payments (order_id, user_id, amount) VALUES (?, ?, ?)")
            .bind($order_id)
            .bind(&$user)
            .bind($req.amount)
            .execute(&mut **$tx)
            .await?;
        let payment_id: i64 = sqlx::query_scalar("SELECT MAX(id) FROM http_payments WHERE order_id = ?")
            .bind($order_id)
            .fetch_one(&mut **$tx)
            .await?;
        Ok($crate::http_contract::PayResponse { order_id: $order_id, user: $user, amount: $req.amount, payment_id })
    }};
}

/// What a framework under test serves; each returns its base URL.
pub trait Framework {
    /// The payment route on MariaDB.
    fn serve_mysql(idem: Idem<sqlx::MySql>, gate: Arc<Gate>) -> impl Future<Output = String>;
    /// The payment route on SQLite.
    fn serve_sqlite(idem: Idem<sqlx::Sqlite>, gate: Arc<Gate>) -> impl Future<Output = String>;
    /// The booking route (`biz_no` from the path) on SQLite.
    fn serve_booking(idem: Idem<sqlx::Sqlite>) -> impl Future<Output = String>;
}

/// The database behind a running app, for the assertions.
#[derive(Clone)]
pub enum Db {
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

/// A running app: its URL, its database, and the gate its payments wait at.
pub struct Served {
    pub base: String,
    pub db: Db,
    pub gate: Arc<Gate>,
}

/// How long a duplicate without a Redis claim waits for the running call
/// (in memory) before it answers 409.
pub const LOCK_WAIT: Duration = Duration::from_secs(1);

async fn mysql_app<F: Framework>(with_redis: bool, gate: Arc<Gate>) -> Option<Served> {
    let pool = idempotency_testkit::reach("mysql", || async {
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(60))
            .connect(&idempotency_testkit::mysql_url())
            .await
            .ok()
    })
    .await?;
    let mut builder = Idem::builder(pool.clone()).lock_wait(LOCK_WAIT);
    if with_redis {
        builder = builder.redis(idempotency_testkit::redis_client().await?);
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
    Some(Served { base: F::serve_mysql(idem, Arc::clone(&gate)).await, db: Db::My(pool), gate })
}

async fn sqlite_app<F: Framework>(gate: Arc<Gate>) -> Served {
    let dir = std::env::temp_dir().join("idem-tests");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.join(format!("{}.db", idempotency_testkit::unique("http"))))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(options)
        .await
        .expect("sqlite file");
    let idem = Idem::builder(pool.clone()).lock_wait(LOCK_WAIT).build();
    idem.migrate().await.expect("migrate");
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS http_orders (id INTEGER PRIMARY KEY AUTOINCREMENT, status TEXT NOT NULL);
         CREATE TABLE IF NOT EXISTS http_payments (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id INTEGER NOT NULL,
             user_id TEXT NOT NULL, amount INTEGER NOT NULL);",
    )
    .execute(&pool)
    .await
    .expect("tables");
    Served { base: F::serve_sqlite(idem, Arc::clone(&gate)).await, db: Db::Lite(pool), gate }
}

/// One answer, read whole.
struct Answer {
    status: u16,
    replayed: Option<String>,
    retry_after: Option<String>,
    should_retry: Option<String>,
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

    /// Asserts this is `expected`, byte for byte, as `application/problem+json`.
    fn assert_problem(&self, expected: &ProblemDetails) {
        let body = String::from_utf8_lossy(&self.body);
        assert_eq!((self.status, self.code()), (expected.status, expected.code.to_owned()), "{body}");
        assert_eq!(body, expected.body());
        assert_eq!(self.content_type, "application/problem+json");
        assert_eq!(self.retry_after, expected.retry_after.map(|s| s.to_string()));
        assert_eq!(self.should_retry, Some(expected.should_retry().to_string()), "{body}");
        assert_eq!(self.replayed, None);
    }
}

/// Pays `order` for `amount`, with `headers` as raw bytes.
async fn send_raw(client: &reqwest::Client, base: &str, order: i64, headers: &[(&str, &[u8])], amount: i64) -> Answer {
    let mut request = client
        .post(format!("{base}/orders/{order}/pay"))
        .header("content-type", "application/json")
        .body(format!(r#"{{"amount":{amount}}}"#));
    for (name, value) in headers {
        request = request.header(*name, HeaderValue::from_bytes(value).expect("a sendable header value"));
    }
    let response = request.send().await.expect("request");
    let header = |name: &str| response.headers().get(name).map(|v| v.to_str().unwrap().to_owned());
    let (status, replayed, retry_after, should_retry) = (
        response.status().as_u16(),
        header("idempotent-replayed"),
        header("retry-after"),
        header("idempotency-should-retry"),
    );
    let content_type = header("content-type").unwrap_or_default();
    let body = response.bytes().await.expect("body").to_vec();
    if content_type == "application/problem+json" {
        // No problem ever carries a control byte or a byte above ASCII.
        assert!(body.iter().all(|b| (b' '..=b'~').contains(b)), "{:?}", String::from_utf8_lossy(&body));
    }
    Answer { status, replayed, retry_after, should_retry, content_type, body }
}

async fn send(
    client: &reqwest::Client,
    base: &str,
    order: i64,
    user: Option<&str>,
    key: Option<&str>,
    amount: i64,
) -> Answer {
    let mut headers: Vec<(&str, &[u8])> = Vec::new();
    if let Some(user) = user {
        headers.push(("x-user-id", user.as_bytes()));
    }
    if let Some(key) = key {
        headers.push(("idempotency-key", key.as_bytes()));
    }
    send_raw(client, base, order, &headers, amount).await
}

/// What the core answers for an `Idempotency-Key` of these bytes.
fn key_problem(value: Option<&[u8]>) -> ProblemDetails {
    IdempotencyKey::from_header_values(value).unwrap_err()
}

fn problem_of(error: idempotency::Error) -> ProblemDetails {
    ProblemDetails::from(&error)
}

fn in_progress() -> ProblemDetails {
    problem_of(idempotency::Error::InProgress { biz: "http_test_pay", key: String::new() })
}

/// A user id of letters and digits, unique to this run.
fn new_user(prefix: &str) -> String {
    idempotency_testkit::unique(prefix).replace('-', "x")
}

/// Every behaviour of the table in DESIGN.md, over HTTP.
async fn scenario(app: &Served) {
    let (base, db) = (app.base.as_str(), &app.db);
    let client = reqwest::Client::new();
    let user = new_user("u");
    let key = idempotency_testkit::unique("key");
    let order = db.new_order().await;

    // 50 identical requests released at once: one execution. Its body waits
    // at the gate until an answer has arrived, and none can finish before
    // it, so that first answer is a duplicate's 409.
    let barrier = Arc::new(Barrier::new(50));
    let (answered, mut answers) = mpsc::unbounded_channel();
    for _ in 0..50 {
        let (client, base, user, key, barrier, answered) =
            (client.clone(), base.to_owned(), user.clone(), key.clone(), Arc::clone(&barrier), answered.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            let _ = answered.send(send(&client, &base, order, Some(&user), Some(&key), 1999).await);
        });
    }
    drop(answered);
    let early = answers.recv().await.expect("an answer");
    early.assert_problem(&in_progress());
    app.gate.open();
    let mut all = vec![early];
    while let Some(answer) = answers.recv().await {
        all.push(answer);
    }
    assert_eq!(all.len(), 50, "every request answered");
    assert_eq!(db.ledger_rows(order).await, 1, "exactly one payment");
    let ok: Vec<&Answer> = all.iter().filter(|a| a.status == 200).collect();
    let busy: Vec<&Answer> = all.iter().filter(|a| a.status == 409).collect();
    assert_eq!(ok.len() + busy.len(), 50, "only 200 or 409: {:?}", all.iter().map(|a| a.status).collect::<Vec<_>>());
    assert!(!busy.is_empty(), "at least the answer given while the body waited");
    for a in &busy {
        a.assert_problem(&in_progress());
    }
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
        assert_eq!(a.content_type, "application/json");
        assert!(a.replayed.is_none() || a.replayed.as_deref() == Some("true"));
    }

    // A retry after completion: the same bytes, marked as replayed; quoted
    // as the IETF draft has it, it is the same key.
    let again = send(&client, base, order, Some(&user), Some(&key), 1999).await;
    assert_eq!((again.status, again.replayed.as_deref()), (200, Some("true")));
    assert_eq!(again.body, body, "byte-identical replay");
    let quoted = send(&client, base, order, Some(&user), Some(&format!("\"{key}\"")), 1999).await;
    assert_eq!((quoted.status, quoted.replayed.as_deref()), (200, Some("true")));
    assert_eq!(quoted.body, body, "the quoted key replays the bare one");

    // The same key with another amount.
    let reused = send(&client, base, order, Some(&user), Some(&key), 5).await;
    reused.assert_problem(&problem_of(idempotency::Error::KeyReused { biz: "http_test_pay", key: String::new() }));
    assert!(!String::from_utf8_lossy(&reused.body).contains(&key), "the key is never echoed");
    assert_eq!(db.ledger_rows(order).await, 1);

    // Another user sending the same header value runs their own request:
    // on the same (now paid) order the body runs and refuses...
    let other = new_user("v");
    let theirs = send(&client, base, order, Some(&other), Some(&key), 1999).await;
    assert_eq!(
        (theirs.status, theirs.body.as_slice(), theirs.replayed.as_deref()),
        (409, &br#"{"code":"ORDER_NOT_PAYABLE"}"#[..], None)
    );
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
    let clean = new_user("w");
    let fresh = db.new_order().await;
    let missing = send(&client, base, fresh, Some(&clean), None, 1999).await;
    missing.assert_problem(&key_problem(None));
    assert_eq!(missing.code(), "MISSING_IDEMPOTENCY_KEY");
    let too_long = "k".repeat(256);
    for bad in ["a b", too_long.as_str(), "{x}", "abcdefg"] {
        let answer = send(&client, base, fresh, Some(&clean), Some(bad), 1999).await;
        answer.assert_problem(&key_problem(Some(bad.as_bytes())));
        assert_eq!(answer.code(), "INVALID_IDEMPOTENCY_KEY", "{bad:?}");
        if bad.len() > 3 {
            assert!(!String::from_utf8_lossy(&answer.body).contains(bad), "the key is never echoed");
        }
    }
    let anonymous = send(&client, base, fresh, None, Some(&idempotency_testkit::unique("key")), 1999).await;
    assert_eq!((anonymous.status, anonymous.body.as_slice()), (401, &b""[..]));
    assert_eq!(db.ledger_rows(fresh).await, 0, "nothing paid for refused requests");
    assert_eq!(db.ledger_rows_of(&clean).await, 0);
    assert_eq!(db.records_of(&clean).await, 0, "no idem_record row for refused requests");
    assert_eq!(db.records_of(&user).await, 1);
}

pub async fn mysql_with_redis<F: Framework>() {
    let Some(app) = mysql_app::<F>(true, Gate::new(false)).await else { return };
    scenario(&app).await;
}

pub async fn mysql_without_redis<F: Framework>() {
    let Some(app) = mysql_app::<F>(false, Gate::new(false)).await else { return };
    scenario(&app).await;
}

pub async fn sqlite_without_redis<F: Framework>() {
    let app = sqlite_app::<F>(Gate::new(false)).await;
    scenario(&app).await;
}

/// `"k"` (a structured-field string, as the IETF draft sends it) and `k`
/// are one key, whichever comes first.
pub async fn quoted_key_is_the_same_key<F: Framework>() {
    let Served { base, db, .. } = sqlite_app::<F>(Gate::new(true)).await;
    let client = reqwest::Client::new();
    let user = new_user("q");
    for quoted_first in [false, true] {
        let key = idempotency_testkit::unique("key");
        let (bare, quoted) = (key.clone(), format!("\"{key}\""));
        let (first, second) = if quoted_first { (&quoted, &bare) } else { (&bare, &quoted) };
        let order = db.new_order().await;
        let executed = send(&client, &base, order, Some(&user), Some(first), 700).await;
        assert_eq!((executed.status, executed.replayed.as_deref()), (200, None), "{first}");
        let paid = executed.json();
        assert_eq!(
            (paid["order_id"].as_i64(), paid["user"].as_str(), paid["amount"].as_i64()),
            (Some(order), Some(&*user), Some(700))
        );
        let replayed = send(&client, &base, order, Some(&user), Some(second), 700).await;
        assert_eq!((replayed.status, replayed.replayed.as_deref()), (200, Some("true")), "{second}");
        assert_eq!(replayed.body, executed.body, "{second} replays {first} byte for byte");
        let reused = send(&client, &base, order, Some(&user), Some(second), 701).await;
        reused.assert_problem(&problem_of(idempotency::Error::KeyReused { biz: "http_test_pay", key: String::new() }));
        assert_eq!(db.ledger_rows(order).await, 1);
    }
    assert_eq!(db.records_of(&user).await, 2, "one record per key, quoted or not");
    assert_eq!(db.ledger_rows_of(&user).await, 2);
}

/// Badly quoted keys (unterminated, escapes or quotes inside, parameters,
/// empty) and quoted content the key rule refuses: 400, nothing written.
pub async fn malformed_quoting_is_refused_and_writes_nothing<F: Framework>() {
    let Served { base, db, .. } = sqlite_app::<F>(Gate::new(true)).await;
    let client = reqwest::Client::new();
    let user = new_user("m");
    let order = db.new_order().await;
    let cases: [&str; 11] = [
        "\"",
        "\"\"",
        "\"abcdefgh",
        "abcdefgh\"",
        "\"abcd\"efgh\"",
        "\"abcd\\\"efgh\"",
        "\"abcd\\\\efgh\"",
        "\"abcdefgh\";p=1",
        "\"abcd efgh\"",
        "\"abcdefg\"",
        "\"abcd/efgh\"",
    ];
    for bad in cases {
        let answer = send(&client, &base, order, Some(&user), Some(bad), 1999).await;
        answer.assert_problem(&key_problem(Some(bad.as_bytes())));
        assert_eq!((answer.status, answer.code().as_str()), (400, "INVALID_IDEMPOTENCY_KEY"), "{bad}");
    }
    assert_eq!(db.ledger_rows(order).await, 0, "nothing paid");
    assert_eq!(db.records_of(&user).await, 0, "no idem_record row");
    // The order is still payable: the refusals left nothing behind.
    let good = send(&client, &base, order, Some(&user), Some("\"abcdefgh\""), 1999).await;
    assert_eq!((good.status, good.replayed.as_deref()), (200, None));
    assert_eq!((db.ledger_rows(order).await, db.records_of(&user).await), (1, 1));
}

/// A principal holding the separator could render another caller's key
/// (`u` + `x:k` and `u:x` + `k` are both `u:x:k`): the extractor refuses it
/// with 400 `INVALID_PRINCIPAL` before the handler runs.
pub async fn principal_with_the_separator_is_refused_by_the_extractor<F: Framework>() {
    let Served { base, db, .. } = sqlite_app::<F>(Gate::new(true)).await;
    let client = reqwest::Client::new();
    let user = new_user("p");
    let key = idempotency_testkit::unique("key");
    let order = db.new_order().await;
    let first = send(&client, &base, order, Some(&user), Some(&format!("x:{key}")), 1999).await;
    assert_eq!((first.status, first.replayed.as_deref()), (200, None));

    let colliding = format!("{user}:x");
    let refused = send(&client, &base, order, Some(&colliding), Some(&key), 1999).await;
    refused.assert_problem(&validate_principal(&colliding).unwrap_err());
    assert_eq!(refused.code(), "INVALID_PRINCIPAL");
    let detail = refused.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("it holds ':' at byte") && !detail.contains(&user), "{detail}");

    let fresh = db.new_order().await;
    for principal in [":", "a:b", &format!("{user}:{user}"), "", &"p".repeat(65), "a b", "a@b"] {
        let answer =
            send(&client, &base, fresh, Some(principal), Some(&idempotency_testkit::unique("key")), 1999).await;
        answer.assert_problem(&validate_principal(principal).unwrap_err());
    }
    assert_eq!(db.ledger_rows(order).await, 1, "only the first payment");
    assert_eq!(db.ledger_rows(fresh).await, 0);
    assert_eq!(db.ledger_rows_of(&colliding).await, 0);
    assert_eq!(db.records_of(&user).await, 1, "the first call's record alone");
}

/// Problem details describe an offending byte (a code point for anything
/// but visible ASCII) and never carry it, in the key or in the principal.
pub async fn details_never_echo_raw_bytes<F: Framework>() {
    let Served { base, db, .. } = sqlite_app::<F>(Gate::new(true)).await;
    let client = reqwest::Client::new();
    let user = new_user("r");
    let order = db.new_order().await;
    let keys: [(&[u8], Option<&str>); 6] = [
        (b"abcd\tefgh", Some("character U+0009 at byte 4")),
        (b"\"abcd\tefgh\"", Some("character U+0009 at byte 5")),
        (b"abcd\xffefgh", None),
        ("clé-12345678".as_bytes(), None),
        ("\"abcdéfgh\"".as_bytes(), None),
        ("\u{202e}abcdefgh".as_bytes(), None),
    ];
    for (raw, shown) in keys {
        let answer =
            send_raw(&client, &base, order, &[("x-user-id", user.as_bytes()), ("idempotency-key", raw)], 1).await;
        answer.assert_problem(&key_problem(Some(raw)));
        assert_eq!(answer.code(), "INVALID_IDEMPOTENCY_KEY");
        let detail = answer.json()["detail"].as_str().unwrap().to_owned();
        match shown {
            Some(shown) => assert!(detail.contains(shown), "{detail}"),
            None => assert!(
                detail.starts_with("the Idempotency-Key header holds bytes that are not visible ASCII"),
                "{detail}"
            ),
        }
        assert!(!detail.contains("abcd") && !detail.contains("efgh"), "{detail}");
    }
    let principals: [(&[u8], &str); 4] = [
        (b"ab\tc", "it holds U+0009 at byte 2"),
        ("zoë".as_bytes(), "it holds U+00EB at byte 2"),
        (b"ab\xffc", "it holds U+FFFD at byte 2"),
        ("a\u{202e}b".as_bytes(), "it holds U+202E at byte 1"),
    ];
    for (raw, shown) in principals {
        let key = idempotency_testkit::unique("key");
        let answer =
            send_raw(&client, &base, order, &[("x-user-id", raw), ("idempotency-key", key.as_bytes())], 1).await;
        answer.assert_problem(&validate_principal(&String::from_utf8_lossy(raw)).unwrap_err());
        let detail = answer.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains(shown), "{detail}");
    }
    assert_eq!(db.ledger_rows(order).await, 0, "nothing paid");
    assert_eq!(db.records_of(&user).await, 0, "no idem_record row");
}

/// The database is down: 503 `IDEMPOTENCY_STORAGE_UNAVAILABLE`, so the
/// client retries with the same key.
pub async fn database_down_is_503<F: Framework>() {
    // A SQLite file in a folder that does not exist, and MySQL on a port
    // nobody listens on.
    let sqlite = sqlx::sqlite::SqlitePoolOptions::new().acquire_timeout(Duration::from_secs(2)).connect_lazy_with(
        sqlx::sqlite::SqliteConnectOptions::new().filename("/nonexistent-idem-dir/none.db").create_if_missing(false),
    );
    let mysql = sqlx::mysql::MySqlPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("mysql://root@127.0.0.1:1/test")
        .expect("a mysql url");
    let bases = [
        F::serve_sqlite(Idem::new(sqlite), Gate::new(true)).await,
        F::serve_mysql(Idem::new(mysql), Gate::new(true)).await,
    ];
    let client = reqwest::Client::new();
    let unavailable = problem_of(idempotency::Error::Storage(sqlx::Error::PoolTimedOut));
    for base in &bases {
        let key = idempotency_testkit::unique("key");
        for _ in 0..2 {
            let answer = send(&client, base, 1, Some("alice"), Some(&key), 1999).await;
            answer.assert_problem(&unavailable);
            assert_eq!((answer.status, answer.code().as_str()), (503, "IDEMPOTENCY_STORAGE_UNAVAILABLE"));
        }
    }
}

/// A `biz_no` past its 64-byte column is the request's fault, not its key's:
/// 400 `INVALID_BIZ_NO` (from `Error::BizNoTooLong`), nothing written; 64
/// bytes are booked.
pub async fn biz_no_too_long_is_400_invalid_biz_no<F: Framework>() {
    let idem = Idem::sqlite_memory().await.expect("sqlite");
    let pool = idem.pool().clone();
    let base = F::serve_booking(idem).await;
    let client = reqwest::Client::new();
    let records = || async { sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM idem_record").fetch_one(&pool).await };
    let book = |reference: String| {
        let request = client
            .post(format!("{base}/refs/{reference}"))
            .header("idempotency-key", idempotency_testkit::unique("key"));
        async move {
            let response = request.send().await.expect("request");
            (response.status().as_u16(), response.text().await.expect("body"))
        }
    };

    let expected = problem_of(idempotency::Error::BizNoTooLong { len: 65, max: 64 });
    assert_eq!(expected.code, "INVALID_BIZ_NO");
    assert_eq!(book("n".repeat(65)).await, (400, expected.body()));
    assert_eq!(records().await.unwrap(), 0, "nothing written");

    assert_eq!(book("n".repeat(64)).await.0, 200);
    assert_eq!(records().await.unwrap(), 1);
}

/// The contract's test list, for a [`Framework`] type: one `#[tokio::test]`
/// per case, named as the case.
#[macro_export]
macro_rules! contract_tests {
    ($framework:ty) => {
        $crate::contract_tests!(@each $framework, 4: mysql_with_redis, mysql_without_redis, sqlite_without_redis);
        $crate::contract_tests!(@each $framework, 2:
            quoted_key_is_the_same_key,
            malformed_quoting_is_refused_and_writes_nothing,
            principal_with_the_separator_is_refused_by_the_extractor,
            details_never_echo_raw_bytes,
            database_down_is_503,
            biz_no_too_long_is_400_invalid_biz_no
        );
    };
    (@each $framework:ty, $threads:literal: $($case:ident),+) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = $threads)]
            async fn $case() {
                $crate::http_contract::$case::<$framework>().await;
            }
        )+
    };
}
