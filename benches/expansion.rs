//! What `#[idempotent]` costs the crate that uses it, at build time: two
//! generated crates of the same `IDEM_BENCH_FNS` fns (default 50), one with
//! the attribute on each and one without, built side by side in one run.
//! Printed: the crate's first build (its dependencies built already), the
//! rebuild after an edit of one fn's body (incremental, as `cargo build`
//! after saving a file), and the debug binary each annotated fn adds. A
//! third crate, the attribute on its first fn only, tells the cost paid
//! once (the call flow, built once per backend) from the cost per fn; a
//! fourth, every fn annotated but all returning one type, the cost of the
//! expansion from that of serde_json reading and writing a new result type.
//!
//! `cargo bench --bench expansion`. The crates and their target directory
//! live under `target/expansion/` (the dependencies build once, on the first
//! run); `IDEM_BENCH_CRATE` points them at another checkout of this crate,
//! to measure an older expansion beside this one.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Rebuilds after a body edit, per crate; the median is printed.
const EDITS: usize = 5;

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Plain,
    Annotated,
    /// The attribute on the first fn only.
    One,
    /// The attribute on every fn, all of them returning the first fn's type.
    Shared,
}

const KINDS: [Kind; 4] = [Kind::Plain, Kind::Annotated, Kind::One, Kind::Shared];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Plain => "plain",
            Kind::Annotated => "annotated",
            Kind::One => "one",
            Kind::Shared => "shared",
        }
    }
}

fn main() {
    let fns: usize = std::env::var("IDEM_BENCH_FNS").ok().and_then(|n| n.parse().ok()).unwrap_or(50);
    let repo = std::env::var_os("IDEM_BENCH_CRATE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    let root = target_dir().join("expansion");
    write_workspace(&root, &repo, fns);
    let target = root.join("target");

    // The dependencies, once: what is timed below is the generated crates only.
    println!("expansion: building the dependencies (slow on the first run) ...");
    for kind in KINDS {
        cargo(&root, &target, kind);
    }

    let mut first = Vec::new();
    for kind in [Kind::Plain, Kind::Annotated] {
        let status = Command::new(cargo_bin())
            .args(["clean", "-q", "-p", &package(kind)])
            .current_dir(&root)
            .env("CARGO_TARGET_DIR", &target)
            .status()
            .expect("cargo clean runs");
        assert!(status.success(), "cargo clean -p {}", package(kind));
        first.push(cargo(&root, &target, kind));
    }

    // A body edit: one fn's literal changes, the crate rebuilds; in turns,
    // so both crates see the same machine.
    let mut rebuilds = [Vec::new(), Vec::new()];
    for round in 0..EDITS {
        for (i, kind) in [Kind::Plain, Kind::Annotated].into_iter().enumerate() {
            write_crate(&root, kind, fns, round + 1);
            rebuilds[i].push(cargo(&root, &target, kind));
        }
    }
    let rebuild: Vec<Duration> = rebuilds.iter_mut().map(|times| median(times)).collect();
    let sizes: Vec<u64> = KINDS
        .iter()
        .map(|kind| std::fs::metadata(target.join("debug").join(package(*kind))).expect("the binary is there").len())
        .collect();

    println!();
    println!("{fns} fns, debug profile (rustc {})", rustc_version());
    println!("{:<44} {:>10} {:>10} {:>7}", "", "plain", "annotated", "ratio");
    row("first build of the crate (s)", first[0], first[1]);
    row(&format!("rebuild after a body edit (s, median of {EDITS})"), rebuild[0], rebuild[1]);
    println!(
        "{:<44} {:>10.1} {:>10.1} {:>6.2}x",
        "debug binary (MB)",
        sizes[0] as f64 / 1e6,
        sizes[1] as f64 / 1e6,
        sizes[1] as f64 / sizes[0] as f64
    );
    let per_fn = (sizes[1] as f64 - sizes[2] as f64) / (fns as f64 - 1.0) / 1e3;
    let once = (sizes[2] as f64 - sizes[0] as f64) / 1e3;
    let average = (sizes[1] as f64 - sizes[0] as f64) / fns as f64 / 1e3;
    println!("debug binary per annotated fn: {per_fn:.1} KB, and {once:.0} KB once (the flow, for one backend)");
    println!("  ((annotated - one) / {}; (annotated - plain) / {fns} = {average:.1} KB)", fns - 1);
    let shared = (sizes[3] as f64 - sizes[2] as f64) / (fns as f64 - 1.0) / 1e3;
    println!("debug binary per annotated fn returning a type another fn returns: {shared:.1} KB");
}

fn row(what: &str, plain: Duration, annotated: Duration) {
    let (p, a) = (plain.as_secs_f64(), annotated.as_secs_f64());
    println!("{what:<44} {p:>10.2} {a:>10.2} {:>6.2}x", a / p);
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// Builds one generated crate and says how long it took.
fn cargo(root: &Path, target: &Path, kind: Kind) -> Duration {
    let started = Instant::now();
    let out = Command::new(cargo_bin())
        .args(["build", "-q", "-p", &package(kind)])
        .current_dir(root)
        .env("CARGO_TARGET_DIR", target)
        .output()
        .expect("cargo runs");
    let took = started.elapsed();
    assert!(out.status.success(), "building {}:\n{}", package(kind), String::from_utf8_lossy(&out.stderr));
    took
}

fn cargo_bin() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn rustc_version() -> String {
    let out = Command::new("rustc").arg("--version").output().map(|o| o.stdout).unwrap_or_default();
    String::from_utf8_lossy(&out).trim().trim_start_matches("rustc ").to_owned()
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"))
}

fn package(kind: Kind) -> String {
    format!("expansion-{}", kind.name())
}

/// A workspace of the two crates, on this crate's lock file (the same
/// dependency versions as its own build).
fn write_workspace(root: &Path, repo: &Path, fns: usize) {
    std::fs::create_dir_all(root).expect("the bench's directory");
    let repo = repo.canonicalize().expect("the crate's checkout");
    std::fs::write(
        root.join("Cargo.toml"),
        "[workspace]\nmembers = [\"plain\", \"annotated\", \"one\", \"shared\"]\nresolver = \"3\"\n\n\
         [profile.dev]\n# The default dev profile, written out: what a newcomer builds with.\n\
         debug = true\nincremental = true\n",
    )
    .expect("workspace manifest");
    let lock = repo.join("Cargo.lock");
    if lock.exists() && !root.join("Cargo.lock").exists() {
        std::fs::copy(lock, root.join("Cargo.lock")).expect("lock file");
    }
    for kind in KINDS {
        let dir = root.join(kind.name());
        std::fs::create_dir_all(dir.join("src")).expect("crate directory");
        let manifest = format!(
            "[package]\nname = \"{}\"\nversion = \"0.0.0\"\nedition = \"2024\"\npublish = false\n\n\
             [dependencies]\n\
             idempotency = {{ path = {:?}, default-features = false, features = [\"sqlite\"] }}\n\
             serde = {{ version = \"1\", features = [\"derive\"] }}\n\
             sqlx = {{ version = \"0.9\", default-features = false, features = [\"runtime-tokio\", \"sqlite\"] }}\n\
             tokio = {{ version = \"1\", default-features = false, features = [\"macros\", \"rt-multi-thread\"] }}\n",
            package(kind),
            repo.display().to_string()
        );
        std::fs::write(dir.join("Cargo.toml"), manifest).expect("crate manifest");
        write_crate(root, kind, fns, 0);
    }
}

/// The crate's one file: `fns` payment-like fns, each with its own result
/// type, and a `main` that calls every one (so each is built and linked).
/// `edit` changes the body of the middle fn only.
fn write_crate(root: &Path, kind: Kind, fns: usize, edit: usize) {
    let mut src = String::from(
        "#![allow(dead_code, unused_variables)]\n\
         use idempotency::{Idem, idempotent};\n\
         use serde::{Deserialize, Serialize};\n\
         use sqlx::{Sqlite, Transaction};\n\n\
         #[derive(Debug)]\n\
         pub enum Error { Idem(idempotency::Error), Db(sqlx::Error) }\n\
         impl From<idempotency::Error> for Error { fn from(e: idempotency::Error) -> Self { Error::Idem(e) } }\n\
         impl From<sqlx::Error> for Error { fn from(e: sqlx::Error) -> Self { Error::Db(e) } }\n\n",
    );
    for i in 0..fns {
        let note = if i == fns / 2 { format!("edit {edit}") } else { format!("fn {i}") };
        let annotated = kind != Kind::Plain && (kind != Kind::One || i == 0);
        let ret = if kind == Kind::Shared { 0 } else { i };
        let attr = if annotated {
            format!("#[idempotent(key = \"order_<order_id>_f{i}\", ttl = \"24h\", biz = \"f{i}\")]\n")
        } else {
            String::new()
        };
        write!(
            src,
            "#[derive(Debug, Serialize, Deserialize)]\n\
             pub struct Receipt{i} {{ pub order_id: i64, pub amount: i64, pub note: String }}\n\n\
             {attr}pub async fn f{i}(idem: &Idem<Sqlite>, tx: &mut Transaction<'_, Sqlite>, order_id: i64, amount: i64) \
             -> Result<Receipt{ret}, Error> {{\n\
             \x20   sqlx::query(\"UPDATE accounts SET balance = balance - ? WHERE id = ?\")\n\
             \x20       .bind(amount)\n\
             \x20       .bind(order_id)\n\
             \x20       .execute(&mut **tx)\n\
             \x20       .await?;\n\
             \x20   Ok(Receipt{ret} {{ order_id, amount, note: \"{note}\".to_owned() }})\n\
             }}\n\n"
        )
        .expect("writing to a String");
    }
    src.push_str(
        "#[tokio::main]\nasync fn main() -> Result<(), Error> {\n    let idem = Idem::sqlite_memory().await?;\n",
    );
    if kind == Kind::Plain || kind == Kind::One {
        src.push_str("    let mut tx = idem.pool().begin().await?;\n");
    }
    for i in 0..fns {
        if kind == Kind::Annotated || kind == Kind::Shared || (kind == Kind::One && i == 0) {
            writeln!(src, "    println!(\"{{:?}}\", f{i}(&idem, {i}, 100).await?);")
        } else {
            writeln!(src, "    println!(\"{{:?}}\", f{i}(&idem, &mut tx, {i}, 100).await?);")
        }
        .expect("writing to a String");
    }
    src.push_str("    Ok(())\n}\n");
    let path = root.join(kind.name()).join("src").join("main.rs");
    // Unchanged text leaves the file alone, so cargo has nothing to rebuild.
    if std::fs::read_to_string(&path).ok().as_deref() != Some(src.as_str()) {
        std::fs::write(path, src).expect("crate source");
    }
}
