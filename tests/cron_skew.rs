//! A cron runner fires by the database's clock without being told to
//! (issue 32): a runner in a child process ten minutes behind (libfaketime,
//! `faketime -f -10m`, Debian's package `faketime`) beside one on the true
//! clock, both built with `Runner::new(&idem, ..)` and no clock option, on a
//! one-second schedule with a 2-second job ttl. The true clock's instance
//! has run every slot of the last eleven minutes (their rows are there;
//! their records, living the runner's minute of margin, have expired): by
//! its own clock the instance behind would fire those slots again, find no
//! live record, and run them a second time. By the database's clock it
//! fires the slots that come now, beside the other instance, and each runs
//! once. On MariaDB and PostgreSQL at once; a few seconds.
//!
//! The child is this test binary again, running this same test with
//! [`CHILD_ENV`] set: the test itself plays the instance behind there, so
//! no entry point of its own passes as a test in a normal run.

use std::ops::Range;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotency::cron::{Runner, SlotOutcome};
use idempotency::{Backend, Idem, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::Transaction;

/// Set in the child's environment: `<database> <run>`.
const CHILD_ENV: &str = "IDEM_CRON_SKEW_CHILD";
/// This test's name: the child runs it again.
const TEST_NAME: &str = "an_instance_ten_minutes_behind_runs_no_slot_twice";
/// How far behind the child's clock is: far more than a slot's record lives
/// (the runner's minute of margin).
const SKEW: &str = "-10m";
/// The slots the true clock's instance ran before this run: eleven minutes.
const HISTORY_SECS: i64 = 660;
/// How many slots the instance behind runs (skipped ones aside) before it stops.
const CHILD_SLOTS: usize = 5;
/// Longest the instance behind waits for them: only a hang takes that long.
const CHILD_BOUND: Duration = Duration::from_secs(60);

#[derive(Debug, Serialize, Deserialize)]
struct Tick {
    slot: i64,
}

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug
enum JobError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
}

impl From<idempotency::Error> for JobError {
    fn from(e: idempotency::Error) -> Self {
        JobError::Idem(e)
    }
}

impl From<sqlx::Error> for JobError {
    fn from(e: sqlx::Error) -> Self {
        JobError::Db(e)
    }
}

/// What differs per database.
trait SkewDb: Backend {
    const LABEL: &'static str;
    /// Creates the table of ticks, if absent.
    fn create_ticks(pool: &sqlx::Pool<Self>) -> impl Future<Output = ()> + Send;
    /// Rows of `run` for each slot of `slots`, as the instance on the true
    /// clock wrote them.
    fn insert_history(pool: &sqlx::Pool<Self>, run: &str, slots: Range<i64>) -> impl Future<Output = ()> + Send;
    /// Rows per slot of `run`.
    fn per_slot(pool: &sqlx::Pool<Self>, run: &str) -> impl Future<Output = Vec<(i64, i64)>> + Send;
    fn connect() -> impl Future<Output = Option<sqlx::Pool<Self>>> + Send;
    fn insert_tick(
        tx: &mut Transaction<'_, Self>,
        run: &str,
        slot: i64,
        instance: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

impl SkewDb for sqlx::MySql {
    const LABEL: &'static str = "mysql";
    async fn insert_history(pool: &sqlx::Pool<Self>, run: &str, slots: Range<i64>) {
        let mut insert = sqlx::QueryBuilder::<Self>::new("INSERT INTO cron_skew (run, slot, instance) ");
        insert.push_values(slots, |mut row, slot| {
            row.push_bind(run.to_owned()).push_bind(slot).push_bind(0_i64);
        });
        insert.build().execute(pool).await.expect("the history");
    }
    async fn create_ticks(pool: &sqlx::Pool<Self>) {
        let ddl = "CREATE TABLE IF NOT EXISTS cron_skew (id BIGINT AUTO_INCREMENT PRIMARY KEY, run VARCHAR(100) NOT NULL, slot BIGINT NOT NULL, instance BIGINT NOT NULL, KEY (run))";
        sqlx::raw_sql(ddl).execute(pool).await.expect("table");
    }
    async fn per_slot(pool: &sqlx::Pool<Self>, run: &str) -> Vec<(i64, i64)> {
        let sql = "SELECT slot, COUNT(*) FROM cron_skew WHERE run = ? GROUP BY slot ORDER BY slot";
        sqlx::query_as(sql).bind(run).fetch_all(pool).await.unwrap()
    }
    async fn insert_tick(
        tx: &mut Transaction<'_, Self>,
        run: &str,
        slot: i64,
        instance: i64,
    ) -> Result<(), sqlx::Error> {
        let sql = "INSERT INTO cron_skew (run, slot, instance) VALUES (?, ?, ?)";
        sqlx::query(sql).bind(run).bind(slot).bind(instance).execute(&mut **tx).await.map(drop)
    }
    async fn connect() -> Option<sqlx::Pool<Self>> {
        idempotency_testkit::reach("mysql", || async {
            sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(4)
                .connect(&idempotency_testkit::mysql_url())
                .await
                .ok()
        })
        .await
    }
}

impl SkewDb for sqlx::Postgres {
    const LABEL: &'static str = "postgres";
    async fn insert_history(pool: &sqlx::Pool<Self>, run: &str, slots: Range<i64>) {
        let mut insert = sqlx::QueryBuilder::<Self>::new("INSERT INTO cron_skew (run, slot, instance) ");
        insert.push_values(slots, |mut row, slot| {
            row.push_bind(run.to_owned()).push_bind(slot).push_bind(0_i64);
        });
        insert.build().execute(pool).await.expect("the history");
    }
    async fn create_ticks(pool: &sqlx::Pool<Self>) {
        let ddl = "SELECT pg_advisory_xact_lock(7306232718293616); CREATE TABLE IF NOT EXISTS cron_skew (id BIGSERIAL PRIMARY KEY, run VARCHAR(100) NOT NULL, slot BIGINT NOT NULL, instance BIGINT NOT NULL)";
        sqlx::raw_sql(ddl).execute(pool).await.expect("table");
    }
    async fn per_slot(pool: &sqlx::Pool<Self>, run: &str) -> Vec<(i64, i64)> {
        let sql = "SELECT slot, COUNT(*) FROM cron_skew WHERE run = $1 GROUP BY slot ORDER BY slot";
        sqlx::query_as(sql).bind(run).fetch_all(pool).await.unwrap()
    }
    async fn insert_tick(
        tx: &mut Transaction<'_, Self>,
        run: &str,
        slot: i64,
        instance: i64,
    ) -> Result<(), sqlx::Error> {
        let sql = "INSERT INTO cron_skew (run, slot, instance) VALUES ($1, $2, $3)";
        sqlx::query(sql).bind(run).bind(slot).bind(instance).execute(&mut **tx).await.map(drop)
    }
    async fn connect() -> Option<sqlx::Pool<Self>> {
        idempotency_testkit::reach("postgres", || async {
            sqlx::postgres::PgPoolOptions::new().max_connections(4).connect(&idempotency_testkit::pg_url()).await.ok()
        })
        .await
    }
}

/// The job: one row per execution, keyed by the slot the schedule meant.
#[idempotent(key = "skew_<run>_<slot>", ttl = "2s", biz = "cron_skew")]
async fn tick<DB: SkewDb>(
    idem: &Idem<DB>,
    tx: &mut Transaction<'_, DB>,
    run: String,
    slot: i64,
    #[idem(skip)] instance: i64,
) -> Result<Tick, JobError> {
    DB::insert_tick(tx, &run, slot, instance).await?;
    Ok(Tick { slot })
}

/// Whether a slot ran here or elsewhere. (A slot that came due while
/// a runner was busy, say on a loaded machine, is skipped: no window.)
fn ran(outcome: SlotOutcome) -> bool {
    use SlotOutcome::{DoneElsewhere, Executed, InProgressElsewhere};
    matches!(outcome, Executed | DoneElsewhere | InProgressElsewhere)
}

/// A runner of `run` built from `idem`, with no clock option, until
/// `shutdown`: the slots it settled, with their outcomes; `settled`
/// counts those that ran.
async fn runner<DB: SkewDb>(
    idem: &Idem<DB>,
    run: &str,
    instance: i64,
    shutdown: impl Future<Output = ()>,
    settled: tokio::sync::watch::Sender<usize>,
) -> Vec<(i64, SlotOutcome)> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let (job_idem, job_run) = (idem.clone(), run.to_owned());
    Runner::new(idem, "skew", "* * * * * *")
        .unwrap()
        .shutdown_grace(Duration::from_secs(5))
        .on_slot(move |r| {
            let mut seen = log.lock().unwrap();
            seen.push((r.slot.unix_secs(), r.outcome));
            settled.send_replace(seen.iter().filter(|(_, outcome)| ran(*outcome)).count());
        })
        .run(shutdown, move |slot| {
            let (idem, run) = (job_idem.clone(), job_run.clone());
            async move { tick(&idem, run, slot.unix_secs(), instance).await }
        })
        .await;
    seen.lock().unwrap().clone()
}

/// The instance behind, in the child: runs [`CHILD_SLOTS`] slots (or
/// gives up after [`CHILD_BOUND`], a hang the parent then reports), and
/// prints every slot it settled as `IDEM-SLOTS <unix second>:<outcome> ...`.
async fn child<DB: SkewDb>(run: &str) {
    let pool = DB::connect().await.expect("the database answers");
    let idem = Idem::new(pool);
    idem.migrate().await.expect("migrate");
    let (settled, mut settled_rx) = tokio::sync::watch::channel(0);
    let enough = async move {
        let enough = settled_rx.wait_for(|n| *n >= CHILD_SLOTS);
        let _ = tokio::time::timeout(CHILD_BOUND, enough).await;
    };
    let slots = runner(&idem, run, 1, enough, settled).await;
    let printed: Vec<String> = slots.iter().map(|(slot, outcome)| format!("{slot}:{}", outcome.as_str())).collect();
    println!("IDEM-SLOTS {}", printed.join(" "));
}

/// The parent's side on `DB`: the history of the last eleven minutes, a
/// runner on the true clock, and the child ten minutes behind beside it
/// until the child has settled its slots.
async fn both_clocks<DB: SkewDb>() {
    let Some(pool) = DB::connect().await else { return };
    DB::create_ticks(&pool).await;
    let idem = Idem::new(pool.clone());
    idem.migrate().await.expect("migrate");
    let run = idempotency_testkit::unique("skew").replace('-', "_");
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;
    DB::insert_history(&pool, &run, now - HISTORY_SECS..now).await;

    let child = Command::new("faketime")
        .args(["-f", SKEW])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, format!("{} {run}", DB::LABEL))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the child");
    let (exited, mut exited_rx) = tokio::sync::watch::channel(false);
    let waited = tokio::task::spawn_blocking(move || {
        let out = child.wait_with_output();
        exited.send_replace(true);
        out
    });
    let child_exited = async move {
        let _ = exited_rx.wait_for(|e| *e).await;
    };
    let ours = runner(&idem, &run, 0, child_exited, tokio::sync::watch::channel(0).0).await;
    let out = waited.await.unwrap().expect("the child ends");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}: child: {} {printed}", DB::LABEL, out.status);
    // The line may follow libtest's `test .. ` on the same line.
    let theirs: Vec<(i64, String)> = printed
        .split("IDEM-SLOTS ")
        .nth(1)
        .and_then(|rest| rest.lines().next())
        .unwrap_or_else(|| panic!("{}: the child printed no slots: {printed}", DB::LABEL))
        .split_whitespace()
        .map(|slot| {
            let (second, outcome) = slot.split_once(':').unwrap();
            (second.parse().unwrap(), outcome.to_owned())
        })
        .collect();

    let rows = DB::per_slot(&pool, &run).await;
    let twice: Vec<_> = rows.iter().filter(|(_, n)| *n > 1).collect();
    println!(
        "{}: {} slots here {ours:?}; {} by the instance {SKEW} behind {theirs:?}; run twice: {twice:?}",
        DB::LABEL,
        ours.len(),
        theirs.len(),
    );
    assert!(twice.is_empty(), "{}: slots run twice: {twice:?}", DB::LABEL);
    let ran: Vec<i64> = theirs.iter().filter(|(_, outcome)| outcome != "skipped").map(|(slot, _)| *slot).collect();
    assert!(ran.len() >= CHILD_SLOTS, "{}: the instance behind settled {theirs:?}", DB::LABEL);
    for (second, outcome) in &theirs {
        // The slots the database's clock says: from the start of this run on.
        assert!(*second >= now, "{}: the instance behind fired {second}, before {now}", DB::LABEL);
        let settled = ["executed", "done_elsewhere", "in_progress_elsewhere", "skipped"].contains(&outcome.as_str());
        assert!(settled, "{}: slot {second} {outcome}", DB::LABEL);
    }
    for second in ran {
        assert!(rows.contains(&(second, 1)), "{}: slot {second} has one row: {rows:?}", DB::LABEL);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_instance_ten_minutes_behind_runs_no_slot_twice() {
    // Run again as the instance behind (see `both_clocks`).
    if let Ok(orders) = std::env::var(CHILD_ENV) {
        let (db, run) = orders.split_once(' ').expect("<database> <run>");
        return match db {
            "mysql" => child::<sqlx::MySql>(run).await,
            _ => child::<sqlx::Postgres>(run).await,
        };
    }
    let runs = Command::new("faketime").args(["-f", "+0", "true"]).status().is_ok_and(|s| s.success());
    if !runs {
        assert!(!idempotency_testkit::services_required(), "faketime not installed and IDEM_REQUIRE_SERVICES=1");
        println!("skipped: faketime not installed");
        return;
    }
    tokio::join!(both_clocks::<sqlx::MySql>(), both_clocks::<sqlx::Postgres>());
}
