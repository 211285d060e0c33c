//! Partitions on a schedule, checked by a history: four engine processes
//! (this binary again, running the same test as an engine) call one annotated
//! fn over shared keys through proxies to a private `redis-server` and a
//! private database, while a seeded nemesis black-holes, delays, loses the
//! replies of and resets their paths; then the history of every call and
//! the final tables go through the checker. The short run on MariaDB
//! (2,800 first calls, about 30 s) runs in every `cargo test`; the full
//! ones (20,000 first calls, about 3 minutes) with
//! `cargo test --release --all-features --test nemesis -- --ignored --nocapture full_`.
//! The seed is one of a fixed set (printed; `IDEM_NEMESIS_SEED` replays a
//! schedule, `IDEM_NEMESIS_SEED=fresh` draws one); the `_on_a_fresh_seed`
//! runs explore with `-- --ignored`. The harness is
//! `idempotency-testkit/src/nemesis/`.

use idempotency_testkit::nemesis::{self, Config, NemesisBackend};

/// Runs `cfg` on `B` from the test named `test`; started again by it as an
/// engine process (the children are this same test), plays that instead,
/// so no entry point of its own passes as a test.
fn run<B: NemesisBackend>(test: &str, cfg: impl FnOnce() -> Config) {
    if nemesis::child_process() {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(nemesis::run::<B>(&cfg(), test));
}

/// A short run on a seed from the clock (printed): exploration, beside
/// the fixed seeds every default run takes.
fn explore(label: &'static str) -> Config {
    Config { seed: idempotency_testkit::soak::fresh_seed(), ..Config::short(label) }
}

mod mysql {
    use idempotency_testkit::backend::MySql;
    use idempotency_testkit::nemesis::Config;

    use super::{explore, run};

    #[test]
    fn short_partitions_keep_exactly_once() {
        run::<MySql>("mysql::short_partitions_keep_exactly_once", || Config::short("short"));
    }

    #[test]
    #[ignore = "minutes long: run with --release -- --ignored"]
    fn full_partitions_keep_exactly_once() {
        run::<MySql>("mysql::full_partitions_keep_exactly_once", || Config::full("full"));
    }

    #[test]
    #[ignore = "exploration on a fresh seed: run with -- --ignored"]
    fn short_partitions_on_a_fresh_seed() {
        run::<MySql>("mysql::short_partitions_on_a_fresh_seed", || explore("explore"));
    }
}

mod postgres {
    use idempotency_testkit::backend::Postgres;
    use idempotency_testkit::nemesis::Config;

    use super::{explore, run};

    /// Regression: found the victim of a deadlock between a call without a
    /// claim and one with a claim answered with the body's error while the
    /// winner committed, about one run in ten (docs/guarantees.md,
    /// "Partitions on a schedule").
    #[test]
    fn short_partitions_keep_exactly_once() {
        run::<Postgres>("postgres::short_partitions_keep_exactly_once", || Config::short("short"));
    }

    #[test]
    #[ignore = "minutes long: run with --release -- --ignored"]
    fn full_partitions_keep_exactly_once() {
        run::<Postgres>("postgres::full_partitions_keep_exactly_once", || Config::full("full"));
    }

    #[test]
    #[ignore = "exploration on a fresh seed: run with -- --ignored"]
    fn short_partitions_on_a_fresh_seed() {
        run::<Postgres>("postgres::short_partitions_on_a_fresh_seed", || explore("explore"));
    }
}

// The harness's own tests (its proxy, checker and schedule) are
// idempotency-testkit's: `idempotency-testkit/tests/harness/`.
