//! The relay: takes batches of pending rows, hands them to a [`Publisher`],
//! and marks each row by the broker's answer, in the transaction that
//! locked the batch.
//!
//! | the broker's answer for a message | the row |
//! |---|---|
//! | confirmed ([`Confirm::Sent`]) | marked sent, in the batch's transaction |
//! | refused ([`Confirm::Refused`]: a nack, unroutable, no stream for the subject) | attempt counted; pending again after a back-off with jitter; dead after [`Relay::max_attempts`], logged, left for an operator |
//! | no answer ([`Confirm::Unconfirmed`]: the connection dropped, a confirm timed out) | untouched and uncounted: the broker was unavailable, not the message at fault; the relay backs off (with jitter) before its next batch |
//!
//! A row is never marked sent before its confirm, and never deleted unless
//! sent (after [`Relay::retention`]) or discarded by an operator. A relay
//! that dies between publish and mark (or whose commit fails) leaves its
//! rows pending: they are published again, with the same message id, and
//! the broker (NATS's duplicate window) or the consumer's record drops the
//! second copy.

use std::future::{Future, poll_fn};
use std::hash::{BuildHasher, Hasher};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::watch;

use crate::engine::Idem;
use crate::store::Backend;
use crate::store::outbox::{DEAD, PENDING, PendingRow};

/// One event as a [`Publisher`] gets it.
#[derive(Debug, Clone)]
pub struct Message {
    id: String,
    destination: String,
    aggregate: Option<String>,
    payload: String,
    headers: Vec<(String, String)>,
    attempts: i32,
    queued_at_ms: i64,
}

impl Message {
    fn from_row(row: PendingRow) -> Self {
        let (_, id, destination, aggregate, payload, headers, attempts, queued_at_ms) = row;
        // Written by `queue` from a map of strings; anything else is ignored.
        let headers = headers
            .and_then(|text| serde_json::from_str::<std::collections::BTreeMap<String, String>>(&text).ok())
            .map(|map| map.into_iter().collect())
            .unwrap_or_default();
        Message { id, destination, aggregate, payload, headers, attempts, queued_at_ms }
    }

    /// The message id: AMQP `message_id`, `Nats-Msg-Id`.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Where it goes: a routing key, or a subject.
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// Its aggregate, if any.
    pub fn aggregate(&self) -> Option<&str> {
        self.aggregate.as_deref()
    }

    /// The JSON payload.
    pub fn payload(&self) -> &str {
        &self.payload
    }

    /// Its headers, by name.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// Refused attempts so far (0 on the first).
    pub fn attempts(&self) -> i32 {
        self.attempts
    }

    /// When its body queued it (Unix epoch ms).
    pub fn queued_at_ms(&self) -> i64 {
        self.queued_at_ms
    }
}

/// The broker's answer for one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Confirm {
    /// Confirmed: stored by the broker. `duplicate`: the broker already had
    /// this message id and dropped this copy (NATS JetStream's duplicate
    /// window); it counts as sent.
    Sent {
        /// Dropped by the broker as a copy of one it holds.
        duplicate: bool,
    },
    /// Refused by the broker for this message (why, as text): counted as an
    /// attempt.
    Refused(String),
    /// No answer: the broker or the connection failed. Not counted; the
    /// row stays pending and the relay backs off.
    Unconfirmed(String),
}

/// Publishes batches to a broker and reports what it confirmed:
/// [`RabbitPublisher`](super::rabbit::RabbitPublisher) (feature `amqp`),
/// [`NatsPublisher`](super::nats::NatsPublisher) (feature `nats`), or your
/// own.
///
/// `publish` answers one [`Confirm`] per message, in order (missing answers
/// count as [`Confirm::Unconfirmed`]), and must end in bounded time: the
/// relay's transaction stays open while it runs. It reconnects by itself
/// when its connection failed.
pub trait Publisher: Send {
    /// Publishes `batch` and waits for the broker's confirms.
    fn publish(&mut self, batch: &[Message]) -> impl Future<Output = Vec<Confirm>> + Send;
}

/// What one batch did; passed to [`Relay::on_batch`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// Rows taken.
    pub taken: usize,
    /// Confirmed and marked sent (including broker duplicates).
    pub sent: usize,
    /// Of those, dropped by the broker as duplicates.
    pub duplicates: usize,
    /// Refused, to be retried.
    pub refused: usize,
    /// Refused for the last time: now dead.
    pub dead: usize,
    /// Not answered: left pending, uncounted.
    pub unconfirmed: usize,
    /// Whether the marks committed (if not, every row taken stays pending
    /// and is published again).
    pub committed: bool,
}

impl BatchReport {
    /// How many messages ended each way, as the metrics label them. Marks
    /// that did not commit leave every row taken pending (`unmarked`).
    fn results(&self) -> [(&'static str, usize); 6] {
        let marked = |n: usize| if self.committed { n } else { 0 };
        [
            ("sent", marked(self.sent - self.duplicates)),
            ("duplicate", marked(self.duplicates)),
            ("refused", marked(self.refused)),
            ("dead", marked(self.dead)),
            ("unconfirmed", self.unconfirmed),
            ("unmarked", self.sent - marked(self.sent)),
        ]
    }
}

/// Counters of one relay since it was built; see [`Relay::stats`].
#[derive(Debug, Default)]
pub struct RelayStats {
    batches: AtomicU64,
    published: AtomicU64,
    duplicates: AtomicU64,
    refused: AtomicU64,
    dead: AtomicU64,
    unconfirmed: AtomicU64,
    lost_marks: AtomicU64,
    purged: AtomicU64,
}

impl RelayStats {
    /// Batches that took at least one row.
    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }
    /// Messages the broker confirmed and whose marks committed (duplicates included).
    pub fn published(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }
    /// Of those, dropped by the broker as duplicates of a message id it had.
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }
    /// Refusals (each counted as an attempt of its row).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
    /// Rows this relay marked dead.
    pub fn dead(&self) -> u64 {
        self.dead.load(Ordering::Relaxed)
    }
    /// Messages without an answer (left pending).
    pub fn unconfirmed(&self) -> u64 {
        self.unconfirmed.load(Ordering::Relaxed)
    }
    /// Confirmed messages whose marks did not commit: they go out again.
    pub fn lost_marks(&self) -> u64 {
        self.lost_marks.load(Ordering::Relaxed)
    }
    /// Sent rows this relay purged.
    pub fn purged(&self) -> u64 {
        self.purged.load(Ordering::Relaxed)
    }
}

type Hook = Arc<dyn Fn(&BatchReport) + Send + Sync>;

/// Publishes the outbox of one engine's database through a [`Publisher`];
/// see the [module docs](super) and the table above. Run one or several
/// (on several instances: PostgreSQL and MySQL/MariaDB hand each a
/// disjoint batch with `FOR UPDATE SKIP LOCKED`; on SQLite they take
/// turns, one batch at a time under the database's write lock).
#[must_use]
pub struct Relay<DB: Backend, P: Publisher> {
    engine: Idem<DB>,
    publisher: P,
    batch_size: u32,
    poll_interval: Duration,
    max_attempts: u32,
    retry_base: Duration,
    retry_max: Duration,
    retention: Duration,
    purge_interval: Duration,
    purge_batch: u32,
    on_batch: Option<Hook>,
    stats: Arc<RelayStats>,
}

impl<DB: Backend, P: Publisher> std::fmt::Debug for Relay<DB, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("batch_size", &self.batch_size)
            .field("poll_interval", &self.poll_interval)
            .field("max_attempts", &self.max_attempts)
            .field("retry_base", &self.retry_base)
            .field("retry_max", &self.retry_max)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend, P: Publisher> Relay<DB, P> {
    /// A relay for `engine`'s outbox through `publisher`. Calls of this
    /// engine that commit events wake it at once.
    pub fn new(engine: &Idem<DB>, publisher: P) -> Self {
        Relay {
            engine: engine.clone(),
            publisher,
            batch_size: 100,
            poll_interval: Duration::from_secs(1),
            max_attempts: 10,
            retry_base: Duration::from_millis(500),
            retry_max: Duration::from_secs(300),
            retention: Duration::from_secs(7 * 24 * 3600),
            purge_interval: Duration::from_secs(60),
            purge_batch: 1000,
            on_batch: None,
            stats: Arc::default(),
        }
    }

    /// Rows per batch (at least 1). Default 100.
    pub fn batch_size(mut self, n: u32) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// How long an idle relay waits before it looks again, unless a call
    /// of its engine commits events first: the bound on commit-to-publish
    /// latency for events committed by other instances. Default 1 s.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Refusals before a row is dead (at least 1). Default 10.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// The back-off after a refusal: `base × 2^(attempts − 1)`, at most
    /// `max`, drawn between half and all of it (jitter). The same schedule
    /// spaces the relay's own batches while the broker does not answer.
    /// Defaults 500 ms and 5 min.
    pub fn retry_backoff(mut self, base: Duration, max: Duration) -> Self {
        self.retry_base = base;
        self.retry_max = max.max(base);
        self
    }

    /// How long sent rows are kept before the relay purges them; aggregate
    /// rows (the locks that keep an aggregate's writers in commit order)
    /// are purged this long after they were created. Default 7 days.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// How often the relay purges sent rows and aggregate rows past the
    /// retention, and how many rows one purge statement deletes. Defaults
    /// 60 s and 1000.
    pub fn purge(mut self, every: Duration, batch: u32) -> Self {
        self.purge_interval = every;
        self.purge_batch = batch.max(1);
        self
    }

    /// Called after each batch that took rows (for logs, metrics, tests).
    pub fn on_batch(mut self, hook: impl Fn(&BatchReport) + Send + Sync + 'static) -> Self {
        self.on_batch = Some(Arc::new(hook));
        self
    }

    /// This relay's counters, live.
    pub fn stats(&self) -> Arc<RelayStats> {
        Arc::clone(&self.stats)
    }

    /// Relays until `shutdown` resolves. A batch in flight is finished
    /// first (its publisher's answers are bounded). Database failures are
    /// logged and retried after a back-off; nothing ends the relay but
    /// `shutdown`.
    pub async fn run<S: Future>(mut self, shutdown: S) {
        let mut shutdown = pin!(shutdown);
        let mut wake = self.engine.outbox_waker().subscribe();
        let mut trouble: u32 = 0;
        let mut next_purge = tokio::time::Instant::now();
        tracing::info!(batch_size = self.batch_size, "idem outbox relay started");
        loop {
            if stopped(shutdown.as_mut()) {
                break;
            }
            if tokio::time::Instant::now() >= next_purge {
                purge_sent(&self.engine, self.retention, self.purge_batch, &self.stats).await;
                next_purge = crate::clock::deadline_in(self.purge_interval);
            }
            // Seen before the batch: a commit after it wakes the wait below.
            wake.borrow_and_update();
            let pause = match self.batch().await {
                Ok(report) if report.unconfirmed > 0 => {
                    trouble = trouble.saturating_add(1);
                    Some(self.backoff(trouble))
                }
                Ok(report) => {
                    trouble = 0;
                    let full = report.taken >= self.batch_size as usize;
                    // A full batch: more may be waiting.
                    (!full).then_some(self.poll_interval)
                }
                Err(e) => {
                    trouble = trouble.saturating_add(1);
                    let pause = self.backoff(trouble);
                    tracing::warn!(error = %e, retry_in = ?pause, "idem outbox relay: database failed");
                    Some(pause)
                }
            };
            if let Some(pause) = pause {
                // While the broker is in trouble, a commit does not cut the pause short.
                let woken = if trouble == 0 { Some(&mut wake) } else { None };
                if idle(shutdown.as_mut(), pause, woken).await {
                    break;
                }
            }
        }
        tracing::info!("idem outbox relay stopped");
    }

    /// One batch: take, publish, mark, commit.
    async fn batch(&mut self) -> Result<BatchReport, sqlx::Error> {
        let db = self.engine.db();
        let now = self.engine.now_ms().await;
        // Whole even if the relay's future is dropped (`store/opening.rs`).
        let pool = db.pool.clone();
        let mut tx = crate::store::opening::whole(async move { DB::outbox_begin(&pool).await }).await?;
        let rows = DB::outbox_pick(db.pooling, &mut tx, now, i64::from(self.batch_size)).await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(BatchReport { committed: true, ..BatchReport::default() });
        }
        let ids: Vec<i64> = rows.iter().map(|row| row.0).collect();
        let messages: Vec<Message> = rows.into_iter().map(Message::from_row).collect();
        let mut confirms = self.publisher.publish(&messages).await;
        confirms.resize(messages.len(), Confirm::Unconfirmed("no answer from the publisher".into()));

        let mut report = BatchReport { taken: messages.len(), ..BatchReport::default() };
        let mut sent = Vec::with_capacity(messages.len());
        let now = self.engine.clock().now_ms();
        let mut failures = Vec::new();
        for ((id, message), confirm) in ids.iter().zip(&messages).zip(&confirms) {
            match confirm {
                Confirm::Sent { duplicate } => {
                    sent.push(*id);
                    report.duplicates += usize::from(*duplicate);
                }
                Confirm::Refused(reason) => {
                    let attempts = message.attempts.saturating_add(1);
                    let dead = u32::try_from(attempts).unwrap_or(u32::MAX) >= self.max_attempts;
                    let next = now.saturating_add(millis(self.backoff(attempts.unsigned_abs())));
                    failures.push((*id, if dead { DEAD } else { PENDING }, attempts, next, reason.as_str(), message));
                    if dead {
                        report.dead += 1;
                    } else {
                        report.refused += 1;
                    }
                }
                Confirm::Unconfirmed(_) => report.unconfirmed += 1,
            }
        }
        report.sent = sent.len();
        let marked = async {
            DB::outbox_mark_sent(db.pooling, &mut tx, &sent, now).await?;
            for (id, status, attempts, next, reason, _) in &failures {
                DB::outbox_mark_failed(db.pooling, &mut tx, *id, *status, *attempts, *next, reason).await?;
            }
            tx.commit().await
        }
        .await;
        report.committed = marked.is_ok();
        self.count(&report, &confirms);
        crate::metrics::outbox_batch(&report.results());
        for (_, status, attempts, _, reason, message) in &failures {
            if *status == DEAD && report.committed {
                tracing::error!(
                    message_id = message.id(),
                    destination = message.destination(),
                    attempts,
                    error = reason,
                    "idem outbox: event refused too many times; dead, left for an operator"
                );
            }
        }
        if let Some(Confirm::Unconfirmed(reason)) = confirms.iter().find(|c| matches!(c, Confirm::Unconfirmed(_))) {
            tracing::warn!(unconfirmed = report.unconfirmed, error = %reason, "idem outbox relay: broker did not answer");
        }
        if let Some(hook) = &self.on_batch {
            hook(&report);
        }
        marked.map(|()| report)
    }

    fn count(&self, report: &BatchReport, confirms: &[Confirm]) {
        let s = &self.stats;
        let add = |counter: &AtomicU64, n: usize| {
            counter.fetch_add(n as u64, Ordering::Relaxed);
        };
        add(&s.batches, 1);
        add(&s.unconfirmed, report.unconfirmed);
        if report.committed {
            add(&s.published, report.sent);
            add(&s.duplicates, report.duplicates);
            add(&s.refused, report.refused + report.dead);
            add(&s.dead, report.dead);
        } else {
            add(&s.lost_marks, confirms.iter().filter(|c| matches!(c, Confirm::Sent { .. })).count());
        }
    }

    fn backoff(&self, attempt: u32) -> Duration {
        backoff(self.retry_base, self.retry_max, attempt)
    }
}

/// Deletes sent rows past the retention, then aggregate rows created
/// before it, a batch at a time while full batches come back (bounded: a
/// backlog is finished by later purges).
async fn purge_sent<DB: Backend>(engine: &Idem<DB>, retention: Duration, batch: u32, stats: &RelayStats) {
    let outbox = engine.outbox();
    let sent = in_batches("sent events", batch, || outbox.purge_sent(retention, batch)).await;
    stats.purged.fetch_add(sent, Ordering::Relaxed);
    in_batches("aggregate rows", batch, || outbox.purge_aggregates(retention, batch)).await;
}

/// Runs `purge` up to ten times while it deletes full batches; the total.
async fn in_batches<F: Future<Output = Result<u64, crate::error::Error>>>(
    what: &str,
    batch: u32,
    mut purge: impl FnMut() -> F,
) -> u64 {
    let mut total = 0;
    for _ in 0..10 {
        match purge().await {
            Ok(n) => {
                total += n;
                if n < u64::from(batch) {
                    break;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, what, "idem outbox relay: purge failed");
                break;
            }
        }
    }
    total
}

/// `base × 2^(attempt − 1)`, at most `max`, drawn between half and all of it.
fn backoff(base: Duration, max: Duration, attempt: u32) -> Duration {
    let full = base.saturating_mul(1u32 << attempt.saturating_sub(1).min(20)).min(max);
    let half = full / 2;
    half + half.mul_f64(unit_random())
}

/// A number in `[0, 1)`, good enough for jitter.
fn unit_random() -> f64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(crate::clock::now_nanos());
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Whether `shutdown` has resolved, without waiting.
fn stopped<S: Future>(shutdown: Pin<&mut S>) -> bool {
    shutdown.poll(&mut Context::from_waker(std::task::Waker::noop())).is_ready()
}

/// Waits `pause`, or until woken (a commit of this engine queued events).
/// `true` once `shutdown` resolved.
async fn idle<S: Future>(mut shutdown: Pin<&mut S>, pause: Duration, wake: Option<&mut watch::Receiver<u64>>) -> bool {
    let mut sleep = pin!(tokio::time::sleep(pause));
    let mut woken = pin!(async move {
        // A closed channel (the engine is gone) never wakes anyone.
        let changed = match wake {
            Some(wake) => wake.changed().await.is_ok(),
            None => false,
        };
        if !changed {
            std::future::pending::<()>().await;
        }
    });
    poll_fn(|cx| {
        if shutdown.as_mut().poll(cx).is_ready() {
            return Poll::Ready(true);
        }
        if sleep.as_mut().poll(cx).is_ready() || woken.as_mut().poll(cx).is_ready() {
            return Poll::Ready(false);
        }
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_within_jitter_and_stops_at_max() {
        let base = Duration::from_millis(100);
        let max = Duration::from_secs(1);
        for attempt in 1..=8u32 {
            let full = (base * 2u32.pow(attempt - 1)).min(max);
            for _ in 0..100 {
                let d = backoff(base, max, attempt);
                assert!(d >= full / 2 && d <= full, "attempt {attempt}: {d:?} outside {:?}..={full:?}", full / 2);
            }
        }
        assert!(backoff(base, max, u32::MAX) <= max);
    }

    #[test]
    fn jitter_spreads() {
        let draws: std::collections::HashSet<u64> = (0..100).map(|_| (unit_random() * 1e6) as u64).collect();
        assert!(draws.len() > 90, "{}", draws.len());
    }
}
