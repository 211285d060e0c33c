//! Tokens in the database, for an engine without Redis: the table
//! `idem_token` (primary key `(biz_type, token)`), which `migrate` creates
//! beside `idem_record`, asked through the store's own token questions.
//!
//! One conditional `UPDATE` decides a consumption: it marks the row used if
//! it is the subject's, unused and live, and of any number of concurrent
//! submits exactly one changes it (the row lock orders them; the others
//! find `used_at` set). The issue speaks of a conditional `DELETE`; it would
//! decide as well, but leave nothing to tell "already used" (go on to the
//! record, which replays the first result) from "never issued" (refuse).
//! So the used row stays until `keep_until` (see
//! [`Builder::token_used_for`](crate::Builder::token_used_for)), then
//! [`Tokens::purge_expired`](super::Tokens::purge_expired) deletes it.
//!
//! A plain read comes first and routes what the update cannot tell: a
//! forged token costs one indexed read and writes nothing.

use std::time::Duration;

use super::{Found, SpentToken, TokenError};
use crate::store::{Backend, Db, TokenId};

/// Reads and conditional updates before a token that keeps being consumed
/// and given back between the two is taken as already used.
const ATTEMPTS: usize = 3;

/// Stores a token just drawn. `Ok(false)`: the token is taken.
pub(super) async fn issue<DB: Backend>(
    db: &Db<DB>,
    id: TokenId<'_>,
    now_ms: u64,
    expires_at_ms: u64,
) -> Result<bool, TokenError> {
    Ok(DB::token_insert(db, id, ms(now_ms), ms(expires_at_ms)).await?)
}

/// Consumes `id` at `now_ms`; a consumed row answers "already used" for
/// `used_for`, and at least until the token would have expired.
pub(super) async fn consume<DB: Backend>(
    db: &Db<DB>,
    id: TokenId<'_>,
    now_ms: u64,
    used_for: Duration,
) -> Result<Found, TokenError> {
    let now = ms(now_ms);
    for _ in 0..ATTEMPTS {
        let Some(row) = DB::token_read(db, id.biz, id.token).await? else {
            return Ok(Found::Unknown);
        };
        let expires_at = match route(&row, id.subject, now) {
            Route::Answer(found) => return Ok(found),
            Route::Take { expires_at } => expires_at,
        };
        let used_until = now.saturating_add(i64::try_from(used_for.as_millis()).unwrap_or(i64::MAX)).max(expires_at);
        if DB::token_consume(db, id, now, used_until).await? {
            return Ok(Found::Consumed { expires_at_ms: u64::try_from(expires_at).unwrap_or(0) });
        }
        // Another submit consumed it between the read and the update: the
        // next read says so.
    }
    Ok(Found::AlreadyUsed)
}

/// Makes `spent` unused again. Its expiry never changed, so a token given
/// back after it expired stays unknown.
pub(super) async fn give_back<DB: Backend>(db: &Db<DB>, spent: &SpentToken, now_ms: u64) -> Result<bool, TokenError> {
    let back = DB::token_give_back(db, spent.id(), ms(spent.used_at_ms)).await?;
    Ok(back && spent.expires_at_ms > now_ms)
}

/// What a row read before the update says.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    /// The answer, without a write.
    Answer(Found),
    /// The subject's live, unused token: try to consume it.
    Take { expires_at: i64 },
}

fn route((owner, used_at, expires_at, keep_until): &crate::store::TokenRow, subject: &str, now: i64) -> Route {
    let answers = if used_at.is_some() { *keep_until > now } else { *expires_at > now };
    if !answers {
        return Route::Answer(Found::Unknown);
    }
    if owner != subject {
        return Route::Answer(Found::OtherSubject);
    }
    if used_at.is_some() {
        return Route::Answer(Found::AlreadyUsed);
    }
    Route::Take { expires_at: *expires_at }
}

fn ms(epoch_ms: u64) -> i64 {
    i64::try_from(epoch_ms).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_route_to_their_answers() {
        let row = |owner: &str, used_at: Option<i64>, expires_at: i64, keep_until: i64| {
            (owner.to_owned(), used_at, expires_at, keep_until)
        };
        let now = 1_000;
        assert_eq!(route(&row("alice", None, 2_000, 2_000), "alice", now), Route::Take { expires_at: 2_000 });
        assert_eq!(route(&row("alice", None, 2_000, 2_000), "bob", now), Route::Answer(Found::OtherSubject));
        assert_eq!(route(&row("alice", None, 1_000, 1_000), "alice", now), Route::Answer(Found::Unknown), "expired");
        assert_eq!(route(&row("alice", None, 1_000, 1_000), "bob", now), Route::Answer(Found::Unknown));
        assert_eq!(route(&row("alice", Some(900), 2_000, 9_000), "alice", now), Route::Answer(Found::AlreadyUsed));
        assert_eq!(route(&row("alice", Some(900), 2_000, 9_000), "bob", now), Route::Answer(Found::OtherSubject));
        // Used, and kept past its expiry: still "already used" until `keep_until`.
        assert_eq!(route(&row("alice", Some(900), 950, 9_000), "alice", now), Route::Answer(Found::AlreadyUsed));
        assert_eq!(route(&row("alice", Some(900), 950, 1_000), "alice", now), Route::Answer(Found::Unknown));
    }
}
