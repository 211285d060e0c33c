//! The key rule: `[A-Za-z0-9_.:-]`, bounded lengths. A key that breaks it is
//! rejected, never escaped, trimmed or hashed: any of those could merge two
//! distinct keys into one.

use std::fmt;

use crate::Shown;

/// Longest key: the `idem_key` column is `VARCHAR(255)`.
pub const MAX_KEY_LEN: usize = 255;
/// Shortest `Idempotency-Key` header: shorter values are too easy to collide.
pub const MIN_HEADER_KEY_LEN: usize = 8;

/// The characters a key may hold; safe in Redis keys, SQL, logs and headers.
pub const fn is_key_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-')
}

/// [`is_key_char`] for each byte: the alphabet is ASCII, so a key is
/// checked a byte at a time (every call checks one, often two).
const KEY_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 128 {
        table[b] = is_key_char(b as u8 as char);
        b += 1;
    }
    table
};

/// Checks `key` against the alphabet and a length of `min..=max` bytes.
///
/// The byte length is checked before the characters, so a value of many
/// megabytes is refused without being scanned; an empty key is
/// [`KeyError::Missing`] whatever `min` is.
pub fn check_key(key: &str, min: usize, max: usize) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Missing);
    }
    if key.len() > max {
        return Err(KeyError::TooLong { len: key.len(), max });
    }
    if !key.bytes().all(|b| KEY_BYTES[usize::from(b)])
        && let Some((at, ch)) = key.char_indices().find(|&(_, c)| !is_key_char(c))
    {
        return Err(KeyError::BadChar { ch, at });
    }
    if key.len() < min {
        return Err(KeyError::TooShort { len: key.len(), min });
    }
    Ok(())
}

/// Why a key was rejected. Carries no copy of the key: it may hold anything
/// the caller sent, including control characters.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// No key at all (missing header, or a template rendered to nothing).
    Missing,
    /// Shorter than the minimum length.
    TooShort {
        /// Length in bytes.
        len: usize,
        /// Minimum allowed.
        min: usize,
    },
    /// Longer than the maximum length.
    TooLong {
        /// Length in bytes.
        len: usize,
        /// Maximum allowed.
        max: usize,
    },
    /// A character outside `[A-Za-z0-9_.:-]`.
    BadChar {
        /// The offending character.
        ch: char,
        /// Its byte offset.
        at: usize,
    },
}

/// Shows an offending character only as visible ASCII or as its code point
/// (see [`Shown`]), so the message is safe in logs and HTTP responses.
impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Missing => f.write_str("no key given"),
            KeyError::TooShort { len, min } => write!(f, "{len} characters, at least {min} required"),
            KeyError::TooLong { len, max } => write!(f, "{len} bytes, at most {max} allowed"),
            KeyError::BadChar { ch, at } => {
                write!(f, "character {} at byte {at}; only A-Z a-z 0-9 _ . : - are allowed", Shown(*ch))
            }
        }
    }
}

impl std::error::Error for KeyError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejects(key: &str) -> KeyError {
        check_key(key, 1, MAX_KEY_LEN).expect_err(key)
    }

    #[test]
    fn accepts_the_whole_alphabet_up_to_255() {
        for key in ["order_42_pay", "u-7:A.b_c", &"k".repeat(255), "x"] {
            assert_eq!(check_key(key, 1, MAX_KEY_LEN), Ok(()), "{key:?}");
        }
    }

    #[test]
    fn the_byte_table_is_the_alphabet() {
        // Every ASCII character and a few beyond, alone and after a good one.
        for c in (0..=0x7fu8).map(char::from).chain(['é', 'ä', '€', '\u{80}', '\u{10ffff}']) {
            for key in [c.to_string(), format!("k{c}")] {
                let bad = (!is_key_char(c)).then(|| KeyError::BadChar { ch: c, at: key.len() - c.len_utf8() });
                assert_eq!(check_key(&key, 1, MAX_KEY_LEN).err(), bad, "{key:?}");
            }
        }
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
    fn the_minimum_applies_after_the_alphabet() {
        assert_eq!(check_key("abcdefgh", MIN_HEADER_KEY_LEN, MAX_KEY_LEN), Ok(()));
        assert_eq!(check_key("abcdefg", MIN_HEADER_KEY_LEN, MAX_KEY_LEN), Err(KeyError::TooShort { len: 7, min: 8 }));
        assert_eq!(check_key("a b", MIN_HEADER_KEY_LEN, MAX_KEY_LEN), Err(KeyError::BadChar { ch: ' ', at: 1 }));
        assert_eq!(check_key("", MIN_HEADER_KEY_LEN, MAX_KEY_LEN), Err(KeyError::Missing));
    }

    #[test]
    fn messages_name_the_reason_without_the_key() {
        assert_eq!(KeyError::Missing.to_string(), "no key given");
        assert_eq!(KeyError::TooShort { len: 7, min: 8 }.to_string(), "7 characters, at least 8 required");
        assert_eq!(KeyError::TooLong { len: 300, max: 255 }.to_string(), "300 bytes, at most 255 allowed");
        let error: &dyn std::error::Error = &KeyError::Missing;
        assert!(error.source().is_none());
    }

    #[test]
    fn bad_characters_show_as_visible_ascii_or_code_points() {
        let shown = |ch| KeyError::BadChar { ch, at: 3 }.to_string();
        assert_eq!(shown(' '), "character U+0020 at byte 3; only A-Z a-z 0-9 _ . : - are allowed");
        assert_eq!(shown('*'), "character '*' at byte 3; only A-Z a-z 0-9 _ . : - are allowed");
        for (ch, code) in [
            ('\n', "U+000A"),
            ('\0', "U+0000"),
            ('\u{7f}', "U+007F"),
            ('é', "U+00E9"),
            ('\u{202e}', "U+202E"),
            ('\'', "U+0027"),
            ('\u{1F600}', "U+1F600"),
        ] {
            let text = shown(ch);
            assert!(text.contains(code) && text.is_ascii() && !text.chars().any(|c| c.is_ascii_control()), "{text:?}");
        }
    }
}
