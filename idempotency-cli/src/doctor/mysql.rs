//! MySQL and MariaDB: the settings a new session of the URL gets
//! (`SHOW VARIABLES`: `max_allowed_packet` against the result bound,
//! `innodb_lock_wait_timeout`, the isolation level), and, on a Galera
//! node, the node's state and `wsrep_sync_wait`.

use super::database::Db;
use super::{Check, Expected, bytes, duration, quoted};

/// What a record's insert carries besides its result: the key, `biz_no`,
/// the fingerprint and the statement itself, with room to spare.
const ROW_BESIDES_RESULT: u64 = 16 << 10;

pub async fn check(db: &mut Db, expected: &Expected, checks: &mut Vec<Check>) {
    let sql = "SHOW VARIABLES WHERE Variable_name IN ('max_allowed_packet', 'innodb_lock_wait_timeout', \
               'tx_isolation', 'transaction_isolation', 'wsrep_on', 'wsrep_sync_wait')";
    let vars = match db.settings(sql).await {
        Ok(vars) => vars,
        Err(e) => {
            checks.push(Check::failure("settings", format!("SHOW VARIABLES failed: {}", quoted(&e.to_string())), ""));
            return;
        }
    };
    let get = |name: &str| vars.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
    let number = |name: &str| get(name).and_then(|v| v.parse::<u64>().ok()).unwrap_or_default();
    checks.push(max_allowed_packet(number("max_allowed_packet"), expected));
    let secs = number("innodb_lock_wait_timeout");
    checks.push(lock_wait_timeout(i64::try_from(secs).unwrap_or(i64::MAX).saturating_mul(1000), db.mariadb, expected));
    let level = get("transaction_isolation").or(get("tx_isolation")).unwrap_or_default().to_owned();
    checks.push(isolation(&level));
    if get("wsrep_on") == Some("ON") {
        checks.extend(galera(db, number("wsrep_sync_wait")).await);
    }
}

fn max_allowed_packet(packet: u64, expected: &Expected) -> Check {
    let (packet_shown, bound) = (bytes(packet), bytes(expected.max_result_bytes));
    let needed = expected.max_result_bytes + ROW_BESIDES_RESULT;
    if packet >= needed {
        return Check::ok(
            "max_allowed_packet",
            format!("{packet_shown}: a record with a result of the largest size (--max-result-bytes {bound}) fits"),
        );
    }
    let fits = packet.saturating_sub(ROW_BESIDES_RESULT);
    Check::failure(
        "max_allowed_packet",
        format!(
            "{packet_shown}, below the result bound (--max-result-bytes {bound}) and the rest of the row: a result \
             between {} and {bound} passes the engine's bound, then the server refuses its record after its body ran \
             (StorageRefused), and every retry runs the body again",
            bytes(fits)
        ),
        format!(
            "SET GLOBAL max_allowed_packet = {} (and in the server's configuration), or lower Builder::max_result_bytes \
             to {fits} and pass --max-result-bytes {fits}",
            needed.next_power_of_two()
        ),
    )
}

/// MariaDB bounds the engines' own waits per statement (`SET STATEMENT`);
/// MySQL has no such form, so a duplicate without Redis waits this long,
/// not `lock_wait`. Either way a body blocked on a row lock longer than its
/// lease lets a duplicate past the expired claim.
fn lock_wait_timeout(ms: i64, mariadb: bool, expected: &Expected) -> Check {
    let (set, lease, wait) = (duration(ms), duration(expected.lease_ms), duration(expected.lock_wait_ms));
    if !mariadb && ms > expected.lock_wait_ms {
        return Check::warning(
            "innodb_lock_wait_timeout",
            format!(
                "{set}: MySQL cannot bound one statement's wait, so a duplicate without Redis waits this long for the \
                 first call, not the engines' lock_wait (--lock-wait {wait})"
            ),
            format!(
                "SET GLOBAL innodb_lock_wait_timeout = {} (or on the pool's connections)",
                (expected.lock_wait_ms / 1000).max(1)
            ),
        );
    }
    if ms >= expected.lease_ms {
        return Check::warning(
            "innodb_lock_wait_timeout",
            format!(
                "{set}: a body blocked on a row lock may outlive its claim's lease (--lease {lease}), and a duplicate \
                 then runs its body beside it; the record keeps one commit, but what a body does outside the \
                 database may happen twice"
            ),
            format!(
                "SET GLOBAL innodb_lock_wait_timeout = {} (below the lease; or on the pool's connections)",
                (expected.lease_ms / 3000).max(1)
            ),
        );
    }
    let own = if mariadb { "the engines bound their own waits per statement" } else { "within --lock-wait" };
    Check::ok("innodb_lock_wait_timeout", format!("{set}: a body's lock wait ends within the lease ({lease}; {own})"))
}

fn isolation(level: &str) -> Check {
    match level {
        "REPEATABLE-READ" | "READ-COMMITTED" => Check::ok("isolation", quoted(level)),
        "READ-UNCOMMITTED" => Check::failure(
            "isolation",
            "READ-UNCOMMITTED: a duplicate can read a record its call has not committed, and replay a result that \
             then rolls back",
            "SET GLOBAL transaction_isolation = 'REPEATABLE-READ' (tx_isolation before MariaDB 11.1; and in the \
             server's configuration)",
        ),
        other => Check::warning(
            "isolation",
            format!(
                "{}: plain reads take shared locks, so bodies meet more lock waits and deadlocks (1213, answered \
                 retry-later); the record still decides",
                quoted(other)
            ),
            "REPEATABLE-READ (the default) or READ-COMMITTED, unless the bodies need this level",
        ),
    }
}

/// A Galera node: serving (synced, in the primary component), and
/// `wsrep_sync_wait` making reads wait for what other nodes committed.
async fn galera(db: &mut Db, sync_wait: u64) -> Vec<Check> {
    let sql = "SHOW STATUS WHERE Variable_name IN ('wsrep_ready', 'wsrep_cluster_status', \
               'wsrep_local_state_comment', 'wsrep_cluster_size')";
    let status = match db.settings(sql).await {
        Ok(status) => status,
        Err(e) => return vec![Check::failure("galera", format!("SHOW STATUS failed: {}", quoted(&e.to_string())), "")],
    };
    let get = |name: &str| status.iter().find(|(n, _)| n == name).map_or("?", |(_, v)| v.as_str());
    let (ready, component, state, size) =
        (get("wsrep_ready"), get("wsrep_cluster_status"), get("wsrep_local_state_comment"), get("wsrep_cluster_size"));
    let node = format!(
        "a Galera node: {}, {} component of {} node{}",
        quoted(state),
        quoted(component),
        quoted(size),
        if size == "1" { "" } else { "s" }
    );
    let serving = if ready == "ON" && component == "Primary" && state == "Synced" {
        Check::ok("galera", node)
    } else {
        Check::failure(
            "galera",
            format!("{node}, wsrep_ready {}: it does not serve writes now", quoted(ready)),
            "take it out of the pool until it is Synced in the primary component",
        )
    };
    let wait = if sync_wait & 1 == 1 {
        Check::ok("wsrep_sync_wait", format!("{sync_wait}: reads wait until this node applied what others committed"))
    } else {
        Check::warning(
            "wsrep_sync_wait",
            format!(
                "{sync_wait} (as a new connection gets it): the loser of a certification conflict may read the \
                 record before this node applied the winner's commit, and answer InProgress instead of the replay"
            ),
            "SET GLOBAL wsrep_sync_wait = 7, or set it in the pool's after_connect (docs/scaling-out.md, \"MariaDB \
             Galera\")",
        )
    };
    vec![serving, wait]
}

#[cfg(test)]
mod tests {
    use super::super::Level;
    use super::*;

    fn expected() -> Expected {
        Expected {
            max_result_bytes: 1 << 20,
            lock_wait_ms: 5000,
            lease_ms: 30_000,
            purge_every_ms: 0,
            outbox_stuck_ms: 0,
        }
    }

    #[test]
    fn the_packet_must_hold_the_largest_result_and_its_row() {
        assert_eq!(max_allowed_packet(16 << 20, &expected()).level, Level::Ok);
        let small = max_allowed_packet(1 << 20, &expected());
        assert_eq!(small.level, Level::Failure);
        assert!(small.found.contains("between 1008 KiB and 1 MiB"), "{}", small.found);
        assert!(small.fix.unwrap().starts_with("SET GLOBAL max_allowed_packet = 2097152 "));
    }

    #[test]
    fn lock_waits_are_held_to_the_lease_and_on_mysql_to_lock_wait() {
        assert_eq!(lock_wait_timeout(50_000, true, &expected()).level, Level::Warning);
        assert_eq!(lock_wait_timeout(10_000, true, &expected()).level, Level::Ok);
        assert_eq!(lock_wait_timeout(10_000, false, &expected()).level, Level::Warning);
        assert_eq!(lock_wait_timeout(5_000, false, &expected()).level, Level::Ok);
        assert_eq!(isolation("READ-UNCOMMITTED").level, Level::Failure);
        assert_eq!(isolation("SERIALIZABLE").level, Level::Warning);
        assert_eq!(isolation("REPEATABLE-READ").level, Level::Ok);
    }
}
