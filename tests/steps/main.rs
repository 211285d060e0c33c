//! Calls to outside services: `#[idempotent(..., steps)]`, the two-phase
//! mode with recorded steps, fencing and recovery.
//!
//! - `api`: the mode in one process, on SQLite, MariaDB and PostgreSQL,
//!   with and without Redis.

mod api;
mod support;
