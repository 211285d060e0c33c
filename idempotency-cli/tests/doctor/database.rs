//! The checks every database has: its tables and their version, the
//! backlogs (expired records, outbox events), and its clock against this
//! host's, on MariaDB, PostgreSQL and SQLite.

use std::process::Command;

use idempotency_testkit::TestBackend;
use idempotency_testkit::backend::{MySql, Postgres, Sqlite};

use super::{DAY, Dialect, doctor, doctor_with, exec, idem, migrate, now_ms, unique_name, url_with_database};

/// The per-database checks, wrong then right, on a database of its own.
macro_rules! tables_and_backlogs {
    ($test:ident, $backend:ty, $dialect:expr, $url:expr) => {
        #[tokio::test]
        async fn $test() {
            type B = $backend;
            let name = unique_name();
            let Some(pool) = B::open_private(&name, 2).await else { return };
            let url: String = ($url)(&name);
            let d: Dialect = $dialect;

            // No tables: the engines never migrated it.
            let bare = doctor(&url, None, &[]);
            assert_eq!((bare.code, bare.level("tables")), (1, "failure"), "{bare:?}");
            assert_eq!(bare.found("tables"), "none of idem's tables (idem_record, idem_meta, idem_token)");
            assert!(bare.fix("tables").starts_with("run `idem migrate`"), "{bare:?}");
            assert_eq!(bare.level("expired_records"), "absent", "nothing to count");

            // An earlier version's record table.
            sqlx::raw_sql(B::RECORD_TABLE_BEFORE_DIGEST).execute(&pool).await.expect("earlier table");
            let stale = doctor(&url, None, &[]);
            assert_eq!((stale.code, stale.level("tables")), (1, "failure"), "{stale:?}");
            assert_eq!(
                stale.found("tables"),
                "idem_record is an earlier version's: no column key_digest, unique on (biz_type,idem_key)"
            );
            assert!(stale.fix("tables").starts_with("stop the earlier version's engines, then run `idem migrate`"));

            // Migrated (by `idem migrate`, then an engine with the outbox):
            // this version's tables.
            migrate(&url);
            let engine = idempotency_runtime::Idem::new(pool.clone());
            engine.migrate().await.expect("migrate with the outbox");
            let ns = engine.redis_namespace().await.expect("namespace").expect("recorded").as_str().to_owned();
            let right = doctor(&url, None, &[]);
            assert_eq!(right.level("tables"), "ok", "{right:?}");
            let aggregate = if d == Dialect::Sqlite { "" } else { "idem_outbox_aggregate, " };
            assert_eq!(
                right.found("tables"),
                format!(
                    "idem_record (unique on key_digest), idem_meta, idem_token: this version's; namespace {ns}; \
                     also idem_outbox, {aggregate}idem_call, idem_step"
                )
            );
            assert_eq!((right.level("expired_records"), right.found("expired_records")), ("ok", "none past its ttl"));
            assert_eq!((right.level("outbox"), right.found("outbox")), ("ok", "nothing pending, none dead"));

            // Records expired two days ago, no purge since: a backlog.
            let now = now_ms();
            for (i, expires) in [now - 2 * DAY - 3_600_000, now - 2 * DAY, now + DAY].into_iter().enumerate() {
                exec(&url, &d.record("doc", &format!("k{i}"), expires)).await;
            }
            let backlog = doctor(&url, None, &[]);
            assert_eq!(backlog.level("expired_records"), "warning", "{backlog:?}");
            assert!(
                backlog.found("expired_records").starts_with(
                    "2 records past their ttl not purged, the oldest expired 2 d ago (more than --purge-every 24 h): no \
                     purge runs"
                ),
                "{backlog:?}"
            );
            assert_eq!(backlog.code, 0, "a warning fails nothing");
            assert_eq!(doctor(&url, None, &["--strict"]).code, 1, "unless --strict");
            assert_eq!(doctor(&url, None, &["--purge-every", "3d"]).level("expired_records"), "ok");
            let purged = idem(&[("IDEM_DATABASE_URL", &url)], &["purge"]);
            assert!(purged.status.success());
            let recent = now_ms() - 60_000;
            exec(&url, &d.record("doc", "k9", recent)).await;
            let after = doctor(&url, None, &[]);
            assert_eq!(after.level("expired_records"), "ok", "{after:?}");
            assert!(after.found("expired_records").starts_with("1 record past their ttl, the oldest for "), "{after:?}");

            // Outbox events: pending for an hour, then one dead.
            let mut tx = pool.begin().await.unwrap();
            for n in 0..2 {
                let id = idempotency_runtime::outbox::MessageId::derive("doc", &name, n).unwrap();
                let event = idempotency_runtime::outbox::Event::json("doc.events", &n).unwrap().id(id);
                idempotency_runtime::outbox::queue(&mut tx, event).await.expect("queue");
            }
            tx.commit().await.unwrap();
            assert_eq!(doctor(&url, None, &[]).level("outbox"), "ok", "just queued");
            exec(&url, "UPDATE idem_outbox SET created_at = created_at - 3600000").await;
            let stuck = doctor(&url, None, &[]);
            assert_eq!(stuck.level("outbox"), "warning", "{stuck:?}");
            assert!(
                stuck.found("outbox").starts_with(
                    "2 events pending, the oldest queued 60 min ago (more than --outbox-stuck-after 10 min): no relay runs"
                ),
                "{stuck:?}"
            );
            exec(&url, "UPDATE idem_outbox SET status = 2 WHERE id = (SELECT MIN(id) FROM (SELECT id FROM idem_outbox) AS o)")
                .await;
            let dead = doctor(&url, None, &[]);
            assert_eq!((dead.code, dead.level("outbox")), (1, "failure"), "{dead:?}");
            assert!(dead.found("outbox").starts_with("1 event dead"), "{dead:?}");
            assert!(dead.found("outbox").ends_with("never sent; 1 pending"), "{dead:?}");
            exec(&url, "UPDATE idem_outbox SET status = 1, sent_at = created_at").await;
            assert_eq!(doctor(&url, None, &[]).found("outbox"), "nothing pending, none dead");

            B::drop_private(pool, &name).await;
        }
    };
}

tables_and_backlogs!(tables_and_backlogs_on_mariadb, MySql, Dialect::MySql, |name: &str| url_with_database(
    &idempotency_testkit::mysql_url(),
    name
));
tables_and_backlogs!(tables_and_backlogs_on_postgres, Postgres, Dialect::Postgres, |name: &str| url_with_database(
    &idempotency_testkit::pg_url(),
    name
));
tables_and_backlogs!(tables_and_backlogs_on_sqlite, Sqlite, Dialect::Sqlite, |name: &str| format!(
    "sqlite:{}",
    Sqlite::dir().join(format!("{name}.db")).display()
));

/// Whether libfaketime runs here (Debian's `faketime`).
fn faketime() -> bool {
    let runs = Command::new("faketime").args(["-f", "+0", "true"]).status().is_ok_and(|s| s.success());
    if !runs {
        assert!(!idempotency_testkit::services_required(), "faketime not installed and IDEM_REQUIRE_SERVICES=1");
        println!("skipped: faketime not installed");
    }
    runs
}

/// This host's clock ten minutes ahead (libfaketime): the database's is
/// behind it by as much; on time, within a second.
async fn clock(url: &str) {
    if !faketime() {
        return;
    }
    let on_time = doctor(url, None, &[]);
    assert_eq!(on_time.level("clock"), "ok", "{on_time:?}");
    assert!(on_time.found("clock").starts_with("the database's is within "), "{on_time:?}");
    let ahead = doctor_with(Some(&["faketime", "-f", "+10m"]), &[("IDEM_DATABASE_URL", url)], &[]);
    assert_eq!(ahead.level("clock"), "warning", "{ahead:?}");
    assert!(ahead.found("clock").starts_with("the database's clock is 10 min behind this host's: "), "{ahead:?}");
    assert_eq!(ahead.fix("clock"), "keep the database's servers and the hosts in NTP");
}

#[tokio::test]
async fn clock_against_this_hosts_on_mariadb() {
    if MySql::open("doctor", 1).await.is_none() {
        return;
    }
    clock(&idempotency_testkit::mysql_url()).await;
}

#[tokio::test]
async fn clock_against_this_hosts_on_postgres() {
    if Postgres::open("doctor", 1).await.is_none() {
        return;
    }
    clock(&idempotency_testkit::pg_url()).await;
}
