//! Duplicates waiting for a running call's answer (`wait`): told when it
//! ends, not polling. The call that ends (its result cached in place of its
//! claim, or its claim released) publishes on a channel named as its claim
//! key (the scripts, `scripts.rs`); a duplicate waiting here subscribes to
//! that channel and, when told, asks the claim again: a result, the key
//! free (the first call failed: it goes ahead as a first call), or someone
//! else's claim (it waits on).
//!
//! One pub/sub connection per engine, made on the first wait and shared by
//! every key waited on; one subscription per key, shared by its waiters
//! here, dropped with the last. A waiter subscribes before it asks again,
//! so a publish cannot slip between its question and its wait. A
//! connection that fails lets its waiters go at their bound (each asks once
//! more then); the next wait connects again. A Redis Cluster has no one
//! connection every publish reaches (sharded channels live on their slot's
//! node): there a waiter asks the claim again at doubling intervals instead.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use redis::aio::PubSubSink;
use tokio::sync::watch;

/// The waits of one engine on one Redis node.
pub(crate) struct Waiters {
    client: redis::Client,
    /// The pub/sub connection's sending half, once connected; `None` again
    /// after it failed.
    sink: tokio::sync::Mutex<Option<PubSubSink>>,
    /// The channels subscribed to: how many waiters each, and the counter
    /// its messages bump.
    channels: Arc<Mutex<HashMap<String, Channel>>>,
}

struct Channel {
    waiters: usize,
    told: watch::Sender<u64>,
}

/// A waiter's subscription: changes when the call it waits on ends.
/// Dropped, it unsubscribes with the channel's last waiter.
pub(crate) struct Subscription<'w> {
    waiters: &'w Waiters,
    channel: String,
    pub(crate) told: watch::Receiver<u64>,
}

impl Waiters {
    pub(crate) fn new(client: redis::Client) -> Self {
        Waiters { client, sink: tokio::sync::Mutex::new(None), channels: Arc::default() }
    }

    /// Subscribes to `channel` (the running call's claim key): `None` when
    /// the pub/sub connection cannot be had.
    pub(crate) async fn subscribe(&self, channel: &str) -> Option<Subscription<'_>> {
        let (told, first) = {
            let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
            let entry =
                channels.entry(channel.to_owned()).or_insert_with(|| Channel { waiters: 0, told: watch::channel(0).0 });
            entry.waiters += 1;
            (entry.told.subscribe(), entry.waiters == 1)
        };
        let subscription = Subscription { waiters: self, channel: channel.to_owned(), told };
        if first {
            // Confirmed by the server before the waiter asks again.
            let mut sink = self.sink().await?;
            if sink.subscribe(channel).await.is_err() {
                self.forget_connection().await;
                return None;
            }
        }
        Some(subscription)
    }

    /// The pub/sub connection's sink, connecting (and starting the task
    /// that hands messages to their channels) if there is none.
    async fn sink(&self) -> Option<PubSubSink> {
        let mut held = self.sink.lock().await;
        if let Some(sink) = held.as_ref() {
            return Some(sink.clone());
        }
        let (sink, mut stream) = self.client.get_async_pubsub().await.ok()?.split();
        let channels = Arc::clone(&self.channels);
        tokio::spawn(async move {
            use futures_core::Stream;
            while let Some(message) = std::future::poll_fn(|cx| std::pin::Pin::new(&mut stream).poll_next(cx)).await {
                let channels = channels.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(channel) = channels.get(message.get_channel_name()) {
                    channel.told.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
        });
        *held = Some(sink.clone());
        Some(sink)
    }

    async fn forget_connection(&self) {
        *self.sink.lock().await = None;
    }
}

impl Drop for Subscription<'_> {
    fn drop(&mut self) {
        let mut channels = self.waiters.channels.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(channel) = channels.get_mut(&self.channel) else { return };
        channel.waiters -= 1;
        if channel.waiters > 0 {
            return;
        }
        channels.remove(&self.channel);
        drop(channels);
        // Off the waiter's path; a failure leaves a subscription whose
        // messages find no channel here, harmless.
        if let Ok(held) = self.waiters.sink.try_lock()
            && let Some(mut sink) = held.clone()
        {
            let channel = std::mem::take(&mut self.channel);
            tokio::spawn(async move {
                let _ = sink.unsubscribe(channel).await;
            });
        }
    }
}
