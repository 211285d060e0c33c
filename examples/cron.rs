//! `cargo run --example cron`: three scheduler instances (three engines,
//! three pools, one SQLite database file) fire a "daily settlement" job every
//! 2 seconds for 4 slots. Each slot settles once, whichever instance wins.
//!
//! The key is the job's *scheduled* slot — the fire time the schedule meant —
//! not the wall clock when an instance happened to wake up, so instances that
//! drift, and a late backfill of a missed slot, all share it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem::{Idem, Outcome, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, Transaction};

const PERIOD_SECS: u64 = 2;
const SLOTS: u64 = 4;

#[derive(Debug, Serialize, Deserialize)]
struct Settlement {
    slot: u64,
    settled_by: u32,
}

#[derive(Debug)]
enum JobError {
    Idem(idem::Error),
    Db(sqlx::Error),
}

impl std::fmt::Display for JobError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobError::Idem(e) => write!(f, "{e}"),
            JobError::Db(e) => write!(f, "database: {e}"),
        }
    }
}

impl From<idem::Error> for JobError {
    fn from(e: idem::Error) -> Self {
        JobError::Idem(e)
    }
}

impl From<sqlx::Error> for JobError {
    fn from(e: sqlx::Error) -> Self {
        JobError::Db(e)
    }
}

/// The job. `instance` is skipped: every instance runs the same action.
#[idempotent(key = "daily_settle_<slot>", ttl = "7d", biz = "settle")]
async fn settle(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    slot: u64,
    #[idem(skip)] instance: u32,
) -> Result<Settlement, JobError> {
    sqlx::query("INSERT INTO settlements (slot, instance) VALUES (?, ?)")
        .bind(slot as i64)
        .bind(instance)
        .execute(&mut **tx)
        .await?;
    Ok(Settlement { slot, settled_by: instance })
}

/// One scheduler instance: wakes at each slot boundary (with its own drift)
/// and fires the job for the slot it meant.
async fn scheduler(idem: Idem<Sqlite>, instance: u32, first_slot: u64) {
    for n in 0..SLOTS {
        let slot = first_slot + n * PERIOD_SECS;
        let drift = Duration::from_millis(37 * u64::from(instance));
        let wake = UNIX_EPOCH + Duration::from_secs(slot) + drift;
        if let Ok(wait) = wake.duration_since(SystemTime::now()) {
            tokio::time::sleep(wait).await;
        }
        let (result, outcome) = idem::observe(settle(&idem, slot, instance)).await;
        let what = match (outcome, &result) {
            (Some(Outcome::Executed), _) => "settled it".to_string(),
            (Some(Outcome::Replayed), Ok(s)) => format!("replayed (settled by instance {})", s.settled_by),
            (_, Err(e)) => format!("{e}"),
            (other, _) => format!("{other:?}"),
        };
        println!("slot {slot}  instance {instance}: {what}");
    }
}

#[tokio::main]
async fn main() -> Result<(), JobError> {
    let path = std::env::temp_dir().join(format!("idem-cron-example-{}.db", std::process::id()));
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let mut instances = Vec::new();
    for _ in 0..3 {
        let pool = SqlitePoolOptions::new().max_connections(2).connect_with(options.clone()).await?;
        instances.push(Idem::new(pool));
    }
    instances[0].migrate().await?;
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS settlements (slot INTEGER NOT NULL, instance INTEGER NOT NULL)")
        .execute(instances[0].pool())
        .await?;

    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    let first_slot = (now / PERIOD_SECS + 1) * PERIOD_SECS;
    let tasks: Vec<_> = instances
        .iter()
        .enumerate()
        .map(|(i, idem)| tokio::spawn(scheduler(idem.clone(), i as u32, first_slot)))
        .collect();
    for t in tasks {
        t.await.expect("scheduler task");
    }

    // A late backfill of the first slot (say, after a restart) replays it.
    let (late, outcome) = idem::observe(settle(&instances[1], first_slot, 1)).await;
    println!("backfill of slot {first_slot}: {outcome:?} {late:?}");

    let rows: Vec<(i64, i64)> = sqlx::query_as("SELECT slot, COUNT(*) FROM settlements GROUP BY slot ORDER BY slot")
        .fetch_all(instances[0].pool())
        .await?;
    for (slot, count) in &rows {
        println!("settlements for slot {slot}: {count}");
    }
    let _ = std::fs::remove_file(&path);
    Ok(())
}
