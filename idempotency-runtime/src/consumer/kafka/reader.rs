//! The reading side: one consumer of the group, subscribed to the topic and
//! its retry topic, polled by a task of its own so that the group's
//! heartbeats and rebalances are served while handlers run. What it fetches
//! goes into the [`Book`]; when the book holds more than a few messages per
//! slot, fetching is paused until the handlers catch up. A revocation
//! commits what was settled of the partitions going away and forgets the
//! rest (their next owner gets it from the committed offset).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::OwnedMessage;
use rdkafka::{ClientContext, Message as _, Offset, TopicPartitionList};
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::book::{Book, Place, Received, Taken};
use super::headers;
use crate::consumer::transport::Deliveries;

/// What the reader, the settler and the rebalance callbacks share.
pub(crate) struct Shared {
    book: Mutex<Book>,
    /// A message became ready (received, released by its key, given back).
    pub(crate) ready: Notify,
    /// The handlers took some: fetching may resume.
    room: Notify,
    /// Held messages past which fetching pauses.
    limit: usize,
}

impl Shared {
    pub(crate) fn new(concurrency: usize) -> Self {
        Shared { book: Mutex::new(Book::default()), ready: Notify::new(), room: Notify::new(), limit: concurrency * 4 }
    }

    pub(crate) fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The places of a partition list.
fn places(list: &TopicPartitionList) -> Vec<Place> {
    list.elements().iter().map(|e| (e.topic().to_owned(), e.partition())).collect()
}

/// A partition list of offsets to commit.
pub(crate) fn offsets(commits: &[(Place, i64)]) -> TopicPartitionList {
    let mut list = TopicPartitionList::with_capacity(commits.len());
    for ((topic, partition), at) in commits {
        // Always valid: the offset is one the broker handed over.
        let _ = list.add_partition_offset(topic, *partition, Offset::Offset(*at));
    }
    list
}

/// The group's rebalance callbacks, on the book.
pub(crate) struct Rebalancing {
    pub(crate) shared: Arc<Shared>,
}

impl ClientContext for Rebalancing {}

impl ConsumerContext for Rebalancing {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            let commits = self.shared.book().revoke(places(list));
            tracing::info!(partitions = list.count(), "idem kafka consumer: partitions revoked");
            // What was settled is committed while the partitions are still ours.
            if !commits.is_empty()
                && let Err(e) = consumer.commit(&offsets(&commits), CommitMode::Sync)
            {
                tracing::warn!(error = %e, "idem kafka consumer: commit on revocation failed");
            }
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            let paused = {
                let mut book = self.shared.book();
                book.assign(places(list));
                book.paused
            };
            tracing::info!(partitions = list.count(), "idem kafka consumer: partitions assigned");
            if paused && let Err(e) = consumer.pause(list) {
                tracing::warn!(error = %e, "idem kafka consumer: pausing new partitions failed");
            }
        }
    }
}

pub(crate) type GroupConsumer = StreamConsumer<Rebalancing>;

/// The reading side, owned by the runner's loop.
pub(crate) struct Reader {
    consumer: Arc<GroupConsumer>,
    shared: Arc<Shared>,
    poll: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
}

impl Reader {
    pub(crate) fn new(
        consumer: Arc<GroupConsumer>,
        shared: Arc<Shared>,
        message_id_header: String,
        retries_header: String,
    ) -> Self {
        let (stop, stopped) = oneshot::channel();
        let task =
            tokio::spawn(poll(Arc::clone(&consumer), Arc::clone(&shared), message_id_header, retries_header, stopped));
        Reader { consumer, shared, poll: Some((stop, task)) }
    }
}

/// Polls until told to stop: messages into the book, fetching paused while
/// the book holds `limit` messages not started.
async fn poll(
    consumer: Arc<GroupConsumer>,
    shared: Arc<Shared>,
    message_id_header: String,
    retries_header: String,
    mut stop: oneshot::Receiver<()>,
) {
    loop {
        let paused = shared.book().paused;
        tokio::select! {
            _ = &mut stop => return,
            () = shared.room.notified(), if paused => {
                let resume = {
                    let mut book = shared.book();
                    let resume = book.held() < shared.limit;
                    book.paused = !resume;
                    resume
                };
                if resume {
                    set_paused(&consumer, false);
                }
            }
            fetched = consumer.recv() => match fetched {
                Ok(message) => {
                    let received = received(message.detach(), &message_id_header, &retries_header);
                    let pause = {
                        let mut book = shared.book();
                        book.receive(received);
                        let pause = !book.paused && book.held() >= shared.limit;
                        book.paused |= pause;
                        pause
                    };
                    shared.ready.notify_one();
                    if pause {
                        set_paused(&consumer, true);
                    }
                }
                // Broker and network errors pass: librdkafka reconnects and fetches again.
                Err(e) => tracing::warn!(error = %e, "idem kafka consumer: fetch failed; retrying"),
            },
        }
    }
}

/// A fetched message as the runner holds it: its id and retry count read
/// from its headers.
pub(crate) fn received(message: OwnedMessage, message_id_header: &str, retries_header: &str) -> Received {
    Received {
        retries: headers::retries(message.headers(), retries_header),
        message_id: headers::message_id(message.headers(), message_id_header),
        message,
        generation: 0,
    }
}

fn set_paused(consumer: &GroupConsumer, paused: bool) {
    let done =
        consumer.assignment().and_then(|list| if paused { consumer.pause(&list) } else { consumer.resume(&list) });
    if let Err(e) = done {
        tracing::warn!(error = %e, paused, "idem kafka consumer: pausing or resuming the fetch failed");
    }
}

impl Deliveries for Reader {
    type Delivery = Received;
    type Error = KafkaError;

    async fn next(&mut self, _room: usize) -> Option<Result<Received, KafkaError>> {
        loop {
            // Registered before looking, so a message that arrives in between wakes it.
            let ready = self.shared.ready.notified();
            let taken = self.shared.book().take(Instant::now());
            match taken {
                Taken::Now(received) => {
                    self.shared.room.notify_one();
                    return Some(Ok(received));
                }
                Taken::Stopped => return None,
                Taken::Wait(None) => ready.await,
                Taken::Wait(Some(due)) => {
                    tokio::select! {
                        () = ready => {}
                        () = tokio::time::sleep_until(due) => {}
                    }
                }
            }
        }
    }

    async fn stop(&mut self) -> Result<(), KafkaError> {
        self.shared.book().stop();
        self.shared.ready.notify_one();
        Ok(())
    }

    /// Commits what was settled, stops polling and leaves the group.
    async fn finish(mut self) {
        let commits = self.shared.book().commits();
        if !commits.is_empty()
            && let Err(e) = self.consumer.commit(&offsets(&commits), CommitMode::Sync)
        {
            tracing::warn!(error = %e, "idem kafka consumer: final commit failed");
        }
        if let Some((stop, task)) = self.poll.take() {
            let _ = stop.send(());
            let _ = task.await;
        }
        self.consumer.unsubscribe();
    }
}
