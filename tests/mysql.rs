//! Behaviour of `#[idempotent]` on MySQL/MariaDB (`IDEM_MYSQL_URL`), with and
//! without Redis (`IDEM_REDIS_URL`).

mod common;

use sqlx::mysql::MySqlPoolOptions;

type Db = sqlx::MySql;

const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_test_ledger (
    id BIGINT AUTO_INCREMENT PRIMARY KEY, k VARCHAR(300) NOT NULL, amount BIGINT NOT NULL, KEY (k))";
const INSERT_LEDGER: &str = "INSERT INTO idem_test_ledger (k, amount) VALUES (?, ?)";
const COUNT_LEDGER: &str = "SELECT COUNT(*) FROM idem_test_ledger WHERE k = ?";
const COUNT_RECORDS: &str = "SELECT COUNT(*) FROM idem_record WHERE biz_type = ?";
const COUNT_RECORDS_KEY: &str = "SELECT COUNT(*) FROM idem_record WHERE biz_type = ? AND idem_key = ?";
/// Whether a duplicate's wait on the record is bounded by `lock_wait`.
const LOCK_WAIT_BOUNDED: bool = true;
const CORRUPT: &str = "UPDATE idem_record SET response = ? WHERE biz_type = ? AND idem_key = ?";

async fn open(_name: &str, max_connections: u32) -> Option<sqlx::Pool<Db>> {
    common::reach("mysql", || async {
        MySqlPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(std::time::Duration::from_secs(60))
            .connect(&common::mysql_url())
            .await
            .ok()
    })
    .await
}

/// A pool whose server never answers (nothing listens on port 1).
fn dead_pool() -> sqlx::Pool<Db> {
    MySqlPoolOptions::new()
        .acquire_timeout(std::time::Duration::from_secs(2))
        .connect_lazy("mysql://root@127.0.0.1:1/test")
        .expect("lazy pool")
}

async fn prepare(pool: &sqlx::Pool<Db>) {
    sqlx::raw_sql(LEDGER_DDL).execute(pool).await.expect("ledger table");
}

include!("suite/mod.rs");

/// Errors are classified by their server code, checked on real errors: a
/// duplicate key, a lock wait past its bound, a deadlock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_classified_by_code() {
    use idem::Backend;
    let Some(pool) = open("classify", 4).await else { return };
    let table = format!("idem_classify_{}", std::process::id());
    let table = table.as_str();
    let ddl = format!("CREATE TABLE IF NOT EXISTS {table} (id INT PRIMARY KEY, v INT NOT NULL)");
    sqlx::raw_sql(sqlx::AssertSqlSafe(ddl)).execute(&pool).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("INSERT IGNORE INTO {table} VALUES (1, 0), (2, 0)")))
        .execute(&pool)
        .await
        .unwrap();
    let class = |e: &sqlx::Error| format!("{:?}", <Db as Backend>::classify(e));

    let dup = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("INSERT INTO {table} VALUES (1, 0)")))
        .execute(&pool)
        .await
        .unwrap_err();
    assert_eq!(class(&dup), "Duplicate");

    let mut a = pool.begin().await.unwrap();
    let mut b = pool.begin().await.unwrap();
    let lock = |id: i32| sqlx::AssertSqlSafe(format!("UPDATE {table} SET v = v + 1 WHERE id = {id}"));
    sqlx::raw_sql(lock(1)).execute(&mut *a).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe("SET SESSION innodb_lock_wait_timeout = 1".to_string()))
        .execute(&mut *b)
        .await
        .unwrap();
    let waited = sqlx::raw_sql(lock(1)).execute(&mut *b).await.unwrap_err();
    assert_eq!(class(&waited), "LockTimeout");

    sqlx::raw_sql(sqlx::AssertSqlSafe("SET SESSION innodb_lock_wait_timeout = 50".to_string()))
        .execute(&mut *b)
        .await
        .unwrap();
    sqlx::raw_sql(lock(2)).execute(&mut *b).await.unwrap();
    let a_sql = lock(2);
    let a_waits = tokio::spawn(async move {
        let r = sqlx::raw_sql(a_sql).execute(&mut *a).await;
        (a, r)
    });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let b_result = sqlx::raw_sql(lock(1)).execute(&mut *b).await;
    let (a, a_result) = a_waits.await.unwrap();
    let deadlock = match (a_result, b_result) {
        (Err(e), _) | (_, Err(e)) => e,
        (Ok(_), Ok(_)) => panic!("no deadlock"),
    };
    assert_eq!(class(&deadlock), "Conflict");
    drop((a, b));
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}"))).execute(&pool).await.unwrap();
}
