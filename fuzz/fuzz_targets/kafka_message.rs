//! What the Kafka consumer runner reads of a message before its handler
//! runs: the message id (`Idem-Message-Id`), the retry count
//! (`Idem-Retries`) and the JSON payload, from headers as Kafka hands them
//! over (a list of names and optional byte values, a name possibly
//! repeated). Input: headers, each a byte choosing its name (the two the
//! runner reads, a near miss in case, or a name from the input), a byte
//! saying whether it has a value, and the value; then whether there is a
//! payload, and the payload.
//!
//! Checks: nothing panics; as Kafka's `lastHeader`, the last header of a
//! name counts; the id is its value exactly when that is UTF-8, else none
//! (never a lossy copy); the count is its value when that is ASCII digits
//! within `u64`, else 0; decoding succeeds exactly when there is a payload,
//! an id and JSON, and yields both unchanged; it fails with `no payload`,
//! `no ...` (the id) or `payload: ...`, in that order.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use idempotency_fuzz::alloc;
use idempotency_runtime::__fuzz;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const ID: &str = "Idem-Message-Id";
const RETRIES: &str = "Idem-Retries";

fuzz_target!(|data: &[u8]| {
    alloc::bounded(data.len(), || check(data));
});

fn check(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let mut headers: Vec<(String, Option<Vec<u8>>)> = Vec::new();
    while u.arbitrary::<bool>().unwrap_or(false) {
        let Ok(pick) = u8::arbitrary(&mut u) else { break };
        let name = match pick % 4 {
            0 => ID.to_owned(),
            1 => RETRIES.to_owned(),
            2 => "idem-retries".to_owned(),
            _ => String::arbitrary(&mut u).unwrap_or_default(),
        };
        let value = match bool::arbitrary(&mut u).unwrap_or(false) {
            true => Some(Vec::<u8>::arbitrary(&mut u).unwrap_or_default()),
            false => None,
        };
        headers.push((name, value));
    }
    let payload: Option<Vec<u8>> = match bool::arbitrary(&mut u).unwrap_or(false) {
        true => Some(u.take_rest().to_vec()),
        false => None,
    };
    let pairs: Vec<(&str, Option<&[u8]>)> = headers.iter().map(|(n, v)| (n.as_str(), v.as_deref())).collect();
    let consumed = __fuzz::kafka_message(&pairs, payload.as_deref());

    let last = |name: &str| pairs.iter().rev().find(|(n, _)| *n == name).and_then(|(_, v)| *v);
    let id = last(ID).and_then(|v| std::str::from_utf8(v).ok()).map(str::to_owned);
    assert_eq!(consumed.message_id, id);
    let count = last(RETRIES)
        .filter(|v| !v.is_empty() && v.iter().all(u8::is_ascii_digit))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse::<u64>().ok())
        .unwrap_or(0);
    assert_eq!(consumed.count, count, "{:?}", last(RETRIES));

    let json: Option<Value> = payload.as_deref().and_then(|p| serde_json::from_slice(p).ok());
    match (&consumed.decoded, &payload, id, json) {
        (Ok((got_id, got)), Some(_), Some(id), Some(json)) => assert!(*got_id == id && *got == json),
        (Err(why), None, _, _) => assert_eq!(why, "no payload"),
        (Err(why), Some(_), None, _) => assert!(why.starts_with("no "), "{why}"),
        (Err(why), Some(_), Some(_), None) => assert!(why.starts_with("payload: "), "{why}"),
        (decoded, payload, id, json) => panic!("decoded {decoded:?} from {payload:?}, id {id:?}, json {json:?}"),
    }
}
