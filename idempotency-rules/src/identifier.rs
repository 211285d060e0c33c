//! SQL identifiers: the table and column names idempotency writes into SQL (the
//! state layer's derive and `col!`, the CLI's `reconcile`).

/// Longest SQL identifier idempotency writes.
pub const MAX_IDENTIFIER_LEN: usize = 64;

/// Whether `name` is a SQL identifier idempotency may write into SQL:
/// `[A-Za-z_][A-Za-z0-9_]{0,63}`. Such a name holds no quote character, so
/// quoting it is enough. A `const fn`: in a `const` block a bad name is a
/// compile error.
pub const fn is_sql_identifier(name: &str) -> bool {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() > MAX_IDENTIFIER_LEN || !(bytes[0].is_ascii_alphabetic() || bytes[0] == b'_') {
        return false;
    }
    let mut i = 1;
    while i < bytes.len() {
        if !(bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
            return false;
        }
        i += 1;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sql_identifiers_are_plain_words() {
        for good in ["orders", "_x", "Paid_At2", &"a".repeat(64)] {
            assert!(is_sql_identifier(good), "{good:?}");
        }
        for bad in ["", "1a", "a-b", "a b", "a;b", "a\"b", "a`b", "caf\u{e9}", "a.b", &"a".repeat(65)] {
            assert!(!is_sql_identifier(bad), "{bad:?}");
        }
    }
}
