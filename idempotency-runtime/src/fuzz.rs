//! Doors for the fuzz targets in `fuzz/` (cargo-fuzz builds with
//! `--cfg fuzzing`; nothing here exists otherwise): every parser of bytes
//! that come from outside, behind a signature of plain bytes and strings,
//! so the targets keep working when the parsers move. Each door runs the
//! parser's own code, from the bytes as they arrive to the verdict the
//! engine acts on; none re-implements one.

use serde_json::Value;

/// A request refused before the handler runs, as the caller sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The HTTP status.
    pub status: u16,
    /// The problem's `code`.
    pub code: &'static str,
    /// The problem's `detail`.
    pub detail: String,
    /// The whole `application/problem+json` body.
    pub body: String,
}

impl From<crate::http::ProblemDetails> for Refusal {
    fn from(problem: crate::http::ProblemDetails) -> Self {
        let body = problem.body();
        Refusal { status: problem.status, code: problem.code, detail: problem.detail, body }
    }
}

/// Whether an HTTP server would hand these header values on at all (the
/// `http` crate's rule: no control bytes but tab): `None` otherwise.
#[cfg(feature = "axum")]
fn receivable(values: &[&[u8]]) -> Option<()> {
    values.iter().all(|v| http::HeaderValue::from_bytes(v).is_ok()).then_some(())
}

/// The `Idempotency-Key` rule on a request with these header lines, as
/// every HTTP adapter applies it (the framework-free core).
#[cfg(feature = "axum")]
pub fn idempotency_key(values: &[&[u8]]) -> Option<Result<String, Refusal>> {
    receivable(values)?;
    let found = crate::http::IdempotencyKey::from_header_values(values.iter().copied());
    Some(found.map(|key| key.0).map_err(Refusal::from))
}

/// The `Idempotency-Token` rule (`Ok(None)`: no such header).
#[cfg(feature = "axum")]
pub fn idempotency_token(values: &[&[u8]]) -> Option<Result<Option<String>, Refusal>> {
    receivable(values)?;
    let found = crate::http::IdempotencyToken::from_header_values(values.iter().copied());
    Some(found.map(|t| t.map(|t| t.0)).map_err(Refusal::from))
}

/// `KeyOrToken` on a request with these key and token header lines:
/// `Ok((true, key))` for a key, `Ok((false, token))` for a token.
#[cfg(feature = "axum")]
pub fn key_or_token(keys: &[&[u8]], tokens: &[&[u8]]) -> Option<Result<(bool, String), Refusal>> {
    use crate::http::KeyOrToken;
    receivable(keys)?;
    receivable(tokens)?;
    let found = KeyOrToken::from_header_values(keys.iter().copied(), tokens.iter().copied()).map_err(Refusal::from);
    Some(found.map(|found| match found {
        KeyOrToken::Key(key) => (true, key.0),
        KeyOrToken::Token(token) => (false, token.0),
    }))
}

/// The principal rule.
pub fn check_principal(principal: &str) -> Result<(), Refusal> {
    crate::http::validate_principal(principal).map_err(Refusal::from)
}

/// What the claim gate makes of a value its claim script hands back: a
/// field of a result hash, or the value at a claim's key.
#[cfg(feature = "redis")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cached {
    /// A finished call's result, live at the time asked.
    Finished {
        /// The first 16 bytes of its fingerprint, in hex.
        fingerprint_prefix: String,
        /// Its serialized result.
        response: String,
        /// Its record's expiry (epoch ms).
        expires_ms: i64,
    },
    /// Someone else's: a running call, or a value idempotency did not write.
    Running,
    /// No answer: an expired result, as the claim script skips it.
    Nothing,
}

/// The value a finished call leaves in its window's result hash.
#[cfg(feature = "redis")]
pub fn cached_value_written(expires_ms: i64, fingerprint: &str, response: &str) -> Vec<u8> {
    crate::gate::redis::layout::result_value(expires_ms, fingerprint, response, false)
}

/// The value a running call holds its claim with.
#[cfg(feature = "redis")]
pub fn claim_value_written(fingerprint: &str) -> Vec<u8> {
    crate::gate::redis::layout::claim_value(fingerprint).into_bytes()
}

/// The gate's reading of `value` at `now_ms` (database time): the claim
/// script's expiry test (bytes 2 to 7, big endian) and the gate's parse.
#[cfg(feature = "redis")]
pub fn cached_value_read(value: &[u8], now_ms: u64) -> Cached {
    if value.first() != Some(&b'd') {
        return Cached::Running;
    }
    match crate::gate::redis::layout::parse_result(value.to_vec()) {
        Some(stored) if u64::try_from(stored.expires_ms).is_ok_and(|at| at > now_ms) => Cached::Finished {
            fingerprint_prefix: stored.fingerprint_prefix_hex().as_str().to_owned(),
            response: stored.response,
            expires_ms: stored.expires_ms,
        },
        Some(_) => Cached::Nothing,
        None => Cached::Running,
    }
}

/// The value an issued token's owner key holds (`used`: once consumed).
#[cfg(feature = "redis")]
pub fn token_owner_written(used: bool, expires_at_ms: u64, subject: &str) -> Vec<u8> {
    use crate::token::redis::{Owner, owner_value};
    owner_value(if used { Owner::Used } else { Owner::Issued }, expires_at_ms, subject).into_bytes()
}

/// The token module's reading of an owner key's value: `(used, expires,
/// subject)`, `Ok(None)` for a value it did not write.
#[cfg(feature = "redis")]
pub fn token_owner_read(value: &[u8]) -> Result<Option<(bool, u64, String)>, String> {
    use crate::token::redis::{Owner, parse_owner};
    let value: Vec<u8> =
        redis::from_redis_value(redis::Value::BulkString(value.to_vec())).map_err(|e| e.to_string())?;
    Ok(parse_owner(&value).map(|(state, expires, subject)| (state == Owner::Used, expires, subject.to_owned())))
}

/// The token module's reading of a live key's value at `now_ms`: its
/// expiry, `Ok(None)` for an expired or foreign value.
#[cfg(feature = "redis")]
pub fn token_live_read(value: &[u8], now_ms: u64) -> Result<Option<u64>, String> {
    let value: Vec<u8> =
        redis::from_redis_value(redis::Value::BulkString(value.to_vec())).map_err(|e| e.to_string())?;
    Ok(crate::token::redis::live_expiry(&value, now_ms))
}

/// What a consumer runner reads of one message before its handler runs.
#[cfg(any(feature = "amqp", feature = "nats", feature = "redis-streams", feature = "kafka"))]
#[derive(Debug, Clone, PartialEq)]
pub struct Consumed {
    /// The message id, if any (what `run_with_id` keys the call by).
    pub message_id: Option<String>,
    /// `run_with_id`'s decoding: the id and the JSON payload, or why the
    /// message is poison.
    pub decoded: Result<(String, Value), String>,
    /// The count the runner settles by: `x-idem-retries` (AMQP),
    /// `Idem-Retries` (Kafka), or the delivery count (NATS, Redis).
    pub count: u64,
}

/// An AMQP delivery whose content header carries `properties` (the basic
/// properties as the broker sends them, flags first) and whose body is
/// `payload`; `None` when the client library refuses the properties.
#[cfg(feature = "amqp")]
pub fn amqp_delivery(properties: &[u8], payload: &[u8]) -> Option<Consumed> {
    let (_, properties) = lapin::protocol::basic::parse_properties(properties).ok()?;
    let mut delivery = lapin::message::Delivery::mock(1, "".into(), "q".into(), false, payload.to_vec());
    delivery.properties = properties;
    consumed::<crate::consumer::amqp::Rabbit>(&delivery)
}

/// A JetStream message with this reply subject and these header lines
/// (`name: value` pairs, already split as the client splits a header
/// block; `None`: a message without headers), and `payload`; `None` when
/// the client library refuses a header name or value.
#[cfg(feature = "nats")]
pub fn nats_message(reply: Option<&str>, headers: Option<&[(&str, &str)]>, payload: &[u8]) -> Option<Consumed> {
    use std::str::FromStr;
    let headers = match headers {
        None => None,
        Some(lines) => {
            let mut map = async_nats::HeaderMap::new();
            for (name, value) in lines {
                let name = async_nats::header::HeaderName::from_str(name).ok()?;
                map.append(name, async_nats::HeaderValue::from_str(value).ok()?);
            }
            Some(map)
        }
    };
    let message = async_nats::jetstream::Message {
        message: async_nats::Message {
            subject: "s".into(),
            reply: reply.map(Into::into),
            payload: payload.to_vec().into(),
            headers,
            status: None,
            description: None,
            length: payload.len(),
        },
        context: nats_context().clone(),
    };
    consumed::<crate::consumer::nats::Jet>(&message)
}

/// A Kafka message on the runner's retry topic with these headers (name
/// and value, `None`: a header without a value; in order, names may
/// repeat) and payload (`None`: a null payload), read as the Kafka runner
/// reads what it fetched: the headers through librdkafka's own list.
#[cfg(feature = "kafka")]
pub fn kafka_message(headers: &[(&str, Option<&[u8]>)], payload: Option<&[u8]>) -> Consumed {
    use crate::consumer::kafka::headers::{Field, Native};
    use crate::consumer::kafka::reader::{Reading, read};
    let fields: Vec<Field> = headers
        .iter()
        .map(|(name, value)| Field { name: name.as_bytes().to_vec(), value: value.map(<[u8]>::to_vec) })
        .collect();
    let message = rdkafka::message::OwnedMessage::new(
        payload.map(<[u8]>::to_vec),
        None,
        "t.g.retry".to_owned(),
        rdkafka::Timestamp::NotAvailable,
        0,
        0,
        None,
    );
    let reading = Reading {
        message_id_header: crate::kafka::MESSAGE_ID_HEADER.to_owned(),
        retries_header: crate::kafka::RETRIES_HEADER.to_owned(),
        retry_topic: "t.g.retry".to_owned(),
    };
    let received = read(message, Native::new(&fields).read(), None, &reading);
    consumed::<crate::consumer::kafka::settler::Group>(&received).expect("always read")
}

/// What the consumer core reads of a delivery of `T`, as its runner does.
#[cfg(any(feature = "amqp", feature = "nats", feature = "redis-streams", feature = "kafka"))]
fn consumed<T: crate::consumer::transport::Settle>(delivery: &T::Delivery) -> Option<Consumed> {
    Some(Consumed {
        message_id: T::message_id(delivery).map(str::to_owned),
        decoded: crate::consumer::decode::message_id_and_payload::<T, Value>(delivery),
        count: T::spent(delivery),
    })
}

/// A Redis Streams reply, as the server sends it (RESP bytes), read as the
/// stream consumer reads it: `XREADGROUP` (`kind` 0), `XAUTOCLAIM` (1) or
/// `XPENDING` (2); `None` when the bytes are no RESP value. For each
/// entry: its id and what the consumer core makes of its fields.
#[cfg(feature = "redis-streams")]
pub fn redis_stream_reply(kind: u8, resp: &[u8]) -> Option<Result<Vec<(String, Consumed)>, String>> {
    use crate::consumer::redis_streams::reply;
    let value = redis::parse_redis_value(resp).ok()?;
    Some(match kind % 3 {
        0 => reply::entries_of_read_reply(&value).map(stream_entries),
        1 => reply::entries_of_autoclaim_reply(&value).map(|(_, entries)| stream_entries(entries)),
        _ => reply::delivery_counts_of_pending_reply(&value).map(|counts| {
            counts
                .into_iter()
                .map(|(id, n)| (id, Consumed { message_id: None, decoded: Err("pending".into()), count: n }))
                .collect()
        }),
    })
}

/// Each entry's id and what the consumer core reads of it.
#[cfg(feature = "redis-streams")]
fn stream_entries(entries: Vec<crate::consumer::redis_streams::reply::RawEntry>) -> Vec<(String, Consumed)> {
    use crate::consumer::redis_streams::{Entry, settler::Group};
    entries
        .into_iter()
        .map(|raw| {
            let entry = Entry::with_default_names(raw);
            let consumed = consumed::<Group>(&entry).expect("always read");
            (entry.id.clone(), consumed)
        })
        .collect()
}

/// A JetStream context for messages that are read, never acked: its
/// client connects lazily, on a runtime that is never driven again.
#[cfg(feature = "nats")]
fn nats_context() -> &'static async_nats::jetstream::Context {
    static CONTEXT: std::sync::OnceLock<(tokio::runtime::Runtime, async_nats::jetstream::Context)> =
        std::sync::OnceLock::new();
    &CONTEXT
        .get_or_init(|| {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
            let context = runtime.block_on(async {
                let options = async_nats::ConnectOptions::new().retry_on_initial_connect();
                let client = options.connect("127.0.0.1:1").await.expect("a lazy client connects later");
                async_nats::jetstream::new(client)
            });
            (runtime, context)
        })
        .1
}

/// The canonical JSON the fingerprint hashes.
pub fn canonical_json(value: &Value) -> Vec<u8> {
    crate::fingerprint::canonical_json(value).into_bytes()
}

/// The fingerprint of a call whose arguments are `args`, in this order.
pub fn fingerprint<T: serde::Serialize>(args: &[(&'static str, T)]) -> Result<String, String> {
    let mut fingerprint = crate::fingerprint::Fingerprint::new();
    for (name, value) in args {
        fingerprint = fingerprint.arg(name, value);
    }
    fingerprint.finish().map_err(|e| e.to_string())
}

/// Lowercase hex SHA-256, as fingerprints are written.
pub fn sha256_hex(bytes: &[u8]) -> String {
    crate::fingerprint::sha256_hex(bytes)
}

/// The values of one record, as a text writes them (`store::text`).
#[derive(Debug, Clone, Copy)]
pub struct RecordValues<'a> {
    pub biz: &'a str,
    pub key: &'a str,
    pub biz_no: Option<&'a str>,
    pub params_hash: &'a str,
    pub status: i16,
    pub response: Option<&'a str>,
    pub now_ms: i64,
    pub expires_ms: i64,
}

/// Every text a server is sent with a record's values written in: per
/// dialect (`"mysql"`, `"postgres"`), its name and its SQL. `bound` is the
/// lock-wait bound in the server's unit. Also the key's digest, which the
/// texts write first.
pub fn record_texts(values: RecordValues<'_>, bound: i64) -> ([u8; 16], Vec<(&'static str, &'static str, String)>) {
    use crate::store::{Dialect, NewRecord, RowKey, Text};
    let rec = NewRecord {
        key: RowKey::new(values.biz, values.key),
        biz_no: values.biz_no,
        params_hash: values.params_hash,
        status: values.status,
        response: values.response,
        now_ms: values.now_ms,
        expires_ms: values.expires_ms,
    };
    let mut texts = Vec::new();
    for (name, dialect) in [("mysql", Dialect::MySql), ("postgres", Dialect::Postgres)] {
        let mut insert = Text::new(dialect, 0);
        insert.insert(&rec);
        let mut update = Text::new(dialect, 0);
        update.mark_finished(&rec);
        for (what, text) in [
            ("insert", insert),
            ("mark_finished", update),
            ("begin_inserting", dialect.begin_inserting(&rec, bound)),
            ("insert_committing", dialect.insert_committing(&rec, bound)),
            ("finish_committing", dialect.finish_committing(&rec)),
        ] {
            texts.push((name, what, text.as_str().to_owned()));
        }
    }
    (crate::key::key_digest(values.biz, values.key), texts)
}
