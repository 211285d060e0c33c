//! The HTTP examples' business part (`examples/shop/`), as users copy it:
//! its payment body run on SQLite.
//!
//! Regression (both fail with the example as it was): a caller paying an
//! order someone else already paid, under a key of its own, was answered
//! with the other payer's `payment_id` and amount; and the body's own SQL
//! failures were all answered 503 "retry", the ones that recur included.

use idempotency::Idem;
use sqlx::Sqlite;

#[derive(Clone)]
pub struct App {
    pub idem: Idem<Sqlite>,
}

crate::shop::payments!(Sqlite, crate::shop::sqlite_payment_id);

async fn app() -> App {
    let idem = Idem::sqlite_memory().await.expect("engine");
    sqlx::raw_sql(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL);
         CREATE TABLE payments (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id INTEGER NOT NULL,
             user_id TEXT NOT NULL, amount INTEGER NOT NULL);
         INSERT INTO orders VALUES (1, 'PENDING'), (2, 'PENDING')",
    )
    .execute(idem.pool())
    .await
    .expect("shop tables");
    App { idem }
}

fn pay(amount: i64) -> PayReq {
    PayReq { amount }
}

/// A new key on a paid order: the payer's own payment for the payer, a
/// refusal that shows nothing of it for anyone else.
#[tokio::test]
async fn an_order_paid_by_another_is_refused_without_their_payment() {
    let app = app().await;
    let paid = |key: &'static str| pay_by_key(&app, "alice".into(), key.into(), 1, pay(1999));
    let alice = paid("key-alice-1").await.expect("alice pays").into_value().unwrap();
    // Alice again with a key she made up anew: her own payment.
    let again = paid("key-alice-2").await.expect("alice again").into_value().unwrap();
    assert_eq!((again.payment_id, again.amount), (alice.payment_id, 1999));
    // Bob: refused, and told nothing of Alice's payment.
    let bob = pay_by_key(&app, "bob".into(), "key-bob-1".into(), 1, pay(5)).await;
    let Err(ApiError::Refused(refusal)) = bob else { panic!("bob was answered {bob:?}") };
    assert!(matches!(refusal, Refusal::PaidByAnother(1)), "{refusal:?}");
    assert_eq!(refusal.status_and_code(), (409, "ORDER_ALREADY_PAID"));
    assert_eq!(refusal.to_string(), "order 1 is already paid");
    let payments: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payments").fetch_one(app.idem.pool()).await.unwrap();
    assert_eq!(payments, 1);
}

/// The body's own SQL failing for good (its table gone) answers 500, not
/// 503: a retry would meet it again.
#[tokio::test]
async fn a_body_failure_that_recurs_is_not_answered_retry() {
    let app = app().await;
    sqlx::raw_sql("DROP TABLE payments").execute(app.idem.pool()).await.unwrap();
    let answer = pay_by_key(&app, "alice".into(), "key-alice-3".into(), 2, pay(1999)).await;
    let Err(ApiError::Idem(error)) = answer else { panic!("answered {answer:?}") };
    assert!(!error.is_retryable(), "{error:?}");
    assert_eq!(idempotency::http::Problem::from(&error).status.as_u16(), 500);
}

/// The records name the order they paid (`biz_no`), so `idem reconcile
/// --record-field biz_no` can match them with `payments.order_id`: by key and
/// by token alike.
#[tokio::test]
async fn records_name_their_order_for_reconcile() {
    let app = app().await;
    pay_by_key(&app, "alice".into(), "key-alice-1".into(), 1, pay(1999)).await.expect("alice pays by key");
    pay_by_token(&app, "bob".into(), "token-bob-2".into(), 2, pay(500)).await.expect("bob pays by token");
    let records: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT biz_type, biz_no FROM idem_record ORDER BY biz_type")
            .fetch_all(app.idem.pool())
            .await
            .unwrap();
    assert_eq!(records, [("http_pay".into(), Some("1".into())), ("http_pay_token".into(), Some("2".into()))]);
    let paid: Vec<(String,)> = sqlx::query_as("SELECT CAST(order_id AS TEXT) FROM payments ORDER BY order_id")
        .fetch_all(app.idem.pool())
        .await
        .unwrap();
    assert_eq!(paid, [("1".into(),), ("2".into(),)], "the column reconcile compares them with");
}
