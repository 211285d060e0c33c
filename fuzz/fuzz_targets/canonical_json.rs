//! The fingerprint's canonical JSON, structure-aware: JSON values built
//! from the input (objects, arrays, strings of any characters, integers
//! and floats of every range), with serde_json's `preserve_order` on, so
//! that maps iterate in the order their keys were inserted.
//!
//! Checks: nothing panics; a value and a copy whose maps were filled in
//! another order are equal, write the same canonical bytes and have the
//! same fingerprint; two values built independently write the same bytes
//! exactly when they are equal; the canonical bytes parse back to the value
//! (so no two different values share them) and are canonical again; a
//! fingerprint is the SHA-256 of the canonical object of its arguments,
//! whatever their order, the last of a repeated name counting; a float
//! that is NaN or infinite anywhere in an argument is refused.
#![no_main]

use arbitrary::{Arbitrary, Result, Unstructured};
use idempotency_fuzz::alloc;
use idempotency_runtime::__fuzz;
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Number, Value};

/// How deep values nest: deep enough for any shape, shallow enough for
/// the recursion of the checks.
const MAX_DEPTH: usize = 8;
/// How many items an array or a map holds at most.
const MAX_LEN: u8 = 8;
/// Argument names: `Fingerprint::arg` takes `&'static str`.
const NAMES: [&str; 6] = ["order_id", "amount", "a", "b", "\u{e9}", "\"\\"];

fuzz_target!(|data: &[u8]| {
    alloc::bounded(data.len(), || {
        let _ = check(&mut Unstructured::new(data));
    });
});

fn check(u: &mut Unstructured<'_>) -> Result<()> {
    let a = value(u, 0)?;
    let order: Vec<u8> = Vec::arbitrary(u)?;
    let b = reordered(&a, &order, &mut 0);
    let canonical = __fuzz::canonical_json(&a);
    assert_eq!(a, b);
    assert_eq!(canonical, __fuzz::canonical_json(&b), "{a} and {b}");
    assert_eq!(__fuzz::fingerprint(&[("v", &a)]), __fuzz::fingerprint(&[("v", &b)]));

    let back: Value = serde_json::from_slice(&canonical).expect("canonical JSON parses");
    assert_eq!(back, a, "{}", String::from_utf8_lossy(&canonical));
    assert_eq!(__fuzz::canonical_json(&back), canonical);

    let c = value(u, 0)?;
    let same_bytes = __fuzz::canonical_json(&c) == canonical;
    assert_eq!(same_bytes, a == c, "{a} and {c}");

    arguments(u, [a, c])?;
    floats(u)
}

/// A fingerprint of named arguments is the hash of their canonical object.
fn arguments(u: &mut Unstructured<'_>, values: [Value; 2]) -> Result<()> {
    let mut args = Vec::new();
    for value in values {
        args.push((*u.choose(&NAMES)?, value));
    }
    let fingerprint = __fuzz::fingerprint(&args).expect("JSON values serialize");
    let object: Map<String, Value> = args.iter().map(|(name, value)| ((*name).to_owned(), value.clone())).collect();
    let expected = __fuzz::sha256_hex(&__fuzz::canonical_json(&Value::Object(object)));
    assert_eq!(fingerprint, expected);
    if args[0].0 != args[1].0 {
        args.reverse();
        assert_eq!(__fuzz::fingerprint(&args).unwrap(), fingerprint, "the order of arguments counts");
    }
    Ok(())
}

/// Floats as arguments hold: refused exactly when one is not finite.
fn floats(u: &mut Unstructured<'_>) -> Result<()> {
    let xs: Vec<Option<f64>> = Vec::arbitrary(u)?;
    let finite = xs.iter().flatten().all(|x| x.is_finite());
    let fingerprint = __fuzz::fingerprint(&[("xs", &xs)]);
    match fingerprint {
        Ok(_) => assert!(finite, "{xs:?}"),
        Err(e) => assert!(!finite && e.contains("NaN or infinite"), "{xs:?}: {e}"),
    }
    Ok(())
}

fn value(u: &mut Unstructured<'_>, depth: usize) -> Result<Value> {
    let kinds = if depth >= MAX_DEPTH { 6 } else { 8 };
    Ok(match u.int_in_range(0..=kinds - 1)? {
        0 => Value::Null,
        1 => Value::Bool(bool::arbitrary(u)?),
        2 => Value::from(u64::arbitrary(u)?),
        3 => Value::from(i64::arbitrary(u)?),
        4 => Number::from_f64(float(u)?).map_or(Value::Null, Value::Number),
        5 => Value::String(String::arbitrary(u)?),
        6 => Value::Array((0..u.int_in_range(0..=MAX_LEN)?).map(|_| value(u, depth + 1)).collect::<Result<_>>()?),
        _ => {
            let mut map = Map::new();
            for _ in 0..u.int_in_range(0..=MAX_LEN)? {
                map.insert(String::arbitrary(u)?, value(u, depth + 1)?);
            }
            Value::Object(map)
        }
    })
}

/// Any float, the edges of the range as often as the rest.
fn float(u: &mut Unstructured<'_>) -> Result<f64> {
    const EDGES: [f64; 9] = [0.0, -0.0, 1.0, -1.0, f64::MAX, f64::MIN, f64::MIN_POSITIVE, 5e-324, 1e21];
    if bool::arbitrary(u)? { Ok(*u.choose(&EDGES)?) } else { f64::arbitrary(u) }
}

/// `value` with every map filled anew, its entries rotated by the next
/// byte of `order` (its keys in another insertion order, same contents).
fn reordered(value: &Value, order: &[u8], next: &mut usize) -> Value {
    match value {
        Value::Array(items) => Value::Array(items.iter().map(|v| reordered(v, order, next)).collect()),
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            let turn = order.get(*next).copied().unwrap_or(1);
            *next += 1;
            if !entries.is_empty() {
                let by = usize::from(turn) % entries.len();
                entries.rotate_left(by);
                if turn & 0x80 != 0 {
                    entries.reverse();
                }
            }
            Value::Object(entries.into_iter().map(|(k, v)| (k.clone(), reordered(v, order, next))).collect())
        }
        scalar => scalar.clone(),
    }
}
