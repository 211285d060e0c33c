//! Log lines and spans a test reads: a `tracing` subscriber that keeps every
//! event (its level, target and fields, the message among them) and every
//! span (its name and fields, as recorded until now), installed for a
//! test's own thread with `tracing::subscriber::set_default`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// One event as it was logged; every field as text (`message` too).
#[derive(Debug, Clone)]
pub struct Line {
    pub level: tracing::Level,
    pub target: String,
    pub fields: BTreeMap<String, String>,
}

impl Line {
    /// The field `name`, `""` when absent.
    pub fn field(&self, name: &str) -> &str {
        self.fields.get(name).map_or("", String::as_str)
    }

    /// Every field's name and value, for a check that none holds a secret.
    pub fn text(&self) -> String {
        format!("{} {:?}", self.target, self.fields)
    }
}

/// A span's name and its fields, as text.
pub type Span = (String, BTreeMap<String, String>);

/// Keeps the lines of every event and the spans it sees; clones share them.
#[derive(Clone, Default)]
pub struct Logs {
    next_span: Arc<AtomicU64>,
    lines: Arc<Mutex<Vec<Line>>>,
    spans: Arc<Mutex<BTreeMap<u64, Span>>>,
}

impl Logs {
    /// The lines whose message is `message`, in the order logged.
    pub fn with_message(&self, message: &str) -> Vec<Line> {
        self.lines.lock().unwrap().iter().filter(|line| line.field("message") == message).cloned().collect()
    }

    /// Every line so far.
    pub fn lines(&self) -> Vec<Line> {
        self.lines.lock().unwrap().clone()
    }

    /// Every span so far, in the order they were made.
    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().values().cloned().collect()
    }
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

impl tracing::Subscriber for Logs {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, attrs: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let id = self.next_span.fetch_add(1, Ordering::Relaxed) + 1;
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

    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        let metadata = event.metadata();
        let line = Line { level: *metadata.level(), target: metadata.target().to_owned(), fields };
        self.lines.lock().unwrap().push(line);
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}
