//! The parent's side of the engine processes: spawning the test binary
//! again with its [`Orders`], reading the lines it prints, telling it to
//! start, and killing it if it outlives the run.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::child::{CHILD_ENV, Orders};

/// One engine process and the lines it prints.
pub struct EngineProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl EngineProcess {
    /// Runs `test` (the parent's own test, which calls `child_process`
    /// first) of this binary, alone, with `orders`; ignored or not.
    pub fn spawn(test: &str, orders: &Orders) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("the test binary"))
            .args(["--exact", test, "--include-ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, serde_json::to_string(orders).expect("orders json"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn an engine process");
        let stdout = child.stdout.take().expect("stdout");
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        Self { stdin: child.stdin.take(), child, lines, seen: Vec::new() }
    }

    /// Waits until `deadline` for the line holding `marker`; what follows
    /// it. (The first may share its line with libtest's `test ... `.)
    /// Blocking.
    pub fn expect(&mut self, marker: &str, deadline: Instant) -> String {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => match line.find(marker) {
                    Some(at) => return line[at + marker.len()..].trim().to_owned(),
                    None => self.seen.push(line),
                },
                Err(e) => panic!("no `{marker}` from process {} ({e}); it printed {:?}", self.child.id(), self.seen),
            }
        }
    }

    /// Lets a process waiting for its go start at `start_us` (wall clock).
    pub fn go(&mut self, start_us: i64) {
        let stdin = self.stdin.as_mut().expect("stdin");
        let line = format!("go {start_us}\n");
        stdin.write_all(line.as_bytes()).and_then(|()| stdin.flush()).expect("write to an engine process");
    }

    /// Waits for the process to exit (it has said it is done); blocking.
    pub fn exited(mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.child.try_wait().expect("wait for an engine process") {
                Some(status) => {
                    assert!(status.success(), "engine process {status}; printed {:?}", self.seen);
                    return;
                }
                None if Instant::now() > deadline => panic!("engine process {} does not exit", self.child.id()),
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
