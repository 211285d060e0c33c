//! A delay the forwarder adds to every byte, each way: the distance of a
//! database in another zone, on loopback.
//!
//! tokio's timers tick in whole milliseconds (a 0.5 ms sleep ends at the
//! next tick: 0.5 to 1.5 ms later), so the delays are kept by a thread of
//! their own that sleeps to the microsecond the OS allows (a futex wait:
//! tens of microseconds late at most) and wakes the waiting task. On a busy
//! machine a woken thread waits for a core; where the process may (as
//! root), this one runs at real-time priority (`SCHED_FIFO`), so the delay
//! stays what it says. Bytes are delayed from the moment they were read,
//! not one chunk after another, so a pipelined stream is delayed once, as
//! on a longer wire.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::Instant;

use tokio::sync::oneshot;

/// One wake-up the timer thread owes: at `due`, to `wake`.
struct Due {
    at: Instant,
    wake: oneshot::Sender<()>,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at.cmp(&other.at)
    }
}

/// The timer thread's inbox, started on first use.
fn timer() -> &'static mpsc::Sender<Due> {
    static TIMER: OnceLock<mpsc::Sender<Due>> = OnceLock::new();
    TIMER.get_or_init(|| {
        let (send, receive) = mpsc::channel::<Due>();
        std::thread::Builder::new()
            .name("idem-forwarder-delay".into())
            .spawn(move || {
                promptly();
                let mut pending: BinaryHeap<Reverse<Due>> = BinaryHeap::new();
                loop {
                    let now = Instant::now();
                    while pending.peek().is_some_and(|Reverse(d)| d.at <= now) {
                        let Reverse(due) = pending.pop().expect("peeked");
                        let _ = due.wake.send(());
                    }
                    let next = match pending.peek() {
                        Some(Reverse(d)) => receive.recv_timeout(d.at.saturating_duration_since(now)),
                        None => receive.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
                    };
                    match next {
                        Ok(due) => pending.push(Reverse(due)),
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Err(mpsc::RecvTimeoutError::Disconnected) => return,
                    }
                }
            })
            .expect("the delay thread");
        send
    })
}

/// Waits until `at`, within the OS's timer slack.
pub(super) async fn until(at: Instant) {
    if at <= Instant::now() {
        return;
    }
    let (wake, woken) = oneshot::channel();
    if timer().send(Due { at, wake }).is_ok() {
        let _ = woken.await;
    }
}

/// Asks for real-time scheduling for this thread (it only ever sleeps and
/// wakes others); refused without the privilege, and then left as it is.
pub fn promptly() {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: a plain system call on the calling thread, with a valid parameter.
    let _ = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
}
