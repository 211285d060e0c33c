//! A cron runner (feature `cron`): fires an `#[idempotent]` job once per
//! slot of a cron schedule, on every instance, and lets the record decide
//! which instance runs it.
//!
//! ```ignore
//! #[idempotent(key = "settle_<slot>", ttl = "7d", biz = "settle")]
//! async fn settle(idem: &Idem<MySql>, tx: &mut Transaction<'_, MySql>, slot: i64)
//!     -> Result<Settlement, JobError>
//! { /* ... */ }
//!
//! idempotency::cron::Runner::new(&idem, "settle", "0 */5 * * * *")?   // every 5 minutes, at second 0
//!     .time_zone("Europe/Paris")?
//!     .catch_up(Duration::from_secs(15 * 60))
//!     .jitter(Duration::from_millis(500))
//!     .run(tokio::signal::ctrl_c(), move |slot| {
//!         let idem = idem.clone();
//!         async move { settle(&idem, slot.unix_secs()).await }
//!     })
//!     .await;
//! ```
//!
//! A *slot* is a fire time the schedule meant, not the moment an instance
//! woke up: key the job by it, and every instance firing that slot (and a
//! late catch-up of it) shares one key, so the slot runs once.
//!
//! - The slot the runner waited for runs when it comes (plus a random
//!   [`jitter`](Runner::jitter)).
//! - Slots that came due while the runner was not waiting for them (it was
//!   starting, or busy with a job that overran) run late, oldest first, if
//!   they lie within the [catch-up window](Runner::catch_up); older ones are
//!   reported [`Skipped`](SlotOutcome::Skipped) and never run. A fresh
//!   runner looks back over the window only; one given
//!   [`resume_after`](Runner::resume_after) (the last slot of its previous
//!   run, [`Stopped::last_slot`]) also reports every slot after that one and
//!   before the window as skipped.
//! - On shutdown a running job gets [`shutdown_grace`](Runner::shutdown_grace)
//!   to finish; past it the job is dropped (its transaction rolls back and
//!   its claim is released: nothing is recorded) and the slot is reported
//!   [`Cancelled`](SlotOutcome::Cancelled). [`Stopped::last_slot`] is then the
//!   slot before it, so a restart that resumes from there runs it (within the
//!   window) and nothing twice.
//!
//! Each slot runs once within the window **whatever the job's ttl**: every
//! record the job's calls write while the runner awaits it lives at least
//! the window plus the jitter plus a minute, even when its ttl is shorter
//! (a ttl of 2 s under an 8 s window would otherwise let the record expire
//! before the catch-up, which then ran the slot again). Longer ttls are
//! untouched; work the job spawns into tasks of its own is not covered.
//!
//! The runner fires by the clock of the engine it is built from: the
//! database's, the one the records' expiry is judged by, so an instance
//! whose own clock is off neither runs a finished slot again after its
//! record expired nor runs a slot early. [`host_clock`](Runner::host_clock)
//! fires by this host's clock instead, and [`clock`](Runner::clock) by any
//! [`Clock`] (a test's, which moves only when the test moves it). Every
//! wait of the runner (the next slot, the jitter, the shutdown grace) is a
//! wait on that clock.
//!
//! Each slot is reported in the log, in the tracing span `idem_cron` (fields
//! `job`, `slot`, `outcome`; the job's own `idem` span is its child), to the
//! [`on_slot`](Runner::on_slot) hook, and as `idem_cron_slots_total` with
//! the feature `metrics`. Slots run one at a time, in order.

use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::pin::pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use croner::Cron;
use croner::parser::CronParser;
use jiff::tz::{Offset, TimeZone};
use jiff::{SignedDuration, Timestamp};
use tracing::Instrument;

use crate::outcome::observe_call;
use crate::retention;

mod clock;
mod slot;

pub use clock::{Clock, ClockFuture};
pub use slot::{Slot, SlotOutcome, SlotReport, Stopped};

/// How many slots older than the window are reported one by one after a
/// long stop; past that the runner jumps to the window (a per-second job
/// stopped for a day would otherwise enumerate 86 400 slots).
const MAX_SKIPPED_REPORTED: usize = 10_000;

/// What a slot's record must outlive beyond the window and the jitter: the
/// time from a runner's decision to run a slot to its call's read of the
/// record (a pool's acquire wait is 30 s by default, a lock wait adds to
/// it), and the skew between the clock that stamped the record and the one
/// that reads it. A minute of extra rows per job costs next to nothing.
const RECORD_MARGIN: Duration = Duration::from_secs(60);

/// A schedule or time zone the runner cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ScheduleError(String);

type Hook = Arc<dyn Fn(&SlotReport) + Send + Sync>;

/// Runs a job once per slot of a cron schedule; see the [module docs](self).
#[must_use]
pub struct Runner {
    job: Arc<str>,
    schedule: Cron,
    zone: TimeZone,
    catch_up: Duration,
    jitter: Duration,
    grace: Duration,
    resume_after: Option<Timestamp>,
    on_slot: Option<Hook>,
    /// What the runner reads the time from and waits on.
    clock: Arc<dyn Clock>,
    /// Which clock that is, for `Debug`: `database`, `host` or `custom`.
    clock_name: &'static str,
}

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field("job", &self.job)
            .field("schedule", &self.schedule.as_str())
            .field("zone", &self.zone.iana_name().unwrap_or("fixed"))
            .field("catch_up", &self.catch_up)
            .field("jitter", &self.jitter)
            .field("grace", &self.grace)
            .field("clock", &self.clock_name)
            .finish_non_exhaustive()
    }
}

impl Runner {
    /// A runner of `idem`'s jobs for `job` (its name in logs, spans and
    /// metrics) on the cron `expression`: five fields (minute granularity)
    /// or six (seconds first), with `L`, `W`, `#`, names and `@daily`-style
    /// nicknames as `croner` reads them. UTC unless
    /// [`time_zone`](Runner::time_zone) says otherwise; no catch-up, no
    /// jitter, 30 s of grace at shutdown.
    ///
    /// It fires slots by `idem`'s clock: the database's, the one the
    /// records' expiry is judged by (the engine reads it once and every
    /// minute, and counts on in between: no round trip per slot). An
    /// instance whose own clock is behind by more than the records' life
    /// (at least the window, the jitter and a minute) would otherwise fire
    /// a slot after its record expired and run it again; one ahead would
    /// run slots before their time.
    pub fn new<DB: crate::Backend>(
        idem: &crate::Idem<DB>,
        job: impl Into<String>,
        expression: &str,
    ) -> Result<Self, ScheduleError> {
        Runner::with_clock(Arc::new(clock::DatabaseClock(idem.clone())), "database", job, expression)
    }

    /// The runner on `clock` (named `clock_name` in `Debug`).
    fn with_clock(
        clock: Arc<dyn Clock>,
        clock_name: &'static str,
        job: impl Into<String>,
        expression: &str,
    ) -> Result<Self, ScheduleError> {
        let schedule = CronParser::new()
            .parse(expression)
            .map_err(|e| ScheduleError(format!("cron expression `{expression}`: {e}")))?;
        Ok(Runner {
            job: Arc::from(job.into()),
            schedule,
            zone: TimeZone::UTC,
            catch_up: Duration::ZERO,
            jitter: Duration::ZERO,
            grace: Duration::from_secs(30),
            resume_after: None,
            on_slot: None,
            clock,
            clock_name,
        })
    }

    /// Fires slots by this host's clock instead of the database's. Only
    /// where every instance's clock is kept close to the database's (NTP):
    /// an instance behind by more than the records' life runs finished
    /// slots again, one ahead runs slots early.
    pub fn host_clock(mut self) -> Self {
        (self.clock, self.clock_name) = (Arc::new(clock::HostClock), "host");
        self
    }

    /// Fires slots by `clock`: reads the time from it, and waits on it for
    /// every slot, the jitter and the shutdown grace. For tests, a clock
    /// that moves only when the test moves it.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        (self.clock, self.clock_name) = (Arc::new(clock), "custom");
        self
    }

    /// The time zone the expression is read in: `UTC`, a fixed offset
    /// (`+05:30`, `-08:00`), or a name from the system's time zone database
    /// (`Europe/Paris`; daylight saving time as `croner` handles it: a
    /// skipped wall-clock time does not fire, a repeated one fires once).
    pub fn time_zone(mut self, zone: &str) -> Result<Self, ScheduleError> {
        self.zone = parse_zone(zone)?;
        Ok(self)
    }

    /// How late a slot may still run when the runner finds it already due
    /// (at start, or after a job that overran). Default zero: such slots are
    /// skipped. Only for jobs that are right to run late.
    ///
    /// Within the window a slot runs once whatever the job's ttl: the
    /// records the job's calls write (in the future the runner awaits, not
    /// in tasks it spawns) live at least the window plus the
    /// [`jitter`](Runner::jitter) plus one minute, so a catch-up finds a
    /// finished slot's record rather than an expired one.
    pub fn catch_up(mut self, window: Duration) -> Self {
        self.catch_up = window;
        self
    }

    /// Waits a random time below `max` before the first catch-up and before
    /// each slot, so instances do not all hit the database at once.
    pub fn jitter(mut self, max: Duration) -> Self {
        self.jitter = max;
        self
    }

    /// How long a running job may go on after shutdown before it is dropped,
    /// on the runner's clock. Default 30 s.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// The last slot the previous run of this job on this instance settled
    /// ([`Stopped::last_slot`], kept by the application across restarts):
    /// the slots after it are caught up within the window and reported
    /// skipped before it.
    pub fn resume_after(mut self, last_slot: SystemTime) -> Self {
        self.resume_after = Timestamp::try_from(last_slot).ok();
        self
    }

    /// Called after each slot is settled (for logs, metrics, tests).
    pub fn on_slot(mut self, hook: impl Fn(&SlotReport) + Send + Sync + 'static) -> Self {
        self.on_slot = Some(Arc::new(hook));
        self
    }

    /// Runs `job` for each slot until `shutdown` resolves (or the schedule
    /// ends). Each run is its own task: a panic is reported as a failure.
    pub async fn run<F, Fut, R, E, S>(self, shutdown: S, job: F) -> Stopped
    where
        F: Fn(Slot) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
        R: Send + 'static,
        E: fmt::Debug + Send + 'static,
        S: Future,
    {
        let mut shutdown = pin!(shutdown);
        let mut cursor = self.resume_after;
        let stopped = |cursor: Option<Timestamp>, schedule_ended| Stopped {
            last_slot: cursor.map(SystemTime::from),
            schedule_ended,
        };
        let record_life = self.record_life();
        tracing::info!(
            job = %self.job,
            schedule = self.schedule.as_str(),
            records_kept_at_least_ms = record_life.as_millis(),
            "idem cron runner started"
        );

        let first = plus(self.now().await, random_below(self.jitter));
        if !self.pause_until(first, shutdown.as_mut()).await {
            return stopped(cursor, false);
        }
        // A fresh runner looks back over the window only.
        let started = self.now().await;
        let mut from = cursor.unwrap_or_else(|| minus(started, self.catch_up));
        let mut inclusive = cursor.is_none();
        let mut skipped_in_a_row = 0;
        // The slot the runner slept until: it runs however late it woke.
        let mut waited_for: Option<Timestamp> = None;

        loop {
            let Some(next) = self.next_after(from, inclusive) else {
                tracing::info!(job = %self.job, "idem cron schedule has no slot left");
                return stopped(cursor, true);
            };
            inclusive = false;
            let now = self.now().await;
            if next > now {
                if !self.pause_until(plus(next, random_below(self.jitter)), shutdown.as_mut()).await {
                    return stopped(cursor, false);
                }
                waited_for = Some(next);
                continue; // `from` unchanged: `next` comes again, now due
            }
            let slot = Slot { job: Arc::clone(&self.job), fire_time: next, late: waited_for != Some(next) };
            if slot.late && next < minus(now, self.catch_up) {
                skipped_in_a_row += 1;
                if skipped_in_a_row > MAX_SKIPPED_REPORTED {
                    tracing::warn!(job = %self.job, "more slots skipped than reported; jumping to the catch-up window");
                    from = minus(now, self.catch_up);
                    inclusive = true;
                    continue;
                }
                self.report(SlotReport { slot, outcome: SlotOutcome::Skipped, call: None, error: None });
            } else {
                skipped_in_a_row = 0;
                match self.fire(slot, &job, record_life, shutdown.as_mut()).await {
                    Fired::Settled => {}
                    Fired::SettledStopping => return stopped(Some(next), false),
                    Fired::Cancelled => return stopped(cursor, false),
                }
            }
            cursor = Some(next);
            from = next;
        }
    }

    /// Now on the runner's clock.
    async fn now(&self) -> Timestamp {
        let now = self.clock.now().await;
        // Out of jiff's range (after 9999): no slot to fire there anyway.
        Timestamp::try_from(now).unwrap_or(Timestamp::MAX)
    }

    /// Sleeps on the runner's clock until it reads `at`.
    async fn sleep_until(&self, at: Timestamp) {
        self.clock.sleep_until(SystemTime::from(at)).await;
    }

    /// How long a slot's record must live at least: until no runner can
    /// still decide to run the slot. A slot runs late only while its fire
    /// time is within the window, on time at most a jitter after it, and its
    /// record is written after it: so the window and the jitter, counted
    /// from the record, plus the margin. (A period of the schedule adds
    /// nothing: the window is counted from the slot's own fire time.)
    fn record_life(&self) -> Duration {
        self.catch_up.saturating_add(self.jitter).saturating_add(RECORD_MARGIN)
    }

    /// The first slot after `from` (or at it, when `inclusive`).
    fn next_after(&self, from: Timestamp, inclusive: bool) -> Option<Timestamp> {
        let mut zoned = from.to_zoned(self.zone.clone());
        let mut inclusive = inclusive;
        loop {
            match self.schedule.find_next_occurrence(&zoned, inclusive) {
                // `croner` works in whole seconds: from 10:00:00.5, "at or
                // after" may answer 10:00:00.
                Ok(next) if next.timestamp() < from => (zoned, inclusive) = (next, false),
                Ok(next) => return Some(next.timestamp()),
                Err(e) => {
                    tracing::debug!(job = %self.job, error = %e, "no next slot");
                    return None;
                }
            }
        }
    }

    /// Sleeps until `at`; `false` if `shutdown` came first.
    async fn pause_until<S: Future>(&self, at: Timestamp, shutdown: std::pin::Pin<&mut S>) -> bool {
        tokio::select! {
            biased;
            _ = shutdown => {
                tracing::info!(job = %self.job, "idem cron runner stopping");
                false
            }
            () = self.sleep_until(at) => true,
        }
    }

    /// Runs the job for `slot` in its own task, its records living at least
    /// `record_life`, and reports how it ended.
    async fn fire<F, Fut, R, E, S>(
        &self,
        slot: Slot,
        job: &F,
        record_life: Duration,
        mut shutdown: std::pin::Pin<&mut S>,
    ) -> Fired
    where
        F: Fn(Slot) -> Fut,
        Fut: Future<Output = Result<R, E>> + Send + 'static,
        R: Send + 'static,
        E: fmt::Debug + Send + 'static,
        S: Future,
    {
        let span = tracing::info_span!(
            "idem_cron",
            job = %self.job,
            slot = %slot,
            catch_up = slot.late,
            outcome = tracing::field::Empty
        );
        let run = retention::keep_records_for(record_life, observe_call(job(slot.clone()))).instrument(span.clone());
        let mut task = tokio::spawn(run);
        let (joined, settled) = tokio::select! {
            joined = &mut task => (Some(joined), Fired::Settled),
            _ = shutdown.as_mut() => {
                tracing::info!(job = %self.job, slot = %slot, "idem cron runner stopping; waiting for the running job");
                let grace_ends = plus(self.now().await, self.grace);
                let joined = tokio::select! {
                    biased;
                    joined = &mut task => Some(joined),
                    () = self.sleep_until(grace_ends) => None,
                };
                (joined, Fired::SettledStopping)
            }
        };
        let (outcome, call, error, fired) = match joined {
            Some(Ok((Ok(_), call))) => (SlotOutcome::of(true, call), call.map(|c| c.outcome), None, settled),
            Some(Ok((Err(e), call))) => {
                (SlotOutcome::of(false, call), call.map(|c| c.outcome), Some(format!("{e:?}")), settled)
            }
            Some(Err(e)) => (SlotOutcome::Failed, None, Some(format!("job panicked: {e}")), settled),
            None => {
                task.abort();
                // Dropped inside the task: its transaction rolls back before we go on.
                let _ = task.await;
                (SlotOutcome::Cancelled, None, None, Fired::Cancelled)
            }
        };
        span.record("outcome", outcome.as_str());
        self.report(SlotReport { slot, outcome, call, error });
        fired
    }

    fn report(&self, report: SlotReport) {
        let (job, slot, outcome) = (&*self.job, &report.slot, report.outcome.as_str());
        match (&report.outcome, &report.error) {
            (SlotOutcome::Failed | SlotOutcome::Cancelled | SlotOutcome::Skipped, error) => {
                tracing::warn!(job, %slot, outcome, error = error.as_deref(), "idem cron slot");
            }
            // Done: the job's answer is its recorded business error.
            (SlotOutcome::Declined | SlotOutcome::DeclinedElsewhere, error) => {
                tracing::info!(job, %slot, outcome, catch_up = slot.late, error = error.as_deref(), "idem cron slot");
            }
            _ => tracing::info!(job, %slot, outcome, catch_up = slot.late, "idem cron slot"),
        }
        crate::metrics::cron_settled(job, report.outcome.as_str());
        if let Some(hook) = &self.on_slot {
            hook(&report);
        }
    }
}

/// Whether the runner goes on after a slot.
enum Fired {
    /// Settled; go on.
    Settled,
    /// Settled after shutdown came (within the grace): stop.
    SettledStopping,
    /// Dropped past the grace: stop, the slot unsettled.
    Cancelled,
}

/// `UTC`, `Z`, `±HH:MM` (or `±HHMM`, `±HH`), or an IANA name.
fn parse_zone(zone: &str) -> Result<TimeZone, ScheduleError> {
    if zone.eq_ignore_ascii_case("utc") || zone == "Z" {
        return Ok(TimeZone::UTC);
    }
    if let Some(sign) = zone.strip_prefix('+').map(|r| (1, r)).or_else(|| zone.strip_prefix('-').map(|r| (-1, r))) {
        let (sign, rest) = sign;
        let digits: String = rest.chars().filter(|c| *c != ':').collect();
        let valid = matches!(digits.len(), 2 | 4) && digits.bytes().all(|b| b.is_ascii_digit()) && rest.len() <= 5;
        let parsed = valid.then(|| {
            let hours: i32 = digits[..2].parse().ok()?;
            let minutes: i32 = if digits.len() == 4 { digits[2..].parse().ok()? } else { 0 };
            (minutes < 60).then_some(sign * (hours * 3600 + minutes * 60))
        });
        return match parsed.flatten().and_then(|secs| Offset::from_seconds(secs).ok()) {
            Some(offset) => Ok(TimeZone::fixed(offset)),
            None => Err(ScheduleError(format!("time zone `{zone}`: expected an offset such as +05:30"))),
        };
    }
    TimeZone::get(zone).map_err(|e| ScheduleError(format!("time zone `{zone}`: {e}")))
}

/// `t + d`, saturating at the latest timestamp.
fn plus(t: Timestamp, d: Duration) -> Timestamp {
    SignedDuration::try_from(d).ok().and_then(|d| t.checked_add(d).ok()).unwrap_or(Timestamp::MAX)
}

/// `t - d`, saturating at the earliest timestamp.
fn minus(t: Timestamp, d: Duration) -> Timestamp {
    SignedDuration::try_from(d).ok().and_then(|d| t.checked_sub(d).ok()).unwrap_or(Timestamp::MIN)
}

/// A random duration in `[0, max)`; zero when `max` is.
fn random_below(max: Duration) -> Duration {
    let nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
    if nanos == 0 {
        return Duration::ZERO;
    }
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(crate::clock::now_nanos());
    Duration::from_nanos(hasher.finish() % nanos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::{Observed, Outcome};

    /// A runner on this host's clock (the engine's is the default).
    fn runner(expression: &str) -> Result<Runner, ScheduleError> {
        Runner::with_clock(Arc::new(clock::HostClock), "host", "j", expression)
    }

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).unwrap()
    }

    #[test]
    fn seconds_are_optional_and_zones_are_read() {
        let every_minute = runner("*/1 * * * *").unwrap();
        // 2026-03-29T00:59:30Z: the next minute is 01:00:00Z.
        assert_eq!(every_minute.next_after(at(1_774_745_970), false), Some(at(1_774_746_000)));
        let every_second = runner("* * * * * *").unwrap();
        assert_eq!(every_second.next_after(at(100), false), Some(at(101)));
        assert_eq!(every_second.next_after(at(100), true), Some(at(100)));
        let half_past = at(100).checked_add(SignedDuration::from_millis(500)).unwrap();
        assert_eq!(every_second.next_after(half_past, true), Some(at(101)), "never before `from`");
        assert_eq!(every_second.next_after(half_past, false), Some(at(101)));

        // 03:00 every day in Paris on 2026-01-15 (UTC+1) is 02:00Z.
        let paris = runner("0 0 3 * * *").unwrap().time_zone("Europe/Paris").unwrap();
        let jan_15 = Timestamp::from_second(1_768_435_200).unwrap(); // 2026-01-15T00:00:00Z
        assert_eq!(paris.next_after(jan_15, false).unwrap().to_string(), "2026-01-15T02:00:00Z");
        let fixed = runner("0 0 3 * * *").unwrap().time_zone("+05:30").unwrap();
        assert_eq!(fixed.next_after(jan_15, false).unwrap().to_string(), "2026-01-15T21:30:00Z");
        let utc = runner("0 0 3 * * *").unwrap().time_zone("UTC").unwrap();
        assert_eq!(utc.next_after(jan_15, false).unwrap().to_string(), "2026-01-15T03:00:00Z");
    }

    #[test]
    fn bad_expressions_and_zones_are_refused() {
        assert!(runner("61 * * * *").is_err());
        assert!(runner("").is_err());
        for zone in ["Mars/Olympus", "+5:3", "+26:00", "+05:60", "+", "-1:00:00"] {
            assert!(runner("* * * * *").unwrap().time_zone(zone).is_err(), "{zone}");
        }
        assert!(runner("* * * * *").unwrap().time_zone("-08:00").is_ok());
    }

    #[test]
    fn an_outcome_decides_before_the_result() {
        use SlotOutcome::*;
        let of = |ok, call: Option<Outcome>| SlotOutcome::of(ok, call.map(Observed::from));
        assert_eq!(of(true, Some(Outcome::Executed)), Executed);
        assert_eq!(of(true, None), Executed);
        assert_eq!(of(true, Some(Outcome::Replayed)), DoneElsewhere);
        assert_eq!(of(false, Some(Outcome::InProgress)), InProgressElsewhere);
        assert_eq!(of(true, Some(Outcome::InProgress)), InProgressElsewhere);
        assert_eq!(of(false, Some(Outcome::Executed)), Failed);
        assert_eq!(of(false, None), Failed);
        assert_eq!(of(true, Some(Outcome::KeyReused)), Failed);
    }

    /// Regression: a job passing on its call's recorded business error was
    /// reported `Failed`, as if the slot were still to do.
    #[test]
    fn a_recorded_answer_is_a_declined_slot() {
        use SlotOutcome::*;
        let recorded = |outcome| Some(Observed { outcome, recorded_error: true });
        for ok in [false, true] {
            assert_eq!(SlotOutcome::of(ok, recorded(Outcome::Executed)), Declined);
            assert_eq!(SlotOutcome::of(ok, recorded(Outcome::Replayed)), DeclinedElsewhere);
        }
    }

    #[test]
    fn jitter_stays_below_its_bound() {
        assert_eq!(random_below(Duration::ZERO), Duration::ZERO);
        assert!((0..1000).all(|_| random_below(Duration::from_millis(5)) < Duration::from_millis(5)));
    }
}
