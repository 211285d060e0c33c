//! The flow of one call: [`run`], the single entry point the
//! `#[idempotent]` attribute calls. It asks the gate (layer 2), then the
//! record table (layer 3) one question per phase, and reports the outcome.
//!
//! entry point → **call flow** → gate → record protocol → backend
//!
//! A call inside a transaction its caller holds (`join`) has its own flow,
//! [`joined`], without the gate.

use std::sync::Arc;

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
pub(crate) mod prebuilt;
pub(crate) mod typed;

use typed::{BoxFuture, CallError, Failed, Typed, run_and_read};

/// The body as the flow runs it: handed the record's transaction.
type DynBody<'a, DB> = dyn Typed<Transaction<'static, DB>> + 'a;

/// A finished call: whether it ran now or was replayed, and where a replay
/// came from. Its value went to the call's typed side.
struct Done {
    outcome: Outcome,
    source: Option<Source>,
}

/// Runs `body` once per `(spec.biz, key)`; the code the attribute writes
/// calls this. `body` gets the transaction the record is written in and
/// hands it back with its result's JSON (`call/typed.rs`). Generic over the
/// backend alone: built once per backend (and, for the backends compiled
/// in, in this crate: `call/prebuilt.rs`), not once per annotated fn.
pub fn run<'a, DB: Backend>(
    engine: &'a Idem<DB>,
    spec: &'static Spec,
    key: String,
    fingerprint: Fingerprint,
    biz_no: Option<String>,
    body: &'a mut DynBody<'_, DB>,
) -> BoxFuture<'a, Result<(), CallError>> {
    Box::pin(async move {
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
    })
}

/// Reports how a call ended (its span, the outcome, the metrics).
fn answer(
    spec: &'static Spec,
    span: &tracing::Span,
    timer: Timer,
    result: Result<Done, CallError>,
) -> Result<(), CallError> {
    let outcome = match &result {
        Ok(done) => done.outcome,
        Err(CallError::Idem(e)) => Outcome::of(e),
        Err(CallError::Body) => Outcome::Failed,
    };
    span.record("outcome", outcome.as_str());
    outcome::report(outcome);
    crate::metrics::call_finished(spec.biz, outcome, result.as_ref().ok().and_then(|done| done.source), timer);
    result.map(|_| ())
}

/// The call, its key already checked.
async fn call<DB: Backend>(
    engine: &Idem<DB>,
    spec: &'static Spec,
    key: &str,
    fingerprint: Fingerprint,
    biz_no: Option<&str>,
    body: &mut DynBody<'_, DB>,
) -> Result<Done, CallError> {
    if let Some(no) = biz_no {
        validate_biz_no(no)?;
    }
    let fingerprint = fingerprint.finish()?;
    let ttl = retention::record_ttl(spec.ttl);
    let id = RecordKey::new(spec.biz, key, &fingerprint, biz_no, ttl);
    // Expiry is stamped and judged on the database's clock: an engine's
    // first call reads it (once); later calls pay one atomic load.
    engine.now_ms().await;

    let entry = engine.gate().enter(engine.db(), id.row(), &fingerprint, spec.lease, engine.lock_wait()).await;
    let pass = match entry {
        Entry::GoAhead(pass) => pass,
        Entry::Replay(answer, source) => {
            replay(&id, &answer.fingerprint, &answer.response, body)?;
            return Ok(Done { outcome: Outcome::Replayed, source: Some(source) });
        }
        Entry::Busy { may_have_committed } => {
            // A claim outlives its call's commit until the cache write lands
            // (or for good, if the process died right after it): a committed
            // call is in the record.
            if may_have_committed && let Some(row) = engine.records().read_live(spec.biz, key).await? {
                let (outcome, answer) = replay_row(&id, row, body)?.split(fingerprint.clone());
                engine.gate().remember(spec.biz, key, &answer);
                return Ok(Done { outcome, source: Some(Source::Database) });
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
            let (outcome, answer) = recorded.split(fingerprint.clone());
            pass.finish(&answer);
            engine.gate().remember(spec.biz, key, &answer);
            let source = (outcome == Outcome::Replayed).then_some(Source::Database);
            Ok(Done { outcome, source })
        }
        Err(e) => {
            pass.abandon().await;
            Err(e)
        }
    }
}

/// The database part of a call, done (its value decoded already): its
/// stored form, and when the record expires.
struct Recorded {
    response: String,
    expires_ms: i64,
    outcome: Outcome,
}

impl Recorded {
    /// How it ended, and what the duplicates are handed: the stored result.
    fn split(self, fingerprint: String) -> (Outcome, Arc<Answer>) {
        let answer = Answer { fingerprint, response: self.response, expires_ms: self.expires_ms };
        (self.outcome, Arc::new(answer))
    }
}

/// The body and its record, in one transaction.
async fn execute<DB: Backend>(
    engine: &Idem<DB>,
    id: &RecordKey<'_>,
    claimed: bool,
    body: &mut DynBody<'_, DB>,
) -> Result<Recorded, CallError> {
    let records = engine.records();
    let tx = match records.open(id, claimed).await? {
        Opened::Go(tx) => tx,
        Opened::Taken(row) => return replay_row(id, row, body),
    };

    let (tx, result) = around_body(engine.db().pooling, run_and_read(body, tx)).await;
    let response = match result {
        Ok(response) => match engine.check_result(id.biz, &response) {
            Ok(()) => response,
            Err(e) => {
                rollback(tx).await;
                return Err(e.into());
            }
        },
        Err(Failed::Body) => {
            rollback(tx).await;
            // A body can fail on what a duplicate left (its lease ran out, or
            // Redis lost the cached result, and it paid the order first), or
            // lose a deadlock against a duplicate that takes its locks in the
            // other order. If that duplicate committed, its result is the answer.
            return match records.settle(id, claimed).await {
                Settled::Replay(row) => replay_row(id, row, body),
                Settled::Busy | Settled::Unknown => Err(CallError::Body),
            };
        }
        Err(Failed::Serialize(e)) => {
            rollback(tx).await;
            return Err(Error::Serialize(e).into());
        }
    };
    match records.commit(tx, id, &response, claimed).await? {
        Committed::Ours { expires_ms } => Ok(Recorded { response, expires_ms, outcome: Outcome::Executed }),
        Committed::Theirs(row) => replay_row(id, row, body),
    }
}

/// The answer a committed row gives a duplicate.
fn replay_row<H>(id: &RecordKey<'_>, row: StoredRecord, body: &mut dyn Typed<H>) -> Result<Recorded, CallError> {
    let Some(response) = row.response.filter(|_| row.status == SUCCEEDED) else {
        return Err(id_in_progress(id).into());
    };
    replay(id, &row.params_hash, &response, body)?;
    Ok(Recorded { response, expires_ms: row.expires_ms, outcome: Outcome::Replayed })
}

/// A stored result for this call, decoded as its value; `KeyReused` when
/// it was stored for other arguments.
fn replay<H>(
    id: &RecordKey<'_>,
    stored_fingerprint: &str,
    response: &str,
    body: &mut dyn Typed<H>,
) -> Result<(), Error> {
    if stored_fingerprint != id.fingerprint {
        return Err(Error::KeyReused { biz: id.biz, key: id.key.to_owned() });
    }
    body.decode(response).map_err(|source| Error::Replay { biz: id.biz, key: id.key.to_owned(), source })
}

fn id_in_progress(id: &RecordKey<'_>) -> Error {
    Error::InProgress { biz: id.biz, key: id.key.to_owned() }
}
