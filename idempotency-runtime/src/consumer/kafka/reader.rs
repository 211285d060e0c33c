//! The reading side: one consumer of the group, subscribed to the topic and
//! its retry topic, polled by a task of its own so that the group's
//! heartbeats, rebalances and commit results are served while handlers run.
//! What it fetches goes into the [`Book`]; while the book holds four
//! messages per slot not yet running (ready, behind their key, waiting out
//! a delay or a retry), fetching is paused, and it resumes at two. The pause
//! is looked at again whenever that count changes and on every assignment
//! change (a revocation drops what was held; a new assignment starts
//! unpaused unless the count says otherwise). A revocation commits what was
//! settled of the partitions going away, unless they were lost, and
//! forgets the rest (their next owner gets it from the committed offset).
//! A panic in the polling task ends the runner with an error.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::KafkaResult;
use rdkafka::message::{BorrowedMessage, OwnedMessage};
use rdkafka::{ClientContext, Message as _, Offset, TopicPartitionList};
use tokio::sync::{Notify, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::book::{Book, Place, Received, Taken};
use super::commit;
use super::error::RunError;
use super::event::{Event, Hook};
use super::headers::{self, Field};
use crate::consumer::transport::Deliveries;

/// What the reader, the settler and the group's callbacks share.
pub(crate) struct Shared {
    book: Mutex<Book>,
    /// A message became ready (received, released by its key, given back).
    pub(crate) ready: Notify,
    /// What the book holds changed (a message taken, given back, or its
    /// retry begun or ended): the polling task looks at the pause again.
    pub(crate) recount: Notify,
    /// Bumped on every revocation and on stop: a message waiting out its
    /// retry looks again whether it is still the runner's.
    changes: watch::Sender<u64>,
    /// Held messages at which fetching pauses.
    limit: usize,
    /// How long a revocation's or the stop's commit waits for its answer.
    commit_timeout: Duration,
    events: Option<Hook>,
}

impl Shared {
    pub(crate) fn new(concurrency: usize, commit_timeout: Duration, events: Option<Hook>) -> Self {
        Shared {
            book: Mutex::new(Book::default()),
            ready: Notify::new(),
            recount: Notify::new(),
            changes: watch::Sender::new(0),
            limit: concurrency * 4,
            commit_timeout,
            events,
        }
    }

    pub(crate) fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn emit(&self, event: Event) {
        if let Some(hook) = &self.events {
            (hook.0)(&event);
        }
    }

    /// Commits `commits` and waits for the broker's answer, at most
    /// `commit_timeout` (a revocation, the stop): confirmed offsets are
    /// marked, and either way told.
    fn commit_now<C: Consumer<Rebalancing>>(&self, consumer: &C, commits: &[(Place, i64)], why: &str) {
        if commits.is_empty() {
            return;
        }
        let result = commit::and_wait(consumer, commits, self.commit_timeout);
        for ((topic, partition), offset) in commits {
            let (topic, partition, offset) = (topic.clone(), *partition, *offset);
            match &result {
                Ok(()) => {
                    self.book().confirmed(&(topic.clone(), partition), offset);
                    self.emit(Event::Committed { topic, partition, offset });
                }
                Err(e) => {
                    tracing::warn!(error = %e, %topic, partition, offset, "idem kafka consumer: commit on {why} failed");
                    self.emit(Event::CommitFailed { topic, partition, offset, error: e.to_string() });
                }
            }
        }
    }

    /// Tells messages waiting out a retry that partitions went, or the
    /// runner is stopping.
    fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Waits `delay` for `received`, unless it stops being the runner's
    /// first (a stop, a revocation of its partition); whether it still is.
    pub(crate) async fn wait_out(&self, received: &Received, delay: Duration) -> bool {
        let due = crate::clock::deadline_in(delay);
        let mut changes = self.changes.subscribe();
        loop {
            if !self.book().holds(received) {
                return false;
            }
            tokio::select! {
                () = tokio::time::sleep_until(due) => return self.book().holds(received),
                _ = changes.changed() => {}
            }
        }
    }

    /// Pauses or resumes the fetching of `consumer`'s whole assignment as
    /// the count of held messages says: paused at `limit`, resumed at half
    /// of it. `again`: applied even when the state did not change (an
    /// assignment changed, and librdkafka's pause is per partition).
    fn repause<C: Consumer<Rebalancing>>(&self, consumer: &C, again: bool) {
        let (paused, held, changed) = {
            let mut book = self.book();
            let held = book.held();
            let paused = if book.paused { held > self.limit / 2 } else { held >= self.limit };
            let changed = paused != book.paused;
            book.paused = paused;
            (paused, held, changed)
        };
        if !(changed || again) {
            return;
        }
        let done = consumer.assignment().and_then(|list| match paused {
            true => consumer.pause(&list),
            false => consumer.resume(&list),
        });
        if let Err(e) = done {
            tracing::warn!(error = %e, paused, "idem kafka consumer: pausing or resuming the fetch failed");
        }
        if changed {
            tracing::debug!(
                held,
                paused,
                "idem kafka consumer: fetching {}",
                if paused { "paused" } else { "resumed" }
            );
            self.emit(if paused { Event::FetchPaused { held } } else { Event::FetchResumed { held } });
        }
    }
}

/// The places of a partition list.
fn places(list: &TopicPartitionList) -> Vec<Place> {
    list.elements().iter().map(|e| (e.topic().to_owned(), e.partition())).collect()
}

/// The group's callbacks (rebalances, commit results), on the book. They
/// run in the polling task.
pub(crate) struct Rebalancing {
    pub(crate) shared: Arc<Shared>,
}

impl ClientContext for Rebalancing {}

impl ConsumerContext for Rebalancing {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            // Lost: the group has moved on; Kafka fences a commit now, and a
            // broker that does not could take one that moves the group back.
            let lost = consumer.assignment_lost();
            let partitions = places(list);
            let commits = self.shared.book().revoke(partitions.clone(), lost);
            self.shared.changed();
            tracing::info!(partitions = list.count(), lost, "idem kafka consumer: partitions revoked");
            // What was settled is committed while the partitions are still ours.
            self.shared.commit_now(consumer, &commits, "revocation");
            self.shared.emit(Event::Revoked { partitions, lost });
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(list) => {
                let partitions = places(list);
                self.shared.book().assign(partitions.clone());
                tracing::info!(partitions = list.count(), "idem kafka consumer: partitions assigned");
                self.shared.emit(Event::Assigned(partitions));
            }
            Rebalance::Revoke(_) => {}
            Rebalance::Error(e) => tracing::warn!(error = %e, "idem kafka consumer: rebalance failed"),
        }
        // What was held of revoked partitions is gone, and new partitions
        // start as the count says: a pause kept from before would never lift.
        self.shared.repause(consumer, true);
    }

    /// A commit's answer: confirmed offsets count as committed; a failed
    /// one is sent again.
    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        for element in offsets.elements() {
            let Offset::Offset(offset) = element.offset() else { continue };
            let (topic, partition) = (element.topic().to_owned(), element.partition());
            let place = (topic.clone(), partition);
            let error = match (&result, element.error()) {
                (Err(e), _) => Some(e.to_string()),
                (Ok(()), Err(e)) => Some(e.to_string()),
                (Ok(()), Ok(())) => None,
            };
            match error {
                None => {
                    self.shared.book().confirmed(&place, offset);
                    self.shared.emit(Event::Committed { topic, partition, offset });
                }
                Some(error) => {
                    self.shared.book().commit_failed(&place);
                    tracing::warn!(%topic, partition, offset, %error,
                        "idem kafka consumer: commit failed; it is sent again");
                    self.shared.emit(Event::CommitFailed { topic, partition, offset, error });
                }
            }
        }
    }
}

pub(crate) type GroupConsumer = StreamConsumer<Rebalancing>;

/// Which headers the reader reads, and where the retry count counts.
#[derive(Debug, Clone)]
pub(crate) struct Reading {
    pub(crate) message_id_header: String,
    pub(crate) retries_header: String,
    /// The retry topic: only a copy there carries a count the runner made.
    pub(crate) retry_topic: String,
}

/// The reading side, owned by the runner's loop.
pub(crate) struct Reader {
    consumer: Arc<GroupConsumer>,
    shared: Arc<Shared>,
    poll: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
}

impl Reader {
    pub(crate) fn new(consumer: Arc<GroupConsumer>, shared: Arc<Shared>, reading: Reading) -> Self {
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(poll(Arc::clone(&consumer), Arc::clone(&shared), reading, stopped));
        Reader { consumer, shared, poll: Some((stop, task)) }
    }
}

/// Polls until told to stop: messages into the book, the fetch paused and
/// resumed as the book's count says.
async fn poll(consumer: Arc<GroupConsumer>, shared: Arc<Shared>, reading: Reading, mut stop: oneshot::Receiver<()>) {
    loop {
        tokio::select! {
            _ = &mut stop => return,
            () = shared.recount.notified() => shared.repause(&*consumer, false),
            fetched = consumer.recv() => match fetched {
                Ok(message) => {
                    let received = received(&message, &reading);
                    drop(message);
                    shared.book().receive(received);
                    shared.ready.notify_one();
                    shared.repause(&*consumer, false);
                }
                // Broker and network errors pass: librdkafka reconnects and fetches again.
                Err(e) => tracing::warn!(error = %e, "idem kafka consumer: fetch failed; retrying"),
            },
        }
    }
}

/// A fetched message as the runner holds it: its headers read as bytes,
/// its id and retry count read from them.
fn received(message: &BorrowedMessage<'_>, reading: &Reading) -> Received {
    let (fields, unreadable) = match headers::of_message(message) {
        Ok(fields) => (fields, None),
        Err(why) => (Vec::new(), Some(why)),
    };
    read(message.detach(), fields, unreadable, reading)
}

/// A message and its headers as the runner holds them. The retry count is
/// read on the retry topic only: elsewhere the header is not the runner's
/// (a dead-letter copy replayed into the topic carries the count it had).
pub(crate) fn read(
    message: OwnedMessage,
    fields: Vec<Field>,
    unreadable: Option<String>,
    reading: &Reading,
) -> Received {
    let retries = match message.topic() == reading.retry_topic {
        true => headers::retries(&fields, &reading.retries_header),
        false => 0,
    };
    Received {
        retries,
        message_id: headers::message_id(&fields, &reading.message_id_header),
        malformed: unreadable.or_else(|| headers::malformed(&fields)),
        fields,
        message,
        generation: 0,
    }
}

impl Deliveries for Reader {
    type Delivery = Received;
    type Error = RunError;

    async fn next(&mut self, _room: usize) -> Option<Result<Received, RunError>> {
        loop {
            let (_, task) = self.poll.as_mut()?;
            if task.is_finished() {
                let (_, task) = self.poll.take()?;
                return Some(Err(RunError::ended("poll", task.await)));
            }
            // Registered before looking, so a message that arrives in between wakes it.
            let ready = self.shared.ready.notified();
            let taken = self.shared.book().take(Instant::now());
            let due = match taken {
                Taken::Now(received) => {
                    self.shared.recount.notify_one();
                    return Some(Ok(received));
                }
                Taken::Stopped => return None,
                Taken::Wait(due) => due,
            };
            let delay = async {
                match due {
                    Some(due) => tokio::time::sleep_until(due).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = ready => {}
                () = delay => {}
                // The polling task never ends on its own: it panicked.
                joined = task => {
                    self.poll = None;
                    return Some(Err(RunError::ended("poll", joined)));
                }
            }
        }
    }

    async fn stop(&mut self) -> Result<(), RunError> {
        self.shared.book().stop();
        self.shared.changed();
        self.shared.ready.notify_one();
        Ok(())
    }

    /// Commits what was settled and not yet confirmed, waiting for the
    /// broker's answer; stops polling and leaves the group.
    async fn finish(mut self) {
        let commits = self.shared.book().commits();
        self.shared.commit_now(&*self.consumer, &commits, "stop");
        if let Some((stop, task)) = self.poll.take() {
            let _ = stop.send(());
            let _ = task.await;
        }
        self.consumer.unsubscribe();
    }
}
