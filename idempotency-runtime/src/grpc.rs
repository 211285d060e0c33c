//! gRPC with tonic (feature `tonic`): the HTTP contract of
//! [`http`](crate::http) carried in gRPC metadata. The key comes from the
//! request's `idempotency-key` metadata under the same rule as the
//! `Idempotency-Key` header, bare or quoted
//! ([`IdempotencyKey::from_metadata`]); errors become [`Status`] codes a
//! client's retry policy reads correctly; [`respond`] answers the call and
//! marks a replay with `idempotent-replayed: true`.
//!
//! ```ignore
//! use idempotency::grpc;
//! use idempotency::http::IdempotencyKey;
//!
//! #[idempotent(key = "<user>:<idem_key>", ttl = "24h", biz = "grpc_pay", engine = app.idem)]
//! async fn pay_order(app: &App, tx: &mut Transaction<'_, MySql>, user: String, idem_key: String,
//!     order_id: i64, amount: i64) -> Result<PayReply, ApiError> { /* ... */ }
//!
//! #[tonic::async_trait]
//! impl Payments for PaymentService {
//!     async fn pay(&self, request: Request<PayRequest>) -> Result<Response<PayReply>, Status> {
//!         let user = authenticate(&request)?;              // your principal, checked by `check_principal`
//!         let IdempotencyKey(idem_key) = IdempotencyKey::from_metadata(request.metadata())?;
//!         let PayRequest { order_id, amount } = request.into_inner();
//!         grpc::respond(pay_order(&self.app, user, idem_key, order_id, amount)).await
//!     }
//! }
//! ```
//!
//! What callers see (every refusal carries the problem's `code` in the
//! metadata `idem-code` and opens its message with it, e.g.
//! `IDEMPOTENCY_KEY_REUSED: this idempotency key was already used ...`,
//! and `idempotency-should-retry: true` on the `UNAVAILABLE` rows below,
//! `false` on every other; the message never repeats the key or a byte the
//! caller sent that is not visible ASCII):
//!
//! | situation | status | `idem-code` |
//! |---|---|---|
//! | first call | the method's own response | |
//! | duplicate of a finished call | the same message, plus metadata `idempotent-replayed: true` | |
//! | duplicate while the first runs, with a wait (`wait = "5s"`, `Builder::wait`) | the first call's answer once it ends, marked | |
//! | an error the method's type declares final (`record_errors`) | its own status, replayed to every retry, marked | |
//! | duplicate while the first runs | `UNAVAILABLE` (retryable), `retry-after: 1`, `grpc-retry-pushback-ms: 1000` | `IDEMPOTENCY_KEY_IN_PROGRESS` |
//! | same key, other arguments | `FAILED_PRECONDITION` (not retryable) | `IDEMPOTENCY_KEY_REUSED` |
//! | no `idempotency-key` metadata | `INVALID_ARGUMENT` | `MISSING_IDEMPOTENCY_KEY` |
//! | key not `[A-Za-z0-9_.:-]{8,255}` (bare or quoted), badly quoted, or sent twice | `INVALID_ARGUMENT` | `INVALID_IDEMPOTENCY_KEY` |
//! | principal with `:`, or not `[A-Za-z0-9_.-]{1,64}` ([`check_principal`]) | `INVALID_ARGUMENT` | `INVALID_PRINCIPAL` |
//! | rendered `biz_no` longer than 64 bytes | `INVALID_ARGUMENT` | `INVALID_BIZ_NO` |
//! | an argument holds a NaN or infinite float | `INVALID_ARGUMENT` | `NON_FINITE_NUMBER` |
//! | database unreachable | `UNAVAILABLE` (retryable) | `IDEMPOTENCY_STORAGE_UNAVAILABLE` |
//! | a two-phase call failed for good (`Error::Permanent`), unmapped by the method | `FAILED_PRECONDITION`, replayed to every retry | `IDEMPOTENT_REQUEST_FAILED` |
//! | stored result no longer deserializes / cannot serialize | `INTERNAL` | `IDEMPOTENCY_REPLAY_FAILED` / `IDEMPOTENCY_SERIALIZE_FAILED` |
//! | `biz` or a step misconfigured in the server's code | `INTERNAL` | `IDEMPOTENCY_MISCONFIGURED` |
//! | `idempotency-token` forged, malformed, expired, or another caller's | `PERMISSION_DENIED` | `IDEMPOTENCY_TOKEN_INVALID` |
//! | the token store unreachable | `UNAVAILABLE`, `retry-after: 1`, `grpc-retry-pushback-ms: 1000` | `IDEMPOTENCY_STORAGE_UNAVAILABLE` |
//!
//! Why these codes: gRPC retry policies retry what their
//! `retryableStatusCodes` list, which in practice is `UNAVAILABLE`; a call
//! still running is worth asking again after the pushback (the retry then
//! gets the replay), and so is a database that is down (nothing was
//! written). A reused key is `FAILED_PRECONDITION`: asking again cannot
//! help until the client picks a new key, and unlike `ALREADY_EXISTS` it
//! cannot be read as "my earlier create went through" (this request did
//! not run). `ABORTED` is left out: it tells clients to retry.
//!
//! Notes:
//! - Only ASCII metadata is read: an `idempotency-key-bin` is not a key, so
//!   a client sending only that is answered `MISSING_IDEMPOTENCY_KEY`.
//! - Scope the key to the caller in the template (`<user>:<idem_key>`) and
//!   check the principal with [`check_principal`], as over HTTP.
//! - The replay marker sees the `#[idempotent]` call awaited inside
//!   [`respond`]'s future (not one in a `tokio::spawn`ed task).

use std::future::Future;

use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::{Code, Response, Status};

use crate::error::Error;
use crate::http::{IdempotencyKey, IdempotencyToken, KeyOrToken, ProblemDetails, header, observe_replay};
use crate::token::TokenError;

pub use crate::http::header::{IDEMPOTENCY_KEY, IDEMPOTENCY_TOKEN, IDEMPOTENT_REPLAYED, REPLAYED, SHOULD_RETRY};

/// The response metadata naming a refusal's stable code
/// (`IDEMPOTENCY_KEY_REUSED`, ...), for clients that branch on it.
pub const IDEM_CODE: &str = "idem-code";
/// The response metadata with the seconds to wait before asking again, as
/// HTTP's `Retry-After`.
pub const RETRY_AFTER: &str = "retry-after";
/// The server pushback of gRPC's retry design: milliseconds a client's
/// retry policy waits before its next attempt.
pub const RETRY_PUSHBACK_MS: &str = "grpc-retry-pushback-ms";

impl IdempotencyKey {
    /// Reads and checks the key from a gRPC request's metadata
    /// (`request.metadata()`): `idempotency-key`, under the rule of the
    /// `Idempotency-Key` header. Missing or malformed: `INVALID_ARGUMENT`
    /// (`MISSING_IDEMPOTENCY_KEY` or `INVALID_IDEMPOTENCY_KEY`), before
    /// anything is written.
    pub fn from_metadata(metadata: &MetadataMap) -> Result<Self, Status> {
        Self::from_header_values(ascii_values(metadata, IDEMPOTENCY_KEY)).map_err(|p| refusal(&p))
    }
}

impl IdempotencyToken {
    /// Reads and checks a token the server issued from the metadata
    /// `idempotency-token`: `Ok(None)` when there is none; one that cannot
    /// be a token (or two) is `PERMISSION_DENIED`, like a forged one.
    pub fn from_metadata(metadata: &MetadataMap) -> Result<Option<Self>, Status> {
        Self::from_header_values(ascii_values(metadata, IDEMPOTENCY_TOKEN)).map_err(|p| refusal(&p))
    }
}

impl KeyOrToken {
    /// Reads either: the client's `idempotency-key` or an issued
    /// `idempotency-token`. Neither or both: `INVALID_ARGUMENT`.
    pub fn from_metadata(metadata: &MetadataMap) -> Result<Self, Status> {
        let keys = ascii_values(metadata, IDEMPOTENCY_KEY);
        Self::from_header_values(keys, ascii_values(metadata, IDEMPOTENCY_TOKEN)).map_err(|p| refusal(&p))
    }
}

/// Every ASCII value sent under `name`, as the raw bytes the rules read.
fn ascii_values<'a>(metadata: &'a MetadataMap, name: &'static str) -> impl Iterator<Item = &'a [u8]> {
    metadata.get_all(name).iter().map(AsciiMetadataValue::as_bytes)
}

/// Checks a principal (the authenticated caller) that scopes keys in a
/// template such as `key = "<user>:<idem_key>"`; the rule is
/// [`validate_principal`](crate::http::validate_principal)'s:
/// `[A-Za-z0-9_.-]{1,64}`, else `INVALID_ARGUMENT` (`INVALID_PRINCIPAL`).
/// Call it where the method (or an interceptor) authenticates the caller.
pub fn check_principal(principal: &str) -> Result<(), Status> {
    crate::http::validate_principal(principal).map_err(|p| refusal(&p))
}

/// Runs an `#[idempotent]` call and answers it: `Ok` becomes the response
/// message (through `Into`, so the fn may return its own serializable type),
/// marked `idempotent-replayed: true` when it was replayed; `Err` becomes
/// its [`Status`] (`idempotency::Error` converts by the table in the module docs).
///
/// ```ignore
/// grpc::respond(pay_order(&self.app, user, idem_key, order_id, amount)).await
/// ```
pub async fn respond<T, M, E>(call: impl Future<Output = Result<T, E>>) -> Result<Response<M>, Status>
where
    T: Into<M>,
    E: Into<Status>,
{
    let (result, replayed) = observe_replay(call).await;
    let mark = |metadata: &mut MetadataMap| {
        if replayed {
            metadata.insert(IDEMPOTENT_REPLAYED, AsciiMetadataValue::from_static(header::REPLAYED));
        }
    };
    match result {
        Ok(value) => {
            let mut response = Response::new(value.into());
            mark(response.metadata_mut());
            Ok(response)
        }
        Err(error) => {
            // A recorded permanent failure is a replay too: marked as HTTP marks it.
            let mut status = error.into();
            mark(status.metadata_mut());
            Err(status)
        }
    }
}

/// The status of an [`Error`]; see the table in the [module docs](self).
/// A server-side failure is logged with its cause, which the status hides.
impl From<Error> for Status {
    fn from(error: Error) -> Self {
        status(&ProblemDetails::answering(&error), code_of(&error))
    }
}

/// The status of a [`TokenError`]: `PERMISSION_DENIED` for a refused
/// token, `UNAVAILABLE` when its store cannot answer.
impl From<TokenError> for Status {
    fn from(error: TokenError) -> Self {
        status(&ProblemDetails::answering_token(&error), token_code_of(&error))
    }
}

fn code_of(error: &Error) -> Code {
    match error {
        Error::InProgress { .. } | Error::Storage(_) => Code::Unavailable,
        Error::KeyReused { .. } | Error::Permanent { .. } => Code::FailedPrecondition,
        Error::InvalidKey(_)
        | Error::BizNoTooLong { .. }
        | Error::InvalidText { .. }
        | Error::NonFiniteFloat { .. } => Code::InvalidArgument,
        Error::Replay { .. }
        | Error::Serialize(_)
        | Error::InvalidBiz
        | Error::InvalidStep { .. }
        | Error::StorageRefused(_)
        | Error::NotMigrated(_)
        | Error::ResultTooLarge { .. } => Code::Internal,
    }
}

fn token_code_of(error: &TokenError) -> Code {
    match error {
        TokenError::Refused(_) => Code::PermissionDenied,
        TokenError::InvalidSubject { .. } => Code::InvalidArgument,
        TokenError::Unavailable(_) | TokenError::Storage(_) | TokenError::Random(_) => Code::Unavailable,
        TokenError::InvalidBiz | TokenError::InvalidTtl => Code::Internal,
    }
}

/// A refusal by the key, token or principal rules: 403 (a token) is
/// `PERMISSION_DENIED`, every other (400) `INVALID_ARGUMENT`.
fn refusal(problem: &ProblemDetails) -> Status {
    let code = if problem.status == 403 { Code::PermissionDenied } else { Code::InvalidArgument };
    status(problem, code)
}

/// The problem as a status: its code and detail as the message, its code
/// in `idem-code`, `idempotency-should-retry`, and the retry hints when
/// asking again may help.
fn status(problem: &ProblemDetails, code: Code) -> Status {
    let mut status = Status::new(code, problem.to_string());
    let metadata = status.metadata_mut();
    metadata.insert(IDEM_CODE, AsciiMetadataValue::from_static(problem.code));
    let retry = if problem.should_retry() { "true" } else { "false" };
    metadata.insert(SHOULD_RETRY, AsciiMetadataValue::from_static(retry));
    if let Some(seconds) = problem.retry_after {
        metadata.insert(RETRY_AFTER, seconds.into());
        metadata.insert(RETRY_PUSHBACK_MS, (u64::from(seconds) * 1000).into());
    }
    status
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::KeyError;
    use crate::token::Refusal;

    fn metadata(pairs: &[(&'static str, &[u8])]) -> MetadataMap {
        let mut metadata = MetadataMap::new();
        for &(name, value) in pairs {
            metadata.append(name, AsciiMetadataValue::try_from(value).expect("a metadata value"));
        }
        metadata
    }

    fn shown(status: &Status) -> (Code, &str, Option<&str>, Option<&str>) {
        let header = |name| status.metadata().get(name).map(|v| v.to_str().unwrap());
        // Said on every refusal: to retry exactly when the pushback says when.
        let retry = if header(RETRY_PUSHBACK_MS).is_some() { "true" } else { "false" };
        assert_eq!(header(SHOULD_RETRY), Some(retry), "{status:?}");
        (status.code(), header(IDEM_CODE).unwrap(), header(RETRY_AFTER), header(RETRY_PUSHBACK_MS))
    }

    #[test]
    fn errors_become_the_codes_of_the_table() {
        let json_error = || serde_json::from_str::<u8>("x").unwrap_err();
        let retry = (Some("1"), Some("1000"));
        let cases = [
            (
                Error::InProgress { biz: "pay", key: "k".into() },
                Code::Unavailable,
                "IDEMPOTENCY_KEY_IN_PROGRESS",
                retry,
            ),
            (
                Error::KeyReused { biz: "pay", key: "k".into() },
                Code::FailedPrecondition,
                "IDEMPOTENCY_KEY_REUSED",
                (None, None),
            ),
            (
                Error::InvalidKey(KeyError::BadChar { ch: ' ', at: 1 }),
                Code::InvalidArgument,
                "INVALID_IDEMPOTENCY_KEY",
                (None, None),
            ),
            (Error::BizNoTooLong { len: 65, max: 64 }, Code::InvalidArgument, "INVALID_BIZ_NO", (None, None)),
            (Error::NonFiniteFloat { arg: "amount" }, Code::InvalidArgument, "NON_FINITE_NUMBER", (None, None)),
            (Error::Storage(sqlx::Error::PoolTimedOut), Code::Unavailable, "IDEMPOTENCY_STORAGE_UNAVAILABLE", retry),
            // A failure that recurs: not UNAVAILABLE (which clients retry).
            (
                Error::StorageRefused(sqlx::Error::RowNotFound),
                Code::Internal,
                "IDEMPOTENCY_STORAGE_REFUSED",
                (None, None),
            ),
            (Error::NotMigrated(sqlx::Error::RowNotFound), Code::Internal, "IDEMPOTENCY_NOT_MIGRATED", (None, None)),
            (
                Error::ResultTooLarge { biz: "pay", len: 2, max: 1 },
                Code::Internal,
                "IDEMPOTENCY_RESULT_TOO_LARGE",
                (None, None),
            ),
            (Error::InvalidText { field: "biz_no", at: 0 }, Code::InvalidArgument, "INVALID_TEXT", (None, None)),
            (
                Error::Replay { biz: "pay", key: "k".into(), source: json_error() },
                Code::Internal,
                "IDEMPOTENCY_REPLAY_FAILED",
                (None, None),
            ),
            (Error::Serialize(json_error()), Code::Internal, "IDEMPOTENCY_SERIALIZE_FAILED", (None, None)),
            (Error::InvalidBiz, Code::Internal, "IDEMPOTENCY_MISCONFIGURED", (None, None)),
        ];
        for (error, code, idem_code, (retry_after, pushback)) in cases {
            let problem = ProblemDetails::<u16>::from(&error);
            let status = Status::from(error);
            assert_eq!(shown(&status), (code, idem_code, retry_after, pushback));
            assert_eq!(status.message(), format!("{idem_code}: {}", problem.detail));
        }
    }

    #[test]
    fn token_errors_become_the_codes_of_the_table() {
        let cases = [
            (TokenError::Refused(Refusal::Unknown), Code::PermissionDenied, "IDEMPOTENCY_TOKEN_INVALID", None),
            (TokenError::Refused(Refusal::OtherSubject), Code::PermissionDenied, "IDEMPOTENCY_TOKEN_INVALID", None),
            (TokenError::InvalidSubject { len: 65 }, Code::InvalidArgument, "INVALID_PRINCIPAL", None),
            (TokenError::Unavailable("redis"), Code::Unavailable, "IDEMPOTENCY_STORAGE_UNAVAILABLE", Some("1000")),
            (
                TokenError::Storage(sqlx::Error::PoolTimedOut),
                Code::Unavailable,
                "IDEMPOTENCY_STORAGE_UNAVAILABLE",
                Some("1000"),
            ),
            (TokenError::InvalidTtl, Code::Internal, "IDEMPOTENCY_MISCONFIGURED", None),
        ];
        for (error, code, idem_code, pushback) in cases {
            let status = Status::from(error);
            let (got, got_code, _, got_pushback) = shown(&status);
            assert_eq!((got, got_code, got_pushback), (code, idem_code, pushback));
        }
    }

    #[test]
    fn metadata_follows_the_header_rules() {
        let key = |pairs: &[(&'static str, &[u8])]| IdempotencyKey::from_metadata(&metadata(pairs));
        assert_eq!(key(&[("idempotency-key", b"\"abcdefgh\"")]).unwrap(), IdempotencyKey("abcdefgh".into()));
        let refused: [&[(&'static str, &[u8])]; 4] = [
            &[],
            &[("idempotency-key", b"abc")],
            &[("idempotency-key", b"abcdefgh"), ("idempotency-key", b"abcdefgh")],
            &[("idempotency-key", b"abcd\xffefgh")],
        ];
        for pairs in refused {
            let core = IdempotencyKey::from_header_values(pairs.iter().map(|&(_, v)| v)).unwrap_err();
            let status = key(pairs).unwrap_err();
            assert_eq!(shown(&status), (Code::InvalidArgument, core.code, None, None));
            assert_eq!(status.message(), core.to_string());
        }
        let binary = {
            let mut m = MetadataMap::new();
            m.insert_bin("idempotency-key-bin", tonic::metadata::BinaryMetadataValue::from_bytes(b"abcdefgh"));
            m
        };
        let missing = IdempotencyKey::from_metadata(&binary).unwrap_err();
        assert_eq!(shown(&missing).1, "MISSING_IDEMPOTENCY_KEY", "binary metadata is not a key");

        let token = b"AbCdEfGhIjKlMnOpQrStUvWxYz0123-_";
        let either = |pairs: &[(&'static str, &[u8])]| KeyOrToken::from_metadata(&metadata(pairs));
        assert!(matches!(either(&[("idempotency-token", token)]), Ok(KeyOrToken::Token(_))));
        assert_eq!(either(&[("idempotency-token", b"forged")]).unwrap_err().code(), Code::PermissionDenied);
        let both = either(&[("idempotency-token", token), ("idempotency-key", b"abcdefgh")]).unwrap_err();
        assert_eq!(shown(&both).0, Code::InvalidArgument);
        assert_eq!(IdempotencyToken::from_metadata(&metadata(&[])).unwrap(), None);

        let principal = check_principal("alice:x").unwrap_err();
        assert_eq!(shown(&principal), (Code::InvalidArgument, "INVALID_PRINCIPAL", None, None));
        assert!(!principal.message().contains("alice"), "{}", principal.message());
        assert!(check_principal("alice").is_ok());
    }
}
