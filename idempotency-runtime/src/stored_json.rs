//! [`StoredJson`]: a fn's value kept as the JSON its record holds, so a
//! replay hands those bytes on instead of decoding them into the value's
//! type and encoding them again for the response.

use std::fmt;

use serde::de::{Deserialize, DeserializeOwned, Deserializer};
use serde::ser::{Serialize, Serializer};
use serde_json::value::RawValue;

/// The value of an `#[idempotent]` fn as the JSON it is stored as.
///
/// A fn returning `T` hands every caller a `T` decoded from the stored
/// JSON, which an HTTP handler then encodes again for its response. A fn
/// returning `StoredJson<T>` hands the stored JSON itself: checked to be
/// JSON, copied once, never decoded. It is what a handler answers with
/// (`IntoResponse` with the feature `axum`, `Responder` with `actix`: `200
/// OK`, `application/json`, the stored bytes), and the first caller and
/// every replay get the same bytes.
///
/// ```ignore
/// #[idempotent(key = "<user>:<idem_key>", ttl = "24h", biz = "pay")]
/// async fn pay(app: &App, tx: &mut Transaction<'_, MySql>, user: String, idem_key: String, order_id: i64)
///     -> Result<StoredJson<Receipt>, PayError>
/// {
///     let receipt = charge(tx, &user, order_id).await?;
///     Ok(StoredJson::new(receipt))
/// }
/// ```
///
/// What it does not do: check that the stored JSON still reads as a `T`.
/// [`into_value`](StoredJson::into_value) decodes it when the value itself
/// is needed, and fails there if `T` changed since the record was written.
#[derive(Clone)]
pub struct StoredJson<T> {
    held: Held<T>,
}

#[derive(Clone)]
enum Held<T> {
    /// Made by the fn's body; written as `T` when stored.
    Value(T),
    /// Read back from the record (or from a cached copy of it).
    Json(Box<RawValue>),
}

impl<T> StoredJson<T> {
    /// The value a fn's body returns.
    pub fn new(value: T) -> Self {
        StoredJson { held: Held::Value(value) }
    }

    /// The stored JSON, as a call's caller gets it (first call and replay
    /// alike); `None` for a value made by [`new`](Self::new) that no call
    /// stored yet.
    pub fn json(&self) -> Option<&str> {
        match &self.held {
            Held::Value(_) => None,
            Held::Json(json) => Some(json.get()),
        }
    }

    /// The value itself: decoded from the stored JSON, or as made.
    pub fn into_value(self) -> Result<T, serde_json::Error>
    where
        T: DeserializeOwned,
    {
        match self.held {
            Held::Value(value) => Ok(value),
            Held::Json(json) => serde_json::from_str(json.get()),
        }
    }

    /// The response body: the stored bytes as they are, or a value not
    /// stored yet written as JSON.
    #[cfg(any(feature = "axum", feature = "actix"))]
    pub(crate) fn into_body(self) -> Result<String, serde_json::Error>
    where
        T: Serialize,
    {
        match self.held {
            Held::Value(value) => serde_json::to_string(&value),
            Held::Json(json) => Ok(String::from(Box::<str>::from(json))),
        }
    }
}

impl<T> From<T> for StoredJson<T> {
    fn from(value: T) -> Self {
        StoredJson::new(value)
    }
}

impl<T: Serialize> Serialize for StoredJson<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match &self.held {
            Held::Value(value) => value.serialize(serializer),
            Held::Json(json) => json.serialize(serializer),
        }
    }
}

/// Keeps the JSON as it is, whatever it holds (see [`StoredJson`]): only
/// from serde_json, which the engine reads stored results with.
impl<'de, T> Deserialize<'de> for StoredJson<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Box::<RawValue>::deserialize(deserializer).map(|json| StoredJson { held: Held::Json(json) })
    }
}

impl<T: fmt::Debug> fmt::Debug for StoredJson<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.held {
            Held::Value(value) => f.debug_tuple("StoredJson").field(value).finish(),
            Held::Json(json) => f.debug_tuple("StoredJson").field(&json.get()).finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Receipt {
        id: u64,
        status: String,
    }

    #[test]
    fn a_value_is_stored_as_itself_and_read_back_as_its_bytes() {
        let made = StoredJson::new(Receipt { id: 7, status: "PAID".into() });
        assert_eq!(made.json(), None);
        let stored = serde_json::to_string(&made).unwrap();
        assert_eq!(stored, r#"{"id":7,"status":"PAID"}"#);
        let read: StoredJson<Receipt> = serde_json::from_str(&stored).unwrap();
        assert_eq!(read.json(), Some(stored.as_str()));
        // Stored again (a cached copy of the record), the bytes stay.
        assert_eq!(serde_json::to_string(&read).unwrap(), stored);
        assert_eq!(read.into_value().unwrap(), Receipt { id: 7, status: "PAID".into() });
    }

    #[test]
    fn the_bytes_are_kept_as_stored_not_rewritten() {
        // Written by another serializer, say an older release: spacing and
        // key order stay as they are.
        let stored = r#"{ "status": "PAID", "id": 7 }"#;
        let read: StoredJson<Receipt> = serde_json::from_str(stored).unwrap();
        assert_eq!(read.json(), Some(stored));
    }

    #[test]
    fn what_is_not_json_is_refused_and_what_is_not_a_t_fails_only_when_decoded() {
        assert!(serde_json::from_str::<StoredJson<Receipt>>("{\"id\":").is_err());
        let other: StoredJson<Receipt> = serde_json::from_str(r#"{"id":"seven"}"#).unwrap();
        assert!(other.into_value().is_err());
    }
}
