//! Tokens in Redis, for an engine with Redis: through the claim gate's
//! connection, timeout and namespace.
//!
//! Two keys per token, each read or written alone (one key per command or
//! script, so Redis Cluster routes every one):
//!
//! | key | value | lives |
//! |---|---|---|
//! | `idem:<ns>:tok.live:<biz>:<subject>:<token>` | `<expires_ms>` | until the token expires or is consumed |
//! | `idem:<ns>:tok.owner:<biz>:<token>` | `i:<expires_ms>:<subject>` (issued), `u:<expires_ms>:<subject>` (used) | until the token expires; once used, `used_for` (and at least as long) |
//!
//! Consuming is one `GETDEL` of the live key (Redis 6.2 and later), or a
//! Lua script doing `GET` and `DEL` in one step where `GETDEL` is missing;
//! never a `GET` then a `DEL`, which lets two concurrent submits both take
//! the token. The subject is part of the live key: another subject's
//! `GETDEL` names a key that does not exist, and touches nothing. When the
//! `GETDEL` finds nothing, the owner key tells why: gone (never issued or
//! expired), another subject's, or used by this one.
//!
//! `tok.live` and `tok.owner` hold a `.`, which no `biz` can: these keys
//! never meet a claim's `idem:<ns>:<biz>:<key>`. Expiries are set with
//! `PX` and the time left (`PXAT` came with `GETDEL`, in 6.2), and the
//! absolute expiry rides in each value, compared with this process's clock
//! like the records' expiries.

use std::sync::{Arc, LazyLock};

use redis::Script;

use super::{Found, SpentToken, TokenError};
use crate::engine::token_settings::Settings;
use crate::gate::redis::{RedisGate, Reply};
use crate::namespace::Namespace;
use crate::store::{Backend, Db, TokenId};

/// `GETDEL` for servers without it: the same answer, in one step.
const GETDEL: &str = r"
local v = redis.call('GET', KEYS[1])
if v then redis.call('DEL', KEYS[1]) end
return v";

static GETDEL_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(GETDEL));

/// Looks at a token that is issued to this subject, live, and missing
/// from its live key (another submit is consuming it or giving it back)
/// this many times before taking it as already used.
const ATTEMPTS: usize = 3;

const UNREACHABLE: &str = "redis did not answer in time";
const REFUSED: &str = "redis refused the operation";
const NO_NAMESPACE: &str = "no namespace for redis keys yet (the database unread, or never migrated: run Idem::migrate, or set Builder::redis_namespace)";

/// Stores a token just drawn: owner key first, `NX`, so a token drawn
/// twice is refused (`Ok(false)`) before its live key exists.
pub(super) async fn issue<DB: Backend>(
    gate: &Arc<RedisGate>,
    db: &Db<DB>,
    id: TokenId<'_>,
    now_ms: u64,
    expires_at_ms: u64,
) -> Result<bool, TokenError> {
    let namespace = namespace(gate, db).await?;
    let ttl = expires_at_ms.saturating_sub(now_ms).max(1);
    let mut owner = redis::cmd("SET");
    owner.arg(owner_key(&namespace, id.biz, id.token)).arg(owner_value(Owner::Issued, expires_at_ms, id.subject));
    owner.arg("PX").arg(ttl).arg("NX");
    if answer::<Option<String>>(gate.send(&owner).await)?.is_none() {
        return Ok(false);
    }
    let mut live = redis::cmd("SET");
    live.arg(live_key(&namespace, id)).arg(expires_at_ms).arg("PX").arg(ttl);
    answer::<()>(gate.send(&live).await)?;
    Ok(true)
}

/// Consumes `id` at `now_ms`.
pub(super) async fn consume<DB: Backend>(
    gate: &Arc<RedisGate>,
    db: &Db<DB>,
    settings: &Settings,
    id: TokenId<'_>,
    now_ms: u64,
) -> Result<Found, TokenError> {
    let namespace = namespace(gate, db).await?;
    let live = live_key(&namespace, id);
    let owner = owner_key(&namespace, id.biz, id.token);
    for _ in 0..ATTEMPTS {
        if let Some(value) = take(gate, settings, &live).await? {
            // Redis keeps a key to its own clock, a little past ours.
            let Some(expires_at_ms) = live_expiry(&value, now_ms) else {
                return Ok(Found::Unknown);
            };
            mark_used(gate, settings, &owner, id.subject, expires_at_ms, now_ms).await;
            return Ok(Found::Consumed { expires_at_ms });
        }
        let mut get = redis::cmd("GET");
        get.arg(&owner);
        let Some(value) = answer::<Option<Vec<u8>>>(gate.send(&get).await)? else {
            return Ok(Found::Unknown);
        };
        let Some((state, expires_at_ms, subject)) = parse_owner(&value) else {
            return Ok(Found::Unknown); // not a value this module wrote
        };
        match state {
            Owner::Issued if expires_at_ms <= now_ms => return Ok(Found::Unknown),
            _ if subject != id.subject => return Ok(Found::OtherSubject),
            Owner::Used => return Ok(Found::AlreadyUsed),
            // Issued, live, ours, and not in its live key: taken by a
            // submit that has not marked it used yet, or being given back.
            Owner::Issued => continue,
        }
    }
    Ok(Found::AlreadyUsed)
}

/// Puts a consumed token back for the rest of its life: the owner key says
/// "issued" again, then the live key returns (`NX`). In between, a submit
/// finds it issued but not live, and takes it as already used: it reaches
/// the record keyed by the token, as every submit of the token does.
pub(super) async fn give_back<DB: Backend>(
    gate: &Arc<RedisGate>,
    db: &Db<DB>,
    spent: &SpentToken,
    now_ms: u64,
) -> Result<bool, TokenError> {
    let namespace = namespace(gate, db).await?;
    let id = spent.id();
    let owner = owner_key(&namespace, id.biz, id.token);
    if spent.expires_at_ms <= now_ms {
        // Expired meanwhile: unknown from now on, not "already used".
        let mut del = redis::cmd("DEL");
        del.arg(&owner);
        answer::<i64>(gate.send(&del).await)?;
        return Ok(false);
    }
    let left = spent.expires_at_ms - now_ms;
    let mut issued = redis::cmd("SET");
    issued.arg(&owner).arg(owner_value(Owner::Issued, spent.expires_at_ms, id.subject)).arg("PX").arg(left);
    answer::<()>(gate.send(&issued).await)?;
    let mut live = redis::cmd("SET");
    live.arg(live_key(&namespace, id)).arg(spent.expires_at_ms).arg("PX").arg(left).arg("NX");
    answer::<Option<String>>(gate.send(&live).await)?;
    Ok(true)
}

/// `GETDEL key`, or the script doing the same where the server lacks it.
/// Bytes, not a `String`: a value that is not UTF-8 is not one this module
/// wrote, not a failed reply (read as a `String`, it answered 503).
async fn take(gate: &RedisGate, settings: &Settings, key: &str) -> Result<Option<Vec<u8>>, TokenError> {
    if !settings.lua() {
        let mut getdel = redis::cmd("GETDEL");
        getdel.arg(key);
        match gate.send::<Option<Vec<u8>>>(&getdel).await {
            Reply::Value(value) => return Ok(value),
            // An error reply: the command did not run (Redis before 6.2
            // does not know it), so the script may run in its place.
            Reply::Refused(e) => {
                settings.set_lua(true);
                tracing::warn!(error = %e, "redis refused GETDEL; tokens are consumed with a Lua script from now on");
            }
            Reply::Unreachable => return Err(TokenError::Unavailable(UNREACHABLE)),
        }
    }
    answer(gate.send_script(&GETDEL_SCRIPT.key(key)).await)
}

/// Marks the owner key used, for `used_for` and at least the token's life.
/// Failing, the token stays consumed (its live key is gone) and its owner
/// key says "issued" until it expires: a resubmission meanwhile is still
/// taken as already used.
async fn mark_used(gate: &RedisGate, settings: &Settings, owner: &str, subject: &str, expires_at_ms: u64, now_ms: u64) {
    // Redis refuses an expiry past 2^63 ms: a longer one is a century.
    let used_for = u64::try_from(crate::clock::bounded(settings.used_for).as_millis()).unwrap_or(u64::MAX);
    let keep = used_for.max(expires_at_ms.saturating_sub(now_ms)).max(1);
    let mut used = redis::cmd("SET");
    used.arg(owner).arg(owner_value(Owner::Used, expires_at_ms, subject)).arg("PX").arg(keep);
    if let Err(e) = answer::<()>(gate.send(&used).await) {
        tracing::warn!(error = %e, "a consumed token could not be marked used");
    }
}

fn answer<T>(reply: Reply<T>) -> Result<T, TokenError> {
    match reply {
        Reply::Value(value) => Ok(value),
        Reply::Refused(e) => {
            tracing::warn!(error = %e, "redis refused a token operation");
            Err(TokenError::Unavailable(REFUSED))
        }
        Reply::Unreachable => Err(TokenError::Unavailable(UNREACHABLE)),
    }
}

async fn namespace<DB: Backend>(gate: &RedisGate, db: &Db<DB>) -> Result<Namespace, TokenError> {
    gate.namespace(db).await.ok_or(TokenError::Unavailable(NO_NAMESPACE))
}

/// What the owner key says of its token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner {
    Issued,
    Used,
}

pub(crate) fn owner_value(state: Owner, expires_at_ms: u64, subject: &str) -> String {
    let tag = match state {
        Owner::Issued => 'i',
        Owner::Used => 'u',
    };
    format!("{tag}:{expires_at_ms}:{subject}")
}

pub(crate) fn parse_owner(value: &[u8]) -> Option<(Owner, u64, &str)> {
    let (tag, rest) = std::str::from_utf8(value).ok()?.split_once(':')?;
    let (expires, subject) = rest.split_once(':')?;
    let state = match tag {
        "i" => Owner::Issued,
        "u" => Owner::Used,
        _ => return None,
    };
    Some((state, decimal(expires)?, subject))
}

/// The expiry a live key holds (`<expires_ms>`), if it is still ahead of
/// `now_ms`.
pub(crate) fn live_expiry(value: &[u8], now_ms: u64) -> Option<u64> {
    decimal(std::str::from_utf8(value).ok()?).filter(|&at| at > now_ms)
}

/// The key a `GETDEL` consumes. Neither the namespace, `biz`, the subject
/// nor the token holds a `:`, so no two tokens share it.
fn live_key(namespace: &Namespace, id: TokenId<'_>) -> String {
    format!("idem:{namespace}:tok.live:{}:{}:{}", id.biz, id.subject, id.token)
}

fn owner_key(namespace: &Namespace, biz: &str, token: &str) -> String {
    format!("idem:{namespace}:tok.owner:{biz}:{token}")
}

/// A number as idempotency writes it into a Redis value: decimal digits, no
/// sign, no leading zero. `str::parse` also takes `+5` and `05`, which idempotency
/// never writes: read as numbers, such foreign values would pass for ours.
fn decimal(text: &str) -> Option<u64> {
    let canonical =
        !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) && (text == "0" || !text.starts_with('0'));
    if canonical { text.parse().ok() } else { None }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_values_read_back() {
        let issued = owner_value(Owner::Issued, 42, "alice");
        assert_eq!(parse_owner(issued.as_bytes()), Some((Owner::Issued, 42, "alice")));
        let used = owner_value(Owner::Used, 7, "a.b-c");
        assert_eq!(parse_owner(used.as_bytes()), Some((Owner::Used, 7, "a.b-c")));
        for garbage in [&b""[..], b"x:1:alice", b"i:x:alice", b"i:1", b"u", b"i:1:\xff"] {
            assert_eq!(parse_owner(garbage), None, "{garbage:?}");
        }
    }

    /// Regression (found by fuzzing: `fuzz/`, target `redis_cached_value`):
    /// a token key holding bytes that are not UTF-8 failed the conversion
    /// of the reply, so consuming answered "Redis unavailable" (503) and
    /// the claims backed off. It is a value this module did not write: the
    /// token is unknown.
    #[cfg(feature = "sqlite")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn values_that_are_not_utf8_are_unknown_tokens() {
        let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let client = redis::Client::open(url).expect("redis url");
        let mut conn = match client.get_multiplexed_async_connection().await {
            Ok(conn) => conn,
            Err(e) => {
                assert!(std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(), "redis unreachable: {e}");
                eprintln!("skipped: redis unreachable ({e})");
                return;
            }
        };
        let namespace = Namespace::new("t_unit").unwrap();
        let clock = Arc::new(crate::clock::Clock::new(false));
        let gate = Arc::new(RedisGate::new(
            crate::gate::redis::Target::Single(client),
            std::time::Duration::from_secs(2),
            Some(namespace.clone()),
            crate::gate::redis::DEFAULT_HOT_WINDOW,
            Arc::clone(&clock),
        ));
        // The namespace is fixed: the database is never asked.
        let pool = sqlx::sqlite::SqlitePoolOptions::new().connect_lazy("sqlite::memory:").unwrap();
        let pool = crate::store::Db::new(pool, crate::store::Pooling::Session);
        let token = crate::random::token();
        let id = TokenId { biz: "t_bytes", token: &token, subject: "alice" };
        let (live, owner) = (live_key(&namespace, id), owner_key(&namespace, id.biz, id.token));
        let settings = Settings::default();
        let now = u64::try_from(clock.now_ms()).unwrap();
        for (key, value) in [(&live, &b"\xff9999999999999"[..]), (&owner, b"i:\xff:alice")] {
            let _: () =
                redis::cmd("SET").arg(key).arg(value).arg("PX").arg(60_000).query_async(&mut conn).await.unwrap();
        }
        // The live key's bytes: consumed by GETDEL, and no expiry in them.
        assert_eq!(consume(&gate, &pool, &settings, id, now).await.unwrap(), Found::Unknown);
        // Then the owner key's: not a value this module wrote.
        assert_eq!(consume(&gate, &pool, &settings, id, now).await.unwrap(), Found::Unknown);
        let _: i64 = redis::cmd("DEL").arg(&live).arg(&owner).query_async(&mut conn).await.unwrap();
    }

    /// Regression (found by fuzzing: `fuzz/`, target `redis_cached_value`):
    /// an expiry with a sign or a leading zero read as one, though this
    /// module never writes one: only what it would have written reads back.
    #[test]
    fn only_canonical_expiries_read_back() {
        for garbage in [&b"u:+1800000000005:alice"[..], b"u:01800000000005:alice", b"i: 5:alice"] {
            assert_eq!(parse_owner(garbage), None, "{garbage:?}");
        }
        for garbage in [&b"+1800000000005"[..], b"01800000000005", b" 1800000000005"] {
            assert_eq!(live_expiry(garbage, 0), None, "{garbage:?}");
        }
        assert_eq!(live_expiry(b"1800000000005", 0), Some(1_800_000_000_005));
    }

    #[test]
    fn keys_never_meet_a_claim_key() {
        let ns = Namespace::new("n1").unwrap();
        let id = TokenId { biz: "pay", token: "T", subject: "alice" };
        assert_eq!(live_key(&ns, id), "idem:n1:tok.live:pay:alice:T");
        assert_eq!(owner_key(&ns, "pay", "T"), "idem:n1:tok.owner:pay:T");
        // A claim key is `idem:{<ns>.<shard>}:...`, a brace where these have the namespace.
        assert!(!live_key(&ns, id).contains('{') && !owner_key(&ns, "pay", "T").contains('{'));
    }
}
