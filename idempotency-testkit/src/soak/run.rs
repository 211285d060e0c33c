//! Running a soak, a storm and a spread of distinct keys on one backend:
//! the body every soak call runs, one call in its own task, the engines,
//! and the runs themselves. Generic over [`SoakBackend`]; only the two
//! annotated fns are written per backend.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency::{Idem, Outcome};
use sqlx::Transaction;

use super::faults::{db_faults, quiet_injected_panics, redis_faults};
use super::{
    CallEnd, Config, Fault, HANG, INJECTED_PANIC, KeyLog, Plan, Receipt, RedisSetup, Report, Rng, SLOW_BODY,
    SoakBackend, SoakError, Tag, Tally, reconcile, schedule,
};

/// One run's shared state: its key prefix and what the bodies saw.
pub struct Ctx {
    pub run: String,
    /// Bodies started (each gets a new `exec` number).
    pub execs: AtomicU64,
    /// Bodies that found their order already paid (a duplicate committed first).
    pub guard_hits: AtomicU64,
    /// Bodies that started while another body of the same key was running
    /// (a lease ran out, or Redis lost the claim).
    pub overlaps: AtomicU64,
    /// Bodies that slept past the 50 ms lease.
    pub slow_bodies: AtomicU64,
    running: Mutex<HashMap<String, u32>>,
}

impl Ctx {
    pub fn new(run: String) -> Self {
        Self {
            run,
            execs: AtomicU64::new(0),
            guard_hits: AtomicU64::new(0),
            overlaps: AtomicU64::new(0),
            slow_bodies: AtomicU64::new(0),
            running: Mutex::new(HashMap::new()),
        }
    }

    pub fn key(&self, i: usize) -> String {
        format!("{}.{i}", self.run)
    }

    /// Marks a body of `key` running until the guard drops (also on panic
    /// or cancellation).
    pub fn enter(&self, key: &str) -> Running<'_> {
        let mut running = self.running.lock().unwrap();
        let n = running.entry(key.to_owned()).or_default();
        if *n > 0 {
            self.overlaps.fetch_add(1, SeqCst);
        }
        *n += 1;
        Running { ctx: self, key: key.to_owned() }
    }
}

pub struct Running<'a> {
    ctx: &'a Ctx,
    key: String,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if let Ok(mut running) = self.ctx.running.lock()
            && let Some(n) = running.get_mut(&self.key)
        {
            *n -= 1;
        }
    }
}

/// What every soak call's body does, inside the call's transaction: pays
/// the key's order if it is still pending, then inserts a payment whatever
/// the order said (only idempotency stands between a duplicate and a second
/// payment); sleeps, then fails or panics as the plan says.
pub async fn body<B: SoakBackend + ?Sized>(
    tx: &mut Transaction<'_, B::Db>,
    k: &str,
    amount: i64,
    ctx: &Ctx,
    plan: Plan,
) -> Result<Receipt, SoakError> {
    let exec = ctx.execs.fetch_add(1, SeqCst) + 1;
    let _running = ctx.enter(k);
    let updated = B::pay_order(tx, &ctx.run, k).await?;
    if !updated {
        ctx.guard_hits.fetch_add(1, SeqCst);
    }
    let payment_id = B::insert_payment(tx, &ctx.run, k, amount, exec as i64).await?;
    if plan.sleep >= SLOW_BODY {
        ctx.slow_bodies.fetch_add(1, SeqCst);
    }
    tokio::time::sleep(plan.sleep).await;
    match plan.fault {
        Fault::BodyError => return Err(SoakError::Body),
        Fault::Panic => panic!("{}", INJECTED_PANIC),
        _ => {}
    }
    Ok(Receipt { key: k.to_owned(), amount, payment_id, exec, order_updated: updated })
}

/// One call in its own task (a panic stays there), cut by its deadline if
/// it has one.
pub async fn call<B: SoakBackend>(engine: Idem<B::Db>, ctx: Arc<Ctx>, plan: Plan) -> CallEnd {
    let deadline = match plan.fault {
        Fault::Cancel(after) => after,
        _ => HANG,
    };
    let task = tokio::spawn(async move {
        let k = ctx.key(plan.key);
        let amount = plan.amount();
        idempotency::observe(tokio::time::timeout(deadline, B::pay(&engine, k, amount, &ctx, plan))).await
    });
    match task.await {
        Ok((Ok(result), outcome)) => CallEnd::Returned(result, outcome),
        Ok((Err(_), _)) if deadline < HANG => CallEnd::Cancelled,
        Ok((Err(_), _)) => CallEnd::Hung,
        Err(e) if e.is_panic() => CallEnd::Panicked,
        Err(e) => panic!("call task: {e}"),
    }
}

/// `n` engines, one pool each, sharing `redis`; creates the tables. `None`
/// when the database is unreachable.
pub async fn engines<B: SoakBackend>(
    n: usize,
    size: u32,
    redis: &RedisSetup,
    tag: &Arc<Tag>,
) -> Option<Vec<Idem<B::Db>>> {
    let mut engines = Vec::new();
    for _ in 0..n {
        let pool = B::open_tagged(Some(tag.clone()), size).await?;
        let idem = redis.builder(Idem::builder(pool)).build();
        engines.push(idem);
    }
    B::create_tables(engines[0].pool()).await;
    engines[0].migrate().await.expect("migrate");
    Some(engines)
}

/// The soak: `None` when a server is unreachable (skipped).
pub async fn soak<B: SoakBackend>(cfg: &Config, redis: RedisSetup) -> Option<Report> {
    quiet_injected_panics();
    let tag = Arc::new(Tag::new(crate::unique(&format!("idem_{}", cfg.label))));
    let engines = engines::<B>(cfg.engines, cfg.pool_size, &redis, &tag).await?;
    let admin = B::open_tagged(None, 2).await?;
    let ctx = Arc::new(Ctx::new(crate::unique(cfg.label)));
    B::orders(&admin, &ctx.run, cfg.keys).await;

    let mut rng = Rng::new(cfg.seed);
    let plans = Arc::new(schedule(cfg, &mut rng));
    let logs = Arc::new(Mutex::new(vec![KeyLog::default(); cfg.keys]));
    let (next, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let stop = Arc::new(AtomicBool::new(false));

    let started = Instant::now();
    let redis_task =
        tokio::spawn(redis_faults(redis.clone(), cfg.redis_kills, cfg.calls, done.clone(), stop.clone(), cfg.seed));
    let db_task = tokio::spawn(db_faults::<B>(admin.clone(), tag.clone(), stop.clone(), cfg.seed));
    let mut workers = Vec::new();
    for t in 0..cfg.tasks {
        let engine = engines[t % engines.len()].clone();
        let (ctx, plans, logs, next, done) = (ctx.clone(), plans.clone(), logs.clone(), next.clone(), done.clone());
        workers.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            loop {
                let i = next.fetch_add(1, SeqCst);
                let Some(plan) = plans.get(i).copied() else { break };
                tokio::time::sleep(plan.delay).await;
                let end = call::<B>(engine.clone(), ctx.clone(), plan).await;
                tally.absorb(&plan, end, &mut logs.lock().unwrap()[plan.key]);
                done.fetch_add(1, SeqCst);
            }
            tally
        }));
    }
    let mut tally = Tally::default();
    for w in workers {
        tally.add(w.await.expect("worker"));
    }
    stop.store(true, SeqCst);
    let redis_kills = redis_task.await.expect("redis faults");
    let db_kills = db_task.await.expect("db faults");
    let elapsed = started.elapsed();

    let tables = B::tables(&admin, &ctx.run).await;
    let logs = logs.lock().unwrap().clone();
    let mut bad = reconcile(&ctx, &logs, &tables);
    bad.extend(tally.unexpected.iter().cloned());
    let report = Report {
        keys_ok: logs.iter().filter(|l| l.first_ok.is_some()).count(),
        reuse_calls: logs.iter().map(|l| u64::from(l.reuse_calls)).sum(),
        tally,
        redis_kills,
        db_kills,
        execs: ctx.execs.load(SeqCst),
        overlaps: ctx.overlaps.load(SeqCst),
        guard_hits: ctx.guard_hits.load(SeqCst),
        slow_bodies: ctx.slow_bodies.load(SeqCst),
        ledger_rows: tables.ledger.len(),
        records: tables.records.len(),
        elapsed,
    };
    report.print(B::NAME, cfg);
    assert!(
        bad.is_empty(),
        "soak {} {} (run {}, seed {}): {} violations:\n{}",
        cfg.label,
        B::NAME,
        ctx.run,
        cfg.seed,
        bad.len(),
        bad.iter().take(50).cloned().collect::<Vec<_>>().join("\n")
    );
    report.assert_faults(cfg);
    B::cleanup(&admin, &ctx.run).await;
    Some(report)
}

/// What a storm saw.
#[derive(Debug)]
pub struct Storm {
    pub ok: usize,
    pub in_progress: usize,
    pub all_answered: Duration,
}

/// `callers` calls on one new key, released together by a barrier and
/// spread over `engines`: the body runs once, every caller gets its result
/// or `InProgress`, and afterwards every engine replays it identically.
pub async fn storm<B: SoakBackend>(engines: &[Idem<B::Db>], callers: usize) -> Storm {
    let ctx = Arc::new(Ctx::new(crate::unique("storm")));
    B::orders(engines[0].pool(), &ctx.run, 1).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(callers));
    let plan = Plan::ok(0, Duration::from_millis(100));
    let mut tasks = Vec::new();
    for i in 0..callers {
        let (idem, ctx, barrier) = (engines[i % engines.len()].clone(), ctx.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let started = Instant::now();
            let r = B::pay(&idem, ctx.key(0), 100, &ctx, plan).await;
            (r, started)
        }));
    }
    let mut results = Vec::new();
    let mut first_start: Option<Instant> = None;
    for t in tasks {
        let (r, started) = t.await.expect("no storm call panics");
        first_start = Some(first_start.map_or(started, |f| f.min(started)));
        results.push(r);
    }
    let all_answered = first_start.unwrap().elapsed();
    assert_eq!(ctx.execs.load(SeqCst), 1, "the storm's body ran more than once");
    let mut first: Option<String> = None;
    let (mut ok, mut in_progress) = (0, 0);
    for r in results {
        match r {
            Ok(receipt) => {
                let json = serde_json::to_string(&receipt).unwrap();
                assert_eq!(first.get_or_insert_with(|| json.clone()), &json);
                ok += 1;
            }
            Err(SoakError::Idem(idempotency::Error::InProgress { .. })) => in_progress += 1,
            Err(e) => panic!("storm: unexpected {e:?}"),
        }
    }
    assert!(ok >= 1, "nobody got the storm's result");
    let first = first.unwrap();
    for idem in engines {
        for _ in 0..5 {
            let (r, outcome) = idempotency::observe(B::pay(idem, ctx.key(0), 100, &ctx, plan)).await;
            assert_eq!(outcome, Some(Outcome::Replayed));
            assert_eq!(serde_json::to_string(&r.unwrap()).unwrap(), first);
        }
    }
    let tables = B::tables(engines[0].pool(), &ctx.run).await;
    assert_eq!(tables.ledger.len(), 1, "one payment");
    assert_eq!(tables.records.len(), 1, "one record");
    assert_eq!(tables.records[0].2.as_deref(), Some(first.as_str()));
    assert_eq!(ctx.execs.load(SeqCst), 1);
    B::cleanup(engines[0].pool(), &ctx.run).await;
    Storm { ok, in_progress, all_answered }
}

/// Executes `n` distinct new keys (healthy servers: each runs once);
/// returns the run, whose keys are `<run>.<i>`, and each key's stored
/// response.
pub async fn distinct_keys<B: SoakBackend>(engines: &[Idem<B::Db>], n: usize) -> (String, HashMap<String, String>) {
    let ctx = Arc::new(Ctx::new(crate::unique("spread")));
    B::orders(engines[0].pool(), &ctx.run, n).await;
    let mut tasks = Vec::new();
    for lane in 0..8 {
        let (engines, ctx) = (engines.to_vec(), ctx.clone());
        tasks.push(tokio::spawn(async move {
            for i in (lane..n).step_by(8) {
                let plan = Plan::ok(i, Duration::ZERO);
                let idem = &engines[i % engines.len()];
                let (r, outcome) = idempotency::observe(B::pay(idem, ctx.key(i), 100, &ctx, plan)).await;
                assert_eq!(outcome, Some(Outcome::Executed), "{:?}", r);
            }
        }));
    }
    for t in tasks {
        t.await.expect("spread task");
    }
    let tables = B::tables(engines[0].pool(), &ctx.run).await;
    assert_eq!((tables.ledger.len(), tables.records.len()), (n, n));
    B::cleanup(engines[0].pool(), &ctx.run).await;
    let responses = tables.records.into_iter().map(|(k, _, r)| (k, r.expect("a response"))).collect();
    (ctx.run.clone(), responses)
}
