//! The history of a run: every call as its process saw it ([`Call`], one
//! JSON line each in the process's file), and every cut as the nemesis
//! made it ([`Window`]). Times are wall-clock microseconds: one machine,
//! one clock for every process.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path as FilePath;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::schedule::{Cut, Path};

/// Now, in microseconds since the epoch.
pub fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_micros() as i64
}

/// One call: which process sent it, its key and arguments (the amount,
/// the only fingerprinted argument besides the key), when it was sent and
/// answered, and the answer. A retry is a call of its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Call {
    pub proc: usize,
    pub key: String,
    pub amount: i64,
    pub start_us: i64,
    pub end_us: i64,
    pub answer: Answer,
    /// The error's text, for a failure: what a violation's report shows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// What a call was answered, as the caller could tell.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Answer {
    /// `Ok` reported `Executed`: the result's JSON.
    Executed(String),
    /// `Ok` reported `Replayed`: the result's JSON.
    Replayed(String),
    InProgress,
    KeyReused,
    /// `Error::Storage`: the database failed or could not be reached.
    Storage,
    /// The body's own query failed (its connection went).
    BodyDb,
    /// `Error::Replay`: a stored result that did not deserialize.
    Replay,
    /// No answer within the process's call deadline (the call was dropped).
    Timeout,
    /// Anything else, as text.
    Other(String),
}

impl Answer {
    /// The result's JSON of an `Ok`.
    pub fn ok(&self) -> Option<&str> {
        match self {
            Answer::Executed(json) | Answer::Replayed(json) => Some(json),
            _ => None,
        }
    }

    /// Whether the caller is done with the key (a retry would change nothing).
    pub fn is_final(&self) -> bool {
        self.ok().is_some() || *self == Answer::KeyReused
    }

    /// A short name for counts.
    pub fn kind(&self) -> &'static str {
        match self {
            Answer::Executed(_) => "executed",
            Answer::Replayed(_) => "replayed",
            Answer::InProgress => "in_progress",
            Answer::KeyReused => "key_reused",
            Answer::Storage => "storage",
            Answer::BodyDb => "body_db",
            Answer::Replay => "replay_error",
            Answer::Timeout => "timeout",
            Answer::Other(_) => "other",
        }
    }
}

/// One cut as it happened: the process, the path, what was done, from
/// when until the heal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    pub proc: usize,
    pub path: Path,
    pub cut: Cut,
    pub start_us: i64,
    pub end_us: i64,
}

impl Window {
    /// Whether the cut touched `[start_us, end_us]` widened by `grace_us`
    /// after its heal (what a heal with a reset leaves to notice).
    pub fn touches(&self, start_us: i64, end_us: i64, grace_us: i64) -> bool {
        self.start_us < end_us && start_us < self.end_us + grace_us
    }
}

/// A process's history file, appended to by its tasks.
pub struct Recorder {
    out: Mutex<BufWriter<File>>,
}

impl Recorder {
    pub fn create(path: &FilePath) -> Self {
        let file = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
        Self { out: Mutex::new(BufWriter::new(file)) }
    }

    pub fn append(&self, call: &Call) {
        let mut out = self.out.lock().unwrap();
        serde_json::to_writer(&mut *out, call).expect("write history");
        out.write_all(b"\n").expect("write history");
    }

    pub fn flush(&self) {
        self.out.lock().unwrap().flush().expect("flush history");
    }
}

/// Reads a history file written by a [`Recorder`].
pub fn read(path: &FilePath) -> Vec<Call> {
    let file = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    BufReader::new(file)
        .lines()
        .map(|line| serde_json::from_str(&line.expect("read history")).expect("a history line"))
        .collect()
}
