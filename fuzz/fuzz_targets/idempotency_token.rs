//! The `Idempotency-Token` header, alone and beside an `Idempotency-Key`
//! (`KeyOrToken`). Input: header lines, `\n` between them; a line
//! starting with `k` is an `Idempotency-Key` line, any other an
//! `Idempotency-Token` line; the first byte is the line's kind, not part of
//! its value.
//!
//! Checks: nothing panics; a token is accepted exactly when one line holds
//! 32 base64url characters, bare or in double quotes, and comes back
//! unquoted; every refusal of a token is the same 403 (nothing tells a
//! malformed token from another caller's); `KeyOrToken` takes exactly one
//! of the two headers, and answers as the extractor of that one would.
#![no_main]

use idempotency_fuzz::{alloc, lines};
use idempotency_runtime::__fuzz;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let lines = lines(data);
    alloc::bounded(data.len(), || check(&lines));
});

fn check(lines: &[&[u8]]) {
    let (keys, tokens): (Vec<&[u8]>, Vec<&[u8]>) = lines.iter().partition(|line| line.first() == Some(&b'k'));
    let keys: Vec<&[u8]> = keys.iter().map(|line| &line[1..]).collect();
    let tokens: Vec<&[u8]> = tokens.iter().map(|line| line.get(1..).unwrap_or_default()).collect();
    let Some(token) = __fuzz::idempotency_token(&tokens) else { return };
    match (&token, tokens.as_slice()) {
        (Ok(None), []) => {}
        (Ok(Some(token)), [line]) => {
            assert!(is_token(token.as_bytes()), "{token:?}");
            assert!(unquoted(line) == token.as_bytes(), "{line:?} became {token:?}");
        }
        (Ok(found), _) => panic!("{found:?} from {tokens:?}"),
        (Err(refusal), _) => {
            assert_eq!((refusal.status, refusal.code), (403, "IDEMPOTENCY_TOKEN_INVALID"));
            let forged = __fuzz::idempotency_token(&[b"forged"]).unwrap().unwrap_err();
            assert_eq!(*refusal, forged, "refusals differ");
            let accepted = matches!(tokens.as_slice(), [line] if is_token(unquoted(line)));
            assert!(!accepted, "{tokens:?} refused");
        }
    }
    let Some(either) = __fuzz::key_or_token(&keys, &tokens) else { return };
    match (keys.is_empty(), token) {
        (true, Ok(None)) => assert_eq!(either.unwrap_err().code, "MISSING_IDEMPOTENCY_KEY"),
        (false, Ok(None)) => {
            let key = __fuzz::idempotency_key(&keys).unwrap();
            assert_eq!(either, key.map(|key| (true, key)));
        }
        (true, Ok(Some(token))) => assert_eq!(either, Ok((false, token))),
        (false, Ok(Some(_))) => {
            let refusal = either.unwrap_err();
            assert_eq!((refusal.status, refusal.code), (400, "INVALID_IDEMPOTENCY_KEY"));
        }
        (_, Err(refusal)) => assert_eq!(either, Err(refusal)),
    }
}

/// 32 characters of base64url: what `Tokens::issue` hands out.
fn is_token(text: &[u8]) -> bool {
    text.len() == 32 && text.iter().all(|&b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn unquoted(line: &[u8]) -> &[u8] {
    line.strip_prefix(b"\"").and_then(|rest| rest.strip_suffix(b"\"")).unwrap_or(line)
}
