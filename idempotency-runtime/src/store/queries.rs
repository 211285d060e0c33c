//! The statements every backend runs in the same shape, written once
//! (`record_queries!`) over each backend's SQL text ([`Queries`]), each sent
//! as the engine's [`Pooling`](super::Pooling) allows.

/// SQL of the statements every backend runs in the same shape.
pub(crate) struct Queries {
    pub insert: &'static str,
    pub mark_finished: &'static str,
    pub read_locking: &'static str,
    pub read_plain: &'static str,
    pub delete_expired: &'static str,
    pub purge_expired: &'static str,
    /// Creates `idem_meta`: one row per setting, such as the namespace.
    pub meta_ddl: &'static str,
    /// Records the namespace unless one is recorded (binds: the namespace).
    pub init_namespace: &'static str,
}

/// The statement reading the namespace back; the same on every backend.
pub(crate) const NAMESPACE: &str = "SELECT value FROM idem_meta WHERE name = 'namespace'";

/// Writes the [`RecordSql`](super::RecordSql) methods that differ only in SQL text, each
/// statement sent as the engine's [`Pooling`](super::Pooling) allows ([`on_pool!`](super::on_pool) for
/// those outside the call's transaction).
macro_rules! record_queries {
    ($q:expr) => {
        // The simple protocol: nothing prepared, behind a pooler too.
        async fn mark_body(tx: &mut ::sqlx::Transaction<'_, Self>) -> Result<(), ::sqlx::Error> {
            let sql = $crate::store::body_savepoint("SAVEPOINT", tx);
            ::sqlx::raw_sql(::sqlx::AssertSqlSafe(sql)).execute(&mut **tx).await.map(drop)
        }

        async fn undo_body(tx: &mut ::sqlx::Transaction<'_, Self>) -> Result<(), ::sqlx::Error> {
            let sql = $crate::store::body_savepoint("ROLLBACK TO SAVEPOINT", tx);
            ::sqlx::raw_sql(::sqlx::AssertSqlSafe(sql)).execute(&mut **tx).await.map(drop)
        }

        async fn execute_text(
            tx: &mut ::sqlx::Transaction<'_, Self>,
            text: $crate::store::Text,
        ) -> Result<(), ::sqlx::Error> {
            ::sqlx::raw_sql(text.into_sql()).execute(&mut **tx).await.map(drop)
        }

        async fn insert(
            pooling: $crate::store::Pooling,
            tx: &mut ::sqlx::Transaction<'_, Self>,
            rec: &$crate::store::NewRecord<'_>,
            wait: Option<::std::time::Duration>,
        ) -> Result<bool, ::sqlx::Error> {
            let sql = Self::bounded($q.insert, wait);
            // Placeholders in column order: key_digest, biz_type, idem_key, biz_no,
            // params_hash, status, response, created_at, updated_at, expires_at.
            let done = pooling
                .query(sql)
                .bind(rec.key.digest)
                .bind(rec.key.biz)
                .bind(rec.key.key)
                .bind(rec.biz_no)
                .bind(rec.params_hash)
                .bind(rec.status)
                .bind(rec.response)
                .bind(rec.now_ms)
                .bind(rec.now_ms)
                .bind(rec.expires_ms)
                .execute(&mut **tx)
                .await;
            $crate::store::inserted(done.map(|d| d.rows_affected()))
        }

        async fn mark_finished(
            pooling: $crate::store::Pooling,
            tx: &mut ::sqlx::Transaction<'_, Self>,
            rec: &$crate::store::NewRecord<'_>,
        ) -> Result<(), ::sqlx::Error> {
            pooling
                .query($q.mark_finished)
                .bind(rec.status)
                .bind(rec.response)
                .bind(rec.now_ms)
                .bind(rec.expires_ms)
                .bind(rec.key.digest)
                .bind(rec.key.biz)
                .bind(rec.key.key)
                .execute(&mut **tx)
                .await
                .map(drop)
        }

        async fn read_locking(
            pooling: $crate::store::Pooling,
            conn: &mut Self::Connection,
            key: $crate::store::RowKey<'_>,
            wait: Option<::std::time::Duration>,
        ) -> Result<Option<$crate::store::StoredRecord>, ::sqlx::Error> {
            let sql = Self::bounded($q.read_locking, wait);
            let row: Option<$crate::store::RecordRow> =
                pooling.query_as(sql).bind(key.digest).bind(key.biz).bind(key.key).fetch_optional(&mut *conn).await?;
            Ok(row.map(Into::into))
        }

        async fn read_plain(
            db: &$crate::store::Db<Self>,
            key: $crate::store::RowKey<'_>,
        ) -> Result<Option<$crate::store::StoredRecord>, ::sqlx::Error> {
            let row: Option<$crate::store::RecordRow> = $crate::store::on_pool!(db, |on, pooling| {
                let query = pooling.query_as($q.read_plain);
                query.bind(key.digest).bind(key.biz).bind(key.key).fetch_optional(on).await
            })?;
            Ok(row.map(Into::into))
        }

        async fn delete_expired(
            pooling: $crate::store::Pooling,
            conn: &mut Self::Connection,
            key: $crate::store::RowKey<'_>,
            now_ms: i64,
            wait: Option<::std::time::Duration>,
        ) -> Result<u64, ::sqlx::Error> {
            let sql = Self::bounded($q.delete_expired, wait);
            let done = pooling
                .query(sql)
                .bind(key.digest)
                .bind(key.biz)
                .bind(key.key)
                .bind(now_ms)
                .execute(&mut *conn)
                .await?;
            Ok(done.rows_affected())
        }

        async fn namespace(db: &$crate::store::Db<Self>) -> Result<Option<String>, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                pooling.query_scalar($crate::store::NAMESPACE).fetch_optional(on).await
            })
        }

        async fn purge_expired(db: &$crate::store::Db<Self>, now_ms: i64, limit: i64) -> Result<u64, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                let done = pooling.query($q.purge_expired).bind(now_ms).bind(limit).execute(on);
                done.await.map(|d| d.rows_affected())
            })
        }
    };
}
pub(crate) use record_queries;
