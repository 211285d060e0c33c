//! `idem doctor`: a deployment checked against what the engines need,
//! before it bites. It connects to the database and to Redis as the engines
//! do (the same URLs, drivers and pooler switch) and reports each check as
//! one line: ok, warning or failure, what it found, and the fix.
//!
//! One file per system: `database.rs` (reaching it, the tables, the clock,
//! what waits to be purged or sent), `postgres.rs` and `mysql.rs` (their
//! settings, a transaction pooler, Galera), `redis.rs` (its version, memory
//! policy, cluster slots and namespace). Every statement is sent as plain
//! SQL text (`sqlx::raw_sql`: nothing prepared, one exchange), so the
//! doctor itself works behind a transaction pooler whether or not it was
//! told of one; the few values it writes into SQL are integers and hex
//! digits it formatted itself.
//!
//! A server that cannot be reached is a failed check, not an error of the
//! tool: exit 1 on any failure (with `--strict`, on any warning too), else 0.

mod database;
mod mysql;
mod postgres;
#[cfg(feature = "redis")]
mod redis;

use serde_json::{Value, json};

use crate::cli::{DoctorArgs, Given};
use crate::dialect::Dialect;
use crate::escape::text;
use crate::out::{self, say};
use crate::time::parse_duration;
use crate::{Done, Failure};

/// What the doctor is pointed at, from the flags and the environment
/// (checked already: the driver is in this build, the namespace valid).
pub struct Deployment {
    pub url: Given,
    pub dialect: Dialect,
    /// Read by the Redis checks only, built with the feature `redis`.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub redis: Option<Given>,
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub namespace: Option<Given>,
    pub pooler: bool,
}

/// The engines' settings the servers' are compared with (the flags), in
/// bytes and milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct Expected {
    pub max_result_bytes: u64,
    pub lock_wait_ms: i64,
    pub lease_ms: i64,
    pub purge_every_ms: i64,
    pub outbox_stuck_ms: i64,
}

impl Expected {
    /// The flags read, or the first one refused (a usage error).
    pub fn of(args: &DoctorArgs) -> Result<Expected, String> {
        let ms = |flag: &str, value: &str| parse_duration(value).map_err(|e| format!("{flag}: {e}"));
        Ok(Expected {
            max_result_bytes: args.max_result_bytes as u64,
            lock_wait_ms: ms("--lock-wait", &args.lock_wait)?,
            lease_ms: ms("--lease", &args.lease)?,
            purge_every_ms: ms("--purge-every", &args.purge_every)?,
            outbox_stuck_ms: ms("--outbox-stuck-after", &args.outbox_stuck_after)?,
        })
    }
}

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Ok,
    Warning,
    Failure,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Warning => "warning",
            Level::Failure => "failure",
        }
    }
}

/// One line of the report: what was checked, how it came out, what was
/// found and, unless all is well, the fix.
#[derive(Debug)]
pub struct Check {
    pub name: &'static str,
    pub level: Level,
    pub found: String,
    pub fix: Option<String>,
}

impl Check {
    pub fn ok(name: &'static str, found: impl Into<String>) -> Check {
        Check { name, level: Level::Ok, found: found.into(), fix: None }
    }

    pub fn warning(name: &'static str, found: impl Into<String>, fix: impl Into<String>) -> Check {
        Check { name, level: Level::Warning, found: found.into(), fix: Some(fix.into()).filter(|f| !f.is_empty()) }
    }

    /// A failure; an empty `fix` is none to give (the server's own error
    /// says what failed).
    pub fn failure(name: &'static str, found: impl Into<String>, fix: impl Into<String>) -> Check {
        Check { name, level: Level::Failure, found: found.into(), fix: Some(fix.into()).filter(|f| !f.is_empty()) }
    }

    fn line(&self) -> String {
        let fix = self.fix.as_deref().map_or(String::new(), |fix| format!("; fix: {fix}"));
        format!("{:<8} {:<24} {}{fix}", self.level.name(), self.name, self.found)
    }

    fn json(&self) -> Value {
        json!({ "check": self.name, "level": self.level.name(), "found": self.found, "fix": self.fix })
    }
}

/// A server's text (an error, a setting's value) as a check shows it.
pub fn quoted(value: &str) -> String {
    text(value).into_owned()
}

pub async fn run(deployment: Deployment, args: &DoctorArgs) -> Result<Done, Failure> {
    let expected = Expected::of(args).map_err(|e| -> Failure { e.into() })?;
    let mut checks = Vec::new();
    let mut db = database::open(&deployment, &mut checks).await;
    let facts = match &mut db {
        Some(db) => {
            let facts = database::check(db, &mut checks).await;
            match deployment.dialect {
                Dialect::Postgres => postgres::check(db, &deployment, &expected, &mut checks).await,
                Dialect::MySql => mysql::check(db, &expected, &mut checks).await,
                Dialect::Sqlite => {}
            }
            database::backlog(db, &facts, &expected, &mut checks).await;
            facts
        }
        None => database::Facts::default(),
    };
    redis_checks(&deployment, &facts, db.as_mut(), &mut checks).await;
    if let Some(db) = db {
        db.close().await;
    }
    report(&checks, args)
}

const NO_REDIS: &str = "not checked: no --redis-url / IDEM_REDIS_URL (engines without Redis need none)";

#[cfg(feature = "redis")]
async fn redis_checks(d: &Deployment, facts: &database::Facts, db: Option<&mut database::Db>, checks: &mut Vec<Check>) {
    match &d.redis {
        Some(url) => redis::check(url, d, facts, db, checks).await,
        None => checks.push(Check::ok("redis", NO_REDIS)),
    }
}

/// Without the feature a Redis URL was refused before: nothing to check.
#[cfg(not(feature = "redis"))]
async fn redis_checks(_: &Deployment, _: &database::Facts, _: Option<&mut database::Db>, checks: &mut Vec<Check>) {
    checks.push(Check::ok("redis", NO_REDIS));
}

fn report(checks: &[Check], args: &DoctorArgs) -> Result<Done, Failure> {
    let count = |level| checks.iter().filter(|c| c.level == level).count();
    let (oks, warnings, failures) = (count(Level::Ok), count(Level::Warning), count(Level::Failure));
    if args.json {
        out::json(&json!({
            "checks": checks.iter().map(Check::json).collect::<Vec<_>>(),
            "ok": oks,
            "warnings": warnings,
            "failures": failures,
        }));
    } else {
        checks.iter().for_each(|c| say(&c.line()));
        let plural = |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        say(&format!(
            "{}, {}, {}",
            plural(failures, "failure", "failures"),
            plural(warnings, "warning", "warnings"),
            plural(oks, "ok", "ok")
        ));
    }
    let failed = failures > 0 || (args.strict && warnings > 0);
    Ok(if failed { Done::Found } else { Done::Ok })
}

/// `ms` as people write it, rounded to the largest unit that keeps two
/// digits: `250 ms`, `30 s`, `10 min`, `2 h`, `3 d`.
pub fn duration(ms: i64) -> String {
    let abs = ms.unsigned_abs();
    let sign = if ms < 0 { "-" } else { "" };
    let (unit, name) = match abs {
        _ if abs < 1000 || (abs < 10_000 && !abs.is_multiple_of(1000)) => return format!("{ms} ms"),
        _ if abs < 119_500 => (1000, "s"),
        _ if abs < 7_170_000 => (60_000, "min"),
        _ if abs < 171_000_000 => (3_600_000, "h"),
        _ => (86_400_000, "d"),
    };
    format!("{sign}{} {name}", (abs + unit / 2) / unit)
}

/// `bytes` as people write it: `512 B`, `64 KiB`, `16 MiB`.
pub fn bytes(n: u64) -> String {
    match n {
        _ if n >= 1 << 20 && n.is_multiple_of(1 << 20) => format!("{} MiB", n >> 20),
        _ if n >= 1 << 10 && n.is_multiple_of(1 << 10) => format!("{} KiB", n >> 10),
        _ => format!("{n} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes_read_as_people_write_them() {
        assert_eq!(duration(0), "0 ms");
        assert_eq!(duration(250), "250 ms");
        assert_eq!(duration(5_000), "5 s");
        assert_eq!(duration(90_000), "90 s");
        assert_eq!(duration(431_000), "7 min");
        assert_eq!(duration(599_700), "10 min");
        assert_eq!(duration(600_000), "10 min");
        assert_eq!(duration(-600_000), "-10 min");
        assert_eq!(duration(3_600_000), "60 min");
        assert_eq!(duration(7_200_000), "2 h");
        assert_eq!(duration(259_200_000), "3 d");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(65_536), "64 KiB");
        assert_eq!(bytes(16 << 20), "16 MiB");
        assert_eq!(bytes(1_000_000), "1000000 B");
    }
}
