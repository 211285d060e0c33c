//! The key rule, and the `biz` and `biz_no` rules, as the runtime applies
//! them per call. The rules themselves live in `idempotency-rules`, which the
//! attribute checks its templates against at compile time: one definition,
//! so the two cannot drift. A key that breaks the rule is rejected, never
//! escaped, trimmed or hashed in its place: any of those could merge two
//! distinct keys. (The record table indexes a key by its [`key_digest`], but
//! stores the key itself beside it and checks it.)

pub use idempotency_rules::{MAX_BIZ_LEN, MAX_BIZ_NO_LEN, MAX_KEY_LEN, MIN_HEADER_KEY_LEN, is_key_char};

use crate::error::Error;

/// A key (or `biz_no`) rendered from its template, as `format!` would,
/// into room for a typical key: `format!` starts from the template's
/// literal text alone and grows the string as each value lands (three
/// allocations for `<user>:<idem_key>`, on every call). What the code the
/// attribute writes calls; not a stable API.
#[doc(hidden)]
pub fn render(pieces: std::fmt::Arguments<'_>) -> String {
    let mut out = String::with_capacity(64);
    // As `format!`: only a `Display` impl that breaks its contract fails.
    std::fmt::Write::write_fmt(&mut out, pieces).expect("a Display implementation returned an error unexpectedly");
    out
}

/// Checks a rendered key: `[A-Za-z0-9_.:-]{1,255}`.
pub fn validate_key(key: &str) -> Result<(), Error> {
    idempotency_rules::check_key(key, 1, MAX_KEY_LEN).map_err(Error::InvalidKey)
}

/// Checks an `Idempotency-Key` header value: `[A-Za-z0-9_.:-]{8,255}`.
pub fn validate_header_key(key: &str) -> Result<(), Error> {
    idempotency_rules::check_key(key, MIN_HEADER_KEY_LEN, MAX_KEY_LEN).map_err(Error::InvalidKey)
}

/// Checks a business action name: `[a-z0-9_]{1,32}`, the rule the
/// attribute enforces on `biz` at compile time ([`Error::InvalidBiz`]).
/// Without `:`, `biz` and key can never run together into another pair's
/// Redis key.
pub fn validate_biz(biz: &str) -> Result<(), Error> {
    if idempotency_rules::is_valid_biz(biz) { Ok(()) } else { Err(Error::InvalidBiz) }
}

/// Checks a rendered `biz_no`: at most 64 bytes, its column's width
/// ([`Error::BizNoTooLong`]), and storable as text ([`validate_text`]). Any
/// other characters are allowed: it is stored, never part of a Redis key.
pub fn validate_biz_no(no: &str) -> Result<(), Error> {
    if no.len() > MAX_BIZ_NO_LEN {
        return Err(Error::BizNoTooLong { len: no.len(), max: MAX_BIZ_NO_LEN });
    }
    validate_text("biz_no", no)
}

/// Checks text the engine stores as it was given (`biz_no`, an outbox
/// event's destination, aggregate and payload): every backend's text columns
/// take it. PostgreSQL refuses a NUL character in text (`22021`, a failure
/// that recurs on every try); MySQL and SQLite would store it, so it is
/// refused on all three alike, before anything is written
/// ([`Error::InvalidText`]). Every other character is text everywhere.
pub fn validate_text(field: &'static str, text: &str) -> Result<(), Error> {
    match text.bytes().position(|b| b == 0) {
        None => Ok(()),
        Some(at) => Err(Error::InvalidText { field, at }),
    }
}

/// The 16-byte digest of `(biz, key)`: the first half of SHA-256 over
/// `biz`, a zero byte and `key`. The record table's unique column
/// (`idem_record.key_digest`) and the Redis result field are both this
/// value; 128 bits keep distinct keys apart (a collision is expected after
/// about 2^64 keys), and the full key is kept beside it and checked.
/// In SQL: `UNHEX(LEFT(SHA2(CONCAT(biz_type, CHAR(0), idem_key), 256), 32))`
/// on MySQL, `encode(substring(sha256(convert_to(biz_type, 'UTF8') ||
/// decode('00', 'hex') || convert_to(idem_key, 'UTF8')) FROM 1 FOR 16),
/// 'hex')::uuid` on PostgreSQL.
pub fn key_digest(biz: &str, key: &str) -> [u8; 16] {
    use sha2::{Digest, Sha256};
    let full = Sha256::new().chain_update(biz).chain_update([0]).chain_update(key).finalize();
    let mut digest = [0; 16];
    digest.copy_from_slice(&full[..16]);
    digest
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::KeyError;

    #[test]
    fn the_digest_is_half_of_sha256_over_biz_nul_key() {
        // sha256(b"pay\0order_1"), as `printf 'pay\0order_1' | sha256sum` prints it.
        let hex: String = key_digest("pay", "order_1").iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "6a1e907f9089e8b5c2dfa774f4e9c791");
        assert_ne!(key_digest("pay", "order_1"), key_digest("pa", "yorder_1"));
    }

    #[test]
    fn keys_are_one_to_255_key_characters() {
        validate_key("x").unwrap();
        validate_key(&"k".repeat(255)).unwrap();
        assert!(matches!(validate_key(""), Err(Error::InvalidKey(KeyError::Missing))));
        assert!(matches!(
            validate_key(&"k".repeat(256)),
            Err(Error::InvalidKey(KeyError::TooLong { len: 256, max: 255 }))
        ));
        assert!(matches!(validate_key("a b"), Err(Error::InvalidKey(KeyError::BadChar { ch: ' ', at: 1 }))));
    }

    #[test]
    fn header_keys_need_eight_characters() {
        validate_header_key("abcdefgh").unwrap();
        assert!(matches!(
            validate_header_key("abcdefg"),
            Err(Error::InvalidKey(KeyError::TooShort { len: 7, min: 8 }))
        ));
    }

    #[test]
    fn biz_names_are_lower_case_words() {
        validate_biz("pay").unwrap();
        validate_biz(&"a".repeat(32)).unwrap();
        for bad in ["", "Pay", "a:b", "a-b", "a.b", "café", &"a".repeat(33)] {
            assert!(matches!(validate_biz(bad), Err(Error::InvalidBiz)), "{bad:?}");
        }
    }

    #[test]
    fn biz_numbers_fit_64_bytes() {
        validate_biz_no("").unwrap();
        validate_biz_no(&"n".repeat(64)).unwrap();
        validate_biz_no("any text: é ü").unwrap();
        assert!(matches!(validate_biz_no(&"n".repeat(65)), Err(Error::BizNoTooLong { len: 65, max: 64 })));
        assert!(matches!(validate_biz_no(&"é".repeat(33)), Err(Error::BizNoTooLong { len: 66, max: 64 })));
    }
}
