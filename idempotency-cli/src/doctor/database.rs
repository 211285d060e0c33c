//! The database, as every backend has it: reaching it, the engine's tables
//! and their version, its clock against this host's, and what waits to be
//! purged or sent (expired records, outbox events).

use std::time::Duration;

use sqlx::any::AnyRow;
use sqlx::{AnyConnection, AssertSqlSafe, Connection, Row};

use super::{Check, Deployment, Expected, duration, quoted};
use crate::dialect::Dialect;
use crate::time::host_ms;

/// How long reaching the database may take (as the other commands).
const CONNECT_WITHIN: Duration = Duration::from_secs(5);

/// One connection to the database, as the engines reach it (the same URL
/// and driver), and what it is.
pub struct Db {
    pub conn: AnyConnection,
    pub dialect: Dialect,
    /// MariaDB rather than MySQL.
    pub mariadb: bool,
}

impl Db {
    /// The rows of `sql`, sent as text (nothing prepared). Built from this
    /// module's constants, integers and hex digits only.
    pub async fn rows(&mut self, sql: impl Into<String>) -> Result<Vec<AnyRow>, sqlx::Error> {
        sqlx::raw_sql(AssertSqlSafe(sql.into())).fetch_all(&mut self.conn).await
    }

    /// The first column of every row of `sql`, as text.
    pub async fn texts(&mut self, sql: impl Into<String>) -> Result<Vec<String>, sqlx::Error> {
        self.rows(sql).await?.iter().map(|r| r.try_get::<String, _>(0)).collect()
    }

    /// The first column of the first row of `sql`, an integer.
    pub async fn integer(&mut self, sql: impl Into<String>) -> Result<Option<i64>, sqlx::Error> {
        Ok(match self.rows(sql).await?.first() {
            Some(row) => row.try_get::<Option<i64>, _>(0)?,
            None => None,
        })
    }

    /// `(name, value)` rows, as `SHOW VARIABLES` and `pg_settings` give them.
    pub async fn settings(&mut self, sql: &str) -> Result<Vec<(String, String)>, sqlx::Error> {
        let rows = self.rows(sql).await?;
        rows.iter().map(|r| Ok((r.try_get::<String, _>(0)?, r.try_get::<String, _>(1)?))).collect()
    }

    pub async fn close(self) {
        let _ = self.conn.close().await;
    }
}

/// Connects once within [`CONNECT_WITHIN`]; why not, as a check.
pub async fn connect(url: &str) -> Result<AnyConnection, String> {
    sqlx::any::install_default_drivers();
    match tokio::time::timeout(CONNECT_WITHIN, AnyConnection::connect(url)).await {
        Err(_) => Err(format!("no answer within {} s", CONNECT_WITHIN.as_secs())),
        Ok(Err(sqlx::Error::Io(io))) => Err(io.to_string()),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(conn)) => Ok(conn),
    }
}

/// Reaches the database and says what it is (the first check), or says
/// why it cannot be reached.
pub async fn open(d: &Deployment, checks: &mut Vec<Check>) -> Option<Db> {
    let conn = match connect(&d.url.value).await {
        Ok(conn) => conn,
        Err(e) => {
            checks.push(Check::failure(
                "database",
                format!("cannot connect ({}): {}", d.url.from, quoted(&e)),
                "check the URL and that the server runs: no call can run without its database",
            ));
            return None;
        }
    };
    let mut db = Db { conn, dialect: d.dialect, mariadb: false };
    let version = match d.dialect {
        Dialect::MySql => "SELECT CAST(VERSION() AS CHAR)",
        Dialect::Postgres => "SHOW server_version",
        Dialect::Sqlite => "SELECT sqlite_version()",
    };
    let version = match db.texts(version).await {
        Ok(found) => found.into_iter().next().unwrap_or_default(),
        Err(e) => {
            checks.push(Check::failure("database", format!("connected, then failed: {}", quoted(&e.to_string())), ""));
            return None;
        }
    };
    db.mariadb = version.contains("MariaDB");
    let product = match d.dialect {
        Dialect::MySql if db.mariadb => "MariaDB",
        Dialect::MySql => "MySQL",
        Dialect::Postgres => "PostgreSQL",
        Dialect::Sqlite => "SQLite",
    };
    let version = version.split("-MariaDB").next().unwrap_or_default();
    checks.push(Check::ok("database", format!("{product} {} ({})", quoted(version), d.url.from)));
    Some(db)
}

/// What the checks found that later ones need.
#[derive(Debug, Default)]
pub struct Facts {
    /// `idem_record` has this version's columns (expiry, digest).
    pub records: bool,
    /// `idem_outbox` exists.
    pub outbox: bool,
    /// The namespace in `idem_meta`.
    pub namespace: Option<String>,
    /// Now on the database's clock (epoch ms), as the engines judge expiry.
    pub now_ms: Option<i64>,
}

/// The tables `Idem::migrate` creates.
const ENGINE_TABLES: [&str; 3] = ["idem_record", "idem_meta", "idem_token"];
/// Tables of optional parts, created by their own migrations.
const PART_TABLES: [&str; 4] = ["idem_outbox", "idem_outbox_aggregate", "idem_call", "idem_step"];
/// The columns of this version's `idem_record`.
const RECORD_COLUMNS: [&str; 11] = [
    "id",
    "key_digest",
    "biz_type",
    "idem_key",
    "biz_no",
    "params_hash",
    "status",
    "response",
    "created_at",
    "updated_at",
    "expires_at",
];
const IDEM_TABLES: &str =
    "('idem_record', 'idem_meta', 'idem_token', 'idem_outbox', 'idem_outbox_aggregate', 'idem_call', 'idem_step')";

/// The catalog's answers, per dialect: idem's tables present, the columns
/// of `idem_record`, and the columns of each of its unique indexes but the
/// primary key (comma-separated, in index order).
fn catalog(d: Dialect) -> [String; 3] {
    match d {
        Dialect::MySql => [
            format!(
                "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME IN {IDEM_TABLES}"
            ),
            "SELECT CAST(COLUMN_NAME AS CHAR) FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'idem_record'".into(),
            "SELECT CAST(GROUP_CONCAT(COLUMN_NAME ORDER BY SEQ_IN_INDEX) AS CHAR) FROM information_schema.STATISTICS \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'idem_record' AND NON_UNIQUE = 0 AND INDEX_NAME <> 'PRIMARY' GROUP BY INDEX_NAME".into(),
        ],
        // The tables the engines' unqualified names find: on the search path.
        Dialect::Postgres => [
            format!(
                "SELECT c.relname::text FROM pg_class c WHERE c.relkind IN ('r', 'p') AND pg_table_is_visible(c.oid) AND c.relname IN {IDEM_TABLES}"
            ),
            "SELECT attname::text FROM pg_attribute WHERE attrelid = to_regclass('idem_record') AND attnum > 0 AND NOT attisdropped".into(),
            "SELECT string_agg(a.attname::text, ',' ORDER BY k.ord) FROM pg_index i \
             CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord) \
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
             WHERE i.indrelid = to_regclass('idem_record') AND i.indisunique AND NOT i.indisprimary GROUP BY i.indexrelid".into(),
        ],
        Dialect::Sqlite => [
            format!("SELECT name FROM sqlite_master WHERE type = 'table' AND name IN {IDEM_TABLES}"),
            "SELECT name FROM pragma_table_info('idem_record')".into(),
            "SELECT group_concat(c.name, ',') FROM pragma_index_list('idem_record') AS l, pragma_index_info(l.name) AS c \
             WHERE l.\"unique\" = 1 AND l.origin <> 'pk' GROUP BY l.name".into(),
        ],
    }
}

/// Now on the database's clock, epoch ms (SQLite's is this host's).
fn now_sql(d: Dialect) -> Option<&'static str> {
    match d {
        Dialect::MySql => {
            Some("SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)")
        }
        Dialect::Postgres => Some("SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT"),
        Dialect::Sqlite => None,
    }
}

/// The tables and the clock.
pub async fn check(db: &mut Db, checks: &mut Vec<Check>) -> Facts {
    let mut facts = Facts::default();
    checks.push(match tables(db, &mut facts).await {
        Ok(check) => check,
        Err(e) => Check::failure("tables", format!("the catalog could not be read: {}", quoted(&e.to_string())), ""),
    });
    checks.push(match clock(db, &mut facts).await {
        Ok(check) => check,
        Err(e) => {
            Check::failure("clock", format!("the database's clock could not be read: {}", quoted(&e.to_string())), "")
        }
    });
    facts
}

async fn tables(db: &mut Db, facts: &mut Facts) -> Result<Check, sqlx::Error> {
    let [present, columns, uniques] = catalog(db.dialect);
    let present = db.texts(present).await?;
    let has = |name: &str| present.iter().any(|p| p == name);
    facts.outbox = has("idem_outbox");
    const MIGRATE: &str = "run `idem migrate` (what Idem::migrate does at an engine's start), or check that the URL \
                           names the engines' database";
    if !ENGINE_TABLES.iter().any(|t| has(t)) {
        return Ok(Check::failure("tables", "none of idem's tables (idem_record, idem_meta, idem_token)", MIGRATE));
    }
    let missing: Vec<&str> = ENGINE_TABLES.into_iter().filter(|t| !has(t)).collect();
    let columns = if has("idem_record") { db.texts(columns).await? } else { Vec::new() };
    let uniques = if has("idem_record") { db.texts(uniques).await? } else { Vec::new() };
    let lacking: Vec<&str> = RECORD_COLUMNS.into_iter().filter(|c| !columns.iter().any(|have| have == c)).collect();
    facts.records = has("idem_record") && lacking.iter().all(|c| *c == "key_digest");
    if has("idem_meta") {
        let ns = db.texts("SELECT value FROM idem_meta WHERE name = 'namespace'").await?;
        facts.namespace = ns.into_iter().next();
    }
    let earlier = uniques.iter().any(|u| u == "biz_type,idem_key") || !uniques.iter().any(|u| u == "key_digest");
    if has("idem_record") && (earlier || !lacking.is_empty()) {
        let shape = if lacking.is_empty() {
            "not unique on key_digest".to_owned()
        } else {
            format!("no column {}", lacking.join(", "))
        };
        let unique = if uniques.is_empty() {
            "no unique index".to_owned()
        } else {
            format!("unique on ({})", uniques.join("), ("))
        };
        return Ok(Check::failure(
            "tables",
            format!("idem_record is an earlier version's: {shape}, {unique}"),
            "stop the earlier version's engines, then run `idem migrate` (docs/operations.md, \"Upgrading the record table\")",
        ));
    }
    if !missing.is_empty() {
        return Ok(Check::failure(
            "tables",
            format!("missing: {} (an earlier version's tables)", missing.join(", ")),
            MIGRATE,
        ));
    }
    let Some(namespace) = &facts.namespace else {
        return Ok(Check::failure("tables", "idem_meta holds no namespace", MIGRATE));
    };
    let parts: Vec<&str> = PART_TABLES.into_iter().filter(|t| has(t)).collect();
    let parts = if parts.is_empty() { String::new() } else { format!("; also {}", parts.join(", ")) };
    Ok(Check::ok(
        "tables",
        format!(
            "idem_record (unique on key_digest), idem_meta, idem_token: this version's; namespace {}{parts}",
            quoted(namespace)
        ),
    ))
}

async fn clock(db: &mut Db, facts: &mut Facts) -> Result<Check, sqlx::Error> {
    let Some(sql) = now_sql(db.dialect) else {
        facts.now_ms = Some(host_ms());
        return Ok(Check::ok("clock", "SQLite's clock is this host's"));
    };
    let before = host_ms();
    let now = db.integer(sql).await?.unwrap_or_default();
    let after = host_ms();
    facts.now_ms = Some(now);
    let skew = now - (before + after) / 2;
    let within = (after - before + 1) / 2;
    let off = skew.abs() - within;
    let side = if skew >= 0 { "ahead of" } else { "behind" };
    if off < 1000 {
        return Ok(Check::ok(
            "clock",
            format!("the database's is within {} of this host's", duration(skew.abs() + within)),
        ));
    }
    Ok(Check::warning(
        "clock",
        format!(
            "the database's clock is {} {side} this host's: the engines stamp and judge expiry and leases by the \
             database's, so no answer changes, but one clock is off, and if it is the database's its correction will \
             move every expiry and lease by as much at once (and a standby or another node may judge them by another)",
            duration(skew.abs())
        ),
        "keep the database's servers and the hosts in NTP",
    ))
}

/// What waits: records past their ttl not purged, outbox events dead or
/// pending too long.
pub async fn backlog(db: &mut Db, facts: &Facts, expected: &Expected, checks: &mut Vec<Check>) {
    let Some(now) = facts.now_ms else { return };
    if facts.records {
        checks.push(match expired(db, now, expected).await {
            Ok(check) => check,
            Err(e) => {
                Check::failure("expired_records", format!("could not be counted: {}", quoted(&e.to_string())), "")
            }
        });
    }
    if facts.outbox {
        checks.push(match outbox(db, now, expected).await {
            Ok(check) => check,
            Err(e) => Check::failure("outbox", format!("could not be counted: {}", quoted(&e.to_string())), ""),
        });
    }
}

/// Expired records counted up to this many: on the expiry index, a cheap
/// walk even on a large table.
const COUNT_UP_TO: i64 = 1_000_000;

async fn expired(db: &mut Db, now: i64, expected: &Expected) -> Result<Check, sqlx::Error> {
    let sql = format!(
        "SELECT COUNT(*), MIN(expires_at) FROM (SELECT expires_at FROM idem_record WHERE expires_at <= {now} \
         ORDER BY expires_at LIMIT {COUNT_UP_TO}) AS e"
    );
    let rows = db.rows(sql).await?;
    let (n, oldest): (i64, Option<i64>) = match rows.first() {
        Some(row) => (row.try_get(0)?, row.try_get(1)?),
        None => (0, None),
    };
    let Some(oldest) = oldest.filter(|_| n > 0) else {
        return Ok(Check::ok("expired_records", "none past its ttl"));
    };
    let count = if n >= COUNT_UP_TO { format!("more than {COUNT_UP_TO}") } else { n.to_string() };
    let records = if n == 1 { "record" } else { "records" };
    let age = now - oldest;
    if age <= expected.purge_every_ms {
        return Ok(Check::ok(
            "expired_records",
            format!(
                "{count} {records} past their ttl, the oldest for {} (within --purge-every {})",
                duration(age),
                duration(expected.purge_every_ms)
            ),
        ));
    }
    Ok(Check::warning(
        "expired_records",
        format!(
            "{count} {records} past their ttl not purged, the oldest expired {} ago (more than --purge-every {}): \
             no purge runs; they answer as absent, but the table and its indexes keep growing",
            duration(age),
            duration(expected.purge_every_ms)
        ),
        "run `idem purge` or Idem::purge_expired(limit) from a periodic job (docs/operations.md, \"Housekeeping\")",
    ))
}

async fn outbox(db: &mut Db, now: i64, expected: &Expected) -> Result<Check, sqlx::Error> {
    let sql = "SELECT CASE WHEN status = 2 THEN 'dead' ELSE 'pending' END, COUNT(*), MIN(created_at) \
               FROM idem_outbox WHERE status IN (0, 2) GROUP BY status";
    let (mut dead, mut pending, mut oldest) = (0_i64, 0_i64, None::<i64>);
    for row in db.rows(sql).await? {
        let (state, n, first): (String, i64, Option<i64>) = (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
        if state == "dead" {
            dead = n;
        } else {
            (pending, oldest) = (n, first);
        }
    }
    if dead > 0 {
        return Ok(Check::failure(
            "outbox",
            format!(
                "{dead} event{} dead (the broker refused {} or the attempts ran out): never sent; {pending} pending",
                if dead == 1 { "" } else { "s" },
                if dead == 1 { "it" } else { "them" }
            ),
            "see them with idem.outbox().dead(limit), then retry_dead(id) or discard_dead(id) (docs/messaging.md)",
        ));
    }
    match oldest {
        Some(oldest) if now - oldest > expected.outbox_stuck_ms => Ok(Check::warning(
            "outbox",
            format!(
                "{pending} event{} pending, the oldest queued {} ago (more than --outbox-stuck-after {}): no relay \
                 runs, or the broker keeps refusing",
                if pending == 1 { "" } else { "s" },
                duration(now - oldest),
                duration(expected.outbox_stuck_ms)
            ),
            "run a relay (idem.outbox().relay(..)); refusals count in idem_outbox_messages_total{result=\"refused\"}",
        )),
        Some(oldest) => {
            Ok(Check::ok("outbox", format!("{pending} pending, the oldest for {}; none dead", duration(now - oldest))))
        }
        None => Ok(Check::ok("outbox", "nothing pending, none dead")),
    }
}

/// How many of `digests` (of cached results in Redis) have a live record:
/// the digests are written as hex literals, which this function formats.
#[cfg(feature = "redis")]
pub async fn live_records(db: &mut Db, digests: &[[u8; 16]], now: i64) -> Result<i64, sqlx::Error> {
    if digests.is_empty() {
        return Ok(0);
    }
    let hex = |d: &[u8; 16]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let literal = |d: &[u8; 16]| match db.dialect {
        Dialect::Postgres => format!("'{}'::uuid", hex(d)),
        Dialect::MySql | Dialect::Sqlite => format!("X'{}'", hex(d)),
    };
    let list = digests.iter().map(literal).collect::<Vec<_>>().join(", ");
    let sql = format!("SELECT COUNT(*) FROM idem_record WHERE key_digest IN ({list}) AND expires_at > {now}");
    Ok(db.integer(sql).await?.unwrap_or_default())
}
