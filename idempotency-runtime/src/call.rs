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
use crate::failure_log;
use crate::fingerprint::{Fingerprint, Hex};
use crate::gate::{Answer, Entry};
use crate::key::{validate_biz_no, validate_key};
use crate::metrics::{Source, Timer};
use crate::outcome::{self, Observed, Outcome};
use crate::retention;
use crate::spec::Spec;
use crate::store::opening::Opening;
use crate::store::record::{Committed, Finished, Opened, RecordKey, Settled};
use crate::store::{Backend, StoredRecord};

pub(crate) mod early_begin;
pub(crate) mod joined;
mod ran;
pub(crate) mod typed;

use ran::{Ran, run_body};
use typed::{BoxFuture, CallError, Typed};

/// The body as the flow runs it: handed the record's transaction.
type DynBody<'a, DB> = dyn Typed<Transaction<'static, DB>> + 'a;

/// A finished call: whether it ran now or was replayed, where a replay
/// came from, and whether its answer is a recorded business error. Its
/// value (or that error) went to the call's typed side.
struct Done {
    outcome: Outcome,
    source: Option<Source>,
    failed: bool,
}

/// Runs `body` once per `(spec.biz, key)`; the code the attribute writes
/// calls this. `body` gets the transaction the record is written in and
/// hands it back with its result's JSON (`call/typed.rs`). Generic over the
/// backend alone: built once per backend (and, for the backends compiled
/// in, in this crate: `prebuilt.rs`), not once per annotated fn.
pub fn run<'a, DB: Backend>(
    engine: &'a Idem<DB>,
    spec: &'static Spec,
    key: String,
    fingerprint: Fingerprint,
    biz_no: Option<String>,
    body: &'a mut DynBody<'_, DB>,
) -> BoxFuture<'a, Result<(), CallError>> {
    // Checked before the future is made: what it keeps of them (the
    // fingerprint's digits, not the document they were written from) is small.
    let checked = validate_key(&key)
        .and_then(|()| biz_no.as_deref().map_or(Ok(()), validate_biz_no))
        .and_then(|()| fingerprint.finish_hex());
    Box::pin(failure_log::watched(checked_run(engine, spec, key, checked, biz_no, body)))
}

/// [`run`], its inputs checked: the future the caller's is boxed around.
async fn checked_run<DB: Backend>(
    engine: &Idem<DB>,
    spec: &'static Spec,
    key: String,
    checked: Result<Hex, Error>,
    biz_no: Option<String>,
    body: &mut DynBody<'_, DB>,
) -> Result<(), CallError> {
    let timer = Timer::start();
    // A rejected key is not logged: it may hold anything the caller sent.
    let key_rejected = matches!(checked, Err(Error::InvalidKey(_)));
    let shown_key = if key_rejected { "<invalid>" } else { key.as_str() };
    let span = tracing::info_span!("idem", biz = spec.biz, key = shown_key, outcome = tracing::field::Empty);
    let result = match checked {
        // Without a subscriber, not entered and left at every poll.
        Ok(hex) if span.is_disabled() => call(engine, spec, &key, &hex, biz_no.as_deref(), body).await,
        Ok(hex) => call(engine, spec, &key, &hex, biz_no.as_deref(), body).instrument(span.clone()).await,
        Err(e) => Err(e.into()),
    };
    answer(spec, &key, &span, timer, result)
}

/// Reports how a call ended (its span, the outcome, the metrics, and the
/// cause of a database failure: `failure_log`).
fn answer(
    spec: &'static Spec,
    key: &str,
    span: &tracing::Span,
    timer: Timer,
    result: Result<Done, CallError>,
) -> Result<(), CallError> {
    let outcome = match &result {
        Ok(done) => done.outcome,
        Err(CallError::Idem(e)) => Outcome::of(e),
        Err(CallError::Body) => Outcome::Failed,
        Err(CallError::Recorded) => unreachable!("a recorded error is a finished call"),
    };
    // A disabled span keeps nothing: the record is not built for it.
    if !span.is_disabled() {
        span.record("outcome", outcome.as_str());
    }
    let recorded_error = matches!(result, Ok(Done { failed: true, .. }));
    outcome::report(Observed { outcome, recorded_error });
    crate::metrics::call_finished(spec.biz, outcome, result.as_ref().ok().and_then(|done| done.source), timer);
    if let Err(e) = &result {
        e.log_cause(spec.biz, key);
    }
    match result {
        Ok(Done { failed: true, .. }) => Err(CallError::Recorded),
        Ok(_) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The call, its key, `biz_no` and arguments already checked.
async fn call<DB: Backend>(
    engine: &Idem<DB>,
    spec: &'static Spec,
    key: &str,
    hex: &Hex,
    biz_no: Option<&str>,
    body: &mut DynBody<'_, DB>,
) -> Result<Done, CallError> {
    let fingerprint = hex.as_str();
    let ttl = retention::record_ttl(spec.ttl);
    let id = RecordKey::new(spec.biz, key, fingerprint, biz_no, ttl);
    // Expiry is stamped and judged on the database's clock: an engine's
    // first call reads it (once); later calls pay one atomic load.
    engine.clock_ready().await;

    // A duplicate of a running call waits for its answer this long (in
    // memory, on the unique index, or told by Redis), then `InProgress`.
    let wait = engine.wait_for(spec);
    // Counted from when the call is first told the key is busy: most calls
    // never are, and need not read the clock for it.
    let mut waited = false;
    let gate = engine.gate();
    // A fn whose calls are mostly replays reads before it claims: one
    // `HGET` in Redis, or its record without Redis (`read_first`).
    let expect_replay = engine.read_first().expected(spec);
    let enter =
        || gate.enter(engine.db(), id.row(), fingerprint, spec.lease, engine.lock_wait().max(wait), expect_replay);
    // The transaction opens while the claim is in flight (`call/early_begin.rs`).
    let mut early = early_begin::beside_the_claim(engine, spec, gate);
    // (Boxed: inline, `beside`'s future with the claim's in it would grow
    // every call's future by half a kilobyte.)
    let mut entry = match &mut early {
        Some(early) => Box::pin(early.beside(enter())).await,
        None => enter().await,
    };
    // Rolled back now, unless our claim lets the body run: a duplicate
    // holds no connection while it waits.
    if !matches!(&entry, Entry::GoAhead(pass) if pass.holds_claim()) {
        early = None;
    }
    let pass = loop {
        match entry {
            Entry::GoAhead(pass) => break pass,
            Entry::Replay(answer, source) => {
                engine.read_first().saw(spec, true);
                replay(&id, &answer.fingerprint, &answer.response, answer.failed, body)?;
                return Ok(Done { outcome: Outcome::Replayed, source: Some(source), failed: answer.failed });
            }
            Entry::Busy { may_have_committed } => {
                // A claim outlives its call's commit until the cache write
                // lands (or for good, if the process died right after it): a
                // committed call is in the record. (The database's futures
                // are boxed here and below: kilobytes each, inline they would
                // grow every call's future, which is moved as it is built.)
                if may_have_committed && let Some(row) = Box::pin(engine.records().read_live(spec.biz, key)).await? {
                    let (outcome, answer) = replay_row(&id, row, body)?.split(*hex);
                    gate.remember(spec.biz, key, &answer);
                    return Ok(Done { outcome, source: Some(Source::Database), failed: answer.failed });
                }
                if wait.is_zero() || waited {
                    return Err(id_in_progress(&id).into());
                }
                // `Duration::MAX` waits with no bound.
                let deadline = crate::clock::deadline_in(wait);
                waited = true;
                // Still running at the deadline (or Redis cannot tell): the
                // record is read once more before `InProgress`, as no publish
                // comes for a commit whose cache write did not land.
                let waited_on = gate.wait_running(engine.db(), id.row(), fingerprint, spec.lease, deadline);
                entry = Box::pin(waited_on).await.unwrap_or(Entry::Busy { may_have_committed: true });
            }
        }
    };

    // Without a claim, one read of the record answers a finished key.
    let claimed = pass.holds_claim();
    if !claimed
        && expect_replay
        && let Some(row) = Box::pin(engine.records().read_live(spec.biz, key)).await?
    {
        let (outcome, answer) = replay_row(&id, row, body)?.split(*hex);
        engine.read_first().saw(spec, true);
        pass.finish(&answer);
        gate.remember(spec.biz, key, &answer);
        return Ok(Done { outcome, source: Some(Source::Database), failed: answer.failed });
    }

    // On the heap from the start: the body's and the database's futures
    // run to kilobytes, and every wrapper that took it by value (the outbox
    // scope, the span, the caller's future) would copy it, first calls and
    // replays alike. A replay never builds this one.
    let executed = Box::pin(execute(engine, spec, &id, claimed, early, body));
    // Events the body queues take their ids from the call (`outbox::queue`).
    #[cfg(feature = "outbox")]
    let executed = crate::outbox::scope(engine, spec.biz, key, executed);
    match executed.await {
        Ok(recorded) => {
            // The stored result goes on to the duplicates: to Redis in place
            // of our claim, or to those waiting here.
            let (outcome, answer) = recorded.split(*hex);
            engine.read_first().saw(spec, outcome == Outcome::Replayed);
            pass.finish(&answer);
            engine.gate().remember(spec.biz, key, &answer);
            let source = (outcome == Outcome::Replayed).then_some(Source::Database);
            Ok(Done { outcome, source, failed: answer.failed })
        }
        Err(e) => {
            pass.abandon().await;
            Err(e)
        }
    }
}

/// The database part of a call, done (its value, or its recorded error,
/// decoded already): its stored form, and when the record expires.
struct Recorded {
    response: String,
    failed: bool,
    expires_ms: i64,
    outcome: Outcome,
}

impl Recorded {
    /// How it ended, and what the duplicates are handed: the stored result.
    fn split(self, fingerprint: Hex) -> (Outcome, Arc<Answer>) {
        let answer = Answer { fingerprint, response: self.response, failed: self.failed, expires_ms: self.expires_ms };
        (self.outcome, Arc::new(answer))
    }
}

/// The body and its record, in one transaction.
async fn execute<DB: Backend>(
    engine: &Idem<DB>,
    spec: &Spec,
    id: &RecordKey<'_>,
    claimed: bool,
    early: Option<Opening<DB>>,
    body: &mut DynBody<'_, DB>,
) -> Result<Recorded, CallError> {
    let records = engine.records_for(spec);
    let tx = match records.open(id, claimed, early).await? {
        Opened::Go(tx) => tx,
        Opened::Taken(row) => return replay_row(id, row, body),
    };
    let ran = match run_body(engine, id.biz, tx, spec.record_errors, body).await {
        Ok(ran) => ran,
        // A body can fail on what a duplicate left (its lease ran out, or
        // Redis lost the cached result, and it paid the order first), or
        // lose a deadlock against a duplicate that takes its locks in the
        // other order. If that duplicate committed, its result is the answer.
        Err(CallError::Body) => {
            return match records.settle(id, claimed).await {
                Settled::Replay(row) => replay_row(id, row, body),
                Settled::Busy | Settled::Unknown => Err(CallError::Body),
            };
        }
        Err(e) => return Err(e),
    };
    let Ran { tx, response, failed } = ran;
    match records.commit(tx, id, Finished::of(&response, failed), claimed).await? {
        Committed::Ours { expires_ms } => Ok(Recorded { response, failed, expires_ms, outcome: Outcome::Executed }),
        Committed::Theirs(row) => replay_row(id, row, body),
    }
}

/// The answer a committed row gives a duplicate: its value, or its
/// recorded business error.
fn replay_row<H>(id: &RecordKey<'_>, row: StoredRecord, body: &mut dyn Typed<H>) -> Result<Recorded, CallError> {
    let Some((_, failed)) = row.answer() else {
        return Err(id_in_progress(id).into());
    };
    let response = row.response.unwrap_or_default();
    replay(id, &row.params_hash, &response, failed, body)?;
    Ok(Recorded { response, failed, expires_ms: row.expires_ms, outcome: Outcome::Replayed })
}

/// A stored result for this call, decoded as its value (or, `failed`, as
/// its error); `KeyReused` when it was stored for other arguments.
fn replay<H>(
    id: &RecordKey<'_>,
    stored_fingerprint: &str,
    response: &str,
    failed: bool,
    body: &mut dyn Typed<H>,
) -> Result<(), Error> {
    if stored_fingerprint != id.fingerprint {
        return Err(Error::KeyReused { biz: id.biz, key: id.key.to_owned() });
    }
    let decoded = if failed { body.decode_failure(response) } else { body.decode(response) };
    decoded.map_err(|source| Error::Replay { biz: id.biz, key: id.key.to_owned(), source })
}

fn id_in_progress(id: &RecordKey<'_>) -> Error {
    Error::InProgress { biz: id.biz, key: id.key.to_owned() }
}

#[cfg(all(test, feature = "redis"))]
mod tests {
    use super::*;
    use crate::call::typed::Body;
    use crate::store::Backend;

    /// What every call copies as its futures are built and boxed: the
    /// future `run` boxes (the checked call with its span), and the futures
    /// an HTTP handler holds inline (a call copies its whole size, used or
    /// not). The backend's rare queries (a namespace read once per engine,
    /// a record read while busy, a connection made once) are boxed, or each
    /// would put kilobytes into every call. Unboxed, these were 2.7-4.1 KB
    /// and 2.1-3.4 KB here, 8.6 and 8.1 KB in the release build of
    /// `examples/http`, whose replay copied about 37 KB (callgrind). The
    /// boxed future is 2.1-2.2 KB here (2 168 bytes in that release build,
    /// 2 632 while it held the arguments' document and the claim's future).
    const CALL_MAX: usize = 2560;
    const REDEEM_MAX: usize = 1536;

    fn sizes<DB: Backend>(pool: sqlx::Pool<DB>) -> (usize, usize) {
        let idem = Idem::builder(pool).redis(redis::Client::open("redis://127.0.0.1:1").unwrap()).build();
        static SPEC: Spec = Spec {
            biz: "size",
            ttl: std::time::Duration::from_secs(60),
            lease: std::time::Duration::from_secs(1),
            wait: None,
            record_errors: false,
        };
        let mut body = Body::new(|tx: Transaction<'static, DB>| async move { (tx, Ok::<u8, Error>(1)) });
        let hex = Fingerprint::new().finish_hex().unwrap();
        let called = checked_run(&idem, &SPEC, "key-1".into(), Ok(hex), None, &mut body);
        let tokens = idem.tokens();
        let redeemed = tokens.redeem("size", "alice", "token", || async { Ok::<u8, crate::token::TokenError>(1) });
        (std::mem::size_of_val(&called), std::mem::size_of_val(&redeemed))
    }

    fn check((called, redeemed): (usize, usize), backend: &str) {
        assert!(called <= CALL_MAX, "{backend}: a call's future is {called} bytes (at most {CALL_MAX})");
        assert!(redeemed <= REDEEM_MAX, "{backend}: a redeem's future is {redeemed} bytes (at most {REDEEM_MAX})");
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_call_future_stays_small_on_sqlite() {
        let pool = sqlx::sqlite::SqlitePoolOptions::new().connect_lazy("sqlite::memory:").unwrap();
        check(sizes(pool), "sqlite");
    }

    #[cfg(feature = "mysql")]
    #[tokio::test]
    async fn a_call_future_stays_small_on_mysql() {
        let pool = sqlx::mysql::MySqlPoolOptions::new().connect_lazy("mysql://nobody@127.0.0.1:1/none").unwrap();
        check(sizes(pool), "mysql");
    }

    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn a_call_future_stays_small_on_postgres() {
        let pool = sqlx::postgres::PgPoolOptions::new().connect_lazy("postgres://nobody@127.0.0.1:1/none").unwrap();
        check(sizes(pool), "postgres");
    }
}
