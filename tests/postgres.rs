//! Behaviour of `#[idempotent]` on PostgreSQL (`IDEM_PG_URL`), with and
//! without Redis (`IDEM_REDIS_URL`): the shared suite, and what only
//! PostgreSQL does.

mod suite;

/// The backend the suite runs on here.
type SuiteBackend = idempotency_testkit::backend::Postgres;

use std::str::FromStr;
use std::time::Duration;

use idempotency::{Idem, idempotent};
use idempotency_testkit::{TestBackend, pg_url, reach, unique};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Transaction};

use suite::Db;
use suite::fixture::TestError;

#[idempotent(key = "<k>", ttl = "1h", biz = "t_pg_lock_timeout")]
async fn lock_timeout_in_body(idem: &Idem<Db>, tx: &mut Transaction<'_, Db>, k: String) -> Result<String, TestError> {
    Ok(sqlx::query_scalar("SHOW lock_timeout").fetch_one(&mut **tx).await?)
}

/// Regression: the record's lock-wait bound is put back to the session's own
/// `lock_timeout` (not the server default) before the body runs.
#[tokio::test]
async fn the_body_sees_the_sessions_own_lock_timeout() {
    let Some(pool) = reach("postgres", || async {
        PgPoolOptions::new()
            .max_connections(1)
            .after_connect(|conn, _| {
                Box::pin(async move { sqlx::raw_sql("SET lock_timeout = '2s'").execute(conn).await.map(drop) })
            })
            .connect(&pg_url())
            .await
            .ok()
    })
    .await
    else {
        return;
    };
    let idem = Idem::builder(pool).lock_wait(Duration::from_millis(700)).build();
    idem.migrate().await.expect("migrate");
    assert_eq!(lock_timeout_in_body(&idem, unique("pglock")).await.unwrap(), "2s");
}

/// Sequential scans of `idem_record` so far, read on the engine's one
/// connection once it flushed its counters.
async fn record_seq_scans(engine: &sqlx::PgPool) -> i64 {
    seq_scans(engine, "idem_record").await
}

/// Sequential scans of `table` so far (see [`record_seq_scans`]).
async fn seq_scans(engine: &sqlx::PgPool, table: &str) -> i64 {
    // Counters reach the shared view when a session goes idle, at most once a
    // second unless forced.
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(engine).await.expect("flush");
    sqlx::query_scalar("SELECT seq_scan FROM pg_stat_user_tables WHERE relname = $1")
        .bind(table)
        .fetch_one(engine)
        .await
        .expect("seq_scan")
}

/// Issue 26.2: a purge walks the expiry index. With 100,000 live records
/// ahead of 20,000 expired ones in the heap, it deletes exactly the expired
/// ones in batches and, once none is left, answers 0 without a scan
/// (PostgreSQL's own counters). Its `LIMIT` subquery used to be planned as a
/// sequential scan: every batch, and a purge with nothing to delete, read
/// the table from its front.
#[tokio::test]
async fn purge_walks_the_expiry_index_not_the_table() {
    let name = unique("purgeidx").replace('-', "_");
    // One connection: the one whose counters the purges add to.
    let Some(engine) = SuiteBackend::open_private(&name, 1).await else { return };
    let idem = Idem::new(engine.clone());
    idem.migrate().await.expect("migrate");
    // Filled in SQL, live rows first: 100,000 live, 20,000 expired (ages 1..=20,000 ms).
    let fill = "INSERT INTO idem_record (key_digest, biz_type, idem_key, params_hash, status, response, created_at, updated_at, expires_at) \
                SELECT encode(substring(sha256(convert_to($1, 'UTF8') || decode('00', 'hex') || convert_to('k' || g, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid, \
                $1, 'k' || g, repeat('0', 64), 1, '{}', 0, 0, CASE WHEN $1 = 't_fill' THEN $2 ELSE g END \
                FROM generate_series(1, $3) g";
    for (biz, rows) in [("t_fill", 100_000), ("t_gone", 20_000)] {
        sqlx::query(fill).bind(biz).bind(i64::MAX / 2).bind(rows).execute(&engine).await.expect("fill");
    }
    sqlx::query("ANALYZE idem_record").execute(&engine).await.expect("analyze");

    let before = record_seq_scans(&engine).await;
    for _ in 0..4 {
        assert_eq!(idem.purge_expired(5_000).await.unwrap(), 5_000);
    }
    assert_eq!(idem.purge_expired(5_000).await.unwrap(), 0, "nothing left to delete");
    assert_eq!(record_seq_scans(&engine).await - before, 0, "a purge scanned idem_record");

    let left: Vec<(String, i64)> = sqlx::query_as("SELECT biz_type, COUNT(*) FROM idem_record GROUP BY biz_type")
        .fetch_all(&engine)
        .await
        .unwrap();
    assert_eq!(left, [("t_fill".to_owned(), 100_000)]);
    drop(idem);
    SuiteBackend::drop_private(engine, &name).await;
}

/// The text of the engine's purge of `table` as the server holds it
/// prepared on the engine's connection, and how many times each kind of
/// plan ran it.
async fn prepared_purge(engine: &sqlx::PgPool, table: &str) -> (String, i64, i64) {
    sqlx::query_as(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements \
         WHERE starts_with(statement, 'DELETE FROM ' || $1 || ' ')",
    )
    .bind(table)
    .fetch_one(engine)
    .await
    .expect("the purge is prepared")
}

/// Asserts that `purge`, planned custom and generic on `engine`, walks the
/// expiry index `index` in order: an index scan of it, no bitmap of it, no
/// sort, no sequential scan anywhere.
async fn assert_walks(engine: &sqlx::PgPool, purge: &str, index: &str, stage: &str) {
    for mode in ["force_custom_plan", "force_generic_plan"] {
        let mut tx = engine.begin().await.expect("begin");
        // Simple protocol: the statement's `$1` and `$2` are PREPARE's own.
        let prepare = format!("SET LOCAL plan_cache_mode = {mode}; PREPARE t_purge (bigint, bigint) AS {purge}");
        sqlx::raw_sql(AssertSqlSafe(prepare)).execute(&mut *tx).await.expect("prepare");
        let plan: Vec<String> =
            sqlx::query_scalar("EXPLAIN EXECUTE t_purge((EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::bigint, 1000)")
                .fetch_all(&mut *tx)
                .await
                .expect("explain");
        sqlx::raw_sql("DEALLOCATE t_purge").execute(&mut *tx).await.expect("deallocate");
        tx.rollback().await.expect("rollback");
        let plan = plan.join("\n");
        let walks = plan.contains(&format!("Index Scan using {index} "));
        let reads_all =
            ["Seq Scan", "Sort", &format!("Bitmap Index Scan on {index}")].iter().any(|node| plan.contains(*node));
        assert!(walks && !reads_all, "{stage}, {mode}:\n{plan}");
    }
}

/// A private database whose planner believes in a cache of 1 MB, migrated,
/// `tables` without autovacuum (statistics and vacuum come when the test
/// says); its pool of one connection, opened after the setting: the
/// engine's, whose statements and counters the test reads.
async fn engine_with_a_small_cache(name: &str, tables: &[&str]) -> Option<sqlx::PgPool> {
    let setup = SuiteBackend::open_private(name, 1).await?;
    let ecs = format!("ALTER DATABASE {name} SET effective_cache_size = '1MB'");
    sqlx::raw_sql(AssertSqlSafe(ecs)).execute(&setup).await.expect("effective_cache_size");
    setup.close().await;
    let options = PgConnectOptions::from_str(&pg_url()).expect("postgres url").database(name);
    let engine = PgPoolOptions::new().max_connections(1).connect_with(options).await.expect("private database");
    Idem::new(engine.clone()).migrate().await.expect("migrate");
    for table in tables {
        let off = format!("ALTER TABLE {table} SET (autovacuum_enabled = false)");
        sqlx::raw_sql(AssertSqlSafe(off)).execute(&engine).await.expect("autovacuum off");
    }
    Some(engine)
}

/// Issue 32.7: every plan of the purge walks the expiry index, among them
/// the generic plan PostgreSQL switches a prepared statement to after five
/// runs. Planned without the values, the purge used to take a third of the
/// table for expired and fetch a tenth of that; once the table outgrew the
/// planner's cache, a sort of every expired row (or a sequential scan) beat
/// the walk, on each batch and with nothing left to delete. The database's
/// `effective_cache_size` of 1 MB gives 120,000 rows the planner's view of
/// a table that outgrew its cache (2 M rows at the server's 4 GB: see
/// docs/performance.md). Checked in the server's own views: the plans of
/// the engine's own statement (custom and generic; without statistics,
/// analyzed, with dead tuples, vacuumed), 12 purges in the default mode
/// having switched to the generic plan, then the rest under
/// `force_generic_plan`, and no sequential scan of the table meanwhile.
#[tokio::test]
async fn purge_walks_the_expiry_index_in_every_plan() {
    const EXPIRY: &str = "idx_idem_record_expires_at";
    let name = unique("purgeplans").replace('-', "_");
    let Some(engine) = engine_with_a_small_cache(&name, &["idem_record"]).await else { return };
    let idem = Idem::new(engine.clone());
    assert_eq!(idem.purge_expired(1_000).await.unwrap(), 0, "the engine prepares its purge");
    let (purge, ..) = prepared_purge(&engine, "idem_record").await;

    // 100,000 live and 20,000 expired records (ages 1..=20,000 ms), in no
    // order of expiry in the heap, as records of several ttls lie.
    sqlx::query(
        "INSERT INTO idem_record (key_digest, biz_type, idem_key, params_hash, status, response, created_at, updated_at, expires_at) \
         SELECT encode(substring(sha256(convert_to(b, 'UTF8') || decode('00', 'hex') || convert_to('k' || g, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid, \
         b, 'k' || g, repeat('0', 64), 1, '{}', 0, 0, CASE WHEN g <= 100000 THEN 4611686018427387903 ELSE g - 100000 END \
         FROM generate_series(1, 120000) g, LATERAL (SELECT CASE WHEN g <= 100000 THEN 't_fill' ELSE 't_gone' END AS b) biz \
         ORDER BY md5(g::text)",
    )
    .execute(&engine)
    .await
    .expect("fill");
    let never: (i64, f32) = sqlx::query_as(
        "SELECT (SELECT COUNT(*) FROM pg_stats WHERE tablename = 'idem_record'), reltuples FROM pg_class WHERE relname = 'idem_record'",
    )
    .fetch_one(&engine)
    .await
    .unwrap();
    assert_eq!(never, (0, -1.0), "never analyzed nor vacuumed");
    assert_walks(&engine, &purge, EXPIRY, "without statistics").await;
    sqlx::query("ANALYZE idem_record").execute(&engine).await.expect("analyze");
    assert_walks(&engine, &purge, EXPIRY, "analyzed").await;

    // Past the switch-over, in the default mode.
    let seq_before = record_seq_scans(&engine).await;
    for _ in 0..12 {
        assert_eq!(idem.purge_expired(1_000).await.unwrap(), 1_000);
    }
    let (_, generic, custom) = prepared_purge(&engine, "idem_record").await;
    assert_eq!(generic + custom, 13, "the statement explained is the one the purges ran");
    assert!(generic > 0, "after five custom plans the purge runs its generic plan ({custom} custom)");
    assert_walks(&engine, &purge, EXPIRY, "dead tuples, statistics from before").await;
    sqlx::query("ANALYZE idem_record").execute(&engine).await.expect("analyze");
    assert_walks(&engine, &purge, EXPIRY, "dead tuples, analyzed").await;

    // The rest, and twelve with nothing to delete, in the generic plan only.
    sqlx::query("SET plan_cache_mode = force_generic_plan").execute(&engine).await.unwrap();
    let mut deleted = 12_000;
    for _ in 0..8 {
        deleted += idem.purge_expired(1_000).await.unwrap();
    }
    assert_eq!(deleted, 20_000);
    for _ in 0..12 {
        assert_eq!(idem.purge_expired(1_000).await.unwrap(), 0, "nothing left to delete");
    }
    assert_eq!(record_seq_scans(&engine).await - seq_before, 0, "a purge scanned idem_record");
    let (_, generic_after, _) = prepared_purge(&engine, "idem_record").await;
    assert_eq!(generic_after - generic, 20, "every purge since ran the generic plan");
    sqlx::query("RESET plan_cache_mode").execute(&engine).await.unwrap();
    sqlx::query("VACUUM ANALYZE idem_record").execute(&engine).await.expect("vacuum");
    assert_walks(&engine, &purge, EXPIRY, "vacuumed").await;

    let left: Vec<(String, i64)> = sqlx::query_as("SELECT biz_type, COUNT(*) FROM idem_record GROUP BY biz_type")
        .fetch_all(&engine)
        .await
        .unwrap();
    assert_eq!(left, [("t_fill".to_owned(), 100_000)]);
    let ecs: String = sqlx::query_scalar("SHOW effective_cache_size").fetch_one(&engine).await.unwrap();
    assert_eq!(ecs, "1MB", "the planner's cache was the database's setting throughout");
    drop(idem);
    SuiteBackend::drop_private(engine, &name).await;
}

/// The other purges of issue 32.7's kind: issued tokens (database store),
/// finished two-phase calls, sent outbox events. As the records' purge:
/// with 100,000 rows to keep and 20,000 to delete, in no order of expiry,
/// custom and generic plans walk the expiry index without statistics,
/// analyzed and with dead tuples, and 12 purges in the default mode (having
/// switched to the generic plan) delete 1,000 each without a sequential
/// scan. Each purge runs once first, on an empty table, so that its
/// statement is prepared on the engine's connection.
#[tokio::test]
async fn the_other_purges_walk_their_expiry_index_in_every_plan() {
    // (table, its expiry index, rows to keep then rows to delete, from the integers g).
    #[allow(unused_mut)] // pushed to with the feature `outbox`
    let mut purges: Vec<(&str, &str, &str)> = vec![
        (
            "idem_token",
            "idx_idem_token_keep_until",
            "INSERT INTO idem_token (biz_type, token, subject, created_at, expires_at, used_at, keep_until) \
             SELECT 't_tok', md5(g::text), 's', 0, 0, NULL, CASE WHEN g <= 100000 THEN 4611686018427387903 ELSE g - 100000 END \
             FROM generate_series(1, 120000) g ORDER BY md5(g::text || 'x')",
        ),
        (
            "idem_call",
            "idx_idem_call_expires_at",
            "INSERT INTO idem_call (biz_type, idem_key, params_hash, status, fence, lease_until, response, created_at, updated_at, expires_at) \
             SELECT 't_call', 'k' || g, repeat('0', 64), 1, 1, 0, '{}', 0, 0, CASE WHEN g <= 100000 THEN 4611686018427387903 ELSE g - 100000 END \
             FROM generate_series(1, 120000) g ORDER BY md5(g::text)",
        ),
    ];
    #[cfg(feature = "outbox")]
    purges.push((
        "idem_outbox",
        "idx_idem_outbox_sent_at",
        "INSERT INTO idem_outbox (message_id, destination, aggregate_key, payload, status, next_attempt_at, created_at, sent_at) \
         SELECT md5(g::text), 'd', NULL, '{}', 1, 0, 0, CASE WHEN g <= 100000 THEN 4611686018427387903 ELSE g - 100000 END \
         FROM generate_series(1, 120000) g ORDER BY md5(g::text)",
    ));
    let tables: Vec<&str> = purges.iter().map(|(table, ..)| *table).collect();
    let name = unique("otherpurges").replace('-', "_");
    let Some(engine) = engine_with_a_small_cache(&name, &tables).await else { return };
    let idem = Idem::new(engine.clone());
    let purge = |table: &'static str| {
        let idem = idem.clone();
        async move {
            match table {
                "idem_token" => idem.tokens().purge_expired(1_000).await.expect("token purge"),
                "idem_call" => idem.purge_expired_calls(1_000).await.expect("call purge"),
                #[cfg(feature = "outbox")]
                "idem_outbox" => idem.outbox().purge_sent(Duration::ZERO, 1_000).await.expect("outbox purge"),
                _ => unreachable!("{table}"),
            }
        }
    };

    for (table, index, fill) in purges {
        assert_eq!(purge(table).await, 0, "{table}: the engine prepares its purge");
        let (statement, ..) = prepared_purge(&engine, table).await;
        sqlx::raw_sql(AssertSqlSafe(fill)).execute(&engine).await.expect("fill");
        assert_walks(&engine, &statement, index, &format!("{table} without statistics")).await;
        sqlx::raw_sql(AssertSqlSafe(format!("ANALYZE {table}"))).execute(&engine).await.expect("analyze");
        assert_walks(&engine, &statement, index, &format!("{table} analyzed")).await;
        let seq_before = seq_scans(&engine, table).await;
        for _ in 0..12 {
            assert_eq!(purge(table).await, 1_000, "{table}");
        }
        assert_eq!(seq_scans(&engine, table).await - seq_before, 0, "a purge scanned {table}");
        let (_, generic, custom) = prepared_purge(&engine, table).await;
        assert_eq!(generic + custom, 13, "{table}: the statement explained is the one the purges ran");
        assert!(generic > 0, "{table}: after five custom plans the purge runs its generic plan");
        assert_walks(&engine, &statement, index, &format!("{table} with dead tuples")).await;
    }
    drop(idem);
    SuiteBackend::drop_private(engine, &name).await;
}
