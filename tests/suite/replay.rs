//! Replays byte for byte: hostile arguments, falsy values, the first
//! caller's result read back from its stored form, and corrupted stored or
//! cached results answered with `Error::Replay`.

use std::sync::atomic::Ordering::SeqCst;

use idempotency::{Idem, Status, StoredJson, idempotent};
use idempotency_testkit::{
    TestBackend, redis_cached_response, redis_client, redis_exists, redis_replace_result, redis_result, unique,
};
use serde::{Deserialize, Serialize};
use sqlx::Transaction;

use super::fixture::{
    Mode, Probe, Redis, TestError, body, engine, ledger_rows, pay, record_rows_for, redis_location,
    with_and_without_redis,
};
use super::{B, Db};

macro_rules! falsy_fn {
    ($name:ident, $biz:literal, $ty:ty, $value:expr) => {
        #[idempotent(key = "<k>", ttl = "1h", biz = $biz)]
        async fn $name(idem: &Idem<Db>, k: String, #[idem(skip)] probe: &Probe) -> Result<$ty, TestError> {
            probe.runs.fetch_add(1, SeqCst);
            Ok($value)
        }
    };
}
falsy_fn!(zero, "t_falsy_zero", i64, 0);
falsy_fn!(empty_string, "t_falsy_str", String, String::new());
falsy_fn!(empty_vec, "t_falsy_vec", Vec<i32>, Vec::new());
falsy_fn!(unit, "t_falsy_unit", (), ());
falsy_fn!(none, "t_falsy_none", Option<i32>, None);
falsy_fn!(falsy_false, "t_falsy_bool", bool, false);

/// A result whose stored form differs from the value: a field left out of
/// the JSON, and a float JSON cannot hold when `amount` is 0.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Shown {
    ratio: f64,
    #[serde(skip_serializing, default)]
    note: String,
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_shown")]
async fn shown(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    #[idem(skip)] probe: &Probe,
) -> Result<Shown, TestError> {
    body(tx, &k, amount, probe, Mode::Ok).await?;
    Ok(Shown { ratio: if amount == 0 { f64::NAN } else { amount as f64 }, note: "not stored".into() })
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_echo")]
async fn echo(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    note: String,
    #[idem(skip)] probe: &Probe,
) -> Result<String, TestError> {
    body(tx, &k, 1, probe, Mode::Ok).await?;
    Ok(note)
}

/// A value handed on as its stored JSON (`StoredJson`), not decoded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    amount: i64,
    note: String,
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_stored_json")]
async fn receipt_json(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    amount: i64,
    #[idem(skip)] probe: &Probe,
) -> Result<StoredJson<Receipt>, TestError> {
    body(tx, &k, amount, probe, Mode::Ok).await?;
    Ok(StoredJson::new(Receipt { amount, note: "caf\u{e9} \"paid\"".into() }))
}

/// The first caller and every replay (from Redis, from the record) get the
/// stored bytes themselves; the body ran once; bytes in the record that are
/// not JSON answer `Error::Replay`, as for a decoded value.
async fn stored_json_hands_on_the_stored_bytes(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let Some(plain) = engine(&unique("db"), 4, Redis::Off).await else { return };
    let probe = Probe::default();
    let k = unique("stored-json");
    let expected = r#"{"amount":7,"note":"café \"paid\""}"#;
    let first = receipt_json(&idem, k.clone(), 7, &probe).await.unwrap();
    assert_eq!(first.json(), Some(expected), "the first caller gets the stored form too");
    for _ in 0..2 {
        let again = receipt_json(&idem, k.clone(), 7, &probe).await.unwrap();
        assert_eq!(again.json(), Some(expected));
    }
    let Status::Completed { response } = idem.status("t_stored_json", &k).await.unwrap() else { panic!("not stored") };
    assert_eq!(response, expected);
    assert_eq!(receipt_json(&idem, k.clone(), 7, &probe).await.unwrap().into_value().unwrap().amount, 7);
    assert!(matches!(
        receipt_json(&idem, k.clone(), 8, &probe).await,
        Err(TestError::Idem(idempotency::Error::KeyReused { .. }))
    ));
    assert_eq!((probe.runs(), ledger_rows(&idem, &k).await), (1, 1));

    // From the record alone, and a record whose bytes are not JSON.
    let k = unique("stored-json-plain");
    receipt_json(&plain, k.clone(), 3, &probe).await.unwrap();
    sqlx::query(B::CORRUPT).bind("{\"amount\": 3").bind("t_stored_json").bind(&k).execute(plain.pool()).await.unwrap();
    let r = receipt_json(&plain, k.clone(), 3, &probe).await;
    assert!(matches!(r, Err(TestError::Idem(idempotency::Error::Replay { .. }))), "{r:?}");
    assert_eq!((probe.runs(), ledger_rows(&plain, &k).await), (2, 1));
}

with_and_without_redis!(
    #[tokio::test]
    stored_json_hands_on_the_stored_bytes_without_redis,
    stored_json_hands_on_the_stored_bytes_with_redis => stored_json_hands_on_the_stored_bytes
);

#[tokio::test]
async fn hostile_arguments_are_stored_and_replayed_byte_for_byte() {
    let name = unique("db");
    let Some(idem) = engine(&name, 4, Redis::On).await else { return };
    let Some(plain) = engine(&name, 4, Redis::Off).await else { return };
    let Some(client) = redis_client().await else { return };
    let probe = Probe::default();
    let notes = [
        "'; DROP TABLE idem_record; --".to_string(),
        "\"quoted\" \\ back\\slash".to_string(),
        "nul \0 inside".to_string(),
        "crlf \r\nSET pwned 1\r\n".to_string(),
        "unicode caf\u{e9} \u{1f4b8} \u{202e}rtl".to_string(),
        "x".repeat(100_000),
    ];
    for note in &notes {
        let k = unique("echo");
        assert_eq!(&echo(&idem, k.clone(), note.clone(), &probe).await.unwrap(), note);
        let cached = redis_cached_response(&client, &redis_location(&idem, "t_echo", &k).await).await;
        assert_eq!(cached, serde_json::to_string(note).unwrap(), "cached byte for byte");
        assert_eq!(&echo(&idem, k.clone(), note.clone(), &probe).await.unwrap(), note, "replayed from Redis");
        assert_eq!(&echo(&plain, k.clone(), note.clone(), &probe).await.unwrap(), note, "replayed from the record");
        let Status::Completed { response } = idem.status("t_echo", &k).await.unwrap() else { panic!("not stored") };
        assert_eq!(response, serde_json::to_string(note).unwrap());
        // Executed without Redis (the record goes in first, completed with its response).
        let k = unique("echo-plain");
        assert_eq!(&echo(&plain, k.clone(), note.clone(), &probe).await.unwrap(), note);
        assert_eq!(&echo(&plain, k.clone(), note.clone(), &probe).await.unwrap(), note, "replayed from the record");
        assert_eq!(ledger_rows(&plain, &k).await, 1);
        assert_eq!(record_rows_for(&plain, "t_echo", &k).await, 1);
    }
    assert_eq!(probe.runs(), 2 * notes.len());
    assert!(!redis_exists(&client, "pwned").await, "no command was injected");
}

async fn falsy_values_replay_exactly(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = unique("falsy");
    for _ in 0..3 {
        assert_eq!(zero(&idem, k.clone(), &probe).await.unwrap(), 0);
        assert_eq!(empty_string(&idem, k.clone(), &probe).await.unwrap(), "");
        assert_eq!(empty_vec(&idem, k.clone(), &probe).await.unwrap(), Vec::<i32>::new());
        unit(&idem, k.clone(), &probe).await.unwrap();
        assert_eq!(none(&idem, k.clone(), &probe).await.unwrap(), None);
        assert!(!falsy_false(&idem, k.clone(), &probe).await.unwrap());
    }
    assert_eq!(probe.runs(), 6, "each fn ran once, then replayed twice");
    let stored = |biz: &'static str| {
        let idem = idem.clone();
        let k = k.clone();
        async move { idem.status(biz, &k).await.unwrap() }
    };
    assert_eq!(stored("t_falsy_zero").await, Status::Completed { response: "0".into() });
    assert_eq!(stored("t_falsy_str").await, Status::Completed { response: "\"\"".into() });
    assert_eq!(stored("t_falsy_vec").await, Status::Completed { response: "[]".into() });
    assert_eq!(stored("t_falsy_unit").await, Status::Completed { response: "null".into() });
    assert_eq!(stored("t_falsy_none").await, Status::Completed { response: "null".into() });
    assert_eq!(stored("t_falsy_bool").await, Status::Completed { response: "false".into() });
}

with_and_without_redis!(
    #[tokio::test]
    falsy_values_replay_exactly_them,
    falsy_values_replay_exactly_them_with_redis => falsy_values_replay_exactly
);

/// The first caller gets the result as its duplicates will (read back from
/// its stored form), and a result that could not replay commits nothing.
async fn first_result_is_the_replayed_one(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = unique("shown");
    let first = shown(&idem, k.clone(), 3, &probe).await.unwrap();
    assert_eq!(first, Shown { ratio: 3.0, note: String::new() }, "the skipped field is left out for everyone");
    assert_eq!(shown(&idem, k.clone(), 3, &probe).await.unwrap(), first);

    let nan = unique("nan");
    for attempt in 1..=2 {
        let refused = shown(&idem, nan.clone(), 0, &probe).await;
        assert!(
            matches!(refused, Err(TestError::Idem(idempotency::Error::Serialize(_)))),
            "attempt {attempt}: {refused:?}"
        );
    }
    assert_eq!(probe.runs(), 3, "one execution, then two that could not be stored");
    assert_eq!(ledger_rows(&idem, &nan).await, 0, "nothing of theirs committed");
    assert_eq!(record_rows_for(&idem, "t_shown", &nan).await, 0);
}

with_and_without_redis!(
    #[tokio::test]
    first_result_is_the_replayed_one_without_redis,
    first_result_is_the_replayed_one_with_redis => first_result_is_the_replayed_one
);

#[tokio::test]
async fn corrupted_stored_response_is_a_replay_error() {
    let Some(idem) = engine(&unique("db"), 4, Redis::Off).await else { return };
    let probe = Probe::default();
    let k = unique("corrupt");
    pay(&idem, k.clone(), 5, &probe, Mode::Ok).await.unwrap();
    sqlx::query(B::CORRUPT).bind("{\"key\": 42").bind("t_pay").bind(&k).execute(idem.pool()).await.unwrap();
    let r = pay(&idem, k.clone(), 5, &probe, Mode::Ok).await;
    match r {
        Err(TestError::Idem(idempotency::Error::Replay { biz, key, .. })) => {
            assert_eq!((biz, key), ("t_pay", k.clone()))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(probe.runs(), 1);
}

/// A cached value corrupted in Redis (a result the fn's type cannot read)
/// answers `Error::Replay`, never a panic, and runs nothing.
#[tokio::test]
async fn corrupted_cached_value_is_a_replay_error() {
    let Some(idem) = engine(&unique("db"), 4, Redis::On).await else { return };
    let Some(client) = redis_client().await else { return };
    let probe = Probe::default();
    let k = unique("corrupt_cache");
    let first = pay(&idem, k.clone(), 8, &probe, Mode::Ok).await.unwrap();
    let at = redis_location(&idem, "t_pay", &k).await;
    let cached = redis_cached_response(&client, &at).await;
    assert_eq!(cached, serde_json::to_string(&first).unwrap());
    let value = redis_result(&client, &at).await.expect("cached");
    let (head, response) = value.split_at(value.len() - cached.len());
    assert_eq!(response, cached.as_bytes(), "the response is the value's tail");
    let corrupted = [head, b"{\"not\":\"a receipt\"}"].concat();
    redis_replace_result(&client, &at, &corrupted).await;

    let (again, outcome) = idempotency::observe(pay(&idem, k.clone(), 8, &probe, Mode::Ok)).await;
    assert!(matches!(again, Err(TestError::Idem(idempotency::Error::Replay { .. }))), "{again:?}");
    assert_eq!(outcome, Some(idempotency::Outcome::Rejected));
    assert_eq!((probe.runs(), ledger_rows(&idem, &k).await), (1, 1));
}
