//! A cron instance whose clock is off fires by the database's clock
//! (`Runner::database_clock`): a runner in a child process 70 s behind
//! (libfaketime, `faketime -f -70s`) beside one on the true clock, a
//! one-second schedule, a 3-second catch-up window and a 2-second job ttl,
//! so each slot's record lives the window plus the runner's minute of margin. By its own clock the child would fire
//! every slot 70 s late, after the slot's record expired, and run it again;
//! by the database's it fires the slots when they come, and each runs once.
//! On MariaDB and PostgreSQL at once; about 80 s.

use std::process::{Command, Stdio};
use std::time::Duration;

use idempotency::cron::{Runner, SlotOutcome};
use idempotency::{Backend, Idem, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::Transaction;

/// Set in the child's environment: `<database> <run> <seconds>`.
const CHILD_ENV: &str = "IDEM_CRON_SKEW_CHILD";
/// How far behind the child's clock is: more than the records' life (63 s).
const SKEW: &str = "-70s";
const SKEW_SECS: u64 = 70;
/// How long the child's runner runs, in seconds.
const CHILD_SECS: u64 = SKEW_SECS + 6;

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

/// A runner of `run` by the database's clock for `secs`; its settled
/// slots and their outcomes.
async fn runner<DB: SkewDb>(idem: &Idem<DB>, run: &str, instance: i64, secs: u64) -> Vec<(i64, SlotOutcome)> {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let (job_idem, job_run) = (idem.clone(), run.to_owned());
    Runner::new("skew", "* * * * * *")
        .unwrap()
        .database_clock(idem)
        // Slots a busy machine wakes late for still run (and stay once).
        .catch_up(Duration::from_secs(3))
        .shutdown_grace(Duration::from_secs(5))
        .on_slot(move |r| log.lock().unwrap().push((r.slot.unix_secs(), r.outcome)))
        .run(tokio::time::sleep(Duration::from_secs(secs)), move |slot| {
            let (idem, run) = (job_idem.clone(), job_run.clone());
            async move { tick(&idem, run, slot.unix_secs(), instance).await }
        })
        .await;
    seen.lock().unwrap().clone()
}

async fn child<DB: SkewDb>(run: &str, secs: u64) {
    let pool = DB::connect().await.expect("the database answers");
    let idem = Idem::new(pool);
    idem.migrate().await.expect("migrate");
    let settled = runner(&idem, run, 1, secs).await;
    let mut outcomes = std::collections::BTreeMap::new();
    for (_, outcome) in &settled {
        *outcomes.entry(outcome.as_str()).or_insert(0) += 1;
    }
    println!("IDEM-SETTLED {} {outcomes:?}", settled.len());
}

/// The child's entry: does nothing unless the parent set [`CHILD_ENV`].
#[test]
fn child_process() {
    let Ok(orders) = std::env::var(CHILD_ENV) else { return };
    let mut words = orders.split(' ');
    let (db, run, secs) = (words.next().unwrap(), words.next().unwrap().to_owned(), words.next().unwrap());
    let secs: u64 = secs.parse().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async move {
        match db {
            "mysql" => child::<sqlx::MySql>(&run, secs).await,
            _ => child::<sqlx::Postgres>(&run, secs).await,
        }
    });
}

/// The parent's side on `DB`: a runner on the true clock for the whole
/// run, and the child, 70 s behind, for most of it.
async fn both_clocks<DB: SkewDb>() {
    let Some(pool) = DB::connect().await else { return };
    DB::create_ticks(&pool).await;
    let idem = Idem::new(pool.clone());
    idem.migrate().await.expect("migrate");
    let run = idempotency_testkit::unique("skew").replace('-', "_");
    let exe = std::env::current_exe().unwrap();
    let child = Command::new("faketime")
        .args(["-f", SKEW])
        .arg(exe)
        .args(["--exact", "child_process", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, format!("{} {run} {CHILD_SECS}", DB::LABEL))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the child");
    let ours = runner(&idem, &run, 0, CHILD_SECS + 2).await;
    let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await.unwrap().expect("the child ends");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child: {} {printed}", out.status);
    let theirs: usize = printed
        .split("IDEM-SETTLED ")
        .nth(1)
        .and_then(|n| n.split_whitespace().next()?.parse().ok())
        .expect("the child's count");

    let rows = DB::per_slot(&pool, &run).await;
    let twice: Vec<_> = rows.iter().filter(|(_, n)| *n > 1).collect();
    let mut outcomes = std::collections::BTreeMap::new();
    for (_, outcome) in &ours {
        *outcomes.entry(outcome.as_str()).or_insert(0) += 1;
    }
    println!("{}: outcomes here {outcomes:?}; the child printed {printed:?}", DB::LABEL);
    println!(
        "{}: {} slots, {} settled here, {theirs} by the instance {SKEW} behind, run twice: {twice:?}",
        DB::LABEL,
        rows.len(),
        ours.len()
    );
    assert!(twice.is_empty(), "{}: slots run twice: {twice:?}", DB::LABEL);
    assert!(theirs as u64 >= CHILD_SECS / 2, "{}: the skewed instance fired its slots ({theirs})", DB::LABEL);
    assert!(rows.len() as u64 >= CHILD_SECS / 2, "{}: {} slots", DB::LABEL, rows.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_instance_behind_fires_by_the_database_clock() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let runs = Command::new("faketime").args(["-f", "+0", "true"]).status().is_ok_and(|s| s.success());
    if !runs {
        assert!(!idempotency_testkit::services_required(), "faketime not installed and IDEM_REQUIRE_SERVICES=1");
        println!("skipped: faketime not installed");
        return;
    }
    tokio::join!(both_clocks::<sqlx::MySql>(), both_clocks::<sqlx::Postgres>());
}
