//! MariaDB: a private one-node Galera started with wrong settings, then
//! set right.

use super::{doctor, migrate};

/// A private one-node MariaDB Galera started wrong (a packet below the
/// result bound, a lock wait past the lease, dirty reads, reads not waiting
/// for other nodes' commits), then desynced, then set right with `SET
/// GLOBAL`.
#[tokio::test]
async fn mariadb_settings_and_galera() {
    let settings = [
        "max_allowed_packet=1M",
        "innodb_lock_wait_timeout=50",
        "transaction-isolation=READ-UNCOMMITTED",
        "wsrep_sync_wait=0",
    ];
    let Some(server) =
        tokio::task::spawn_blocking(move || idempotency_testkit::mariadb::MariaDb::start(&settings, true))
            .await
            .unwrap()
    else {
        return;
    };
    let url = server.url();
    migrate(&url);

    let wrong = doctor(&url, None, &[]);
    assert_eq!(wrong.code, 1, "{wrong:?}");
    assert_eq!(wrong.level("max_allowed_packet"), "failure");
    assert!(wrong.found("max_allowed_packet").starts_with(
        "1 MiB, below the result bound (--max-result-bytes 1 MiB) and the rest of the row: a result between 1008 KiB \
         and 1 MiB passes"
    ));
    assert_eq!(wrong.level("innodb_lock_wait_timeout"), "warning");
    assert!(wrong.found("innodb_lock_wait_timeout").starts_with("50 s: a body blocked on a row lock may outlive"));
    assert_eq!(wrong.level("isolation"), "failure");
    assert!(wrong.found("isolation").starts_with("READ-UNCOMMITTED: a duplicate can read a record"));
    assert_eq!(
        (wrong.level("galera"), wrong.found("galera")),
        ("ok", "a Galera node: Synced, Primary component of 1 node")
    );
    assert_eq!(wrong.level("wsrep_sync_wait"), "warning");
    assert!(wrong.found("wsrep_sync_wait").starts_with("0 (as a new connection gets it): the loser"));
    // A smaller result bound fits the packet.
    assert_eq!(doctor(&url, None, &["--max-result-bytes", "500000"]).level("max_allowed_packet"), "ok");

    server.client("SET GLOBAL wsrep_desync = ON").expect("desync");
    let desynced = doctor(&url, None, &[]);
    assert_eq!(desynced.level("galera"), "failure", "{desynced:?}");
    assert!(desynced.found("galera").contains(": it does not serve writes now"), "{desynced:?}");

    server
        .client(
            "SET GLOBAL wsrep_desync = OFF; SET GLOBAL max_allowed_packet = 16777216; \
             SET GLOBAL innodb_lock_wait_timeout = 10; SET GLOBAL tx_isolation = 'REPEATABLE-READ'; \
             SET GLOBAL wsrep_sync_wait = 7",
        )
        .expect("set right");
    let right = doctor(&url, None, &[]);
    assert_eq!(right.code, 0, "{right:?}");
    for check in [
        "database",
        "tables",
        "clock",
        "max_allowed_packet",
        "innodb_lock_wait_timeout",
        "isolation",
        "galera",
        "wsrep_sync_wait",
    ] {
        assert_eq!(right.level(check), "ok", "{check}: {right:?}");
    }
    assert_eq!(right.found("isolation"), "REPEATABLE-READ");
    assert_eq!(right.found("wsrep_sync_wait"), "7: reads wait until this node applied what others committed");
}
