//! A call that fails on the database logs its cause once, for the operator:
//! the caller is told only whether to retry (`Storage`, 503) or not
//! (`StorageRefused`, `NotMigrated`, 500), never the database's message.
//!
//! The engine's own statements fail with an [`Error`] the flow holds. A
//! body's fail with its own error type, which the flow cannot read: what it
//! sees is the conversion of the body's `sqlx::Error` into [`Error`] (the
//! `?` the guides write), noted here ([`note`]) for the call being polled on
//! this thread. Each call's flow runs inside [`watched`], which swaps the
//! call's note in and out around each of its polls (as `outcome::observe`
//! does with outcomes), so the note follows the call across threads and a
//! call inside another's body keeps its own.
//!
//! The line carries `biz`, where the failure came from (`by`: the body's
//! statements or the engine's), the database's code (SQLSTATE, or SQLite's
//! result code) and the error, never the key: a run of the call's key in
//! the database's message (a duplicate entry quotes the value) shows as
//! `<key>`.

use std::cell::RefCell;
use std::future::Future;

use crate::error::Error;
use crate::key::MIN_HEADER_KEY_LEN;

/// A database failure converted during a call: enough to log it once the
/// call ends (the `sqlx::Error` itself moved on into the body's error).
struct Noted {
    code: Option<String>,
    error: String,
    retryable: bool,
}

thread_local! {
    /// The note of the call being polled on this thread (`Some(None)`: that
    /// call noted nothing yet); `None` outside any call.
    static NOTED: RefCell<Option<Option<Box<Noted>>>> = const { RefCell::new(None) };
}

/// Keeps `error`, converted into `Error` (`retryable`: as `Storage`), for
/// the call being polled on this thread, if any. The last one wins: a body
/// that handled an earlier failure fails on the one it returned.
pub(crate) fn note(error: &sqlx::Error, retryable: bool) {
    NOTED.with_borrow_mut(|noted| {
        if let Some(slot) = noted {
            let code = database_code(error);
            *slot = Some(Box::new(Noted { code, error: error.to_string(), retryable }));
        }
    });
}

/// Runs a call's flow with a note of its own, swapped in around each poll.
pub(crate) async fn watched<F: Future>(future: F) -> F::Output {
    /// Puts back the enclosing call's note, even if the poll panics.
    struct Restore<'a> {
        outer: Option<Option<Box<Noted>>>,
        ours: &'a mut Option<Box<Noted>>,
    }
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            let ours = NOTED.replace(self.outer.take());
            *self.ours = ours.flatten();
        }
    }
    let mut future = std::pin::pin!(future);
    let mut ours = None;
    std::future::poll_fn(|cx| {
        let outer = NOTED.replace(Some(ours.take()));
        let _restore = Restore { outer, ours: &mut ours };
        future.as_mut().poll(cx)
    })
    .await
}

/// Where a call's failure came from, as its flow saw it.
pub(crate) enum Failure<'a> {
    /// The engine's own statement (or the key, the arguments...): `error`.
    Engine(&'a Error),
    /// The body returned its own error: its database failure, if it noted one.
    Body,
}

/// Logs the cause of a call of `biz` (with `key`) that ended in `failure`,
/// if it failed on the database: at `warn` for a failure that passes, at
/// `error` for one that recurs. Called by the flows as the call ends,
/// inside [`watched`]; anything else is not a database failure, or not
/// this call's to log (a recorded error is an answer).
pub(crate) fn report(biz: &'static str, key: &str, failure: Failure<'_>) {
    let noted = NOTED.with_borrow_mut(|noted| noted.as_mut().and_then(Option::take));
    let (by, code, error, retryable) = match failure {
        Failure::Engine(error) => {
            let (Error::Storage(cause) | Error::StorageRefused(cause) | Error::NotMigrated(cause)) = error else {
                return;
            };
            ("engine", database_code(cause), cause.to_string(), error.is_retryable())
        }
        Failure::Body => match noted {
            Some(noted) => ("body", noted.code, noted.error, noted.retryable),
            None => return,
        },
    };
    let error = without_key(&error, key);
    let code = code.as_deref().unwrap_or("");
    if retryable {
        tracing::warn!(
            biz,
            by,
            code,
            error = error.as_str(),
            "idempotent call failed on the database; the caller is told to retry"
        );
    } else {
        tracing::error!(
            biz,
            by,
            code,
            error = error.as_str(),
            "idempotent call failed on the database; the caller is told not to retry"
        );
    }
}

/// The database's own code for `error`: SQLSTATE (PostgreSQL, MySQL,
/// MariaDB) or result code (SQLite); none for the connection or the pool.
fn database_code(error: &sqlx::Error) -> Option<String> {
    match error {
        sqlx::Error::Database(e) => e.code().map(|code| code.into_owned()),
        _ => None,
    }
}

/// `text` with every run of at least [`MIN_HEADER_KEY_LEN`] bytes of `key`
/// shown as `<key>`: the shortest key a client may send, so a value a
/// client chose never reaches the log, whole or in part.
fn without_key(text: &str, key: &str) -> String {
    let (text_bytes, key_bytes) = (text.as_bytes(), key.as_bytes());
    let mut shown = String::with_capacity(text.len());
    let (mut at, mut copied) = (0, 0);
    while at < text_bytes.len() {
        let longest = (0..key_bytes.len())
            .map(|from| text_bytes[at..].iter().zip(&key_bytes[from..]).take_while(|(a, b)| a == b).count())
            .max()
            .unwrap_or(0);
        if longest >= MIN_HEADER_KEY_LEN {
            // Keys are ASCII, so a run starts and ends on character boundaries.
            shown.push_str(&text[copied..at]);
            shown.push_str("<key>");
            at += longest;
            copied = at;
        } else {
            at += 1;
        }
    }
    shown.push_str(&text[copied..]);
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_the_key_are_left_out() {
        let key = "alice:5d0c2a6e-pay-42";
        assert_eq!(
            without_key("Duplicate entry '5d0c2a6e-pay-42' for key 'k'", key),
            "Duplicate entry '<key>' for key 'k'"
        );
        assert_eq!(without_key("x alice:5d0c2a6e-pay-42 y 5d0c2a6e z", key), "x <key> y <key> z");
        // Shorter runs are the template's text or short values: kept.
        assert_eq!(without_key("Unknown column 'alice' in 'pay-42'", key), "Unknown column 'alice' in 'pay-42'");
        assert_eq!(without_key("é 5d0c2a6e-pay ü", key), "é <key> ü");
        assert_eq!(without_key("", key), "");
        assert_eq!(without_key("anything", ""), "anything");
    }

    #[tokio::test]
    async fn a_call_keeps_its_own_note_across_polls_and_inner_calls() {
        let failure = || sqlx::Error::Protocol("lost".into());
        note(&failure(), true); // outside any call: kept nowhere
        let (outer, inner) = watched(async {
            note(&failure(), true);
            tokio::task::yield_now().await;
            let inner = watched(async {
                tokio::task::yield_now().await;
                NOTED.with_borrow(|n| n.as_ref().map(Option::is_some))
            })
            .await;
            tokio::task::yield_now().await;
            (NOTED.with_borrow(|n| n.as_ref().map(Option::is_some)), inner)
        })
        .await;
        assert_eq!((outer, inner), (Some(true), Some(false)));
        assert!(NOTED.with_borrow(Option::is_none));
    }
}
