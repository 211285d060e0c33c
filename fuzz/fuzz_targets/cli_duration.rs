//! Durations as the attribute's `ttl` and `lease` and the `idem` tool's
//! `--older-than` spell them (`idempotency_rules::parse_duration`, which both
//! share), and the tool's dates. Input: the duration's text; its first
//! eight bytes, read as epoch milliseconds, are also shown as a date.
//!
//! Checks: nothing panics; a text is accepted exactly when it is one or
//! more `<digits><unit>` (units `ms`, `s`, `m`, `h`, `d`) adding up to more
//! than zero and at most 100 years, and the value is that sum, computed
//! here without overflow; the tool reads the same value; a refusal's
//! message is bounded by the text's length; every epoch-ms value shows as
//! an RFC 3339 date that reads back to it.
#![no_main]

use idempotency_fuzz::{alloc, time};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    alloc::bounded(data.len(), || {
        if let Some(ms) = data.get(..8) {
            check_date(i64::from_le_bytes(ms.try_into().expect("eight bytes")));
        }
        if let Ok(text) = std::str::from_utf8(data) {
            check_duration(text);
        }
    });
});

fn check_duration(text: &str) {
    let parsed = idempotency_rules::parse_duration(text);
    match (&parsed, sum(text)) {
        (Ok(ms), Some(expected)) => assert_eq!(u128::from(*ms), expected, "{text:?}"),
        (Err(_), None) => {}
        (parsed, expected) => panic!("{text:?}: parsed {parsed:?}, expected {expected:?}"),
    }
    if let Err(e) = &parsed {
        // The message repeats the text (or its unit) once, never more.
        assert!(e.to_string().len() <= 2 * text.len() + 200, "{e}");
    }
    assert_eq!(time::parse_duration(text).ok(), parsed.ok().map(|ms| i64::try_from(ms).expect("100 years fit")));
}

/// The milliseconds `text` spells, by the rule written out; `None` when it
/// breaks it.
fn sum(text: &str) -> Option<u128> {
    let mut total: u128 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let unit_end = rest[digits..].find(|c: char| c.is_ascii_digit()).map_or(rest.len(), |i| digits + i);
        let per_unit = match &rest[digits..unit_end] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return None,
        };
        // Past 100 years either way: a long run of digits cannot come back.
        let number: u128 = rest[..digits].parse().ok().filter(|_| digits > 0)?;
        total = total.checked_add(number.checked_mul(per_unit)?)?;
        rest = &rest[unit_end..];
    }
    (1..=u128::from(idempotency_rules::MAX_DURATION_MS)).contains(&total).then_some(total)
}

fn check_date(ms: i64) {
    let shown = time::rfc3339(ms);
    let (date, clock) = shown.split_once('T').expect("a date and a time");
    let (year, month_day) = date
        .rsplit_once('-')
        .and_then(|(ym, d)| Some((ym.rsplit_once('-')?, d)))
        .map(|((y, m), d)| (y, (m, d)))
        .expect("y-m-d");
    let (month, day) = month_day;
    let clock = clock.strip_suffix('Z').expect("UTC");
    let year: i64 = year.parse().expect("year");
    let (month, day): (i64, i64) = (month.parse().expect("month"), day.parse().expect("day"));
    assert!((1..=12).contains(&month) && (1..=31).contains(&day), "{shown}");
    let [h, m, s]: [i64; 3] = {
        let (hms, millis) = clock.split_once('.').expect("milliseconds");
        assert_eq!(millis.len(), 3, "{shown}");
        let parts: Vec<i64> = hms.split(':').map(|p| p.parse().expect("a number")).collect();
        let back = days_from_civil(year, month, day) as i128 * 86_400_000
            + i128::from(parts[0] * 3_600_000 + parts[1] * 60_000 + parts[2] * 1000)
            + i128::from(millis.parse::<i64>().expect("millis"));
        assert_eq!(back, i128::from(ms), "{shown}");
        parts.try_into().expect("h:m:s")
    };
    assert!((0..24).contains(&h) && (0..60).contains(&m) && (0..60).contains(&s), "{shown}");
}

/// Howard Hinnant's `days_from_civil`, the inverse of the tool's
/// `civil_from_days`, in i128 so no date overflows it.
fn days_from_civil(y: i64, m: i64, d: i64) -> i128 {
    let (y, m, d) = (i128::from(y) - i128::from(m <= 2), i128::from(m), i128::from(d));
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}
