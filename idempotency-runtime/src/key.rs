//! The key rule, and the `biz` and `biz_no` rules, as the runtime applies
//! them per call. The rules themselves live in `idempotency-rules`, which the
//! attribute checks its templates against at compile time: one definition,
//! so the two cannot drift. A key that breaks the rule is rejected, never
//! escaped, trimmed or hashed: any of those could merge two distinct keys.

pub use idempotency_rules::{MAX_BIZ_LEN, MAX_BIZ_NO_LEN, MAX_KEY_LEN, MIN_HEADER_KEY_LEN, is_key_char};

use crate::error::Error;

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
/// ([`Error::BizNoTooLong`]). Any characters are allowed: it is stored, never
/// part of a Redis key.
pub fn validate_biz_no(no: &str) -> Result<(), Error> {
    if no.len() <= MAX_BIZ_NO_LEN { Ok(()) } else { Err(Error::BizNoTooLong { len: no.len(), max: MAX_BIZ_NO_LEN }) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::KeyError;

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
