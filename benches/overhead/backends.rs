//! The rows of one backend, written once for the three (`backend!`): its
//! plain transaction, the annotated fn and its floors, each row measured in
//! turns with the rows it is compared with.

use super::*;
use count::Counted;
use idempotency_testkit::forwarder::Protocol;

macro_rules! backend {
    ($module:ident, $db:ident, $name:literal, $protocol:expr, $url:expr, $ddl:literal, $seed:literal, $update:literal, $insert_record:literal, $insert_bounded:literal, $select_record:literal) => {
        pub mod $module {
            use super::*;

            /// How the round trips are counted on the wire (SQLite has none).
            const PROTOCOL: Option<Protocol> = $protocol;
            use sqlx::{Transaction, $db};

            pub async fn bare(pool: &sqlx::Pool<$db>, order_id: i64) {
                let mut tx = pool.begin().await.expect("begin");
                sqlx::query($update).bind(order_id).execute(&mut *tx).await.expect("update");
                tx.commit().await.expect("commit");
            }

            #[idempotent(key = "<run>_<n>", ttl = "1h", biz = "bench_pay")]
            pub async fn pay(
                idem: &Idem<$db>,
                tx: &mut Transaction<'_, $db>,
                run: &str,
                n: usize,
                order_id: i64,
                #[idem(skip)] executions: &AtomicUsize,
            ) -> Result<Receipt, BenchError> {
                executions.fetch_add(1, Ordering::Relaxed);
                sqlx::query($update).bind(order_id).execute(&mut **tx).await?;
                Ok(Receipt { order_id, amount: 1999 })
            }

            /// Call `i` of a replay row: one of the ten finished keys
            /// `<run>_0` to `<run>_9` again, through `idempotency`.
            async fn replay_one(idem: &Idem<$db>, run: &str, i: usize, executions: &AtomicUsize, row: &str) {
                let n = i % 10;
                if let Err(e) = pay(idem, run, n, (n as i64 % ORDERS) + 1, executions).await {
                    panic!("{row}: {e:?}");
                }
            }

            /// The least a first call with a claim can cost, with no idempotency code
            /// at all: the claim, the body's transaction with the record
            /// insert, and the cache write spawned off the caller's path.
            /// `gate`: the statements the engine sends instead (its claim and
            /// cache-write scripts, the insert bounded by `lock_wait`) in
            /// place of a native `SET NX GET`, a plain insert and the least
            /// cache write: what is left between it and `first` is the
            /// engine's own code.
            pub async fn floor(
                pool: &sqlx::Pool<$db>,
                redis: &redis::aio::ConnectionManager,
                key: String,
                order_id: i64,
                gate: bool,
            ) {
                let redis_key = format!("idem:bench_floor:{key}");
                let mut conn = redis.clone();
                let claim = if gate {
                    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
                    GATE_CLAIM
                        .key(&redis_key)
                        .key("idem:bench_floor:results:0")
                        .key("idem:bench_floor:results:1")
                        .arg("p:token:fp")
                        .arg(30_000)
                        .arg(&key)
                        .arg(now as i64)
                        .arg(3_600_000)
                        .invoke_async(&mut conn)
                        .await
                } else {
                    redis::cmd("SET")
                        .arg(&redis_key)
                        .arg("p:token:fp")
                        .arg("NX")
                        .arg("PX")
                        .arg(30_000)
                        .arg("GET")
                        .query_async(&mut conn)
                        .await
                };
                let _: Option<String> = claim.expect("claim");
                let mut tx = pool.begin().await.expect("begin");
                sqlx::query($update).bind(order_id).execute(&mut *tx).await.expect("update");
                let now =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
                // The unique column as the engine writes it: the key's digest.
                let digest: String =
                    idempotency::key::key_digest("bench_floor", &key).iter().map(|b| format!("{b:02x}")).collect();
                let insert = if gate { $insert_bounded } else { $insert_record };
                sqlx::query(insert)
                    .bind(digest)
                    .bind("bench_floor")
                    .bind(&key)
                    .bind(None::<&str>)
                    .bind("0".repeat(64))
                    .bind(1i16)
                    .bind(r#"{"order_id":1,"amount":1999}"#)
                    .bind(now)
                    .bind(now)
                    .bind(now + 3_600_000)
                    .execute(&mut *tx)
                    .await
                    .expect("insert record");
                tx.commit().await.expect("commit");
                tokio::spawn(async move {
                    let finish = if gate {
                        GATE_FINISH
                            .key(&redis_key)
                            .key("idem:bench_floor:results:0")
                            .arg("p:token:fp")
                            .arg(&key)
                            .arg(r#"d:fp:{"order_id":1,"amount":1999}"#)
                            .arg(3_600_000)
                            .arg("1")
                            .invoke_async(&mut conn)
                            .await
                    } else {
                        FLOOR_FINISH
                            .key(&redis_key)
                            .arg("p:token:fp")
                            .arg("d:fp:{}")
                            .arg(3_600_000)
                            .invoke_async(&mut conn)
                            .await
                    };
                    let _: i64 = finish.expect("finish");
                });
            }

            pub async fn run(rows: &mut Vec<Row>, passes: &[Claims], phase: Phase) -> Option<()> {
                run_on(rows, passes, $url, $name, phase, Scale::at_hand()).await
            }

            /// The rows on the server at `url`, labelled `name`.
            pub async fn run_on(
                rows: &mut Vec<Row>,
                passes: &[Claims],
                url: String,
                name: &'static str,
                phase: Phase,
                scale: Scale,
            ) -> Option<()> {
                let pool = sqlx::pool::PoolOptions::<$db>::new()
                    .max_connections(POOL)
                    .test_before_acquire(false)
                    .connect(&url)
                    .await
                    .map_err(|e| println!("skipped: {name} unreachable ({e})"))
                    .ok()?;
                // Every connection open before the first row: opening one (a
                // process fork on PostgreSQL) is not what a call costs, and
                // a storm's waiters would otherwise measure it.
                let mut open = Vec::with_capacity(POOL as usize);
                for _ in 0..POOL {
                    open.push(pool.acquire().await.expect("connect"));
                }
                drop(open);
                sqlx::raw_sql($ddl).execute(&pool).await.expect("orders table");
                sqlx::query($seed).bind(ORDERS).execute(&pool).await.expect("seed orders");
                let Scale { seq_calls, conc_calls, storms, replays_per_call, local, counted: count } = scale;
                // Round trips are counted on a pool of its own, one connection
                // through a counting forwarder (`count.rs`).
                let counted = match PROTOCOL {
                    Some(protocol) => Some(Counted::<$db>::to(&url, protocol).await),
                    None => None,
                };

                for claims in passes {
                    let builder = Idem::builder(pool.clone());
                    let idem = match claims {
                        Claims::None => builder.build(),
                        Claims::Single(c) => builder.redis(c.clone()).build(),
                        Claims::Cluster(c, _) => builder.redis_cluster((**c).clone()).build(),
                    };
                    idem.migrate().await.expect("migrate");
                    let client = claims.nodes();
                    let label = claims.label();
                    let run_id = idempotency_testkit::unique(label);
                    let executions = Arc::new(AtomicUsize::new(0));
                    // The same engine on the counted pool (SQLite: on its own).
                    let counted_idem = match &counted {
                        Some(counted) => {
                            let builder = Idem::builder(counted.pool.clone());
                            match claims {
                                Claims::None => builder.build(),
                                Claims::Single(c) => builder.redis(c.clone()).build(),
                                Claims::Cluster(c, _) => builder.redis_cluster((**c).clone()).build(),
                            }
                        }
                        None => idem.clone(),
                    };
                    let counted_pool = counted.as_ref().map_or_else(|| pool.clone(), |c| c.pool.clone());

                    let tasks = phase.tasks();
                    let calls = if tasks == 1 { seq_calls } else { conc_calls };
                    let push =
                        |rows: &mut Vec<Row>, mode, (wall, lat): (Duration, Vec<Duration>), (sql, redis_cmds)| {
                            rows.push(Row {
                                backend: name,
                                redis: label,
                                mode,
                                tasks,
                                calls: lat.len(),
                                calls_per_sec: lat.len() as f64 / wall.as_secs_f64(),
                                p50_ms: percentile(&lat, 0.50),
                                p99_ms: percentile(&lat, 0.99),
                                sql_per_call: sql,
                                redis_per_call: redis_cmds,
                                executions: None,
                            });
                        };

                    // bare, first (a fresh key per call) and, with one Redis node,
                    // floor (the same round trips hand-written) in turns, so each
                    // ratio compares rows of the same moments; bare's Redis column
                    // does not apply, and it is measured in every pass for that
                    let tag = format!("{run_id}-first{tasks}");
                    let p = pool.clone();
                    let mut turns = vec![(
                        "bare",
                        call(move |i| {
                            let p = p.clone();
                            async move { bare(&p, (i as i64 % ORDERS) + 1).await }
                        }),
                    )];
                    let (i2, t2, e2) = (idem.clone(), tag.clone(), executions.clone());
                    turns.push((
                        "first",
                        call(move |i| {
                            let (idem, tag, e) = (i2.clone(), t2.clone(), e2.clone());
                            async move {
                                pay(&idem, &tag, i, (i as i64 % ORDERS) + 1, &e).await.expect("first");
                            }
                        }),
                    ));
                    let floor_redis = match claims {
                        Claims::Single(c) => Some(redis::aio::ConnectionManager::new(c.clone()).await.expect("redis")),
                        _ => None,
                    };
                    if let Some(redis) = &floor_redis {
                        for (mode, gate) in [("floor", false), ("floor-gate", true)] {
                            let (p, r, t) = (pool.clone(), redis.clone(), format!("{tag}-{mode}"));
                            turns.push((
                                mode,
                                call(move |i| {
                                    let (p, r, key) = (p.clone(), r.clone(), format!("{t}_{i}"));
                                    async move { floor(&p, &r, key, (i as i64 % ORDERS) + 1, gate).await }
                                }),
                            ));
                        }
                    }
                    for (mode, timing) in alternating(tasks, calls, turns).await {
                        let counted = match (mode, &floor_redis) {
                            ("bare", _) => {
                                let p = &counted_pool;
                                round_trips(counted.as_ref(), &[], WARM, count, |i| bare(p, (i as i64 % ORDERS) + 1))
                                    .await
                            }
                            ("floor" | "floor-gate", Some(redis)) => {
                                let t = format!("{tag}-{mode}count");
                                round_trips(counted.as_ref(), &client, WARM, count, |i| {
                                    floor(
                                        &counted_pool,
                                        redis,
                                        format!("{t}_{i}"),
                                        (i as i64 % ORDERS) + 1,
                                        mode == "floor-gate",
                                    )
                                })
                                .await
                            }
                            _ => {
                                let tag_c = format!("{tag}-count");
                                round_trips(counted.as_ref(), &client, WARM, count, |i| {
                                    let (idem, tag, e) = (&counted_idem, &tag_c, &executions);
                                    async move {
                                        pay(idem, tag, i, 1, e).await.expect("first");
                                    }
                                })
                                .await
                            }
                        };
                        push(rows, mode, timing, counted);
                    }

                    // replay: the same 10 finished keys again and again; with one
                    // Redis node in turns with plain GETs (pushed after replay-local)
                    let (i2, t2, e2) = (idem.clone(), tag.clone(), executions.clone());
                    let before = executions.load(Ordering::Relaxed);
                    let replay = call(move |i| {
                        let (idem, tag, e) = (i2.clone(), t2.clone(), e2.clone());
                        async move { replay_one(&idem, &tag, i, &e, "replay").await }
                    });
                    let mut turns = vec![("replay", replay)];
                    // select: the floor of a replay without Redis, one indexed
                    // read of the record in autocommit (by its unique digest)
                    if let Claims::None = claims {
                        let digests: Arc<Vec<String>> = Arc::new(
                            (0..10)
                                .map(|n| {
                                    let key = format!("{tag}_{n}");
                                    idempotency::key::key_digest("bench_pay", &key)
                                        .iter()
                                        .map(|b| format!("{b:02x}"))
                                        .collect()
                                })
                                .collect(),
                        );
                        let p = pool.clone();
                        turns.push((
                            "select",
                            call(move |i| {
                                let (p, digest) = (p.clone(), digests[i % digests.len()].clone());
                                async move {
                                    let found: Option<(Option<String>,)> = sqlx::query_as($select_record)
                                        .bind(digest)
                                        .fetch_optional(&p)
                                        .await
                                        .expect("select");
                                    assert!(found.is_some_and(|(r,)| r.is_some()), "no record to select");
                                }
                            }),
                        ));
                    }
                    if let Claims::Single(c) = claims {
                        let mut conn = c.get_multiplexed_async_connection().await.expect("redis");
                        // Each replayed result: its field in the hash of its window.
                        let namespace = idem.redis_namespace().await.expect("namespace").expect("migrated");
                        let mut fields = Vec::new();
                        for n in 0..10 {
                            let at = idempotency::redis_layout::locate(
                                namespace.as_str(),
                                "bench_pay",
                                &format!("{tag}_{n}"),
                            )
                            .expect("namespace");
                            let hashes: Vec<String> = redis::cmd("KEYS")
                                .arg(format!("{}*", at.results_prefix))
                                .query_async(&mut conn)
                                .await
                                .expect("keys");
                            for hash in hashes {
                                let held: bool = redis::cmd("HEXISTS")
                                    .arg(&hash)
                                    .arg(&at.field[..])
                                    .query_async(&mut conn)
                                    .await
                                    .expect("hexists");
                                if held {
                                    fields.push((hash, at.field.to_vec()));
                                    break;
                                }
                            }
                        }
                        assert_eq!(fields.len(), 10, "the replayed results in redis");
                        turns.extend(plain_gets(c, tasks, fields).await);
                    }
                    // A replay is short: from one task five times the calls, so
                    // that its median and GET's hold still from run to run
                    // (300 calls of a round trip that is 20 µs or 80 µs as the
                    // vCPUs happen to sleep gave a ratio anywhere in ±20 %).
                    let replay_calls = if tasks == 1 { calls * replays_per_call } else { calls };
                    let mut timings = alternating(tasks, replay_calls, turns).await.into_iter();
                    let (_, timing) = timings.next().expect("replay row");
                    // pushed after replay, as get and tcp
                    let gets: Vec<_> = timings.collect();
                    assert_eq!(executions.load(Ordering::Relaxed), before, "a replay executed the body");
                    let counted = round_trips(counted.as_ref(), &client, WARM, count, |i| {
                        replay_one(&counted_idem, &tag, i, &executions, "replay")
                    })
                    .await;
                    push(rows, "replay", timing, counted);

                    // replay-local: the same finished keys from the process's own cache
                    if local && !matches!(claims, Claims::Cluster(..)) {
                        let cache = idempotency::LocalCache::new(10_000, 64 << 20).max_age(Duration::from_secs(600));
                        let builder = Idem::builder(pool.clone()).local_cache(cache);
                        let local = match claims {
                            Claims::Single(c) => builder.redis(c.clone()).build(),
                            _ => builder.build(),
                        };
                        for i in 0..10 {
                            replay_one(&local, &tag, i, &executions, "warm").await;
                        }
                        let before = executions.load(Ordering::Relaxed);
                        let (l2, t2, e2) = (local.clone(), tag.clone(), executions.clone());
                        let local_calls = calls * 20;
                        let timing = drive(tasks, local_calls, None, move |i| {
                            let (idem, tag, e) = (l2.clone(), t2.clone(), e2.clone());
                            async move { replay_one(&idem, &tag, i, &e, "replay-local").await }
                        })
                        .await;
                        assert_eq!(executions.load(Ordering::Relaxed), before, "a local replay executed the body");
                        let counted = round_trips(None::<&Counted<$db>>, &client, WARM, count, |i| {
                            replay_one(&local, &tag, i, &executions, "replay-local")
                        })
                        .await;
                        push(rows, "replay-local", timing, counted);
                    }

                    // get, tcp and select: the least a replay's one round trip costs
                    for (mode, timing) in gets {
                        push(rows, mode, timing, (f64::NAN, f64::NAN));
                    }

                    // storm: 100 calls released together on one new key
                    if phase == Phase::OneTask || storms == 0 {
                        continue;
                    }
                    let mut lat = Vec::new();
                    let mut wall = Duration::ZERO;
                    for s in 0..storms {
                        let storm_exec = Arc::new(AtomicUsize::new(0));
                        let barrier = Arc::new(Barrier::new(STORM));
                        let tag = format!("{run_id}-storm{s}");
                        let mut handles = Vec::new();
                        for _ in 0..STORM {
                            let (idem, tag, e, b) = (idem.clone(), tag.clone(), storm_exec.clone(), barrier.clone());
                            handles.push(tokio::spawn(async move {
                                b.wait().await;
                                let t = Instant::now();
                                let r = pay(&idem, &tag, 0, 1, &e).await;
                                assert!(
                                    matches!(r, Ok(_) | Err(BenchError::Idem(idempotency::Error::InProgress { .. }))),
                                    "{r:?}"
                                );
                                t.elapsed()
                            }));
                        }
                        let start = Instant::now();
                        for h in handles {
                            lat.push(h.await.expect("storm task"));
                        }
                        wall += start.elapsed();
                        let n = storm_exec.load(Ordering::Relaxed);
                        assert_eq!(n, 1, "storm {s} executed {n} times");
                    }
                    lat.sort();
                    rows.push(Row {
                        backend: name,
                        redis: label,
                        mode: "storm",
                        tasks: STORM,
                        calls: lat.len(),
                        calls_per_sec: lat.len() as f64 / wall.as_secs_f64(),
                        p50_ms: percentile(&lat, 0.50),
                        p99_ms: percentile(&lat, 0.99),
                        sql_per_call: f64::NAN,
                        redis_per_call: f64::NAN,
                        executions: Some(1),
                    });
                }
                Some(())
            }
        }
    };
}

backend!(
    mariadb,
    MySql,
    "mariadb",
    Some(Protocol::MySql),
    idempotency_testkit::mysql_url(),
    "CREATE TABLE IF NOT EXISTS bench_orders (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL, paid_count BIGINT NOT NULL DEFAULT 0)",
    "INSERT IGNORE INTO bench_orders (id, status) WITH RECURSIVE n (i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) SELECT i, 'PENDING' FROM n",
    "UPDATE bench_orders SET paid_count = paid_count + 1 WHERE id = ? AND status = 'PENDING'",
    "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (UNHEX(?), ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    "/*M! SET STATEMENT innodb_lock_wait_timeout = 5 FOR */ INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (UNHEX(?), ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    "SELECT response FROM idem_record WHERE key_digest = UNHEX(?)"
);

backend!(
    postgres,
    Postgres,
    "postgres",
    Some(Protocol::Postgres),
    idempotency_testkit::pg_url(),
    "CREATE TABLE IF NOT EXISTS bench_orders (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL, paid_count BIGINT NOT NULL DEFAULT 0)",
    "INSERT INTO bench_orders (id, status) SELECT i, 'PENDING' FROM generate_series(1, $1) AS i ON CONFLICT DO NOTHING",
    "UPDATE bench_orders SET paid_count = paid_count + 1 WHERE id = $1 AND status = 'PENDING'",
    "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (CAST($1 AS uuid), $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES (CAST($1 AS uuid), $2, $3, $4, $5, $6, $7, $8, $9, $10 + 0 * length(set_config('lock_timeout', '5000', true))) ON CONFLICT (key_digest) DO NOTHING",
    "SELECT response FROM idem_record WHERE key_digest = CAST($1 AS uuid)"
);

// Without Redis only (`main`), so its floor's inserts are never sent.
backend!(
    sqlite,
    Sqlite,
    "sqlite",
    None,
    sqlite_url(),
    "CREATE TABLE IF NOT EXISTS bench_orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL, paid_count INTEGER NOT NULL DEFAULT 0)",
    "INSERT OR IGNORE INTO bench_orders (id, status) WITH RECURSIVE n (i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) SELECT i, 'PENDING' FROM n",
    "UPDATE bench_orders SET paid_count = paid_count + 1 WHERE id = ? AND status = 'PENDING'",
    "-- not sent",
    "-- not sent",
    "SELECT response FROM idem_record WHERE key_digest = unhex(?)"
);

/// The SQLite database the bench writes: one file for the run, in the
/// system's temporary directory (sqlx opens it in WAL mode).
pub fn sqlite_url() -> String {
    format!("sqlite://{}?mode=rwc", sqlite_path().display())
}

pub fn sqlite_path() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("idem-bench-{}.db", std::process::id()))
}
