//! Issue 26.1: an `idem_record` of an earlier version (unique on
//! `(biz_type, idem_key)`, no `key_digest`) is migrated when this version's
//! engines start, and its records keep answering: the same bytes, no body
//! run again, duplicates still kept out.

use std::sync::Arc;
use std::sync::atomic::Ordering::SeqCst;

use idempotency::Idem;
use idempotency_testkit::{TestBackend, unique};
use tokio::sync::Barrier;

use super::fixture::{Mode, Probe, TestError, pay};
use super::{B, Db};

/// A record row as the earlier table held it.
type Row = (String, String, Option<String>, String, i16, Option<String>, i64, i64, i64);

async fn unique_indexes(pool: &sqlx::Pool<Db>) -> Vec<String> {
    let mut found: Vec<String> = sqlx::query_scalar(B::RECORD_UNIQUE_INDEXES).fetch_all(pool).await.expect("indexes");
    found.sort();
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_the_table_before_the_digest_replay_after_the_migration() {
    let name = unique("upgrade").replace('-', "_");
    let Some(pool) = B::open_private(&name, 4).await else { return };
    B::prepare(&pool).await;
    let probe = Arc::new(Probe::default());
    let keys: Vec<String> = (0..30).map(|i| format!("up-{i}")).collect();

    // Real records, written by today's engine, then moved into a table of
    // the earlier form, as an earlier version would have left them.
    let receipts = {
        let idem = Idem::new(pool.clone());
        idem.migrate().await.expect("migrate");
        let mut receipts = Vec::new();
        for k in &keys {
            receipts.push(pay(&idem, k.clone(), 7, &probe, Mode::Ok).await.unwrap());
        }
        receipts
    };
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at \
         FROM idem_record ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("rows");
    assert_eq!(rows.len(), keys.len());
    sqlx::raw_sql("DROP TABLE idem_record").execute(&pool).await.expect("drop");
    sqlx::raw_sql(B::RECORD_TABLE_BEFORE_DIGEST).execute(&pool).await.expect("earlier table");
    for r in &rows {
        sqlx::query(B::INSERT_RECORD_BEFORE_DIGEST)
            .bind(&r.0)
            .bind(&r.1)
            .bind(&r.2)
            .bind(&r.3)
            .bind(r.4)
            .bind(&r.5)
            .bind(r.6)
            .bind(r.7)
            .bind(r.8)
            .execute(&pool)
            .await
            .expect("earlier row");
    }
    assert_eq!(unique_indexes(&pool).await, ["biz_type,idem_key"]);

    // Two engines of this version start on it at once: one migrates, the
    // other finds it done.
    let barrier = Arc::new(Barrier::new(2));
    let starts: Vec<_> = (0..2)
        .map(|_| {
            let (pool, barrier) = (pool.clone(), barrier.clone());
            tokio::spawn(async move {
                let idem = Idem::new(pool);
                barrier.wait().await;
                idem.migrate().await.map(|()| idem)
            })
        })
        .collect();
    let mut engines = Vec::new();
    for start in starts {
        engines.push(start.await.unwrap().expect("migrate the earlier table"));
    }
    assert_eq!(unique_indexes(&pool).await, ["key_digest"], "unique on the digest alone");
    let idem = engines.pop().unwrap();
    idem.migrate().await.expect("a migrated table migrates to nothing");

    // Every record replays its own bytes; no body runs again.
    let ran = probe.runs.load(SeqCst);
    assert_eq!(ran, keys.len());
    for (k, receipt) in keys.iter().zip(&receipts) {
        assert_eq!(&pay(&idem, k.clone(), 7, &probe, Mode::Ok).await.unwrap(), receipt, "{k}");
    }
    assert_eq!(probe.runs.load(SeqCst), ran, "a migrated record ran its body again");

    // A storm on a migrated key replays; the fingerprint still tells a
    // reused key; a new key runs once.
    let storm = Arc::new(Barrier::new(16));
    let calls: Vec<_> = (0..16)
        .map(|_| {
            let (idem, probe, storm, k) = (idem.clone(), probe.clone(), storm.clone(), keys[0].clone());
            tokio::spawn(async move {
                storm.wait().await;
                pay(&idem, k, 7, &probe, Mode::Ok).await
            })
        })
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap(), receipts[0]);
    }
    let reused = pay(&idem, keys[1].clone(), 8, &probe, Mode::Ok).await;
    assert!(matches!(reused, Err(TestError::Idem(idempotency::Error::KeyReused { .. }))), "{reused:?}");
    assert_eq!(probe.runs.load(SeqCst), ran);
    let fresh = pay(&idem, "up-new".into(), 7, &probe, Mode::Ok).await.unwrap();
    assert_eq!(pay(&idem, "up-new".into(), 7, &probe, Mode::Ok).await.unwrap(), fresh);
    assert_eq!(probe.runs.load(SeqCst), ran + 1);

    let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_record").fetch_one(&pool).await.unwrap();
    assert_eq!(count, keys.len() as i64 + 1, "one row per key");
    drop((idem, engines));
    B::drop_private(pool, &name).await;
}
