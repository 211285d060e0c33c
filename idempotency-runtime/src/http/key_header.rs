//! The header rules on raw bytes: the client's `Idempotency-Key` (bare or
//! as a structured-field string) and the server-issued `Idempotency-Token`,
//! each refused with the exact reason before anything is written. Any
//! transport that carries these values (HTTP headers, gRPC metadata) calls
//! the `from_header_values` entries with the bytes it received.

use serde::{Deserialize, Serialize};

use super::framework::RequestHeaders;
use super::header;
use super::problem::{KEY_RULE, ProblemDetails};
use crate::error::{Error, KeyError};
use crate::key::validate_header_key;
use crate::token::is_well_formed;

/// The request's `Idempotency-Key` header, checked against
/// `[A-Za-z0-9_.:-]{8,255}`, bare (`abc-123-xyz`) or as a structured-field
/// string (`"abc-123-xyz"`, unquoted here: both are the same key). As an
/// extractor (axum, actix-web) it refuses the request with 400
/// (`MISSING_IDEMPOTENCY_KEY` or `INVALID_IDEMPOTENCY_KEY`) before the
/// handler runs; nothing is written for such a request.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct IdempotencyKey(pub String);

impl IdempotencyKey {
    /// Reads and checks the key from a request's headers (axum's
    /// `http::HeaderMap`, actix-web's `HeaderMap`); the problem carries the
    /// framework's status.
    pub fn from_headers<H: RequestHeaders + ?Sized>(headers: &H) -> Result<Self, ProblemDetails<H::Status>> {
        Self::from_header_values(headers.header_values(header::IDEMPOTENCY_KEY)).map_err(ProblemDetails::convert)
    }

    /// The key rule on raw bytes: every value the request carried under the
    /// key's name, in order (none: missing; two: refused, as neither can be
    /// trusted to be "the" key).
    pub fn from_header_values<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> Result<Self, ProblemDetails> {
        let mut values = values.into_iter();
        let Some(value) = values.next() else {
            return Err(ProblemDetails::missing_key());
        };
        if values.next().is_some() {
            return Err(ProblemDetails::invalid_key("the Idempotency-Key header was sent more than once".into()));
        }
        // The common case first, in one pass: key characters alone are
        // visible ASCII and hold no quote, so such a value is the key as sent.
        if let Ok(text) = std::str::from_utf8(value)
            && validate_header_key(text).is_ok()
        {
            return Ok(IdempotencyKey(text.to_owned()));
        }
        let Some(text) = visible_ascii(value) else {
            return Err(ProblemDetails::invalid_key(format!(
                "the Idempotency-Key header holds bytes that are not visible ASCII; {KEY_RULE}"
            )));
        };
        let Some(quoted) = text.strip_prefix('"') else {
            return match validate_header_key(text) {
                Ok(()) => Ok(IdempotencyKey(text.to_owned())),
                Err(Error::InvalidKey(KeyError::Missing)) => Err(ProblemDetails::missing_key()),
                Err(Error::InvalidKey(reason)) => Err(ProblemDetails::invalid_header_key(&reason)),
                Err(e) => Err(ProblemDetails::from(&e)),
            };
        };
        // A structured-field string: `"`, then characters where `\` escapes
        // `"` or `\`, then `"`. No key character needs an escape, so any
        // quote or backslash inside is refused rather than decoded.
        let Some(inner) = quoted.strip_suffix('"') else {
            return Err(ProblemDetails::invalid_key(format!(
                "the Idempotency-Key header opens a quoted string that does not end with its closing quote; {KEY_RULE}"
            )));
        };
        if inner.contains(['"', '\\']) {
            return Err(ProblemDetails::invalid_key(format!(
                "the quoted Idempotency-Key holds a quote or a backslash escape; {KEY_RULE}"
            )));
        }
        match validate_header_key(inner) {
            Ok(()) => Ok(IdempotencyKey(inner.to_owned())),
            Err(Error::InvalidKey(KeyError::Missing)) => {
                Err(ProblemDetails::invalid_key(format!("the quoted Idempotency-Key is empty; {KEY_RULE}")))
            }
            // Offsets count from the header's first byte, the opening quote.
            Err(Error::InvalidKey(KeyError::BadChar { ch, at })) => {
                Err(ProblemDetails::invalid_header_key(&KeyError::BadChar { ch, at: at + 1 }))
            }
            Err(Error::InvalidKey(reason)) => Err(ProblemDetails::invalid_header_key(&reason)),
            Err(e) => Err(ProblemDetails::from(&e)),
        }
    }

    /// The key, unquoted.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The value as text when every byte is visible ASCII or a tab (what
/// `HeaderValue::to_str` accepts in both http 0.2 and 1); tabs then meet
/// the key rule, which names them by code point.
fn visible_ascii(value: &[u8]) -> Option<&str> {
    let visible = value.iter().all(|&b| b == b'\t' || (b' '..=b'~').contains(&b));
    if visible { std::str::from_utf8(value).ok() } else { None }
}

/// The request's `Idempotency-Token` header: a token the server issued
/// ([`Idem::tokens`](crate::Idem::tokens)), bare or as a structured-field
/// string (`"..."`). Checked for shape only (32 characters of base64url);
/// whether it was issued, to whom, and whether it is used is for
/// [`Tokens::redeem`](crate::Tokens::redeem) to say. A header that cannot
/// be a token (or is sent twice) is refused like a forged token: 403
/// `IDEMPOTENCY_TOKEN_INVALID`, before the handler runs. As an extractor it
/// requires the header (403 without it too); in axum take
/// `Option<IdempotencyToken>` where it is one way among others, or (in
/// either framework) [`KeyOrToken`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct IdempotencyToken(pub String);

impl IdempotencyToken {
    /// Reads and checks the token from a request's headers: `Ok(None)` when
    /// there is none.
    pub fn from_headers<H: RequestHeaders + ?Sized>(headers: &H) -> Result<Option<Self>, ProblemDetails<H::Status>> {
        Self::from_header_values(headers.header_values(header::IDEMPOTENCY_TOKEN)).map_err(ProblemDetails::convert)
    }

    /// The token rule on raw bytes: every value the request carried under
    /// the token's name, in order; `Ok(None)` for none.
    pub fn from_header_values<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> Result<Option<Self>, ProblemDetails> {
        let mut values = values.into_iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(ProblemDetails::token_invalid());
        }
        let text = visible_ascii(value).unwrap_or_default();
        let token = text.strip_prefix('"').and_then(|quoted| quoted.strip_suffix('"')).unwrap_or(text);
        if is_well_formed(token) {
            Ok(Some(IdempotencyToken(token.to_owned())))
        } else {
            Err(ProblemDetails::token_invalid())
        }
    }

    /// The token, unquoted.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Either way a request may name its call: a client's `Idempotency-Key`,
/// or an `Idempotency-Token` the server issued. Neither: 400
/// `MISSING_IDEMPOTENCY_KEY`; both: 400 `INVALID_IDEMPOTENCY_KEY` (which
/// one counts would be a guess); a malformed key: 400 as for
/// [`IdempotencyKey`]; a malformed token: 403 as for [`IdempotencyToken`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyOrToken {
    /// The client's key.
    Key(IdempotencyKey),
    /// The token the server issued.
    Token(IdempotencyToken),
}

impl KeyOrToken {
    /// Reads and checks either header.
    pub fn from_headers<H: RequestHeaders + ?Sized>(headers: &H) -> Result<Self, ProblemDetails<H::Status>> {
        let keys = headers.header_values(header::IDEMPOTENCY_KEY);
        Self::from_header_values(keys, headers.header_values(header::IDEMPOTENCY_TOKEN))
            .map_err(ProblemDetails::convert)
    }

    /// Both rules on raw bytes: the values sent under the key's name and
    /// under the token's.
    pub fn from_header_values<'a>(
        keys: impl IntoIterator<Item = &'a [u8]>,
        tokens: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<Self, ProblemDetails> {
        let mut keys = keys.into_iter().peekable();
        let has_key = keys.peek().is_some();
        match IdempotencyToken::from_header_values(tokens)? {
            Some(_) if has_key => Err(ProblemDetails::invalid_key(
                "send either an Idempotency-Key or an Idempotency-Token, not both".into(),
            )),
            Some(token) => Ok(KeyOrToken::Token(token)),
            None if has_key => IdempotencyKey::from_header_values(keys).map(KeyOrToken::Key),
            None => Err(ProblemDetails::missing_key_or_token()),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn key_from(values: &[&[u8]]) -> Result<IdempotencyKey, ProblemDetails> {
        IdempotencyKey::from_header_values(values.iter().copied())
    }

    fn code(values: &[&[u8]]) -> &'static str {
        match key_from(values) {
            Ok(k) => panic!("{k:?} accepted"),
            Err(p) => {
                assert_eq!(p.status, 400);
                p.code
            }
        }
    }

    #[test]
    fn accepts_keys_of_8_to_255_characters() {
        assert_eq!(key_from(&[b"abcdefgh"]).unwrap().as_str(), "abcdefgh");
        let long = "A0_.:-".repeat(42) + "abc";
        assert_eq!(long.len(), 255);
        assert_eq!(key_from(&[long.as_bytes()]).unwrap().0, long);
        assert_eq!(key_from(&[b"9f1c2e4a-7b7e-4c1d-a1d4-2b6f0f1e9a10"]).unwrap().0.len(), 36);
    }

    #[test]
    fn refuses_missing_and_malformed_keys() {
        assert_eq!(code(&[]), "MISSING_IDEMPOTENCY_KEY");
        assert_eq!(code(&[b""]), "MISSING_IDEMPOTENCY_KEY");
        let too_long = "k".repeat(256);
        for bad in [&b"a b"[..], b"{x}", b"abcdefg", too_long.as_bytes(), b"abcdefgh\xff", b"abcd efgh", b"abcdefgh/"] {
            assert_eq!(code(&[bad]), "INVALID_IDEMPOTENCY_KEY", "{:?}", String::from_utf8_lossy(bad));
        }
        assert_eq!(code(&[b"abcdefgh", b"abcdefgh"]), "INVALID_IDEMPOTENCY_KEY");
    }

    #[test]
    fn quoted_keys_are_the_same_keys_unquoted() {
        assert_eq!(key_from(&[b"\"abcdefgh\""]).unwrap(), key_from(&[b"abcdefgh"]).unwrap());
        assert_eq!(key_from(&[b"\"abcdefgh\""]).unwrap().as_str(), "abcdefgh");
        let long = "A0_.:-".repeat(42) + "abc";
        assert_eq!(key_from(&[format!("\"{long}\"").as_bytes()]).unwrap().0, long);
        let uuid = "9f1c2e4a-7b7e-4c1d-a1d4-2b6f0f1e9a10";
        assert_eq!(key_from(&[format!("\"{uuid}\"").as_bytes()]).unwrap().0, uuid);
    }

    #[test]
    fn refuses_bad_quoting_and_what_the_rule_refuses_inside_quotes() {
        let too_long = format!("\"{}\"", "k".repeat(256));
        let cases: [&[u8]; 13] = [
            b"\"",
            b"\"\"",
            b"\"abcdefgh",
            b"abcdefgh\"",
            b"\"abcd\"efgh\"",
            b"\"abcd\\\"efgh\"",
            b"\"abcd\\efgh\"",
            b"\"abcdefgh\";p=1",
            b"\"abcdefgh\" ",
            b"\"abcd efgh\"",
            b"\"abcdefg\"",
            b"\"abcdefgh/\"",
            too_long.as_bytes(),
        ];
        for bad in cases {
            assert_eq!(code(&[bad]), "INVALID_IDEMPOTENCY_KEY", "{:?}", String::from_utf8_lossy(bad));
        }
        let detail = |value: &[u8]| key_from(&[value]).unwrap_err().detail;
        assert_eq!(
            detail(b"\"abcdefgh"),
            format!(
                "the Idempotency-Key header opens a quoted string that does not end with its closing quote; {KEY_RULE}"
            )
        );
        assert_eq!(
            detail(b"\"abcd\\\"efgh\""),
            format!("the quoted Idempotency-Key holds a quote or a backslash escape; {KEY_RULE}")
        );
        assert_eq!(detail(b"\"\""), format!("the quoted Idempotency-Key is empty; {KEY_RULE}"));
        // The offset counts from the header's first byte, the opening quote.
        assert_eq!(
            detail(b"\"abcd efgh\""),
            format!(
                "the Idempotency-Key header is invalid (character U+0020 at byte 5; only A-Z a-z 0-9 _ . : - are allowed); {KEY_RULE}"
            )
        );
    }

    /// Every detail is visible ASCII: no control byte, no byte >= 0x80, and
    /// none of the caller's text beyond one visible ASCII character.
    pub(crate) fn assert_shows_no_raw_bytes(problem: &ProblemDetails, raw: &str) {
        let body = problem.body();
        assert!(problem.detail.bytes().all(|b| b.is_ascii_graphic() || b == b' ') && body.is_ascii(), "{body}");
        assert!(!body.contains(raw), "{body}");
    }

    #[test]
    fn details_never_echo_raw_bytes() {
        // Header values that reach the key rule hold visible ASCII or tabs.
        let tab = key_from(&[b"abcd\tefgh"]).unwrap_err();
        assert!(tab.detail.contains("character U+0009 at byte 4"), "{}", tab.detail);
        assert_shows_no_raw_bytes(&tab, "abcd\tefgh");
        let quoted_tab = key_from(&[b"\"abcd\tefgh\""]).unwrap_err();
        assert!(quoted_tab.detail.contains("character U+0009 at byte 5"), "{}", quoted_tab.detail);
        for raw in [&b"abcd\xffefgh"[..], "clé-12345678".as_bytes(), b"\"abcd\xc3\xa9efgh\"", b"\"\xe2\x80\xaeabcdefgh"]
        {
            let problem = key_from(&[raw]).unwrap_err();
            assert_eq!(problem.code, "INVALID_IDEMPOTENCY_KEY");
            assert_eq!(
                problem.detail,
                format!("the Idempotency-Key header holds bytes that are not visible ASCII; {KEY_RULE}")
            );
            assert_shows_no_raw_bytes(&problem, "abcd");
        }
        // Keys rendered by the fn may hold anything its arguments held.
        for (ch, code) in
            [('\n', "U+000A"), ('\0', "U+0000"), ('é', "U+00E9"), ('\u{202e}', "U+202E"), ('\u{7f}', "U+007F")]
        {
            let problem = ProblemDetails::<u16>::from(&Error::InvalidKey(KeyError::BadChar { ch, at: 7 }));
            assert!(problem.detail.contains(&format!("character {code} at byte 7")), "{}", problem.detail);
            assert_shows_no_raw_bytes(&problem, &ch.to_string());
        }
    }

    #[test]
    fn problem_details_never_repeat_the_key() {
        let key = "secret-key-value-{x}";
        let problem = key_from(&[key.as_bytes()]).unwrap_err();
        assert!(!problem.body().contains("secret-key-value"), "{}", problem.body());
        let reused = Error::KeyReused { biz: "pay", key: "u1:secret-key-value".into() };
        let in_progress = Error::InProgress { biz: "pay", key: "u1:secret-key-value".into() };
        for e in [reused, in_progress] {
            assert!(!ProblemDetails::<u16>::from(&e).body().contains("secret"));
        }
    }

    fn token_from(values: &[&[u8]]) -> Result<Option<IdempotencyToken>, ProblemDetails> {
        IdempotencyToken::from_header_values(values.iter().copied())
    }

    #[test]
    fn token_headers_are_checked_for_shape_and_refused_as_forged() {
        let token = "AbCdEfGhIjKlMnOpQrStUvWxYz0123-_";
        assert_eq!(token_from(&[token.as_bytes()]).unwrap().unwrap().as_str(), token);
        assert_eq!(token_from(&[format!("\"{token}\"").as_bytes()]).unwrap().unwrap().as_str(), token);
        assert_eq!(token_from(&[]).unwrap(), None);
        let short = &token[1..];
        let long = format!("{token}A");
        let plus = token.replace('-', "+");
        for bad in [
            &b""[..],
            short.as_bytes(),
            long.as_bytes(),
            plus.as_bytes(),
            b"\"",
            b"AbCdEfGhIjKlMnOpQrStUvWxYz0123-\xff",
        ] {
            let problem = token_from(&[bad]).unwrap_err();
            assert_eq!((problem.status, problem.code), (403, "IDEMPOTENCY_TOKEN_INVALID"));
            assert_shows_no_raw_bytes(&problem, "AbCdEfGh");
        }
        assert_eq!(token_from(&[token.as_bytes(), token.as_bytes()]).unwrap_err().code, "IDEMPOTENCY_TOKEN_INVALID");
    }

    #[test]
    fn key_or_token_takes_exactly_one() {
        let token: &[u8] = b"AbCdEfGhIjKlMnOpQrStUvWxYz0123-_";
        let key: &[u8] = b"abcdefgh";
        let either = |keys: &[&[u8]], tokens: &[&[u8]]| {
            KeyOrToken::from_header_values(keys.iter().copied(), tokens.iter().copied())
        };
        assert_eq!(either(&[], &[]).unwrap_err().code, "MISSING_IDEMPOTENCY_KEY");
        assert_eq!(either(&[key], &[]).unwrap(), KeyOrToken::Key(IdempotencyKey("abcdefgh".into())));
        assert_eq!(either(&[key], &[token]).unwrap_err().code, "INVALID_IDEMPOTENCY_KEY");
        let only_token = KeyOrToken::Token(IdempotencyToken(String::from_utf8(token.to_vec()).unwrap()));
        assert_eq!(either(&[], &[token]).unwrap(), only_token);
        assert_eq!(either(&[], &[b"forged"]).unwrap_err().status, 403);
    }
}
