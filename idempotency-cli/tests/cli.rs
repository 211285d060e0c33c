//! The built `idem` binary against MariaDB, PostgreSQL and SQLite (and
//! Redis): records and business rows seeded with known mismatches, then the
//! exact output and exit code of every command, hostile table and column
//! names refused (and the tables left alone), names that need quoting used.
//! A server that does not answer skips its test, unless
//! `IDEM_REQUIRE_SERVICES=1`.

// The test's own output and seeding statements, not the tool's: the tool
// prints through `src/out.rs` and prepares statements in `src/store.rs` only.
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use idempotency_runtime::redis_layout::Location;
use serde_json::{Value, json};
use sqlx::any::AnyPoolOptions;
use sqlx::{AnyPool, AssertSqlSafe};

/// 2026-01-01T00:00:00Z.
const CREATED: i64 = 1_767_225_600_000;
/// 2026-01-02T00:00:00Z: long gone.
const EXPIRED: i64 = 1_767_312_000_000;
/// 2100-01-01T00:00:00Z.
const LIVE: i64 = 4_102_444_800_000;
const HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

#[derive(Clone, Copy, PartialEq)]
enum Db {
    MySql,
    Postgres,
    Sqlite,
}

struct Fixture {
    db: Db,
    url: String,
    pool: AnyPool,
    redis: Option<redis::Client>,
    namespace: String,
    biz: String,
    suffix: String,
    /// The database made for this fixture alone (MariaDB, PostgreSQL;
    /// SQLite's file always is), dropped by [`Fixture::finish`].
    private: Option<String>,
    /// The 10-minute window of Redis result hashes when the fixture began.
    window: u128,
}

fn unique() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() % 1_000_000_000;
    format!("{}_{nanos}_{}", std::process::id() % 100_000, N.fetch_add(1, Ordering::Relaxed))
}

fn unreachable(service: &str, e: impl std::fmt::Display) -> Option<Fixture> {
    assert!(std::env::var("IDEM_REQUIRE_SERVICES").map_or(true, |v| v != "1"), "{service} unreachable: {e}");
    println!("skipped: {service} unreachable ({e})");
    None
}

/// The server's URL (SQLite: a new file of its own).
fn server_url(db: Db) -> String {
    match db {
        Db::MySql => std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into()),
        Db::Postgres => {
            std::env::var("IDEM_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
        }
        Db::Sqlite => {
            let dir = std::env::temp_dir().join("idem-tests");
            std::fs::create_dir_all(&dir).unwrap();
            format!("sqlite:{}?mode=rwc", dir.join(format!("cli_{}.db", unique())).display())
        }
    }
}

/// `url` with its database replaced by `name`.
fn with_database(url: &str, name: &str) -> String {
    let base = url.rsplit_once('/').map_or(url, |(base, _)| base);
    format!("{base}/{name}")
}

impl Fixture {
    /// On the shared test database, migrated: records of a biz of its own.
    async fn new(db: Db) -> Option<Fixture> {
        Fixture::open(db, false, true).await
    }

    /// On a database of its own (whole-table outputs are exact there),
    /// migrated or without idem's tables.
    async fn private(db: Db, migrated: bool) -> Option<Fixture> {
        Fixture::open(db, true, migrated).await
    }

    async fn open(db: Db, private: bool, migrated: bool) -> Option<Fixture> {
        let mut url = server_url(db);
        sqlx::any::install_default_drivers();
        let private = match (private, db) {
            (true, Db::MySql | Db::Postgres) => {
                let admin = match AnyPoolOptions::new().max_connections(1).connect(&url).await {
                    Ok(pool) => pool,
                    Err(e) => return unreachable(&url, e),
                };
                let name = format!("idem_cli_{}", unique());
                sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&admin).await.unwrap();
                admin.close().await;
                url = with_database(&url, &name);
                Some(name)
            }
            _ => None,
        };
        let pool = match AnyPoolOptions::new().max_connections(2).connect(&url).await {
            Ok(pool) => pool,
            Err(e) => return unreachable(&url, e),
        };
        // The tables, as the engine creates them.
        if migrated {
            let done = match db {
                Db::MySql => {
                    idempotency_runtime::Idem::new(sqlx::MySqlPool::connect(&url).await.unwrap()).migrate().await
                }
                Db::Postgres => {
                    idempotency_runtime::Idem::new(sqlx::PgPool::connect(&url).await.unwrap()).migrate().await
                }
                Db::Sqlite => {
                    idempotency_runtime::Idem::new(sqlx::SqlitePool::connect(&url).await.unwrap()).migrate().await
                }
            };
            done.expect("migrate");
        }
        let redis_url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let redis = redis::Client::open(redis_url).ok();
        let redis = match &redis {
            Some(client) if client.get_multiplexed_async_connection().await.is_ok() => redis,
            _ => return unreachable("redis", "no connection"),
        };
        let suffix = unique();
        let (namespace, biz) = (format!("cli_{suffix}"), format!("cli_{suffix}"));
        let window = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() / 600_000;
        Some(Fixture { db, url, pool, redis, namespace, biz, suffix, private, window })
    }

    /// Drops the fixture's own database.
    async fn finish(self) {
        self.pool.close().await;
        let Some(name) = self.private else { return };
        let admin = AnyPoolOptions::new().max_connections(1).connect(&server_url(self.db)).await.unwrap();
        // A PgBouncer may still hold server connections to it.
        let force = if self.db == Db::Postgres { " WITH (FORCE)" } else { "" };
        sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE {name}{force}"))).execute(&admin).await.unwrap();
    }

    fn arg(&self, n: usize) -> String {
        if self.db == Db::Postgres { format!("${n}") } else { "?".into() }
    }

    /// The first placeholder as a `key_digest`, bound as 32 hex digits.
    fn digest_arg(&self) -> String {
        match self.db {
            Db::MySql => "UNHEX(?)".into(),
            Db::Postgres => "CAST($1 AS uuid)".into(),
            Db::Sqlite => "unhex(?)".into(),
        }
    }

    async fn exec(&self, sql: String) {
        sqlx::raw_sql(AssertSqlSafe(sql)).execute(&self.pool).await.expect("seed");
    }

    async fn record(&self, key: &str, biz_no: Option<&str>, status: i16, created: i64, expires: i64) -> i64 {
        let response = (status == 1).then(|| format!("{{\"key\":\"{key}\"}}"));
        self.row(&self.biz, key, biz_no, status, response.as_deref(), created, expires).await
    }

    /// A row of `idem_record` as given: what only a hand in the database
    /// writes too (a `biz` or key the engine would refuse).
    #[allow(clippy::too_many_arguments)]
    async fn row(
        &self,
        biz: &str,
        key: &str,
        biz_no: Option<&str>,
        status: i16,
        response: Option<&str>,
        created: i64,
        expires: i64,
    ) -> i64 {
        let a = |n| self.arg(n);
        let sql = format!(
            "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, updated_at, expires_at) \
             VALUES ({}, {}, {}, {}, {}, {}, {}, {}, {}, {})",
            self.digest_arg(),
            a(2),
            a(3),
            a(4),
            a(5),
            a(6),
            a(7),
            a(8),
            a(9),
            a(10)
        );
        let digest: String =
            idempotency_runtime::key::key_digest(biz, key).iter().map(|b| format!("{b:02x}")).collect();
        sqlx::query(AssertSqlSafe(sql))
            .bind(digest)
            .bind(biz)
            .bind(key)
            .bind(biz_no)
            .bind(HASH)
            .bind(status)
            .bind(response)
            .bind(created)
            .bind(created)
            .bind(expires)
            .execute(&self.pool)
            .await
            .expect("record");
        let sql = format!("SELECT id FROM idem_record WHERE biz_type = {} AND idem_key = {}", a(1), a(2));
        sqlx::query_scalar(AssertSqlSafe(sql)).bind(biz).bind(key).fetch_one(&self.pool).await.unwrap()
    }

    /// Where `key` lives in Redis, by the engine's own layout.
    fn location(&self, key: &str) -> Location {
        idempotency_runtime::redis_layout::locate(&self.namespace, &self.biz, key).unwrap()
    }

    /// The result hash a cached result of `key` is forged into: the window
    /// of the fixture's start, once (a window of the time of each call would
    /// name another hash across a 10-minute boundary; the tool finds any).
    fn results_hash(&self, key: &str) -> String {
        format!("{}{}", self.location(key).results_prefix, self.window)
    }

    /// Forges the cached result of `key`, as a finished call leaves it.
    async fn redis_cache(&self, key: &str, response: &str) {
        self.redis_cache_in(&self.results_hash(key), key, response).await;
    }

    /// Forges the cached result of `key` into the hash `hash`.
    async fn redis_cache_in(&self, hash: &str, key: &str, response: &str) {
        let mut conn = self.redis.as_ref().unwrap().get_multiplexed_async_connection().await.unwrap();
        let value = idempotency_runtime::redis_layout::result_value(LIVE, HASH, response);
        let _: () = redis::pipe()
            .cmd("HSET")
            .arg(hash)
            .arg(&self.location(key).field[..])
            .arg(value)
            .ignore()
            .cmd("PEXPIRE")
            .arg(hash)
            .arg(600_000)
            .ignore()
            .query_async(&mut conn)
            .await
            .unwrap();
    }

    /// Forges the claim of a running call on `key`.
    async fn redis_claim(&self, key: &str, value: &str) {
        let mut conn = self.redis.as_ref().unwrap().get_multiplexed_async_connection().await.unwrap();
        let _: () = redis::cmd("SET")
            .arg(self.location(key).claim)
            .arg(value)
            .arg("PX")
            .arg(600_000)
            .query_async(&mut conn)
            .await
            .unwrap();
    }

    /// Whether Redis holds the claim or the cached result of `key`.
    async fn redis_holds(&self, key: &str) -> bool {
        let mut conn = self.redis.as_ref().unwrap().get_multiplexed_async_connection().await.unwrap();
        let at = self.location(key);
        let claim: bool = redis::cmd("EXISTS").arg(&at.claim).query_async(&mut conn).await.unwrap();
        let cached: bool =
            redis::cmd("HEXISTS").arg(self.results_hash(key)).arg(&at.field[..]).query_async(&mut conn).await.unwrap();
        claim || cached
    }

    /// Runs `idem` with this fixture's database, Redis and namespace.
    fn idem(&self, args: &[&str], stdin: &str) -> Output {
        self.idem_at(&self.url, args, stdin)
    }

    /// Runs `idem` with the database at `url`.
    fn idem_at(&self, url: &str, args: &[&str], stdin: &str) -> Output {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(args)
            .env("IDEM_DATABASE_URL", url)
            .env("IDEM_REDIS_URL", std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into()))
            .env("IDEM_REDIS_NAMESPACE", &self.namespace)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the idem binary");
        child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
        child.wait_with_output().unwrap()
    }

    async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}"))).fetch_one(&self.pool).await.unwrap()
    }
}

fn out(o: &Output) -> (i32, String) {
    (o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stdout).into_owned())
}

fn out_json(o: &Output) -> (i32, Value) {
    let (code, stdout) = out(o);
    (code, serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout} {}", err(o))))
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

async fn every_command(db: Db) {
    let Some(f) = Fixture::new(db).await else { return };
    let b = f.biz.clone();
    let id1 = f.record("k1", Some("1"), 1, CREATED, LIVE).await;
    let id2 = f.record("k2", Some("2"), 1, CREATED + 1, LIVE).await;
    f.record("k3", Some("3"), 1, CREATED + 2, EXPIRED).await;
    let id4 = f.record("k4", Some("4"), 1, CREATED + 3, LIVE).await;
    let id6 = f.record("k6", Some("6"), 0, CREATED + 4, LIVE).await;
    f.redis_cache("k1", "{\"key\":\"k1\"}").await;
    f.redis_cache("k2", "{\"key\":\"k2\"}").await;
    f.redis_claim("k7", "p:token:fingerprint").await;

    // status
    assert_eq!(out(&f.idem(&["status", &b, "k1"], "")), (0, "completed {\"key\":\"k1\"}\n".into()));
    assert_eq!(out(&f.idem(&["status", &b, "k3"], "")), (0, "expired\n".into()));
    assert_eq!(out(&f.idem(&["status", &b, "nope"], "")), (0, "absent\n".into()));
    assert_eq!(out(&f.idem(&["status", &b, "k7"], "")), (0, "in_progress\n".into()), "seen through its claim");
    assert_eq!(
        out_json(&f.idem(&["status", &b, "k1", "--json"], "")),
        (0, json!({ "biz": b, "key": "k1", "status": "completed", "response": { "key": "k1" } }))
    );

    // show
    let k1 = json!({
        "id": id1, "biz": b, "key": "k1", "biz_no": "1", "state": "succeeded", "params_hash": HASH,
        "created_at": "2026-01-01T00:00:00.000Z", "updated_at": "2026-01-01T00:00:00.000Z",
        "expires_at": "2100-01-01T00:00:00.000Z", "expired": false, "response": { "key": "k1" },
    });
    let redis_k1 = json!({
        "key": f.location("k1").claim, "state": "cached", "in": [f.results_hash("k1")],
        "expires_at": "2100-01-01T00:00:00.000Z",
    });
    assert_eq!(out_json(&f.idem(&["show", &b, "k1", "--json"], "")), (0, json!({ "record": k1, "redis": redis_k1 })));
    let expected = format!(
        "record {b} k4\n  id          {id4}\n  state       succeeded\n  biz_no      4\n  params_hash {HASH}\n  \
         created_at  2026-01-01T00:00:00.003Z\n  updated_at  2026-01-01T00:00:00.003Z\n  \
         expires_at  2100-01-01T00:00:00.000Z\n  response    {{\"key\":\"k4\"}}\nredis {}\n  absent\n",
        f.location("k4").claim
    );
    assert_eq!(out(&f.idem(&["show", &b, "k4"], "")), (0, expected));
    let (code, shown) = out_json(&f.idem(&["show", &b, "k7", "--json"], ""));
    assert_eq!((code, &shown["record"], &shown["redis"]["state"]), (0, &Value::Null, &json!("claimed")));

    // list
    let (code, listed) = out_json(&f.idem(&["list", "--biz", &b, "--json"], ""));
    let keys: Vec<&str> = listed.as_array().unwrap().iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!((code, keys), (0, vec!["k1", "k2", "k3", "k4", "k6"]));
    let (_, processing) = out_json(&f.idem(&["list", "--biz", &b, "--state", "processing", "--json"], ""));
    assert_eq!(processing[0]["id"], json!(id6));
    assert_eq!(processing.as_array().unwrap().len(), 1);
    let (_, two) = out_json(&f.idem(&["list", "--biz", &b, "--older-than", "1d", "--limit", "2", "--json"], ""));
    assert_eq!(
        two.as_array().unwrap().iter().map(|r| r["id"].clone()).collect::<Vec<_>>(),
        vec![json!(id1), json!(id2)]
    );
    let (_, none) = out_json(&f.idem(&["list", "--biz", &b, "--older-than", "36500d", "--json"], ""));
    assert_eq!(none, json!([]));
    let table = "KEY  STATE       CREATED_AT                EXPIRES_AT                BIZ_NO\n\
                 k6   processing  2026-01-01T00:00:00.004Z  2100-01-01T00:00:00.000Z  6\n"
        .to_owned();
    assert_eq!(out(&f.idem(&["list", "--biz", &b, "--state", "processing"], "")), (0, table));

    // reconcile: order_no 1, 2, 3, 5, 6 and a NULL against biz_no 1, 2, 3, 4, 6 (6 stuck in processing)
    let pay = format!("cli_pay_{}", f.suffix);
    f.exec(format!("CREATE TABLE {pay} (id INTEGER PRIMARY KEY, order_no BIGINT NULL, ref VARCHAR(64) NULL)")).await;
    f.exec(format!(
        "INSERT INTO {pay} (id, order_no, ref) VALUES (1, 1, 'k1'), (2, 2, 'k2'), (3, 3, 'k3'), (4, 5, 'k4'), (5, 6, 'k6'), (6, NULL, NULL)"
    ))
    .await;
    let reconcile = |table: &str, column: &str, more: &[&str]| {
        let mut args = vec!["reconcile", "--biz", &b, "--table", table, "--column", column];
        args.extend_from_slice(more);
        f.idem(&args, "")
    };
    let found = reconcile(&pay, "order_no", &["--record-field", "biz_no", "--json"]);
    let brief = |key: &str, no: &str, state: &str, ms: u8| json!({ "key": key, "biz_no": no, "state": state, "created_at": format!("2026-01-01T00:00:00.00{ms}Z") });
    assert_eq!(
        out_json(&found),
        (
            1,
            json!({
                "biz": b, "table": pay, "column": "order_no", "record_field": "biz_no",
                "records_without_row": { "count": 1, "items": [brief("k4", "4", "succeeded", 3)] },
                "rows_without_record": { "count": 1, "items": ["5"] },
                "stuck_in_processing": { "count": 1, "items": [brief("k6", "6", "processing", 4)] },
                "found": 3,
            })
        )
    );
    let text = format!(
        "reconcile {b}: idem_record.biz_no against {pay}.order_no\n\
         records without a business row: 1\n  k4  biz_no=4  succeeded  created 2026-01-01T00:00:00.003Z\n\
         business rows without a record: 1\n  5\n\
         records stuck in processing: 1\n  k6  biz_no=6  processing  created 2026-01-01T00:00:00.004Z\n\
         3 found\n"
    );
    assert_eq!(out(&reconcile(&pay, "order_no", &["--record-field", "biz_no"])), (1, text));
    // By key, with processing allowed for 30 000 days: nothing found.
    let clean = reconcile(&pay, "ref", &["--stuck-after", "30000d"]);
    assert_eq!(out(&clean).0, 0, "{}", out(&clean).1);
    assert!(out(&clean).1.ends_with("nothing found\n"));

    // Hostile names are refused before anything runs, and the table stays.
    for (table, column) in [
        (format!("{pay}; DROP TABLE {pay}"), "order_no".to_owned()),
        (format!("{pay}\" --"), "order_no".into()),
        (format!("{pay}`"), "order_no".into()),
        (format!("{pay} WHERE 1=1"), "order_no".into()),
        ("".into(), "order_no".into()),
        ("1abc".into(), "order_no".into()),
        ("a.b.c".into(), "order_no".into()),
        ("caf\u{e9}".into(), "order_no".into()),
        ("a".repeat(65), "order_no".into()),
        (pay.clone(), "order_no) FROM x; --".into()),
        (pay.clone(), format!("{pay}.order_no")),
        (pay.clone(), "o'r".into()),
    ] {
        let refused = reconcile(&table, &column, &[]);
        assert_eq!(out(&refused), (2, String::new()), "{table:?} {column:?}");
        assert!(err(&refused).contains("is not a SQL identifier"), "{}", err(&refused));
    }
    assert_eq!(f.count(&pay).await, 6, "the table is intact");
    // A valid name the database does not know: a failure, exit 3.
    assert_eq!(out(&reconcile(&format!("{pay}_missing"), "order_no", &[])).0, 3);

    // Names that only work quoted.
    match db {
        Db::Sqlite => {
            f.exec("CREATE TABLE \"order\" (\"select\" TEXT)".into()).await;
            f.exec("INSERT INTO \"order\" VALUES ('k1'), ('k2'), ('k3'), ('k4'), ('k6')".into()).await;
            let quoted = reconcile("order", "select", &["--stuck-after", "30000d"]);
            assert_eq!(out(&quoted).0, 0, "{}", err(&quoted));
        }
        Db::Postgres => {
            let mixed = format!("CliPay_{}", f.suffix);
            f.exec(format!("CREATE TABLE \"{mixed}\" (\"Ref\" TEXT)")).await;
            f.exec(format!("INSERT INTO \"{mixed}\" VALUES ('k1'), ('k2'), ('k3'), ('k4')")).await;
            let (code, stdout) = out(&reconcile(&mixed, "Ref", &["--stuck-after", "30000d"]));
            assert_eq!(code, 1, "{stdout}");
            assert!(stdout.contains("records without a business row: 1\n  k6"), "{stdout}");
            f.exec(format!("DROP TABLE \"{mixed}\"")).await;
        }
        Db::MySql => {
            // Qualified by its database.
            let (code, stdout) = out(&reconcile(&format!("test.{pay}"), "ref", &["--stuck-after", "30000d"]));
            assert_eq!((code, stdout.ends_with("nothing found\n")), (0, true), "{stdout}");
        }
    }

    // forget: declined, then confirmed; the record and its Redis entry go.
    let declined = f.idem(&["forget", &b, "k2"], "n\n");
    assert_eq!(out(&declined), (1, String::new()));
    assert!(err(&declined).contains("forget? [y/N]"), "{}", err(&declined));
    assert!(err(&declined).contains("local replay cache may still answer it"), "{}", err(&declined));
    assert_eq!(out(&f.idem(&["status", &b, "k2"], "")).1, "completed {\"key\":\"k2\"}\n");
    let confirmed = f.idem(&["forget", &b, "k2"], "y\n");
    let removed = format!(
        "removed record {b} k2 (id {id2}, succeeded)\nremoved redis cached result of {} from {}\nnote: instances \
         with a local replay cache (Builder::local_cache) may answer the forgotten result until their \
         LocalCache::max_age has passed (10 s unless set); wait that long before relying on a new call executing\n",
        f.location("k2").claim,
        f.results_hash("k2")
    );
    assert_eq!(out(&confirmed), (0, removed));
    assert_eq!(out(&f.idem(&["status", &b, "k2"], "")).1, "absent\n");
    assert!(!f.redis_holds("k2").await);
    assert_eq!(out(&f.idem(&["forget", &b, "k2", "--yes"], "")), (0, format!("nothing to forget for {b} k2\n")));
    let (code, stdout) = out(&f.idem(&["forget", &b, "k1", "--yes"], ""));
    assert_eq!((code, stdout.lines().count()), (0, 3), "{stdout}");

    // purge (no `--expired` needed, still accepted): what is expired now,
    // then the three seeded expired. The shared database holds other tests'
    // records, whose purges may race this one: the whole output is asserted
    // on a database of its own (`purge_says_whose_records_it_deletes`).
    assert_eq!(out(&f.idem(&["purge"], "")).0, 0);
    for key in ["p1", "p2", "p3"] {
        f.record(key, None, 1, CREATED, EXPIRED).await;
    }
    let (code, purged) = out(&f.idem(&["purge", "--expired", "--batch", "2"], ""));
    assert_eq!(code, 0, "{purged}");
    assert!(purged.starts_with("expired records by biz:\n"), "{purged}");
    let (_, left) = out_json(&f.idem(&["list", "--biz", &b, "--json"], ""));
    let keys: Vec<&str> = left.as_array().unwrap().iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys, vec!["k4", "k6"]);

    // migrate: the tables are already this version's; what they hold stays.
    assert_eq!(out(&f.idem(&["migrate"], "")), (0, "migrated: the tables are this version's\n".into()));
    assert_eq!(out(&f.idem(&["status", &b, "k4"], "")), (0, "completed {\"key\":\"k4\"}\n".into()));

    // Usage errors exit 2; failures 3.
    assert_eq!(out(&f.idem(&["status", "Not-A-Biz", "k1"], "")).0, 2);
    assert_eq!(out(&f.idem(&["status", &b, "bad key"], "")).0, 2);
    assert_eq!(out(&f.idem(&["list", "--biz", &b, "--older-than", "ten"], "")).0, 2);
    f.exec(format!("DROP TABLE {pay}")).await;
    // A business table the database does not know is no hint to migrate.
    let missing = reconcile(&format!("{pay}_gone"), "order_no", &[]);
    assert_eq!(out(&missing).0, 3);
    assert!(!err(&missing).contains("idem migrate"), "{}", err(&missing));
    f.finish().await;
}

#[tokio::test]
async fn every_command_on_mariadb() {
    every_command(Db::MySql).await;
}

#[tokio::test]
async fn every_command_on_postgres() {
    every_command(Db::Postgres).await;
}

#[tokio::test]
async fn every_command_on_sqlite() {
    every_command(Db::Sqlite).await;
}

/// What `idem` says of a database without its tables (after the URL's source).
const NOT_MIGRATED: &str = "the database lacks idem's tables (idem_record, idem_meta): run `idem migrate` to create \
                            them, as an engine's Idem::migrate does at start-up (or check that the URL names the \
                            engines' database)";

/// Whether `text` holds a character a terminal must not get raw (a newline
/// ends a line and is allowed): the set `src/escape.rs` escapes, spelled
/// out again.
fn assert_safe(text: &str) {
    let raw = text.chars().find(|&c| {
        c != '\n'
            && (c.is_control()
                || matches!(c, '\u{61c}' | '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}' | '\u{2060}'..='\u{206f}'))
    });
    assert_eq!(raw, None, "a raw control or bidi character reached the terminal: {text:?}");
}

/// Issue 32.1 (the tool's part): behind PgBouncer in transaction mode, with
/// `--transaction-pooler`, every command on a database of its own, from
/// `migrate` on an empty one to `purge`, each answer asserted whole; the
/// read commands three times (each a new process whose statements meet
/// server connections earlier ones prepared on). The flag on another
/// database is a usage error.
#[tokio::test]
async fn every_command_behind_pgbouncer_with_the_flag() {
    let Some(f) = Fixture::private(Db::Postgres, false).await else { return };
    let Some(bouncer) = idempotency_testkit::pgbouncer::PgBouncer::start() else { return };
    let url = bouncer.url(f.private.as_deref().unwrap());
    let idem = |args: &[&str], stdin: &str| {
        let mut args = args.to_vec();
        args.push("--transaction-pooler");
        f.idem_at(&url, &args, stdin)
    };
    let b = f.biz.clone();

    // No tables yet: told to migrate; `migrate` makes them, twice is harmless.
    let bare = idem(&["list", "--biz", &b], "");
    assert_eq!((out(&bare), err(&bare)), ((3, String::new()), format!("idem: IDEM_DATABASE_URL: {NOT_MIGRATED}\n")));
    for _ in 0..2 {
        let migrated = idem(&["migrate"], "");
        assert_eq!(out(&migrated), (0, "migrated: the tables are this version's\n".into()), "{}", err(&migrated));
    }
    assert_eq!(f.count("idem_record").await, 0);
    assert_eq!(f.count("idem_meta").await, 1, "the namespace recorded");

    let id1 = f.record("k1", Some("1"), 1, CREATED, LIVE).await;
    let id2 = f.record("k2", Some("2"), 1, CREATED + 1, LIVE).await;
    f.record("k3", Some("3"), 1, CREATED + 2, EXPIRED).await;
    f.record("k6", Some("6"), 0, CREATED + 3, LIVE).await;
    let pay = format!("cli_pay_{}", f.suffix);
    f.exec(format!("CREATE TABLE {pay} (order_no BIGINT NULL)")).await;
    f.exec(format!("INSERT INTO {pay} (order_no) VALUES (1), (3), (5), (NULL)")).await;

    let shown = format!(
        "record {b} k1\n  id          {id1}\n  state       succeeded\n  biz_no      1\n  params_hash {HASH}\n  \
         created_at  2026-01-01T00:00:00.000Z\n  updated_at  2026-01-01T00:00:00.000Z\n  \
         expires_at  2100-01-01T00:00:00.000Z\n  response    {{\"key\":\"k1\"}}\nredis {}\n  absent\n",
        f.location("k1").claim
    );
    let listed = "KEY  STATE       CREATED_AT                EXPIRES_AT                BIZ_NO\n\
                  k1   succeeded   2026-01-01T00:00:00.000Z  2100-01-01T00:00:00.000Z  1\n\
                  k2   succeeded   2026-01-01T00:00:00.001Z  2100-01-01T00:00:00.000Z  2\n\
                  k3   succeeded   2026-01-01T00:00:00.002Z  2026-01-02T00:00:00.000Z  3\n\
                  k6   processing  2026-01-01T00:00:00.003Z  2100-01-01T00:00:00.000Z  6\n";
    let reconciled = format!(
        "reconcile {b}: idem_record.biz_no against {pay}.order_no\n\
         records without a business row: 2\n  k2  biz_no=2  succeeded  created 2026-01-01T00:00:00.001Z\n  \
         k6  biz_no=6  processing  created 2026-01-01T00:00:00.003Z\n\
         business rows without a record: 1\n  5\n\
         records stuck in processing: 1\n  k6  biz_no=6  processing  created 2026-01-01T00:00:00.003Z\n\
         4 found\n"
    );
    for _ in 0..3 {
        assert_eq!(out(&idem(&["status", &b, "k1"], "")), (0, "completed {\"key\":\"k1\"}\n".into()));
        assert_eq!(out(&idem(&["status", &b, "k3"], "")), (0, "expired\n".into()));
        assert_eq!(out(&idem(&["status", &b, "nope"], "")), (0, "absent\n".into()));
        assert_eq!(out(&idem(&["show", &b, "k1"], "")), (0, shown.clone()));
        let (code, json) = out_json(&idem(&["show", &b, "k1", "--json"], ""));
        assert_eq!((code, &json["record"]["id"], &json["redis"]["state"]), (0, &json!(id1), &json!("absent")));
        assert_eq!(out(&idem(&["list", "--biz", &b], "")), (0, listed.into()));
        let reconcile = ["reconcile", "--biz", &b, "--table", &pay, "--column", "order_no", "--record-field", "biz_no"];
        assert_eq!(out(&idem(&reconcile, "")), (1, reconciled.clone()));
    }
    let forgot = format!("removed record {b} k2 (id {id2}, succeeded)\n{LOCAL_CACHES}\n");
    assert_eq!(out(&idem(&["forget", &b, "k2", "--yes"], "")), (0, forgot));
    let purged = format!("expired records by biz:\n         1  {b}\npurged 1 expired record\n");
    assert_eq!(out(&idem(&["purge"], "")), (0, purged));
    assert_eq!(out(&idem(&["status", &b, "k3"], "")), (0, "absent\n".into()));
    let (_, left) = out_json(&idem(&["list", "--biz", &b, "--json"], ""));
    let keys: Vec<&str> = left.as_array().unwrap().iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["k1", "k6"]);

    let sqlite = f.idem_at("sqlite::memory:", &["status", &b, "k1", "--transaction-pooler"], "");
    assert_eq!(sqlite.status.code(), Some(2));
    assert!(err(&sqlite).contains("--transaction-pooler: for PostgreSQL only"), "{}", err(&sqlite));
    drop(bouncer);
    f.finish().await;
}

/// What `forget` prints last, once it removed something.
const LOCAL_CACHES: &str = "note: instances with a local replay cache (Builder::local_cache) may answer the \
                            forgotten result until their LocalCache::max_age has passed (10 s unless set); wait that \
                            long before relying on a new call executing";

/// A `biz_no` a request wrote: a newline (a forged row), an erase-line,
/// OSC 52 (the clipboard), C1 CSI, DEL, a right-to-left override, a
/// left-to-right isolate and a backslash.
const BIZ_NO: &str = "7\n\u{1b}[2K\u{1b}]52;c;aGk=\u{7}\u{9b}\u{7f}\u{202e}\u{2066}\\";
/// It shown: as Rust writes it in a string, the backslash doubled.
const BIZ_NO_SHOWN: &str = r"7\n\u{1b}[2K\u{1b}]52;c;aGk=\u{7}\u{9b}\u{7f}\u{202e}\u{2066}\\";
/// A stored response holding it: serde_json escapes C0 and the backslash
/// and leaves DEL, C1 and bidi controls raw, which the tool escapes as JSON.
const RESPONSE_SHOWN: &str = r#"{"note":"7\n\u001b[2K\u001b]52;c;aGk=\u0007\u009b\u007f\u202e\u2066\\"}"#;
/// A key and a biz only a hand in the database writes (the engine refuses
/// them), and how they show. MariaDB keeps both columns in ASCII.
fn hand_written(db: Db) -> [(&'static str, &'static str); 2] {
    if db == Db::MySql {
        [("k8\u{1b}[2K\u{7f}\r", r"k8\u{1b}[2K\u{7f}\r"), ("p\u{1b}[2K\u{7f}x", r"p\u{1b}[2K\u{7f}x")]
    } else {
        [
            ("k8\u{1b}[2K\u{202e}\u{200f}", r"k8\u{1b}[2K\u{202e}\u{200f}"),
            ("p\u{1b}[2K\u{202e}x", r"p\u{1b}[2K\u{202e}x"),
        ]
    }
}
const OTHER_NO: &str = "8\u{1b}]52;c;aGk=\u{7}\u{61c}";
const OTHER_NO_SHOWN: &str = r"8\u{1b}]52;c;aGk=\u{7}\u{61c}";
/// A business column's value.
const ROW: &str = "5\n9  forged\u{1b}[2K\u{9b}\u{2069}";
const ROW_SHOWN: &str = r"5\n9  forged\u{1b}[2K\u{9b}\u{2069}";

/// The database of the escaping tests (issue 32.6), on a database of its
/// own: text from requests (a `biz_no`, a stored response, a business
/// column's value) and what only a hand in the database or Redis writes (a
/// key, a `biz`, a result hash's name), holding newlines, erase and
/// clipboard sequences, C1, DEL and bidi controls. Each command's test
/// asserts its whole output, escaped, and that nothing raw reached the
/// terminal; `--json` stays JSON with the same values and no such
/// character either.
struct Hostile {
    f: Fixture,
    /// The call `k7`: `biz_no` [`BIZ_NO`], its response holding it too.
    id7: i64,
    /// A record in processing under a hand-written key, `biz_no` [`OTHER_NO`].
    key: &'static str,
    key_shown: &'static str,
    evil_biz: &'static str,
    evil_biz_shown: &'static str,
    /// The result hash k7's cached result was forged into, and as shown.
    hash: String,
    hash_shown: String,
}

impl Hostile {
    async fn new(db: Db) -> Option<Hostile> {
        let f = Fixture::private(db, true).await?;
        let b = f.biz.clone();
        let [(key, key_shown), (evil_biz, evil_biz_shown)] = hand_written(db);
        let response = serde_json::to_string(&json!({ "note": BIZ_NO })).unwrap();
        let id7 = f.row(&b, "k7", Some(BIZ_NO), 1, Some(&response), CREATED, LIVE).await;
        f.row(&b, key, Some(OTHER_NO), 0, None, CREATED + 1, LIVE).await;
        // In a result hash whose name a hand forged with the shard's prefix
        // (what `SCAN` finds).
        let prefix = f.location("k7").results_prefix;
        let hash = format!("{prefix}9\u{1b}[2K\n\u{202e}");
        let hash_shown = format!(r"{prefix}9\u{{1b}}[2K\n\u{{202e}}");
        f.redis_cache_in(&hash, "k7", &response).await;
        Some(Hostile { f, id7, key, key_shown, evil_biz, evil_biz_shown, hash, hash_shown })
    }

    /// Runs `idem`; asserts nothing raw reached the terminal.
    fn idem(&self, args: &[&str], stdin: &str) -> Output {
        let o = self.f.idem(args, stdin);
        assert_safe(&String::from_utf8_lossy(&o.stdout));
        assert_safe(&err(&o));
        o
    }
}

/// Runs the test `$check` (an async fn of a [`Hostile`]) on each database.
macro_rules! escaping_test {
    ($(#[$doc:meta])* $name:ident, $check:ident) => {
        $(#[$doc])*
        #[tokio::test]
        async fn $name() {
            for db in [Db::MySql, Db::Postgres, Db::Sqlite] {
                let Some(h) = Hostile::new(db).await else { continue };
                $check(&h).await;
                h.f.finish().await;
            }
        }
    };
}

async fn status_escaped(h: &Hostile) {
    let b = &h.f.biz;
    assert_eq!(out(&h.idem(&["status", b, "k7"], "")), (0, format!("completed {RESPONSE_SHOWN}\n")));
    let (_, status) = out_json(&h.idem(&["status", b, "k7", "--json"], ""));
    assert_eq!(status["response"], json!({ "note": BIZ_NO }));
}

escaping_test!(
    /// Issue 32.6: `status` shows a stored response with its raw controls as JSON escapes.
    status_escapes_the_stored_response,
    status_escaped
);

async fn show_escaped(h: &Hostile) {
    let (b, id7, hash_shown) = (&h.f.biz, h.id7, &h.hash_shown);
    let claim = h.f.location("k7").claim;
    let shown = format!(
        "record {b} k7\n  id          {id7}\n  state       succeeded\n  biz_no      {BIZ_NO_SHOWN}\n  params_hash {HASH}\n  \
         created_at  2026-01-01T00:00:00.000Z\n  updated_at  2026-01-01T00:00:00.000Z\n  \
         expires_at  2100-01-01T00:00:00.000Z\n  response    {RESPONSE_SHOWN}\nredis {claim}\n  \
         cached result until 2100-01-01T00:00:00.000Z (in {hash_shown})\n"
    );
    assert_eq!(out(&h.idem(&["show", b, "k7"], "")), (0, shown));
    let (_, json) = out_json(&h.idem(&["show", b, "k7", "--json"], ""));
    assert_eq!((&json["record"]["biz_no"], &json["record"]["response"]), (&json!(BIZ_NO), &json!({ "note": BIZ_NO })));
    assert_eq!(json["redis"]["in"], json!([h.hash]));
}

escaping_test!(
    /// Issue 32.6: `show` escapes the `biz_no`, the response and the name of a result hash.
    show_escapes_every_field,
    show_escaped
);

async fn list_escaped(h: &Hostile) {
    let (b, key_shown) = (&h.f.biz, h.key_shown);
    // The columns line up on what is shown.
    let width = key_shown.chars().count();
    let listed = format!(
        "{:width$}  STATE       CREATED_AT                EXPIRES_AT                BIZ_NO\n\
         {:width$}  succeeded   2026-01-01T00:00:00.000Z  2100-01-01T00:00:00.000Z  {BIZ_NO_SHOWN}\n\
         {key_shown}  processing  2026-01-01T00:00:00.001Z  2100-01-01T00:00:00.000Z  {OTHER_NO_SHOWN}\n",
        "KEY", "k7"
    );
    assert_eq!(out(&h.idem(&["list", "--biz", b], "")), (0, listed));
    let (_, json) = out_json(&h.idem(&["list", "--biz", b, "--json"], ""));
    let fields = |r: &Value| (r["key"].as_str().unwrap().to_owned(), r["biz_no"].as_str().unwrap().to_owned());
    let rows: Vec<(String, String)> = json.as_array().unwrap().iter().map(fields).collect();
    assert_eq!(rows, [("k7".into(), BIZ_NO.into()), (h.key.into(), OTHER_NO.into())]);
}

escaping_test!(
    /// Issue 32.6: `list` escapes keys and `biz_no`s (a newline would forge a row).
    list_escapes_keys_and_biz_nos,
    list_escaped
);

async fn reconcile_escaped(h: &Hostile) {
    let f = &h.f;
    let b = &f.biz;
    let pay = format!("cli_pay_{}", f.suffix);
    f.exec(format!("CREATE TABLE {pay} (no VARCHAR(64) NULL)")).await;
    let insert = format!("INSERT INTO {pay} (no) VALUES ({}), ({})", f.arg(1), f.arg(2));
    sqlx::query(AssertSqlSafe(insert)).bind(BIZ_NO).bind(ROW).execute(&f.pool).await.unwrap();
    let stuck = format!("  {}  biz_no={OTHER_NO_SHOWN}  processing  created 2026-01-01T00:00:00.001Z", h.key_shown);
    let reconciled = format!(
        "reconcile {b}: idem_record.biz_no against {pay}.no\nrecords without a business row: 1\n{stuck}\n\
         business rows without a record: 1\n  {ROW_SHOWN}\nrecords stuck in processing: 1\n{stuck}\n3 found\n"
    );
    let reconcile = ["reconcile", "--biz", b, "--table", &pay, "--column", "no", "--record-field", "biz_no"];
    assert_eq!(out(&h.idem(&reconcile, "")), (1, reconciled));
    let (_, json) = out_json(&h.idem(&[&reconcile[..], &["--json"]].concat(), ""));
    assert_eq!(json["rows_without_record"]["items"], json!([ROW]));
    assert_eq!(json["stuck_in_processing"]["items"][0]["key"], json!(h.key));
    assert_eq!(json["records_without_row"]["items"][0]["biz_no"], json!(OTHER_NO));
}

escaping_test!(
    /// Issue 32.6: `reconcile` escapes keys, `biz_no`s and the business column's values.
    reconcile_escapes_keys_values_and_biz_nos,
    reconcile_escaped
);

async fn forget_escaped(h: &Hostile) {
    let (b, id7, hash_shown) = (&h.f.biz, h.id7, &h.hash_shown);
    let claim = h.f.location("k7").claim;
    let forgot = h.idem(&["forget", b, "k7"], "y\n");
    let prompt = format!(
        "about to remove:\n  record {b} k7 (id {id7}, succeeded, expires 2100-01-01T00:00:00.000Z)\n  \
         redis cached result of {claim} (in {hash_shown})\n  \
         (instances with a local replay cache may still answer it for up to their max_age)\nforget? [y/N] "
    );
    assert_eq!(err(&forgot), prompt);
    let removed = format!(
        "removed record {b} k7 (id {id7}, succeeded)\nremoved redis cached result of {claim} from {hash_shown}\n\
         {LOCAL_CACHES}\n"
    );
    assert_eq!(out(&forgot), (0, removed));
}

escaping_test!(
    /// Issue 32.6: `forget` escapes its prompt and what it says it removed.
    forget_escapes_its_prompt_and_report,
    forget_escaped
);

async fn purge_escaped(h: &Hostile) {
    let b = &h.f.biz;
    h.f.row(h.evil_biz, "e1", None, 1, Some("{}"), CREATED, EXPIRED).await;
    h.f.row(b, "e2", None, 1, Some("{}"), CREATED, EXPIRED).await;
    let purged = format!(
        "expired records by biz:\n         1  {b}\n         1  {}\npurged 2 expired records\n",
        h.evil_biz_shown
    );
    assert_eq!(out(&h.idem(&["purge"], "")), (0, purged));
}

escaping_test!(
    /// Issue 32.6: `purge` escapes the biz it counts (only a hand writes such a biz).
    purge_escapes_the_biz_it_counts,
    purge_escaped
);

/// Issue 35.4: `purge` on a database several services share says how many
/// expired records of each biz it deletes (then deletes them all, as an
/// engine's own purge does), and leaves every live record.
async fn purge_says_whose_records_it_deletes(db: Db) {
    let Some(f) = Fixture::private(db, true).await else { return };
    let (b, other) = (f.biz.clone(), format!("{}_2", f.biz));
    for (biz, key, expires) in [(&b, "a1", EXPIRED), (&b, "a2", EXPIRED), (&b, "a3", LIVE), (&other, "b1", EXPIRED)] {
        f.row(biz, key, None, 1, Some("{}"), CREATED, expires).await;
    }
    let purged = format!("expired records by biz:\n         2  {b}\n         1  {other}\npurged 3 expired records\n");
    assert_eq!(out(&f.idem(&["purge", "--batch", "2"], "")), (0, purged));
    assert_eq!(f.count("idem_record").await, 1, "the live record stays");
    assert_eq!(out(&f.idem(&["purge"], "")), (0, "purged 0 expired records\n".into()), "nothing left");
    f.finish().await;
}

#[tokio::test]
async fn purge_says_whose_records_it_deletes_on_mariadb() {
    purge_says_whose_records_it_deletes(Db::MySql).await;
}

#[tokio::test]
async fn purge_says_whose_records_it_deletes_on_postgres() {
    purge_says_whose_records_it_deletes(Db::Postgres).await;
}

#[tokio::test]
async fn purge_says_whose_records_it_deletes_on_sqlite() {
    purge_says_whose_records_it_deletes(Db::Sqlite).await;
}

/// Issue 35.4: on a database without idem's tables, every command that
/// reads them says to run `idem migrate` (told by the error's code, and on
/// SQLite by its catalog), naming where the URL came from; after `idem
/// migrate` they work.
async fn a_database_without_the_tables_is_told_to_migrate(db: Db) {
    let Some(f) = Fixture::private(db, false).await else { return };
    let b = f.biz.clone();
    f.exec("CREATE TABLE payments (no VARCHAR(64) NULL)".into()).await;
    let told = format!("idem: IDEM_DATABASE_URL: {NOT_MIGRATED}\n");
    for args in [
        vec!["status", &b, "k1"],
        vec!["show", &b, "k1"],
        vec!["list", "--biz", &b],
        vec!["forget", &b, "k1", "--yes"],
        vec!["purge"],
        vec!["reconcile", "--biz", &b, "--table", "payments", "--column", "no"],
    ] {
        let o = f.idem(&args, "");
        assert_eq!((out(&o), err(&o)), ((3, String::new()), told.clone()), "{args:?}");
    }
    // Named as typed when typed.
    let typed = f.idem_at("", &["list", "--biz", &b, "--database-url", &f.url], "");
    assert_eq!(err(&typed), format!("idem: --database-url: {NOT_MIGRATED}\n"));
    assert_eq!(out(&f.idem(&["migrate"], "")).0, 0);
    let listed = "KEY  STATE       CREATED_AT                EXPIRES_AT                BIZ_NO\n";
    assert_eq!(out(&f.idem(&["list", "--biz", &b], "")), (0, listed.into()));
    f.finish().await;
}

#[tokio::test]
async fn a_database_without_the_tables_is_told_to_migrate_on_mariadb() {
    a_database_without_the_tables_is_told_to_migrate(Db::MySql).await;
}

#[tokio::test]
async fn a_database_without_the_tables_is_told_to_migrate_on_postgres() {
    a_database_without_the_tables_is_told_to_migrate(Db::Postgres).await;
}

#[tokio::test]
async fn a_database_without_the_tables_is_told_to_migrate_on_sqlite() {
    a_database_without_the_tables_is_told_to_migrate(Db::Sqlite).await;
}

/// `idem` with `args`, the environment holding only `env`.
fn idem_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args);
    for var in ["IDEM_DATABASE_URL", "IDEM_REDIS_URL", "IDEM_REDIS_NAMESPACE", "IDEM_TRANSACTION_POOLER"] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied()).output().unwrap()
}

#[test]
fn no_database_is_a_usage_error_and_an_unreachable_one_a_failure() {
    let run = |url: Option<&str>| {
        let env: Vec<(&str, &str)> = url.map(|url| ("IDEM_DATABASE_URL", url)).into_iter().collect();
        idem_with(&["status", "pay", "k1"], &env).status.code()
    };
    assert_eq!(run(None), Some(2));
    assert_eq!(run(Some("mysql://root@127.0.0.1:1/test")), Some(3));
    assert_eq!(run(Some("oracle://x")), Some(2), "an unknown scheme is refused before anything is opened");
    let namespace =
        idem_with(&["status", "pay", "k1", "--namespace", "a b"], &[("IDEM_DATABASE_URL", "sqlite::memory:")]);
    assert_eq!(
        (namespace.status.code(), err(&namespace)),
        (
            Some(2),
            "idem: --namespace: a namespace of 3 bytes breaks the rule: 1 to 64 characters from A-Z a-z 0-9 _ . -\n"
                .into()
        )
    );
    let help = idem_with(&["--help"], &[]);
    assert_eq!(help.status.code(), Some(0));
    let shown = String::from_utf8_lossy(&help.stdout);
    assert!(shown.contains("idem reconcile --biz pay --table payments"));
    // Environment variables are named, never shown with a value (set or not).
    for var in ["IDEM_DATABASE_URL", "IDEM_REDIS_URL", "IDEM_REDIS_NAMESPACE", "IDEM_TRANSACTION_POOLER"] {
        assert!(shown.contains(&format!("[env: {var}]")), "{var}: {shown}");
    }
}

/// Issue 35.4: an unreachable database fails at once with the real cause
/// (not "pool timed out" after 10 s), naming where its URL came from: the
/// flag when typed (even with the variable set), else the variable.
#[test]
fn an_unreachable_database_is_told_with_its_cause_and_the_urls_source() {
    let refused =
        |from: &str| format!("idem: {from}: cannot connect to the database: Connection refused (os error 111)\n");
    for url in ["mysql://root@127.0.0.1:1/test", "postgres://postgres@127.0.0.1:1/test"] {
        let started = std::time::Instant::now();
        let by_env = idem_with(&["list", "--biz", "pay"], &[("IDEM_DATABASE_URL", url)]);
        println!("{url}: failed after {:?}", started.elapsed());
        assert_eq!((by_env.status.code(), err(&by_env)), (Some(3), refused("IDEM_DATABASE_URL")));
        let typed =
            idem_with(&["list", "--biz", "pay", "--database-url", url], &[("IDEM_DATABASE_URL", "sqlite::memory:")]);
        assert_eq!((typed.status.code(), err(&typed)), (Some(3), refused("--database-url")));
    }
    let sqlite = idem_with(&["list", "--biz", "pay"], &[("IDEM_DATABASE_URL", "sqlite:/nonexistent-idem-dir/x.db")]);
    assert_eq!(
        (sqlite.status.code(), err(&sqlite)),
        (
            Some(3),
            "idem: IDEM_DATABASE_URL: cannot connect to the database: error returned from database: (code: 14) \
             unable to open database file\n"
                .into()
        )
    );
}

/// Issue 35.4: with both URLs set in the environment, as an operator's
/// shell has them, a usage error's usage line shows what the command needs
/// (`--biz`), not `--database-url` and `--redis-url` as if required; and
/// `idem purge` needs nothing more.
#[test]
fn usage_lines_leave_out_what_the_environment_set() {
    let env = [("IDEM_DATABASE_URL", "sqlite::memory:"), ("IDEM_REDIS_URL", "redis://127.0.0.1:1")];
    let list = idem_with(&["list"], &env);
    assert_eq!(
        (list.status.code(), err(&list)),
        (
            Some(2),
            "error: the following required arguments were not provided:\n  --biz <BIZ>\n\nUsage: idem list --biz \
             <BIZ>\n\nFor more information, try '--help'.\n"
                .into()
        )
    );
    let purge = idem_with(&["purge"], &env);
    assert_eq!(purge.status.code(), Some(3), "no clap error: the in-memory database has no tables");
    assert_eq!(err(&purge), format!("idem: IDEM_DATABASE_URL: {NOT_MIGRATED}\n"));
}

/// Issue 32.6: a message quoting what the environment or a flag held
/// shows its control and bidi characters escaped.
#[test]
fn messages_quoting_input_are_escaped() {
    let o = idem_with(&["list", "--biz", "pay"], &[("IDEM_DATABASE_URL", "x\u{1b}[2K\u{202e}://h")]);
    assert_eq!(
        (o.status.code(), err(&o)),
        (
            Some(2),
            "idem: IDEM_DATABASE_URL: unknown scheme `x\\u{1b}[2K\\u{202e}`; expected mysql:, postgres: or sqlite:\n"
                .into()
        )
    );
    let o = idem_with(
        &["list", "--biz", "pay"],
        &[("IDEM_DATABASE_URL", "sqlite::memory:"), ("IDEM_TRANSACTION_POOLER", "on\u{1b}]52;c;aGk=\u{7}")],
    );
    assert_eq!(
        (o.status.code(), err(&o)),
        (
            Some(2),
            "idem: IDEM_TRANSACTION_POOLER: \"on\\u{1b}]52;c;aGk=\\u{7}\" is not a boolean (1 or 0, true or false)\n"
                .into()
        )
    );
}
