//! The `idem` tool's table and column names (`reconcile --table
//! billing.payments --column idem_key`) and the scheme of
//! `IDEM_DATABASE_URL`. Input: the first byte says whether the name may be
//! qualified by its schema (odd) or not; the rest is the name.
//!
//! Checks: nothing panics; a name is accepted exactly when each of its
//! parts (at most two, and only where a schema may qualify it) is
//! `[A-Za-z_][A-Za-z0-9_]{0,63}`, the rule `idempotency_rules::is_sql_identifier`
//! states; it shows as typed and is quoted part by part, so no quote
//! character of the dialect ever appears inside; a refusal's message shows
//! no control or bidi character of the name.
#![no_main]

use idempotency_fuzz::dialect::Dialect;
use idempotency_fuzz::ident::Ident;
use idempotency_fuzz::{alloc, is_safe_to_show};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, name)) = data.split_first() else { return };
    let Ok(name) = std::str::from_utf8(name) else { return };
    alloc::bounded(data.len(), || check(name, flags & 1 == 1));
});

fn check(name: &str, qualified: bool) {
    let parts: Vec<&str> = if qualified { name.split('.').collect() } else { vec![name] };
    let keeps_rule = parts.len() <= 2 && parts.iter().all(|part| is_identifier(part));
    assert_eq!(parts.iter().all(|part| idempotency_rules::is_sql_identifier(part)), parts.iter().all(|p| is_identifier(p)));
    match Ident::parse("table", name, qualified) {
        Ok(ident) => {
            assert!(keeps_rule, "{name:?} accepted");
            assert_eq!(ident.to_string(), name);
            for (dialect, quote) in [(Dialect::MySql, "`"), (Dialect::Postgres, "\""), (Dialect::Sqlite, "\"")] {
                let expected: Vec<String> = parts.iter().map(|part| format!("{quote}{part}{quote}")).collect();
                assert_eq!(ident.quoted(dialect), expected.join("."));
            }
        }
        Err(refused) => {
            assert!(!keeps_rule, "{name:?} refused");
            let message = refused.to_string();
            assert!(is_safe_to_show(&message), "{message:?}");
        }
    }
    // The database URL's scheme: one of three, or a refusal naming it.
    let dialect = Dialect::of(name);
    let scheme = name.split(':').next().unwrap_or_default();
    let expected = match scheme {
        "mysql" | "mariadb" => Some(Dialect::MySql),
        "postgres" | "postgresql" => Some(Dialect::Postgres),
        "sqlite" => Some(Dialect::Sqlite),
        _ => None,
    };
    assert_eq!(dialect.as_ref().ok().copied(), expected, "{name:?}");
}

/// `[A-Za-z_][A-Za-z0-9_]{0,63}`, spelled out.
fn is_identifier(part: &str) -> bool {
    let mut bytes = part.bytes();
    let first_ok = bytes.next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
    first_ok && part.len() <= 64 && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}
