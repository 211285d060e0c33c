//! What a body in `steps` mode holds: the step context [`Steps`], the
//! [`StepKey`] each outside call gets, and the [`Failure`] a body declares
//! permanent.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::Transaction;

use super::protocol::{self, CallKey, Held, StepRecord};
use crate::engine::Idem;
use crate::error::{Error, Failure};
use crate::fingerprint::sha256_hex;
use crate::store::Backend;
use crate::store::calls::Owner;

/// The step context of a body in `steps` mode (`#[idempotent(..., steps)]`
/// with a parameter `steps: &mut Steps<DB>`, supplied by the engine like the
/// transaction in the plain mode).
///
/// ```ignore
/// #[idempotent(key = "order_<order_id>_charge", ttl = "24h", biz = "charge", steps)]
/// async fn charge(
///     idem: &Idem<MySql>,
///     steps: &mut Steps<MySql>,
///     #[idem(skip)] provider: &Provider,
///     order_id: u64,
///     amount: i64,
/// ) -> Result<Receipt, ChargeError> {
///     // An outside call: recorded once answered, replayed on a retry.
///     let charge: Charge = steps.step("charge", |step_key| provider.charge(step_key, amount)).await?;
///     if let Charge::Declined { reason } = &charge {
///         return Err(steps.permanent(reason).into()); // recorded: retries get it again
///     }
///     // Local writes: one final transaction with the record, fenced.
///     let tx = steps.transaction().await?;
///     sqlx::query("INSERT INTO payment (order_id, charge_id) VALUES (?, ?)")
///         .bind(order_id).bind(&charge.id).execute(&mut **tx).await?;
///     Ok(Receipt { order_id, charge_id: charge.id })
/// }
/// ```
///
/// Steps come first, then the transaction: a step after
/// [`transaction`](Steps::transaction) is refused, so no transaction stays
/// open across an outside call (holding its connection and locks).
pub struct Steps<DB: Backend> {
    engine: Idem<DB>,
    biz: &'static str,
    key: String,
    fingerprint: String,
    biz_no: Option<String>,
    owner: Owner,
    resumed: bool,
    /// Results recorded for this call (by us or an owner before us).
    recorded: HashMap<String, String>,
    /// Names used in this run.
    used: HashSet<String>,
    /// A step's call was started in this run (so something may have
    /// reached outside even if it failed).
    started: bool,
    /// A step record found the call no longer ours.
    fenced: bool,
    failure: Option<Failure>,
    tx: Option<Transaction<'static, DB>>,
}

impl<DB: Backend> fmt::Debug for Steps<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Steps")
            .field("biz", &self.biz)
            .field("key", &self.key)
            .field("fence", &self.owner.fence)
            .field("resumed", &self.resumed)
            .field("recorded", &self.recorded.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// What the call flow takes back from a finished body.
pub(crate) struct Parts<DB: Backend> {
    pub owner: Owner,
    pub resumed: bool,
    pub started: bool,
    pub fenced: bool,
    pub has_steps: bool,
    pub failure: Option<Failure>,
    pub tx: Option<Transaction<'static, DB>>,
}

impl<DB: Backend> Steps<DB> {
    pub(crate) fn new(engine: Idem<DB>, id: &CallKey<'_>, held: Held) -> Self {
        Steps {
            engine,
            biz: id.biz,
            key: id.key.to_owned(),
            fingerprint: id.fingerprint.to_owned(),
            biz_no: id.biz_no.map(str::to_owned),
            owner: held.owner,
            resumed: held.resumed,
            recorded: held.recorded,
            used: HashSet::new(),
            started: false,
            fenced: false,
            failure: None,
            tx: None,
        }
    }

    pub(crate) fn into_parts(self) -> Parts<DB> {
        Parts {
            owner: self.owner,
            resumed: self.resumed,
            started: self.started,
            fenced: self.fenced,
            has_steps: !self.recorded.is_empty(),
            failure: self.failure,
            tx: self.tx,
        }
    }

    fn id(&self) -> CallKey<'_> {
        CallKey {
            biz: self.biz,
            key: &self.key,
            fingerprint: &self.fingerprint,
            biz_no: self.biz_no.as_deref(),
            // Only phase one needs these.
            ttl: std::time::Duration::ZERO,
            lease: std::time::Duration::ZERO,
        }
    }

    /// Runs the outside call `name` once for this key: `call` gets the
    /// step's [`StepKey`] (send it to the service as its idempotency key)
    /// and its `Ok` result is recorded, in a small transaction of its own,
    /// before it is returned. A step recorded by an earlier attempt returns
    /// that result without calling anything.
    ///
    /// An `Err` from `call` is returned as it is and nothing is recorded: a
    /// retry calls again, with the same key. Engine errors come through
    /// `SE: From<idempotency::Error>`: a refused name ([`Error::InvalidStep`]), a
    /// database failure, or `InProgress` when the call was taken over by
    /// another owner (the engine then answers with that owner's outcome,
    /// whatever the body returns).
    ///
    /// Names follow the `biz` rule, `[a-z0-9_]{1,32}`, and are used once per
    /// call. Results must serialize and read back, like the fn's own.
    pub async fn step<R, SE, F, Fut>(&mut self, name: &str, call: F) -> Result<R, SE>
    where
        R: Serialize + DeserializeOwned,
        SE: From<Error>,
        F: FnOnce(StepKey) -> Fut,
        Fut: Future<Output = Result<R, SE>>,
    {
        self.check(name)?;
        if let Some(stored) = self.recorded.get(name) {
            tracing::debug!(step = name, "idem: step replayed from its record");
            return Ok(self.read_back(stored)?);
        }
        let step_key = StepKey::new(self.biz, &self.key, name);
        self.started = true;
        let value = call(step_key.clone()).await?;
        // What a retry would replay, read back, so this run sees the same.
        let response = serde_json::to_string(&value).map_err(Error::Serialize)?;
        let value: R = serde_json::from_str(&response).map_err(Error::Serialize)?;
        let db = self.engine.db();
        let recorded =
            protocol::record_step(db, self.engine.clock(), &self.id(), self.owner, name, step_key.as_str(), &response)
                .await?;
        match recorded {
            StepRecord::Recorded => {
                self.recorded.insert(name.to_owned(), response);
                Ok(value)
            }
            StepRecord::Taken(stored) => {
                let value = self.read_back(&stored)?;
                self.recorded.insert(name.to_owned(), stored);
                Ok(value)
            }
            StepRecord::Fenced => {
                tracing::info!(step = name, "idem: fenced off, the call was taken over; its step is not recorded");
                self.fenced = true;
                Err(self.id().in_progress().into())
            }
        }
    }

    /// The final transaction, opened on first use: the body's local writes
    /// go in it, and the engine commits it together with the finished
    /// record, only if this call still owns the key. Opening it ends the
    /// steps: a step afterwards is refused.
    pub async fn transaction(&mut self) -> Result<&mut Transaction<'static, DB>, Error> {
        if self.fenced {
            return Err(self.id().in_progress());
        }
        let tx = match self.tx.take() {
            Some(tx) => tx,
            None => crate::store::opening::begin(self.engine.pool()).await?,
        };
        Ok(self.tx.insert(tx))
    }

    /// Declares the body's failure permanent: return the error this gives
    /// (through your error type's `From<idempotency::Error>`), and the engine
    /// records `failure` (as JSON) in the final transaction, with whatever
    /// the body wrote in it, and answers this call and every retry with
    /// [`Error::Permanent`], byte for byte, without running the body again.
    /// For answers that will not change, such as a declined card. A body
    /// that returns `Ok` afterwards records its value as usual.
    pub fn permanent<P: Serialize + ?Sized>(&mut self, failure: &P) -> Error {
        match serde_json::to_string(failure) {
            Ok(json) => {
                let failure = Failure::from_json(json);
                self.failure = Some(failure.clone());
                Error::Permanent { biz: self.biz, key: self.key.clone(), failure }
            }
            Err(e) => Error::Serialize(e),
        }
    }

    /// The key of step `name` for this call, as [`step`](Steps::step) hands
    /// it to its closure.
    pub fn step_key(&self, name: &str) -> StepKey {
        StepKey::new(self.biz, &self.key, name)
    }

    /// Whether this run took the call over from an earlier owner whose
    /// lease ran out (its recorded steps answer from the record).
    pub fn resumed(&self) -> bool {
        self.resumed
    }

    /// The call's rendered key.
    pub fn key(&self) -> &str {
        &self.key
    }

    fn check(&mut self, name: &str) -> Result<(), Error> {
        let refuse = |reason| Err(Error::InvalidStep { name: name.to_owned(), reason });
        if !idempotency_rules::is_valid_biz(name) {
            return refuse("a step name must match [a-z0-9_]{1,32}");
        }
        if self.tx.is_some() {
            return refuse("the final transaction is open: call every step before `steps.transaction()`");
        }
        if !self.used.insert(name.to_owned()) {
            return refuse("a step name is used once per call (a second call with it would replay the first)");
        }
        Ok(())
    }

    fn read_back<R: DeserializeOwned>(&self, stored: &str) -> Result<R, Error> {
        serde_json::from_str(stored).map_err(|source| Error::Replay { biz: self.biz, key: self.key.clone(), source })
    }
}

/// The idempotency key of one step of one call: the lowercase hex SHA-256
/// of `(biz, key, step name)`, 64 characters (within what payment
/// providers accept), the same in every attempt and every process. Send it
/// to the outside service as *its* idempotency key (`Idempotency-Key`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StepKey(String);

impl StepKey {
    fn new(biz: &str, key: &str, step: &str) -> Self {
        // NUL separated: no part holds one, so no two triples meet.
        let input = format!("idem-step\0{biz}\0{key}\0{step}");
        StepKey(sha256_hex(input.as_bytes()))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for StepKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for StepKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl From<StepKey> for String {
    fn from(key: StepKey) -> String {
        key.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guards the step key's derivation: providers keep keys for days, so a
    /// change would make every retry across an upgrade a new charge.
    #[test]
    fn step_keys_are_stable_and_distinct() {
        let key = StepKey::new("charge", "order_42", "charge");
        assert_eq!(key.as_str().len(), 64);
        assert!(key.as_str().bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(key, StepKey::new("charge", "order_42", "charge"));
        assert_eq!(key.as_str(), sha256_hex(b"idem-step\0charge\0order_42\0charge"));
        let others = [
            StepKey::new("charge", "order_42", "refund"),
            StepKey::new("charge", "order_43", "charge"),
            StepKey::new("refund", "order_42", "charge"),
            StepKey::new("charge", "order_4", "2charge"),
        ];
        assert!(others.iter().all(|other| *other != key));
    }
}
