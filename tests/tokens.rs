//! Issued one-time tokens (`Idem::tokens`) against the real servers: the
//! same suite on SQLite, MariaDB and PostgreSQL, each with the tokens in
//! Redis through `GETDEL`, in Redis through the Lua script, and in the
//! database (no Redis). Then what only Redis has (the key layout, the Lua
//! fallback on a server without `GETDEL`, an outage), and HTTP end to end:
//! `GET /orders/{id}/pay-token`, then `POST /orders/{id}/pay` with
//! `Idempotency-Token`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotency::{Backend, Consumption, Idem, Outcome, Status, TokenError, idempotent, observe, token::Refusal};
use idempotency_testkit::servers::{RedisCluster, RedisServer};
use idempotency_testkit::unique;
use sqlx::{Pool, Transaction};
use tokio::sync::{Barrier, mpsc, watch};

/// The action of the tokens and of the calls they key.
const BIZ: &str = "tok_test_pay";
/// How long a duplicate without a Redis claim waits for the running call
/// (in memory) before it answers `InProgress`.
const LOCK_WAIT: Duration = Duration::from_millis(500);
/// Tokens meant to stay live through a test.
const LONG: Duration = Duration::from_secs(600);
/// Tokens meant to expire during a test: long enough to be consumed first
/// on a loaded machine, short enough to wait out.
const SHORT: Duration = Duration::from_secs(2);
/// Submits racing one token.
const CROWD: usize = 100;
/// How long a consumed token answers "already used" here (the engine's
/// default is a day; the tests' keys need not outlive them that long).
const USED_FOR: Duration = Duration::from_secs(900);

/// What the guarded bodies of one test do and saw.
struct Probe {
    /// Bodies that started.
    runs: AtomicUsize,
    /// The next body fails (once).
    fail_next: AtomicBool,
    /// Bodies wait here until it is open.
    open: watch::Sender<bool>,
    /// Told each time a body starts.
    started: mpsc::UnboundedSender<()>,
}

impl Probe {
    fn new(open: bool) -> (Arc<Self>, mpsc::UnboundedReceiver<()>) {
        let (started, starts) = mpsc::unbounded_channel();
        let probe = Probe {
            runs: AtomicUsize::new(0),
            fail_next: AtomicBool::new(false),
            open: watch::Sender::new(open),
            started,
        };
        (Arc::new(probe), starts)
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// A body's part: counted, held while closed, failing when told to.
    async fn body(&self) -> Result<(), TestError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let _ = self.started.send(());
        let mut open = self.open.subscribe();
        // Bounded: a test that never opens it fails on its answers instead of hanging.
        let _ = tokio::time::timeout(Duration::from_secs(30), open.wait_for(|open| *open)).await;
        if self.fail_next.swap(false, Ordering::SeqCst) { Err(TestError::Body) } else { Ok(()) }
    }
}

#[derive(Debug)]
enum TestError {
    Idem(idempotency::Error),
    Token(TokenError),
    /// The body failed (nothing recorded).
    Body,
}

impl From<idempotency::Error> for TestError {
    fn from(e: idempotency::Error) -> Self {
        TestError::Idem(e)
    }
}

impl From<TokenError> for TestError {
    fn from(e: TokenError) -> Self {
        TestError::Token(e)
    }
}

/// Where the tokens of one run of the suite live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Redis, consumed with `GETDEL`.
    Getdel,
    /// Redis, consumed with the Lua script (`Builder::token_consume_with_lua`).
    Lua,
    /// The `idem_token` table: no Redis.
    Database,
}

/// An engine over `pool` with its tokens in `place`, migrated; `None` when
/// Redis is needed and does not answer.
async fn engine<DB: Backend>(pool: Pool<DB>, place: Place) -> Option<Idem<DB>> {
    let builder = Idem::builder(pool).lock_wait(LOCK_WAIT).token_used_for(USED_FOR);
    let builder = match place {
        Place::Database => builder,
        Place::Getdel => builder.redis(idempotency_testkit::redis_client().await?),
        Place::Lua => builder.redis(idempotency_testkit::redis_client().await?).token_consume_with_lua(true),
    };
    let idem = builder.build();
    idem.migrate().await.expect("migrate");
    Some(idem)
}

/// A SQLite file of its own (WAL, so reads go on beside a writer), deleted
/// with this guard.
struct LiteFile(std::path::PathBuf);

impl Drop for LiteFile {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.0.display()));
        }
    }
}

async fn sqlite_pool() -> Option<(Pool<sqlx::Sqlite>, LiteFile)> {
    let file = std::env::temp_dir().join(format!("{}.db", unique("idem-tokens")));
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&file)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(options)
        .await
        .expect("sqlite file");
    Some((pool, LiteFile(file)))
}

async fn mysql_pool() -> Option<(Pool<sqlx::MySql>, ())> {
    let pool = idempotency_testkit::reach("mysql", || async {
        let options = sqlx::mysql::MySqlPoolOptions::new().max_connections(10).acquire_timeout(Duration::from_secs(60));
        options.connect(&idempotency_testkit::mysql_url()).await.ok()
    })
    .await?;
    Some((pool, ()))
}

async fn pg_pool() -> Option<(Pool<sqlx::Postgres>, ())> {
    let pool = idempotency_testkit::reach("postgres", || async {
        let options = sqlx::postgres::PgPoolOptions::new().max_connections(10).acquire_timeout(Duration::from_secs(60));
        options.connect(&idempotency_testkit::pg_url()).await.ok()
    })
    .await?;
    Some((pool, ()))
}

/// Waits until this process's clock is past `at_ms` (a token's expiry):
/// the moment the engine compares expiries with.
async fn wait_past(at_ms: u64) {
    loop {
        let now = u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis()).unwrap();
        if now > at_ms {
            return;
        }
        tokio::time::sleep(Duration::from_millis(at_ms + 1 - now)).await;
    }
}

/// A well-formed token nobody issued.
fn forged() -> String {
    let seed = unique("f");
    let mut token: String = seed.chars().rev().filter(char::is_ascii_alphanumeric).take(32).collect();
    while token.len() < 32 {
        token.push('Q');
    }
    token
}

/// One test per check and place: `async fn $check()` running the
/// backend module's `$check($place)`.
macro_rules! checks {
    ($place:expr, $($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                super::$check($place).await
            }
        )*
    };
}

/// Every check of the suite, for one place.
macro_rules! every_check {
    ($place:expr) => {
        checks!(
            $place,
            consumes_once_then_already_used,
            another_subject_is_refused_without_consuming,
            forged_malformed_other_biz_and_expired_are_unknown,
            concurrent_consumes_have_one_winner,
            concurrent_submits_run_the_body_once,
            a_submit_while_the_first_runs_is_in_progress,
            a_failed_body_gives_the_token_back,
            a_give_back_after_expiry_leaves_it_unknown,
            refused_tokens_write_nothing,
            bad_subjects_biz_and_ttl_are_refused,
        );
    };
}

/// The test's part of the suite, per backend: a guarded call keyed by the
/// token, and every check, run for each place.
macro_rules! backend_suite {
    ($module:ident, $db:ty, $pool:path, $count_token_rows:expr) => {
        mod $module {
            use super::*;

            type Db = $db;

            /// The call a token guards, keyed by it (scoped to the subject).
            #[idempotent(key = "<subject>:<token>", ttl = "1h", biz = "tok_test_pay")]
            async fn pay(
                idem: &Idem<Db>,
                tx: &mut Transaction<'_, Db>,
                subject: String,
                token: String,
                amount: i64,
                #[idem(skip)] probe: &Probe,
            ) -> Result<i64, TestError> {
                sqlx::query("SELECT 1").execute(&mut **tx).await.map_err(idempotency::Error::from)?;
                probe.body().await?;
                Ok(amount)
            }

            /// One submit: the token redeemed for one call to `pay`, and how that call ended.
            pub(crate) async fn submit(
                idem: &Idem<Db>,
                subject: &str,
                token: &str,
                amount: i64,
                probe: &Probe,
            ) -> (Result<i64, TestError>, Option<Outcome>) {
                let call = || pay(idem, subject.to_owned(), token.to_owned(), amount, probe);
                observe(idem.tokens().redeem(BIZ, subject, token, call)).await
            }

            async fn setup(place: Place) -> Option<(Idem<Db>, impl Sized)> {
                let (pool, guard) = $pool().await?;
                Some((engine(pool, place).await?, guard))
            }

            /// Issue → consume → `Consumed`; again → `AlreadyUsed`.
            pub async fn consumes_once_then_already_used(place: Place) {
                let Some((idem, _guard)) = setup(place).await else { return };
                let user = unique("u");
                let issued = idem.tokens().issue(BIZ, &user, LONG).await.expect("issue");
                assert_eq!(issued.token.len(), idempotency::token::TOKEN_LEN);
                assert!(idempotency::token::is_well_formed(&issued.token), "{issued:?}");
                assert_eq!(issued.ttl, LONG);
                match idem.tokens().consume(BIZ, &user, &issued.token).await.expect("consume") {
                    Consumption::Consumed(spent) => {
                        assert_eq!((spent.token(), spent.subject()), (issued.token.as_str(), user.as_str()));
                        assert_eq!(spent.expires_at_ms(), issued.expires_at_ms);
                    }
                    other => panic!("first consume: {other:?}"),
                }
                for _ in 0..2 {
                    let again = idem.tokens().consume(BIZ, &user, &issued.token).await.expect("consume");
                    assert!(matches!(again, Consumption::AlreadyUsed), "{again:?}");
                }
            }

            /// Another subject's token is refused and left as it was: its
            /// subject still consumes it.
            pub async fn another_subject_is_refused_without_consuming(place: Place) {
                let Some((idem, _guard)) = setup(place).await else { return };
                let (alice, bob) = (unique("alice"), unique("bob"));
                let issued = idem.tokens().issue(BIZ, &alice, LONG).await.expect("issue");
                for _ in 0..2 {
                    let theirs = idem.tokens().consume(BIZ, &bob, &issued.token).await.expect("consume");
                    assert!(matches!(theirs, Consumption::OtherSubject), "{theirs:?}");
                }
                let ours = idem.tokens().consume(BIZ, &alice, &issued.token).await.expect("consume");
                assert!(matches!(ours, Consumption::Consumed(_)), "{ours:?}");
                let theirs = idem.tokens().consume(BIZ, &bob, &issued.token).await.expect("consume");
                assert!(matches!(theirs, Consumption::OtherSubject), "once used, still another's: {theirs:?}");
            }

            /// Forged, malformed, another `biz`'s and expired tokens are unknown.
            pub async fn forged_malformed_other_biz_and_expired_are_unknown(place: Place) {
                let Some((idem, _guard)) = setup(place).await else { return };
                let user = unique("u");
                let tokens = idem.tokens();
                let unknown = |c: &Consumption| matches!(c, Consumption::Unknown);
                let forged = forged();
                assert!(idempotency::token::is_well_formed(&forged));
                for token in [forged.as_str(), "", "short", &"A".repeat(33), &format!("{}:", "A".repeat(31))] {
                    let answer = tokens.consume(BIZ, &user, token).await.expect("consume");
                    assert!(unknown(&answer), "{token:?}: {answer:?}");
                }
                let issued = tokens.issue(BIZ, &user, LONG).await.expect("issue");
                let other_biz = tokens.consume("tok_test_other", &user, &issued.token).await.expect("consume");
                assert!(unknown(&other_biz), "{other_biz:?}");

                let short = tokens.issue(BIZ, &user, SHORT).await.expect("issue");
                wait_past(short.expires_at_ms).await;
                for _ in 0..2 {
                    let expired = tokens.consume(BIZ, &user, &short.token).await.expect("consume");
                    assert!(unknown(&expired), "{expired:?}");
                }
                // Not consumed by the refusals: the live one is still there.
                let live = tokens.consume(BIZ, &user, &issued.token).await.expect("consume");
                assert!(matches!(live, Consumption::Consumed(_)), "{live:?}");
            }

            /// 100 concurrent consumes of one token: exactly one `Consumed`.
            pub async fn concurrent_consumes_have_one_winner(place: Place) {
                let Some((idem, _guard)) = setup(place).await else { return };
                let user = unique("u");
                let issued = idem.tokens().issue(BIZ, &user, LONG).await.expect("issue");
                let barrier = Arc::new(Barrier::new(CROWD));
                let mut tasks = tokio::task::JoinSet::new();
                for _ in 0..CROWD {
                    let (idem, user, token, barrier) =
                        (idem.clone(), user.clone(), issued.token.clone(), Arc::clone(&barrier));
                    tasks.spawn(async move {
                        barrier.wait().await;
                        idem.tokens().consume(BIZ, &user, &token).await.expect("consume")
                    });
                }
                let (mut consumed, mut used) = (0, 0);
                while let Some(answer) = tasks.join_next().await {
                    match answer.expect("task") {
                        Consumption::Consumed(_) => consumed += 1,
                        Consumption::AlreadyUsed => used += 1,
                        other => panic!("{other:?}"),
                    }
                }
                assert_eq!((consumed, used), (1, CROWD - 1));
            }

            /// 100 concurrent submits of one token through an
            /// `#[idempotent]` fn keyed by it: the body runs once, every
            /// other answer is its replay or `InProgress`.
            pub async fn concurrent_submits_run_the_body_once(place: Place) {
                let Some((idem, _guard)) = setup(place).await else { return };
                let user = unique("u");
                let issued = idem.tokens().issue(BIZ, &user, LONG).await.expect("issue");
                let (probe, _starts) = Probe::new(true);
                let barrier = Arc::new(Barrier::new(CROWD));
                let mut tasks = tokio::task::JoinSet::new();
                for _ in 0..CROWD {
                    let (idem, user, token, barrier, probe) =
                        (idem.clone(), user.clone(), issued.token.clone(), Arc::clone(&barrier), Arc::clone(&probe));
                    tasks.spawn(async move {
                        barrier.wait().await;
                        submit(&idem, &user, &token, 1999, &probe).await
                    });
                }
                let (mut executed, mut replayed, mut in_progress) = (0, 0, 0);
                while let Some(answer) = tasks.join_next().await {
                    match answer.expect("task") {
                        (Ok(1999), Some(Outcome::Executed)) => executed += 1,
                        (Ok(1999), Some(Outcome::Replayed)) => replayed += 1,
                        (Err(TestError::Idem(idempotency::Error::InProgress { .. })), Some(Outcome::InProgress)) => {
                            in_progress += 1
                        }
                        other => panic!("{other:?}"),
                    }
                }
                assert_eq!(probe.runs(), 1, "the body ran once");
                assert_eq!(executed, 1);
                assert_eq!(executed + replayed + in_progress, CROWD);
                let key = format!("{user}:{}", issued.token);
                assert!(matches!(idem.status(BIZ, &key).await.expect("status"), Status::Completed { .. }));
                let (again, outcome) = submit(&idem, &user, &issued.token, 1999, &probe).await;
                assert!(matches!((again, outcome), (Ok(1999), Some(Outcome::Replayed))));
                assert_eq!(probe.runs(), 1);
            }

            /// A submit while the first still runs answers `InProgress`;
            /// once it finished, the replay.
            pub async fn a_submit_while_the_first_runs_is_in_progress(place: Place) {
                let Some((idem, _guard)) = setup(place).await else { return };
                let user = unique("u");
                let issued = idem.tokens().issue(BIZ, &user, LONG).await.expect("issue");
                let (probe, mut starts) = Probe::new(false);
                let first = {
                    let (idem, user, token, probe) =
                        (idem.clone(), user.clone(), issued.token.clone(), Arc::clone(&probe));
                    tokio::spawn(async move { submit(&idem, &user, &token, 5, &probe).await })
                };
                starts.recv().await.expect("the first body started");
                let (second, outcome) = submit(&idem, &user, &issued.token, 5, &probe).await;
                assert!(
                    matches!(second, Err(TestError::Idem(idempotency::Error::InProgress { .. }))),
                    "{second:?} {outcome:?}"
                );
                probe.open.send_replace(true);
                let (first, outcome) = first.await.expect("first");
                assert!(matches!((first, outcome), (Ok(5), Some(Outcome::Executed))));
                let (third, outcome) = submit(&idem, &user, &issued.token, 5, &probe).await;
                assert!(matches!((third, outcome), (Ok(5), Some(Outcome::Replayed))));
                assert_eq!(probe.runs(), 1);
            }

            /// A body that fails gives the token back: it can be consumed
            /// again, and the next submit executes.
            pub async fn a_failed_body_gives_the_token_back(place: Place) {
                let Some((idem, _guard)) = setup(place).await else { return };
                let user = unique("u");
                let issued = idem.tokens().issue(BIZ, &user, LONG).await.expect("issue");
                let (probe, _starts) = Probe::new(true);
                probe.fail_next.store(true, Ordering::SeqCst);
                let (failed, outcome) = submit(&idem, &user, &issued.token, 7, &probe).await;
                assert!(matches!((failed, outcome), (Err(TestError::Body), Some(Outcome::Failed))));

                // Back, for the rest of its life: consumable, not "already used".
                let Consumption::Consumed(spent) = idem.tokens().consume(BIZ, &user, &issued.token).await.unwrap()
                else {
                    panic!("the failed call did not give the token back");
                };
                assert_eq!(spent.expires_at_ms(), issued.expires_at_ms);
                assert!(idem.tokens().give_back(spent).await.expect("give back"));

                let (paid, outcome) = submit(&idem, &user, &issued.token, 7, &probe).await;
                assert!(matches!((paid, outcome), (Ok(7), Some(Outcome::Executed))));
                let (again, outcome) = submit(&idem, &user, &issued.token, 7, &probe).await;
                assert!(matches!((again, outcome), (Ok(7), Some(Outcome::Replayed))));
                assert_eq!(probe.runs(), 2, "the failed run and the one that executed");
                let after = idem.tokens().consume(BIZ, &user, &issued.token).await.unwrap();
                assert!(matches!(after, Consumption::AlreadyUsed), "{after:?}");
            }

            /// A token given back after it expired stays gone: unknown, not
            /// "already used".
            pub async fn a_give_back_after_expiry_leaves_it_unknown(place: Place) {
                let Some((idem, _guard)) = setup(place).await else { return };
                let user = unique("u");
                let issued = idem.tokens().issue(BIZ, &user, SHORT).await.expect("issue");
                let Consumption::Consumed(spent) = idem.tokens().consume(BIZ, &user, &issued.token).await.unwrap()
                else {
                    panic!("not consumed");
                };
                wait_past(issued.expires_at_ms).await;
                assert!(!idem.tokens().give_back(spent).await.expect("give back"));
                let after = idem.tokens().consume(BIZ, &user, &issued.token).await.unwrap();
                assert!(matches!(after, Consumption::Unknown), "{after:?}");
            }

            /// Forged, expired and another subject's tokens: refused, the
            /// body never runs, and no record is written.
            pub async fn refused_tokens_write_nothing(place: Place) {
                let Some((idem, _guard)) = setup(place).await else { return };
                let (alice, bob) = (unique("alice"), unique("bob"));
                let (probe, _starts) = Probe::new(true);
                let alices = idem.tokens().issue(BIZ, &alice, LONG).await.expect("issue");
                let short = idem.tokens().issue(BIZ, &bob, SHORT).await.expect("issue");
                wait_past(short.expires_at_ms).await;
                let cases = [
                    (bob.as_str(), forged(), Refusal::Unknown),
                    (bob.as_str(), short.token.clone(), Refusal::Unknown),
                    (bob.as_str(), alices.token.clone(), Refusal::OtherSubject),
                ];
                for (subject, token, why) in cases {
                    let (refused, outcome) = submit(&idem, subject, &token, 1, &probe).await;
                    match refused {
                        Err(TestError::Token(TokenError::Refused(got))) => assert_eq!(got, why, "{token}"),
                        other => panic!("{token}: {other:?}"),
                    }
                    assert_eq!(outcome, None, "no call was made");
                    let key = format!("{subject}:{token}");
                    assert_eq!(idem.status(BIZ, &key).await.expect("status"), Status::Absent);
                }
                assert_eq!(probe.runs(), 0);
                // Alice's token was left alone.
                let (paid, outcome) = submit(&idem, &alice, &alices.token, 1, &probe).await;
                assert!(matches!((paid, outcome), (Ok(1), Some(Outcome::Executed))));
            }

            /// What the engine refuses before it touches a store.
            pub async fn bad_subjects_biz_and_ttl_are_refused(place: Place) {
                let Some((idem, _guard)) = setup(place).await else { return };
                let tokens = idem.tokens();
                for subject in ["", "a:b", "a b", "zoë", &"p".repeat(65)] {
                    let issued = tokens.issue(BIZ, subject, LONG).await;
                    assert!(matches!(issued, Err(TokenError::InvalidSubject { .. })), "{subject:?}: {issued:?}");
                    let consumed = tokens.consume(BIZ, subject, &forged()).await;
                    assert!(matches!(consumed, Err(TokenError::InvalidSubject { .. })), "{subject:?}: {consumed:?}");
                }
                for biz in ["", "Pay", "a:b", "tok.live"] {
                    assert!(matches!(tokens.issue(biz, "u", LONG).await, Err(TokenError::InvalidBiz)), "{biz:?}");
                }
                assert!(matches!(tokens.issue(BIZ, "u", Duration::ZERO).await, Err(TokenError::InvalidTtl)));
                let too_long = Duration::from_secs(101 * 365 * 86_400);
                assert!(matches!(tokens.issue(BIZ, "u", too_long).await, Err(TokenError::InvalidTtl)));
            }

            /// Without Redis, expired rows go with `purge_expired`; live
            /// ones stay.
            pub async fn purge_removes_expired_token_rows(place: Place) {
                let Some((idem, _guard)) = setup(place).await else { return };
                let user = unique("u");
                let gone = idem.tokens().issue(BIZ, &user, SHORT).await.expect("issue");
                let kept = idem.tokens().issue(BIZ, &user, LONG).await.expect("issue");
                let rows = |token: String| {
                    let pool = idem.pool().clone();
                    async move {
                        let n: i64 = sqlx::query_scalar($count_token_rows).bind(token).fetch_one(&pool).await.unwrap();
                        n
                    }
                };
                assert_eq!((rows(gone.token.clone()).await, rows(kept.token.clone()).await), (1, 1));
                wait_past(gone.expires_at_ms).await;
                while idem.tokens().purge_expired(1_000).await.expect("purge") > 0 {}
                assert_eq!((rows(gone.token).await, rows(kept.token).await), (0, 1));
            }

            mod redis_getdel {
                use super::*;
                every_check!(Place::Getdel);
            }

            mod redis_lua {
                use super::*;
                every_check!(Place::Lua);
            }

            mod database {
                use super::*;
                every_check!(Place::Database);
                checks!(Place::Database, purge_removes_expired_token_rows);
            }
        }
    };
}

backend_suite!(sqlite, sqlx::Sqlite, sqlite_pool, "SELECT COUNT(*) FROM idem_token WHERE token = ?");
backend_suite!(mysql, sqlx::MySql, mysql_pool, "SELECT COUNT(*) FROM idem_token WHERE token = ?");
backend_suite!(postgres, sqlx::Postgres, pg_pool, "SELECT COUNT(*) FROM idem_token WHERE token = $1");

// What only Redis has.

/// The keys of the module docs of `token::redis`: the live key holds the
/// expiry, the owner key the state and subject; a consume deletes the
/// live key and marks the owner used; another subject's attempt touches
/// neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_follow_the_layout() {
    let Some((pool, _file)) = sqlite_pool().await else { return };
    let Some(idem) = engine(pool, Place::Getdel).await else { return };
    let Some(client) = idempotency_testkit::redis_client().await else { return };
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let namespace = idem.redis_namespace().await.expect("namespace").expect("migrated");
    let (alice, bob) = (unique("alice"), unique("bob"));
    let issued = idem.tokens().issue(BIZ, &alice, LONG).await.expect("issue");
    let live = format!("idem:{namespace}:tok.live:{BIZ}:{alice}:{}", issued.token);
    let owner = format!("idem:{namespace}:tok.owner:{BIZ}:{}", issued.token);
    let get = |key: String| {
        let mut conn = conn.clone();
        async move {
            let value: Option<String> = redis::cmd("GET").arg(&key).query_async(&mut conn).await.expect("GET");
            let ttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut conn).await.expect("PTTL");
            (value, ttl)
        }
    };
    let ttl_ms = i64::try_from(LONG.as_millis()).unwrap();
    let (value, ttl) = get(live.clone()).await;
    assert_eq!(value, Some(issued.expires_at_ms.to_string()));
    assert!((1..=ttl_ms).contains(&ttl), "{ttl}");
    let (value, ttl) = get(owner.clone()).await;
    assert_eq!(value, Some(format!("i:{}:{alice}", issued.expires_at_ms)));
    assert!((1..=ttl_ms).contains(&ttl), "{ttl}");

    let theirs = idem.tokens().consume(BIZ, &bob, &issued.token).await.expect("consume");
    assert!(matches!(theirs, Consumption::OtherSubject), "{theirs:?}");
    assert_eq!(get(live.clone()).await.0, Some(issued.expires_at_ms.to_string()), "untouched");
    let bobs_key = format!("idem:{namespace}:tok.live:{BIZ}:{bob}:{}", issued.token);
    assert_eq!(get(bobs_key).await.0, None);

    let ours = idem.tokens().consume(BIZ, &alice, &issued.token).await.expect("consume");
    assert!(matches!(ours, Consumption::Consumed(_)), "{ours:?}");
    assert_eq!(get(live.clone()).await, (None, -2), "consumed: gone");
    let (value, ttl) = get(owner.clone()).await;
    assert_eq!(value, Some(format!("u:{}:{alice}", issued.expires_at_ms)));
    let used_ms = i64::try_from(USED_FOR.as_millis()).unwrap();
    assert!(ttl > ttl_ms && ttl <= used_ms, "kept for the used window: {ttl}");
    let _: i64 = redis::cmd("DEL").arg(&owner).query_async(&mut conn).await.expect("DEL");
}

/// The `GETDEL` path sends `GETDEL`; the Lua path (forced on the builder)
/// never does, and consumes through the script: counted by the server
/// itself (`INFO commandstats`) on a Redis of this test alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_path_sends_what_it_says() {
    let Some(server) = RedisServer::start() else { return };
    let calls = |command: &str| server.calls().get(command).copied().unwrap_or(0);
    let Some((pool, _file)) = sqlite_pool().await else { return };
    let build = |lua: bool| {
        let builder = Idem::builder(pool.clone()).redis(server.client()).token_consume_with_lua(lua);
        builder.build()
    };
    let (with_getdel, with_lua) = (build(false), build(true));
    with_getdel.migrate().await.expect("migrate");
    let scripts = || calls("evalsha") + calls("eval");

    let user = unique("u");
    let issued = with_getdel.tokens().issue(BIZ, &user, LONG).await.expect("issue");
    let first = with_getdel.tokens().consume(BIZ, &user, &issued.token).await.expect("consume");
    assert!(matches!(first, Consumption::Consumed(_)), "{first:?}");
    assert_eq!((calls("getdel"), scripts()), (1, 0));

    let issued = with_lua.tokens().issue(BIZ, &user, LONG).await.expect("issue");
    let first = with_lua.tokens().consume(BIZ, &user, &issued.token).await.expect("consume");
    assert!(matches!(first, Consumption::Consumed(_)), "{first:?}");
    let again = with_lua.tokens().consume(BIZ, &user, &issued.token).await.expect("consume");
    assert!(matches!(again, Consumption::AlreadyUsed), "{again:?}");
    assert_eq!(calls("getdel"), 1, "the Lua path never sends GETDEL");
    // Two consumes; the first EVALSHA may meet NOSCRIPT and go again as EVAL.
    assert!((2..=3).contains(&scripts()), "{}", scripts());
}

/// A Redis that does not know `GETDEL` (as before 6.2; here renamed away)
/// answers an error: the engine switches to the script by itself, and
/// every answer stays right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_without_getdel_switches_to_the_script() {
    let Some(server) = RedisServer::start_with(&["--rename-command", "GETDEL", ""]) else { return };
    let mut conn = server.client().get_connection().expect("redis");
    assert!(redis::cmd("GETDEL").arg("k").query::<Option<String>>(&mut conn).is_err(), "GETDEL still known");
    let Some((pool, _file)) = sqlite_pool().await else { return };
    let idem = Idem::builder(pool).redis(server.client()).build();
    idem.migrate().await.expect("migrate");
    let (alice, bob) = (unique("alice"), unique("bob"));
    let issued = idem.tokens().issue(BIZ, &alice, LONG).await.expect("issue");
    let theirs = idem.tokens().consume(BIZ, &bob, &issued.token).await.expect("consume");
    assert!(matches!(theirs, Consumption::OtherSubject), "{theirs:?}");
    let Consumption::Consumed(spent) = idem.tokens().consume(BIZ, &alice, &issued.token).await.expect("consume") else {
        panic!("not consumed");
    };
    let again = idem.tokens().consume(BIZ, &alice, &issued.token).await.expect("consume");
    assert!(matches!(again, Consumption::AlreadyUsed), "{again:?}");
    assert!(idem.tokens().give_back(spent).await.expect("give back"));
    let back = idem.tokens().consume(BIZ, &alice, &issued.token).await.expect("consume");
    assert!(matches!(back, Consumption::Consumed(_)), "{back:?}");
    let calls = server.calls();
    let scripts = calls.get("evalsha").copied().unwrap_or(0) + calls.get("eval").copied().unwrap_or(0);
    assert!(scripts >= 3, "consumed through the script");
}

/// Tokens live where they were issued: with Redis down, issuing and
/// consuming answer `Unavailable` (retryable), never a pass, and the body
/// does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_answers_unavailable_never_a_pass() {
    let Some((pool, _file)) = sqlite_pool().await else { return };
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let idem = Idem::builder(pool).redis(client).redis_timeout(Duration::from_millis(200)).build();
    idem.migrate().await.expect("migrate");
    let user = unique("u");
    let issued = idem.tokens().issue(BIZ, &user, LONG).await;
    assert!(matches!(&issued, Err(e @ TokenError::Unavailable(_)) if e.is_retryable()), "{issued:?}");
    let consumed = idem.tokens().consume(BIZ, &user, &forged()).await;
    assert!(matches!(&consumed, Err(e @ TokenError::Unavailable(_)) if e.is_retryable()), "{consumed:?}");
    let (probe, _starts) = Probe::new(true);
    let (refused, outcome) = sqlite::submit(&idem, &user, &forged(), 1, &probe).await;
    assert!(matches!(refused, Err(TestError::Token(TokenError::Unavailable(_)))), "{refused:?}");
    assert_eq!((outcome, probe.runs()), (None, 0));
}

/// On a Redis Cluster (three masters of this test alone) every token
/// operation touches one key, so each is routed to its slot: both paths
/// answer as on one node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_work_on_a_redis_cluster() {
    let Some(cluster) = RedisCluster::start() else { return };
    let Some((pool, _file)) = sqlite_pool().await else { return };
    for lua in [false, true] {
        let idem = Idem::builder(pool.clone()).redis_cluster(cluster.client()).token_consume_with_lua(lua).build();
        idem.migrate().await.expect("migrate");
        let (alice, bob) = (unique("alice"), unique("bob"));
        for _ in 0..5 {
            let issued = idem.tokens().issue(BIZ, &alice, LONG).await.expect("issue");
            let theirs = idem.tokens().consume(BIZ, &bob, &issued.token).await.expect("consume");
            assert!(matches!(theirs, Consumption::OtherSubject), "{theirs:?}");
            let Consumption::Consumed(spent) =
                idem.tokens().consume(BIZ, &alice, &issued.token).await.expect("consume")
            else {
                panic!("not consumed (lua: {lua})");
            };
            let again = idem.tokens().consume(BIZ, &alice, &issued.token).await.expect("consume");
            assert!(matches!(again, Consumption::AlreadyUsed), "{again:?}");
            assert!(idem.tokens().give_back(spent).await.expect("give back"));
            let back = idem.tokens().consume(BIZ, &alice, &issued.token).await.expect("consume");
            assert!(matches!(back, Consumption::Consumed(_)), "{back:?}");
        }
        let forged = idem.tokens().consume(BIZ, &alice, &forged()).await.expect("consume");
        assert!(matches!(forged, Consumption::Unknown), "{forged:?}");
    }
}

// HTTP end to end: the example's two routes, on an ephemeral port.

mod over_http {
    //! `GET /orders/{id}/pay-token`, then `POST /orders/{id}/pay` with the
    //! token in `Idempotency-Token` (or a client's `Idempotency-Key`): on
    //! MariaDB with the tokens in Redis, on PostgreSQL with them in Redis
    //! through the script, and on SQLite with them in the database.

    use super::*;
    use axum::extract::{FromRequestParts, Path, State};
    use axum::http::StatusCode;
    use axum::http::request::Parts;
    use axum::response::{IntoResponse, Response};
    use axum::routing::{get, post};
    use axum::{Json, Router, middleware};
    use idempotency::http::{IdempotencyKey, IdempotencyToken, KeyOrToken, Problem, check_principal, replay_header};
    use serde::{Deserialize, Serialize};

    /// The action tokens are issued for, and the one of the calls they key.
    const PAY_TOKENS: &str = "tok_http_pay";
    const TOKEN_TTL: Duration = Duration::from_secs(900);

    #[derive(Debug, Serialize, Deserialize)]
    pub struct PayReq {
        amount: i64,
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub struct PayResponse {
        order_id: i64,
        user: String,
        amount: i64,
    }

    impl IntoResponse for PayResponse {
        fn into_response(self) -> Response {
            (StatusCode::OK, Json(self)).into_response()
        }
    }

    #[derive(Debug)]
    pub enum ApiError {
        Idem(idempotency::Error),
        Token(TokenError),
        BadAmount,
        NotPayable,
    }

    impl From<idempotency::Error> for ApiError {
        fn from(e: idempotency::Error) -> Self {
            ApiError::Idem(e)
        }
    }

    impl From<TokenError> for ApiError {
        fn from(e: TokenError) -> Self {
            ApiError::Token(e)
        }
    }

    impl From<sqlx::Error> for ApiError {
        fn from(e: sqlx::Error) -> Self {
            ApiError::Idem(e.into())
        }
    }

    impl IntoResponse for ApiError {
        fn into_response(self) -> Response {
            match self {
                ApiError::Idem(e) => e.into_response(),
                ApiError::Token(e) => e.into_response(),
                ApiError::BadAmount => (StatusCode::UNPROCESSABLE_ENTITY, "amount").into_response(),
                ApiError::NotPayable => (StatusCode::CONFLICT, "not payable").into_response(),
            }
        }
    }

    /// The caller, from `X-User-Id`.
    pub struct UserId(String);

    impl<S: Send + Sync> FromRequestParts<S> for UserId {
        type Rejection = Response;

        async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Response> {
            let Some(value) = parts.headers.get("x-user-id") else {
                return Err(StatusCode::UNAUTHORIZED.into_response());
            };
            let user = String::from_utf8_lossy(value.as_bytes());
            check_principal(&user).map_err(IntoResponse::into_response)?;
            Ok(UserId(user.into_owned()))
        }
    }

    #[derive(Serialize)]
    struct PayToken {
        token: String,
        expires_in: u64,
    }

    /// One answer, read whole.
    struct Answer {
        status: u16,
        replayed: Option<String>,
        retry_after: Option<String>,
        content_type: String,
        body: String,
    }

    impl Answer {
        fn json(&self) -> serde_json::Value {
            serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
        }

        /// Asserts this is `expected`, byte for byte, as `application/problem+json`.
        fn assert_problem(&self, expected: &Problem) {
            assert_eq!(self.status, expected.status.as_u16(), "{}", self.body);
            assert_eq!(self.body, expected.body());
            assert_eq!(self.content_type, "application/problem+json");
            assert_eq!(self.retry_after, expected.retry_after.map(|s| s.to_string()));
            assert_eq!(self.replayed, None);
        }
    }

    async fn read(response: reqwest::Response) -> Answer {
        let header = |name: &str| response.headers().get(name).map(|v| v.to_str().unwrap().to_owned());
        let (status, replayed, retry_after, content_type) = (
            response.status().as_u16(),
            header("idempotent-replayed"),
            header("retry-after"),
            header("content-type").unwrap_or_default(),
        );
        Answer { status, replayed, retry_after, content_type, body: response.text().await.expect("body") }
    }

    async fn pay_token(client: &reqwest::Client, base: &str, order: i64, user: &str) -> Answer {
        let request = client.get(format!("{base}/orders/{order}/pay-token")).header("x-user-id", user);
        read(request.send().await.expect("request")).await
    }

    async fn pay(
        client: &reqwest::Client,
        base: &str,
        order: i64,
        user: &str,
        headers: &[(&str, &str)],
        amount: i64,
    ) -> Answer {
        let mut request = client
            .post(format!("{base}/orders/{order}/pay"))
            .header("x-user-id", user)
            .header("content-type", "application/json")
            .body(format!(r#"{{"amount":{amount}}}"#));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        read(request.send().await.expect("request")).await
    }

    /// Serves `router` on an ephemeral port; returns its base URL.
    async fn serve(router: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
        format!("http://{addr}")
    }

    /// What differs per database: the type, and SQL placeholders.
    macro_rules! http_app {
        ($module:ident, $db:ty, $pool:path, $place:expr, $q:expr) => {
            mod $module {
                use super::*;

                type Db = $db;

                /// The statements, in this database's placeholders.
                struct Sql {
                    pay: &'static str,
                    insert_payment: &'static str,
                    new_order: &'static str,
                    payments: &'static str,
                    records: &'static str,
                }
                const SQL: Sql = $q;

                #[derive(Clone)]
                pub struct App {
                    pub idem: Idem<Db>,
                    pub probe: Arc<Probe>,
                }

                async fn pay_token_route(
                    State(app): State<App>,
                    UserId(user): UserId,
                    Path(_order_id): Path<i64>,
                ) -> Result<Json<PayToken>, ApiError> {
                    let issued = app.idem.tokens().issue(PAY_TOKENS, &user, TOKEN_TTL).await?;
                    Ok(Json(PayToken { token: issued.token, expires_in: issued.ttl.as_secs() }))
                }

                async fn pay_route(
                    State(app): State<App>,
                    UserId(user): UserId,
                    proof: KeyOrToken,
                    Path(order_id): Path<i64>,
                    Json(req): Json<PayReq>,
                ) -> Result<PayResponse, ApiError> {
                    match proof {
                        KeyOrToken::Key(IdempotencyKey(idem_key)) => {
                            pay_by_key(&app, user, idem_key, order_id, req).await
                        }
                        KeyOrToken::Token(IdempotencyToken(token)) => {
                            let call = || pay_by_token(&app, user.clone(), token.clone(), order_id, req);
                            app.idem.tokens().redeem(PAY_TOKENS, &user, &token, call).await
                        }
                    }
                }

                #[idempotent(key = "<user>:<idem_key>", ttl = "1h", biz = "tok_http_key", engine = app.idem)]
                async fn pay_by_key(
                    app: &App,
                    tx: &mut Transaction<'_, Db>,
                    user: String,
                    idem_key: String,
                    order_id: i64,
                    req: PayReq,
                ) -> Result<PayResponse, ApiError> {
                    charge(app, tx, user, order_id, req).await
                }

                #[idempotent(key = "<user>:<token>", ttl = "1h", biz = "tok_http_pay", engine = app.idem)]
                async fn pay_by_token(
                    app: &App,
                    tx: &mut Transaction<'_, Db>,
                    user: String,
                    token: String,
                    order_id: i64,
                    req: PayReq,
                ) -> Result<PayResponse, ApiError> {
                    charge(app, tx, user, order_id, req).await
                }

                async fn charge(
                    app: &App,
                    tx: &mut Transaction<'_, Db>,
                    user: String,
                    order_id: i64,
                    req: PayReq,
                ) -> Result<PayResponse, ApiError> {
                    if req.amount <= 0 {
                        return Err(ApiError::BadAmount);
                    }
                    let paid = sqlx::query(SQL.pay).bind(order_id).execute(&mut **tx).await?;
                    if paid.rows_affected() == 0 {
                        return Err(ApiError::NotPayable);
                    }
                    app.probe.body().await.map_err(|_| ApiError::NotPayable)?;
                    sqlx::query(SQL.insert_payment)
                        .bind(order_id)
                        .bind(&user)
                        .bind(req.amount)
                        .execute(&mut **tx)
                        .await?;
                    Ok(PayResponse { order_id, user, amount: req.amount })
                }

                async fn count(pool: &Pool<Db>, sql: &'static str, bind: String) -> i64 {
                    sqlx::query_scalar(sql).bind(bind).fetch_one(pool).await.expect(sql)
                }

                /// The whole flow, on one app.
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn pay_token_then_pay_with_it() {
                    let Some((pool, _guard)) = $pool().await else { return };
                    let Some(idem) = engine(pool.clone(), $place).await else { return };
                    sqlx::raw_sql(
                        "CREATE TABLE IF NOT EXISTS tok_orders (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL);
                         CREATE TABLE IF NOT EXISTS tok_payments (order_id BIGINT NOT NULL, user_id VARCHAR(100) NOT NULL,
                             amount BIGINT NOT NULL)",
                    )
                    .execute(&pool)
                    .await
                    .expect("tables");
                    let (probe, mut starts) = Probe::new(false);
                    let app = App { idem: idem.clone(), probe: Arc::clone(&probe) };
                    let router = Router::new()
                        .route("/orders/{id}/pay", post(pay_route))
                        .route("/orders/{id}/pay-token", get(pay_token_route))
                        .layer(middleware::from_fn(replay_header))
                        .with_state(app);
                    let base = serve(router).await;
                    let client = reqwest::Client::new();
                    let (alice, bob) = (unique("alice"), unique("bob"));
                    let new_order = || {
                        let pool = pool.clone();
                        async move {
                            static NEXT: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);
                            let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
                            let id = i64::try_from(nanos % 1_000_000_000_000_000).unwrap() * 100
                                + NEXT.fetch_add(1, Ordering::Relaxed) % 100;
                            sqlx::query(SQL.new_order).bind(id).execute(&pool).await.expect("order");
                            id
                        }
                    };
                    let payments = |order: i64| count(&pool, SQL.payments, order.to_string());
                    let records = |user: &str, token: &str| count(&pool, SQL.records, format!("{user}:{token}"));
                    let invalid = Problem::token_invalid();
                    let order = new_order().await;

                    // The token: alice's, for 15 minutes.
                    let answer = pay_token(&client, &base, order, &alice).await;
                    assert_eq!(answer.status, 200, "{}", answer.body);
                    let json = answer.json();
                    let token = json["token"].as_str().expect("token").to_owned();
                    assert!(idempotency::token::is_well_formed(&token), "{token}");
                    assert_eq!(json["expires_in"], 900);
                    let with_token = [("idempotency-token", token.as_str())];

                    // Another user's, a forged and a malformed token: 403, nothing written.
                    pay(&client, &base, order, &bob, &with_token, 1999).await.assert_problem(&invalid);
                    for forged in [forged(), "not-a-token".to_owned()] {
                        let answer = pay(&client, &base, order, &alice, &[("idempotency-token", &forged)], 1999).await;
                        answer.assert_problem(&invalid);
                        assert_eq!(records(&alice, &forged).await, 0);
                    }
                    assert_eq!((payments(order).await, records(&bob, &token).await), (0, 0));

                    // A payment that fails gives the token back: nothing written, and the next one runs.
                    let failed = pay(&client, &base, order, &alice, &with_token, 0).await;
                    assert_eq!(failed.status, 422, "{}", failed.body);
                    assert_eq!((payments(order).await, records(&alice, &token).await), (0, 0));

                    // The first payment, held in its body: a resubmission meanwhile is 409.
                    let first = {
                        let (client, base, alice, token) = (client.clone(), base.clone(), alice.clone(), token.clone());
                        tokio::spawn(async move {
                            pay(&client, &base, order, &alice, &[("idempotency-token", &token)], 1999).await
                        })
                    };
                    starts.recv().await.expect("the first body started");
                    let busy = pay(&client, &base, order, &alice, &with_token, 1999).await;
                    let in_progress = idempotency::Error::InProgress { biz: "tok_http_pay", key: String::new() };
                    busy.assert_problem(&Problem::from(&in_progress));
                    probe.open.send_replace(true);
                    let first = first.await.expect("first");
                    assert_eq!((first.status, first.replayed.as_deref()), (200, None), "{}", first.body);
                    assert_eq!(first.json()["amount"], 1999);

                    // Submitted again: the first answer, replayed.
                    let again = pay(&client, &base, order, &alice, &with_token, 1999).await;
                    assert_eq!((again.status, again.replayed.as_deref()), (200, Some("true")), "{}", again.body);
                    assert_eq!(again.body, first.body);
                    assert_eq!((payments(order).await, records(&alice, &token).await), (1, 1));
                    assert_eq!(probe.runs(), 1);

                    // Bob's token, tried by alice first, is still bob's.
                    let bobs_order = new_order().await;
                    let bobs = pay_token(&client, &base, bobs_order, &bob).await.json()["token"].as_str().unwrap().to_owned();
                    let bobs_header = [("idempotency-token", bobs.as_str())];
                    pay(&client, &base, bobs_order, &alice, &bobs_header, 5).await.assert_problem(&invalid);
                    let paid = pay(&client, &base, bobs_order, &bob, &bobs_header, 5).await;
                    assert_eq!((paid.status, paid.replayed.as_deref()), (200, None), "{}", paid.body);
                    assert_eq!((payments(bobs_order).await, records(&alice, &bobs).await), (1, 0));

                    // An expired token: 403, nothing written.
                    let late_order = new_order().await;
                    let expired = idem.tokens().issue(PAY_TOKENS, &alice, SHORT).await.expect("issue");
                    wait_past(expired.expires_at_ms).await;
                    let answer = pay(&client, &base, late_order, &alice, &[("idempotency-token", &expired.token)], 9).await;
                    answer.assert_problem(&invalid);
                    assert_eq!((payments(late_order).await, records(&alice, &expired.token).await), (0, 0));

                    // Both headers: 400; a client's key alone still works.
                    let fresh = pay_token(&client, &base, late_order, &alice).await.json()["token"].as_str().unwrap().to_owned();
                    let key = unique("key");
                    let both = [("idempotency-token", fresh.as_str()), ("idempotency-key", key.as_str())];
                    let answer = pay(&client, &base, late_order, &alice, &both, 9).await;
                    assert_eq!((answer.status, answer.json()["code"].as_str()), (400, Some("INVALID_IDEMPOTENCY_KEY")));
                    let by_key = pay(&client, &base, late_order, &alice, &[("idempotency-key", &key)], 9).await;
                    assert_eq!(by_key.status, 200, "{}", by_key.body);
                    assert_eq!(payments(late_order).await, 1);
                }
            }
        };
    }

    http_app!(
        mysql_with_redis,
        sqlx::MySql,
        mysql_pool,
        Place::Getdel,
        Sql {
            pay: "UPDATE tok_orders SET status = 'PAID' WHERE id = ? AND status = 'PENDING'",
            insert_payment: "INSERT INTO tok_payments (order_id, user_id, amount) VALUES (?, ?, ?)",
            new_order: "INSERT INTO tok_orders (id, status) VALUES (?, 'PENDING')",
            payments: "SELECT COUNT(*) FROM tok_payments WHERE order_id = CAST(? AS SIGNED)",
            records: "SELECT COUNT(*) FROM idem_record WHERE biz_type = 'tok_http_pay' AND idem_key = ?",
        }
    );

    http_app!(
        postgres_with_redis_lua,
        sqlx::Postgres,
        pg_pool,
        Place::Lua,
        Sql {
            pay: "UPDATE tok_orders SET status = 'PAID' WHERE id = $1 AND status = 'PENDING'",
            insert_payment: "INSERT INTO tok_payments (order_id, user_id, amount) VALUES ($1, $2, $3)",
            new_order: "INSERT INTO tok_orders (id, status) VALUES ($1, 'PENDING')",
            payments: "SELECT COUNT(*) FROM tok_payments WHERE order_id = CAST($1 AS BIGINT)",
            records: "SELECT COUNT(*) FROM idem_record WHERE biz_type = 'tok_http_pay' AND idem_key = $1",
        }
    );

    http_app!(
        sqlite_without_redis,
        sqlx::Sqlite,
        sqlite_pool,
        Place::Database,
        Sql {
            pay: "UPDATE tok_orders SET status = 'PAID' WHERE id = ? AND status = 'PENDING'",
            insert_payment: "INSERT INTO tok_payments (order_id, user_id, amount) VALUES (?, ?, ?)",
            new_order: "INSERT INTO tok_orders (id, status) VALUES (?, 'PENDING')",
            payments: "SELECT COUNT(*) FROM tok_payments WHERE order_id = CAST(? AS INTEGER)",
            records: "SELECT COUNT(*) FROM idem_record WHERE biz_type = 'tok_http_pay' AND idem_key = ?",
        }
    );
}
