//! Random identifiers: claim owner tokens and record-store namespaces.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::clock;
use crate::fingerprint::push_lower_hex;

/// Appends 128 bits as 32 lowercase hex digits that no other call of this
/// process returns (the low half is a counter) nor, in practice, any other
/// process (the high half is drawn once per process). Claims take one on
/// every call, replays included: no hashing and no clock here.
pub(crate) fn push_token(out: &mut String) {
    static PROCESS: OnceLock<u64> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let process = *PROCESS.get_or_init(random_u64);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    push_lower_hex(out, &(u128::from(process) << 64 | u128::from(n)).to_be_bytes());
}

/// A [`push_token`] of its own.
#[cfg(test)]
pub(crate) fn token() -> String {
    let mut token = String::with_capacity(32);
    push_token(&mut token);
    token
}

/// 64 bits from the OS (through std's `RandomState`, whose keys differ per
/// instance) mixed with the time: a new value on every call.
pub(crate) fn random_u64() -> u64 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u128(clock::now_nanos());
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_do_not_repeat() {
        let set: std::collections::HashSet<_> = (0..10_000).map(|_| token()).collect();
        assert_eq!(set.len(), 10_000);
        assert!(set.iter().all(|t| t.len() == 32 && t.bytes().all(|b| b.is_ascii_hexdigit())));
    }

    #[test]
    fn random_values_do_not_repeat() {
        let set: std::collections::HashSet<_> = (0..10_000).map(|_| random_u64()).collect();
        assert_eq!(set.len(), 10_000);
    }
}
