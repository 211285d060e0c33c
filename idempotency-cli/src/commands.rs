//! What each command does and prints. Every value shown comes from a
//! request, the database or Redis, so each is escaped ([`crate::escape`])
//! and every line goes out through [`crate::out`].

use std::collections::{BTreeSet, HashSet};
use std::io::BufRead;

use idempotency_runtime::Status;
use serde_json::{Value, json};

use crate::cli::{CallId, Cli, Command, Given, RecordField, State};
use crate::doctor::{self, Deployment, Expected};
use crate::escape::{self, text};
use crate::ident::Ident;
use crate::out::{ask, say, tell};
use crate::redis_store::{self, Location};
use crate::store::{Dialect, ListFilter, Record, Store};
use crate::time::{parse_duration, rfc3339};
use crate::{Done, Failure};
use crate::{drivers, out};

/// What a command opens, from its flags and the environment.
struct Settings {
    url: Given,
    dialect: Dialect,
    redis: Option<Given>,
    namespace: Option<Given>,
    pooler: bool,
}

/// The settings of `cli`, or why they are refused (a usage error):
/// everything typed or set is checked before anything is opened.
fn settings(cli: &Cli) -> Result<Settings, String> {
    let global = &cli.global;
    let url = global.database_url()?.ok_or("no database: pass --database-url or set IDEM_DATABASE_URL")?;
    if let Some(refused) = check(&cli.command) {
        return Err(refused);
    }
    let dialect = drivers::database(&url)?;
    let pooler = global.transaction_pooler()?;
    if pooler && dialect != Dialect::Postgres {
        return Err("--transaction-pooler: for PostgreSQL only (a postgres: URL)".into());
    }
    // Only the commands that look at Redis open it: a Redis URL set for the
    // applications does not stop `idem list` in a build without Redis.
    let redis = match &cli.command {
        Command::Status { .. } | Command::Show { .. } | Command::Forget { .. } | Command::Doctor(_) => {
            global.redis_url()?
        }
        _ => None,
    };
    if let Some(redis) = &redis {
        drivers::redis(redis)?;
    }
    let namespace = global.namespace()?;
    if let Some(ns) = &namespace {
        idempotency_runtime::Namespace::new(&ns.value).map_err(|e| format!("{}: {e}", ns.from))?;
    }
    Ok(Settings { url, dialect, redis, namespace, pooler })
}

pub async fn run(cli: Cli) -> Result<Done, Failure> {
    let s = match settings(&cli) {
        Ok(settings) => settings,
        Err(refused) => return Ok(Done::Usage(refused)),
    };
    if let Command::Doctor(args) = &cli.command {
        let deployment =
            Deployment { url: s.url, dialect: s.dialect, redis: s.redis, namespace: s.namespace, pooler: s.pooler };
        return doctor::run(deployment, args).await;
    }
    let redis = redis_store::open(s.redis.as_ref())?;
    let store = Store::open(s.url, s.dialect, redis, s.namespace, s.pooler).await?;
    match cli.command {
        Command::Status { id, json } => status(&store, &id, json).await,
        Command::Show { id, json } => show(&store, &id, json).await,
        Command::List { biz, state, older_than, limit, json } => {
            let created_before = older_than.map(|d| parse_duration(&d).map(|ms| store.now_ms() - ms)).transpose()?;
            let filter = ListFilter {
                biz: &biz,
                processing: state.map(|s| s == State::Processing),
                created_before,
                limit: i64::from(limit),
            };
            list(&store, &filter, json).await
        }
        Command::Forget { id, yes } => forget(&store, &id, yes).await,
        Command::Migrate => {
            store.migrate().await?;
            say("migrated: the tables are this version's");
            Ok(Done::Ok)
        }
        Command::Purge { batch, .. } => purge(&store, batch).await,
        Command::Reconcile { biz, table, column, record_field, stuck_after, limit, json } => {
            let table = Ident::parse("table", &table, true).map_err(|e| e.to_string())?;
            let column = Ident::parse("column", &column, false).map_err(|e| e.to_string())?;
            let stuck_after = parse_duration(&stuck_after)?;
            reconcile(&store, Reconcile { biz: &biz, table, column, record_field, stuck_after, limit }, json).await
        }
        Command::Doctor(_) => unreachable!("answered before the store opened"),
    }
}

/// The first argument that breaks a rule, as a message.
fn check(command: &Command) -> Option<String> {
    let biz_ok =
        |biz: &str| (!idempotency_rules::is_valid_biz(biz)).then(|| format!("biz {biz:?}: expected [a-z0-9_]{{1,32}}"));
    let id_ok = |id: &CallId| {
        biz_ok(&id.biz).or_else(|| {
            idempotency_rules::check_key(&id.key, 1, idempotency_rules::MAX_KEY_LEN).err().map(|e| format!("key: {e}"))
        })
    };
    let duration_ok = |what: &str, d: &str| parse_duration(d).err().map(|e| format!("{what}: {e}"));
    match command {
        Command::Status { id, .. } | Command::Show { id, .. } | Command::Forget { id, .. } => id_ok(id),
        Command::List { biz, older_than, .. } => {
            biz_ok(biz).or_else(|| older_than.as_deref().and_then(|d| duration_ok("--older-than", d)))
        }
        Command::Purge { .. } | Command::Migrate => None,
        Command::Doctor(args) => Expected::of(args).err(),
        Command::Reconcile { biz, table, column, stuck_after, .. } => biz_ok(biz)
            .or_else(|| Ident::parse("table", table, true).err().map(|e| e.to_string()))
            .or_else(|| Ident::parse("column", column, false).err().map(|e| e.to_string()))
            .or_else(|| duration_ok("--stuck-after", stuck_after)),
    }
}

/// A stored response as JSON (it always is; kept as text otherwise).
fn response_json(response: &str) -> Value {
    serde_json::from_str(response).unwrap_or_else(|_| Value::String(response.to_owned()))
}

async fn status(store: &Store, id: &CallId, as_json: bool) -> Result<Done, Failure> {
    let status = store.status(&id.biz, &id.key).await?;
    let (name, response) = match &status {
        Status::Absent => ("absent", None),
        Status::InProgress => ("in_progress", None),
        Status::Completed { response } => ("completed", Some(response)),
        Status::Expired => ("expired", None),
        _ => ("unknown", None),
    };
    if as_json {
        let mut out = json!({ "biz": id.biz, "key": id.key, "status": name });
        if let Some(response) = response {
            out["response"] = response_json(response);
        }
        out::json(&out);
    } else {
        match response {
            Some(response) => say(&format!("{name} {}", escape::response(response))),
            None => say(name),
        }
    }
    Ok(Done::Ok)
}

/// What Redis holds for a call: its claim, or its cached result.
enum RedisEntry {
    NotConfigured,
    NoNamespace,
    Absent(Location),
    Claimed {
        at: Location,
        lease_ms: i64,
    },
    /// In the result hashes named (bytes: a name is any key a `SCAN` of the
    /// shard's prefix found).
    Cached {
        at: Location,
        hashes: Vec<Vec<u8>>,
        expires_at: i64,
    },
    Other {
        at: Location,
    },
    Unreachable(String),
}

async fn redis_entry(store: &Store, id: &CallId) -> Result<RedisEntry, Failure> {
    let Some(redis) = &store.redis else { return Ok(RedisEntry::NotConfigured) };
    let Some(at) = store.redis_location(&id.biz, &id.key).await? else { return Ok(RedisEntry::NoNamespace) };
    let claim = match redis.get(&at.claim).await {
        Err(e) => return Ok(RedisEntry::Unreachable(e.to_string())),
        Ok(claim) => claim,
    };
    if let Some((value, ttl)) = claim {
        return Ok(if value.starts_with(b"p:") {
            RedisEntry::Claimed { at, lease_ms: ttl }
        } else {
            RedisEntry::Other { at }
        });
    }
    let results = match redis.results(&at).await {
        Err(e) => return Ok(RedisEntry::Unreachable(e.to_string())),
        Ok(results) => results,
    };
    let expires_at = results.iter().find_map(|(_, v)| redis.result_expiry(v));
    Ok(match expires_at {
        Some(expires_at) => {
            RedisEntry::Cached { at, hashes: results.into_iter().map(|(hash, _)| hash).collect(), expires_at }
        }
        None if results.is_empty() => RedisEntry::Absent(at),
        None => RedisEntry::Other { at },
    })
}

/// A result hash's name as text (not UTF-8: with U+FFFD in place).
fn hash_name(hash: &[u8]) -> String {
    String::from_utf8_lossy(hash).into_owned()
}

/// Result hashes' names, escaped, as a list.
fn hash_names(hashes: &[Vec<u8>]) -> String {
    hashes.iter().map(|h| text(&hash_name(h)).into_owned()).collect::<Vec<_>>().join(", ")
}

impl RedisEntry {
    fn json(&self) -> Value {
        match self {
            RedisEntry::NotConfigured => json!({ "state": "not_configured" }),
            RedisEntry::NoNamespace => json!({ "state": "no_namespace" }),
            RedisEntry::Absent(at) => json!({ "key": at.claim, "state": "absent" }),
            RedisEntry::Claimed { at, lease_ms } => {
                json!({ "key": at.claim, "state": "claimed", "lease_ms": lease_ms })
            }
            RedisEntry::Cached { at, hashes, expires_at } => {
                let hashes: Vec<String> = hashes.iter().map(|h| hash_name(h)).collect();
                json!({ "key": at.claim, "state": "cached", "in": hashes, "expires_at": rfc3339(*expires_at) })
            }
            RedisEntry::Other { at } => json!({ "key": at.claim, "state": "unknown_value" }),
            RedisEntry::Unreachable(e) => json!({ "state": "unreachable", "error": e }),
        }
    }

    /// What `show` prints of it, a line each.
    fn lines(&self) -> Vec<String> {
        let key = |at: &Location| format!("redis {}", text(&at.claim));
        match self {
            RedisEntry::NotConfigured => vec!["redis: not configured (IDEM_REDIS_URL)".into()],
            RedisEntry::NoNamespace => vec!["redis: no namespace (idem_meta has none; pass --namespace)".into()],
            RedisEntry::Absent(at) => vec![key(at), "  absent".into()],
            RedisEntry::Claimed { at, lease_ms } => {
                vec![key(at), format!("  claimed by a running call, lease ends in {lease_ms} ms")]
            }
            RedisEntry::Cached { at, hashes, expires_at } => {
                vec![key(at), format!("  cached result until {} (in {})", rfc3339(*expires_at), hash_names(hashes))]
            }
            RedisEntry::Other { at } => vec![key(at), "  a value idem did not write".into()],
            RedisEntry::Unreachable(e) => vec![format!("redis: unreachable ({})", text(e))],
        }
    }

    /// Whether Redis holds something of the call to delete.
    fn held(&self) -> bool {
        matches!(self, RedisEntry::Claimed { .. } | RedisEntry::Cached { .. } | RedisEntry::Other { .. })
    }
}

fn record_json(r: &Record, now_ms: i64) -> Value {
    json!({
        "id": r.id,
        "biz": r.biz,
        "key": r.key,
        "biz_no": r.biz_no,
        "state": r.state,
        "params_hash": r.params_hash,
        "created_at": rfc3339(r.created_at),
        "updated_at": rfc3339(r.updated_at),
        "expires_at": rfc3339(r.expires_at),
        "expired": r.expires_at <= now_ms,
        "response": r.response.as_deref().map(response_json),
    })
}

/// A record's biz and key, escaped, as `show`, `forget` and the prompt name it.
fn call_name(biz: &str, key: &str) -> String {
    format!("{} {}", text(biz), text(key))
}

async fn show(store: &Store, id: &CallId, as_json: bool) -> Result<Done, Failure> {
    let record = store.record(&id.biz, &id.key).await?;
    let redis = redis_entry(store, id).await?;
    if as_json {
        out::json(&json!({ "record": record.as_ref().map(|r| record_json(r, store.now_ms())), "redis": redis.json() }));
        return Ok(Done::Ok);
    }
    match &record {
        None => {
            say(&format!("record {}", call_name(&id.biz, &id.key)));
            say("  none");
        }
        Some(r) => {
            let expired = if r.expires_at <= store.now_ms() { " (expired)" } else { "" };
            say(&format!("record {}", call_name(&r.biz, &r.key)));
            say(&format!("  id          {}", r.id));
            say(&format!("  state       {}", r.state));
            say(&format!("  biz_no      {}", r.biz_no.as_deref().map_or("-".into(), text)));
            say(&format!("  params_hash {}", text(&r.params_hash)));
            say(&format!("  created_at  {}", rfc3339(r.created_at)));
            say(&format!("  updated_at  {}", rfc3339(r.updated_at)));
            say(&format!("  expires_at  {}{expired}", rfc3339(r.expires_at)));
            say(&format!("  response    {}", r.response.as_deref().map_or("-".into(), escape::response)));
        }
    }
    redis.lines().iter().for_each(|line| say(line));
    Ok(Done::Ok)
}

async fn list(store: &Store, filter: &ListFilter<'_>, as_json: bool) -> Result<Done, Failure> {
    let records = store.list(filter).await?;
    if as_json {
        out::json(&Value::Array(records.iter().map(|r| record_json(r, store.now_ms())).collect()));
        return Ok(Done::Ok);
    }
    // Escaped first, so that the columns line up on what is shown.
    let keys: Vec<String> = records.iter().map(|r| text(&r.key).into_owned()).collect();
    let width = keys.iter().map(|k| k.chars().count()).max().unwrap_or(0).max(3);
    say(&format!("{:width$}  {:10}  {:24}  {:24}  BIZ_NO", "KEY", "STATE", "CREATED_AT", "EXPIRES_AT"));
    for (r, key) in records.iter().zip(&keys) {
        let (created, expires) = (rfc3339(r.created_at), rfc3339(r.expires_at));
        let biz_no = r.biz_no.as_deref().map_or("-".into(), text);
        say(&format!("{key:width$}  {:10}  {created:24}  {expires:24}  {biz_no}", r.state));
    }
    Ok(Done::Ok)
}

async fn forget(store: &Store, id: &CallId, yes: bool) -> Result<Done, Failure> {
    let record = store.record(&id.biz, &id.key).await?;
    let redis = redis_entry(store, id).await?;
    if let RedisEntry::Unreachable(e) = &redis {
        return Err(format!("redis unreachable, nothing removed: {e}").into());
    }
    if record.is_none() && !redis.held() {
        say(&format!("nothing to forget for {}", call_name(&id.biz, &id.key)));
        return Ok(Done::Ok);
    }
    if !yes {
        tell("about to remove:");
        if let Some(r) = &record {
            let (name, expires) = (call_name(&r.biz, &r.key), rfc3339(r.expires_at));
            tell(&format!("  record {name} (id {}, {}, expires {expires})", r.id, r.state));
        }
        match &redis {
            RedisEntry::Claimed { at, .. } | RedisEntry::Other { at } => {
                tell(&format!("  redis entry {}", text(&at.claim)))
            }
            RedisEntry::Cached { at, hashes, .. } => {
                tell(&format!("  redis cached result of {} (in {})", text(&at.claim), hash_names(hashes)))
            }
            _ => {}
        }
        if matches!(redis, RedisEntry::Claimed { .. }) {
            tell("  (a call holds the claim now: forgetting lets a duplicate run beside it)");
        }
        tell("  (instances with a local replay cache may still answer it for up to their max_age)");
        ask("forget? [y/N]");
        let mut answer = String::new();
        let _ = std::io::stdin().lock().read_line(&mut answer);
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            tell("not confirmed; nothing removed");
            return Ok(Done::Found);
        }
    }
    let mut removed = false;
    if let Some(r) = &record
        && store.delete(&id.biz, &id.key).await?
    {
        say(&format!("removed record {} (id {}, {})", call_name(&r.biz, &r.key), r.id, r.state));
        removed = true;
    }
    if let Some(redis_store) = &store.redis {
        match &redis {
            RedisEntry::Claimed { at, .. } | RedisEntry::Other { at } if redis_store.del(&at.claim).await? => {
                say(&format!("removed redis entry {}", text(&at.claim)));
                removed = true;
            }
            RedisEntry::Cached { at, hashes, .. } => {
                for hash in hashes {
                    if redis_store.hdel(hash, at).await? {
                        let (claim, hash) = (text(&at.claim), hash_name(hash));
                        say(&format!("removed redis cached result of {claim} from {}", text(&hash)));
                        removed = true;
                    }
                }
            }
            _ => {}
        }
    }
    if removed {
        say(LOCAL_CACHES);
    }
    Ok(Done::Ok)
}

/// Deletes what is expired, having said how many records of each biz
/// that is: on a database several services share, what belongs to whom.
/// Every biz's, as an engine's own purge does: an expired record counts as
/// absent for every engine, so deleting it changes no answer.
async fn purge(store: &Store, batch: u32) -> Result<Done, Failure> {
    let by_biz = store.expired_by_biz().await?;
    if !by_biz.is_empty() {
        say("expired records by biz:");
        for (biz, n) in &by_biz {
            say(&format!("{n:>10}  {}", text(biz)));
        }
    }
    let n = store.purge_expired(batch).await?;
    say(&format!("purged {n} expired record{}", if n == 1 { "" } else { "s" }));
    Ok(Done::Ok)
}

/// What `forget` cannot reach: the copies instances keep in memory.
const LOCAL_CACHES: &str = "note: instances with a local replay cache (Builder::local_cache) may answer the forgotten \
result until their LocalCache::max_age has passed (10 s unless set); wait that long before relying on a new call executing";

struct Reconcile<'a> {
    biz: &'a str,
    table: Ident,
    column: Ident,
    record_field: RecordField,
    stuck_after: i64,
    limit: usize,
}

async fn reconcile(store: &Store, r: Reconcile<'_>, as_json: bool) -> Result<Done, Failure> {
    let records = store.all_of(r.biz).await?;
    let rows: HashSet<String> = store.values(&r.table, &r.column).await?.into_iter().collect();
    let field = |rec: &Record| match r.record_field {
        RecordField::IdemKey => Some(rec.key.clone()),
        RecordField::BizNo => rec.biz_no.clone(),
    };
    let without_row: Vec<&Record> =
        records.iter().filter(|rec| field(rec).is_none_or(|value| !rows.contains(&value))).collect();
    let recorded: HashSet<String> = records.iter().filter_map(field).collect();
    // Numbers in their order, then text.
    let without_record: BTreeSet<(u8, i128, String)> = rows
        .iter()
        .filter(|v| !recorded.contains(*v))
        .map(|v| match v.parse::<i128>() {
            Ok(n) => (0, n, v.clone()),
            Err(_) => (1, 0, v.clone()),
        })
        .collect();
    let stuck_before = store.now_ms() - r.stuck_after;
    let stuck: Vec<&Record> =
        records.iter().filter(|rec| rec.state == "processing" && rec.created_at <= stuck_before).collect();
    let found = without_row.len() + without_record.len() + stuck.len();

    let brief = |rec: &&Record| json!({ "key": rec.key, "biz_no": rec.biz_no, "state": rec.state, "created_at": rfc3339(rec.created_at) });
    if as_json {
        out::json(&json!({
            "biz": r.biz,
            "table": r.table.to_string(),
            "column": r.column.to_string(),
            "record_field": r.record_field.name(),
            "records_without_row": {
                "count": without_row.len(),
                "items": without_row.iter().take(r.limit).map(brief).collect::<Vec<_>>(),
            },
            "rows_without_record": {
                "count": without_record.len(),
                "items": without_record.iter().take(r.limit).map(|v| v.2.clone()).collect::<Vec<_>>(),
            },
            "stuck_in_processing": {
                "count": stuck.len(),
                "items": stuck.iter().take(r.limit).map(brief).collect::<Vec<_>>(),
            },
            "found": found,
        }));
    } else {
        let line = |rec: &Record| {
            let biz_no = rec.biz_no.as_deref().map_or("-".into(), text);
            format!("  {}  biz_no={biz_no}  {}  created {}", text(&rec.key), rec.state, rfc3339(rec.created_at))
        };
        let field = r.record_field.name();
        say(&format!("reconcile {}: idem_record.{field} against {}.{}", text(r.biz), r.table, r.column));
        say(&format!("records without a business row: {}", without_row.len()));
        without_row.iter().take(r.limit).for_each(|rec| say(&line(rec)));
        say(&format!("business rows without a record: {}", without_record.len()));
        without_record.iter().take(r.limit).for_each(|v| say(&format!("  {}", text(&v.2))));
        say(&format!("records stuck in processing: {}", stuck.len()));
        stuck.iter().take(r.limit).for_each(|rec| say(&line(rec)));
        say(&if found == 0 { "nothing found".to_owned() } else { format!("{found} found") });
    }
    Ok(if found == 0 { Done::Ok } else { Done::Found })
}
