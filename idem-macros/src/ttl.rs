//! Durations written as `"30s"`, `"15m"`, `"24h"`, `"7d"`, `"1h30m"`, `"500ms"`.

/// The longest ttl or lease: 100 years. Far beyond any use, and far below
/// what Redis (`PX`) and the record's epoch-ms `BIGINT` can hold.
const MAX_MS: u64 = 36_500 * 86_400_000;

/// Milliseconds in `text`, or a message saying what is wrong with it.
pub fn parse_duration(text: &str) -> Result<u64, String> {
    const EXPECTED: &str =
        "expected a duration such as \"30s\", \"15m\", \"24h\", \"7d\" or \"1h30m\" (units: ms, s, m, h, d)";
    if text.is_empty() {
        return Err(format!("empty duration; {EXPECTED}"));
    }
    let mut total: u64 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if digits == 0 {
            return Err(format!("`{text}` is not a duration; {EXPECTED}"));
        }
        let number: u64 = rest[..digits].parse().map_err(|_| format!("`{text}` is too long a duration"))?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let per_unit: u64 = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "" => return Err(format!("`{text}` lacks a unit; {EXPECTED}")),
            unit => return Err(format!("unknown unit `{unit}` in `{text}`; {EXPECTED}")),
        };
        rest = &rest[unit_len..];
        total = number
            .checked_mul(per_unit)
            .and_then(|ms| total.checked_add(ms))
            .ok_or_else(|| format!("`{text}` is too long a duration"))?;
    }
    if total == 0 {
        return Err(format!("`{text}` is zero; a duration must be greater than zero"));
    }
    if total > MAX_MS {
        return Err(format!("`{text}` is longer than the longest duration, 100 years (\"36500d\")"));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::parse_duration;

    #[test]
    fn parses_units_and_combinations() {
        assert_eq!(parse_duration("30s"), Ok(30_000));
        assert_eq!(parse_duration("15m"), Ok(900_000));
        assert_eq!(parse_duration("24h"), Ok(86_400_000));
        assert_eq!(parse_duration("7d"), Ok(604_800_000));
        assert_eq!(parse_duration("1h30m"), Ok(5_400_000));
        assert_eq!(parse_duration("500ms"), Ok(500));
        assert_eq!(parse_duration("1d2h3m4s5ms"), Ok(93_784_005));
    }

    #[test]
    fn rejects_with_a_reason() {
        for bad in ["", "0s", "0h0m", "10", "h", "5 s", "5x", "-5s", "1.5h", "99999999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse_duration("5x").unwrap_err().contains("unknown unit `x`"));
        assert!(parse_duration("0s").unwrap_err().contains("greater than zero"));
        assert_eq!(parse_duration("36500d"), Ok(3_153_600_000_000));
        assert!(parse_duration("36500d1ms").unwrap_err().contains("100 years"));
        assert!(parse_duration("99999999999999999999d").unwrap_err().contains("too long a duration"));
    }
}
