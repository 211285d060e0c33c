//! The flow of a call inside a transaction its caller holds (`join`):
//! [`run_joined`], which the attribute calls for a fn with `join`.
//!
//! The record goes into the caller's transaction first, in a savepoint
//! around the body ([`Records::join`]): a failing body rolls back its own
//! writes only, and the record commits when the caller commits. No gate:
//! a Redis claim or a cached result would outlive a rollback this call
//! never hears of, and an in-memory wait would hand duplicates a result
//! that is not committed yet. Duplicates elsewhere wait on the unique
//! index instead (bounded by `lock_wait`), then replay the committed row.
//! Only the local cache is read, since it holds committed results only.
//!
//! entry point → **call flow** → record protocol → backend

use sqlx::Transaction;
use tracing::Instrument;

use super::ran::{Ran, run_body};
use super::typed::{BoxFuture, CallError, Typed};
use super::{Done, answer, replay, replay_row};
use crate::engine::Idem;
use crate::failure_log;
use crate::fingerprint::Fingerprint;
use crate::key::{validate_biz_no, validate_key};
use crate::metrics::{Source, Timer};
use crate::outcome::Outcome;
use crate::retention;
use crate::spec::Spec;
use crate::store::Backend;
use crate::store::record::{Finished, Joined, RecordKey};

/// The body as the flow runs it: handed a savepoint of the caller's transaction.
type DynBody<'a, 't, DB> = dyn Typed<Transaction<'t, DB>> + 'a;

/// Runs `body` once per `(spec.biz, key)` inside `tx`, the caller's
/// transaction; the code the attribute writes for `join` calls this.
/// `body` gets a savepoint of `tx` and hands it back with its result's
/// JSON. `Ok` means done in the caller's transaction: it is recorded when,
/// and only if, the caller commits. Built once per backend, as [`run`](super::run).
pub fn run_joined<'a, 't: 'a, DB: Backend>(
    engine: &'a Idem<DB>,
    spec: &'static Spec,
    key: String,
    fingerprint: Fingerprint,
    biz_no: Option<String>,
    tx: &'t mut Transaction<'_, DB>,
    body: &'a mut DynBody<'_, 't, DB>,
) -> BoxFuture<'a, Result<(), CallError>> {
    Box::pin(failure_log::watched(async move {
        let timer = Timer::start();
        let checked = validate_key(&key);
        // A rejected key is not logged: it may hold anything the caller sent.
        let shown_key = if checked.is_ok() { key.as_str() } else { "<invalid>" };
        let span = tracing::info_span!(
            "idem",
            biz = spec.biz,
            key = shown_key,
            mode = "join",
            outcome = tracing::field::Empty
        );
        let result = match checked {
            Ok(()) => call(engine, spec, &key, fingerprint, biz_no.as_deref(), tx, body).instrument(span.clone()).await,
            Err(e) => Err(e.into()),
        };
        answer(spec, &key, &span, timer, result)
    }))
}

/// The call, its key already checked. Nothing reaches the caller's
/// transaction before the key, the business number and the arguments are
/// found good.
async fn call<'t, DB: Backend>(
    engine: &Idem<DB>,
    spec: &'static Spec,
    key: &str,
    fingerprint: Fingerprint,
    biz_no: Option<&str>,
    tx: &'t mut Transaction<'_, DB>,
    body: &mut DynBody<'_, 't, DB>,
) -> Result<Done, CallError> {
    if let Some(no) = biz_no {
        validate_biz_no(no)?;
    }
    let fingerprint = fingerprint.finish_hex()?;
    let ttl = retention::record_ttl(spec.ttl);
    let id = RecordKey::new(spec.biz, key, &fingerprint, biz_no, ttl);
    engine.clock_ready().await;

    if let Some(answer) = engine.gate().cached(spec.biz, key) {
        replay(&id, &answer.fingerprint, &answer.response, answer.failed, body)?;
        return Ok(Done { outcome: Outcome::Replayed, source: Some(Source::Local), failed: answer.failed });
    }
    // A row found here is never remembered: it may be the caller's own,
    // written earlier in this transaction and not committed.
    let savepoint = match engine.records_for(spec).join(tx, &id).await? {
        Joined::Go(savepoint) => savepoint,
        Joined::Taken(row) => {
            let failed = replay_row(&id, row, body)?.failed;
            return Ok(Done { outcome: Outcome::Replayed, source: Some(Source::Database), failed });
        }
    };
    let executed = Box::pin(execute(engine, &id, savepoint, spec.record_errors, body));
    // Events the body queues take their ids from the call (`outbox::queue`).
    #[cfg(feature = "outbox")]
    let executed = crate::outbox::scope(engine, spec.biz, key, executed);
    let failed = executed.await?;
    Ok(Done { outcome: Outcome::Executed, source: None, failed })
}

/// The body in its savepoint, then the finished record beside it: its
/// value, or (`record_errors`, a declared business error) that error, the
/// body's own writes rolled back to a savepoint of their own. `Ok(true)`:
/// the error was recorded, and read back for the caller. No settling after
/// a failure, unlike a call of our own: a duplicate cannot have committed
/// in between (our record holds the key), and a deadlock may have ended the
/// caller's whole transaction, which only the body's own error tells the
/// caller.
async fn execute<'t, DB: Backend>(
    engine: &Idem<DB>,
    id: &RecordKey<'_>,
    savepoint: Transaction<'t, DB>,
    record_errors: bool,
    body: &mut DynBody<'_, 't, DB>,
) -> Result<bool, CallError> {
    let Ran { tx: savepoint, response, failed } = run_body(engine, id.biz, savepoint, record_errors, body).await?;
    engine.records().finish_joined(savepoint, id, Finished::of(&response, failed)).await?;
    Ok(failed)
}
