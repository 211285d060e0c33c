//! Redis: eviction policies on private servers, the namespace against the
//! database's records, a private cluster's slot coverage.

use std::time::{Duration, Instant};

use idempotency_testkit::TestBackend;
use idempotency_testkit::backend::Sqlite;

use super::{DAY, Dialect, HASH, doctor, doctor_with, exec, now_ms, unique_name};

/// A migrated SQLite file of its own, and its namespace.
async fn sqlite_migrated() -> (String, String, sqlx::SqlitePool) {
    let name = unique_name();
    let pool = Sqlite::open_private(&name, 2).await.expect("sqlite");
    let idem = idempotency_runtime::Idem::new(pool.clone());
    idem.migrate().await.expect("migrate");
    let ns = idem.redis_namespace().await.unwrap().unwrap().as_str().to_owned();
    (format!("sqlite:{}", Sqlite::dir().join(format!("{name}.db")).display()), ns, pool)
}

/// Private Redis servers: evicting once full is a failure, an evicting
/// policy without a limit a warning, `noeviction` ok.
#[tokio::test]
async fn redis_memory_policy() {
    let (url, _, _pool) = sqlite_migrated().await;
    let start = |args: &'static [&'static str]| {
        tokio::task::spawn_blocking(move || idempotency_testkit::servers::RedisServer::start_with(args))
    };
    let Some(lru) = start(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]).await.unwrap() else {
        return;
    };
    let evicting = doctor(&url, Some(&lru.url()), &[]);
    assert_eq!((evicting.code, evicting.level("redis_memory")), (1, "failure"), "{evicting:?}");
    assert!(evicting.found("redis_memory").starts_with(
        "maxmemory 64 MiB with maxmemory-policy allkeys-lru: once memory is full Redis evicts keys, a running call's \
         claim among them"
    ));
    assert_eq!(evicting.fix("redis_memory"), "CONFIG SET maxmemory-policy noeviction, and the same in redis.conf");
    assert_eq!(evicting.level("redis"), "ok");
    assert!(evicting.found("redis").starts_with("Redis "), "{evicting:?}");

    let unbounded = start(&["--maxmemory-policy", "volatile-lru"]).await.unwrap().unwrap();
    let later = doctor(&url, Some(&unbounded.url()), &[]);
    assert_eq!(later.level("redis_memory"), "warning", "{later:?}");
    assert!(later.found("redis_memory").starts_with("maxmemory 0 (no limit) with maxmemory-policy volatile-lru"));

    let noeviction = start(&["--maxmemory", "64mb", "--maxmemory-policy", "noeviction"]).await.unwrap().unwrap();
    let right = doctor(&url, Some(&noeviction.url()), &[]);
    assert_eq!(right.code, 0, "{right:?}");
    assert_eq!(
        right.found("redis_memory"),
        "maxmemory 64 MiB, maxmemory-policy noeviction: when full, writes fail and the engines go on with the database alone"
    );
}

/// Whether the namespace in Redis is the database's: on a private Redis,
/// nothing yet; only another namespace's keys; a cached result whose record
/// the database lacks (as after a restore from a backup); then the record.
#[tokio::test]
async fn redis_namespace_is_the_databases() {
    let (url, ns, _pool) = sqlite_migrated().await;
    let Some(redis) = tokio::task::spawn_blocking(idempotency_testkit::servers::RedisServer::start).await.unwrap()
    else {
        return;
    };
    let redis_url = redis.url();
    let empty = doctor(&url, Some(&redis_url), &[]);
    assert_eq!(
        (empty.level("redis_namespace"), empty.found("redis_namespace")),
        ("ok", format!("{ns} (the database's); Redis holds no key of idem now").as_str())
    );

    let mut conn = redis.client().get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("SET").arg("idem:{other_db.3}:pay:k1").arg("p:x:y").query_async(&mut conn).await.unwrap();
    let other = doctor(&url, Some(&redis_url), &[]);
    assert_eq!(other.level("redis_namespace"), "warning", "{other:?}");
    assert!(
        other
            .found("redis_namespace")
            .starts_with(&format!("no key of {ns} (the database's) among the keys sampled, which are of other_db:"))
    );

    // A cached result of this database's namespace, live, without its record.
    let at = idempotency_runtime::redis_layout::locate(&ns, "pay", "order_1").unwrap();
    let live = now_ms() + DAY;
    let value = idempotency_runtime::redis_layout::result_value(live, HASH, "{\"paid\":true}");
    let hash = format!("{}2945040", at.results_prefix);
    let _: () = redis::cmd("HSET").arg(&hash).arg(&at.field[..]).arg(value).query_async(&mut conn).await.unwrap();
    let restored = doctor(&url, Some(&redis_url), &[]);
    assert_eq!((restored.code, restored.level("redis_namespace")), (1, "failure"), "{restored:?}");
    assert!(restored.found("redis_namespace").starts_with(&format!(
        "1 of 1 cached results sampled in {ns} have no live record in the database: a database restored from a backup"
    )));
    assert!(restored.fix("redis_namespace").starts_with(&format!(
        "delete the namespace's keys (redis-cli --scan --pattern 'idem:{{{ns}.*' | xargs redis-cli del)"
    )));

    exec(&url, &Dialect::Sqlite.record("pay", "order_1", live)).await;
    let right = doctor(&url, Some(&redis_url), &[]);
    assert_eq!(right.code, 0, "{right:?}");
    assert_eq!(
        right.found("redis_namespace"),
        format!("{ns} (the database's): 1 cached results sampled, each with its live record")
    );

    let elsewhere = doctor_with(
        None,
        &[("IDEM_DATABASE_URL", &url), ("IDEM_REDIS_URL", &redis_url), ("IDEM_REDIS_NAMESPACE", "app_set")],
        &[],
    );
    assert_eq!(elsewhere.level("redis_namespace"), "warning", "{elsewhere:?}");
    assert!(
        elsewhere.found("redis_namespace").starts_with(&format!("--namespace app_set is not the database's ({ns})"))
    );
}

/// A private Redis Cluster from any node's URL: every slot served, then
/// one slot taken from its master.
#[tokio::test]
async fn redis_cluster_slot_coverage() {
    let (url, _, _pool) = sqlite_migrated().await;
    let Some(cluster) = tokio::task::spawn_blocking(idempotency_testkit::servers::RedisCluster::start).await.unwrap()
    else {
        return;
    };
    let seed = &cluster.urls()[1];
    let whole = doctor(&url, Some(seed), &[]);
    assert_eq!(whole.code, 0, "{whole:?}");
    assert_eq!(
        whole.found("redis_cluster"),
        "a Redis Cluster, every slot (16384) served by 3 masters: the engines need Builder::redis_cluster"
    );
    assert!(whole.found("redis").contains("(cluster, IDEM_REDIS_URL)"), "{whole:?}");
    assert!(whole.found("redis_memory").contains("noeviction on every master"), "{whole:?}");

    // Slot 0 taken from the master that serves it, which then sees the
    // cluster fail.
    let owner = (0..3)
        .find(|&i| {
            let nodes: String = cluster.query_node(i, redis::cmd("CLUSTER").arg("NODES")).unwrap();
            nodes.lines().any(|l| l.contains("myself") && l.split_whitespace().any(|s| s.starts_with("0-")))
        })
        .expect("the master of slot 0");
    let _: () = cluster.query_node(owner, redis::cmd("CLUSTER").arg("DELSLOTS").arg(0)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info: String = cluster.query_node(owner, redis::cmd("CLUSTER").arg("INFO")).unwrap();
        if info.contains("cluster_state:fail") {
            break;
        }
        assert!(Instant::now() < deadline, "the cluster never failed: {info}");
        tokio::task::yield_now().await;
    }
    let gap = doctor(&url, Some(&cluster.urls()[owner]), &[]);
    assert_eq!((gap.code, gap.level("redis_cluster")), (1, "failure"), "{gap:?}");
    assert!(
        gap.found("redis_cluster").starts_with(
            "a Redis Cluster, cluster_state fail: 16383 of 16384 slots assigned, 16383 served, by 3 masters"
        )
    );
}
