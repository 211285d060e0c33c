//! The statements sqlx sends, counted per thread: how many round trips a
//! call makes, and whether one was sent yet.

use std::cell::Cell;
use std::sync::Once;

thread_local! {
    /// The statements sqlx logged on this thread (its `sqlx::query` events).
    static STATEMENTS: Cell<usize> = const { Cell::new(0) };
}

/// Counts every thread's statements into its own [`STATEMENTS`]: tests on
/// other threads do not disturb a count. Installed as the global default
/// once (a scoped one misses events when another thread registered sqlx's
/// event sites first). SQLite's statements run on its worker thread and are
/// not seen. The engine's readings of the database's clock are not a call's
/// statements: one that failed on a loaded machine is taken again a second
/// later, in the background, on this thread; they are left out.
struct Statements;

/// Whether an event of sqlx's is a reading of the database's clock.
#[derive(Default)]
struct ClockReading(bool);

impl tracing::field::Visit for ClockReading {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0 |= matches!(field.name(), "summary" | "db.statement")
            && (value.contains("UTC_TIMESTAMP(6)") || value.contains("clock_timestamp()"));
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }
}

impl tracing::Subscriber for Statements {
    fn register_callsite(&self, meta: &'static tracing::Metadata<'static>) -> tracing::subscriber::Interest {
        if meta.target() == "sqlx::query" {
            tracing::subscriber::Interest::always()
        } else {
            tracing::subscriber::Interest::never()
        }
    }
    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        meta.target() == "sqlx::query"
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut clock = ClockReading::default();
        event.record(&mut clock);
        if !clock.0 {
            STATEMENTS.with(|n| n.set(n.get() + 1));
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Starts counting (once per test binary; each test runs in its own process).
pub(crate) fn count_statements() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        tracing::subscriber::set_global_default(Statements).expect("no other global subscriber in this binary");
    });
}

/// The statements counted on this thread so far.
pub(crate) fn statements() -> usize {
    STATEMENTS.with(Cell::get)
}
