//! PostgreSQL (`IDEM_PG_URL`).

use std::str::FromStr;
use std::time::Duration;

use sqlx::Pool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::TestBackend;
use crate::{pg_url, reach};

/// PostgreSQL: the server's `test` database, private ones beside it.
pub struct Postgres;

const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_test_ledger (
    id BIGSERIAL PRIMARY KEY, k VARCHAR(300) NOT NULL, amount BIGINT NOT NULL)";

impl TestBackend for Postgres {
    type Db = sqlx::Postgres;

    const NAME: &'static str = "postgres";

    const INSERT_LEDGER: &'static str = "INSERT INTO idem_test_ledger (k, amount) VALUES ($1, $2)";
    const COUNT_LEDGER: &'static str = "SELECT COUNT(*) FROM idem_test_ledger WHERE k = $1";
    // By the unique digest, computed by the server from `(biz, key)`.
    const COUNT_RECORDS_KEY: &'static str = "SELECT COUNT(*) FROM idem_record WHERE key_digest = encode(substring(sha256(convert_to($1, 'UTF8') || decode('00', 'hex') || convert_to($2, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid";
    const DELETE_RECORD: &'static str = "DELETE FROM idem_record WHERE key_digest = encode(substring(sha256(convert_to($1, 'UTF8') || decode('00', 'hex') || convert_to($2, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid";
    const CORRUPT: &'static str = "UPDATE idem_record SET response = $1 WHERE key_digest = encode(substring(sha256(convert_to($2, 'UTF8') || decode('00', 'hex') || convert_to($3, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid";
    const BIZ_NO: &'static str = "SELECT biz_no FROM idem_record WHERE key_digest = encode(substring(sha256(convert_to($1, 'UTF8') || decode('00', 'hex') || convert_to($2, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid";
    const RECORD_TABLE_BEFORE_DIGEST: &'static str = "CREATE TABLE idem_record (
        id BIGSERIAL PRIMARY KEY,
        biz_type VARCHAR(32) NOT NULL,
        idem_key VARCHAR(255) NOT NULL,
        biz_no VARCHAR(64) NULL,
        params_hash CHAR(64) NOT NULL,
        status SMALLINT NOT NULL,
        response TEXT NULL,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL,
        expires_at BIGINT NOT NULL,
        CONSTRAINT uk_idem_record_biz_key UNIQUE (biz_type, idem_key)
    );
    CREATE INDEX idx_idem_record_biz_no ON idem_record (biz_type, biz_no);
    CREATE INDEX idx_idem_record_expires_at ON idem_record (expires_at)";
    const INSERT_RECORD_BEFORE_DIGEST: &'static str = "INSERT INTO idem_record (biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)";
    const RECORD_UNIQUE_INDEXES: &'static str = "SELECT string_agg(a.attname::text, ',' ORDER BY k.ord) FROM pg_index i \
        CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord) \
        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
        WHERE i.indrelid = 'idem_record'::regclass AND i.indisunique AND NOT i.indisprimary GROUP BY i.indexrelid";
    /// Under an advisory lock: concurrent `CREATE TABLE IF NOT EXISTS` can
    /// collide in the catalog.
    const LOCKABLE_ROWS_DDL: &'static str = "SELECT pg_advisory_xact_lock(7306232718293614); CREATE TABLE IF NOT EXISTS idem_classify (id INT PRIMARY KEY, v INT NOT NULL); INSERT INTO idem_classify VALUES (1, 0), (2, 0) ON CONFLICT DO NOTHING";

    const LOCK_WAIT_BOUNDED: bool = true;
    const ONE_WRITER: bool = false;

    async fn open(_name: &str, max_connections: u32) -> Option<Pool<sqlx::Postgres>> {
        reach(Self::NAME, || async {
            PgPoolOptions::new()
                .max_connections(max_connections)
                .acquire_timeout(Duration::from_secs(60))
                .connect(&pg_url())
                .await
                .ok()
        })
        .await
    }

    async fn open_private(name: &str, max_connections: u32) -> Option<Pool<sqlx::Postgres>> {
        let admin = Self::open(name, 1).await?;
        let create = sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"));
        sqlx::raw_sql(create).execute(&admin).await.expect("create database");
        admin.close().await;
        let options = PgConnectOptions::from_str(&pg_url()).expect("postgres url").database(name);
        Some(
            PgPoolOptions::new()
                .max_connections(max_connections)
                .connect_with(options)
                .await
                .expect("private database"),
        )
    }

    async fn drop_private(pool: Pool<sqlx::Postgres>, name: &str) {
        pool.close().await;
        let admin = Self::open(name, 1).await.expect("postgres");
        let drop = sqlx::AssertSqlSafe(format!("DROP DATABASE {name} WITH (FORCE)"));
        sqlx::raw_sql(drop).execute(&admin).await.expect("drop database");
    }

    /// Nothing listens on port 1.
    fn dead_pool() -> Pool<sqlx::Postgres> {
        PgPoolOptions::new()
            .acquire_timeout(Duration::from_secs(2))
            .connect_lazy("postgres://postgres@127.0.0.1:1/test")
            .expect("lazy pool")
    }

    async fn prepare(pool: &Pool<sqlx::Postgres>) {
        // Concurrent CREATE TABLE IF NOT EXISTS can collide in the catalog.
        let mut tx = pool.begin().await.expect("begin");
        sqlx::query("SELECT pg_advisory_xact_lock(7306232718293612)").execute(&mut *tx).await.expect("lock");
        sqlx::raw_sql(LEDGER_DDL).execute(&mut *tx).await.expect("ledger table");
        tx.commit().await.expect("commit");
    }
}
