//! What the consumer runners read of a message before its handler runs:
//! the message id, the JSON payload, and the count they settle by
//! (`x-idem-retries` on RabbitMQ, the delivery count of the reply subject
//! on JetStream). Input: the first byte picks the broker.
//!
//! - AMQP: two bytes (little-endian) of length, the basic properties as the
//!   broker sends them (flags first), then the body.
//! - NATS, as received: the reply subject, a line; header lines up to an
//!   empty line (none: no headers); then the payload.
//! - NATS, as JetStream writes it: a reply subject built from a delivery
//!   count, names and sequence numbers drawn from the input.
//! - Redis Streams: a byte picking the command (`XREADGROUP`, `XAUTOCLAIM`,
//!   `XPENDING`), then its reply as the server sends it (RESP): for each
//!   entry, the `message_id` field when it is UTF-8, decoding exactly when
//!   there is one and a `payload` field holding JSON.
//!
//! Checks: nothing panics; the id is the `message_id` property or the first
//! `Nats-Msg-Id` header, exactly; decoding succeeds exactly when there is
//! an id and the payload is JSON, and yields both unchanged; the retry
//! count is the header's integer when it is one (clamped to `u32`), else
//! 0; the delivery count read from a reply subject JetStream wrote is the
//! count it wrote.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use idempotency_fuzz::alloc;
use idempotency_runtime::__fuzz::{self, Consumed};
use lapin::types::AMQPValue;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(
    init: {
        // The JetStream context is made once; its allocations are not the input's.
        __fuzz::nats_message(None, None, b"");
    },
    |data: &[u8]| {
        let Some((&broker, rest)) = data.split_first() else { return };
        alloc::bounded(data.len(), || match broker % 4 {
            0 => amqp(rest),
            1 => nats(rest),
            2 => jetstream_reply(rest),
            _ => redis_stream(rest),
        });
    }
);

fn amqp(data: &[u8]) {
    let Some(len) = data.get(..2).map(|b| usize::from(u16::from_le_bytes([b[0], b[1]]))) else { return };
    let properties = data.get(2..).map(|rest| &rest[..len.min(rest.len())]).unwrap_or_default();
    let payload = &data[(2 + properties.len()).min(data.len())..];
    let Some(consumed) = __fuzz::amqp_delivery(properties, payload) else { return };
    let (_, parsed) = lapin::protocol::basic::parse_properties(properties).expect("parsed once already");
    let id = parsed.message_id().as_ref().map(|id| id.as_str().to_owned());
    check_decoded(&consumed, id, payload);
    let header = parsed.headers().as_ref().and_then(|h| h.inner().get("x-idem-retries").cloned());
    let retries: i128 = match header {
        Some(AMQPValue::ShortShortInt(n)) => n.into(),
        Some(AMQPValue::ShortShortUInt(n)) => n.into(),
        Some(AMQPValue::ShortInt(n)) => n.into(),
        Some(AMQPValue::ShortUInt(n)) => n.into(),
        Some(AMQPValue::LongInt(n)) => n.into(),
        Some(AMQPValue::LongUInt(n)) => n.into(),
        Some(AMQPValue::LongLongInt(n)) => n.into(),
        _ => 0,
    };
    assert_eq!(i128::from(consumed.count), retries.clamp(0, u32::MAX.into()), "{header:?}");
}

fn nats(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let (reply, rest) = text.split_once('\n').unwrap_or((text, ""));
    let (block, payload) = rest.split_once("\n\n").unwrap_or((rest, ""));
    let reply = (!reply.is_empty()).then_some(reply);
    let Some(headers) = header_lines(block) else { return };
    let pairs: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let headers = (!block.is_empty()).then_some(pairs.as_slice());
    let Some(consumed) = __fuzz::nats_message(reply, headers, payload.as_bytes()) else { return };
    let id = pairs.iter().find(|(name, _)| *name == "Nats-Msg-Id").map(|(_, value)| (*value).to_owned());
    check_decoded(&consumed, id, payload.as_bytes());
}

/// A header block split into lines as the NATS client splits what it
/// receives: `name: value`, a value continued on lines that start with
/// white space, trimmed; `None` for a line without `:` (the client drops
/// such a message). A value left holding a `\r` never reaches a runner
/// either: async-nats 0.51 asserts on it while reading, in its connection
/// task (`HeaderValue::from`; see docs/guarantees.md, "Fuzzing");
/// `nats_message` answers `None` for it.
fn header_lines(block: &str) -> Option<Vec<(&str, String)>> {
    let mut lines = block.lines().peekable();
    let mut headers = Vec::new();
    while let Some(line) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let (name, value) = line.split_once(':')?;
        let mut value = value.trim_start().to_owned();
        while let Some(more) = lines.next_if(|s| s.starts_with(char::is_whitespace)) {
            value.push_str(more);
        }
        value.truncate(value.trim_end().len());
        headers.push((name, value));
    }
    Some(headers)
}

/// `$JS.ACK.[<domain>.<account hash>.]<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>`.
fn jetstream_reply(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok((with_domain, delivered, numbers, names)) = <(bool, u64, [u64; 4], [&str; 4])>::arbitrary(&mut u) else {
        return;
    };
    if names.iter().any(|name| name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic() && b != b'.')) {
        return;
    }
    let [domain, hash, stream, consumer] = names;
    let [sseq, cseq, ns, pending] = numbers;
    let prefix = if with_domain { format!("$JS.ACK.{domain}.{hash}.") } else { "$JS.ACK.".to_owned() };
    let reply = format!("{prefix}{stream}.{consumer}.{delivered}.{sseq}.{cseq}.{ns}.{pending}");
    let consumed = __fuzz::nats_message(Some(&reply), None, b"{}").expect("no headers to refuse");
    // JetStream counts in an int64; the runner counts one when none is read.
    let expected = if i64::try_from(delivered).is_ok() { delivered } else { 1 };
    assert_eq!(consumed.count, expected, "{reply}");
}

fn check_decoded(consumed: &Consumed, id: Option<String>, payload: &[u8]) {
    assert_eq!(consumed.message_id, id);
    let json: Option<Value> = serde_json::from_slice(payload).ok();
    match (&consumed.decoded, id, json) {
        (Ok((got_id, got)), Some(id), Some(json)) => assert!(*got_id == id && *got == json),
        (Err(why), None, _) => assert!(why.starts_with("no "), "{why}"),
        (Err(why), Some(_), None) => assert!(why.starts_with("payload: "), "{why}"),
        (decoded, id, json) => panic!("decoded {decoded:?} from id {id:?} and payload {json:?}"),
    }
}

/// A Redis Streams reply: every entry read as the consumer core reads it.
fn redis_stream(data: &[u8]) {
    let Some((&kind, resp)) = data.split_first() else { return };
    let Some(Ok(entries)) = __fuzz::redis_stream_reply(kind, resp) else { return };
    for (_, consumed) in entries {
        if kind % 3 == 2 {
            continue; // a pending row: its count only
        }
        assert_eq!(consumed.count, 1, "read as a first delivery");
        match (&consumed.message_id, &consumed.decoded) {
            (Some(id), Ok((decoded_id, _))) => assert_eq!(id, decoded_id),
            (None, Ok(_)) => panic!("decoded without a message id"),
            (_, Err(_)) => {}
        }
    }
}

