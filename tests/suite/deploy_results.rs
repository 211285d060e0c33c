//! Deploys that change an annotated fn's result type while records live:
//! each test stores an `Order` with the fn as it was (`order`), then
//! replays it through the fn as the deploy left it (same `biz`, key and
//! arguments, another return type). A stored result replays when serde can
//! read it as the new type, and is `Error::Replay` when it cannot; the new
//! bodies fail if they run, since none may (docs/guarantees.md, "Deploying
//! changes", names each test).

use idempotency::{Idem, Outcome, idempotent, observe};
use idempotency_testkit::unique;
use serde::{Deserialize, Serialize};
use sqlx::Transaction;

use super::Db;
use super::fixture::{Mode, Probe, Redis, TestError, body, engine, ledger_rows, with_and_without_redis};

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum State {
    Paid,
    Refunded,
}

/// Before the deploy; stored as `{"id":7,"amount":5,"state":"Paid"}`.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Order {
    id: i64,
    amount: i64,
    state: State,
}

const STORED: &str = r#"{"id":7,"amount":5,"state":"Paid"}"#;

#[idempotent(key = "<k>", ttl = "1h", biz = "t_deploy_result")]
async fn order(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    #[idem(skip)] probe: &Probe,
) -> Result<Order, TestError> {
    body(tx, &k, 5, probe, Mode::Ok).await?;
    Ok(Order { id: 7, amount: 5, state: State::Paid })
}

/// The fn after the deploy, returning `$ty`; its body must never run.
macro_rules! after_the_deploy {
    ($name:ident -> $ty:ty) => {
        #[idempotent(key = "<k>", ttl = "1h", biz = "t_deploy_result")]
        async fn $name(idem: &Idem<Db>, k: String, #[idem(skip)] probe: &Probe) -> Result<$ty, TestError> {
            probe.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Err(TestError::Body)
        }
    };
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct WithOption {
    id: i64,
    amount: i64,
    state: State,
    coupon: Option<String>,
}
after_the_deploy!(with_option -> WithOption);

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct WithDefault {
    id: i64,
    amount: i64,
    state: State,
    #[serde(default)]
    currency: String,
}
after_the_deploy!(with_default -> WithDefault);

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Fewer {
    id: i64,
    state: State,
}
after_the_deploy!(fewer -> Fewer);

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Aliased {
    id: i64,
    #[serde(alias = "amount")]
    total: i64,
    state: State,
}
after_the_deploy!(aliased -> Aliased);

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Widened {
    id: i64,
    amount: f64,
    state: State,
}
after_the_deploy!(widened -> Widened);

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum StateWithAlias {
    #[serde(alias = "Paid")]
    Settled,
    Refunded,
    Cancelled,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct VariantAliased {
    id: i64,
    amount: i64,
    state: StateWithAlias,
}
after_the_deploy!(variant_aliased -> VariantAliased);

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct WithRequired {
    id: i64,
    amount: i64,
    state: State,
    currency: String,
}
after_the_deploy!(with_required -> WithRequired);

#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Strict {
    id: i64,
    state: State,
}
after_the_deploy!(strict -> Strict);

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Renamed {
    id: i64,
    total: i64,
    state: State,
}
after_the_deploy!(renamed -> Renamed);

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Retyped {
    id: i64,
    amount: String,
    state: State,
}
after_the_deploy!(retyped -> Retyped);

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum StateRenamed {
    Settled,
    Refunded,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct VariantRenamed {
    id: i64,
    amount: i64,
    state: StateRenamed,
}
after_the_deploy!(variant_renamed -> VariantRenamed);

/// Renamed *and* optional: serde reads the missing field as `None`.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct RenamedOptional {
    id: i64,
    total: Option<i64>,
    state: State,
}
after_the_deploy!(renamed_optional -> RenamedOptional);

/// A fresh key with an `Order` stored under it.
async fn stored(idem: &Idem<Db>, probe: &Probe) -> String {
    let k = unique("result");
    assert_eq!(order(idem, k.clone(), probe).await.unwrap(), Order { id: 7, amount: 5, state: State::Paid });
    k
}

fn assert_replayed<T: PartialEq + std::fmt::Debug>(called: (Result<T, TestError>, Option<Outcome>), expected: T) {
    assert!(matches!(&called, (Ok(v), Some(Outcome::Replayed)) if *v == expected), "{called:?}");
}

/// `Error::Replay` naming the call, with serde's reason, exactly.
fn assert_replay_error<T: std::fmt::Debug>(called: (Result<T, TestError>, Option<Outcome>), k: &str, reason: &str) {
    match called {
        (Err(TestError::Idem(idempotency::Error::Replay { biz, key, source })), Some(Outcome::Rejected)) => {
            assert_eq!((biz, key.as_str(), source.to_string().as_str()), ("t_deploy_result", k, reason));
        }
        other => panic!("expected Error::Replay ({reason}), got {other:?}"),
    }
}

async fn compatible_results_replay(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = stored(&idem, &probe).await;
    let Ok(idempotency::Status::Completed { response }) = idem.status("t_deploy_result", &k).await else { panic!() };
    assert_eq!(response, STORED);

    let replayed = observe(with_option(&idem, k.clone(), &probe)).await;
    assert_replayed(replayed, WithOption { id: 7, amount: 5, state: State::Paid, coupon: None });
    let replayed = observe(with_default(&idem, k.clone(), &probe)).await;
    assert_replayed(replayed, WithDefault { id: 7, amount: 5, state: State::Paid, currency: String::new() });
    assert_replayed(observe(fewer(&idem, k.clone(), &probe)).await, Fewer { id: 7, state: State::Paid });
    assert_replayed(observe(aliased(&idem, k.clone(), &probe)).await, Aliased { id: 7, total: 5, state: State::Paid });
    assert_replayed(
        observe(widened(&idem, k.clone(), &probe)).await,
        Widened { id: 7, amount: 5.0, state: State::Paid },
    );
    let replayed = observe(variant_aliased(&idem, k.clone(), &probe)).await;
    assert_replayed(replayed, VariantAliased { id: 7, amount: 5, state: StateWithAlias::Settled });
    assert_eq!((probe.runs(), ledger_rows(&idem, &k).await), (1, 1), "nothing ran after the deploy");
}

with_and_without_redis!(
    #[tokio::test]
    results_serde_still_reads_replay_after_the_deploy,
    results_serde_still_reads_replay_after_the_deploy_with_redis => compatible_results_replay
);

async fn incompatible_results_are_replay_errors(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = stored(&idem, &probe).await;
    let reason = "missing field `currency` at line 1 column 34";
    assert_replay_error(observe(with_required(&idem, k.clone(), &probe)).await, &k, reason);
    let reason = "unknown field `amount`, expected `id` or `state` at line 1 column 16";
    assert_replay_error(observe(strict(&idem, k.clone(), &probe)).await, &k, reason);
    let reason = "missing field `total` at line 1 column 34";
    assert_replay_error(observe(renamed(&idem, k.clone(), &probe)).await, &k, reason);
    let reason = "invalid type: integer `5`, expected a string at line 1 column 18";
    assert_replay_error(observe(retyped(&idem, k.clone(), &probe)).await, &k, reason);
    let reason = "unknown variant `Paid`, expected `Settled` or `Refunded` at line 1 column 33";
    assert_replay_error(observe(variant_renamed(&idem, k.clone(), &probe)).await, &k, reason);
    // Nothing ran and nothing changed: the old version still replays.
    assert_eq!(order(&idem, k.clone(), &probe).await.unwrap(), Order { id: 7, amount: 5, state: State::Paid });
    assert_eq!((probe.runs(), ledger_rows(&idem, &k).await), (1, 1));
}

with_and_without_redis!(
    #[tokio::test]
    results_serde_cannot_read_are_replay_errors,
    results_serde_cannot_read_are_replay_errors_with_redis => incompatible_results_are_replay_errors
);

/// The trap among the changes: a renamed field that is an `Option` replays
/// without error, as `None`.
async fn renamed_optional_field_replays_as_none(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = stored(&idem, &probe).await;
    let expected = RenamedOptional { id: 7, total: None, state: State::Paid };
    assert_replayed(observe(renamed_optional(&idem, k.clone(), &probe)).await, expected);
    assert_eq!(probe.runs(), 1);
}

with_and_without_redis!(
    #[tokio::test]
    a_renamed_optional_field_replays_silently_as_none,
    a_renamed_optional_field_replays_silently_as_none_with_redis => renamed_optional_field_replays_as_none
);
