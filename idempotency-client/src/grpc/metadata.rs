//! The outcome of a call as metadata of its answer: gRPC's errors reach
//! the caller as a `Status`, which carries metadata and no extensions.

use std::time::Duration;

use http::{HeaderMap, HeaderValue};

use crate::attempts::{Stop, Tally};
use crate::outcome::Outcome;

/// The metadata the gRPC layer adds to every answer it hands back, a
/// success's or an error's (prefixed `idem-client-`: this client's, not
/// the server's).
pub(crate) const KEY: &str = "idem-client-key";
pub(crate) const ATTEMPTS: &str = "idem-client-attempts";
pub(crate) const STOP: &str = "idem-client-stop";

/// Writes the key, the attempts and the stop as metadata (replacing any
/// the server sent under those names).
pub(crate) fn write(headers: &mut HeaderMap, key: &str, tally: Tally) {
    if let Ok(key) = HeaderValue::from_str(key) {
        headers.insert(KEY, key);
    }
    headers.insert(ATTEMPTS, tally.attempts.into());
    let stop = match tally.stop {
        Stop::Final => HeaderValue::from_static("final"),
        Stop::Attempts => HeaderValue::from_static("attempts"),
        Stop::Time => HeaderValue::from_static("time"),
        Stop::NotResendable => HeaderValue::from_static("not-resendable"),
        Stop::RetryAfterTooLong(after) => HeaderValue::from_str(&format!("retry-after-too-long:{}", after.as_millis()))
            .expect("digits are a header value"),
    };
    headers.insert(STOP, stop);
}

/// What [`write`] wrote, read back; `None` without it.
pub(crate) fn read(headers: &HeaderMap) -> Option<Outcome> {
    let text = |name| headers.get(name).and_then(|v| v.to_str().ok());
    let stop = match text(STOP)? {
        "final" => Stop::Final,
        "attempts" => Stop::Attempts,
        "time" => Stop::Time,
        "not-resendable" => Stop::NotResendable,
        other => {
            Stop::RetryAfterTooLong(Duration::from_millis(other.strip_prefix("retry-after-too-long:")?.parse().ok()?))
        }
    };
    let tally = Tally { attempts: text(ATTEMPTS)?.parse().ok()?, stop };
    Some(Outcome::new(text(KEY)?.to_owned(), tally, headers))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::{IDEMPOTENT_REPLAYED, REPLAYED};

    #[test]
    fn metadata_reads_back_what_was_written() {
        let stops = [
            Stop::Final,
            Stop::Attempts,
            Stop::Time,
            Stop::NotResendable,
            Stop::RetryAfterTooLong(Duration::from_secs(60)),
        ];
        for stop in stops {
            let mut headers = HeaderMap::new();
            headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static(REPLAYED));
            write(&mut headers, "order-42-pay", Tally { attempts: 3, stop });
            let read = read(&headers).expect("an outcome");
            assert_eq!(read, Outcome { key: "order-42-pay".into(), attempts: 3, replayed: true, stop });
        }
        assert_eq!(read(&HeaderMap::new()), None);
    }
}
