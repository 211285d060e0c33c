//! The annotated fns every cell calls, generated per backend by one macro
//! (the backend's sqlx type and ledger SQL differ, nothing else): for each
//! mode (plain, `join`, `steps`) and each set of options (none,
//! `record_errors`, `wait = "30s"`, both; `steps` takes no
//! `record_errors`), one fn of its own `biz`. Each writes a ledger row
//! (`idem_test_ledger`, with the statement sent unnamed, as behind a
//! transaction pooler) and ends as its [`Script`] says.
//!
//! [`Calls::call`] is the one door to them: it picks the fn of a shape and,
//! for `join`, is the caller: it opens the transaction, names its session
//! to the script, calls, and commits (a value or a declared error) or rolls
//! back.

use std::future::Future;
use std::pin::Pin;

use idempotency::{BusinessError, Idem};
use idempotency_testkit::TestBackend;
use serde::{Deserialize, Serialize};

use crate::script::Script;
use crate::table::{Mode, Options};

/// What a call answers: the same bytes for every replay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Paid {
    pub key: String,
    pub amount: i64,
    /// Which run of the body: a second execution would say 2.
    pub run: u64,
}

/// A declared business error: recorded with `record_errors`, declared
/// permanent in steps mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Declined {
    pub reason: String,
    pub run: u64,
}

#[derive(Debug)]
#[allow(dead_code)] // the fields show in answers through Debug
pub enum CallError {
    Declined(Declined),
    /// The body's own failure, never recorded.
    Body,
    Idem(idempotency::Error),
    Db(sqlx::Error),
}

impl From<idempotency::Error> for CallError {
    fn from(e: idempotency::Error) -> Self {
        CallError::Idem(e)
    }
}

impl From<sqlx::Error> for CallError {
    fn from(e: sqlx::Error) -> Self {
        CallError::Db(e)
    }
}

impl BusinessError for CallError {
    type Record = Declined;

    fn recorded(&self) -> Option<Declined> {
        match self {
            CallError::Declined(declined) => Some(declined.clone()),
            _ => None,
        }
    }

    fn replayed(record: Declined) -> Self {
        CallError::Declined(record)
    }
}

impl idempotency::consumer::AsIdemError for CallError {
    fn idem_error(&self) -> Option<&idempotency::Error> {
        match self {
            CallError::Idem(e) => Some(e),
            _ => None,
        }
    }
}

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A backend's sqlx database.
pub type Db<F> = <<F as Calls>::Backend as TestBackend>::Db;

/// A backend's annotated fns (see the module docs).
pub trait Calls: Send + Sync + 'static {
    type Backend: TestBackend;

    /// Calls the fn of `(mode, options)` with `k` and `amount`.
    fn call<'a>(
        idem: &'a Idem<Db<Self>>,
        mode: Mode,
        options: Options,
        k: String,
        amount: i64,
        script: &'a Script,
    ) -> BoxFuture<'a, Result<Paid, CallError>>;

    /// The `biz` of `(mode, options)`.
    fn biz(mode: Mode, options: Options) -> &'static str {
        match (mode, options) {
            (Mode::Plain, Options::Defaults) => "mx_plain",
            (Mode::Plain, Options::RecordErrors) => "mx_plain_re",
            (Mode::Plain, Options::Wait) => "mx_plain_w",
            (Mode::Plain, Options::RecordErrorsWait) => "mx_plain_rew",
            (Mode::Join, Options::Defaults) => "mx_join",
            (Mode::Join, Options::RecordErrors) => "mx_join_re",
            (Mode::Join, Options::Wait) => "mx_join_w",
            (Mode::Join, Options::RecordErrorsWait) => "mx_join_rew",
            (Mode::Steps, Options::Defaults) => "mx_steps",
            (Mode::Steps, Options::Wait) => "mx_steps_w",
            (Mode::Steps, _) => unreachable!("steps with record_errors is excluded"),
        }
    }
}

/// The fns of one backend: `family!(Name, TestBackend type, session id SQL)`.
macro_rules! family {
    ($family:ident, $backend:ty, $session:expr) => {
        /// The annotated fns over this backend.
        pub struct $family;

        const _: () = {
            use idempotency::{Idem, Steps, idempotent};
            use idempotency_testkit::TestBackend;
            use sqlx::Transaction;

            use crate::fns::{BoxFuture, CallError, Calls, Paid};
            use crate::script::Script;
            use crate::table::{Mode, Options};

            type Db = <$backend as TestBackend>::Db;

            /// The body of plain and joined fns: a ledger row, then as told.
            async fn body(
                tx: &mut Transaction<'_, Db>,
                k: String,
                amount: i64,
                script: &Script,
            ) -> Result<Paid, CallError> {
                let run = script.start();
                let insert = sqlx::query(<$backend as TestBackend>::INSERT_LEDGER).persistent(false);
                insert.bind(&k).bind(amount).execute(&mut **tx).await?;
                script.end(run).await?;
                Ok(Paid { key: k, amount, run })
            }

            /// The steps body: an outside call as a step; a decline is
            /// declared permanent; else a ledger row in the final
            /// transaction, then as told.
            async fn steps_body(
                steps: &mut Steps<Db>,
                k: String,
                amount: i64,
                script: &Script,
            ) -> Result<Paid, CallError> {
                let run = script.start();
                let _charge: String = steps.step("charge", |step_key| script.outside(step_key)).await?;
                if script.declines() {
                    script.hold().await;
                    return Err(steps.permanent(&script.decline(run)).into());
                }
                let tx = steps.transaction().await?;
                let insert = sqlx::query(<$backend as TestBackend>::INSERT_LEDGER).persistent(false);
                insert.bind(&k).bind(amount).execute(&mut **tx).await?;
                script.end(run).await?;
                Ok(Paid { key: k, amount, run })
            }

            #[idempotent(key = "<k>", ttl = "1h", biz = "mx_plain")]
            async fn plain(
                idem: &Idem<Db>,
                tx: &mut Transaction<'_, Db>,
                k: String,
                amount: i64,
                #[idem(skip)] script: &Script,
            ) -> Result<Paid, CallError> {
                body(tx, k, amount, script).await
            }

            #[idempotent(key = "<k>", ttl = "1h", biz = "mx_plain_re", record_errors)]
            async fn plain_re(
                idem: &Idem<Db>,
                tx: &mut Transaction<'_, Db>,
                k: String,
                amount: i64,
                #[idem(skip)] script: &Script,
            ) -> Result<Paid, CallError> {
                body(tx, k, amount, script).await
            }

            #[idempotent(key = "<k>", ttl = "1h", biz = "mx_plain_w", wait = "30s")]
            async fn plain_w(
                idem: &Idem<Db>,
                tx: &mut Transaction<'_, Db>,
                k: String,
                amount: i64,
                #[idem(skip)] script: &Script,
            ) -> Result<Paid, CallError> {
                body(tx, k, amount, script).await
            }

            #[idempotent(key = "<k>", ttl = "1h", biz = "mx_plain_rew", record_errors, wait = "30s")]
            async fn plain_rew(
                idem: &Idem<Db>,
                tx: &mut Transaction<'_, Db>,
                k: String,
                amount: i64,
                #[idem(skip)] script: &Script,
            ) -> Result<Paid, CallError> {
                body(tx, k, amount, script).await
            }

            #[idempotent(key = "<k>", ttl = "1h", biz = "mx_join", join)]
            async fn join(
                idem: &Idem<Db>,
                tx: &mut Transaction<'_, Db>,
                k: String,
                amount: i64,
                #[idem(skip)] script: &Script,
            ) -> Result<Paid, CallError> {
                body(tx, k, amount, script).await
            }

            #[idempotent(key = "<k>", ttl = "1h", biz = "mx_join_re", join, record_errors)]
            async fn join_re(
                idem: &Idem<Db>,
                tx: &mut Transaction<'_, Db>,
                k: String,
                amount: i64,
                #[idem(skip)] script: &Script,
            ) -> Result<Paid, CallError> {
                body(tx, k, amount, script).await
            }

            #[idempotent(key = "<k>", ttl = "1h", biz = "mx_join_w", join, wait = "30s")]
            async fn join_w(
                idem: &Idem<Db>,
                tx: &mut Transaction<'_, Db>,
                k: String,
                amount: i64,
                #[idem(skip)] script: &Script,
            ) -> Result<Paid, CallError> {
                body(tx, k, amount, script).await
            }

            #[idempotent(key = "<k>", ttl = "1h", biz = "mx_join_rew", join, record_errors, wait = "30s")]
            async fn join_rew(
                idem: &Idem<Db>,
                tx: &mut Transaction<'_, Db>,
                k: String,
                amount: i64,
                #[idem(skip)] script: &Script,
            ) -> Result<Paid, CallError> {
                body(tx, k, amount, script).await
            }

            #[idempotent(key = "<k>", ttl = "1h", biz = "mx_steps", steps)]
            async fn stepped(
                idem: &Idem<Db>,
                steps: &mut Steps<Db>,
                k: String,
                amount: i64,
                #[idem(skip)] script: &Script,
            ) -> Result<Paid, CallError> {
                steps_body(steps, k, amount, script).await
            }

            #[idempotent(key = "<k>", ttl = "1h", biz = "mx_steps_w", steps, wait = "30s")]
            async fn stepped_w(
                idem: &Idem<Db>,
                steps: &mut Steps<Db>,
                k: String,
                amount: i64,
                #[idem(skip)] script: &Script,
            ) -> Result<Paid, CallError> {
                steps_body(steps, k, amount, script).await
            }

            /// The caller of a joined fn: its own transaction, its session
            /// named, the call, then commit (a value or a declared error,
            /// which the record holds) or roll back.
            async fn joined(
                idem: &Idem<Db>,
                options: Options,
                k: String,
                amount: i64,
                script: &Script,
            ) -> Result<Paid, CallError> {
                let mut tx = idem.pool().begin().await?;
                let session: Option<&'static str> = $session;
                if let Some(sql) = session {
                    let id: i64 = sqlx::query_scalar(sql).persistent(false).fetch_one(&mut *tx).await?;
                    script.set_session(id);
                }
                let called = match options {
                    Options::Defaults => join(idem, &mut tx, k, amount, script).await,
                    Options::RecordErrors => join_re(idem, &mut tx, k, amount, script).await,
                    Options::Wait => join_w(idem, &mut tx, k, amount, script).await,
                    Options::RecordErrorsWait => join_rew(idem, &mut tx, k, amount, script).await,
                };
                match &called {
                    Ok(_) | Err(CallError::Declined(_)) => tx.commit().await?,
                    Err(_) => tx.rollback().await?,
                }
                called
            }

            impl Calls for $family {
                type Backend = $backend;

                fn call<'a>(
                    idem: &'a Idem<Db>,
                    mode: Mode,
                    options: Options,
                    k: String,
                    amount: i64,
                    script: &'a Script,
                ) -> BoxFuture<'a, Result<Paid, CallError>> {
                    Box::pin(async move {
                        match (mode, options) {
                            (Mode::Plain, Options::Defaults) => plain(idem, k, amount, script).await,
                            (Mode::Plain, Options::RecordErrors) => plain_re(idem, k, amount, script).await,
                            (Mode::Plain, Options::Wait) => plain_w(idem, k, amount, script).await,
                            (Mode::Plain, Options::RecordErrorsWait) => plain_rew(idem, k, amount, script).await,
                            (Mode::Join, options) => joined(idem, options, k, amount, script).await,
                            (Mode::Steps, Options::Defaults) => stepped(idem, k, amount, script).await,
                            (Mode::Steps, Options::Wait) => stepped_w(idem, k, amount, script).await,
                            (Mode::Steps, _) => unreachable!("steps with record_errors is excluded"),
                        }
                    })
                }
            }
        };
    };
}

family!(SqliteFns, idempotency_testkit::backend::Sqlite, None);
family!(MysqlFns, idempotency_testkit::backend::MySql, Some("SELECT CAST(CONNECTION_ID() AS SIGNED)"));
family!(PostgresFns, idempotency_testkit::backend::Postgres, Some("SELECT CAST(pg_backend_pid() AS BIGINT)"));
