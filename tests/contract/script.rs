//! What a clause tells one call's body to do, and what it learns back: the
//! body's runs (shared by every call of a clause's key), how the body ends
//! (a value, a failure of its own, a declared decline), a gate the body
//! waits at until the clause opens it, a barrier the call waits at before
//! it starts (a storm's release), and two signs that a duplicate waits:
//! its call pended (in memory, on an engine without Redis), and the
//! session of the caller's transaction (`join`), which the database shows
//! waiting. Every wait here waits for its event; the bound only turns a
//! hang into a failure.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::Duration;

use tokio::sync::{Barrier, Semaphore, watch};

use crate::fns::{CallError, Declined};

/// How long any wait of a clause may take before the clause fails: only a hang takes this long.
pub const BOUND: Duration = Duration::from_secs(30);

/// Waits for `event`, failing the clause with `what` after [`BOUND`].
pub async fn within<T>(what: &str, event: impl Future<Output = T>) -> T {
    match tokio::time::timeout(BOUND, event).await {
        Ok(value) => value,
        Err(_) => panic!("never within {BOUND:?}: {what}"),
    }
}

/// How many times the body of a clause's key started, and how many outside
/// calls its steps made.
#[derive(Debug, Default)]
pub struct Runs {
    body: AtomicU64,
    outside: AtomicU64,
}

impl Runs {
    pub fn body(&self) -> u64 {
        self.body.load(SeqCst)
    }

    pub fn outside(&self) -> u64 {
        self.outside.load(SeqCst)
    }
}

/// How the body ends once its writes are done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Its value.
    Value,
    /// An error of its own, never recorded.
    Fails,
    /// A declared business error: recorded with `record_errors`, or in
    /// steps mode declared permanent.
    Declines,
}

/// One call's instructions; see the module docs.
pub struct Script {
    runs: Arc<Runs>,
    ending: Ending,
    /// The body stops here (its writes done) until the clause opens it.
    gate: Option<Semaphore>,
    held: watch::Sender<bool>,
    /// The call starts once every call of the storm is at the barrier.
    barrier: Option<Arc<Barrier>>,
    /// The call's future returned `Pending` once.
    pended: watch::Sender<bool>,
    /// The session of the caller's transaction (`join`), when the database shows sessions.
    session: watch::Sender<Option<i64>>,
}

impl Script {
    /// A body that ends with its value, counted in `runs`.
    pub fn new(runs: &Arc<Runs>, ending: Ending) -> Self {
        Script {
            runs: Arc::clone(runs),
            ending,
            gate: None,
            held: watch::Sender::new(false),
            barrier: None,
            pended: watch::Sender::new(false),
            session: watch::Sender::new(None),
        }
    }

    /// The body waits, its writes done, until [`release`](Self::release).
    pub fn held(mut self) -> Self {
        self.gate = Some(Semaphore::new(0));
        self
    }

    /// The call starts only when every call sharing `barrier` is there.
    pub fn arriving(mut self, barrier: &Arc<Barrier>) -> Self {
        self.barrier = Some(Arc::clone(barrier));
        self
    }

    // The body's side.

    /// The body starts: its run's number for this key.
    pub fn start(&self) -> u64 {
        self.runs.body.fetch_add(1, SeqCst) + 1
    }

    /// Whether the body declines (steps mode declares it permanent).
    pub fn declines(&self) -> bool {
        self.ending == Ending::Declines
    }

    /// An outside call of a step: counted, answered with its step key.
    pub async fn outside(&self, step_key: idempotency::StepKey) -> Result<String, CallError> {
        self.runs.outside.fetch_add(1, SeqCst);
        Ok(format!("charge-{}", &step_key.as_str()[..16]))
    }

    /// The body's writes are done: waits at the gate if held, then ends as
    /// told (`run` is the body's run).
    pub async fn end(&self, run: u64) -> Result<(), CallError> {
        self.hold().await;
        match self.ending {
            Ending::Value => Ok(()),
            Ending::Fails => Err(CallError::Body),
            Ending::Declines => Err(CallError::Declined(self.decline(run))),
        }
    }

    /// Waits at the gate, if held.
    pub async fn hold(&self) {
        if let Some(gate) = &self.gate {
            self.held.send_replace(true);
            gate.acquire().await.expect("the gate stays open").forget();
        }
    }

    /// The decline this body answers with on its run `run`.
    pub fn decline(&self, run: u64) -> Declined {
        Declined { reason: "insufficient \"funds\" \u{e9}".into(), run }
    }

    // The caller's side (entries, the caller of a joined call).

    /// Runs `call` once the storm's barrier lets it, noting when it first pends.
    pub async fn call<F: Future>(&self, call: F) -> F::Output {
        if let Some(barrier) = &self.barrier {
            barrier.wait().await;
        }
        let mut call = pin!(call);
        std::future::poll_fn(|cx| {
            let poll = call.as_mut().poll(cx);
            if poll.is_pending() {
                self.pended.send_if_modified(|p| !std::mem::replace(p, true));
            }
            poll
        })
        .await
    }

    /// The caller's transaction runs in session `id`.
    pub fn set_session(&self, id: i64) {
        self.session.send_replace(Some(id));
    }

    // The clause's side.

    /// Until the body waits at its gate.
    pub async fn until_held(&self) {
        let mut held = self.held.subscribe();
        within("the body reached its gate", held.wait_for(|h| *h)).await.expect("held");
    }

    /// Opens the gate.
    pub fn release(&self) {
        self.gate.as_ref().expect("a held script").add_permits(1);
    }

    /// Until the call pended once (`place`: where it was made, for the failure).
    pub async fn until_pended(&self, place: impl std::fmt::Display) {
        let mut pended = self.pended.subscribe();
        within(&format!("{place}: the call pended"), pended.wait_for(|p| *p)).await.expect("pended");
    }

    /// The session of the caller's transaction, once it is known.
    pub async fn session(&self) -> i64 {
        let mut session = self.session.subscribe();
        let known = within("the caller's session", session.wait_for(Option::is_some)).await.expect("session");
        known.expect("known")
    }
}
