//! Fault-injection soak with reconciliation, on MariaDB and PostgreSQL, each
//! with two engines (two pools) sharing a private `redis-server` that is
//! killed and restarted mid-run. The short soak runs in every `cargo test`;
//! the full ones (20,000 calls over 14,000 keys, and over 2,000) with
//! `cargo test --release --all-features --test soak -- --ignored --nocapture`.
//! Set `IDEM_SOAK_SEED` to replay a schedule. See `common/soak.rs`.

mod common;
#[path = "common/soak.rs"]
mod soak;

use std::sync::Arc;

use common::servers::RedisServer;
use soak::{Config, RedisSetup};

macro_rules! soak_suite {
    ($backend:ident) => {
        mod $backend {
            use super::*;

            async fn run(cfg: Config) {
                let Some(server) = RedisServer::start() else { return };
                let redis = RedisSetup::Single(Arc::new(server));
                soak::$backend::soak(&cfg, redis).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn short_soak_keeps_exactly_once_under_faults() {
                run(Config::short("soak")).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            #[ignore = "minutes long: run with --release -- --ignored"]
            async fn full_soak_keeps_exactly_once_under_faults() {
                run(Config::full("soakfull")).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            #[ignore = "minutes long: run with --release -- --ignored"]
            async fn crowded_soak_keeps_exactly_once_under_faults() {
                run(Config::crowded("soakcrowd")).await;
            }
        }
    };
}

soak_suite!(mysql);
soak_suite!(postgres);

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
    use soak::{Ctx, KeyLog, Receipt, Tables, reconcile};
    let ctx = Ctx::new("r".into());
    let receipt =
        |k: &str, id: i64| Receipt { key: k.into(), amount: 100, payment_id: id, exec: id as u64, order_updated: true };
    let json = |r: &Receipt| serde_json::to_string(r).unwrap();
    let (r0, r1) = (receipt("r.0", 1), receipt("r.1", 2));
    let healthy = Tables {
        ledger: vec![("r.0".into(), 1, 100, 1), ("r.1".into(), 2, 100, 2)],
        records: vec![("r.0".into(), 1, Some(json(&r0))), ("r.1".into(), 1, Some(json(&r1)))],
        orders: vec![
            ("r.0".into(), "PAID".into(), 1),
            ("r.1".into(), "PAID".into(), 1),
            ("r.2".into(), "PENDING".into(), 0),
        ],
    };
    let logs = vec![
        KeyLog { first_ok: Some(json(&r0)), oks: 2, ..KeyLog::default() },
        KeyLog { first_ok: Some(json(&r1)), oks: 1, ..KeyLog::default() },
        KeyLog::default(),
    ];
    assert_eq!(reconcile(&ctx, &logs, &healthy), Vec::<String>::new());

    let mut doubled =
        Tables { ledger: healthy.ledger.clone(), records: healthy.records.clone(), orders: healthy.orders.clone() };
    doubled.ledger.push(("r.1".into(), 3, 100, 3));
    assert!(reconcile(&ctx, &logs, &doubled).iter().any(|v| v.contains("2 ledger rows")));

    let mut orphan =
        Tables { ledger: healthy.ledger.clone(), records: healthy.records.clone(), orders: healthy.orders.clone() };
    orphan.records.push(("r.2".into(), 0, None));
    let found = reconcile(&ctx, &logs, &orphan);
    assert!(found.iter().any(|v| v.contains("processing")), "{found:?}");
    assert!(found.iter().any(|v| v.contains("without a ledger row")), "{found:?}");

    let mut unrecorded =
        Tables { ledger: healthy.ledger.clone(), records: healthy.records.clone(), orders: healthy.orders.clone() };
    unrecorded.records.remove(1);
    let found = reconcile(&ctx, &logs, &unrecorded);
    assert!(found.iter().any(|v| v.contains("without an idem_record row")), "{found:?}");
    assert!(found.iter().any(|v| v.contains("returned Ok")), "{found:?}");

    let mut differ = logs.clone();
    differ[0].mismatches.push(json(&receipt("r.0", 9)));
    assert!(reconcile(&ctx, &differ, &healthy).iter().any(|v| v.contains("later Ok")));

    let mut twice = logs.clone();
    twice[1].executed = 2;
    assert!(reconcile(&ctx, &twice, &healthy).iter().any(|v| v.contains("reported Executed")));

    let mut reused = logs.clone();
    reused[2].key_reused = 1;
    assert!(reconcile(&ctx, &reused, &healthy).iter().any(|v| v.contains("KeyReused")));
}
