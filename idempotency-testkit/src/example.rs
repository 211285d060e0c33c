//! One of this workspace's examples, run as the process a user runs:
//! `cargo test` (and nextest) build every example beside the test
//! binaries, in `<target>/debug/examples/`, and a test starts the one it
//! needs with its environment, reads where it listens from its output, and
//! kills it when done.
//!
//! A test run with `--test` builds no example: the binary is then missing
//! or older than its sources, and the test fails saying which `cargo build`
//! makes it (never a stale server tested in silence).

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
    /// workspace (its binary must be newer than them and than the library's
    /// sources); `features` only name what builds it, for the message.
    pub async fn start(
        name: &str,
        sources: &[&str],
        features: &str,
        env: &[(&str, &str)],
        marker: &str,
    ) -> (Example, String) {
        let binary = binary(name, sources, features);
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
    pub async fn run(name: &str, sources: &[&str], features: &str, env: &[(&str, &str)]) -> String {
        let binary = binary(name, sources, features);
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

/// The built example `name`, checked to be newer than its sources.
fn binary(name: &str, sources: &[&str], features: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary");
    // `<target>/<profile>/deps/<test>` → `<target>/<profile>/examples/<name>`.
    let profile = exe.parent().and_then(Path::parent).expect("a test binary in <target>/<profile>/deps");
    let binary = profile.join("examples").join(name);
    let build = format!("cargo build --example {name} --features {features} (a whole `cargo test` builds it)");
    let built = std::fs::metadata(&binary)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| panic!("the example {name} is not built at {}: {build}", binary.display()));
    let root = workspace();
    let library = ["src", "idempotency-runtime/src", "idempotency-macros/src", "idempotency-rules/src"];
    for source in sources.iter().chain(&library) {
        if let Some((path, changed)) = newest(&root.join(source))
            && changed > built
        {
            panic!("the example {name} is older than {}: {build}", path.display());
        }
    }
    binary
}

/// The most recently changed file under `path` (or `path` itself).
fn newest(path: &Path) -> Option<(PathBuf, SystemTime)> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_dir() {
        return Some((path.to_owned(), meta.modified().ok()?));
    }
    std::fs::read_dir(path).ok()?.filter_map(|entry| newest(&entry.ok()?.path())).max_by_key(|(_, changed)| *changed)
}
