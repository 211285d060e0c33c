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

mod database;
mod mysql;
mod postgres;
mod redis_checks;

use std::process::{Command, Output, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;
use sqlx::AssertSqlSafe;
use sqlx::any::AnyPoolOptions;

pub const HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";
pub const DAY: i64 = 86_400_000;

pub fn now_ms() -> i64 {
    i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis()).unwrap()
}

/// `idem` with only the given variables of its own set.
pub fn idem(env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    for var in ["IDEM_DATABASE_URL", "IDEM_REDIS_URL", "IDEM_REDIS_NAMESPACE", "IDEM_TRANSACTION_POOLER"] {
        command.env_remove(var);
    }
    command.envs(env.iter().copied()).args(args).stdin(Stdio::null()).output().expect("the idem binary")
}

/// What one `idem doctor --json` said, and its exit code.
pub struct Report {
    pub code: i32,
    pub json: Value,
}

impl Report {
    pub fn check(&self, name: &str) -> Option<&Value> {
        self.json["checks"].as_array().unwrap().iter().find(|c| c["check"] == name)
    }

    /// The check's level, or `absent`.
    pub fn level(&self, name: &str) -> &str {
        self.check(name).map_or("absent", |c| c["level"].as_str().unwrap())
    }

    pub fn found(&self, name: &str) -> &str {
        self.check(name).map_or("", |c| c["found"].as_str().unwrap())
    }

    pub fn fix(&self, name: &str) -> &str {
        self.check(name).map_or("", |c| c["fix"].as_str().unwrap_or(""))
    }
}

impl std::fmt::Debug for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit {}: {:#}", self.code, self.json)
    }
}

pub fn doctor_with(program: Option<&[&str]>, env: &[(&str, &str)], args: &[&str]) -> Report {
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
pub fn doctor(url: &str, redis: Option<&str>, args: &[&str]) -> Report {
    let mut env = vec![("IDEM_DATABASE_URL", url)];
    env.extend(redis.map(|r| ("IDEM_REDIS_URL", r)));
    doctor_with(None, &env, args)
}

pub fn unique_name() -> String {
    idempotency_testkit::unique("idem_doctor").replace('-', "_")
}

pub fn url_with_database(url: &str, name: &str) -> String {
    let base = url.rsplit_once('/').map_or(url, |(base, _)| base);
    format!("{base}/{name}")
}

/// SQL for each database: a `key_digest` literal of the key's digest.
#[derive(Clone, Copy, PartialEq)]
pub enum Dialect {
    MySql,
    Postgres,
    Sqlite,
}

impl Dialect {
    pub fn digest(self, biz: &str, key: &str) -> String {
        let hex: String = idempotency_runtime::key::key_digest(biz, key).iter().map(|b| format!("{b:02x}")).collect();
        if self == Dialect::Postgres { format!("'{hex}'::uuid") } else { format!("X'{hex}'") }
    }

    /// A record of `biz`/`key` expiring at `expires` (epoch ms).
    pub fn record(self, biz: &str, key: &str, expires: i64) -> String {
        format!(
            "INSERT INTO idem_record (key_digest, biz_type, idem_key, biz_no, params_hash, status, response, created_at, \
             updated_at, expires_at) VALUES ({}, '{biz}', '{key}', NULL, '{HASH}', 1, '{{}}', {c}, {c}, {expires})",
            self.digest(biz, key),
            c = expires - DAY,
        )
    }
}

pub async fn exec(url: &str, sql: &str) {
    sqlx::any::install_default_drivers();
    let pool = AnyPoolOptions::new().max_connections(1).connect(url).await.expect("seed connection");
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned())).execute(&pool).await.expect(sql);
    pool.close().await;
}

pub fn migrate(url: &str) {
    let out = idem(&[("IDEM_DATABASE_URL", url)], &["migrate"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
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
