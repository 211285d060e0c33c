//! What wakes an engine's relays.

/// Wakes the relays built on one engine when a call that queued events
/// commits: they look at once instead of at their next poll.
#[derive(Debug)]
pub(crate) struct Waker(tokio::sync::watch::Sender<u64>);

impl Default for Waker {
    fn default() -> Self {
        Waker(tokio::sync::watch::Sender::new(0))
    }
}

impl Waker {
    pub(crate) fn wake(&self) {
        self.0.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.0.subscribe()
    }
}
