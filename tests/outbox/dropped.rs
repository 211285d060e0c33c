//! A relay dropped while its batch's `BEGIN` is unanswered (the database's
//! replies held on a forwarder) gives its connection back outside a
//! transaction: the `BEGIN` is answered and rolled back on a task of its
//! own (`store/opening.rs`). Dropped half-way, sqlx gave the connection back
//! inside the transaction, to the pool the application's own statements use.

use idempotency_testkit::forwarder::{Forwarder, Hold};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::*;

/// Connections `pool` has lent out.
fn lent<DB: sqlx::Database>(pool: &Pool<DB>) -> u32 {
    pool.size() - pool.num_idle() as u32
}

/// Starts a relay on `idem` (over `pool`, through `link`) and lets it
/// publish one event (its first purge and batch done, replies flowing);
/// then holds the database's replies until its next batch's `BEGIN` is out,
/// drops the relay, lets the replies through, and waits for the
/// connection to come back.
async fn drop_the_relay_mid_begin<DB: Backend>(idem: &Idem<DB>, pool: &Pool<DB>, link: &Forwarder) {
    let recorder = Recorder::default();
    seed(idem, "dropped", None, "first").await;
    let relay = spawn_relay(Relay::new(idem, recorder.clone()).poll_interval(Duration::from_millis(20)));
    until("the first event published", Duration::from_secs(30), || async { !recorder.log().is_empty() }).await;
    until("the first batch's connection back", Duration::from_secs(30), || async { lent(pool) == 0 }).await;
    link.hold(Hold::Replies);
    // The next batch, a poll later: its `BEGIN` (the purge is not due).
    until("a connection lent for the batch's BEGIN", Duration::from_secs(30), || async { lent(pool) == 1 }).await;
    relay.1.abort();
    assert!(relay.1.await.expect_err("dropped").is_cancelled());
    link.hold(Hold::Nothing);
    until("the relay's connection back", Duration::from_secs(30), || async { lent(pool) == 0 }).await;
}

#[tokio::test]
async fn mysql_a_relay_dropped_mid_begin_gives_its_connection_back_outside_a_transaction() {
    let Some(fresh) = fresh_mysql().await else { return };
    let url = std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let direct: MySqlConnectOptions = url.parse().expect("url");
    let database: String = sqlx::query_scalar("SELECT DATABASE()").fetch_one(fresh.idem.pool()).await.expect("db");
    let link = Forwarder::start(direct.get_port()).await;
    // No ping before a connection is lent: the held reply is `BEGIN`'s.
    let options = direct.port(link.port()).database(&database);
    let pool =
        MySqlPoolOptions::new().max_connections(2).test_before_acquire(false).connect_with(options).await.unwrap();
    let idem = Idem::new(pool.clone());
    drop_the_relay_mid_begin(&idem, &pool, &link).await;

    let mut conns = Vec::new();
    for _ in 0..pool.size() {
        conns.push(pool.acquire().await.expect("a connection"));
    }
    for conn in &mut conns {
        let inside: i64 =
            sqlx::query_scalar("SELECT CAST(@@in_transaction AS SIGNED)").fetch_one(&mut **conn).await.unwrap();
        assert_eq!(inside, 0, "a connection came back inside a transaction");
    }
    drop((conns, idem, link));
    pool.close().await;
    fresh.drop_db().await;
}

#[tokio::test]
async fn postgres_a_relay_dropped_mid_begin_gives_its_connection_back_outside_a_transaction() {
    let Some(fresh) = fresh_postgres().await else { return };
    let url = std::env::var("IDEM_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let direct: PgConnectOptions = url.parse().expect("url");
    let schema: String =
        sqlx::query_scalar("SELECT current_schema()").fetch_one(fresh.idem.pool()).await.expect("schema");
    let link = Forwarder::start(direct.get_port()).await;
    let name = format!("idem_relay_{}", unique());
    let options = direct.port(link.port()).options([("search_path", schema.as_str())]).application_name(&name);
    let pool = PgPoolOptions::new().max_connections(2).test_before_acquire(false).connect_with(options).await.unwrap();
    let idem = Idem::new(pool.clone());
    drop_the_relay_mid_begin(&idem, &pool, &link).await;

    // This pool's sessions, as the server sees them (its own name).
    let sql = "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1 AND state LIKE 'idle in transaction%'";
    let inside: i64 = sqlx::query_scalar(sql).bind(&name).fetch_one(fresh.idem.pool()).await.unwrap();
    assert_eq!(inside, 0, "a connection came back inside a transaction");
    drop((idem, link));
    pool.close().await;
    fresh.drop_db().await;
}
