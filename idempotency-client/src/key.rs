//! Keys: one made for each logical request (a random UUID), or the caller's
//! own, checked against the rule the server applies before anything is sent.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use idempotency_rules::{KeyError, MAX_KEY_LEN, MIN_HEADER_KEY_LEN, check_key};

/// A new key: a random (version 4) UUID, 36 characters, e.g.
/// `0b6a3e5e-1f2d-4c1a-9a53-2f7d1c9e8b41`.
///
/// The middleware makes one for every logical request that has none; call
/// this yourself to store the key with the business object first (an order
/// and the key that pays it) and send it again after a restart.
pub fn new_key() -> String {
    let mut bytes = [0u8; 16];
    fill_random(&mut bytes);
    bytes[6] = (bytes[6] & 0x0f) | 0x40; // version 4
    bytes[8] = (bytes[8] & 0x3f) | 0x80; // RFC 9562 variant
    let mut key = String::with_capacity(36);
    for (i, byte) in bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            key.push('-');
        }
        key.push(char::from(HEX[usize::from(byte >> 4)]));
        key.push(char::from(HEX[usize::from(byte & 0x0f)]));
    }
    key
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Random bytes from the operating system; where it cannot answer, std's
/// `RandomState` over the time and a counter (never two equal draws in one
/// process, and another process's keys differ by their hasher's keys).
pub(crate) fn fill_random(out: &mut [u8]) {
    if getrandom::fill(out).is_err() {
        fill_fallback(out);
    }
}

fn fill_fallback(out: &mut [u8]) {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    for chunk in out.chunks_mut(8) {
        let mut hasher = RandomState::new().build_hasher();
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        hasher.write_u128(nanos);
        hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        chunk.copy_from_slice(&hasher.finish().to_le_bytes()[..chunk.len()]);
    }
}

/// A caller's key the server would refuse (400 `INVALID_IDEMPOTENCY_KEY`):
/// refused here instead, before anything is sent. The key itself is never
/// repeated: it may hold anything.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the Idempotency-Key is invalid ({reason}); keys are 8 to 255 characters from A-Z a-z 0-9 _ . : -, bare or in double quotes; nothing was sent"
)]
pub struct InvalidKey {
    reason: Reason,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Reason {
    Rule(KeyError),
    NotVisibleAscii,
    BadQuoting,
    SentTwice,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Rule(error) => error.fmt(f),
            Reason::NotVisibleAscii => f.write_str("it holds bytes that are not visible ASCII"),
            Reason::BadQuoting => f.write_str("a quoted key must be one pair of double quotes around the key"),
            Reason::SentTwice => f.write_str("the header is set more than once"),
        }
    }
}

/// Checks a key as the server checks its `Idempotency-Key` header:
/// `[A-Za-z0-9_.:-]{8,255}`, bare or in double quotes. Returns the key
/// without its quotes.
pub fn check(key: &str) -> Result<&str, InvalidKey> {
    check_bytes(key.as_bytes())
}

/// [`check`] on a header's raw bytes.
pub(crate) fn check_bytes(value: &[u8]) -> Result<&str, InvalidKey> {
    let invalid = |reason| Err(InvalidKey { reason });
    let Ok(text) = std::str::from_utf8(value) else { return invalid(Reason::NotVisibleAscii) };
    let bare = match text.strip_prefix('"') {
        None => text,
        Some(quoted) => match quoted.strip_suffix('"') {
            Some(inner) if !inner.contains(['"', '\\']) => inner,
            _ => return invalid(Reason::BadQuoting),
        },
    };
    match check_key(bare, MIN_HEADER_KEY_LEN, MAX_KEY_LEN) {
        Ok(()) => Ok(bare),
        Err(KeyError::BadChar { ch, .. }) if !(' '..='~').contains(&ch) => invalid(Reason::NotVisibleAscii),
        Err(error) => invalid(Reason::Rule(error)),
    }
}

/// The key of a request's headers: `Ok(None)` when it has none, the caller's
/// own when it has one that keeps the rule.
pub(crate) fn of_headers(headers: &http::HeaderMap) -> Result<Option<String>, InvalidKey> {
    let mut values = headers.get_all(crate::header::IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else { return Ok(None) };
    if values.next().is_some() {
        return Err(InvalidKey { reason: Reason::SentTwice });
    }
    check_bytes(value.as_bytes()).map(|key| Some(key.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_keys_are_uuids_that_keep_the_rule_and_never_repeat() {
        let keys: std::collections::HashSet<String> = (0..10_000).map(|_| new_key()).collect();
        assert_eq!(keys.len(), 10_000);
        for key in &keys {
            assert_eq!(check(key), Ok(key.as_str()));
            assert_eq!(key.len(), 36);
            assert_eq!((&key[14..15], key.matches('-').count()), ("4", 4), "{key}");
        }
    }

    #[test]
    fn the_fallback_never_draws_the_same_twice() {
        let draws: std::collections::HashSet<[u8; 16]> = (0..10_000)
            .map(|_| {
                let mut bytes = [0u8; 16];
                fill_fallback(&mut bytes);
                bytes
            })
            .collect();
        assert_eq!(draws.len(), 10_000);
    }

    #[test]
    fn caller_keys_follow_the_header_rule() {
        assert_eq!(check("order-42-pay"), Ok("order-42-pay"));
        assert_eq!(check("\"order-42-pay\""), Ok("order-42-pay"));
        let refused = [
            ("short", "5 characters, at least 8 required"),
            ("order 42 pay", "character U+0020 at byte 5"),
            ("order-42-pay\u{e9}", "not visible ASCII"),
            ("order-42\tpay", "not visible ASCII"),
            ("\"order-42-pay", "one pair of double quotes"),
            ("\"order\"-42-pay\"", "one pair of double quotes"),
            ("\"order\\-42-pay\"", "one pair of double quotes"),
            ("", "no key given"),
        ];
        for (key, reason) in refused {
            let error = check(key).expect_err(key).to_string();
            assert!(error.contains(reason) && error.ends_with("nothing was sent"), "{key:?}: {error}");
            assert!(!error.contains("order") && !error.contains("short"), "the key is not repeated: {error}");
        }
        assert!(check_bytes(b"order-42\xffpay").is_err());
    }

    #[test]
    fn a_header_sent_twice_is_refused() {
        let mut headers = http::HeaderMap::new();
        assert_eq!(of_headers(&headers), Ok(None));
        headers.append("idempotency-key", http::HeaderValue::from_static("order-42-pay"));
        assert_eq!(of_headers(&headers), Ok(Some("order-42-pay".into())));
        headers.append("idempotency-key", http::HeaderValue::from_static("order-42-pay"));
        assert!(of_headers(&headers).unwrap_err().to_string().contains("more than once"));
    }
}
