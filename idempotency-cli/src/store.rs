//! Where the records are: the database named by `IDEM_DATABASE_URL` (and
//! Redis, by `IDEM_REDIS_URL`). Reads, lists and deletes go straight to
//! `idem_record` through sqlx's `Any` driver, with this file's SQL; `status`
//! and `purge` ask the engine itself. Behind a pooler in transaction mode
//! (`--transaction-pooler`), each statement goes unnamed in a transaction of
//! its own, and the engine is told (`Builder::transaction_pooler`).

use std::time::{Duration, Instant};

use idempotency_runtime::redis_layout::Location;
use idempotency_runtime::{Backend, Builder, Idem, Namespace, Status};
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
    /// The database's clock when the store opened, and this process's
    /// monotonic clock then: "expired" means what the engines mean by it.
    clock: (i64, Instant),
    /// PostgreSQL behind a pooler in transaction mode.
    pooler: bool,
}

/// Runs one statement of `$store`: straight on the pool; behind a pooler in
/// transaction mode unnamed (`.persistent($persistent)`) and in a
/// transaction of its own, so both of sqlx's exchanges (Parse and Describe,
/// then Bind and Execute) meet one server connection. `$statement` is
/// written once, on the executor `$on`.
macro_rules! on_pool {
    ($store:expr, |$on:ident, $persistent:ident| $statement:expr) => {{
        let store: &Store = $store;
        if store.pooler {
            let mut tx = store.pool.begin().await?;
            let done = {
                let ($on, $persistent) = (&mut *tx, false);
                $statement
            };
            // A failed statement's transaction rolls back as it drops.
            if done.is_ok() {
                tx.commit().await?;
            }
            done
        } else {
            let ($on, $persistent) = (&store.pool, true);
            $statement
        }
    }};
}

/// The row of one key, found as the engines find it: by the unique
/// `key_digest`, checked against the full key (binds: the digest in hex,
/// `biz`, `key`).
fn by_key(d: Dialect) -> String {
    format!("key_digest = {} AND biz_type = {} AND idem_key = {}", d.digest_arg(1), d.arg(2), d.arg(3))
}

fn digest_hex(biz: &str, key: &str) -> String {
    idempotency_runtime::key::key_digest(biz, key).iter().map(|b| format!("{b:02x}")).collect()
}

/// Runs `$use` on an engine over one connection to `$store`'s database,
/// with `$redis` and `$namespace` (told about the pooler on PostgreSQL):
/// `$use` is written once, on the engine `$idem`, whatever the backend.
macro_rules! with_engine {
    ($store:expr, $redis:expr, $namespace:expr, |$idem:ident| $use:expr) => {{
        let store: &Store = $store;
        match store.dialect {
            Dialect::MySql => {
                let pool = sqlx::mysql::MySqlPoolOptions::new().max_connections(1).connect(&store.url).await?;
                let $idem = engine_builder(pool, $redis, $namespace)?.build();
                $use
            }
            Dialect::Postgres => {
                let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&store.url).await?;
                let $idem = store.postgres(engine_builder(pool, $redis, $namespace)?).build();
                $use
            }
            Dialect::Sqlite => {
                let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect(&store.url).await?;
                let $idem = engine_builder(pool, $redis, $namespace)?.build();
                $use
            }
        }
    }};
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

/// The database's clock in Unix epoch milliseconds (SQLite's is this
/// host's), read as the engines read it.
async fn database_ms(pool: &AnyPool, dialect: Dialect) -> Result<i64, Failure> {
    let sql = match dialect {
        Dialect::MySql => "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000",
        Dialect::Postgres => "SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT",
        Dialect::Sqlite => return Ok(crate::time::host_ms()),
    };
    let row = sqlx::raw_sql(sql).fetch_one(pool).await?;
    Ok(row.try_get::<i64, _>(0)?)
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
    pub async fn open(
        url: &str,
        redis_url: Option<&str>,
        namespace: Option<String>,
        pooler: bool,
    ) -> Result<Store, Failure> {
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
        let clock = (database_ms(&pool, dialect).await?, Instant::now());
        Ok(Store { url: url.to_owned(), dialect, pool, redis, namespace, pooler, clock })
    }

    /// Now on the database's clock, in Unix epoch milliseconds: the clock
    /// the engines stamp and judge expiry by, whatever this host's says.
    pub fn now_ms(&self) -> i64 {
        let elapsed = i64::try_from(self.clock.1.elapsed().as_millis()).unwrap_or(i64::MAX);
        self.clock.0.saturating_add(elapsed)
    }

    /// The record of `(biz, key)`, expired or not.
    pub async fn record(&self, biz: &str, key: &str) -> Result<Option<Record>, Failure> {
        let d = self.dialect;
        let sql = format!("SELECT {} FROM idem_record WHERE {}", columns(d), by_key(d));
        let row = on_pool!(self, |on, persistent| {
            let query = sqlx::query(AssertSqlSafe(sql)).persistent(persistent);
            query.bind(digest_hex(biz, key)).bind(biz).bind(key).fetch_optional(on).await
        })?;
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
        let rows = on_pool!(self, |on, persistent| {
            let mut query = sqlx::query(AssertSqlSafe(sql)).persistent(persistent).bind(filter.biz);
            if let Some(processing) = filter.processing {
                query = query.bind(if processing { 0_i16 } else { 1_i16 });
            }
            if let Some(before) = filter.created_before {
                query = query.bind(before);
            }
            query.bind(filter.limit).fetch_all(on).await
        })?;
        Ok(rows.iter().map(Record::from_row).collect::<Result<_, _>>()?)
    }

    /// Every record of a `biz`: `(key, biz_no, processing, created_at)`.
    pub async fn all_of(&self, biz: &str) -> Result<Vec<Record>, Failure> {
        let d = self.dialect;
        let sql = format!("SELECT {} FROM idem_record WHERE biz_type = {} ORDER BY id", columns(d), d.arg(1));
        let rows = on_pool!(self, |on, persistent| {
            sqlx::query(AssertSqlSafe(sql)).persistent(persistent).bind(biz).fetch_all(on).await
        })?;
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
        let rows = on_pool!(self, |on, persistent| sqlx::query(AssertSqlSafe(sql))
            .persistent(persistent)
            .fetch_all(on)
            .await)?;
        Ok(rows.iter().map(|r| r.try_get::<String, _>(0)).collect::<Result<_, _>>()?)
    }

    /// Deletes the record of `(biz, key)`; whether there was one.
    pub async fn delete(&self, biz: &str, key: &str) -> Result<bool, Failure> {
        let d = self.dialect;
        let sql = format!("DELETE FROM idem_record WHERE {}", by_key(d));
        let done = on_pool!(self, |on, persistent| {
            let query = sqlx::query(AssertSqlSafe(sql)).persistent(persistent);
            query.bind(digest_hex(biz, key)).bind(biz).bind(key).execute(on).await
        })?;
        Ok(done.rows_affected() > 0)
    }

    /// The namespace of this store's Redis keys: `--namespace`, else the
    /// one `migrate` recorded in `idem_meta`.
    pub async fn namespace(&self) -> Result<Option<String>, Failure> {
        if let Some(ns) = &self.namespace {
            return Ok(Some(ns.clone()));
        }
        let sql = "SELECT value FROM idem_meta WHERE name = 'namespace'";
        Ok(on_pool!(self, |on, persistent| {
            sqlx::query_scalar::<_, String>(sql).persistent(persistent).fetch_optional(on).await
        })?)
    }

    /// Where `(biz, key)` lives in Redis, when there is a Redis and a namespace.
    pub async fn redis_location(&self, biz: &str, key: &str) -> Result<Option<Location>, Failure> {
        if self.redis.is_none() {
            return Ok(None);
        }
        let Some(ns) = self.namespace().await? else { return Ok(None) };
        Ok(Some(idempotency_runtime::redis_layout::locate(&ns, biz, key).map_err(|e| format!("namespace: {e}"))?))
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
    pub async fn redis_get(&self, key: &str) -> Result<Option<(Vec<u8>, i64)>, Failure> {
        let mut conn = self.redis_conn().await?;
        let (value, ttl): (Option<Vec<u8>>, i64) =
            redis::pipe().cmd("GET").arg(key).cmd("PTTL").arg(key).query_async(&mut conn).await?;
        Ok(value.map(|v| (v, ttl)))
    }

    /// The result hashes that hold a cached result of `at`, with its bytes.
    /// The hashes of one shard are few (two windows live at a time), and so
    /// are the keys a `SCAN` walks: results share hashes.
    pub async fn redis_results(&self, at: &Location) -> Result<Vec<(String, Vec<u8>)>, Failure> {
        let mut conn = self.redis_conn().await?;
        let (mut cursor, mut found) = (0u64, Vec::new());
        loop {
            let (next, hashes): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}*", at.results_prefix))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await?;
            for hash in hashes {
                let value: Option<Vec<u8>> =
                    redis::cmd("HGET").arg(&hash).arg(&at.field[..]).query_async(&mut conn).await?;
                found.extend(value.map(|v| (hash, v)));
            }
            if next == 0 {
                return Ok(found);
            }
            cursor = next;
        }
    }

    /// Deletes `key` in Redis; whether it existed.
    pub async fn redis_del(&self, key: &str) -> Result<bool, Failure> {
        let mut conn = self.redis_conn().await?;
        let n: i64 = redis::cmd("DEL").arg(key).query_async(&mut conn).await?;
        Ok(n > 0)
    }

    /// Deletes `at`'s cached result from `hash`; whether it was there.
    pub async fn redis_hdel(&self, hash: &str, at: &Location) -> Result<bool, Failure> {
        let mut conn = self.redis_conn().await?;
        let n: i64 = redis::cmd("HDEL").arg(hash).arg(&at.field[..]).query_async(&mut conn).await?;
        Ok(n > 0)
    }

    /// Where `(biz, key)` stands, as the engine sees it.
    pub async fn status(&self, biz: &str, key: &str) -> Result<Status, Failure> {
        let (redis, namespace) = (self.redis.clone(), self.namespace.clone());
        Ok(with_engine!(self, redis, namespace, |idem| idem.status(biz, key).await)?)
    }

    /// A PostgreSQL engine's builder, told about the pooler.
    fn postgres(&self, builder: Builder<sqlx::Postgres>) -> Builder<sqlx::Postgres> {
        builder.transaction_pooler(self.pooler)
    }

    /// Runs the engine's own `migrate`.
    pub async fn migrate(&self) -> Result<(), Failure> {
        Ok(with_engine!(self, None, None, |idem| idem.migrate().await)?)
    }

    /// Deletes expired records, `batch` at a time, until none is left; how many.
    pub async fn purge_expired(&self, batch: u32) -> Result<u64, Failure> {
        with_engine!(self, None, None, |idem| purge(idem, batch).await)
    }
}

fn engine_builder<DB: Backend>(
    pool: sqlx::Pool<DB>,
    redis: Option<redis::Client>,
    namespace: Option<String>,
) -> Result<Builder<DB>, Failure> {
    let mut builder = Idem::builder(pool).lock_wait(Duration::from_secs(1));
    if let Some(client) = redis {
        builder = builder.redis(client);
    }
    if let Some(ns) = namespace {
        builder = builder.redis_namespace(Namespace::new(&ns)?);
    }
    Ok(builder)
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
