//! Epoch milliseconds (how `idem_record` keeps time) shown as UTC RFC 3339,
//! and durations read as the attribute reads `ttl` (`10m`, `1h30m`).

/// `2026-05-01T03:00:00.000Z`.
pub fn rfc3339(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rest = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z", rest / 3600, rest % 3600 / 60, rest % 60)
}

/// Howard Hinnant's `civil_from_days`: the proleptic Gregorian date of a
/// day count since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// A duration such as `10m` or `1h30m`, in milliseconds.
pub fn parse_duration(text: &str) -> Result<i64, String> {
    let ms = idempotency_rules::parse_duration(text).map_err(|e| e.to_string())?;
    i64::try_from(ms).map_err(|_| format!("{text}: too long"))
}

/// Milliseconds since the Unix epoch, now, on this host's clock (SQLite's
/// clock: its file lives here).
pub fn host_ms() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(4_102_444_800_000), "2100-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(parse_duration("1h30m"), Ok(5_400_000));
        assert!(parse_duration("10").is_err());
    }
}
