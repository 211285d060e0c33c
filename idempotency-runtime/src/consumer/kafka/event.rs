//! What a Kafka runner tells of its own work besides settlements
//! ([`Consumer::on_event`](super::Consumer::on_event)): partitions assigned
//! and revoked, commits confirmed or failed, fetching paused and resumed.
//! For dashboards and alerts; the runner's tests wait for these instead of
//! for time to pass.

use std::fmt;
use std::sync::Arc;

/// One thing the runner did; see [`Consumer::on_event`](super::Consumer::on_event).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// Partitions handed to this consumer: (topic, partition) pairs.
    Assigned(Vec<(String, i32)>),
    /// Partitions taken away. What was settled of them was committed first,
    /// unless `lost`: the group moved on without this consumer (its session
    /// timed out), and a commit of a former member could move the group's
    /// offset back, so nothing is committed.
    Revoked {
        /// (topic, partition) pairs.
        partitions: Vec<(String, i32)>,
        /// Whether librdkafka reported the assignment lost.
        lost: bool,
    },
    /// Fetching paused: the runner holds `held` messages that have not
    /// started (ready, behind an earlier message of their key, or waiting
    /// out a delay or a retry), four per slot or more.
    FetchPaused {
        /// Messages held and not running.
        held: usize,
    },
    /// Fetching resumed: the runner holds two per slot or fewer.
    FetchResumed {
        /// Messages held and not running.
        held: usize,
    },
    /// The broker confirmed a partition's committed offset.
    Committed {
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
        /// Where the group resumes.
        offset: i64,
    },
    /// A commit failed. It is sent again with the partition's next
    /// settlement, and at the latest when the partition is revoked or the
    /// runner stops (those commits wait for the broker's answer).
    CommitFailed {
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
        /// The offset that was not committed.
        offset: i64,
        /// Why, as librdkafka says it.
        error: String,
    },
}

/// The `on_event` hook.
#[derive(Clone)]
pub(crate) struct Hook(pub(crate) Arc<dyn Fn(&Event) + Send + Sync>);

impl fmt::Debug for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("on_event hook")
    }
}
