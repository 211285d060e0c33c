//! The harness's own tests: the nemesis's proxy does what each cut says,
//! its checker and the soak's reconciliation are not vacuous, and the
//! schedules have the shape they claim. No server is needed; these sit with
//! the harness rather than among the crate's tests, so a red line in the
//! crate's suite is about the crate.

mod proxy;
mod rules;
mod schedule;
mod soak;
