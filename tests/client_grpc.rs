//! The client half over gRPC against a real server of this crate: the
//! tonic client of `examples/grpc/proto.rs` on a channel wrapped in
//! `idempotency_client::grpc::IdempotencyLayer`, calling the gRPC example
//! (`examples/grpc.rs`, run as the process a user runs) on a SQLite file
//! of its own, through a forwarder the test cuts and holds
//! (`idempotency_testkit::forwarder`). Each case counts the `payments`
//! rows (one per execution) and the committed `idem_record` rows exactly.

// Its client; the server half is the example's.
#[path = "../examples/grpc/proto.rs"]
#[allow(dead_code)]
mod proto;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_client::grpc::{IdempotencyLayer, Idempotent, outcome};
use idempotency_client::{Outcome, Retries, Retrying, Stop, new_key};
use idempotency_testkit::example::Example;
use idempotency_testkit::forwarder::{Forwarder, Hold};
use proto::{PayReply, PayRequest, PaymentsClient};
use sqlx::SqlitePool;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};
use tower_layer::Layer;

/// The example server on a SQLite file of its own, behind `front`.
struct Shop {
    _server: Example,
    server_port: u16,
    front: Arc<Forwarder>,
    pool: SqlitePool,
    file: std::path::PathBuf,
}

impl Shop {
    async fn open() -> Shop {
        let file = std::env::temp_dir().join(format!("{}.db", idempotency_testkit::unique("idem-client-grpc")));
        let url = format!("sqlite:{}", file.display());
        let (server, serving) = Example::start(
            "grpc",
            &["examples/grpc.rs", "examples/grpc"],
            &idempotency_testkit::facade_features!(),
            &[("IDEM_GRPC_ADDR", "127.0.0.1:0"), ("IDEM_SQLITE_URL", &url)],
            "serving idem.example.Payments on ",
        )
        .await;
        let addr = serving.split_whitespace().next().expect("an address");
        let server_port = addr.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).expect("a port");
        let front = Arc::new(Forwarder::start(server_port).await);
        let pool = SqlitePool::connect(&url).await.expect("the example's database");
        Shop { _server: server, server_port, front, pool, file }
    }

    async fn client(&self, layer: IdempotencyLayer) -> PaymentsClient<Idempotent<Channel>> {
        let endpoint = Channel::from_shared(format!("http://127.0.0.1:{}", self.front.port())).unwrap();
        let channel =
            tokio::time::timeout(Duration::from_secs(30), endpoint.connect()).await.unwrap().expect("a channel");
        let mut client = PaymentsClient::new(layer.layer(channel));
        // One call answered first (refused: no caller), so that every frame
        // of the connection's start has crossed before a test holds replies.
        let mut anonymous = pay(1, 1, None);
        anonymous.metadata_mut().remove("x-user-id");
        let answer = tokio::time::timeout(Duration::from_secs(30), client.pay(anonymous)).await.unwrap();
        assert_eq!(answer.unwrap_err().code(), Code::Unauthenticated);
        client
    }

    /// Executions: the order's `payments` rows.
    async fn payments(&self, order: i64) -> i64 {
        let sql = "SELECT COUNT(*) FROM payments WHERE order_id = ?";
        sqlx::query_scalar(sql).bind(order).fetch_one(&self.pool).await.expect(sql)
    }

    async fn payment_id(&self, order: i64) -> i64 {
        let sql = "SELECT id FROM payments WHERE order_id = ?";
        sqlx::query_scalar(sql).bind(order).fetch_one(&self.pool).await.expect(sql)
    }

    /// bob's committed records' keys (`bob:<key>`); the example's own
    /// demonstration calls are alice's.
    async fn records(&self) -> Vec<String> {
        let sql = "SELECT idem_key FROM idem_record WHERE biz_type = 'grpc_pay' AND status = 1 AND idem_key LIKE 'bob:%' ORDER BY id";
        sqlx::query_scalar(sql).fetch_all(&self.pool).await.expect(sql)
    }

    async fn close(self) {
        self.pool.close().await;
        drop(self._server);
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.file.display()));
        }
    }
}

/// The retries told: (attempt, code answered, wait).
type Told = Arc<Mutex<Vec<(u32, Option<u16>, Duration)>>>;

fn layer(retries: Retries, told: &Told, also: impl Fn(&Retrying<'_>) + Send + Sync + 'static) -> IdempotencyLayer {
    let told = Arc::clone(told);
    IdempotencyLayer::new(retries).on_retry(move |retrying| {
        told.lock().unwrap().push((retrying.attempt, retrying.answered, retrying.wait));
        also(retrying);
    })
}

/// bob pays `order`, with `key` when given.
fn pay(order_id: i64, amount: i64, key: Option<&str>) -> Request<PayRequest> {
    let mut request = Request::new(PayRequest { order_id, amount });
    request.metadata_mut().insert("x-user-id", "bob".parse().unwrap());
    if let Some(key) = key {
        request.metadata_mut().insert("idempotency-key", key.parse().unwrap());
    }
    request
}

fn told_of(answer: &Result<Response<PayReply>, Status>) -> Outcome {
    outcome(answer).unwrap_or_else(|| panic!("no outcome on {answer:?}"))
}

async fn within<T>(what: &str, event: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), event).await.unwrap_or_else(|_| panic!("{what} did not happen"))
}

/// The reply lost after the server committed: the client sees the
/// connection cut, calls again with the same key on a new connection, and
/// gets the replay, marked. One payment, one record.
#[tokio::test]
async fn a_reply_lost_after_the_commit_is_replayed() {
    let shop = Shop::open().await;
    let told = Told::default();
    let mut client = shop.client(layer(Retries::default(), &told, |_| {})).await;
    let mut answered = shop.front.held_replies();
    shop.front.hold(Hold::Replies);
    let paying = tokio::spawn(async move { client.pay(pay(60, 1999, None)).await });
    within("the server's reply", answered.wait_for(|bytes| *bytes > 0)).await.unwrap();
    assert_eq!((shop.payments(60).await, shop.records().await.len()), (1, 1), "committed before it replied");
    shop.front.switch(shop.server_port);
    let answer = within("the retry", paying).await.unwrap();
    let told_now = told_of(&answer);
    let reply = answer.expect("a reply").into_inner();
    assert_eq!((told_now.attempts, told_now.replayed, told_now.stop), (2, true, Stop::Final));
    assert_eq!((reply.payment_id, reply.amount), (shop.payment_id(60).await, 1999));
    assert_eq!(told.lock().unwrap().iter().map(|t| (t.0, t.1)).collect::<Vec<_>>(), [(1, None)]);
    assert_eq!(shop.payments(60).await, 1);
    assert_eq!(shop.records().await, [format!("bob:{}", told_now.key)]);
    shop.close().await;
}

/// The database busy past the server's wait (a write lock the test holds
/// on the SQLite file for longer than the example's 5 s busy timeout):
/// `UNAVAILABLE` with `grpc-retry-pushback-ms: 1000`; the lock is let go
/// when the client is told, and the call, asked again after the pushback,
/// runs once.
#[tokio::test]
async fn the_database_busy_then_free_runs_once_after_the_pushback() {
    let shop = Shop::open().await;
    let mut lock = shop.pool.acquire().await.unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut *lock).await.unwrap();
    let told = Told::default();
    let (busy, mut turned_away) = tokio::sync::mpsc::unbounded_channel();
    let layer = layer(Retries::default(), &told, move |retrying| {
        let _ = busy.send(retrying.answered);
    });
    let mut client = shop.client(layer).await;
    let paying = tokio::spawn(async move { client.pay(pay(61, 1999, None)).await });
    assert_eq!(within("UNAVAILABLE", turned_away.recv()).await, Some(Some(14)), "told to come back");
    sqlx::raw_sql("COMMIT").execute(&mut *lock).await.unwrap();
    let answer = within("the retry", paying).await.unwrap();
    let told_now = told_of(&answer);
    assert_eq!((told_now.attempts, told_now.replayed), (2, false));
    assert_eq!(answer.expect("a reply").into_inner().payment_id, shop.payment_id(61).await);
    let (attempt, code, wait) = told.lock().unwrap()[0];
    assert_eq!((attempt, code), (1, Some(14)));
    assert!(wait >= Duration::from_secs(1), "the pushback honoured: {wait:?}");
    assert_eq!((shop.payments(61).await, shop.records().await.len()), (1, 1));
    drop(lock);
    shop.close().await;
}

/// The server unreachable, then back: the call is made again until it
/// runs, once. The way back opens when the client is told of the failure.
#[tokio::test]
async fn the_server_unreachable_then_back_runs_once() {
    let shop = Shop::open().await;
    let told = Told::default();
    let (front, port) = (Arc::clone(&shop.front), shop.server_port);
    let mut client = shop.client(layer(Retries::default(), &told, move |_| front.switch(port))).await;
    shop.front.cut();
    let answer = within("the call", client.pay(pay(62, 1999, None))).await;
    let told_now = told_of(&answer);
    assert_eq!((told_now.attempts, told_now.replayed), (2, false));
    assert_eq!(answer.expect("a reply").into_inner().payment_id, shop.payment_id(62).await);
    assert_eq!(told.lock().unwrap().iter().map(|t| (t.0, t.1)).collect::<Vec<_>>(), [(1, None)]);
    assert_eq!((shop.payments(62).await, shop.records().await.len()), (1, 1));
    shop.close().await;
}

/// Answers a retry cannot change come back after one attempt:
/// `FAILED_PRECONDITION` for a reused key (`idem-code:
/// IDEMPOTENCY_KEY_REUSED`, `idempotency-should-retry: false`) and for an
/// order paid before, `UNAUTHENTICATED`; a caller's key that breaks the
/// rule is refused before anything is sent.
#[tokio::test]
async fn refusals_come_back_at_once() {
    let shop = Shop::open().await;
    let told = Told::default();
    let mut client = shop.client(layer(Retries::default(), &told, |_| {})).await;
    let key = new_key();
    client.pay(pay(63, 1999, Some(&key))).await.expect("paid");
    let reused = client.pay(pay(63, 5, Some(&key))).await;
    let status = reused.as_ref().unwrap_err();
    let metadata = |name| status.metadata().get(name).map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(
        (metadata("idem-code"), metadata("idempotency-should-retry")),
        (Some("IDEMPOTENCY_KEY_REUSED".into()), Some("false".into()))
    );
    assert_eq!((told_of(&reused).attempts, told_of(&reused).stop), (1, Stop::Final));
    let paid_before = client.pay(pay(63, 1999, None)).await;
    assert_eq!(
        (paid_before.as_ref().unwrap_err().code(), told_of(&paid_before).attempts),
        (Code::FailedPrecondition, 1)
    );
    let mut anonymous = pay(63, 1999, None);
    anonymous.metadata_mut().remove("x-user-id");
    let anonymous = client.pay(anonymous).await;
    assert_eq!((anonymous.as_ref().unwrap_err().code(), told_of(&anonymous).attempts), (Code::Unauthenticated, 1));
    let refused = client.pay(pay(64, 1999, Some("short"))).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused.message().starts_with("INVALID_IDEMPOTENCY_KEY: ") && refused.message().ends_with("nothing was sent")
    );
    assert!(told.lock().unwrap().is_empty(), "nothing was asked again");
    assert_eq!((shop.payments(63).await, shop.payments(64).await, shop.records().await.len()), (1, 0, 1));
    shop.close().await;
}

/// With the server unreachable for good, the attempts stop at their count
/// (`UNAVAILABLE`); with no reply ever coming, at their total time
/// (`DEADLINE_EXCEEDED`). Each status carries the key and the attempts.
/// Nothing runs.
#[tokio::test]
async fn attempts_stop_at_their_count_and_their_time() {
    let shop = Shop::open().await;
    let mut client = shop.client(layer(Retries::default().max_attempts(3), &Told::default(), |_| {})).await;
    shop.front.cut();
    let answer = within("three attempts", client.pay(pay(65, 1999, None))).await;
    let told_now = told_of(&answer);
    assert_eq!(answer.unwrap_err().code(), Code::Unavailable);
    assert_eq!((told_now.attempts, told_now.stop), (3, Stop::Attempts));

    shop.front.switch(shop.server_port);
    let total = Duration::from_secs(2);
    let mut client = shop.client(layer(Retries::default().total(total), &Told::default(), |_| {})).await;
    shop.front.hold(Hold::Everything);
    let answer = within("the total", client.pay(pay(65, 1999, None))).await;
    let told_now = told_of(&answer);
    assert_eq!(answer.unwrap_err().code(), Code::DeadlineExceeded);
    assert_eq!((told_now.attempts, told_now.stop), (1, Stop::Time));
    shop.front.cut(); // the held call never reaches the server
    assert_eq!((shop.payments(65).await, shop.records().await.len()), (0, 0));
    shop.close().await;
}
