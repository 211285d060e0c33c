//! The proof by killing processes: the calling side runs in child processes
//! (this test binary again, running the parent's own test as a child: see
//! [`child_process`]), which call a
//! payment provider on loopback ([`Provider`]) through an annotated fn and
//! can be told to stop at a named point: they print `IDEM-STOP <point>` and
//! wait, so the parent kills them with SIGKILL exactly there, or pauses them
//! with SIGSTOP. Retries come from other processes; the parent reconciles
//! the provider's books and the database, and measures how long after the
//! kill a retry succeeds.
//!
//! Kill points: two-phase (`steps`): `before_step` (phase one committed),
//! `after_provider` (the provider charged and answered, the step not yet
//! recorded), `before_commit` (the payment written in the final
//! transaction, not committed), `after_commit` (committed, not answered).
//! Plain mode: `after_provider`, `before_commit`, `after_commit`.
//!
//! `cargo test --test steps crash` runs every point once on MariaDB and
//! PostgreSQL, with and without Redis, a few at a time;
//! `cargo test --release --test steps crash_figures -- --ignored --nocapture`
//! runs them one at a time, five times each, and prints the figures.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use idempotency::{Error, Idem, Steps, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{Pool, Transaction};

use crate::provider::{Provider, ProviderCharge, ProviderClient};
use crate::support::{TestDb, epoch_ms, unique, unmigrated_engine};

/// Set in a child's environment: its orders, as JSON.
pub(crate) const CHILD_ENV: &str = "IDEM_STEPS_CHILD";
const STEPS_BIZ: &str = "crash_steps";
const PLAIN_BIZ: &str = "crash_plain";
const ZOMBIE_BIZ: &str = "crash_zombie";
/// The lease of both fns below.
const LEASE_MS: i64 = 1000;
/// Longest wait for one line from a child.
const LINE_WAIT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------- the child

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ChildConfig {
    pub(crate) db: DbKind,
    pub(crate) redis: bool,
    pub(crate) mode: Mode,
    pub(crate) key: String,
    pub(crate) amount: i64,
    pub(crate) provider: String,
    /// Where to stop and wait for a line on stdin.
    pub(crate) stop: Option<String>,
    /// Call again until the answer is final (not `InProgress`, not a
    /// failure of the provider or the database).
    pub(crate) retry: bool,
    /// Print `IDEM-READY` once connected, and wait for a line on stdin
    /// before calling: the parent starts the clock, not the process.
    pub(crate) wait_for_go: bool,
    /// Which fns to call.
    pub(crate) fns: Fns,
    /// Run under libfaketime with this offset (`+10m`, `-10m`).
    pub(crate) faketime: Option<String>,
    /// The parent's test, which the child runs again (see [`child_process`]).
    pub(crate) test: String,
}

/// The fns a child calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Fns {
    /// `pay_steps` and `pay_plain`: a 1 s lease, which a kill leaves to run out.
    Crash,
    /// `pay_zombie`: an hour's lease, which the parent ends by SQL (and in
    /// Redis) once the retry has seen it held.
    Zombie,
    /// The fns of [`crate::skew`] (ttl 5 min, lease 30 s).
    Skew,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) enum DbKind {
    MariaDb,
    Postgres,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) enum Mode {
    Steps,
    Plain,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Receipt {
    pub(crate) key: String,
    pub(crate) charge_id: String,
    pub(crate) amount: i64,
}

#[derive(Debug)]
pub(crate) enum ChildError {
    Idem(Error),
    Db(sqlx::Error),
    Provider(String),
}

impl From<Error> for ChildError {
    fn from(e: Error) -> Self {
        ChildError::Idem(e)
    }
}

impl From<sqlx::Error> for ChildError {
    fn from(e: sqlx::Error) -> Self {
        ChildError::Db(e)
    }
}

/// The two-phase mode: the charge is a step, the payment row goes in the
/// final transaction.
#[idempotent(key = "<key>", ttl = "1h", biz = "crash_steps", biz_no = "<key>", lease = "1s", steps)]
async fn pay_steps<DB: TestDb>(
    idem: &Idem<DB>,
    steps: &mut Steps<DB>,
    #[idem(skip)] provider: &ProviderClient,
    key: &str,
    amount: i64,
) -> Result<Receipt, ChildError> {
    charge_in_steps(steps, provider, key, amount).await
}

/// [`pay_steps`] with a lease that never runs out during a test: the
/// zombie tests end it by SQL once the retry has found it held.
#[idempotent(key = "<key>", ttl = "1h", biz = "crash_zombie", biz_no = "<key>", lease = "1h", steps)]
async fn pay_zombie<DB: TestDb>(
    idem: &Idem<DB>,
    steps: &mut Steps<DB>,
    #[idem(skip)] provider: &ProviderClient,
    key: &str,
    amount: i64,
) -> Result<Receipt, ChildError> {
    charge_in_steps(steps, provider, key, amount).await
}

/// The body of the two-phase fns, with its stop points.
async fn charge_in_steps<DB: TestDb>(
    steps: &mut Steps<DB>,
    provider: &ProviderClient,
    key: &str,
    amount: i64,
) -> Result<Receipt, ChildError> {
    stop_at("before_step").await;
    let charge: ProviderCharge = steps
        .step("charge", |step_key| async move {
            let charge = provider.charge(step_key.as_str(), key, amount).await.map_err(ChildError::Provider)?;
            stop_at("after_provider").await;
            Ok::<_, ChildError>(charge)
        })
        .await?;
    if charge.declined {
        return Err(steps.permanent(&charge).into());
    }
    stop_at("before_final").await;
    let tx = steps.transaction().await?;
    DB::insert_payment(tx, key, &charge.id, amount).await?;
    stop_at("before_commit").await;
    Ok(Receipt { key: key.to_owned(), charge_id: charge.id, amount })
}

/// The plain mode with the charge inside the body, as the plain mode's
/// README warns against: the provider's idempotency key is all that keeps a
/// retry from charging again.
#[idempotent(key = "<key>", ttl = "1h", biz = "crash_plain", lease = "1s")]
async fn pay_plain<DB: TestDb>(
    idem: &Idem<DB>,
    tx: &mut Transaction<'_, DB>,
    #[idem(skip)] provider: &ProviderClient,
    key: &str,
    amount: i64,
) -> Result<Receipt, ChildError> {
    let charge = provider.charge(&format!("plain-{key}"), key, amount).await.map_err(ChildError::Provider)?;
    stop_at("after_provider").await;
    DB::insert_payment(tx, key, &charge.id, amount).await?;
    stop_at("before_commit").await;
    Ok(Receipt { key: key.to_owned(), charge_id: charge.id, amount })
}

static STOP: OnceLock<Option<String>> = OnceLock::new();

/// At the configured point: says so, and waits for a line on stdin (the
/// parent kills or pauses the process meanwhile). A closed stdin (the
/// parent died) ends the process rather than letting the call go on.
pub(crate) async fn stop_at(point: &str) {
    if STOP.get().and_then(Option::as_deref) != Some(point) {
        return;
    }
    println!("IDEM-STOP {point}");
    wait_for_line().await;
}

async fn wait_for_line() {
    let read = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|n| n > 0)
    });
    if !matches!(read.await, Ok(Ok(true))) {
        std::process::exit(3);
    }
}

/// The child's side, first thing in each parent test: a child is the
/// parent's own test run again with [`CHILD_ENV`] set, so no entry point of
/// its own passes as a test. Plays the child and returns `true` there;
/// returns `false` at once in the parent.
pub(crate) fn child_process() -> bool {
    let Ok(config) = std::env::var(CHILD_ENV) else { return false };
    let config: ChildConfig = serde_json::from_str(&config).expect("child config");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async move {
        match config.db {
            DbKind::MariaDb => child::<sqlx::MySql>(config).await,
            DbKind::Postgres => child::<sqlx::Postgres>(config).await,
        }
    });
    true
}

async fn child<DB: TestDb>(config: ChildConfig) {
    STOP.set(config.stop.clone()).unwrap();
    let db = DB::connect().await.expect("the database answers");
    let idem = unmigrated_engine(db.pool.clone(), config.redis).await.expect("redis answers");
    let provider = ProviderClient::new(config.provider.clone());
    // Warm the pool, so the clock does not count the first connection.
    DB::payments(&db.pool, &config.key).await;
    if config.wait_for_go {
        println!("IDEM-READY");
        wait_for_line().await;
    }
    let mut attempts = 0;
    let mut told_busy = false;
    loop {
        attempts += 1;
        let (key, amount) = (&config.key, config.amount);
        let answer = match (config.mode, config.fns) {
            (Mode::Steps, Fns::Crash) => pay_steps(&idem, &provider, key, amount).await,
            (Mode::Plain, Fns::Crash) => pay_plain(&idem, &provider, key, amount).await,
            (Mode::Steps, Fns::Zombie) => pay_zombie(&idem, &provider, key, amount).await,
            (Mode::Plain, Fns::Zombie) => unreachable!("the zombie fn is two-phase"),
            (Mode::Steps, Fns::Skew) => crate::skew::pay_steps(&idem, &provider, key, amount).await,
            (Mode::Plain, Fns::Skew) => crate::skew::pay_plain(&idem, &provider, key, amount).await,
        };
        let at = epoch_ms();
        let final_answer =
            matches!(answer, Ok(_) | Err(ChildError::Idem(Error::Permanent { .. } | Error::KeyReused { .. })));
        if config.retry && matches!(answer, Err(ChildError::Idem(Error::InProgress { .. }))) && !told_busy {
            // The parent waits for this before it ends a held lease.
            println!("IDEM-BUSY");
            told_busy = true;
        }
        if config.retry && !final_answer {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        stop_at("after_commit").await;
        println!("IDEM-ANSWER {}", render(&answer));
        println!("IDEM-DONE {at} {attempts}");
        return;
    }
}

/// The answer as the parent compares it: the result's JSON, the recorded
/// failure's, or the error.
fn render(answer: &Result<Receipt, ChildError>) -> String {
    match answer {
        Ok(receipt) => format!("ok {}", serde_json::to_string(receipt).unwrap()),
        Err(ChildError::Idem(Error::Permanent { failure, .. })) => format!("failed {}", failure.as_json()),
        Err(ChildError::Idem(Error::InProgress { .. })) => "in_progress".to_owned(),
        Err(ChildError::Idem(e)) => format!("error {e}"),
        Err(ChildError::Db(e)) => format!("error database: {e}"),
        Err(ChildError::Provider(e)) => format!("error {e}"),
    }
}

// --------------------------------------------------------------- the parent

/// A child process and the lines it prints.
pub(crate) struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

/// What a child answered: its line, when the answer came (epoch ms) and
/// after how many calls.
#[derive(Debug)]
pub(crate) struct Answered {
    pub(crate) answer: String,
    at_ms: i64,
    pub(crate) attempts: u32,
}

impl Proc {
    pub(crate) fn spawn(config: &ChildConfig) -> Proc {
        let exe = std::env::current_exe().unwrap();
        let mut command = match &config.faketime {
            Some(offset) => {
                let mut faked = Command::new("faketime");
                faked.args(["-f", offset]).arg(exe);
                faked
            }
            None => Command::new(exe),
        };
        let mut child = command
            .args(["--exact", &config.test, "--include-ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, serde_json::to_string(config).unwrap())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn a child");
        let stdout = child.stdout.take().unwrap();
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        Proc { stdin: child.stdin.take(), child, lines, seen: Vec::new() }
    }

    /// Waits for the line holding `marker`; returns what follows it. (The
    /// first may share its line with libtest's `test crash::crash ... `.)
    pub(crate) fn expect(&mut self, marker: &str) -> String {
        loop {
            match self.lines.recv_timeout(LINE_WAIT) {
                Ok(line) => {
                    if let Some(at) = line.find(marker) {
                        return line[at + marker.len()..].trim().to_owned();
                    }
                    self.seen.push(line);
                }
                Err(e) => panic!("no `{marker}` from child {} ({e}); it printed {:?}", self.child.id(), self.seen),
            }
        }
    }

    /// Lets a child waiting at a point (or for its go) carry on.
    pub(crate) fn go(&mut self) {
        let stdin = self.stdin.as_mut().expect("stdin");
        stdin.write_all(b"go\n").and_then(|()| stdin.flush()).expect("write to the child");
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).unwrap();
        // SAFETY: a plain kill(2) on our own child, which has not been reaped.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "kill({pid}, {signal})");
    }

    /// SIGSTOP, returning once the child has stopped: `kill(2)` returns
    /// before the signal takes effect, and a child told to go on right
    /// after could run on past its point first (seen: a zombie stopped
    /// inside its final transaction, its call's row locked, so the retry
    /// waited on it until the line wait ran out).
    fn stop(&self) {
        self.signal(libc::SIGSTOP);
        let pid = libc::pid_t::try_from(self.child.id()).unwrap();
        let mut status = 0;
        // SAFETY: waitpid(2) on our own child, not yet reaped; WUNTRACED
        // reports the stop and leaves the child to be waited for again.
        let waited = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED) };
        assert!(waited == pid && libc::WIFSTOPPED(status), "child {pid} did not stop: {waited}, {status:#x}");
    }

    /// SIGKILL (`Child::kill` on Unix), reaped.
    fn kill(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reaped");
    }

    pub(crate) fn answered(mut self) -> Answered {
        let answer = self.expect("IDEM-ANSWER ");
        let done = self.expect("IDEM-DONE ");
        let (at, attempts) = done.split_once(' ').expect("at and attempts");
        let status = self.child.wait().expect("the child exits");
        assert!(status.success(), "child {status}; printed {:?}", self.seen);
        Answered { answer, at_ms: at.parse().unwrap(), attempts: attempts.parse().unwrap() }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The parent's side: the provider, and the databases to reconcile.
pub(crate) struct Bench {
    /// The parent's test (its children run it again).
    test: &'static str,
    runtime: tokio::runtime::Runtime,
    pub(crate) provider: Provider,
    mariadb: Option<Pool<sqlx::MySql>>,
    postgres: Option<Pool<sqlx::Postgres>>,
    redis: bool,
}

impl Bench {
    /// The bench of the parent test `test` (its path in this binary).
    pub(crate) fn new(test: &'static str) -> Bench {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let (provider, mariadb, postgres, redis) = runtime.block_on(async {
            let provider = Provider::start().await;
            let mariadb = prepare::<sqlx::MySql>().await;
            let postgres = prepare::<sqlx::Postgres>().await;
            let redis = crate::support::redis_answers().await;
            (provider, mariadb, postgres, redis)
        });
        Bench { test, runtime, provider, mariadb, postgres, redis }
    }

    pub(crate) fn config(&self, db: DbKind, redis: bool, mode: Mode, key: &str) -> ChildConfig {
        ChildConfig {
            db,
            redis,
            mode,
            key: key.to_owned(),
            amount: 1999,
            provider: self.provider.url(),
            stop: None,
            retry: false,
            wait_for_go: false,
            fns: Fns::Crash,
            faketime: None,
            test: self.test.to_owned(),
        }
    }

    /// The setups this machine can run: each database that answers, with
    /// and without Redis (if it answers).
    pub(crate) fn setups(&self) -> Vec<(DbKind, bool)> {
        let mut setups = Vec::new();
        for (db, up) in [(DbKind::MariaDb, self.mariadb.is_some()), (DbKind::Postgres, self.postgres.is_some())] {
            if up {
                setups.push((db, false));
                if self.redis {
                    setups.push((db, true));
                }
            }
        }
        setups
    }

    /// Ends the lease of the two-phase call `(biz, key)` now, as if it had
    /// run out: its `idem_call` row's lease, and its claim in Redis.
    pub(crate) fn end_lease(&self, db: DbKind, redis: bool, biz: &str, key: &str) {
        self.runtime.block_on(async {
            match db {
                DbKind::MariaDb => end_lease(self.mariadb.as_ref().unwrap(), redis, biz, key).await,
                DbKind::Postgres => end_lease(self.postgres.as_ref().unwrap(), redis, biz, key).await,
            }
        });
    }

    /// What the key left behind: charges at the provider, payment rows,
    /// and the record's status (`idem_call` for steps, `idem_record` for
    /// the plain mode).
    fn books(&self, db: DbKind, mode: Mode, key: &str) -> Books {
        let biz = match mode {
            Mode::Steps => STEPS_BIZ,
            Mode::Plain => PLAIN_BIZ,
        };
        self.books_of(db, mode, biz, key)
    }

    /// [`Bench::books`] of the fns of another `biz`.
    pub(crate) fn books_of(&self, db: DbKind, mode: Mode, biz: &str, key: &str) -> Books {
        let charges = self.provider.charges(key);
        self.runtime.block_on(async {
            match db {
                DbKind::MariaDb => books(self.mariadb.as_ref().unwrap(), mode, biz, key, charges).await,
                DbKind::Postgres => books(self.postgres.as_ref().unwrap(), mode, biz, key, charges).await,
            }
        })
    }
}

async fn end_lease<DB: TestDb>(pool: &Pool<DB>, redis: bool, biz: &str, key: &str) {
    let row = format!("biz_type = '{biz}' AND idem_key = '{key}'");
    DB::force(pool, format!("UPDATE idem_call SET lease_until = 0 WHERE {row}")).await;
    if redis {
        let idem = unmigrated_engine(pool.clone(), true).await.expect("redis answers");
        let namespace = idem.redis_namespace().await.unwrap().expect("migrated");
        let at = idempotency::redis_layout::locate(namespace.as_str(), biz, key).expect("a valid namespace");
        let client = redis::Client::open(crate::support::redis_url()).expect("redis url");
        idempotency_testkit::redis_del(&client, &at.claim).await;
    }
}

async fn prepare<DB: TestDb>() -> Option<Pool<DB>> {
    let db = DB::connect().await?;
    crate::support::engine(db.pool.clone(), false).await?;
    Some(db.pool)
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Books {
    pub(crate) charges: u32,
    pub(crate) payments: i64,
    /// Status of the record (1 succeeded) and, for steps, its fence.
    pub(crate) record: Option<(i16, i64)>,
    pub(crate) steps_left: i64,
}

async fn books<DB: TestDb>(pool: &Pool<DB>, mode: Mode, biz: &str, key: &str, charges: u32) -> Books {
    let payments = DB::payments(pool, key).await;
    let (record, steps_left) = match mode {
        Mode::Steps => (DB::call(pool, biz, key).await.map(|c| (c.status, c.fence)), DB::steps(pool, biz, key).await),
        Mode::Plain => (DB::record_status(pool, biz, key).await.map(|s| (s, 0)), 0),
    };
    Books { charges, payments, record, steps_left }
}

/// One kill: what the retry took, measured from the kill.
#[derive(Debug, Clone)]
struct Figure {
    mode: Mode,
    redis: bool,
    point: &'static str,
    ms: i64,
    attempts: u32,
}

const STEPS_POINTS: [&str; 4] = ["before_step", "after_provider", "before_commit", "after_commit"];
const PLAIN_POINTS: [&str; 3] = ["after_provider", "before_commit", "after_commit"];

/// A child killed with SIGKILL at `point`; a retry from another process
/// (started beforehand, told to go right after the kill) calls until the
/// answer is final; a third process replays. Per key: one charge at the
/// provider, one payment row, one succeeded record, answers identical.
fn kill_at(bench: &Bench, db: DbKind, redis: bool, mode: Mode, point: &'static str) -> Figure {
    let key = unique(&format!("kill-{point}"));
    let mut first = Proc::spawn(&ChildConfig { stop: Some(point.to_owned()), ..bench.config(db, redis, mode, &key) });
    let mut retry = Proc::spawn(&ChildConfig { retry: true, wait_for_go: true, ..bench.config(db, redis, mode, &key) });
    retry.expect("IDEM-READY");
    first.expect(&format!("IDEM-STOP {point}"));
    let killed_at = epoch_ms();
    first.kill();
    retry.go();
    let retried = retry.answered();
    let replayed = Proc::spawn(&bench.config(db, redis, mode, &key)).answered();

    let scene = format!("{mode:?} on {db:?}, redis {redis}, killed at {point}");
    assert!(retried.answer.starts_with("ok {"), "{scene}: {retried:?}");
    assert_eq!(replayed.answer, retried.answer, "{scene}: the replay differs");
    assert_eq!(replayed.attempts, 1, "{scene}");
    let fence = match (mode, point) {
        // Committed before the kill: nothing to take over.
        (Mode::Steps, "after_commit") => 1,
        (Mode::Steps, _) => 2,
        (Mode::Plain, _) => 0,
    };
    let books = bench.books(db, mode, &key);
    assert_eq!(books, Books { charges: 1, payments: 1, record: Some((1, fence)), steps_left: 0 }, "{scene}");
    // The provider is asked again only when its answer died with the
    // process: the charge inside a plain body, or a step not yet recorded.
    let asked_again = match mode {
        Mode::Steps => point == "after_provider",
        Mode::Plain => point != "after_commit",
    };
    assert_eq!(bench.provider.requests(&key), 1 + u32::from(asked_again), "{scene}: requests at the provider");
    Figure { mode, redis, point, ms: retried.at_ms - killed_at, attempts: retried.attempts }
}

/// A two-phase child paused with SIGSTOP at `point`; another process
/// finds the key held (`InProgress`), the test then ends the zombie's lease
/// (by SQL and in Redis, as if it had run out), and the other process takes
/// the key over and finishes it; resumed with SIGCONT, the paused one
/// commits nothing and answers with the new owner's result.
fn pause_at(bench: &Bench, db: DbKind, redis: bool, point: &'static str) {
    let key = unique(&format!("zombie-{point}"));
    let config = ChildConfig { fns: Fns::Zombie, ..bench.config(db, redis, Mode::Steps, &key) };
    let mut zombie = Proc::spawn(&ChildConfig { stop: Some(point.to_owned()), ..config.clone() });
    let mut retry = Proc::spawn(&ChildConfig { retry: true, wait_for_go: true, ..config });
    retry.expect("IDEM-READY");
    zombie.expect(&format!("IDEM-STOP {point}"));
    zombie.stop();
    // Read only once it runs again: it then goes on at once.
    zombie.go();
    retry.go();
    retry.expect("IDEM-BUSY");
    bench.end_lease(db, redis, ZOMBIE_BIZ, &key);
    let taken = retry.answered();
    let scene = format!("zombie on {db:?}, redis {redis}, paused at {point}");
    assert!(taken.answer.starts_with("ok {"), "{scene}: {taken:?}");
    assert!(taken.attempts > 1, "{scene}: in progress while the lease held: {taken:?}");
    assert_eq!(bench.books_of(db, Mode::Steps, ZOMBIE_BIZ, &key).record, Some((1, 2)), "{scene}");

    zombie.signal(libc::SIGCONT);
    let resumed = zombie.answered();
    assert_eq!(resumed.answer, taken.answer, "{scene}: the zombie answers with the new owner's result");
    let books = bench.books_of(db, Mode::Steps, ZOMBIE_BIZ, &key);
    assert_eq!(books, Books { charges: 1, payments: 1, record: Some((1, 2)), steps_left: 0 }, "{scene}");
}

/// A provider slower than the lease: a retry takes the call over while the
/// first request is still in flight (the provider answers it 409), the
/// first's answer then finds its step fenced off. Still one charge.
fn slow_provider(bench: &Bench, db: DbKind, redis: bool) {
    let key = unique("slow");
    bench.provider.slow(&key, Duration::from_millis(2500));
    let first = Proc::spawn(&bench.config(db, redis, Mode::Steps, &key));
    let mut retry =
        Proc::spawn(&ChildConfig { retry: true, wait_for_go: true, ..bench.config(db, redis, Mode::Steps, &key) });
    retry.expect("IDEM-READY");
    let deadline = std::time::Instant::now() + LINE_WAIT;
    while bench.provider.requests(&key) == 0 {
        assert!(std::time::Instant::now() < deadline, "the first request never reached the provider");
        std::thread::sleep(Duration::from_millis(5));
    }
    retry.go();
    let retried = retry.answered();
    let first = first.answered();
    let scene = format!("slow provider on {db:?}, redis {redis}");
    assert!(retried.answer.starts_with("ok {"), "{scene}: {retried:?}");
    assert!(first.answer == retried.answer || first.answer == "in_progress", "{scene}: {first:?} vs {retried:?}");
    let books = bench.books(db, Mode::Steps, &key);
    assert_eq!((books.charges, books.payments, books.record.map(|r| r.0)), (1, 1, Some(1)), "{scene}");
}

/// A provider failing twice (503, no charge): each failure ends the lease
/// at once, so the retries (from the same process here) take the call over
/// right away, fence by fence, until the charge goes through.
fn failing_provider(bench: &Bench, db: DbKind, redis: bool) {
    let key = unique("failing");
    bench.provider.fail_next(&key, 2);
    let answered = Proc::spawn(&ChildConfig { retry: true, ..bench.config(db, redis, Mode::Steps, &key) }).answered();
    let scene = format!("failing provider on {db:?}, redis {redis}");
    assert!(answered.answer.starts_with("ok {"), "{scene}: {answered:?}");
    assert_eq!(answered.attempts, 3, "{scene}");
    assert_eq!(bench.provider.requests(&key), 3, "{scene}");
    let books = bench.books(db, Mode::Steps, &key);
    assert_eq!(books, Books { charges: 1, payments: 1, record: Some((1, 3)), steps_left: 0 }, "{scene}");
}

/// A declined charge, declared permanent: recorded once, and every later
/// call from any process answers the same failure without a new request.
fn declined(bench: &Bench, db: DbKind, redis: bool) {
    let key = unique("declined");
    bench.provider.decline(&key);
    let first = Proc::spawn(&bench.config(db, redis, Mode::Steps, &key)).answered();
    let again = Proc::spawn(&bench.config(db, redis, Mode::Steps, &key)).answered();
    let scene = format!("declined on {db:?}, redis {redis}");
    assert!(first.answer.starts_with("failed {") && first.answer.contains("\"declined\":true"), "{scene}: {first:?}");
    assert_eq!(again.answer, first.answer, "{scene}");
    assert_eq!(bench.provider.requests(&key), 1, "{scene}");
    assert_eq!(bench.books(db, Mode::Steps, &key).record.map(|r| r.0), Some(2), "{scene}");
}

/// Runs `jobs` on `threads` threads at once.
pub(crate) fn in_parallel<T: Send>(threads: usize, jobs: Vec<Box<dyn FnOnce() -> T + Send + '_>>) -> Vec<T> {
    let jobs = Mutex::new(jobs.into_iter().enumerate().collect::<Vec<_>>());
    let done = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let Some((i, job)) = jobs.lock().unwrap().pop() else { break };
                    let out = job();
                    done.lock().unwrap().push((i, out));
                }
            });
        }
    });
    let mut done = done.into_inner().unwrap();
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, out)| out).collect()
}

/// A test's jobs: a kill gives a figure, the others none.
type Job<'b> = Box<dyn FnOnce() -> Option<Figure> + Send + 'b>;

fn kill_jobs(bench: &Bench) -> Vec<Job<'_>> {
    let mut jobs: Vec<Job<'_>> = Vec::new();
    for (db, redis) in bench.setups() {
        for point in STEPS_POINTS {
            jobs.push(Box::new(move || Some(kill_at(bench, db, redis, Mode::Steps, point))));
        }
        for point in PLAIN_POINTS {
            jobs.push(Box::new(move || Some(kill_at(bench, db, redis, Mode::Plain, point))));
        }
    }
    jobs
}

/// Prints the figures: per mode, Redis and kill point, the time from the
/// kill to the retry's success (min / median / max over databases and runs).
fn print_figures(figures: &[Figure]) {
    let mut table: BTreeMap<(Mode, bool, &str), Vec<i64>> = BTreeMap::new();
    for f in figures {
        table.entry((f.mode, f.redis, f.point)).or_default().push(f.ms);
    }
    println!(
        "time from SIGKILL to a successful retry (lease {LEASE_MS} ms; ms, min / median / max, MariaDB and PostgreSQL)"
    );
    println!("| mode | Redis | killed at | min | median | max | runs |");
    println!("|---|---|---|---|---|---|---|");
    for ((mode, redis, point), mut ms) in table {
        ms.sort_unstable();
        let mode = match mode {
            Mode::Steps => "two-phase",
            Mode::Plain => "plain",
        };
        println!(
            "| {mode} | {} | {point} | {} | {} | {} | {} |",
            if redis { "yes" } else { "no" },
            ms[0],
            ms[ms.len() / 2],
            ms[ms.len() - 1],
            ms.len()
        );
    }
    let attempts = figures.iter().map(|f| f.attempts).max().unwrap_or(0);
    println!("retry attempts per kill (20 ms apart while in progress): at most {attempts}");
}

/// Every kill point, both modes, MariaDB and PostgreSQL, with and without
/// Redis; SIGSTOP zombies at three points; a slow provider; a declined
/// charge. Reconciled per key (see [`kill_at`]).
#[test]
fn crash() {
    if child_process() {
        return;
    }
    let bench = Bench::new("crash::crash");
    if bench.setups().is_empty() {
        return;
    }
    let bench = &bench;
    let mut jobs = kill_jobs(bench);
    for (db, redis) in bench.setups() {
        for point in ["after_provider", "before_final", "before_commit"] {
            jobs.push(Box::new(move || {
                pause_at(bench, db, redis, point);
                None
            }));
        }
        jobs.push(Box::new(move || {
            slow_provider(bench, db, redis);
            None
        }));
        jobs.push(Box::new(move || {
            declined(bench, db, redis);
            None
        }));
        jobs.push(Box::new(move || {
            failing_provider(bench, db, redis);
            None
        }));
    }
    // Two jobs at a time: each has two or three processes of its own.
    let figures: Vec<Figure> = in_parallel(2, jobs).into_iter().flatten().collect();
    print_figures(&figures);
}

/// The figures for the README: every kill point five times, one at a time.
#[test]
#[ignore = "a minute or two: run with --ignored --nocapture"]
fn crash_figures() {
    if child_process() {
        return;
    }
    let bench = Bench::new("crash::crash_figures");
    let mut figures = Vec::new();
    for _ in 0..5 {
        figures.extend(in_parallel(1, kill_jobs(&bench)).into_iter().flatten());
    }
    print_figures(&figures);
}
