//! One engine process: the test binary run again with [`CHILD_ENV`] set
//! (by [`super::run`]), its own `Idem` over the run's database and Redis,
//! both reached through its own proxies. It connects, says `IDEM-READY`,
//! waits for `go <start µs>` on stdin (all processes share the start),
//! makes its calls from several tasks, each when it is due, appends each
//! to its history file, and says `IDEM-DONE <calls>`.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use idempotency::{Idem, Outcome, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::Transaction;

use super::NemesisBackend;
use super::history::{Answer, Call, Recorder, now_us};
use super::schedule::{Config, RETRIES, calls, retry_pause, stream};
use crate::soak::{Ctx, Plan, Receipt, SoakBackend, SoakError, body};

/// Set in a child's environment: its [`Orders`], as JSON.
pub const CHILD_ENV: &str = "IDEM_NEMESIS_CHILD";
/// A call not answered within this long is dropped and recorded as a
/// timeout: far beyond any cut, so only a hang reaches it.
const CALL_DEADLINE: Duration = Duration::from_secs(30);

/// What the parent tells one child.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Orders {
    /// `TestBackend::NAME` of the database.
    pub backend: String,
    pub proc: usize,
    pub db_port: u16,
    pub db_name: String,
    pub redis_port: u16,
    /// The run's key prefix.
    pub run: String,
    pub seed: u64,
    pub procs: usize,
    pub calls_per_proc: usize,
    pub keys: usize,
    pub tasks: usize,
    pub interval_us: i64,
    pub history: PathBuf,
}

impl Orders {
    fn config(&self) -> Config {
        Config {
            label: "child",
            procs: self.procs,
            calls_per_proc: self.calls_per_proc,
            keys: self.keys,
            tasks: self.tasks,
            interval: Duration::from_micros(self.interval_us as u64),
            deadline: Duration::MAX,
            seed: self.seed,
        }
    }
}

/// The call every process makes: the soak's body (pay the order, insert
/// a payment) under a 1 s lease, so a claim a cut leaves behind ends soon.
#[idempotent(key = "<k>", ttl = "1h", biz = "soak_pay", lease = "1s")]
async fn pay<B: SoakBackend>(
    idem: &Idem<B::Db>,
    tx: &mut Transaction<'_, B::Db>,
    k: String,
    amount: i64,
    #[idem(skip)] ctx: &Ctx,
    #[idem(skip)] plan: Plan,
) -> Result<Receipt, SoakError> {
    body::<B>(tx, &k, amount, ctx, plan).await
}

/// The lease of `pay`, for the checker.
pub const LEASE: Duration = Duration::from_secs(1);

/// The child's entry, first thing in the test that [`super::run`] names
/// (the parent test itself, started again): plays one engine process and
/// returns `true` when this process was started as one (`CHILD_ENV` set);
/// returns `false` at once otherwise. Call it outside any runtime.
pub fn child_process() -> bool {
    let Ok(orders) = std::env::var(CHILD_ENV) else { return false };
    let orders: Orders = serde_json::from_str(&orders).expect("child orders");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    match orders.backend.as_str() {
        #[cfg(feature = "mysql")]
        "mysql" => runtime.block_on(child::<crate::backend::MySql>(orders)),
        #[cfg(feature = "postgres")]
        "postgres" => runtime.block_on(child::<crate::backend::Postgres>(orders)),
        other => panic!("no nemesis backend `{other}` in this build"),
    }
    true
}

async fn child<B: NemesisBackend>(orders: Orders) {
    let pool = B::pool_via(orders.db_port, &orders.db_name, orders.tasks as u32);
    let redis = redis::Client::open(format!("redis://127.0.0.1:{}", orders.redis_port)).expect("redis url");
    let idem = Idem::builder(pool.clone()).redis(redis).build();
    // Open every connection before the start, so the clock counts calls.
    let mut warm = Vec::new();
    for _ in 0..orders.tasks {
        warm.push(pool.acquire().await.expect("the database answers through the proxy"));
    }
    drop(warm);
    println!("IDEM-READY");
    let start_us: i64 = match wait_for_line().await.split_once(' ') {
        Some(("go", at)) => at.trim().parse().expect("a start time"),
        _ => panic!("expected `go <start µs>`"),
    };

    let ctx = Arc::new(Ctx::new(orders.run.clone()));
    let plans = Arc::new(calls(&orders.config(), orders.proc));
    let recorder = Arc::new(Recorder::create(&orders.history));
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..orders.tasks {
        let (idem, ctx, plans, recorder, next) =
            (idem.clone(), ctx.clone(), plans.clone(), recorder.clone(), next.clone());
        let mut rng = stream(orders.seed, 0x7A5C_0000 + (orders.proc * 1_000 + t) as u64);
        let (proc, interval_us) = (orders.proc, orders.interval_us);
        tasks.push(tokio::spawn(async move {
            let mut made = 0;
            loop {
                let i = next.fetch_add(1, SeqCst);
                let Some(plan) = plans.get(i).copied() else { break };
                let due = start_us + i as i64 * interval_us - now_us();
                if due > 0 {
                    tokio::time::sleep(Duration::from_micros(due as u64)).await;
                }
                for n in 0..=RETRIES {
                    let call = one_call::<B>(&idem, &ctx, plan, proc).await;
                    recorder.append(&call);
                    made += 1;
                    if call.answer.is_final() {
                        break;
                    }
                    tokio::time::sleep(retry_pause(n, &mut rng)).await;
                }
            }
            made
        }));
    }
    let mut made = 0;
    for task in tasks {
        made += task.await.expect("a calling task");
    }
    recorder.flush();
    println!("IDEM-DONE {made}");
}

/// One call of `plan`, timed on the shared clock.
async fn one_call<B: NemesisBackend>(idem: &Idem<B::Db>, ctx: &Ctx, plan: Plan, proc: usize) -> Call {
    let (key, amount) = (ctx.key(plan.key), plan.amount());
    let start_us = now_us();
    let answered =
        tokio::time::timeout(CALL_DEADLINE, idempotency::observe(pay::<B>(idem, key.clone(), amount, ctx, plan)));
    let answered = answered.await;
    let end_us = now_us();
    let detail = match &answered {
        Ok((Err(e), _)) => Some(format!("{e:?}")),
        _ => None,
    };
    let answer = match answered {
        Err(_elapsed) => Answer::Timeout,
        Ok((Ok(receipt), outcome)) => {
            let json = serde_json::to_string(&receipt).expect("receipt json");
            match outcome {
                Some(Outcome::Executed) => Answer::Executed(json),
                Some(Outcome::Replayed) => Answer::Replayed(json),
                other => Answer::Other(format!("Ok with outcome {other:?}: {json}")),
            }
        }
        Ok((Err(e), _)) => match e {
            SoakError::Idem(idempotency::Error::InProgress { .. }) => Answer::InProgress,
            SoakError::Idem(idempotency::Error::KeyReused { .. }) => Answer::KeyReused,
            SoakError::Idem(idempotency::Error::Storage(_)) => Answer::Storage,
            SoakError::Idem(idempotency::Error::Replay { .. }) => Answer::Replay,
            SoakError::Db(_) => Answer::BodyDb,
            other => Answer::Other(format!("{other:?}")),
        },
    };
    Call { proc, key, amount, start_us, end_us, answer, detail }
}

/// Waits for a line on stdin; a closed stdin (the parent died) ends the
/// process rather than letting it call on.
async fn wait_for_line() -> String {
    let read = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|n| (n > 0).then_some(line))
    });
    match read.await {
        Ok(Ok(Some(line))) => line,
        _ => std::process::exit(3),
    }
}
