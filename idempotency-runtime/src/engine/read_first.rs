//! Which fns read before they claim: those whose calls are mostly replays.
//!
//! Without a claim in Redis, a duplicate learns its key is taken only at
//! the unique index: a transaction opened, its insert refused, the record
//! read, the transaction rolled back (four round trips on a server). One
//! autocommit read of the record answers a finished key in one round trip.
//! With Redis, a replay found by the claim script costs Redis the script;
//! one native `HGET` of the result finds it at the floor's cost. Either
//! read done on every call would cost each first call a round trip, so
//! each fn keeps a two-bit counter of how its recent calls ended (replayed:
//! up, executed: down) and reads first while replays dominate. A wrong
//! guess costs one read; the claim and the unique index stay the only
//! judges of who runs.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::spec::Spec;

/// Slots the fns share by their spec's address; two fns in one slot only
/// blur each other's guess.
const SLOTS: usize = 64;
/// Read first from this count on (of at most [`SATURATED`]).
const READ_FROM: u8 = 2;
const SATURATED: u8 = 3;

/// One engine's guesses.
#[derive(Debug)]
pub(crate) struct ReadFirst {
    slots: [AtomicU8; SLOTS],
}

impl Default for ReadFirst {
    fn default() -> Self {
        Self { slots: std::array::from_fn(|_| AtomicU8::new(0)) }
    }
}

impl ReadFirst {
    /// Whether a call of `spec` should read its record before anything else.
    pub(crate) fn expected(&self, spec: &'static Spec) -> bool {
        self.slot(spec).load(Ordering::Relaxed) >= READ_FROM
    }

    /// Whether the recent calls of `spec` all ran (none was a replay).
    pub(crate) fn at_rest(&self, spec: &'static Spec) -> bool {
        self.slot(spec).load(Ordering::Relaxed) == 0
    }

    /// A call of `spec` reached the database and was `replayed` (or ran).
    pub(crate) fn saw(&self, spec: &'static Spec, replayed: bool) {
        let slot = self.slot(spec);
        let was = slot.load(Ordering::Relaxed);
        let now = if replayed { (was + 1).min(SATURATED) } else { was.saturating_sub(1) };
        // Stored only on a change: a steady fn's calls write nothing shared.
        if now != was {
            slot.store(now, Ordering::Relaxed);
        }
    }

    fn slot(&self, spec: &'static Spec) -> &AtomicU8 {
        let address = std::ptr::from_ref(spec) as usize;
        &self.slots[(address >> 4 ^ address >> 10) % SLOTS]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    static SPEC: Spec =
        Spec { biz: "t", ttl: Duration::from_secs(1), lease: Duration::from_secs(1), wait: None, record_errors: false };

    #[test]
    fn replays_turn_it_on_and_executions_off() {
        let guesses = ReadFirst::default();
        assert!(!guesses.expected(&SPEC), "first calls first");
        guesses.saw(&SPEC, true);
        assert!(!guesses.expected(&SPEC), "one replay is not a pattern");
        guesses.saw(&SPEC, true);
        assert!(guesses.expected(&SPEC));
        for _ in 0..10 {
            guesses.saw(&SPEC, true);
        }
        guesses.saw(&SPEC, false);
        assert!(guesses.expected(&SPEC), "saturated: one first call among replays keeps it");
        guesses.saw(&SPEC, false);
        assert!(!guesses.expected(&SPEC));
        for _ in 0..10 {
            guesses.saw(&SPEC, false);
        }
        assert!(!guesses.expected(&SPEC));
    }
}
