//! Behaviour of `#[idempotent]` on PostgreSQL (`IDEM_PG_URL`), with and
//! without Redis (`IDEM_REDIS_URL`): the shared suite, and what only
//! PostgreSQL does.

mod suite;

/// The backend the suite runs on here.
type SuiteBackend = idempotency_testkit::backend::Postgres;

use std::time::Duration;

use idempotency::{Idem, idempotent};
use idempotency_testkit::{TestBackend, pg_url, reach, unique};
use sqlx::Transaction;
use sqlx::postgres::PgPoolOptions;

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
    // Counters reach the shared view when a session goes idle, at most once a
    // second unless forced.
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(engine).await.expect("flush");
    sqlx::query_scalar("SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'idem_record'")
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
