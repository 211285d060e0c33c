//! The key rule. A key that breaks it is rejected, never escaped, trimmed or
//! hashed: any of those could merge two distinct keys into one.

use crate::error::{Error, KeyError};

/// Longest key: the `idem_key` column is `VARCHAR(255)`.
pub const MAX_KEY_LEN: usize = 255;
/// Shortest `Idempotency-Key` header: shorter values are too easy to collide.
pub const MIN_HEADER_KEY_LEN: usize = 8;

/// Checks a rendered key: `[A-Za-z0-9_.:-]{1,255}`.
pub fn validate_key(key: &str) -> Result<(), Error> {
    check(key, 1, MAX_KEY_LEN).map_err(Error::InvalidKey)
}

/// Longest `biz`: the `biz_type` column is `VARCHAR(32)`.
pub const MAX_BIZ_LEN: usize = 32;

/// Checks a business action name: `[a-z0-9_]{1,32}`, the rule the
/// attribute enforces on `biz` at compile time. Without `:`, `biz` and key
/// can never run together into another pair's Redis key.
pub fn validate_biz(biz: &str) -> Result<(), Error> {
    let ok = (1..=MAX_BIZ_LEN).contains(&biz.len())
        && biz.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok { Ok(()) } else { Err(Error::InvalidKey(KeyError::BadBiz)) }
}

/// Checks an `Idempotency-Key` header value: `[A-Za-z0-9_.:-]{8,255}`.
pub fn validate_header_key(key: &str) -> Result<(), Error> {
    check(key, MIN_HEADER_KEY_LEN, MAX_KEY_LEN).map_err(Error::InvalidKey)
}

fn check(key: &str, min: usize, max: usize) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Missing);
    }
    // Byte length first: a 10 MB value is refused before it is scanned.
    if key.len() > max {
        return Err(KeyError::TooLong { len: key.len(), max });
    }
    if let Some((at, ch)) = key.char_indices().find(|&(_, c)| !is_key_char(c)) {
        return Err(KeyError::BadChar { ch, at });
    }
    if key.len() < min {
        return Err(KeyError::TooShort { len: key.len(), min });
    }
    Ok(())
}

/// The characters a key may hold; safe in Redis keys, SQL, logs and headers.
pub fn is_key_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejects(key: &str) -> KeyError {
        match validate_key(key) {
            Err(Error::InvalidKey(e)) => e,
            other => panic!("{key:?} accepted: {other:?}"),
        }
    }

    #[test]
    fn accepts_the_whole_alphabet_up_to_255() {
        validate_key("order_42_pay").unwrap();
        validate_key("u-7:A.b_c").unwrap();
        validate_key(&"k".repeat(255)).unwrap();
        validate_key("x").unwrap();
    }

    #[test]
    fn rejects_with_the_reason() {
        assert_eq!(rejects(""), KeyError::Missing);
        assert_eq!(rejects(&"k".repeat(256)), KeyError::TooLong { len: 256, max: 255 });
        assert_eq!(rejects("a b"), KeyError::BadChar { ch: ' ', at: 1 });
        assert_eq!(rejects("a*"), KeyError::BadChar { ch: '*', at: 1 });
        assert_eq!(rejects("{x}"), KeyError::BadChar { ch: '{', at: 0 });
        assert_eq!(rejects("a\nb"), KeyError::BadChar { ch: '\n', at: 1 });
        assert_eq!(rejects("café"), KeyError::BadChar { ch: 'é', at: 3 });
        assert_eq!(rejects("a\0"), KeyError::BadChar { ch: '\0', at: 1 });
    }

    #[test]
    fn biz_names_are_lower_case_words() {
        validate_biz("pay").unwrap();
        validate_biz(&"a".repeat(32)).unwrap();
        for bad in ["", "Pay", "a:b", "a-b", "a.b", "café", &"a".repeat(33)] {
            assert!(matches!(validate_biz(bad), Err(Error::InvalidKey(KeyError::BadBiz))), "{bad:?}");
        }
    }

    #[test]
    fn header_keys_need_eight_characters() {
        validate_header_key("abcdefgh").unwrap();
        assert!(matches!(
            validate_header_key("abcdefg"),
            Err(Error::InvalidKey(KeyError::TooShort { len: 7, min: 8 }))
        ));
    }
}
