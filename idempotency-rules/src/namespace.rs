//! The namespace every Redis key of a record store carries.

/// Longest namespace.
pub const MAX_NAMESPACE_LEN: usize = 64;

/// `true` when `name` matches `[A-Za-z0-9_.-]{1,64}`: the key alphabet
/// without `:`, so a namespace can never run into the `biz` and key that
/// follow it in a Redis key.
pub fn is_valid_namespace(name: &str) -> bool {
    (1..=MAX_NAMESPACE_LEN).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_rule_and_refuses_the_rest() {
        for good in ["a", "tenant_a", "prod-eu.1", "0123456789abcdef", &"x".repeat(MAX_NAMESPACE_LEN)] {
            assert!(is_valid_namespace(good), "{good:?}");
        }
        for bad in ["", "a:b", "a b", "café", "a*", &"x".repeat(MAX_NAMESPACE_LEN + 1)] {
            assert!(!is_valid_namespace(bad), "{bad:?}");
        }
    }
}
