//! Redis Streams consumers (feature `redis-streams`, on the [`redis`]
//! client the claims use): a consumer group read with `XREADGROUP`, your
//! handler called once per entry, and the entry settled by what the handler
//! returned and the [`Outcome`](crate::Outcome) of the `#[idempotent]` call it made: the
//! same contract as the other runners, on the same core and builder
//! ([`crate::consumer`]).
//!
//! ```ignore
//! // Entries: XADD orders * message_id <id> payload <json>
//! idempotency::redis_streams::Consumer::new(redis_client, "orders", "stock")
//!     .consumer_name("stock-1")
//!     .max_deliver(4)
//!     .run_with_id(tokio::signal::ctrl_c(), move |message_id: String, event: OrderPaid| {
//!         let idem = idem.clone();
//!         // #[idempotent(key = "<message_id>", ...)]
//!         async move { deduct_stock(&idem, message_id, event).await }
//!     })
//!     .await
//! ```
//!
//! An entry carries its payload (JSON) in the field `payload` and, for
//! [`Consumer::run_with_id`], its message id in the field `message_id`
//! (both names can be changed). The message id is never the entry id: an
//! entry id is given per append, so a copy of one event published again (an
//! outbox relay that crashed before marking it sent) gets a new one, and a
//! call keyed by it would run again.
//!
//! How an entry is settled (a handler's `Err` is judged by the
//! [`idempotency::Error`](crate::Error) it carries, through [`AsIdemError`], else
//! by the outcome of its last `#[idempotent]` call):
//!
//! | what happened | settlement |
//! |---|---|
//! | the handler returned `Ok` (its call executed or replayed, or it dealt with the failure) | `XACK` |
//! | `Err` whose error carries no `idempotency::Error` while the handler's last call answered with a recorded business error (a `record_errors` fn's declared error, executed now or replayed); or `Err` carrying `Error::Permanent` (a `steps` call's recorded failure) | `XACK`, once ([`Action::AckRecorded`]): that error is the message's final answer, which a retry would only replay |
//! | `Err` carrying `Error::Storage` (the database failed or is down) | left pending, claimable again after [`Consumer::storage_delay`], its delivery count unchanged: not counted |
//! | `Err` carrying `Error::StorageRefused` or `Error::NotMigrated` (a database failure that recurs) | a counted retry while the budget allows, then the dead letter |
//! | `Err` carrying `Error::InProgress`, or outcome `InProgress` | left pending, claimable again after [`Consumer::in_progress_delay`], not counted |
//! | `Err` carrying `KeyReused`, `InvalidKey` or any other `idempotency::Error` but those two, or outcome `KeyReused`/`Rejected`; no `payload` field, or one that does not deserialize (or, for [`Consumer::run_with_id`], no UTF-8 `message_id` field) | a copy to the dead-letter stream and `XACK`, in one `MULTI` |
//! | any other `Err` (the body's own), or a panic | left pending, claimable again after [`Consumer::retry_delay`], until its delivery count reaches [`Consumer::max_deliver`]; then dead-lettered |
//! | the dead-letter copy or a settlement cannot be sent (Redis down) | left pending: claimed again once idle for [`Consumer::claim_idle`] |
//! | taken but not started when the runner stops | given back: claimable at once, not counted |
//!
//! Redis Streams has no delayed redelivery, so "left pending, claimable
//! again after a delay" is `XCLAIM <stream> <group> <me> 0 <id> IDLE
//! <claim_idle - delay> JUSTID`: the entry stays in the group's pending list,
//! idle as if delivered `claim_idle - delay` ago, so the next `XAUTOCLAIM`
//! of any consumer of the group (each runs one every
//! [`Consumer::claim_interval`]) takes it once `delay` has passed (a delay
//! longer than `claim_idle` waits `claim_idle`). Uncounted, the same call
//! sets `RETRYCOUNT <delivered - 1>`, which the claim brings back to what it
//! was. While it waits, the entry holds no slot of [`Consumer::concurrency`].
//!
//! The count is Redis's own: the times the pending list says the entry was
//! delivered (`XPENDING`). As on NATS, an entry taken over from a consumer
//! that died counts one more, so an entry that kills every consumer that
//! takes it is dead-lettered at [`Consumer::max_deliver`] instead of going
//! round forever.
//!
//! A consumer that dies (or hangs) leaves its entries pending: after
//! [`Consumer::claim_idle`] (default 30 s; keep it above the handler's
//! longest run) any other consumer of the group takes them with
//! `XAUTOCLAIM`, and the call replays what the dead one committed.
//!
//! The dead-letter stream (default `<stream>:dead`) gets the entry's fields
//! and `idem_dead_reason` ([`Reason::as_str`]), `idem_stream`,
//! `idem_entry_id`, `idem_delivered` and `idem_error` (the handler's error,
//! or why the payload was refused); the copy and the `XACK` go in one
//! `MULTI`, so neither happens without the other.
//!
//! The runner creates the group (`XGROUP CREATE <stream> <group> 0
//! MKSTREAM`; an existing one is kept), starting at the stream's first entry,
//! and again if it vanishes (a Redis restarted without persistence). Reads
//! are `XREADGROUP ... COUNT <free slots> BLOCK <at most 1 s> STREAMS
//! <stream> >`, on a connection of their own. A Redis that is unreachable is waited
//! out (50 ms, doubling up to 2 s between tries): no busy loop, and once it
//! answers the runner goes on; errors Redis answers to the commands
//! themselves (`WRONGTYPE`, `NOPERM`, `ERR`: not a stream, no rights, a
//! Redis older than 6.2) end it. One Redis, not a Redis Cluster.

mod reader;
pub(crate) mod reply;
pub(crate) mod settler;

use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManagerConfig;
use redis::{RedisError, RedisResult};

use self::reader::{MAX_BLOCK, ReadJob, Reader};
use self::reply::RawEntry;
use self::settler::Group;
use super::transport::{Start, Transport};
pub use super::{Action, AsIdemError, Reason};

/// The field an entry's payload is read from, unless [`Consumer::payload_field`] says otherwise.
pub const PAYLOAD_FIELD: &str = "payload";
/// The field an entry's message id is read from, unless [`Consumer::message_id_field`] says otherwise.
pub const MESSAGE_ID_FIELD: &str = "message_id";

/// The longest [`Consumer::claim_idle`] (see there).
const LONGEST_CLAIM_IDLE: Duration = Duration::from_secs(10 * 365 * 86_400);
/// On a dead-letter copy: why ([`Reason::as_str`]: `poison`, `key_reused`, ...).
pub const DEAD_REASON_FIELD: &str = "idem_dead_reason";
/// On a dead-letter copy: the stream the entry was in.
pub const DEAD_STREAM_FIELD: &str = "idem_stream";
/// On a dead-letter copy: the entry's id in that stream.
pub const DEAD_ENTRY_ID_FIELD: &str = "idem_entry_id";
/// On a dead-letter copy: how many times it was delivered.
pub const DEAD_DELIVERED_FIELD: &str = "idem_delivered";
/// On a dead-letter copy: the handler's error, or why the payload was refused.
pub const DEAD_ERROR_FIELD: &str = "idem_error";

/// What Redis tells of an entry ([`Settled::delivery`](crate::consumer::Settled::delivery)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Delivered {
    /// Redis's delivery count of the entry (1 on the first).
    pub count: u64,
    /// The entry's id in the stream.
    pub entry_id: String,
}

/// What the runner did with one entry; passed to [`Consumer::on_settle`].
pub type Settled = super::Settled<Delivered>;

/// The names one runner uses, shared by its reads and its settlements.
pub(crate) struct Names {
    pub(crate) stream: String,
    pub(crate) group: String,
    pub(crate) consumer: String,
    pub(crate) payload_field: String,
    pub(crate) message_id_field: String,
}

/// One delivered entry.
pub(crate) struct Entry {
    pub(crate) id: String,
    pub(crate) fields: Vec<(Vec<u8>, Vec<u8>)>,
    /// Times Redis delivered it, this delivery included.
    pub(crate) delivered: u64,
    /// Which field is the payload.
    payload_at: Option<usize>,
    pub(crate) message_id: Option<String>,
}

impl Entry {
    /// The entry with its payload and message id found by the runner's
    /// field names (the first field of each name; a message id that is not
    /// UTF-8 counts as none, never as a lossy copy that could merge two ids).
    fn new(raw: RawEntry, delivered: u64, names: &Names) -> Self {
        let find = |name: &str| raw.fields.iter().position(|(field, _)| field == name.as_bytes());
        let payload_at = find(&names.payload_field);
        let message_id = find(&names.message_id_field).and_then(|i| String::from_utf8(raw.fields[i].1.clone()).ok());
        Entry { id: raw.id, fields: raw.fields, delivered, payload_at, message_id }
    }

    fn payload(&self) -> Option<&[u8]> {
        self.payload_at.map(|i| self.fields[i].1.as_slice())
    }

    /// An entry read with the default field names, first delivered (for
    /// the fuzz targets' door, `crate::fuzz`).
    #[cfg(fuzzing)]
    pub(crate) fn with_default_names(raw: RawEntry) -> Self {
        let names = Names {
            stream: String::new(),
            group: String::new(),
            consumer: String::new(),
            payload_field: PAYLOAD_FIELD.to_owned(),
            message_id_field: MESSAGE_ID_FIELD.to_owned(),
        };
        Entry::new(raw, 1, &names)
    }
}

/// Consumes a Redis stream as one consumer of a consumer group, calling a
/// handler per entry and settling each by its outcome; see the
/// [module docs](self).
pub type Consumer = super::Consumer<Settings>;

/// What a Redis Streams runner reads from: a stream, a group, this
/// consumer's name in it, the field names, and how entries are taken over.
#[derive(Debug)]
pub struct Settings {
    client: redis::Client,
    stream: String,
    group: String,
    consumer_name: String,
    dead_letter_stream: String,
    payload_field: String,
    message_id_field: String,
    claim_idle: Duration,
    claim_interval: Duration,
}

impl Consumer {
    /// A runner for the group `group` of `stream` (created when absent),
    /// dead-lettering to `<stream>:dead`, under a consumer name of its own
    /// (`idem-` and 32 random hex digits; see [`consumer_name`](Self::consumer_name)).
    pub fn new(client: redis::Client, stream: impl Into<String>, group: impl Into<String>) -> Self {
        let stream = stream.into();
        let mut consumer_name = "idem-".to_owned();
        crate::random::push_token(&mut consumer_name);
        let settings = Settings {
            client,
            dead_letter_stream: format!("{stream}:dead"),
            stream,
            group: group.into(),
            consumer_name,
            payload_field: PAYLOAD_FIELD.to_owned(),
            message_id_field: MESSAGE_ID_FIELD.to_owned(),
            claim_idle: Duration::from_secs(30),
            claim_interval: Duration::from_secs(1),
        };
        super::Consumer::with(settings, 4)
    }

    /// This consumer's name in the group. Give each instance a stable one
    /// (say the host's name): a restarted instance under a new name leaves
    /// its old name in the group's consumer list (its pending entries are
    /// claimed by the others all the same).
    pub fn consumer_name(mut self, name: impl Into<String>) -> Self {
        self.transport.consumer_name = name.into();
        self
    }

    /// Where dead letters go. Default `<stream>:dead`.
    pub fn dead_letter_stream(mut self, stream: impl Into<String>) -> Self {
        self.transport.dead_letter_stream = stream.into();
        self
    }

    /// The field holding the payload. Default [`PAYLOAD_FIELD`].
    pub fn payload_field(mut self, field: impl Into<String>) -> Self {
        self.transport.payload_field = field.into();
        self
    }

    /// The field holding the message id ([`run_with_id`](Self::run_with_id)).
    /// Default [`MESSAGE_ID_FIELD`].
    pub fn message_id_field(mut self, field: impl Into<String>) -> Self {
        self.transport.message_id_field = field.into();
        self
    }

    /// At which delivery a failing entry is dead-lettered instead of left
    /// for another try (at least 1). Default 4: the first delivery and three more.
    pub fn max_deliver(mut self, n: u64) -> Self {
        self.policy.bound = n.max(1);
        self
    }

    /// How long an entry stays pending before any consumer of the group
    /// takes it over (`XAUTOCLAIM`'s min-idle-time): a consumer that died
    /// holds its entries this long. Default 30 s; keep it above the
    /// handler's longest run, and above the delays (a longer delay waits
    /// this long). At least 1 ms; at most ten years (`Duration::MAX`: an
    /// entry is never taken over): a delay is given as the entry's idle time,
    /// `claim_idle - delay`, which Redis counts back from now and resets to
    /// now before 1970.
    pub fn claim_idle(mut self, idle: Duration) -> Self {
        self.transport.claim_idle = idle.clamp(Duration::from_millis(1), LONGEST_CLAIM_IDLE);
        self
    }

    /// How often this consumer looks for entries to take over (and so how
    /// late, at most, a delayed entry comes back). Default 1 s.
    pub fn claim_interval(mut self, interval: Duration) -> Self {
        self.transport.claim_interval = crate::clock::bounded(interval.max(Duration::from_millis(1)));
        self
    }
}

impl Transport for Settings {
    type Error = RedisError;
    type Delivered = Delivered;
}

impl Start for Settings {
    type Settle = Group;
    type Deliveries = Reader;

    /// Connects (lazily) and starts reading.
    async fn start(self, _concurrency: usize) -> RedisResult<(Group, Reader)> {
        // Both connect lazily and reconnect by themselves; the reader's
        // answers may take the whole block time.
        let read_config = ConnectionManagerConfig::new().set_response_timeout(Some(MAX_BLOCK + Duration::from_secs(5)));
        let reads = self.client.get_connection_manager_lazy(read_config)?;
        let settlements = self.client.get_connection_manager_lazy(ConnectionManagerConfig::new())?;
        let names = Arc::new(Names {
            stream: self.stream,
            group: self.group,
            consumer: self.consumer_name,
            payload_field: self.payload_field,
            message_id_field: self.message_id_field,
        });
        tracing::info!(stream = %names.stream, group = %names.group, consumer = %names.consumer,
            "idem redis streams consumer started");
        let reader = Reader::new(ReadJob {
            conn: reads,
            names: Arc::clone(&names),
            claim_idle: self.claim_idle,
            claim_interval: self.claim_interval,
        });
        let group = Group {
            conn: settlements,
            names,
            dead_letter_stream: self.dead_letter_stream,
            claim_idle: self.claim_idle,
        };
        Ok((group, reader))
    }
}
