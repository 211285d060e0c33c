//! Problem details (RFC 9457): what every refusal and failure answers, with
//! a stable `code`, whatever the framework. Each adapter only writes them
//! out (status, `application/problem+json` body, `Retry-After`).

use std::fmt;

use serde::Serialize;

use super::framework::HttpStatus;
use crate::error::{Error, KeyError};
use crate::key::MAX_KEY_LEN;
use crate::token::TokenError;

/// The media type of error bodies.
pub const PROBLEM_JSON: &str = "application/problem+json";

const BAD_REQUEST: u16 = 400;
const FORBIDDEN: u16 = 403;
const CONFLICT: u16 = 409;
const UNPROCESSABLE_ENTITY: u16 = 422;
const INTERNAL_SERVER_ERROR: u16 = 500;
const SERVICE_UNAVAILABLE: u16 = 503;

/// What a key may be, for details: the header's rule.
pub(crate) const KEY_RULE: &str = "keys are 8 to 255 characters from A-Z a-z 0-9 _ . : -, bare or in double quotes";

/// An `application/problem+json` error answer (RFC 9457) with a stable
/// `code`, its status spelled as the framework spells it: `u16` in the
/// framework-free core, [`http::Problem`](crate::http::Problem) for axum,
/// [`http::actix::Problem`](crate::http::actix::Problem) for actix-web.
/// Built from an [`Error`] or a [`TokenError`] (`Problem::from(&error)`),
/// by the key and token rules, or by the principal check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProblemDetails<S = u16> {
    /// The HTTP status.
    pub status: S,
    /// Stable, machine-readable code, e.g. `IDEMPOTENCY_KEY_REUSED`.
    pub code: &'static str,
    /// Short summary of the kind of problem.
    pub title: &'static str,
    /// What happened this time (never the key itself).
    pub detail: String,
    /// Seconds for a `Retry-After` header, when asking again may help.
    /// It also decides `Idempotency-Should-Retry` ([`should_retry`](Self::should_retry)).
    pub retry_after: Option<u32>,
}

/// The JSON body of a problem.
#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    title: &'a str,
    status: u16,
    code: &'a str,
    detail: &'a str,
}

impl<S: HttpStatus> ProblemDetails<S> {
    pub(crate) fn new(status: u16, code: &'static str, title: &'static str, detail: String) -> Self {
        ProblemDetails { status: S::from_code(status), code, title, detail, retry_after: None }
    }

    /// A token that is forged, malformed, expired, or issued to another
    /// caller: 403 `IDEMPOTENCY_TOKEN_INVALID`, alike for all (the caller
    /// learns nothing about other callers' tokens).
    pub fn token_invalid() -> Self {
        ProblemDetails::new(
            FORBIDDEN,
            "IDEMPOTENCY_TOKEN_INVALID",
            "Idempotency token invalid",
            "the Idempotency-Token is unknown, expired, or was issued to another caller; \
             ask for a new one; nothing was written"
                .into(),
        )
    }

    /// Whether asking again with the same key can help: what the
    /// `Idempotency-Should-Retry` header says (`true` or `false`), on every
    /// problem an adapter answers. True exactly when the problem says when
    /// to come back (`retry_after`): a request still running, a database
    /// that is down. A refusal, or a failure that recurs, says `false`, so
    /// a client does not retry a 500 or a business 409 of the handler's
    /// own by its status alone.
    pub fn should_retry(&self) -> bool {
        self.retry_after.is_some()
    }

    /// The `type` URI: `urn:idem:problem:` and the code in kebab case, the
    /// crate's namespace, whoever built the problem. A problem of the
    /// application's own names its own with
    /// [`with_type`](ProblemDetails::with_type).
    pub fn type_uri(&self) -> String {
        format!("urn:idem:problem:{}", self.code.to_ascii_lowercase().replace('_', "-"))
    }

    /// The JSON body, as sent.
    pub fn body(&self) -> String {
        self.body_of_type(&self.type_uri())
    }

    /// The JSON body, `type_uri` as its `type`.
    pub(crate) fn body_of_type(&self, type_uri: &str) -> String {
        let body = Body {
            kind: type_uri,
            title: self.title,
            status: self.status.code(),
            code: self.code,
            detail: &self.detail,
        };
        serde_json::to_string(&body).expect("a problem body serializes")
    }

    /// The same problem, its status spelled by another framework.
    pub(crate) fn convert<T: HttpStatus>(self) -> ProblemDetails<T> {
        let ProblemDetails { status, code, title, detail, retry_after } = self;
        ProblemDetails { status: T::from_code(status.code()), code, title, detail, retry_after }
    }
}

impl ProblemDetails {
    pub(crate) fn missing_key() -> Self {
        ProblemDetails::new(
            BAD_REQUEST,
            "MISSING_IDEMPOTENCY_KEY",
            "Idempotency-Key header required",
            "send an Idempotency-Key header of 8 to 255 characters from A-Z a-z 0-9 _ . : -, \
             and the same value again when retrying"
                .into(),
        )
    }

    pub(crate) fn missing_key_or_token() -> Self {
        ProblemDetails::new(
            BAD_REQUEST,
            "MISSING_IDEMPOTENCY_KEY",
            "Idempotency-Key or Idempotency-Token header required",
            "send the Idempotency-Token the server issued for this form, or an Idempotency-Key header of \
             8 to 255 characters from A-Z a-z 0-9 _ . : -, and the same value again when retrying"
                .into(),
        )
    }

    pub(crate) fn invalid_key(detail: String) -> Self {
        ProblemDetails::new(BAD_REQUEST, "INVALID_IDEMPOTENCY_KEY", "Invalid idempotency key", detail)
    }

    /// The header breaks the key rule. `reason` shows an offending character
    /// only as visible ASCII or a code point (see `KeyError`'s `Display`).
    pub(crate) fn invalid_header_key(reason: &KeyError) -> Self {
        ProblemDetails::invalid_key(format!("the Idempotency-Key header is invalid ({reason}); {KEY_RULE}"))
    }

    pub(crate) fn invalid_principal(title: &'static str, detail: String) -> Self {
        ProblemDetails::new(BAD_REQUEST, "INVALID_PRINCIPAL", title, detail)
    }

    /// What an adapter answers for `error`; a server-side failure is logged
    /// here with its cause, which the body hides from the caller, but for a
    /// database failure: the call that met it logged it (`failure_log`).
    #[cfg(any(feature = "axum", feature = "actix", feature = "tonic"))]
    pub(crate) fn answering(error: &Error) -> Self {
        let problem = of_error(error);
        let logged = matches!(error, Error::Storage(_) | Error::StorageRefused(_) | Error::NotMigrated(_));
        if problem.status >= INTERNAL_SERVER_ERROR && !logged {
            tracing::error!(error = %error, "idempotent request failed");
        }
        problem
    }

    /// As `answering`, for a token's failure.
    #[cfg(any(feature = "axum", feature = "actix", feature = "tonic"))]
    pub(crate) fn answering_token(error: &TokenError) -> Self {
        let problem = of_token_error(error);
        if problem.status >= INTERNAL_SERVER_ERROR {
            tracing::error!(error = %error, "idempotency token failed");
        }
        problem
    }
}

impl<S> fmt::Display for ProblemDetails<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.detail)
    }
}

fn of_error(error: &Error) -> ProblemDetails {
    match error {
        // Not the client's key: the `biz_no` comes from the request's
        // arguments, the `biz` from the server's code.
        Error::BizNoTooLong { len, max } => ProblemDetails::new(
            BAD_REQUEST,
            "INVALID_BIZ_NO",
            "Business number too long",
            format!("the request's business number is {len} bytes long, at most {max} are allowed; nothing was written"),
        ),
        Error::InvalidText { field, at } => ProblemDetails::new(
            BAD_REQUEST,
            "INVALID_TEXT",
            "Request holds text a database cannot store",
            format!("the request's {field} holds a NUL character at byte {at}, which cannot be stored; nothing was written"),
        ),
        Error::ResultTooLarge { len, max, .. } => ProblemDetails::new(
            INTERNAL_SERVER_ERROR,
            "IDEMPOTENCY_RESULT_TOO_LARGE",
            "Result too large to record",
            format!(
                "the result is {len} bytes, more than the {max} the server records; nothing was recorded, \
                 and sending the same request again fails the same way"
            ),
        ),
        Error::InvalidBiz => ProblemDetails::new(
            INTERNAL_SERVER_ERROR,
            "IDEMPOTENCY_MISCONFIGURED",
            "Idempotency misconfigured on the server",
            "the server names this action in a way idempotency does not accept; nothing was written".into(),
        ),
        // The key as the fn rendered it, the caller's scope included.
        Error::InvalidKey(reason) => ProblemDetails::invalid_key(format!(
            "the idempotency key, with the scope the server adds to it, is invalid ({reason}); \
             the whole must be at most {MAX_KEY_LEN} characters from A-Z a-z 0-9 _ . : -"
        )),
        Error::InProgress { .. } => ProblemDetails {
            retry_after: Some(1),
            ..ProblemDetails::new(
                CONFLICT,
                "IDEMPOTENCY_KEY_IN_PROGRESS",
                "Request with this idempotency key is in progress",
                "a request with the same idempotency key is still being processed; \
                 retry later with the same key to receive its result"
                    .into(),
            )
        },
        Error::KeyReused { .. } => ProblemDetails::new(
            UNPROCESSABLE_ENTITY,
            "IDEMPOTENCY_KEY_REUSED",
            "Idempotency key reused with another request",
            "this idempotency key was already used for a request with other parameters; \
             use a new key for a new request"
                .into(),
        ),
        // Transient: retry. The rule ("What a caller is told to do next" in
        // docs/guarantees.md): a failure that passes says when to come back.
        Error::Storage(_) => ProblemDetails {
            retry_after: Some(1),
            ..ProblemDetails::new(
                SERVICE_UNAVAILABLE,
                "IDEMPOTENCY_STORAGE_UNAVAILABLE",
                "Idempotency storage unavailable",
                "the request could not be completed; retry with the same key: it runs once, or answers with what was recorded".into(),
            )
        },
        // Final: the same request fails the same way; no `Retry-After`.
        Error::StorageRefused(_) => ProblemDetails::new(
            INTERNAL_SERVER_ERROR,
            "IDEMPOTENCY_STORAGE_REFUSED",
            "The database refused the request",
            "the database refused this request's data or statements; nothing was written, and sending \
             the same request again fails the same way"
                .into(),
        ),
        Error::NotMigrated(_) => ProblemDetails::new(
            INTERNAL_SERVER_ERROR,
            "IDEMPOTENCY_NOT_MIGRATED",
            "Idempotency tables missing",
            "the server's idempotency tables are missing or out of date (its operator must run `idem migrate`, \
             or `Idem::migrate` at start-up); nothing was written"
                .into(),
        ),
        Error::Replay { .. } => ProblemDetails::new(
            INTERNAL_SERVER_ERROR,
            "IDEMPOTENCY_REPLAY_FAILED",
            "Stored response cannot be replayed",
            "the request was already processed, but its stored response can no longer be read".into(),
        ),
        Error::Serialize(_) => ProblemDetails::new(
            INTERNAL_SERVER_ERROR,
            "IDEMPOTENCY_SERIALIZE_FAILED",
            "Request cannot be made idempotent",
            "the request or its result could not be serialized; nothing was written".into(),
        ),
        Error::NonFiniteFloat { .. } => ProblemDetails::new(
            UNPROCESSABLE_ENTITY,
            "NON_FINITE_NUMBER",
            "Request holds a number that is not finite",
            "a number in the request is NaN or infinite, which cannot be told apart from no number; \
             nothing was written"
                .into(),
        ),
        // The handler's own error type usually answers this one; the
        // recorded failure is the application's to show, not this layer's.
        Error::Permanent { .. } => ProblemDetails::new(
            UNPROCESSABLE_ENTITY,
            "IDEMPOTENT_REQUEST_FAILED",
            "Request failed permanently",
            "the request failed for good and its failure was recorded; \
             a retry with the same key gets this answer again"
                .into(),
        ),
        Error::InvalidStep { .. } => ProblemDetails::new(
            INTERNAL_SERVER_ERROR,
            "IDEMPOTENCY_MISCONFIGURED",
            "Idempotency misconfigured on the server",
            "the server calls an outside service in a way idempotency does not accept; nothing was called".into(),
        ),
    }
}

fn of_token_error(error: &TokenError) -> ProblemDetails {
    match error {
        TokenError::Refused(_) => ProblemDetails::token_invalid(),
        TokenError::InvalidSubject { .. } => ProblemDetails::invalid_principal(
            "Caller identity cannot hold an idempotency token",
            format!(
                "the caller's identity cannot hold an idempotency token; it must be 1 to {} \
                 characters from A-Z a-z 0-9 _ . -",
                crate::token::MAX_SUBJECT_LEN
            ),
        ),
        TokenError::Unavailable(_) | TokenError::Storage(_) => ProblemDetails {
            retry_after: Some(1),
            ..ProblemDetails::new(
                SERVICE_UNAVAILABLE,
                "IDEMPOTENCY_STORAGE_UNAVAILABLE",
                "Idempotency storage unavailable",
                "the idempotency token could not be checked or issued; retry with the same token: \
                 nothing was decided"
                    .into(),
            )
        },
        // The system's randomness failing passes too: it says when to ask again.
        TokenError::Random(_) => ProblemDetails {
            retry_after: Some(1),
            ..ProblemDetails::new(
                SERVICE_UNAVAILABLE,
                "IDEMPOTENCY_TOKEN_UNAVAILABLE",
                "Idempotency token cannot be issued",
                "no idempotency token could be issued right now; ask again later".into(),
            )
        },
        // `biz` or ttl: the server's code, not the request.
        TokenError::InvalidBiz | TokenError::InvalidTtl => ProblemDetails::new(
            INTERNAL_SERVER_ERROR,
            "IDEMPOTENCY_MISCONFIGURED",
            "Idempotency misconfigured on the server",
            "the server names this action or its token lifetime in a way idempotency does not accept; \
             nothing was written"
                .into(),
        ),
    }
}

impl<S: HttpStatus> From<&Error> for ProblemDetails<S> {
    fn from(error: &Error) -> Self {
        of_error(error).convert()
    }
}

impl<S: HttpStatus> From<Error> for ProblemDetails<S> {
    fn from(error: Error) -> Self {
        ProblemDetails::from(&error)
    }
}

impl<S: HttpStatus> From<&TokenError> for ProblemDetails<S> {
    fn from(error: &TokenError) -> Self {
        of_token_error(error).convert()
    }
}

impl<S: HttpStatus> From<TokenError> for ProblemDetails<S> {
    fn from(error: TokenError) -> Self {
        ProblemDetails::from(&error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: a bad `biz_no` or `biz` was answered "the idempotency key
    /// is invalid", blaming the client's key for the server's arguments.
    #[test]
    fn biz_errors_do_not_blame_the_key() {
        let biz_no = ProblemDetails::<u16>::from(&Error::BizNoTooLong { len: 65, max: 64 });
        assert_eq!(
            biz_no.detail,
            "the request's business number is 65 bytes long, at most 64 are allowed; nothing was written"
        );
        let biz = ProblemDetails::<u16>::from(&Error::InvalidBiz);
        let float = ProblemDetails::<u16>::from(&Error::NonFiniteFloat { arg: "amount" });
        for problem in [biz_no, biz, float] {
            assert!(!problem.detail.contains("key") && !problem.title.contains("key"), "{problem:?}");
            assert!(!problem.detail.contains("amount"), "{problem:?}");
        }
    }

    /// What `Idempotency-Should-Retry` says for each answer: `true` for
    /// the failures that pass (503) and a request still running (409),
    /// `false` for every refusal and every failure that recurs.
    #[test]
    fn only_what_passes_says_retry() {
        let json_error = || serde_json::from_str::<u8>("x").unwrap_err();
        let errors = [
            (Error::InProgress { biz: "pay", key: "k".into() }, true),
            (Error::Storage(sqlx::Error::PoolTimedOut), true),
            (Error::KeyReused { biz: "pay", key: "k".into() }, false),
            (Error::InvalidKey(KeyError::Missing), false),
            (Error::BizNoTooLong { len: 65, max: 64 }, false),
            (Error::StorageRefused(sqlx::Error::RowNotFound), false),
            (Error::NotMigrated(sqlx::Error::RowNotFound), false),
            (Error::ResultTooLarge { biz: "pay", len: 2, max: 1 }, false),
            (Error::Replay { biz: "pay", key: "k".into(), source: json_error() }, false),
            (Error::Serialize(json_error()), false),
            (Error::InvalidBiz, false),
            (Error::NonFiniteFloat { arg: "amount" }, false),
        ];
        for (error, retry) in errors {
            let problem = ProblemDetails::<u16>::from(&error);
            assert_eq!((problem.should_retry(), problem.retry_after.is_some()), (retry, retry), "{error:?}");
            assert_eq!(problem.should_retry(), problem.status == SERVICE_UNAVAILABLE || problem.status == CONFLICT);
        }
        let random = ProblemDetails::<u16>::from(&TokenError::Random(std::io::Error::other("no entropy")));
        assert_eq!((random.status, random.should_retry(), random.retry_after), (503, true, Some(1)));
        assert!(!ProblemDetails::<u16>::token_invalid().should_retry());
        assert!(!ProblemDetails::missing_key().should_retry());
    }

    #[test]
    fn storage_details_stay_out_of_the_body() {
        let error = Error::Storage(sqlx::Error::Protocol("password=hunter2".into()));
        assert!(!ProblemDetails::<u16>::from(&error).body().contains("hunter2"));
    }
}
