//! What the runner reads from a Kafka message's headers, and writes on the
//! copies it produces. Kafka headers are a list of (name, bytes) pairs in
//! which a name may repeat: as Kafka's own `Headers::lastHeader`, the last
//! one of a name counts. These read input from the outside world: they
//! never panic.

use rdkafka::message::{Header, Headers, OwnedHeaders};

/// The value of the last header named `name`, if any (a header without a
/// value counts as none).
pub(crate) fn last<'a, H: Headers + ?Sized>(headers: Option<&'a H>, name: &str) -> Option<&'a [u8]> {
    let headers = headers?;
    let mut found = None;
    for i in 0..headers.count() {
        if let Some(header) = headers.try_get(i)
            && header.key == name
        {
            found = header.value;
        }
    }
    found
}

/// The message id: the last `name` header, when it is UTF-8 (never a
/// lossy copy, which could merge two ids).
pub(crate) fn message_id<H: Headers + ?Sized>(headers: Option<&H>, name: &str) -> Option<String> {
    last(headers, name).and_then(|v| std::str::from_utf8(v).ok()).map(str::to_owned)
}

/// The retry count: the last `name` header when it is a decimal number
/// (ASCII digits only, at most `u64::MAX`), else 0, as for a first attempt.
pub(crate) fn retries<H: Headers + ?Sized>(headers: Option<&H>, name: &str) -> u64 {
    last(headers, name).map(count_of).unwrap_or(0)
}

/// A decimal count, 0 when it is none.
pub(crate) fn count_of(value: &[u8]) -> u64 {
    if value.is_empty() || value.len() > 20 || !value.iter().all(u8::is_ascii_digit) {
        return 0;
    }
    std::str::from_utf8(value).ok().and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// `headers` without those named in `drop`, then `extra` appended: the
/// headers of a copy the runner produces (a retry, a dead letter).
pub(crate) fn copy_with<H: Headers + ?Sized>(
    headers: Option<&H>,
    drop: &[&str],
    extra: &[(&str, &[u8])],
) -> OwnedHeaders {
    let mut out = OwnedHeaders::new();
    if let Some(headers) = headers {
        for header in (0..headers.count()).filter_map(|i| headers.try_get(i)) {
            if !drop.contains(&header.key) {
                out = out.insert(Header { key: header.key, value: header.value });
            }
        }
    }
    for (key, value) in extra {
        out = out.insert(Header { key, value: Some(*value) });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, Option<&[u8]>)]) -> OwnedHeaders {
        pairs.iter().fold(OwnedHeaders::new(), |h, (key, value)| h.insert(Header { key, value: *value }))
    }

    #[test]
    fn the_last_header_of_a_name_counts_and_bad_values_read_as_none() {
        let h = headers(&[
            ("Idem-Retries", Some(b"2")),
            ("Idem-Message-Id", Some(b"first")),
            ("Idem-Retries", Some(b"5")),
            ("Idem-Message-Id", Some(b"second")),
        ]);
        assert_eq!(retries(Some(&h), "Idem-Retries"), 5);
        assert_eq!(message_id(Some(&h), "Idem-Message-Id").as_deref(), Some("second"));
        for bad in [&b""[..], b"-1", b"+3", b" 3", b"3x", b"99999999999999999999", b"\xff"] {
            let h = headers(&[("Idem-Retries", Some(bad))]);
            assert_eq!(retries(Some(&h), "Idem-Retries"), 0, "{bad:?}");
        }
        assert_eq!(
            retries(Some(&headers(&[("Idem-Retries", Some(b"18446744073709551615"))])), "Idem-Retries"),
            u64::MAX
        );
        assert_eq!(message_id(Some(&headers(&[("Idem-Message-Id", Some(b"\xff"))])), "Idem-Message-Id"), None);
        assert_eq!(message_id(Some(&headers(&[("Idem-Message-Id", None)])), "Idem-Message-Id"), None);
        assert_eq!(message_id::<OwnedHeaders>(None, "Idem-Message-Id"), None);
    }

    #[test]
    fn a_copy_keeps_the_other_headers_and_replaces_the_dropped_ones() {
        let h = headers(&[("a", Some(b"1")), ("Idem-Retries", Some(b"1")), ("b", None)]);
        let copy = copy_with(Some(&h), &["Idem-Retries"], &[("Idem-Retries", b"2")]);
        let pairs: Vec<(String, Option<Vec<u8>>)> =
            copy.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec))).collect();
        assert_eq!(
            pairs,
            vec![("a".into(), Some(b"1".to_vec())), ("b".into(), None), ("Idem-Retries".into(), Some(b"2".to_vec()))]
        );
    }
}
