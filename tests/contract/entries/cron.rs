//! The cron runner on a manual clock, a job keyed by its slot: a call is a
//! runner (an instance) firing the one slot the clock reads, its answer
//! the `SlotReport` the `on_slot` hook gets, read with what the job
//! produced. Calls of one key fire the same slot, so they are the same
//! slot on several instances (or again after a restart).

use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use idempotency::Outcome;
use idempotency::cron::{Runner, Slot, SlotOutcome, SlotReport};
use idempotency_testkit::ManualClock;
use tokio::sync::oneshot;

use super::{Answer, EntryPoint, Produced, Shape};
use crate::backends::Store;
use crate::fns::BoxFuture;
use crate::script::{BOUND, Script};

/// The slot every call fires: 2030-01-01T00:00:00Z, one of every second's.
const SLOT_SECS: u64 = 1_893_456_000;

pub struct Cron<F: Store>(pub Shape<F>);

/// The answer a slot's report gives, with what the job produced.
fn answer(report: &SlotReport, produced: Option<Produced>) -> Answer {
    match (report.outcome, produced) {
        (SlotOutcome::Executed, Some(Produced::Value(bytes))) => Answer::Value { bytes, replayed: false },
        (SlotOutcome::DoneElsewhere, Some(Produced::Value(bytes))) => Answer::Value { bytes, replayed: true },
        (SlotOutcome::Declined, Some(Produced::Declined(bytes))) => Answer::Declined { bytes, replayed: false },
        (SlotOutcome::DeclinedElsewhere, Some(Produced::Declined(bytes))) => Answer::Declined { bytes, replayed: true },
        (SlotOutcome::InProgressElsewhere, _) => Answer::InProgress,
        (SlotOutcome::Failed, _) if report.call == Some(Outcome::KeyReused) => Answer::KeyReused,
        // A decline the fn does not record is the body's own failure.
        (SlotOutcome::Failed, Some(Produced::Failed(_) | Produced::Declined(_)))
            if report.call == Some(Outcome::Failed) =>
        {
            Answer::BodyFailed
        }
        (outcome, produced) => Answer::Other(format!(
            "slot {outcome:?} (call {:?}, {:?}), produced {produced:?}",
            report.call, report.error
        )),
    }
}

impl<F: Store> EntryPoint for Cron<F> {
    fn call(&self, key: &str, amount: i64, script: Arc<Script>) -> BoxFuture<'static, Answer> {
        let (shape, key) = (self.0.clone(), key.to_owned());
        Box::pin(async move {
            let clock = ManualClock::new(UNIX_EPOCH + Duration::from_secs(SLOT_SECS));
            let (report, reported) = oneshot::channel::<SlotReport>();
            let report = Mutex::new(Some(report));
            let runner = Runner::new(&shape.idem, "matrix", "* * * * * *").expect("a schedule").clock(clock).on_slot(
                move |slot| {
                    if let Some(report) = report.lock().unwrap().take() {
                        let _ = report.send(slot.clone());
                    }
                },
            );
            let produced = Arc::new(Mutex::new(None));
            let job = {
                let produced = Arc::clone(&produced);
                move |slot: Slot| {
                    let (shape, script, produced) = (shape.clone(), Arc::clone(&script), Arc::clone(&produced));
                    let key = format!("{key}.{}", slot.unix_secs());
                    async move {
                        let result = shape.call(key, amount, &script).await;
                        *produced.lock().unwrap() = Some(Produced::of(&result));
                        result
                    }
                }
            };
            let (stop, stopped) = oneshot::channel::<()>();
            let running = tokio::spawn(runner.run(
                async move {
                    let _ = stopped.await;
                },
                job,
            ));
            // A held first call's slot settles once the clause lets it go, itself within the bound.
            let report = match tokio::time::timeout(2 * BOUND, reported).await {
                Ok(Ok(report)) => report,
                _ => panic!("the slot was never settled"),
            };
            let _ = stop.send(());
            running.await.expect("the runner stops");
            let produced = produced.lock().unwrap().take();
            answer(&report, produced)
        })
    }

    fn record_key(&self, key: &str) -> String {
        format!("{key}.{SLOT_SECS}")
    }
}
