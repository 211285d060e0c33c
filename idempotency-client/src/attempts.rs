//! The attempts of one logical request, whatever carries them: send, judge
//! the answer, wait, send again, within the bounds of [`Retries`]. Each
//! transport (reqwest's middleware, the tonic layer) implements
//! [`Transport`]; the loop and its stops are written once, here.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::retries::{Jitter, Retries};
use crate::verdict::Verdict;

/// Why the answer handed back is the last one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stop {
    /// The answer is final: a success, a replay, or a refusal that asking
    /// again would meet again (400, 422, a 500 without `Retry-After`, ...).
    Final,
    /// Asking again could help, but the attempts allowed were all made.
    Attempts,
    /// Asking again could help, but the time allowed ran out (or the next
    /// wait would have ended past it).
    Time,
    /// The server asked to wait this long, more than the `Retry-After` the
    /// policy honours: its answer is handed back rather than asked sooner.
    RetryAfterTooLong(Duration),
    /// The request's body is a stream, which cannot be sent twice: it was
    /// sent once, and its answer (or failure) is handed back as it is.
    NotResendable,
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stop::Final => f.write_str("the answer is final"),
            Stop::Attempts => f.write_str("no attempts left"),
            Stop::Time => f.write_str("no time left"),
            Stop::RetryAfterTooLong(after) => {
                write!(f, "the server asked to wait {} s, longer than allowed", after.as_secs())
            }
            Stop::NotResendable => f.write_str("the body is a stream, which cannot be sent again"),
        }
    }
}

/// A retry about to be made, as told to the hook of
/// [`IdempotencyMiddleware::on_retry`](crate::IdempotencyMiddleware::on_retry)
/// (and the gRPC layer's): to log it or count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Retrying<'a> {
    /// The key the next attempt carries, as every attempt did.
    pub key: &'a str,
    /// The attempt that is retried (1 for the first).
    pub attempt: u32,
    /// What it was answered: the HTTP status or the gRPC code; `None` when
    /// it got no answer (refused, cut, timed out).
    pub answered: Option<u16>,
    /// How long until the next attempt.
    pub wait: Duration,
}

/// The hook told of each retry.
pub(crate) type OnRetry = std::sync::Arc<dyn Fn(&Retrying<'_>) + Send + Sync>;

/// How one logical request went: the attempts made and why they stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tally {
    pub(crate) attempts: u32,
    pub(crate) stop: Stop,
}

/// What the last attempt came back with.
pub(crate) enum Answer<R, E> {
    Response(R),
    Failed(E),
    /// Abandoned after this long (the attempt's timeout or the total's end).
    TimedOut(Duration),
}

/// One transport's part of the loop.
pub(crate) trait Transport {
    type Response;
    type Error;

    /// Sends the request once more (a copy while it can be copied).
    fn attempt(&mut self) -> impl Future<Output = Result<Self::Response, Self::Error>> + Send + '_;

    /// Whether another attempt can be made at all (a stream cannot).
    fn can_resend(&self) -> bool;

    fn judge(&self, response: &Self::Response) -> Verdict;

    /// The status (or code) a response answered, for [`Retrying`].
    fn answered(&self, response: &Self::Response) -> Option<u16>;

    /// A failure to get an answer: the request may or may not have run.
    fn judge_error(&self, error: &Self::Error) -> Verdict;

    /// Lets go of an answer that will be asked again.
    fn discard(&mut self, response: Self::Response) -> impl Future<Output = ()> + Send + '_;
}

/// Makes the attempts of the request keyed `key`, telling `on_retry` of
/// each retry; returns the last answer and how they went.
pub(crate) async fn run<T: Transport>(
    retries: &Retries,
    transport: &mut T,
    key: &str,
    on_retry: Option<&OnRetry>,
) -> (Answer<T::Response, T::Error>, Tally) {
    let deadline = Instant::now() + retries.total;
    // Seeded at the first retry: most requests never need one.
    let mut jitter: Option<Jitter> = None;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let bound = retries.attempt_timeout.map_or(deadline, |t| deadline.min(Instant::now() + t));
        let answer = match tokio::time::timeout_at(bound, transport.attempt()).await {
            Ok(Ok(response)) => Answer::Response(response),
            Ok(Err(error)) => Answer::Failed(error),
            Err(_) => Answer::TimedOut(retries.attempt_timeout.filter(|_| bound < deadline).unwrap_or(retries.total)),
        };
        let verdict = match &answer {
            Answer::Response(response) => transport.judge(response),
            Answer::Failed(error) => transport.judge_error(error),
            Answer::TimedOut(_) => Verdict::Retry { after: None },
        };
        let Verdict::Retry { after } = verdict else {
            return (answer, Tally { attempts, stop: Stop::Final });
        };
        let stop = |stop| Tally { attempts, stop };
        if !transport.can_resend() {
            return (answer, stop(Stop::NotResendable));
        }
        if attempts >= retries.max_attempts {
            return (answer, stop(Stop::Attempts));
        }
        if let Some(after) = after.filter(|after| *after > retries.max_retry_after) {
            return (answer, stop(Stop::RetryAfterTooLong(after)));
        }
        let backoff = jitter.get_or_insert_with(Jitter::seeded).up_to(retries.ceiling(attempts));
        let wait = after.unwrap_or_default().max(backoff);
        if Instant::now() + wait >= deadline {
            return (answer, stop(Stop::Time));
        }
        if let Some(on_retry) = on_retry {
            let answered = match &answer {
                Answer::Response(response) => transport.answered(response),
                Answer::Failed(_) | Answer::TimedOut(_) => None,
            };
            on_retry(&Retrying { key, attempt: attempts, answered, wait });
        }
        if let Answer::Response(response) = answer {
            let _ = tokio::time::timeout_at(deadline, transport.discard(response)).await;
        }
        tokio::time::sleep(wait).await;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    /// A transport whose answers are scripted: `Ok(verdict)` answers, `Err`
    /// fails, `None` never answers.
    struct Script {
        answers: VecDeque<Option<Result<Verdict, ()>>>,
        resendable: bool,
        sent: Vec<Instant>,
        discarded: u32,
    }

    impl Script {
        fn new(answers: impl IntoIterator<Item = Option<Result<Verdict, ()>>>) -> Self {
            Script { answers: answers.into_iter().collect(), resendable: true, sent: Vec::new(), discarded: 0 }
        }
    }

    impl Transport for Script {
        type Response = Verdict;
        type Error = ();

        fn attempt(&mut self) -> impl Future<Output = Result<Verdict, ()>> + Send + '_ {
            self.sent.push(Instant::now());
            let next = self.answers.pop_front().expect("no attempt past the script");
            async move {
                match next {
                    Some(answer) => answer,
                    None => std::future::pending().await,
                }
            }
        }

        fn can_resend(&self) -> bool {
            self.resendable
        }

        fn judge(&self, response: &Verdict) -> Verdict {
            *response
        }

        fn answered(&self, _: &Verdict) -> Option<u16> {
            Some(503)
        }

        fn judge_error(&self, _: &()) -> Verdict {
            Verdict::Retry { after: None }
        }

        fn discard(&mut self, _: Verdict) -> impl Future<Output = ()> + Send + '_ {
            self.discarded += 1;
            std::future::ready(())
        }
    }

    const KEY: &str = "order-42-pay";
    const RETRY: Option<Result<Verdict, ()>> = Some(Ok(Verdict::Retry { after: None }));
    const FINAL: Option<Result<Verdict, ()>> = Some(Ok(Verdict::Final));

    fn retry_after(secs: u64) -> Option<Result<Verdict, ()>> {
        Some(Ok(Verdict::Retry { after: Some(Duration::from_secs(secs)) }))
    }

    // The clock is tokio's paused one: waits pass at once, and exactly.

    #[tokio::test(start_paused = true)]
    async fn retries_until_a_final_answer() {
        let mut script = Script::new([RETRY, Some(Err(())), FINAL]);
        let (answer, tally) = run(&Retries::default(), &mut script, KEY, None).await;
        assert!(matches!(answer, Answer::Response(Verdict::Final)));
        assert_eq!(tally, Tally { attempts: 3, stop: Stop::Final });
        assert_eq!(script.discarded, 1, "the retried answer was let go; the failure had none");
    }

    #[tokio::test(start_paused = true)]
    async fn the_hook_is_told_of_each_retry_before_its_wait() {
        let told = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let hook: OnRetry = {
            let told = told.clone();
            std::sync::Arc::new(move |retrying: &Retrying<'_>| {
                told.lock().unwrap().push((
                    retrying.key.to_owned(),
                    retrying.attempt,
                    retrying.answered,
                    retrying.wait,
                ));
            })
        };
        let mut script = Script::new([retry_after(1), Some(Err(())), FINAL]);
        let retries = Retries::default().backoff(Duration::ZERO, Duration::ZERO);
        let (_, tally) = run(&retries, &mut script, KEY, Some(&hook)).await;
        assert_eq!(tally.attempts, 3);
        let second = Duration::from_secs(1);
        assert_eq!(*told.lock().unwrap(), [(KEY.into(), 1, Some(503), second), (KEY.into(), 2, None, Duration::ZERO)]);
    }

    #[tokio::test(start_paused = true)]
    async fn stops_at_the_attempts_allowed() {
        let mut script = Script::new([RETRY, RETRY, RETRY]);
        let (_, tally) = run(&Retries::default().max_attempts(3), &mut script, KEY, None).await;
        assert_eq!(tally, Tally { attempts: 3, stop: Stop::Attempts });
    }

    #[tokio::test(start_paused = true)]
    async fn waits_at_least_what_the_server_asked_and_within_the_backoff_otherwise() {
        let retries = Retries::default().backoff(Duration::from_millis(100), Duration::from_secs(1));
        let mut script = Script::new([retry_after(2), RETRY, RETRY, FINAL]);
        let (_, tally) = run(&retries, &mut script, KEY, None).await;
        assert_eq!(tally.attempts, 4);
        let gaps: Vec<Duration> = script.sent.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps[0] >= Duration::from_secs(2) && gaps[0] <= Duration::from_secs(2), "{gaps:?}");
        assert!(gaps[1] <= Duration::from_millis(200), "second retry's ceiling: {gaps:?}");
        assert!(gaps[2] <= Duration::from_millis(400), "third retry's ceiling: {gaps:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_after_past_the_allowed_is_handed_back() {
        let mut script = Script::new([retry_after(60)]);
        let (_, tally) = run(&Retries::default(), &mut script, KEY, None).await;
        assert_eq!(tally, Tally { attempts: 1, stop: Stop::RetryAfterTooLong(Duration::from_secs(60)) });
    }

    #[tokio::test(start_paused = true)]
    async fn the_total_bounds_waits_and_attempts() {
        // A wait that would end past the total: handed back at once.
        let retries = Retries::default().total(Duration::from_secs(5)).max_retry_after(Duration::from_secs(10));
        let mut script = Script::new([retry_after(6)]);
        let started = Instant::now();
        let (_, tally) = run(&retries, &mut script, KEY, None).await;
        assert_eq!((tally, started.elapsed()), (Tally { attempts: 1, stop: Stop::Time }, Duration::ZERO));
        // An attempt that never answers: abandoned at the total's end.
        let mut script = Script::new([retry_after(1), None]);
        let (answer, tally) = run(&retries, &mut script, KEY, None).await;
        assert!(matches!(answer, Answer::TimedOut(t) if t == Duration::from_secs(5)));
        assert_eq!((tally, started.elapsed()), (Tally { attempts: 2, stop: Stop::Time }, Duration::from_secs(5)));
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempt_that_hangs_is_tried_again_after_its_timeout() {
        let retries = Retries::default().attempt_timeout(Duration::from_secs(2));
        let mut script = Script::new([None, FINAL]);
        let (answer, tally) = run(&retries, &mut script, KEY, None).await;
        assert!(matches!(answer, Answer::Response(Verdict::Final)));
        assert_eq!(tally, Tally { attempts: 2, stop: Stop::Final });
        assert!(script.sent[1] - script.sent[0] >= Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_sent_once_is_never_retried() {
        let mut script = Script::new([RETRY]);
        script.resendable = false;
        let (_, tally) = run(&Retries::default(), &mut script, KEY, None).await;
        assert_eq!(tally, Tally { attempts: 1, stop: Stop::NotResendable });
        assert_eq!(script.discarded, 0, "the answer is handed back whole");
    }
}
