//! The reading side: the group created (`XGROUP CREATE ... MKSTREAM`),
//! entries left pending by anyone taken over (`XAUTOCLAIM`, every
//! `claim_interval`, their delivery counts from `XPENDING`), new entries read
//! (`XREADGROUP ... >`), and Redis outages waited out.
//!
//! Each read runs in a task of its own, on a connection of its own (a
//! blocking read would hold up the acks of the other one): a runner that
//! stops mid-read waits for the read (at most [`MAX_BLOCK`]) and gives back
//! what it brought, rather than leave entries delivered to nobody.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{RedisError, RedisResult, Value};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::reply::{RawEntry, delivery_counts_of_pending_reply, entries_of_autoclaim_reply, entries_of_read_reply};
use super::{Entry, Names};
use crate::consumer::transport::Deliveries;

/// The longest `XREADGROUP ... BLOCK`: how long a stop may wait for a read.
pub(crate) const MAX_BLOCK: Duration = Duration::from_secs(1);
/// The first wait after a failed read; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// What one read needs, cloned into its task.
#[derive(Clone)]
pub(crate) struct ReadJob {
    pub(crate) conn: ConnectionManager,
    pub(crate) names: Arc<Names>,
    pub(crate) claim_idle: Duration,
    pub(crate) claim_interval: Duration,
}

/// Where the reads are: whether the group exists, the `XAUTOCLAIM` cursor,
/// when the next claim is due.
struct ReadState {
    group_ready: bool,
    cursor: String,
    claim_due: Instant,
}

type Read = (ReadState, RedisResult<Vec<Entry>>);

pub(crate) struct Reader {
    job: ReadJob,
    /// `None` while a read is in flight (the read holds it).
    state: Option<ReadState>,
    in_flight: Option<JoinHandle<Read>>,
    taken: VecDeque<Entry>,
    stopped: bool,
    failures: u32,
    not_before: Instant,
}

impl Reader {
    pub(crate) fn new(job: ReadJob) -> Self {
        let now = Instant::now();
        Reader {
            job,
            state: Some(ReadState { group_ready: false, cursor: "0-0".to_owned(), claim_due: now }),
            in_flight: None,
            taken: VecDeque::new(),
            stopped: false,
            failures: 0,
            not_before: now,
        }
    }
}

impl Deliveries for Reader {
    type Delivery = Entry;
    type Error = RedisError;

    async fn next(&mut self, room: usize) -> Option<RedisResult<Entry>> {
        loop {
            if let Some(entry) = self.taken.pop_front() {
                return Some(Ok(entry));
            }
            if self.in_flight.is_none() {
                if self.stopped {
                    return None;
                }
                tokio::time::sleep_until(self.not_before).await;
                let state = self.state.take().expect("a state when no read is in flight");
                let job = self.job.clone();
                self.in_flight = Some(tokio::spawn(async move { job.read(state, room).await }));
            }
            // Awaiting the handle, not the read: dropped here, the read goes
            // on and its entries are picked up by the next call.
            let joined = self.in_flight.as_mut().expect("a read in flight").await;
            self.in_flight = None;
            let (state, result) = match joined {
                Ok(read) => read,
                Err(e) => {
                    tracing::error!(error = %e, "idem redis streams consumer: a read's task failed; reading again");
                    (
                        ReadState { group_ready: false, cursor: "0-0".to_owned(), claim_due: Instant::now() },
                        Ok(Vec::new()),
                    )
                }
            };
            self.state = Some(state);
            match result {
                Ok(entries) => {
                    self.failures = 0;
                    self.taken.extend(entries);
                }
                Err(e) if fails_for_good(&e) => return Some(Err(e)),
                Err(e) => {
                    self.failures = self.failures.saturating_add(1);
                    let wait = backoff(self.failures);
                    self.not_before = Instant::now() + wait;
                    tracing::warn!(stream = %self.job.names.stream, error = %e, ?wait,
                        "idem redis streams consumer: Redis failed; waiting, then reading again");
                }
            }
        }
    }

    async fn stop(&mut self) -> RedisResult<()> {
        self.stopped = true;
        Ok(())
    }

    async fn finish(self) {}
}

impl Drop for Reader {
    /// A runner dropped mid-read (its task aborted) leaves no read behind.
    fn drop(&mut self) {
        if let Some(read) = &self.in_flight {
            read.abort();
        }
    }
}

/// The wait before the `failures`th read after a failure: no busy loop
/// while Redis is down, and no long wait once it is back.
fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    FIRST_BACKOFF.saturating_mul(1 << doublings).min(MAX_BACKOFF)
}

/// Errors Redis answers to the commands themselves, which no wait mends:
/// the key is not a stream, the user may not run them, Redis is older than
/// 6.2 (no `XAUTOCLAIM`). Anything else (Redis unreachable, loading,
/// failing over) is waited out.
fn fails_for_good(e: &RedisError) -> bool {
    matches!(e.code(), Some("WRONGTYPE" | "NOPERM" | "ERR"))
}

fn no_group(e: &RedisError) -> bool {
    e.code() == Some("NOGROUP")
}

impl ReadJob {
    /// Takes up to `room` entries: claimed ones first when a claim is due,
    /// else new ones (blocking until one comes or the next claim is due).
    async fn read(self, mut state: ReadState, room: usize) -> Read {
        let result = self.read_into(&mut state, room).await;
        match result {
            // The group is gone (a Redis restarted empty, a deleted stream):
            // created again on the next read.
            Err(e) if no_group(&e) => {
                tracing::warn!(stream = %self.names.stream, group = %self.names.group,
                    "idem redis streams consumer: the group is gone; creating it again");
                state.group_ready = false;
                (state, Ok(Vec::new()))
            }
            result => (state, result),
        }
    }

    async fn read_into(&self, state: &mut ReadState, room: usize) -> RedisResult<Vec<Entry>> {
        let mut conn = self.conn.clone();
        let names = &*self.names;
        if !state.group_ready {
            create_group(&mut conn, names).await?;
            state.group_ready = true;
        }
        let now = Instant::now();
        if now >= state.claim_due {
            let reply: Value = redis::cmd("XAUTOCLAIM")
                .arg(&names.stream)
                .arg(&names.group)
                .arg(&names.consumer)
                .arg(millis(self.claim_idle))
                .arg(&state.cursor)
                .arg("COUNT")
                .arg(room)
                .query_async(&mut conn)
                .await?;
            let (cursor, claimed) = entries_of_autoclaim_reply(&reply).map_err(unreadable)?;
            // A full pass over the pending entries: the next one after the interval.
            if cursor == "0-0" {
                state.claim_due = now + self.claim_interval;
            }
            state.cursor = cursor;
            if !claimed.is_empty() {
                return self.with_delivery_counts(&mut conn, claimed).await;
            }
        }
        let block = state.claim_due.saturating_duration_since(now).clamp(Duration::from_millis(1), MAX_BLOCK);
        let reply: Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&names.group)
            .arg(&names.consumer)
            .arg("COUNT")
            .arg(room)
            .arg("BLOCK")
            .arg(millis(block))
            .arg("STREAMS")
            .arg(&names.stream)
            .arg(">")
            .query_async(&mut conn)
            .await?;
        let fresh = entries_of_read_reply(&reply).map_err(unreadable)?;
        // Read with `>`: their first delivery.
        Ok(fresh.into_iter().map(|raw| Entry::new(raw, 1, names)).collect())
    }

    /// Claimed entries with the times Redis delivered them (the claim
    /// included), from one pipelined `XPENDING` per entry.
    async fn with_delivery_counts(
        &self,
        conn: &mut ConnectionManager,
        claimed: Vec<RawEntry>,
    ) -> RedisResult<Vec<Entry>> {
        let names = &*self.names;
        let mut pipe = redis::pipe();
        for raw in &claimed {
            pipe.cmd("XPENDING").arg(&names.stream).arg(&names.group).arg(&raw.id).arg(&raw.id).arg(1);
        }
        let replies: Vec<Value> = pipe.query_async(conn).await?;
        let mut entries = Vec::with_capacity(claimed.len());
        for (raw, reply) in claimed.into_iter().zip(replies.iter().map(Some).chain(std::iter::repeat(None))) {
            let counted = reply.map(delivery_counts_of_pending_reply).transpose().map_err(unreadable)?;
            // Acked meanwhile (a slow first handler): handled again, it replays.
            let delivered = counted.and_then(|rows| rows.first().map(|(_, n)| *n)).unwrap_or(1);
            entries.push(Entry::new(raw, delivered, names));
        }
        Ok(entries)
    }
}

/// `XGROUP CREATE <stream> <group> 0 MKSTREAM`: a new group starts at the
/// stream's first entry (nothing published before the first consumer is
/// missed); an existing one (`BUSYGROUP`) keeps its place.
async fn create_group(conn: &mut ConnectionManager, names: &Names) -> RedisResult<()> {
    let created: RedisResult<()> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&names.stream)
        .arg(&names.group)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(conn)
        .await;
    match created {
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
        other => other,
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A reply that could not be read, as a Redis error (it is waited out and
/// read again, like a failed read).
fn unreadable(what: String) -> RedisError {
    RedisError::from((redis::ErrorKind::Parse, "unreadable reply", what))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_up_to_its_cap() {
        let waits: Vec<u128> = (1..=8).map(|n| backoff(n).as_millis()).collect();
        assert_eq!(waits, vec![50, 100, 200, 400, 800, 1600, 2000, 2000]);
        assert_eq!(backoff(u32::MAX), MAX_BACKOFF);
    }
}
