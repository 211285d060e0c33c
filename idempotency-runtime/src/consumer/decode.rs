//! What a delivery's bytes become: the handler's argument, or a poison
//! message (an `Err` with the reason as text, dead-lettered unhandled).
//! These read input from the outside world: they never panic.

use serde::de::DeserializeOwned;

use super::transport::Settle;

/// The payload as JSON.
pub(crate) fn payload_json<M: DeserializeOwned>(payload: &[u8]) -> Result<M, String> {
    serde_json::from_slice(payload).map_err(|e| format!("payload: {e}"))
}

/// The message id (`None`: the delivery has none; `where_id_is` says where
/// it was looked for) and the payload as JSON.
pub(crate) fn message_id_and_payload_json<M: DeserializeOwned>(
    message_id: Option<&str>,
    where_id_is: &str,
    payload: &[u8],
) -> Result<(String, M), String> {
    let id = message_id.ok_or_else(|| format!("no {where_id_is}"))?;
    Ok((id.to_owned(), payload_json(payload)?))
}

/// [`payload_json`] of a delivery of `T` (what `Consumer::run` hands over).
pub(crate) fn payload<T: Settle, M: DeserializeOwned>(delivery: &T::Delivery) -> Result<M, String> {
    payload_json(T::payload(delivery)?)
}

/// [`message_id_and_payload_json`] of a delivery of `T` (`Consumer::run_with_id`).
pub(crate) fn message_id_and_payload<T: Settle, M: DeserializeOwned>(
    delivery: &T::Delivery,
) -> Result<(String, M), String> {
    message_id_and_payload_json(T::message_id(delivery), T::MESSAGE_ID, T::payload(delivery)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poison_is_an_error_never_a_panic() {
        assert_eq!(payload_json::<u8>(b"7"), Ok(7));
        assert!(payload_json::<u8>(b"{not json").unwrap_err().starts_with("payload: "));
        assert!(payload_json::<u8>(&[0xff, 0xfe]).is_err());
        assert_eq!(message_id_and_payload_json::<u8>(Some("m"), "id", b"1"), Ok(("m".to_owned(), 1)));
        assert_eq!(
            message_id_and_payload_json::<u8>(None, "message_id field", b"1").unwrap_err(),
            "no message_id field"
        );
    }
}
