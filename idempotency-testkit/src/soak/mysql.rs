//! MariaDB/MySQL: the soak's tables and SQL, pools tagged by connection id,
//! and the connection killer.

use std::sync::Arc;
use std::time::Duration;

use sqlx::mysql::MySqlPoolOptions;
use sqlx::{AssertSqlSafe, Pool};

use super::statements::{SoakQueries, soak_statements};
use super::{Rng, SoakBackend, Tag};
use crate::backend::MySql;
use crate::{mysql_url, reach};

type Db = sqlx::MySql;

const DDL: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS soak_orders (run VARCHAR(100) NOT NULL, k VARCHAR(255) NOT NULL, \
     status VARCHAR(16) NOT NULL, paid INT NOT NULL DEFAULT 0, PRIMARY KEY (run, k))",
    "CREATE TABLE IF NOT EXISTS soak_payments (id BIGINT AUTO_INCREMENT PRIMARY KEY, run VARCHAR(100) NOT NULL, \
     k VARCHAR(255) NOT NULL, amount BIGINT NOT NULL, exec BIGINT NOT NULL, KEY (run, k))",
];

const Q: SoakQueries = SoakQueries {
    pay_order: "UPDATE soak_orders SET status = 'PAID', paid = paid + 1 WHERE run = ? AND k = ? AND status = 'PENDING'",
    insert_payment: "INSERT INTO soak_payments (run, k, amount, exec) VALUES (?, ?, ?, ?) RETURNING id",
    select_ledger: "SELECT k, id, amount, exec FROM soak_payments WHERE run = ?",
    select_records: "SELECT idem_key, status, response FROM idem_record WHERE biz_type = ? AND idem_key LIKE ?",
    select_orders: "SELECT k, status, paid FROM soak_orders WHERE run = ?",
    delete_ledger: "DELETE FROM soak_payments WHERE run = ?",
    delete_orders: "DELETE FROM soak_orders WHERE run = ?",
    delete_records: "DELETE FROM idem_record WHERE biz_type = ? AND idem_key LIKE ?",
};

/// `keys` pending orders `<run>.0 ..`, from MariaDB's sequence engine.
fn insert_orders(keys: usize) -> String {
    format!(
        "INSERT INTO soak_orders (run, k, status) SELECT ?, CONCAT(?, '.', seq), 'PENDING' FROM seq_0_to_{}",
        keys - 1
    )
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

    soak_statements!(Q);
}
