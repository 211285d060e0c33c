//! The flow of one call: [`run`], the single entry point the
//! `#[idempotent]` attribute calls. It asks the gate (layer 2), then the
//! record table (layer 3) one question per phase, and reports the outcome.
//!
//! entry point → **call flow** → gate → record protocol → backend
//!
//! A call inside a transaction its caller holds (`join`) has its own flow,
//! [`joined`], without the gate.

use std::future::Future;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::Transaction;
use tracing::Instrument;

use crate::engine::Idem;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::gate::{Answer, Entry};
use crate::key::{validate_biz_no, validate_key};
use crate::metrics::{Source, Timer};
use crate::outcome::{self, Outcome};
use crate::retention;
use crate::spec::Spec;
use crate::store::pooling::around_body;
use crate::store::record::{Committed, Opened, RecordKey, Settled, rollback};
use crate::store::{Backend, SUCCEEDED, StoredRecord};

pub(crate) mod joined;

/// Why a call did not return a value: the engine's reason, or the body's.
enum CallError<E> {
    Idem(Error),
    Body(E),
}

impl<E> From<Error> for CallError<E> {
    fn from(e: Error) -> Self {
        CallError::Idem(e)
    }
}

/// A finished call: its value, whether it ran now or was replayed, and
/// where a replay came from.
struct Done<T> {
    value: T,
    outcome: Outcome,
    source: Option<Source>,
}

/// Runs `body` once per `(spec.biz, key)`; the code the attribute writes
/// calls this. `body` gets the transaction the record is written in and
/// hands it back with its result.
pub async fn run<DB, T, E, F, Fut>(
    engine: &Idem<DB>,
    spec: &'static Spec,
    key: String,
    fingerprint: Fingerprint,
    biz_no: Option<String>,
    body: F,
) -> Result<T, E>
where
    DB: Backend,
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: FnOnce(Transaction<'static, DB>) -> Fut,
    Fut: Future<Output = (Transaction<'static, DB>, Result<T, E>)>,
{
    let timer = Timer::start();
    let checked = validate_key(&key);
    // A rejected key is not logged: it may hold anything the caller sent.
    let shown_key = if checked.is_ok() { key.as_str() } else { "<invalid>" };
    let span = tracing::info_span!("idem", biz = spec.biz, key = shown_key, outcome = tracing::field::Empty);
    let result = match checked {
        Ok(()) => call(engine, spec, &key, fingerprint, biz_no.as_deref(), body).instrument(span.clone()).await,
        Err(e) => Err(e.into()),
    };
    answer(spec, &span, timer, result)
}

/// Reports how a call ended (its span, the outcome, the metrics) and hands
/// the caller its result.
fn answer<T, E: From<Error>>(
    spec: &'static Spec,
    span: &tracing::Span,
    timer: Timer,
    result: Result<Done<T>, CallError<E>>,
) -> Result<T, E> {
    let outcome = match &result {
        Ok(done) => done.outcome,
        Err(CallError::Idem(e)) => Outcome::of(e),
        Err(CallError::Body(_)) => Outcome::Failed,
    };
    span.record("outcome", outcome.as_str());
    outcome::report(outcome);
    crate::metrics::call_finished(spec.biz, outcome, result.as_ref().ok().and_then(|done| done.source), timer);
    match result {
        Ok(done) => Ok(done.value),
        Err(CallError::Idem(e)) => Err(E::from(e)),
        Err(CallError::Body(e)) => Err(e),
    }
}

/// The call, its key already checked.
async fn call<DB, T, E, F, Fut>(
    engine: &Idem<DB>,
    spec: &'static Spec,
    key: &str,
    fingerprint: Fingerprint,
    biz_no: Option<&str>,
    body: F,
) -> Result<Done<T>, CallError<E>>
where
    DB: Backend,
    T: Serialize + DeserializeOwned,
    F: FnOnce(Transaction<'static, DB>) -> Fut,
    Fut: Future<Output = (Transaction<'static, DB>, Result<T, E>)>,
{
    if let Some(no) = biz_no {
        validate_biz_no(no)?;
    }
    let fingerprint = fingerprint.finish()?;
    let ttl = retention::record_ttl(spec.ttl);
    let id = RecordKey { biz: spec.biz, key, fingerprint: &fingerprint, biz_no, ttl };
    // Expiry is stamped and judged on the database's clock: an engine's
    // first call reads it (once); later calls pay one atomic load.
    engine.now_ms().await;

    let entry = engine.gate().enter(engine.db(), spec.biz, key, &fingerprint, spec.lease, engine.lock_wait()).await;
    let pass = match entry {
        Entry::GoAhead(pass) => pass,
        Entry::Replay(answer, source) => {
            let value = replay(&id, &answer.fingerprint, &answer.response)?;
            return Ok(Done { value, outcome: Outcome::Replayed, source: Some(source) });
        }
        Entry::Busy { may_have_committed } => {
            // A claim outlives its call's commit until the cache write lands
            // (or for good, if the process died right after it): a committed
            // call is in the record.
            if may_have_committed && let Some(row) = engine.records().read_live(spec.biz, key).await? {
                let (value, outcome, answer) = replay_row(&id, row)?.split(fingerprint.clone());
                engine.gate().remember(spec.biz, key, &answer);
                return Ok(Done { value, outcome, source: Some(Source::Database) });
            }
            return Err(id_in_progress(&id).into());
        }
    };

    // On the heap from the start: the body's and the database's futures
    // run to kilobytes, and every wrapper that took it by value (the outbox
    // scope, the span, the caller's future) would copy it, first calls and
    // replays alike. A replay never builds this one.
    let executed = Box::pin(execute(engine, &id, pass.holds_claim(), body));
    // Events the body queues take their ids from the call (`outbox::queue`).
    #[cfg(feature = "outbox")]
    let executed = crate::outbox::scope(engine, spec.biz, key, executed);
    match executed.await {
        Ok(recorded) => {
            // The stored result goes on to the duplicates: to Redis in place
            // of our claim, or to those waiting here.
            let (value, outcome, answer) = recorded.split(fingerprint.clone());
            pass.finish(&answer);
            engine.gate().remember(spec.biz, key, &answer);
            let source = (outcome == Outcome::Replayed).then_some(Source::Database);
            Ok(Done { value, outcome, source })
        }
        Err(e) => {
            pass.abandon().await;
            Err(e)
        }
    }
}

/// The database part of a call, done: the value, its stored form, and when
/// the record expires.
struct Recorded<T> {
    value: T,
    response: String,
    expires_ms: i64,
    outcome: Outcome,
}

impl<T> Recorded<T> {
    /// The value, and what the duplicates are handed: the stored result.
    fn split(self, fingerprint: String) -> (T, Outcome, Arc<Answer>) {
        let answer = Answer { fingerprint, response: self.response, expires_ms: self.expires_ms };
        (self.value, self.outcome, Arc::new(answer))
    }
}

/// The body and its record, in one transaction.
async fn execute<DB, T, E, F, Fut>(
    engine: &Idem<DB>,
    id: &RecordKey<'_>,
    claimed: bool,
    body: F,
) -> Result<Recorded<T>, CallError<E>>
where
    DB: Backend,
    T: Serialize + DeserializeOwned,
    F: FnOnce(Transaction<'static, DB>) -> Fut,
    Fut: Future<Output = (Transaction<'static, DB>, Result<T, E>)>,
{
    let records = engine.records();
    let tx = match records.open(id, claimed).await? {
        Opened::Go(tx) => tx,
        Opened::Taken(row) => return replay_row(id, row),
    };

    let (tx, result) = around_body(engine.db().pooling, body(tx)).await;
    let value = match result {
        Ok(value) => value,
        Err(e) => {
            rollback(tx).await;
            // A body can fail on what a duplicate left (its lease ran out, or
            // Redis lost the cached result, and it paid the order first), or
            // lose a deadlock against a duplicate that takes its locks in the
            // other order. If that duplicate committed, its result is the answer.
            return match records.settle(id, claimed).await {
                Settled::Replay(row) => replay_row(id, row),
                Settled::Busy | Settled::Unknown => Err(CallError::Body(e)),
            };
        }
    };
    let (value, response) = match stored_form(&value) {
        Ok(stored) => stored,
        Err(e) => {
            rollback(tx).await;
            return Err(Error::Serialize(e).into());
        }
    };

    match records.commit(tx, id, &response, claimed).await? {
        Committed::Ours { expires_ms } => Ok(Recorded { value, response, expires_ms, outcome: Outcome::Executed }),
        Committed::Theirs(row) => replay_row(id, row),
    }
}

/// The result as it is stored, and read back from there: the first caller
/// gets what every replay will (a skipped field, a float that JSON cannot
/// hold), and a result that cannot replay fails before anything commits.
fn stored_form<T: Serialize + DeserializeOwned>(value: &T) -> Result<(T, String), serde_json::Error> {
    let response = serde_json::to_string(value)?;
    Ok((serde_json::from_str(&response)?, response))
}

/// The answer a committed row gives a duplicate.
fn replay_row<T: DeserializeOwned, E>(id: &RecordKey<'_>, row: StoredRecord) -> Result<Recorded<T>, CallError<E>> {
    let Some(response) = row.response.filter(|_| row.status == SUCCEEDED) else {
        return Err(id_in_progress(id).into());
    };
    let value = replay(id, &row.params_hash, &response)?;
    Ok(Recorded { value, response, expires_ms: row.expires_ms, outcome: Outcome::Replayed })
}

/// A stored result for this call: its value, or `KeyReused` when it was
/// stored for other arguments.
fn replay<T: DeserializeOwned>(id: &RecordKey<'_>, stored_fingerprint: &str, response: &str) -> Result<T, Error> {
    if stored_fingerprint != id.fingerprint {
        return Err(Error::KeyReused { biz: id.biz, key: id.key.to_owned() });
    }
    serde_json::from_str(response).map_err(|source| Error::Replay { biz: id.biz, key: id.key.to_owned(), source })
}

fn id_in_progress(id: &RecordKey<'_>) -> Error {
    Error::InProgress { biz: id.biz, key: id.key.to_owned() }
}
