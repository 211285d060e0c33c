//! MariaDB/MySQL: the soak's tables and SQL, pools tagged by connection id,
//! the connection killer, and the annotated fns.

use std::sync::Arc;
use std::time::Duration;

use idem::{Idem, idempotent};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{AssertSqlSafe, Pool, Transaction};

use super::{BIZ, Ctx, PayFuture, Plan, Receipt, Rng, SoakBackend, SoakError, Tables, Tag, body};
use crate::backend::MySql;
use crate::{mysql_url, reach};

type Db = sqlx::MySql;

const DDL: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS soak_orders (run VARCHAR(100) NOT NULL, k VARCHAR(255) NOT NULL, \
     status VARCHAR(16) NOT NULL, paid INT NOT NULL DEFAULT 0, PRIMARY KEY (run, k))",
    "CREATE TABLE IF NOT EXISTS soak_payments (id BIGINT AUTO_INCREMENT PRIMARY KEY, run VARCHAR(100) NOT NULL, \
     k VARCHAR(255) NOT NULL, amount BIGINT NOT NULL, exec BIGINT NOT NULL, KEY (run, k))",
];
const PAY_ORDER: &str =
    "UPDATE soak_orders SET status = 'PAID', paid = paid + 1 WHERE run = ? AND k = ? AND status = 'PENDING'";
const INSERT_PAYMENT: &str = "INSERT INTO soak_payments (run, k, amount, exec) VALUES (?, ?, ?, ?) RETURNING id";
const SELECT_LEDGER: &str = "SELECT k, id, amount, exec FROM soak_payments WHERE run = ?";
const SELECT_RECORDS: &str =
    "SELECT idem_key, status, response FROM idem_record WHERE biz_type = ? AND idem_key LIKE ?";
const SELECT_ORDERS: &str = "SELECT k, status, paid FROM soak_orders WHERE run = ?";
const DELETE_LEDGER: &str = "DELETE FROM soak_payments WHERE run = ?";
const DELETE_ORDERS: &str = "DELETE FROM soak_orders WHERE run = ?";
const DELETE_RECORDS: &str = "DELETE FROM idem_record WHERE biz_type = ? AND idem_key LIKE ?";

/// `keys` pending orders `<run>.0 ..`, from MariaDB's sequence engine.
fn insert_orders(keys: usize) -> String {
    format!(
        "INSERT INTO soak_orders (run, k, status) SELECT ?, CONCAT(?, '.', seq), 'PENDING' FROM seq_0_to_{}",
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
    body::<MySql>(tx, &k, amount, ctx, plan).await
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
    body::<MySql>(tx, &k, amount, ctx, plan).await
}

impl SoakBackend for MySql {
    async fn create_tables(pool: &Pool<Db>) {
        for ddl in DDL {
            sqlx::raw_sql(ddl).execute(pool).await.expect("soak tables");
        }
    }

    /// Tagged: each connection's id goes into the tag.
    async fn open_tagged(tag: Option<Arc<Tag>>, size: u32) -> Option<Pool<Db>> {
        reach("mysql", || {
            let tag = tag.clone();
            async move {
                let mut options =
                    MySqlPoolOptions::new().max_connections(size).acquire_timeout(Duration::from_secs(60));
                if let Some(tag) = tag {
                    options = options.after_connect(move |conn, _| {
                        let tag = tag.clone();
                        Box::pin(async move {
                            let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()").fetch_one(&mut *conn).await?;
                            tag.ids.lock().unwrap().insert(id);
                            Ok(())
                        })
                    });
                }
                options.connect(&mysql_url()).await.ok()
            }
        })
        .await
    }

    /// `KILL`s one tagged connection with an open InnoDB transaction.
    async fn kill_one(admin: &Pool<Db>, tag: &Tag, rng: &mut Rng) -> bool {
        let Ok(busy) = sqlx::query_scalar::<_, u64>("SELECT trx_mysql_thread_id FROM information_schema.INNODB_TRX")
            .fetch_all(admin)
            .await
        else {
            return false;
        };
        let ours: Vec<u64> = {
            let ids = tag.ids.lock().unwrap();
            busy.into_iter().filter(|id| ids.contains(id)).collect()
        };
        if ours.is_empty() {
            return false;
        }
        let id = ours[rng.below(ours.len() as u64) as usize];
        sqlx::query(AssertSqlSafe(format!("KILL {id}"))).execute(admin).await.is_ok()
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
