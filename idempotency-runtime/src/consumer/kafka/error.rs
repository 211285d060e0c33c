//! [`RunError`]: why a Kafka runner ended.

use std::fmt;

use rdkafka::error::KafkaError;
use tokio::task::JoinError;

/// Why [`Consumer::run`](super::Consumer::run) (or `run_with_id`) ended
/// with an error.
#[derive(Debug)]
#[non_exhaustive]
pub enum RunError {
    /// The Kafka client failed: the consumer or the producer could not be
    /// created, or the subscription was refused.
    Kafka(KafkaError),
    /// A task of the runner's own ended by a panic; `task` names it
    /// (`"poll"`: the task that polls the consumer, serving rebalances,
    /// commit results and the `on_event` hook). The runner stops as on
    /// shutdown: it commits what was settled (the rest comes back to the
    /// group's next owner of its partitions) and returns this, instead of
    /// waiting on a consumer nothing polls any more.
    Panicked {
        /// Which task.
        task: &'static str,
        /// The panic's message, when it was a string.
        panic: String,
    },
}

impl RunError {
    /// How the task `task` ended, which it never does on its own.
    pub(crate) fn ended(task: &'static str, joined: Result<(), JoinError>) -> RunError {
        let panic = match joined {
            Ok(()) => "ended".to_owned(),
            Err(e) if e.is_panic() => {
                let payload = e.into_panic();
                match payload.downcast::<String>() {
                    Ok(message) => *message,
                    Err(payload) => payload.downcast::<&str>().map(|m| (*m).to_owned()).unwrap_or_default(),
                }
            }
            Err(e) => e.to_string(),
        };
        RunError::Panicked { task, panic }
    }
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Kafka(e) => write!(f, "kafka: {e}"),
            RunError::Panicked { task, panic } => write!(f, "the kafka runner's {task} task panicked: {panic}"),
        }
    }
}

impl std::error::Error for RunError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RunError::Kafka(e) => Some(e),
            RunError::Panicked { .. } => None,
        }
    }
}

impl From<KafkaError> for RunError {
    fn from(e: KafkaError) -> Self {
        RunError::Kafka(e)
    }
}
