//! `idem doctor` (the built binary) against real servers, each check set up
//! wrong and set up right: databases of their own on MariaDB, PostgreSQL
//! and SQLite (no tables, an earlier version's record table, then
//! migrated; records expired days ago, then purged; outbox events dead and
//! stuck, then sent), a private PgBouncer in transaction mode, session
//! settings through PostgreSQL's URL options, a private one-node MariaDB
//! Galera whose globals the test sets, this host's clock moved by
//! libfaketime, private Redis servers started with an evicting policy and a
//! private Redis Cluster missing a slot, and cached results in Redis whose
//! records the database lacks. A server that does not answer skips its
//! test, unless `IDEM_REQUIRE_SERVICES=1`.

// The test's own output and seeding statements, not the tool's.
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idempotency_testkit::TestBackend;
use idempotency_testkit::backend::{MySql, Postgres, Sqlite};
use serde_json::Value;
use sqlx::AssertSqlSafe;
use sqlx::any::AnyPoolOptions;

const HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";
const DAY: i64 = 86_400_000;

fn now_ms() -> i64 {
    i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis()).unwrap()
}

/// `idem` with only the given variables of its own set.
fn idem(env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    for var in ["IDEM_DATABASE_URL", "IDEM_REDIS_URL", "IDEM_REDIS_NAMESPACE", "IDEM_TRANSACTION_POOLER"] {
        command.env_remove(var);
    }
    command.envs(env.iter().copied()).args(args).stdin(Stdio::null()).output().expect("the idem binary")
}

/// What one `idem doctor --json` said, and its exit code.
struct Report {
    code: i32,
    json: Value,
}

impl Report {
    fn check(&self, name: &str) -> Option<&Value> {
        self.json["checks"].as_array().unwrap().iter().find(|c| c["check"] == name)
    }

    /// The check's level, or `absent`.
    fn level(&self, name: &str) -> &str {
        self.check(name).map_or("absent", |c| c["level"].as_str().unwrap())
    }

    fn found(&self, name: &str) -> &str {
        self.check(name).map_or("", |c| c["found"].as_str().unwrap())
    }

    fn fix(&self, name: &str) -> &str {
        self.check(name).map_or("", |c| c["fix"].as_str().unwrap_or(""))
    }
}

impl std::fmt::Debug for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit {}: {:#}", self.code, self.json)
    }
}

fn doctor_with(program: Option<&[&str]>, env: &[(&str, &str)], args: &[&str]) -> Report {
    let mut all = vec!["doctor", "--json"];
    all.extend_from_slice(args);
    let out = match program {
        None => idem(env, &all),
        Some(wrapper) => {
            let mut command = Command::new(wrapper[0]);
            command.args(&wrapper[1..]).arg(env!("CARGO_BIN_EXE_idem")).args(&all);
            for var in ["IDEM_DATABASE_URL", "IDEM_REDIS_URL", "IDEM_REDIS_NAMESPACE", "IDEM_TRANSACTION_POOLER"] {
                command.env_remove(var);
            }
            command.envs(env.iter().copied()).stdin(Stdio::null()).output().expect("the wrapped idem binary")
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("{e}: {stdout} {}", String::from_utf8_lossy(&out.stderr)));
    Report { code: out.status.code().unwrap_or(-1), json }
}

/// `idem doctor --json` on the database at `url` (and Redis at `redis`).
fn doctor(url: &str, redis: Option<&str>, args: &[&str]) -> Report {
    let mut env = vec![("IDEM_DATABASE_URL", url)];
    env.extend(redis.map(|r| ("IDEM_REDIS_URL", r)));
    doctor_with(None, &env, args)
}

fn unique_name() -> String {
    idempotency_testkit::unique("idem_doctor").replace('-', "_")
}

fn url_with_database(url: &str, name: &str) -> String {
    let base = url.rsplit_once('/').map_or(url, |(base, _)| base);
    format!("{base}/{name}")
}

/// SQL for each database: a `key_digest` literal of the key's digest.
#[derive(Clone, Copy, PartialEq)]
enum Dialect {
    MySql,
    Postgres,
    Sqlite,
}

impl Dialect {
    fn digest(self, biz: &str, key: &str) -> String {
        let hex: String = idempotency_runtime::key::key_digest(biz, key).iter().map(|b| format!("{b:02x}")).collect();
        if self == Dialect::Postgres { format!("'{hex}'::uuid") } else { format!("X'{hex}'") }
    }

    /// A record of `biz`/`key` expiring at `expires` (epoch ms).
    fn record(self, biz: &str, key: &str, expires: i64) -> String {
        format!(
            "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, \
             updated_at, expires_at) VALUES ({}, '{biz}', '{key}', NULL, '{HASH}', 1, '{{}}', {c}, {c}, {expires})",
            self.digest(biz, key),
            c = expires - DAY,
        )
    }
}

async fn exec(url: &str, sql: &str) {
    sqlx::any::install_default_drivers();
    let pool = AnyPoolOptions::new().max_connections(1).connect(url).await.expect("seed connection");
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned())).execute(&pool).await.expect(sql);
    pool.close().await;
}

fn migrate(url: &str) {
    let out = idem(&[("IDEM_DATABASE_URL", url)], &["migrate"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The per-database checks, wrong then right, on a database of its own.
macro_rules! tables_and_backlogs {
    ($test:ident, $backend:ty, $dialect:expr, $url:expr) => {
        #[tokio::test]
        async fn $test() {
            type B = $backend;
            let name = unique_name();
            let Some(pool) = B::open_private(&name, 2).await else { return };
            let url: String = ($url)(&name);
            let d: Dialect = $dialect;

            // No tables: the engines never migrated it.
            let bare = doctor(&url, None, &[]);
            assert_eq!((bare.code, bare.level("tables")), (1, "failure"), "{bare:?}");
            assert_eq!(bare.found("tables"), "none of idem's tables (idem_record, idem_meta, idem_token)");
            assert!(bare.fix("tables").starts_with("run `idem migrate`"), "{bare:?}");
            assert_eq!(bare.level("expired_records"), "absent", "nothing to count");

            // An earlier version's record table.
            sqlx::raw_sql(B::RECORD_TABLE_BEFORE_DIGEST).execute(&pool).await.expect("earlier table");
            let stale = doctor(&url, None, &[]);
            assert_eq!((stale.code, stale.level("tables")), (1, "failure"), "{stale:?}");
            assert_eq!(
                stale.found("tables"),
                "idem_record is an earlier version's: no column key_digest, unique on (biz_type,idem_key)"
            );
            assert!(stale.fix("tables").starts_with("stop the earlier version's engines, then run `idem migrate`"));

            // Migrated (by `idem migrate`, then an engine with the outbox):
            // this version's tables.
            migrate(&url);
            let engine = idempotency_runtime::Idem::new(pool.clone());
            engine.migrate().await.expect("migrate with the outbox");
            let ns = engine.redis_namespace().await.expect("namespace").expect("recorded").as_str().to_owned();
            let right = doctor(&url, None, &[]);
            assert_eq!(right.level("tables"), "ok", "{right:?}");
            let aggregate = if d == Dialect::Sqlite { "" } else { "idem_outbox_aggregate, " };
            assert_eq!(
                right.found("tables"),
                format!(
                    "idem_record (unique on key_digest), idem_meta, idem_token: this version's; namespace {ns}; \
                     also idem_outbox, {aggregate}idem_call, idem_step"
                )
            );
            assert_eq!((right.level("expired_records"), right.found("expired_records")), ("ok", "none past its ttl"));
            assert_eq!((right.level("outbox"), right.found("outbox")), ("ok", "nothing pending, none dead"));

            // Records expired two days ago, no purge since: a backlog.
            let now = now_ms();
            for (i, expires) in [now - 2 * DAY - 3_600_000, now - 2 * DAY, now + DAY].into_iter().enumerate() {
                exec(&url, &d.record("doc", &format!("k{i}"), expires)).await;
            }
            let backlog = doctor(&url, None, &[]);
            assert_eq!(backlog.level("expired_records"), "warning", "{backlog:?}");
            assert!(
                backlog.found("expired_records").starts_with(
                    "2 records past their ttl not purged, the oldest expired 2 d ago (more than --purge-every 24 h): no \
                     purge runs"
                ),
                "{backlog:?}"
            );
            assert_eq!(backlog.code, 0, "a warning fails nothing");
            assert_eq!(doctor(&url, None, &["--strict"]).code, 1, "unless --strict");
            assert_eq!(doctor(&url, None, &["--purge-every", "3d"]).level("expired_records"), "ok");
            let purged = idem(&[("IDEM_DATABASE_URL", &url)], &["purge"]);
            assert!(purged.status.success());
            let recent = now_ms() - 60_000;
            exec(&url, &d.record("doc", "k9", recent)).await;
            let after = doctor(&url, None, &[]);
            assert_eq!(after.level("expired_records"), "ok", "{after:?}");
            assert!(after.found("expired_records").starts_with("1 record past their ttl, the oldest for "), "{after:?}");

            // Outbox events: pending for an hour, then one dead.
            let mut tx = pool.begin().await.unwrap();
            for n in 0..2 {
                let id = idempotency_runtime::outbox::MessageId::derive("doc", &name, n).unwrap();
                let event = idempotency_runtime::outbox::Event::json("doc.events", &n).unwrap().id(id);
                idempotency_runtime::outbox::queue(&mut tx, event).await.expect("queue");
            }
            tx.commit().await.unwrap();
            assert_eq!(doctor(&url, None, &[]).level("outbox"), "ok", "just queued");
            exec(&url, "UPDATE idem_outbox SET created_at = created_at - 3600000").await;
            let stuck = doctor(&url, None, &[]);
            assert_eq!(stuck.level("outbox"), "warning", "{stuck:?}");
            assert!(
                stuck.found("outbox").starts_with(
                    "2 events pending, the oldest queued 60 min ago (more than --outbox-stuck-after 10 min): no relay runs"
                ),
                "{stuck:?}"
            );
            exec(&url, "UPDATE idem_outbox SET status = 2 WHERE id = (SELECT MIN(id) FROM (SELECT id FROM idem_outbox) AS o)")
                .await;
            let dead = doctor(&url, None, &[]);
            assert_eq!((dead.code, dead.level("outbox")), (1, "failure"), "{dead:?}");
            assert!(dead.found("outbox").starts_with("1 event dead"), "{dead:?}");
            assert!(dead.found("outbox").ends_with("never sent; 1 pending"), "{dead:?}");
            exec(&url, "UPDATE idem_outbox SET status = 1, sent_at = created_at").await;
            assert_eq!(doctor(&url, None, &[]).found("outbox"), "nothing pending, none dead");

            B::drop_private(pool, &name).await;
        }
    };
}

tables_and_backlogs!(tables_and_backlogs_on_mariadb, MySql, Dialect::MySql, |name: &str| url_with_database(
    &idempotency_testkit::mysql_url(),
    name
));
tables_and_backlogs!(tables_and_backlogs_on_postgres, Postgres, Dialect::Postgres, |name: &str| url_with_database(
    &idempotency_testkit::pg_url(),
    name
));
tables_and_backlogs!(tables_and_backlogs_on_sqlite, Sqlite, Dialect::Sqlite, |name: &str| format!(
    "sqlite:{}",
    Sqlite::dir().join(format!("{name}.db")).display()
));

/// Whether libfaketime runs here (Debian's `faketime`).
fn faketime() -> bool {
    let runs = Command::new("faketime").args(["-f", "+0", "true"]).status().is_ok_and(|s| s.success());
    if !runs {
        assert!(!idempotency_testkit::services_required(), "faketime not installed and IDEM_REQUIRE_SERVICES=1");
        println!("skipped: faketime not installed");
    }
    runs
}

/// This host's clock ten minutes ahead (libfaketime): the database's is
/// behind it by as much; on time, within a second.
async fn clock(url: &str) {
    if !faketime() {
        return;
    }
    let on_time = doctor(url, None, &[]);
    assert_eq!(on_time.level("clock"), "ok", "{on_time:?}");
    assert!(on_time.found("clock").starts_with("the database's is within "), "{on_time:?}");
    let ahead = doctor_with(Some(&["faketime", "-f", "+10m"]), &[("IDEM_DATABASE_URL", url)], &[]);
    assert_eq!(ahead.level("clock"), "warning", "{ahead:?}");
    assert!(ahead.found("clock").starts_with("the database's clock is 10 min behind this host's: "), "{ahead:?}");
    assert_eq!(ahead.fix("clock"), "keep the database's servers and the hosts in NTP");
}

#[tokio::test]
async fn clock_against_this_hosts_on_mariadb() {
    if MySql::open("doctor", 1).await.is_none() {
        return;
    }
    clock(&idempotency_testkit::mysql_url()).await;
}

#[tokio::test]
async fn clock_against_this_hosts_on_postgres() {
    if Postgres::open("doctor", 1).await.is_none() {
        return;
    }
    clock(&idempotency_testkit::pg_url()).await;
}

/// A transaction pooler shows from the client: through a private PgBouncer
/// in transaction mode without the switch, a failure; with it, ok, and
/// every other check works through it too. Directly, ok without the switch
/// and a warning with it.
#[tokio::test]
async fn a_transaction_pooler_is_seen_from_the_client() {
    let name = unique_name();
    let Some(pool) = Postgres::open_private(&name, 1).await else { return };
    let Some(bouncer) = idempotency_testkit::pgbouncer::PgBouncer::start() else { return };
    let direct = url_with_database(&idempotency_testkit::pg_url(), &name);
    migrate(&direct);
    let pooled = bouncer.url(&name);

    let without = doctor(&pooled, None, &[]);
    assert_eq!((without.code, without.level("pooler")), (1, "failure"), "{without:?}");
    assert!(
        without.found("pooler").starts_with("a transaction pooler in front of PostgreSQL (this connection's server"),
        "{without:?}"
    );
    assert!(without.fix("pooler").starts_with("build the engines with Builder::transaction_pooler(true)"));
    let with = doctor(&pooled, None, &["--transaction-pooler"]);
    assert_eq!(with.level("pooler"), "ok", "{with:?}");
    assert!(with.found("pooler").starts_with("a transaction pooler, and --transaction-pooler says so"), "{with:?}");
    for check in ["database", "tables", "clock", "idle_in_transaction", "isolation", "expired_records"] {
        assert_eq!(with.level(check), "ok", "{check} through PgBouncer: {with:?}");
    }

    let plain = doctor(&direct, None, &[]);
    assert_eq!(
        (plain.level("pooler"), plain.found("pooler")),
        ("ok", "no transaction pooler: one server session across transactions")
    );
    let needless = doctor(&direct, None, &["--transaction-pooler"]);
    assert_eq!(needless.level("pooler"), "warning", "{needless:?}");
    assert!(needless.found("pooler").starts_with("--transaction-pooler is given, but this connection kept one server"));
    drop(bouncer);
    Postgres::drop_private(pool, &name).await;
}

/// `lock_timeout`, `idle_in_transaction_session_timeout` and the default
/// isolation level, set per session through the URL's options: wrong, then
/// right.
#[tokio::test]
async fn postgres_settings_against_the_lease() {
    if Postgres::open("doctor", 1).await.is_none() {
        return;
    }
    let base = idempotency_testkit::pg_url();
    let wrong = format!(
        "{base}?options[lock_timeout]=0&options[idle_in_transaction_session_timeout]=5000\
         &options[default_transaction_isolation]=serializable"
    );
    let bad = doctor(&wrong, None, &[]);
    assert_eq!(bad.level("lock_timeout"), "warning", "{bad:?}");
    assert!(bad.found("lock_timeout").starts_with("0 (no bound): a body blocked on a row lock may outlive"));
    assert_eq!(bad.level("idle_in_transaction"), "warning");
    assert!(bad.found("idle_in_transaction").starts_with(
        "idle_in_transaction_session_timeout 5 s is below the lease (--lease 30 s): a body waiting inside"
    ));
    assert_eq!(bad.level("isolation"), "warning");
    assert!(bad.found("isolation").starts_with("default_transaction_isolation serializable: "));
    assert_eq!(bad.code, 0, "warnings");

    let right = format!(
        "{base}?options[lock_timeout]=10000&options[idle_in_transaction_session_timeout]=0\
         &options[default_transaction_isolation]=read%20committed"
    );
    let good = doctor(&right, None, &[]);
    assert_eq!(
        good.found("lock_timeout"),
        "10 s: a body's lock wait ends within the lease (30 s; the engines bound their own)",
        "{good:?}"
    );
    assert_eq!(good.level("idle_in_transaction"), "ok");
    assert_eq!(good.found("isolation"), "default_transaction_isolation read committed");
    // The lease is the engines': a longer one makes 5 s fine, 10 s not.
    let longer = doctor(&right, None, &["--lease", "5s"]);
    assert_eq!(longer.level("lock_timeout"), "warning", "{longer:?}");
}

/// A private one-node MariaDB Galera started wrong (a packet below the
/// result bound, a lock wait past the lease, dirty reads, reads not waiting
/// for other nodes' commits), then desynced, then set right with `SET
/// GLOBAL`.
#[tokio::test]
async fn mariadb_settings_and_galera() {
    let settings = [
        "max_allowed_packet=1M",
        "innodb_lock_wait_timeout=50",
        "transaction-isolation=READ-UNCOMMITTED",
        "wsrep_sync_wait=0",
    ];
    let Some(server) =
        tokio::task::spawn_blocking(move || idempotency_testkit::mariadb::MariaDb::start(&settings, true))
            .await
            .unwrap()
    else {
        return;
    };
    let url = server.url();
    migrate(&url);

    let wrong = doctor(&url, None, &[]);
    assert_eq!(wrong.code, 1, "{wrong:?}");
    assert_eq!(wrong.level("max_allowed_packet"), "failure");
    assert!(wrong.found("max_allowed_packet").starts_with(
        "1 MiB, below the result bound (--max-result-bytes 1 MiB) and the rest of the row: a result between 1008 KiB \
         and 1 MiB passes"
    ));
    assert_eq!(wrong.level("innodb_lock_wait_timeout"), "warning");
    assert!(wrong.found("innodb_lock_wait_timeout").starts_with("50 s: a body blocked on a row lock may outlive"));
    assert_eq!(wrong.level("isolation"), "failure");
    assert!(wrong.found("isolation").starts_with("READ-UNCOMMITTED: a duplicate can read a record"));
    assert_eq!(
        (wrong.level("galera"), wrong.found("galera")),
        ("ok", "a Galera node: Synced, Primary component of 1 node")
    );
    assert_eq!(wrong.level("wsrep_sync_wait"), "warning");
    assert!(wrong.found("wsrep_sync_wait").starts_with("0 (as a new connection gets it): the loser"));
    // A smaller result bound fits the packet.
    assert_eq!(doctor(&url, None, &["--max-result-bytes", "500000"]).level("max_allowed_packet"), "ok");

    server.client("SET GLOBAL wsrep_desync = ON").expect("desync");
    let desynced = doctor(&url, None, &[]);
    assert_eq!(desynced.level("galera"), "failure", "{desynced:?}");
    assert!(desynced.found("galera").contains(": it does not serve writes now"), "{desynced:?}");

    server
        .client(
            "SET GLOBAL wsrep_desync = OFF; SET GLOBAL max_allowed_packet = 16777216; \
             SET GLOBAL innodb_lock_wait_timeout = 10; SET GLOBAL tx_isolation = 'REPEATABLE-READ'; \
             SET GLOBAL wsrep_sync_wait = 7",
        )
        .expect("set right");
    let right = doctor(&url, None, &[]);
    assert_eq!(right.code, 0, "{right:?}");
    for check in [
        "database",
        "tables",
        "clock",
        "max_allowed_packet",
        "innodb_lock_wait_timeout",
        "isolation",
        "galera",
        "wsrep_sync_wait",
    ] {
        assert_eq!(right.level(check), "ok", "{check}: {right:?}");
    }
    assert_eq!(right.found("isolation"), "REPEATABLE-READ");
    assert_eq!(right.found("wsrep_sync_wait"), "7: reads wait until this node applied what others committed");
}

/// A migrated SQLite file of its own, and its namespace.
async fn sqlite_migrated() -> (String, String, sqlx::SqlitePool) {
    let name = unique_name();
    let pool = Sqlite::open_private(&name, 2).await.expect("sqlite");
    let idem = idempotency_runtime::Idem::new(pool.clone());
    idem.migrate().await.expect("migrate");
    let ns = idem.redis_namespace().await.unwrap().unwrap().as_str().to_owned();
    (format!("sqlite:{}", Sqlite::dir().join(format!("{name}.db")).display()), ns, pool)
}

/// Private Redis servers: evicting once full is a failure, an evicting
/// policy without a limit a warning, `noeviction` ok.
#[tokio::test]
async fn redis_memory_policy() {
    let (url, _, _pool) = sqlite_migrated().await;
    let start = |args: &'static [&'static str]| {
        tokio::task::spawn_blocking(move || idempotency_testkit::servers::RedisServer::start_with(args))
    };
    let Some(lru) = start(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]).await.unwrap() else {
        return;
    };
    let evicting = doctor(&url, Some(&lru.url()), &[]);
    assert_eq!((evicting.code, evicting.level("redis_memory")), (1, "failure"), "{evicting:?}");
    assert!(evicting.found("redis_memory").starts_with(
        "maxmemory 64 MiB with maxmemory-policy allkeys-lru: once memory is full Redis evicts keys, a running call's \
         claim among them"
    ));
    assert_eq!(evicting.fix("redis_memory"), "CONFIG SET maxmemory-policy noeviction, and the same in redis.conf");
    assert_eq!(evicting.level("redis"), "ok");
    assert!(evicting.found("redis").starts_with("Redis "), "{evicting:?}");

    let unbounded = start(&["--maxmemory-policy", "volatile-lru"]).await.unwrap().unwrap();
    let later = doctor(&url, Some(&unbounded.url()), &[]);
    assert_eq!(later.level("redis_memory"), "warning", "{later:?}");
    assert!(later.found("redis_memory").starts_with("maxmemory 0 (no limit) with maxmemory-policy volatile-lru"));

    let noeviction = start(&["--maxmemory", "64mb", "--maxmemory-policy", "noeviction"]).await.unwrap().unwrap();
    let right = doctor(&url, Some(&noeviction.url()), &[]);
    assert_eq!(right.code, 0, "{right:?}");
    assert_eq!(
        right.found("redis_memory"),
        "maxmemory 64 MiB, maxmemory-policy noeviction: when full, writes fail and the engines go on with the database alone"
    );
}

/// Whether the namespace in Redis is the database's: on a private Redis,
/// nothing yet; only another namespace's keys; a cached result whose record
/// the database lacks (as after a restore from a backup); then the record.
#[tokio::test]
async fn redis_namespace_is_the_databases() {
    let (url, ns, _pool) = sqlite_migrated().await;
    let Some(redis) = tokio::task::spawn_blocking(idempotency_testkit::servers::RedisServer::start).await.unwrap()
    else {
        return;
    };
    let redis_url = redis.url();
    let empty = doctor(&url, Some(&redis_url), &[]);
    assert_eq!(
        (empty.level("redis_namespace"), empty.found("redis_namespace")),
        ("ok", format!("{ns} (the database's); Redis holds no key of idem now").as_str())
    );

    let mut conn = redis.client().get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("SET").arg("idem:{other_db.3}:pay:k1").arg("p:x:y").query_async(&mut conn).await.unwrap();
    let other = doctor(&url, Some(&redis_url), &[]);
    assert_eq!(other.level("redis_namespace"), "warning", "{other:?}");
    assert!(
        other
            .found("redis_namespace")
            .starts_with(&format!("no key of {ns} (the database's) among the keys sampled, which are of other_db:"))
    );

    // A cached result of this database's namespace, live, without its record.
    let at = idempotency_runtime::redis_layout::locate(&ns, "pay", "order_1").unwrap();
    let live = now_ms() + DAY;
    let value = idempotency_runtime::redis_layout::result_value(live, HASH, "{\"paid\":true}");
    let hash = format!("{}2945040", at.results_prefix);
    let _: () = redis::cmd("HSET").arg(&hash).arg(&at.field[..]).arg(value).query_async(&mut conn).await.unwrap();
    let restored = doctor(&url, Some(&redis_url), &[]);
    assert_eq!((restored.code, restored.level("redis_namespace")), (1, "failure"), "{restored:?}");
    assert!(restored.found("redis_namespace").starts_with(&format!(
        "1 of 1 cached results sampled in {ns} have no live record in the database: a database restored from a backup"
    )));
    assert!(restored.fix("redis_namespace").starts_with(&format!(
        "delete the namespace's keys (redis-cli --scan --pattern 'idem:{{{ns}.*' | xargs redis-cli del)"
    )));

    exec(&url, &Dialect::Sqlite.record("pay", "order_1", live)).await;
    let right = doctor(&url, Some(&redis_url), &[]);
    assert_eq!(right.code, 0, "{right:?}");
    assert_eq!(
        right.found("redis_namespace"),
        format!("{ns} (the database's): 1 cached results sampled, each with its live record")
    );

    let elsewhere = doctor_with(
        None,
        &[("IDEM_DATABASE_URL", &url), ("IDEM_REDIS_URL", &redis_url), ("IDEM_REDIS_NAMESPACE", "app_set")],
        &[],
    );
    assert_eq!(elsewhere.level("redis_namespace"), "warning", "{elsewhere:?}");
    assert!(
        elsewhere.found("redis_namespace").starts_with(&format!("--namespace app_set is not the database's ({ns})"))
    );
}

/// A private Redis Cluster from any node's URL: every slot served, then
/// one slot taken from its master.
#[tokio::test]
async fn redis_cluster_slot_coverage() {
    let (url, _, _pool) = sqlite_migrated().await;
    let Some(cluster) = tokio::task::spawn_blocking(idempotency_testkit::servers::RedisCluster::start).await.unwrap()
    else {
        return;
    };
    let seed = &cluster.urls()[1];
    let whole = doctor(&url, Some(seed), &[]);
    assert_eq!(whole.code, 0, "{whole:?}");
    assert_eq!(
        whole.found("redis_cluster"),
        "a Redis Cluster, every slot (16384) served by 3 masters: the engines need Builder::redis_cluster"
    );
    assert!(whole.found("redis").contains("(cluster, IDEM_REDIS_URL)"), "{whole:?}");
    assert!(whole.found("redis_memory").contains("noeviction on every master"), "{whole:?}");

    // Slot 0 taken from the master that serves it, which then sees the
    // cluster fail.
    let owner = (0..3)
        .find(|&i| {
            let nodes: String = cluster.query_node(i, redis::cmd("CLUSTER").arg("NODES")).unwrap();
            nodes.lines().any(|l| l.contains("myself") && l.split_whitespace().any(|s| s.starts_with("0-")))
        })
        .expect("the master of slot 0");
    let _: () = cluster.query_node(owner, redis::cmd("CLUSTER").arg("DELSLOTS").arg(0)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info: String = cluster.query_node(owner, redis::cmd("CLUSTER").arg("INFO")).unwrap();
        if info.contains("cluster_state:fail") {
            break;
        }
        assert!(Instant::now() < deadline, "the cluster never failed: {info}");
        tokio::task::yield_now().await;
    }
    let gap = doctor(&url, Some(&cluster.urls()[owner]), &[]);
    assert_eq!((gap.code, gap.level("redis_cluster")), (1, "failure"), "{gap:?}");
    assert!(
        gap.found("redis_cluster").starts_with(
            "a Redis Cluster, cluster_state fail: 16383 of 16384 slots assigned, 16383 served, by 3 masters"
        )
    );
}

/// Servers that do not answer are failed checks, said on one line each,
/// and the tool exits 1; the text report ends with the counts.
#[test]
fn unreachable_servers_are_failed_checks() {
    let out = idem(
        &[("IDEM_DATABASE_URL", "mysql://root@127.0.0.1:1/test"), ("IDEM_REDIS_URL", "redis://127.0.0.1:1")],
        &["doctor"],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert_eq!(lines.len(), 3, "{stdout}");
    assert_eq!(
        lines[0],
        "failure  database                 cannot connect (IDEM_DATABASE_URL): Connection refused (os error 111); fix: \
         check the URL and that the server runs: no call can run without its database"
    );
    assert!(lines[1].starts_with("failure  redis                    cannot connect (IDEM_REDIS_URL): "), "{stdout}");
    assert!(lines[1].ends_with(
        "; fix: check the URL and that Redis runs: meanwhile the engines go on with the database alone (every \
         guarantee holds, replays are slower)"
    ));
    assert_eq!(lines[2], "2 failures, 0 warnings, 0 ok");

    let usage = idem(&[("IDEM_DATABASE_URL", "sqlite::memory:")], &["doctor", "--lease", "10"]);
    assert_eq!(usage.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&usage.stderr).starts_with("idem: --lease: "), "{usage:?}");
}
