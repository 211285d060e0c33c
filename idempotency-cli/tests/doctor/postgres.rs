//! PostgreSQL: a transaction pooler seen from the client (a private
//! PgBouncer), and the session's timeouts and isolation level through the
//! URL's options.

use idempotency_testkit::TestBackend;
use idempotency_testkit::backend::Postgres;

use super::{doctor, migrate, unique_name, url_with_database};

/// A transaction pooler shows from the client: through a private PgBouncer
/// in transaction mode without the switch, a failure; with it, ok, and
/// every other check works through it too. Directly, ok without the switch
/// and a warning with it.
#[tokio::test]
async fn a_transaction_pooler_is_seen_from_the_client() {
    let name = unique_name();
    let Some(pool) = Postgres::open_private(&name, 1).await else { return };
    let Some(bouncer) = idempotency_testkit::pgbouncer::PgBouncer::start() else { return };
    let direct = url_with_database(&idempotency_testkit::pg_url(), &name);
    migrate(&direct);
    let pooled = bouncer.url(&name);

    let without = doctor(&pooled, None, &[]);
    assert_eq!((without.code, without.level("pooler")), (1, "failure"), "{without:?}");
    assert!(
        without.found("pooler").starts_with("a transaction pooler in front of PostgreSQL (this connection's server"),
        "{without:?}"
    );
    assert!(without.fix("pooler").starts_with("build the engines with Builder::transaction_pooler(true)"));
    let with = doctor(&pooled, None, &["--transaction-pooler"]);
    assert_eq!(with.level("pooler"), "ok", "{with:?}");
    assert!(with.found("pooler").starts_with("a transaction pooler, and --transaction-pooler says so"), "{with:?}");
    for check in ["database", "tables", "clock", "idle_in_transaction", "isolation", "expired_records"] {
        assert_eq!(with.level(check), "ok", "{check} through PgBouncer: {with:?}");
    }

    let plain = doctor(&direct, None, &[]);
    assert_eq!(
        (plain.level("pooler"), plain.found("pooler")),
        ("ok", "no transaction pooler: one server session across transactions")
    );
    let needless = doctor(&direct, None, &["--transaction-pooler"]);
    assert_eq!(needless.level("pooler"), "warning", "{needless:?}");
    assert!(needless.found("pooler").starts_with("--transaction-pooler is given, but this connection kept one server"));
    drop(bouncer);
    Postgres::drop_private(pool, &name).await;
}

/// `lock_timeout`, `idle_in_transaction_session_timeout` and the default
/// isolation level, set per session through the URL's options: wrong, then
/// right.
#[tokio::test]
async fn postgres_settings_against_the_lease() {
    if Postgres::open("doctor", 1).await.is_none() {
        return;
    }
    let base = idempotency_testkit::pg_url();
    let wrong = format!(
        "{base}?options[lock_timeout]=0&options[idle_in_transaction_session_timeout]=5000\
         &options[default_transaction_isolation]=serializable"
    );
    let bad = doctor(&wrong, None, &[]);
    assert_eq!(bad.level("lock_timeout"), "warning", "{bad:?}");
    assert!(bad.found("lock_timeout").starts_with("0 (no bound): a body blocked on a row lock may outlive"));
    assert_eq!(bad.level("idle_in_transaction"), "warning");
    assert!(bad.found("idle_in_transaction").starts_with(
        "idle_in_transaction_session_timeout 5 s is below the lease (--lease 30 s): a body waiting inside"
    ));
    assert_eq!(bad.level("isolation"), "warning");
    assert!(bad.found("isolation").starts_with("default_transaction_isolation serializable: "));
    assert_eq!(bad.code, 0, "warnings");

    let right = format!(
        "{base}?options[lock_timeout]=10000&options[idle_in_transaction_session_timeout]=0\
         &options[default_transaction_isolation]=read%20committed"
    );
    let good = doctor(&right, None, &[]);
    assert_eq!(
        good.found("lock_timeout"),
        "10 s: a body's lock wait ends within the lease (30 s; the engines bound their own)",
        "{good:?}"
    );
    assert_eq!(good.level("idle_in_transaction"), "ok");
    assert_eq!(good.found("isolation"), "default_transaction_isolation read committed");
    // The lease is the engines': a longer one makes 5 s fine, 10 s not.
    let longer = doctor(&right, None, &["--lease", "5s"]);
    assert_eq!(longer.level("lock_timeout"), "warning", "{longer:?}");
}
