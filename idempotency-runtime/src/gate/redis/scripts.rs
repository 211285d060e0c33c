//! The gate's Lua scripts. Each touches the keys of one call only (one hash
//! tag: one Redis Cluster slot), so it runs atomically wherever the call's
//! keys live. `EVALSHA` ([`evalsha`]), loading the script first when the
//! server has not yet (`Link::eval`). A first call's two are in files of
//! their own (`claim.lua`, `finish.lua`): the overhead bench's `floor-gate`
//! row sends them too.

use redis::{Cmd, Script};

// The claim: a finished result of this call in the result hash of this
// window or the one before (KEYS[2], KEYS[3]), unless it expired by the
// database's clock (ARGV[4]: the record's expiry is the value's bytes 2 to
// 7, big endian); otherwise what holds the claim key (KEYS[1]); otherwise
// the claim is ours: set with the lease (ARGV[2], ms) and nil is answered.
// Our own value counts as ours: a client that resends after a lost reply
// (the cluster client does) finds it. A result found in the window before
// is copied into this window's hash (expiring ARGV[5] ms from now when the
// hash is new): a replayed result stays where one `HGET` of this window
// finds it (`RedisGate::peek`).
//
// Whatever the gate did not write is absent, and dropped: a result shorter
// than its tag, expiry and fingerprint (23 bytes, `layout`), or tagged
// neither `d` (a value) nor `f` (a recorded business error), or the value
// the caller could not read last time (ARGV[6], its response not UTF-8:
// Lua cannot tell); a result hash of another type
// (WRONGTYPE: every call of its shard and window would fail); a claim that
// is not `p:` or has no lease, or a claim key of another type (SET replaces
// it). So one corrupt entry costs one call its fast path, never an error:
// the record decides.
const CLAIM: &str = include_str!("claim.lua");

// Compare-and-delete: only the owner of the claim may drop it (a key of
// another type is no one's claim). ARGV[2] '1': duplicates may be waiting
// (`waiters.rs`): told on the channel named as the claim key.
const RELEASE: &str = r"
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if ARGV[2] == '1' then redis.call('PUBLISH', KEYS[1], '') end
  return 1
end
return 0";

// Compare-and-swap: our own claim (KEYS[1], ARGV[1]) turns into the
// finished result (ARGV[3]) in this window's result hash (KEYS[2], field
// ARGV[2]), which expires one hot window after the window ends (ARGV[4],
// ms from now; set once, when the hash is new). A key of another type where
// the hash goes is not the gate's (the claim script drops it too): replaced.
// ARGV[5] '1': duplicates may be waiting (`waiters.rs`), told as by RELEASE.
const FINISH: &str = include_str!("finish.lua");

/// The three scripts, hashed once per engine.
pub(crate) struct Scripts {
    pub claim: Script,
    pub release: Script,
    pub finish: Script,
}

impl Scripts {
    pub(crate) fn new() -> Self {
        Scripts { claim: Script::new(CLAIM), release: Script::new(RELEASE), finish: Script::new(FINISH) }
    }
}

/// `EVALSHA` of `script` over `keys`, as one command; the caller appends the
/// script's arguments. Written into one buffer: redis-rs's
/// `ScriptInvocation` allocates once per key and argument, and a claim is on
/// every call's path, replays included. 512 bytes hold a claim's keys and
/// arguments (about 300) and a cache write's with a result of 200.
pub(crate) fn evalsha(script: &Script, keys: &[&str]) -> Cmd {
    let mut cmd = Cmd::with_capacity(3 + keys.len() + 5, 512);
    cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys.len()).arg(keys);
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The claim script's idea of a readable result is the layout's.
    #[test]
    fn the_claim_script_reads_results_as_the_layout_writes_them() {
        use super::super::layout::{ERROR_TAG, VALUE_TAG, result_value};
        let shortest = result_value(0, "", "", false).len();
        let check = format!("#v < {shortest} or (tag ~= {VALUE_TAG} and tag ~= {ERROR_TAG})");
        assert!(CLAIM.contains(&check), "{CLAIM}");
    }
}
