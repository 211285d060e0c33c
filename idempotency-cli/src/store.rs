//! Where the records are: the database named by `IDEM_DATABASE_URL` (and
//! Redis, by `IDEM_REDIS_URL`, in `redis_store.rs`). Reads, lists and
//! deletes go straight to `idem_record` through sqlx's `Any` driver, with
//! this file's SQL; `status`, `purge` and `migrate` ask the engine itself.
//! Behind a pooler in transaction mode (`--transaction-pooler`), each
//! statement goes unnamed in a transaction of its own, and the engine is
//! told (`Builder::transaction_pooler`). Each backend is built only with
//! its feature ([`crate::drivers`]).

use std::time::{Duration, Instant};

use idempotency_runtime::{Backend, Builder, Idem, Status};
use sqlx::any::{AnyArguments, AnyPoolOptions, AnyRow};
use sqlx::{Any, AnyPool, AssertSqlSafe, Row};

use crate::Failure;
use crate::cli::Given;
pub use crate::dialect::Dialect;
use crate::redis_store::{Location, RedisStore};

/// How long opening the database may take. An unreachable server fails at
/// once ("connection refused"); one that does not answer fails after this,
/// not after sqlx's pool has retried for its own 10 or 30 s.
const CONNECT_WITHIN: Duration = Duration::from_secs(5);

/// The database and the optional Redis.
pub struct Store {
    /// The database URL, and where it came from (`--database-url` or
    /// `IDEM_DATABASE_URL`).
    pub url: Given,
    pub dialect: Dialect,
    pub pool: AnyPool,
    pub redis: Option<RedisStore>,
    namespace: Option<String>,
    /// The database's clock when the store opened, and this process's
    /// monotonic clock then: "expired" means what the engines mean by it.
    clock: (i64, Instant),
    /// PostgreSQL behind a pooler in transaction mode.
    pooler: bool,
}

/// Runs one statement of `$store` (made by [`Store::query`] or
/// [`Store::query_scalar`]): straight on the pool; behind a pooler in
/// transaction mode in a transaction of its own, so both of sqlx's
/// exchanges for an unnamed statement (Parse and Describe, then Bind and
/// Execute) meet one server connection. `$statement` is written once, on
/// the executor `$on`.
macro_rules! on_pool {
    ($store:expr, |$on:ident| $statement:expr) => {{
        let store: &Store = $store;
        if store.pooler {
            let mut tx = store.pool.begin().await?;
            let done = {
                let $on = &mut *tx;
                $statement
            };
            // A failed statement's transaction rolls back as it drops.
            if done.is_ok() {
                tx.commit().await?;
            }
            done
        } else {
            let $on = &store.pool;
            $statement
        }
    }};
}

// The one place the tool's prepared statements are made: behind a pooler
// in transaction mode each goes unnamed (a named one lives in a server
// connection the next transaction may not get). `sqlx::query` and its kin
// are refused everywhere else in this crate (`clippy.toml`), as in the
// engine's `store/pooling.rs`. `sqlx::raw_sql` (nothing prepared) needs no
// such care.
#[allow(clippy::disallowed_methods)]
impl Store {
    /// `sqlx::query` of SQL built from this file's constants and checked
    /// identifiers only, sent as the pooler allows.
    fn query<'q>(&self, sql: String) -> sqlx::query::Query<'q, Any, AnyArguments> {
        sqlx::query(AssertSqlSafe(sql)).persistent(!self.pooler)
    }

    /// `sqlx::query_scalar`, sent as the pooler allows.
    fn query_scalar<'q, O>(&self, sql: &'static str) -> sqlx::query::QueryScalar<'q, Any, O, AnyArguments>
    where
        (O,): for<'r> sqlx::FromRow<'r, sqlx::any::AnyRow>,
    {
        sqlx::query_scalar(sql).persistent(!self.pooler)
    }
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
/// A backend this build lacks was refused before the store opened.
macro_rules! with_engine {
    ($store:expr, $redis:expr, $namespace:expr, |$idem:ident| $use:expr) => {{
        let store: &Store = $store;
        let url = store.url.value.as_str();
        match store.dialect {
            #[cfg(feature = "mysql")]
            Dialect::MySql => {
                let pool = sqlx::mysql::MySqlPoolOptions::new().max_connections(1).acquire_timeout(CONNECT_WITHIN);
                let $idem = engine_builder(pool.connect(url).await?, $redis, $namespace)?.build();
                $use
            }
            #[cfg(feature = "postgres")]
            Dialect::Postgres => {
                let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).acquire_timeout(CONNECT_WITHIN);
                let builder = engine_builder(pool.connect(url).await?, $redis, $namespace)?;
                let $idem = builder.transaction_pooler(store.pooler).build();
                $use
            }
            #[cfg(feature = "sqlite")]
            Dialect::Sqlite => {
                let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).acquire_timeout(CONNECT_WITHIN);
                let $idem = engine_builder(pool.connect(url).await?, $redis, $namespace)?.build();
                $use
            }
            #[allow(unreachable_patterns)]
            other => return Err(crate::drivers::left_out(store.url.from, crate::drivers::feature(other)).into()),
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
    /// Opens the database of `url` (its driver is in this build: see
    /// [`crate::drivers::database`]) and keeps `redis` and `namespace`
    /// (checked already).
    pub async fn open(
        url: Given,
        dialect: Dialect,
        redis: Option<RedisStore>,
        namespace: Option<Given>,
        pooler: bool,
    ) -> Result<Store, Failure> {
        sqlx::any::install_default_drivers();
        reach(&url).await?;
        let pool = AnyPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(CONNECT_WITHIN)
            .connect(&url.value)
            .await
            .map_err(|e| format!("{}: {e}", url.from))?;
        let clock = (database_ms(&pool, dialect).await?, Instant::now());
        let namespace = namespace.map(|ns| ns.value);
        Ok(Store { url, dialect, pool, redis, namespace, pooler, clock })
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
        let row = on_pool!(self, |on| {
            let query = self.query(sql);
            query.bind(digest_hex(biz, key)).bind(biz).bind(key).fetch_optional(on).await
        });
        let row = self.idem_tables(row).await?;
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
        let rows = on_pool!(self, |on| {
            let mut query = self.query(sql).bind(filter.biz);
            if let Some(processing) = filter.processing {
                query = query.bind(if processing { 0_i16 } else { 1_i16 });
            }
            if let Some(before) = filter.created_before {
                query = query.bind(before);
            }
            query.bind(filter.limit).fetch_all(on).await
        });
        let rows = self.idem_tables(rows).await?;
        Ok(rows.iter().map(Record::from_row).collect::<Result<_, _>>()?)
    }

    /// Every record of a `biz`: `(key, biz_no, processing, created_at)`.
    pub async fn all_of(&self, biz: &str) -> Result<Vec<Record>, Failure> {
        let d = self.dialect;
        let sql = format!("SELECT {} FROM idem_record WHERE biz_type = {} ORDER BY id", columns(d), d.arg(1));
        let rows = on_pool!(self, |on| self.query(sql).bind(biz).fetch_all(on).await);
        let rows = self.idem_tables(rows).await?;
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
        let rows = on_pool!(self, |on| self.query(sql).fetch_all(on).await)?;
        Ok(rows.iter().map(|r| r.try_get::<String, _>(0)).collect::<Result<_, _>>()?)
    }

    /// Deletes the record of `(biz, key)`; whether there was one.
    pub async fn delete(&self, biz: &str, key: &str) -> Result<bool, Failure> {
        let d = self.dialect;
        let sql = format!("DELETE FROM idem_record WHERE {}", by_key(d));
        let done = on_pool!(self, |on| {
            let query = self.query(sql);
            query.bind(digest_hex(biz, key)).bind(biz).bind(key).execute(on).await
        });
        let done = self.idem_tables(done).await?;
        Ok(done.rows_affected() > 0)
    }

    /// The namespace of this store's Redis keys: `--namespace`, else the
    /// one `migrate` recorded in `idem_meta`.
    pub async fn namespace(&self) -> Result<Option<String>, Failure> {
        if let Some(ns) = &self.namespace {
            return Ok(Some(ns.clone()));
        }
        let sql = "SELECT value FROM idem_meta WHERE name = 'namespace'";
        let namespace = on_pool!(self, |on| self.query_scalar::<String>(sql).fetch_optional(on).await);
        self.idem_tables(namespace).await
    }

    /// Where `(biz, key)` lives in Redis, when there is a Redis and a namespace.
    pub async fn redis_location(&self, biz: &str, key: &str) -> Result<Option<Location>, Failure> {
        let Some(redis) = &self.redis else { return Ok(None) };
        let Some(ns) = self.namespace().await? else { return Ok(None) };
        Ok(Some(redis.locate(&ns, biz, key)?))
    }

    /// Where `(biz, key)` stands, as the engine sees it.
    pub async fn status(&self, biz: &str, key: &str) -> Result<Status, Failure> {
        let namespace = self.namespace.clone();
        let status = with_engine!(self, self.redis.as_ref(), namespace, |idem| idem.status(biz, key).await);
        self.idem_tables(status).await
    }

    /// Runs the engine's own `migrate`.
    pub async fn migrate(&self) -> Result<(), Failure> {
        Ok(with_engine!(self, None, None, |idem| idem.migrate().await)?)
    }

    /// How many records of each biz are expired now, by biz.
    pub async fn expired_by_biz(&self) -> Result<Vec<(String, i64)>, Failure> {
        let d = self.dialect;
        let sql = format!(
            "SELECT biz_type, COUNT(*) FROM idem_record WHERE expires_at <= {} GROUP BY biz_type ORDER BY biz_type",
            d.arg(1)
        );
        let now = self.now_ms();
        let rows = on_pool!(self, |on| self.query(sql).bind(now).fetch_all(on).await);
        let rows = self.idem_tables(rows).await?;
        let by_biz = |row: &AnyRow| Ok((row.try_get::<String, _>(0)?.trim_end().to_owned(), row.try_get(1)?));
        Ok(rows.iter().map(by_biz).collect::<Result<_, sqlx::Error>>()?)
    }

    /// Deletes expired records, `batch` at a time, until none is left; how many.
    pub async fn purge_expired(&self, batch: u32) -> Result<u64, Failure> {
        let purged = with_engine!(self, None, None, |idem| purge(idem, batch).await);
        self.idem_tables(purged).await
    }

    /// The outcome of statements on idem's own tables, with a failure
    /// because the database lacks them told as such: run `idem migrate`.
    /// Told by the error's code (MySQL 1146, PostgreSQL 42P01), never its
    /// text; SQLite has no code of its own for it, so its catalog is asked.
    async fn idem_tables<T, E: Into<Failure>>(&self, done: Result<T, E>) -> Result<T, Failure> {
        let failure = match done {
            Ok(value) => return Ok(value),
            Err(e) => e.into(),
        };
        let Some(error) = sqlx_error(&*failure) else { return Err(failure) };
        let missing = match self.dialect {
            Dialect::Sqlite => error.as_database_error().is_some() && !self.sqlite_has_idem_tables().await?,
            dialect => is_undefined_table(dialect, error),
        };
        if missing {
            return Err(format!(
                "{}: the database lacks idem's tables (idem_record, idem_meta): run `idem migrate` to create them, \
                 as an engine's Idem::migrate does at start-up (or check that the URL names the engines' database)",
                self.url.from
            )
            .into());
        }
        Err(failure)
    }

    /// Whether SQLite's catalog holds both of idem's tables the tool reads.
    async fn sqlite_has_idem_tables(&self) -> Result<bool, Failure> {
        let sql = "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name IN ('idem_record', 'idem_meta')";
        let n: i64 = self.query_scalar(sql).fetch_one(&self.pool).await?;
        Ok(n == 2)
    }
}

/// The sqlx error in `failure`'s chain (an engine's `Error::Storage` holds one).
fn sqlx_error<'a>(failure: &'a (dyn std::error::Error + 'static)) -> Option<&'a sqlx::Error> {
    let mut at = Some(failure);
    while let Some(error) = at {
        if let Some(found) = error.downcast_ref::<sqlx::Error>() {
            return Some(found);
        }
        at = error.source();
    }
    None
}

/// MySQL's `ER_NO_SUCH_TABLE`.
#[cfg(feature = "mysql")]
const MYSQL_NO_SUCH_TABLE: u16 = 1146;

/// Whether `error` is the server's "no such table", by its code.
fn is_undefined_table(dialect: Dialect, error: &sqlx::Error) -> bool {
    let Some(db) = error.as_database_error() else { return false };
    match dialect {
        #[cfg(feature = "mysql")]
        Dialect::MySql => {
            db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().is_some_and(|e| e.number() == MYSQL_NO_SUCH_TABLE)
        }
        Dialect::Postgres => db.code().as_deref() == Some("42P01"),
        _ => false,
    }
}

/// Connects once, within [`CONNECT_WITHIN`], to tell why a database cannot
/// be reached (connection refused, unknown host, authentication), naming
/// where its URL came from. A pool's own connect would retry until its
/// timeout and say only "pool timed out".
async fn reach(url: &Given) -> Result<(), Failure> {
    use sqlx::Connection;
    match tokio::time::timeout(CONNECT_WITHIN, sqlx::AnyConnection::connect(&url.value)).await {
        Err(_) => Err(format!(
            "{}: cannot connect to the database: no answer within {} s",
            url.from,
            CONNECT_WITHIN.as_secs()
        )
        .into()),
        Ok(Err(e)) => {
            let cause = match &e {
                sqlx::Error::Io(io) => io.to_string(),
                other => other.to_string(),
            };
            Err(format!("{}: cannot connect to the database: {cause}", url.from).into())
        }
        Ok(Ok(connection)) => {
            let _ = connection.close().await;
            Ok(())
        }
    }
}

fn engine_builder<DB: Backend>(
    pool: sqlx::Pool<DB>,
    redis: Option<&RedisStore>,
    namespace: Option<String>,
) -> Result<Builder<DB>, Failure> {
    let builder = Idem::builder(pool).lock_wait(Duration::from_secs(1));
    #[cfg(feature = "redis")]
    let builder = match redis {
        Some(redis) => {
            let builder = builder.redis(redis.client());
            match namespace {
                Some(ns) => builder.redis_namespace(idempotency_runtime::Namespace::new(&ns)?),
                None => builder,
            }
        }
        None => builder,
    };
    #[cfg(not(feature = "redis"))]
    let _ = (redis.map(|never| match *never {}), namespace);
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
