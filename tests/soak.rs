//! Fault-injection soak with reconciliation, on MariaDB and PostgreSQL, each
//! with two engines (two pools) sharing a private `redis-server` that is
//! killed and restarted mid-run. The short soak runs in every `cargo test`;
//! the full ones (20,000 calls over 14,000 keys, and over 2,000) with
//! `cargo test --release --all-features --test soak -- --ignored --nocapture`.
//! Set `IDEM_SOAK_SEED` to replay a schedule. The harness is
//! `idempotency-testkit/src/soak/`.

use std::sync::Arc;

use idempotency_testkit::servers::RedisServer;
use idempotency_testkit::soak::{self, Config, RedisSetup, SoakBackend};

/// One soak of `cfg` on `B`, through a private `redis-server`.
async fn run<B: SoakBackend>(cfg: Config) {
    let Some(server) = RedisServer::start() else { return };
    let redis = RedisSetup::Single(Arc::new(server));
    soak::soak::<B>(&cfg, redis).await;
}

mod mysql {
    use idempotency_testkit::backend::MySql;
    use idempotency_testkit::soak::Config;

    use super::run;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn short_soak_keeps_exactly_once_under_faults() {
        run::<MySql>(Config::short("soak")).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    #[ignore = "minutes long: run with --release -- --ignored"]
    async fn full_soak_keeps_exactly_once_under_faults() {
        run::<MySql>(Config::full("soakfull")).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    #[ignore = "minutes long: run with --release -- --ignored"]
    async fn crowded_soak_keeps_exactly_once_under_faults() {
        run::<MySql>(Config::crowded("soakcrowd")).await;
    }
}

mod postgres {
    use idempotency_testkit::backend::Postgres;
    use idempotency_testkit::soak::Config;

    use super::run;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn short_soak_keeps_exactly_once_under_faults() {
        run::<Postgres>(Config::short("soak")).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    #[ignore = "minutes long: run with --release -- --ignored"]
    async fn full_soak_keeps_exactly_once_under_faults() {
        run::<Postgres>(Config::full("soakfull")).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    #[ignore = "minutes long: run with --release -- --ignored"]
    async fn crowded_soak_keeps_exactly_once_under_faults() {
        run::<Postgres>(Config::crowded("soakcrowd")).await;
    }
}

// The harness's own tests (schedule, fault check, reconciliation) are
// idempotency-testkit's: `idempotency-testkit/tests/harness/soak.rs`.
