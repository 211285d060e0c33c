//! What each command does and prints.

use std::collections::{BTreeSet, HashSet};
use std::io::{BufRead, Write};

use idempotency_runtime::Status;
use serde_json::{Value, json};

use crate::Done;
use crate::cli::{CallId, Cli, Command, RecordField, State};
use crate::ident::Ident;
use crate::store::{Dialect, Failure, ListFilter, Record, Store};
use crate::time::{parse_duration, rfc3339};
use idempotency_runtime::redis_layout::Location;

pub async fn run(cli: Cli) -> Result<Done, Failure> {
    let Some(url) = cli.global.database_url.as_deref() else {
        return Ok(Done::Usage("no database: set IDEM_DATABASE_URL or pass --database-url".into()));
    };
    // Everything the user typed is checked before anything is opened.
    if let Some(refused) = check(&cli.command) {
        return Ok(Done::Usage(refused));
    }
    let global = &cli.global;
    if global.transaction_pooler && Dialect::of(url)? != Dialect::Postgres {
        return Ok(Done::Usage("--transaction-pooler: for PostgreSQL only (a postgres: URL)".into()));
    }
    let store =
        Store::open(url, global.redis_url.as_deref(), global.namespace.clone(), global.transaction_pooler).await?;
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
            println!("migrated: the tables are this version's");
            Ok(Done::Ok)
        }
        Command::Purge { batch, .. } => {
            let n = store.purge_expired(batch).await?;
            println!("purged {n} expired record{}", if n == 1 { "" } else { "s" });
            Ok(Done::Ok)
        }
        Command::Reconcile { biz, table, column, record_field, stuck_after, limit, json } => {
            let table = Ident::parse("table", &table, true).map_err(|e| e.to_string())?;
            let column = Ident::parse("column", &column, false).map_err(|e| e.to_string())?;
            let stuck_after = parse_duration(&stuck_after)?;
            reconcile(&store, Reconcile { biz: &biz, table, column, record_field, stuck_after, limit }, json).await
        }
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
        Command::Reconcile { biz, table, column, stuck_after, .. } => biz_ok(biz)
            .or_else(|| Ident::parse("table", table, true).err().map(|e| e.to_string()))
            .or_else(|| Ident::parse("column", column, false).err().map(|e| e.to_string()))
            .or_else(|| duration_ok("--stuck-after", stuck_after)),
    }
}

fn print_json(value: &Value) {
    println!("{}", serde_json::to_string_pretty(value).unwrap_or_default());
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
        print_json(&out);
    } else {
        match response {
            Some(response) => println!("{name} {response}"),
            None => println!("{name}"),
        }
    }
    Ok(Done::Ok)
}

/// What Redis holds for a call: its claim, or its cached result.
enum RedisEntry {
    NotConfigured,
    NoNamespace,
    Absent(Location),
    Claimed { at: Location, lease_ms: i64 },
    Cached { at: Location, hashes: Vec<String>, expires_at: i64 },
    Other { at: Location },
    Unreachable(String),
}

async fn redis_entry(store: &Store, id: &CallId) -> Result<RedisEntry, Failure> {
    if store.redis.is_none() {
        return Ok(RedisEntry::NotConfigured);
    }
    let Some(at) = store.redis_location(&id.biz, &id.key).await? else { return Ok(RedisEntry::NoNamespace) };
    let claim = match store.redis_get(&at.claim).await {
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
    let results = match store.redis_results(&at).await {
        Err(e) => return Ok(RedisEntry::Unreachable(e.to_string())),
        Ok(results) => results,
    };
    let expires_at = results.iter().find_map(|(_, v)| idempotency_runtime::redis_layout::parse_result(v.clone()));
    Ok(match expires_at {
        Some((expires_at, ..)) => {
            RedisEntry::Cached { at, hashes: results.into_iter().map(|(hash, _)| hash).collect(), expires_at }
        }
        None if results.is_empty() => RedisEntry::Absent(at),
        None => RedisEntry::Other { at },
    })
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
                json!({ "key": at.claim, "state": "cached", "in": hashes, "expires_at": rfc3339(*expires_at) })
            }
            RedisEntry::Other { at } => json!({ "key": at.claim, "state": "unknown_value" }),
            RedisEntry::Unreachable(e) => json!({ "state": "unreachable", "error": e }),
        }
    }

    fn text(&self) -> String {
        match self {
            RedisEntry::NotConfigured => "redis: not configured (IDEM_REDIS_URL)".into(),
            RedisEntry::NoNamespace => "redis: no namespace (idem_meta has none; pass --namespace)".into(),
            RedisEntry::Absent(at) => format!("redis {}\n  absent", at.claim),
            RedisEntry::Claimed { at, lease_ms } => {
                format!("redis {}\n  claimed by a running call, lease ends in {lease_ms} ms", at.claim)
            }
            RedisEntry::Cached { at, hashes, expires_at } => {
                format!("redis {}\n  cached result until {} (in {})", at.claim, rfc3339(*expires_at), hashes.join(", "))
            }
            RedisEntry::Other { at } => format!("redis {}\n  a value idem did not write", at.claim),
            RedisEntry::Unreachable(e) => format!("redis: unreachable ({e})"),
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

async fn show(store: &Store, id: &CallId, as_json: bool) -> Result<Done, Failure> {
    let record = store.record(&id.biz, &id.key).await?;
    let redis = redis_entry(store, id).await?;
    if as_json {
        print_json(
            &json!({ "record": record.as_ref().map(|r| record_json(r, store.now_ms())), "redis": redis.json() }),
        );
        return Ok(Done::Ok);
    }
    match &record {
        None => println!("record {} {}\n  none", id.biz, id.key),
        Some(r) => {
            let expired = if r.expires_at <= store.now_ms() { " (expired)" } else { "" };
            println!("record {} {}", r.biz, r.key);
            println!("  id          {}", r.id);
            println!("  state       {}", r.state);
            println!("  biz_no      {}", r.biz_no.as_deref().unwrap_or("-"));
            println!("  params_hash {}", r.params_hash);
            println!("  created_at  {}", rfc3339(r.created_at));
            println!("  updated_at  {}", rfc3339(r.updated_at));
            println!("  expires_at  {}{expired}", rfc3339(r.expires_at));
            println!("  response    {}", r.response.as_deref().unwrap_or("-"));
        }
    }
    println!("{}", redis.text());
    Ok(Done::Ok)
}

async fn list(store: &Store, filter: &ListFilter<'_>, as_json: bool) -> Result<Done, Failure> {
    let records = store.list(filter).await?;
    if as_json {
        print_json(&Value::Array(records.iter().map(|r| record_json(r, store.now_ms())).collect()));
        return Ok(Done::Ok);
    }
    let width = records.iter().map(|r| r.key.len()).max().unwrap_or(0).max(3);
    println!("{:width$}  {:10}  {:24}  {:24}  BIZ_NO", "KEY", "STATE", "CREATED_AT", "EXPIRES_AT");
    for r in &records {
        let (created, expires) = (rfc3339(r.created_at), rfc3339(r.expires_at));
        let biz_no = r.biz_no.as_deref().unwrap_or("-");
        println!("{:width$}  {:10}  {created:24}  {expires:24}  {biz_no}", r.key, r.state);
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
        println!("nothing to forget for {} {}", id.biz, id.key);
        return Ok(Done::Ok);
    }
    if !yes {
        let mut prompt = String::from("about to remove:\n");
        if let Some(r) = &record {
            prompt += &format!(
                "  record {} {} (id {}, {}, expires {})\n",
                r.biz,
                r.key,
                r.id,
                r.state,
                rfc3339(r.expires_at)
            );
        }
        match &redis {
            RedisEntry::Claimed { at, .. } | RedisEntry::Other { at } => {
                prompt += &format!("  redis entry {}\n", at.claim)
            }
            RedisEntry::Cached { at, hashes, .. } => {
                prompt += &format!("  redis cached result of {} (in {})\n", at.claim, hashes.join(", "))
            }
            _ => {}
        }
        if matches!(redis, RedisEntry::Claimed { .. }) {
            prompt += "  (a call holds the claim now: forgetting lets a duplicate run beside it)\n";
        }
        prompt += "  (instances with a local replay cache may still answer it for up to their max_age)\n";
        eprint!("{prompt}forget? [y/N] ");
        let _ = std::io::stderr().flush();
        let mut answer = String::new();
        let _ = std::io::stdin().lock().read_line(&mut answer);
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            eprintln!("not confirmed; nothing removed");
            return Ok(Done::Found);
        }
    }
    let mut removed = false;
    if let Some(r) = &record
        && store.delete(&id.biz, &id.key).await?
    {
        println!("removed record {} {} (id {}, {})", r.biz, r.key, r.id, r.state);
        removed = true;
    }
    match &redis {
        RedisEntry::Claimed { at, .. } | RedisEntry::Other { at } if store.redis_del(&at.claim).await? => {
            println!("removed redis entry {}", at.claim);
            removed = true;
        }
        RedisEntry::Cached { at, hashes, .. } => {
            for hash in hashes {
                if store.redis_hdel(hash, at).await? {
                    println!("removed redis cached result of {} from {hash}", at.claim);
                    removed = true;
                }
            }
        }
        _ => {}
    }
    if removed {
        println!("{LOCAL_CACHES}");
    }
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
        print_json(&json!({
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
            let biz_no = rec.biz_no.as_deref().unwrap_or("-");
            format!("  {}  biz_no={biz_no}  {}  created {}", rec.key, rec.state, rfc3339(rec.created_at))
        };
        println!("reconcile {}: idem_record.{} against {}.{}", r.biz, r.record_field.name(), r.table, r.column);
        println!("records without a business row: {}", without_row.len());
        without_row.iter().take(r.limit).for_each(|rec| println!("{}", line(rec)));
        println!("business rows without a record: {}", without_record.len());
        without_record.iter().take(r.limit).for_each(|v| println!("  {}", v.2));
        println!("records stuck in processing: {}", stuck.len());
        stuck.iter().take(r.limit).for_each(|rec| println!("{}", line(rec)));
        println!("{}", if found == 0 { "nothing found".to_owned() } else { format!("{found} found") });
    }
    Ok(if found == 0 { Done::Ok } else { Done::Found })
}
