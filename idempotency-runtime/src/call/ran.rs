//! A body run in the transaction its record commits in, and what it left
//! to record: one ending for a call of its own ([`run`](super::run)) and a
//! joined one ([`run_joined`](super::joined::run_joined)), which differ only
//! in what holds the transaction and in how the record is written.

use sqlx::Transaction;

use super::typed::{CallError, Failed, Typed, run_and_read};
use crate::engine::Idem;
use crate::error::Error;
use crate::store::Backend;
use crate::store::pooling::around_body;
use crate::store::record::rollback;

/// What a body left to record, its transaction (or savepoint) still open.
pub(super) struct Ran<'t, DB: Backend> {
    pub(super) tx: Transaction<'t, DB>,
    /// Its value's JSON, or its declared error's, already read back as the
    /// caller's answer (`run_and_read`).
    pub(super) response: String,
    /// `response` is a declared business error (`record_errors`): the
    /// body's own writes are rolled back already, the record stays.
    pub(super) failed: bool,
}

/// Runs `body` in `tx` and checks what it gave: `Ok` with what to record,
/// or why nothing is recorded, `tx` rolled back (`CallError::Body`: the
/// body's own error, kept for the caller). With `record_errors` the body
/// starts after a savepoint, to roll back to while the record commits
/// holding a declared error.
pub(super) async fn run_body<'t, DB: Backend>(
    engine: &Idem<DB>,
    biz: &'static str,
    mut tx: Transaction<'t, DB>,
    record_errors: bool,
    body: &mut (dyn Typed<Transaction<'t, DB>> + '_),
) -> Result<Ran<'t, DB>, CallError> {
    if record_errors && let Err(e) = DB::mark_body(&mut tx).await {
        rollback(tx).await;
        return Err(Error::from_store(e).into());
    }
    // A panic or a drop here drops the transaction, which sqlx rolls back
    // (a savepoint on the connection's next use: the caller's writes stay).
    let (mut tx, result) = around_body(engine.db().pooling, run_and_read(body, tx)).await;
    let failed = matches!(result, Err(Failed::Recorded(_)));
    let response = match result {
        Ok(json) | Err(Failed::Recorded(json)) => json,
        Err(Failed::Body) => {
            rollback(tx).await;
            return Err(CallError::Body);
        }
        Err(Failed::Serialize(e)) => {
            rollback(tx).await;
            return Err(Error::Serialize(e).into());
        }
    };
    if let Err(e) = engine.check_result(biz, &response) {
        rollback(tx).await;
        return Err(e.into());
    }
    // The body's own writes go; the record stays, holding its error. A
    // transaction the database already ended (a deadlock) cannot keep the
    // record: the error is the body's, unrecorded.
    if failed && DB::undo_body(&mut tx).await.is_err() {
        rollback(tx).await;
        return Err(CallError::Body);
    }
    Ok(Ran { tx, response, failed })
}
