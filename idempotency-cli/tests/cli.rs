//! The built `idem` binary against MariaDB, PostgreSQL and SQLite (and
//! Redis): records and business rows seeded with known mismatches, then the
//! exact output and exit code of every command, hostile table and column
//! names refused (and the tables left alone), names that need quoting used.
//! A server that does not answer skips its test, unless
//! `IDEM_REQUIRE_SERVICES=1`.

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

impl Fixture {
    async fn new(db: Db) -> Option<Fixture> {
        let url = match db {
            Db::MySql => std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into()),
            Db::Postgres => {
                std::env::var("IDEM_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
            }
            Db::Sqlite => {
                let dir = std::env::temp_dir().join("idem-tests");
                std::fs::create_dir_all(&dir).unwrap();
                format!("sqlite:{}?mode=rwc", dir.join(format!("cli_{}.db", unique())).display())
            }
        };
        sqlx::any::install_default_drivers();
        let pool = match AnyPoolOptions::new().max_connections(2).connect(&url).await {
            Ok(pool) => pool,
            Err(e) => return unreachable(&url, e),
        };
        // The tables, as the engine creates them.
        let migrated = match db {
            Db::MySql => idempotency_runtime::Idem::new(sqlx::MySqlPool::connect(&url).await.unwrap()).migrate().await,
            Db::Postgres => idempotency_runtime::Idem::new(sqlx::PgPool::connect(&url).await.unwrap()).migrate().await,
            Db::Sqlite => {
                idempotency_runtime::Idem::new(sqlx::SqlitePool::connect(&url).await.unwrap()).migrate().await
            }
        };
        migrated.expect("migrate");
        let redis_url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let redis = redis::Client::open(redis_url).ok();
        let redis = match &redis {
            Some(client) if client.get_multiplexed_async_connection().await.is_ok() => redis,
            _ => return unreachable("redis", "no connection"),
        };
        let suffix = unique();
        Some(Fixture { db, url, pool, redis, namespace: format!("cli_{suffix}"), biz: format!("cli_{suffix}"), suffix })
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
        let response = (status == 1).then(|| format!("{{\"key\":\"{key}\"}}"));
        let digest: String =
            idempotency_runtime::key::key_digest(&self.biz, key).iter().map(|b| format!("{b:02x}")).collect();
        sqlx::query(AssertSqlSafe(sql))
            .bind(digest)
            .bind(&self.biz)
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
        sqlx::query_scalar(AssertSqlSafe(sql)).bind(&self.biz).bind(key).fetch_one(&self.pool).await.unwrap()
    }

    /// Where `key` lives in Redis, by the engine's own layout.
    fn location(&self, key: &str) -> Location {
        idempotency_runtime::redis_layout::locate(&self.namespace, &self.biz, key).unwrap()
    }

    /// The result hash a cached result of `key` is forged into (the window of now).
    fn results_hash(&self, key: &str) -> String {
        let window = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() / 600_000;
        format!("{}{window}", self.location(key).results_prefix)
    }

    /// Forges the cached result of `key`, as a finished call leaves it.
    async fn redis_cache(&self, key: &str, response: &str) {
        let mut conn = self.redis.as_ref().unwrap().get_multiplexed_async_connection().await.unwrap();
        let value = idempotency_runtime::redis_layout::result_value(LIVE, HASH, response);
        let hash = self.results_hash(key);
        let _: () = redis::pipe()
            .cmd("HSET")
            .arg(&hash)
            .arg(&self.location(key).field[..])
            .arg(value)
            .ignore()
            .cmd("PEXPIRE")
            .arg(&hash)
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

    // purge: what is expired now, then exactly the three seeded expired.
    assert_eq!(out(&f.idem(&["purge", "--expired"], "")).0, 0);
    for key in ["p1", "p2", "p3"] {
        f.record(key, None, 1, CREATED, EXPIRED).await;
    }
    assert_eq!(out(&f.idem(&["purge", "--expired", "--batch", "2"], "")), (0, "purged 3 expired records\n".into()));
    let (_, left) = out_json(&f.idem(&["list", "--biz", &b, "--json"], ""));
    let keys: Vec<&str> = left.as_array().unwrap().iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys, vec!["k4", "k6"]);

    // migrate: the tables are already this version's; what they hold stays.
    assert_eq!(out(&f.idem(&["migrate"], "")), (0, "migrated: the tables are this version's\n".into()));
    assert_eq!(out(&f.idem(&["status", &b, "k4"], "")), (0, "completed {\"key\":\"k4\"}\n".into()));

    // Usage errors exit 2; failures 3.
    assert_eq!(out(&f.idem(&["status", "Not-A-Biz", "k1"], "")).0, 2);
    assert_eq!(out(&f.idem(&["status", &b, "bad key"], "")).0, 2);
    assert_eq!(out(&f.idem(&["purge"], "")).0, 2, "--expired is required");
    assert_eq!(out(&f.idem(&["list", "--biz", &b, "--older-than", "ten"], "")).0, 2);
    f.exec(format!("DROP TABLE {pay}")).await;
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

/// Regression: behind PgBouncer in transaction mode, with
/// `--transaction-pooler`, command after command (each a new process whose
/// statements meet server connections earlier ones prepared on) answers
/// as straight; the flag on another database is a usage error.
#[tokio::test]
async fn commands_work_behind_pgbouncer_with_the_flag() {
    let Some(f) = Fixture::new(Db::Postgres).await else { return };
    let Some(bouncer) = idempotency_testkit::pgbouncer::PgBouncer::start() else { return };
    let url = bouncer.url("test");
    let idem = |args: &[&str], stdin: &str| {
        let mut args = args.to_vec();
        args.push("--transaction-pooler");
        f.idem_at(&url, &args, stdin)
    };
    let b = f.biz.clone();
    let id1 = f.record("k1", Some("1"), 1, CREATED, LIVE).await;
    let id2 = f.record("k2", Some("2"), 1, CREATED + 1, LIVE).await;
    f.record("k3", Some("3"), 1, CREATED + 2, EXPIRED).await;
    for _ in 0..3 {
        assert_eq!(out(&idem(&["status", &b, "k1"], "")), (0, "completed {\"key\":\"k1\"}\n".into()));
        assert_eq!(out(&idem(&["status", &b, "k3"], "")), (0, "expired\n".into()));
        let (code, shown) = out_json(&idem(&["show", &b, "k1", "--json"], ""));
        assert_eq!((code, &shown["record"]["id"]), (0, &json!(id1)));
        let (code, listed) = out_json(&idem(&["list", "--biz", &b, "--json"], ""));
        let keys: Vec<&str> = listed.as_array().unwrap().iter().map(|r| r["key"].as_str().unwrap()).collect();
        assert_eq!((code, keys), (0, vec!["k1", "k2", "k3"]));
    }
    let (code, removed) = out(&idem(&["forget", &b, "k2", "--yes"], ""));
    assert_eq!(code, 0);
    assert!(removed.starts_with(&format!("removed record {b} k2 (id {id2}, succeeded)\nnote: ")), "{removed}");
    assert_eq!(out(&idem(&["purge", "--expired"], "")).0, 0);
    assert_eq!(out(&idem(&["status", &b, "k3"], "")), (0, "absent\n".into()));
    assert_eq!(f.count(&format!("idem_record WHERE biz_type = '{b}'")).await, 1);

    let sqlite = f.idem_at("sqlite::memory:", &["status", &b, "k1", "--transaction-pooler"], "");
    assert_eq!(sqlite.status.code(), Some(2));
    assert!(err(&sqlite).contains("--transaction-pooler: for PostgreSQL only"), "{}", err(&sqlite));
}

#[test]
fn no_database_is_a_usage_error_and_an_unreachable_one_a_failure() {
    let run = |url: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
        cmd.args(["status", "pay", "k1"]).env_remove("IDEM_DATABASE_URL").env_remove("IDEM_REDIS_URL");
        if let Some(url) = url {
            cmd.env("IDEM_DATABASE_URL", url);
        }
        cmd.output().unwrap().status.code()
    };
    assert_eq!(run(None), Some(2));
    assert_eq!(run(Some("mysql://root@127.0.0.1:1/test")), Some(3));
    assert_eq!(run(Some("oracle://x")), Some(3));
    let help = Command::new(env!("CARGO_BIN_EXE_idem")).arg("--help").output().unwrap();
    assert_eq!(help.status.code(), Some(0));
    let shown = String::from_utf8_lossy(&help.stdout);
    assert!(shown.contains("idem reconcile --biz pay --table payments"));
    // Environment variables are named, never shown with a value (set or not).
    for var in ["IDEM_DATABASE_URL", "IDEM_REDIS_URL", "IDEM_REDIS_NAMESPACE", "IDEM_TRANSACTION_POOLER"] {
        assert!(shown.contains(&format!("[env: {var}]")), "{var}: {shown}");
    }
}
