//! One cell's world: its database, fresh engines over it (each with the
//! cell's gate on a path of its own, and the cell's entry point; another
//! instance with a pool of its own too), unique keys, what a key left
//! behind, and the sign that a duplicate waits.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idempotency::Idem;

use crate::backends::{Database, OwnPool, Rows, SQLITE_BUSY, Store};
use crate::entries::{self, EntryPoint};
use crate::fns::Db;
use crate::gates::{self, Path};
use crate::script::{Script, within};
use crate::table::{Backend, Combo, Gate, Mode};

/// How long a duplicate waits for a running call without `wait` (no
/// Redis: in memory or on the unique index): short, so a cell's clause 7
/// costs little, and whole seconds for MariaDB.
pub const LOCK_WAIT: Duration = Duration::from_secs(1);

/// A server's view is read this often while a clause waits for what it shows.
const VIEW_POLL: Duration = Duration::from_millis(5);

pub struct Rig<F: Store> {
    pub combo: Combo,
    db: Database<Db<F>>,
}

/// One engine (an instance), its way to Redis and the entry point over it.
pub struct Engine<F: Store> {
    pub idem: Idem<Db<F>>,
    pub path: Option<Path>,
    pub entry: Arc<dyn EntryPoint>,
    /// Its pool of its own ([`Rig::instance`]); `None`: the cell's pool.
    pub own: Option<OwnPool<Db<F>>>,
}

impl<F: Store> Engine<F> {
    /// What it asked Redis and its own pool so far: where a wait shows.
    pub fn asked(&self) -> Asked {
        Asked {
            redis: self.path.as_ref().map_or(0, Path::asked),
            database: self.own.as_ref().map_or(0, OwnPool::asked),
        }
    }

    /// Closes its pool of its own, if any.
    pub async fn close(&self) {
        if let Some(own) = &self.own {
            own.pool.close().await;
        }
    }
}

/// What an engine asked before a duplicate started on it.
#[derive(Debug, Clone, Copy)]
pub struct Asked {
    redis: u64,
    database: u64,
}

/// Where a duplicate comes: the running call's instance, or another one
/// (a gateway's retry that reaches another instance).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Same,
    Other,
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Place::Same => "on the same instance",
            Place::Other => "on another instance",
        })
    }
}

impl<F: Store> Rig<F> {
    pub fn new(combo: Combo, db: Database<Db<F>>) -> Self {
        Rig { combo, db }
    }

    /// A fresh engine over the cell's database: a new instance, as at a
    /// start (the database is migrated already). `None` (after `skipped:
    /// ...`) when its Redis does not answer.
    pub async fn engine(&self) -> Option<Engine<F>> {
        self.engine_over(self.db.pool.clone(), None).await
    }

    /// Another instance, as another process is: a fresh engine over a pool
    /// of its own (counted, its sessions known), on a path of its own to Redis.
    pub async fn instance(&self) -> Option<Engine<F>> {
        let own = F::own_pool(&self.db);
        self.engine_over(own.pool.clone(), Some(own)).await
    }

    async fn engine_over(&self, pool: sqlx::Pool<Db<F>>, own: Option<OwnPool<Db<F>>>) -> Option<Engine<F>> {
        let builder = F::builder(pool, self.db.pooler).lock_wait(LOCK_WAIT);
        let (builder, path) = gates::attach(self.combo.gate, builder).await?;
        let idem = builder.build();
        let entry = entries::entry::<F>(self.combo.entry, idem.clone(), self.combo.mode, self.combo.options).await;
        Some(Engine { idem, path, entry, own })
    }

    /// How long a duplicate without `wait` may wait for a running call
    /// before `InProgress`: not at all behind a Redis claim, else
    /// `lock_wait` (in memory, on the unique index, or asking phase one
    /// again in steps mode), and on SQLite, where a duplicate elsewhere
    /// waits for the write lock, at least its busy timeout.
    pub fn in_progress_bound(&self, place: Place) -> Duration {
        match (self.combo.mode, self.combo.gate, self.combo.backend) {
            (Mode::Join, _, Backend::Sqlite) => SQLITE_BUSY,
            (_, Gate::NoRedis, Backend::Sqlite) if place == Place::Other => SQLITE_BUSY,
            (Mode::Join, _, _) | (_, Gate::NoRedis, _) => LOCK_WAIT,
            _ => Duration::ZERO,
        }
    }

    /// A key no other clause or cell uses.
    pub fn key(&self, clause: &str) -> String {
        idempotency_testkit::unique(&format!("mx-{clause}"))
    }

    /// The fn's `biz`.
    pub fn biz(&self) -> &'static str {
        F::biz(self.combo.mode, self.combo.options)
    }

    /// The rows the calls of `key` left (`idem_record`'s, or `idem_call`'s in steps mode).
    pub async fn rows(&self, engine: &Engine<F>, key: &str) -> Rows {
        F::rows(&self.db.direct, self.combo.mode, self.biz(), &engine.entry.record_key(key)).await
    }

    /// How many bodies of `key` committed their ledger row.
    pub async fn ledger(&self, engine: &Engine<F>, key: &str) -> i64 {
        F::ledger(&self.db.direct, &engine.entry.record_key(key)).await
    }

    /// Until the duplicate following `dup` (`place`, on `engine`, which had
    /// asked `before` when it started; the `nth` waiting duplicate of `key`)
    /// waits for the running call. What shows it:
    /// - `join` (any gate, none is asked): the caller's session waits on a
    ///   lock inside its insert into `idem_record`, as the server shows it;
    ///   SQLite shows no waiting writer, so there only its call pending
    ///   (a weaker sign: it may pend before its insert).
    /// - no Redis, on the same instance: the call pended, which it first
    ///   does waiting in memory for the running call (nothing before asks
    ///   the database).
    /// - no Redis, on another instance: a session of its pool waits on the
    ///   record's unique index (plain), or it asked phase one three times
    ///   (steps: `idem_call`'s row is committed, nothing to wait on but the
    ///   next question); on SQLite it asked for the write lock again after
    ///   its busy timeout passed (plain and steps).
    /// - one Redis (with or without the local cache): Redis counts `nth`
    ///   subscribers on the claim's channel (one per engine).
    /// - a Redis Cluster, whose waiters ask the claim again at intervals:
    ///   the engine asked Redis three times since (the claim, and twice again).
    pub async fn until_waiting(
        &self,
        place: Place,
        engine: &Engine<F>,
        key: &str,
        dup: &Script,
        before: Asked,
        nth: i64,
    ) {
        match (self.combo.mode, self.combo.gate) {
            (Mode::Join, _) if self.combo.backend == Backend::Sqlite => dup.until_pended(place).await,
            (Mode::Join, _) => {
                let session = dup.session().await;
                self.until_session_waits(place, session).await;
            }
            (_, Gate::NoRedis) if place == Place::Same => dup.until_pended(place).await,
            (_, Gate::NoRedis) => self.until_instance_waits(engine, before).await,
            (_, Gate::Redis | Gate::LocalCache) => self.until_subscribed(place, engine, key, nth).await,
            (_, Gate::Cluster) => {
                let path = engine.path.as_ref().expect("a path to the cluster");
                path.until_asked(before.redis + 3, &format!("{place}: 3 requests to redis")).await;
            }
        }
    }

    /// Another instance without Redis waits (see [`until_waiting`](Self::until_waiting)).
    async fn until_instance_waits(&self, engine: &Engine<F>, before: Asked) {
        let own = engine.own.as_ref().expect("another instance has a pool of its own");
        match (self.combo.mode, self.combo.backend) {
            (_, Backend::Sqlite) => {
                own.until_asked(before.database + 2, "on another instance: the write lock asked for again").await;
            }
            (Mode::Plain, _) => {
                within("on another instance: its session waits on the record", async {
                    while F::own_session_waits(&self.db.direct, own).await != Some(true) {
                        tokio::time::sleep(VIEW_POLL).await;
                    }
                })
                .await;
            }
            (_, _) => own.until_asked(before.database + 6, "on another instance: phase one asked three times").await,
        }
    }

    async fn until_session_waits(&self, place: Place, session: i64) {
        within(&format!("{place}: the duplicate's session waits on the record"), async {
            while F::session_waits(&self.db.direct, session).await != Some(true) {
                tokio::time::sleep(VIEW_POLL).await;
            }
        })
        .await;
    }

    async fn until_subscribed(&self, place: Place, engine: &Engine<F>, key: &str, nth: i64) {
        let namespace = engine.idem.redis_namespace().await.expect("the namespace").expect("migrated");
        let at = idempotency::redis_layout::locate(namespace.as_str(), self.biz(), &engine.entry.record_key(key))
            .expect("a namespace");
        let client = idempotency_testkit::redis_client().await.expect("redis");
        let mut conn = crate::gates::test_connection(&client).await;
        within(&format!("{place}: {nth} subscribers on the claim's channel"), async {
            loop {
                let counts: Vec<(String, i64)> =
                    redis::cmd("PUBSUB").arg("NUMSUB").arg(&at.claim).query_async(&mut conn).await.expect("NUMSUB");
                if counts.first().is_some_and(|(_, n)| *n >= nth) {
                    return;
                }
                tokio::time::sleep(VIEW_POLL).await;
            }
        })
        .await;
    }
}
