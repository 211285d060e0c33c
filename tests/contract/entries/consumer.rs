//! A Redis Streams consumer runner (the shared Redis, a stream of its own
//! per entry point): a call is one entry added to the stream, and its
//! answer the settlement the runner's `on_settle` hook reports, read with
//! what the handler produced. Its delays (retry, in progress, storage) and
//! its claim idle time are an hour, so an entry settled for later never
//! comes back within a cell: one entry, one delivery.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::Outcome;
use idempotency::redis_streams::{Action, Consumer as Runner, Reason, Settled};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use super::{Answer, EntryPoint, Produced, Shape};
use crate::backends::Store;
use crate::fns::BoxFuture;
use crate::script::{BOUND, Script};

/// Longer than any cell: what is settled for later stays pending.
const LATER: Duration = Duration::from_secs(3600);

/// What the hook told of one entry.
#[derive(Debug)]
struct Report {
    action: Action,
    outcome: Option<Outcome>,
    error: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct Message {
    key: String,
    amount: i64,
    /// Which script the body follows (not an argument of the fn).
    script: u64,
}

type Waiting = Arc<Mutex<HashMap<String, oneshot::Sender<Report>>>>;

pub struct Consumer<F: Store> {
    redis: redis::Client,
    stream: String,
    scripts: Arc<Mutex<HashMap<u64, Arc<Script>>>>,
    produced: Arc<Mutex<HashMap<String, Produced>>>,
    waiting: Waiting,
    next: AtomicU64,
    _stop: oneshot::Sender<()>,
    _shape: std::marker::PhantomData<F>,
}

impl<F: Store> Consumer<F> {
    /// A runner on a stream of its own, eight deliveries at a time.
    pub async fn start(shape: Shape<F>) -> Self {
        let redis = idempotency_testkit::redis_client().await.expect("the consumer's Redis answers");
        let stream = idempotency_testkit::unique("matrix-stream");
        let waiting = Waiting::default();
        let scripts: Arc<Mutex<HashMap<u64, Arc<Script>>>> = Arc::default();
        let produced: Arc<Mutex<HashMap<String, Produced>>> = Arc::default();
        let told = Arc::clone(&waiting);
        let runner = Runner::new(redis.clone(), stream.clone(), "matrix")
            .concurrency(8)
            .retry_delay(LATER)
            .in_progress_delay(LATER)
            .storage_delay(LATER)
            .claim_idle(LATER)
            .on_settle(move |settled: &Settled| {
                let Some(id) = &settled.message_id else { return };
                if let Some(tell) = told.lock().unwrap().remove(id) {
                    let _ = tell.send(Report {
                        action: settled.action,
                        outcome: settled.outcome,
                        error: settled.error.clone(),
                    });
                }
            });
        let (stop, stopped) = oneshot::channel::<()>();
        let handler = {
            let (scripts, produced) = (Arc::clone(&scripts), Arc::clone(&produced));
            move |id: String, message: Message| {
                let (shape, scripts, produced) = (shape.clone(), Arc::clone(&scripts), Arc::clone(&produced));
                async move {
                    let script = scripts.lock().unwrap()[&message.script].clone();
                    let result = shape.call(message.key, message.amount, &script).await;
                    produced.lock().unwrap().insert(id, Produced::of(&result));
                    result
                }
            }
        };
        tokio::spawn(runner.run_with_id(
            async move {
                let _ = stopped.await;
            },
            handler,
        ));
        Consumer {
            redis,
            stream,
            scripts,
            produced,
            waiting,
            next: AtomicU64::new(0),
            _stop: stop,
            _shape: std::marker::PhantomData,
        }
    }
}

/// The answer a settlement gives, with what the handler produced.
fn answer(report: &Report, produced: Option<Produced>) -> Answer {
    let replayed = report.outcome == Some(Outcome::Replayed);
    let finished = matches!(report.outcome, Some(Outcome::Executed | Outcome::Replayed));
    match (report.action, produced) {
        (Action::Ack, Some(Produced::Value(bytes))) if finished => Answer::Value { bytes, replayed },
        // The handler passed its call's recorded decline on: its final answer, acked once.
        (Action::AckRecorded, Some(Produced::Declined(bytes))) if finished => Answer::Declined { bytes, replayed },
        (Action::Requeue, _) if report.outcome == Some(Outcome::InProgress) => Answer::InProgress,
        (Action::DeadLetter(Reason::KeyReused), _) => Answer::KeyReused,
        // A decline the fn does not record is the body's own failure.
        (Action::Retry { .. }, Some(Produced::Failed(_) | Produced::Declined(_)))
            if report.outcome == Some(Outcome::Failed) =>
        {
            Answer::BodyFailed
        }
        (action, produced) => Answer::Other(format!(
            "settled {action:?} ({:?}, {:?}), produced {produced:?}",
            report.outcome, report.error
        )),
    }
}

impl<F: Store> EntryPoint for Consumer<F> {
    fn call(&self, key: &str, amount: i64, script: Arc<Script>) -> BoxFuture<'static, Answer> {
        let number = self.next.fetch_add(1, SeqCst);
        self.scripts.lock().unwrap().insert(number, script);
        let id = format!("{}-{number}", self.stream);
        let (tell, told) = oneshot::channel();
        self.waiting.lock().unwrap().insert(id.clone(), tell);
        let payload = serde_json::to_string(&Message { key: key.to_owned(), amount, script: number }).expect("JSON");
        let (redis, stream, produced) = (self.redis.clone(), self.stream.clone(), Arc::clone(&self.produced));
        Box::pin(async move {
            let mut conn = crate::gates::test_connection(&redis).await;
            let added: redis::RedisResult<String> = redis::cmd("XADD")
                .arg(&stream)
                .arg("*")
                .arg("message_id")
                .arg(&id)
                .arg("payload")
                .arg(&payload)
                .query_async(&mut conn)
                .await;
            added.expect("XADD");
            // A held first call settles once the clause lets it go, itself within the bound.
            let report = match tokio::time::timeout(2 * BOUND, told).await {
                Ok(Ok(report)) => report,
                _ => panic!("the entry {id} was never settled"),
            };
            let produced = produced.lock().unwrap().remove(&id);
            answer(&report, produced)
        })
    }
}

impl<F: Store> Drop for Consumer<F> {
    fn drop(&mut self) {
        // The runner stops with `_stop`; its stream goes too.
        let (redis, stream) = (self.redis.clone(), self.stream.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let mut conn = crate::gates::test_connection(&redis).await;
                let _: redis::RedisResult<i64> =
                    redis::cmd("DEL").arg(&stream).arg(format!("{stream}:dead")).query_async(&mut conn).await;
            });
        }
    }
}
