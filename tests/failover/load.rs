//! The clients and their history: one annotated fn that writes a ledger row
//! in the call's transaction, callers that retry a failed call (same key,
//! same arguments, the next engine) until it answers, and every attempt
//! recorded with what it saw.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency::{Idem, Outcome, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{Postgres, Transaction};
use tokio::sync::Barrier;
use tokio::task::JoinHandle;

/// The business action.
pub const BIZ: &str = "failover_pay";
/// The ledger: one row per committed execution, naming the attempt that ran it.
pub const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS failover_ledger (
    id BIGSERIAL PRIMARY KEY, k VARCHAR(255) NOT NULL, amount BIGINT NOT NULL, attempt BIGINT NOT NULL)";
/// A call still without an answer after this long is a hang: it stops retrying.
const ANSWER_WITHIN: Duration = Duration::from_secs(40);
/// Between two attempts of one call.
const RETRY_PAUSE: Duration = Duration::from_millis(25);
/// Tasks calling distinct keys, and callers in one storm.
const STEADY_TASKS: usize = 12;
const STORM_CALLERS: usize = 16;
const STORM_EVERY: Duration = Duration::from_millis(500);

/// What a call answers: which attempt executed it and its ledger row, so a
/// replay names the execution it replays.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Receipt {
    pub key: String,
    pub amount: i64,
    pub attempt: u64,
    pub ledger_id: i64,
}

#[derive(Debug)]
pub enum PayError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
}

impl From<idempotency::Error> for PayError {
    fn from(e: idempotency::Error) -> Self {
        PayError::Idem(e)
    }
}

impl From<sqlx::Error> for PayError {
    fn from(e: sqlx::Error) -> Self {
        PayError::Db(e)
    }
}

/// One attempt's identity, and whether its body ran to the end (what
/// follows is the record's write and `COMMIT`).
pub struct Probe {
    attempt: u64,
    body_done: AtomicBool,
}

#[idempotent(key = "<k>", ttl = "1h", biz = "failover_pay")]
async fn pay(
    idem: &Idem<Postgres>,
    tx: &mut Transaction<'_, Postgres>,
    k: String,
    amount: i64,
    #[idem(skip)] probe: &Probe,
) -> Result<Receipt, PayError> {
    let ledger_id: i64 =
        sqlx::query_scalar("INSERT INTO failover_ledger (k, amount, attempt) VALUES ($1, $2, $3) RETURNING id")
            .bind(&k)
            .bind(amount)
            .bind(probe.attempt as i64)
            .fetch_one(&mut **tx)
            .await?;
    probe.body_done.store(true, SeqCst);
    Ok(Receipt { key: k, amount, attempt: probe.attempt, ledger_id })
}

/// Where the run stood when an attempt started or ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// Both servers up, replication flowing.
    Before,
    /// The standby's replication link held.
    Stalled,
    /// Answers from the primary held in the path; the primary then killed.
    Frozen,
    /// The path cut: nothing reachable until the standby is promoted.
    Down,
    /// The path switched to the promoted standby.
    After,
}

const PHASES: [Phase; 5] = [Phase::Before, Phase::Stalled, Phase::Frozen, Phase::Down, Phase::After];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A fresh key from the steady load.
    Steady,
    /// One of a storm's callers on one key.
    Storm,
    /// A key answered before the failover, sent again after it (a
    /// redelivered message, a client retry that came late).
    Late,
}

#[derive(Clone, Debug)]
pub enum Answer {
    Ok(Receipt, Outcome),
    /// `Storage`, `InProgress`, or the body's own database error (its class
    /// and message): tried again.
    Retryable(&'static str, String),
    /// Anything else: the call stops there.
    Final(String),
}

/// One attempt of one call: `at` is when its answer arrived, from the
/// start of the load.
#[derive(Clone, Debug)]
pub struct Attempt {
    pub call: u64,
    pub id: u64,
    pub key: String,
    pub kind: Kind,
    pub engine: usize,
    /// The phase its answer arrived in.
    pub ended: Phase,
    pub at: Duration,
    pub body_done: bool,
    pub answer: Answer,
}

impl Attempt {
    /// One line of the history, to show.
    pub fn line(&self) -> String {
        let answer = match &self.answer {
            Answer::Ok(r, outcome) => format!("{outcome:?} {}", serde_json::to_string(r).expect("json")),
            Answer::Retryable(class, message) => format!("{class}: {message}"),
            Answer::Final(message) => format!("final: {message}"),
        };
        format!(
            "attempt {} call {} {:?} key {} engine {} at {:?} ({:?}) body ran: {}: {answer}",
            self.id, self.call, self.kind, self.key, self.engine, self.at, self.ended, self.body_done
        )
    }
}

/// The engines and everything the clients record.
pub struct Load {
    engines: Vec<Idem<Postgres>>,
    run: String,
    start: Instant,
    phase: AtomicU8,
    stop: AtomicBool,
    next_call: AtomicU64,
    next_attempt: AtomicU64,
    next_key: AtomicU64,
    executions_answered: AtomicUsize,
    history: Mutex<Vec<Attempt>>,
}

impl Load {
    pub fn new(engines: Vec<Idem<Postgres>>) -> Arc<Load> {
        Arc::new(Load {
            engines,
            run: idempotency_testkit::unique("fo"),
            start: Instant::now(),
            phase: AtomicU8::new(0),
            stop: AtomicBool::new(false),
            next_call: AtomicU64::new(0),
            next_attempt: AtomicU64::new(1),
            next_key: AtomicU64::new(0),
            executions_answered: AtomicUsize::new(0),
            history: Mutex::new(Vec::new()),
        })
    }

    pub fn enter(&self, phase: Phase) {
        self.phase.store(PHASES.iter().position(|p| *p == phase).expect("phase") as u8, SeqCst);
    }

    fn phase(&self) -> Phase {
        PHASES[self.phase.load(SeqCst) as usize]
    }

    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// Calls answered `Executed` so far.
    pub fn executions_answered(&self) -> usize {
        self.executions_answered.load(SeqCst)
    }

    pub fn history(&self) -> Vec<Attempt> {
        self.history.lock().unwrap().clone()
    }

    /// Calls `key` until it answers (or [`ANSWER_WITHIN`] passes), each
    /// attempt on the next engine, as a load balancer retries elsewhere.
    pub async fn call(&self, key: String, amount: i64, kind: Kind, first_engine: usize) {
        let call = self.next_call.fetch_add(1, SeqCst);
        let deadline = Instant::now() + ANSWER_WITHIN;
        for n in 0.. {
            let engine = (first_engine + n) % self.engines.len();
            let probe = Probe { attempt: self.next_attempt.fetch_add(1, SeqCst), body_done: AtomicBool::new(false) };
            let (result, outcome) = idempotency::observe(pay(&self.engines[engine], key.clone(), amount, &probe)).await;
            let answer = match result {
                Ok(receipt) => Answer::Ok(receipt, outcome.expect("an outcome")),
                Err(PayError::Idem(e @ idempotency::Error::InProgress { .. })) => {
                    Answer::Retryable("in progress", e.to_string())
                }
                Err(PayError::Idem(e @ idempotency::Error::Storage(_))) => Answer::Retryable("storage", e.to_string()),
                Err(PayError::Db(e)) => Answer::Retryable("body's database error", e.to_string()),
                Err(PayError::Idem(e)) => Answer::Final(e.to_string()),
            };
            if matches!(answer, Answer::Ok(_, Outcome::Executed)) {
                self.executions_answered.fetch_add(1, SeqCst);
            }
            let retry = matches!(answer, Answer::Retryable(..));
            self.history.lock().unwrap().push(Attempt {
                call,
                id: probe.attempt,
                key: key.clone(),
                kind,
                engine,
                ended: self.phase(),
                at: self.elapsed(),
                body_done: probe.body_done.load(SeqCst),
                answer,
            });
            if !retry || Instant::now() > deadline {
                return;
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }

    /// The steady load (fresh keys from [`STEADY_TASKS`] tasks) and a storm
    /// of [`STORM_CALLERS`] on one key every [`STORM_EVERY`], until
    /// [`Load::stop`].
    pub fn spawn(self: &Arc<Self>) -> Vec<JoinHandle<()>> {
        let mut tasks: Vec<JoinHandle<()>> = (0..STEADY_TASKS)
            .map(|t| {
                let load = self.clone();
                tokio::spawn(async move {
                    while !load.stop.load(SeqCst) {
                        let n = load.next_key.fetch_add(1, SeqCst);
                        load.call(format!("{}.s{n}", load.run), (n % 7) as i64 + 1, Kind::Steady, t).await;
                    }
                })
            })
            .collect();
        let load = self.clone();
        tasks.push(tokio::spawn(async move {
            for storm in 0.. {
                if load.stop.load(SeqCst) {
                    break;
                }
                load.storm(format!("{}.storm{storm}", load.run)).await;
                tokio::time::sleep(STORM_EVERY).await;
            }
        }));
        tasks
    }

    async fn storm(self: &Arc<Self>, key: String) {
        let barrier = Arc::new(Barrier::new(STORM_CALLERS));
        let callers: Vec<_> = (0..STORM_CALLERS)
            .map(|i| {
                let (load, key, barrier) = (self.clone(), key.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    load.call(key, 9, Kind::Storm, i).await;
                })
            })
            .collect();
        for caller in callers {
            caller.await.expect("storm caller");
        }
    }

    /// Ends the load; the tasks finish their calls (retries included).
    pub async fn stop(&self, tasks: Vec<JoinHandle<()>>) {
        self.stop.store(true, SeqCst);
        for task in tasks {
            task.await.expect("load task");
        }
    }

    /// Sends every key answered before the primary was lost once more, with
    /// the same arguments, over every engine in turn, from [`STEADY_TASKS`]
    /// tasks.
    pub async fn late_duplicates(self: &Arc<Self>) -> usize {
        let mut keys: Vec<(String, i64)> = self
            .history()
            .into_iter()
            .filter(|a| a.ended < Phase::Frozen)
            .filter_map(|a| match a.answer {
                Answer::Ok(r, _) => Some((r.key, r.amount)),
                _ => None,
            })
            .collect();
        keys.sort();
        keys.dedup();
        let keys = Arc::new(keys);
        let next = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..STEADY_TASKS)
            .map(|_| {
                let (load, keys, next) = (self.clone(), keys.clone(), next.clone());
                tokio::spawn(async move {
                    loop {
                        let i = next.fetch_add(1, SeqCst);
                        let Some((key, amount)) = keys.get(i) else { break };
                        load.call(key.clone(), *amount, Kind::Late, i).await;
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("late task");
        }
        keys.len()
    }
}
