//! Redis entries belong to one record store: two databases sharing a
//! Redis, a database re-created under it, an explicit namespace.

use idempotency::{Idem, Status};
use idempotency_testkit::{TestBackend, redis_cached_response, redis_client, redis_result, unique};

use super::B;
use super::fixture::{
    Mode, Probe, TestError, engine_on_private_database, ledger_rows, pay, record_rows_for, redis_location,
};

/// Regression: two databases (two tenants, or staging and production)
/// sharing one Redis never answer each other's calls: each runs its own
/// body, keeps its own record, and sees its own key reuse only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn databases_sharing_a_redis_never_replay_each_others_results() {
    let (name_a, name_b) = (unique("tenant_a").replace('-', "_"), unique("tenant_b").replace('-', "_"));
    let Some((pool_a, a)) = engine_on_private_database(&name_a).await else { return };
    let Some((pool_b, b)) = engine_on_private_database(&name_b).await else { return };
    let Some(client) = redis_client().await else { return };
    let (ns_a, ns_b) = (a.redis_namespace().await.unwrap().unwrap(), b.redis_namespace().await.unwrap().unwrap());
    assert_ne!(ns_a, ns_b, "each database made its own namespace");
    let (probe_a, probe_b) = (Probe::default(), Probe::default());
    let k = unique("order_1");

    let paid_a = pay(&a, k.clone(), 5, &probe_a, Mode::Ok).await.unwrap();
    // A's result is cached: under a shared key layout B would now replay it.
    redis_cached_response(&client, &redis_location(&a, "t_pay", &k).await).await;

    let (paid_b, outcome) = idempotency::observe(pay(&b, k.clone(), 5, &probe_b, Mode::Ok)).await;
    assert_eq!(outcome, Some(idempotency::Outcome::Executed), "B ran its own body");
    let paid_b = paid_b.unwrap();
    assert_eq!((paid_a.run, paid_b.run, probe_a.runs(), probe_b.runs()), (1, 1, 1, 1));
    assert_eq!((ledger_rows(&a, &k).await, ledger_rows(&b, &k).await), (1, 1));
    assert_eq!((record_rows_for(&a, "t_pay", &k).await, record_rows_for(&b, "t_pay", &k).await), (1, 1));
    assert!(matches!(b.status("t_pay", &k).await.unwrap(), Status::Completed { .. }));

    // Another amount: `KeyReused` on each side, for the key each used.
    let other = unique("order_2");
    pay(&a, other.clone(), 5, &probe_a, Mode::Ok).await.unwrap();
    redis_cached_response(&client, &redis_location(&a, "t_pay", &other).await).await;
    let (fresh, outcome) = idempotency::observe(pay(&b, other.clone(), 6, &probe_b, Mode::Ok)).await;
    assert_eq!((fresh.unwrap().amount, outcome), (6, Some(idempotency::Outcome::Executed)), "B never used the key");
    let reused = pay(&b, k.clone(), 6, &probe_b, Mode::Ok).await;
    assert!(matches!(reused, Err(TestError::Idem(idempotency::Error::KeyReused { .. }))), "{reused:?}");
    assert_eq!(pay(&a, k.clone(), 5, &probe_a, Mode::Ok).await.unwrap(), paid_a, "A still replays its own");
    assert_eq!((probe_a.runs(), probe_b.runs()), (2, 2));

    drop((a, b));
    B::drop_private(pool_a, &name_a).await;
    B::drop_private(pool_b, &name_b).await;
}

/// Regression: a database dropped and re-created (a restore, a test reset)
/// while Redis keeps the old entries gets a new namespace at `migrate`: the
/// next call executes, whether the engine is new or the one that migrated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_database_does_not_see_the_old_redis_entries() {
    let name = unique("recreated").replace('-', "_");
    let Some((pool, idem)) = engine_on_private_database(&name).await else { return };
    let Some(client) = redis_client().await else { return };
    let probe = Probe::default();
    let k = unique("order_1");
    pay(&idem, k.clone(), 5, &probe, Mode::Ok).await.unwrap();
    let old = redis_location(&idem, "t_pay", &k).await;
    redis_cached_response(&client, &old).await;
    drop(idem);
    B::drop_private(pool, &name).await;

    let Some((pool, idem)) = engine_on_private_database(&name).await else { return };
    assert!(redis_result(&client, &old).await.is_some(), "Redis kept the old entry");
    let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 5, &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap().run, outcome), (2, Some(idempotency::Outcome::Executed)));
    assert_eq!((ledger_rows(&idem, &k).await, record_rows_for(&idem, "t_pay", &k).await), (1, 1));

    // Reset under a running engine: `migrate` makes it read the new namespace.
    sqlx::raw_sql("DROP TABLE idem_meta").execute(&pool).await.expect("drop idem_meta");
    sqlx::query(B::DELETE_RECORD).bind("t_pay").bind(&k).execute(&pool).await.expect("delete record");
    idem.migrate().await.expect("migrate");
    let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 5, &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap().run, outcome), (3, Some(idempotency::Outcome::Executed)));

    drop(idem);
    B::drop_private(pool, &name).await;
}

/// An explicit namespace is used as given, and shared by the engines given it.
#[tokio::test]
async fn an_explicit_namespace_is_shared_by_the_engines_given_it() {
    let Some(client) = redis_client().await else { return };
    let Some(pool) = B::open(&unique("db"), 4).await else { return };
    B::prepare(&pool).await;
    let namespace = idempotency::Namespace::new(&unique("shared")).unwrap();
    let build = || Idem::builder(pool.clone()).redis(client.clone()).redis_namespace(namespace.clone()).build();
    let (a, b) = (build(), build());
    a.migrate().await.expect("migrate");
    assert_eq!(b.redis_namespace().await.unwrap(), Some(namespace.clone()));
    let probe = Probe::default();
    let k = unique("explicit");
    let first = pay(&a, k.clone(), 5, &probe, Mode::Ok).await.unwrap();
    let at = idempotency::redis_layout::locate(namespace.as_str(), "t_pay", &k).unwrap();
    let cached = redis_cached_response(&client, &at).await;
    assert_eq!(cached, serde_json::to_string(&first).unwrap());
    // Replayed from Redis, not the record: the record is gone.
    sqlx::query(B::DELETE_RECORD).bind("t_pay").bind(&k).execute(&pool).await.expect("delete record");
    let (again, outcome) = idempotency::observe(pay(&b, k.clone(), 5, &probe, Mode::Ok)).await;
    assert_eq!((again.unwrap(), outcome), (first, Some(idempotency::Outcome::Replayed)));
    assert!(idempotency::Namespace::new("a:b").is_err(), "a `:` could merge two namespaces' keys");
}
