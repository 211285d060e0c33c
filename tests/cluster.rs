//! At scale: a private 3-master Redis Cluster and four engines (four pools,
//! as four application instances would), on MariaDB and PostgreSQL. A storm
//! of 100 calls on one key runs its body once; distinct keys land on every
//! master; a short fault-injection soak through the cluster (one master
//! killed and restarted mid-run) reconciles. The nodes stop at the end.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_testkit::Location;
use idempotency_testkit::servers::RedisCluster;
use idempotency_testkit::soak::{self, Config, RedisSetup, SoakBackend, Tag};
use idempotency_testkit::unique;

const INSTANCES: usize = 4;

/// The run's claim/result keys (`idem:<biz>:<run>.*`) node `i` holds, with
/// their values.
/// The cached results on node `i` of the calls at `places`: (claim key,
/// response), read from the result hashes of each call's shard.
fn results_on_node(cluster: &RedisCluster, i: usize, places: &[Location]) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for at in places {
        let (mut cursor, pattern) = (0u64, format!("{}*", at.results_prefix));
        loop {
            let (next, hashes): (u64, Vec<String>) = cluster
                .query_node(i, redis::cmd("SCAN").arg(cursor).arg("MATCH").arg(&pattern).arg("COUNT").arg(1000))
                .expect("SCAN");
            for hash in hashes {
                let value: Option<Vec<u8>> =
                    cluster.query_node(i, redis::cmd("HGET").arg(&hash).arg(&at.field[..])).expect("HGET");
                if let Some((_, _, response)) = value.and_then(idempotency::redis_layout::parse_result) {
                    found.push((at.claim.clone(), response));
                }
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    found
}

/// Four engines on `B` share a private 3-master cluster: a storm, distinct
/// keys spread over every master, and a short soak with one master killed.
async fn four_instances<B: SoakBackend>() {
    let Some(cluster) = RedisCluster::start() else { return };
    let cluster = Arc::new(cluster);
    let redis = RedisSetup::Cluster(cluster.clone());
    let tag = Arc::new(Tag::new(unique("idem_cluster")));
    let Some(engines) = soak::engines::<B>(INSTANCES, 6, &redis, &tag).await else { return };

    // Storm: 100 callers, one new key, four instances.
    let storm = soak::storm::<B>(&engines, 100).await;
    println!(
        "cluster {}: storm of 100 over {INSTANCES} engines: 1 execution, {} got the result, {} in progress, all answered in {:?}",
        B::NAME,
        storm.ok,
        storm.in_progress,
        storm.all_answered
    );

    // Distinct keys spread over the three masters.
    let n = 300;
    let (_run, stored) = soak::distinct_keys::<B>(&engines, n).await;
    let namespace = engines[0].redis_namespace().await.expect("namespace").expect("migrated");
    let places: Vec<Location> = stored
        .keys()
        .map(|k| idempotency::redis_layout::locate(namespace.as_str(), soak::BIZ, k).expect("namespace"))
        .collect();
    // A claim becomes its result after the commit, off the
    // caller's path: poll until every key holds one.
    let deadline = Instant::now() + Duration::from_secs(10);
    let per_node = loop {
        let per_node: Vec<Vec<(String, String)>> =
            (0..cluster.ports().len()).map(|i| results_on_node(&cluster, i, &places)).collect();
        if per_node.iter().map(Vec::len).sum::<usize>() == n || Instant::now() > deadline {
            break per_node;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let counts: Vec<usize> = per_node.iter().map(Vec::len).collect();
    println!("cluster {}: {n} keys per master {counts:?}", B::NAME);
    assert!(counts.iter().all(|&k| k > 0), "a master holds none of the keys: {counts:?}");
    assert_eq!(counts.iter().sum::<usize>(), n, "one cached entry per key");
    // Each holds its key's stored response: what a replay returns.
    let cached: HashMap<String, String> = per_node.into_iter().flatten().collect();
    let expected: HashMap<String, String> =
        places.iter().zip(stored.values()).map(|(at, response)| (at.claim.clone(), response.clone())).collect();
    assert_eq!(cached, expected, "every key caches its stored response");
    drop(engines);

    // A short soak through the cluster, one master killed once.
    let cfg =
        Config { calls: 1_000, keys: 700, engines: INSTANCES, pool_size: 5, redis_kills: 1, ..Config::short("csoak") };
    soak::soak::<B>(&cfg, redis).await;
}

mod mysql {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn four_instances_share_a_redis_cluster() {
        super::four_instances::<idempotency_testkit::backend::MySql>().await;
    }
}

mod postgres {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn four_instances_share_a_redis_cluster() {
        super::four_instances::<idempotency_testkit::backend::Postgres>().await;
    }
}
