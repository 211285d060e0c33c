//! Wall-clock time as the record table stores it: Unix epoch milliseconds.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    u64::try_from(now_nanos() / 1_000_000).unwrap_or(u64::MAX)
}

/// Nanoseconds since the Unix epoch (0 if the clock is set before it).
pub fn now_nanos() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}
