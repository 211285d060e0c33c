//! The namespace of a record store: every Redis key an engine writes carries
//! it, so engines on different databases never share a claim or a cached
//! result, while every instance on one database does.
//!
//! By default it is an identifier that [`Idem::migrate`](crate::Idem::migrate)
//! generates once and keeps in the database itself (table `idem_meta`): a
//! database dropped and re-created, or a second database sharing the Redis,
//! gets its own. An explicit one can be set with
//! [`Builder::redis_namespace`](crate::Builder::redis_namespace).

use std::fmt;
use std::sync::Arc;

use crate::random;

/// A checked namespace: `[A-Za-z0-9_.-]{1,64}` (`idempotency_rules::is_valid_namespace`).
/// No `:`, so a namespace can never run into the `biz` and key that follow
/// it in a Redis key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Namespace(Arc<str>);

impl Namespace {
    /// Checks `name` against the rule.
    pub fn new(name: &str) -> Result<Self, InvalidNamespace> {
        if idempotency_rules::is_valid_namespace(name) {
            Ok(Namespace(name.into()))
        } else {
            Err(InvalidNamespace { len: name.len() })
        }
    }

    /// A fresh random namespace (64 bits, 16 hex digits), as `migrate`
    /// stores in a database that has none.
    pub(crate) fn generate() -> Self {
        let mut name = String::with_capacity(16);
        crate::fingerprint::push_lower_hex(&mut name, &random::random_u64().to_be_bytes());
        Namespace(name.into())
    }

    /// The namespace as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A namespace outside `[A-Za-z0-9_.-]{1,64}`. Carries no copy of the text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a namespace of {len} bytes breaks the rule: 1 to 64 characters from A-Z a-z 0-9 _ . -")]
pub struct InvalidNamespace {
    /// Length of the refused text, in bytes.
    pub len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_rule_and_refuses_the_rest() {
        for good in ["a", "tenant_a", "prod-eu.1", &"x".repeat(64)] {
            assert_eq!(Namespace::new(good).unwrap().as_str(), good);
        }
        for bad in ["", "a:b", "a b", "café", "a*", &"x".repeat(65)] {
            assert_eq!(Namespace::new(bad), Err(InvalidNamespace { len: bad.len() }), "{bad:?}");
        }
    }

    #[test]
    fn generated_ones_obey_the_rule_and_differ() {
        let a = Namespace::generate();
        assert_eq!(Namespace::new(a.as_str()).unwrap(), a);
        assert_eq!(a.as_str().len(), 16);
        assert_ne!(a, Namespace::generate());
    }
}
