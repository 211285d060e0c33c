//! The runner's book of what it holds, per partition it owns: the offsets
//! received and not yet settled, the keys being handled (a later message of
//! a busy key waits for it), the messages ready to start or waiting out a
//! delay, and how far the group's offset may be committed: up to the lowest
//! offset not yet settled, never past one still running or waiting. No
//! input/output here: the reader and the settler call it under one lock.

use std::collections::{BTreeSet, HashMap, VecDeque};

use rdkafka::Message as _;
use rdkafka::message::OwnedMessage;
use tokio::time::Instant;

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
    /// The last offset committed (or handed to be committed).
    committed: Option<i64>,
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

    /// The offset to commit, when it moved forward.
    fn advance(&mut self) -> Option<i64> {
        let at = self.resume_at()?;
        if self.committed.is_some_and(|c| c >= at) {
            return None;
        }
        self.committed = Some(at);
        Some(at)
    }
}

/// What the runner holds; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct Book {
    generation: u64,
    partitions: HashMap<Place, Partition>,
    ready: VecDeque<Received>,
    delayed: Vec<(Instant, Received)>,
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
                busy: HashMap::new(),
            });
        }
    }

    /// Partitions taken away: forgotten with everything held of them (their
    /// next owner gets those messages from the committed offset). Returns
    /// the offsets to commit before they go.
    pub(crate) fn revoke(&mut self, places: impl IntoIterator<Item = Place>) -> Vec<(Place, i64)> {
        let mut commits = Vec::new();
        for place in places {
            if let Some(mut partition) = self.partitions.remove(&place) {
                if let Some(at) = partition.advance() {
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

    /// Every owned partition's offset to commit, where it moved forward.
    pub(crate) fn commits(&mut self) -> Vec<(Place, i64)> {
        self.partitions.iter_mut().filter_map(|(place, p)| p.advance().map(|at| (place.clone(), at))).collect()
    }

    /// How many messages are held and not started.
    pub(crate) fn held(&self) -> usize {
        let waiting: usize = self.partitions.values().flat_map(|p| p.busy.values()).map(VecDeque::len).sum();
        self.ready.len() + self.delayed.len() + waiting
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
        Received { message, generation: 0, retries: 0, message_id: None }
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
        assert_eq!(book.revoke([place(0)]), vec![(place(0), 5)]);
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
        assert_eq!(book.commits(), vec![]);
    }
}
