//! Behaviour of `#[idempotent]` on MySQL/MariaDB (`IDEM_MYSQL_URL`), with and
//! without Redis (`IDEM_REDIS_URL`): the shared suite.

mod suite;

/// The backend the suite runs on here.
type SuiteBackend = idempotency_testkit::backend::MySql;
