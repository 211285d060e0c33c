//! The typed side of a call, behind `dyn`: the only code each annotated fn
//! adds beside its own body. The flows ([`run`](super::run),
//! [`run_joined`](super::joined::run_joined), the steps' `run_steps`) are
//! generic over the backend alone, so they are built once per backend (and
//! shared from this crate: [`prebuilt`](super::prebuilt)), not once per fn;
//! what stays generic is the body, its value's JSON, and handing the caller
//! its `Result<T, E>`, as async-trait boxes a method's future and tracing
//! keeps its expansion thin.
//!
//! The attribute writes (see `expand.rs` in the macros crate):
//!
//! ```ignore
//! let mut value = None;
//! let mut error = None;
//! let ended = {
//!     let error = &mut error;
//!     let mut body = Body::new(&mut value, move |tx| async move {
//!         let out: Result<T, E> = { /* the fn's body */ };
//!         (tx, stored(out, error))
//!     });
//!     run(engine, &SPEC, key, fingerprint, biz_no, &mut body).await
//! };
//! answer(ended, value, error)
//! ```

use std::future::Future;
use std::pin::Pin;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::Error;

/// A future on the heap, as the flows take the body's and return their own.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why the body gave no result to store.
pub enum Failed {
    /// The body returned its own error (kept for the caller by [`stored`]).
    Body,
    /// Its value has no JSON form.
    Serialize(serde_json::Error),
}

/// Why a call did not return a value: the engine's reason, or the body's
/// (which the caller's fn holds).
pub enum CallError {
    /// The engine's: the key, the arguments, the store, the record.
    Idem(Error),
    /// The body's own error, kept by [`stored`].
    Body,
}

impl From<Error> for CallError {
    fn from(e: Error) -> Self {
        CallError::Idem(e)
    }
}

/// One call's typed side, as a flow sees it. `H` is what the body is handed
/// and hands back: a transaction, a savepoint, the step context.
pub trait Typed<H>: Send {
    /// Runs the body (once): its value comes back as the JSON to store.
    fn run<'s>(&'s mut self, handed: H) -> BoxFuture<'s, (H, Result<String, Failed>)>
    where
        H: 's;

    /// Reads a stored result as the caller's value. The first caller's
    /// value is read back from its own JSON too, so it gets what every
    /// replay will.
    fn decode(&mut self, response: &str) -> Result<(), serde_json::Error>;
}

/// Runs the body and reads its value back from the JSON it gave: the first
/// caller gets what every replay will (a skipped field, a float that JSON
/// cannot hold), and a result that cannot replay fails before anything
/// commits.
pub(crate) async fn run_and_read<H: Send>(body: &mut (dyn Typed<H> + '_), handed: H) -> (H, Result<String, Failed>) {
    let (handed, result) = body.run(handed).await;
    let result = match result {
        Ok(json) => body.decode(&json).map(|()| json).map_err(Failed::Serialize),
        Err(failed) => Err(failed),
    };
    (handed, result)
}

/// The typed side of one annotated fn: its body, and where its value goes.
pub struct Body<'v, F, T> {
    body: Option<F>,
    value: &'v mut Option<T>,
}

impl<'v, F, T> Body<'v, F, T> {
    /// `body`, whose value goes to `value` once decoded.
    pub fn new(value: &'v mut Option<T>, body: F) -> Self {
        Body { body: Some(body), value }
    }
}

impl<'v, H, F, Fut, T> Typed<H> for Body<'v, F, T>
where
    H: Send,
    F: FnOnce(H) -> Fut + Send,
    Fut: Future<Output = (H, Result<String, Failed>)> + Send + 'v,
    T: DeserializeOwned + Send,
{
    fn run<'s>(&'s mut self, handed: H) -> BoxFuture<'s, (H, Result<String, Failed>)>
    where
        H: 's,
    {
        match self.body.take() {
            Some(body) => Box::pin(body(handed)),
            None => unreachable!("a flow runs the body once"),
        }
    }

    fn decode(&mut self, response: &str) -> Result<(), serde_json::Error> {
        // `serde_json::from_str`, written out: two generic calls fewer per type.
        let mut json = serde_json::Deserializer::from_str(response);
        *self.value = Some(T::deserialize(&mut json)?);
        json.end()
    }
}

/// The body's result as the flow takes it: its value's JSON, or its error
/// kept in `error` for [`answer`].
pub fn stored<T: Serialize, E>(out: Result<T, E>, error: &mut Option<E>) -> Result<String, Failed> {
    match out {
        Ok(value) => {
            // `serde_json::to_string`, written out: two generic calls fewer per type.
            let mut json = Vec::with_capacity(128);
            match value.serialize(&mut serde_json::Serializer::new(&mut json)) {
                Ok(()) => Ok(text(json)),
                Err(e) => Err(Failed::Serialize(e)),
            }
        }
        Err(e) => {
            *error = Some(e);
            Err(Failed::Body)
        }
    }
}

/// What the caller gets, once the flow said how the call ended.
pub fn answer<T, E: From<Error>>(ended: Result<(), CallError>, value: Option<T>, error: Option<E>) -> Result<T, E> {
    // A flow ends `Ok` only after a `decode` that worked, and `Body` only
    // after the body's error.
    match ended {
        Ok(()) => match value {
            Some(value) => Ok(value),
            None => unreachable!("a call that ended well decoded its value"),
        },
        Err(CallError::Idem(e)) => Err(E::from(e)),
        Err(CallError::Body) => match error {
            Some(error) => Err(error),
            None => unreachable!("a body that failed left its error"),
        },
    }
}

/// serde_json's output as the `String` it is: serde_json writes UTF-8 only.
fn text(json: Vec<u8>) -> String {
    String::from_utf8(json).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    use super::{Body, Failed, Typed, stored};

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Receipt {
        order_id: u64,
        note: Option<String>,
        state: State,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    enum State {
        Paid,
        Refunded { amount: i64 },
    }

    fn decoded(json: &str) -> Result<Receipt, serde_json::Error> {
        let mut value = None;
        let mut body = Body::new(&mut value, |tx: ()| async move { (tx, Err(Failed::Body)) });
        Typed::<()>::decode(&mut body, json)?;
        Ok(value.expect("decoded"))
    }

    /// `stored` writes serde_json's own bytes, so records written before
    /// it replay byte for byte, and keeps the body's error for `answer`.
    #[test]
    fn stored_writes_what_serde_json_writes() {
        let receipts = [
            Receipt { order_id: 7, note: None, state: State::Paid },
            Receipt { order_id: u64::MAX, note: Some("\"q\" \u{e9}\n".into()), state: State::Refunded { amount: -3 } },
        ];
        let mut error: Option<()> = None;
        for receipt in receipts {
            let expected = serde_json::to_string(&receipt).unwrap();
            assert!(matches!(stored(Ok(receipt), &mut error), Ok(json) if json == expected));
        }
        let map: std::collections::HashMap<(u8, u8), u8> = [((1, 2), 3)].into();
        let refused = serde_json::to_string(&map).unwrap_err().to_string();
        assert!(matches!(stored::<_, ()>(Ok(map), &mut error), Err(Failed::Serialize(e)) if e.to_string() == refused));
        assert!(error.is_none());
        assert!(matches!(stored::<(), _>(Err("body"), &mut None), Err(Failed::Body)));
        let mut kept = None;
        let _ = stored::<(), _>(Err("body"), &mut kept);
        assert_eq!(kept, Some("body"));
    }

    /// `decode` reads and fails as `serde_json::from_str`, the error's text
    /// (with its position) included.
    #[test]
    fn decode_reads_and_fails_as_serde_json_does() {
        let good = r#" {"order_id":7,"note":null,"state":{"Refunded":{"amount":2}}} "#;
        assert_eq!(decoded(good).unwrap(), serde_json::from_str::<Receipt>(good).unwrap());
        for bad in [
            r#"{"order_id":7,"note":null}"#,
            r#"{"order_id":"7","note":null,"state":"Paid"}"#,
            r#"{"order_id":7,"note":null,"state":"Settled"}"#,
            r#"{"order_id":7,"note":null,"state":"Paid"} x"#,
            r#"{"order_id":7,"#,
        ] {
            let expected = serde_json::from_str::<Receipt>(bad).unwrap_err().to_string();
            assert_eq!(decoded(bad).unwrap_err().to_string(), expected, "{bad}");
        }
    }
}
