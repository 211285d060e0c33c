//! Calls to outside services: `#[idempotent(..., steps)]`, the two-phase
//! mode with recorded steps, fencing and recovery.
//!
//! - `api`: the mode in one process, on SQLite, MariaDB and PostgreSQL,
//!   with and without Redis.
//! - `crash`: the proof by killing real processes (child processes are this
//!   binary again), against a payment provider on loopback (`provider`).
//! - `skew`: the same processes with their clocks skewed by libfaketime:
//!   the database's clock decides expiry and leases.
//! - `waits`: a duplicate on another instance, with no Redis claim, waits
//!   for the running call within its bound.

mod api;
mod crash;
mod provider;
mod skew;
mod support;
mod waits;
