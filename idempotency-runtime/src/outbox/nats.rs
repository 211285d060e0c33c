//! The NATS JetStream publisher of the outbox relay (features `outbox` and
//! `nats`): each event is published to its destination subject with the
//! event's id as `Nats-Msg-Id`, and counts as sent once JetStream
//! acknowledged it. A re-published event (its relay died before marking
//! it) inside the stream's duplicate window is dropped by the server and
//! acknowledged as a duplicate; past the window, the consumer's record
//! drops it.
//!
//! The subjects must belong to a stream (else the server refuses: no
//! stream, counted as an attempt). Keep the stream's duplicate window
//! (default 2 minutes) longer than a relay's worst-case time from publish
//! to commit.

use std::time::Duration;

use async_nats::header::HeaderMap;
use async_nats::jetstream::{self, context::PublishErrorKind};

use super::relay::{Confirm, Message, Publisher};

/// The header JetStream deduplicates on.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// Publishes outbox events to NATS JetStream; see the [module docs](self).
/// The client reconnects by itself.
#[derive(Clone)]
pub struct NatsPublisher {
    context: jetstream::Context,
    ack_timeout: Duration,
}

impl std::fmt::Debug for NatsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsPublisher").field("ack_timeout", &self.ack_timeout).finish_non_exhaustive()
    }
}

impl NatsPublisher {
    /// A publisher through `client`'s JetStream.
    pub fn new(client: async_nats::Client) -> Self {
        Self::with_context(jetstream::new(client))
    }

    /// A publisher through a JetStream context (a domain or prefix of its own).
    pub fn with_context(context: jetstream::Context) -> Self {
        NatsPublisher { context, ack_timeout: Duration::from_secs(10) }
    }

    /// How long a batch waits for its acknowledgements; the ones missing
    /// then are unconfirmed (not counted as attempts). Default 10 s.
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self
    }
}

fn headers(message: &Message) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in message.headers() {
        headers.insert(name.as_str(), value.as_str());
    }
    headers.insert(MSG_ID_HEADER, message.id());
    headers
}

/// Whether the server answered for this message (refused it: no stream,
/// an API error, an invalid subject), rather than nobody answering.
fn answered(kind: PublishErrorKind) -> bool {
    !matches!(kind, PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe)
}

impl Publisher for NatsPublisher {
    async fn publish(&mut self, batch: &[Message]) -> Vec<Confirm> {
        let deadline = crate::clock::deadline_in(self.ack_timeout);
        // All sent first, then all acknowledgements awaited.
        let mut pending = Vec::with_capacity(batch.len());
        for message in batch {
            let payload = message.payload().as_bytes().to_vec().into();
            let sent = tokio::time::timeout_at(
                deadline,
                self.context.publish_with_headers(message.destination().to_owned(), headers(message), payload),
            )
            .await;
            pending.push(match sent {
                Ok(Ok(ack)) => Ok(ack),
                Ok(Err(e)) if answered(e.kind()) => Err(Confirm::Refused(format!("publish: {e}"))),
                Ok(Err(e)) => Err(Confirm::Unconfirmed(format!("publish: {e}"))),
                Err(_) => Err(Confirm::Unconfirmed("publish: timed out".to_owned())),
            });
        }
        let mut answers = Vec::with_capacity(batch.len());
        for ack in pending {
            answers.push(match ack {
                Err(answer) => answer,
                Ok(ack) => match tokio::time::timeout_at(deadline, ack).await {
                    Ok(Ok(ack)) => Confirm::Sent { duplicate: ack.duplicate },
                    Ok(Err(e)) if answered(e.kind()) => Confirm::Refused(format!("ack: {e}")),
                    Ok(Err(e)) => Confirm::Unconfirmed(format!("ack: {e}")),
                    Err(_) => Confirm::Unconfirmed("ack: timed out".to_owned()),
                },
            });
        }
        answers
    }
}
