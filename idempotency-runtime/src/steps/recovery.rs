//! Recovery without a client: the calls stuck in `processing` past their
//! lease, for an application to drive to the end (call the fn again with
//! the same arguments: it takes the call over and resumes from the
//! recorded steps), and the purge of finished calls.

use crate::engine::Idem;
use crate::error::Error;
use crate::key::validate_biz;
use crate::store::Backend;

/// A call in `processing` whose lease ran out: its owner died, hangs, or
/// failed for now and handed the key on. Nobody finishes it until a call
/// with its key comes again.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StuckCall {
    /// The rendered key.
    pub key: String,
    /// The business number recorded with it, if the fn declares `biz_no`:
    /// the handle to find the arguments again.
    pub biz_no: Option<String>,
    /// Its fencing token: 1, plus one per takeover so far.
    pub fence: i64,
    /// When its lease ended, in Unix epoch milliseconds.
    pub lease_ended_at_ms: i64,
    /// When phase one first recorded it, in Unix epoch milliseconds.
    pub started_at_ms: i64,
}

impl<DB: Backend> Idem<DB> {
    /// Up to `limit` calls of `biz` (a fn in `steps` mode) stuck in
    /// `processing` past their lease, the longest stuck first. Call the fn
    /// again for each, with the arguments it was called with (found through
    /// the key or the `biz_no`): it takes over and resumes. A call whose
    /// owner is still running past its lease is listed too; taking it over
    /// is safe, since the old owner is fenced off.
    pub async fn stuck_calls(&self, biz: &str, limit: u32) -> Result<Vec<StuckCall>, Error> {
        validate_biz(biz)?;
        let rows =
            DB::calls_stuck(self.db(), biz, self.now_ms().await, i64::from(limit)).await.map_err(Error::from_store)?;
        Ok(rows
            .into_iter()
            .map(|(key, biz_no, fence, lease_ended_at_ms, started_at_ms)| StuckCall {
                key,
                biz_no,
                fence,
                lease_ended_at_ms,
                started_at_ms,
            })
            .collect())
    }

    /// Deletes up to `limit` finished two-phase calls whose ttl ran out;
    /// returns how many. Calls in `processing` are never purged: they wait
    /// for [`stuck_calls`](Idem::stuck_calls) and a retry.
    pub async fn purge_expired_calls(&self, limit: u32) -> Result<u64, Error> {
        DB::calls_purge_expired(self.db(), self.now_ms().await, i64::from(limit)).await.map_err(Error::from_store)
    }
}
