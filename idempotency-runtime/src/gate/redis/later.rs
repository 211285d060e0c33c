//! Work the gate leaves for later, off the caller's path: a release or a
//! result write whose answer was lost, skipped by the back-off, or left by a
//! call dropped halfway. Each runs in a background task, at most one per
//! claim and at most [`MAX_BACKGROUND`] per engine at once; past that a claim
//! is left to its lease.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::connection::{Backoff, Missed, answered};
use super::scripts::evalsha;
use super::{HeldClaim, RedisGate};

/// How many times work left for later (a release, a result write) is tried
/// before giving up and leaving the claim to its lease.
const LATER_TRIES: usize = 20;
/// Most background tasks (releases and result writes left for later) one
/// engine runs at once. With Redis black-holed, every claim sent before the
/// first timeout leaves one; past the bound, claims end with their lease.
pub const MAX_BACKGROUND: usize = 256;

/// A claim sent but not answered. Dropped so (the answer failed or timed
/// out, or the caller's future was dropped while waiting), the script may
/// still run and set our claim: it is released off the caller's path and
/// past the back-off, and retried until Redis answers, since a release that
/// overtakes the late claim (say, on a fresh connection) deletes nothing.
/// Compare-and-delete on our own token: repeating it is harmless.
pub(crate) struct Unanswered<'a> {
    pub claims: &'a Arc<RedisGate>,
    pub held: Option<HeldClaim>,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            self.claims.release_unanswered(held);
        }
    }
}

impl RedisGate {
    /// Drops our claim so the next call may execute (after a failed body).
    /// Unanswered, or skipped while Redis backs off, it is retried off the
    /// caller's path rather than left to run out its lease.
    pub(crate) async fn release(self: &Arc<Self>, held: &HeldClaim) {
        if !answered(&self.release_with(held, Backoff::Respect).await) {
            self.release_unanswered(held.clone());
        }
    }

    /// Releases `held` from a background task (see [`MAX_BACKGROUND`]):
    /// at once, and like an unanswered one if that fails.
    pub(crate) fn release_in_background(self: &Arc<Self>, held: HeldClaim) {
        self.spawn_later(|claims| async move {
            crate::metrics::background_release();
            if !answered(&claims.release_with(&held, Backoff::Respect).await) {
                claims.release_after_failure(&held).await;
            }
        });
    }

    /// Releases, from a background task, a claim whose answer (or whose
    /// release's answer) was lost.
    fn release_unanswered(self: &Arc<Self>, held: HeldClaim) {
        self.spawn_later(|claims| async move {
            crate::metrics::background_release();
            claims.release_after_failure(&held).await
        });
    }

    async fn release_with(&self, held: &HeldClaim, backoff: Backoff) -> Result<i64, Missed> {
        let mut call = evalsha(&self.scripts.release, &[&held.place.claim]);
        call.arg(&held.value).arg(self.publish());
        self.link.eval::<i64>(&self.scripts.release, &call, backoff).await
    }

    async fn release_after_failure(&self, held: &HeldClaim) {
        // Two answered releases, a timeout apart, within about a lease's
        // worth of tries: the first may still overtake the late claim.
        let mut replies = 0;
        for _ in 0..LATER_TRIES {
            self.pause_before_retry().await;
            if answered(&self.release_with(held, Backoff::Ignore).await) {
                replies += 1;
                if replies == 2 {
                    return;
                }
            }
        }
    }

    /// Turns our claim into the finished result, from a background task:
    /// the record already holds it, and a duplicate arriving before the
    /// write lands reads it from there. A write skipped by the back-off or
    /// left unanswered is tried again, so the claim does not live out its
    /// lease (each duplicate meanwhile would cost a lookup, and answer
    /// `InProgress` once the record expired).
    pub(crate) fn finish_later(self: &Arc<Self>, held: HeldClaim, field: [u8; 16], done: Vec<u8>) {
        self.spawn_later(move |claims| async move {
            let write = |backoff| {
                // The window of the moment the write is sent: a result
                // written late lives its full hot window from then.
                let now = claims.clock.now_ms();
                let results = held.place.results(super::layout::window_of(now, claims.hot_window));
                let ttl = super::layout::results_ttl_ms(now, claims.hot_window);
                let mut call = evalsha(&claims.scripts.finish, &[&held.place.claim, &results]);
                call.arg(&held.value).arg(&field[..]).arg(&done).arg(ttl).arg(claims.publish());
                let claims = &claims;
                async move { claims.link.eval::<i64>(&claims.scripts.finish, &call, backoff).await }
            };
            if answered(&write(Backoff::Respect).await) {
                return;
            }
            for _ in 0..LATER_TRIES {
                claims.pause_before_retry().await;
                // Compare-and-swap on our own token with an absolute expiry
                // inside the value: landing late, or twice, is harmless.
                if answered(&write(Backoff::Ignore).await) {
                    return;
                }
            }
        });
    }

    /// Waits a timeout, and longer if Redis is backing off.
    async fn pause_before_retry(&self) {
        tokio::time::sleep(self.link.timeout.max(self.link.backoff_left())).await;
    }

    /// Runs `task` in the background unless [`MAX_BACKGROUND`] already run.
    fn spawn_later<F, Fut>(self: &Arc<Self>, task: F)
    where
        F: FnOnce(Arc<Self>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        if self.background.fetch_add(1, Ordering::Relaxed) >= MAX_BACKGROUND {
            self.background.fetch_sub(1, Ordering::Relaxed);
            tracing::debug!("too much redis work left for later; a claim ends with its lease");
            return;
        }
        // Counted down however the task ends, even dropped with its runtime.
        struct Slot(Arc<RedisGate>);
        impl Drop for Slot {
            fn drop(&mut self) {
                self.0.background.fetch_sub(1, Ordering::Relaxed);
            }
        }
        let slot = Slot(Arc::clone(self));
        let task = task(Arc::clone(self));
        spawn_detached(async move {
            let _slot = slot;
            task.await;
        });
    }

    /// Background tasks running now.
    #[cfg(test)]
    pub(crate) fn background(&self) -> usize {
        self.background.load(Ordering::Relaxed)
    }
}

/// Runs `task` on the current runtime; outside one there is nothing to run
/// it on, and it is dropped (a claim then ends with its lease).
fn spawn_detached(task: impl std::future::Future<Output = ()> + Send + 'static) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(task);
    }
}
