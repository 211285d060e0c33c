//! One aggregate's events leave in commit order when writers overlap
//! (issue 23, item 3), with two relays: the second writer of an aggregate
//! waits in `queue` until the first ends, so `id` order is commit order,
//! and the relays publish an aggregate in `id` order, one event at a time.
//! A submodule of the `outbox` target: it shares its fixtures.

use tokio::sync::{Barrier, Notify};

use super::*;

/// An event of `aggregate`, with an id of its own (queued outside a call).
fn event(aggregate: &str, payload: &str) -> Event {
    let id = MessageId::derive("t_overlap", &format!("{aggregate}.{payload}"), 0).unwrap();
    Event::raw("overlap", payload.to_owned()).aggregate(aggregate).id(id)
}

/// Queues one event of `aggregate` in a transaction of its own and commits.
async fn queue_one<DB: Backend>(idem: &Idem<DB>, aggregate: &str, payload: &str) {
    let mut tx = idem.pool().begin().await.unwrap();
    idempotency::outbox::queue(&mut tx, event(aggregate, payload)).await.unwrap();
    tx.commit().await.unwrap();
}

/// The payloads of `aggregate` the publisher confirmed, in order.
fn published(recorder: &Recorder, aggregate: &str) -> Vec<String> {
    recorder.log().into_iter().filter(|(_, a, _)| a.as_deref() == Some(aggregate)).map(|(_, _, p)| p).collect()
}

/// The rows of `idem_outbox` as `(id, aggregate_key, payload)`, in `id` order.
trait OutboxRows: Backend {
    fn outbox_rows(pool: &Pool<Self>) -> impl Future<Output = Vec<(i64, Option<String>, String)>> + Send;
    /// Writers of this (test's own) database held up behind a lock, as the
    /// server shows them; `None` where the test has no such view (SQLite,
    /// whose writers wait in their busy handler).
    fn lock_waiters(pool: &Pool<Self>) -> impl Future<Output = Option<i64>> + Send;
}

macro_rules! outbox_rows {
    ($($db:ty: $waiters:expr),*) => {$(
        impl OutboxRows for $db {
            async fn outbox_rows(pool: &Pool<Self>) -> Vec<(i64, Option<String>, String)> {
                sqlx::query_as("SELECT id, aggregate_key, payload FROM idem_outbox ORDER BY id")
                    .fetch_all(pool)
                    .await
                    .unwrap()
            }

            async fn lock_waiters(pool: &Pool<Self>) -> Option<i64> {
                let sql: Option<&'static str> = $waiters;
                Some(sqlx::query_scalar(sql?).fetch_one(pool).await.expect("lock waiters"))
            }
        }
    )*};
}
outbox_rows!(
    Sqlite: None,
    // MariaDB's INNODB_TRX leaves out some of the waiters (seen: 2 of 4
    // listed, 4 of 4 in the statement, for 30 s): the process list shows
    // every session still inside the aggregate row's upsert, which a writer
    // cannot leave while the first holds that row.
    MySql: Some(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST
         WHERE DB = DATABASE() AND INFO LIKE 'INSERT INTO idem_outbox_aggregate %'"
    ),
    Postgres: Some(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
);

/// The payloads of `aggregate` in the table, in `id` order.
async fn queued_in_id_order<DB: OutboxRows>(idem: &Idem<DB>, aggregate: &str) -> Vec<String> {
    let rows = DB::outbox_rows(idem.pool()).await;
    rows.into_iter().filter(|(_, a, _)| a.as_deref() == Some(aggregate)).map(|(_, _, p)| p).collect()
}

/// Writers of `order-1` that queue while its first writer is held.
const WAITERS: usize = 4;

/// Two rounds (the aggregate rows absent, then present) of
/// [`overlapping_writers`], with two relays running throughout.
async fn one_aggregate_leaves_in_commit_order_under_overlapping_writers<DB: OutboxRows>(
    fresh: Fresh<DB>,
    one_writer: bool,
) {
    let recorder = Recorder::default();
    let relays: Vec<_> = (0..2)
        .map(|_| spawn_relay(Relay::new(&fresh.idem, recorder.clone()).poll_interval(Duration::from_millis(5))))
        .collect();
    let mut expected = Vec::new();
    for round in 1..=2 {
        expected.extend(overlapping_writers(&fresh.idem, &recorder, one_writer, round).await);
        until("the round's events of order-1", Duration::from_secs(20), || async {
            published(&recorder, "order-1").len() >= expected.len()
        })
        .await;
    }
    for relay in relays {
        stop(relay).await;
    }
    assert_eq!(queued_in_id_order(&fresh.idem, "order-1").await, expected, "id order is not commit order");
    assert_eq!(published(&recorder, "order-1"), expected, "published out of commit order");
    let b = if one_writer { 0 } else { 2 };
    assert_eq!(published(&recorder, "order-2").len(), b);
    let counts = fresh.idem.outbox().counts().await.unwrap();
    assert_eq!((counts.pending, counts.sent, counts.dead), (0, (expected.len() + b) as u64, 0));
    fresh.drop_db().await;
}

/// The first writer of `order-1` queues and is held open; [`WAITERS`]
/// more, all begun at a barrier, queue for `order-1` too. While the first
/// is held nothing of this round leaves and no waiter's `queue` returns
/// (each waits for the one before it to end). On a server, a writer on
/// `order-2` meanwhile neither waits nor is held back; SQLite has one
/// writer at a time (every writer, and the relays, wait for the held one),
/// so `one_writer` skips that part. Returns the round's commit order: the
/// first, then the waiters in the order their `queue` returned.
async fn overlapping_writers<DB: OutboxRows>(
    idem: &Idem<DB>,
    recorder: &Recorder,
    one_writer: bool,
    round: usize,
) -> Vec<String> {
    let first_payload = format!("r{round}-first");
    let first_queued = Arc::new(Barrier::new(2));
    let release_first = Arc::new(Notify::new());
    let first = tokio::spawn({
        let (idem, first_queued, release_first) = (idem.clone(), first_queued.clone(), release_first.clone());
        let payload = first_payload.clone();
        async move {
            let mut tx = idem.pool().begin().await.unwrap();
            idempotency::outbox::queue(&mut tx, event("order-1", &payload)).await.unwrap();
            first_queued.wait().await;
            release_first.notified().await;
            tx.commit().await.unwrap();
        }
    });
    let first_queued = tokio::time::timeout(Duration::from_secs(10), first_queued.wait()).await;
    first_queued.expect("the first writer queued");

    // Each waiter notes its payload as soon as its `queue` returns: that
    // is after the writer before it committed, so before its own commit.
    let queued_after = Arc::new(Mutex::new(Vec::<String>::new()));
    let begun = Arc::new(Barrier::new(WAITERS + 1));
    let waiters: Vec<_> = (0..WAITERS)
        .map(|i| {
            let (idem, queued_after, begun) = (idem.clone(), queued_after.clone(), begun.clone());
            tokio::spawn(async move {
                let payload = format!("r{round}-w{i}");
                let mut tx = idem.pool().begin().await.unwrap();
                begun.wait().await;
                idempotency::outbox::queue(&mut tx, event("order-1", &payload)).await.unwrap();
                queued_after.lock().unwrap().push(payload);
                tx.commit().await.unwrap();
            })
        })
        .collect();
    tokio::time::timeout(Duration::from_secs(10), begun.wait()).await.expect("the waiters began");
    // On a server, every waiter blocked behind the held writer, in the
    // server's view (a waiter that got through instead fails the asserts
    // below at once). SQLite shows no waiters: there the final order is
    // the proof.
    if DB::lock_waiters(idem.pool()).await.is_some() {
        until("the waiters blocked on order-1", Duration::from_secs(30), || async {
            DB::lock_waiters(idem.pool()).await >= Some(WAITERS as i64) || !queued_after.lock().unwrap().is_empty()
        })
        .await;
    }
    let this_round = |recorder: &Recorder| -> Vec<String> {
        let prefix = format!("r{round}-");
        published(recorder, "order-1").into_iter().filter(|p| p.starts_with(&prefix)).collect()
    };
    assert_eq!(this_round(recorder), Vec::<String>::new(), "order-1 published while its first writer was uncommitted");
    assert_eq!(
        *queued_after.lock().unwrap(),
        Vec::<String>::new(),
        "a writer of order-1 queued while the first held it"
    );

    if !one_writer {
        let b = format!("r{round}-b");
        let other = tokio::time::timeout(Duration::from_secs(5), queue_one(idem, "order-2", &b)).await;
        assert!(other.is_ok(), "a writer on order-2 waited for the held writer of order-1");
        until(&format!("order-2's event in round {round}, while order-1 is held"), Duration::from_secs(10), || async {
            published(recorder, "order-2").contains(&b)
        })
        .await;
        assert_eq!(*queued_after.lock().unwrap(), Vec::<String>::new(), "a writer of order-1 queued while held");
    }

    release_first.notify_one();
    tokio::time::timeout(Duration::from_secs(20), first).await.expect("the first writer ends").unwrap();
    for waiter in waiters {
        tokio::time::timeout(Duration::from_secs(20), waiter).await.expect("a waiter ends").unwrap();
    }
    let mut order = vec![first_payload];
    order.extend(queued_after.lock().unwrap().iter().cloned());
    assert_eq!(order.len(), WAITERS + 1);
    order
}

/// Confirms through a [`Recorder`]; the first batch, when `hold` is set,
/// waits for its release first.
#[derive(Clone, Default)]
struct HoldFirst {
    recorder: Recorder,
    hold: Option<Holding>,
}

impl Publisher for HoldFirst {
    async fn publish(&mut self, batch: &[Message]) -> Vec<Confirm> {
        if let Some(hold) = &self.hold
            && !hold.held.swap(true, SeqCst)
        {
            hold.entered.notify_one();
            hold.release.notified().await;
        }
        self.recorder.publish(batch).await
    }
}

/// While one relay holds an aggregate's event in flight (published, not
/// yet confirmed and marked), the other relay publishes other aggregates
/// but not that aggregate's next event; once the first confirms, the next
/// follows. Servers only: on SQLite a relay's batch holds the write lock,
/// so nothing is queued meanwhile.
async fn a_relay_holding_an_aggregates_event_holds_back_its_next_on_the_other<DB: Backend>(fresh: Fresh<DB>) {
    let idem = &fresh.idem;
    let recorder = Recorder::default();
    queue_one(idem, "order-1", "a1").await;
    let holding = Holding::default();
    let first_relay = HoldFirst { recorder: recorder.clone(), hold: Some(holding.clone()) };
    let first_relay = spawn_relay(Relay::new(idem, first_relay).poll_interval(Duration::from_millis(5)));
    tokio::time::timeout(Duration::from_secs(10), holding.entered.notified()).await.expect("the first relay took a1");
    queue_one(idem, "order-1", "a2").await;
    queue_one(idem, "order-2", "b1").await;
    let second_relay = HoldFirst { recorder: recorder.clone(), hold: None };
    let second_relay = spawn_relay(Relay::new(idem, second_relay).poll_interval(Duration::from_millis(5)));
    until("the second relay to publish b1", Duration::from_secs(10), || async {
        published(&recorder, "order-2") == ["b1"]
    })
    .await;
    // Taking b1, the second relay passed over a2 (queued before it); b2,
    // queued now, shows that a later poll passed over a2 too.
    queue_one(idem, "order-2", "b2").await;
    until("the second relay to publish b2", Duration::from_secs(10), || async {
        published(&recorder, "order-2") == ["b1", "b2"]
    })
    .await;
    assert_eq!(published(&recorder, "order-1"), Vec::<String>::new(), "a2 left while a1 was in flight");
    holding.release.notify_one();
    until("a1 and a2", Duration::from_secs(10), || async { published(&recorder, "order-1").len() >= 2 }).await;
    stop(first_relay).await;
    stop(second_relay).await;
    assert_eq!(published(&recorder, "order-1"), ["a1", "a2"]);
    assert_eq!(idem.outbox().counts().await.unwrap().sent, 4);
    fresh.drop_db().await;
}

/// `idem_outbox_aggregate`, the servers' table of aggregate rows.
trait AggregateRows: OutboxRows {
    /// `(aggregate_key, queued)` of every row, by key.
    fn aggregate_rows(pool: &Pool<Self>) -> impl Future<Output = Vec<(String, i64)>> + Send;
    /// Drops the table, as on a database migrated before it existed.
    fn drop_aggregate_table(pool: &Pool<Self>) -> impl Future<Output = ()> + Send;
}

macro_rules! aggregate_rows {
    ($($db:ty),*) => {$(
        impl AggregateRows for $db {
            async fn aggregate_rows(pool: &Pool<Self>) -> Vec<(String, i64)> {
                sqlx::query_as("SELECT aggregate_key, queued FROM idem_outbox_aggregate ORDER BY aggregate_key")
                    .fetch_all(pool)
                    .await
                    .unwrap()
            }

            async fn drop_aggregate_table(pool: &Pool<Self>) {
                sqlx::raw_sql("DROP TABLE idem_outbox_aggregate").execute(pool).await.unwrap();
            }
        }
    )*};
}
aggregate_rows!(MySql, Postgres);

/// A database migrated before aggregate rows existed gets their table
/// from `migrate`; an event with an aggregate creates (then counts in)
/// its row, and one without creates none.
async fn migrate_adds_the_aggregate_rows_to_an_existing_outbox<DB: AggregateRows>(fresh: Fresh<DB>) {
    let idem = &fresh.idem;
    DB::drop_aggregate_table(idem.pool()).await;
    seed(idem, "plain", None, "before").await;
    idem.migrate().await.expect("migrate again");
    queue_one(idem, "order-1", "a1").await;
    queue_one(idem, "order-1", "a2").await;
    queue_one(idem, "order-2", "b1").await;
    seed(idem, "plain", None, "after").await;
    assert_eq!(DB::aggregate_rows(idem.pool()).await, [("order-1".to_owned(), 2), ("order-2".to_owned(), 1)]);
    assert_eq!(idem.outbox().counts().await.unwrap().pending, 5);
    fresh.drop_db().await;
}

/// The relays purge aggregate rows past the retention with the sent rows,
/// skipping those a writer holds (a fresh one, or an old one): the purge
/// never waits for a body, so the relays keep publishing meanwhile.
async fn aggregate_rows_are_purged_with_the_sent_rows_never_waiting_for_a_writer<DB: AggregateRows>(fresh: Fresh<DB>) {
    let idem = &fresh.idem;
    for aggregate in ["order-1", "order-2", "order-3"] {
        queue_one(idem, aggregate, "old").await;
    }
    // Held open: order-2's row (old; its count of 2 uncommitted) and
    // order-9's (new, uncommitted).
    let mut held_old = idem.pool().begin().await.unwrap();
    idempotency::outbox::queue(&mut held_old, event("order-2", "held")).await.unwrap();
    let mut held_new = idem.pool().begin().await.unwrap();
    idempotency::outbox::queue(&mut held_new, event("order-9", "held")).await.unwrap();

    let recorder = Recorder::default();
    let relay = Relay::new(idem, recorder.clone())
        .poll_interval(Duration::from_millis(5))
        .retention(Duration::ZERO)
        .purge(Duration::from_millis(10), 1);
    let stats = relay.stats();
    let relay = spawn_relay(relay);
    until("the unheld rows purged", Duration::from_secs(10), || async {
        DB::aggregate_rows(idem.pool()).await == [("order-2".to_owned(), 1)]
    })
    .await;
    // The relay goes on while the writers hold their rows.
    queue_one(idem, "order-4", "new").await;
    until("order-4 published", Duration::from_secs(10), || async { published(&recorder, "order-4") == ["new"] }).await;
    held_old.commit().await.unwrap();
    held_new.commit().await.unwrap();
    until("every row purged", Duration::from_secs(10), || async {
        DB::aggregate_rows(idem.pool()).await.is_empty() && stats.purged() == 6
    })
    .await;
    stop(relay).await;
    assert_eq!(published(&recorder, "order-2"), ["old", "held"]);
    fresh.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_one_aggregate_leaves_in_commit_order_under_overlapping_writers() {
    let Some(fresh) = fresh_sqlite().await else { return };
    one_aggregate_leaves_in_commit_order_under_overlapping_writers(fresh, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_one_aggregate_leaves_in_commit_order_under_overlapping_writers() {
    let Some(fresh) = fresh_mysql().await else { return };
    one_aggregate_leaves_in_commit_order_under_overlapping_writers(fresh, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_one_aggregate_leaves_in_commit_order_under_overlapping_writers() {
    let Some(fresh) = fresh_postgres().await else { return };
    one_aggregate_leaves_in_commit_order_under_overlapping_writers(fresh, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_a_relay_holding_an_aggregates_event_holds_back_its_next_on_the_other() {
    let Some(fresh) = fresh_mysql().await else { return };
    a_relay_holding_an_aggregates_event_holds_back_its_next_on_the_other(fresh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_relay_holding_an_aggregates_event_holds_back_its_next_on_the_other() {
    let Some(fresh) = fresh_postgres().await else { return };
    a_relay_holding_an_aggregates_event_holds_back_its_next_on_the_other(fresh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_migrate_adds_the_aggregate_rows_to_an_existing_outbox() {
    let Some(fresh) = fresh_mysql().await else { return };
    migrate_adds_the_aggregate_rows_to_an_existing_outbox(fresh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_migrate_adds_the_aggregate_rows_to_an_existing_outbox() {
    let Some(fresh) = fresh_postgres().await else { return };
    migrate_adds_the_aggregate_rows_to_an_existing_outbox(fresh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_aggregate_rows_are_purged_with_the_sent_rows_never_waiting_for_a_writer() {
    let Some(fresh) = fresh_mysql().await else { return };
    aggregate_rows_are_purged_with_the_sent_rows_never_waiting_for_a_writer(fresh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_aggregate_rows_are_purged_with_the_sent_rows_never_waiting_for_a_writer() {
    let Some(fresh) = fresh_postgres().await else { return };
    aggregate_rows_are_purged_with_the_sent_rows_never_waiting_for_a_writer(fresh).await;
}
