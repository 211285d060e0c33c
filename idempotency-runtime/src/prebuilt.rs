//! The call flows of each backend compiled in, built in this crate. An
//! unoptimized build of the caller's crate (cargo's dev profile, where rustc
//! shares generic code between crates) links to these instead of building
//! the flows again; an optimized build builds its own, to inline them.

use crate::store::Backend;

/// Never called: naming each flow of each backend compiled in builds them
/// here.
pub fn flows() -> usize {
    let mut named = 0;
    #[cfg(feature = "sqlite")]
    {
        named ^= of::<sqlx::Sqlite>();
    }
    #[cfg(feature = "mysql")]
    {
        named ^= of::<sqlx::MySql>();
    }
    #[cfg(feature = "postgres")]
    {
        named ^= of::<sqlx::Postgres>();
    }
    named
}

fn of<DB: Backend>() -> usize {
    let plain: fn(_, _, _, _, _, _) -> _ = crate::call::run::<DB>;
    let joined: fn(_, _, _, _, _, _, _) -> _ = crate::call::joined::run_joined::<DB>;
    let steps: fn(_, _, _, _, _, _) -> _ = crate::steps::run_steps::<DB>;
    plain as usize ^ joined as usize ^ steps as usize
}
