//! End to end over gRPC with tonic: a real tonic server on a loopback
//! port and a real tonic client on one HTTP/2 channel, the `Payments`
//! service of `examples/grpc` (its hand-written `proto.rs`), whose method,
//! written inside a `#[tonic::async_trait]` impl, reads the caller from
//! `x-user-id`, the key with `IdempotencyKey::from_metadata`, and answers
//! through `idempotency::grpc::respond` an `#[idempotent]` fn keyed
//! `<user>:<idem_key>`. The cases of `tests/http_contract` where they
//! apply: one scenario on MariaDB with and without Redis and on SQLite
//! without (a storm of 50, replays bare and quoted, a reused key, another
//! caller's identical key, refusals that write nothing); malformed quoting,
//! principals with the separator, details without raw bytes, and a
//! database that is down. Codes and metadata are asserted literally: they
//! are what a client's retry policy reads.

#[path = "../examples/grpc/proto.rs"]
mod proto;

use std::sync::Arc;
use std::time::Duration;

use idempotency::grpc;
use idempotency::http::{IdempotencyKey, ProblemDetails, validate_principal};
use idempotency::{Idem, idempotent};
use prost::Message;
use proto::{PayReply, PayRequest, Payments, PaymentsClient, PaymentsServer};
use sqlx::Transaction;
use tokio::sync::{Barrier, mpsc, watch};
use tonic::metadata::{AsciiMetadataValue, BinaryMetadataValue};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Response, Status};

/// The method's own failures beside the engine's.
#[derive(Debug)]
enum PayError {
    Idem(idempotency::Error),
    NotPayable,
}

impl From<idempotency::Error> for PayError {
    fn from(e: idempotency::Error) -> Self {
        PayError::Idem(e)
    }
}

impl From<sqlx::Error> for PayError {
    fn from(e: sqlx::Error) -> Self {
        PayError::Idem(e.into())
    }
}

const NOT_PAYABLE: &str = "ORDER_NOT_PAYABLE: the order is not pending payment";

impl From<PayError> for Status {
    fn from(e: PayError) -> Self {
        match e {
            PayError::Idem(e) => e.into(),
            PayError::NotPayable => Status::failed_precondition(NOT_PAYABLE),
        }
    }
}

/// Where a payment's body waits until the test opens it, so duplicates
/// certainly arrive while it runs.
struct Gate(watch::Sender<bool>);

impl Gate {
    fn new(open: bool) -> Arc<Self> {
        Arc::new(Gate(watch::Sender::new(open)))
    }

    fn open(&self) {
        self.0.send_replace(true);
    }

    async fn pass(&self) {
        let mut open = self.0.subscribe();
        // Bounded: a test that never opens it fails on its answers instead of hanging.
        let _ = tokio::time::timeout(Duration::from_secs(30), open.wait_for(|open| *open)).await;
    }
}

/// The caller from `x-user-id`: none is `UNAUTHENTICATED`; one that cannot
/// scope a key is refused by `check_principal`.
fn caller<T>(request: &Request<T>) -> Result<String, Status> {
    let Some(user) = request.metadata().get("x-user-id") else {
        return Err(Status::unauthenticated("send x-user-id"));
    };
    let user = String::from_utf8_lossy(user.as_bytes());
    grpc::check_principal(&user)?;
    Ok(user.into_owned())
}

macro_rules! pay_service {
    ($module:ident, $db:ty) => {
        mod $module {
            use super::*;

            pub struct Service {
                pub idem: Idem<$db>,
                pub gate: Arc<Gate>,
            }

            #[idempotent(key = "<user>:<idem_key>", ttl = "1h", biz = "grpc_test_pay", engine = app.idem)]
            async fn pay_order(
                app: &Service,
                tx: &mut Transaction<'_, $db>,
                user: String,
                idem_key: String,
                order_id: i64,
                amount: i64,
            ) -> Result<PayReply, PayError> {
                let paid = sqlx::query("UPDATE grpc_orders SET status = 'PAID' WHERE id = ? AND status = 'PENDING'")
                    .bind(order_id)
                    .execute(&mut **tx)
                    .await?;
                if paid.rows_affected() == 0 {
                    return Err(PayError::NotPayable);
                }
                app.gate.pass().await;
                sqlx::query("INSERT INTO grpc_payments (order_id, user_id, amount) VALUES (?, ?, ?)")
                    .bind(order_id)
                    .bind(&user)
                    .bind(amount)
                    .execute(&mut **tx)
                    .await?;
                let payment_id: i64 = sqlx::query_scalar("SELECT MAX(id) FROM grpc_payments WHERE order_id = ?")
                    .bind(order_id)
                    .fetch_one(&mut **tx)
                    .await?;
                Ok(PayReply { order_id, user, amount, payment_id })
            }

            #[tonic::async_trait]
            impl Payments for Service {
                async fn pay(&self, request: Request<PayRequest>) -> Result<Response<PayReply>, Status> {
                    let user = caller(&request)?;
                    let IdempotencyKey(idem_key) = IdempotencyKey::from_metadata(request.metadata())?;
                    let PayRequest { order_id, amount } = request.into_inner();
                    grpc::respond(pay_order(self, user, idem_key, order_id, amount)).await
                }
            }
        }
    };
}

pay_service!(on_mysql, sqlx::MySql);
pay_service!(on_sqlite, sqlx::Sqlite);

/// Serves `service` on an ephemeral loopback port; returns a client on one channel.
async fn serve(service: impl Payments) -> PaymentsClient {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().unwrap();
    let server = Server::builder().serve_with_incoming(PaymentsServer::new(service), TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("serve") });
    let channel = Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.expect("connect");
    PaymentsClient::new(channel)
}

/// The database behind a running service, for the assertions.
enum Db {
    My(sqlx::MySqlPool),
    Lite(sqlx::SqlitePool),
}

impl Db {
    async fn count(&self, sql: &'static str, bind: &str) -> i64 {
        match self {
            Db::My(pool) => sqlx::query_scalar(sql).bind(bind).fetch_one(pool).await,
            Db::Lite(pool) => sqlx::query_scalar(sql).bind(bind).fetch_one(pool).await,
        }
        .expect(sql)
    }

    async fn count_by_id(&self, sql: &'static str, bind: i64) -> i64 {
        match self {
            Db::My(pool) => sqlx::query_scalar(sql).bind(bind).fetch_one(pool).await,
            Db::Lite(pool) => sqlx::query_scalar(sql).bind(bind).fetch_one(pool).await,
        }
        .expect(sql)
    }

    /// A new `PENDING` order; ids come from the table, so runs never collide.
    async fn new_order(&self) -> i64 {
        const SQL: &str = "INSERT INTO grpc_orders (status) VALUES ('PENDING')";
        match self {
            Db::My(pool) => i64::try_from(sqlx::query(SQL).execute(pool).await.expect(SQL).last_insert_id()).unwrap(),
            Db::Lite(pool) => sqlx::query(SQL).execute(pool).await.expect(SQL).last_insert_rowid(),
        }
    }

    async fn ledger_rows(&self, order_id: i64) -> i64 {
        self.count_by_id("SELECT COUNT(*) FROM grpc_payments WHERE order_id = ?", order_id).await
    }

    async fn ledger_rows_of(&self, user: &str) -> i64 {
        self.count("SELECT COUNT(*) FROM grpc_payments WHERE user_id = ?", user).await
    }

    /// `idem_record` rows of this action whose key starts with `user:`
    /// (users are alphanumeric, so `LIKE` sees no wildcard in them).
    async fn records_of(&self, user: &str) -> i64 {
        let sql = "SELECT COUNT(*) FROM idem_record WHERE biz_type = 'grpc_test_pay' AND idem_key LIKE ?";
        self.count(sql, &format!("{user}:%")).await
    }
}

/// A running service: its client, its database, the gate its payments wait at.
struct Served {
    client: PaymentsClient,
    db: Db,
    gate: Arc<Gate>,
}

/// How long a duplicate without a Redis claim waits for the running call
/// (in memory) before it answers in progress.
const LOCK_WAIT: Duration = Duration::from_secs(1);

async fn mysql_service(with_redis: bool) -> Option<Served> {
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
        "CREATE TABLE IF NOT EXISTS grpc_orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, status VARCHAR(16) NOT NULL);
         CREATE TABLE IF NOT EXISTS grpc_payments (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BIGINT NOT NULL,
             user_id VARCHAR(100) NOT NULL, amount BIGINT NOT NULL, KEY (order_id), KEY (user_id));",
    )
    .execute(&pool)
    .await
    .expect("tables");
    let gate = Gate::new(false);
    let client = serve(on_mysql::Service { idem, gate: Arc::clone(&gate) }).await;
    Some(Served { client, db: Db::My(pool), gate })
}

async fn sqlite_service(open: bool) -> Served {
    let dir = std::env::temp_dir().join("idem-tests");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.join(format!("{}.db", idempotency_testkit::unique("grpc"))))
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
        "CREATE TABLE IF NOT EXISTS grpc_orders (id INTEGER PRIMARY KEY AUTOINCREMENT, status TEXT NOT NULL);
         CREATE TABLE IF NOT EXISTS grpc_payments (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id INTEGER NOT NULL,
             user_id TEXT NOT NULL, amount INTEGER NOT NULL);",
    )
    .execute(&pool)
    .await
    .expect("tables");
    let gate = Gate::new(open);
    let client = serve(on_sqlite::Service { idem, gate: Arc::clone(&gate) }).await;
    Served { client, db: Db::Lite(pool), gate }
}

/// One answer: the reply with its encoded bytes and replay marker, or the status.
#[derive(Debug)]
enum Answer {
    Reply { reply: PayReply, bytes: Vec<u8>, replayed: Option<String> },
    Refused(Status),
}

impl Answer {
    /// The reply and its replay marker; panics on a refusal.
    fn reply(&self) -> (&PayReply, &[u8], Option<&str>) {
        match self {
            Answer::Reply { reply, bytes, replayed } => (reply, bytes, replayed.as_deref()),
            Answer::Refused(status) => panic!("refused: {status:?}"),
        }
    }

    fn status(&self) -> &Status {
        match self {
            Answer::Refused(status) => status,
            Answer::Reply { reply, .. } => panic!("answered {reply:?}"),
        }
    }

    /// Asserts the refusal is `problem` with `code`: the problem's code in
    /// `idem-code`, `code: detail` as the message, and the retry hints
    /// exactly when the problem asks for a retry.
    fn assert_refused(&self, code: Code, problem: &ProblemDetails) {
        let status = self.status();
        let meta = |name| status.metadata().get(name).map(|v| v.to_str().unwrap().to_owned());
        assert_eq!((status.code(), meta("idem-code")), (code, Some(problem.code.to_owned())), "{status:?}");
        assert_eq!(status.message(), problem.to_string());
        let seconds = problem.retry_after;
        assert_eq!(meta("retry-after"), seconds.map(|s| s.to_string()));
        assert_eq!(meta("grpc-retry-pushback-ms"), seconds.map(|s| (s * 1000).to_string()));
        assert_eq!(meta("idempotent-replayed"), None);
    }
}

/// Pays `order` for `amount` with `metadata` as raw bytes (`-bin` names as binary metadata).
async fn send_raw(client: &PaymentsClient, order: i64, amount: i64, metadata: &[(&'static str, &[u8])]) -> Answer {
    let mut request = Request::new(PayRequest { order_id: order, amount });
    for &(name, value) in metadata {
        if name.ends_with("-bin") {
            request.metadata_mut().append_bin(name, BinaryMetadataValue::from_bytes(value));
        } else {
            request.metadata_mut().append(name, AsciiMetadataValue::try_from(value).expect("sendable metadata"));
        }
    }
    match client.clone().pay(request).await {
        Ok(response) => {
            let replayed = response.metadata().get("idempotent-replayed").map(|v| v.to_str().unwrap().to_owned());
            let reply = response.into_inner();
            Answer::Reply { bytes: reply.encode_to_vec(), reply, replayed }
        }
        Err(status) => {
            // No message ever carries a control byte or a byte above ASCII.
            assert!(status.message().bytes().all(|b| (b' '..=b'~').contains(&b)), "{:?}", status.message());
            Answer::Refused(status)
        }
    }
}

async fn send(client: &PaymentsClient, order: i64, user: Option<&str>, key: Option<&str>, amount: i64) -> Answer {
    let mut metadata: Vec<(&'static str, &[u8])> = Vec::new();
    if let Some(user) = user {
        metadata.push(("x-user-id", user.as_bytes()));
    }
    if let Some(key) = key {
        metadata.push(("idempotency-key", key.as_bytes()));
    }
    send_raw(client, order, amount, &metadata).await
}

/// What the core answers for an `idempotency-key` of these bytes.
fn key_problem(value: Option<&[u8]>) -> ProblemDetails {
    IdempotencyKey::from_header_values(value).unwrap_err()
}

fn problem_of(error: idempotency::Error) -> ProblemDetails {
    ProblemDetails::from(&error)
}

fn in_progress() -> ProblemDetails {
    problem_of(idempotency::Error::InProgress { biz: "grpc_test_pay", key: String::new() })
}

fn reused() -> ProblemDetails {
    problem_of(idempotency::Error::KeyReused { biz: "grpc_test_pay", key: String::new() })
}

/// A user id of letters and digits, unique to this run.
fn new_user(prefix: &str) -> String {
    idempotency_testkit::unique(prefix).replace('-', "x")
}

/// Every behaviour of the table in `idempotency::grpc`, over a real channel.
async fn scenario(service: &Served) {
    let (client, db) = (&service.client, &service.db);
    let user = new_user("u");
    let key = idempotency_testkit::unique("key");
    let order = db.new_order().await;

    // 50 identical calls released at once: one execution. Its body waits at
    // the gate until an answer has arrived, and none can finish before it,
    // so that first answer is a duplicate's UNAVAILABLE.
    let barrier = Arc::new(Barrier::new(50));
    let (answered, mut answers) = mpsc::unbounded_channel();
    for _ in 0..50 {
        let (client, user, key, barrier, answered) =
            (client.clone(), user.clone(), key.clone(), Arc::clone(&barrier), answered.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            let _ = answered.send(send(&client, order, Some(&user), Some(&key), 1999).await);
        });
    }
    drop(answered);
    let early = answers.recv().await.expect("an answer");
    early.assert_refused(Code::Unavailable, &in_progress());
    service.gate.open();
    let mut all = vec![early];
    while let Some(answer) = answers.recv().await {
        all.push(answer);
    }
    assert_eq!(all.len(), 50, "every call answered");
    assert_eq!(db.ledger_rows(order).await, 1, "exactly one payment");
    let (ok, busy): (Vec<&Answer>, Vec<&Answer>) = all.iter().partition(|a| matches!(a, Answer::Reply { .. }));
    assert!(!busy.is_empty(), "at least the answer given while the body waited");
    for answer in &busy {
        answer.assert_refused(Code::Unavailable, &in_progress());
    }
    let executed: Vec<&&Answer> = ok.iter().filter(|a| a.reply().2.is_none()).collect();
    assert_eq!(executed.len(), 1, "exactly one reply executed (no replay marker)");
    let (paid, bytes, _) = executed[0].reply();
    let (paid, bytes) = (paid.clone(), bytes.to_vec());
    assert_eq!((paid.order_id, paid.user.as_str(), paid.amount), (order, user.as_str(), 1999));
    for answer in &ok {
        let (_, got, replayed) = answer.reply();
        assert_eq!(got, bytes, "every reply carries the same message");
        assert!(matches!(replayed, None | Some("true")), "{replayed:?}");
    }

    // Each busy caller retries as a retry policy on UNAVAILABLE does (after
    // the pushback it was told: the call has completed by now, so the test
    // does not wait it out): it receives the replay.
    for answer in busy {
        assert_eq!(answer.status().metadata().get("grpc-retry-pushback-ms").unwrap(), "1000");
        let retried = send(client, order, Some(&user), Some(&key), 1999).await;
        assert_eq!(retried.reply().1, bytes);
        assert_eq!(retried.reply().2, Some("true"));
    }

    // A retry after completion: the same message, marked as replayed; quoted
    // as the IETF draft has it, it is the same key.
    let again = send(client, order, Some(&user), Some(&key), 1999).await;
    assert_eq!(again.reply(), (&paid, bytes.as_slice(), Some("true")), "an identical replay");
    let quoted = send(client, order, Some(&user), Some(&format!("\"{key}\"")), 1999).await;
    assert_eq!(quoted.reply(), (&paid, bytes.as_slice(), Some("true")), "the quoted key replays the bare one");

    // The same key with another amount: not retryable.
    let other_amount = send(client, order, Some(&user), Some(&key), 5).await;
    other_amount.assert_refused(Code::FailedPrecondition, &reused());
    assert!(!other_amount.status().message().contains(&key), "the key is never echoed");
    assert_eq!(db.ledger_rows(order).await, 1);

    // Another user sending the same key runs their own call: on the same
    // (now paid) order the body runs and refuses...
    let other = new_user("v");
    let theirs = send(client, order, Some(&other), Some(&key), 1999).await;
    assert_eq!((theirs.status().code(), theirs.status().message()), (Code::FailedPrecondition, NOT_PAYABLE));
    assert_eq!(theirs.status().metadata().get("idempotent-replayed"), None);
    // ...and on an order of their own it pays it, with their own payment.
    let their_order = db.new_order().await;
    let theirs = send(client, their_order, Some(&other), Some(&key), 1999).await;
    let (their_paid, _, replayed) = theirs.reply();
    assert_eq!((their_paid.order_id, their_paid.user.as_str(), replayed), (their_order, other.as_str(), None));
    assert_ne!(their_paid.payment_id, paid.payment_id);
    assert_eq!(db.ledger_rows(their_order).await, 1);
    assert_eq!(db.records_of(&other).await, 1, "the refused call recorded nothing");

    // Without a key (or with it only as binary metadata), with a malformed
    // key, without a user: refused, nothing written.
    let clean = new_user("w");
    let fresh = db.new_order().await;
    send(client, fresh, Some(&clean), None, 1999).await.assert_refused(Code::InvalidArgument, &key_problem(None));
    let binary = [("x-user-id", clean.as_bytes()), ("idempotency-key-bin", key.as_bytes())];
    send_raw(client, fresh, 1999, &binary).await.assert_refused(Code::InvalidArgument, &key_problem(None));
    assert_eq!(key_problem(None).code, "MISSING_IDEMPOTENCY_KEY");
    let too_long = "k".repeat(256);
    for bad in ["a b", too_long.as_str(), "{x}", "abcdefg"] {
        let answer = send(client, fresh, Some(&clean), Some(bad), 1999).await;
        answer.assert_refused(Code::InvalidArgument, &key_problem(Some(bad.as_bytes())));
        assert_eq!(answer.status().metadata().get("idem-code").unwrap(), "INVALID_IDEMPOTENCY_KEY", "{bad:?}");
        if bad.len() > 3 {
            assert!(!answer.status().message().contains(bad), "the key is never echoed");
        }
    }
    let twice = [("x-user-id", clean.as_bytes()), ("idempotency-key", b"abcdefgh"), ("idempotency-key", b"abcdefgh")];
    let twice_answer = send_raw(client, fresh, 1999, &twice).await;
    twice_answer.assert_refused(Code::InvalidArgument, &key_problem_of(&[b"abcdefgh", b"abcdefgh"]));
    let anonymous = send(client, fresh, None, Some(&idempotency_testkit::unique("key")), 1999).await;
    assert_eq!(anonymous.status().code(), Code::Unauthenticated);
    assert_eq!(db.ledger_rows(fresh).await, 0, "nothing paid for refused calls");
    assert_eq!(db.ledger_rows_of(&clean).await, 0);
    assert_eq!(db.records_of(&clean).await, 0, "no idem_record row for refused calls");
    assert_eq!(db.records_of(&user).await, 1);
}

fn key_problem_of(values: &[&[u8]]) -> ProblemDetails {
    IdempotencyKey::from_header_values(values.iter().copied()).unwrap_err()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_with_redis() {
    let Some(service) = mysql_service(true).await else { return };
    scenario(&service).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_without_redis() {
    let Some(service) = mysql_service(false).await else { return };
    scenario(&service).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_without_redis() {
    scenario(&sqlite_service(false).await).await;
}

/// `"k"` (a structured-field string, as the IETF draft sends it) and `k`
/// are one key, whichever comes first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quoted_key_is_the_same_key() {
    let Served { client, db, .. } = sqlite_service(true).await;
    let user = new_user("q");
    for quoted_first in [false, true] {
        let key = idempotency_testkit::unique("key");
        let (bare, quoted) = (key.clone(), format!("\"{key}\""));
        let (first, second) = if quoted_first { (&quoted, &bare) } else { (&bare, &quoted) };
        let order = db.new_order().await;
        let executed = send(&client, order, Some(&user), Some(first), 700).await;
        let (paid, bytes, replayed) = executed.reply();
        assert_eq!((paid.order_id, paid.user.as_str(), paid.amount, replayed), (order, user.as_str(), 700, None));
        let replay = send(&client, order, Some(&user), Some(second), 700).await;
        assert_eq!(replay.reply(), (paid, bytes, Some("true")), "{second} replays {first}");
        send(&client, order, Some(&user), Some(second), 701).await.assert_refused(Code::FailedPrecondition, &reused());
        assert_eq!(db.ledger_rows(order).await, 1);
    }
    assert_eq!(db.records_of(&user).await, 2, "one record per key, quoted or not");
    assert_eq!(db.ledger_rows_of(&user).await, 2);
}

/// Badly quoted keys and quoted content the key rule refuses:
/// `INVALID_ARGUMENT`, nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_quoting_is_refused_and_writes_nothing() {
    let Served { client, db, .. } = sqlite_service(true).await;
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
        let answer = send(&client, order, Some(&user), Some(bad), 1999).await;
        answer.assert_refused(Code::InvalidArgument, &key_problem(Some(bad.as_bytes())));
        assert_eq!(answer.status().metadata().get("idem-code").unwrap(), "INVALID_IDEMPOTENCY_KEY", "{bad}");
    }
    assert_eq!(db.ledger_rows(order).await, 0, "nothing paid");
    assert_eq!(db.records_of(&user).await, 0, "no idem_record row");
    // The order is still payable: the refusals left nothing behind.
    let good = send(&client, order, Some(&user), Some("\"abcdefgh\""), 1999).await;
    assert_eq!(good.reply().2, None);
    assert_eq!((db.ledger_rows(order).await, db.records_of(&user).await), (1, 1));
}

/// A principal holding the separator could render another caller's key
/// (`u` + `x:k` and `u:x` + `k` are both `u:x:k`): `check_principal`
/// refuses it with `INVALID_ARGUMENT` before anything runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn principal_with_the_separator_is_refused() {
    let Served { client, db, .. } = sqlite_service(true).await;
    let user = new_user("p");
    let key = idempotency_testkit::unique("key");
    let order = db.new_order().await;
    let first = send(&client, order, Some(&user), Some(&format!("x:{key}")), 1999).await;
    assert_eq!(first.reply().2, None);

    let colliding = format!("{user}:x");
    let refused = send(&client, order, Some(&colliding), Some(&key), 1999).await;
    refused.assert_refused(Code::InvalidArgument, &validate_principal(&colliding).unwrap_err());
    let message = refused.status().message();
    assert!(message.starts_with("INVALID_PRINCIPAL: ") && message.contains("it holds ':' at byte"), "{message}");
    assert!(!message.contains(&user), "{message}");

    let fresh = db.new_order().await;
    for principal in [":", "a:b", &format!("{user}:{user}"), "", &"p".repeat(65), "a b", "a@b"] {
        let answer = send(&client, fresh, Some(principal), Some(&idempotency_testkit::unique("key")), 1999).await;
        answer.assert_refused(Code::InvalidArgument, &validate_principal(principal).unwrap_err());
    }
    assert_eq!(db.ledger_rows(order).await, 1, "only the first payment");
    assert_eq!(db.ledger_rows(fresh).await, 0);
    assert_eq!(db.ledger_rows_of(&colliding).await, 0);
    assert_eq!(db.records_of(&user).await, 1, "the first call's record alone");
}

/// Status messages describe an offending byte (a code point for anything
/// but visible ASCII) and never carry it, in the key or in the principal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn details_never_echo_raw_bytes() {
    let Served { client, db, .. } = sqlite_service(true).await;
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
        let answer = send_raw(&client, order, 1, &[("x-user-id", user.as_bytes()), ("idempotency-key", raw)]).await;
        answer.assert_refused(Code::InvalidArgument, &key_problem(Some(raw)));
        let message = answer.status().message();
        match shown {
            Some(shown) => assert!(message.contains(shown), "{message}"),
            None => assert!(message.contains("holds bytes that are not visible ASCII"), "{message}"),
        }
        assert!(!message.contains("abcd") && !message.contains("efgh"), "{message}");
    }
    let principals: [(&[u8], &str); 4] = [
        (b"ab\tc", "it holds U+0009 at byte 2"),
        ("zoë".as_bytes(), "it holds U+00EB at byte 2"),
        (b"ab\xffc", "it holds U+FFFD at byte 2"),
        ("a\u{202e}b".as_bytes(), "it holds U+202E at byte 1"),
    ];
    for (raw, shown) in principals {
        let key = idempotency_testkit::unique("key");
        let answer = send_raw(&client, order, 1, &[("x-user-id", raw), ("idempotency-key", key.as_bytes())]).await;
        answer.assert_refused(Code::InvalidArgument, &validate_principal(&String::from_utf8_lossy(raw)).unwrap_err());
        assert!(answer.status().message().contains(shown), "{}", answer.status().message());
    }
    assert_eq!(db.ledger_rows(order).await, 0, "nothing paid");
    assert_eq!(db.records_of(&user).await, 0, "no idem_record row");
}

/// The database is down: `UNAVAILABLE` (`IDEMPOTENCY_STORAGE_UNAVAILABLE`),
/// which retry policies retry, with the same key, as often as it stays down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_down_is_unavailable() {
    // A SQLite file in a folder that does not exist, and MySQL on a port
    // nobody listens on.
    let sqlite = sqlx::sqlite::SqlitePoolOptions::new().acquire_timeout(Duration::from_secs(2)).connect_lazy_with(
        sqlx::sqlite::SqliteConnectOptions::new().filename("/nonexistent-idem-dir/none.db").create_if_missing(false),
    );
    let mysql = sqlx::mysql::MySqlPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("mysql://root@127.0.0.1:1/test")
        .expect("a mysql url");
    let clients = [
        serve(on_sqlite::Service { idem: Idem::new(sqlite), gate: Gate::new(true) }).await,
        serve(on_mysql::Service { idem: Idem::new(mysql), gate: Gate::new(true) }).await,
    ];
    let unavailable = problem_of(idempotency::Error::Storage(sqlx::Error::PoolTimedOut));
    assert_eq!(unavailable.code, "IDEMPOTENCY_STORAGE_UNAVAILABLE");
    for client in &clients {
        let key = idempotency_testkit::unique("key");
        for _ in 0..2 {
            send(client, 1, Some("alice"), Some(&key), 1999).await.assert_refused(Code::Unavailable, &unavailable);
        }
    }
}
