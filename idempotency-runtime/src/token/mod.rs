//! Issued one-time tokens, for flows that cannot trust keys clients make
//! (a client's `Idempotency-Key` may be reused or forged): the server
//! issues a token when it renders the form, bound to the caller (the
//! *subject*), and the submit consumes it. Consumption is atomic: of any
//! number of concurrent submits, one consumes. The consumed token then
//! serves as the call's idempotency key, so a resubmission replays the first
//! result (or answers `InProgress` while it runs), and a call that fails
//! gives the token back for the rest of its life: a failed attempt burns
//! nothing.
//!
//! ```ignore
//! // GET: render the form with a token for this user, valid 15 minutes.
//! let issued = idem.tokens().issue("pay", &user, Duration::from_secs(900)).await?;
//!
//! // POST: the token guards one call, keyed by the token itself.
//! idem.tokens().redeem("pay", &user, &token, || pay(&idem, &user, &token, order_id)).await
//! ```
//!
//! What [`Tokens::consume`] answers:
//!
//! | the token | answer | consumed? |
//! |---|---|---|
//! | issued to this subject, live, unused | [`Consumption::Consumed`] | now |
//! | issued to this subject, consumed before (within [`Builder::token_used_for`](crate::Builder::token_used_for)) | [`Consumption::AlreadyUsed`] | already |
//! | issued to another subject | [`Consumption::OtherSubject`] | no: its subject can still consume it |
//! | never issued, malformed, expired, or of another `biz` | [`Consumption::Unknown`] | no |
//!
//! Tokens live where they were issued: in Redis when the engine has one
//! (module `redis`: `GETDEL`, or a Lua script where `GETDEL` is missing), in the
//! table `idem_token` otherwise (module `database`: one conditional `UPDATE`
//! decides). A token issued in Redis cannot be checked in the database, so
//! a Redis outage answers [`TokenError::Unavailable`] (retryable, 503 over
//! HTTP), never a pass.

use std::future::Future;
use std::time::Duration;

use crate::engine::Idem;
use crate::key::validate_biz;
use crate::store::{Backend, TokenId};

mod database;
#[cfg(feature = "redis")]
pub(crate) mod redis;

/// Length of a token: 24 random bytes (192 bits) in base64url, unpadded.
pub const TOKEN_LEN: usize = 32;
/// Random bytes in a token.
const TOKEN_BYTES: usize = 24;
/// Longest subject: the principal rule of `idempotency::http::check_principal`.
pub const MAX_SUBJECT_LEN: usize = 64;
pub use crate::engine::token_settings::DEFAULT_USED_FOR;

/// How many times a token is drawn when the one drawn is already taken
/// (never seen with 192 bits; bounded all the same).
const ISSUE_ATTEMPTS: usize = 3;

/// A token just issued: hand [`token`](IssuedToken::token) to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct IssuedToken {
    /// The token: [`TOKEN_LEN`] characters of base64url (`A-Z a-z 0-9 - _`).
    pub token: String,
    /// How long it lives from issue.
    pub ttl: Duration,
    /// When it expires, in Unix epoch milliseconds.
    pub expires_at_ms: u64,
}

/// What [`Tokens::consume`] found; see the table in the [module docs](self).
#[derive(Debug)]
#[must_use]
#[non_exhaustive]
pub enum Consumption {
    /// The token was this subject's, live and unused: this call consumed it.
    /// Give it back with [`Tokens::give_back`] if the call it guards fails.
    Consumed(SpentToken),
    /// This subject consumed the token before. Go on to the call keyed by
    /// the token: it replays the first result, answers `InProgress` while
    /// the first still runs, or runs if the first left nothing (it failed
    /// and was dropped before giving the token back).
    AlreadyUsed,
    /// The token was issued to another subject: refused, and left as it
    /// was, so its own subject can still consume it.
    OtherSubject,
    /// Never issued (forged, malformed, another `biz`'s), or expired.
    Unknown,
}

/// A token this call consumed: the right to give it back.
#[derive(Debug)]
#[must_use = "a consumed token is given back with `Tokens::give_back` if the call it guards fails"]
pub struct SpentToken {
    biz: String,
    subject: String,
    token: String,
    expires_at_ms: u64,
    /// When it was consumed (epoch ms): the database path gives back this
    /// consumption only, never a later one.
    used_at_ms: u64,
}

impl SpentToken {
    /// The token.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The subject it was issued to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// When it expires, in Unix epoch milliseconds: given back, it lives
    /// until then.
    pub fn expires_at_ms(&self) -> u64 {
        self.expires_at_ms
    }

    fn id(&self) -> TokenId<'_> {
        TokenId { biz: &self.biz, token: &self.token, subject: &self.subject }
    }
}

/// Why [`Tokens::redeem`] refused a token (over HTTP both are 403
/// `IDEMPOTENCY_TOKEN_INVALID`, alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// Never issued, malformed, or expired.
    Unknown,
    /// Issued to another subject (and left for it).
    OtherSubject,
}

/// What can go wrong with a token, besides the answers of [`Consumption`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// A `biz` outside `[a-z0-9_]{1,32}`: a mistake in the server's code.
    /// Nothing was written. Over HTTP: 500 `IDEMPOTENCY_MISCONFIGURED`.
    #[error("invalid biz: it must match [a-z0-9_]{{1,{max}}}", max = idempotency_rules::MAX_BIZ_LEN)]
    InvalidBiz,

    /// A subject outside `[A-Za-z0-9_.-]{1,64}` (no `:`, so it cannot run
    /// into the token in a key). Nothing was written. Over HTTP: 400
    /// `INVALID_PRINCIPAL`.
    #[error("invalid token subject of {len} bytes: it must be 1 to 64 characters from A-Z a-z 0-9 _ . -")]
    InvalidSubject {
        /// Length in bytes.
        len: usize,
    },

    /// A ttl of zero, or past 100 years. Nothing was written.
    #[error("a token's ttl must be between 1 ms and 100 years")]
    InvalidTtl,

    /// [`Tokens::redeem`] refused the token; nothing ran. Over HTTP: 403
    /// `IDEMPOTENCY_TOKEN_INVALID`.
    #[error("idempotency token refused: {0:?}")]
    Refused(Refusal),

    /// Redis, where this engine's tokens live, did not answer in time or
    /// refused the operation, or its namespace is unknown yet (the database
    /// unread or never migrated). Retry later; nothing was decided.
    /// Over HTTP: 503.
    #[error("token store unavailable: {0}")]
    Unavailable(&'static str),

    /// The database failed or could not be reached. Retry later. Over
    /// HTTP: 503.
    #[error("token storage failed: {0}")]
    Storage(#[source] sqlx::Error),

    /// The operating system's random source failed: no token was issued.
    #[error("the operating system's random source failed: {0}")]
    Random(#[source] std::io::Error),
}

impl TokenError {
    /// `true` when the same operation may succeed if tried again later
    /// (`Unavailable`, `Storage`).
    pub fn is_retryable(&self) -> bool {
        matches!(self, TokenError::Unavailable(_) | TokenError::Storage(_))
    }
}

impl From<sqlx::Error> for TokenError {
    fn from(e: sqlx::Error) -> Self {
        TokenError::Storage(e)
    }
}

impl<DB: Backend> Idem<DB> {
    /// Issued one-time tokens: issue one bound to a subject, consume it
    /// once, give it back when the call it guarded failed. See [`Tokens`].
    pub fn tokens(&self) -> Tokens<'_, DB> {
        Tokens::new(self)
    }
}

/// Issued one-time tokens of one engine: [`Idem::tokens`].
pub struct Tokens<'e, DB: Backend> {
    idem: &'e Idem<DB>,
}

impl<DB: Backend> std::fmt::Debug for Tokens<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens").field("settings", self.idem.token_settings()).finish_non_exhaustive()
    }
}

/// What a store found for a consumption; [`Tokens::consume`] makes it a
/// [`Consumption`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    Consumed { expires_at_ms: u64 },
    AlreadyUsed,
    OtherSubject,
    Unknown,
}

impl<'e, DB: Backend> Tokens<'e, DB> {
    pub(crate) fn new(idem: &'e Idem<DB>) -> Self {
        Self { idem }
    }

    /// Issues a token for `subject` (the caller it is for: a user id, say)
    /// and `biz`, live for `ttl`: [`TOKEN_LEN`] characters of base64url over
    /// 192 bits from the operating system's random source, holding nothing
    /// else.
    pub async fn issue(&self, biz: &str, subject: &str, ttl: Duration) -> Result<IssuedToken, TokenError> {
        check_biz_and_subject(biz, subject)?;
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        if ttl_ms == 0 || ttl_ms > idempotency_rules::MAX_DURATION_MS {
            return Err(TokenError::InvalidTtl);
        }
        for _ in 0..ISSUE_ATTEMPTS {
            let token = generate()?;
            let now = self.now_ms().await;
            let expires_at_ms = now + ttl_ms;
            if self.insert(TokenId { biz, token: &token, subject }, now, expires_at_ms).await? {
                return Ok(IssuedToken { token, ttl, expires_at_ms });
            }
        }
        Err(TokenError::Storage(sqlx::Error::Protocol("a freshly drawn token was taken every time".into())))
    }

    /// Consumes `token` for `subject`, atomically: of concurrent calls,
    /// one gets [`Consumption::Consumed`]. A token that is not
    /// [well formed](is_well_formed) is [`Consumption::Unknown`] before
    /// Redis or the database is asked.
    pub async fn consume(&self, biz: &str, subject: &str, token: &str) -> Result<Consumption, TokenError> {
        check_biz_and_subject(biz, subject)?;
        if !is_well_formed(token) {
            return Ok(Consumption::Unknown);
        }
        let now = self.now_ms().await;
        Ok(match self.take(TokenId { biz, token, subject }, now).await? {
            Found::Consumed { expires_at_ms } => Consumption::Consumed(SpentToken {
                biz: biz.to_owned(),
                subject: subject.to_owned(),
                token: token.to_owned(),
                expires_at_ms,
                used_at_ms: now,
            }),
            Found::AlreadyUsed => Consumption::AlreadyUsed,
            Found::OtherSubject => Consumption::OtherSubject,
            Found::Unknown => Consumption::Unknown,
        })
    }

    /// Makes a consumed token usable again until its own expiry, after the
    /// call it guarded failed. `Ok(false)`: it expired meanwhile, and stays
    /// gone. A submit racing the give-back either consumes the token once
    /// it is back, or finds it [`AlreadyUsed`](Consumption::AlreadyUsed)
    /// and reaches the call keyed by the token: the record lets one run.
    pub async fn give_back(&self, spent: SpentToken) -> Result<bool, TokenError> {
        let now = self.now_ms().await;
        #[cfg(feature = "redis")]
        if let Some(gate) = self.idem.gate().redis_gate() {
            return Box::pin(redis::give_back(gate, self.idem.db(), &spent, now)).await;
        }
        Box::pin(database::give_back(self.idem.db(), &spent, now)).await
    }

    /// Runs `call` under `token`: consumes it (or finds it already used by
    /// `subject`), runs `call`, and gives the token back if `call` returns
    /// `Err`. Key `call`'s record by the token (say
    /// `key = "<user>:<token>"`), so that every submit of one token meets
    /// the same record: one runs, the others replay it or answer
    /// `InProgress`. Refused ([`TokenError::Refused`]): an unknown, expired
    /// or another subject's token; `call` does not run. A `call` dropped
    /// before it ends keeps the token consumed: the next submit finds it
    /// already used and reaches the record, which holds nothing, so it runs.
    pub async fn redeem<T, E, F, Fut>(&self, biz: &str, subject: &str, token: &str, call: F) -> Result<T, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: From<TokenError>,
    {
        let spent = match self.consume(biz, subject, token).await? {
            Consumption::Consumed(spent) => Some(spent),
            Consumption::AlreadyUsed => None,
            Consumption::OtherSubject => return Err(TokenError::Refused(Refusal::OtherSubject).into()),
            Consumption::Unknown => return Err(TokenError::Refused(Refusal::Unknown).into()),
        };
        let result = call().await;
        if result.is_err()
            && let Some(spent) = spent
            && let Err(e) = self.give_back(spent).await
        {
            // Left consumed: the next submit finds it already used, and runs.
            tracing::warn!(error = %e, biz, "a failed call's token could not be given back");
        }
        result
    }

    /// Deletes up to `limit` rows of `idem_token` that answer nothing any
    /// more (expired, or used past [`Builder::token_used_for`](crate::Builder::token_used_for));
    /// returns how many. Tokens in Redis expire by themselves.
    pub async fn purge_expired(&self, limit: u32) -> Result<u64, TokenError> {
        let now = self.idem.now_ms().await;
        Ok(DB::token_purge_expired(self.idem.db(), now, i64::from(limit)).await?)
    }

    /// Now on the database's clock, as token expiries are stamped and judged.
    async fn now_ms(&self) -> u64 {
        u64::try_from(self.idem.now_ms().await).unwrap_or(0)
    }

    /// Stores a token just drawn where this engine keeps tokens. The stores'
    /// futures are boxed (here, in `take` and in `give_back`): inline, they
    /// would put kilobytes into `redeem`'s future, which a handler holds.
    async fn insert(&self, id: TokenId<'_>, now: u64, expires_at_ms: u64) -> Result<bool, TokenError> {
        #[cfg(feature = "redis")]
        if let Some(gate) = self.idem.gate().redis_gate() {
            return Box::pin(redis::issue(gate, self.idem.db(), id, now, expires_at_ms)).await;
        }
        Box::pin(database::issue(self.idem.db(), id, now, expires_at_ms)).await
    }

    /// Consumes a well-formed token where this engine keeps tokens.
    async fn take(&self, id: TokenId<'_>, now: u64) -> Result<Found, TokenError> {
        let settings = self.idem.token_settings();
        #[cfg(feature = "redis")]
        if let Some(gate) = self.idem.gate().redis_gate() {
            return Box::pin(redis::consume(gate, self.idem.db(), settings, id, now)).await;
        }
        Box::pin(database::consume(self.idem.db(), id, now, settings.used_for)).await
    }
}

fn check_biz_and_subject(biz: &str, subject: &str) -> Result<(), TokenError> {
    validate_biz(biz).map_err(|_| TokenError::InvalidBiz)?;
    if is_valid_subject(subject) { Ok(()) } else { Err(TokenError::InvalidSubject { len: subject.len() }) }
}

/// `true` when `subject` matches `[A-Za-z0-9_.-]{1,64}`: the principal rule
/// of `idempotency::http::check_principal`.
pub fn is_valid_subject(subject: &str) -> bool {
    (1..=MAX_SUBJECT_LEN).contains(&subject.len())
        && subject.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// `true` when `token` could be one this crate issued: exactly
/// [`TOKEN_LEN`] characters of base64url (`A-Z a-z 0-9 - _`). Checked on
/// every token a client sends, before Redis or the database sees it.
pub fn is_well_formed(token: &str) -> bool {
    token.len() == TOKEN_LEN && token.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// A new token: [`TOKEN_BYTES`] from the operating system, in base64url.
fn generate() -> Result<String, TokenError> {
    let mut bytes = [0u8; TOKEN_BYTES];
    getrandom::fill(&mut bytes).map_err(|e| {
        TokenError::Random(match e.raw_os_error() {
            Some(code) => std::io::Error::from_raw_os_error(code),
            None => std::io::Error::other(e.to_string()),
        })
    })?;
    Ok(base64url(&bytes))
}

/// Base64url without padding (RFC 4648 §5) of whole 3-byte groups.
fn base64url(bytes: &[u8; TOKEN_BYTES]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(TOKEN_LEN);
    for group in bytes.chunks_exact(3) {
        let n = u32::from(group[0]) << 16 | u32::from(group[1]) << 8 | u32::from(group[2]);
        for shift in [18, 12, 6, 0] {
            out.push(char::from(ALPHABET[(n >> shift & 63) as usize]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_32_url_safe_characters_and_do_not_repeat() {
        let set: std::collections::HashSet<_> = (0..10_000).map(|_| generate().unwrap()).collect();
        assert_eq!(set.len(), 10_000);
        assert!(set.iter().all(|t| is_well_formed(t)), "{set:?}");
    }

    #[test]
    fn base64url_matches_rfc_4648() {
        let mut bytes = [0u8; TOKEN_BYTES];
        bytes[..6].copy_from_slice(b"foobar");
        assert!(base64url(&bytes).starts_with("Zm9vYmFy"));
        assert_eq!(base64url(&[0xff; TOKEN_BYTES]), "_".repeat(TOKEN_LEN));
        assert_eq!(base64url(&[0xfb; TOKEN_BYTES]), "-_v7".repeat(TOKEN_LEN / 4));
    }

    #[test]
    fn every_bit_of_every_character_is_random() {
        // Over many tokens each position takes every one of the 64 characters.
        let tokens: Vec<String> = (0..4_000).map(|_| generate().unwrap()).collect();
        for at in 0..TOKEN_LEN {
            let seen: std::collections::HashSet<u8> = tokens.iter().map(|t| t.as_bytes()[at]).collect();
            assert_eq!(seen.len(), 64, "position {at}");
        }
    }

    #[test]
    fn malformed_tokens_are_refused_before_any_lookup() {
        let good = "A".repeat(TOKEN_LEN);
        assert!(is_well_formed(&good));
        for bad in [
            String::new(),
            "A".repeat(TOKEN_LEN - 1),
            "A".repeat(TOKEN_LEN + 1),
            format!("{}=", "A".repeat(TOKEN_LEN - 1)),
            format!("{}:", "A".repeat(TOKEN_LEN - 1)),
            format!("{}+", "A".repeat(TOKEN_LEN - 1)),
            format!("{}/", "A".repeat(TOKEN_LEN - 1)),
            format!("{}é", "A".repeat(TOKEN_LEN - 2)),
            format!("{}*", "A".repeat(TOKEN_LEN - 1)),
        ] {
            assert!(!is_well_formed(&bad), "{bad:?}");
        }
    }

    #[test]
    fn subjects_follow_the_principal_rule() {
        for good in ["alice", "u-1.a_B9", &"p".repeat(MAX_SUBJECT_LEN)] {
            assert!(is_valid_subject(good), "{good:?}");
        }
        for bad in ["", "a:b", "a b", "zoë", "a*", "a\tb", &"p".repeat(MAX_SUBJECT_LEN + 1)] {
            assert!(!is_valid_subject(bad), "{bad:?}");
        }
    }
}
