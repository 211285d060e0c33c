//! What the runner reads from a Kafka message's headers, and writes on the
//! copies it produces. Kafka headers are a list of (name, bytes) pairs in
//! which a name may repeat: as Kafka's own `Headers::lastHeader`, the last
//! one of a name counts.
//!
//! Names are read as bytes, through librdkafka's own header API: Kafka and
//! librdkafka pass them through unchecked, so any producer can write one
//! that is not UTF-8, and rdkafka's `Headers::try_get` unwraps the UTF-8
//! check (a panic in the task that polls, on every consumer of the group
//! that fetches the record). Such a message is poison ([`malformed`]).
//! These read input from the outside world: they never panic.

use std::ffi::CStr;
use std::fmt::Write as _;

use rdkafka::bindings::{rd_kafka_header_cnt, rd_kafka_header_get_all, rd_kafka_headers_t, rd_kafka_message_headers};
use rdkafka::message::{BorrowedMessage, Header, OwnedHeaders};
use rdkafka::types::RDKafkaRespErr;

/// One header as the runner holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Field {
    /// Its name, as the producer wrote it (up to a first NUL byte, which
    /// librdkafka's API cannot show).
    pub(crate) name: Vec<u8>,
    /// Its value; `None` for a header without one.
    pub(crate) value: Option<Vec<u8>>,
}

/// Every header of a fetched message, in order; `Err` (why) when librdkafka
/// cannot parse the message's header block.
pub(crate) fn of_message(message: &BorrowedMessage<'_>) -> Result<Vec<Field>, String> {
    let mut headers: *mut rd_kafka_headers_t = std::ptr::null_mut();
    // SAFETY: `message.ptr()` is the live message `message` borrows; the
    // header list librdkafka hands back lives as long as that message.
    let err = unsafe { rd_kafka_message_headers(message.ptr(), &mut headers) };
    match err {
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR if !headers.is_null() => {
            // SAFETY: a live header list, read before `message` is dropped.
            Ok(unsafe { of_native(headers) })
        }
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR | RDKafkaRespErr::RD_KAFKA_RESP_ERR__NOENT => Ok(Vec::new()),
        err => Err(format!("headers not readable: {}", rdkafka::error::RDKafkaErrorCode::from(err))),
    }
}

/// Every header of a librdkafka header list, in order, names as bytes.
///
/// # Safety
/// `headers` points to a live header list, not changed while this runs.
pub(crate) unsafe fn of_native(headers: *const rd_kafka_headers_t) -> Vec<Field> {
    // SAFETY: the caller's promise.
    let count = unsafe { rd_kafka_header_cnt(headers) };
    let mut fields = Vec::with_capacity(count);
    for idx in 0..count {
        let (mut name, mut value, mut size) = (std::ptr::null(), std::ptr::null(), 0usize);
        // SAFETY: `idx < count` on a live list; librdkafka writes the three
        // pointers, which stay valid as long as the list.
        let err = unsafe { rd_kafka_header_get_all(headers, idx, &mut name, &mut value, &mut size) };
        if err != RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            continue;
        }
        // SAFETY: librdkafka keeps every name NUL-terminated, and a value as
        // `size` bytes at `value` (null for a header without one).
        let name = unsafe { CStr::from_ptr(name) }.to_bytes().to_vec();
        let value =
            (!value.is_null()).then(|| unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) }.to_vec());
        fields.push(Field { name, value });
    }
    fields
}

/// Why these headers make their message poison: the first name that is
/// not UTF-8 (its position and bytes); `None` when every name is.
pub(crate) fn malformed(fields: &[Field]) -> Option<String> {
    let (i, field) = fields.iter().enumerate().find(|(_, f)| std::str::from_utf8(&f.name).is_err())?;
    let shown = &field.name[..field.name.len().min(32)];
    let mut hex = String::with_capacity(shown.len() * 2);
    for byte in shown {
        let _ = write!(hex, "{byte:02x}");
    }
    let more = if field.name.len() > shown.len() { "..." } else { "" };
    Some(format!("header {i}'s name is not UTF-8 (bytes {hex}{more})"))
}

/// The value of the last header named `name`, if any (a header without a
/// value counts as none).
pub(crate) fn last<'a>(fields: &'a [Field], name: &str) -> Option<&'a [u8]> {
    fields.iter().rev().find(|f| f.name == name.as_bytes()).and_then(|f| f.value.as_deref())
}

/// The message id: the last `name` header, when it is UTF-8 (never a
/// lossy copy, which could merge two ids).
pub(crate) fn message_id(fields: &[Field], name: &str) -> Option<String> {
    last(fields, name).and_then(|v| std::str::from_utf8(v).ok()).map(str::to_owned)
}

/// The retry count: the last `name` header when it is a decimal number
/// (ASCII digits only, at most `u64::MAX`), else 0, as for a first attempt.
pub(crate) fn retries(fields: &[Field], name: &str) -> u64 {
    last(fields, name).map(count_of).unwrap_or(0)
}

/// A decimal count, 0 when it is none.
pub(crate) fn count_of(value: &[u8]) -> u64 {
    if value.is_empty() || value.len() > 20 || !value.iter().all(u8::is_ascii_digit) {
        return 0;
    }
    std::str::from_utf8(value).ok().and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// The headers of a copy the runner produces (a retry, a dead letter):
/// `fields` without those named in `drop`, then `extra` appended. When a
/// name in `fields` is not UTF-8 (rdkafka writes names from `&str` only),
/// the copy keeps `raw`, the original's own header list, byte for byte,
/// and `extra` is appended to it: nothing is dropped, and the last header
/// of a name counts.
pub(crate) fn copy_with(
    fields: &[Field],
    raw: Option<&OwnedHeaders>,
    drop: &[&str],
    extra: &[(&str, &[u8])],
) -> OwnedHeaders {
    let mut out = match (malformed(fields), raw) {
        (Some(_), Some(raw)) => raw.clone(),
        _ => {
            let mut out = OwnedHeaders::new_with_capacity(fields.len() + extra.len());
            for field in fields {
                let Ok(name) = std::str::from_utf8(&field.name) else { continue };
                if !drop.contains(&name) {
                    out = out.insert(Header { key: name, value: field.value.as_deref() });
                }
            }
            out
        }
    };
    for (key, value) in extra {
        out = out.insert(Header { key, value: Some(*value) });
    }
    out
}

/// A librdkafka header list built from raw names and values (which
/// rdkafka's `OwnedHeaders` cannot hold): what a producer of another
/// client can send, for the tests and the fuzz door of the reading path.
#[cfg(any(test, fuzzing))]
pub(crate) struct Native(*mut rd_kafka_headers_t);

#[cfg(any(test, fuzzing))]
impl Native {
    pub(crate) fn new(fields: &[Field]) -> Native {
        use rdkafka::bindings::{rd_kafka_header_add, rd_kafka_headers_new};
        // SAFETY: a new list, owned by the value returned.
        let list = unsafe { rd_kafka_headers_new(fields.len()) };
        for field in fields {
            let (value, size) = match &field.value {
                Some(v) => (v.as_ptr().cast(), v.len() as isize),
                None => (std::ptr::null(), 0),
            };
            // SAFETY: librdkafka copies the name and value bytes.
            unsafe { rd_kafka_header_add(list, field.name.as_ptr().cast(), field.name.len() as isize, value, size) };
        }
        Native(list)
    }

    /// Its headers, read as the runner reads a fetched message's.
    pub(crate) fn read(&self) -> Vec<Field> {
        // SAFETY: the list this value owns.
        unsafe { of_native(self.0) }
    }
}

#[cfg(any(test, fuzzing))]
impl Drop for Native {
    fn drop(&mut self) {
        // SAFETY: the list this value owns, destroyed once.
        unsafe { rdkafka::bindings::rd_kafka_headers_destroy(self.0) }
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::message::Headers as _;

    use super::*;

    fn fields(pairs: &[(&[u8], Option<&[u8]>)]) -> Vec<Field> {
        pairs.iter().map(|(name, value)| Field { name: name.to_vec(), value: value.map(<[u8]>::to_vec) }).collect()
    }

    #[test]
    fn the_last_header_of_a_name_counts_and_bad_values_read_as_none() {
        let h = fields(&[
            (b"Idem-Retries", Some(b"2")),
            (b"Idem-Message-Id", Some(b"first")),
            (b"Idem-Retries", Some(b"5")),
            (b"Idem-Message-Id", Some(b"second")),
        ]);
        assert_eq!(retries(&h, "Idem-Retries"), 5);
        assert_eq!(message_id(&h, "Idem-Message-Id").as_deref(), Some("second"));
        for bad in [&b""[..], b"-1", b"+3", b" 3", b"3x", b"99999999999999999999", b"\xff"] {
            assert_eq!(retries(&fields(&[(b"Idem-Retries", Some(bad))]), "Idem-Retries"), 0, "{bad:?}");
        }
        assert_eq!(retries(&fields(&[(b"Idem-Retries", Some(b"18446744073709551615"))]), "Idem-Retries"), u64::MAX);
        assert_eq!(message_id(&fields(&[(b"Idem-Message-Id", Some(b"\xff"))]), "Idem-Message-Id"), None);
        assert_eq!(message_id(&fields(&[(b"Idem-Message-Id", None)]), "Idem-Message-Id"), None);
        assert_eq!(message_id(&[], "Idem-Message-Id"), None);
    }

    #[test]
    fn a_copy_keeps_the_other_headers_and_replaces_the_dropped_ones() {
        let h = fields(&[(b"a", Some(b"1")), (b"Idem-Retries", Some(b"1")), (b"b", None)]);
        let copy = copy_with(&h, None, &["Idem-Retries"], &[("Idem-Retries", b"2")]);
        let pairs: Vec<(String, Option<Vec<u8>>)> =
            copy.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec))).collect();
        assert_eq!(
            pairs,
            vec![("a".into(), Some(b"1".to_vec())), ("b".into(), None), ("Idem-Retries".into(), Some(b"2".to_vec()))]
        );
    }

    /// Regression: rdkafka's own reading unwrapped a header name's UTF-8
    /// check, so a name another client wrote as bytes panicked the task
    /// that polls. Read through librdkafka's API, it is the message's
    /// problem, named, and a copy keeps it byte for byte.
    #[test]
    fn a_header_name_that_is_not_utf8_is_read_as_bytes_and_makes_the_message_poison() {
        let sent = fields(&[(b"ok", Some(b"1")), (b"\xff\xfebad", Some(b"v")), (b"Idem-Retries", Some(b"2"))]);
        let native = Native::new(&sent);
        let read = native.read();
        assert_eq!(read, sent);
        assert_eq!(malformed(&read).as_deref(), Some("header 1's name is not UTF-8 (bytes fffe626164)"));
        assert_eq!(retries(&read, "Idem-Retries"), 2, "the other headers still read");
        assert_eq!(malformed(&fields(&[(b"ok", None)])), None);
        let long = vec![0xff; 40];
        let why = malformed(&fields(&[(&long, None)])).unwrap();
        assert!(why.ends_with(&format!("{}...)", "ff".repeat(32))), "{why}");

        // The copy: the original list as librdkafka holds it (`raw`), then
        // the runner's own headers; the fields are not rebuilt.
        let raw = OwnedHeaders::new().insert(Header { key: "as-fetched", value: Some(b"1") });
        let names = |h: &OwnedHeaders| h.iter().map(|h| h.key.to_owned()).collect::<Vec<_>>();
        let copy = copy_with(&read, Some(&raw), &["Idem-Retries"], &[("Idem-Dead-Reason", b"poison")]);
        assert_eq!(names(&copy), ["as-fetched", "Idem-Dead-Reason"]);
        let fine = copy_with(&fields(&[(b"ok", Some(b"1"))]), Some(&raw), &[], &[]);
        assert_eq!(names(&fine), ["ok"], "well-formed fields are rebuilt");
    }
}
