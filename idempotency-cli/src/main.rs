//! `idem`: the operators' tool for the records of the `idempotency` crate.
//!
//! `status`, `show`, `list`, `forget`, `migrate`, `purge`, `reconcile` and
//! `doctor` against `IDEM_DATABASE_URL` (MySQL/MariaDB, PostgreSQL or
//! SQLite) and optionally `IDEM_REDIS_URL`; see `idem --help`. Each driver is a cargo
//! feature (`drivers.rs`); everything printed goes through `out.rs`.

mod cli;
mod commands;
mod dialect;
mod doctor;
mod drivers;
mod escape;
mod ident;
mod out;
mod redis_store;
mod store;
mod time;

use std::process::ExitCode;

use clap::Parser;

/// How a command ended, as its exit code says.
pub enum Done {
    /// 0: done; for `reconcile`, nothing found; for `doctor`, no check failed.
    Ok,
    /// 1: `reconcile` found something, a `doctor` check failed, or `forget`
    /// was not confirmed.
    Found,
    /// 2: the arguments were refused (clap's own usage errors exit 2 too).
    Usage(String),
}

/// A failure that is not the user's typing: exit code 3.
pub type Failure = Box<dyn std::error::Error + Send + Sync>;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            out::tell(&format!("idem: {e}"));
            return ExitCode::from(3);
        }
    };
    match runtime.block_on(commands::run(cli)) {
        Ok(Done::Ok) => ExitCode::SUCCESS,
        Ok(Done::Found) => ExitCode::from(1),
        Ok(Done::Usage(message)) => {
            out::tell(&format!("idem: {message}"));
            ExitCode::from(2)
        }
        // A failure may quote what the database or Redis holds: `tell`
        // escapes it.
        Err(e) => {
            out::tell(&format!("idem: {e}"));
            ExitCode::from(3)
        }
    }
}
