//! The whole path on Redis Streams, under faults, reconciled.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use idempotency::redis_streams::Consumer;
use idempotency::{Idem, Outcome, idempotent};
use redis::aio::MultiplexedConnection;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{MySql, Transaction};
use tokio::sync::{Notify, oneshot};

use crate::support::*;

/// Publishes outbox messages to a Redis stream (`XADD <stream> * message_id
/// <id> payload <json>`): what a Redis Streams relay is. Faults: every
/// `duplicate_every`th message is appended twice (a copy with a new entry
/// id), and when `crash_next` is set, the batch is published and the relay
/// then never returns (its task is aborted before it marks the rows sent:
/// they are published again).
struct StreamPublisher {
    conn: MultiplexedConnection,
    stream: String,
    counts: Arc<RelayCounts>,
    crash_next: Arc<AtomicBool>,
    crashed: Arc<Notify>,
}

#[derive(Default)]
struct RelayCounts {
    appended: AtomicU64,
    duplicated: AtomicU64,
    crashed_messages: AtomicU64,
    crashes: AtomicU64,
}

const DUPLICATE_EVERY: u64 = 7;

impl idempotency::outbox::Publisher for StreamPublisher {
    async fn publish(&mut self, batch: &[idempotency::outbox::Message]) -> Vec<idempotency::outbox::Confirm> {
        let mut answers = Vec::new();
        for message in batch {
            let fields: [(&str, &[u8]); 2] =
                [("message_id", message.id().as_bytes()), ("payload", message.payload().as_bytes())];
            let mut cmd = redis::cmd("XADD");
            cmd.arg(&self.stream).arg("*");
            for (f, v) in fields {
                cmd.arg(f).arg(v);
            }
            match cmd.query_async::<String>(&mut self.conn).await {
                Ok(_) => {
                    let n = self.counts.appended.fetch_add(1, SeqCst) + 1;
                    if n.is_multiple_of(DUPLICATE_EVERY) && cmd.query_async::<String>(&mut self.conn).await.is_ok() {
                        self.counts.duplicated.fetch_add(1, SeqCst);
                    }
                    answers.push(idempotency::outbox::Confirm::Sent { duplicate: false });
                }
                Err(e) => answers.push(idempotency::outbox::Confirm::Unconfirmed(e.to_string())),
            }
        }
        if self.crash_next.swap(false, SeqCst) {
            self.counts.crashes.fetch_add(1, SeqCst);
            self.counts.crashed_messages.fetch_add(batch.len() as u64, SeqCst);
            self.crashed.notify_one();
            std::future::pending::<()>().await;
        }
        answers
    }
}

#[idempotent(key = "order_<order_id>_pay", ttl = "1h", biz = "t_rs_pay")]
async fn pay(
    idem: &Idem<MySql>,
    tx: &mut Transaction<'_, MySql>,
    order_id: i64,
    sku: String,
    stream: String,
    roll_back: bool,
) -> Result<i64, StockError> {
    sqlx::query("INSERT INTO idem_rs_payments (order_id, sku) VALUES (?, ?)")
        .bind(order_id)
        .bind(&sku)
        .execute(&mut **tx)
        .await?;
    let paid = OrderPaid { order_id, sku, qty: 1 };
    idempotency::outbox::queue(
        tx,
        idempotency::outbox::Event::json(stream, &paid)?.aggregate(format!("order-{order_id}")),
    )
    .await?;
    if roll_back {
        return Err(StockError::RolledBack);
    }
    Ok(order_id)
}

/// What the consumers saw.
#[derive(Default)]
struct Seen {
    executed: AtomicU64,
    replayed: AtomicU64,
    in_progress: AtomicU64,
    other: AtomicU64,
    kills: AtomicU64,
}

/// The whole path on Redis Streams: pay calls (each order paid three times
/// at once) queue `order.paid` in their transaction; an outbox relay appends
/// the events to the stream (duplicating some, crashing between publish and
/// mark-sent so that a batch goes out again); two consumers (killed after a
/// commit and before the `XACK`, and replaced) deduct stock keyed by the
/// message id. Then it reconciles: every payment's effect exactly once,
/// none for a rolled-back body, the outbox sent, nothing pending, no dead
/// letter, every extra copy replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_through_an_outbox_relay_with_duplicates_and_kills_every_effect_once() {
    let started = Instant::now();
    // A database of the run's own: the outbox's counts are the run's alone.
    let Some(client) = idempotency_testkit::redis_client().await else { return };
    let Some(admin) = idempotency_testkit::reach("mysql", || async {
        MySqlPoolOptions::new().max_connections(1).connect(&idempotency_testkit::mysql_url()).await.ok()
    })
    .await
    else {
        return;
    };
    let database = format!("rs_e2e_{}", order_id());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}"))).execute(&admin).await.unwrap();
    let options: sqlx::mysql::MySqlConnectOptions = idempotency_testkit::mysql_url().parse().unwrap();
    let pool = MySqlPoolOptions::new().max_connections(12).connect_with(options.database(&database)).await.unwrap();
    let w = world_on(engine_on(pool, Some(&client)).await, client, 1_000_000).await;
    sqlx::raw_sql("CREATE TABLE idem_rs_payments (order_id BIGINT PRIMARY KEY, sku VARCHAR(64) NOT NULL)")
        .execute(w.idem.pool())
        .await
        .unwrap();
    const ORDERS: i64 = 500;
    const KILLS: u64 = 5;
    // Ids no other call takes: `order_id` steps 1000 per microsecond.
    let base = order_id();
    let rolled_back = move |order: i64| (order - base) % 10 == 3;
    let payer = Idem::builder(w.idem.pool().clone()).build();

    // The relay, supervised: one that crashed is replaced.
    let counts = Arc::new(RelayCounts::default());
    let crash_next = Arc::new(AtomicBool::new(false));
    let stop_all = Arc::new(AtomicBool::new(false));
    let relay = {
        let (payer, client, stream, counts, crash_next, stop_all) =
            (payer.clone(), w.client.clone(), w.stream.clone(), counts.clone(), crash_next.clone(), stop_all.clone());
        tokio::spawn(async move {
            loop {
                let crashed = Arc::new(Notify::new());
                let publisher = StreamPublisher {
                    conn: client.get_multiplexed_async_connection().await.unwrap(),
                    stream: stream.clone(),
                    counts: counts.clone(),
                    crash_next: crash_next.clone(),
                    crashed: crashed.clone(),
                };
                let relay = idempotency::outbox::Relay::new(&payer, publisher)
                    .batch_size(20)
                    .poll_interval(Duration::from_millis(50));
                let stop_flag = stop_all.clone();
                let mut task = tokio::spawn(relay.run(async move {
                    while !stop_flag.load(SeqCst) {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }));
                tokio::select! {
                    _ = &mut task => return,
                    () = crashed.notified() => {
                        task.abort();
                        let _ = task.await;
                    }
                }
            }
        })
    };

    // Two consumers, supervised: one killed before its XACK is replaced
    // (under a new name: its entry is taken over by XAUTOCLAIM).
    let seen = Arc::new(Seen::default());
    let kill_armed = Arc::new(AtomicBool::new(false));
    let mut supervisors = Vec::new();
    for c in 0..2 {
        let (idem, client, stream, seen, kill_armed, stop_all) =
            (w.idem.clone(), w.client.clone(), w.stream.clone(), seen.clone(), kill_armed.clone(), stop_all.clone());
        supervisors.push(tokio::spawn(async move {
            for life in 0.. {
                let killed = Arc::new(Notify::new());
                let (stop_tx, stop_rx) = oneshot::channel::<()>();
                let consumer = Consumer::new(client.clone(), stream.clone(), GROUP)
                    .consumer_name(format!("e2e-{c}-{life}"))
                    .concurrency(4)
                    .claim_idle(Duration::from_millis(700))
                    .claim_interval(Duration::from_millis(50))
                    .in_progress_delay(Duration::from_millis(50))
                    .retry_delay(Duration::from_millis(50));
                let (idem, seen, kill_armed, killed_in) =
                    (idem.clone(), seen.clone(), kill_armed.clone(), killed.clone());
                let mut task = tokio::spawn(consumer.run_with_id(
                    async move {
                        let _ = stop_rx.await;
                    },
                    move |id: String, event: OrderPaid| {
                        let (idem, seen, kill_armed, killed) =
                            (idem.clone(), seen.clone(), kill_armed.clone(), killed_in.clone());
                        async move {
                            let (done, outcome) = idempotency::observe(deduct_by_id(&idem, id, event)).await;
                            if done.is_ok() && outcome == Some(Outcome::Executed) && kill_armed.swap(false, SeqCst) {
                                seen.kills.fetch_add(1, SeqCst);
                                killed.notify_one();
                                std::future::pending::<()>().await;
                            }
                            match outcome {
                                Some(Outcome::Executed) => seen.executed.fetch_add(1, SeqCst),
                                Some(Outcome::Replayed) => seen.replayed.fetch_add(1, SeqCst),
                                Some(Outcome::InProgress) => seen.in_progress.fetch_add(1, SeqCst),
                                _ => seen.other.fetch_add(1, SeqCst),
                            };
                            done
                        }
                    },
                ));
                let stopping = {
                    let stop_all = stop_all.clone();
                    async move {
                        while !stop_all.load(SeqCst) {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                };
                tokio::select! {
                    () = killed.notified() => {
                        // Dead before its XACK: its entries stay pending in its name.
                        task.abort();
                        let _ = task.await;
                    }
                    () = stopping => {
                        let _ = stop_tx.send(());
                        within("a consumer's stop", &mut task).await.unwrap().unwrap();
                        return;
                    }
                }
            }
        }));
    }

    // The pay calls: every order three times at once; every tenth rolled back.
    let mut kills_armed = 0;
    for chunk in (0..ORDERS).collect::<Vec<_>>().chunks(20) {
        let mut calls = tokio::task::JoinSet::new();
        for &i in chunk {
            let order = base + i;
            for _ in 0..3 {
                let (payer, sku, stream) = (payer.clone(), w.sku.clone(), w.stream.clone());
                calls.spawn(async move { pay(&payer, order, sku, stream, rolled_back(order)).await });
            }
        }
        while let Some(done) = calls.join_next().await {
            match done.unwrap() {
                Ok(_) | Err(StockError::RolledBack) | Err(StockError::Idem(idempotency::Error::InProgress { .. })) => {}
                Err(e) => panic!("pay: {e:?}"),
            }
        }
        // The faults, spread over the run.
        if chunk[0] % 60 == 20 {
            crash_next.store(true, SeqCst);
        }
        if chunk[0] % 60 == 40 && kills_armed < KILLS {
            kill_armed.store(true, SeqCst);
            kills_armed += 1;
        }
    }
    // A duplicate that met its first call in progress is paid again now (replays).
    for i in 0..ORDERS {
        let order = base + i;
        if !rolled_back(order) {
            pay(&payer, order, w.sku.clone(), w.stream.clone(), false).await.expect("paid");
        }
    }
    let expected: i64 = (0..ORDERS).filter(|i| !rolled_back(base + i)).count() as i64;

    // Every payment's move, every entry acked, the outbox sent.
    let stream = w.stream.clone();
    let mut conn = w.conn();
    within("every effect, nothing pending, the outbox sent", async {
        loop {
            let moves: i64 = sqlx::query_scalar("SELECT COUNT(DISTINCT order_id) FROM idem_rs_moves WHERE sku = ?")
                .bind(&w.sku)
                .fetch_one(w.idem.pool())
                .await
                .unwrap();
            let pending = pending_of(&mut conn, &stream).await.len();
            let outbox = payer.outbox().counts().await.unwrap();
            if moves >= expected && pending == 0 && outbox.pending == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    stop_all.store(true, SeqCst);
    for s in supervisors {
        within("a consumer's supervisor", s).await.unwrap();
    }
    within("the relay", relay).await.unwrap();

    // Reconcile.
    let payments: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_rs_payments WHERE sku = ?")
        .bind(&w.sku)
        .fetch_one(w.idem.pool())
        .await
        .unwrap();
    let moves: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_rs_moves WHERE sku = ?")
        .bind(&w.sku)
        .fetch_one(w.idem.pool())
        .await
        .unwrap();
    let orphans: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM idem_rs_moves m LEFT JOIN idem_rs_payments p ON p.order_id = m.order_id WHERE m.sku = ? AND p.order_id IS NULL",
    )
    .bind(&w.sku)
    .fetch_one(w.idem.pool())
    .await
    .unwrap();
    let outbox = payer.outbox().counts().await.unwrap();
    let entries = w.length(&w.stream).await;
    let appended = counts.appended.load(SeqCst) + counts.duplicated.load(SeqCst);
    let (executed, replayed, kills) = (seen.executed.load(SeqCst), seen.replayed.load(SeqCst), seen.kills.load(SeqCst));
    println!(
        "redis streams end to end: {payments} payments, {entries} entries ({} duplicated, {} crashed-batch messages in {} crashes), \
         {executed} executed + {kills} killed after commit, {replayed} replayed, {} in progress, {:.1} s",
        counts.duplicated.load(SeqCst),
        counts.crashed_messages.load(SeqCst),
        counts.crashes.load(SeqCst),
        seen.in_progress.load(SeqCst),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(payments, expected, "every order paid or rolled back");
    assert_eq!((moves, orphans), (payments, 0), "exactly one stock move per payment, none without one");
    assert_eq!(w.stock().await, 1_000_000 - payments);
    assert_eq!((outbox.pending, outbox.dead), (0, 0));
    assert_eq!(outbox.sent as i64, payments, "one event per payment, none for a rolled-back body");
    assert_eq!(entries, appended, "the stream holds every copy appended");
    assert!(counts.crashes.load(SeqCst) >= 1 && counts.duplicated.load(SeqCst) >= 1 && kills == KILLS, "faults");
    assert_eq!(seen.other.load(SeqCst), 0, "every delivery executed, replayed or in progress");
    assert_eq!(executed + kills, payments as u64, "one execution per payment");
    assert!(executed + replayed >= entries, "every entry executed or replayed: {executed} + {replayed} < {entries}");
    assert!(replayed >= entries - payments as u64 + kills, "every extra copy and every killed delivery replayed");
    assert_eq!(pending_of(&mut w.conn(), &w.stream).await, vec![], "nothing pending");
    assert_eq!(w.length(&w.dead).await, 0, "no dead letter");
    assert!(started.elapsed() < Duration::from_secs(60));
    w.idem.pool().close().await;
    w.remove().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {database}"))).execute(&admin).await.unwrap();
}
