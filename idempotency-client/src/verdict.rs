//! What an answer tells the caller to do next, read from the status and the
//! headers alone (a body is never read to decide): the retry table of the
//! crate's docs, once for HTTP and once for gRPC.

use std::time::{Duration, SystemTime};

use http::HeaderMap;
use http::header::RETRY_AFTER;

use crate::header::SHOULD_RETRY;

/// Try again (not before `after` when the server said when), or stop here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Final,
    Retry { after: Option<Duration> },
}

/// An HTTP answer. The server's own word (`Idempotency-Should-Retry`)
/// decides when it gives it; otherwise the status: 429, 502, 503 and 504
/// are retried, and so are a 409 and any other 5xx that carry a
/// `Retry-After` (this crate's `IDEMPOTENCY_KEY_IN_PROGRESS`; its final
/// 500s carry none). Everything else is final: 1xx to 3xx, and the other
/// 4xx (400, 422 `IDEMPOTENCY_KEY_REUSED`, ...) and 5xx.
pub(crate) fn of_http(status: http::StatusCode, headers: &HeaderMap) -> Verdict {
    if !status.is_client_error() && !status.is_server_error() {
        return Verdict::Final;
    }
    let after = retry_after(headers);
    let retry = match should_retry(headers) {
        Some(said) => said,
        None => match status.as_u16() {
            429 | 502 | 503 | 504 => true,
            409 => after.is_some(),
            _ => status.is_server_error() && after.is_some(),
        },
    };
    if retry { Verdict::Retry { after } } else { Verdict::Final }
}

/// gRPC's codes this layer reads (`tonic::Code`'s numbers).
#[cfg(feature = "grpc")]
const ABORTED: u16 = 10;
#[cfg(feature = "grpc")]
const RESOURCE_EXHAUSTED: u16 = 8;
#[cfg(feature = "grpc")]
const UNAVAILABLE: u16 = 14;

/// A gRPC answer, from its headers: a trailers-only answer carries its
/// `grpc-status` there (every error this crate's servers answer does); one
/// without is a message whose status follows it, and final. The server's
/// `idempotency-should-retry` decides when given; otherwise `UNAVAILABLE`
/// and `ABORTED` are retried, and `RESOURCE_EXHAUSTED` when the server
/// says when; a negative `grpc-retry-pushback-ms` (gRPC's "do not retry")
/// stops. `FAILED_PRECONDITION` (a reused key), `INVALID_ARGUMENT`,
/// `INTERNAL` and the rest are final.
#[cfg(feature = "grpc")]
pub(crate) fn of_grpc(headers: &HeaderMap) -> Verdict {
    let Some(code) = headers.get("grpc-status").and_then(|v| v.to_str().ok()?.parse::<u16>().ok()) else {
        return Verdict::Final;
    };
    if code == 0 {
        return Verdict::Final;
    }
    let pushback = headers.get("grpc-retry-pushback-ms").map(|v| v.to_str().ok().and_then(|v| v.parse::<i64>().ok()));
    let after = match pushback {
        Some(Some(ms)) if ms >= 0 => Some(Duration::from_millis(ms.unsigned_abs())),
        Some(_) => return Verdict::Final, // negative or unreadable: the server says do not retry
        None => retry_after(headers),
    };
    let retry = match should_retry(headers) {
        Some(said) => said,
        None => match code {
            UNAVAILABLE | ABORTED => true,
            RESOURCE_EXHAUSTED => after.is_some(),
            _ => false,
        },
    };
    if retry { Verdict::Retry { after } } else { Verdict::Final }
}

/// `Idempotency-Should-Retry: true|false`, when the server sent it.
fn should_retry(headers: &HeaderMap) -> Option<bool> {
    let value = headers.get(SHOULD_RETRY)?.as_bytes();
    if value.eq_ignore_ascii_case(b"true") {
        Some(true)
    } else if value.eq_ignore_ascii_case(b"false") {
        Some(false)
    } else {
        None
    }
}

/// `Retry-After` as delay-seconds or an HTTP date (a date past is no
/// wait). A value that is neither is no hint.
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = text.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let date = httpdate::parse_http_date(text).ok()?;
    Some(date.duration_since(SystemTime::now()).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for &(name, value) in pairs {
            map.append(name, value.parse().unwrap());
        }
        map
    }

    fn http(status: u16, pairs: &[(&'static str, &str)]) -> Verdict {
        of_http(http::StatusCode::from_u16(status).unwrap(), &headers(pairs))
    }

    const SECOND: Option<Duration> = Some(Duration::from_secs(1));

    /// The table of the crate's docs, row by row, as this crate's servers answer.
    #[test]
    fn http_answers_of_an_idempotency_server() {
        let retry = Verdict::Retry { after: SECOND };
        // 409 IDEMPOTENCY_KEY_IN_PROGRESS, 503 IDEMPOTENCY_STORAGE_UNAVAILABLE.
        assert_eq!(http(409, &[("retry-after", "1"), ("idempotency-should-retry", "true")]), retry);
        assert_eq!(http(503, &[("retry-after", "1"), ("idempotency-should-retry", "true")]), retry);
        // 400, 422 IDEMPOTENCY_KEY_REUSED, 500 IDEMPOTENCY_STORAGE_REFUSED / NOT_MIGRATED.
        for status in [400, 422, 500] {
            assert_eq!(http(status, &[("idempotency-should-retry", "false")]), Verdict::Final, "{status}");
        }
        // The server's word beats the status either way.
        assert_eq!(http(503, &[("idempotency-should-retry", "false")]), Verdict::Final);
        assert_eq!(http(418, &[("idempotency-should-retry", "TRUE")]), Verdict::Retry { after: None });
        // A business 409 of the handler's own (ORDER_NOT_PAYABLE) says false.
        assert_eq!(http(409, &[("idempotency-should-retry", "false")]), Verdict::Final);
    }

    #[test]
    fn http_answers_without_the_servers_word() {
        for status in [200, 201, 204, 301, 304] {
            assert_eq!(http(status, &[("retry-after", "1")]), Verdict::Final, "{status}");
        }
        for status in [429, 502, 503, 504] {
            assert_eq!(http(status, &[]), Verdict::Retry { after: None }, "{status}");
        }
        assert_eq!(http(409, &[("retry-after", "1")]), Verdict::Retry { after: SECOND }, "in progress, older server");
        assert_eq!(http(500, &[("retry-after", "1")]), Verdict::Retry { after: SECOND });
        for status in [400, 401, 403, 404, 408, 409, 410, 422, 500, 501] {
            assert_eq!(http(status, &[]), Verdict::Final, "{status}");
        }
        assert_eq!(http(422, &[("retry-after", "1")]), Verdict::Final, "a 4xx other than 409 and 429");
        assert_eq!(http(503, &[("idempotency-should-retry", "maybe")]), Verdict::Retry { after: None });
    }

    #[test]
    fn retry_after_in_seconds_or_as_a_date() {
        assert_eq!(retry_after(&headers(&[("retry-after", " 7 ")])), Some(Duration::from_secs(7)));
        assert_eq!(retry_after(&headers(&[("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")])), Some(Duration::ZERO));
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(120));
        let wait = retry_after(&headers(&[("retry-after", &later)])).unwrap();
        assert!(wait > Duration::from_secs(100) && wait <= Duration::from_secs(120), "{wait:?}");
        for junk in ["-1", "1.5", "soon", ""] {
            assert_eq!(retry_after(&headers(&[("retry-after", junk)])), None, "{junk:?}");
        }
    }

    #[cfg(feature = "grpc")]
    fn grpc(pairs: &[(&'static str, &str)]) -> Verdict {
        of_grpc(&headers(pairs))
    }

    /// The codes and metadata of `idempotency::grpc`'s table.
    #[cfg(feature = "grpc")]
    #[test]
    fn grpc_answers_of_an_idempotency_server() {
        let in_progress = [("grpc-status", "14"), ("retry-after", "1"), ("grpc-retry-pushback-ms", "1000")];
        assert_eq!(grpc(&in_progress), Verdict::Retry { after: SECOND });
        assert_eq!(grpc(&[("grpc-status", "14")]), Verdict::Retry { after: None }, "a transport's UNAVAILABLE");
        // FAILED_PRECONDITION (reused key), INVALID_ARGUMENT, INTERNAL, PERMISSION_DENIED.
        for code in ["9", "3", "13", "7", "2", "4"] {
            assert_eq!(grpc(&[("grpc-status", code)]), Verdict::Final, "{code}");
        }
        assert_eq!(grpc(&[("grpc-status", "14"), ("grpc-retry-pushback-ms", "-1")]), Verdict::Final);
        assert_eq!(grpc(&[("grpc-status", "14"), ("grpc-retry-pushback-ms", "x")]), Verdict::Final);
        assert_eq!(grpc(&[("grpc-status", "14"), ("idempotency-should-retry", "false")]), Verdict::Final);
        assert_eq!(grpc(&[("grpc-status", "8")]), Verdict::Final);
        assert_eq!(
            grpc(&[("grpc-status", "8"), ("grpc-retry-pushback-ms", "250")]),
            Verdict::Retry { after: Some(Duration::from_millis(250)) }
        );
        assert_eq!(grpc(&[("grpc-status", "10")]), Verdict::Retry { after: None });
        assert_eq!(grpc(&[("grpc-status", "0")]), Verdict::Final);
        assert_eq!(grpc(&[]), Verdict::Final, "a message follows: its status comes in the trailers");
    }
}
