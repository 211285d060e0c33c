//! What the runner hands the job and reports: the slot, how each ended,
//! and why the runner stopped.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use jiff::Timestamp;

use crate::outcome::{Observed, Outcome};

/// One fire time of the schedule, handed to the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub(super) job: Arc<str>,
    pub(super) fire_time: Timestamp,
    /// Run late: due when the runner found it, not the one it waited for.
    pub(super) late: bool,
}

impl Slot {
    /// The job's name, as given to [`Runner::new`](super::Runner::new).
    pub fn job(&self) -> &str {
        &self.job
    }

    /// The instant the schedule meant.
    pub fn fire_time(&self) -> SystemTime {
        SystemTime::from(self.fire_time)
    }

    /// The fire time in whole seconds since the Unix epoch: a key for a
    /// schedule with second (or coarser) granularity.
    pub fn unix_secs(&self) -> i64 {
        self.fire_time.as_second()
    }

    /// Whether the slot runs late: it came due while the runner was not
    /// waiting for it (a catch-up).
    pub fn is_catch_up(&self) -> bool {
        self.late
    }
}

/// The fire time in UTC, RFC 3339 (`2026-05-01T03:00:00Z`).
impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.fire_time, f)
    }
}

/// How one slot ended on this instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SlotOutcome {
    /// This instance ran the job and its call recorded the slot.
    Executed,
    /// The slot was done already (by another instance, or by this one
    /// before a restart): its result was replayed.
    DoneElsewhere,
    /// This instance ran the job, and its call's answer was a declared
    /// business error, recorded (`record_errors`; a `steps` call's
    /// `Error::Permanent`): the slot is done, and whoever fires it again
    /// gets that answer replayed ([`DeclinedElsewhere`](SlotOutcome::DeclinedElsewhere)).
    Declined,
    /// The slot was done already, its answer a recorded business error,
    /// replayed: as [`DoneElsewhere`](SlotOutcome::DoneElsewhere), for a
    /// slot that [declined](SlotOutcome::Declined).
    DeclinedElsewhere,
    /// Another instance was running the slot (`Error::InProgress`).
    InProgressElsewhere,
    /// The job failed (or panicked, or its call was refused): nothing was
    /// recorded here. The runner does not retry it; a restart resuming
    /// before it runs it again, within the window.
    Failed,
    /// Shut down while the job ran, past the grace period: dropped,
    /// nothing recorded.
    Cancelled,
    /// Older than the catch-up window when the runner came to it: not run.
    Skipped,
}

impl SlotOutcome {
    /// The name in logs, spans and metrics: `executed`, `done_elsewhere`,
    /// `declined`, `declined_elsewhere`, `in_progress_elsewhere`, `failed`,
    /// `cancelled` or `skipped`.
    pub fn as_str(self) -> &'static str {
        match self {
            SlotOutcome::Executed => "executed",
            SlotOutcome::DoneElsewhere => "done_elsewhere",
            SlotOutcome::Declined => "declined",
            SlotOutcome::DeclinedElsewhere => "declined_elsewhere",
            SlotOutcome::InProgressElsewhere => "in_progress_elsewhere",
            SlotOutcome::Failed => "failed",
            SlotOutcome::Cancelled => "cancelled",
            SlotOutcome::Skipped => "skipped",
        }
    }

    /// How a job's run ended: by the outcome of its `#[idempotent]` call
    /// when it made one (a recorded answer is the slot's, whether the job
    /// passed it on or dealt with it), else by its result.
    pub(super) fn of(ok: bool, call: Option<Observed>) -> SlotOutcome {
        let recorded = call.is_some_and(|call| call.recorded_error);
        match (ok, call.map(|call| call.outcome)) {
            (_, Some(Outcome::Executed)) if recorded => SlotOutcome::Declined,
            (_, Some(Outcome::Replayed)) if recorded => SlotOutcome::DeclinedElsewhere,
            (_, Some(Outcome::InProgress)) => SlotOutcome::InProgressElsewhere,
            (true, Some(Outcome::Executed) | None) => SlotOutcome::Executed,
            (true, Some(Outcome::Replayed)) => SlotOutcome::DoneElsewhere,
            _ => SlotOutcome::Failed,
        }
    }
}

/// What the runner did with one slot; passed to [`Runner::on_slot`](super::Runner::on_slot).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SlotReport {
    /// The slot.
    pub slot: Slot,
    /// How it ended here.
    pub outcome: SlotOutcome,
    /// The outcome of the last `#[idempotent]` call the job made, if it ran.
    pub call: Option<Outcome>,
    /// The job's error or panic, as text.
    pub error: Option<String>,
}

/// Why [`Runner::run`](super::Runner::run) returned, and where a restart resumes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stopped {
    /// The last slot settled (run, replayed, failed or skipped; not a
    /// cancelled one): pass it to [`Runner::resume_after`](super::Runner::resume_after) on the next start.
    pub last_slot: Option<SystemTime>,
    /// `true` when the schedule has no slot left (a pattern with a year that
    /// passed); `false` when shut down.
    pub schedule_ended: bool,
}
