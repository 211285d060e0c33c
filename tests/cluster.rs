//! At scale: a private 3-master Redis Cluster and four engines (four pools,
//! as four application instances would), on MariaDB and PostgreSQL. A storm
//! of 100 calls on one key runs its body once; distinct keys land on every
//! master; a short fault-injection soak through the cluster (one master
//! killed and restarted mid-run) reconciles. The nodes stop at the end.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_testkit::servers::RedisCluster;
use idem_testkit::soak::{self, Config, RedisSetup, SoakBackend, Tag};
use idem_testkit::unique;

const INSTANCES: usize = 4;

/// The run's claim/result keys (`idem:<biz>:<run>.*`) node `i` holds, with
/// their values.
fn keys_on_node(cluster: &RedisCluster, i: usize, pattern: &str) -> Vec<(String, String)> {
    let (mut cursor, mut found) = (0u64, Vec::new());
    loop {
        let (next, keys): (u64, Vec<String>) = cluster
            .query_node(i, redis::cmd("SCAN").arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(1000))
            .expect("SCAN");
        for key in keys {
            // A claim released since the SCAN is gone: nothing to report.
            let value: Option<String> = cluster.query_node(i, redis::cmd("GET").arg(&key)).expect("GET");
            found.extend(value.map(|value| (key, value)));
        }
        if next == 0 {
            return found;
        }
        cursor = next;
    }
}

/// The response part of a finished result, `d:<fingerprint>:<response>`;
/// `None` for a claim still running (`p:...`).
/// The response in a finished result, `d:<expires_ms>:<fingerprint>:<response>`.
fn cached_response(value: &str) -> Option<&str> {
    let (_expires, rest) = value.strip_prefix("d:")?.split_once(':')?;
    rest.split_once(':').map(|(_, response)| response)
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
    let (run, stored) = soak::distinct_keys::<B>(&engines, n).await;
    let namespace = engines[0].redis_namespace().await.expect("namespace").expect("migrated");
    let pattern = format!("idem:{namespace}:{}:{run}.*", soak::BIZ);
    // A claim becomes its result after the commit, off the
    // caller's path: poll until every key holds one.
    let deadline = Instant::now() + Duration::from_secs(10);
    let per_node = loop {
        let per_node: Vec<Vec<(String, String)>> =
            (0..cluster.ports().len()).map(|i| keys_on_node(&cluster, i, &pattern)).collect();
        let finished = per_node.iter().flatten().filter(|(_, v)| cached_response(v).is_some()).count();
        if finished == n || Instant::now() > deadline {
            break per_node;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let counts: Vec<usize> = per_node.iter().map(Vec::len).collect();
    println!("cluster {}: {n} keys per master {counts:?}", B::NAME);
    assert!(counts.iter().all(|&k| k > 0), "a master holds none of the keys: {counts:?}");
    assert_eq!(counts.iter().sum::<usize>(), n, "one cached entry per key");
    // Each holds its key's stored response: what a replay returns.
    let cached: HashMap<String, Option<&str>> =
        per_node.iter().flatten().map(|(k, v)| (k.clone(), cached_response(v))).collect();
    let expected: HashMap<String, Option<&str>> =
        stored.iter().map(|(k, r)| (format!("idem:{namespace}:{}:{k}", soak::BIZ), Some(r.as_str()))).collect();
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
        super::four_instances::<idem_testkit::backend::MySql>().await;
    }
}

mod postgres {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn four_instances_share_a_redis_cluster() {
        super::four_instances::<idem_testkit::backend::Postgres>().await;
    }
}
