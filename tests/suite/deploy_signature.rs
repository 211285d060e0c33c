//! Deploys that change an annotated fn's signature or attribute while
//! retries are in flight: each test stores a record with the fn as it was
//! (`place`), then calls the fn as the deploy left it, with the same `biz`
//! and key, and asserts what the retry gets (docs/guarantees.md, "Deploying
//! changes", names each test).

use idempotency::{Idem, Outcome, idempotent, observe};
use idempotency_testkit::unique;
use serde::Serialize;
use sqlx::Transaction;

use super::Db;
use super::fixture::{
    Mode, Probe, Receipt, Redis, TestError, body, engine, ledger_rows, past_the_release, record_rows_for,
    until_expired, with_and_without_redis,
};

/// Before the deploy.
#[idempotent(key = "<k>", ttl = "1h", biz = "t_deploy")]
async fn place(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    #[idem(skip)] probe: &Probe,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, amount, probe, Mode::Ok).await?;
    Ok(Receipt { key: k, amount, run })
}

/// Two arguments added, marked: left out of the fingerprint at their default.
#[idempotent(key = "<k>", ttl = "1h", biz = "t_deploy")]
async fn place_marked(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    #[idem(skip_if_default)] coupon: Option<String>,
    #[idem(skip_if_default)] express: bool,
    #[idem(skip)] probe: &Probe,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, amount, probe, Mode::Ok).await?;
    Ok(Receipt { key: k, amount, run })
}

/// An argument added without the marker: in the fingerprint, `None` as null.
#[idempotent(key = "<k>", ttl = "1h", biz = "t_deploy")]
async fn place_unmarked(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    coupon: Option<String>,
    #[idem(skip)] probe: &Probe,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, amount, probe, Mode::Ok).await?;
    Ok(Receipt { key: k, amount, run })
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_deploy")]
async fn place_reordered(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    amount: i64,
    #[idem(skip)] probe: &Probe,
    k: String,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, amount, probe, Mode::Ok).await?;
    Ok(Receipt { key: k, amount, run })
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_deploy")]
async fn place_renamed(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    total: i64,
    #[idem(skip)] probe: &Probe,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, total, probe, Mode::Ok).await?;
    Ok(Receipt { key: k, amount: total, run })
}

/// A newtype serializes as what it wraps: the same JSON as an `i64`.
#[derive(Debug, Clone, Copy, Serialize)]
struct Cents(i64);

#[idempotent(key = "<k>", ttl = "1h", biz = "t_deploy")]
async fn place_in_cents(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: Cents,
    #[idem(skip)] probe: &Probe,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, amount.0, probe, Mode::Ok).await?;
    Ok(Receipt { key: k, amount: amount.0, run })
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_deploy")]
async fn place_as_text(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: String,
    #[idem(skip)] probe: &Probe,
) -> Result<Receipt, TestError> {
    let amount: i64 = amount.parse().map_err(|_| TestError::Body)?;
    let run = body(tx, &k, amount, probe, Mode::Ok).await?;
    Ok(Receipt { key: k, amount, run })
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_deploy")]
async fn place_without_amount(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    #[idem(skip)] probe: &Probe,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, 5, probe, Mode::Ok).await?;
    Ok(Receipt { key: k, amount: 5, run })
}

#[idempotent(key = "v2_<k>", ttl = "1h", biz = "t_deploy")]
async fn place_new_key(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    #[idem(skip)] probe: &Probe,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, amount, probe, Mode::Ok).await?;
    Ok(Receipt { key: k, amount, run })
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_deploy_v2")]
async fn place_new_biz(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    #[idem(skip)] probe: &Probe,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, amount, probe, Mode::Ok).await?;
    Ok(Receipt { key: k, amount, run })
}

#[idempotent(key = "<k>", ttl = "1s", biz = "t_deploy")]
async fn place_short_ttl(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    #[idem(skip)] probe: &Probe,
) -> Result<Receipt, TestError> {
    let run = body(tx, &k, amount, probe, Mode::Ok).await?;
    Ok(Receipt { key: k, amount, run })
}

type Called = (Result<Receipt, TestError>, Option<Outcome>);

/// The first execution's receipt, replayed.
fn assert_replayed(called: Called, first: &Receipt) {
    assert!(matches!(&called, (Ok(r), Some(Outcome::Replayed)) if r == first), "{called:?}");
}

fn assert_key_reused(called: Called, k: &str) {
    assert!(
        matches!(&called, (Err(TestError::Idem(idempotency::Error::KeyReused { biz: "t_deploy", key })), Some(Outcome::KeyReused)) if key == k),
        "{called:?}"
    );
}

/// Executed again, as the body's `run`-th run.
fn assert_executed_again(called: Called, k: &str, run: usize) {
    assert!(matches!(&called, (Ok(r), Some(Outcome::Executed)) if r.run == run && r.key == k), "{called:?}");
}

async fn added_marked_arguments_replay(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = unique("marked");
    let first = place(&idem, k.clone(), 5, &probe).await.unwrap();
    // The retry after the deploy, the new arguments at their default.
    assert_replayed(observe(place_marked(&idem, k.clone(), 5, None, false, &probe)).await, &first);
    // Set, they count: not the call that was made.
    assert_key_reused(observe(place_marked(&idem, k.clone(), 5, Some("SPRING".into()), false, &probe)).await, &k);
    assert_key_reused(observe(place_marked(&idem, k.clone(), 5, None, true, &probe)).await, &k);
    assert_eq!((probe.runs(), ledger_rows(&idem, &k).await), (1, 1));

    // Rolled back: a call the new version made at the defaults replays on the old one.
    let back = unique("rollback");
    let first = place_marked(&idem, back.clone(), 6, None, false, &probe).await.unwrap();
    assert_replayed(observe(place(&idem, back.clone(), 6, &probe)).await, &first);
    // One made with a coupon is another call for the old version.
    let coupon = unique("coupon");
    let first = place_marked(&idem, coupon.clone(), 7, Some("SPRING".into()), true, &probe).await.unwrap();
    assert_replayed(observe(place_marked(&idem, coupon.clone(), 7, Some("SPRING".into()), true, &probe)).await, &first);
    assert_key_reused(observe(place_marked(&idem, coupon.clone(), 7, None, true, &probe)).await, &coupon);
    assert_key_reused(observe(place(&idem, coupon.clone(), 7, &probe)).await, &coupon);
    assert_eq!(probe.runs(), 3, "one execution per key");
}

with_and_without_redis!(
    #[tokio::test]
    added_arguments_marked_skip_if_default_replay_calls_made_before,
    added_arguments_marked_skip_if_default_replay_calls_made_before_with_redis => added_marked_arguments_replay
);

async fn added_unmarked_argument_is_key_reused(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = unique("unmarked");
    place(&idem, k.clone(), 5, &probe).await.unwrap();
    assert_key_reused(observe(place_unmarked(&idem, k.clone(), 5, None, &probe)).await, &k);
    assert_eq!((probe.runs(), ledger_rows(&idem, &k).await), (1, 1));
}

with_and_without_redis!(
    #[tokio::test]
    an_added_unmarked_argument_is_key_reused_even_as_none,
    an_added_unmarked_argument_is_key_reused_even_as_none_with_redis => added_unmarked_argument_is_key_reused
);

/// The marker changes the document of calls that had the argument: its
/// calls in flight, made at the default, held `"coupon": null`.
async fn marking_an_existing_argument_is_key_reused(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = unique("existing");
    place_unmarked(&idem, k.clone(), 5, None, &probe).await.unwrap();
    assert_key_reused(observe(place_marked(&idem, k.clone(), 5, None, false, &probe)).await, &k);
    // Set, the argument is in both documents alike.
    let set = unique("existing_set");
    let first = place_unmarked(&idem, set.clone(), 5, Some("SPRING".into()), &probe).await.unwrap();
    assert_replayed(observe(place_marked(&idem, set.clone(), 5, Some("SPRING".into()), false, &probe)).await, &first);
    assert_eq!(probe.runs(), 2);
}

with_and_without_redis!(
    #[tokio::test]
    marking_an_existing_argument_is_key_reused_for_its_calls_at_the_default,
    marking_an_existing_argument_is_key_reused_for_its_calls_at_the_default_with_redis => marking_an_existing_argument_is_key_reused
);

async fn reordered_arguments_replay(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = unique("reordered");
    let first = place(&idem, k.clone(), 5, &probe).await.unwrap();
    assert_replayed(observe(place_reordered(&idem, 5, &probe, k.clone())).await, &first);
    assert_key_reused(observe(place_reordered(&idem, 6, &probe, k.clone())).await, &k);
    assert_eq!(probe.runs(), 1);
}

with_and_without_redis!(
    #[tokio::test]
    reordered_arguments_replay_the_document_is_keyed_by_name,
    reordered_arguments_replay_the_document_is_keyed_by_name_with_redis => reordered_arguments_replay
);

async fn renamed_argument_is_key_reused(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = unique("renamed");
    place(&idem, k.clone(), 5, &probe).await.unwrap();
    assert_key_reused(observe(place_renamed(&idem, k.clone(), 5, &probe)).await, &k);
    assert_eq!(probe.runs(), 1);
}

with_and_without_redis!(
    #[tokio::test]
    a_renamed_argument_is_key_reused,
    a_renamed_argument_is_key_reused_with_redis => renamed_argument_is_key_reused
);

async fn retyped_arguments_match_by_their_json(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = unique("retyped");
    let first = place(&idem, k.clone(), 5, &probe).await.unwrap();
    assert_replayed(observe(place_in_cents(&idem, k.clone(), Cents(5), &probe)).await, &first);
    assert_key_reused(observe(place_as_text(&idem, k.clone(), "5".into(), &probe)).await, &k);
    assert_eq!(probe.runs(), 1);
}

with_and_without_redis!(
    #[tokio::test]
    a_retyped_argument_replays_only_when_its_json_is_the_same,
    a_retyped_argument_replays_only_when_its_json_is_the_same_with_redis => retyped_arguments_match_by_their_json
);

async fn removed_argument_is_key_reused(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = unique("removed");
    place(&idem, k.clone(), 5, &probe).await.unwrap();
    assert_key_reused(observe(place_without_amount(&idem, k.clone(), &probe)).await, &k);
    assert_eq!(probe.runs(), 1);
}

with_and_without_redis!(
    #[tokio::test]
    a_removed_argument_is_key_reused,
    a_removed_argument_is_key_reused_with_redis => removed_argument_is_key_reused
);

/// Another key template renders another key: a record of its own, so the
/// retry runs the body a second time.
async fn changed_key_template_executes_again(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = unique("template");
    place(&idem, k.clone(), 5, &probe).await.unwrap();
    assert_executed_again(observe(place_new_key(&idem, k.clone(), 5, &probe)).await, &k, 2);
    assert_eq!(ledger_rows(&idem, &k).await, 2, "the business write happened twice");
    assert_eq!(record_rows_for(&idem, "t_deploy", &format!("v2_{k}")).await, 1);
}

with_and_without_redis!(
    #[tokio::test]
    a_changed_key_template_executes_again,
    a_changed_key_template_executes_again_with_redis => changed_key_template_executes_again
);

async fn changed_biz_executes_again(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = unique("biz");
    place(&idem, k.clone(), 5, &probe).await.unwrap();
    assert_executed_again(observe(place_new_biz(&idem, k.clone(), 5, &probe)).await, &k, 2);
    assert_eq!(ledger_rows(&idem, &k).await, 2, "the business write happened twice");
    assert_eq!(record_rows_for(&idem, "t_deploy_v2", &k).await, 1);
}

with_and_without_redis!(
    #[tokio::test]
    a_changed_biz_executes_again,
    a_changed_biz_executes_again_with_redis => changed_biz_executes_again
);

/// A record keeps the expiry it was written with: a shorter ttl does not
/// cut an old record short, a longer one does not stretch it.
async fn changed_ttl_applies_to_new_records_only(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let shortened = unique("shortened");
    let first = place(&idem, shortened.clone(), 5, &probe).await.unwrap();
    // A record of the short ttl written after ours: once it has expired,
    // ours would have too, had the shorter ttl applied to it.
    let witness = unique("witness");
    place_short_ttl(&idem, witness.clone(), 5, &probe).await.unwrap();
    until_expired(&idem, "t_deploy", &witness).await;
    assert_replayed(observe(place_short_ttl(&idem, shortened.clone(), 5, &probe)).await, &first);

    let lengthened = unique("lengthened");
    place_short_ttl(&idem, lengthened.clone(), 5, &probe).await.unwrap();
    until_expired(&idem, "t_deploy", &lengthened).await;
    // A Redis claim whose cache write has not landed yet (a busy machine)
    // answers `InProgress` past its record's expiry, until the write lands.
    let again = past_the_release(|| place(&idem, lengthened.clone(), 5, &probe)).await;
    assert!(matches!(&again, Ok(r) if r.run == 4 && r.key == lengthened), "executed again: {again:?}");
    assert_eq!((probe.runs(), ledger_rows(&idem, &lengthened).await), (4, 2));
}

with_and_without_redis!(
    #[tokio::test]
    a_changed_ttl_applies_to_new_records_only,
    a_changed_ttl_applies_to_new_records_only_with_redis => changed_ttl_applies_to_new_records_only
);
