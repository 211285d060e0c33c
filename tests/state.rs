//! Layer 4, state transitions, on SQLite, MariaDB and PostgreSQL: every
//! answer, 100 concurrent advances of one row, a cancel and a refund racing
//! a payment, and the layer alone stopping a double payment when the key
//! layer is misconfigured.

use std::sync::Arc;
use std::time::Duration;

use idempotency::state::{Advanced, advance};
use idempotency::{Idem, col, idempotent, transition};
use serde::{Deserialize, Serialize};
use tokio::sync::Barrier;

/// Text storage: `'PENDING'`, `'PAID'`, ...
#[derive(Clone, Copy, Debug, PartialEq, Eq, idempotency::State)]
#[state(table = "idem_test_orders", id = "id", column = "status")]
#[state(transitions(Pending -> Paid, Paid -> Refunded, Pending -> Closed))]
enum OrderStatus {
    Pending,
    Paid,
    Refunded,
    Closed,
}

/// Integer storage (`SMALLINT`), with a renamed table column.
#[derive(Clone, Copy, Debug, PartialEq, Eq, idempotency::State)]
#[state(table = "idem_test_tickets", id = "ticket_id", column = "state", storage = "int")]
#[state(transitions(Open -> Done))]
enum TicketState {
    Open = 0,
    Done = 7,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Payment {
    order_id: i64,
    /// Whether this call moved the order to `Paid` (and wrote the ledger row).
    paid_now: bool,
}

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug in assertion messages
enum PayError {
    Idem(idempotency::Error),
    Db(sqlx::Error),
    Conflict(OrderStatus),
    NotFound,
}

impl From<idempotency::Error> for PayError {
    fn from(e: idempotency::Error) -> Self {
        PayError::Idem(e)
    }
}

impl From<sqlx::Error> for PayError {
    fn from(e: sqlx::Error) -> Self {
        PayError::Db(e)
    }
}

fn services_required() -> bool {
    std::env::var("IDEM_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

fn unique() -> i64 {
    use std::sync::atomic::{AtomicI64, Ordering};
    static NEXT: AtomicI64 = AtomicI64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    // Distinct across processes and runs: time in the high digits.
    i64::try_from(nanos % 1_000_000_000_000).unwrap() * 1000 + NEXT.fetch_add(1, Ordering::Relaxed) % 1000
}

macro_rules! state_suite {
    ($backend:ident, $db:ty, $ph:literal, $connect:expr, $ddl:expr) => {
        mod $backend {
            use super::*;

            type Db = $db;

            /// `?` or `$n`.
            fn sql(text: &str) -> String {
                if $ph == "$" {
                    let mut n = 0;
                    text.chars()
                        .map(|c| {
                            if c == '?' {
                                n += 1;
                                format!("${n}")
                            } else {
                                c.to_string()
                            }
                        })
                        .collect()
                } else {
                    text.to_owned()
                }
            }

            async fn pool() -> Option<sqlx::Pool<Db>> {
                let connect: fn() -> _ = $connect;
                match connect().await {
                    Ok(pool) => {
                        for ddl in $ddl {
                            sqlx::raw_sql(ddl).execute(&pool).await.expect("ddl");
                        }
                        Some(pool)
                    }
                    Err(e) => {
                        assert!(!services_required(), "{} unreachable: {e}", stringify!($backend));
                        println!("skipped: {} unreachable ({e})", stringify!($backend));
                        None
                    }
                }
            }

            async fn new_order(pool: &sqlx::Pool<Db>) -> i64 {
                let id = unique();
                sqlx::query(sqlx::AssertSqlSafe(sql("INSERT INTO idem_test_orders (id, status) VALUES (?, 'PENDING')")))
                    .bind(id)
                    .execute(pool)
                    .await
                    .expect("order");
                id
            }

            async fn status_of(pool: &sqlx::Pool<Db>, id: i64) -> (String, Option<i64>) {
                sqlx::query_as(sqlx::AssertSqlSafe(sql("SELECT status, paid_at FROM idem_test_orders WHERE id = ?")))
                    .bind(id)
                    .fetch_one(pool)
                    .await
                    .expect("status")
            }

            async fn ledger_rows(pool: &sqlx::Pool<Db>, id: i64) -> i64 {
                sqlx::query_scalar(sqlx::AssertSqlSafe(sql("SELECT COUNT(*) FROM idem_test_payments WHERE order_id = ?")))
                    .bind(id)
                    .fetch_one(pool)
                    .await
                    .expect("ledger")
            }

            async fn pay_once(pool: &sqlx::Pool<Db>, id: i64) -> Advanced<OrderStatus> {
                let mut tx = pool.begin().await.expect("begin");
                let answer = advance(transition!(OrderStatus: Pending -> Paid))
                    .set(col!(paid_at), 1_000_i64)
                    .run(&mut *tx, id)
                    .await
                    .expect("advance");
                tx.commit().await.expect("commit");
                answer
            }

            #[tokio::test]
            async fn every_answer() {
                let Some(pool) = pool().await else { return };
                let id = new_order(&pool).await;
                let mut conn = pool.acquire().await.unwrap();

                let paid = advance(transition!(OrderStatus: Pending -> Paid)).set(col!(paid_at), 1_000_i64);
                assert_eq!(paid.run(&mut *conn, id).await.unwrap(), Advanced::Applied);
                assert_eq!(status_of(&pool, id).await, ("PAID".to_owned(), Some(1_000)));

                // Again, with another value to set: already done, nothing written.
                let again = advance(transition!(OrderStatus: Pending -> Paid)).set(col!(paid_at), 2_000_i64);
                assert_eq!(again.run(&mut *conn, id).await.unwrap(), Advanced::AlreadyThere);
                assert_eq!(status_of(&pool, id).await, ("PAID".to_owned(), Some(1_000)));

                let close = advance(transition!(OrderStatus: Pending -> Closed));
                assert_eq!(close.run(&mut *conn, id).await.unwrap(), Advanced::Conflict { current: OrderStatus::Paid });
                assert_eq!(status_of(&pool, id).await.0, "PAID");

                let refund = advance(transition!(OrderStatus: Paid -> Refunded));
                assert_eq!(refund.run(&mut *conn, id).await.unwrap(), Advanced::Applied);
                assert_eq!(status_of(&pool, id).await.0, "REFUNDED");

                let missing = advance(transition!(OrderStatus: Pending -> Paid));
                assert_eq!(missing.run(&mut *conn, unique()).await.unwrap(), Advanced::NotFound);

                // A stored value that is no state of the type: a typed error, nothing written.
                let odd = new_order(&pool).await;
                sqlx::query(sqlx::AssertSqlSafe(sql("UPDATE idem_test_orders SET status = 'SHIPPED' WHERE id = ?")))
                    .bind(odd)
                    .execute(&pool)
                    .await
                    .unwrap();
                let err = advance(transition!(OrderStatus: Pending -> Paid)).run(&mut *conn, odd).await.unwrap_err();
                let shown = err.to_string();
                assert!(matches!(err, sqlx::Error::Decode(_)), "{err:?}");
                assert!(shown.contains("\"SHIPPED\"") && shown.contains("OrderStatus"), "{shown}");
                assert_eq!(status_of(&pool, odd).await, ("SHIPPED".to_owned(), None));
            }

            #[tokio::test]
            async fn states_stored_as_small_integers() {
                let Some(pool) = pool().await else { return };
                let id = unique();
                sqlx::query(sqlx::AssertSqlSafe(sql("INSERT INTO idem_test_tickets (ticket_id, state) VALUES (?, 0)")))
                    .bind(id)
                    .execute(&pool)
                    .await
                    .unwrap();
                let mut conn = pool.acquire().await.unwrap();
                let done = || advance(transition!(TicketState: Open -> Done));
                assert_eq!(done().run(&mut *conn, id).await.unwrap(), Advanced::Applied);
                assert_eq!(done().run(&mut *conn, id).await.unwrap(), Advanced::AlreadyThere);
                let stored: i16 =
                    sqlx::query_scalar(sqlx::AssertSqlSafe(sql("SELECT state FROM idem_test_tickets WHERE ticket_id = ?")))
                        .bind(id)
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                assert_eq!(stored, 7, "the discriminant is what is stored");
                assert_eq!(done().run(&mut *conn, unique()).await.unwrap(), Advanced::NotFound);
            }

            /// 100 concurrent `Paid` advances of one row, each in its own
            /// transaction: exactly one `Applied`, 99 `AlreadyThere`.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn hundred_concurrent_advances_apply_once() {
                let Some(pool) = pool().await else { return };
                let id = new_order(&pool).await;
                let barrier = Arc::new(Barrier::new(100));
                let tasks: Vec<_> = (0..100)
                    .map(|_| {
                        let (pool, barrier) = (pool.clone(), barrier.clone());
                        tokio::spawn(async move {
                            barrier.wait().await;
                            pay_once(&pool, id).await
                        })
                    })
                    .collect();
                let mut answers = Vec::new();
                for task in tasks {
                    answers.push(task.await.unwrap());
                }
                let applied = answers.iter().filter(|a| **a == Advanced::Applied).count();
                let already = answers.iter().filter(|a| **a == Advanced::AlreadyThere).count();
                assert_eq!((applied, already), (1, 99), "{answers:?}");
                assert_eq!(status_of(&pool, id).await, ("PAID".to_owned(), Some(1_000)));
            }

            /// A cancel and a payment of one pending order, released together:
            /// one wins, the other gets a `Conflict` carrying the winner's state.
            /// A refund racing the payment either follows it (`Applied`) or comes
            /// first and sees the real current state, `Pending`.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn racing_transitions_have_one_winner_and_a_real_conflict() {
                let Some(pool) = pool().await else { return };
                for _ in 0..10 {
                    let id = new_order(&pool).await;
                    let barrier = Arc::new(Barrier::new(2));
                    let close = {
                        let (pool, barrier) = (pool.clone(), barrier.clone());
                        tokio::spawn(async move {
                            barrier.wait().await;
                            let mut tx = pool.begin().await.unwrap();
                            let a = advance(transition!(OrderStatus: Pending -> Closed)).run(&mut *tx, id).await.unwrap();
                            tx.commit().await.unwrap();
                            a
                        })
                    };
                    let pay = {
                        let (pool, barrier) = (pool.clone(), barrier.clone());
                        tokio::spawn(async move {
                            barrier.wait().await;
                            pay_once(&pool, id).await
                        })
                    };
                    let (close, pay) = (close.await.unwrap(), pay.await.unwrap());
                    let final_state = status_of(&pool, id).await.0;
                    match (close, pay) {
                        (Advanced::Applied, Advanced::Conflict { current: OrderStatus::Closed }) => {
                            assert_eq!(final_state, "CLOSED")
                        }
                        (Advanced::Conflict { current: OrderStatus::Paid }, Advanced::Applied) => {
                            assert_eq!(final_state, "PAID")
                        }
                        other => panic!("not one winner and one real conflict: {other:?}"),
                    }
                }
                for _ in 0..10 {
                    let id = new_order(&pool).await;
                    let barrier = Arc::new(Barrier::new(2));
                    let refund = {
                        let (pool, barrier) = (pool.clone(), barrier.clone());
                        tokio::spawn(async move {
                            barrier.wait().await;
                            let mut tx = pool.begin().await.unwrap();
                            let a = advance(transition!(OrderStatus: Paid -> Refunded)).run(&mut *tx, id).await.unwrap();
                            tx.commit().await.unwrap();
                            a
                        })
                    };
                    let pay = {
                        let (pool, barrier) = (pool.clone(), barrier.clone());
                        tokio::spawn(async move {
                            barrier.wait().await;
                            pay_once(&pool, id).await
                        })
                    };
                    let (refund, pay) = (refund.await.unwrap(), pay.await.unwrap());
                    assert_eq!(pay, Advanced::Applied, "the payment always applies");
                    let final_state = status_of(&pool, id).await.0;
                    match refund {
                        Advanced::Applied => assert_eq!(final_state, "REFUNDED"),
                        Advanced::Conflict { current: OrderStatus::Pending } => assert_eq!(final_state, "PAID"),
                        other => panic!("refund answered {other:?} with the order {final_state}"),
                    }
                }
            }

            /// The key layer misconfigured (two keys for one order): both
            /// bodies run, but the second sees `AlreadyThere`, pays nothing,
            /// and the ledger holds one row.
            #[idempotent(key = "<k>", ttl = "1h", biz = "t_state_pay")]
            async fn pay(
                idem: &Idem<Db>,
                tx: &mut sqlx::Transaction<'_, Db>,
                k: String,
                order_id: i64,
            ) -> Result<Payment, PayError> {
                let answer = advance(transition!(OrderStatus: Pending -> Paid))
                    .set(col!(paid_at), 5_000_i64)
                    .run(&mut **tx, order_id)
                    .await?;
                let paid_now = match answer {
                    Advanced::Applied => {
                        sqlx::query(sqlx::AssertSqlSafe(sql(
                            "INSERT INTO idem_test_payments (order_id, amount) VALUES (?, 1999)",
                        )))
                        .bind(order_id)
                        .execute(&mut **tx)
                        .await?;
                        true
                    }
                    Advanced::AlreadyThere => false,
                    Advanced::Conflict { current } => return Err(PayError::Conflict(current)),
                    Advanced::NotFound => return Err(PayError::NotFound),
                };
                Ok(Payment { order_id, paid_now })
            }

            #[tokio::test]
            async fn the_state_layer_alone_stops_a_double_payment() {
                let Some(pool) = pool().await else { return };
                let idem = Idem::new(pool.clone());
                idem.migrate().await.unwrap();
                let id = new_order(&pool).await;
                let (first, outcome) = idempotency::observe(pay(&idem, format!("first-{id}"), id)).await;
                assert_eq!((first.unwrap(), outcome), (Payment { order_id: id, paid_now: true }, Some(idempotency::Outcome::Executed)));
                // Another key for the same order: the record cannot tell; the state can.
                let (second, outcome) = idempotency::observe(pay(&idem, format!("second-{id}"), id)).await;
                assert_eq!((second.unwrap(), outcome), (Payment { order_id: id, paid_now: false }, Some(idempotency::Outcome::Executed)));
                assert_eq!(ledger_rows(&pool, id).await, 1, "one payment");
                assert_eq!(status_of(&pool, id).await, ("PAID".to_owned(), Some(5_000)));
            }
        }
    };
}

state_suite!(
    sqlite,
    sqlx::Sqlite,
    "?",
    || async {
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
        let file = std::env::temp_dir().join(format!("idem-state-{}-{}.db", std::process::id(), unique()));
        let options = SqliteConnectOptions::new()
            .filename(file)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(30));
        SqlitePoolOptions::new().max_connections(8).connect_with(options).await
    },
    [
        "CREATE TABLE IF NOT EXISTS idem_test_orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL, paid_at INTEGER NULL)",
        "CREATE TABLE IF NOT EXISTS idem_test_tickets (ticket_id INTEGER PRIMARY KEY, state SMALLINT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS idem_test_payments (id INTEGER PRIMARY KEY, order_id INTEGER NOT NULL, amount INTEGER NOT NULL)",
    ]
);

state_suite!(
    mysql,
    sqlx::MySql,
    "?",
    || async {
        let url = std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(60))
            .connect(&url)
            .await
    },
    [
        "CREATE TABLE IF NOT EXISTS idem_test_orders (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL, paid_at BIGINT NULL)",
        "CREATE TABLE IF NOT EXISTS idem_test_tickets (ticket_id BIGINT PRIMARY KEY, state SMALLINT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS idem_test_payments (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BIGINT NOT NULL, amount BIGINT NOT NULL, KEY (order_id))",
    ]
);

state_suite!(
    postgres,
    sqlx::Postgres,
    "$",
    || async {
        let url = std::env::var("IDEM_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(60))
            .connect(&url)
            .await
    },
    // One string, one implicit transaction: the lock keeps concurrent
    // `CREATE TABLE IF NOT EXISTS` from colliding in the catalog.
    ["SELECT pg_advisory_xact_lock(7306232718293620); \
      CREATE TABLE IF NOT EXISTS idem_test_orders (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL, paid_at BIGINT NULL); \
      CREATE TABLE IF NOT EXISTS idem_test_tickets (ticket_id BIGINT PRIMARY KEY, state SMALLINT NOT NULL); \
      CREATE TABLE IF NOT EXISTS idem_test_payments (id BIGSERIAL PRIMARY KEY, order_id BIGINT NOT NULL, amount BIGINT NOT NULL)"]
);
