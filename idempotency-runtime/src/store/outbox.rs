//! The `idem_outbox` table: events queued in a body's own transaction,
//! taken in batches by relays (`crate::outbox`). Each backend writes its
//! DDL and SQL text beside its record statements; the statements of the
//! same shape are written once by `outbox_queries!`.
//!
//! A relay's batch is the first pending rows in `id` order whose
//! aggregate has no earlier row pending or dead, locked for the batch
//! (`FOR UPDATE SKIP LOCKED` where the database has it); the transaction
//! stays open while the broker confirms, so a relay that dies mid-batch
//! leaves its rows to the next one, unmarked.
//!
//! `id` order is commit order within an aggregate: ids are handed out at
//! insert, so before its insert an event of an aggregate locks that
//! aggregate's row in `idem_outbox_aggregate` (created on first use) until
//! its transaction ends. A second writer of the aggregate waits there, and
//! takes its id after the first committed (or rolled back). SQLite needs
//! no such row: it has one writer at a time, and an insert takes the write
//! lock, whatever the transaction's begin mode. The rows hold no state the
//! order depends on: a row deleted (purged) is created again by the next
//! writer, and a row a writer holds cannot be deleted until it ends.

use std::future::Future;

use sqlx::{Pool, Transaction};

use super::{Db, Pooling};

/// `status` of a row waiting for the broker.
pub(crate) const PENDING: i16 = 0;
/// `status` of a row the broker confirmed.
pub(crate) const SENT: i16 = 1;
/// `status` of a row refused too many times: left for an operator.
pub(crate) const DEAD: i16 = 2;

/// A row about to be queued. Times are Unix epoch milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct NewEvent<'a> {
    pub message_id: &'a str,
    pub destination: &'a str,
    pub aggregate: Option<&'a str>,
    pub payload: &'a str,
    pub headers: Option<&'a str>,
    pub biz: Option<&'a str>,
    pub key: Option<&'a str>,
    pub now_ms: i64,
}

/// A row a relay took: `id`, `message_id`, `destination`, `aggregate_key`,
/// `payload`, `headers`, `attempts`, `created_at`.
pub type PendingRow = (i64, String, String, Option<String>, String, Option<String>, i32, i64);

/// A dead row: the columns of [`PendingRow`], then `last_error`,
/// `biz_type`, `idem_key`.
pub type DeadRow = (
    i64,
    String,
    String,
    Option<String>,
    String,
    Option<String>,
    i32,
    i64,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// SQL of the outbox statements; the same in shape on every backend.
pub(crate) struct OutboxQueries {
    /// Locks an aggregate's row until the transaction ends, creating it if
    /// absent (binds: aggregate, now); `None` where writers already take
    /// turns (SQLite).
    pub lock_aggregate: Option<&'static str>,
    /// Queues an event; a `message_id` already queued is left as it is.
    pub insert: &'static str,
    /// The relay's batch (binds: now, limit).
    pub pick: &'static str,
    /// A refused attempt (binds: status, attempts, next_attempt_at, last_error, id).
    pub mark_failed: &'static str,
    /// Deletes up to a limit of rows sent at or before a time.
    pub purge_sent: &'static str,
    /// Dead rows in `id` order (binds: limit).
    pub list_dead: &'static str,
    /// A dead row back to pending (binds: next_attempt_at, message_id).
    pub retry_dead: &'static str,
    /// Deletes a dead row (binds: message_id).
    pub discard_dead: &'static str,
    /// Rows by status: pending, sent, dead.
    pub count: &'static str,
}

/// The outbox statements of one backend. Public in name only, like
/// [`RecordSql`](super::RecordSql): the module is private.
pub trait OutboxSql: sqlx::Database + Sized {
    /// Creates `idem_outbox` and its indexes if absent.
    fn outbox_migrate(db: &Db<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Opens a relay's batch transaction (MySQL: `READ COMMITTED`, so the
    /// locking read takes no gap locks that would hold back bodies queueing
    /// new rows while the broker confirms; SQLite: the write lock, which
    /// makes it one relay at a time).
    fn outbox_begin(pool: &Pool<Self>) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send;

    /// Queues `event` on the body's connection, after locking its
    /// aggregate (if any) until the body's transaction ends. `Ok(false)`:
    /// its `message_id` was queued already.
    fn outbox_insert(
        pooling: Pooling,
        conn: &mut Self::Connection,
        event: &NewEvent<'_>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Locks and returns the next batch, at most `limit` rows.
    fn outbox_pick(
        pooling: Pooling,
        tx: &mut Transaction<'static, Self>,
        now_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<PendingRow>, sqlx::Error>> + Send;

    /// Marks the rows `ids` sent at `now_ms`.
    fn outbox_mark_sent(
        pooling: Pooling,
        tx: &mut Transaction<'static, Self>,
        ids: &[i64],
        now_ms: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Records a refused attempt of row `id`: its new status (pending or
    /// dead), attempt count, next attempt time and the broker's reason.
    fn outbox_mark_failed(
        pooling: Pooling,
        tx: &mut Transaction<'static, Self>,
        id: i64,
        status: i16,
        attempts: i32,
        next_attempt_ms: i64,
        error: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Deletes up to `limit` rows sent at or before `before_ms`.
    fn outbox_purge_sent(
        db: &Db<Self>,
        before_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Deletes up to `limit` aggregate rows created at or before
    /// `before_ms`, skipping those a writer holds: it never waits for a
    /// body.
    fn outbox_purge_aggregates(
        db: &Db<Self>,
        before_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Up to `limit` dead rows, oldest first.
    fn outbox_list_dead(db: &Db<Self>, limit: i64) -> impl Future<Output = Result<Vec<DeadRow>, sqlx::Error>> + Send;

    /// Puts the dead row `message_id` back to pending, attempts reset.
    /// `Ok(false)`: no dead row has that id.
    fn outbox_retry_dead(
        db: &Db<Self>,
        message_id: &str,
        now_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Deletes the dead row `message_id`. `Ok(false)`: no dead row has that id.
    fn outbox_discard_dead(db: &Db<Self>, message_id: &str) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// How many rows are pending, sent and dead.
    fn outbox_count(db: &Db<Self>) -> impl Future<Output = Result<(i64, i64, i64), sqlx::Error>> + Send;
}

/// Error text as stored in `last_error` (its column holds 1024 bytes).
pub(crate) fn clip_error(error: &str) -> &str {
    const MAX: usize = 1000;
    if error.len() <= MAX {
        return error;
    }
    let mut end = MAX;
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    &error[..end]
}

/// Writes the [`OutboxSql`] methods that differ only in SQL text, each
/// statement sent as the engine's pooling allows
/// ([`on_pool!`](super::on_pool) for those outside a transaction).
macro_rules! outbox_queries {
    ($q:expr) => {
        async fn outbox_insert(
            pooling: $crate::store::Pooling,
            conn: &mut Self::Connection,
            event: &$crate::store::outbox::NewEvent<'_>,
        ) -> Result<bool, ::sqlx::Error> {
            if let (Some(lock), Some(aggregate)) = ($q.lock_aggregate, event.aggregate) {
                pooling.query(lock).bind(aggregate).bind(event.now_ms).execute(&mut *conn).await?;
            }
            let done = pooling.query($q.insert)
                .bind(event.message_id)
                .bind(event.destination)
                .bind(event.aggregate)
                .bind(event.payload)
                .bind(event.headers)
                .bind(event.biz)
                .bind(event.key)
                .bind(event.now_ms)
                .bind(event.now_ms)
                .execute(&mut *conn)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn outbox_pick(
            pooling: $crate::store::Pooling,
            tx: &mut ::sqlx::Transaction<'static, Self>,
            now_ms: i64,
            limit: i64,
        ) -> Result<Vec<$crate::store::outbox::PendingRow>, ::sqlx::Error> {
            let rows = pooling.query_as($q.pick).bind(now_ms).bind(limit);
            rows.fetch_all(&mut **tx).await
        }

        async fn outbox_mark_sent(
            pooling: $crate::store::Pooling,
            tx: &mut ::sqlx::Transaction<'static, Self>,
            ids: &[i64],
            now_ms: i64,
        ) -> Result<(), ::sqlx::Error> {
            if ids.is_empty() {
                return Ok(());
            }
            // Built from constants and placeholders only.
            let list: Vec<String> =
                (2..ids.len() + 2).map(<Self as $crate::store::RecordSql>::placeholder).collect();
            let sql = format!(
                "UPDATE idem_outbox SET status = {sent}, sent_at = {at}, attempts = attempts + 1, last_error = NULL WHERE id IN ({list})",
                sent = $crate::store::outbox::SENT,
                at = <Self as $crate::store::RecordSql>::placeholder(1),
                list = list.join(", "),
            );
            let mut query = pooling.query(::sqlx::AssertSqlSafe(sql)).bind(now_ms);
            for id in ids {
                query = query.bind(*id);
            }
            query.execute(&mut **tx).await.map(drop)
        }

        async fn outbox_mark_failed(
            pooling: $crate::store::Pooling,
            tx: &mut ::sqlx::Transaction<'static, Self>,
            id: i64,
            status: i16,
            attempts: i32,
            next_attempt_ms: i64,
            error: &str,
        ) -> Result<(), ::sqlx::Error> {
            pooling.query($q.mark_failed)
                .bind(status)
                .bind(attempts)
                .bind(next_attempt_ms)
                .bind($crate::store::outbox::clip_error(error))
                .bind(id)
                .execute(&mut **tx)
                .await
                .map(drop)
        }

        async fn outbox_purge_sent(
            db: &$crate::store::Db<Self>,
            before_ms: i64,
            limit: i64,
        ) -> Result<u64, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                let done = pooling.query($q.purge_sent).bind(before_ms).bind(limit).execute(on);
                done.await.map(|d| d.rows_affected())
            })
        }

        async fn outbox_list_dead(
            db: &$crate::store::Db<Self>,
            limit: i64,
        ) -> Result<Vec<$crate::store::outbox::DeadRow>, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                pooling.query_as($q.list_dead).bind(limit).fetch_all(on).await
            })
        }

        async fn outbox_retry_dead(
            db: &$crate::store::Db<Self>,
            message_id: &str,
            now_ms: i64,
        ) -> Result<bool, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                let done =
                    pooling.query($q.retry_dead).bind(now_ms).bind(message_id).execute(on);
                done.await.map(|d| d.rows_affected() == 1)
            })
        }

        async fn outbox_discard_dead(db: &$crate::store::Db<Self>, message_id: &str) -> Result<bool, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                let done = pooling.query($q.discard_dead).bind(message_id).execute(on);
                done.await.map(|d| d.rows_affected() == 1)
            })
        }

        async fn outbox_count(db: &$crate::store::Db<Self>) -> Result<(i64, i64, i64), ::sqlx::Error> {
            let rows: Vec<(i16, i64)> = $crate::store::on_pool!(db, |on, pooling| {
                pooling.query_as($q.count).fetch_all(on).await
            })?;
            let of = |status: i16| rows.iter().find(|(s, _)| *s == status).map_or(0, |(_, n)| *n);
            Ok((
                of($crate::store::outbox::PENDING),
                of($crate::store::outbox::SENT),
                of($crate::store::outbox::DEAD),
            ))
        }
    };
}
pub(crate) use outbox_queries;
