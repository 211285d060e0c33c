//! Where the records are: the database named by `IDEM_DATABASE_URL` (and
//! Redis, by `IDEM_REDIS_URL`). Reads, lists and deletes go straight to
//! `idem_record` through sqlx's `Any` driver, with this file's SQL; `status`
//! and `purge` ask the engine itself.

use std::time::Duration;

use idem_runtime::{Backend, Idem, Namespace, Status};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, AssertSqlSafe, Row};

pub use crate::dialect::Dialect;

/// A failure that is not the user's typing: exit code 3.
pub type Failure = Box<dyn std::error::Error + Send + Sync>;

/// The database and the optional Redis.
pub struct Store {
    pub url: String,
    pub dialect: Dialect,
    pub pool: AnyPool,
    pub redis: Option<redis::Client>,
    namespace: Option<String>,
}

/// One row of `idem_record`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Record {
    pub id: i64,
    pub biz: String,
    pub key: String,
    pub biz_no: Option<String>,
    pub params_hash: String,
    pub state: &'static str,
    pub response: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
    pub expires_at: i64,
}

/// The columns [`Record::from_row`] reads, in order. `params_hash` is a
/// `CHAR(64)`, which the `Any` driver cannot read on PostgreSQL: as text.
fn columns(d: Dialect) -> String {
    let hash = d.as_text("params_hash");
    format!("id, biz_type, idem_key, biz_no, {hash}, status, response, created_at, updated_at, expires_at")
}

impl Record {
    fn from_row(row: &AnyRow) -> Result<Record, sqlx::Error> {
        let status: i64 = row.try_get(5)?;
        Ok(Record {
            id: row.try_get(0)?,
            biz: row.try_get::<String, _>(1)?.trim_end().to_owned(),
            key: row.try_get(2)?,
            biz_no: row.try_get(3)?,
            // CHAR(64): PostgreSQL pads nothing here (64 hex digits), but be safe.
            params_hash: row.try_get::<String, _>(4)?.trim_end().to_owned(),
            state: if status == 1 { "succeeded" } else { "processing" },
            response: row.try_get(6)?,
            created_at: row.try_get(7)?,
            updated_at: row.try_get(8)?,
            expires_at: row.try_get(9)?,
        })
    }
}

/// What `list` selects.
pub struct ListFilter<'a> {
    pub biz: &'a str,
    pub processing: Option<bool>,
    pub created_before: Option<i64>,
    pub limit: i64,
}

impl Store {
    pub async fn open(url: &str, redis_url: Option<&str>, namespace: Option<String>) -> Result<Store, Failure> {
        let dialect = Dialect::of(url)?;
        sqlx::any::install_default_drivers();
        let pool = AnyPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(10))
            .connect(url)
            .await
            .map_err(|e| format!("IDEM_DATABASE_URL: {e}"))?;
        let redis = redis_url.map(redis::Client::open).transpose().map_err(|e| format!("IDEM_REDIS_URL: {e}"))?;
        if let Some(ns) = &namespace {
            Namespace::new(ns).map_err(|e| format!("--namespace: {e}"))?;
        }
        Ok(Store { url: url.to_owned(), dialect, pool, redis, namespace })
    }

    /// The record of `(biz, key)`, expired or not.
    pub async fn record(&self, biz: &str, key: &str) -> Result<Option<Record>, Failure> {
        let d = self.dialect;
        let sql =
            format!("SELECT {} FROM idem_record WHERE biz_type = {} AND idem_key = {}", columns(d), d.arg(1), d.arg(2));
        let row = sqlx::query(AssertSqlSafe(sql)).bind(biz).bind(key).fetch_optional(&self.pool).await?;
        Ok(row.as_ref().map(Record::from_row).transpose()?)
    }

    /// Records of a `biz`, oldest first.
    pub async fn list(&self, filter: &ListFilter<'_>) -> Result<Vec<Record>, Failure> {
        let d = self.dialect;
        let mut sql = format!("SELECT {} FROM idem_record WHERE biz_type = {}", columns(d), d.arg(1));
        let mut n = 1;
        if filter.processing.is_some() {
            n += 1;
            sql += &format!(" AND status = {}", d.arg(n));
        }
        if filter.created_before.is_some() {
            n += 1;
            sql += &format!(" AND created_at <= {}", d.arg(n));
        }
        sql += &format!(" ORDER BY created_at, id LIMIT {}", d.arg(n + 1));
        let mut query = sqlx::query(AssertSqlSafe(sql)).bind(filter.biz);
        if let Some(processing) = filter.processing {
            query = query.bind(if processing { 0_i16 } else { 1_i16 });
        }
        if let Some(before) = filter.created_before {
            query = query.bind(before);
        }
        let rows = query.bind(filter.limit).fetch_all(&self.pool).await?;
        Ok(rows.iter().map(Record::from_row).collect::<Result<_, _>>()?)
    }

    /// Every record of a `biz`: `(key, biz_no, processing, created_at)`.
    pub async fn all_of(&self, biz: &str) -> Result<Vec<Record>, Failure> {
        let d = self.dialect;
        let sql = format!("SELECT {} FROM idem_record WHERE biz_type = {} ORDER BY id", columns(d), d.arg(1));
        let rows = sqlx::query(AssertSqlSafe(sql)).bind(biz).fetch_all(&self.pool).await?;
        Ok(rows.iter().map(Record::from_row).collect::<Result<_, _>>()?)
    }

    /// The distinct non-null values of `column` in `table`, as text. Both
    /// were checked and quoted ([`crate::ident`]).
    pub async fn values(
        &self,
        table: &crate::ident::Ident,
        column: &crate::ident::Ident,
    ) -> Result<Vec<String>, Failure> {
        let d = self.dialect;
        let (t, c) = (table.quoted(d), column.quoted(d));
        let sql = format!("SELECT DISTINCT {} FROM {t} WHERE {c} IS NOT NULL", d.as_text(&c));
        let rows = sqlx::query(AssertSqlSafe(sql)).fetch_all(&self.pool).await?;
        Ok(rows.iter().map(|r| r.try_get::<String, _>(0)).collect::<Result<_, _>>()?)
    }

    /// Deletes the record of `(biz, key)`; whether there was one.
    pub async fn delete(&self, biz: &str, key: &str) -> Result<bool, Failure> {
        let d = self.dialect;
        let sql = format!("DELETE FROM idem_record WHERE biz_type = {} AND idem_key = {}", d.arg(1), d.arg(2));
        let done = sqlx::query(AssertSqlSafe(sql)).bind(biz).bind(key).execute(&self.pool).await?;
        Ok(done.rows_affected() > 0)
    }

    /// The namespace of this store's Redis keys: `--namespace`, else the
    /// one `migrate` recorded in `idem_meta`.
    pub async fn namespace(&self) -> Result<Option<String>, Failure> {
        if let Some(ns) = &self.namespace {
            return Ok(Some(ns.clone()));
        }
        let sql = "SELECT value FROM idem_meta WHERE name = 'namespace'";
        Ok(sqlx::query_scalar::<_, String>(sql).fetch_optional(&self.pool).await?)
    }

    /// The Redis key of `(biz, key)`, when there is a Redis and a namespace.
    pub async fn redis_key(&self, biz: &str, key: &str) -> Result<Option<String>, Failure> {
        if self.redis.is_none() {
            return Ok(None);
        }
        Ok(self.namespace().await?.map(|ns| format!("idem:{ns}:{biz}:{key}")))
    }

    async fn redis_conn(&self) -> Result<redis::aio::MultiplexedConnection, Failure> {
        let client = self.redis.as_ref().ok_or("no Redis")?;
        let conn = tokio::time::timeout(Duration::from_secs(5), client.get_multiplexed_async_connection())
            .await
            .map_err(|_| "IDEM_REDIS_URL: no answer within 5 s")?
            .map_err(|e| format!("IDEM_REDIS_URL: {e}"))?;
        Ok(conn)
    }

    /// What Redis holds at `key`, and for how long (ms; -1 without expiry).
    pub async fn redis_get(&self, key: &str) -> Result<Option<(String, i64)>, Failure> {
        let mut conn = self.redis_conn().await?;
        let (value, ttl): (Option<String>, i64) =
            redis::pipe().cmd("GET").arg(key).cmd("PTTL").arg(key).query_async(&mut conn).await?;
        Ok(value.map(|v| (v, ttl)))
    }

    /// Deletes `key` in Redis; whether it existed.
    pub async fn redis_del(&self, key: &str) -> Result<bool, Failure> {
        let mut conn = self.redis_conn().await?;
        let n: i64 = redis::cmd("DEL").arg(key).query_async(&mut conn).await?;
        Ok(n > 0)
    }

    /// Where `(biz, key)` stands, as the engine sees it.
    pub async fn status(&self, biz: &str, key: &str) -> Result<Status, Failure> {
        let namespace = self.namespace.clone();
        let redis = self.redis.clone();
        let status = match self.dialect {
            Dialect::MySql => {
                let pool = sqlx::mysql::MySqlPoolOptions::new().max_connections(1).connect(&self.url).await?;
                engine(pool, redis, namespace)?.status(biz, key).await
            }
            Dialect::Postgres => {
                let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&self.url).await?;
                engine(pool, redis, namespace)?.status(biz, key).await
            }
            Dialect::Sqlite => {
                let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect(&self.url).await?;
                engine(pool, redis, namespace)?.status(biz, key).await
            }
        };
        Ok(status?)
    }

    /// Deletes expired records, `batch` at a time, until none is left; how many.
    pub async fn purge_expired(&self, batch: u32) -> Result<u64, Failure> {
        match self.dialect {
            Dialect::MySql => {
                let pool = sqlx::mysql::MySqlPoolOptions::new().max_connections(1).connect(&self.url).await?;
                purge(engine(pool, None, None)?, batch).await
            }
            Dialect::Postgres => {
                let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&self.url).await?;
                purge(engine(pool, None, None)?, batch).await
            }
            Dialect::Sqlite => {
                let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect(&self.url).await?;
                purge(engine(pool, None, None)?, batch).await
            }
        }
    }
}

fn engine<DB: Backend>(
    pool: sqlx::Pool<DB>,
    redis: Option<redis::Client>,
    namespace: Option<String>,
) -> Result<Idem<DB>, Failure> {
    let mut builder = Idem::builder(pool).lock_wait(Duration::from_secs(1));
    if let Some(client) = redis {
        builder = builder.redis(client);
    }
    if let Some(ns) = namespace {
        builder = builder.redis_namespace(Namespace::new(&ns)?);
    }
    Ok(builder.build())
}

async fn purge<DB: Backend>(idem: Idem<DB>, batch: u32) -> Result<u64, Failure> {
    let batch = batch.max(1);
    let mut total = 0;
    loop {
        let n = idem.purge_expired(batch).await?;
        total += n;
        if n < u64::from(batch) {
            return Ok(total);
        }
    }
}
