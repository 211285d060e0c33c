//! The typed side of a call, behind `dyn`: the only code each annotated fn
//! adds beside its own body. The flows ([`run`](super::run),
//! [`run_joined`](super::joined::run_joined), the steps' `run_steps`) are
//! generic over the backend alone, so they are built once per backend (and
//! shared from this crate: [`prebuilt`](crate::prebuilt)), not once per fn;
//! what stays generic is the body, its value's JSON, and handing the caller
//! its `Result<T, E>`, as async-trait boxes a method's future and tracing
//! keeps its expansion thin.
//!
//! The attribute writes (see `expand.rs` in the macros crate):
//!
//! ```ignore
//! let mut body = Body::new(move |tx| async move {
//!     let out: Result<T, E> = { /* the fn's body */ };
//!     (tx, out)
//! });
//! let ended = run(engine, &SPEC, key, fingerprint, biz_no, &mut body).await;
//! body.answer(ended)
//! ```
//!
//! A fn with `record_errors` writes `Body::recording(..)`: its declared
//! business errors ([`BusinessError`]) are recorded and replayed like values.

use std::future::Future;
use std::pin::Pin;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::business_error::BusinessError;
use crate::error::Error;
use crate::failure_log;

/// A future on the heap, as the flows take the body's and return their own.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why the body gave no value to store.
pub enum Failed {
    /// The body returned its own error (kept for the caller by [`stored`]).
    Body,
    /// The body returned an error its fn declared final
    /// ([`BusinessError`]): this JSON is recorded in the value's place, and
    /// every duplicate gets the same error.
    Recorded(String),
    /// Its value (or its declared error) has no JSON form.
    Serialize(serde_json::Error),
}

/// Why a call did not return a value: the engine's reason, or the body's
/// (which the caller's fn holds).
pub enum CallError {
    /// The engine's: the key, the arguments, the store, the record.
    Idem(Error),
    /// The body's own error, kept by [`stored`].
    Body,
    /// The call's answer is a recorded business error, its own or a
    /// replayed one: the fn holds it, read back from its record.
    Recorded,
}

impl CallError {
    /// Logs the cause of a call that failed on the database, once
    /// ([`failure_log`]); a recorded error is an answer, not a failure.
    pub(crate) fn log_cause(&self, biz: &'static str, key: &str) {
        match self {
            CallError::Idem(e) => failure_log::report(biz, key, failure_log::Failure::Engine(e)),
            CallError::Body => failure_log::report(biz, key, failure_log::Failure::Body),
            CallError::Recorded => {}
        }
    }
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

    /// Reads a recorded business error as the caller's error, as
    /// [`decode`](Typed::decode) reads a value (the first caller's too). A
    /// fn that records no errors cannot read one: an error.
    fn decode_failure(&mut self, recorded: &str) -> Result<(), serde_json::Error>;
}

/// Runs the body and reads its value (or its declared error) back from
/// the JSON it gave: the first caller gets what every replay will (a
/// skipped field, a float that JSON cannot hold), and an answer that cannot
/// replay fails before anything commits, as a final error with nothing
/// recorded.
pub(crate) async fn run_and_read<H: Send>(body: &mut (dyn Typed<H> + '_), handed: H) -> (H, Result<String, Failed>) {
    let (handed, result) = body.run(handed).await;
    let result = match result {
        Ok(json) => body.decode(&json).map(|()| json).map_err(Failed::Serialize),
        Err(Failed::Recorded(json)) => match body.decode_failure(&json) {
            Ok(()) => Err(Failed::Recorded(json)),
            Err(e) => Err(Failed::Serialize(e)),
        },
        Err(failed) => Err(failed),
    };
    (handed, result)
}

/// How a fn with `record_errors` records its declared errors and reads
/// them back: [`BusinessError`]'s, as plain functions, so [`Body`] needs
/// the trait only where the attribute asks for it.
struct Recording<E> {
    record: RecordFn<E>,
    replay: fn(&str) -> Result<E, serde_json::Error>,
}

/// The JSON of a declared business error's record; `None` for any other error.
type RecordFn<E> = fn(&E) -> Option<Result<String, serde_json::Error>>;

/// What a fn's value must be: stored as JSON, and read back from it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be stored and replayed by #[idempotent]",
    label = "the fn's value must implement `serde::Serialize` and `serde::Deserialize`",
    note = "add `#[derive(serde::Serialize, serde::Deserialize)]` to `{Self}`; a field that must not be stored can be `#[serde(skip)]`"
)]
pub trait Replayable: Serialize + DeserializeOwned {}

impl<T: Serialize + DeserializeOwned> Replayable for T {}

/// The typed side of one annotated fn: its body, its value or error once
/// the call ends, and how they go to and from JSON. The serde and error
/// bounds are checked once, where it is made ([`Body::new`]), so a value
/// that cannot be stored is one error on the fn's return type.
pub struct Body<'f, F, T, E> {
    body: Option<F>,
    value: Option<T>,
    error: Option<E>,
    to_json: fn(&T) -> Result<String, serde_json::Error>,
    from_json: fn(&str) -> Result<T, serde_json::Error>,
    from_idem: fn(Error) -> E,
    recording: Option<Recording<E>>,
    /// The body's future lives as long as this.
    _future: std::marker::PhantomData<&'f ()>,
}

impl<'f, F, T: Replayable, E: From<Error>> Body<'f, F, T, E> {
    /// `body`, whose value is stored and replayed.
    pub fn new(body: F) -> Self {
        Body {
            body: Some(body),
            value: None,
            error: None,
            to_json: to_json::<T>,
            from_json: from_json::<T>,
            from_idem: E::from,
            recording: None,
            _future: std::marker::PhantomData,
        }
    }
}

impl<'f, F, T, E> Body<'f, F, T, E> {
    /// What the caller gets, once the flow said how the call ended.
    pub fn answer(self, ended: Result<(), CallError>) -> Result<T, E> {
        // A flow ends `Ok` only after a `decode` that worked, `Body` only
        // after the body's error, and `Recorded` after a `decode_failure`.
        match ended {
            Ok(()) => match self.value {
                Some(value) => Ok(value),
                None => unreachable!("a call that ended well decoded its value"),
            },
            Err(CallError::Idem(e)) => Err((self.from_idem)(e)),
            Err(CallError::Body | CallError::Recorded) => match self.error {
                Some(error) => Err(error),
                None => unreachable!("a body that failed left its error, and a recorded one was read back"),
            },
        }
    }
}

impl<'f, F, T: Replayable, E: From<Error> + BusinessError> Body<'f, F, T, E> {
    /// As [`new`](Body::new), for a fn with `record_errors`: an error that
    /// [`BusinessError::recorded`] declares final is recorded and replayed.
    pub fn recording(body: F) -> Self {
        let recording = Recording { record: record_error::<E>, replay: replay_error::<E> };
        Body { recording: Some(recording), ..Body::new(body) }
    }
}

impl<'f, H, F, Fut, T, E> Typed<H> for Body<'f, F, T, E>
where
    H: Send,
    F: FnOnce(H) -> Fut + Send,
    Fut: Future<Output = (H, Result<T, E>)> + Send + 'f,
    T: Send,
    E: Send,
{
    fn run<'s>(&'s mut self, handed: H) -> BoxFuture<'s, (H, Result<String, Failed>)>
    where
        H: 's,
    {
        let Some(body) = self.body.take() else { unreachable!("a flow runs the body once") };
        Box::pin(async move {
            let (handed, out) = body(handed).await;
            let record = self.recording.as_ref().map(|r| r.record);
            (handed, stored(out, self.to_json, &mut self.error, record))
        })
    }

    fn decode(&mut self, response: &str) -> Result<(), serde_json::Error> {
        self.value = Some((self.from_json)(response)?);
        Ok(())
    }

    fn decode_failure(&mut self, recorded: &str) -> Result<(), serde_json::Error> {
        match &self.recording {
            Some(recording) => {
                self.error = Some((recording.replay)(recorded)?);
                Ok(())
            }
            None => Err(serde::de::Error::custom(
                "a recorded business error, and this fn records none (it lost `record_errors` since)",
            )),
        }
    }
}

/// The body's result as the flow takes it: its value's JSON; or its error,
/// kept in `error` for [`Body::answer`], and its declared record's JSON when
/// `record` (the fn's `record_errors`) says it is final.
pub(crate) fn stored<T, E>(
    out: Result<T, E>,
    to_json: fn(&T) -> Result<String, serde_json::Error>,
    error: &mut Option<E>,
    record: Option<RecordFn<E>>,
) -> Result<String, Failed> {
    match out {
        Ok(value) => to_json(&value).map_err(Failed::Serialize),
        Err(e) => {
            let recorded = record.and_then(|record| record(&e));
            *error = Some(e);
            match recorded {
                None => Err(Failed::Body),
                Some(Ok(json)) => Err(Failed::Recorded(json)),
                Some(Err(e)) => Err(Failed::Serialize(e)),
            }
        }
    }
}

/// `serde_json::to_string`, written out: two generic calls fewer per type.
fn to_json<T: Serialize + ?Sized>(value: &T) -> Result<String, serde_json::Error> {
    let mut json = Vec::with_capacity(128);
    value.serialize(&mut serde_json::Serializer::new(&mut json))?;
    Ok(text(json))
}

/// `serde_json::from_str`, written out: two generic calls fewer per type.
fn from_json<T: DeserializeOwned>(json: &str) -> Result<T, serde_json::Error> {
    let mut json = serde_json::Deserializer::from_str(json);
    let value = T::deserialize(&mut json)?;
    json.end()?;
    Ok(value)
}

/// The record of a declared business error, if `error` is one.
fn record_error<E: BusinessError>(error: &E) -> Option<Result<String, serde_json::Error>> {
    error.recorded().map(|record| to_json(&record))
}

/// A recorded business error, read back as the fn's error.
fn replay_error<E: BusinessError>(recorded: &str) -> Result<E, serde_json::Error> {
    from_json::<E::Record>(recorded).map(E::replayed)
}

/// serde_json's output as the `String` it is: serde_json writes UTF-8 only.
fn text(json: Vec<u8>) -> String {
    String::from_utf8(json).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    use super::{Body, BusinessError, CallError, Error, Failed, Typed, stored, to_json};

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
        let mut body = Body::new(|tx: ()| async move { (tx, Err::<Receipt, Error>(Error::InvalidBiz)) });
        Typed::<()>::decode(&mut body, json)?;
        Ok(body.answer(Ok(())).expect("decoded"))
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
            assert!(matches!(stored(Ok(receipt), to_json, &mut error, None), Ok(json) if json == expected));
        }
        let map: std::collections::HashMap<(u8, u8), u8> = [((1, 2), 3)].into();
        let refused = serde_json::to_string(&map).unwrap_err().to_string();
        let json = stored::<_, ()>(Ok(map), to_json, &mut error, None);
        assert!(matches!(json, Err(Failed::Serialize(e)) if e.to_string() == refused));
        assert!(error.is_none());
        assert!(matches!(stored::<(), _>(Err("body"), to_json, &mut None, None), Err(Failed::Body)));
        let mut kept = None;
        let _ = stored::<(), _>(Err("body"), to_json, &mut kept, None);
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

    #[derive(Debug, PartialEq)]
    enum PayError {
        Declined { reason: String },
        Down,
        Idem,
    }

    impl From<Error> for PayError {
        fn from(_: Error) -> Self {
            PayError::Idem
        }
    }

    impl BusinessError for PayError {
        type Record = String;
        fn recorded(&self) -> Option<String> {
            match self {
                PayError::Declined { reason } => Some(reason.clone()),
                PayError::Down | PayError::Idem => None,
            }
        }
        fn replayed(reason: String) -> Self {
            PayError::Declined { reason }
        }
    }

    /// A declared error is recorded as its record's JSON (and kept for the
    /// caller), any other error is the body's; read back, the record is
    /// the fn's error again. A fn without `record_errors` records nothing
    /// and cannot read a recorded error.
    #[tokio::test]
    async fn declared_errors_are_recorded_and_read_back() {
        let declined = PayError::Declined { reason: "\"card\"".into() };
        let mut body = Body::recording(|tx: ()| async move { (tx, Err::<u8, _>(declined)) });
        let (_, ran) = Typed::<()>::run(&mut body, ()).await;
        assert!(matches!(ran, Err(Failed::Recorded(ref json)) if json == r#""\"card\"""#));
        Typed::<()>::decode_failure(&mut body, r#""expired""#).unwrap();
        assert_eq!(body.answer(Err(CallError::Recorded)), Err(PayError::Declined { reason: "expired".into() }));

        let mut body = Body::recording(|tx: ()| async move { (tx, Err::<u8, _>(PayError::Down)) });
        assert!(matches!(Typed::<()>::run(&mut body, ()).await.1, Err(Failed::Body)));
        assert_eq!(body.answer(Err(CallError::Body)), Err(PayError::Down));

        let declined = PayError::Declined { reason: "x".into() };
        let mut body = Body::new(|tx: ()| async move { (tx, Err::<u8, _>(declined)) });
        assert!(matches!(Typed::<()>::run(&mut body, ()).await.1, Err(Failed::Body)));
        assert!(Typed::<()>::decode_failure(&mut body, r#""x""#).is_err());
    }
}
