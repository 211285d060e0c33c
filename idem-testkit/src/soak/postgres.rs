//! PostgreSQL: the soak's tables and SQL, pools tagged by `application_name`,
//! the connection killer, and the annotated fns.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use idem::{Idem, idempotent};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Pool, Transaction};

use super::{BIZ, Ctx, PayFuture, Plan, Receipt, Rng, SoakBackend, SoakError, Tables, Tag, body};
use crate::backend::Postgres;
use crate::{pg_url, reach};

type Db = sqlx::Postgres;

const DDL: &str = "SELECT pg_advisory_xact_lock(7306232718293617);
    CREATE TABLE IF NOT EXISTS soak_orders (run VARCHAR(100) NOT NULL, k VARCHAR(255) NOT NULL,
        status VARCHAR(16) NOT NULL, paid INT NOT NULL DEFAULT 0, PRIMARY KEY (run, k));
    CREATE TABLE IF NOT EXISTS soak_payments (id BIGSERIAL PRIMARY KEY, run VARCHAR(100) NOT NULL,
        k VARCHAR(255) NOT NULL, amount BIGINT NOT NULL, exec BIGINT NOT NULL);
    CREATE INDEX IF NOT EXISTS soak_payments_run_k ON soak_payments (run, k);";
const PAY_ORDER: &str =
    "UPDATE soak_orders SET status = 'PAID', paid = paid + 1 WHERE run = $1 AND k = $2 AND status = 'PENDING'";
const INSERT_PAYMENT: &str = "INSERT INTO soak_payments (run, k, amount, exec) VALUES ($1, $2, $3, $4) RETURNING id";
const SELECT_LEDGER: &str = "SELECT k, id, amount, exec FROM soak_payments WHERE run = $1";
const SELECT_RECORDS: &str =
    "SELECT idem_key, status, response FROM idem_record WHERE biz_type = $1 AND idem_key LIKE $2";
const SELECT_ORDERS: &str = "SELECT k, status, paid FROM soak_orders WHERE run = $1";
const DELETE_LEDGER: &str = "DELETE FROM soak_payments WHERE run = $1";
const DELETE_ORDERS: &str = "DELETE FROM soak_orders WHERE run = $1";
const DELETE_RECORDS: &str = "DELETE FROM idem_record WHERE biz_type = $1 AND idem_key LIKE $2";

/// `keys` pending orders `<run>.0 ..`.
fn insert_orders(keys: usize) -> String {
    format!(
        "INSERT INTO soak_orders (run, k, status) SELECT $1, $2 || '.' || g, 'PENDING' FROM generate_series(0, {}) g",
        keys - 1
    )
}

#[idempotent(key = "<k>", ttl = "1h", biz = "soak_pay")]
async fn pay(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    #[idem(skip)] ctx: &Ctx,
    #[idem(skip)] plan: Plan,
) -> Result<Receipt, SoakError> {
    body::<Postgres>(tx, &k, amount, ctx, plan).await
}

#[idempotent(key = "<k>", ttl = "1h", biz = "soak_pay", lease = "50ms")]
async fn pay_short_lease(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    #[idem(skip)] ctx: &Ctx,
    #[idem(skip)] plan: Plan,
) -> Result<Receipt, SoakError> {
    body::<Postgres>(tx, &k, amount, ctx, plan).await
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

    async fn tables(pool: &Pool<Db>, run: &str) -> Tables {
        let like = format!("{run}.%");
        Tables {
            ledger: sqlx::query_as(SELECT_LEDGER).bind(run).fetch_all(pool).await.expect("ledger"),
            records: sqlx::query_as(SELECT_RECORDS).bind(BIZ).bind(&like).fetch_all(pool).await.expect("records"),
            orders: sqlx::query_as(SELECT_ORDERS).bind(run).fetch_all(pool).await.expect("orders"),
        }
    }

    async fn cleanup(pool: &Pool<Db>, run: &str) {
        let like = format!("{run}.%");
        sqlx::query(DELETE_LEDGER).bind(run).execute(pool).await.expect("delete ledger");
        sqlx::query(DELETE_ORDERS).bind(run).execute(pool).await.expect("delete orders");
        sqlx::query(DELETE_RECORDS).bind(BIZ).bind(&like).execute(pool).await.expect("delete records");
    }

    async fn pay_order(tx: &mut Transaction<'_, Db>, run: &str, k: &str) -> Result<bool, sqlx::Error> {
        Ok(sqlx::query(PAY_ORDER).bind(run).bind(k).execute(&mut **tx).await?.rows_affected() == 1)
    }

    async fn insert_payment(
        tx: &mut Transaction<'_, Db>,
        run: &str,
        k: &str,
        amount: i64,
        exec: i64,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(INSERT_PAYMENT).bind(run).bind(k).bind(amount).bind(exec).fetch_one(&mut **tx).await
    }

    fn pay<'a>(idem: &'a Idem<Db>, k: String, amount: i64, ctx: &'a Ctx, plan: Plan) -> PayFuture<'a> {
        if plan.short_lease {
            Box::pin(pay_short_lease(idem, k, amount, ctx, plan))
        } else {
            Box::pin(pay(idem, k, amount, ctx, plan))
        }
    }
}
