//! The `Idempotency-Key` header, bare and quoted, and the principal that
//! scopes it. Input: the header's lines, `\n` between them.
//!
//! Checks: nothing panics; an accepted key keeps the key rule
//! (`[A-Za-z0-9_.:-]{8,255}`) and is the line itself or its unquoted
//! content; the bare and the quoted form of a key agree; a refusal is a
//! 400 whose detail is visible ASCII of a bounded length (never an echo of
//! the header); a principal passes `check_principal` exactly when it keeps
//! its rule, the same rule as token subjects, and a principal and a key
//! render a key that splits back into the two.
#![no_main]

use idempotency_fuzz::{alloc, lines};
use idempotency_runtime::__fuzz::{self, Refusal};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let lines = lines(data);
    alloc::bounded(data.len(), || check(&lines));
});

fn check(lines: &[&[u8]]) {
    let Some(found) = __fuzz::idempotency_key(lines) else { return };
    match (&found, lines) {
        (Ok(key), [line]) => {
            assert_eq!(idempotency_rules::check_key(key, 8, 255), Ok(()), "{key:?}");
            let quoted = [b"\"", key.as_bytes(), b"\""].concat();
            assert!(*line == key.as_bytes() || *line == quoted, "{line:?} became {key:?}");
            // Either form of the key is the same key.
            assert_eq!(__fuzz::idempotency_key(&[key.as_bytes()]), Some(Ok(key.clone())));
            assert_eq!(__fuzz::idempotency_key(&[&quoted]), Some(Ok(key.clone())));
        }
        (Ok(key), _) => panic!("{key:?} accepted from {} lines", lines.len()),
        (Err(refusal), _) => check_refusal(refusal, lines),
    }
    if let [line] = lines {
        check_quoting(line, &found);
        if let Ok(principal) = std::str::from_utf8(line) {
            check_principal(principal, found.as_ref().ok());
        }
    }
}

fn check_refusal(refusal: &Refusal, lines: &[&[u8]]) {
    assert_eq!(refusal.status, 400, "{refusal:?}");
    let expected = if lines.is_empty() || (lines.len() == 1 && lines[0].is_empty()) {
        "MISSING_IDEMPOTENCY_KEY"
    } else {
        "INVALID_IDEMPOTENCY_KEY"
    };
    assert_eq!(refusal.code, expected, "{lines:?}");
    // The detail names a reason, never the header: a few hundred visible
    // ASCII characters, whatever was sent.
    assert!(refusal.detail.bytes().all(|b| b.is_ascii_graphic() || b == b' '), "{refusal:?}");
    assert!(refusal.body.is_ascii() && refusal.detail.len() <= 200, "{refusal:?}");
}

/// `"content"` is accepted exactly when `content` is, as the same key,
/// unless the content holds a quote or a backslash (refused, never
/// unescaped).
fn check_quoting(line: &[u8], found: &Result<String, Refusal>) {
    let Some(content) = line.strip_prefix(b"\"").and_then(|rest| rest.strip_suffix(b"\"")) else { return };
    let bare = __fuzz::idempotency_key(&[content]);
    if content.is_empty() || content.contains(&b'"') || content.contains(&b'\\') {
        assert!(found.is_err(), "{line:?} accepted");
        return;
    }
    match (found, bare) {
        (Ok(quoted), Some(Ok(bare))) => assert_eq!(*quoted, bare),
        (Err(_), Some(Err(_))) => {}
        (quoted, bare) => panic!("{line:?} gave {quoted:?}, its content {bare:?}"),
    }
}

/// The line as a principal, scoping `key` (the line as a key, if accepted).
fn check_principal(principal: &str, key: Option<&String>) {
    let keeps_rule = (1..=64).contains(&principal.len())
        && principal.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    let checked = __fuzz::check_principal(principal);
    assert_eq!(checked.is_ok(), keeps_rule, "{principal:?}: {checked:?}");
    assert_eq!(idempotency_runtime::token::is_valid_subject(principal), keeps_rule, "{principal:?}");
    match checked {
        Err(refusal) => {
            assert_eq!((refusal.status, refusal.code), (400, "INVALID_PRINCIPAL"));
            assert!(refusal.detail.bytes().all(|b| b.is_ascii_graphic() || b == b' '), "{refusal:?}");
            assert!(refusal.detail.len() <= 250, "{refusal:?}");
        }
        Ok(()) => {
            // `<principal>:<key>`: the first `:` is the separator, so no two
            // pairs render the same key; the whole keeps the rule while it
            // fits 255 bytes.
            let Some(key) = key else { return };
            let rendered = format!("{principal}:{key}");
            assert_eq!(rendered.split_once(':'), Some((principal, key.as_str())));
            let fits = idempotency_runtime::key::validate_key(&rendered).is_ok();
            assert_eq!(fits, rendered.len() <= 255, "{rendered:?}");
        }
    }
}
