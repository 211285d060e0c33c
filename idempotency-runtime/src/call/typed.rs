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
        let body = self.body.take().expect("a flow runs the body once");
        Box::pin(body(handed))
    }

    fn decode(&mut self, response: &str) -> Result<(), serde_json::Error> {
        *self.value = Some(serde_json::from_str(response)?);
        Ok(())
    }
}

/// The body's result as the flow takes it: its value's JSON, or its error
/// kept in `error` for [`answer`].
pub fn stored<T: Serialize, E>(out: Result<T, E>, error: &mut Option<E>) -> Result<String, Failed> {
    match out {
        Ok(value) => serde_json::to_string(&value).map_err(Failed::Serialize),
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
        Ok(()) => Ok(value.expect("a call that ended well decoded its value")),
        Err(CallError::Idem(e)) => Err(E::from(e)),
        Err(CallError::Body) => Err(error.expect("a body that failed left its error")),
    }
}
