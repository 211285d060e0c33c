//! Durations written as `"30s"`, `"15m"`, `"24h"`, `"7d"`, `"1h30m"`, `"500ms"`:
//! how the attribute's `ttl` and `lease` are spelled.

use std::fmt;

/// The longest duration, in milliseconds: 100 years (`"36500d"`). Far beyond
/// any ttl or lease, and far below what Redis (`PX`) and the record's
/// epoch-ms `BIGINT` can hold.
pub const MAX_DURATION_MS: u64 = 36_500 * 86_400_000;

/// The milliseconds `text` spells: a number and a unit (`ms`, `s`, `m`, `h`,
/// `d`), repeated, greater than zero and at most [`MAX_DURATION_MS`].
pub fn parse_duration(text: &str) -> Result<u64, DurationError> {
    let owned = || text.to_owned();
    if text.is_empty() {
        return Err(DurationError::Empty);
    }
    let mut total: u64 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if digits == 0 {
            return Err(DurationError::NotADuration { text: owned() });
        }
        // Only digits: the parse fails on overflow alone.
        let number: u64 = rest[..digits].parse().map_err(|_| DurationError::TooLong { text: owned() })?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let per_unit: u64 = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "" => return Err(DurationError::NoUnit { text: owned() }),
            unit => return Err(DurationError::UnknownUnit { unit: unit.to_owned(), text: owned() }),
        };
        rest = &rest[unit_len..];
        total = number
            .checked_mul(per_unit)
            .and_then(|ms| total.checked_add(ms))
            .ok_or_else(|| DurationError::TooLong { text: owned() })?;
    }
    if total == 0 {
        return Err(DurationError::Zero { text: owned() });
    }
    if total > MAX_DURATION_MS {
        return Err(DurationError::TooLong { text: owned() });
    }
    Ok(total)
}

/// Why a duration was refused; its `Display` names the valid spellings.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DurationError {
    /// Nothing written.
    Empty,
    /// Something other than a number where a number must start.
    NotADuration {
        /// The text as written.
        text: String,
    },
    /// A number without a unit.
    NoUnit {
        /// The text as written.
        text: String,
    },
    /// A unit other than `ms`, `s`, `m`, `h`, `d`.
    UnknownUnit {
        /// The unit as written.
        unit: String,
        /// The text as written.
        text: String,
    },
    /// Zero in total.
    Zero {
        /// The text as written.
        text: String,
    },
    /// Longer than [`MAX_DURATION_MS`] (100 years).
    TooLong {
        /// The text as written.
        text: String,
    },
}

const EXPECTED: &str =
    "expected a duration such as \"30s\", \"15m\", \"24h\", \"7d\" or \"1h30m\" (units: ms, s, m, h, d)";

impl fmt::Display for DurationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DurationError::Empty => write!(f, "empty duration; {EXPECTED}"),
            DurationError::NotADuration { text } => write!(f, "`{text}` is not a duration; {EXPECTED}"),
            DurationError::NoUnit { text } => write!(f, "`{text}` lacks a unit; {EXPECTED}"),
            DurationError::UnknownUnit { unit, text } => write!(f, "unknown unit `{unit}` in `{text}`; {EXPECTED}"),
            DurationError::Zero { text } => write!(f, "`{text}` is zero; a duration must be greater than zero"),
            DurationError::TooLong { text } => {
                write!(f, "`{text}` is longer than the longest duration, 100 years (\"36500d\")")
            }
        }
    }
}

impl std::error::Error for DurationError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_combinations() {
        assert_eq!(parse_duration("30s"), Ok(30_000));
        assert_eq!(parse_duration("15m"), Ok(900_000));
        assert_eq!(parse_duration("24h"), Ok(86_400_000));
        assert_eq!(parse_duration("7d"), Ok(604_800_000));
        assert_eq!(parse_duration("1h30m"), Ok(5_400_000));
        assert_eq!(parse_duration("500ms"), Ok(500));
        assert_eq!(parse_duration("1d2h3m4s5ms"), Ok(93_784_005));
        assert_eq!(parse_duration("36500d"), Ok(MAX_DURATION_MS));
    }

    #[test]
    fn rejects_with_a_reason() {
        for bad in ["", "0s", "0h0m", "10", "h", "5 s", "5x", "-5s", "1.5h", "99999999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
        let text = |t: &str| t.to_owned();
        assert_eq!(parse_duration(""), Err(DurationError::Empty));
        assert_eq!(parse_duration("h"), Err(DurationError::NotADuration { text: text("h") }));
        assert_eq!(parse_duration("10"), Err(DurationError::NoUnit { text: text("10") }));
        assert_eq!(parse_duration("5x"), Err(DurationError::UnknownUnit { unit: text("x"), text: text("5x") }));
        assert_eq!(parse_duration("0h0m"), Err(DurationError::Zero { text: text("0h0m") }));
        assert_eq!(parse_duration("36500d1ms"), Err(DurationError::TooLong { text: text("36500d1ms") }));
        // Past u64 in the number, or in the product: the same refusal.
        for huge in ["99999999999999999999d", "18446744073709551615d", "213503982334601d"] {
            assert_eq!(parse_duration(huge), Err(DurationError::TooLong { text: text(huge) }));
        }
    }

    #[test]
    fn messages_name_the_valid_spellings() {
        let message = |t: &str| parse_duration(t).unwrap_err().to_string();
        assert!(message("5x").starts_with("unknown unit `x` in `5x`; expected a duration such as \"30s\""));
        assert!(message("").contains("(units: ms, s, m, h, d)"));
        assert_eq!(message("0s"), "`0s` is zero; a duration must be greater than zero");
        assert_eq!(message("36501d"), "`36501d` is longer than the longest duration, 100 years (\"36500d\")");
    }
}
