//! Cron jobs on MariaDB and PostgreSQL. By hand: three scheduler instances
//! (three engines, three pools, one database) fire the same 20 slots; each
//! slot runs exactly once, and a late backfill of a past slot does not run
//! it again. With `idempotency::cron::Runner`: three instances on a one-second
//! schedule for 30 slots, one of them stopped for 10 slots; every slot runs
//! once, missed slots within the window are caught up once, older ones are
//! skipped; a job cancelled at shutdown runs on the next start, once; and
//! a catch-up never runs a finished slot again, whatever the job's ttl.
//!
//! The runners fire by a [`ManualClock`] the test moves: a slot comes only
//! once every runner has settled what was due and waits on the clock, so no
//! outcome depends on how fast the machine is. The records' expiry is
//! judged by the database's real clock: where a test needs a record to
//! have aged as the runners' time went on, it ages it (by SQL, and its
//! cached copy in Redis). Wall-clock bounds only turn a hang into a failure.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idempotency::{Idem, Outcome, Status, idempotent};
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
    Idem(idempotency::Error),
    Db(sqlx::Error),
    /// A final answer (`record_errors`): recorded, replayed.
    Declined(Declined),
}

/// What a declining job records: the slot it declined.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Declined {
    slot: i64,
}

impl idempotency::BusinessError for JobError {
    type Record = Declined;

    fn recorded(&self) -> Option<Declined> {
        match self {
            JobError::Declined(declined) => Some(declined.clone()),
            _ => None,
        }
    }

    fn replayed(record: Declined) -> Self {
        JobError::Declined(record)
    }
}

/// How many times a declining job's body ran, per run (its rows roll back).
static DECLINE_RUNS: std::sync::Mutex<Option<HashMap<String, usize>>> = std::sync::Mutex::new(None);

fn decline_runs(run: &str) -> usize {
    DECLINE_RUNS.lock().unwrap().as_ref().and_then(|runs| runs.get(run).copied()).unwrap_or(0)
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
                        builder = builder.redis(idempotency_testkit::redis_client().await?);
                    }
                    let idem = builder.build();
                    idem.migrate().await.expect("migrate");
                    engines.push(idem);
                }
                Some(engines)
            }

            async fn three_instances_twenty_slots(redis: bool) {
                let Some(engines) = engines(redis).await else { return };
                let run = idempotency_testkit::unique("cron");
                let mut executed = 0;
                for slot in 0..SLOTS {
                    let barrier = Arc::new(Barrier::new(INSTANCES as usize));
                    let mut fired = Vec::new();
                    for (instance, idem) in engines.iter().enumerate() {
                        let (idem, run, barrier) = (idem.clone(), run.clone(), barrier.clone());
                        fired.push(tokio::spawn(async move {
                            barrier.wait().await;
                            idempotency::observe(settle(&idem, run, slot, instance as u32)).await
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
                                assert!(matches!(result, Err(JobError::Idem(idempotency::Error::InProgress { .. }))))
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
                let (late, outcome) = idempotency::observe(settle(&engines[2], run.clone(), 3, 2)).await;
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
    idempotency_testkit::reach("mysql", || async {
        sqlx::mysql::MySqlPoolOptions::new().max_connections(4).connect(&idempotency_testkit::mysql_url()).await.ok()
    }),
    "CREATE TABLE IF NOT EXISTS cron_runs (id BIGINT AUTO_INCREMENT PRIMARY KEY, run VARCHAR(100) NOT NULL, slot BIGINT NOT NULL, instance BIGINT NOT NULL, KEY (run))",
    "INSERT INTO cron_runs (run, slot, instance) VALUES (?, ?, ?)",
    "SELECT COUNT(*) FROM cron_runs WHERE run = ?",
    "SELECT COUNT(DISTINCT slot) FROM cron_runs WHERE run = ?"
);

cron_suite!(
    postgres,
    Postgres,
    idempotency_testkit::reach("postgres", || async {
        sqlx::postgres::PgPoolOptions::new().max_connections(4).connect(&idempotency_testkit::pg_url()).await.ok()
    }),
    "SELECT pg_advisory_xact_lock(7306232718293613); CREATE TABLE IF NOT EXISTS cron_runs (id BIGSERIAL PRIMARY KEY, run VARCHAR(100) NOT NULL, slot BIGINT NOT NULL, instance BIGINT NOT NULL)",
    "INSERT INTO cron_runs (run, slot, instance) VALUES ($1, $2, $3)",
    "SELECT COUNT(*) FROM cron_runs WHERE run = $1",
    "SELECT COUNT(DISTINCT slot) FROM cron_runs WHERE run = $1"
);

/// How late a slot the runner finds already due may still run.
const WINDOW: Duration = Duration::from_millis(2_500);
/// The runner's jitter before each slot (and before its start-up catch-up).
const JITTER: Duration = Duration::from_millis(100);
/// Slots of the runner test: S0 .. S29, one a second.
const RUNNER_SLOTS: i64 = 30;

/// One slot as an instance reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    instance: u32,
    slot: i64,
    outcome: idempotency::cron::SlotOutcome,
    catch_up: bool,
}

/// The runners' time: `secs` (a slot's Unix second) plus `ms`.
fn at_ms(secs: i64, ms: u64) -> std::time::SystemTime {
    std::time::UNIX_EPOCH + Duration::from_secs(secs as u64) + Duration::from_millis(ms)
}

/// A whole second a little ahead of this host's clock: the runs' S0, so
/// their slots look like today's in the tables (the runners never read
/// this host's clock: their time is the test's [`ManualClock`]).
fn a_second_ahead(secs: u64) -> i64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    (now + secs) as i64
}

use idempotency_testkit::ManualClock;

/// Once `n` runners have started and wait out their start-up jitter (or,
/// having drawn none, their first slot), lets the jitter pass.
async fn jitter_passes(clock: &ManualClock, n: usize) {
    clock.sleepers(n).await;
    clock.advance(JITTER);
}

/// Once `n` runners have settled everything due and wait for `slot` (each
/// within its jitter after it), makes the slot come: the clock moves to the
/// end of the jitter, and every one of them fires it.
async fn slot_comes(clock: &ManualClock, n: usize, slot: std::time::SystemTime) {
    let waits = clock.sleepers(n).await;
    assert!(waits.iter().all(|w| *w >= slot && *w < slot + JITTER), "{n} runners wait for {slot:?}: {waits:?}");
    clock.set(slot + JITTER);
}

macro_rules! runner_suite {
    (
        $module:ident, $db:ident, $redis:expr, $open:expr,
        $ddl:literal, $insert:literal, $per_slot:literal, $record_life:literal, $call_life:literal,
        $call_answer:literal, $age_record:literal, $age_call:literal
    ) => {
        mod $module {
            use std::sync::Mutex;
            use std::time::SystemTime;

            use idempotency::Steps;
            use idempotency::cron::{Runner, SlotOutcome, Stopped};
            use sqlx::{Transaction, $db};

            use super::*;

            const REDIS: bool = $redis;

            /// The job: one row per run, keyed by the slot's fire time. With
            /// `hang`, it says so once its row is written and never finishes.
            #[idempotent(key = "tick_<run>_<slot>", ttl = "1h", biz = "cron_runner")]
            async fn tick(
                idem: &Idem<$db>,
                tx: &mut Transaction<'_, $db>,
                run: String,
                slot: i64,
                #[idem(skip)] instance: u32,
                #[idem(skip)] hang: Option<tokio::sync::mpsc::UnboundedSender<i64>>,
            ) -> Result<(), JobError> {
                sqlx::query($insert).bind(&run).bind(slot).bind(instance as i64).execute(&mut **tx).await?;
                if let Some(started) = hang {
                    let _ = started.send(slot);
                    std::future::pending::<()>().await;
                }
                // Long enough for the other instances to arrive while it runs.
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(())
            }

            async fn engines(redis: bool) -> Option<Vec<Idem<$db>>> {
                let mut engines = Vec::new();
                for _ in 0..INSTANCES {
                    let pool: sqlx::Pool<$db> = $open.await?;
                    sqlx::raw_sql($ddl).execute(&pool).await.expect("cron table");
                    let mut builder = Idem::builder(pool);
                    if redis {
                        builder = builder.redis(idempotency_testkit::redis_client().await?);
                    }
                    let idem = builder.build();
                    idem.migrate().await.expect("migrate");
                    engines.push(idem);
                }
                Some(engines)
            }

            /// The job that declines for good: its row rolls back, its
            /// decline is recorded (`record_errors`).
            #[idempotent(key = "decline_<run>_<slot>", ttl = "1h", biz = "cron_decline", record_errors)]
            async fn decline(
                idem: &Idem<$db>,
                tx: &mut Transaction<'_, $db>,
                run: String,
                slot: i64,
                #[idem(skip)] instance: u32,
            ) -> Result<(), JobError> {
                *DECLINE_RUNS.lock().unwrap().get_or_insert_with(HashMap::new).entry(run.clone()).or_default() += 1;
                sqlx::query($insert).bind(&run).bind(slot).bind(instance as i64).execute(&mut **tx).await?;
                Err(JobError::Declined(Declined { slot }))
            }

            /// The same decline in the two-phase mode: declared permanent
            /// (`Error::Permanent`), recorded in `idem_call`.
            #[idempotent(key = "decline_steps_<run>_<slot>", ttl = "1h", biz = "cron_decline_steps", steps)]
            async fn decline_steps(
                idem: &Idem<$db>,
                steps: &mut Steps<$db>,
                run: String,
                slot: i64,
                #[idem(skip)] instance: u32,
            ) -> Result<(), JobError> {
                *DECLINE_RUNS.lock().unwrap().get_or_insert_with(HashMap::new).entry(run.clone()).or_default() += 1;
                let tx = steps.transaction().await?;
                sqlx::query($insert).bind(&run).bind(slot).bind(instance as i64).execute(&mut **tx).await?;
                Err(steps.permanent(&Declined { slot }).into())
            }

            /// The job with a ttl shorter than the catch-up window: its
            /// record alone would have expired when a catch-up came to it.
            #[idempotent(key = "short_<run>_<slot>", ttl = "2s", biz = "cron_short")]
            async fn short_lived(
                idem: &Idem<$db>,
                tx: &mut Transaction<'_, $db>,
                run: String,
                slot: i64,
                #[idem(skip)] instance: u32,
            ) -> Result<(), JobError> {
                sqlx::query($insert).bind(&run).bind(slot).bind(instance as i64).execute(&mut **tx).await?;
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(())
            }

            /// The same in the two-phase mode: its record is `idem_call`'s.
            #[idempotent(key = "steps_<run>_<slot>", ttl = "2s", biz = "cron_steps", steps)]
            async fn short_lived_steps(
                idem: &Idem<$db>,
                steps: &mut Steps<$db>,
                run: String,
                slot: i64,
                #[idem(skip)] instance: u32,
            ) -> Result<(), JobError> {
                let tx = steps.transaction().await?;
                sqlx::query($insert).bind(&run).bind(slot).bind(instance as i64).execute(&mut **tx).await?;
                Ok(())
            }

            /// The database's clock moves on by `by` for the record of
            /// `(biz, key)`, as it would while the runners' clock did: the
            /// record (`$age_record` or `$age_call`) is stamped `by`
            /// earlier, and so is the expiry its cached copy in Redis
            /// carries. The runners' clock is the test's, the database's
            /// is real: without this a catch-up seconds later by the
            /// runners' clock came milliseconds later by the database's.
            async fn age(idem: &Idem<$db>, redis: bool, table: &'static str, biz: &str, key: &str, by: Duration) {
                let by = by.as_millis() as i64;
                let aged = sqlx::query(table)
                    .bind(by)
                    .bind(by)
                    .bind(by)
                    .bind(biz)
                    .bind(key)
                    .execute(idem.pool())
                    .await
                    .expect("age the record");
                assert_eq!(aged.rows_affected(), 1, "{key}: one record");
                if !redis {
                    return;
                }
                let namespace = idem.redis_namespace().await.unwrap().expect("a namespace");
                let client = idempotency_testkit::redis_client().await.expect("redis");
                let at = idempotency::redis_layout::locate(namespace.as_str(), biz, key).unwrap();
                // Written after the commit, off the call's path: wait for it.
                idempotency_testkit::redis_cached_response(&client, &at).await;
                let cached = idempotency_testkit::redis_result(&client, &at).await.expect("cached");
                let (expires, fingerprint, response) = idempotency::redis_layout::parse_result(cached).unwrap();
                let aged = idempotency::redis_layout::result_value(expires - by, &fingerprint, &response);
                idempotency_testkit::redis_replace_result(&client, &at, &aged).await;
            }

            /// One instance's `runner` on `clock`, until it has reported
            /// `last` (a slot's Unix second): the shutdown follows what it
            /// did, not a timer.
            async fn instance<Fut>(
                runner: Runner,
                instance: u32,
                last: i64,
                seen: Arc<Mutex<Vec<Seen>>>,
                job: impl Fn(i64) -> Fut + Send + Sync + 'static,
            ) -> Stopped
            where
                Fut: std::future::Future<Output = Result<(), JobError>> + Send + 'static,
            {
                let (reported, mut reported_rx) = tokio::sync::watch::channel(i64::MIN);
                let runner = runner.on_slot(move |r| {
                    let (slot, outcome, catch_up) = (r.slot.unix_secs(), r.outcome, r.slot.is_catch_up());
                    seen.lock().unwrap().push(Seen { instance, slot, outcome, catch_up });
                    reported.send_replace(slot);
                });
                let shutdown = async move {
                    let _ = reported_rx.wait_for(|slot| *slot >= last).await;
                };
                runner.run(shutdown, move |slot| job(slot.unix_secs())).await
            }

            /// `tick` on a one-second schedule with the 2.5 s window.
            async fn tick_instance(
                idem: Idem<$db>,
                clock: ManualClock,
                run: String,
                i: u32,
                resume: Option<SystemTime>,
                last: i64,
                seen: Arc<Mutex<Vec<Seen>>>,
            ) -> Stopped {
                let mut runner =
                    Runner::new(&idem, "tick", "* * * * * *").unwrap().clock(clock).catch_up(WINDOW).jitter(JITTER);
                if let Some(resume) = resume {
                    runner = runner.resume_after(resume);
                }
                instance(runner, i, last, seen, move |slot| {
                    let (idem, run) = (idem.clone(), run.clone());
                    async move { tick(&idem, run, slot, i, None).await }
                })
                .await
            }

            async fn thirty_slots_one_instance_stopped_for_ten(redis: bool) {
                let Some(engines) = engines(redis).await else { return };
                let run = idempotency_testkit::unique("runner");
                let t0 = a_second_ahead(3);
                let at = |slot: i64, ms: u64| at_ms(t0 + slot, ms);
                let seen = Arc::new(Mutex::new(Vec::new()));

                // All three start just after S2: S0..S2 came due before
                // anyone ran, inside the 2.5 s window (S-1 is outside it).
                let clock = ManualClock::new(at(2, 50));
                let start = |i: usize, resume, last| {
                    let (idem, clock) = (engines[i].clone(), clock.clone());
                    tokio::spawn(tick_instance(idem, clock, run.clone(), i as u32, resume, t0 + last, seen.clone()))
                };
                let a = start(0, None, 9);
                let b = start(1, None, RUNNER_SLOTS - 1);
                let c = start(2, None, RUNNER_SLOTS - 1);
                jitter_passes(&clock, 3).await;
                // Instance 0 stops once it has settled S9 (it waits for no
                // slot after it), and comes back just after S19: S10..S16
                // are older than the window then, S17..S19 within it.
                for slot in 3..=9 {
                    slot_comes(&clock, 3, at(slot, 0)).await;
                }
                let stopped = a.await.unwrap();
                assert_eq!((stopped.last_slot, stopped.schedule_ended), (Some(at(9, 0)), false));
                for slot in 10..=19 {
                    slot_comes(&clock, 2, at(slot, 0)).await;
                }
                // The two others have settled S19 and wait for S20.
                clock.sleepers(2).await;
                let a = start(0, stopped.last_slot, RUNNER_SLOTS - 1);
                jitter_passes(&clock, 3).await;
                for slot in 20..RUNNER_SLOTS {
                    slot_comes(&clock, 3, at(slot, 0)).await;
                }
                for task in [a, b, c] {
                    let stopped = task.await.unwrap();
                    assert_eq!(stopped.last_slot, Some(at(RUNNER_SLOTS - 1, 0)));
                }

                // Every slot ran exactly once, and no other slot ran.
                let pool = engines[0].pool();
                let rows: Vec<(i64, i64)> = sqlx::query_as($per_slot).bind(&run).fetch_all(pool).await.unwrap();
                let expected: Vec<(i64, i64)> = (0..RUNNER_SLOTS).map(|i| (t0 + i, 1)).collect();
                assert_eq!(rows, expected, "one row per slot S0..S29");

                let seen = seen.lock().unwrap().clone();
                let of = |instance: u32| -> Vec<(i64, SlotOutcome, bool)> {
                    seen.iter()
                        .filter(|s| s.instance == instance)
                        .map(|s| (s.slot - t0, s.outcome, s.catch_up))
                        .collect()
                };
                use SlotOutcome::{DoneElsewhere, Executed, InProgressElsewhere, Skipped};
                let ran = |o: SlotOutcome| matches!(o, Executed | DoneElsewhere | InProgressElsewhere);
                // Instances 1 and 2 settled every slot once, in order, none
                // skipped; S0..S2 as catch-ups, the rest on time.
                for instance in [1, 2] {
                    let slots = of(instance);
                    assert_eq!(slots.iter().map(|s| s.0).collect::<Vec<_>>(), (0..RUNNER_SLOTS).collect::<Vec<_>>());
                    assert!(slots.iter().all(|s| ran(s.1)), "instance {instance}: {slots:?}");
                    assert!(slots.iter().all(|s| s.2 == (s.0 <= 2)), "instance {instance} catch-ups: {slots:?}");
                }
                // Instance 0: S0..S9; after the restart S10..S16 skipped,
                // S17..S19 caught up (the others had finished them), then
                // S20..S29 on time.
                let slots = of(0);
                assert_eq!(slots.iter().map(|s| s.0).collect::<Vec<_>>(), (0..RUNNER_SLOTS).collect::<Vec<_>>());
                for &(slot, outcome, catch_up) in &slots {
                    match slot {
                        0..=2 => assert!(ran(outcome) && catch_up, "S{slot}: {outcome:?}"),
                        3..=9 | 20.. => assert!(ran(outcome) && !catch_up, "S{slot}: {outcome:?}"),
                        10..=16 => assert_eq!((outcome, catch_up), (Skipped, true), "S{slot}"),
                        _ => assert_eq!((outcome, catch_up), (DoneElsewhere, true), "S{slot}"),
                    }
                }
                // Each slot was executed by exactly one instance.
                for slot in 0..RUNNER_SLOTS {
                    let executed = seen.iter().filter(|s| s.slot == t0 + slot && s.outcome == Executed).count();
                    assert_eq!(executed, 1, "S{slot}: {seen:?}");
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn runner_thirty_slots_one_instance_stopped_for_ten() {
                let test = thirty_slots_one_instance_stopped_for_ten(REDIS);
                tokio::time::timeout(Duration::from_secs(60), test).await.expect("the runner test hung");
            }

            /// Regression (issue 23): a catch-up never runs a finished slot
            /// again, whatever the job's ttl. Instances 0 and 1 run S0..S11
            /// of a one-second schedule with a job whose ttl is 2 s;
            /// instance 2 starts just after S7 with `catch_up(8s)`, so
            /// S0..S7 are within its window, and S0..S5 finished more than
            /// 2 s before. Every slot runs exactly once across the three.
            async fn catch_up_past_a_short_ttl(redis: bool) {
                const CATCH_UP: Duration = Duration::from_secs(8);
                const LAST: i64 = 11;
                // What each runner keeps its records for: window + jitter + a minute.
                let life_ms = |window: Duration| (window + JITTER).as_millis() as i64 + 60_000;
                let Some(engines) = engines(redis).await else { return };
                let run = idempotency_testkit::unique("short");
                let t0 = a_second_ahead(2);
                let at = |slot: i64, ms: u64| at_ms(t0 + slot, ms);
                let key = |slot: i64| format!("short_{run}_{}", t0 + slot);
                let seen = Arc::new(Mutex::new(Vec::new()));
                let clock = ManualClock::new(at(-1, 300));
                let start = |i: usize, catch_up: Duration| {
                    let (idem, run) = (engines[i].clone(), run.clone());
                    let runner = Runner::new(&idem, "short", "* * * * * *")
                        .unwrap()
                        .clock(clock.clone())
                        .catch_up(catch_up)
                        .jitter(JITTER);
                    tokio::spawn(instance(runner, i as u32, t0 + LAST, seen.clone(), move |slot| {
                        let (idem, run) = (idem.clone(), run.clone());
                        async move { short_lived(&idem, run, slot, i as u32).await }
                    }))
                };

                // 0 and 1 start 0.7 s before S0 (no window: S0 is their first slot).
                let (a, b) = (start(0, Duration::ZERO), start(1, Duration::ZERO));
                jitter_passes(&clock, 2).await;
                for slot in 0..=7 {
                    slot_comes(&clock, 2, at(slot, 0)).await;
                }
                // 2 starts just after S7: its window reaches back to S-0.5.
                // By then the records of S0..S7 are 7.5 to 0.5 s old.
                clock.sleepers(2).await;
                clock.set(at(7, 500));
                for slot in 0..=7 {
                    let old = at(7, 500).duration_since(at(slot, 0)).unwrap();
                    age(&engines[0], redis, $age_record, "cron_short", &key(slot), old).await;
                }
                let c = start(2, CATCH_UP);
                jitter_passes(&clock, 3).await;
                for slot in 8..=LAST {
                    slot_comes(&clock, 3, at(slot, 0)).await;
                }
                for task in [a, b, c] {
                    assert_eq!(task.await.unwrap().last_slot, Some(at(LAST, 0)));
                }

                let pool = engines[0].pool();
                let rows: Vec<(i64, i64)> = sqlx::query_as($per_slot).bind(&run).fetch_all(pool).await.unwrap();
                let expected: Vec<(i64, i64)> = (0..=LAST).map(|i| (t0 + i, 1)).collect();
                assert_eq!(rows, expected, "each slot S0..S11 ran exactly once");

                let seen = seen.lock().unwrap().clone();
                use SlotOutcome::{DoneElsewhere, Executed, InProgressElsewhere};
                for instance in 0..INSTANCES {
                    let slots: Vec<(i64, SlotOutcome, bool)> = seen
                        .iter()
                        .filter(|s| s.instance == instance)
                        .map(|s| (s.slot - t0, s.outcome, s.catch_up))
                        .collect();
                    assert_eq!(slots.iter().map(|s| s.0).collect::<Vec<_>>(), (0..=LAST).collect::<Vec<_>>());
                    for &(slot, outcome, catch_up) in &slots {
                        if instance == 2 && slot <= 7 {
                            // Caught up, each finished by 0 or 1: replayed, never run again.
                            assert_eq!((outcome, catch_up), (DoneElsewhere, true), "instance 2 S{slot}: {slots:?}");
                        } else {
                            assert!(!catch_up, "instance {instance} S{slot} on time");
                            assert!(matches!(outcome, Executed | DoneElsewhere | InProgressElsewhere), "S{slot}");
                        }
                    }
                }
                // Each slot's record outlives the window of the runner that wrote it.
                for slot in 0..=LAST {
                    let executed: Vec<&Seen> =
                        seen.iter().filter(|s| s.slot == t0 + slot && s.outcome == Executed).collect();
                    assert_eq!(executed.len(), 1, "S{slot}: {seen:?}");
                    let window = if executed[0].instance == 2 { CATCH_UP } else { Duration::ZERO };
                    let life: i64 = sqlx::query_scalar($record_life)
                        .bind("cron_short")
                        .bind(key(slot))
                        .fetch_one(pool)
                        .await
                        .unwrap();
                    assert_eq!(life, life_ms(window), "S{slot}");
                }
                // Outside a runner the job's record keeps its own ttl.
                let outside = format!("{run}-outside");
                short_lived(&engines[0], outside.clone(), t0, 0).await.unwrap();
                let key = format!("short_{outside}_{t0}");
                let life: i64 =
                    sqlx::query_scalar($record_life).bind("cron_short").bind(&key).fetch_one(pool).await.unwrap();
                assert_eq!(life, 2_000);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_catch_up_never_runs_a_finished_slot_again_whatever_the_ttl() {
                let test = catch_up_past_a_short_ttl(false);
                tokio::time::timeout(Duration::from_secs(60), test).await.expect("the catch-up test hung");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_catch_up_never_runs_a_finished_slot_again_whatever_the_ttl_with_redis() {
                let test = catch_up_past_a_short_ttl(true);
                tokio::time::timeout(Duration::from_secs(60), test).await.expect("the catch-up test hung");
            }

            /// Regression (issue 23), two-phase mode: a steps job with a
            /// 2 s ttl runs S0 on instance 0; instance 1 starts 3 s after
            /// with a 3.5 s window (back to S-0.5) and replays S0 instead of
            /// running it again.
            async fn steps_catch_up_past_a_short_ttl(redis: bool) {
                let Some(engines) = engines(redis).await else { return };
                let run = idempotency_testkit::unique("steps");
                let t0 = a_second_ahead(2);
                let at = |slot: i64, ms: u64| at_ms(t0 + slot, ms);
                let seen = Arc::new(Mutex::new(Vec::new()));
                let clock = ManualClock::new(at(-1, 300));
                let start = |i: usize, catch_up: Duration| {
                    let (idem, run) = (engines[i].clone(), run.clone());
                    let runner = Runner::new(&idem, "steps", "* * * * * *")
                        .unwrap()
                        .clock(clock.clone())
                        .catch_up(catch_up)
                        .jitter(JITTER);
                    // Each stops once it has settled S0 (1 after the slot it
                    // went on to, S1, a catch-up started before it saw the
                    // shutdown and finished within the grace).
                    tokio::spawn(instance(runner, i as u32, t0, seen.clone(), move |slot| {
                        let (idem, run) = (idem.clone(), run.clone());
                        async move { short_lived_steps(&idem, run, slot, i as u32).await }
                    }))
                };
                let first = start(0, Duration::ZERO);
                jitter_passes(&clock, 1).await;
                slot_comes(&clock, 1, at(0, 0)).await;
                assert_eq!(first.await.unwrap().last_slot, Some(at(0, 0)));
                // 3 s later by the runners' clock, and by the database's for S0's call.
                clock.set(at(3, 0));
                let key = format!("steps_{run}_{t0}");
                age(&engines[0], redis, $age_call, "cron_steps", &key, Duration::from_secs(3)).await;
                let second = start(1, Duration::from_millis(3_500));
                jitter_passes(&clock, 1).await;
                assert_eq!(second.await.unwrap().last_slot, Some(at(1, 0)));

                let seen: Vec<(u32, i64, SlotOutcome, bool)> =
                    seen.lock().unwrap().iter().map(|s| (s.instance, s.slot - t0, s.outcome, s.catch_up)).collect();
                use SlotOutcome::{DoneElsewhere, Executed};
                assert_eq!(seen, [(0, 0, Executed, false), (1, 0, DoneElsewhere, true), (1, 1, Executed, true)]);
                let pool = engines[0].pool();
                let rows: Vec<(i64, i64)> = sqlx::query_as($per_slot).bind(&run).fetch_all(pool).await.unwrap();
                assert_eq!(rows, [(t0, 1), (t0 + 1, 1)], "S0 ran once");
                let life: i64 =
                    sqlx::query_scalar($call_life).bind("cron_steps").bind(&key).fetch_one(pool).await.unwrap();
                assert_eq!(life, JITTER.as_millis() as i64 + 60_000, "window 0 + jitter + a minute");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_catch_up_never_runs_a_finished_steps_slot_again() {
                let test = steps_catch_up_past_a_short_ttl(false);
                tokio::time::timeout(Duration::from_secs(60), test).await.expect("the catch-up test hung");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_catch_up_never_runs_a_finished_steps_slot_again_with_redis() {
                let test = steps_catch_up_past_a_short_ttl(true);
                tokio::time::timeout(Duration::from_secs(60), test).await.expect("the catch-up test hung");
            }

            /// Regression: a job passing on its call's recorded decline was
            /// reported `Failed`, as a slot still to do. Instance 0 fires S1
            /// and the job declines: `Declined`, the slot settled. Another
            /// runner (a restart resuming before S1, within its window)
            /// fires S1 again: the decline is replayed, `DeclinedElsewhere`,
            /// the body not run again. Each counted under its own label.
            /// With `steps`, the job declares its decline permanent.
            async fn declined_slot_is_done(steps: bool) {
                let Some(engines) = engines(REDIS).await else { return };
                idempotency_testkit::counters::install();
                let run = idempotency_testkit::unique("decline");
                let job = idempotency_testkit::unique("decline-job");
                let t0 = a_second_ahead(2);
                let at = |slot: i64, ms: u64| at_ms(t0 + slot, ms);
                let clock = ManualClock::new(at(0, 500));
                type Report = (u32, i64, SlotOutcome, Option<Outcome>, bool, Option<String>);
                let seen: Arc<Mutex<Vec<Report>>> = Arc::default();
                let start = |i: u32, runner: Runner| {
                    let (idem, run, log) = (engines[i as usize].clone(), run.clone(), seen.clone());
                    let (reported, mut reported_rx) = tokio::sync::watch::channel(false);
                    let runner = runner.clock(clock.clone()).on_slot(move |r| {
                        let slot = r.slot.unix_secs() - t0;
                        log.lock().unwrap().push((i, slot, r.outcome, r.call, r.slot.is_catch_up(), r.error.clone()));
                        reported.send_replace(slot >= 1);
                    });
                    let shutdown = async move {
                        let _ = reported_rx.wait_for(|s1| *s1).await;
                    };
                    tokio::spawn(runner.run(shutdown, move |slot| {
                        let (idem, run) = (idem.clone(), run.clone());
                        async move {
                            match steps {
                                true => decline_steps(&idem, run, slot.unix_secs(), i).await,
                                false => decline(&idem, run, slot.unix_secs(), i).await,
                            }
                        }
                    }))
                };
                let first = start(0, Runner::new(&engines[0], job.as_str(), "* * * * * *").unwrap());
                assert_eq!(clock.sleepers(1).await, [at(1, 0)]);
                clock.set(at(1, 0));
                assert_eq!(first.await.unwrap().last_slot, Some(at(1, 0)), "the declined slot is settled");
                clock.set(at(1, 300));
                let restart = Runner::new(&engines[1], job.as_str(), "* * * * * *")
                    .unwrap()
                    .catch_up(Duration::from_secs(1))
                    .resume_after(at(0, 0));
                assert_eq!(start(1, restart).await.unwrap().last_slot, Some(at(1, 0)));

                let seen = seen.lock().unwrap().clone();
                let got: Vec<(u32, i64, SlotOutcome, Option<Outcome>, bool)> =
                    seen.iter().map(|r| (r.0, r.1, r.2, r.3, r.4)).collect();
                use SlotOutcome::{Declined as DeclinedHere, DeclinedElsewhere};
                assert_eq!(
                    got,
                    [
                        (0, 1, DeclinedHere, Some(Outcome::Executed), false),
                        (1, 1, DeclinedElsewhere, Some(Outcome::Replayed), true)
                    ],
                    "{seen:?}"
                );
                let error = if steps { "Permanent" } else { "Declined" };
                assert!(seen.iter().all(|r| r.5.as_deref().is_some_and(|e| e.contains(error))), "{seen:?}");
                assert_eq!(decline_runs(&run), 1, "the body ran once");
                let pool = engines[0].pool();
                let rows: Vec<(i64, i64)> = sqlx::query_as($per_slot).bind(&run).fetch_all(pool).await.unwrap();
                let recorded = format!(r#"{{"slot":{}}}"#, t0 + 1);
                if steps {
                    // A permanent failure commits with what its body wrote.
                    assert_eq!(rows, [(t0 + 1, 1)]);
                    let key = format!("decline_steps_{run}_{}", t0 + 1);
                    let failure: (i16, String) = sqlx::query_as($call_answer)
                        .bind("cron_decline_steps")
                        .bind(&key)
                        .fetch_one(pool)
                        .await
                        .unwrap();
                    assert_eq!(failure, (2, recorded));
                } else {
                    assert_eq!(rows, [], "the declined job's row rolled back");
                    let key = format!("decline_{run}_{}", t0 + 1);
                    assert_eq!(
                        engines[0].status("cron_decline", &key).await.unwrap(),
                        Status::Failed { error: recorded }
                    );
                }
                let counted = idempotency_testkit::counters::counted_by(
                    idempotency::metrics::CRON_SLOTS,
                    &[("job", &job)],
                    "outcome",
                );
                let expected = [("declined".to_owned(), 1), ("declined_elsewhere".to_owned(), 1)];
                assert_eq!(counted, HashMap::from(expected));
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_declined_slot_is_done_and_never_run_again() {
                let test = declined_slot_is_done(false);
                tokio::time::timeout(Duration::from_secs(60), test).await.expect("the decline test hung");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_steps_slot_failed_for_good_is_done_and_never_run_again() {
                let test = declined_slot_is_done(true);
                tokio::time::timeout(Duration::from_secs(60), test).await.expect("the decline test hung");
            }

            /// A job still running at shutdown, past the grace, is dropped:
            /// its transaction rolls back, the slot is reported cancelled and
            /// is not the last settled; the next start runs it, once.
            async fn cancelled_at_shutdown() {
                let Some(engines) = engines(REDIS).await else { return };
                let idem = engines[0].clone();
                let run = idempotency_testkit::unique("cancel");
                let t0 = a_second_ahead(2);
                let at = |slot: i64, ms: u64| at_ms(t0 + slot, ms);
                let clock = ManualClock::new(at(0, 500));
                let seen = Arc::new(Mutex::new(Vec::new()));
                let (started, mut started_rx) = tokio::sync::mpsc::unbounded_channel::<i64>();
                let log = seen.clone();
                let (job_idem, job_run) = (idem.clone(), run.clone());
                let first = Runner::new(&idem, "tick", "* * * * * *")
                    .unwrap()
                    .clock(clock.clone())
                    .shutdown_grace(Duration::from_millis(200))
                    .on_slot(move |r| log.lock().unwrap().push((r.slot.unix_secs() - t0, r.outcome)))
                    .run(async move { started_rx.recv().await }, move |slot| {
                        let (idem, run, started) = (job_idem.clone(), job_run.clone(), started.clone());
                        async move { tick(&idem, run, slot.unix_secs(), 0, Some(started)).await }
                    });
                let first = tokio::spawn(first);
                // S1 comes; its job hangs, the shutdown comes, and the runner
                // waits out the grace on its clock: the grace ends.
                assert_eq!(clock.sleepers(1).await, [at(1, 0)]);
                clock.set(at(1, 0));
                assert_eq!(clock.sleepers(1).await, [at(1, 200)], "the grace");
                // With Redis, the hanging call holds its claim.
                let claim = if REDIS {
                    let namespace = idem.redis_namespace().await.unwrap().expect("a namespace");
                    let client = idempotency_testkit::redis_client().await.expect("redis");
                    let key = format!("tick_{run}_{}", t0 + 1);
                    let at = idempotency::redis_layout::locate(namespace.as_str(), "cron_runner", &key).unwrap();
                    assert!(idempotency_testkit::redis_exists(&client, &at.claim).await, "S1's claim is held");
                    Some((client, at))
                } else {
                    None
                };
                clock.set(at(1, 200));
                let stopped = first.await.unwrap();
                assert_eq!(stopped.last_slot, None, "the cancelled slot is not settled");
                assert_eq!(*seen.lock().unwrap(), [(1, SlotOutcome::Cancelled)]);
                if let Some((client, held)) = claim {
                    // The dropped call's claim is released off its path: wait for it.
                    let released = async {
                        while idempotency_testkit::redis_exists(&client, &held.claim).await {
                            tokio::task::yield_now().await;
                        }
                    };
                    tokio::time::timeout(Duration::from_secs(30), released).await.expect("the claim released");
                }

                // The next start looks back over its 3 s window and runs
                // S-1, S0 and the cancelled S1, once each.
                let log = seen.clone();
                let (job_idem, job_run) = (idem.clone(), run.clone());
                let (done, mut done_rx) = tokio::sync::watch::channel(false);
                Runner::new(&idem, "tick", "* * * * * *")
                    .unwrap()
                    .clock(clock.clone())
                    .catch_up(Duration::from_secs(3))
                    .on_slot(move |r| {
                        log.lock().unwrap().push((r.slot.unix_secs() - t0, r.outcome));
                        if r.slot.unix_secs() == t0 + 1 {
                            done.send_replace(true);
                        }
                    })
                    .run(
                        async move {
                            let _ = done_rx.wait_for(|d| *d).await;
                        },
                        move |s| {
                            let (idem, run) = (job_idem.clone(), job_run.clone());
                            async move { tick(&idem, run, s.unix_secs(), 1, None).await }
                        },
                    )
                    .await;
                use SlotOutcome::{Cancelled, Executed};
                assert_eq!(*seen.lock().unwrap(), [(1, Cancelled), (-1, Executed), (0, Executed), (1, Executed)]);
                // The cancelled run left nothing: every slot has one row, its own.
                let rows: Vec<(i64, i64)> = sqlx::query_as($per_slot).bind(&run).fetch_all(idem.pool()).await.unwrap();
                assert_eq!(rows, [(t0 - 1, 1), (t0, 1), (t0 + 1, 1)]);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_job_cancelled_at_shutdown_runs_on_the_next_start() {
                let test = cancelled_at_shutdown();
                tokio::time::timeout(Duration::from_secs(60), test).await.expect("the cancellation test hung");
            }
        }
    };
}

runner_suite!(
    mysql_runner,
    MySql,
    true,
    idempotency_testkit::reach("mysql", || async {
        sqlx::mysql::MySqlPoolOptions::new().max_connections(4).connect(&idempotency_testkit::mysql_url()).await.ok()
    }),
    "CREATE TABLE IF NOT EXISTS cron_ticks (id BIGINT AUTO_INCREMENT PRIMARY KEY, run VARCHAR(100) NOT NULL, slot BIGINT NOT NULL, instance BIGINT NOT NULL, KEY (run))",
    "INSERT INTO cron_ticks (run, slot, instance) VALUES (?, ?, ?)",
    "SELECT slot, COUNT(*) FROM cron_ticks WHERE run = ? GROUP BY slot ORDER BY slot",
    "SELECT expires_at - updated_at FROM idem_record WHERE biz_type = ? AND idem_key = ?",
    "SELECT expires_at - updated_at FROM idem_call WHERE biz_type = ? AND idem_key = ?",
    "SELECT status, response FROM idem_call WHERE biz_type = ? AND idem_key = ?",
    "UPDATE idem_record SET created_at = created_at - ?, updated_at = updated_at - ?, expires_at = expires_at - ? WHERE biz_type = ? AND idem_key = ?",
    "UPDATE idem_call SET created_at = created_at - ?, updated_at = updated_at - ?, expires_at = expires_at - ? WHERE biz_type = ? AND idem_key = ?"
);

runner_suite!(
    postgres_runner,
    Postgres,
    false,
    idempotency_testkit::reach("postgres", || async {
        sqlx::postgres::PgPoolOptions::new().max_connections(4).connect(&idempotency_testkit::pg_url()).await.ok()
    }),
    "SELECT pg_advisory_xact_lock(7306232718293615); CREATE TABLE IF NOT EXISTS cron_ticks (id BIGSERIAL PRIMARY KEY, run VARCHAR(100) NOT NULL, slot BIGINT NOT NULL, instance BIGINT NOT NULL)",
    "INSERT INTO cron_ticks (run, slot, instance) VALUES ($1, $2, $3)",
    "SELECT slot, COUNT(*) FROM cron_ticks WHERE run = $1 GROUP BY slot ORDER BY slot",
    "SELECT expires_at - updated_at FROM idem_record WHERE biz_type = $1 AND idem_key = $2",
    "SELECT expires_at - updated_at FROM idem_call WHERE biz_type = $1 AND idem_key = $2",
    "SELECT status, response FROM idem_call WHERE biz_type = $1 AND idem_key = $2",
    "UPDATE idem_record SET created_at = created_at - $1, updated_at = updated_at - $2, expires_at = expires_at - $3 WHERE biz_type = $4 AND idem_key = $5",
    "UPDATE idem_call SET created_at = created_at - $1, updated_at = updated_at - $2, expires_at = expires_at - $3 WHERE biz_type = $4 AND idem_key = $5"
);
