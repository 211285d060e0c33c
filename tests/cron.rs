//! Cron jobs: three scheduler instances (three engines, three pools, one
//! database) fire the same 20 slots; each slot runs exactly once, and a late
//! backfill of a past slot does not run it again. MariaDB and PostgreSQL.

mod common;

use std::sync::Arc;
use std::time::Duration;

use idem::{Idem, Outcome, idempotent};
use serde::{Deserialize, Serialize};
use tokio::sync::Barrier;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Settlement {
    slot: u64,
    instance: u32,
}

#[derive(Debug)]
#[allow(dead_code)] // the fields show in assertion messages through Debug
enum JobError {
    Idem(idem::Error),
    Db(sqlx::Error),
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

const INSTANCES: u32 = 3;
const SLOTS: u64 = 20;

macro_rules! cron_suite {
    ($module:ident, $db:ident, $open:expr, $ddl:literal, $insert:literal, $count:literal, $distinct:literal) => {
        mod $module {
            use super::*;
            use sqlx::{Transaction, $db};

            /// The job: the key is the run's name plus the slot the schedule
            /// meant, so every instance firing that slot shares it.
            #[idempotent(key = "settle_<run>_<slot>", ttl = "7d", biz = "cron_settle")]
            async fn settle(
                idem: &Idem<$db>,
                tx: &mut Transaction<'_, $db>,
                run: String,
                slot: u64,
                #[idem(skip)] instance: u32,
            ) -> Result<Settlement, JobError> {
                sqlx::query($insert).bind(&run).bind(slot as i64).bind(instance as i64).execute(&mut **tx).await?;
                // Long enough for the other instances to arrive while it runs.
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(Settlement { slot, instance })
            }

            async fn engines(redis: bool) -> Option<Vec<Idem<$db>>> {
                let mut engines = Vec::new();
                for _ in 0..INSTANCES {
                    let pool: sqlx::Pool<$db> = $open.await?;
                    sqlx::raw_sql($ddl).execute(&pool).await.expect("cron table");
                    let mut builder = Idem::builder(pool);
                    if redis {
                        builder = builder.redis(common::redis_client().await?);
                    }
                    let idem = builder.build();
                    idem.migrate().await.expect("migrate");
                    engines.push(idem);
                }
                Some(engines)
            }

            async fn three_instances_twenty_slots(redis: bool) {
                let Some(engines) = engines(redis).await else { return };
                let run = common::unique("cron");
                let mut executed = 0;
                for slot in 0..SLOTS {
                    let barrier = Arc::new(Barrier::new(INSTANCES as usize));
                    let mut fired = Vec::new();
                    for (instance, idem) in engines.iter().enumerate() {
                        let (idem, run, barrier) = (idem.clone(), run.clone(), barrier.clone());
                        fired.push(tokio::spawn(async move {
                            barrier.wait().await;
                            idem::observe(settle(&idem, run, slot, instance as u32)).await
                        }));
                    }
                    let mut winners = Vec::new();
                    for f in fired {
                        let (result, outcome) = f.await.unwrap();
                        match outcome {
                            Some(Outcome::Executed) => {
                                executed += 1;
                                winners.push(result.unwrap());
                            }
                            Some(Outcome::Replayed) => winners.push(result.unwrap()),
                            Some(Outcome::InProgress) => {
                                assert!(matches!(result, Err(JobError::Idem(idem::Error::InProgress { .. }))))
                            }
                            other => panic!("slot {slot}: {other:?} {result:?}"),
                        }
                    }
                    // Whoever answered, answered with the one execution.
                    assert!(winners.windows(2).all(|w| w[0] == w[1]), "slot {slot}: {winners:?}");
                }
                assert_eq!(executed, SLOTS as usize);

                let pool = engines[0].pool();
                let rows: i64 = sqlx::query_scalar($count).bind(&run).fetch_one(pool).await.unwrap();
                let slots: i64 = sqlx::query_scalar($distinct).bind(&run).fetch_one(pool).await.unwrap();
                assert_eq!((rows, slots), (SLOTS as i64, SLOTS as i64), "each slot ran once");

                // A late backfill of slot 3 from another instance replays it.
                let (late, outcome) = idem::observe(settle(&engines[2], run.clone(), 3, 2)).await;
                assert_eq!(outcome, Some(Outcome::Replayed));
                assert_eq!(late.unwrap().slot, 3);
                let rows: i64 = sqlx::query_scalar($count).bind(&run).fetch_one(pool).await.unwrap();
                assert_eq!(rows, SLOTS as i64);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 3)]
            async fn each_slot_runs_once_across_three_instances() {
                three_instances_twenty_slots(false).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 3)]
            async fn each_slot_runs_once_across_three_instances_with_redis() {
                three_instances_twenty_slots(true).await;
            }
        }
    };
}

cron_suite!(
    mysql,
    MySql,
    common::reach("mysql", || async {
        sqlx::mysql::MySqlPoolOptions::new().max_connections(4).connect(&common::mysql_url()).await.ok()
    }),
    "CREATE TABLE IF NOT EXISTS cron_runs (id BIGINT AUTO_INCREMENT PRIMARY KEY, run VARCHAR(100) NOT NULL, slot BIGINT NOT NULL, instance BIGINT NOT NULL, KEY (run))",
    "INSERT INTO cron_runs (run, slot, instance) VALUES (?, ?, ?)",
    "SELECT COUNT(*) FROM cron_runs WHERE run = ?",
    "SELECT COUNT(DISTINCT slot) FROM cron_runs WHERE run = ?"
);

cron_suite!(
    postgres,
    Postgres,
    common::reach("postgres", || async {
        sqlx::postgres::PgPoolOptions::new().max_connections(4).connect(&common::pg_url()).await.ok()
    }),
    "SELECT pg_advisory_xact_lock(7306232718293613); CREATE TABLE IF NOT EXISTS cron_runs (id BIGSERIAL PRIMARY KEY, run VARCHAR(100) NOT NULL, slot BIGINT NOT NULL, instance BIGINT NOT NULL)",
    "INSERT INTO cron_runs (run, slot, instance) VALUES ($1, $2, $3)",
    "SELECT COUNT(*) FROM cron_runs WHERE run = $1",
    "SELECT COUNT(DISTINCT slot) FROM cron_runs WHERE run = $1"
);
