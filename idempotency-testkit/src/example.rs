//! One of this workspace's examples, run as the process a user runs: a
//! test starts the one it needs with its environment, reads where it
//! listens from its output, and kills it when done.
//!
//! `cargo test` (and nextest) build every example beside the test binaries,
//! in `<target>/<profile>/examples/`; that binary is used when it is newer
//! than its sources. Otherwise (a run narrowed with `--test`, a source
//! changed since) the test has cargo build it with the test's own features
//! ([`facade_features!`](crate::facade_features)), as its own build would:
//! never a stale server tested in silence.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime};

use tokio::sync::oneshot;

/// A running example; killed (SIGKILL) and reaped when dropped.
pub struct Example {
    child: Child,
}

impl Example {
    /// Starts example `name` with `env` (and the test's environment, less
    /// its `IDEM_*` variables) and waits until a line of its
    /// output holds `marker`; returns the example and the rest of that line
    /// after the marker (`"listening on "` → `"http://127.0.0.1:PORT ..."`).
    /// `sources` are the example's own files and folders, relative to the
    /// workspace (a binary older than them or than the library's sources is
    /// built again); `features` are the test's own, which build it
    /// (`idempotency_testkit::facade_features!()`).
    pub async fn start(
        name: &str,
        sources: &[&str],
        features: &[&str],
        env: &[(&str, &str)],
        marker: &str,
    ) -> (Example, String) {
        let binary = located(name, sources, features).await;
        let mut child = command(&binary, env)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()));
        let stdout = child.stdout.take().expect("its stdout");
        let (found, rest) = oneshot::channel();
        let wanted = marker.to_owned();
        // Reads on until the example ends, so that it never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut found = Some(found);
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                println!("example: {line}");
                if let Some((_, after)) = line.split_once(wanted.as_str())
                    && let Some(found) = found.take()
                {
                    let _ = found.send(after.to_owned());
                }
            }
        });
        let example = Example { child };
        // Bounded: an example that never says it is ready fails the test.
        // Awaited, not blocked on: the test's runtime may serve the example
        // meanwhile (a forwarder between it and its database).
        let rest = tokio::time::timeout(Duration::from_secs(60), rest)
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_else(|| panic!("the example {name} never printed {marker:?} (its output is above)"));
        (example, rest)
    }

    /// The example's process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Runs example `name` (as [`start`](Self::start) finds it) to its end
    /// and returns what it printed; one that fails, or runs past a minute
    /// (then killed), fails the test.
    pub async fn run(name: &str, sources: &[&str], features: &[&str], env: &[(&str, &str)]) -> String {
        let binary = located(name, sources, features).await;
        let child = command(&binary, env).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn();
        let child = child.unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()));
        let pid = child.id();
        // Waited for off the runtime's thread, which may serve the example.
        let output =
            tokio::time::timeout(Duration::from_secs(60), tokio::task::spawn_blocking(|| child.wait_with_output()));
        let Ok(output) = output.await else {
            // SAFETY: a signal to the child this call started and has not reaped.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!("the example {name} ran past a minute");
        };
        let output = output.expect("waited for").expect("its output");
        let printed = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(output.status.success(), "the example {name} failed ({}):\n{printed}", output.status);
        printed
    }
}

/// The example's command: the test's environment less its own settings
/// (`IDEM_REDIS_URL`, ...), which are not the example's, plus `env`.
fn command(binary: &Path, env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(binary);
    for (var, _) in std::env::vars_os() {
        if var.to_string_lossy().starts_with("IDEM_") {
            command.env_remove(var);
        }
    }
    command.envs(env.iter().copied());
    command
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The workspace's root.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the testkit sits in the workspace").to_owned()
}

/// [`binary`] off the runtime's thread (cargo may build for a minute).
async fn located(name: &str, sources: &[&str], features: &[&str]) -> PathBuf {
    let (name, features) = (name.to_owned(), features.iter().map(|f| f.to_string()).collect::<Vec<_>>());
    let sources = sources.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    tokio::task::spawn_blocking(move || binary(&name, &sources, &features)).await.expect("the example located")
}

/// The example `name` as cargo built it beside this test, or, missing or
/// older than its sources, as cargo builds it now.
fn binary(name: &str, sources: &[String], features: &[String]) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary");
    // `<target>/<profile>/deps/<test>` → `<target>/<profile>/examples/<name>`.
    let profile = exe.parent().and_then(Path::parent).expect("a test binary in <target>/<profile>/deps");
    let beside = profile.join("examples").join(name);
    if let Ok(built) = std::fs::metadata(&beside).and_then(|m| m.modified()) {
        let root = workspace();
        let library = ["src", "idempotency-runtime/src", "idempotency-macros/src", "idempotency-rules/src"];
        let sources = sources.iter().map(String::as_str).chain(library);
        if sources.filter_map(|source| newest(&root.join(source))).all(|(_, changed)| changed <= built) {
            return beside;
        }
    }
    build(name, features)
}

/// Every feature of the `idempotency` package: all of them on is CI's
/// `--workspace --all-features` build.
const FACADE_FEATURES: usize = 14;

/// Has cargo build example `name` with `features` (the test's) and returns
/// the executable it names.
fn build(name: &str, features: &[String]) -> PathBuf {
    let list = features.join(",");
    let mut args = vec!["build", "--example", name, "--message-format=json-render-diagnostics"];
    if features.len() == FACADE_FEATURES {
        args.extend(["--workspace", "--all-features"]);
    } else {
        args.extend(["-p", "idempotency", "--features", &list]);
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out =
        Command::new(cargo).args(&args).current_dir(workspace()).stderr(Stdio::inherit()).output().expect("cargo runs");
    assert!(out.status.success(), "cargo {args:?} failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .find_map(|m| {
            let example = m["reason"] == "compiler-artifact"
                && m["target"]["name"] == name
                && m["target"]["kind"][0] == "example";
            example.then(|| m["executable"].as_str().map(PathBuf::from)).flatten()
        })
        .unwrap_or_else(|| panic!("cargo named no executable for the example {name}"))
}

/// The `idempotency` features the calling test was built with, for
/// [`Example::start`] (expanded in the test's crate, where they are set).
#[macro_export]
macro_rules! facade_features {
    () => {{
        let all = [
            ("sqlite", cfg!(feature = "sqlite")),
            ("mysql", cfg!(feature = "mysql")),
            ("postgres", cfg!(feature = "postgres")),
            ("redis", cfg!(feature = "redis")),
            ("axum", cfg!(feature = "axum")),
            ("actix", cfg!(feature = "actix")),
            ("tonic", cfg!(feature = "tonic")),
            ("amqp", cfg!(feature = "amqp")),
            ("outbox", cfg!(feature = "outbox")),
            ("nats", cfg!(feature = "nats")),
            ("redis-streams", cfg!(feature = "redis-streams")),
            ("kafka", cfg!(feature = "kafka")),
            ("cron", cfg!(feature = "cron")),
            ("metrics", cfg!(feature = "metrics")),
        ];
        all.into_iter().filter(|(_, on)| *on).map(|(name, _)| name).collect::<::std::vec::Vec<&'static str>>()
    }};
}

/// The most recently changed file under `path` (or `path` itself).
fn newest(path: &Path) -> Option<(PathBuf, SystemTime)> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_dir() {
        return Some((path.to_owned(), meta.modified().ok()?));
    }
    std::fs::read_dir(path).ok()?.filter_map(|entry| newest(&entry.ok()?.path())).max_by_key(|(_, changed)| *changed)
}
