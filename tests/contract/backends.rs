//! What differs per database for the matrix: where a cell's records live
//! (a SQLite file of its own; the shared MariaDB and PostgreSQL `test`
//! databases, migrated once per process; PostgreSQL through a private
//! PgBouncer started once per process), how an engine is built over it,
//! the reads the clauses check: the key's rows, the ledger, and whether a
//! session waits on a lock; and another instance's pool of its own, counted
//! ([`OwnPool`]).

use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::{Builder, Idem};
use idempotency_testkit::backend::{MySql, Postgres, Sqlite};
use idempotency_testkit::pgbouncer::PgBouncer;
use idempotency_testkit::{TestBackend, unique};
use sqlx::Pool;
use sqlx::pool::PoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use tokio::sync::{OnceCell, watch};

use crate::fns::{Calls, Db, MysqlFns, PostgresFns, SqliteFns};
use crate::table::{Backend, Mode};

/// Connections of a shared pool: two cells at once, each with a storm of
/// callers holding one.
const SHARED_POOL: u32 = 32;

/// A SQLite writer waits this long for another (`busy_timeout`): the bound
/// of a joined duplicate there, which neither `lock_wait` nor `wait` sets.
pub const SQLITE_BUSY: Duration = Duration::from_secs(3);

/// Connections of another instance's own pool: a duplicate holds one.
const OWN_POOL: u32 = 4;

/// Where a cell's records live.
pub struct Database<DB: sqlx::Database> {
    /// What the engines use (through PgBouncer for `pgbouncer`).
    pub pool: Pool<DB>,
    /// Straight to the server: what the checks and the views read.
    pub direct: Pool<DB>,
    /// The engine is told it is behind a transaction pooler.
    pub pooler: bool,
    _file: Option<SqliteFile>,
}

/// A key's rows: all of them, the finished ones, and what a finished one stores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rows {
    pub all: i64,
    pub finished: i64,
    pub stored: Option<String>,
}

/// Another instance's pool of its own over a cell's database (the way the
/// cell's engines reach it, through PgBouncer for `pgbouncer`): how many
/// times its engine asked the database (each connection it was handed
/// counts once: a statement on the pool, a transaction), and its sessions
/// as the server shows them.
pub struct OwnPool<DB: sqlx::Database> {
    pub pool: Pool<DB>,
    asked: watch::Sender<u64>,
    /// MariaDB: the ids of its connections.
    sessions: Arc<Mutex<Vec<i64>>>,
    /// PostgreSQL: the `application_name` its connections give (which
    /// PgBouncer passes on to the server connection a client is lent).
    name: String,
}

impl<DB: sqlx::Database> OwnPool<DB> {
    /// Options that count every connection handed out; `after_connect` is
    /// the backend's own (it counts a new connection).
    fn options(asked: &watch::Sender<u64>) -> PoolOptions<DB> {
        let asked = asked.clone();
        PoolOptions::new().max_connections(OWN_POOL).acquire_timeout(Duration::from_secs(60)).before_acquire(
            move |_, _| {
                asked.send_modify(|n| *n += 1);
                Box::pin(async { Ok(true) })
            },
        )
    }

    fn new(asked: watch::Sender<u64>, pool: Pool<DB>, sessions: Arc<Mutex<Vec<i64>>>, name: String) -> Self {
        OwnPool { pool, asked, sessions, name }
    }

    /// Connections handed out so far.
    pub fn asked(&self) -> u64 {
        *self.asked.borrow()
    }

    /// Until `count` connections were handed out in all.
    pub async fn until_asked(&self, count: u64, what: &str) {
        let mut asked = self.asked.subscribe();
        crate::script::within(what, asked.wait_for(|n| *n >= count)).await.expect("the pool's count");
    }
}

/// The database side of a backend's fns.
pub trait Store: Calls {
    /// The database a cell of `backend` uses; `None` (after `skipped: ...`)
    /// when its server does not answer.
    fn database(backend: Backend) -> impl Future<Output = Option<Database<Db<Self>>>> + Send;

    /// An engine's builder over `pool`.
    fn builder(pool: Pool<Db<Self>>, pooler: bool) -> Builder<Db<Self>>;

    /// The rows of `(biz, key)`: `idem_record`'s, or `idem_call`'s in steps mode.
    fn rows(pool: &Pool<Db<Self>>, mode: Mode, biz: &str, key: &str) -> impl Future<Output = Rows> + Send;

    /// The ledger rows of `key`: how many bodies of it committed.
    fn ledger(pool: &Pool<Db<Self>>, key: &str) -> impl Future<Output = i64> + Send;

    /// Whether session `id` waits on a lock inside a statement on
    /// `idem_record`; `None` where the database shows no sessions (SQLite).
    fn session_waits(pool: &Pool<Db<Self>>, id: i64) -> impl Future<Output = Option<bool>> + Send;

    /// Another instance's pool of its own over `database`.
    fn own_pool(database: &Database<Db<Self>>) -> OwnPool<Db<Self>>;

    /// Whether a session of `own` waits on a lock inside a statement on
    /// `idem_record`, as `direct` shows it; `None` where the database shows
    /// no sessions (SQLite).
    fn own_session_waits(direct: &Pool<Db<Self>>, own: &OwnPool<Db<Self>>)
    -> impl Future<Output = Option<bool>> + Send;
}

/// The own pool of a backend whose new connections need nothing more than counting.
macro_rules! counted_pool {
    ($options:expr) => {{
        let asked = watch::Sender::new(0);
        let counting = asked.clone();
        let pool = OwnPool::options(&asked)
            .after_connect(move |_, _| {
                counting.send_modify(|n| *n += 1);
                Box::pin(async { Ok(()) })
            })
            .connect_lazy_with($options);
        (asked, pool)
    }};
}

/// The reads of one backend, in its placeholders.
macro_rules! reads {
    ($record:literal, $call:literal, $waits:expr) => {
        async fn rows(pool: &Pool<Db<Self>>, mode: Mode, biz: &str, key: &str) -> Rows {
            let sql = if mode == Mode::Steps { $call } else { $record };
            let (all, finished, stored): (i64, i64, Option<String>) =
                sqlx::query_as(sql).bind(biz).bind(key).fetch_one(pool).await.expect("the key's rows");
            Rows { all, finished, stored }
        }

        async fn ledger(pool: &Pool<Db<Self>>, key: &str) -> i64 {
            let count = <<Self as Calls>::Backend as TestBackend>::COUNT_LEDGER;
            sqlx::query_scalar(count).bind(key).fetch_one(pool).await.expect("the ledger rows")
        }

        async fn session_waits(pool: &Pool<Db<Self>>, id: i64) -> Option<bool> {
            let sql: Option<&'static str> = $waits;
            let waiting: i64 = sqlx::query_scalar(sql?).bind(id).fetch_one(pool).await.expect("the session's wait");
            Some(waiting > 0)
        }
    };
}

impl Store for SqliteFns {
    async fn database(_: Backend) -> Option<Database<sqlx::Sqlite>> {
        let file = SqliteFile(Sqlite::dir().join(format!("{}.db", unique("matrix"))));
        let options = SqliteConnectOptions::new()
            .filename(&file.0)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(SQLITE_BUSY);
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(options)
            .await
            .expect("a sqlite file");
        migrate::<Self>(&pool).await;
        Some(Database { direct: pool.clone(), pool, pooler: false, _file: Some(file) })
    }

    fn builder(pool: Pool<sqlx::Sqlite>, _: bool) -> Builder<sqlx::Sqlite> {
        Idem::builder(pool)
    }

    reads!(
        "SELECT COUNT(*), COUNT(CASE WHEN status <> 0 THEN 1 END), MAX(CASE WHEN status <> 0 THEN response END) \
         FROM idem_record WHERE biz_type = ? AND idem_key = ?",
        "SELECT COUNT(*), COUNT(CASE WHEN status <> 0 THEN 1 END), MAX(CASE WHEN status <> 0 THEN response END) \
         FROM idem_call WHERE biz_type = ? AND idem_key = ?",
        None
    );

    /// The cell's file, as another process opens it (its busy timeout the same).
    fn own_pool(database: &Database<sqlx::Sqlite>) -> OwnPool<sqlx::Sqlite> {
        let (asked, pool) = counted_pool!((*database.pool.connect_options()).clone());
        OwnPool::new(asked, pool, Arc::default(), String::new())
    }

    async fn own_session_waits(_: &Pool<sqlx::Sqlite>, _: &OwnPool<sqlx::Sqlite>) -> Option<bool> {
        None
    }
}

impl Store for MysqlFns {
    async fn database(_: Backend) -> Option<Database<sqlx::MySql>> {
        static SHARED: OnceCell<Option<Pool<sqlx::MySql>>> = OnceCell::const_new();
        let pool = SHARED
            .get_or_init(|| async {
                let pool = MySql::open("matrix", SHARED_POOL).await?;
                migrate::<Self>(&pool).await;
                Some(pool)
            })
            .await
            .clone()?;
        Some(Database { direct: pool.clone(), pool, pooler: false, _file: None })
    }

    fn builder(pool: Pool<sqlx::MySql>, _: bool) -> Builder<sqlx::MySql> {
        Idem::builder(pool)
    }

    // By the unique digest: by `biz_type` and `idem_key` alone would scan
    // the shared table.
    reads!(
        "SELECT COUNT(*), COUNT(CASE WHEN status <> 0 THEN 1 END), MAX(CASE WHEN status <> 0 THEN response END) \
         FROM idem_record WHERE key_digest = UNHEX(LEFT(SHA2(CONCAT(?, CHAR(0), ?), 256), 32))",
        "SELECT COUNT(*), COUNT(CASE WHEN status <> 0 THEN 1 END), MAX(CASE WHEN status <> 0 THEN response END) \
         FROM idem_call WHERE biz_type = ? AND idem_key = ?",
        // MariaDB's lock-wait views leave some waiters out; the process
        // list shows the statement a session is still inside.
        Some(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
             WHERE ID = ? AND INFO LIKE '%INSERT INTO idem_record %' AND INFO NOT LIKE 'SELECT %'"
        )
    );

    /// Each new connection tells its id.
    fn own_pool(database: &Database<sqlx::MySql>) -> OwnPool<sqlx::MySql> {
        let (asked, sessions) = (watch::Sender::new(0), Arc::<Mutex<Vec<i64>>>::default());
        let (counting, noting) = (asked.clone(), Arc::clone(&sessions));
        let pool = OwnPool::options(&asked)
            .after_connect(move |conn, _| {
                counting.send_modify(|n| *n += 1);
                let noting = Arc::clone(&noting);
                Box::pin(async move {
                    let id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)").fetch_one(conn).await?;
                    noting.lock().unwrap().push(id);
                    Ok(())
                })
            })
            .connect_lazy_with((*database.pool.connect_options()).clone());
        OwnPool::new(asked, pool, sessions, String::new())
    }

    async fn own_session_waits(direct: &Pool<sqlx::MySql>, own: &OwnPool<sqlx::MySql>) -> Option<bool> {
        let sessions = own.sessions.lock().unwrap().clone();
        for id in sessions {
            if Self::session_waits(direct, id).await == Some(true) {
                return Some(true);
            }
        }
        Some(false)
    }
}

impl Store for PostgresFns {
    async fn database(backend: Backend) -> Option<Database<sqlx::Postgres>> {
        static SHARED: OnceCell<Option<Pool<sqlx::Postgres>>> = OnceCell::const_new();
        let direct = SHARED
            .get_or_init(|| async {
                let pool = Postgres::open("matrix", SHARED_POOL).await?;
                migrate::<Self>(&pool).await;
                Some(pool)
            })
            .await
            .clone()?;
        if backend != Backend::PgBouncer {
            return Some(Database { pool: direct.clone(), direct, pooler: false, _file: None });
        }
        let bounced = crate::processes::PGBOUNCER
            .get(async {
                // Fewer server connections than clients: they take turns.
                let bouncer = PgBouncer::start_with(16)?;
                let pool = PgPoolOptions::new()
                    .max_connections(SHARED_POOL)
                    .acquire_timeout(Duration::from_secs(60))
                    .connect_with(bouncer.options("test"))
                    .await
                    .expect("a pool through pgbouncer");
                Some((bouncer, pool))
            })
            .await?;
        Some(Database { pool: bounced.1.clone(), direct, pooler: true, _file: None })
    }

    fn builder(pool: Pool<sqlx::Postgres>, pooler: bool) -> Builder<sqlx::Postgres> {
        Idem::builder(pool).transaction_pooler(pooler)
    }

    reads!(
        "SELECT COUNT(*), COUNT(CASE WHEN status <> 0 THEN 1 END), MAX(CASE WHEN status <> 0 THEN response END) \
         FROM idem_record WHERE key_digest = encode(substring(sha256(convert_to($1, 'UTF8') || decode('00', 'hex') \
         || convert_to($2, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid",
        "SELECT COUNT(*), COUNT(CASE WHEN status <> 0 THEN 1 END), MAX(CASE WHEN status <> 0 THEN response END) \
         FROM idem_call WHERE biz_type = $1 AND idem_key = $2",
        Some("SELECT COUNT(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'")
    );

    /// Its connections named: behind PgBouncer a client's session is
    /// whichever server connection it is lent, which takes its name.
    fn own_pool(database: &Database<sqlx::Postgres>) -> OwnPool<sqlx::Postgres> {
        let name = unique("mx-instance");
        let options = (*database.pool.connect_options()).clone().application_name(&name);
        let (asked, pool) = counted_pool!(options);
        OwnPool::new(asked, pool, Arc::default(), name)
    }

    async fn own_session_waits(direct: &Pool<sqlx::Postgres>, own: &OwnPool<sqlx::Postgres>) -> Option<bool> {
        let sql = "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock' \
                   AND query LIKE '%INSERT INTO idem_record %'";
        let waiting: i64 =
            sqlx::query_scalar(sql).bind(&own.name).fetch_one(direct).await.expect("the sessions' waits");
        Some(waiting > 0)
    }
}

/// The engine's tables and the ledger, once per database.
async fn migrate<F: Store>(pool: &Pool<Db<F>>) {
    Idem::new(pool.clone()).migrate().await.expect("migrate");
    <F::Backend as TestBackend>::prepare(pool).await;
}

/// A cell's SQLite file, deleted with its journals when the cell ends.
struct SqliteFile(PathBuf);

impl Drop for SqliteFile {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut path = self.0.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }
}
