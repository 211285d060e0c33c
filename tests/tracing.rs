//! Guards the call's tracing span: one `idem` span per call, with `biz`,
//! `key` and `outcome` (`executed`, `replayed`, `key_reused`, `failed`), and
//! never the raw arguments or a rejected key.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use idempotency::{Idem, idempotent};
use sqlx::Sqlite;

/// A span's name and its fields, as text.
type Span = (String, BTreeMap<String, String>);

/// Records every span's name and fields.
#[derive(Clone, Default)]
struct Spans {
    next_id: Arc<AtomicU64>,
    spans: Arc<Mutex<BTreeMap<u64, Span>>>,
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl tracing::field::Visit for Fields<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl tracing::Subscriber for Spans {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, attrs: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        self.spans.lock().unwrap().insert(id, (attrs.metadata().name().to_owned(), fields));
        tracing::span::Id::from_u64(id)
    }
    fn record(&self, id: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        if let Some((_, fields)) = self.spans.lock().unwrap().get_mut(&id.into_u64()) {
            values.record(&mut Fields(fields));
        }
    }
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug
struct Failure(idempotency::Error);

impl From<idempotency::Error> for Failure {
    fn from(e: idempotency::Error) -> Self {
        Failure(e)
    }
}

#[idempotent(key = "acct_<account>", ttl = "1h", biz = "t_span")]
async fn transfer(idem: &Idem<Sqlite>, account: String, secret_note: String) -> Result<u32, Failure> {
    Ok(secret_note.len() as u32)
}

#[tokio::test]
async fn each_call_has_one_span_with_its_outcome_and_no_arguments() {
    let idem = Idem::sqlite_memory().await.unwrap();
    let spans = Spans::default();
    let _guard = tracing::subscriber::set_default(spans.clone());

    transfer(&idem, "a1".into(), "s3cr3t-31337".into()).await.unwrap();
    transfer(&idem, "a1".into(), "s3cr3t-31337".into()).await.unwrap();
    transfer(&idem, "a1".into(), "other-s3cr3t".into()).await.unwrap_err();
    transfer(&idem, "bad key\r\n".into(), "s3cr3t-31337".into()).await.unwrap_err();

    let spans = spans.spans.lock().unwrap();
    let idem_spans: Vec<_> = spans.values().filter(|(name, _)| name == "idem").map(|(_, f)| f).collect();
    let seen: Vec<(&str, &str, &str)> = idem_spans
        .iter()
        .map(|f| (f["biz"].as_str(), f["key"].as_str(), f.get("outcome").map_or("", String::as_str)))
        .collect();
    assert_eq!(
        seen,
        [
            ("t_span", "acct_a1", "executed"),
            ("t_span", "acct_a1", "replayed"),
            ("t_span", "acct_a1", "key_reused"),
            ("t_span", "<invalid>", "rejected"),
        ]
    );
    for (_, fields) in spans.values() {
        for value in fields.values() {
            assert!(!value.contains("s3cr3t") && !value.contains("bad key"), "logged: {value}");
        }
    }
}
