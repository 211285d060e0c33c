//! Arguments refused before anything is written, end to end through
//! `#[idempotent]` on SQLite: a float that is NaN or infinite, at any depth
//! of any argument (JSON has no form for one, so it would fingerprint like
//! `null`), and a `biz_no` longer than its column.

use std::collections::BTreeMap;

use idempotency::{Idem, Outcome, idempotent, observe};
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, Transaction};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Line {
    sku: String,
    price: f64,
    discount: Option<f32>,
}

/// Writes one row per call that runs; the result is the id. (A body error
/// is a storage error here: `idempotency::Error: From<sqlx::Error>`.)
#[idempotent(key = "quote_<id>", ttl = "1h", biz = "t_quote")]
async fn quote(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    id: i64,
    amount: Option<f64>,
    lines: Vec<Line>,
    rates: BTreeMap<String, f32>,
) -> Result<i64, idempotency::Error> {
    sqlx::query("INSERT INTO quotes (id) VALUES (?)").bind(id).execute(&mut **tx).await?;
    Ok(id)
}

/// The same table and `biz`, with a business number from the arguments.
#[idempotent(key = "booked_<id>", ttl = "1h", biz = "t_quote", biz_no = "<reference>")]
async fn book(
    idem: &Idem<Sqlite>,
    tx: &mut Transaction<'_, Sqlite>,
    id: i64,
    reference: String,
) -> Result<i64, idempotency::Error> {
    sqlx::query("INSERT INTO quotes (id) VALUES (?)").bind(id).execute(&mut **tx).await?;
    Ok(id)
}

async fn engine() -> Idem<Sqlite> {
    let idem = Idem::sqlite_memory().await.expect("sqlite");
    sqlx::raw_sql("CREATE TABLE quotes (id INTEGER PRIMARY KEY)").execute(idem.pool()).await.expect("table");
    idem
}

/// (quote rows, idem_record rows of `t_quote`).
async fn rows(idem: &Idem<Sqlite>) -> (i64, i64) {
    let quotes = sqlx::query_scalar("SELECT COUNT(*) FROM quotes").fetch_one(idem.pool()).await.expect("quotes");
    let records = sqlx::query_scalar("SELECT COUNT(*) FROM idem_record WHERE biz_type = 't_quote'")
        .fetch_one(idem.pool())
        .await
        .expect("records");
    (quotes, records)
}

fn line(price: f64, discount: Option<f32>) -> Line {
    Line { sku: "a".into(), price, discount }
}

/// Asserts the call was refused naming `arg`, as `Outcome::Rejected`.
fn assert_refused(called: (Result<i64, idempotency::Error>, Option<Outcome>), arg: &str) {
    match called {
        (Err(idempotency::Error::NonFiniteFloat { arg: got }), Some(Outcome::Rejected)) => {
            assert_eq!(got, arg);
            let shown = idempotency::Error::NonFiniteFloat { arg: got }.to_string();
            assert_eq!(
                shown,
                format!(
                    "argument `{arg}` holds a float that is NaN or infinite, which has no JSON form to fingerprint"
                )
            );
        }
        other => panic!("expected NonFiniteFloat {{ arg: {arg:?} }} and Rejected, got {other:?}"),
    }
}

#[tokio::test]
async fn non_finite_floats_are_refused_and_nothing_is_written() {
    let idem = engine().await;
    let no_rates = BTreeMap::new;
    for x in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        assert_refused(observe(quote(&idem, 1, Some(x), vec![], no_rates())).await, "amount");
        assert_refused(observe(quote(&idem, 2, None, vec![line(1.0, None), line(x, None)], no_rates())).await, "lines");
    }
    for x in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        assert_refused(observe(quote(&idem, 3, None, vec![line(1.0, Some(x))], no_rates())).await, "lines");
        let rates = BTreeMap::from([("eur".to_owned(), 1.0), ("usd".to_owned(), x)]);
        assert_refused(observe(quote(&idem, 4, Some(2.5), vec![line(1.0, Some(0.5))], rates)).await, "rates");
    }
    assert_eq!(rows(&idem).await, (0, 0), "no body ran, no record was written");

    // Finite floats, however odd, are arguments like any other.
    let rates = BTreeMap::from([("eur".to_owned(), f32::MIN_POSITIVE)]);
    let lines = vec![line(-0.0, Some(f32::MAX)), line(5e-324, None)];
    let ran = observe(quote(&idem, 5, Some(f64::MAX), lines.clone(), rates.clone())).await;
    assert!(matches!(ran, (Ok(5), Some(Outcome::Executed))), "{ran:?}");
    let again = observe(quote(&idem, 5, Some(f64::MAX), lines, rates)).await;
    assert!(matches!(again, (Ok(5), Some(Outcome::Replayed))), "{again:?}");
    assert_eq!(rows(&idem).await, (1, 1));
}

/// Regression: `Some(NaN)`, `Some(inf)` and `None` all fingerprinted as
/// `null`, so a call with `Some(NaN)` replayed the result of one with `None`.
#[tokio::test]
async fn some_nan_does_not_replay_none() {
    let idem = engine().await;
    let ran = observe(quote(&idem, 7, None, vec![], BTreeMap::new())).await;
    assert!(matches!(ran, (Ok(7), Some(Outcome::Executed))), "{ran:?}");
    for x in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        assert_refused(observe(quote(&idem, 7, Some(x), vec![], BTreeMap::new())).await, "amount");
    }
    let other = observe(quote(&idem, 7, Some(1.5), vec![], BTreeMap::new())).await;
    assert!(
        matches!(other, (Err(idempotency::Error::KeyReused { biz: "t_quote", ref key }), Some(Outcome::KeyReused)) if key == "quote_7"),
        "{other:?}"
    );
    let same = observe(quote(&idem, 7, None, vec![], BTreeMap::new())).await;
    assert!(matches!(same, (Ok(7), Some(Outcome::Replayed))), "{same:?}");
    assert_eq!(rows(&idem).await, (1, 1), "one body, one record");
}

/// A `biz_no` past its 64-byte column is `Error::BizNoTooLong` (not a key
/// error) and `Outcome::Rejected`, before the body runs; 64 bytes fit.
#[tokio::test]
async fn biz_no_longer_than_its_column_is_rejected() {
    let idem = engine().await;
    let refused = observe(book(&idem, 1, "n".repeat(65))).await;
    assert!(
        matches!(refused, (Err(idempotency::Error::BizNoTooLong { len: 65, max: 64 }), Some(Outcome::Rejected))),
        "{refused:?}"
    );
    assert!(!refused.0.unwrap_err().is_retryable());
    // Multi-byte characters count in bytes, as the column does.
    let refused = observe(book(&idem, 2, "é".repeat(33))).await;
    assert!(matches!(refused.0, Err(idempotency::Error::BizNoTooLong { len: 66, max: 64 })), "{refused:?}");
    assert_eq!(rows(&idem).await, (0, 0), "no body ran, no record was written");

    let ran = observe(book(&idem, 3, "n".repeat(64))).await;
    assert!(matches!(ran, (Ok(3), Some(Outcome::Executed))), "{ran:?}");
    assert_eq!(rows(&idem).await, (1, 1));
    assert_eq!(idempotency::key::MAX_BIZ_NO_LEN, 64);
}
