//! What the soak's backends share: the statements that differ only in their
//! text ([`SoakQueries`], written into each backend by `soak_statements!`)
//! and the two annotated fns every backend calls through.

use idempotency::{Idem, idempotent};
use sqlx::Transaction;

use super::{Ctx, Plan, Receipt, SoakBackend, SoakError, body};

/// The SQL of the statements every backend runs in the same shape.
#[cfg(any(feature = "mysql", feature = "postgres"))]
pub(crate) struct SoakQueries {
    /// Pays the order `(run, k)` if it is pending (binds: run, k).
    pub pay_order: &'static str,
    /// Inserts a payment, returning its id (binds: run, k, amount, exec).
    pub insert_payment: &'static str,
    /// `(k, id, amount, exec)` of the run's payments (binds: run).
    pub select_ledger: &'static str,
    /// `(idem_key, status, response)` of the run's records (binds: biz, `<run>.%`).
    pub select_records: &'static str,
    /// `(k, status, paid)` of the run's orders (binds: run).
    pub select_orders: &'static str,
    /// Deletes the run's payments (binds: run).
    pub delete_ledger: &'static str,
    /// Deletes the run's orders (binds: run).
    pub delete_orders: &'static str,
    /// Deletes the run's records (binds: biz, `<run>.%`).
    pub delete_records: &'static str,
}

/// Writes the [`SoakBackend`] methods that differ only in SQL text.
#[cfg(any(feature = "mysql", feature = "postgres"))]
macro_rules! soak_statements {
    ($q:expr) => {
        async fn tables(pool: &::sqlx::Pool<Self::Db>, run: &str) -> $crate::soak::Tables {
            let like = format!("{run}.%");
            let biz = $crate::soak::BIZ;
            $crate::soak::Tables {
                ledger: ::sqlx::query_as($q.select_ledger).bind(run).fetch_all(pool).await.expect("ledger"),
                records: ::sqlx::query_as($q.select_records)
                    .bind(biz)
                    .bind(&like)
                    .fetch_all(pool)
                    .await
                    .expect("records"),
                orders: ::sqlx::query_as($q.select_orders).bind(run).fetch_all(pool).await.expect("orders"),
            }
        }

        async fn cleanup(pool: &::sqlx::Pool<Self::Db>, run: &str) {
            let like = format!("{run}.%");
            ::sqlx::query($q.delete_ledger).bind(run).execute(pool).await.expect("delete ledger");
            ::sqlx::query($q.delete_orders).bind(run).execute(pool).await.expect("delete orders");
            let biz = $crate::soak::BIZ;
            ::sqlx::query($q.delete_records).bind(biz).bind(&like).execute(pool).await.expect("delete records");
        }

        async fn pay_order(
            tx: &mut ::sqlx::Transaction<'_, Self::Db>,
            run: &str,
            k: &str,
        ) -> Result<bool, ::sqlx::Error> {
            Ok(::sqlx::query($q.pay_order).bind(run).bind(k).execute(&mut **tx).await?.rows_affected() == 1)
        }

        async fn insert_payment(
            tx: &mut ::sqlx::Transaction<'_, Self::Db>,
            run: &str,
            k: &str,
            amount: i64,
            exec: i64,
        ) -> Result<i64, ::sqlx::Error> {
            ::sqlx::query_scalar($q.insert_payment).bind(run).bind(k).bind(amount).bind(exec).fetch_one(&mut **tx).await
        }
    };
}
#[cfg(any(feature = "mysql", feature = "postgres"))]
pub(crate) use soak_statements;

/// The soak's call: [`body`] under `#[idempotent]`.
#[idempotent(key = "<k>", ttl = "1h", biz = "soak_pay")]
pub(crate) async fn pay<B: SoakBackend + ?Sized>(
    idem: &Idem<B::Db>,
    tx: &mut Transaction<'_, B::Db>,
    k: String,
    amount: i64,
    #[idem(skip)] ctx: &Ctx,
    #[idem(skip)] plan: Plan,
) -> Result<Receipt, SoakError> {
    body::<B>(tx, &k, amount, ctx, plan).await
}

/// The same action through a claim that lives 50 ms: a slow body outlives
/// it, and a duplicate may claim the key meanwhile.
#[idempotent(key = "<k>", ttl = "1h", biz = "soak_pay", lease = "50ms")]
pub(crate) async fn pay_short_lease<B: SoakBackend + ?Sized>(
    idem: &Idem<B::Db>,
    tx: &mut Transaction<'_, B::Db>,
    k: String,
    amount: i64,
    #[idem(skip)] ctx: &Ctx,
    #[idem(skip)] plan: Plan,
) -> Result<Receipt, SoakError> {
    body::<B>(tx, &k, amount, ctx, plan).await
}
