//! The flow of one two-phase call: [`run_steps`], the entry point the
//! attribute calls for a fn with `steps`. The same gate as the plain mode
//! (a Redis claim, or the in-memory wait), then the phases of
//! [`protocol`](super::protocol), and the same outcome reports.
//!
//! entry point → **call flow** → gate → call protocol → backend

use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument;

use super::context::{Parts, Steps};
use super::protocol::{self, CallKey, Finished, Opened};
use crate::call::typed::{BoxFuture, CallError, Failed, Typed, run_and_read};
use crate::clock::AskingAgain;
use crate::engine::Idem;
use crate::error::Error;
use crate::error::Failure;
use crate::failure_log;
use crate::fingerprint::{Fingerprint, Hex};
use crate::gate::{Answer, Entry};
use crate::key::{validate_biz_no, validate_key};
use crate::metrics::{Source, Timer};
use crate::outcome::{self, Observed, Outcome};
use crate::retention;
use crate::spec::Spec;
use crate::store::calls::{CallRow, FAILED, Owner};
use crate::store::pooling::around_body;
use crate::store::record::rollback;
use crate::store::{Backend, PROCESSING, RowKey, SUCCEEDED};

/// The body as the flow runs it: handed the step context.
type DynBody<'a, DB> = dyn Typed<Steps<DB>> + 'a;

/// How a call ended: its result, how it is reported, and what the gate
/// hands on to duplicates (a succeeded result only).
struct Ended {
    result: Result<(), CallError>,
    outcome: Outcome,
    source: Option<Source>,
    answer: Option<Arc<Answer>>,
}

impl Ended {
    fn error(error: Error) -> Self {
        Ended { outcome: Outcome::of(&error), result: Err(CallError::Idem(error)), source: None, answer: None }
    }

    fn body() -> Self {
        Ended { result: Err(CallError::Body), outcome: Outcome::Failed, source: None, answer: None }
    }
}

/// Runs `body` once per `(spec.biz, key)`, in two phases; the code the
/// attribute writes for `steps` calls this. `body` gets the step context
/// and hands it back with its result's JSON. Built once per backend, as
/// [`run`](crate::__private::run).
pub fn run_steps<'a, DB: Backend>(
    engine: &'a Idem<DB>,
    spec: &'static Spec,
    key: String,
    fingerprint: Fingerprint,
    biz_no: Option<String>,
    body: &'a mut DynBody<'_, DB>,
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
            mode = "steps",
            outcome = tracing::field::Empty
        );
        let ended = match checked {
            Ok(()) => call(engine, spec, &key, fingerprint, biz_no.as_deref(), body).instrument(span.clone()).await,
            Err(e) => Ended::error(e),
        };
        span.record("outcome", ended.outcome.as_str());
        let recorded_error = matches!(ended.result, Err(CallError::Idem(Error::Permanent { .. })));
        outcome::report(Observed { outcome: ended.outcome, recorded_error });
        crate::metrics::call_finished(spec.biz, ended.outcome, ended.source, timer);
        if let Err(e) = &ended.result {
            e.log_cause(spec.biz, &key);
        }
        ended.result
    }))
}

/// The call, its key already checked: the gate, then the database.
async fn call<DB: Backend>(
    engine: &Idem<DB>,
    spec: &'static Spec,
    key: &str,
    fingerprint: Fingerprint,
    biz_no: Option<&str>,
    body: &mut DynBody<'_, DB>,
) -> Ended {
    if let Some(no) = biz_no
        && let Err(e) = validate_biz_no(no)
    {
        return Ended::error(e);
    }
    let fingerprint = match fingerprint.finish() {
        Ok(fingerprint) => fingerprint,
        Err(e) => return Ended::error(e),
    };
    let ttl = retention::record_ttl(spec.ttl);
    let id = CallKey { biz: spec.biz, key, fingerprint: &fingerprint, biz_no, ttl, lease: spec.lease };
    // Leases, fences and expiry are stamped and judged on the database's clock.
    engine.now_ms().await;

    let row = RowKey::new(spec.biz, key);
    // A duplicate of a running call waits for its answer this long, as in
    // the single-transaction flow (`crate::call`).
    let wait = engine.wait_for(spec);
    // `Duration::MAX` waits with no bound.
    let deadline = crate::clock::deadline_in(wait);
    let gate = engine.gate();
    let mut entry = gate.enter(engine.db(), row, &fingerprint, spec.lease, engine.lock_wait().max(wait), false).await;
    loop {
        match entry {
            Entry::GoAhead(pass) => {
                // On the heap, as in the single-transaction flow (`crate::call`).
                // A call running elsewhere is waited for as the unique index
                // makes a plain call wait: `lock_wait`, or `wait` if longer.
                let executed = Box::pin(execute(engine, &id, engine.lock_wait().max(wait), body));
                // Events the body queues take their ids from the call (`outbox::queue`).
                #[cfg(feature = "outbox")]
                let executed =
                    crate::outbox::scope_where(engine, spec.biz, key, executed, |ended| ended.answer.is_some());
                let ended = executed.await;
                // A succeeded result goes on to the duplicates (Redis in place of
                // our claim, or those waiting here); anything else lets them in.
                match &ended.answer {
                    Some(answer) => {
                        pass.finish(answer);
                        gate.remember(spec.biz, key, answer);
                    }
                    None => pass.abandon().await,
                }
                return ended;
            }
            Entry::Replay(answer, source) => {
                return match replay(&id, &answer.fingerprint, &answer.response, body) {
                    Ok(()) => Ended { result: Ok(()), outcome: Outcome::Replayed, source: Some(source), answer: None },
                    Err(e) => Ended::error(e),
                };
            }
            Entry::Busy { may_have_committed } => {
                // A Redis claim outlives its call's commit until the cache write
                // lands (or for good, if the process died): the record knows.
                if may_have_committed {
                    match protocol::read(engine.db(), &id).await {
                        Ok(Some(row)) if answers(&row, engine) => {
                            let ended = from_row(&id, row, Outcome::Replayed, body);
                            if let Some(answer) = &ended.answer {
                                gate.remember(spec.biz, key, answer);
                            }
                            return ended;
                        }
                        Ok(_) => {}
                        Err(e) => return Ended::error(e),
                    }
                }
                if wait.is_zero() {
                    return Ended::error(id.in_progress());
                }
                entry = match gate.wait_running(engine.db(), row, &fingerprint, spec.lease, deadline).await {
                    Some(entry) => entry,
                    None => return Ended::error(id.in_progress()),
                };
            }
        }
    }
}

/// Phase one (waiting up to `bound` for a call running elsewhere), the
/// body with its steps, and the final transaction.
async fn execute<DB: Backend>(
    engine: &Idem<DB>,
    id: &CallKey<'_>,
    bound: Duration,
    body: &mut DynBody<'_, DB>,
) -> Ended {
    let db = engine.db();
    let held = match open_within(engine, id, bound).await {
        Ok(Opened::Held(held)) => held,
        Ok(Opened::Finished(row)) => return from_row(id, row, Outcome::Replayed, body),
        Ok(Opened::Busy { .. }) => return Ended::error(id.in_progress()),
        Err(e) => return Ended::error(e),
    };

    let (steps, result) = around_body(db.pooling, run_and_read(body, Steps::new(engine.clone(), id, held))).await;
    let parts = steps.into_parts();
    if parts.fenced {
        if let Some(tx) = parts.tx {
            rollback(tx).await;
        }
        return new_owners_outcome(engine, id, body).await;
    }
    let (status, response) = match result {
        Ok(response) => match engine.check_result(id.biz, &response) {
            Ok(()) => (SUCCEEDED, response),
            Err(e) => return give_up(engine, parts, Ended::error(e)).await,
        },
        Err(Failed::Serialize(e)) => return give_up(engine, parts, Ended::error(Error::Serialize(e))).await,
        // `record_errors` is refused with `steps` at compile time: a steps
        // body declares its final failures with `Steps::permanent`.
        Err(Failed::Body | Failed::Recorded(_)) => match &parts.failure {
            Some(failure) => (FAILED, failure.as_json().to_owned()),
            None => return give_up(engine, parts, Ended::body()).await,
        },
    };

    let Parts { owner, has_steps, tx, .. } = parts;
    let tx = match tx {
        Some(tx) => tx,
        None => match crate::store::opening::begin(&db.pool).await {
            Ok(tx) => tx,
            Err(e) => {
                protocol::release(db, engine.clock(), owner).await;
                return Ended::error(protocol::db_error::<DB>(id, e));
            }
        },
    };
    let last = protocol::Final { status, response: &response, ttl: id.ttl, has_steps };
    match protocol::finish(db.pooling, tx, engine.clock(), owner, last).await {
        Ok(Finished::Ours { expires_ms }) => match status {
            SUCCEEDED => Ended {
                result: Ok(()),
                outcome: Outcome::Executed,
                source: None,
                answer: Some(Arc::new(Answer {
                    fingerprint: Hex::stored(id.fingerprint),
                    response,
                    failed: false,
                    expires_ms,
                })),
            },
            _ => Ended {
                result: Err(CallError::Idem(permanent(id, response))),
                outcome: Outcome::Executed,
                source: None,
                answer: None,
            },
        },
        Ok(Finished::Fenced) => new_owners_outcome(engine, id, body).await,
        Err(e) => after_failed_finish(engine, id, owner, e, body).await,
    }
}

/// Phase one, asked again while a call of these arguments runs elsewhere
/// (its lease running; nothing kept this call out: no Redis, or a claim
/// lost), until `bound` has passed since the first question. That call's
/// row is committed and holds no lock to wait on, so the question is asked
/// again at doubling intervals, and as its lease ends (a pause never past
/// the bound; the last question at it). Then the answer is that call's
/// (its value, its permanent failure), the key ours (it gave the key up,
/// or its lease ran out and this call takes over), or, still running,
/// `InProgress`. On SQLite each question first waits for the write lock
/// (its busy timeout), which the running call's final transaction holds:
/// one that times out is asked again the same way.
async fn open_within<DB: Backend>(engine: &Idem<DB>, id: &CallKey<'_>, bound: Duration) -> Result<Opened, Error> {
    // `Duration::MAX` waits with no bound.
    let mut asking = AskingAgain::until(crate::clock::deadline_in(bound));
    loop {
        let opened = protocol::open(engine.db(), engine.clock(), id).await;
        let lease_left = match &opened {
            // Judged on the database's clock, as `open` judged it.
            Ok(Opened::Busy { lease_until_ms }) => {
                let left = lease_until_ms.saturating_sub(engine.clock().now_ms()).max(1);
                Some(Duration::from_millis(u64::try_from(left).unwrap_or(u64::MAX)))
            }
            Err(Error::InProgress { .. }) => None,
            _ => return opened,
        };
        if !asking.pause(lease_left).await {
            return opened;
        }
    }
}

/// A body that failed for now (or whose result cannot be stored): its
/// transaction rolls back, its recorded steps stay, and the key is handed
/// on at once. A call that was neither resumed nor reached outside is
/// deleted, as if it never ran.
async fn give_up<DB: Backend>(engine: &Idem<DB>, parts: Parts<DB>, ended: Ended) -> Ended {
    let db = engine.db();
    if let Some(tx) = parts.tx {
        rollback(tx).await;
    }
    if parts.resumed || parts.started || parts.has_steps {
        protocol::release(db, engine.clock(), parts.owner).await;
    } else {
        protocol::discard(db, parts.owner).await;
    }
    ended
}

/// Whether `row` answers duplicates now: finished (succeeded or failed)
/// and not expired, judged as the plain mode judges a record. An expired
/// one counts as absent: a new owner may be replacing it.
fn answers<DB: Backend>(row: &CallRow, engine: &Idem<DB>) -> bool {
    row.status != PROCESSING && row.expires_ms > engine.clock().now_ms()
}

/// Fenced off: the key was taken over. The new owner's outcome answers:
/// its result or failure once it finished (and until it expires),
/// `InProgress` while it runs.
async fn new_owners_outcome<DB: Backend>(engine: &Idem<DB>, id: &CallKey<'_>, body: &mut DynBody<'_, DB>) -> Ended {
    match protocol::read(engine.db(), id).await {
        Ok(Some(row)) if answers(&row, engine) => from_row(id, row, Outcome::Replayed, body),
        Ok(_) => Ended::error(id.in_progress()),
        Err(e) => Ended::error(e),
    }
}

/// The final transaction failed. If it was its `COMMIT` whose answer was
/// lost, the call may have finished all the same: the row says, and a row
/// finished under our fence is our own commit. Another owner's answers
/// only until it expires.
async fn after_failed_finish<DB: Backend>(
    engine: &Idem<DB>,
    id: &CallKey<'_>,
    owner: Owner,
    error: sqlx::Error,
    body: &mut DynBody<'_, DB>,
) -> Ended {
    match protocol::read(engine.db(), id).await {
        Ok(Some(row)) if row.status != PROCESSING && row.id == owner.id && row.fence == owner.fence => {
            from_row(id, row, Outcome::Executed, body)
        }
        Ok(Some(row)) if answers(&row, engine) => from_row(id, row, Outcome::Replayed, body),
        _ => {
            protocol::release(engine.db(), engine.clock(), owner).await;
            Ended::error(protocol::db_error::<DB>(id, error))
        }
    }
}

/// The answer a finished call gives.
fn from_row<DB: Backend>(id: &CallKey<'_>, row: CallRow, outcome: Outcome, body: &mut DynBody<'_, DB>) -> Ended {
    let CallRow { params_hash, status, response, expires_ms, .. } = row;
    let response = response.unwrap_or_default();
    if params_hash != id.fingerprint {
        return Ended::error(id.reused());
    }
    if status == FAILED {
        return Ended { result: Err(CallError::Idem(permanent(id, response))), outcome, source: None, answer: None };
    }
    match replay(id, &params_hash, &response, body) {
        Ok(()) => {
            let source = (outcome == Outcome::Replayed).then_some(Source::Database);
            let answer =
                Arc::new(Answer { fingerprint: Hex::stored(&params_hash), response, failed: false, expires_ms });
            Ended { result: Ok(()), outcome, source, answer: Some(answer) }
        }
        Err(e) => Ended::error(e),
    }
}

fn permanent(id: &CallKey<'_>, failure: String) -> Error {
    Error::Permanent { biz: id.biz, key: id.key.to_owned(), failure: Failure::from_json(failure) }
}

/// A stored result for this call, decoded as its value; `KeyReused` when
/// it was stored for other arguments.
fn replay<DB: Backend>(
    id: &CallKey<'_>,
    stored_fingerprint: &str,
    response: &str,
    body: &mut DynBody<'_, DB>,
) -> Result<(), Error> {
    if stored_fingerprint != id.fingerprint {
        return Err(id.reused());
    }
    body.decode(response).map_err(|source| Error::Replay { biz: id.biz, key: id.key.to_owned(), source })
}
