//! A duplicate of a running call waits for its answer (`wait`, per fn or
//! `Builder::wait`), told by Redis when it ends rather than polling: it gets
//! the first call's result (or goes ahead as a first call if that one
//! failed), and `InProgress` only once its bound passes, having read the
//! record once more. A pub/sub connection that goes silent is noticed and
//! its waiters ask the claim at intervals, each within its bound. Two
//! engines on one database and one Redis stand for two instances. Every
//! wait here ends on the event (the first call let go), seen through
//! Redis's own count of subscribers or the proxy's; the bounds are
//! generous, only against hangs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::{Idem, Outcome, idempotent};
use idempotency_testkit::forwarder::Forwarder;
use idempotency_testkit::servers::RedisServer;
use idempotency_testkit::{TestBackend, redis_del, redis_set, unique};
use sqlx::Transaction;
use tokio::task::JoinHandle;

use super::fixture::{
    Mode, Probe, Receipt, TestError, body, is_in_progress, ledger_rows, lent, pay, redis_location, until, until_held,
};
use super::{B, Db};

/// `pay`'s twin that waits for a running duplicate whatever the engine says.
#[idempotent(key = "<k>", ttl = "1h", biz = "t_wait", wait = "30s")]
async fn pay_waiting(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    #[idem(skip)] probe: &Probe,
    #[idem(skip)] mode: Mode,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, amount, probe, mode).await?;
    Ok(Receipt { key: k, amount, run })
}

/// A call's answer and its outcome, as a duplicate in a task of its own got them.
type Answered = (Result<Receipt, TestError>, Option<Outcome>);

/// Instances over one database and one Redis (the shared one, or a private
/// server a test reaches through a proxy); `None` when a server is
/// unreachable.
struct Fleet {
    pool: sqlx::Pool<Db>,
    redis: redis::Client,
    /// A private server, when the fleet has one.
    server: Option<RedisServer>,
}

impl Fleet {
    /// Over the shared Redis.
    async fn shared() -> Option<Fleet> {
        let redis = idempotency_testkit::redis_client().await?;
        Self::over(redis, None).await
    }

    /// Over a private Redis, for proxies between it and an instance.
    async fn private() -> Option<Fleet> {
        let server = RedisServer::start()?;
        Self::over(server.client(), Some(server)).await
    }

    async fn over(redis: redis::Client, server: Option<RedisServer>) -> Option<Fleet> {
        let pool = B::open(&unique("db"), 24).await?;
        B::prepare(&pool).await;
        let fleet = Fleet { pool, redis, server };
        fleet.instance(Duration::ZERO).migrate().await.expect("migrate");
        Some(fleet)
    }

    /// An instance whose duplicates wait `wait` by default.
    fn instance(&self, wait: Duration) -> Idem<Db> {
        Idem::builder(self.pool.clone()).redis(self.redis.clone()).wait(wait).build()
    }

    /// An instance that reaches the private Redis through `proxy`.
    fn through(&self, proxy: &Forwarder, wait: Duration) -> Idem<Db> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}", proxy.port())).expect("redis url");
        Idem::builder(self.pool.clone()).redis(client).wait(wait).build()
    }

    /// A proxy to the private Redis.
    async fn proxy(&self) -> Forwarder {
        Forwarder::start(self.server.as_ref().expect("a private redis").port()).await
    }
}

/// A first call of `k` on `idem` (`pay`, or `pay_waiting` when
/// `own_wait`), its body held at its gate until `probe.open()`: its claim
/// taken and its statements done.
async fn hold_first(
    idem: &Idem<Db>,
    k: &str,
    probe: &Arc<Probe>,
    mode: Mode,
    own_wait: bool,
) -> JoinHandle<Result<Receipt, TestError>> {
    let (idem, k, held) = (idem.clone(), k.to_owned(), Arc::clone(probe));
    let first = tokio::spawn(async move {
        if own_wait { pay_waiting(&idem, k, 7, &held, mode).await } else { pay(&idem, k, 7, &held, mode).await }
    });
    until_held(probe).await;
    first
}

/// A duplicate of `k` on `idem` in a task of its own (`pay`, or
/// `pay_waiting` when `own_wait`), and when it answered.
fn duplicate(idem: &Idem<Db>, k: &str, probe: &Arc<Probe>, own_wait: bool) -> JoinHandle<(Answered, Instant)> {
    let (idem, k, probe) = (idem.clone(), k.to_owned(), Arc::clone(probe));
    tokio::spawn(async move {
        let answered = if own_wait {
            idempotency::observe(pay_waiting(&idem, k, 7, &probe, Mode::Ok)).await
        } else {
            idempotency::observe(pay(&idem, k, 7, &probe, Mode::Ok)).await
        };
        (answered, Instant::now())
    })
}

/// `n` duplicates of `k`, taking turns over `instances`.
fn duplicates(instances: &[&Idem<Db>], n: usize, k: &str, probe: &Arc<Probe>) -> Vec<JoinHandle<(Answered, Instant)>> {
    (0..n).map(|i| duplicate(instances[i % instances.len()], k, probe, false)).collect()
}

/// The answer of a duplicate's task, within 60 s (only against a hang).
async fn answer(duplicate: JoinHandle<(Answered, Instant)>) -> (Answered, Instant) {
    tokio::time::timeout(Duration::from_secs(60), duplicate).await.expect("the duplicate hung").unwrap()
}

/// Until Redis (`redis`) counts `n` subscribers on the claim's channel of
/// `(biz, k)`: one per engine with waiters.
async fn until_waiting(redis: &redis::Client, idem: &Idem<Db>, biz: &str, k: &str, n: i64) {
    let at = redis_location(idem, biz, k).await;
    let mut conn = redis.get_multiplexed_async_connection().await.expect("redis");
    let start = Instant::now();
    loop {
        let counts: Vec<(String, i64)> =
            redis::cmd("PUBSUB").arg("NUMSUB").arg(&at.claim).query_async(&mut conn).await.expect("NUMSUB");
        if counts.first().map_or(0, |(_, count)| *count) >= n {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{counts:?}: the duplicates never waited");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Duplicates on both instances while the first call is held: each waits
/// (as Redis's subscriber count shows), and once the first is let go every
/// one replays its result; the body ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_wait_for_the_running_call_and_get_its_result() {
    let Some(fleet) = Fleet::shared().await else { return };
    let (a, b) = (fleet.instance(Duration::from_secs(30)), fleet.instance(Duration::from_secs(30)));
    let (probe, k) = (Arc::new(Probe::default()), unique("wait"));
    let first = hold_first(&a, &k, &probe, Mode::HeldThenOk, false).await;
    let waiting = duplicates(&[&a, &b], 8, &k, &probe);
    until_waiting(&fleet.redis, &a, "t_pay", &k, 2).await;
    assert!(waiting.iter().all(|d| !d.is_finished()), "a duplicate answered while the first ran");
    // Waiting, they hold no connection (one opened beside its claim was
    // rolled back): the first call's is the one lent.
    until("the waiters hold no connection", || lent(&a) == 1).await;
    probe.open();
    let first = first.await.unwrap().expect("the first call");
    for duplicate in waiting {
        let ((answered, outcome), _) = answer(duplicate).await;
        assert_eq!((answered.expect("waited and replayed"), outcome), (first.clone(), Some(Outcome::Replayed)));
    }
    assert_eq!((probe.runs(), ledger_rows(&a, &k).await), (1, 1));
}

/// The first call fails while duplicates wait: one of them goes ahead as a
/// first call, and every other replays its result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_goes_ahead_when_the_running_call_fails() {
    let Some(fleet) = Fleet::shared().await else { return };
    let (a, b) = (fleet.instance(Duration::from_secs(30)), fleet.instance(Duration::from_secs(30)));
    let (probe, k) = (Arc::new(Probe::default()), unique("wait-fail"));
    let first = hold_first(&a, &k, &probe, Mode::HeldThenFail, false).await;
    let waiting = duplicates(&[&a, &b], 6, &k, &probe);
    until_waiting(&fleet.redis, &a, "t_pay", &k, 2).await;
    probe.open();
    assert!(matches!(first.await.unwrap(), Err(TestError::Body)));
    let mut answers = Vec::new();
    for duplicate in waiting {
        let ((answered, outcome), _) = answer(duplicate).await;
        answers.push((answered.expect("an answer"), outcome.expect("an outcome")));
    }
    let executed = answers.iter().filter(|(_, o)| *o == Outcome::Executed).count();
    assert_eq!(executed, 1, "{answers:?}");
    assert!(answers.iter().all(|(receipt, _)| receipt.run == 2), "{answers:?}");
    assert_eq!((probe.runs(), ledger_rows(&a, &k).await), (2, 1));
}

/// Past its bound a waiter answers `InProgress` while the first still runs;
/// a fn's own `wait` overrides the engine's zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bound_ends_a_wait_and_a_fns_own_wait_overrides_the_engines() {
    let Some(fleet) = Fleet::shared().await else { return };
    let (a, b) = (fleet.instance(Duration::from_millis(200)), fleet.instance(Duration::from_millis(200)));
    let (probe, k) = (Arc::new(Probe::default()), unique("wait-bound"));
    let first = hold_first(&a, &k, &probe, Mode::HeldThenOk, false).await;
    let (bounded, outcome) = idempotency::observe(pay(&b, k.clone(), 7, &probe, Mode::Ok)).await;
    assert!(is_in_progress(&bounded), "{bounded:?}");
    assert_eq!(outcome, Some(Outcome::InProgress));
    probe.open();
    first.await.unwrap().expect("the first call");

    // Instances that do not wait, and a fn that does.
    let (a, b) = (fleet.instance(Duration::ZERO), fleet.instance(Duration::ZERO));
    let (probe, k) = (Arc::new(Probe::default()), unique("wait-fn"));
    let held = hold_first(&a, &k, &probe, Mode::HeldThenOk, true).await;
    let waiting = duplicate(&b, &k, &probe, true);
    until_waiting(&fleet.redis, &a, "t_wait", &k, 1).await;
    probe.open();
    let held = held.await.unwrap().expect("the first call");
    let ((answered, outcome), _) = answer(waiting).await;
    assert_eq!((answered.expect("waited"), outcome), (held, Some(Outcome::Replayed)));
}

/// Regression (issue 52.2): the pub/sub connection goes silent once it
/// subscribes (a NAT or load balancer that dropped it, a host gone): its
/// SUBSCRIBE is never confirmed. A duplicate with `wait(1s)` still answers
/// `InProgress` within its bound (and the Redis timeout), not after TCP
/// gives up, 15 minutes on; one with `wait(30s)` gets the first call's
/// result soon after it ends, asking the claim at intervals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_subscription_is_never_confirmed_answers_within_its_bound() {
    const WAIT: Duration = Duration::from_secs(1);
    // The Redis timeout (500 ms by default), and a loaded machine's slack.
    const SLACK: Duration = Duration::from_millis(5_500);
    let Some(fleet) = Fleet::private().await else { return };
    let proxy = fleet.proxy().await;
    proxy.silence_subscribers();
    let a = fleet.instance(Duration::ZERO);
    let (probe, k) = (Arc::new(Probe::default()), unique("wait-silent"));
    let first = hold_first(&a, &k, &probe, Mode::HeldThenOk, false).await;

    let bounded = fleet.through(&proxy, WAIT);
    let asked = Instant::now();
    let ((answered, outcome), answered_at) = answer(duplicate(&bounded, &k, &probe, false)).await;
    assert!(is_in_progress(&answered), "{answered:?}");
    assert_eq!(outcome, Some(Outcome::InProgress));
    let took = answered_at - asked;
    assert!(took < WAIT + SLACK, "answered after {took:?}, its bound is {WAIT:?}");
    assert!(proxy.subscribers() >= 1, "its subscription was silenced");

    // Another instance, waiting long: its subscription is silenced too; it
    // asks the claim at intervals and replays the result soon after.
    let patient = fleet.through(&proxy, Duration::from_secs(30));
    let silenced = proxy.subscribers();
    let waiting = duplicate(&patient, &k, &probe, false);
    until("the patient waiter subscribed", || proxy.subscribers() > silenced).await;
    probe.open();
    let released = Instant::now();
    let first = first.await.unwrap().expect("the first call");
    let ((answered, outcome), answered_at) = answer(waiting).await;
    assert_eq!((answered.expect("replayed"), outcome), (first, Some(Outcome::Replayed)));
    let took = answered_at - released;
    assert!(took < Duration::from_secs(10), "answered {took:?} after the first call ended (bound 30 s)");
    assert_eq!(probe.runs(), 1);
}

/// Regression (issue 52.2): a pub/sub connection that goes silent after its
/// subscription was confirmed (the end's publish never arrives) is noticed
/// by a ping within the Redis timeout: the waiter asks the claim at
/// intervals and replays the result soon after the first call ends, not
/// at its 30 s bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pub_sub_connection_gone_silent_is_noticed_and_its_waiters_ask_the_claim() {
    let Some(fleet) = Fleet::private().await else { return };
    let proxy = fleet.proxy().await;
    let a = fleet.instance(Duration::ZERO);
    let (probe, k) = (Arc::new(Probe::default()), unique("wait-gone"));
    let first = hold_first(&a, &k, &probe, Mode::HeldThenOk, false).await;
    let patient = fleet.through(&proxy, Duration::from_secs(30));
    let waiting = duplicate(&patient, &k, &probe, false);
    until_waiting(&fleet.redis, &a, "t_pay", &k, 1).await;
    proxy.silence_subscribers();
    probe.open();
    let released = Instant::now();
    let first = first.await.unwrap().expect("the first call");
    let ((answered, outcome), answered_at) = answer(waiting).await;
    assert_eq!((answered.expect("replayed"), outcome), (first, Some(Outcome::Replayed)));
    let took = answered_at - released;
    assert!(took < Duration::from_secs(10), "answered {took:?} after the first call ended (bound 30 s)");
    assert_eq!(probe.runs(), 1);
}

/// Regression (issue 52.3): a claim that outlives its call's commit (the
/// process died after `COMMIT`, or its cache write never landed) sends no
/// publish. A waiter past its bound reads the record once more and replays
/// it, rather than answering `InProgress`. The claim is forged; the record
/// is committed by an instance without Redis once the waiter waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_its_bound_a_waiter_replays_a_record_committed_without_a_publish() {
    let Some(fleet) = Fleet::shared().await else { return };
    let waiter = fleet.instance(Duration::from_secs(5));
    let (probe, k) = (Arc::new(Probe::default()), unique("wait-stale"));
    let claim = redis_location(&waiter, "t_pay", &k).await.claim;
    redis_set(&fleet.redis, &claim, "p:crashed:0000", 60_000).await;

    let waiting = duplicate(&waiter, &k, &probe, false);
    // Subscribed: it read the record (absent) and waits for a publish.
    until_waiting(&fleet.redis, &waiter, "t_pay", &k, 1).await;
    let without_redis = Idem::new(fleet.pool.clone());
    let committed = pay(&without_redis, k.clone(), 7, &probe, Mode::Ok).await.expect("committed without Redis");
    let ((answered, outcome), _) = answer(waiting).await;
    assert_eq!((answered.expect("replayed from the record"), outcome), (committed, Some(Outcome::Replayed)));
    assert_eq!((probe.runs(), ledger_rows(&waiter, &k).await), (1, 1));
    redis_del(&fleet.redis, &claim).await;
}

/// Regression (issue 52.4): `wait(Duration::MAX)` panicked ("overflow when
/// adding duration to instant"). It means no bound: the duplicate waits
/// until the first call ends, and replays its result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_of_duration_max_has_no_bound() {
    let Some(fleet) = Fleet::shared().await else { return };
    let (a, b) = (fleet.instance(Duration::ZERO), fleet.instance(Duration::MAX));
    let (probe, k) = (Arc::new(Probe::default()), unique("wait-max"));
    let first = hold_first(&a, &k, &probe, Mode::HeldThenOk, false).await;
    let waiting = duplicate(&b, &k, &probe, false);
    until_waiting(&fleet.redis, &a, "t_pay", &k, 1).await;
    assert!(!waiting.is_finished(), "the duplicate answered while the first ran");
    probe.open();
    let first = first.await.unwrap().expect("the first call");
    let ((answered, outcome), _) = answer(waiting).await;
    assert_eq!((answered.expect("waited"), outcome), (first, Some(Outcome::Replayed)));
    assert_eq!(probe.runs(), 1);
}
