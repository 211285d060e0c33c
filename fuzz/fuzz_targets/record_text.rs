//! The record's statements as SQL texts with their values written in
//! (`store::text`): the keys, `biz_no`s, fingerprints and results a caller
//! hands over, and the integers the engine adds. Input: arbitrary values,
//! drawn from the bytes (`arbitrary`).
//!
//! Checks, for every text either server is sent: it parses as the intended
//! statements whatever the values hold. Between quotes there is nothing but
//! hex digits where a value goes, and the text with each value's literal
//! and each integer blanked out is the same as the one written from plain
//! values (no quote, semicolon or comment of a value's ever reaches the
//! SQL around it); and the literals, read as hex, give back the values, in
//! their columns' order, byte for byte.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use idempotency_fuzz::alloc;
use idempotency_runtime::__fuzz::{self, RecordValues};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    alloc::bounded(data.len(), || check(data));
});

fn check(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok((biz, key, biz_no, params_hash, response)) =
        <(String, String, Option<String>, String, Option<String>)>::arbitrary(&mut u)
    else {
        return;
    };
    let Ok((status, now_ms, expires_ms, bound)) = <(i16, i64, i64, i64)>::arbitrary(&mut u) else { return };
    let values = RecordValues {
        biz: &biz,
        key: &key,
        biz_no: biz_no.as_deref(),
        params_hash: &params_hash,
        status,
        response: response.as_deref(),
        now_ms,
        expires_ms,
    };
    // The same shape (what is NULL, what is not) from plain values.
    let plain = RecordValues {
        biz: "b",
        key: "k",
        biz_no: biz_no.as_ref().map(|_| "n"),
        params_hash: "p",
        status: 0,
        response: response.as_ref().map(|_| "r"),
        now_ms: 0,
        expires_ms: 0,
    };
    let (digest, texts) = __fuzz::record_texts(values, bound);
    let (_, plain_texts) = __fuzz::record_texts(plain, 0);
    assert_eq!(texts.len(), plain_texts.len());
    for ((dialect, what, sql), (_, _, plain_sql)) in texts.iter().zip(&plain_texts) {
        let (shape, literals) = read(sql);
        assert_eq!(shape, read(plain_sql).0, "{dialect} {what}: {sql:?}");
        let record = [Some(&digest[..]), Some(biz.as_bytes()), Some(key.as_bytes())];
        let expected: Vec<&[u8]> = match *what {
            "insert" | "begin_inserting" | "insert_committing" => record
                .into_iter()
                .chain([biz_no.as_ref().map(|s| s.as_bytes()), Some(params_hash.as_bytes())])
                .chain([response.as_ref().map(|s| s.as_bytes())])
                .flatten()
                .collect(),
            _ => [response.as_ref().map(|s| s.as_bytes())].into_iter().chain(record).flatten().collect(),
        };
        assert_eq!(literals, expected, "{dialect} {what}: {sql:?}");
    }
}

/// The text with every all-hex literal blanked (`'?'`) and every integer
/// outside quotes too (`#`), and the blanked literals' bytes. Panics on a
/// literal left open or a hex literal of odd length.
fn read(sql: &str) -> (String, Vec<Vec<u8>>) {
    let (mut shape, mut literals) = (String::new(), Vec::new());
    let bytes = sql.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\'' => {
                let end = i + 1 + sql[i + 1..].find('\'').unwrap_or_else(|| panic!("a literal left open: {sql:?}"));
                let content = &sql[i + 1..end];
                if content.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
                    assert_eq!(content.len() % 2, 0, "odd hex: {sql:?}");
                    let decoded = (0..content.len() / 2)
                        .map(|n| u8::from_str_radix(&content[2 * n..2 * n + 2], 16).expect("hex"))
                        .collect();
                    literals.push(decoded);
                    shape.push_str("'?'");
                } else {
                    // Fixed SQL's own strings ('hex', 'UTF8', a setting's name).
                    shape.push_str(&sql[i..=end]);
                }
                i = end + 1;
            }
            b'0'..=b'9' | b'-' if bytes[i] != b'-' || bytes.get(i + 1).is_some_and(u8::is_ascii_digit) => {
                i += 1;
                while bytes.get(i).is_some_and(u8::is_ascii_digit) {
                    i += 1;
                }
                shape.push('#');
            }
            b => {
                assert!(b.is_ascii() && b != 0, "a byte outside quotes that fixed SQL never holds: {sql:?}");
                shape.push(char::from(b));
                i += 1;
            }
        }
    }
    (shape, literals)
}
