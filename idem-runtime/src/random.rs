//! Random identifiers: claim owner tokens and record-store namespaces.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::clock;
use crate::fingerprint::lower_hex;

/// 128 bits that no other call of this process (nor, in practice, any other
/// process) returns: a per-process random seed (from the OS, through std's
/// `RandomState`), the time and a counter, as 32 lowercase hex digits.
pub(crate) fn token() -> String {
    static SEED: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let seed = SEED.get_or_init(Default::default);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut a = seed.build_hasher();
    a.write_u64(n);
    a.write_u128(clock::now_nanos());
    let mut b = seed.build_hasher();
    b.write_u64(!n);
    b.write_u64(a.finish());
    lower_hex(&(u128::from(a.finish()) << 64 | u128::from(b.finish())).to_be_bytes())
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
}
