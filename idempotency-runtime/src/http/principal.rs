//! The principal rule: which callers may scope a key (`<user>:<idem_key>`)
//! without two of them ever rendering the same key.

use idempotency_rules::Shown;

use super::problem::ProblemDetails;
use crate::key::is_key_char;

/// Longest principal the check accepts: with the `:` separator it leaves a
/// header key 190 bytes of the 255 a rendered key may hold.
pub const MAX_PRINCIPAL_LEN: usize = 64;

/// Checks a principal (the authenticated caller) that scopes keys in a
/// template such as `key = "<user>:<idem_key>"`: `[A-Za-z0-9_.-]{1,64}`,
/// the key characters without the `:` separator, so that no two pairs of
/// principal and header key render the same key (`a` + `b:c` and `a:b` +
/// `c` would). Refused: 400 `INVALID_PRINCIPAL`, whose detail names the
/// offending character (as its code point when not visible ASCII) but never
/// repeats the principal.
///
/// The framework-free form; the adapters' `check_principal` (axum's
/// [`http::check_principal`](crate::http::check_principal), actix-web's
/// [`http::actix::check_principal`](crate::http::actix::check_principal))
/// answer the same problem with their framework's status.
pub fn validate_principal(principal: &str) -> Result<(), ProblemDetails> {
    let why = if principal.is_empty() {
        "it is empty".to_owned()
    } else if principal.len() > MAX_PRINCIPAL_LEN {
        format!("it is {} bytes long", principal.len())
    } else if let Some((at, ch)) = principal.char_indices().find(|&(_, c)| c == ':' || !is_key_char(c)) {
        format!("it holds {} at byte {at}", Shown(ch))
    } else {
        return Ok(());
    };
    Err(ProblemDetails::invalid_principal(
        "Caller identity cannot scope an idempotency key",
        format!(
            "the caller's identity cannot scope an idempotency key: {why}; it must be 1 to {MAX_PRINCIPAL_LEN} \
             characters from A-Z a-z 0-9 _ . - (`:` separates it from the key)"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::key_header::tests::assert_shows_no_raw_bytes;

    #[test]
    fn principals_without_the_separator_pass() {
        for good in ["alice", "u-1.a_B9", &"p".repeat(MAX_PRINCIPAL_LEN)] {
            assert_eq!(validate_principal(good), Ok(()), "{good:?}");
        }
    }

    #[test]
    fn principals_that_could_merge_keys_are_refused() {
        let rule = "it must be 1 to 64 characters from A-Z a-z 0-9 _ . - (`:` separates it from the key)";
        let too_long = "p".repeat(MAX_PRINCIPAL_LEN + 1);
        let cases = [
            ("alice:bob", "it holds ':' at byte 5"),
            (":", "it holds ':' at byte 0"),
            ("", "it is empty"),
            (too_long.as_str(), "it is 65 bytes long"),
            ("al ice", "it holds U+0020 at byte 2"),
            ("alice@example", "it holds '@' at byte 5"),
            ("zoë", "it holds U+00EB at byte 2"),
            ("a\u{202e}b", "it holds U+202E at byte 1"),
            ("a\tb", "it holds U+0009 at byte 1"),
        ];
        for (principal, why) in cases {
            let problem = validate_principal(principal).unwrap_err();
            assert_eq!((problem.status, problem.code), (400, "INVALID_PRINCIPAL"), "{principal:?}");
            assert_eq!(problem.detail, format!("the caller's identity cannot scope an idempotency key: {why}; {rule}"));
            assert_eq!(problem.type_uri(), "urn:idem:problem:invalid-principal");
            if principal.len() > 1 {
                assert_shows_no_raw_bytes(&problem, principal);
            }
        }
    }
}
