//! The runner's book of what it holds, per partition it owns: the offsets
//! received and not yet settled, the keys being handled (a later message of
//! a busy key waits for it), the messages ready to start or waiting out a
//! delay, and how far the group's offset may be committed: up to the lowest
//! offset not yet settled, never past one still running or waiting. An
//! offset counts as committed once the broker confirmed it, not when its
//! commit was sent: a commit that failed is sent again (with the next
//! settlement, on revocation, on stop). It also counts what it holds that
//! has not started, messages waiting out a retry included: fetching pauses
//! on that count. No input/output here: the reader and the settler call it
//! under one lock.

use std::collections::{BTreeSet, HashMap, VecDeque};

use rdkafka::Message as _;
use rdkafka::message::OwnedMessage;
use tokio::time::Instant;

use super::headers::Field;

/// A topic and one of its partitions.
pub(crate) type Place = (String, i32);

/// One message as the runner holds it.
#[derive(Debug, Clone)]
pub(crate) struct Received {
    pub(crate) message: OwnedMessage,
    /// The assignment it was received under: settling it commits only while
    /// that same assignment holds its partition.
    pub(crate) generation: u64,
    /// Its retry header (0 on a first attempt).
    pub(crate) retries: u64,
    /// Its message id header, if UTF-8.
    pub(crate) message_id: Option<String>,
    /// Its headers, names as bytes.
    pub(crate) fields: Vec<Field>,
    /// Why its headers make it poison (a name that is not UTF-8), if they do.
    pub(crate) malformed: Option<String>,
}

impl Received {
    pub(crate) fn place(&self) -> Place {
        (self.message.topic().to_owned(), self.message.partition())
    }
}

/// One owned partition.
#[derive(Debug)]
struct Partition {
    generation: u64,
    /// Received and not settled (running, ready, waiting for its key or a delay).
    unsettled: BTreeSet<i64>,
    /// One past the highest offset received.
    next: Option<i64>,
    /// The last offset the broker confirmed committed.
    committed: Option<i64>,
    /// The last offset sent to be committed, confirmed or not yet.
    requested: Option<i64>,
    /// Keys with a message received and not settled; the later messages of
    /// each, in order.
    busy: HashMap<Vec<u8>, VecDeque<Received>>,
}

impl Partition {
    /// Where the group may resume: the lowest unsettled offset, or past
    /// everything received; `None` when nothing was received.
    fn resume_at(&self) -> Option<i64> {
        self.unsettled.first().copied().or(self.next)
    }

    /// The offset to commit in the background, when it moved past what
    /// was sent already.
    fn advance(&mut self) -> Option<i64> {
        let at = self.resume_at()?;
        if self.requested.max(self.committed).is_some_and(|c| c >= at) {
            return None;
        }
        self.requested = Some(at);
        Some(at)
    }

    /// The offset to commit and wait for, when it is past what the broker
    /// confirmed (sent but unconfirmed counts as not committed).
    fn unconfirmed(&self) -> Option<i64> {
        let at = self.resume_at()?;
        self.committed.is_none_or(|c| c < at).then_some(at)
    }
}

/// What the runner holds; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct Book {
    generation: u64,
    partitions: HashMap<Place, Partition>,
    ready: VecDeque<Received>,
    delayed: Vec<(Instant, Received)>,
    /// Messages waiting out their retry delay or their retry copy's produce.
    retrying: usize,
    stopping: bool,
    /// Whether the reader paused fetching (too much is held already).
    pub(crate) paused: bool,
}

/// What [`Book::take`] found.
#[derive(Debug)]
pub(crate) enum Taken {
    /// A message to start now.
    Now(Received),
    /// Nothing yet; the earliest delay ends then, if one is waiting.
    Wait(Option<Instant>),
    /// The runner is stopping: nothing more.
    Stopped,
}

impl Book {
    /// Partitions handed to this consumer: a new assignment.
    pub(crate) fn assign(&mut self, places: impl IntoIterator<Item = Place>) {
        self.generation += 1;
        for place in places {
            let generation = self.generation;
            self.partitions.entry(place).or_insert_with(|| Partition {
                generation,
                unsettled: BTreeSet::new(),
                next: None,
                committed: None,
                requested: None,
                busy: HashMap::new(),
            });
        }
    }

    /// Partitions taken away: forgotten with everything held of them (their
    /// next owner gets those messages from the committed offset). Returns
    /// the offsets to commit before they go: none when they were `lost`
    /// (the group moved on without this consumer, whose commit the broker
    /// would fence, or worse, take).
    pub(crate) fn revoke(&mut self, places: impl IntoIterator<Item = Place>, lost: bool) -> Vec<(Place, i64)> {
        let mut commits = Vec::new();
        for place in places {
            if let Some(partition) = self.partitions.remove(&place) {
                if let Some(at) = partition.unconfirmed().filter(|_| !lost) {
                    commits.push((place.clone(), at));
                }
                self.ready.retain(|r| r.place() != place);
                self.delayed.retain(|(_, r)| r.place() != place);
            }
        }
        commits
    }

    /// A message fetched: held until settled, ready at once unless a message
    /// of its key is still unsettled. One of a partition not owned (fetched
    /// before a revocation) or received while stopping is dropped unheld.
    pub(crate) fn receive(&mut self, mut received: Received) {
        if self.stopping {
            return;
        }
        let offset = received.message.offset();
        let Some(partition) = self.partitions.get_mut(&received.place()) else {
            return;
        };
        if !partition.unsettled.insert(offset) {
            return; // fetched twice (a seek): already held
        }
        partition.next = Some(partition.next.map_or(offset + 1, |n| n.max(offset + 1)));
        received.generation = partition.generation;
        match received.message.key() {
            Some(key) => match partition.busy.get_mut(key) {
                Some(waiting) => waiting.push_back(received),
                None => {
                    partition.busy.insert(key.to_vec(), VecDeque::new());
                    self.ready.push_back(received);
                }
            },
            None => self.ready.push_back(received),
        }
    }

    /// The next message to start: one whose delay ended first, else the
    /// oldest ready one.
    pub(crate) fn take(&mut self, now: Instant) -> Taken {
        if self.stopping {
            return Taken::Stopped;
        }
        let due = self.delayed.iter().enumerate().filter(|(_, (at, _))| *at <= now).min_by_key(|(_, (at, _))| *at);
        if let Some((i, _)) = due {
            return Taken::Now(self.delayed.swap_remove(i).1);
        }
        match self.ready.pop_front() {
            Some(received) => Taken::Now(received),
            None => Taken::Wait(self.delayed.iter().map(|(at, _)| *at).min()),
        }
    }

    /// A message settled (acked, retried as a copy, dead-lettered): its
    /// offset is done and its key free for the next. Returns the offset to
    /// commit when it moved forward; `None` too when the partition is no
    /// longer owned by the assignment it came under (nothing is committed
    /// for a partition another consumer owns now).
    pub(crate) fn settle(&mut self, received: &Received) -> Option<(Place, i64)> {
        let place = received.place();
        let partition = self.owned(&place, received.generation)?;
        partition.unsettled.remove(&received.message.offset());
        if let Some(key) = received.message.key()
            && let Some(waiting) = partition.busy.get_mut(key)
        {
            match waiting.pop_front() {
                Some(next) => self.ready.push_back(next),
                None => {
                    partition.busy.remove(key);
                }
            }
        }
        let partition = self.partitions.get_mut(&place)?;
        partition.advance().map(|at| (place, at))
    }

    /// A message given back to start again at `due`, uncounted: still
    /// unsettled, its key still busy. Dropped when its partition is no
    /// longer owned or the runner is stopping.
    pub(crate) fn requeue(&mut self, received: Received, due: Instant) {
        if self.stopping || self.owned(&received.place(), received.generation).is_none() {
            return;
        }
        self.delayed.push((due, received));
    }

    /// Stops: nothing more is taken or received; what was held and not
    /// started stays unsettled (and uncommitted): the group's next owner
    /// gets it.
    pub(crate) fn stop(&mut self) {
        self.stopping = true;
        self.ready.clear();
        self.delayed.clear();
        for partition in self.partitions.values_mut() {
            partition.busy.clear();
        }
    }

    /// Every owned partition's offset to commit and wait for, where it is
    /// past what the broker confirmed.
    pub(crate) fn commits(&self) -> Vec<(Place, i64)> {
        self.partitions.iter().filter_map(|(place, p)| p.unconfirmed().map(|at| (place.clone(), at))).collect()
    }

    /// The broker confirmed `offset` committed for `place`.
    pub(crate) fn confirmed(&mut self, place: &Place, offset: i64) {
        if let Some(partition) = self.partitions.get_mut(place) {
            partition.committed = partition.committed.max(Some(offset));
            partition.requested = partition.requested.max(Some(offset));
        }
    }

    /// A commit for `place` failed: what was sent and not confirmed is sent
    /// again, with the next settlement or at the latest on revocation or stop.
    pub(crate) fn commit_failed(&mut self, place: &Place) {
        if let Some(partition) = self.partitions.get_mut(place) {
            partition.requested = partition.committed;
        }
    }

    /// Whether `received` is still the runner's to settle: not stopping,
    /// and its partition still held under the assignment it came with.
    pub(crate) fn holds(&mut self, received: &Received) -> bool {
        !self.stopping && self.owned(&received.place(), received.generation).is_some()
    }

    /// A message began waiting out its retry delay (counted as held until
    /// [`retry_ended`](Self::retry_ended)).
    pub(crate) fn retry_began(&mut self) {
        self.retrying += 1;
    }

    pub(crate) fn retry_ended(&mut self) {
        self.retrying = self.retrying.saturating_sub(1);
    }

    /// How many messages are held and not running: ready, waiting for their
    /// key, waiting out a delay or a retry.
    pub(crate) fn held(&self) -> usize {
        let waiting: usize = self.partitions.values().flat_map(|p| p.busy.values()).map(VecDeque::len).sum();
        self.ready.len() + self.delayed.len() + self.retrying + waiting
    }

    fn owned(&mut self, place: &Place, generation: u64) -> Option<&mut Partition> {
        self.partitions.get_mut(place).filter(|p| p.generation == generation)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rdkafka::Timestamp;

    use super::*;

    fn message(partition: i32, offset: i64, key: Option<&str>) -> Received {
        let message = OwnedMessage::new(
            Some(b"{}".to_vec()),
            key.map(|k| k.as_bytes().to_vec()),
            "t".to_owned(),
            Timestamp::NotAvailable,
            partition,
            offset,
            None,
        );
        Received { message, generation: 0, retries: 0, message_id: None, fields: Vec::new(), malformed: None }
    }

    fn offsets(book: &mut Book, now: Instant) -> Vec<i64> {
        let mut taken = Vec::new();
        while let Taken::Now(r) = book.take(now) {
            taken.push(r.message.offset());
        }
        taken
    }

    fn place(partition: i32) -> Place {
        ("t".to_owned(), partition)
    }

    #[test]
    fn the_commit_never_passes_the_lowest_unsettled_offset() {
        let now = Instant::now();
        let mut book = Book::default();
        book.assign([place(0)]);
        for offset in 10..13 {
            book.receive(message(0, offset, None));
        }
        let mut held: Vec<Received> = Vec::new();
        while let Taken::Now(r) = book.take(now) {
            held.push(r);
        }
        // 11 and 12 settle first: 10 still runs, nothing moves.
        assert_eq!(book.settle(&held[2]), Some((place(0), 10)), "resumes at 10: the first commit");
        assert_eq!(book.settle(&held[1]), None);
        assert_eq!(book.settle(&held[0]), Some((place(0), 13)), "all settled: past the last");
    }

    #[test]
    fn a_later_message_of_a_busy_key_waits_for_it_and_others_do_not() {
        let now = Instant::now();
        let mut book = Book::default();
        book.assign([place(0)]);
        book.receive(message(0, 0, Some("a")));
        book.receive(message(0, 1, Some("a")));
        book.receive(message(0, 2, Some("b")));
        book.receive(message(0, 3, None));
        let mut first = Vec::new();
        while let Taken::Now(r) = book.take(now) {
            first.push(r);
        }
        assert_eq!(first.iter().map(|r| r.message.offset()).collect::<Vec<_>>(), [0, 2, 3]);
        // Given back uncounted, "a"@0 keeps its key: "a"@1 still waits.
        book.requeue(first[0].clone(), now + Duration::from_secs(1));
        assert_eq!(offsets(&mut book, now), Vec::<i64>::new());
        let again = match book.take(now + Duration::from_secs(1)) {
            Taken::Now(r) => r,
            other => panic!("{other:?}"),
        };
        assert_eq!(again.message.offset(), 0);
        book.settle(&again);
        assert_eq!(offsets(&mut book, now), [1]);
    }

    #[test]
    fn a_revoked_partition_is_forgotten_and_never_committed_again() {
        let now = Instant::now();
        let mut book = Book::default();
        book.assign([place(0), place(1)]);
        book.receive(message(0, 5, None));
        book.receive(message(0, 6, None));
        book.receive(message(1, 0, None));
        let running = match book.take(now) {
            Taken::Now(r) => r,
            other => panic!("{other:?}"),
        };
        assert_eq!(running.place(), place(0));
        // Revoked while 5 runs: committed up to it, 6 dropped unhandled.
        assert_eq!(book.revoke([place(0)], false), vec![(place(0), 5)]);
        assert_eq!(offsets(&mut book, now), [0], "only partition 1's message is left");
        assert_eq!(book.settle(&running), None, "not ours any more");
        // Given back again under a new assignment: a message of the old one
        // still commits nothing.
        book.assign([place(0)]);
        assert_eq!(book.settle(&running), None);
        book.receive(message(0, 5, None));
        assert_eq!(offsets(&mut book, now), [5]);
    }

    #[test]
    fn stopping_keeps_what_was_not_started_uncommitted() {
        let now = Instant::now();
        let mut book = Book::default();
        book.assign([place(0)]);
        book.receive(message(0, 0, None));
        book.receive(message(0, 1, None));
        let running = match book.take(now) {
            Taken::Now(r) => r,
            other => panic!("{other:?}"),
        };
        book.stop();
        assert!(matches!(book.take(now), Taken::Stopped));
        book.receive(message(0, 2, None));
        assert_eq!(book.settle(&running), Some((place(0), 1)), "1 was never started: resume there");
        assert_eq!(book.commits(), vec![(place(0), 1)], "sent, not confirmed: committed again on stop");
        book.confirmed(&place(0), 1);
        assert_eq!(book.commits(), vec![]);
    }

    /// Regression: an offset counted as committed once its commit was sent,
    /// so after a failed one the revocation and the stop skipped it.
    #[test]
    fn an_offset_counts_as_committed_once_confirmed_and_a_failed_commit_is_sent_again() {
        let now = Instant::now();
        let mut book = Book::default();
        book.assign([place(0)]);
        for offset in 0..3 {
            book.receive(message(0, offset, None));
        }
        let taken: Vec<Received> = std::iter::from_fn(|| match book.take(now) {
            Taken::Now(r) => Some(r),
            _ => None,
        })
        .collect();
        assert_eq!(book.settle(&taken[0]), Some((place(0), 1)));
        book.commit_failed(&place(0));
        assert_eq!(book.commits(), vec![(place(0), 1)]);
        // The next settlement sends it again, with what it adds.
        assert_eq!(book.settle(&taken[1]), Some((place(0), 2)));
        assert_eq!(book.settle(&taken[2]), Some((place(0), 3)), "sent, not yet confirmed: no resend of 2");
        book.confirmed(&place(0), 2);
        assert_eq!(book.commits(), vec![(place(0), 3)]);
        assert_eq!(book.revoke([place(0)], false), vec![(place(0), 3)], "revoked: committed and waited for");
    }

    #[test]
    fn lost_partitions_are_forgotten_without_a_commit() {
        let now = Instant::now();
        let mut book = Book::default();
        book.assign([place(0)]);
        book.receive(message(0, 0, None));
        let Taken::Now(running) = book.take(now) else { panic!("nothing taken") };
        assert_eq!(book.settle(&running), Some((place(0), 1)));
        book.commit_failed(&place(0));
        assert_eq!(book.revoke([place(0)], true), vec![]);
        assert!(!book.holds(&running));
    }

    #[test]
    fn messages_waiting_for_their_retry_count_as_held() {
        let now = Instant::now();
        let mut book = Book::default();
        book.assign([place(0)]);
        book.receive(message(0, 0, None));
        book.receive(message(0, 1, Some("a")));
        book.receive(message(0, 2, Some("a")));
        assert_eq!(book.held(), 3, "0 and 1 ready, 2 behind its key");
        let Taken::Now(first) = book.take(now) else { panic!("nothing taken") };
        assert_eq!(book.held(), 2, "0 runs");
        book.retry_began();
        assert_eq!(book.held(), 3, "0 waits out its retry");
        assert!(book.holds(&first));
        book.retry_ended();
        assert_eq!(book.held(), 2);
        book.stop();
        assert!(!book.holds(&first), "stopping: nothing more is the runner's to settle");
    }
}
