//! What identifies a call: the key rule (hostile keys refused before any
//! write, edge keys that obey it, case), the fingerprint (other arguments
//! are `KeyReused`, `HashMap` order does not matter), and `biz_no`.

use std::collections::HashMap;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use idempotency::{Idem, Status, idempotent};
use idempotency_testkit::{TestBackend, redis_client, redis_exists, redis_holds, unique};
use serde::{Deserialize, Serialize};
use sqlx::Transaction;

use super::fixture::{
    Mode, Probe, Receipt, Redis, TestError, body, engine, engine_on_private_redis, ledger_rows, pay, record_rows_for,
    redis_location, with_and_without_redis,
};
use super::{B, Db};

async fn key_reuse_is_refused(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let k = unique("reuse");
    pay(&idem, k.clone(), 100, &probe, Mode::Ok).await.unwrap();
    let reused = pay(&idem, k.clone(), 101, &probe, Mode::Ok).await;
    assert!(matches!(reused, Err(TestError::Idem(idempotency::Error::KeyReused { .. }))), "{reused:?}");
    assert_eq!(ledger_rows(&idem, &k).await, 1);
    assert_eq!(probe.runs(), 1);
}

with_and_without_redis!(
    #[tokio::test]
    same_key_other_arguments_is_key_reused,
    same_key_other_arguments_is_key_reused_with_redis => key_reuse_is_refused
);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Cart {
    items: HashMap<String, i64>,
    nested: Vec<HashMap<String, String>>,
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_cart")]
async fn checkout(idem: &Idem<Db>, k: String, cart: Cart, #[idem(skip)] probe: &Probe) -> Result<usize, TestError> {
    Ok(probe.runs.fetch_add(1, SeqCst) + 1)
}

#[tokio::test]
async fn hashmap_arguments_fingerprint_the_same_in_any_order() {
    let Some(idem) = engine(&unique("db"), 4, Redis::Off).await else { return };
    let probe = Probe::default();
    let k = unique("cart");
    let pairs: Vec<(String, i64)> = (0..40).map(|i| (format!("sku{i}"), i)).collect();
    let forward: HashMap<String, i64> = pairs.iter().cloned().collect();
    let backward: HashMap<String, i64> = pairs.iter().rev().cloned().collect();
    let nested = |n: usize| vec![(0..n).map(|i| (format!("f{i}"), format!("v{i}"))).collect::<HashMap<_, _>>()];
    let first = checkout(&idem, k.clone(), Cart { items: forward, nested: nested(20) }, &probe).await.unwrap();
    let second = checkout(&idem, k.clone(), Cart { items: backward, nested: nested(20) }, &probe).await.unwrap();
    assert_eq!((first, second, probe.runs()), (1, 1, 1));
    let mut changed: HashMap<String, i64> = pairs.iter().cloned().collect();
    changed.insert("sku0".into(), 99);
    let reused = checkout(&idem, k.clone(), Cart { items: changed, nested: nested(20) }, &probe).await;
    assert!(matches!(reused, Err(TestError::Idem(idempotency::Error::KeyReused { .. }))), "{reused:?}");
}

#[idempotent(key = "bad_<k>", ttl = "1h", biz = "t_badkey")]
async fn with_bad_key(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    #[idem(skip)] probe: &Probe,
) -> Result<usize, TestError> {
    body(tx, &k, 1, probe, Mode::Ok).await
}

#[idempotent(key = "bad_<k>", ttl = "1h", biz = "t_longkey")]
async fn with_long_key(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    #[idem(skip)] probe: &Probe,
) -> Result<usize, TestError> {
    body(tx, &k, 1, probe, Mode::Ok).await
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_bad_empty")]
async fn with_empty_key(idem: &Idem<Db>, k: String, #[idem(skip)] probe: &Probe) -> Result<usize, TestError> {
    Ok(probe.runs.fetch_add(1, SeqCst) + 1)
}

/// Hostile keys, each rendered through `bad_<k>`: every one must be refused
/// with `InvalidKey` before any Redis or database write.
/// Hostile values of `k` in the key template `bad_<k>`, each with the
/// refusal it must get (offsets count the `bad_` prefix).
fn hostile_keys() -> Vec<(&'static str, String, idempotency::KeyError)> {
    use idempotency::KeyError::{BadChar, TooLong};
    let bad = |ch: char, in_k: usize| BadChar { ch, at: "bad_".len() + in_k };
    vec![
        ("256 bytes", "k".repeat(252), TooLong { len: 256, max: 255 }),
        ("10k bytes", "k".repeat(10_000), TooLong { len: 10_004, max: 255 }),
        ("space", "with space".into(), bad(' ', 4)),
        ("only spaces", "   ".into(), bad(' ', 0)),
        ("tab", "a\tb".into(), bad('\t', 1)),
        ("newline", "new\nline".into(), bad('\n', 3)),
        ("carriage return", "a\rb".into(), bad('\r', 1)),
        ("redis CRLF injection", "x\r\nSET pwned 1\r\n".into(), bad('\r', 1)),
        ("NUL", "nul\0".into(), bad('\0', 3)),
        ("escape", "a\u{1b}[31m".into(), bad('\u{1b}', 1)),
        ("DEL", "a\u{7f}".into(), bad('\u{7f}', 1)),
        ("glob *", "star*".into(), bad('*', 4)),
        ("glob ?", "what?".into(), bad('?', 4)),
        ("glob []", "[ab]".into(), bad('[', 0)),
        ("hash tag {}", "{brace}".into(), bad('{', 0)),
        ("single quote", "o'brien".into(), bad('\'', 1)),
        ("double quote", "say\"hi\"".into(), bad('"', 3)),
        ("sql comment", "a;--".into(), bad(';', 1)),
        ("sql injection", "1' OR '1'='1".into(), bad('\'', 1)),
        ("backslash", "a\\b".into(), bad('\\', 1)),
        ("percent", "100%".into(), bad('%', 3)),
        ("slash", "a/b".into(), bad('/', 1)),
        ("hash", "a#b".into(), bad('#', 1)),
        ("at", "a@b".into(), bad('@', 1)),
        ("plus", "a+b".into(), bad('+', 1)),
        ("comma", "a,b".into(), bad(',', 1)),
        ("equals", "a=b".into(), bad('=', 1)),
        ("latin accent", "caf\u{e9}".into(), bad('\u{e9}', 3)),
        ("cyrillic lookalike a", "b\u{430}d".into(), bad('\u{430}', 1)),
        ("fullwidth k", "\u{ff4b}ey".into(), bad('\u{ff4b}', 0)),
        ("zero-width space", "a\u{200b}b".into(), bad('\u{200b}', 1)),
        ("right-to-left override", "a\u{202e}b".into(), bad('\u{202e}', 1)),
        ("combining accent", "e\u{301}".into(), bad('\u{301}', 1)),
        ("emoji", "pay\u{1f4b8}".into(), bad('\u{1f4b8}', 3)),
    ]
}

/// Whether `r` is exactly the refusal `expected`.
fn refused_with<T: std::fmt::Debug>(r: &Result<T, TestError>, expected: &idempotency::KeyError) -> bool {
    matches!(r, Err(TestError::Idem(idempotency::Error::InvalidKey(e))) if e == expected)
}

#[tokio::test]
async fn hostile_keys_are_refused_before_any_write() {
    let Some(idem) = engine(&unique("db"), 4, Redis::On).await else { return };
    // The same engine over servers that never answer: a refusal that touched
    // either would come out as `Storage` instead.
    let unreachable = Idem::builder(B::dead_pool()).redis(redis::Client::open("redis://127.0.0.1:1").unwrap()).build();
    let probe = Probe::default();
    let hostile = hostile_keys();
    assert!(hostile.len() >= 30);
    for (what, k, expected) in &hostile {
        for engine in [&idem, &unreachable] {
            let r = with_bad_key(engine, k.clone(), &probe).await;
            assert!(refused_with(&r, expected), "{what}: {r:?}, expected {expected:?}");
        }
    }
    for engine in [&idem, &unreachable] {
        let empty = with_empty_key(engine, String::new(), &probe).await;
        assert!(refused_with(&empty, &idempotency::KeyError::Missing), "{empty:?}");
    }
    assert_eq!(probe.runs(), 0, "no body ran");
    // (Some keys cannot even be looked up: MySQL's key column is ASCII, and
    // PostgreSQL text refuses NUL. The engine never sends them.)
    for (_, k, _) in hostile.iter().filter(|(_, k, _)| k.is_ascii() && !k.contains('\0')) {
        assert_eq!(record_rows_for(&idem, "t_badkey", &format!("bad_{k}")).await, 0);
        assert_eq!(ledger_rows(&idem, k).await, 0);
    }
    assert_eq!(record_rows_for(&idem, "t_bad_empty", "").await, 0);
    if let Some(client) = redis_client().await {
        for (what, k, _) in &hostile {
            assert!(
                !redis_holds(&client, &redis_location(&idem, "t_badkey", &format!("bad_{k}")).await).await,
                "{what}"
            );
        }
        assert!(!redis_holds(&client, &redis_location(&idem, "t_bad_empty", "").await).await);
        assert!(!redis_exists(&client, "pwned").await, "no command was injected");
    }
}

/// The shortest key, one byte, end to end.
#[idempotent(key = "<k>", ttl = "1h", biz = "t_one")]
async fn with_one_byte_key(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    #[idem(skip)] probe: &Probe,
) -> Result<usize, TestError> {
    body(tx, "t_one", 1, probe, Mode::Ok).await
}

#[tokio::test]
async fn one_byte_key_works_end_to_end() {
    // A private Redis: the one key is not shared with the other backends' runs.
    let Some((_server, idem)) = engine_on_private_redis(Duration::from_millis(500)).await else { return };
    // The database may be shared with earlier runs: start from nothing.
    sqlx::query(B::DELETE_RECORD).bind("t_one").bind("x").execute(idem.pool()).await.expect("delete");
    let probe = Probe::default();
    let (first, outcome) = idempotency::observe(with_one_byte_key(&idem, "x".into(), &probe)).await;
    assert_eq!((first.unwrap(), outcome), (1, Some(idempotency::Outcome::Executed)));
    let (again, outcome) = idempotency::observe(with_one_byte_key(&idem, "x".into(), &probe)).await;
    assert_eq!((again.unwrap(), outcome), (1, Some(idempotency::Outcome::Replayed)));
    assert_eq!(record_rows_for(&idem, "t_one", "x").await, 1);
    assert_eq!(probe.runs(), 1);
}

#[tokio::test]
async fn edge_keys_that_obey_the_rule_work() {
    let Some(idem) = engine(&unique("db"), 4, Redis::On).await else { return };
    let probe = Probe::default();
    let unique = unique("edge").replace('-', "_");
    let longest = format!("{unique}{}", "k".repeat(251 - unique.len())); // "bad_" + 251 = 255 bytes
    for k in [longest, format!("{unique}.a:b-c_D"), format!("{unique}_")] {
        let first = with_long_key(&idem, k.clone(), &probe).await.unwrap();
        assert_eq!(with_long_key(&idem, k.clone(), &probe).await.unwrap(), first, "replayed");
        assert_eq!(record_rows_for(&idem, "t_longkey", &format!("bad_{k}")).await, 1);
    }
    assert_eq!(probe.runs(), 3);
}

/// Keys compare byte for byte: `Order-1` and `order-1` are two keys, each
/// executed and recorded (MySQL's key columns are `ascii_bin`: its default
/// collations ignore case and would merge them).
async fn keys_differing_in_case_are_two_keys(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 4, redis).await else { return };
    let probe = Probe::default();
    let upper = unique("Order");
    let lower = upper.to_lowercase();
    assert_ne!(upper, lower);
    let first = pay(&idem, upper.clone(), 5, &probe, Mode::Ok).await.unwrap();
    let second = pay(&idem, lower.clone(), 5, &probe, Mode::Ok).await.unwrap();
    assert_eq!(first, Receipt { key: upper.clone(), amount: 5, run: 1 });
    assert_eq!(second, Receipt { key: lower.clone(), amount: 5, run: 2 });
    assert_eq!(pay(&idem, upper.clone(), 5, &probe, Mode::Ok).await.unwrap(), first);
    assert_eq!(pay(&idem, lower.clone(), 5, &probe, Mode::Ok).await.unwrap(), second);
    assert_eq!(probe.runs(), 2);
    for (k, receipt) in [(&upper, &first), (&lower, &second)] {
        assert_eq!(record_rows_for(&idem, "t_pay", k).await, 1, "{k}");
        let status = idem.status("t_pay", k).await.unwrap();
        assert_eq!(status, Status::Completed { response: serde_json::to_string(receipt).unwrap() });
    }
}

with_and_without_redis!(
    #[tokio::test]
    keys_differing_only_in_case_are_two_keys,
    keys_differing_only_in_case_are_two_keys_with_redis => keys_differing_in_case_are_two_keys
);

#[idempotent(key = "<k>", ttl = "1h", biz = "t_bizno", biz_no = "<no>")]
async fn with_biz_no(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    no: String,
    #[idem(skip)] probe: &Probe,
) -> Result<usize, TestError> {
    body(tx, &k, 1, probe, Mode::Ok).await
}

/// `biz_no` is free text: whatever it holds lands in its column unchanged,
/// with Redis (record inserted last) and without (record completed last).
#[tokio::test]
async fn biz_no_is_stored_exactly() {
    let name = unique("db");
    let Some(claimed) = engine(&name, 4, Redis::On).await else { return };
    let Some(plain) = engine(&name, 4, Redis::Off).await else { return };
    let probe = Probe::default();
    let numbers = ["o'1", "back\\slash \\' \"", "caf\u{e9} \u{1f4b8}", "", "--; DROP TABLE idem_record"];
    for idem in [&claimed, &plain] {
        for no in numbers {
            let k = unique("bizno");
            with_biz_no(idem, k.clone(), no.to_owned(), &probe).await.unwrap();
            let stored: Option<String> =
                sqlx::query_scalar(B::BIZ_NO).bind("t_bizno").bind(&k).fetch_one(idem.pool()).await.unwrap();
            assert_eq!(stored.as_deref(), Some(no));
        }
    }
    assert_eq!(probe.runs(), 2 * numbers.len());
}

/// A `biz_no` past its 64-byte column is refused before anything is written,
/// with and without Redis: over servers that never answer the refusal is the
/// same, so nothing was sent. 64 bytes fit.
#[tokio::test]
async fn biz_no_longer_than_64_bytes_is_refused_before_any_write() {
    let name = unique("db");
    let Some(claimed) = engine(&name, 4, Redis::On).await else { return };
    let Some(plain) = engine(&name, 4, Redis::Off).await else { return };
    let unreachable = Idem::builder(B::dead_pool()).redis(redis::Client::open("redis://127.0.0.1:1").unwrap()).build();
    let probe = Probe::default();
    for (idem, reachable) in [(&claimed, true), (&plain, true), (&unreachable, false)] {
        let k = unique("bizno-long");
        let refused = with_biz_no(idem, k.clone(), "n".repeat(65), &probe).await;
        let too_long = matches!(refused, Err(TestError::Idem(idempotency::Error::BizNoTooLong { len: 65, max: 64 })));
        assert!(too_long, "{refused:?}");
        if !reachable {
            continue;
        }
        assert_eq!(record_rows_for(idem, "t_bizno", &k).await, 0);
        assert_eq!(ledger_rows(idem, &k).await, 0);
        assert_eq!(idem.status("t_bizno", &k).await.unwrap(), Status::Absent, "no record, no claim");
    }
    assert_eq!(probe.runs(), 0, "no body ran");

    let k = unique("bizno-64");
    assert_eq!(with_biz_no(&plain, k.clone(), "n".repeat(64), &probe).await.unwrap(), 1);
    let stored: Option<String> =
        sqlx::query_scalar(B::BIZ_NO).bind("t_bizno").bind(&k).fetch_one(plain.pool()).await.unwrap();
    assert_eq!(stored, Some("n".repeat(64)));
}
