//! A call that fails on the database logs its cause once, for the operator
//! (the caller is only told whether to retry): `biz`, where it failed
//! (`by`: the body's statements or the engine's), the database's code and
//! message, and never the key. Read from the lines a subscriber kept, on
//! each database, with and without Redis; a call that did not fail on the
//! database (an answer, a body's own error, a replay) logs none.

use idempotency::{BusinessError, Error, Idem, idempotent};
use idempotency_testkit::logs::{Line, Logs};
use idempotency_testkit::{TestBackend, unique};
use serde::{Deserialize, Serialize};
use sqlx::Transaction;

use super::fixture::{Probe, Redis, engine, with_and_without_redis};
use super::{B, Db};

const REFUSED: &str = "idempotent call failed on the database; the caller is told not to retry";
const RETRY: &str = "idempotent call failed on the database; the caller is told to retry";

/// A table made earlier, in another shape than the body's statements expect.
const OLD_SHAPE: &str = "CREATE TABLE IF NOT EXISTS idem_test_old_shape (id BIGINT NOT NULL)";
/// A business table unique on the key the body writes.
const UNIQUE_KEYS: &str = "CREATE TABLE IF NOT EXISTS idem_test_unique_keys (k VARCHAR(255) NOT NULL UNIQUE)";

/// How the body fails, or not.
#[derive(Clone, Copy, Debug)]
enum Body {
    /// Inserts a column its table does not have.
    WrongShape,
    /// Inserts its key twice into a column unique on it: the database's
    /// message (MariaDB's) quotes the key.
    KeyTwice,
    /// Declines: an answer its error type records.
    Declines,
    /// Fails on its own, no database involved.
    OwnError,
    /// Succeeds.
    Pays,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Declined;

#[derive(Debug)]
#[allow(dead_code)] // shown through Debug
enum PayError {
    Idem(Error),
    Declined(Declined),
    Own,
}

impl From<Error> for PayError {
    fn from(e: Error) -> Self {
        PayError::Idem(e)
    }
}

/// As the HTTP guide's error type: a `sqlx::Error` goes through `idempotency::Error`.
impl From<sqlx::Error> for PayError {
    fn from(e: sqlx::Error) -> Self {
        PayError::Idem(e.into())
    }
}

impl BusinessError for PayError {
    type Record = Declined;
    fn recorded(&self) -> Option<Declined> {
        match self {
            PayError::Declined(declined) => Some(declined.clone()),
            _ => None,
        }
    }
    fn replayed(record: Declined) -> Self {
        PayError::Declined(record)
    }
}

fn insert_key() -> &'static str {
    if B::NAME == "postgres" {
        "INSERT INTO idem_test_unique_keys (k) VALUES ($1)"
    } else {
        "INSERT INTO idem_test_unique_keys (k) VALUES (?)"
    }
}

#[idempotent(key = "<k>", ttl = "1h", biz = "t_failure_log", record_errors)]
async fn pay(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    #[idem(skip)] body: Body,
    #[idem(skip)] probe: &Probe,
) -> Result<u32, PayError> {
    probe.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    match body {
        Body::WrongShape => {
            sqlx::raw_sql("INSERT INTO idem_test_old_shape (id, user_id) VALUES (1, 'alice')")
                .execute(&mut **tx)
                .await?;
        }
        Body::KeyTwice => {
            sqlx::query(insert_key()).bind(&k).execute(&mut **tx).await?;
            sqlx::query(insert_key()).bind(&k).execute(&mut **tx).await?;
        }
        Body::Declines => return Err(PayError::Declined(Declined)),
        Body::OwnError => return Err(PayError::Own),
        Body::Pays => {}
    }
    Ok(1)
}

/// `pay` inside the caller's transaction (`join`).
#[idempotent(key = "<k>", ttl = "1h", biz = "t_failure_log", join)]
async fn pay_in(
    idem: &Idem<Db>,
    tx: &mut Transaction<'_, Db>,
    k: String,
    #[idem(skip)] probe: &Probe,
) -> Result<u32, PayError> {
    probe.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    sqlx::raw_sql("INSERT INTO idem_test_old_shape (id, user_id) VALUES (1, 'alice')").execute(&mut **tx).await?;
    Ok(1)
}

/// The database's code for a column missing from a table (SQLSTATE; SQLite's result code).
fn unknown_column_code() -> &'static str {
    match B::NAME {
        "mysql" => "42S22",
        "postgres" => "42703",
        _ => "1",
    }
}

/// The lines logged as the calls of `during` ran, with either message.
async fn logged<F: std::future::Future>(during: F) -> (F::Output, Vec<Line>) {
    let logs = Logs::default();
    let output = {
        let _guard = tracing::subscriber::set_default(logs.clone());
        during.await
    };
    let mut lines = logs.with_message(REFUSED);
    lines.extend(logs.with_message(RETRY));
    (output, lines)
}

/// The only line: at `error`, of this `biz`, by the body, with the code and
/// the database's message, and not a run of the key anywhere in it.
fn the_line_says(lines: &[Line], k: &str, by: &str, code: &str, says: &str) {
    assert_eq!(lines.len(), 1, "{lines:?}");
    let line = &lines[0];
    assert_eq!(line.level, tracing::Level::ERROR, "{line:?}");
    assert_eq!((line.field("biz"), line.field("by"), line.field("code")), ("t_failure_log", by, code), "{line:?}");
    assert!(line.field("error").contains(says), "{line:?}");
    // `unique` keys end in digits the database's message would quote.
    assert!(!line.text().contains(k) && !line.text().contains(&k[k.len() - 8..]), "the key is logged: {line:?}");
}

/// Creates the bodies' tables if missing; on PostgreSQL under a lock, as
/// concurrent `CREATE TABLE IF NOT EXISTS` can collide in its catalog.
async fn business_tables(idem: &Idem<Db>) {
    let mut tx = idem.pool().begin().await.expect("begin");
    if B::NAME == "postgres" {
        sqlx::raw_sql("SELECT pg_advisory_xact_lock(7306232718293615)").execute(&mut *tx).await.expect("lock");
    }
    for ddl in [OLD_SHAPE, UNIQUE_KEYS] {
        sqlx::raw_sql(ddl).execute(&mut *tx).await.expect("business table");
    }
    tx.commit().await.expect("commit");
}

async fn a_bodys_database_failure_is_logged_once(redis: Redis) {
    let Some(idem) = engine(&unique("db"), 3, redis).await else { return };
    business_tables(&idem).await;
    let probe = Probe::default();

    let k = unique("failure-log-shape");
    let (answer, lines) = logged(pay(&idem, k.clone(), Body::WrongShape, &probe)).await;
    assert!(matches!(answer, Err(PayError::Idem(Error::StorageRefused(_)))), "{answer:?}");
    the_line_says(&lines, &k, "body", unknown_column_code(), "user_id");

    let k = unique("failure-log-key-twice");
    let (answer, lines) = logged(pay(&idem, k.clone(), Body::KeyTwice, &probe)).await;
    assert!(matches!(answer, Err(PayError::Idem(Error::StorageRefused(_)))), "{answer:?}");
    let code = match B::NAME {
        "mysql" => "23000",
        "postgres" => "23505",
        _ => "2067",
    };
    // MariaDB quotes the entry: the key's place in it is shown, not the key.
    let says = if B::NAME == "mysql" { "Duplicate entry '<key>'" } else { "idem_test_unique_keys" };
    the_line_says(&lines, &k, "body", code, says);

    // Inside the caller's transaction, the same.
    let k = unique("failure-log-joined");
    let mut tx = idem.pool().begin().await.expect("begin");
    let (answer, lines) = logged(pay_in(&idem, &mut tx, k.clone(), &probe)).await;
    assert!(matches!(answer, Err(PayError::Idem(Error::StorageRefused(_)))), "{answer:?}");
    the_line_says(&lines, &k, "body", unknown_column_code(), "user_id");
    tx.rollback().await.expect("rollback");

    // Not failures on the database: nothing logged, whatever happened before.
    for body in [Body::Declines, Body::OwnError, Body::Pays] {
        let k = unique("failure-log-none");
        let (first, lines) = logged(pay(&idem, k.clone(), body, &probe)).await;
        assert!(lines.is_empty(), "{body:?}: {lines:?}");
        if matches!(body, Body::Declines | Body::Pays) {
            let (again, lines) = logged(pay(&idem, k.clone(), body, &probe)).await;
            assert_eq!(format!("{again:?}"), format!("{first:?}"), "{body:?} replays");
            assert!(lines.is_empty(), "{body:?} replayed: {lines:?}");
        }
    }
    // Three failing bodies, three that ran, two replays.
    assert_eq!(probe.runs.load(std::sync::atomic::Ordering::SeqCst), 6);
}

with_and_without_redis!(
    #[tokio::test(flavor = "current_thread")]
    a_bodys_database_failure_is_logged_once_with_its_code_and_without_the_key,
    a_bodys_database_failure_is_logged_once_with_its_code_and_without_the_key_with_redis
        => a_bodys_database_failure_is_logged_once
);

/// The engine's own statements: tables never made (`migrate` forgotten) is
/// an `error` by the engine with the database's code; a database out of
/// reach is a `warn`, without one (no database answered).
#[tokio::test(flavor = "current_thread")]
async fn the_engines_own_failures_are_logged_once() {
    let name = unique("idem_failure_log").replace('-', "_");
    let Some(pool) = B::open_private(&name, 2).await else { return };
    let idem = Idem::new(pool.clone()); // never migrated
    let probe = Probe::default();
    let k = unique("failure-log-engine");
    let (answer, lines) = logged(pay(&idem, k.clone(), Body::Pays, &probe)).await;
    assert!(matches!(answer, Err(PayError::Idem(Error::NotMigrated(_)))), "{answer:?}");
    let code = match B::NAME {
        "mysql" => "42S02",
        "postgres" => "42P01",
        _ => "1",
    };
    the_line_says(&lines, &k, "engine", code, "idem_record");
    B::drop_private(pool, &name).await;

    let idem = Idem::new(B::dead_pool());
    let (answer, lines) = logged(pay(&idem, k.clone(), Body::Pays, &probe)).await;
    assert!(matches!(answer, Err(PayError::Idem(Error::Storage(_)))), "{answer:?}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    let line = &lines[0];
    assert_eq!(line.level, tracing::Level::WARN, "{line:?}");
    // SQLite's file cannot be opened (its result code); no server answers the others.
    let (code, says) = match B::NAME {
        "sqlite" => ("14", "unable to open database file"),
        _ => ("", "pool timed out"),
    };
    assert_eq!(
        (line.field("biz"), line.field("by"), line.field("code")),
        ("t_failure_log", "engine", code),
        "{line:?}"
    );
    assert!(line.field("error").contains(says), "{line:?}");
    assert_eq!(probe.runs.load(std::sync::atomic::Ordering::SeqCst), 0, "no body ran");
}
