//! Calls running in this process without a Redis claim. A duplicate of one
//! waits for it here, in memory, and takes its result, where it would
//! otherwise wait on the unique index and then read the record: a burst of
//! duplicates on one instance costs the database one call.
//!
//! Only an optimisation: duplicates on other instances still meet at the
//! unique index, and a call that fails or is dropped lets its waiters go on
//! to the database as if they had come first.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

/// The result a finished call hands to its waiting duplicates.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Fingerprint stored with the result.
    pub fingerprint: String,
    /// The serialized result, as stored.
    pub response: String,
}

type Answer = Option<Arc<Shared>>;

/// The calls in flight, by `biz` and key.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    calls: Mutex<HashMap<String, watch::Receiver<Answer>>>,
}

/// What [`InFlight::enter`] decided.
pub(crate) enum Entered<'a> {
    /// No duplicate is running here: this call goes ahead.
    First(Leader<'a>),
    /// A duplicate finished while this call waited.
    Answered(Arc<Shared>),
    /// A duplicate is still running after the wait.
    Busy,
}

/// The running call of a key. Dropped, it lets its waiters go.
pub(crate) struct Leader<'a> {
    flight: &'a InFlight,
    id: String,
    answer: watch::Sender<Answer>,
}

impl InFlight {
    /// Enters the call `(biz, key)`: goes first, or waits up to `wait` for
    /// the duplicate running here.
    pub(crate) async fn enter(&self, biz: &str, key: &str, wait: Duration) -> Entered<'_> {
        // `biz` has no `:`, so the id is unambiguous.
        let id = format!("{biz}:{key}");
        // A wait too long to add to now never ends: a year stands for it.
        let now = tokio::time::Instant::now();
        let deadline = now.checked_add(wait).unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600));
        loop {
            let mut running = {
                let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
                match calls.get(&id) {
                    Some(running) => running.clone(),
                    None => {
                        let (answer, receiver) = watch::channel(None);
                        calls.insert(id.clone(), receiver);
                        return Entered::First(Leader { flight: self, id, answer });
                    }
                }
            };
            match tokio::time::timeout_at(deadline, running.wait_for(Option::is_some)).await {
                Ok(Ok(answer)) => {
                    if let Some(shared) = answer.as_ref() {
                        return Entered::Answered(Arc::clone(shared));
                    }
                }
                // It failed or was dropped: whoever enters next goes first.
                Ok(Err(_closed)) => {}
                Err(_elapsed) => return Entered::Busy,
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.calls.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

impl Leader<'_> {
    /// Hands the result to the duplicates waiting, if any.
    pub(crate) fn finish(self, fingerprint: String, response: String) {
        // One receiver is the map's own: more are waiters.
        if self.answer.receiver_count() > 1 {
            self.answer.send_replace(Some(Arc::new(Shared { fingerprint, response })));
        }
    }
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        self.flight.calls.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn duplicates_take_the_result_of_the_first() {
        let flight = InFlight::default();
        let Entered::First(leader) = flight.enter("pay", "k", WAIT).await else { panic!("first") };
        let waiters = (0..8).map(|_| flight.enter("pay", "k", WAIT)).collect::<Vec<_>>();
        let finish = async {
            tokio::task::yield_now().await;
            leader.finish("fp".into(), "{\"a\":1}".into());
        };
        let (answers, ()) = tokio::join!(futures_join_all(waiters), finish);
        for answer in answers {
            let Entered::Answered(shared) = answer else { panic!("not answered") };
            assert_eq!((shared.fingerprint.as_str(), shared.response.as_str()), ("fp", "{\"a\":1}"));
        }
        assert_eq!(flight.len(), 0, "the finished call left the map");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_first_call_lets_one_waiter_go_first() {
        let flight = InFlight::default();
        let Entered::First(leader) = flight.enter("pay", "k", WAIT).await else { panic!("first") };
        let waiters = (0..4).map(|_| flight.enter("pay", "k", Duration::from_millis(50))).collect::<Vec<_>>();
        let fail = async {
            tokio::task::yield_now().await;
            drop(leader);
        };
        let (answers, ()) = tokio::join!(futures_join_all(waiters), fail);
        // One goes first; the others wait on it, and as it never finishes
        // they give up: none is answered.
        let firsts = answers.iter().filter(|a| matches!(a, Entered::First(_))).count();
        let busy = answers.iter().filter(|a| matches!(a, Entered::Busy)).count();
        assert_eq!((firsts, busy), (1, 3));
    }

    #[tokio::test]
    async fn other_keys_and_other_biz_do_not_wait() {
        let flight = InFlight::default();
        let Entered::First(_a) = flight.enter("pay", "k", WAIT).await else { panic!() };
        assert!(matches!(flight.enter("pay", "k2", WAIT).await, Entered::First(_)));
        assert!(matches!(flight.enter("refund", "k", WAIT).await, Entered::First(_)));
    }

    #[tokio::test]
    async fn an_endless_wait_does_not_overflow() {
        let flight = InFlight::default();
        let Entered::First(leader) = flight.enter("pay", "k", Duration::MAX).await else { panic!() };
        let finish = async {
            tokio::task::yield_now().await;
            leader.finish("fp".into(), "1".into());
        };
        let (answer, ()) = tokio::join!(flight.enter("pay", "k", Duration::MAX), finish);
        assert!(matches!(answer, Entered::Answered(shared) if shared.response == "1"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_gives_up_after_the_wait() {
        let flight = InFlight::default();
        let Entered::First(_leader) = flight.enter("pay", "k", WAIT).await else { panic!() };
        assert!(matches!(flight.enter("pay", "k", Duration::from_millis(10)).await, Entered::Busy));
    }

    /// Polls all futures together (no `futures` dependency for one test).
    async fn futures_join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
        let mut pinned: Vec<_> = futures.into_iter().map(Box::pin).collect();
        let mut out: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
        std::future::poll_fn(|cx| {
            let mut pending = false;
            for (f, slot) in pinned.iter_mut().zip(out.iter_mut()) {
                if slot.is_none() {
                    match f.as_mut().poll(cx) {
                        std::task::Poll::Ready(v) => *slot = Some(v),
                        std::task::Poll::Pending => pending = true,
                    }
                }
            }
            if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
        })
        .await;
        out.into_iter().map(Option::unwrap).collect()
    }
}
