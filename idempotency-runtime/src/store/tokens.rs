//! The statements of issued tokens without Redis (`crate::token::database`)
//! in `idem_token`, which `migrate` creates beside `idem_record`: their
//! shape, written once by `token_queries!` over each backend's SQL text.

/// One issued token in `idem_token`: its business action, its text, and
/// the subject it was issued to.
#[derive(Debug, Clone, Copy)]
pub struct TokenId<'a> {
    pub biz: &'a str,
    pub token: &'a str,
    pub subject: &'a str,
}

/// A token row as read back: `subject`, `used_at`, `expires_at`, `keep_until`.
pub type TokenRow = (String, Option<i64>, i64, i64);

/// SQL of the token statements, the same in shape on every backend.
pub(crate) struct TokenQueries {
    pub insert: &'static str,
    pub consume: &'static str,
    pub read: &'static str,
    pub give_back: &'static str,
    pub purge_expired: &'static str,
}

/// Writes the token methods of [`RecordSql`], which differ only in SQL
/// text; each statement runs outside any call's transaction ([`on_pool!`]).
macro_rules! token_queries {
    ($q:expr) => {
        async fn token_insert(
            db: &$crate::store::Db<Self>,
            id: $crate::store::TokenId<'_>,
            now_ms: i64,
            expires_ms: i64,
        ) -> Result<bool, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                let done = pooling
                    .query($q.insert)
                    .bind(id.biz)
                    .bind(id.token)
                    .bind(id.subject)
                    .bind(now_ms)
                    .bind(expires_ms)
                    .bind(expires_ms)
                    .execute(on)
                    .await;
                $crate::store::inserted(done.map(|d| d.rows_affected()))
            })
        }

        async fn token_consume(
            db: &$crate::store::Db<Self>,
            id: $crate::store::TokenId<'_>,
            now_ms: i64,
            used_until_ms: i64,
        ) -> Result<bool, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                let done = pooling
                    .query($q.consume)
                    .bind(now_ms)
                    .bind(used_until_ms)
                    .bind(id.biz)
                    .bind(id.token)
                    .bind(id.subject)
                    .bind(now_ms)
                    .execute(on)
                    .await;
                done.map(|d| d.rows_affected() == 1)
            })
        }

        async fn token_read(
            db: &$crate::store::Db<Self>,
            biz: &str,
            token: &str,
        ) -> Result<Option<$crate::store::TokenRow>, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                pooling.query_as($q.read).bind(biz).bind(token).fetch_optional(on).await
            })
        }

        async fn token_give_back(
            db: &$crate::store::Db<Self>,
            id: $crate::store::TokenId<'_>,
            used_at_ms: i64,
        ) -> Result<bool, ::sqlx::Error> {
            $crate::store::on_pool!(db, |on, pooling| {
                let done = pooling
                    .query($q.give_back)
                    .bind(id.biz)
                    .bind(id.token)
                    .bind(id.subject)
                    .bind(used_at_ms)
                    .execute(on)
                    .await;
                done.map(|d| d.rows_affected() == 1)
            })
        }

        async fn token_purge_expired(
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
pub(crate) use token_queries;
