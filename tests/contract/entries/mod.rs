//! The entry points, each mapping its native answer (a `Result` and its
//! outcome; an HTTP status, headers and body; a settlement and its
//! `on_settle` report; a `SlotReport`) to one vocabulary, [`Answer`], which
//! the clauses are written in. Adding an entry point is one impl of
//! [`EntryPoint`].

mod axum;
mod consumer;
mod cron;
mod direct;

use std::fmt;
use std::sync::Arc;

use idempotency::{Idem, Outcome};

use crate::backends::Store;
use crate::fns::{BoxFuture, CallError, Db};
use crate::script::Script;
use crate::table::{Entry, Mode, Options};

/// What a caller was answered, whatever the entry point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The fn's value, as the entry shows it (its JSON), and whether the
    /// entry marked it replayed.
    Value { bytes: String, replayed: bool },
    /// A declared error (recorded, or permanent in steps mode): its JSON,
    /// and whether marked replayed.
    Declined { bytes: String, replayed: bool },
    /// A duplicate of a running call: ask again later.
    InProgress,
    /// The key with other arguments: fix the caller.
    KeyReused,
    /// The body's own failure, nothing recorded.
    BodyFailed,
    /// Anything else, as the entry said it.
    Other(String),
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// What a handler or job made of its call, before its entry point settled
/// it: the bytes a caller would see.
#[derive(Debug, Clone)]
pub enum Produced {
    Value(String),
    Declined(String),
    Failed(String),
}

impl Produced {
    fn of(result: &Result<crate::fns::Paid, CallError>) -> Self {
        match result {
            Ok(paid) => Produced::Value(serde_json::to_string(paid).expect("a value's JSON")),
            Err(CallError::Declined(declined)) => {
                Produced::Declined(serde_json::to_string(declined).expect("a decline's JSON"))
            }
            Err(CallError::Idem(idempotency::Error::Permanent { failure, .. })) => {
                Produced::Declined(failure.as_json().to_owned())
            }
            Err(other) => Produced::Failed(format!("{other:?}")),
        }
    }
}

/// One entry point, over one engine: calls the fn of the cell's shape.
pub trait EntryPoint: Send + Sync {
    /// Calls the fn for the clause's `key` with `amount`, as this entry
    /// point does, and answers in the vocabulary.
    fn call(&self, key: &str, amount: i64, script: Arc<Script>) -> BoxFuture<'static, Answer>;

    /// The key the fn runs under for the clause's `key` (a cron job's key
    /// is its slot's).
    fn record_key(&self, key: &str) -> String {
        key.to_owned()
    }
}

/// The cell's entry point over `idem`, for the fn of `(mode, options)`.
pub async fn entry<F: Store>(entry: Entry, idem: Idem<Db<F>>, mode: Mode, options: Options) -> Arc<dyn EntryPoint> {
    let shape = Shape { idem, mode, options };
    match entry {
        Entry::Direct => Arc::new(direct::Direct::<F>(shape)),
        Entry::Axum => Arc::new(axum::Axum::<F>::new(shape)),
        Entry::Consumer => Arc::new(consumer::Consumer::<F>::start(shape).await),
        Entry::Cron => Arc::new(cron::Cron::<F>(shape)),
    }
}

/// The engine and the fn an entry point calls.
pub struct Shape<F: Store> {
    idem: Idem<Db<F>>,
    mode: Mode,
    options: Options,
}

impl<F: Store> Clone for Shape<F> {
    fn clone(&self) -> Self {
        Shape { idem: self.idem.clone(), mode: self.mode, options: self.options }
    }
}

impl<F: Store> Shape<F> {
    /// The call, as a handler or job makes it: through the script (its
    /// barrier, its pending sign).
    async fn call(&self, key: String, amount: i64, script: &Script) -> Result<crate::fns::Paid, CallError> {
        script.call(F::call(&self.idem, self.mode, self.options, key, amount, script)).await
    }
}

/// A direct caller's answer: the `Result` and the outcome `observe` saw.
fn from_result(result: &Result<crate::fns::Paid, CallError>, outcome: Option<Outcome>) -> Answer {
    let replayed = outcome == Some(Outcome::Replayed);
    let recorded = matches!(outcome, Some(Outcome::Executed | Outcome::Replayed));
    match (result, Produced::of(result)) {
        (Ok(_), Produced::Value(bytes)) => Answer::Value { bytes, replayed },
        // A declared error the fn does not record is the body's own failure.
        (Err(CallError::Declined(_)), Produced::Declined(_)) if !recorded => Answer::BodyFailed,
        (_, Produced::Declined(bytes)) => Answer::Declined { bytes, replayed },
        (Err(CallError::Idem(idempotency::Error::InProgress { .. })), _) => Answer::InProgress,
        (Err(CallError::Idem(idempotency::Error::KeyReused { .. })), _) => Answer::KeyReused,
        (Err(CallError::Body), _) => Answer::BodyFailed,
        (_, Produced::Failed(text) | Produced::Value(text)) => Answer::Other(text),
    }
}
