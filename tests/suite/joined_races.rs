//! Joined calls (`join`) meeting others: callers with one key at once, a
//! caller holding its transaction past the bound, a plain duplicate while
//! the caller's transaction is open, and a caller holding `FOR UPDATE` on
//! the row its call updates.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::{Idem, Outcome, idempotent};
use idempotency_testkit::{TestBackend, unique};
use sqlx::Transaction;

use super::fixture::{
    Mode, Probe, Receipt, Redis, TestError, is_in_progress, ledger_rows, pay, pay_in, record_rows_for,
    with_and_without_redis,
};
use super::joined::{engine_with_local_cache, own_rows, own_write};
use super::{B, Db};

/// This backend's text of one statement: `[SQLite, MySQL, PostgreSQL]`.
fn sql(texts: [&'static str; 3]) -> &'static str {
    match B::NAME {
        "sqlite" => texts[0],
        "mysql" => texts[1],
        _ => texts[2],
    }
}

/// The server's id of the session `conn` is on; `None` on SQLite, whose
/// writers wait in their busy handler, out of sight.
async fn session_id(conn: &mut sqlx::pool::PoolConnection<Db>) -> Option<i64> {
    let read = sql(["", "SELECT CAST(CONNECTION_ID() AS SIGNED)", "SELECT CAST(pg_backend_pid() AS BIGINT)"]);
    if read.is_empty() {
        return None;
    }
    Some(sqlx::query_scalar(read).fetch_one(&mut **conn).await.expect("the session's id"))
}

/// The ids of the sessions of `idem`'s pool other than the `held` ones the
/// test holds: it takes every other connection the pool may hand out, then
/// gives them back (so a call started next runs on one of them). Counted
/// by the test, not read from the pool, whose count of idle connections
/// lags behind a connection just given back.
async fn free_sessions(idem: &Idem<Db>, held: u32) -> Vec<i64> {
    let pool = idem.pool();
    let mut taken = Vec::new();
    for _ in held..pool.options().get_max_connections() {
        taken.push(pool.acquire().await.expect("a connection"));
    }
    let mut ids = Vec::new();
    for conn in &mut taken {
        ids.extend(session_id(conn).await);
    }
    ids
}

/// Waits until one of `sessions` waits for a lock inside a statement on
/// `idem_record`, as the server shows it (MariaDB's lock-wait views leave
/// out some waiters; its process list shows the statement a session is
/// still inside, which here cannot end before the first caller does, after
/// the bound's `SET STATEMENT` prefix; the probe's own text is left out).
/// Returns at once on SQLite, which shows no waiters: there the outcome
/// after the first caller ends is the proof.
async fn until_one_waits_on_the_record(idem: &Idem<Db>, sessions: &[i64]) {
    if B::NAME == "sqlite" {
        return;
    }
    let probe = sql([
        "",
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST
         WHERE ID = ? AND INFO LIKE '%INSERT INTO idem_record %' AND INFO NOT LIKE 'SELECT %'",
        "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'",
    ]);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for &id in sessions {
            let waiting: i64 = sqlx::query_scalar(probe).bind(id).fetch_one(idem.pool()).await.expect("probe");
            if waiting > 0 {
                return;
            }
        }
        assert!(Instant::now() < deadline, "no session of {sessions:?} waited on the record within 30 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Callers behind a barrier, each in its own transaction, one key: one
/// execution; every other caller waits on the unique index for the first
/// commit and replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_with_one_key_at_once_execute_once() {
    const CALLERS: usize = 8;
    let Some(pool) = B::open(&unique("db"), CALLERS as u32 + 1).await else { return };
    B::prepare(&pool).await;
    let idem = Idem::new(pool);
    idem.migrate().await.expect("migrate");
    let probe = Arc::new(Probe::default());
    let barrier = Arc::new(tokio::sync::Barrier::new(CALLERS));
    let k = unique("join-race");

    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            let (idem, probe, barrier, k) = (idem.clone(), probe.clone(), barrier.clone(), k.clone());
            tokio::spawn(async move {
                let mut tx = idem.pool().begin().await.unwrap();
                barrier.wait().await;
                let (result, outcome) = idempotency::observe(pay_in(&idem, &mut tx, k, 7, &probe, Mode::Ok)).await;
                tx.commit().await.unwrap();
                (result.unwrap(), outcome.unwrap())
            })
        })
        .collect();
    let mut answers = Vec::new();
    for caller in callers {
        answers.push(caller.await.unwrap());
    }
    let executed = answers.iter().filter(|(_, outcome)| *outcome == Outcome::Executed).count();
    let replayed = answers.iter().filter(|(_, outcome)| *outcome == Outcome::Replayed).count();
    assert_eq!((executed, replayed), (1, CALLERS - 1), "{answers:?}");
    assert!(answers.iter().all(|(receipt, _)| *receipt == Receipt { key: k.clone(), amount: 7, run: 1 }));
    assert_eq!(probe.runs(), 1);
    assert_eq!((ledger_rows(&idem, &k).await, record_rows_for(&idem, "t_pay", &k).await), (1, 1));
}

/// The first caller rolls back while a second waits on its record: the
/// second executes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_caller_executes_when_the_first_rolls_back() {
    let Some(idem) = engine_with_local_cache(Redis::Off).await else { return };
    let probe = Arc::new(Probe::default());
    let k = unique("join-second");

    let mut first = idem.pool().begin().await.unwrap();
    pay_in(&idem, &mut first, k.clone(), 7, &probe, Mode::Ok).await.unwrap();
    let sessions = free_sessions(&idem, 1).await;
    let second = {
        let (idem, probe, k) = (idem.clone(), probe.clone(), k.clone());
        tokio::spawn(async move {
            let mut tx = idem.pool().begin().await.unwrap();
            let (result, outcome) = idempotency::observe(pay_in(&idem, &mut tx, k, 7, &probe, Mode::Ok)).await;
            tx.commit().await.unwrap();
            (result.unwrap(), outcome)
        })
    };
    until_one_waits_on_the_record(&idem, &sessions).await;
    assert!(!second.is_finished(), "the second caller waits on the first one's record");
    first.rollback().await.unwrap();
    let (receipt, outcome) = second.await.unwrap();
    assert_eq!((receipt.run, outcome), (2, Some(Outcome::Executed)));
    assert_eq!((ledger_rows(&idem, &k).await, record_rows_for(&idem, "t_pay", &k).await), (1, 1));
}

/// The session's own lock-wait setting, read inside `tx`.
async fn lock_wait_setting(tx: &mut Transaction<'_, Db>) -> String {
    let read = sql(["", "SELECT CAST(@@innodb_lock_wait_timeout AS CHAR)", "SELECT current_setting('lock_timeout')"]);
    sqlx::query_scalar(read).fetch_one(&mut **tx).await.expect("the lock-wait setting")
}

/// A caller holding its transaction open past `lock_wait`: a duplicate in
/// another transaction answers `InProgress` after the bound (not a body
/// error), and its own transaction goes on and commits. Neither caller's
/// session keeps the bound. SQLite's wait is its busy timeout instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_holding_past_the_bound_makes_the_duplicate_in_progress() {
    if !B::LOCK_WAIT_BOUNDED {
        return;
    }
    let Some(pool) = B::open(&unique("db"), 4).await else { return };
    B::prepare(&pool).await;
    let idem = Idem::builder(pool).lock_wait(Duration::from_millis(300)).build();
    idem.migrate().await.expect("migrate");
    let probe = Probe::default();
    let k = unique("join-bound");

    let mut holder = idem.pool().begin().await.unwrap();
    let setting = lock_wait_setting(&mut holder).await;
    let first = pay_in(&idem, &mut holder, k.clone(), 7, &probe, Mode::Ok).await.unwrap();
    assert_eq!(lock_wait_setting(&mut holder).await, setting, "the bound ended before the body");

    let mut other = idem.pool().begin().await.unwrap();
    own_write(&mut other, &k).await;
    let started = Instant::now();
    let waited = pay_in(&idem, &mut other, k.clone(), 7, &probe, Mode::Ok);
    let waited = tokio::time::timeout(Duration::from_secs(60), waited).await.expect("the wait is bounded");
    let elapsed = started.elapsed();
    assert!(is_in_progress(&waited), "{waited:?}");
    // MariaDB counts the bound in whole seconds, at least one; the upper
    // bound only tells the bound from the server's default (50 s; none).
    assert!(elapsed >= Duration::from_millis(250) && elapsed < Duration::from_secs(30), "{elapsed:?}");
    assert_eq!(lock_wait_setting(&mut other).await, setting, "no bound left on the caller's session");
    own_write(&mut other, &k).await;
    other.commit().await.unwrap();
    assert_eq!(own_rows(&idem, &k).await, 2, "the duplicate's transaction went on");

    holder.commit().await.unwrap();
    let mut retry = idem.pool().begin().await.unwrap();
    let (again, outcome) = idempotency::observe(pay_in(&idem, &mut retry, k.clone(), 7, &probe, Mode::Ok)).await;
    retry.commit().await.unwrap();
    assert_eq!((again.unwrap(), outcome), (first, Some(Outcome::Replayed)));
    assert_eq!(probe.runs(), 1);
}

/// A plain call (the engine's own transaction) while a joined one's caller
/// has not committed: it waits, then replays the joined result. Without
/// Redis it waits on the record before its body; with Redis its claim
/// lets the body run, whose record insert then waits, meets the committed
/// row, and rolls back.
async fn plain_duplicate_waits_for_the_callers_commit(redis: Redis) {
    let Some(idem) = engine_with_local_cache(redis).await else { return };
    let probe = Arc::new(Probe::default());
    let k = unique("join-plain");

    let mut caller = idem.pool().begin().await.unwrap();
    let first = pay_in(&idem, &mut caller, k.clone(), 7, &probe, Mode::Ok).await.unwrap();
    let sessions = free_sessions(&idem, 1).await;
    let plain = {
        let (idem, probe, k) = (idem.clone(), probe.clone(), k.clone());
        tokio::spawn(async move { idempotency::observe(pay(&idem, k, 7, &probe, Mode::Ok)).await })
    };
    until_one_waits_on_the_record(&idem, &sessions).await;
    assert!(!plain.is_finished(), "the plain call waits for the caller");
    caller.commit().await.unwrap();
    let (plain, outcome) = plain.await.unwrap();
    assert_eq!((plain.unwrap(), outcome), (first, Some(Outcome::Replayed)));
    assert_eq!(probe.runs(), if redis == Redis::On { 2 } else { 1 });
    assert_eq!((ledger_rows(&idem, &k).await, record_rows_for(&idem, "t_pay", &k).await), (1, 1));
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_plain_duplicate_waits_for_the_joined_callers_commit,
    a_plain_duplicate_waits_for_the_joined_callers_commit_with_redis => plain_duplicate_waits_for_the_callers_commit
);

/// Regression: a plain call holding a Redis claim inserts its record after
/// its body, and that insert waited on the unique index for as long as a
/// joined caller's transaction held the key (it had no bound). A caller
/// holds its transaction up to 30 s: a plain duplicate answers `InProgress`
/// within the engine's `lock_wait` (1 s) while the caller still holds it,
/// with Redis (its body ran and rolled back) and without (it waited before
/// its body); once the caller commits, the duplicate replays its result.
/// SQLite's wait is its busy timeout instead.
async fn plain_duplicate_of_a_caller_holding_30_s(redis: Redis) {
    if !B::LOCK_WAIT_BOUNDED {
        return;
    }
    // A database of its own: a caller holding the shared tables for up to
    // 30 s queued every other test's DDL (`CREATE .. IF NOT EXISTS` takes a
    // table lock on PostgreSQL) behind it, and their writes behind that
    // (seen: another test's duplicate InProgress, and this one's body
    // blocked until the caller committed).
    let name = unique("held30").replace('-', "_");
    let Some(pool) = B::open_private(&name, 4).await else { return };
    B::prepare(&pool).await;
    let builder = Idem::builder(pool.clone()).lock_wait(Duration::from_secs(1));
    let idem = match redis {
        Redis::On => {
            let Some(client) = idempotency_testkit::redis_client().await else { return };
            builder.redis(client).build()
        }
        Redis::Off | Redis::DeadPort => builder.build(),
    };
    idem.migrate().await.expect("migrate");
    let probe = Arc::new(Probe::default());
    let k = unique("join-held");
    // A first call of its own: the engine has read the database's clock and
    // namespace, and its pool holds a connection for the duplicate's body
    // (on a loaded server, a new connection can wait as long as the caller).
    pay(&idem, unique("join-held-warm"), 7, &Probe::default(), Mode::Ok).await.unwrap();

    let mut caller = idem.pool().begin().await.unwrap();
    let first = pay_in(&idem, &mut caller, k.clone(), 7, &probe, Mode::Ok).await.unwrap();
    let release = Arc::new(tokio::sync::Notify::new());
    let committed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let holder = {
        let (release, committed) = (release.clone(), committed.clone());
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(30), release.notified()).await;
            caller.commit().await.unwrap();
            committed.store(true, std::sync::atomic::Ordering::SeqCst);
        })
    };
    let (duplicate, outcome) = idempotency::observe(pay(&idem, k.clone(), 7, &probe, Mode::Ok)).await;
    assert!(!committed.load(std::sync::atomic::Ordering::SeqCst), "answered only once the caller committed");
    assert!(is_in_progress(&duplicate), "{duplicate:?}");
    assert_eq!(outcome, Some(Outcome::InProgress));
    assert_eq!(probe.runs(), if redis == Redis::On { 2 } else { 1 }, "with a claim the body ran, without it did not");

    release.notify_one();
    holder.await.unwrap();
    let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 7, &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap(), outcome), (first, Some(Outcome::Replayed)));
    assert_eq!((ledger_rows(&idem, &k).await, record_rows_for(&idem, "t_pay", &k).await), (1, 1));
    idem.pool().close().await;
    B::drop_private(pool, &name).await;
}

with_and_without_redis!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_plain_duplicate_of_a_caller_holding_30_s_is_in_progress_after_lock_wait,
    a_plain_duplicate_of_a_caller_holding_30_s_is_in_progress_after_lock_wait_with_redis => plain_duplicate_of_a_caller_holding_30_s
);

/// Orders a test creates, one row per key (so tests never share a lock).
const ORDERS_DDL: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS idem_test_join_orders (k VARCHAR(255) NOT NULL PRIMARY KEY, status VARCHAR(16) NOT NULL)",
    "CREATE TABLE IF NOT EXISTS idem_test_join_orders (k VARCHAR(255) NOT NULL PRIMARY KEY, status VARCHAR(16) NOT NULL)",
    "SELECT pg_advisory_xact_lock(7306232718293625); \
     CREATE TABLE IF NOT EXISTS idem_test_join_orders (k VARCHAR(255) NOT NULL PRIMARY KEY, status VARCHAR(16) NOT NULL)",
];
const NEW_ORDER: [&str; 3] = [
    "INSERT INTO idem_test_join_orders (k, status) VALUES (?, 'PENDING')",
    "INSERT INTO idem_test_join_orders (k, status) VALUES (?, 'PENDING')",
    "INSERT INTO idem_test_join_orders (k, status) VALUES ($1, 'PENDING')",
];
/// Locks the order row until the transaction ends (SQLite: its write lock).
const LOCK_ORDER: [&str; 3] = [
    "UPDATE idem_test_join_orders SET status = status WHERE k = ?",
    "SELECT status FROM idem_test_join_orders WHERE k = ? FOR UPDATE",
    "SELECT status FROM idem_test_join_orders WHERE k = $1 FOR UPDATE",
];
const ORDER_STATUS: [&str; 3] = [
    "SELECT status FROM idem_test_join_orders WHERE k = ?",
    "SELECT status FROM idem_test_join_orders WHERE k = ?",
    "SELECT status FROM idem_test_join_orders WHERE k = $1",
];

/// Pays the order, in the caller's transaction.
#[idempotent(key = "order_<k>", ttl = "1h", biz = "t_order", join)]
async fn pay_order(idem: &Idem<Db>, tx: &mut Transaction<'_, Db>, k: String) -> Result<u64, TestError> {
    let paid = sqlx::query(sql([
        "UPDATE idem_test_join_orders SET status = 'PAID' WHERE k = ? AND status = 'PENDING'",
        "UPDATE idem_test_join_orders SET status = 'PAID' WHERE k = ? AND status = 'PENDING'",
        "UPDATE idem_test_join_orders SET status = 'PAID' WHERE k = $1 AND status = 'PENDING'",
    ]))
    .bind(&k)
    .execute(&mut **tx)
    .await?;
    Ok(paid.rows_affected())
}

/// The deadlock: a caller holding `FOR UPDATE` on the order row
/// calls the fn that updates it. Joined, the body runs on the caller's own
/// connection, so it never waits on the caller's lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_holding_for_update_on_the_row_does_not_deadlock() {
    let Some(idem) = engine_with_local_cache(Redis::Off).await else { return };
    sqlx::raw_sql(sql(ORDERS_DDL)).execute(idem.pool()).await.expect("orders table");
    let k = unique("join-locked");
    sqlx::query(sql(NEW_ORDER)).bind(&k).execute(idem.pool()).await.unwrap();
    let status = || async { sqlx::query_scalar::<_, String>(sql(ORDER_STATUS)).bind(&k).fetch_one(idem.pool()).await };

    for expected in [Outcome::Executed, Outcome::Replayed] {
        let mut tx = idem.pool().begin().await.unwrap();
        sqlx::query(sql(LOCK_ORDER)).bind(&k).execute(&mut *tx).await.unwrap();
        let call = idempotency::observe(pay_order(&idem, &mut tx, k.clone()));
        let (paid, outcome) = tokio::time::timeout(Duration::from_secs(10), call).await.expect("no deadlock");
        tx.commit().await.unwrap();
        // The replay answers the first result, 1 row, not what the body would find now.
        assert_eq!((paid.unwrap(), outcome.unwrap()), (1, expected));
    }
    assert_eq!(status().await.unwrap(), "PAID");
    assert_eq!(record_rows_for(&idem, "t_order", &format!("order_{k}")).await, 1);
}
