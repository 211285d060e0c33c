//! The soak harness is not vacuous: its schedule has the shape it claims,
//! its fault check and its reconciliation report each violation.

use idempotency_testkit::soak::{self, Config};

/// The schedule repeats 30% of calls and uses every key.
#[test]
fn schedule_uses_every_key_with_thirty_percent_repeats() {
    for cfg in [Config::short("s"), Config::full("f")] {
        let plans = soak::schedule(&cfg, &mut soak::Rng::new(cfg.seed));
        let distinct: std::collections::HashSet<usize> = plans.iter().map(|p| p.key).collect();
        assert_eq!((plans.len(), distinct.len()), (cfg.calls, cfg.keys));
        assert_eq!((cfg.calls - cfg.keys) * 10, cfg.calls * 3, "30% of calls repeat a key");
        let late = plans.iter().filter(|p| !p.delay.is_zero()).count();
        assert!(late > 0, "no duplicate arrives after a slow body's lease");
    }
}

/// The fault check is not vacuous: a run whose bodies of one key never ran
/// at the same time fails it, however many other faults it saw.
#[test]
fn fault_check_requires_overlapping_bodies() {
    use soak::{Report, Tally};
    let report = |overlaps| Report {
        tally: Tally { failed: 1, panicked: 1, cancelled: 1, ..Tally::default() },
        redis_kills: 2,
        db_kills: 1,
        execs: 10,
        overlaps,
        guard_hits: 0,
        slow_bodies: 1,
        ledger_rows: 0,
        records: 0,
        keys_ok: 0,
        reuse_calls: 0,
        elapsed: std::time::Duration::ZERO,
    };
    assert_eq!(report(1).missing_faults(), Vec::<&str>::new());
    assert_eq!(report(0).missing_faults(), ["two bodies of one key at once"]);
}

/// The crowded schedule spreads 20,000 calls over exactly 2,000 keys.
#[test]
fn crowded_schedule_uses_two_thousand_keys() {
    let cfg = Config::crowded("c");
    let plans = soak::schedule(&cfg, &mut soak::Rng::new(cfg.seed));
    let distinct: std::collections::HashSet<usize> = plans.iter().map(|p| p.key).collect();
    assert_eq!((plans.len(), distinct.len()), (20_000, 2_000));
}

/// The reconciliation is not vacuous: each kind of violation is reported.
#[test]
fn reconcile_reports_each_violation() {
    use idempotency::Outcome;
    use soak::{CallEnd, Ctx, KeyLog, Plan, Receipt, SoakError, Tables, Tally, reconcile};
    use std::time::Duration;
    let ctx = Ctx::new("r".into());
    let plain = |i: usize| Plan::ok(i, Duration::ZERO);
    let reuse = |i: usize| Plan { reuse: true, ..plain(i) };
    // Key i's payment `id`, for the plain amount `Plan::amount` gives it.
    let receipt = |i: usize, id: i64| Receipt {
        key: ctx.key(i),
        amount: plain(i).amount(),
        payment_id: id,
        exec: id as u64,
        order_updated: true,
    };
    let json = |r: &Receipt| serde_json::to_string(r).unwrap();
    // What a caller saw, through the soak's own bookkeeping.
    let ok = |log: &mut KeyLog, plan: Plan, r: &Receipt, outcome: Outcome| {
        Tally::default().absorb(&plan, CallEnd::Returned(Ok(r.clone()), Some(outcome)), log);
    };
    let key_reused = |log: &mut KeyLog, plan: Plan| {
        let e = idempotency::Error::KeyReused { biz: soak::BIZ, key: ctx.key(plan.key) };
        Tally::default().absorb(&plan, CallEnd::Returned(Err(SoakError::Idem(e)), Some(Outcome::KeyReused)), log);
    };

    let (r0, r1) = (receipt(0, 1), receipt(1, 2));
    let healthy = Tables {
        ledger: vec![("r.0".into(), 1, 100, 1), ("r.1".into(), 2, 101, 2)],
        records: vec![("r.0".into(), 1, Some(json(&r0))), ("r.1".into(), 1, Some(json(&r1)))],
        orders: vec![
            ("r.0".into(), "PAID".into(), 1),
            ("r.1".into(), "PAID".into(), 1),
            ("r.2".into(), "PENDING".into(), 0),
        ],
    };
    // r.0: executed, then replayed; r.1: executed, then reused with other
    // arguments; r.2: never called.
    let mut logs = vec![KeyLog::default(); 3];
    ok(&mut logs[0], plain(0), &r0, Outcome::Executed);
    ok(&mut logs[0], plain(0), &r0, Outcome::Replayed);
    ok(&mut logs[1], plain(1), &r1, Outcome::Executed);
    key_reused(&mut logs[1], reuse(1));
    assert_eq!(reconcile(&ctx, &logs, &healthy), Vec::<String>::new());
    let copy =
        || Tables { ledger: healthy.ledger.clone(), records: healthy.records.clone(), orders: healthy.orders.clone() };

    let mut doubled = copy();
    doubled.ledger.push(("r.1".into(), 3, 101, 3));
    assert!(reconcile(&ctx, &logs, &doubled).iter().any(|v| v.contains("2 ledger rows")));

    let mut orphan = copy();
    orphan.records.push(("r.2".into(), 0, None));
    let found = reconcile(&ctx, &logs, &orphan);
    assert!(found.iter().any(|v| v.contains("processing")), "{found:?}");
    assert!(found.iter().any(|v| v.contains("without a ledger row")), "{found:?}");

    let mut unrecorded = copy();
    unrecorded.records.remove(1);
    let found = reconcile(&ctx, &logs, &unrecorded);
    assert!(found.iter().any(|v| v.contains("without an idem_record row")), "{found:?}");
    assert!(found.iter().any(|v| v.contains("returned Ok")), "{found:?}");

    // The ledger row says another amount than the record's response.
    let mut disagree = copy();
    disagree.ledger[0].2 = 150;
    let found = reconcile(&ctx, &logs, &disagree);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("r.0: record says") && found[0].ends_with("amount 150 exec 1"), "{found:?}");

    // The order was paid twice.
    let mut paid_twice = copy();
    paid_twice.orders[0].2 = 2;
    assert_eq!(
        reconcile(&ctx, &logs, &paid_twice),
        [r#"r.0: paid in the ledger, order is Some(("PAID", 2))"#, "r.0: order PAID paid 2, ledger rows 1"]
    );

    let mut differ = logs.clone();
    differ[0].mismatches.push(json(&receipt(0, 9)));
    assert!(reconcile(&ctx, &differ, &healthy).iter().any(|v| v.contains("later Ok")));

    let mut twice = logs.clone();
    twice[1].executed = 2;
    assert!(reconcile(&ctx, &twice, &healthy).iter().any(|v| v.contains("reported Executed")));

    // Ok with a receipt for another key.
    let mut foreign = logs.clone();
    ok(&mut foreign[0], plain(0), &Receipt { key: "r.1".into(), ..r0.clone() }, Outcome::Replayed);
    assert!(reconcile(&ctx, &foreign, &healthy).contains(&"r.0: Ok with a receipt for key r.1".to_owned()));

    // A call with other arguments is handed the winner's result.
    let mut other_args = logs.clone();
    ok(&mut other_args[0], reuse(0), &r0, Outcome::Replayed);
    assert_eq!(
        reconcile(&ctx, &other_args, &healthy),
        ["r.0: a call with amount 101 got Ok for amount 100 (other arguments)"]
    );

    // A call with other arguments executes as well, and gets its own result.
    let mut second = logs.clone();
    ok(&mut second[0], reuse(0), &Receipt { amount: 101, payment_id: 7, exec: 7, ..r0.clone() }, Outcome::Executed);
    assert!(
        reconcile(&ctx, &second, &healthy).contains(&"r.0: Ok for amount 101, the winner's is Some(100)".to_owned())
    );

    // A call with the winner's own arguments is told KeyReused.
    let mut own_args = logs.clone();
    key_reused(&mut own_args[0], plain(0));
    assert_eq!(reconcile(&ctx, &own_args, &healthy), ["r.0: KeyReused for amount 100, the winner's is Some(100)"]);

    // KeyReused on a key nothing was stored for.
    let mut unstored = logs.clone();
    key_reused(&mut unstored[2], reuse(2));
    assert_eq!(reconcile(&ctx, &unstored, &healthy), ["r.2: KeyReused for amount 103, the winner's is None"]);
}
