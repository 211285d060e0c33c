//! The gate without a claim: calls running on this engine. A duplicate of
//! one waits for it here, in memory, and takes its result, where it would
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

use super::{Answer, Entry};

type Slot = Option<Arc<Answer>>;

/// The calls in flight on one engine, by `biz` and key.
#[derive(Debug, Default)]
pub(crate) struct MemoryGate {
    calls: Mutex<HashMap<String, watch::Receiver<Slot>>>,
}

/// The running call of a key. Dropped, it lets its waiters go.
pub(crate) struct Leader<'a> {
    gate: &'a MemoryGate,
    id: String,
    answer: watch::Sender<Slot>,
}

impl MemoryGate {
    /// Enters the call `(biz, key)`: goes ahead, or waits up to `wait` for
    /// the duplicate running here and replays its result; still running
    /// then, it is busy (and has not committed: it would have answered).
    pub(crate) async fn enter(&self, biz: &str, key: &str, wait: Duration) -> Entry<'_> {
        // `biz` has no `:`, so the id is unambiguous.
        let id = format!("{biz}:{key}");
        // `Duration::MAX` waits with no bound.
        let deadline = crate::clock::deadline_in(wait);
        loop {
            let mut running = {
                let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
                match calls.get(&id) {
                    Some(running) => running.clone(),
                    None => {
                        let (answer, receiver) = watch::channel(None);
                        calls.insert(id.clone(), receiver);
                        return Entry::GoAhead(super::Pass::Leader(Leader { gate: self, id, answer }));
                    }
                }
            };
            match tokio::time::timeout_at(deadline, running.wait_for(Option::is_some)).await {
                Ok(Ok(answer)) => {
                    if let Some(answer) = answer.as_ref() {
                        return Entry::Replay(
                            super::Replayed::Shared(Arc::clone(answer)),
                            crate::metrics::Source::Memory,
                        );
                    }
                }
                // It failed or was dropped: whoever enters next goes first.
                Ok(Err(_closed)) => {}
                Err(_elapsed) => return Entry::Busy { may_have_committed: false },
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
    pub(crate) fn finish(self, answer: Arc<Answer>) {
        // One receiver is the map's own: more are waiters.
        if self.answer.receiver_count() > 1 {
            self.answer.send_replace(Some(answer));
        }
    }
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        self.gate.calls.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::super::Pass;
    use super::*;
    use crate::fingerprint::Hex;

    fn answer(fingerprint: &str, response: &str) -> Arc<Answer> {
        Arc::new(Answer {
            fingerprint: Hex::stored(fingerprint),
            response: response.into(),
            failed: false,
            expires_ms: i64::MAX,
        })
    }

    const WAIT: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn duplicates_take_the_result_of_the_first() {
        let gate = MemoryGate::default();
        let Entry::GoAhead(Pass::Leader(leader)) = gate.enter("pay", "k", WAIT).await else { panic!("first") };
        let waiters = (0..8).map(|_| gate.enter("pay", "k", WAIT)).collect::<Vec<_>>();
        let finish = async {
            tokio::task::yield_now().await;
            leader.finish(answer("fp", "{\"a\":1}"));
        };
        let (answers, ()) = tokio::join!(futures_join_all(waiters), finish);
        for answer in answers {
            let Entry::Replay(answer, _) = answer else { panic!("not answered") };
            assert_eq!((answer.fingerprint.as_str(), answer.response.as_str()), ("fp", "{\"a\":1}"));
        }
        assert_eq!(gate.len(), 0, "the finished call left the map");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_first_call_lets_one_waiter_go_first() {
        let gate = MemoryGate::default();
        let Entry::GoAhead(Pass::Leader(leader)) = gate.enter("pay", "k", WAIT).await else { panic!("first") };
        let waiters = (0..4).map(|_| gate.enter("pay", "k", Duration::from_millis(50))).collect::<Vec<_>>();
        let fail = async {
            tokio::task::yield_now().await;
            drop(leader);
        };
        let (answers, ()) = tokio::join!(futures_join_all(waiters), fail);
        // One goes first; the others wait on it, and as it never finishes
        // they give up: none is answered.
        let firsts = answers.iter().filter(|a| matches!(a, Entry::GoAhead(_))).count();
        let busy = answers.iter().filter(|a| matches!(a, Entry::Busy { may_have_committed: false })).count();
        assert_eq!((firsts, busy), (1, 3));
    }

    #[tokio::test]
    async fn other_keys_and_other_biz_do_not_wait() {
        let gate = MemoryGate::default();
        let Entry::GoAhead(Pass::Leader(_a)) = gate.enter("pay", "k", WAIT).await else { panic!() };
        assert!(matches!(gate.enter("pay", "k2", WAIT).await, Entry::GoAhead(_)));
        assert!(matches!(gate.enter("refund", "k", WAIT).await, Entry::GoAhead(_)));
    }

    #[tokio::test]
    async fn an_endless_wait_does_not_overflow() {
        let gate = MemoryGate::default();
        let Entry::GoAhead(Pass::Leader(leader)) = gate.enter("pay", "k", Duration::MAX).await else { panic!() };
        let finish = async {
            tokio::task::yield_now().await;
            leader.finish(answer("fp", "1"));
        };
        let (answer, ()) = tokio::join!(gate.enter("pay", "k", Duration::MAX), finish);
        assert!(matches!(answer, Entry::Replay(answer, _) if answer.response == "1"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_gives_up_after_the_wait() {
        let gate = MemoryGate::default();
        let Entry::GoAhead(Pass::Leader(_leader)) = gate.enter("pay", "k", WAIT).await else { panic!() };
        assert!(matches!(gate.enter("pay", "k", Duration::from_millis(10)).await, Entry::Busy { .. }));
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
