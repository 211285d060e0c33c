//! The record protocol: what a call asks the record table, one question
//! per phase, written once for every backend.
//!
//! - [`Records::open`], before the body: the transaction the body runs in.
//!   Without a claim the record goes in first, so a duplicate blocks on the
//!   unique index before its body runs (bounded by `lock_wait`); with a
//!   claim, duplicates are already kept out and the record waits for the end.
//! - [`Records::commit`], after a body that returned a value: the finished
//!   record, then `COMMIT`; or the duplicate's row that holds the key.
//! - [`Records::settle`], after any failure once the body ran: the row a
//!   duplicate committed, if any.
//! - [`Records::read_live`]: a duplicate's question when the gate says busy.
//! - [`Records::join`] and [`Records::finish_joined`]: the same record,
//!   first, in a savepoint of a transaction the caller holds (the `join`
//!   mode); it commits when the caller commits.
//!
//! Where the database is far ([`RIDE_FROM`]), the record's statement rides
//! in the round trip of the `BEGIN` or the `COMMIT` the transaction sends
//! anyway, one text each (`store::text`): a call then waits for the round
//! trips of a plain transaction. Closer, each goes bound, on its own.

use std::time::Duration;

use sqlx::Transaction;

pub(crate) use super::opening::rollback;
use super::opening::{self, Opening};
use super::{Backend, Db, ErrorClass, FAILED, NewRecord, PROCESSING, Pooling, RowKey, SUCCEEDED, StoredRecord};
use crate::clock::Clock;
use crate::error::Error;

/// Pauses before each of [`Records::settle`]'s probes: at once, then twice
/// more after a woken duplicate had time to insert.
const SETTLE_PAUSES: [Duration; 3] = [Duration::ZERO, Duration::from_millis(5), Duration::from_millis(50)];

/// How many attempts a deadlock or serialization failure before the body
/// runs gets: the first and two retries.
const CONFLICT_ATTEMPTS: u32 = 3;

/// How far the database must be for the record's statements to ride with
/// `BEGIN` and `COMMIT` (`store::text`): a round trip this long or longer,
/// as the engine's reading of the database's clock measured it. Closer, a
/// round trip costs less than the server's work on a text: its statements
/// are parsed and planned on every call, where a bound statement's plan is
/// kept (PostgreSQL planned the record's insert in 0.09 ms on the bench's
/// machine), and on MariaDB the `ROLLBACK` sqlx sends for a transaction a
/// text committed is a round trip of its own, off the caller's path. On
/// loopback the riding call was 9-18 % slower from one task; 1 ms away,
/// 20-45 % faster (docs/performance.md).
const RIDE_FROM: Duration = Duration::from_micros(500);

/// One call's identity in the record table, borrowed for the call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecordKey<'a> {
    pub biz: &'static str,
    pub key: &'a str,
    pub fingerprint: &'a str,
    pub biz_no: Option<&'a str>,
    pub ttl: Duration,
    /// How the table finds the key (its digest computed once per call).
    row: RowKey<'a>,
}

impl<'a> RecordKey<'a> {
    pub(crate) fn new(
        biz: &'static str,
        key: &'a str,
        fingerprint: &'a str,
        biz_no: Option<&'a str>,
        ttl: Duration,
    ) -> Self {
        RecordKey { biz, key, fingerprint, biz_no, ttl, row: RowKey::new(biz, key) }
    }

    /// How the table finds the key; the gate finds it by the same digest.
    pub(crate) fn row(&self) -> RowKey<'a> {
        self.row
    }

    /// The row to insert at `now` (database time, epoch ms).
    fn record<'r>(&'r self, status: i16, response: Option<&'r str>, now: i64) -> NewRecord<'r> {
        NewRecord {
            key: self.row,
            biz_no: self.biz_no,
            params_hash: self.fingerprint,
            status,
            response,
            now_ms: now,
            expires_ms: now.saturating_add(i64::try_from(self.ttl.as_millis()).unwrap_or(i64::MAX)),
        }
    }

    fn in_progress(&self) -> Error {
        Error::InProgress { biz: self.biz, key: self.key.to_owned() }
    }
}

/// The record table of one engine.
pub(crate) struct Records<'p, DB: Backend> {
    pub db: &'p Db<DB>,
    /// Bound on a wait for a duplicate still in flight.
    pub lock_wait: Duration,
    /// The database's clock: every stamp and every expiry judged by it.
    pub clock: &'p Clock,
}

/// What [`Records::open`] found.
pub(crate) enum Opened<DB: Backend> {
    /// Run the body in this transaction.
    Go(Transaction<'static, DB>),
    /// A live committed row holds the key: the answer, without the body.
    Taken(StoredRecord),
}

/// What a call finished with, to record.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Finished<'r> {
    /// Its value's JSON.
    Value(&'r str),
    /// A business error its fn declared final, as recorded (JSON).
    Error(&'r str),
}

impl<'r> Finished<'r> {
    /// `response`, a declared business error's when `failed`.
    pub(crate) fn of(response: &'r str, failed: bool) -> Self {
        if failed { Finished::Error(response) } else { Finished::Value(response) }
    }

    fn status(self) -> i16 {
        match self {
            Finished::Value(_) => SUCCEEDED,
            Finished::Error(_) => FAILED,
        }
    }

    fn response(self) -> &'r str {
        match self {
            Finished::Value(json) | Finished::Error(json) => json,
        }
    }
}

/// What [`Records::commit`] did.
pub(crate) enum Committed {
    /// Our record and the body's writes committed; the record expires then.
    Ours { expires_ms: i64 },
    /// A duplicate's committed row holds the key: ours was rolled back.
    Theirs(StoredRecord),
}

/// What [`Records::settle`] found.
pub(crate) enum Settled {
    /// A committed, live row holds the key.
    Replay(StoredRecord),
    /// A duplicate still holds the key past `lock_wait`.
    Busy,
    /// Nothing committed, or the database could not tell.
    Unknown,
}

impl<DB: Backend> Records<'_, DB> {
    /// The transaction the body runs in, or the live row that answers
    /// instead. `claimed`: a Redis claim keeps duplicates out, so the record
    /// waits for [`commit`](Records::commit); `early`: its transaction,
    /// opened while the claim was in flight (`call/early_begin.rs`).
    pub(crate) async fn open(
        &self,
        id: &RecordKey<'_>,
        claimed: bool,
        early: Option<Opening<DB>>,
    ) -> Result<Opened<DB>, Error> {
        if claimed {
            let mut opening = early.unwrap_or_else(|| Opening::begin(&self.db.pool));
            return opening.take().await.map(Opened::Go).map_err(|e| db_error::<DB>(id, e));
        }
        let mut attempt = 0;
        loop {
            attempt += 1;
            let record = id.record(PROCESSING, None, self.clock.now_ms());
            let riding = if self.rides() { DB::begin_inserting(self.db, &record, self.lock_wait) } else { None };
            let opened = match riding {
                Some(text) => self.begin_inserting(id, &record, text).await,
                None => self.open_then_insert(id, &record).await,
            };
            match opened {
                Ok(opened) => return Ok(opened),
                Err(e) if DB::classify(&e) == ErrorClass::Conflict && attempt < CONFLICT_ATTEMPTS => continue,
                Err(e) => return Err(db_error::<DB>(id, e)),
            }
        }
    }

    /// Whether the record's statements ride with `BEGIN` and `COMMIT`: the
    /// database is at least [`RIDE_FROM`] away.
    fn rides(&self) -> bool {
        self.clock.round_trip().is_some_and(|round_trip| round_trip >= RIDE_FROM)
    }

    /// The transaction and the record in one round trip: `BEGIN` carries
    /// the insert ([`RecordSql::begin_inserting`]). A row that holds the
    /// key fails the text, which leaves nothing open; a plain read then
    /// finds that row. A row that expired (or one gone since) is left to
    /// [`open_then_insert`](Records::open_then_insert), which replaces it
    /// inside the call's transaction.
    async fn begin_inserting(
        &self,
        id: &RecordKey<'_>,
        record: &NewRecord<'_>,
        text: super::Text,
    ) -> Result<Opened<DB>, sqlx::Error> {
        let pool = self.db.pool.clone();
        match opening::whole(async move { pool.begin_with(text.into_sql()).await }).await {
            Ok(tx) => Ok(Opened::Go(tx)),
            Err(e) if super::is_unique_violation(&e) => match DB::read_plain(self.db, id.row).await? {
                Some(row) if row.expires_ms > self.clock.now_ms() => Ok(Opened::Taken(row)),
                Some(_) | None => self.open_then_insert(id, record).await,
            },
            Err(e) if DB::begin_refused(&e) => {
                self.db.begin_rides.store(false, std::sync::atomic::Ordering::Relaxed);
                self.open_then_insert(id, record).await
            }
            Err(e) => Err(e),
        }
    }

    /// The transaction, then the record in it, one statement after the
    /// other (the bound set with `BEGIN`, ended before the body).
    async fn open_then_insert(&self, id: &RecordKey<'_>, record: &NewRecord<'_>) -> Result<Opened<DB>, sqlx::Error> {
        // SQLite waits for its write lock at `BEGIN IMMEDIATE`.
        let mut tx = opening::begin_bounded(&self.db.pool, self.lock_wait).await?;
        let inserted = match insert(self.db.pooling, &mut tx, id, record, Wait::Set(self.lock_wait), self.clock).await {
            Ok(Taken::No) => DB::end_bound(self.db.pooling, &mut tx).await.map(|()| Taken::No),
            other => other,
        };
        match inserted {
            Ok(Taken::No) => Ok(Opened::Go(tx)),
            Ok(Taken::By(row)) => {
                rollback(tx).await;
                Ok(Opened::Taken(row))
            }
            Err(e) => {
                rollback(tx).await;
                Err(e)
            }
        }
    }

    /// Writes the finished record holding `response` (inserted with a
    /// claim, completed without) and commits. With a claim the insert waits
    /// at most `lock_wait` on a duplicate in flight (a `join` caller's open
    /// transaction holding the key), then answers `InProgress`, as a call
    /// without a claim does before its body. On any other failure our work
    /// is rolled back and the key [settled](Records::settle): a duplicate
    /// that won a conflict (or our own commit, whose answer alone was lost)
    /// is the answer; a conflict with no committed row is `InProgress`.
    pub(crate) async fn commit(
        &self,
        mut tx: Transaction<'static, DB>,
        id: &RecordKey<'_>,
        finished: Finished<'_>,
        claimed: bool,
    ) -> Result<Committed, Error> {
        let record = id.record(finished.status(), Some(finished.response()), self.clock.now_ms());
        let riding = if !self.rides() || finished.response().len() > super::text::MAX_RIDING {
            None
        } else if claimed {
            DB::insert_committing(&record, self.lock_wait)
        } else {
            DB::finish_committing(&record)
        };
        let written = match riding {
            // The record and `COMMIT` in one round trip.
            Some(text) => match DB::execute_text(&mut tx, text).await {
                Ok(_) => {
                    // Committed by the text: the `ROLLBACK` sqlx queues
                    // on dropping it ends nothing (it goes out with the
                    // pool's check of the connection, off our path).
                    drop(tx);
                    return Ok(Committed::Ours { expires_ms: record.expires_ms });
                }
                // A row met the unique index and the `COMMIT` did not run:
                // an expired row to replace, or a duplicate's, as below.
                Err(e) if claimed && super::is_unique_violation(&e) => match DB::recover_refused(&mut tx).await {
                    Ok(()) => {
                        insert(self.db.pooling, &mut tx, id, &record, Wait::AfterBody(self.lock_wait), self.clock).await
                    }
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            },
            None if claimed => {
                insert(self.db.pooling, &mut tx, id, &record, Wait::AfterBody(self.lock_wait), self.clock).await
            }
            None => DB::mark_finished(self.db.pooling, &mut tx, &record).await.map(|()| Taken::No),
        };
        let failure = match written {
            Ok(Taken::No) => match tx.commit().await {
                Ok(()) => return Ok(Committed::Ours { expires_ms: record.expires_ms }),
                Err(e) => e,
            },
            // The lease ran out and a duplicate finished first: ours is undone.
            Ok(Taken::By(row)) => {
                rollback(tx).await;
                return Ok(Committed::Theirs(row));
            }
            Err(e) => {
                rollback(tx).await;
                if DB::classify(&e) == ErrorClass::LockTimeout {
                    return Err(id.in_progress());
                }
                e
            }
        };
        match self.settle(id, claimed).await {
            Settled::Replay(row) => Ok(Committed::Theirs(row)),
            Settled::Busy => Err(id.in_progress()),
            Settled::Unknown => Err(db_error::<DB>(id, failure)),
        }
    }

    /// After a failure once the body has run (`claimed`: under a Redis
    /// claim, the record not yet inserted): the committed row of the key,
    /// if any. Asked the way a call without a claim asks before its body
    /// (insert the record in a transaction of its own, rolled back), so it
    /// waits for a duplicate still committing, such as the winner of a
    /// deadlock with us; a plain read right after our rollback could miss
    /// it. Bounded by `lock_wait` on the key, and twice that in all: a
    /// database in trouble must not hold back the call's own error for a
    /// pool's whole wait.
    pub(crate) async fn settle(&self, id: &RecordKey<'_>, claimed: bool) -> Settled {
        // Again when one finds nothing: a duplicate that was waiting on our
        // rolled-back insert may be overtaken by the probe's own insert, and
        // only gets the key when the probe rolls back; a later probe then
        // waits for it. Without a claim our record went in first, so a
        // duplicate may have been waiting on it: the pauses leave it time
        // to insert on a busy machine (seen under partitions: a deadlock's
        // victim overtook the winner's insert twice in a row). Failing
        // calls pay this, never a successful one.
        let pauses = if claimed { &SETTLE_PAUSES[..2] } else { &SETTLE_PAUSES[..] };
        let probe = async {
            for &pause in pauses {
                tokio::time::sleep(pause).await;
                let mut tx = opening::begin_bounded(&self.db.pool, self.lock_wait).await?;
                let probe = id.record(PROCESSING, None, self.clock.now_ms());
                let taken = insert(self.db.pooling, &mut tx, id, &probe, Wait::Set(self.lock_wait), self.clock).await;
                rollback(tx).await;
                if let Taken::By(row) = taken? {
                    return Ok(Taken::By(row));
                }
            }
            Ok(Taken::No)
        };
        match tokio::time::timeout(self.lock_wait.saturating_mul(2), probe).await {
            Ok(Ok(Taken::By(row))) => Settled::Replay(row),
            Ok(Err(e)) if DB::classify(&e) == ErrorClass::LockTimeout => Settled::Busy,
            Ok(Ok(Taken::No) | Err(_)) | Err(_) => Settled::Unknown,
        }
    }

    /// The committed row of `(biz, key)`, live or expired, read without
    /// waiting on locks.
    pub(crate) async fn read(&self, biz: &str, key: &str) -> Result<Option<StoredRecord>, Error> {
        DB::read_plain(self.db, RowKey::new(biz, key)).await.map_err(Error::from_store)
    }

    /// The live committed row of `(biz, key)`, if any.
    pub(crate) async fn read_live(&self, biz: &str, key: &str) -> Result<Option<StoredRecord>, Error> {
        Ok(self.read(biz, key).await?.filter(|row| row.is_live(self.clock.now_ms())))
    }
}

/// What [`Records::join`] found.
pub(crate) enum Joined<'t, DB: Backend> {
    /// Run the body in this savepoint of the caller's transaction; our
    /// record (processing) is in it.
    Go(Transaction<'t, DB>),
    /// A row holds the key: committed, or written earlier in the caller's
    /// own transaction. Nothing of ours is left in the caller's transaction.
    Taken(StoredRecord),
}

/// The `join` mode: the record in a transaction the caller holds.
impl<DB: Backend> Records<'_, DB> {
    /// Opens a savepoint in the caller's transaction and inserts the record
    /// there first, so a duplicate in another transaction waits on the
    /// unique index before its body runs (bounded by `lock_wait`, and the
    /// bound ended before the body). On a taken key or an error the
    /// savepoint is rolled back, leaving the caller's transaction usable.
    /// A deadlock cannot be retried here: the transaction is the caller's.
    pub(crate) async fn join<'t>(
        &self,
        tx: &'t mut Transaction<'_, DB>,
        id: &RecordKey<'_>,
    ) -> Result<Joined<'t, DB>, Error> {
        let pooling = self.db.pooling;
        let mut savepoint = sqlx::Acquire::begin(tx).await.map_err(|e| db_error::<DB>(id, e))?;
        let record = id.record(PROCESSING, None, self.clock.now_ms());
        let inserted = async {
            DB::bound_within(pooling, &mut savepoint, self.lock_wait).await?;
            let taken = insert(pooling, &mut savepoint, id, &record, Wait::Set(self.lock_wait), self.clock).await?;
            if let Taken::No = taken {
                DB::end_bound(pooling, &mut savepoint).await?;
            }
            Ok(taken)
        }
        .await;
        match inserted {
            Ok(Taken::No) => Ok(Joined::Go(savepoint)),
            Ok(Taken::By(row)) => {
                rollback(savepoint).await;
                Ok(Joined::Taken(row))
            }
            Err(e) => {
                rollback(savepoint).await;
                Err(db_error::<DB>(id, e))
            }
        }
    }

    /// Stores `response` in the record [`join`](Records::join) inserted and
    /// releases the savepoint: the record now stands or falls with the
    /// caller's commit.
    pub(crate) async fn finish_joined(
        &self,
        mut savepoint: Transaction<'_, DB>,
        id: &RecordKey<'_>,
        finished: Finished<'_>,
    ) -> Result<(), Error> {
        let record = id.record(finished.status(), Some(finished.response()), self.clock.now_ms());
        let done = match DB::mark_finished(self.db.pooling, &mut savepoint, &record).await {
            Ok(()) => savepoint.commit().await,
            Err(e) => {
                rollback(savepoint).await;
                Err(e)
            }
        };
        done.map_err(|e| db_error::<DB>(id, e))
    }
}

/// Whether the record insert found the key already taken.
enum Taken {
    No,
    By(StoredRecord),
}

/// How the record statements of a transaction wait on a duplicate still
/// in flight.
#[derive(Clone, Copy)]
enum Wait {
    /// At most this long: the transaction was opened bounded
    /// (`begin_bounded`, `bound_within`) where the backend bounds per
    /// transaction, and each statement says it where it bounds per statement.
    Set(Duration),
    /// At most this long, though the transaction was opened without a
    /// bound: the record goes in after a body that waits as it pleases.
    AfterBody(Duration),
}

/// Inserts the record: ours, or taken by a live committed row. An expired
/// row is replaced inside the same transaction. `wait` bounds the wait on a
/// duplicate still in flight.
async fn insert<DB: Backend>(
    pooling: Pooling,
    tx: &mut Transaction<'_, DB>,
    id: &RecordKey<'_>,
    record: &NewRecord<'_>,
    wait: Wait,
    clock: &Clock,
) -> Result<Taken, sqlx::Error> {
    // Each round either inserts, finds the live row, or clears an expired
    // one; a row that vanishes three times in a row is not worth chasing
    // (nor is one whose digest another key holds: the read checks the full
    // key and finds nothing). After the body, the first insert also sets
    // the bound where it is the transaction's (the later statements keep it).
    let bound = match wait {
        Wait::Set(wait) | Wait::AfterBody(wait) => Some(wait),
    };
    for round in 0..3 {
        let inserted = match wait {
            Wait::AfterBody(wait) if round == 0 => DB::insert_after_body(pooling, tx, record, wait).await?,
            _ => DB::insert(pooling, tx, record, bound).await?,
        };
        if inserted {
            return Ok(Taken::No);
        }
        let now = clock.now_ms();
        match DB::read_locking(pooling, &mut **tx, id.row, bound).await? {
            Some(row) if row.expires_ms > now => return Ok(Taken::By(row)),
            Some(_) => {
                DB::delete_expired(pooling, &mut **tx, id.row, now, bound).await?;
            }
            None => {}
        }
    }
    Err(sqlx::Error::Protocol("idem_record row of the key keeps changing, or another key holds its digest".into()))
}

/// A database error as the caller sees it: a lock wait past its bound, or
/// a conflict that outlived its retries, means someone else holds the key;
/// anything else is told as [`Error::from_store`] tells it.
fn db_error<DB: Backend>(id: &RecordKey<'_>, error: sqlx::Error) -> Error {
    match DB::classify(&error) {
        ErrorClass::LockTimeout | ErrorClass::Conflict => id.in_progress(),
        _ => Error::from_store(error),
    }
}
