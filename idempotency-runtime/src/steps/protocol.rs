//! The record protocol of a two-phase call, one question per phase, asked
//! of the store's `CallSql`:
//!
//! - [`open`], phase one: own the key (insert, or take over a call whose
//!   lease ran out), or find what answers instead.
//! - [`record_step`]: a step's result, under our fence.
//! - [`finish`], in the final transaction: the call marked finished under
//!   our fence, its steps deleted, `COMMIT`.
//! - [`release`] / [`discard`]: after a failure that is not permanent, the
//!   key is handed on at once (its lease ended, or the call deleted when
//!   nothing reached outside).

use std::collections::HashMap;
use std::time::Duration;

use sqlx::Transaction;

use crate::clock::Clock;
use crate::error::Error;
use crate::store::calls::{CallRow, NewCall, Owner, StepWritten};
use crate::store::record::rollback;
use crate::store::{Backend, Db, ErrorClass, PROCESSING, Pooling};

/// Rounds of insert / read / take over before phase one gives up on a key
/// that keeps changing under it (and answers `InProgress`).
const OPEN_ATTEMPTS: usize = 3;

/// One call's identity, borrowed for the call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CallKey<'a> {
    pub biz: &'static str,
    pub key: &'a str,
    pub fingerprint: &'a str,
    pub biz_no: Option<&'a str>,
    pub ttl: Duration,
    pub lease: Duration,
}

impl CallKey<'_> {
    pub(crate) fn in_progress(&self) -> Error {
        Error::InProgress { biz: self.biz, key: self.key.to_owned() }
    }

    pub(crate) fn reused(&self) -> Error {
        Error::KeyReused { biz: self.biz, key: self.key.to_owned() }
    }
}

/// The key, ours after phase one.
#[derive(Debug)]
pub(crate) struct Held {
    pub owner: Owner,
    /// Steps recorded by the owners before us: name → result (JSON).
    pub recorded: HashMap<String, String>,
    /// Taken over from an earlier owner (so steps may have started).
    pub resumed: bool,
}

/// What phase one found.
#[derive(Debug)]
pub(crate) enum Opened {
    /// The key is ours: run the body.
    Held(Held),
    /// A finished call (succeeded or failed) answers; its fingerprint is
    /// still to be compared.
    Finished(CallRow),
    /// A call with these arguments is processing and its lease runs
    /// until then (epoch ms, the database's clock).
    Busy { lease_until_ms: i64 },
}

/// Phase one: a processing call with our fence, committed before anything
/// else happens; or the call that answers instead.
pub(crate) async fn open<DB: Backend>(db: &Db<DB>, clock: &Clock, id: &CallKey<'_>) -> Result<Opened, Error> {
    for _ in 0..OPEN_ATTEMPTS {
        let now = clock.now_ms();
        let lease_until = now.saturating_add(ms(id.lease));
        let new = NewCall {
            biz: id.biz,
            key: id.key,
            biz_no: id.biz_no,
            params_hash: id.fingerprint,
            now_ms: now,
            lease_until_ms: lease_until,
            expires_ms: now.saturating_add(ms(id.ttl)),
        };
        if let Some(call_id) = DB::call_insert(db, &new).await.map_err(|e| db_error::<DB>(id, e))? {
            let owner = Owner { id: call_id, fence: 1 };
            return Ok(Opened::Held(Held { owner, recorded: HashMap::new(), resumed: false }));
        }
        let Some(row) = DB::call_read(db, id.biz, id.key).await.map_err(|e| db_error::<DB>(id, e))? else {
            continue; // deleted in between: insert again
        };
        if row.status != PROCESSING {
            if row.expires_ms > now {
                return Ok(Opened::Finished(row));
            }
            DB::call_delete_expired(db, id.biz, id.key, now).await.map_err(|e| db_error::<DB>(id, e))?;
            continue;
        }
        // Never resume a call made with other arguments.
        if row.params_hash != id.fingerprint {
            return Err(id.reused());
        }
        if row.lease_until_ms > now {
            return Ok(Opened::Busy { lease_until_ms: row.lease_until_ms });
        }
        let from = Owner { id: row.id, fence: row.fence };
        if DB::call_take_over(db, from, now, lease_until).await.map_err(|e| db_error::<DB>(id, e))? {
            let owner = Owner { id: row.id, fence: row.fence + 1 };
            // Read after the takeover committed: a step the old owner was
            // recording held the takeover back, so it is here.
            let steps = DB::steps_read(db, row.id).await.map_err(|e| db_error::<DB>(id, e))?;
            tracing::info!(fence = owner.fence, steps = steps.len(), "idem: call taken over after its lease ran out");
            return Ok(Opened::Held(Held { owner, recorded: steps.into_iter().collect(), resumed: true }));
        }
        // Another retry took it over, or its owner finished: look again.
    }
    Err(id.in_progress())
}

/// What [`record_step`] did.
#[derive(Debug)]
pub(crate) enum StepRecord {
    /// Recorded under our fence.
    Recorded,
    /// Already recorded (by an owner we took over from): this result stands.
    Taken(String),
    /// The call is no longer ours.
    Fenced,
}

/// Records a step's result (JSON) under `owner`, in a statement of its own.
pub(crate) async fn record_step<DB: Backend>(
    db: &Db<DB>,
    clock: &Clock,
    id: &CallKey<'_>,
    owner: Owner,
    step: &str,
    step_key: &str,
    response: &str,
) -> Result<StepRecord, Error> {
    let written = DB::step_insert(db, owner, step, step_key, response, clock.now_ms())
        .await
        .map_err(|e| db_error::<DB>(id, e))?;
    Ok(match written {
        StepWritten::Recorded => StepRecord::Recorded,
        StepWritten::Fenced => StepRecord::Fenced,
        StepWritten::Taken => match DB::step_read(db, owner.id, step).await.map_err(|e| db_error::<DB>(id, e))? {
            Some(stored) => StepRecord::Taken(stored),
            None => StepRecord::Fenced,
        },
    })
}

/// What [`finish`] did.
#[derive(Debug)]
pub(crate) enum Finished {
    /// Committed: the body's writes and the finished call; it expires then.
    Ours { expires_ms: i64 },
    /// The call is no longer ours: everything rolled back.
    Fenced,
}

/// What the final transaction writes: the call's outcome and what to clean.
pub(crate) struct Final<'a> {
    pub status: i16,
    pub response: &'a str,
    pub ttl: Duration,
    /// Whether steps were recorded (and are deleted with the finish).
    pub has_steps: bool,
}

/// The final transaction: marks the call finished with the outcome's
/// `status` and `response` if `owner` still holds it, deletes its steps,
/// and commits. An error leaves it unknown whether the commit happened
/// (when it was the `COMMIT` that failed).
pub(crate) async fn finish<DB: Backend>(
    pooling: Pooling,
    mut tx: Transaction<'static, DB>,
    clock: &Clock,
    owner: Owner,
    last: Final<'_>,
) -> Result<Finished, sqlx::Error> {
    let Final { status, response, ttl, has_steps } = last;
    let now = clock.now_ms();
    let expires_ms = now.saturating_add(ms(ttl));
    // The fenced update first: it takes the call's row lock, so a takeover
    // waits for this commit (and then finds the call finished).
    match DB::call_finish(pooling, &mut tx, owner, status, response, now, expires_ms).await {
        Ok(true) => {}
        Ok(false) => {
            rollback(tx).await;
            return Ok(Finished::Fenced);
        }
        Err(e) => {
            rollback(tx).await;
            return Err(e);
        }
    }
    if has_steps && let Err(e) = DB::steps_delete(pooling, &mut tx, owner.id).await {
        rollback(tx).await;
        return Err(e);
    }
    tx.commit().await?;
    Ok(Finished::Ours { expires_ms })
}

/// Ends our lease now, so the next call takes over at once and resumes
/// from the recorded steps. Best effort: otherwise the lease ends by itself.
pub(crate) async fn release<DB: Backend>(db: &Db<DB>, clock: &Clock, owner: Owner) {
    if let Err(e) = DB::call_release(db, owner, clock.now_ms()).await {
        tracing::debug!(error = %e, "idem: releasing the call's lease failed; it ends by itself");
    }
}

/// Deletes our processing call: nothing of it reached outside, so the next
/// call starts afresh and recovery has nothing to list. Best effort.
pub(crate) async fn discard<DB: Backend>(db: &Db<DB>, owner: Owner) {
    if let Err(e) = DB::call_discard(db, owner).await {
        tracing::debug!(error = %e, "idem: discarding the call failed; its lease ends by itself");
    }
}

/// The call of the key as it stands, read without locks.
pub(crate) async fn read<DB: Backend>(db: &Db<DB>, id: &CallKey<'_>) -> Result<Option<CallRow>, Error> {
    DB::call_read(db, id.biz, id.key).await.map_err(|e| db_error::<DB>(id, e))
}

/// A database error as the caller sees it: a lock wait past its bound, or
/// a conflict, means someone else holds the key.
pub(crate) fn db_error<DB: Backend>(id: &CallKey<'_>, error: sqlx::Error) -> Error {
    match DB::classify(&error) {
        ErrorClass::LockTimeout | ErrorClass::Conflict => id.in_progress(),
        _ => Error::from_store(error),
    }
}

/// A duration as the tables count it: milliseconds (capped, as durations
/// are at 100 years).
pub(crate) fn ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}
