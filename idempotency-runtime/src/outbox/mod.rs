//! The transactional outbox (feature `outbox`): an event that must leave
//! the service if and only if the body's writes commit. A body cannot
//! publish inside its transaction (the publish cannot roll back) nor after
//! it (a crash in between loses the event): it [`queue`]s the event into
//! the table `idem_outbox`, in its own transaction, and a [`Relay`] (feature
//! `amqp` for RabbitMQ, `nats` for NATS JetStream, `kafka` for Kafka) publishes it later and
//! marks it sent once the broker confirmed it.
//!
//! ```ignore
//! #[idempotent(key = "order_<order_id>_pay", ttl = "24h", biz = "pay")]
//! async fn pay(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, order_id: u64, amount: i64)
//!     -> Result<Receipt, PayError>
//! {
//!     sqlx::query("UPDATE orders SET status = 'PAID' WHERE id = ? AND status = 'PENDING'")
//!         .bind(order_id).execute(&mut **tx).await?;
//!     let paid = OrderPaid { order_id, amount };
//!     // Commits with the UPDATE and the record, or not at all.
//!     idempotency::outbox::queue(tx, Event::json("order.paid", &paid)?.aggregate(format!("order-{order_id}"))).await?;
//!     Ok(Receipt { order_id, amount })
//! }
//! ```
//!
//! **Message ids.** Each event queued inside an `#[idempotent]` call gets a
//! [`MessageId`] derived from the call: its `biz`, its key and the event's
//! position in the body (0 for the first `queue`, 1 for the next...). A
//! body that is rolled back and runs again queues the same ids, and a
//! consumer can deduplicate on them (the relays send the id as the AMQP
//! `message_id` and as `Nats-Msg-Id`). An id names one event: queueing an id
//! that is already in the table leaves the first row as it is (a key that
//! runs again after its record expired queues nothing new while the first
//! event's row is kept; the consumers' own records would take it for a
//! duplicate anyway). Outside a call, give the id yourself ([`Event::id`]).
//!
//! **Order.** Events of one [aggregate](Event::aggregate) are published in
//! the order their transactions committed, even when writers overlap.
//! Queueing an event with an aggregate first locks that aggregate's row
//! (table `idem_outbox_aggregate` on MySQL/MariaDB and PostgreSQL) until
//! the transaction ends: a second transaction queueing for the aggregate
//! waits in `queue` until the first commits or rolls back, so one
//! aggregate's `id`s rise in commit order (SQLite has one writer at a time
//! and needs no row). A relay takes a row only when no earlier row of its
//! aggregate is pending (even one another relay holds, or one waiting out
//! its back-off) or dead. So one aggregate's events go out one per batch,
//! and a dead row holds back the rest of its aggregate until an operator
//! retries or discards it. Events without an aggregate have no order among
//! themselves and take no lock. The messaging guide (`docs/messaging.md`,
//! "The outbox") gives the cost and what to mind: how long the lock is
//! held, several aggregates in one transaction.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::Transaction;

use crate::clock::{Clock, host_ms};
use crate::engine::Idem;
use crate::error::Error;
use crate::key::{validate_biz, validate_key};
use crate::store::Backend;
use crate::store::outbox::{DeadRow, NewEvent};

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "amqp")]
pub mod rabbit;
mod relay;

pub use relay::{BatchReport, Confirm, Message, Publisher, Relay, RelayStats};

/// Length of a [`MessageId`]: 32 lowercase hex digits (128 bits).
pub const MESSAGE_ID_LEN: usize = 32;

/// The id of one queued event: 32 lowercase hex digits, derived from the
/// call that queued it (or given), so a re-executed body queues the same.
/// It is valid as an idempotency key, so a consumer can key its own
/// `#[idempotent]` call by it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(String);

impl MessageId {
    /// The id of the event a call of `biz` with `key` queues at `position`
    /// in its body: the first 128 bits of SHA-256 over the three. The ids
    /// `queue` gives inside a call are these.
    pub fn derive(biz: &str, key: &str, position: u32) -> Result<Self, Error> {
        validate_biz(biz)?;
        validate_key(key)?;
        Ok(Self::hash(biz, key, position))
    }

    fn hash(biz: &str, key: &str, position: u32) -> Self {
        let mut h = Sha256::new();
        // Lengths first: no two (biz, key) pairs share an input.
        h.update(b"idem-outbox\0");
        h.update((biz.len() as u64).to_be_bytes());
        h.update(biz.as_bytes());
        h.update((key.len() as u64).to_be_bytes());
        h.update(key.as_bytes());
        h.update(position.to_be_bytes());
        let digest = h.finalize();
        let mut hex = String::with_capacity(MESSAGE_ID_LEN);
        for byte in &digest[..MESSAGE_ID_LEN / 2] {
            hex.push_str(&format!("{byte:02x}"));
        }
        MessageId(hex)
    }

    /// An id read back (from a message, a header or a row): `None` unless
    /// it is 32 lowercase hex digits.
    pub fn parse(text: &str) -> Option<Self> {
        let ok = text.len() == MESSAGE_ID_LEN && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        ok.then(|| MessageId(text.to_owned()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for MessageId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// An event to [`queue`]: where it goes, its JSON payload, headers, and
/// the aggregate it belongs to.
#[derive(Debug, Clone)]
#[must_use]
pub struct Event {
    destination: String,
    payload: String,
    headers: BTreeMap<String, String>,
    aggregate: Option<String>,
    id: Option<MessageId>,
}

impl Event {
    /// An event for `destination` (RabbitMQ: the routing key on the relay's
    /// exchange; NATS: the subject) carrying `payload` as JSON.
    /// `Err(Error::Serialize)` if the payload does not serialize.
    pub fn json(destination: impl Into<String>, payload: &impl Serialize) -> Result<Self, Error> {
        let payload = serde_json::to_string(payload).map_err(Error::Serialize)?;
        Ok(Self::raw(destination, payload))
    }

    /// An event whose payload is already JSON text (not checked).
    pub fn raw(destination: impl Into<String>, payload: impl Into<String>) -> Self {
        Event {
            destination: destination.into(),
            payload: payload.into(),
            headers: BTreeMap::new(),
            aggregate: None,
            id: None,
        }
    }

    /// Adds a header (an AMQP header; a NATS header). The names
    /// `Nats-Msg-Id` and `Nats-*` are the relay's own.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// The aggregate the event belongs to (say `order-42`): events of one
    /// aggregate are published in the order their transactions committed,
    /// and a transaction queueing for an aggregate waits for any other
    /// that queued for it and has not ended yet (see the
    /// [module docs](self)). At most 255 bytes.
    pub fn aggregate(mut self, aggregate: impl Into<String>) -> Self {
        self.aggregate = Some(aggregate.into());
        self
    }

    /// The event's id, in place of the one derived from the call: needed
    /// outside an `#[idempotent]` call.
    pub fn id(mut self, id: MessageId) -> Self {
        self.id = Some(id);
        self
    }
}

/// Longest destination and aggregate: their columns' width.
const MAX_NAME_LEN: usize = 255;

/// Queues `event` in `tx`, the body's transaction: it commits with the
/// body's writes and the record, or not at all. Returns its id.
///
/// Inside an `#[idempotent]` call the id is derived from the call (see the
/// [module docs](self)); elsewhere the event must carry one ([`Event::id`]),
/// else `Err(Error::InvalidKey(KeyError::Missing))`: there is no key to
/// derive it from. A destination or aggregate longer than 255 bytes, or
/// empty, is `Err(Error::InvalidKey(..))` too, and a NUL character in the
/// destination, the aggregate or the payload `Err(Error::InvalidText)`
/// (PostgreSQL's text refuses it), with nothing written. The database's
/// failure is `Err(Error::Storage)` when it passes (see [`Error`]).
///
/// An event with an aggregate first locks the aggregate's row until `tx`
/// ends (one more statement): while another open transaction holds it,
/// this call waits, bounded by the database's lock wait. Two transactions
/// that lock two aggregates in opposite orders deadlock, and the database
/// fails one (`Error::Storage`): queue one transaction's aggregates in a
/// fixed order.
pub async fn queue<DB: Backend>(tx: &mut Transaction<'_, DB>, event: Event) -> Result<MessageId, Error> {
    use crate::error::KeyError;
    let too_long = |s: &str| (s.is_empty() || s.len() > MAX_NAME_LEN).then_some(s.len());
    if let Some(len) = too_long(&event.destination).or_else(|| event.aggregate.as_deref().and_then(too_long)) {
        return Err(Error::InvalidKey(if len == 0 {
            KeyError::Missing
        } else {
            KeyError::TooLong { len, max: MAX_NAME_LEN }
        }));
    }
    crate::key::validate_text("destination", &event.destination)?;
    if let Some(aggregate) = &event.aggregate {
        crate::key::validate_text("aggregate", aggregate)?;
    }
    crate::key::validate_text("payload", &event.payload)?;
    let (id, call) = match (event.id, current_call()) {
        (Some(id), call) => (id, call),
        (None, Some(call)) => (MessageId::hash(call.biz, &call.key, call.position), Some(call)),
        (None, None) => return Err(Error::InvalidKey(KeyError::Missing)),
    };
    let headers = if event.headers.is_empty() {
        None
    } else {
        Some(serde_json::to_string(&event.headers).map_err(Error::Serialize)?)
    };
    let row = NewEvent {
        message_id: id.as_str(),
        destination: &event.destination,
        aggregate: event.aggregate.as_deref(),
        payload: &event.payload,
        headers: headers.as_deref(),
        biz: call.as_ref().map(|c| c.biz),
        key: call.as_ref().map(|c| c.key.as_str()),
        // The database's clock inside a call; outside one there is no
        // engine to read it through, and this host's stands in.
        now_ms: call.as_ref().map_or_else(host_ms, |c| c.clock.now_ms()),
    };
    DB::outbox_insert(crate::store::pooling::in_body(), &mut **tx, &row).await.map_err(Error::from_store)?;
    Ok(id)
}

/// The `#[idempotent]` call a body runs in, as `queue` sees it.
struct CallScope {
    biz: &'static str,
    key: String,
    next: Cell<u32>,
    clock: Arc<Clock>,
}

tokio::task_local! {
    static CALL: CallScope;
}

/// The running call and the position of the event about to be queued.
struct CurrentCall {
    biz: &'static str,
    key: String,
    position: u32,
    clock: Arc<Clock>,
}

fn current_call() -> Option<CurrentCall> {
    CALL.try_with(|scope| {
        let position = scope.next.get();
        scope.next.set(position.saturating_add(1));
        CurrentCall { biz: scope.biz, key: scope.key.clone(), position, clock: Arc::clone(&scope.clock) }
    })
    .ok()
}

/// Runs one execution of a call's body and record (`call::execute`) with
/// the call known to [`queue`]; once it committed having queued events,
/// wakes the engine's relays. Each execution counts positions from 0, so a
/// body that runs again queues the same ids.
pub(crate) async fn scope<DB: Backend, T, E>(
    engine: &Idem<DB>,
    biz: &'static str,
    key: &str,
    execution: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    scope_where(engine, biz, key, execution, Result::is_ok).await
}

/// [`scope`] for an execution whose output says by `committed` whether its
/// final transaction committed (the `steps` mode's).
pub(crate) async fn scope_where<DB: Backend, R>(
    engine: &Idem<DB>,
    biz: &'static str,
    key: &str,
    execution: impl Future<Output = R>,
    committed: impl FnOnce(&R) -> bool,
) -> R {
    let scope = CallScope { biz, key: key.to_owned(), next: Cell::new(0), clock: Arc::clone(engine.clock()) };
    let (result, queued) = CALL
        .scope(scope, async move {
            let result = execution.await;
            (result, CALL.with(|s| s.next.get()))
        })
        .await;
    if queued > 0 && committed(&result) {
        engine.outbox_waker().wake();
    }
    result
}

/// A dead event: refused by the broker [`Relay::max_attempts`] times, kept
/// for an operator ([`Outbox::dead`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadEvent {
    /// Its id.
    pub message_id: String,
    /// Where it was going.
    pub destination: String,
    /// Its aggregate, if any.
    pub aggregate: Option<String>,
    /// Its JSON payload.
    pub payload: String,
    /// Its headers as a JSON object, if any.
    pub headers: Option<String>,
    /// Attempts made.
    pub attempts: i32,
    /// When it was queued (Unix epoch ms).
    pub queued_at_ms: i64,
    /// The broker's last refusal.
    pub last_error: Option<String>,
    /// The `biz` of the call that queued it, if queued in one.
    pub biz: Option<String>,
    /// The key of the call that queued it, if queued in one.
    pub key: Option<String>,
}

impl From<DeadRow> for DeadEvent {
    fn from(row: DeadRow) -> Self {
        let (_, message_id, destination, aggregate, payload, headers, attempts, queued_at_ms, last_error, biz, key) =
            row;
        DeadEvent { message_id, destination, aggregate, payload, headers, attempts, queued_at_ms, last_error, biz, key }
    }
}

/// Rows of `idem_outbox` by status ([`Outbox::counts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Counts {
    /// Waiting for a relay (including those waiting out a back-off).
    pub pending: u64,
    /// Confirmed by the broker, not yet purged.
    pub sent: u64,
    /// Left for an operator.
    pub dead: u64,
}

/// The operator's side of the outbox: [`Idem::outbox`].
#[derive(Debug)]
pub struct Outbox<'e, DB: Backend> {
    engine: &'e Idem<DB>,
}

impl<DB: Backend> Idem<DB> {
    /// The outbox of this engine's database: dead events, retries, purges,
    /// counts. Queue events with [`queue`]; publish them with a [`Relay`].
    pub fn outbox(&self) -> Outbox<'_, DB> {
        Outbox { engine: self }
    }
}

impl<DB: Backend> Outbox<'_, DB> {
    /// Up to `limit` dead events, oldest first.
    pub async fn dead(&self, limit: u32) -> Result<Vec<DeadEvent>, Error> {
        let rows = DB::outbox_list_dead(self.engine.db(), i64::from(limit)).await.map_err(Error::from_store)?;
        Ok(rows.into_iter().map(DeadEvent::from).collect())
    }

    /// Puts a dead event back in line, its attempts reset: the relays take
    /// it at once (and the events of its aggregate queued after it, after
    /// it). `Ok(false)`: no dead event has that id.
    pub async fn retry_dead(&self, message_id: &str) -> Result<bool, Error> {
        let retried = DB::outbox_retry_dead(self.engine.db(), message_id, self.engine.now_ms().await)
            .await
            .map_err(Error::from_store)?;
        if retried {
            self.engine.outbox_waker().wake();
        }
        Ok(retried)
    }

    /// Deletes a dead event for good, never published: the events of its
    /// aggregate queued after it go on. `Ok(false)`: no dead event has that id.
    pub async fn discard_dead(&self, message_id: &str) -> Result<bool, Error> {
        let discarded = DB::outbox_discard_dead(self.engine.db(), message_id).await.map_err(Error::from_store)?;
        if discarded {
            self.engine.outbox_waker().wake();
        }
        Ok(discarded)
    }

    /// Deletes up to `limit` events sent at least `retention` ago; returns
    /// how many. Relays do this by themselves ([`Relay::retention`]).
    pub async fn purge_sent(&self, retention: Duration, limit: u32) -> Result<u64, Error> {
        let before =
            self.engine.now_ms().await.saturating_sub(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX));
        DB::outbox_purge_sent(self.engine.db(), before, i64::from(limit)).await.map_err(Error::from_store)
    }

    /// Deletes up to `limit` aggregate rows (the locks that keep one
    /// aggregate's writers in commit order) created at least `retention`
    /// ago; returns how many. Safe at any time: a writer holding a row
    /// keeps it until it ends, and the next writer creates it again. The
    /// relays call it with their sent-row purge.
    pub(crate) async fn purge_aggregates(&self, retention: Duration, limit: u32) -> Result<u64, Error> {
        let before =
            self.engine.now_ms().await.saturating_sub(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX));
        DB::outbox_purge_aggregates(self.engine.db(), before, i64::from(limit)).await.map_err(Error::from_store)
    }

    /// How many events are pending, sent (and not purged), and dead.
    pub async fn counts(&self) -> Result<Counts, Error> {
        let (pending, sent, dead) = DB::outbox_count(self.engine.db()).await.map_err(Error::from_store)?;
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(Counts { pending: n(pending), sent: n(sent), dead: n(dead) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_derived_from_biz_key_and_position() {
        let a = MessageId::derive("pay", "order_1_pay", 0).unwrap();
        assert_eq!(a, MessageId::derive("pay", "order_1_pay", 0).unwrap());
        assert_ne!(a, MessageId::derive("pay", "order_1_pay", 1).unwrap());
        assert_ne!(a, MessageId::derive("pay", "order_2_pay", 0).unwrap());
        assert_ne!(a, MessageId::derive("refund", "order_1_pay", 0).unwrap());
        // The length prefix keeps ("a", "b_c") and ("a_b", "c") apart.
        assert_ne!(MessageId::hash("a", "b_c", 0), MessageId::hash("a_b", "c", 0));
        assert_eq!(a.as_str().len(), MESSAGE_ID_LEN);
        assert_eq!(MessageId::parse(a.as_str()), Some(a.clone()));
        assert!(validate_key(a.as_str()).is_ok());
        // A fixed vector: ids must not change between releases, or a
        // re-executed body would queue new ones.
        assert_eq!(MessageId::hash("pay", "order_1_pay", 0).as_str(), PINNED);
    }

    const PINNED: &str = "ca9b0c4a8b3fe46d3795f6d8d2fbf076";

    #[test]
    fn parse_takes_only_ids() {
        assert!(MessageId::parse("").is_none());
        assert!(MessageId::parse(&"A".repeat(32)).is_none());
        assert!(MessageId::parse(&"a".repeat(31)).is_none());
        assert!(MessageId::parse(&"0".repeat(32)).is_some());
    }

    #[test]
    fn derive_checks_biz_and_key() {
        assert!(matches!(MessageId::derive("Pay", "k", 0), Err(Error::InvalidBiz)));
        assert!(matches!(MessageId::derive("pay", "a b", 0), Err(Error::InvalidKey(_))));
    }
}
