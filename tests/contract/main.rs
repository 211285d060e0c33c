//! The contract matrix: the "What callers see" table of
//! `docs/guarantees.md` as eight clauses (`clauses.rs`), run over every
//! combination users configure (`table.rs`): backend × gate × mode ×
//! options × entry point, one test per cell, named by its combination
//! (`mysql::redis::join::record_errors::axum`).
//!
//! - A cell runs every clause that applies to it, each on fresh engines and
//!   keys of its own, and fails with the list of the clauses that failed.
//! - A run runs a seeded slice (`slice.rs`): the other cells are listed as
//!   ignored. `IDEM_MATRIX=all`, or `--include-ignored`, runs them all:
//!   `cargo test --all-features --test contract -- --include-ignored`.
//! - The harness is libtest-mimic's: `cargo test` and `cargo nextest` list,
//!   filter and run the cells as tests (nextest one per process: a cell
//!   then starts the servers it needs, a Redis Cluster, a PgBouncer, once).

mod backends;
mod clauses;
mod entries;
mod fns;
mod gates;
mod processes;
mod rig;
mod script;
mod slice;
mod table;

use std::any::Any;
use std::sync::{Arc, OnceLock};

use libtest_mimic::{Arguments, Failed, Trial};

use crate::backends::Store;
use crate::fns::{MysqlFns, PostgresFns, SqliteFns};
use crate::rig::Rig;
use crate::slice::Plan;
use crate::table::{Backend, Combo};

/// One runtime for the process: the shared pools and servers live on it,
/// and every cell runs on it (a cell's thread blocks on its future).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime")
    })
}

fn main() {
    let args = Arguments::from_args();
    let cells = table::cells();
    let plan = Plan::from_env(&cells);
    if !args.list {
        eprintln!(
            "contract matrix: {} cells ({} combinations, the rest excluded in table.rs); {}",
            cells.len(),
            table::combinations(),
            if plan.all {
                "IDEM_MATRIX=all: every cell".to_owned()
            } else {
                format!(
                    "IDEM_MATRIX_SEED={} slices {} of them (the rest ignored; --include-ignored or IDEM_MATRIX=all runs all)",
                    plan.seed,
                    plan.slice_len()
                )
            }
        );
    }
    let mut trials: Vec<Trial> = cells
        .iter()
        .map(|&combo| Trial::test(combo.to_string(), move || cell(combo)).with_ignored_flag(!plan.runs(combo)))
        .collect();
    trials.push(Trial::test("slice::covers_every_pair_of_values", move || Ok(slice::check(&cells)?)));
    let conclusion = libtest_mimic::run(&args, trials);
    runtime().block_on(async { processes::stop_all() });
    conclusion.exit();
}

/// Runs one cell on the process's runtime.
fn cell(combo: Combo) -> Result<(), Failed> {
    runtime().block_on(async move {
        match combo.backend {
            Backend::Sqlite => run::<SqliteFns>(combo).await,
            Backend::Mysql => run::<MysqlFns>(combo).await,
            Backend::Postgres | Backend::PgBouncer => run::<PostgresFns>(combo).await,
        }
    })
}

/// Every clause that applies to `combo`, each in a task of its own (a
/// failing one does not stop the others); fails with the list of those that failed.
async fn run<F: Store>(combo: Combo) -> Result<(), Failed> {
    let Some(database) = F::database(combo.backend).await else { return Ok(()) };
    let rig = Arc::new(Rig::<F>::new(combo, database));
    let mut failed = Vec::new();
    for (n, name) in clauses::CLAUSES {
        if clauses::applies(n, combo).is_err() {
            continue;
        }
        match tokio::spawn(clauses::run(n, Arc::clone(&rig))).await {
            Ok(true) => {}
            // A server the clause needs does not answer: `skipped: ...` was printed.
            Ok(false) => return Ok(()),
            Err(e) => failed.push(format!("clause {n} ({name}): {}", panic_text(e.into_panic()))),
        }
    }
    if failed.is_empty() {
        return Ok(());
    }
    let defect = table::known_defect(combo).map(|why| format!("\nknown defect: {why}")).unwrap_or_default();
    Err(format!("{}{defect}", failed.join("\n")).into())
}

fn panic_text(panic: Box<dyn Any + Send>) -> String {
    match panic.downcast::<String>() {
        Ok(text) => *text,
        Err(panic) => panic.downcast_ref::<&str>().map_or_else(|| "a panic".to_owned(), |s| (*s).to_owned()),
    }
}
