//! Random identifiers: claim owner tokens and record-store namespaces.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

use crate::clock;

/// Appends 128 bits as 32 lowercase hex digits that no other call of this
/// process returns (the low half is a counter) nor, in practice, any other
/// process (the high half is drawn once per process, then mixed with the
/// time of the call, so that a forked child or a clone of a memory snapshot,
/// which copy the counter, still draw their own). Claims take one on every
/// call, replays included: no hashing and no allocation here.
#[cfg(any(feature = "redis", test))]
pub(crate) fn push_token(out: &mut String) {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static PROCESS: OnceLock<u64> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let process = *PROCESS.get_or_init(random_u64);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let high = process ^ clock::now_nanos() as u64; // the low 64 bits: they change every call
    crate::fingerprint::push_lower_hex(out, &(u128::from(high) << 64 | u128::from(n)).to_be_bytes());
}

/// A [`push_token`] of its own.
#[cfg(test)]
pub(crate) fn token() -> String {
    let mut token = String::with_capacity(32);
    push_token(&mut token);
    token
}

/// 64 bits from the operating system; where it cannot answer, std's
/// `RandomState` (keys drawn once per thread, then stepped) over the time.
pub(crate) fn random_u64() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        let mut hasher = RandomState::new().build_hasher();
        hasher.write_u128(clock::now_nanos());
        hasher.finish()
    })
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
