//! Behaviour of `#[idempotent]` on PostgreSQL (`IDEM_PG_URL`), with and
//! without Redis (`IDEM_REDIS_URL`): the shared suite, and what only
//! PostgreSQL does.

mod suite;

/// The backend the suite runs on here.
type SuiteBackend = idem_testkit::backend::Postgres;

use std::time::Duration;

use idem::{Idem, idempotent};
use idem_testkit::{pg_url, reach, unique};
use sqlx::Transaction;
use sqlx::postgres::PgPoolOptions;

use suite::Db;
use suite::fixture::TestError;

#[idempotent(key = "<k>", ttl = "1h", biz = "t_pg_lock_timeout")]
async fn lock_timeout_in_body(idem: &Idem<Db>, tx: &mut Transaction<'_, Db>, k: String) -> Result<String, TestError> {
    Ok(sqlx::query_scalar("SHOW lock_timeout").fetch_one(&mut **tx).await?)
}

/// Regression: the record's lock-wait bound is put back to the session's own
/// `lock_timeout` (not the server default) before the body runs.
#[tokio::test]
async fn the_body_sees_the_sessions_own_lock_timeout() {
    let Some(pool) = reach("postgres", || async {
        PgPoolOptions::new()
            .max_connections(1)
            .after_connect(|conn, _| {
                Box::pin(async move { sqlx::raw_sql("SET lock_timeout = '2s'").execute(conn).await.map(drop) })
            })
            .connect(&pg_url())
            .await
            .ok()
    })
    .await
    else {
        return;
    };
    let idem = Idem::builder(pool).lock_wait(Duration::from_millis(700)).build();
    idem.migrate().await.expect("migrate");
    assert_eq!(lock_timeout_in_body(&idem, unique("pglock")).await.unwrap(), "2s");
}
