//! The statements sqlx sends, counted per thread (whether one was sent
//! yet), and the round trips each flow of a call makes, counted on the
//! wire: a forwarder between the pool and the server sees every turn the
//! client takes (`idempotency_testkit::forwarder::Turns`), so a statement
//! added back to a flow fails its test, on MariaDB and PostgreSQL alike.

use std::cell::Cell;
use std::sync::Once;

thread_local! {
    /// The statements sqlx logged on this thread (its `sqlx::query` events).
    static STATEMENTS: Cell<usize> = const { Cell::new(0) };
}

/// Counts every thread's statements into its own [`STATEMENTS`]: tests on
/// other threads do not disturb a count. Installed as the global default
/// once (a scoped one misses events when another thread registered sqlx's
/// event sites first). SQLite's statements run on its worker thread and are
/// not seen. The engine's readings of the database's clock are not a call's
/// statements: one that failed on a loaded machine is taken again a second
/// later, in the background, on this thread; they are left out.
struct Statements;

/// Whether an event of sqlx's is a reading of the database's clock.
#[derive(Default)]
struct ClockReading(bool);

impl tracing::field::Visit for ClockReading {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0 |= matches!(field.name(), "summary" | "db.statement")
            && (value.contains("UTC_TIMESTAMP(6)") || value.contains("clock_timestamp()"));
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }
}

impl tracing::Subscriber for Statements {
    fn register_callsite(&self, meta: &'static tracing::Metadata<'static>) -> tracing::subscriber::Interest {
        if meta.target() == "sqlx::query" {
            tracing::subscriber::Interest::always()
        } else {
            tracing::subscriber::Interest::never()
        }
    }
    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        meta.target() == "sqlx::query"
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut clock = ClockReading::default();
        event.record(&mut clock);
        if !clock.0 {
            STATEMENTS.with(|n| n.set(n.get() + 1));
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Starts counting (once per test binary; each test runs in its own process).
pub(crate) fn count_statements() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        tracing::subscriber::set_global_default(Statements).expect("no other global subscriber in this binary");
    });
}

/// The statements counted on this thread so far.
pub(crate) fn statements() -> usize {
    STATEMENTS.with(Cell::get)
}

pub(crate) mod round_trips {
    use idempotency::Idem;
    use idempotency_testkit::forwarder::{Forwarder, Path, Protocol, Turns};
    use idempotency_testkit::{TestBackend, redis_client, unique};

    use super::super::fixture::{Mode, Probe, ledger_rows, pay, until};
    use super::super::{B, Db};

    /// A pool of one connection reaching the server half a millisecond away
    /// each way, through a forwarder that counts the round trips: every
    /// statement of a call goes over it, and the record's statements ride
    /// along (a database that far). No ping before a connection is lent
    /// (`test_before_acquire`, on by default in sqlx, is a round trip of its
    /// own before every transaction).
    pub(crate) async fn counted() -> Option<(Forwarder, sqlx::Pool<Db>)> {
        far(1).await
    }

    /// [`counted`], with a pool of up to `connections`.
    pub(crate) async fn far(connections: u32) -> Option<(Forwarder, sqlx::Pool<Db>)> {
        let (url, protocol) = match B::NAME {
            "mysql" => (idempotency_testkit::mysql_url(), Protocol::MySql),
            "postgres" => (idempotency_testkit::pg_url(), Protocol::Postgres),
            _ => return None,
        };
        // Reached once directly: a stopped server is started (or skipped).
        let direct = B::open(&unique("rt"), 1).await?;
        B::prepare(&direct).await;
        let (scheme, rest) = url.split_once("://").expect("a url");
        let (user, address) = rest.rsplit_once('@').expect("a user");
        let (host_port, database) = address.split_once('/').expect("a database");
        let port = host_port.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).expect("a port");
        let path = Path { count: Some(protocol), delay: std::time::Duration::from_micros(500) };
        let link = Forwarder::start_with(port, path).await;
        let database = database.split('?').next().expect("a database");
        // Plain TCP: the forwarder reads the messages.
        let tls = if B::NAME == "postgres" { "?sslmode=disable" } else { "" };
        let url = format!("{scheme}://{user}@127.0.0.1:{}/{database}{tls}", link.port());
        let options = sqlx::pool::PoolOptions::<Db>::new().max_connections(connections).test_before_acquire(false);
        let pool = options.connect(&url).await.expect("through the forwarder");
        Some((link, pool))
    }

    /// The turns counted so far, once the pool's connection is back (the
    /// pool's own turns then done).
    pub(crate) async fn settled(link: &Forwarder, pool: &sqlx::Pool<Db>) -> Turns {
        until("the connection back in the pool", || pool.num_idle() as u32 == pool.size()).await;
        link.turns()
    }

    /// The least of three runs of `measured` (each counts its own turns): a
    /// background reading of the database's clock (each minute, or a second
    /// after one failed) adds turns to the run it falls in.
    async fn least_of_three<F, Fut>(measured: F) -> Turns
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Turns>,
    {
        let mut least: Option<Turns> = None;
        for _ in 0..3 {
            let turns = measured().await;
            least = Some(match least {
                Some(l) if (l.statements, l.background) <= (turns.statements, turns.background) => l,
                _ => turns,
            });
        }
        least.expect("three runs")
    }

    /// A plain transaction doing the body's statement: what a caller would
    /// write without `idempotency`.
    async fn bare(pool: &sqlx::Pool<Db>, k: &str) {
        let mut tx = pool.begin().await.expect("begin");
        sqlx::query(B::INSERT_LEDGER).bind(k).bind(1_i64).execute(&mut *tx).await.expect("ledger");
        tx.commit().await.expect("commit");
    }

    /// A first call, then (its count back at rest) `calls` more, so that
    /// the fn is one of first calls and every statement is prepared on the
    /// connection.
    async fn warm(idem: &Idem<Db>, probe: &Probe) {
        for _ in 0..4 {
            let k = unique("rt_warm");
            pay(idem, k.clone(), 1, probe, Mode::Ok).await.unwrap();
            // A replay, then a first call again: the read of a key and the
            // failed insert are prepared too, and the fn is one of first calls.
            pay(idem, k, 1, probe, Mode::Ok).await.unwrap();
            pay(idem, unique("rt_warm"), 1, probe, Mode::Ok).await.unwrap();
        }
    }

    /// The caller's round trips per flow, and the pool's after each, with
    /// the database 1 ms away:
    /// `bare` 3 (`BEGIN`, the body's statement, `COMMIT`); a first call
    /// the same 3 with Redis (`BEGIN` beside the claim, the body, the
    /// record's insert with `COMMIT`) and without (`BEGIN` with the record's
    /// insert, the body, the record's update with `COMMIT`); a replay
    /// without Redis of a fn of first calls 2 (the insert refused, the row
    /// read); with Redis none. Its transaction committed by a text, the
    /// call leaves sqlx a `ROLLBACK` to send with the pool's ping: MariaDB
    /// answers it in a round trip of its own, PostgreSQL in the ping's.
    #[tokio::test]
    async fn each_flow_waits_for_the_round_trips_of_a_plain_transaction() {
        let Some((link, pool)) = counted().await else { return };
        let pool_ping = if B::NAME == "mysql" { 2 } else { 1 };
        let probe = Probe::default();
        let (link, pool, probe) = (&link, &pool, &probe);

        let plain = least_of_three(|| async {
            let before = settled(link, pool).await;
            bare(pool, &unique("rt_bare")).await;
            settled(link, pool).await - before
        });
        assert_eq!(plain.await, Turns { statements: 3, background: 1 }, "bare");

        let idem = &Idem::builder(pool.clone()).build();
        idem.migrate().await.expect("migrate");
        warm(idem, probe).await;
        let first = least_of_three(|| async {
            let k = unique("rt_first");
            let before = settled(link, pool).await;
            assert_eq!(pay(idem, k.clone(), 1, probe, Mode::Ok).await.unwrap().run, probe.runs());
            let turns = settled(link, pool).await - before;
            assert_eq!(ledger_rows(idem, &k).await, 1);
            turns
        });
        assert_eq!(first.await, Turns { statements: 3, background: pool_ping }, "first call without Redis");
        let replay = least_of_three(|| async {
            // After a first call: a fn of first calls, whose replays go
            // through the unique index.
            let (k, runs) = (unique("rt_replay"), probe.runs());
            pay(idem, k.clone(), 1, probe, Mode::Ok).await.unwrap();
            let before = settled(link, pool).await;
            assert_eq!(pay(idem, k, 1, probe, Mode::Ok).await.unwrap().run, runs + 1, "replayed");
            settled(link, pool).await - before
        });
        assert_eq!(replay.await, Turns { statements: 2, background: 2 }, "a replay without Redis");

        let Some(client) = redis_client().await else { return };
        let idem = &Idem::builder(pool.clone()).redis(client).build();
        idem.migrate().await.expect("migrate");
        warm(idem, probe).await;
        let first = least_of_three(|| async {
            let before = settled(link, pool).await;
            assert_eq!(pay(idem, unique("rt_first_redis"), 1, probe, Mode::Ok).await.unwrap().run, probe.runs());
            settled(link, pool).await - before
        });
        assert_eq!(first.await, Turns { statements: 3, background: pool_ping }, "first call with Redis");
    }
}
