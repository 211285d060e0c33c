//! Nothing but a home for the `quickstart` example (`quickstart.rs`
//! beside this folder): a package of its own, so that the README's first
//! command builds the crate with SQLite alone.
