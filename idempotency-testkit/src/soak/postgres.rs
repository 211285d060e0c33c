//! PostgreSQL: the soak's tables and SQL, pools tagged by `application_name`,
//! and the connection killer.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Pool};

use super::statements::{SoakQueries, soak_statements};
use super::{Rng, SoakBackend, Tag};
use crate::backend::Postgres;
use crate::{pg_url, reach};

type Db = sqlx::Postgres;

const DDL: &str = "SELECT pg_advisory_xact_lock(7306232718293617);
    CREATE TABLE IF NOT EXISTS soak_orders (run VARCHAR(100) NOT NULL, k VARCHAR(255) NOT NULL,
        status VARCHAR(16) NOT NULL, paid INT NOT NULL DEFAULT 0, PRIMARY KEY (run, k));
    CREATE TABLE IF NOT EXISTS soak_payments (id BIGSERIAL PRIMARY KEY, run VARCHAR(100) NOT NULL,
        k VARCHAR(255) NOT NULL, amount BIGINT NOT NULL, exec BIGINT NOT NULL);
    CREATE INDEX IF NOT EXISTS soak_payments_run_k ON soak_payments (run, k);";

const Q: SoakQueries = SoakQueries {
    pay_order: "UPDATE soak_orders SET status = 'PAID', paid = paid + 1 WHERE run = $1 AND k = $2 AND status = 'PENDING'",
    insert_payment: "INSERT INTO soak_payments (run, k, amount, exec) VALUES ($1, $2, $3, $4) RETURNING id",
    select_ledger: "SELECT k, id, amount, exec FROM soak_payments WHERE run = $1",
    select_records: "SELECT idem_key, status, response FROM idem_record WHERE biz_type = $1 AND idem_key LIKE $2",
    select_orders: "SELECT k, status, paid FROM soak_orders WHERE run = $1",
    delete_ledger: "DELETE FROM soak_payments WHERE run = $1",
    delete_orders: "DELETE FROM soak_orders WHERE run = $1",
    delete_records: "DELETE FROM idem_record WHERE biz_type = $1 AND idem_key LIKE $2",
};

/// `keys` pending orders `<run>.0 ..`.
fn insert_orders(keys: usize) -> String {
    format!(
        "INSERT INTO soak_orders (run, k, status) SELECT $1, $2 || '.' || g, 'PENDING' FROM generate_series(0, {}) g",
        keys - 1
    )
}

impl SoakBackend for Postgres {
    async fn create_tables(pool: &Pool<Db>) {
        // One implicit transaction: the advisory lock covers the DDL.
        sqlx::raw_sql(DDL).execute(pool).await.expect("soak tables");
    }

    /// Tagged: its connections carry the tag's name as `application_name`.
    async fn open_tagged(tag: Option<Arc<Tag>>, size: u32) -> Option<Pool<Db>> {
        reach("postgres", || {
            let tag = tag.clone();
            async move {
                let mut options = PgConnectOptions::from_str(&pg_url()).ok()?;
                if let Some(tag) = &tag {
                    options = options.application_name(&tag.name);
                }
                PgPoolOptions::new()
                    .max_connections(size)
                    .acquire_timeout(Duration::from_secs(60))
                    .connect_with(options)
                    .await
                    .ok()
            }
        })
        .await
    }

    /// `pg_terminate_backend` on one tagged backend inside a transaction.
    async fn kill_one(admin: &Pool<Db>, tag: &Tag, _rng: &mut Rng) -> bool {
        let killed: Result<Option<bool>, _> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = $1 AND xact_start IS NOT NULL AND pid <> pg_backend_pid() \
             ORDER BY random() LIMIT 1",
        )
        .bind(&tag.name)
        .fetch_optional(admin)
        .await;
        matches!(killed, Ok(Some(true)))
    }

    async fn orders(pool: &Pool<Db>, run: &str, keys: usize) {
        sqlx::query(AssertSqlSafe(insert_orders(keys))).bind(run).bind(run).execute(pool).await.expect("insert orders");
    }

    soak_statements!(Q);
}
