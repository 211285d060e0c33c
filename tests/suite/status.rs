//! `status` at each stage of a call, and `purge_expired` in batches.

use std::sync::Arc;

use idempotency::{Idem, Status};
use idempotency_testkit::{TestBackend, unique};

use super::fixture::{Mode, Probe, Receipt, Redis, engine, pay, pay_short_ttl, until_expired, until_started};
use super::{B, Db};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_each_stage() {
    let Some(idem) = engine(&unique("db"), 4, Redis::On).await else { return };
    let probe = Arc::new(Probe::default());
    let k = unique("status");
    assert_eq!(idem.status("t_pay", &k).await.unwrap(), Status::Absent);
    let running = {
        let (idem, k, probe) = (idem.clone(), k.clone(), probe.clone());
        tokio::spawn(async move { pay(&idem, k, 3, &probe, Mode::HeldThenOk).await })
    };
    until_started(&probe, 1).await;
    assert_eq!(idem.status("t_pay", &k).await.unwrap(), Status::InProgress);
    probe.open();
    let receipt = running.await.unwrap().unwrap();
    let status = idem.status("t_pay", &k).await.unwrap();
    assert_eq!(status.response::<Receipt>().unwrap().unwrap(), receipt);
    assert!(matches!(idem.status("t_pay", "no such key").await, Err(idempotency::Error::InvalidKey(_))));
    // `biz` obeys the attribute's rule: with a `:` it could read another pair's claim.
    for biz in ["t:pay", "T_pay", ""] {
        let refused = idem.status(biz, &k).await;
        assert!(matches!(refused, Err(idempotency::Error::InvalidBiz)), "{biz:?}: {refused:?}");
    }
}

/// Every `(biz_type, idem_key)` in `idem_record`, sorted.
async fn all_records(pool: &sqlx::Pool<Db>) -> Vec<(String, String)> {
    let mut rows: Vec<(String, String)> =
        sqlx::query_as("SELECT biz_type, idem_key FROM idem_record").fetch_all(pool).await.expect("records");
    rows.sort();
    rows
}

/// `purge_expired(limit)` deletes expired records only, at most `limit` per
/// call. On a database of its own: it deletes whatever has expired.
#[tokio::test]
async fn purge_expired_deletes_expired_records_in_batches() {
    let name = unique("purge").replace('-', "_");
    let Some(pool) = B::open_private(&name, 2).await else { return };
    B::prepare(&pool).await;
    let idem = Idem::new(pool.clone());
    idem.migrate().await.expect("migrate");
    let probe = Probe::default();
    let expired: Vec<String> = (0..5).map(|i| format!("gone-{i}")).collect();
    let live: Vec<(String, String)> = (0..3).map(|i| ("t_pay".to_owned(), format!("kept-{i}"))).collect();
    for k in &expired {
        pay_short_ttl(&idem, k.clone(), &probe, Mode::Ok).await.unwrap();
    }
    let mut receipts = Vec::new();
    for (_, k) in &live {
        receipts.push(pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap());
    }
    for k in &expired {
        until_expired(&idem, "t_ttl", k).await;
    }
    assert_eq!(all_records(&pool).await.len(), 8);

    assert_eq!(idem.purge_expired(3).await.unwrap(), 3);
    let left = all_records(&pool).await;
    let (left_live, left_expired): (Vec<_>, Vec<_>) = left.into_iter().partition(|(biz, _)| biz == "t_pay");
    assert_eq!(left_live, live, "every live record stays");
    assert_eq!(left_expired.len(), 2, "{left_expired:?}");
    assert!(left_expired.iter().all(|(biz, k)| biz == "t_ttl" && expired.contains(k)), "{left_expired:?}");

    assert_eq!(idem.purge_expired(10).await.unwrap(), 2, "the rest");
    assert_eq!(all_records(&pool).await, live);
    assert_eq!(idem.purge_expired(10).await.unwrap(), 0);
    for k in &expired {
        assert_eq!(idem.status("t_ttl", k).await.unwrap(), Status::Absent, "{k} was purged");
    }
    for ((_, k), receipt) in live.iter().zip(&receipts) {
        assert_eq!(&pay(&idem, k.clone(), 1, &probe, Mode::Ok).await.unwrap(), receipt, "{k} still replays");
    }
    assert_eq!(probe.runs(), 8);
    drop(idem);
    B::drop_private(pool, &name).await;
}
