//! Redis, one server or a cluster (found from any node's URL, as its
//! `INFO server` says): its version, each master's `maxmemory` and
//! `maxmemory-policy` (read from `INFO memory`, which managed services that
//! rename `CONFIG` still answer), a cluster's slot coverage, and whether
//! the namespace in Redis is the database's: a sample of its cached results
//! looked up among the live records.

use std::collections::BTreeSet;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, ConnectionAddr};

use super::database::{Db, Facts, live_records};
use super::{Check, Deployment, bytes, quoted};
use crate::cli::Given;

/// How long reaching a node, and each answer, may take.
const WITHIN: Duration = Duration::from_secs(5);
/// Keys a `SCAN` of one node may walk for the namespace check: a sample,
/// bounded whatever the size of the keyspace.
const SCAN_ROUNDS: usize = 10;
const SCAN_COUNT: usize = 1000;
/// Cached results looked up among the records.
const SAMPLE: usize = 200;

/// One node: where it is, and a connection to it.
struct Node {
    addr: String,
    conn: MultiplexedConnection,
}

async fn connect(client: &Client) -> Result<MultiplexedConnection, String> {
    let config = AsyncConnectionConfig::new().set_connection_timeout(Some(WITHIN)).set_response_timeout(Some(WITHIN));
    client.get_multiplexed_async_connection_with_config(&config).await.map_err(|e| e.to_string())
}

/// `INFO <section>` as `(field, value)` pairs.
async fn info(conn: &mut MultiplexedConnection, section: &str) -> Result<Vec<(String, String)>, String> {
    let text: String = redis::cmd("INFO").arg(section).query_async(conn).await.map_err(|e| e.to_string())?;
    Ok(fields(&text))
}

fn fields(text: &str) -> Vec<(String, String)> {
    text.lines().filter_map(|l| l.trim_end().split_once(':')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
}

fn field<'a>(fields: &'a [(String, String)], name: &str) -> &'a str {
    fields.iter().find(|(k, _)| k == name).map_or("", |(_, v)| v.as_str())
}

pub async fn check(url: &Given, d: &Deployment, facts: &Facts, db: Option<&mut Db>, checks: &mut Vec<Check>) {
    let unreachable = |e: &str| {
        Check::failure(
            "redis",
            format!("cannot connect ({}): {}", url.from, quoted(e)),
            "check the URL and that Redis runs: meanwhile the engines go on with the database alone (every guarantee \
             holds, replays are slower)",
        )
    };
    let client = match Client::open(url.value.as_str()) {
        Ok(client) => client,
        Err(e) => return checks.push(unreachable(&e.to_string())),
    };
    let mut seed = match connect(&client).await {
        Ok(conn) => conn,
        Err(e) => return checks.push(unreachable(&e)),
    };
    let server = match info(&mut seed, "server").await {
        Ok(server) => server,
        Err(e) => return checks.push(unreachable(&e)),
    };
    let (version, mode) = (field(&server, "redis_version").to_owned(), field(&server, "redis_mode").to_owned());
    checks.push(version_check(&version, &mode, url));
    let nodes = if mode == "cluster" {
        match cluster(&client, &mut seed).await {
            Ok((check, nodes)) => {
                checks.push(check);
                nodes
            }
            Err(e) => return checks.push(Check::failure("redis_cluster", quoted(&e), "")),
        }
    } else {
        vec![Node { addr: address(&client), conn: seed }]
    };
    let mut nodes = nodes;
    checks.push(memory(&mut nodes, mode == "cluster").await);
    checks.push(namespace(&mut nodes, d, facts, db).await);
}

fn address(client: &Client) -> String {
    match client.get_connection_info().addr() {
        ConnectionAddr::Tcp(host, port) => format!("{host}:{port}"),
        other => other.to_string(),
    }
}

fn version_check(version: &str, mode: &str, url: &Given) -> Check {
    let numbers: Vec<u32> = version.split('.').map(|n| n.parse().unwrap_or(0)).collect();
    let at_least = |major, minor| (numbers.first().copied(), numbers.get(1).copied()) >= (Some(major), Some(minor));
    let found = format!("Redis {} ({}, {})", quoted(version), quoted(mode), url.from);
    if at_least(6, 2) {
        Check::ok("redis", found)
    } else {
        Check::warning(
            "redis",
            format!("{found}: older than 6.2, which this crate is not tested on (the suite runs Redis 7)"),
            "upgrade Redis to 6.2 or later",
        )
    }
}

/// The cluster's slot coverage from the seed's view, and a connection to
/// each master (the same credentials as the seed's URL).
async fn cluster(client: &Client, seed: &mut MultiplexedConnection) -> Result<(Check, Vec<Node>), String> {
    let info: String = redis::cmd("CLUSTER").arg("INFO").query_async(seed).await.map_err(|e| e.to_string())?;
    let info = fields(&info);
    let listing: String = redis::cmd("CLUSTER").arg("NODES").query_async(seed).await.map_err(|e| e.to_string())?;
    let seed_host = match client.get_connection_info().addr() {
        ConnectionAddr::Tcp(host, _) => host.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    let mut nodes = Vec::new();
    for line in listing.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        let (Some(addr), Some(flags)) = (parts.get(1), parts.get(2)) else { continue };
        if !flags.split(',').any(|f| f == "master") || flags.contains("fail") || flags.contains("noaddr") {
            continue;
        }
        let addr = addr.split(['@', ',']).next().unwrap_or_default();
        let Some((host, port)) = addr.rsplit_once(':') else { continue };
        let host = if host.is_empty() { seed_host.clone() } else { host.to_owned() };
        let Ok(port) = port.parse::<u16>() else { continue };
        let info = client.get_connection_info().clone().set_addr(ConnectionAddr::Tcp(host.clone(), port));
        let node = Client::open(info).map_err(|e| e.to_string())?;
        let conn = connect(&node).await.map_err(|e| format!("master {host}:{port}: {e}"))?;
        nodes.push(Node { addr: format!("{host}:{port}"), conn });
    }
    nodes.sort_by(|a, b| a.addr.cmp(&b.addr));
    let (state, assigned, served) =
        (field(&info, "cluster_state"), field(&info, "cluster_slots_assigned"), field(&info, "cluster_slots_ok"));
    let masters = nodes.len();
    let check = if state == "ok" && assigned == "16384" && served == "16384" {
        Check::ok(
            "redis_cluster",
            format!(
                "a Redis Cluster, every slot (16384) served by {masters} masters: the engines need Builder::redis_cluster"
            ),
        )
    } else {
        Check::failure(
            "redis_cluster",
            format!(
                "a Redis Cluster, cluster_state {}: {} of 16384 slots assigned, {} served, by {masters} masters: \
                 calls whose keys hash to the others go on with the database alone, and a node may refuse every call",
                quoted(state),
                quoted(assigned),
                quoted(served)
            ),
            "assign every slot and bring failed masters back (redis-cli --cluster check / fix)",
        )
    };
    Ok((check, nodes))
}

/// Every node's memory bound and eviction policy; the worst node decides.
async fn memory(nodes: &mut [Node], cluster: bool) -> Check {
    let mut worst: Option<Check> = None;
    for node in nodes.iter_mut() {
        let memory = match info(&mut node.conn, "memory").await {
            Ok(memory) => memory,
            Err(e) => {
                return Check::failure(
                    "redis_memory",
                    format!("{}: INFO memory failed: {}", node.addr, quoted(&e)),
                    "",
                );
            }
        };
        let max: u64 = field(&memory, "maxmemory").parse().unwrap_or(0);
        let policy = field(&memory, "maxmemory_policy");
        let on = if cluster { format!(" on {}", node.addr) } else { String::new() };
        let limit = if max == 0 { "0 (no limit)".to_owned() } else { bytes(max) };
        const FIX: &str = "CONFIG SET maxmemory-policy noeviction, and the same in redis.conf";
        let check = if policy == "noeviction" {
            Check::ok(
                "redis_memory",
                format!(
                    "maxmemory {limit}, maxmemory-policy noeviction{}: when full, writes fail and the engines go on \
                     with the database alone",
                    if cluster { " on every master" } else { "" }
                ),
            )
        } else if max > 0 {
            Check::failure(
                "redis_memory",
                format!(
                    "maxmemory {limit} with maxmemory-policy {}{on}: once memory is full Redis evicts keys, a running \
                     call's claim among them, and a duplicate runs its body beside the first (the unique index keeps \
                     one commit, not one set of outside effects)",
                    quoted(policy)
                ),
                FIX,
            )
        } else {
            Check::warning(
                "redis_memory",
                format!(
                    "maxmemory 0 (no limit) with maxmemory-policy {}{on}: nothing is evicted now, but once a limit is \
                     set, running calls' claims can be",
                    quoted(policy)
                ),
                FIX,
            )
        };
        if worst.as_ref().is_none_or(|w| check.level > w.level) {
            worst = Some(check);
        }
    }
    worst.unwrap_or_else(|| Check::failure("redis_memory", "no master to ask", ""))
}

/// A hash's field and value, as bytes.
type Pair = (Vec<u8>, Vec<u8>);

/// What a sample of the keyspace says of the namespaces in Redis.
#[derive(Default)]
struct Seen {
    /// Every namespace whose keys the sample met.
    namespaces: BTreeSet<String>,
    /// The namespace's cached results sampled: the field (the key's
    /// digest) and the record's expiry the result carries.
    results: Vec<([u8; 16], i64)>,
}

async fn sample(nodes: &mut [Node], namespace: &str) -> Result<Seen, String> {
    let mut seen = Seen::default();
    let mut hashes = Vec::new();
    for node in nodes.iter_mut() {
        let mut cursor = 0_u64;
        for _ in 0..SCAN_ROUNDS {
            let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg("idem:{*")
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .query_async(&mut node.conn)
                .await
                .map_err(|e| e.to_string())?;
            for key in keys {
                let Some((ns, rest)) = split_key(&key) else { continue };
                if ns == namespace && rest.first() == Some(&b'r') && rest[1..].iter().all(u8::is_ascii_digit) {
                    hashes.push(key.clone());
                }
                seen.namespaces.insert(ns);
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        for hash in hashes.drain(..) {
            if seen.results.len() >= SAMPLE {
                break;
            }
            let (_, pairs): (u64, Vec<Pair>) = redis::cmd("HSCAN")
                .arg(&hash)
                .arg(0)
                .arg("COUNT")
                .arg(SAMPLE)
                .query_async(&mut node.conn)
                .await
                .map_err(|e| e.to_string())?;
            for (field, value) in pairs {
                let Ok(field) = <[u8; 16]>::try_from(field.as_slice()) else { continue };
                if let Some((expires, ..)) = idempotency_runtime::redis_layout::parse_result(value) {
                    seen.results.push((field, expires));
                }
            }
        }
    }
    seen.results.truncate(SAMPLE);
    Ok(seen)
}

/// `idem:{<namespace>.<shard>}:<rest>` as its namespace and rest.
fn split_key(key: &[u8]) -> Option<(String, &[u8])> {
    let inner = key.strip_prefix(b"idem:{")?;
    let close = inner.iter().position(|&b| b == b'}')?;
    let tag = std::str::from_utf8(&inner[..close]).ok()?;
    let (ns, _shard) = tag.rsplit_once('.')?;
    let rest = inner[close + 1..].strip_prefix(b":")?;
    Some((ns.to_owned(), rest))
}

async fn namespace(nodes: &mut [Node], d: &Deployment, facts: &Facts, db: Option<&mut Db>) -> Check {
    let given = d.namespace.as_ref().map(|g| g.value.clone());
    let Some(ns) = given.clone().or(facts.namespace.clone()) else {
        return Check::warning(
            "redis_namespace",
            "not checked: the database's namespace is unknown (see the checks above)",
            "run `idem migrate`, or pass the engines' namespace with --namespace",
        );
    };
    if let (Some(given), Some(own)) = (&given, &facts.namespace)
        && given != own
    {
        return Check::warning(
            "redis_namespace",
            format!(
                "--namespace {} is not the database's ({}): engines that set it share claims and results only with \
                 engines that set it too; those that do not use the database's",
                quoted(given),
                quoted(own)
            ),
            "set the same namespace on every engine of this database (Builder::redis_namespace), or none",
        );
    }
    let seen = match sample(nodes, &ns).await {
        Ok(seen) => seen,
        Err(e) => return Check::failure("redis_namespace", format!("SCAN failed: {}", quoted(&e)), ""),
    };
    let shown = quoted(&ns);
    if !seen.namespaces.contains(&ns) {
        let others: Vec<String> = seen.namespaces.iter().map(|n| quoted(n)).collect();
        if others.is_empty() {
            return Check::ok("redis_namespace", format!("{shown} (the database's); Redis holds no key of idem now"));
        }
        return Check::warning(
            "redis_namespace",
            format!(
                "no key of {shown} (the database's) among the keys sampled, which are of {}: other databases' \
                 engines use this Redis, or these engines set another namespace",
                others.join(", ")
            ),
            "if the engines set a namespace (Builder::redis_namespace), pass it with --namespace",
        );
    }
    let (Some(db), Some(now)) = (db, facts.now_ms) else {
        return Check::ok("redis_namespace", format!("{shown}: keys present (the records were not read)"));
    };
    let live: Vec<[u8; 16]> = seen.results.iter().filter(|(_, expires)| *expires > now).map(|(d, _)| *d).collect();
    let found = match live_records(db, &live, now).await {
        Ok(found) => found,
        Err(e) => {
            return Check::failure("redis_namespace", format!("records unreadable: {}", quoted(&e.to_string())), "");
        }
    };
    let missing = live.len() as i64 - found;
    if missing > 0 {
        return Check::failure(
            "redis_namespace",
            format!(
                "{missing} of {} cached results sampled in {shown} have no live record in the database: a database \
                 restored from a backup (or records deleted by hand); the engines replay those results as if the \
                 calls had run",
                live.len()
            ),
            format!(
                "delete the namespace's keys (redis-cli --scan --pattern 'idem:{{{ns}.*' | xargs redis-cli del), or give \
                 the database a new namespace (docs/design-choices.md)"
            ),
        );
    }
    Check::ok(
        "redis_namespace",
        format!("{shown} (the database's): {} cached results sampled, each with its live record", live.len()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_before_6_2_warn() {
        let url = Given { value: "redis://h".into(), from: "IDEM_REDIS_URL" };
        let level = |v: &str| version_check(v, "standalone", &url).level;
        use super::super::Level::{Ok, Warning};
        assert_eq!((level("7.0.15"), level("6.2.0"), level("10.0.1")), (Ok, Ok, Ok));
        assert_eq!((level("6.0.20"), level("5.0.7"), level("")), (Warning, Warning, Warning));
    }

    #[test]
    fn keys_name_their_namespace() {
        assert_eq!(split_key(b"idem:{shop_1.41}:r2945040"), Some(("shop_1".to_owned(), &b"r2945040"[..])));
        assert_eq!(split_key(b"idem:{a.b.7}:pay:k1"), Some(("a.b".to_owned(), &b"pay:k1"[..])));
        assert_eq!(split_key(b"idem:{nodot}:x"), None);
        assert_eq!(split_key(b"other:{a.1}:x"), None);
    }
}
