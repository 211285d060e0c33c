//! With a Redis claim, a first call's `BEGIN` goes out while its claim is
//! in flight (a round trip saved on a server), and a call the claim turns
//! away gives its connection back outside any transaction; so does a call
//! dropped before its `BEGIN` was answered, with Redis or without. Redis is a
//! private server whose writes (every claim is a script) the test holds.
//! SQLite opens after the claim, as before: its statements run on a worker
//! thread this count does not see, so there the test checks the outcome.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::Idem;
use idempotency_testkit::servers::RedisServer;
use idempotency_testkit::{TestBackend, redis_pause_writes, redis_unpause, unique};
use tokio::task::JoinHandle;

use super::fixture::{Mode, Probe, Receipt, TestError, ledger_rows, lent, pay, record_rows_for, until};
use super::statements::{count_statements, statements};
use super::{B, Db};

/// How long an engine waits for Redis where the test holds a claim that
/// must not time out (and fall back to the database alone) on a slow machine.
const CLAIM_HELD: Duration = Duration::from_secs(60);

/// Where the test drops the call instead: its claim, answered after the
/// call is gone, is released once this has passed (the engine's default).
const RELEASE_AFTER: Duration = Duration::from_millis(500);

/// Whether this backend opens early (SQLite does not).
const EARLY: bool = !matches!(B::NAME.as_bytes(), b"sqlite");

/// An engine on a private Redis (waited for `redis_timeout`) and a database
/// of its own (what the server shows of its sessions is this test's alone),
/// its scripts loaded by a first call.
async fn engine(redis_timeout: Duration) -> Option<(RedisServer, Idem<Db>, sqlx::Pool<Db>, String)> {
    let server = RedisServer::start()?;
    let name = unique("early").replace('-', "_");
    let pool = B::open_private(&name, 4).await?;
    B::prepare(&pool).await;
    let idem = Idem::builder(pool.clone()).redis(server.client()).redis_timeout(redis_timeout).build();
    idem.migrate().await.expect("migrate");
    pay(&idem, unique("warm"), 1, &Probe::default(), Mode::Ok).await.unwrap();
    Some((server, idem, pool, name))
}

/// Waits until `server` holds `n` cached results (written after a call answered).
async fn until_cached(server: &RedisServer, idem: &Idem<Db>, n: i64) {
    let namespace = idem.redis_namespace().await.expect("namespace").expect("migrated");
    until("the results landed in Redis", || server.results_held(namespace.as_str()) >= n).await;
}

/// Sessions of `pool`'s database idle inside a transaction (PostgreSQL).
async fn idle_in_transaction(pool: &sqlx::Pool<Db>) -> i64 {
    let sql = "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'";
    sqlx::query_scalar::<_, i64>(sql).fetch_one(pool).await.expect("pg_stat_activity")
}

/// A `pay` of `k` on a task of its own.
fn spawn_pay(idem: &Idem<Db>, probe: &Arc<Probe>, k: &str) -> JoinHandle<Result<Receipt, TestError>> {
    let (idem, probe, k) = (idem.clone(), Arc::clone(probe), k.to_owned());
    tokio::spawn(async move { pay(&idem, k, 1, &probe, Mode::Ok).await })
}

/// Holds Redis's writes (every claim is a script) and starts a `pay` of
/// `k`; on a server, returns once its `BEGIN` is out beside the held claim.
async fn pay_with_the_claim_held(
    server: &RedisServer,
    idem: &Idem<Db>,
    probe: &Arc<Probe>,
    k: &str,
) -> JoinHandle<Result<Receipt, TestError>> {
    redis_pause_writes(&server.client()).await;
    let before = statements();
    let call = spawn_pay(idem, probe, k);
    if EARLY {
        until_begun(idem, before).await;
    }
    call
}

/// Waits until a transaction of the engine's is open: on MariaDB a
/// connection lent and its `BEGIN` among the statements sqlx logged on this
/// thread since `before`; PostgreSQL's `BEGIN` is not logged, and the
/// server shows the session idle in it.
async fn until_begun(idem: &Idem<Db>, before: usize) {
    let start = Instant::now();
    loop {
        let begun = match B::NAME {
            "postgres" => idle_in_transaction(idem.pool()).await == 1,
            _ => statements() > before && lent(idem) == 1,
        };
        if begun {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "never: BEGIN sent while the claim is held");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Connections of the pool inside a transaction (each asked on MariaDB;
/// PostgreSQL shows every session of the database).
async fn in_transaction(idem: &Idem<Db>) -> i64 {
    match B::NAME {
        "mysql" => {
            let mut conns = Vec::new();
            for _ in 0..idem.pool().size() {
                conns.push(idem.pool().acquire().await.expect("a connection"));
            }
            let mut inside = 0;
            for conn in &mut conns {
                let sql = "SELECT CAST(@@in_transaction AS SIGNED)";
                inside += sqlx::query_scalar::<_, i64>(sql).fetch_one(&mut **conn).await.expect("@@in_transaction");
            }
            inside
        }
        "postgres" => idle_in_transaction(idem.pool()).await,
        _ => 0,
    }
}

#[tokio::test]
async fn a_first_call_sends_begin_while_its_claim_is_held() {
    count_statements();
    let Some((server, idem, pool, name)) = engine(CLAIM_HELD).await else { return };
    until_cached(&server, &idem, 1).await;
    let (probe, k) = (Arc::new(Probe::default()), unique("early"));

    let call = pay_with_the_claim_held(&server, &idem, &probe, &k).await;
    assert_eq!(probe.runs(), 0, "the body waits for the claim");
    redis_unpause(&server.client()).await;

    let receipt = call.await.expect("the call's task").expect("the call");
    assert_eq!(receipt.run, 1);
    assert_eq!((probe.runs(), ledger_rows(&idem, &k).await, record_rows_for(&idem, "t_pay", &k).await), (1, 1, 1));
    drop(idem);
    B::drop_private(pool, &name).await;
}

#[tokio::test]
async fn a_duplicate_the_claim_turns_away_gives_its_connection_back_outside_a_transaction() {
    count_statements();
    let Some((server, idem, pool, name)) = engine(CLAIM_HELD).await else { return };
    let (probe, k) = (Arc::new(Probe::default()), unique("early"));
    assert_eq!(pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap().run, 1);
    until_cached(&server, &idem, 2).await;

    // Its fn's calls so far all ran: the duplicate opens early too, and the
    // claim script answers it with the cached result.
    let duplicate = pay_with_the_claim_held(&server, &idem, &probe, &k).await;
    redis_unpause(&server.client()).await;
    let replayed = duplicate.await.expect("the duplicate's task").expect("the duplicate");
    assert_eq!((replayed.run, probe.runs()), (1, 1), "replayed, not run");

    // Rolled back off its path: the connection comes back, and no
    // connection of the pool is left inside a transaction.
    until("the duplicate's connection back in the pool", || lent(&idem) == 0).await;
    assert_eq!(in_transaction(&idem).await, 0, "a connection came back inside a transaction");
    assert_eq!((ledger_rows(&idem, &k).await, record_rows_for(&idem, "t_pay", &k).await), (1, 1));
    drop(idem);
    B::drop_private(pool, &name).await;
}

#[tokio::test]
async fn a_call_dropped_while_its_claim_is_held_gives_its_connection_back_outside_a_transaction() {
    count_statements();
    let Some((server, idem, pool, name)) = engine(RELEASE_AFTER).await else { return };
    until_cached(&server, &idem, 1).await;
    let (probe, k) = (Arc::new(Probe::default()), unique("early"));

    let call = pay_with_the_claim_held(&server, &idem, &probe, &k).await;
    // The caller gives up (a timeout, a client gone): its future is dropped
    // with the claim unanswered and the transaction open.
    call.abort();
    assert!(call.await.expect_err("dropped").is_cancelled());
    redis_unpause(&server.client()).await;

    until("the dropped call's connection back in the pool", || lent(&idem) == 0).await;
    assert_eq!(in_transaction(&idem).await, 0, "a connection came back inside a transaction");
    // Its claim was released: the key runs now, once.
    let receipt = super::fixture::past_the_release(|| pay(&idem, k.clone(), 1, &probe, Mode::Ok)).await.unwrap();
    assert_eq!((receipt.run, probe.runs(), ledger_rows(&idem, &k).await), (1, 1, 1));
    drop(idem);
    B::drop_private(pool, &name).await;
}

/// The port `url` names.
fn port_of(url: &str) -> u16 {
    let address = url.rsplit_once('@').map_or(url.split_once("://").expect("a url").1, |(_, a)| a);
    let host_port = address.split(['/', '?']).next().expect("an address");
    host_port.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).expect("a port")
}

/// `url` with its host and port replaced by `127.0.0.1:port` and its
/// database by `database`.
fn through(url: &str, port: u16, database: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a url");
    let user = rest.rsplit_once('@').map_or(String::new(), |(u, _)| format!("{u}@"));
    format!("{scheme}://{user}127.0.0.1:{port}/{database}")
}

/// A call is dropped while its `BEGIN` is unanswered (the database's
/// replies held on the way): the `BEGIN` is still answered and rolled back,
/// and the connection comes back outside a transaction. With Redis the
/// `BEGIN` went out beside the claim (held too); without Redis it is the
/// call's first statement. (Dropped half-way, sqlx gave the connection back
/// inside the transaction: `store/opening.rs`.)
async fn dropped_while_begin_unanswered(with_redis: bool) {
    use idempotency_testkit::forwarder::{Forwarder, Hold};
    if !EARLY {
        return;
    }
    let Some(server) = RedisServer::start() else { return };
    let name = unique("early").replace('-', "_");
    let Some(direct) = B::open_private(&name, 2).await else { return };
    B::prepare(&direct).await;
    let url = if B::NAME == "postgres" { idempotency_testkit::pg_url() } else { idempotency_testkit::mysql_url() };
    let link = Forwarder::start(port_of(&url)).await;
    let url = through(&url, link.port(), &name);
    // No ping before a connection is lent: the held reply is `BEGIN`'s.
    let options = sqlx::pool::PoolOptions::<Db>::new().max_connections(4).test_before_acquire(false);
    let pool = options.connect(&url).await.expect("through the link");
    let builder = Idem::builder(pool.clone());
    let idem = if with_redis { builder.redis(server.client()).redis_timeout(RELEASE_AFTER) } else { builder }.build();
    idem.migrate().await.expect("migrate");
    let probe = Arc::new(Probe::default());
    pay(&idem, unique("warm"), 1, &probe, Mode::Ok).await.unwrap();
    if with_redis {
        until_cached(&server, &idem, 1).await;
    }
    until("the warm call's connection back", || lent(&idem) == 0).await;

    let (client, k) = (server.client(), unique("early"));
    if with_redis {
        redis_pause_writes(&client).await;
    }
    link.hold(Hold::Replies);
    let call = spawn_pay(&idem, &probe, &k);
    // The BEGIN reached the server (PostgreSQL shows the session in a
    // transaction); its answer is held.
    until("a connection lent for the BEGIN", || lent(&idem) == 1).await;
    if B::NAME == "postgres" {
        until_async("the BEGIN ran", || async { idle_in_transaction(&direct).await == 1 }).await;
    }
    call.abort();
    assert!(call.await.expect_err("dropped").is_cancelled());
    link.hold(Hold::Nothing);
    if with_redis {
        redis_unpause(&client).await;
    }

    until("the dropped call's connection back in the pool", || lent(&idem) == 0).await;
    assert_eq!(in_transaction(&idem).await, 0, "a connection came back inside a transaction");
    let receipt = super::fixture::past_the_release(|| pay(&idem, k.clone(), 1, &probe, Mode::Ok)).await.unwrap();
    assert_eq!((receipt.run, ledger_rows(&idem, &k).await), (2, 1), "the warm call ran first");
    drop((idem, pool, link));
    B::drop_private(direct, &name).await;
}

#[tokio::test]
async fn a_call_dropped_while_its_begin_is_unanswered_gives_its_connection_back_outside_a_transaction() {
    dropped_while_begin_unanswered(false).await;
}

#[tokio::test]
async fn a_call_dropped_while_its_begin_beside_the_claim_is_unanswered_gives_its_connection_back_outside_a_transaction()
{
    dropped_while_begin_unanswered(true).await;
}

/// [`until`] for a condition that needs a query.
async fn until_async<F: std::future::Future<Output = bool>>(what: &str, done: impl Fn() -> F) {
    let start = Instant::now();
    while !done().await {
        assert!(start.elapsed() < Duration::from_secs(30), "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
