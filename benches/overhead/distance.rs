//! The rows at a distance: MariaDB, PostgreSQL and Redis reached through
//! the testkit's forwarder, which holds every byte [`EACH_WAY`] in each
//! direction (`idempotency_testkit::forwarder::Path::delay`): a round trip
//! 1 ms longer, as a managed database or one in another zone is from its
//! callers. There every round trip a flow waits for is the cost, whatever
//! the CPU does. Before the rows, a `SELECT 1` direct, through the
//! forwarder without a delay and with it, in turns: what the path adds.

use std::time::Duration;

use idempotency_testkit::forwarder::{Forwarder, Path};

use super::*;

/// Added to every byte, each way.
const EACH_WAY: Duration = Duration::from_micros(500);
/// `SELECT 1`s per path in the check.
const SELECTS: usize = 300;

/// The rows of MariaDB and PostgreSQL at a distance, without Redis and
/// with the single Redis of `passes` (if any) as far away.
pub fn run(rows: &mut Vec<Row>, passes: &[Claims]) {
    // The forwarders run on a thread of their own, apart from the callers'
    // current-thread runtime, woken as promptly as the delay's own thread.
    let net = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .on_thread_start(idempotency_testkit::forwarder::promptly)
        .enable_all()
        .build()
        .expect("runtime");
    let far = Path { delay: EACH_WAY, count: None };
    let mut far_passes = vec![Claims::None];
    let redis_link = passes.iter().find_map(|p| match p {
        Claims::Single(c) => {
            let redis::ConnectionAddr::Tcp(_, port) = c.get_connection_info().addr() else { return None };
            Some(net.block_on(Forwarder::start_with(*port, far)))
        }
        _ => None,
    });
    if let Some(link) = &redis_link {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}", link.port())).expect("redis url");
        far_passes.push(Claims::Single(client));
    }
    // A full run measures many callers too.
    let phases: &[Phase] = if quick() { &[Phase::OneTask] } else { &[Phase::OneTask, Phase::Concurrent] };

    let url = idempotency_testkit::mysql_url();
    let link = net.block_on(Forwarder::start_with(count::port_of(&url), far));
    let direct = net.block_on(Forwarder::start_with(count::port_of(&url), Path::default()));
    Phase::OneTask.runtime().block_on(select_1::<sqlx::MySql>("mariadb", &url, &direct, &link));
    for &phase in phases {
        let at = count::through(&url, link.port());
        let scale = Scale::at_a_distance();
        phase.runtime().block_on(mariadb::run_on(rows, &far_passes, at, "mariadb+1ms", phase, scale));
    }

    let url = idempotency_testkit::pg_url();
    let link = net.block_on(Forwarder::start_with(count::port_of(&url), far));
    let direct = net.block_on(Forwarder::start_with(count::port_of(&url), Path::default()));
    Phase::OneTask.runtime().block_on(select_1::<sqlx::Postgres>("postgres", &url, &direct, &link));
    for &phase in phases {
        let at = count::through(&url, link.port());
        let scale = Scale::at_a_distance();
        phase.runtime().block_on(postgres::run_on(rows, &far_passes, at, "postgres+1ms", phase, scale));
    }
    drop((redis_link, net));
}

/// Prints what the path adds to a `SELECT 1`: the p50 of one straight to
/// the server, through a forwarder without a delay, and through `far`, in
/// turns.
async fn select_1<DB: sqlx::Database>(name: &str, url: &str, direct: &Forwarder, far: &Forwarder)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    use sqlx::Connection;
    // One connection each, held: a pool gives a connection back with a
    // ping (a round trip of its own), which the next query would wait for.
    let open = |url: String| async move { DB::Connection::connect(&url).await.ok() };
    let (Some(straight), Some(forwarded), Some(distant)) = (
        open(count::through(url, count::port_of(url))).await,
        open(count::through(url, direct.port())).await,
        open(count::through(url, far.port())).await,
    ) else {
        println!("skipped: {name} unreachable (the rows at a distance left out)");
        return;
    };
    let select = |connection: DB::Connection| {
        let connection = std::sync::Arc::new(tokio::sync::Mutex::new(connection));
        call(move |_| {
            let connection = connection.clone();
            async move {
                let mut connection = connection.lock().await;
                sqlx::raw_sql("SELECT 1").execute(&mut *connection).await.expect("SELECT 1");
            }
        })
    };
    let turns = vec![("direct", select(straight)), ("forwarded", select(forwarded)), ("far", select(distant))];
    let timed = alternating(1, SELECTS, turns).await;
    let p50 = |row: &str| timed.iter().find(|(n, _)| *n == row).map_or(f64::NAN, |(_, (_, l))| percentile(l, 0.5));
    let (direct, forwarded, far) = (p50("direct"), p50("forwarded"), p50("far"));
    println!(
        "{name}: a SELECT 1 takes {direct:.3} ms straight to the server, {forwarded:.3} ms through the forwarder, \
         {far:.3} ms through it at +{:.1} ms each way: the delay adds {:.3} ms a round trip (the forwarder itself {:.3} ms)",
        EACH_WAY.as_secs_f64() * 1e3,
        far - forwarded,
        forwarded - direct,
    );
}
