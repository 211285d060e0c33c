//! `cargo run --example cron --features cron`: three scheduler instances
//! (three engines, three pools, one SQLite database file) run the same
//! `idempotency::cron::Runner` on a schedule firing every 2 seconds. Each slot
//! settles once, whichever instance wins; the others report it done or in
//! progress elsewhere. The third instance starts 5 seconds late and catches
//! up the slots it missed within its 4-second window.
//!
//! The key is the job's *scheduled* slot (the fire time the schedule meant),
//! not the wall clock when an instance happened to wake up, so instances
//! that drift, and a late catch-up of a missed slot, all share it.

use std::time::Duration;

use idempotency::cron::{Runner, SlotReport};
use idempotency::{Idem, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, Transaction};

#[derive(Debug, Serialize, Deserialize)]
struct Settlement {
    slot: i64,
    settled_by: u32,
}

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug in the slot reports
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

/// The job, keyed by the slot. `instance` is skipped: every instance runs
/// the same action.
#[idempotent(key = "settle_<slot>", ttl = "7d", biz = "settle")]
async fn settle(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    slot: i64,
    #[idem(skip)] instance: u32,
) -> Result<Settlement, JobError> {
    sqlx::query("INSERT INTO settlements (slot, instance) VALUES (?, ?)")
        .bind(slot)
        .bind(instance)
        .execute(&mut **tx)
        .await?;
    Ok(Settlement { slot, settled_by: instance })
}

/// One instance: the runner, until `stop` fires.
async fn instance(idem: Idem<Sqlite>, instance: u32, stop: tokio::sync::watch::Receiver<bool>) {
    let mut stop = stop;
    // Built from the engine: it fires by the engine's clock, the database's
    // (SQLite's is this host's), the one the records' expiry is judged by.
    let runner = Runner::new(&idem, "settle", "*/2 * * * * *")
        .expect("a valid expression")
        .catch_up(Duration::from_secs(4))
        .jitter(Duration::from_millis(100))
        .on_slot(move |report: &SlotReport| {
            let error = report.error.as_deref().unwrap_or("");
            println!("instance {instance}: slot {} {} {error}", report.slot, report.outcome.as_str());
        });
    let stopped = runner
        .run(async move { stop.wait_for(|s| *s).await.map(drop).unwrap_or(()) }, move |slot| {
            let idem = idem.clone();
            async move { settle(&idem, slot.unix_secs(), instance).await }
        })
        .await;
    println!("instance {instance} stopped after slot {:?}", stopped.last_slot);
}

#[tokio::main]
async fn main() -> Result<(), JobError> {
    let path = std::env::temp_dir().join(format!("idem-cron-example-{}.db", std::process::id()));
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let mut engines = Vec::new();
    for _ in 0..3 {
        let pool = SqlitePoolOptions::new().max_connections(2).connect_with(options.clone()).await?;
        engines.push(Idem::new(pool));
    }
    engines[0].migrate().await?;
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS settlements (slot INTEGER NOT NULL, instance INTEGER NOT NULL)")
        .execute(engines[0].pool())
        .await?;

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    for (i, idem) in engines.iter().enumerate().take(2) {
        tasks.push(tokio::spawn(instance(idem.clone(), i as u32, stopped.clone())));
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    println!("instance 2 starts late");
    tasks.push(tokio::spawn(instance(engines[2].clone(), 2, stopped.clone())));
    tokio::time::sleep(Duration::from_secs(5)).await;
    let _ = stop.send(true);
    for t in tasks {
        t.await.expect("instance task");
    }

    let rows: Vec<(i64, i64)> = sqlx::query_as("SELECT slot, COUNT(*) FROM settlements GROUP BY slot ORDER BY slot")
        .fetch_all(engines[0].pool())
        .await?;
    for (slot, count) in &rows {
        println!("settlements for slot {slot}: {count}");
    }
    let _ = std::fs::remove_file(&path);
    Ok(())
}
