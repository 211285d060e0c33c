//! The store's side of calls to outside services ([`crate::steps`]): the
//! questions the two-phase protocol asks, over two tables of their own that
//! `migrate` creates beside `idem_record`.
//!
//! ```text
//! idem_call(id, biz_type, idem_key, biz_no, params_hash,
//!           status     -- 0 processing, 1 succeeded, 2 failed (declared permanent)
//!           fence      -- the owner's fencing token: 1, then +1 at every takeover
//!           lease_until, response, created_at, updated_at, expires_at,
//!           UNIQUE(biz_type, idem_key), INDEX stuck (biz_type, status, lease_until), INDEX(expires_at))
//! idem_step(call_id, step, step_key, fence, response, created_at, PRIMARY KEY(call_id, step))
//! ```
//!
//! Why not `idem_record`: a two-phase record is committed while it is still
//! `processing`, carries a fence and a lease, and can end `failed`; the
//! plain mode's record never does any of that, and its protocol relies on
//! it (a committed row there is always finished). Separate tables leave the
//! plain mode's table, indexes, statements and round trips exactly as they
//! were, need no `ALTER TABLE` of a possibly large production table, and
//! give the recovery scan an index of its own that plain inserts never pay.
//!
//! A call's steps hang off its row id, not its key: a call that expired and
//! was replaced by a new one under the same key gets a new id, so it can
//! never replay the steps of the old one. Steps are deleted in the final
//! transaction, so none outlives its call.
//!
//! Every statement that changes a call names the owner (`id` and `fence`):
//! a call whose key was taken over changes nothing. The step insert reads
//! the call row with a shared lock, so a takeover waits for a step being
//! recorded (and a step after the takeover finds the new fence).

use std::future::Future;

use sqlx::Transaction;

use super::{Db, Pooling};

/// `status` of a call whose failure was declared permanent: recorded and
/// replayed like a result (`idem_call` only; see also
/// [`PROCESSING`](super::PROCESSING) and [`SUCCEEDED`](super::SUCCEEDED)).
pub(crate) const FAILED: i16 = 2;

/// A call's row about to be inserted by phase one. Times are epoch ms.
#[derive(Debug, Clone, Copy)]
pub struct NewCall<'a> {
    pub biz: &'a str,
    pub key: &'a str,
    pub biz_no: Option<&'a str>,
    pub params_hash: &'a str,
    pub now_ms: i64,
    pub lease_until_ms: i64,
    pub expires_ms: i64,
}

/// The owner of a processing call: its row and its fencing token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub id: i64,
    pub fence: i64,
}

/// A call's row, as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallRow {
    pub id: i64,
    pub params_hash: String,
    pub status: i16,
    pub fence: i64,
    pub lease_until_ms: i64,
    pub response: Option<String>,
    pub expires_ms: i64,
}

/// The columns `call_read` selects, in order.
pub type CallColumns = (i64, String, i16, i64, i64, Option<String>, i64);

impl From<CallColumns> for CallRow {
    fn from((id, params_hash, status, fence, lease_until_ms, response, expires_ms): CallColumns) -> Self {
        CallRow { id, params_hash, status, fence, lease_until_ms, response, expires_ms }
    }
}

/// A call stuck in `processing` past its lease: `idem_key`, `biz_no`,
/// `fence`, `lease_until`, `created_at`.
pub type StuckColumns = (String, Option<String>, i64, i64, i64);

/// What a step insert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepWritten {
    /// Recorded under our fence.
    Recorded,
    /// The call is no longer ours (taken over, or finished): nothing written.
    Fenced,
    /// The step was already recorded (by an owner this one took over from).
    Taken,
}

/// What each backend writes in its own SQL for calls to outside services.
/// Sealed like [`RecordSql`](super::RecordSql): public in name only.
pub trait CallSql: sqlx::Database + Sized {
    /// Creates `idem_call`, `idem_step` and their indexes if absent.
    fn call_migrate(db: &Db<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Phase one: inserts a processing call, fence 1. `Ok(Some(id))`:
    /// inserted (and committed, one statement); `Ok(None)`: the key is taken.
    fn call_insert(db: &Db<Self>, call: &NewCall<'_>) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send;

    /// The call of `(biz, key)`, read without locks.
    fn call_read(
        db: &Db<Self>,
        biz: &str,
        key: &str,
    ) -> impl Future<Output = Result<Option<CallRow>, sqlx::Error>> + Send;

    /// Deletes the call of `(biz, key)` if it finished and expired at or
    /// before `now_ms` (a processing call never expires: it is resumed).
    fn call_delete_expired(
        db: &Db<Self>,
        biz: &str,
        key: &str,
        now_ms: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Takes over a processing call whose lease ran out by `now_ms`: fence
    /// `from.fence + 1`, a new lease. `Ok(false)`: someone else changed it first.
    fn call_take_over(
        db: &Db<Self>,
        from: Owner,
        now_ms: i64,
        lease_until_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// In the final transaction: marks the call finished (`status`, with
    /// `response`) if `owner` still holds it. `Ok(false)`: fenced off.
    fn call_finish(
        pooling: Pooling,
        tx: &mut Transaction<'static, Self>,
        owner: Owner,
        status: i16,
        response: &str,
        now_ms: i64,
        expires_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Ends `owner`'s lease now, so a retry takes over at once.
    fn call_release(db: &Db<Self>, owner: Owner, now_ms: i64)
    -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Deletes `owner`'s processing call (one that never reached outside).
    fn call_discard(db: &Db<Self>, owner: Owner) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Records a step's result under `owner`, if it still holds the call.
    fn step_insert(
        db: &Db<Self>,
        owner: Owner,
        step: &str,
        step_key: &str,
        response: &str,
        now_ms: i64,
    ) -> impl Future<Output = Result<StepWritten, sqlx::Error>> + Send;

    /// The recorded result of one step of a call.
    fn step_read(
        db: &Db<Self>,
        call_id: i64,
        step: &str,
    ) -> impl Future<Output = Result<Option<String>, sqlx::Error>> + Send;

    /// Every recorded step of a call: `(step, response)`.
    fn steps_read(
        db: &Db<Self>,
        call_id: i64,
    ) -> impl Future<Output = Result<Vec<(String, String)>, sqlx::Error>> + Send;

    /// In the final transaction: deletes the steps of a call.
    fn steps_delete(
        pooling: Pooling,
        tx: &mut Transaction<'static, Self>,
        call_id: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Up to `limit` calls of `biz` in `processing` whose lease ended by
    /// `now_ms`, the longest stuck first.
    fn calls_stuck(
        db: &Db<Self>,
        biz: &str,
        now_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<StuckColumns>, sqlx::Error>> + Send;

    /// Deletes up to `limit` finished calls expired by `now_ms`.
    fn calls_purge_expired(
        db: &Db<Self>,
        now_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;
}

/// SQL of the call statements that every backend runs in the same shape.
pub(crate) struct CallQueries {
    pub read: &'static str,
    pub delete_expired: &'static str,
    pub take_over: &'static str,
    pub finish: &'static str,
    pub release: &'static str,
    pub discard: &'static str,
    pub step_insert: &'static str,
    pub step_read: &'static str,
    pub steps_read: &'static str,
    pub steps_delete: &'static str,
    pub stuck: &'static str,
    pub purge_expired: &'static str,
}

/// Writes the [`CallSql`] methods that differ only in SQL text (all but
/// `call_insert`, whose way of returning the new id differs), each
/// statement sent as the engine's pooling allows
/// ([`on_pool!`](super::on_pool) for those outside the final transaction).
macro_rules! call_queries {
    ($q:expr) => {
        async fn call_read(
            db: &$crate::store::Db<Self>,
            biz: &str,
            key: &str,
        ) -> Result<Option<$crate::store::calls::CallRow>, ::sqlx::Error> {
            let row: Option<$crate::store::calls::CallColumns> = $crate::store::on_pool!(db, |on, pooling| {
                pooling.query_as($q.read).bind(biz).bind(key).fetch_optional(on).await
            })?;
            Ok(row.map(Into::into))
        }

        async fn call_delete_expired(
            db: &$crate::store::Db<Self>,
            biz: &str,
            key: &str,
            now_ms: i64,
        ) -> Result<u64, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                let done = pooling.query($q.delete_expired).bind(biz).bind(key).bind(now_ms).execute(on);
                done.await.map(|d| d.rows_affected())
            })
        }

        async fn call_take_over(
            db: &$crate::store::Db<Self>,
            from: $crate::store::calls::Owner,
            now_ms: i64,
            lease_until_ms: i64,
        ) -> Result<bool, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                let done = pooling
                    .query($q.take_over)
                    .bind(lease_until_ms)
                    .bind(now_ms)
                    .bind(from.id)
                    .bind(from.fence)
                    .bind(now_ms)
                    .execute(on)
                    .await;
                done.map(|d| d.rows_affected() == 1)
            })
        }

        async fn call_finish(
            pooling: $crate::store::Pooling,
            tx: &mut ::sqlx::Transaction<'static, Self>,
            owner: $crate::store::calls::Owner,
            status: i16,
            response: &str,
            now_ms: i64,
            expires_ms: i64,
        ) -> Result<bool, ::sqlx::Error> {
            let done = pooling
                .query($q.finish)
                .bind(status)
                .bind(response)
                .bind(now_ms)
                .bind(expires_ms)
                .bind(owner.id)
                .bind(owner.fence)
                .execute(&mut **tx)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn call_release(
            db: &$crate::store::Db<Self>,
            owner: $crate::store::calls::Owner,
            now_ms: i64,
        ) -> Result<bool, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                let done = pooling.query($q.release).bind(now_ms).bind(owner.id).bind(owner.fence).execute(on).await;
                done.map(|d| d.rows_affected() == 1)
            })
        }

        async fn call_discard(
            db: &$crate::store::Db<Self>,
            owner: $crate::store::calls::Owner,
        ) -> Result<bool, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                let done = pooling.query($q.discard).bind(owner.id).bind(owner.fence).execute(on);
                done.await.map(|d| d.rows_affected() == 1)
            })
        }

        async fn step_insert(
            db: &$crate::store::Db<Self>,
            owner: $crate::store::calls::Owner,
            step: &str,
            step_key: &str,
            response: &str,
            now_ms: i64,
        ) -> Result<$crate::store::calls::StepWritten, ::sqlx::Error> {
            use $crate::store::calls::StepWritten;
            $crate::store::on_pool!(db, |on, pooling| {
                let done = pooling
                    .query($q.step_insert)
                    .bind(step)
                    .bind(step_key)
                    .bind(response)
                    .bind(now_ms)
                    .bind(owner.id)
                    .bind(owner.fence)
                    .execute(on)
                    .await;
                match done {
                    Ok(done) if done.rows_affected() == 1 => Ok(StepWritten::Recorded),
                    Ok(_) => Ok(StepWritten::Fenced),
                    Err(e) if $crate::store::is_unique_violation(&e) => Ok(StepWritten::Taken),
                    Err(e) => Err(e),
                }
            })
        }

        async fn step_read(
            db: &$crate::store::Db<Self>,
            call_id: i64,
            step: &str,
        ) -> Result<Option<String>, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                pooling.query_scalar($q.step_read).bind(call_id).bind(step).fetch_optional(on).await
            })
        }

        async fn steps_read(
            db: &$crate::store::Db<Self>,
            call_id: i64,
        ) -> Result<Vec<(String, String)>, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                pooling.query_as($q.steps_read).bind(call_id).fetch_all(on).await
            })
        }

        async fn steps_delete(
            pooling: $crate::store::Pooling,
            tx: &mut ::sqlx::Transaction<'static, Self>,
            call_id: i64,
        ) -> Result<u64, ::sqlx::Error> {
            let done = pooling.query($q.steps_delete).bind(call_id).execute(&mut **tx).await?;
            Ok(done.rows_affected())
        }

        async fn calls_stuck(
            db: &$crate::store::Db<Self>,
            biz: &str,
            now_ms: i64,
            limit: i64,
        ) -> Result<Vec<$crate::store::calls::StuckColumns>, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                let rows = pooling.query_as($q.stuck).bind(biz).bind(now_ms).bind(limit).fetch_all(on);
                rows.await
            })
        }

        async fn calls_purge_expired(
            db: &$crate::store::Db<Self>,
            now_ms: i64,
            limit: i64,
        ) -> Result<u64, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                let done = pooling.query($q.purge_expired).bind(now_ms).bind(limit).execute(on);
                done.await.map(|d| d.rows_affected())
            })
        }
    };
}
pub(crate) use call_queries;
