//! One cell's world: its database, fresh engines over it (each with the
//! cell's gate on a path of its own, and the cell's entry point), unique
//! keys, what a key left behind, and the sign that a duplicate waits.

use std::sync::Arc;
use std::time::Duration;

use idempotency::Idem;

use crate::backends::{Database, Rows, SQLITE_BUSY, Store};
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
}

impl<F: Store> Rig<F> {
    pub fn new(combo: Combo, db: Database<Db<F>>) -> Self {
        Rig { combo, db }
    }

    /// A fresh engine over the cell's database: a new instance, as at a
    /// start (the database is migrated already). `None` (after `skipped:
    /// ...`) when its Redis does not answer.
    pub async fn engine(&self) -> Option<Engine<F>> {
        let builder = F::builder(self.db.pool.clone(), self.db.pooler).lock_wait(LOCK_WAIT);
        let (builder, path) = gates::attach(self.combo.gate, builder).await?;
        let idem = builder.build();
        let entry = entries::entry::<F>(self.combo.entry, idem.clone(), self.combo.mode, self.combo.options).await;
        Some(Engine { idem, path, entry })
    }

    /// How long a duplicate without `wait` may wait for a running call
    /// before `InProgress`: not at all behind a Redis claim, else
    /// `lock_wait` (in memory, or on the unique index), and on SQLite's
    /// unique index its busy timeout.
    pub fn in_progress_bound(&self) -> Duration {
        match (self.combo.mode, self.combo.gate, self.combo.backend) {
            (Mode::Join, _, Backend::Sqlite) => SQLITE_BUSY,
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

    /// Until the duplicate following `dup` waits for the running call of
    /// `key` on `engine` (`asked`: the requests its Redis path carried
    /// before the duplicate started). What shows it:
    /// - `join` (any gate, none is asked): the caller's session waits on a
    ///   lock inside its insert into `idem_record`, as the server shows it;
    ///   SQLite shows no waiting writer, so there only its call pending
    ///   (a weaker sign: it may pend before its insert).
    /// - no Redis: the call pended, which it first does waiting in memory
    ///   for the running call (nothing before asks the database).
    /// - one Redis (with or without the local cache): Redis counts a
    ///   subscriber on the claim's channel.
    /// - a Redis Cluster, whose waiters ask the claim again at intervals:
    ///   the engine asked Redis three times since (the claim, and twice again).
    pub async fn until_waiting(&self, engine: &Engine<F>, key: &str, dup: &Script, asked: u64) {
        match (self.combo.mode, self.combo.gate) {
            (Mode::Join, _) if self.combo.backend == Backend::Sqlite => dup.until_pended().await,
            (Mode::Join, _) => {
                let session = dup.session().await;
                self.until_session_waits(session).await;
            }
            (_, Gate::NoRedis) => dup.until_pended().await,
            (_, Gate::Redis | Gate::LocalCache) => self.until_subscribed(engine, key).await,
            (_, Gate::Cluster) => engine.path.as_ref().expect("a path to the cluster").until_asked(asked + 3).await,
        }
    }

    async fn until_session_waits(&self, session: i64) {
        within("the duplicate's session waits on the record", async {
            while F::session_waits(&self.db.direct, session).await != Some(true) {
                tokio::time::sleep(VIEW_POLL).await;
            }
        })
        .await;
    }

    async fn until_subscribed(&self, engine: &Engine<F>, key: &str) {
        let namespace = engine.idem.redis_namespace().await.expect("the namespace").expect("migrated");
        let at = idempotency::redis_layout::locate(namespace.as_str(), self.biz(), &engine.entry.record_key(key))
            .expect("a namespace");
        let client = idempotency_testkit::redis_client().await.expect("redis");
        let mut conn = crate::gates::test_connection(&client).await;
        within("a subscriber on the claim's channel", async {
            loop {
                let counts: Vec<(String, i64)> =
                    redis::cmd("PUBSUB").arg("NUMSUB").arg(&at.claim).query_async(&mut conn).await.expect("NUMSUB");
                if counts.first().is_some_and(|(_, n)| *n > 0) {
                    return;
                }
                tokio::time::sleep(VIEW_POLL).await;
            }
        })
        .await;
    }
}
