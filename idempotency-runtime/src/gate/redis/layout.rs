//! Where the Redis gate keeps what, and in which bytes.
//!
//! - A **claim**, while a call runs: the string `idem:{<ns>.<shard>}:<biz>:<key>`
//!   holding `p:<owner token>:<fingerprint>`, with the lease as its Redis TTL.
//!   Claims live as long as calls run: few, short-lived, and readable by eye.
//! - A **finished result**, for fast replays during the hot window: one
//!   field in a hash per shard and per window of time,
//!   `idem:{<ns>.<shard>}:r<window>`. The field is 16 bytes of a digest of
//!   `(biz, key)`; the value is `d`, the record's expiry (6 bytes, big
//!   endian, epoch ms on the database's clock), the first 16 bytes of the
//!   fingerprint, then the response. A window's hash expires one hot window
//!   after the window ends, so a result stays between one and two hot
//!   windows, and Redis holds about `rate × 1.5 × hot window` results at a
//!   time, whatever the records' ttl. A result replayed from the window
//!   before is copied into the current one (the claim script does it), so a
//!   key that keeps being replayed stays where one `HGET` finds it.
//!
//! A hash per window spends no per-key overhead (a key's own entry, object
//! and expiry cost Redis about 110 bytes) on each result: a 150-byte
//! response costs about 250 bytes instead of 440. Every key of one
//! `(biz, key)` carries the same hash tag, `{<ns>.<shard>}`, so a script
//! touching the claim and the result hashes stays in one Redis Cluster
//! slot; 64 shards spread the results over the cluster.

use std::time::Duration;

use crate::fingerprint::{Hex, write_lower_hex};
use crate::namespace::Namespace;
use crate::random::push_token;

/// How many result hashes each window is spread over (and so how many
/// Redis Cluster slots one namespace's results use).
pub(crate) const SHARDS: u16 = 64;
/// Bytes of the fingerprint kept with a cached result: 128 bits tell two
/// argument lists apart as surely as the full digest does in practice.
const FINGERPRINT_BYTES: usize = 16;
/// `d`, then the expiry: the bytes before the fingerprint.
const EXPIRY_END: usize = 7;
const FINGERPRINT_END: usize = EXPIRY_END + FINGERPRINT_BYTES;

/// Where one `(biz, key)` lives in Redis.
#[derive(Debug, Clone)]
pub(crate) struct Place {
    /// `idem:{<ns>.<shard>}:`: every key of this call starts so.
    prefix: String,
    /// The claim's key.
    pub claim: String,
    /// The call's field in the result hashes.
    pub field: [u8; 16],
}

/// The name of `field`'s result hash in `window`: what [`Place::results`]
/// names, without the claim's key (a read of the result alone). As a
/// command's argument it is written straight into the command's buffer: a
/// replay names its hash on every read.
pub(crate) struct ResultsName<'a> {
    pub namespace: &'a Namespace,
    pub field: &'a [u8; 16],
    pub window: i64,
}

impl ResultsName<'_> {
    /// Its length in bytes, to size a command before it is written.
    pub(crate) fn len(&self) -> usize {
        // `idem:{`, `.` and `}:r`; the shard, two digits at most; the window, 20.
        self.namespace.as_str().len() + 10 + 2 + 20
    }

    /// Writes the name a piece at a time into `put`.
    fn write(&self, mut put: impl FnMut(&str)) {
        write_prefix(self.namespace, self.field, &mut put);
        put("r");
        put(itoa::Buffer::new().format(self.window));
    }
}

impl redis::ToRedisArgs for ResultsName<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        // Put together on the stack and handed over at once: a piece at a
        // time, each went through the command's `io::Write`. A name is at
        // most 96 bytes (a namespace at most 64 of them), so it fits; were
        // it cut, a replay would only miss its result and claim.
        let mut name = [0u8; 128];
        let mut len = 0;
        self.write(|piece| {
            if let Some(room) = name.get_mut(len..len + piece.len()) {
                room.copy_from_slice(piece.as_bytes());
                len += piece.len();
            }
        });
        out.write_arg(&name[..len]);
    }
}

/// [`ResultsName`] as text.
#[cfg(test)]
pub(crate) fn results_of(namespace: &Namespace, field: &[u8; 16], window: i64) -> String {
    let mut name = String::new();
    ResultsName { namespace, field, window }.write(|piece| name.push_str(piece));
    name
}

/// Writes `idem:{<ns>.<shard>}:`, the start of every key of `field`'s call,
/// a piece at a time into `put`.
fn write_prefix(namespace: &Namespace, field: &[u8; 16], mut put: impl FnMut(&str)) {
    let shard = u16::from_be_bytes([field[0], field[1]]) % SHARDS;
    put("idem:{");
    put(namespace.as_str());
    put(".");
    put(itoa::Buffer::new().format(shard));
    put("}:");
}

/// Appends `n` in decimal, as `write!` would, without the formatting
/// machinery (a replay names a result hash on every read).
fn push_decimal(out: &mut String, n: i64) {
    out.push_str(itoa::Buffer::new().format(n));
}

impl Place {
    pub(crate) fn of(namespace: &Namespace, biz: &str, key: &str) -> Place {
        Place::at(namespace, biz, key, crate::key::key_digest(biz, key))
    }

    /// [`Place::of`], given the key's digest ([`crate::key::key_digest`]).
    pub(crate) fn at(namespace: &Namespace, biz: &str, key: &str, field: [u8; 16]) -> Place {
        let mut prefix = String::with_capacity(16 + namespace.as_str().len());
        write_prefix(namespace, &field, |piece| prefix.push_str(piece));
        let claim = [prefix.as_str(), biz, ":", key].concat();
        Place { prefix, claim, field }
    }

    /// The result hash of `window` (see [`window_of`]).
    pub(crate) fn results(&self, window: i64) -> String {
        // Sized up front: `format!` guesses short and grows, twice per claim.
        let mut name = String::with_capacity(self.prefix.len() + 21);
        name.push_str(&self.prefix);
        name.push('r');
        push_decimal(&mut name, window);
        name
    }

    /// The result hashes a lookup at `now_ms` reads: this window's and the
    /// one before (a result written then still lives).
    pub(crate) fn results_at(&self, now_ms: i64, hot: Duration) -> [String; 2] {
        let window = window_of(now_ms, hot);
        [self.results(window), self.results(window - 1)]
    }
}

/// The window `now_ms` falls in: windows are one hot window long.
pub(crate) fn window_of(now_ms: i64, hot: Duration) -> i64 {
    now_ms.div_euclid(hot_ms(hot))
}

/// How long the hash of the window `now_ms` falls in must live from now:
/// to one hot window past the window's end.
pub(crate) fn results_ttl_ms(now_ms: i64, hot: Duration) -> i64 {
    let hot = hot_ms(hot);
    ((now_ms.div_euclid(hot) + 2) * hot - now_ms).max(1)
}

fn hot_ms(hot: Duration) -> i64 {
    i64::try_from(hot.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// A claim's value, `p:<owner token>:<fingerprint>`, in one allocation.
pub(crate) fn claim_value(fingerprint: &str) -> String {
    let mut value = String::with_capacity(2 + 32 + 1 + fingerprint.len());
    value.push_str("p:");
    push_token(&mut value);
    value.push(':');
    value.push_str(fingerprint);
    value
}

/// The tag of a finished call's value.
pub(crate) const VALUE_TAG: u8 = b'd';
/// The tag of a finished call's recorded business error (`record_errors`).
pub(crate) const ERROR_TAG: u8 = b'f';

/// A finished result as the result hash keeps it: its tag (a value, or,
/// `failed`, a recorded business error), its record's expiry, its
/// fingerprint's prefix, its JSON.
pub(crate) fn result_value(expires_ms: i64, fingerprint: &str, response: &str, failed: bool) -> Vec<u8> {
    let mut value = Vec::with_capacity(FINGERPRINT_END + response.len());
    value.push(if failed { ERROR_TAG } else { VALUE_TAG });
    let expires = u64::try_from(expires_ms).unwrap_or(0).min((1 << 48) - 1);
    value.extend_from_slice(&expires.to_be_bytes()[2..]);
    value.extend_from_slice(&fingerprint_prefix(fingerprint));
    value.extend_from_slice(response.as_bytes());
    value
}

/// The first [`FINGERPRINT_BYTES`] of a hex fingerprint, as bytes (zeros
/// where it is shorter or not hex: such a fingerprint is never stored).
fn fingerprint_prefix(fingerprint: &str) -> [u8; FINGERPRINT_BYTES] {
    let mut out = [0; FINGERPRINT_BYTES];
    let digit = |c: u8| (c as char).to_digit(16).map_or(0, |d| d as u8);
    for (byte, pair) in out.iter_mut().zip(fingerprint.as_bytes().chunks_exact(2)) {
        *byte = digit(pair[0]) << 4 | digit(pair[1]);
    }
    out
}

/// A result read back: its expiry, whether it was stored for the
/// fingerprint the caller holds, and the response.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct StoredResult {
    pub expires_ms: i64,
    /// A recorded business error rather than a value.
    pub failed: bool,
    /// The stored fingerprint's first 16 bytes.
    prefix: [u8; FINGERPRINT_BYTES],
    pub response: String,
}

impl StoredResult {
    /// Whether it was stored for `fingerprint` (compared on its prefix, in
    /// hex on the stack: a replay allocates nothing for it).
    pub(crate) fn is_for(&self, fingerprint: &str) -> bool {
        let mut hex = [0; 2 * FINGERPRINT_BYTES];
        write_lower_hex(&mut hex, &self.prefix);
        fingerprint.as_bytes().starts_with(&hex)
    }

    /// The stored fingerprint's first 16 bytes, in hex.
    pub(crate) fn fingerprint_prefix_hex(&self) -> Hex {
        Hex::of_bytes(&self.prefix)
    }
}

/// Reads a result hash's value: `None` for bytes the gate did not write.
pub(crate) fn parse_result(value: Vec<u8>) -> Option<StoredResult> {
    read_result(value).ok()
}

/// Reads a result hash's value, or hands back bytes the gate did not write
/// (too short, another tag, a response that is not UTF-8), whole: the claim
/// script drops a result by comparing it with them.
pub(crate) fn read_result(mut value: Vec<u8>) -> Result<StoredResult, Vec<u8>> {
    if value.len() < FINGERPRINT_END || (value[0] != VALUE_TAG && value[0] != ERROR_TAG) {
        return Err(value);
    }
    let failed = value[0] == ERROR_TAG;
    let mut head = [0; FINGERPRINT_END];
    head.copy_from_slice(&value[..FINGERPRINT_END]);
    // The response is the value's tail: it stays in the reply's buffer.
    value.drain(..FINGERPRINT_END);
    let response = String::from_utf8(value).map_err(|e| [&head[..], e.as_bytes()].concat())?;
    let mut expires = [0; 8];
    expires[2..].copy_from_slice(&head[1..EXPIRY_END]);
    let mut prefix = [0; FINGERPRINT_BYTES];
    prefix.copy_from_slice(&head[EXPIRY_END..]);
    // Six bytes: always a positive i64.
    Ok(StoredResult { expires_ms: i64::from_be_bytes(expires), failed, prefix, response })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FP: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn results_read_back_as_written() {
        let stored = parse_result(result_value(1_796_212_228_629, FP, "{\"x\":\"a:b\"}", false)).unwrap();
        assert_eq!(stored.expires_ms, 1_796_212_228_629);
        assert_eq!(stored.response, "{\"x\":\"a:b\"}");
        assert!(stored.is_for(FP));
        assert!(!stored.is_for(&FP.replace('0', "1")));
        assert!(!stored.is_for("0123"), "a shorter fingerprint never matches");
        assert_eq!(stored.fingerprint_prefix_hex().as_str(), &FP[..32]);
        assert_eq!(result_value(5, FP, "", false).len(), FINGERPRINT_END, "1 + 6 + 16 bytes besides the response");
        assert_eq!(parse_result(result_value(5, FP, "", false)).unwrap().response, "");
    }

    #[test]
    fn bytes_it_did_not_write_are_not_results() {
        for theirs in [&b""[..], b"d", b"p:t:f", b"dshort", b"x123456789012345678901234"] {
            assert_eq!(parse_result(theirs.to_vec()), None, "{theirs:?}");
        }
        let mut bad_utf8 = result_value(5, FP, "{", false);
        bad_utf8.push(0xff);
        assert_eq!(parse_result(bad_utf8.clone()), None);
        // Handed back whole: the claim script drops the value equal to them.
        assert_eq!(read_result(bad_utf8.clone()), Err(bad_utf8));
        assert_eq!(read_result(b"dshort".to_vec()), Err(b"dshort".to_vec()));
    }

    #[test]
    fn names_are_written_as_format_writes_them() {
        for n in [0, 7, 10, 99, 1_796_212_228, -1, -10, i64::MAX, i64::MIN] {
            let mut s = String::from("x");
            push_decimal(&mut s, n);
            assert_eq!(s, format!("x{n}"));
        }
        let namespace = Namespace::new("3f9a0c21d4e5b6a7").unwrap();
        let field = [0x01, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let shard = 0x0102 % SHARDS;
        assert_eq!(results_of(&namespace, &field, 2_993_687), format!("idem:{{3f9a0c21d4e5b6a7.{shard}}}:r2993687"));
        let place = Place::at(&namespace, "pay", "k", field);
        assert_eq!(place.results(-3), format!("idem:{{3f9a0c21d4e5b6a7.{shard}}}:r-3"));
        // As a command's argument, the same bytes (a replay's `HGET` names it
        // so), the longest namespace and window too.
        let longest = Namespace::new(&"n".repeat(64)).unwrap();
        for (namespace, window) in [(&namespace, 2_993_687), (&namespace, -3), (&longest, i64::MIN)] {
            let place = Place::at(namespace, "pay", "k", field);
            let name = ResultsName { namespace, field: &field, window };
            let mut hget = redis::Cmd::with_capacity(3, name.len());
            hget.arg("HGET").arg(name).arg(&field[..]);
            let args: Vec<&[u8]> = hget
                .args_iter()
                .map(|arg| match arg {
                    redis::Arg::Simple(bytes) => bytes,
                    _ => b"",
                })
                .collect();
            assert_eq!(args, [&b"HGET"[..], place.results(window).as_bytes(), &field[..]]);
        }
    }

    #[test]
    fn one_call_keeps_one_hash_tag() {
        let namespace = Namespace::new("3f9a0c21d4e5b6a7").unwrap();
        let place = Place::of(&namespace, "pay", "order_1");
        let tag = &place.claim[..place.claim.find('}').unwrap() + 1];
        assert!(tag.starts_with("idem:{3f9a0c21d4e5b6a7."), "{tag}");
        assert!(place.claim.ends_with("}:pay:order_1"), "{}", place.claim);
        assert!(place.results(42).starts_with(tag) && place.results(42).ends_with(":r42"));
        assert_eq!(results_of(&namespace, &place.field, 42), place.results(42));
        assert_ne!(Place::of(&namespace, "pay", "order_2").field, place.field);
        assert_ne!(Place::of(&namespace, "pa", "yorder_1").field, place.field, "biz and key are kept apart");
    }

    #[test]
    fn a_result_lives_between_one_and_two_hot_windows() {
        let hot = Duration::from_secs(600);
        for now in [0, 1, 599_999, 600_000, 1_796_212_228_629] {
            let ttl = results_ttl_ms(now, hot);
            assert!((600_000..=1_200_000).contains(&ttl), "{now}: {ttl}");
            // Until its hash expires, a lookup reads the window it was written in.
            let written = window_of(now, hot);
            assert!(window_of(now + ttl - 1, hot) - written <= 1);
        }
    }
}
