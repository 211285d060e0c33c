//! A duplicate never gets a failure when a record committed: a deadlock
//! between a claimed and an unclaimed call replays the winner.

use std::sync::Arc;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use idempotency::{Idem, idempotent};
use idempotency_testkit::{TestBackend, unique};
use sqlx::Transaction;

use super::fixture::{
    Probe, Receipt, TestError, engine_on_private_database, ledger_rows, record_rows_for, until_expired, until_held,
};
use super::{B, Db};

/// Which lock a `pay_locking` body takes, and when.
#[derive(Debug, Clone, Copy)]
enum LockOrder {
    /// Locks the business row, then returns (the record goes in after).
    RowThenReturn,
    /// Waits at the gate, then locks the business row.
    HeldThenRow,
}

#[idempotent(key = "<k>", ttl = "3s", biz = "t_lock")]
async fn pay_locking(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    #[idem(skip)] probe: &Probe,
    #[idem(skip)] order: LockOrder,
) -> Result<Receipt, TestError> {
    let run = probe.runs.fetch_add(1, SeqCst) + 1;
    sqlx::query(B::INSERT_LEDGER).bind(&k).bind(amount).execute(&mut **tx).await?;
    if let LockOrder::HeldThenRow = order {
        probe.held.fetch_add(1, SeqCst);
        probe.gate.acquire().await.expect("gate").forget();
    }
    sqlx::query("UPDATE idem_classify SET v = v + 1 WHERE id = 1").execute(&mut **tx).await?;
    if let LockOrder::RowThenReturn = order {
        probe.held.fetch_add(1, SeqCst);
    }
    Ok(Receipt { key: k, amount, run })
}

/// A call without a claim (record first) and a claimed call (record last)
/// whose bodies lock one business row: held at gates so they deadlock for
/// certain. The victim, whichever the server picks, replays the winner.
async fn deadlock_between_claimed_and_unclaimed(over_an_expired_record: bool) {
    if B::ONE_WRITER {
        return; // one writer at a time: nothing to deadlock on
    }
    let name = unique("deadlock").replace('-', "_");
    let Some((pool, claimed)) = engine_on_private_database(&name).await else { return };
    sqlx::raw_sql(B::LOCKABLE_ROWS_DDL).execute(&pool).await.expect("business row");
    let unclaimed = Idem::new(pool.clone());
    let probe = Arc::new(Probe::default());
    let k = unique("deadlock");
    if over_an_expired_record {
        let before = Probe::default();
        before.open();
        pay_locking(&unclaimed, k.clone(), 7, &before, LockOrder::RowThenReturn).await.unwrap();
        until_expired(&unclaimed, "t_lock", &k).await;
    }

    // Without a claim: record in, body held before it locks the row.
    let first = {
        let (idem, k, probe) = (unclaimed.clone(), k.clone(), probe.clone());
        tokio::spawn(
            async move { idempotency::observe(pay_locking(&idem, k, 7, &probe, LockOrder::HeldThenRow)).await },
        )
    };
    until_held(&probe).await;
    // With a claim: the body locks the row, then the record insert waits on
    // the first call's record.
    let second = {
        let (idem, k, probe) = (claimed.clone(), k.clone(), probe.clone());
        tokio::spawn(
            async move { idempotency::observe(pay_locking(&idem, k, 7, &probe, LockOrder::RowThenReturn)).await },
        )
    };
    let start = std::time::Instant::now();
    while probe.held.load(SeqCst) < 2 {
        assert!(start.elapsed() < Duration::from_secs(30), "the claimed body never locked the row");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    probe.open(); // the first now waits on the row: a deadlock either way round

    let (first, first_outcome) = first.await.unwrap();
    let (second, second_outcome) = second.await.unwrap();
    let (first, second) = (first.expect("the first call failed"), second.expect("the claimed call failed"));
    assert_eq!(first, second, "both callers got the committed result");
    let mut outcomes = vec![first_outcome, second_outcome];
    outcomes.sort_by_key(|o| format!("{o:?}"));
    assert_eq!(outcomes, vec![Some(idempotency::Outcome::Executed), Some(idempotency::Outcome::Replayed)]);
    assert_eq!(probe.runs(), 2, "both bodies ran; one was rolled back");
    assert_eq!(ledger_rows(&claimed, &k).await, 1 + i64::from(over_an_expired_record));
    assert_eq!(record_rows_for(&claimed, "t_lock", &k).await, 1);

    drop((claimed, unclaimed));
    B::drop_private(pool, &name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_between_a_claimed_and_an_unclaimed_call_replays_the_winner() {
    deadlock_between_claimed_and_unclaimed(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_between_two_calls_replacing_an_expired_record_replays_the_winner() {
    deadlock_between_claimed_and_unclaimed(true).await;
}
