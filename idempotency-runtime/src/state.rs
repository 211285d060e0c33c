//! Layer 4: the business state itself, the last line of defence. A
//! transition is one conditional `UPDATE` with the expected state in its
//! `WHERE`; when it changes no row, the row is read again to tell "already
//! done" (an answer, never a failure, or upstream retries forever) from a
//! conflict or a missing row.
//!
//! ```ignore
//! #[derive(Clone, Copy, Debug, PartialEq, Eq, idempotency::State)]
//! #[state(table = "orders", id = "id", column = "status")]
//! #[state(transitions(Pending -> Paid, Paid -> Refunded, Pending -> Closed))]
//! enum OrderStatus { Pending, Paid, Refunded, Closed }
//!
//! // inside a body, or on any sqlx transaction or connection:
//! let answer = idempotency::state::advance(idempotency::transition!(OrderStatus: Pending -> Paid))
//!     .set(idempotency::col!(paid_at), now_ms)
//!     .run(&mut **tx, order_id)
//!     .await?;
//! match answer {
//!     Advanced::Applied | Advanced::AlreadyThere => { /* paid: by us, or before */ }
//!     Advanced::Conflict { current } => { /* e.g. closed: refuse */ }
//!     Advanced::NotFound => { /* no such order */ }
//! }
//! ```
//!
//! Table, id column, state column and extra columns are SQL identifiers
//! checked at compile time (`[A-Za-z_][A-Za-z0-9_]{0,63}`) and quoted; they
//! never come from runtime strings. Values (the states, the id, what `set`
//! writes) are always bound parameters. A transition not declared on the
//! type is a compile error where it is written.

use std::fmt;
use std::marker::PhantomData;

use sqlx::{Arguments, AssertSqlSafe, Database, Decode, Encode, Executor, Type};

use crate::store::Backend;

/// How many times a row re-read in `from` is updated again.
const UPDATE_ATTEMPTS: u32 = 3;

/// A SQL identifier checked at compile time. Written with
/// [`col!`](crate::col) or by `#[derive(State)]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ident(&'static str);

impl Ident {
    /// Not a stable API: `col!` and the derive call it in a `const`
    /// block, where an invalid name is a compile error.
    #[doc(hidden)]
    pub const fn __checked(name: &'static str) -> Ident {
        assert!(
            idempotency_rules::is_sql_identifier(name),
            "not a SQL identifier: expected [A-Za-z_][A-Za-z0-9_]{{0,63}}"
        );
        Ident(name)
    }

    /// The identifier as written.
    pub const fn as_str(&self) -> &'static str {
        self.0
    }
}

/// How a state is stored in its column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// As text (`VARCHAR`/`TEXT`), e.g. `'PAID'`.
    Text(&'static str),
    /// As a small integer (`SMALLINT`), the variant's discriminant.
    Int(i16),
}

impl fmt::Display for Stored {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stored::Text(text) => write!(f, "{text:?}"),
            Stored::Int(n) => write!(f, "{n}"),
        }
    }
}

/// A state column and its allowed transitions; implemented by
/// `#[derive(State)]`, which also checks the declaration at compile time.
pub trait State: Copy + PartialEq + fmt::Debug + Send + Sync + Sized + 'static {
    /// The table holding the rows.
    const TABLE: Ident;
    /// The column identifying a row.
    const ID: Ident;
    /// The column holding the state.
    const COLUMN: Ident;

    /// Whether the states are stored as small integers (else as text).
    const STORED_AS_INT: bool;

    /// How `self` is stored.
    fn stored(self) -> Stored;

    /// The state stored as `text`, if it is one.
    fn from_text(text: &str) -> Option<Self>;

    /// The state stored as `n`, if it is one.
    fn from_int(n: i16) -> Option<Self>;
}

/// A declared transition of `S`, from one state to another. Made by
/// [`transition!`](crate::transition), which refuses undeclared ones at
/// compile time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition<S> {
    from: S,
    to: S,
}

impl<S: State> Transition<S> {
    /// Not a stable API: the derive's checked constructor calls it.
    #[doc(hidden)]
    pub const fn __declared(from: S, to: S) -> Self {
        Transition { from, to }
    }

    /// The state the row must be in.
    pub fn from(&self) -> S {
        self.from
    }

    /// The state the row moves to.
    pub fn to(&self) -> S {
        self.to
    }
}

/// What [`Advance::run`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advanced<S> {
    /// The row was in `from`; it is now in `to` (and the `set` columns hold
    /// their values). One `UPDATE`.
    Applied,
    /// The row was already in `to`: done before (a duplicate, a retry).
    /// Answer it as success. Nothing was written.
    AlreadyThere,
    /// The row is in another state: a real conflict. Nothing was written.
    Conflict {
        /// The state the row is in, as read back.
        current: S,
    },
    /// No row has this id. Nothing was written.
    NotFound,
}

/// A stored state that is none of the type's states.
#[derive(Debug, thiserror::Error)]
#[error("`{table}.{column}` holds {value}, which is none of the states of `{ty}`")]
pub struct UnknownState {
    /// The table.
    pub table: &'static str,
    /// The state column.
    pub column: &'static str,
    /// The value found.
    pub value: String,
    /// The state type.
    pub ty: &'static str,
}

/// Starts a transition of one row; see [`Advance`].
pub fn advance<S: State, DB: Backend>(transition: Transition<S>) -> Advance<S, DB>
where
    &'static str: for<'t> Encode<'t, DB> + Type<DB>,
    i16: for<'t> Encode<'t, DB> + Type<DB>,
{
    let mut args = DB::Arguments::default();
    let bound = bind_state(&mut args, transition.to);
    Advance { transition, columns: Vec::new(), args, error: bound.err(), _db: PhantomData }
}

/// One conditional `UPDATE` being put together: [`set`](Advance::set) other
/// columns, then [`run`](Advance::run) it on a row.
#[must_use = "nothing is written until `run` is awaited"]
pub struct Advance<S, DB: Database> {
    transition: Transition<S>,
    columns: Vec<Ident>,
    args: DB::Arguments,
    error: Option<sqlx::error::BoxDynError>,
    _db: PhantomData<DB>,
}

impl<S: State, DB: Backend> Advance<S, DB> {
    /// Also sets `column` to `value` when the transition applies (never
    /// when it does not). `column` comes from [`col!`](crate::col).
    pub fn set<T>(mut self, column: Ident, value: T) -> Self
    where
        T: for<'t> Encode<'t, DB> + Type<DB>,
    {
        if self.error.is_none()
            && let Err(e) = self.args.add(value)
        {
            self.error = Some(e);
        }
        self.columns.push(column);
        self
    }

    /// Moves row `id` along the transition: one conditional `UPDATE`, and
    /// on zero rows one `SELECT` of the row's state (and the `UPDATE` again
    /// if the row turns out to be in `from` after all, up to three times). Works on any
    /// connection: `&mut **tx` inside an `#[idempotent]` body, or a
    /// transaction or pool connection of your own.
    pub async fn run<C, I>(mut self, conn: &mut C, id: I) -> Result<Advanced<S>, sqlx::Error>
    where
        // Names the database through the connection's type, so callers
        // never spell it out.
        C: sqlx::Connection<Database = DB>,
        for<'e> &'e mut C: Executor<'e, Database = DB>,
        I: for<'t> Encode<'t, DB> + Type<DB> + Clone,
        &'static str: for<'t> Encode<'t, DB> + Type<DB>,
        i16: for<'t> Encode<'t, DB> + Type<DB>,
        DB::Arguments: sqlx::IntoArguments<DB> + Clone,
        for<'r> String: Decode<'r, DB> + Type<DB>,
        for<'r> i16: Decode<'r, DB>,
        (String,): for<'r> sqlx::FromRow<'r, DB::Row>,
        (i16,): for<'r> sqlx::FromRow<'r, DB::Row>,
    {
        if let Some(e) = self.error.take() {
            return Err(sqlx::Error::Encode(e));
        }
        let mut n = 1; // the new state is argument 1
        let mut sets = format!("{} = {}", DB::quote(S::COLUMN.as_str()), DB::placeholder(n));
        for column in &self.columns {
            n += 1;
            sets.push_str(&format!(", {} = {}", DB::quote(column.as_str()), DB::placeholder(n)));
        }
        let update = format!(
            "UPDATE {} SET {sets} WHERE {} = {} AND {} = {}",
            DB::quote(S::TABLE.as_str()),
            DB::quote(S::ID.as_str()),
            DB::placeholder(n + 1),
            DB::quote(S::COLUMN.as_str()),
            DB::placeholder(n + 2),
        );
        let mut update_args = self.args;
        update_args.add(id.clone()).map_err(sqlx::Error::Encode)?;
        bind_state(&mut update_args, self.transition.from).map_err(sqlx::Error::Encode)?;

        // The latest committed state: under MySQL's REPEATABLE READ a plain
        // read could show a snapshot from before the update that beat ours.
        let select = format!(
            "SELECT {} FROM {} WHERE {} = {}{}",
            DB::quote(S::COLUMN.as_str()),
            DB::quote(S::TABLE.as_str()),
            DB::quote(S::ID.as_str()),
            DB::placeholder(1),
            DB::latest_committed_suffix(),
        );
        let mut select_args = DB::Arguments::default();
        select_args.add(id).map_err(sqlx::Error::Encode)?;

        // Unnamed statements in the body of an engine behind a transaction pooler.
        let pooling = crate::store::pooling::in_body();
        let mut attempt = 0;
        loop {
            attempt += 1;
            // Built from checked identifiers and placeholders only.
            let update = pooling.query_with(AssertSqlSafe(update.clone()), update_args.clone());
            if DB::rows_affected(&update.execute(&mut *conn).await?) > 0 {
                return Ok(Advanced::Applied);
            }
            let current = if S::STORED_AS_INT {
                let select = pooling.query_as_with(AssertSqlSafe(select.clone()), select_args.clone());
                let found: Option<(i16,)> = select.fetch_optional(&mut *conn).await?;
                found.map(|(n,)| (S::from_int(n), n.to_string()))
            } else {
                let select = pooling.query_as_with(AssertSqlSafe(select.clone()), select_args.clone());
                let found: Option<(String,)> = select.fetch_optional(&mut *conn).await?;
                found.map(|(text,)| (S::from_text(&text), format!("{text:?}")))
            };
            return match current {
                None => Ok(Advanced::NotFound),
                Some((Some(state), _)) if state == self.transition.to => Ok(Advanced::AlreadyThere),
                // In `from` after all: our `UPDATE` ran while another
                // transaction held the row in a state it then left (on
                // PostgreSQL it skips a row whose old version does not
                // match, without waiting). Try again.
                Some((Some(state), _)) if state == self.transition.from && attempt < UPDATE_ATTEMPTS => continue,
                Some((Some(state), _)) => Ok(Advanced::Conflict { current: state }),
                Some((None, value)) => Err(sqlx::Error::Decode(Box::new(UnknownState {
                    table: S::TABLE.as_str(),
                    column: S::COLUMN.as_str(),
                    value,
                    ty: std::any::type_name::<S>(),
                }))),
            };
        }
    }
}

fn bind_state<S: State, DB: Database>(args: &mut DB::Arguments, state: S) -> Result<(), sqlx::error::BoxDynError>
where
    &'static str: for<'t> Encode<'t, DB> + Type<DB>,
    i16: for<'t> Encode<'t, DB> + Type<DB>,
{
    match state.stored() {
        Stored::Text(text) => args.add(text),
        Stored::Int(n) => args.add(n),
    }
}

/// A declared transition of a `#[derive(State)]` type, checked at compile
/// time: `transition!(OrderStatus: Pending -> Paid)`. A transition the type
/// does not declare, or a state it does not have, does not compile.
#[macro_export]
macro_rules! transition {
    ($state:ty : $from:ident -> $to:ident) => {
        const { <$state>::__idem_transition(<$state>::$from, <$state>::$to) }
    };
}

/// A SQL column name checked at compile time, for
/// [`Advance::set`](crate::state::Advance::set): `col!(paid_at)`. A name
/// outside `[A-Za-z_][A-Za-z0-9_]{0,63}` does not compile.
#[macro_export]
macro_rules! col {
    ($name:ident) => {
        const { $crate::state::Ident::__checked(::core::stringify!($name)) }
    };
}
