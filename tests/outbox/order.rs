//! One aggregate's events leave in commit order when writers overlap
//! (issue 23, item 3), with two relays: the second writer of an aggregate
//! waits in `queue` until the first ends, so `id` order is commit order,
//! and the relays publish an aggregate in `id` order, one event at a time.
//! A submodule of the `outbox` target: it shares its fixtures.

use tokio::sync::{Barrier, Notify};

use super::*;

/// How long a held writer (or a held batch) stays held while the test
/// looks for what must not happen: many polls of relays polling every 5 ms.
const HELD: Duration = Duration::from_millis(500);

/// An event of `aggregate`, with an id of its own (queued outside a call).
fn event(aggregate: &str, payload: &str) -> Event {
    let id = MessageId::derive("t_overlap", &format!("{aggregate}.{payload}"), 0).unwrap();
    Event::raw("overlap", payload.to_owned()).aggregate(aggregate).id(id)
}

/// Queues one event of `aggregate` in a transaction of its own and commits.
async fn queue_one<DB: Backend>(idem: &Idem<DB>, aggregate: &str, payload: &str) {
    let mut tx = idem.pool().begin().await.unwrap();
    idem::outbox::queue(&mut tx, event(aggregate, payload)).await.unwrap();
    tx.commit().await.unwrap();
}

/// The payloads of `aggregate` the publisher confirmed, in order.
fn published(recorder: &Recorder, aggregate: &str) -> Vec<String> {
    recorder.log().into_iter().filter(|(_, a, _)| a.as_deref() == Some(aggregate)).map(|(_, _, p)| p).collect()
}

/// The rows of `idem_outbox` as `(id, aggregate_key, payload)`, in `id` order.
trait OutboxRows: Backend {
    fn outbox_rows(pool: &Pool<Self>) -> impl Future<Output = Vec<(i64, Option<String>, String)>> + Send;
}

macro_rules! outbox_rows {
    ($($db:ty),*) => {$(
        impl OutboxRows for $db {
            async fn outbox_rows(pool: &Pool<Self>) -> Vec<(i64, Option<String>, String)> {
                sqlx::query_as("SELECT id, aggregate_key, payload FROM idem_outbox ORDER BY id")
                    .fetch_all(pool)
                    .await
                    .unwrap()
            }
        }
    )*};
}
outbox_rows!(Sqlite, MySql, Postgres);

/// The payloads of `aggregate` in the table, in `id` order.
async fn queued_in_id_order<DB: OutboxRows>(idem: &Idem<DB>, aggregate: &str) -> Vec<String> {
    let rows = DB::outbox_rows(idem.pool()).await;
    rows.into_iter().filter(|(_, a, _)| a.as_deref() == Some(aggregate)).map(|(_, _, p)| p).collect()
}

/// Two writers queue for `order-1`; the first is held open after its
/// `queue` while two relays run. Nothing of `order-1` leaves while the
/// first is uncommitted, the second waits in `queue` until the first
/// ends, and both the table's `id` order and the publisher see a1, a2
/// (commit order). On a server, a writer on `order-2` meanwhile neither
/// waits nor is held back; SQLite has one writer at a time (every writer,
/// and the relays, wait for the held one), so `one_writer` skips that part.
async fn one_aggregate_leaves_in_commit_order_under_overlapping_writers<DB: OutboxRows>(
    fresh: Fresh<DB>,
    one_writer: bool,
) {
    let idem = fresh.idem.clone();
    let recorder = Recorder::default();
    let relays: Vec<_> = (0..2)
        .map(|_| spawn_relay(Relay::new(&idem, recorder.clone()).poll_interval(Duration::from_millis(5))))
        .collect();

    let first_queued = Arc::new(Barrier::new(2));
    let release_first = Arc::new(Notify::new());
    let first = tokio::spawn({
        let (idem, first_queued, release_first) = (idem.clone(), first_queued.clone(), release_first.clone());
        async move {
            let mut tx = idem.pool().begin().await.unwrap();
            idem::outbox::queue(&mut tx, event("order-1", "a1")).await.unwrap();
            first_queued.wait().await;
            release_first.notified().await;
            tx.commit().await.unwrap();
        }
    });
    first_queued.wait().await;

    let second_queued_at = Arc::new(Mutex::new(None::<Instant>));
    let second = tokio::spawn({
        let (idem, second_queued_at) = (idem.clone(), second_queued_at.clone());
        async move {
            let mut tx = idem.pool().begin().await.unwrap();
            idem::outbox::queue(&mut tx, event("order-1", "a2")).await.unwrap();
            *second_queued_at.lock().unwrap() = Some(Instant::now());
            tx.commit().await.unwrap();
        }
    });
    tokio::time::sleep(HELD).await;
    assert_eq!(
        published(&recorder, "order-1"),
        Vec::<String>::new(),
        "order-1's second event left while its first was uncommitted"
    );
    assert!(second_queued_at.lock().unwrap().is_none(), "the second writer of order-1 queued while the first held it");

    if !one_writer {
        let other = tokio::time::timeout(Duration::from_secs(5), queue_one(&idem, "order-2", "b1")).await;
        assert!(other.is_ok(), "a writer on order-2 waited for the held writer of order-1");
        until("order-2's event, while order-1 is held", Duration::from_secs(10), || async {
            published(&recorder, "order-2") == ["b1"]
        })
        .await;
        assert!(
            second_queued_at.lock().unwrap().is_none(),
            "the second writer of order-1 queued while the first held it"
        );
    }

    let released_at = Instant::now();
    release_first.notify_one();
    tokio::time::timeout(Duration::from_secs(20), first).await.expect("the first writer ends").unwrap();
    tokio::time::timeout(Duration::from_secs(20), second).await.expect("the second writer ends").unwrap();
    let second_queued_at = second_queued_at.lock().unwrap().expect("the second writer queued");
    assert!(second_queued_at >= released_at, "the second writer queued before the first was released");

    until("both events of order-1", Duration::from_secs(20), || async { published(&recorder, "order-1").len() >= 2 })
        .await;
    for relay in relays {
        stop(relay).await;
    }
    assert_eq!(queued_in_id_order(&idem, "order-1").await, ["a1", "a2"], "id order is not commit order");
    assert_eq!(published(&recorder, "order-1"), ["a1", "a2"], "published out of commit order");
    let counts = idem.outbox().counts().await.unwrap();
    let expected_sent = if one_writer { 2 } else { 3 };
    assert_eq!((counts.pending, counts.sent, counts.dead), (0, expected_sent, 0));
    fresh.drop_db().await;
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
    tokio::time::sleep(HELD).await;
    assert_eq!(published(&recorder, "order-1"), Vec::<String>::new(), "a2 left while a1 was in flight");
    holding.release.notify_one();
    until("a1 and a2", Duration::from_secs(10), || async { published(&recorder, "order-1").len() >= 2 }).await;
    stop(first_relay).await;
    stop(second_relay).await;
    assert_eq!(published(&recorder, "order-1"), ["a1", "a2"]);
    assert_eq!(idem.outbox().counts().await.unwrap().sent, 3);
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
