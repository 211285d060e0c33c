//! The settling side: `XACK`; an entry given back by setting its idle time
//! (and, uncounted, its delivery count) with `XCLAIM`, so that the next
//! `XAUTOCLAIM` of any consumer takes it after the delay; a dead letter
//! copied and acked in one `MULTI`.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{RedisError, RedisResult};

use super::{
    DEAD_DELIVERED_FIELD, DEAD_ENTRY_ID_FIELD, DEAD_ERROR_FIELD, DEAD_REASON_FIELD, DEAD_STREAM_FIELD, Delivered,
    Entry, Names,
};
use crate::consumer::Reason;
use crate::consumer::transport::{DeadLettered, Retried, Settle};

pub(crate) struct Group {
    pub(crate) conn: ConnectionManager,
    pub(crate) names: Arc<Names>,
    pub(crate) dead_letter_stream: String,
    pub(crate) claim_idle: Duration,
}

impl Settle for Group {
    type Delivery = Entry;
    type Error = RedisError;
    type Delivered = Delivered;

    const NAME: &'static str = "redis_streams";
    const MESSAGE_ID: &'static str = "message id field (UTF-8)";
    const EXHAUSTED: Reason = Reason::DeliveriesExhausted;
    const METRIC: &'static str = crate::metrics::REDIS_STREAM_SETTLEMENTS;
    const METRIC_SCOPE: &'static str = "stream";

    fn scope(&self) -> &str {
        &self.names.stream
    }

    fn payload(entry: &Entry) -> Result<&[u8], String> {
        entry.payload().ok_or_else(|| "no payload field".to_owned())
    }

    fn message_id(entry: &Entry) -> Option<&str> {
        entry.message_id.as_deref()
    }

    /// Redis's delivery count (1 on the first).
    fn spent(entry: &Entry) -> u64 {
        entry.delivered
    }

    async fn ack(&self, entry: &Entry) -> RedisResult<()> {
        let names = &*self.names;
        self.idempotent(redis::cmd("XACK").arg(&names.stream).arg(&names.group).arg(&entry.id)).await.map(drop)
    }

    /// Idle for `claim_idle - delay` and delivered one time fewer: claimed
    /// again after the delay, its count back where it was.
    async fn requeue(&self, entry: &Entry, delay: Duration) -> RedisResult<()> {
        self.give_back(entry, delay, Some(entry.delivered.saturating_sub(1))).await
    }

    /// Idle for `claim_idle - delay`: claimed again after the delay, the
    /// claim counting one more delivery.
    async fn retry(&self, entry: &Entry, delay: Duration, _: u64) -> Retried<RedisError> {
        Retried::Done(self.give_back(entry, delay, None).await)
    }

    async fn dead_letter(&self, entry: &Entry, reason: Reason, error: Option<&str>) -> DeadLettered<RedisError> {
        let names = &*self.names;
        let mut copy = redis::cmd("XADD");
        copy.arg(&self.dead_letter_stream).arg("*");
        for (field, value) in &entry.fields {
            copy.arg(field).arg(value);
        }
        copy.arg(DEAD_REASON_FIELD).arg(reason.as_str());
        copy.arg(DEAD_STREAM_FIELD).arg(&names.stream);
        copy.arg(DEAD_ENTRY_ID_FIELD).arg(&entry.id);
        copy.arg(DEAD_DELIVERED_FIELD).arg(entry.delivered);
        if let Some(error) = error {
            copy.arg(DEAD_ERROR_FIELD).arg(error);
        }
        let mut pipe = redis::pipe();
        // The copy and the ack together, or neither: no copy twice, none lost.
        pipe.atomic().add_command(copy).ignore();
        pipe.cmd("XACK").arg(&names.stream).arg(&names.group).arg(&entry.id).ignore();
        match pipe.query_async::<()>(&mut self.conn.clone()).await {
            Ok(()) => DeadLettered::Done(Ok(())),
            Err(e) => DeadLettered::NotStored(e),
        }
    }

    fn delivered(entry: &Entry) -> Delivered {
        Delivered { count: entry.delivered, entry_id: entry.id.clone() }
    }
}

impl Group {
    /// `XCLAIM <stream> <group> <me> 0 <id> IDLE <claim_idle - delay>
    /// [RETRYCOUNT n] JUSTID`: the entry stays pending, and becomes
    /// claimable once `delay` has passed (at once for no delay; after
    /// `claim_idle` for a delay longer than that). `JUSTID` leaves its
    /// delivery count alone.
    async fn give_back(&self, entry: &Entry, delay: Duration, delivered: Option<u64>) -> RedisResult<()> {
        let names = &*self.names;
        let idle = u64::try_from(self.claim_idle.saturating_sub(delay).as_millis()).unwrap_or(u64::MAX);
        let mut claim = redis::cmd("XCLAIM");
        claim.arg(&names.stream).arg(&names.group).arg(&names.consumer).arg(0).arg(&entry.id).arg("IDLE").arg(idle);
        if let Some(delivered) = delivered {
            claim.arg("RETRYCOUNT").arg(delivered);
        }
        claim.arg("JUSTID");
        self.idempotent(&claim).await.map(drop)
    }

    /// Runs a command that may safely run twice, a second time if the
    /// connection failed under the first: the connection a settlement finds
    /// after a Redis outage is a dead one (the manager reconnects once a
    /// command failed on it), and an entry left pending for that would wait
    /// `claim_idle` before it comes back.
    async fn idempotent(&self, cmd: &redis::Cmd) -> RedisResult<redis::Value> {
        let mut conn = self.conn.clone();
        match cmd.query_async(&mut conn).await {
            Err(e) if e.is_io_error() || e.is_connection_dropped() => cmd.query_async(&mut conn).await,
            answer => answer,
        }
    }
}
