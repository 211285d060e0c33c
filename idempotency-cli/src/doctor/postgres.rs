//! PostgreSQL: a transaction pooler in front of it, and the settings the
//! engines' connections get (`lock_timeout`,
//! `idle_in_transaction_session_timeout`, the default isolation level), read
//! from `pg_settings` as a new session of the URL sees them (its `options`
//! included).

use std::time::Duration;

use sqlx::{AnyConnection, Row};

use super::database::{Db, connect};
use super::{Check, Deployment, Expected, duration, quoted};

pub async fn check(db: &mut Db, d: &Deployment, expected: &Expected, checks: &mut Vec<Check>) {
    checks.push(match probe(db, &d.url.value).await {
        Ok(seen) => pooler(seen, d),
        Err(e) => Check::failure("pooler", format!("the probe failed: {}", quoted(&e)), ""),
    });
    let sql = "SELECT name::text, setting::text FROM pg_settings \
               WHERE name IN ('lock_timeout', 'idle_in_transaction_session_timeout', 'default_transaction_isolation')";
    let settings = match db.settings(sql).await {
        Ok(settings) => settings,
        Err(e) => {
            checks.push(Check::failure("settings", format!("pg_settings unreadable: {}", quoted(&e.to_string())), ""));
            return;
        }
    };
    let get = |name: &str| settings.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()).unwrap_or_default();
    let ms = |name: &str| get(name).parse::<i64>().unwrap_or_default();
    checks.push(lock_timeout(ms("lock_timeout"), expected));
    checks.push(idle_in_transaction(ms("idle_in_transaction_session_timeout"), expected));
    checks.push(isolation(&get("default_transaction_isolation")));
}

/// What the probe saw of the server session behind one connection.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    /// The same server session throughout.
    OneSession,
    /// Another server session after a transaction (backend pids).
    Changed(i64, i64),
    /// Its next statement waited while another connection held a
    /// transaction: a pooler with one server connection to share.
    Waited,
}

/// How long a statement may wait for a server connection another
/// connection holds before the probe lets that one go.
const HOLD: Duration = Duration::from_secs(2);

/// A transaction pooler shows from the client as a session that changes
/// between transactions: `db`'s connection asks its backend's pid, a second
/// connection opens a transaction (through a pooler it takes the server
/// connection `db`'s just gave back, PgBouncer handing out the last one
/// returned first), and `db`'s asks again. Directly, or through a session
/// pooler, the pid stays. Three rounds, for poolers that pick otherwise.
async fn probe(db: &mut Db, url: &str) -> Result<Seen, String> {
    let mut other = connect(url).await?;
    let seen = rounds(&mut db.conn, &mut other).await.map_err(|e| e.to_string());
    let _ = sqlx::Connection::close(other).await;
    seen
}

async fn rounds(conn: &mut AnyConnection, other: &mut AnyConnection) -> Result<Seen, sqlx::Error> {
    for _ in 0..3 {
        let first = backend_pid(conn).await?;
        sqlx::raw_sql("BEGIN").execute(&mut *other).await?;
        backend_pid(other).await?;
        let next = backend_pid(conn);
        tokio::pin!(next);
        let (next, waited) = tokio::select! {
            next = &mut next => (next?, false),
            _ = tokio::time::sleep(HOLD) => {
                sqlx::raw_sql("COMMIT").execute(&mut *other).await?;
                (next.await?, true)
            }
        };
        if waited {
            return Ok(Seen::Waited);
        }
        sqlx::raw_sql("COMMIT").execute(&mut *other).await?;
        if next != first {
            return Ok(Seen::Changed(first, next));
        }
    }
    Ok(Seen::OneSession)
}

async fn backend_pid(conn: &mut AnyConnection) -> Result<i64, sqlx::Error> {
    sqlx::raw_sql("SELECT pg_backend_pid()::bigint").fetch_one(conn).await?.try_get(0)
}

const POOLER_DOC: &str = "docs/scaling-out.md, \"PostgreSQL behind a transaction pooler\"";

fn pooler(seen: Seen, d: &Deployment) -> Check {
    let found = match seen {
        Seen::OneSession if d.pooler => {
            return Check::warning(
                "pooler",
                "--transaction-pooler is given, but this connection kept one server session across transactions: no \
                 transaction pooler on this path; the switch costs a round trip per statement",
                "drop the switch (Builder::transaction_pooler, --transaction-pooler) unless the applications reach \
                 PostgreSQL through a transaction pooler this host does not",
            );
        }
        Seen::OneSession => {
            return Check::ok("pooler", "no transaction pooler: one server session across transactions");
        }
        Seen::Changed(first, next) => {
            format!(
                "this connection's server session changed between two transactions (backend pid {first}, then {next})"
            )
        }
        Seen::Waited => "this connection waited for a server connection while another held a transaction".to_owned(),
    };
    if d.pooler {
        return Check::ok(
            "pooler",
            format!(
                "a transaction pooler, and --transaction-pooler says so ({found}): the engines need Builder::transaction_pooler(true)"
            ),
        );
    }
    Check::failure(
        "pooler",
        format!(
            "a transaction pooler in front of PostgreSQL ({found}), without the switch: statements the engines \
             prepare by name fail there (`prepared statement \"sqlx_s_1\" already exists`)"
        ),
        format!(
            "build the engines with Builder::transaction_pooler(true) and pass --transaction-pooler to idem ({POOLER_DOC})"
        ),
    )
}

/// A body blocked on a row lock longer than its claim's lease lets a
/// duplicate past the expired claim to run its body beside it: the record
/// keeps one commit, but what the body does outside the database may
/// happen twice. The engines bound their own waits (`SET LOCAL`).
fn lock_timeout(ms: i64, expected: &Expected) -> Check {
    let lease = duration(expected.lease_ms);
    if ms > 0 && ms < expected.lease_ms {
        return Check::ok(
            "lock_timeout",
            format!(
                "{}: a body's lock wait ends within the lease ({lease}; the engines bound their own)",
                duration(ms)
            ),
        );
    }
    let set = if ms == 0 { "0 (no bound)".to_owned() } else { duration(ms) };
    Check::warning(
        "lock_timeout",
        format!(
            "{set}: a body blocked on a row lock may outlive its claim's lease (--lease {lease}), and a duplicate then \
             runs its body beside it; the record keeps one commit, but what a body does outside the database may \
             happen twice"
        ),
        "set a lock_timeout below the lease for the engines' role (ALTER ROLE app SET lock_timeout = '10s', or \
         options=-c lock_timeout=10s in the URL)",
    )
}

/// A body idle in its transaction (awaiting an outside call) longer than
/// the server allows loses its session: the call fails, and its retry runs
/// the body again.
fn idle_in_transaction(ms: i64, expected: &Expected) -> Check {
    let lease = duration(expected.lease_ms);
    match ms {
        0 => Check::ok("idle_in_transaction", "0 (off): a body may wait inside its transaction for its whole lease"),
        ms if ms >= expected.lease_ms => {
            Check::ok("idle_in_transaction", format!("{}: not below the lease (--lease {lease})", duration(ms)))
        }
        ms => Check::warning(
            "idle_in_transaction",
            format!(
                "idle_in_transaction_session_timeout {} is below the lease (--lease {lease}): a body waiting inside its \
                 transaction longer than that (an outside call) loses its connection, the call fails and its retry runs \
                 the body again",
                duration(ms)
            ),
            "raise it above the longest lease for the engines' role (ALTER ROLE app SET \
             idle_in_transaction_session_timeout = '5min'), or to 0",
        ),
    }
}

fn isolation(level: &str) -> Check {
    if level == "read committed" || level == "read uncommitted" {
        return Check::ok("isolation", format!("default_transaction_isolation {}", quoted(level)));
    }
    Check::warning(
        "isolation",
        format!(
            "default_transaction_isolation {}: a body writing rows a concurrent transaction changed fails with a \
             serialization error (40001), answered retry-later, instead of waiting; the record still decides",
            quoted(level)
        ),
        "ALTER ROLE app SET default_transaction_isolation = 'read committed', unless the bodies need this level",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expected(lease_ms: i64) -> Expected {
        Expected { max_result_bytes: 1 << 20, lock_wait_ms: 5000, lease_ms, purge_every_ms: 0, outbox_stuck_ms: 0 }
    }

    #[test]
    fn timeouts_are_held_to_the_lease() {
        let level = |c: Check| c.level;
        use super::super::Level::{Ok, Warning};
        assert_eq!(level(lock_timeout(0, &expected(30_000))), Warning);
        assert_eq!(level(lock_timeout(10_000, &expected(30_000))), Ok);
        assert_eq!(level(lock_timeout(30_000, &expected(30_000))), Warning);
        assert_eq!(level(idle_in_transaction(0, &expected(30_000))), Ok);
        assert_eq!(level(idle_in_transaction(10_000, &expected(30_000))), Warning);
        assert_eq!(level(idle_in_transaction(60_000, &expected(30_000))), Ok);
        assert_eq!(level(isolation("read committed")), Ok);
        assert_eq!(level(isolation("serializable")), Warning);
    }
}
