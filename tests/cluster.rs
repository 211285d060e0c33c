//! At scale: a private 3-master Redis Cluster and four engines (four pools,
//! as four application instances would), on MariaDB and PostgreSQL. A storm
//! of 100 calls on one key runs its body once; distinct keys land on every
//! master; a short fault-injection soak through the cluster (one master
//! killed and restarted mid-run) reconciles. The nodes stop at the end.

mod common;
#[path = "common/soak.rs"]
mod soak;

use std::sync::Arc;

use common::servers::RedisCluster;
use soak::{Config, RedisSetup, Tag};

const INSTANCES: usize = 4;

/// How many of the run's claim/result keys (`idem:<biz>:<run>.*`) node `i` holds.
fn keys_on_node(cluster: &RedisCluster, i: usize, pattern: &str) -> usize {
    let (mut cursor, mut n) = (0u64, 0);
    loop {
        let (next, keys): (u64, Vec<String>) = cluster
            .query_node(i, redis::cmd("SCAN").arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(1000))
            .expect("SCAN");
        n += keys.len();
        if next == 0 {
            return n;
        }
        cursor = next;
    }
}

macro_rules! cluster_suite {
    ($backend:ident) => {
        mod $backend {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn four_instances_share_a_redis_cluster() {
                let Some(cluster) = RedisCluster::start() else { return };
                let cluster = Arc::new(cluster);
                let redis = RedisSetup::Cluster(cluster.clone());
                let tag = Arc::new(Tag::new(common::unique("idem_cluster")));
                let Some(engines) = soak::$backend::engines(INSTANCES, 6, &redis, &tag).await else { return };

                // Storm: 100 callers, one new key, four instances.
                let storm = soak::$backend::storm(&engines, 100).await;
                println!(
                    "cluster {}: storm of 100 over {INSTANCES} engines: 1 execution, {} got the result, {} in progress, all answered in {:?}",
                    stringify!($backend),
                    storm.ok,
                    storm.in_progress,
                    storm.all_answered
                );

                // Distinct keys spread over the three masters.
                let n = 300;
                let run = soak::$backend::distinct_keys(&engines, n).await;
                let pattern = format!("idem:{}:{run}.*", soak::BIZ);
                let per_node: Vec<usize> =
                    (0..cluster.ports().len()).map(|i| keys_on_node(&cluster, i, &pattern)).collect();
                println!("cluster {}: {n} keys per master {per_node:?}", stringify!($backend));
                assert!(per_node.iter().all(|&k| k > 0), "a master holds none of the keys: {per_node:?}");
                assert_eq!(per_node.iter().sum::<usize>(), n, "every finished key is cached exactly once");
                drop(engines);

                // A short soak through the cluster, one master killed once.
                let cfg = Config {
                    calls: 1_000,
                    keys: 700,
                    engines: INSTANCES,
                    pool_size: 5,
                    redis_kills: 1,
                    ..Config::short("csoak")
                };
                soak::$backend::soak(&cfg, redis).await;
            }
        }
    };
}

cluster_suite!(mysql);
cluster_suite!(postgres);
