//! Which cells a run runs: all of them (`IDEM_MATRIX=all`, or
//! `--include-ignored`), or a slice drawn from `IDEM_MATRIX_SEED` (CI sets
//! it from the clock, so the slice rotates; the seed is printed, and
//! setting it again runs the same slice). Cells outside the slice are
//! listed as ignored, never as passed.
//!
//! A slice covers every pair of values of two dimensions at least once (a
//! gate with an entry, a mode with a backend, ...), the cells drawn in the
//! seed's order, each time the one that covers the most pairs not yet
//! covered (about 23 cells), then more in the seed's order up to
//! [`SLICE`] (or `IDEM_MATRIX_SLICE`): a fresh choice every seed. Known
//! defects are left out of it.

use std::collections::HashSet;

use crate::table::{Combo, known_defect};

/// The seed when `IDEM_MATRIX_SEED` is not set: a run without it is the same run every time.
const DEFAULT_SEED: u64 = 1;

/// Cells in a slice: about a minute of CI's suite, run four at a time
/// beside the other tests on two cores (about two seconds a cell).
const SLICE: usize = 60;

/// What this run runs.
pub struct Plan {
    pub seed: u64,
    /// Every cell, not a slice.
    pub all: bool,
    chosen: HashSet<Combo>,
}

impl Plan {
    /// From the environment: `IDEM_MATRIX=all`, `IDEM_MATRIX_SEED=<u64>`.
    pub fn from_env(cells: &[Combo]) -> Plan {
        let all = std::env::var("IDEM_MATRIX").is_ok_and(|v| v == "all");
        let number = |name: &str, default: u64| match std::env::var(name) {
            Ok(text) => text.trim().parse().unwrap_or_else(|_| panic!("{name}={text}: not a number")),
            Err(_) => default,
        };
        let seed = number("IDEM_MATRIX_SEED", DEFAULT_SEED);
        let size = usize::try_from(number("IDEM_MATRIX_SLICE", SLICE as u64)).expect("a slice size");
        Plan { seed, all, chosen: slice(cells, seed, size) }
    }

    /// Whether `combo` runs without `--include-ignored`.
    pub fn runs(&self, combo: Combo) -> bool {
        self.all || self.chosen.contains(&combo)
    }

    /// How many cells the slice holds.
    pub fn slice_len(&self) -> usize {
        self.chosen.len()
    }
}

/// A pair of values of two dimensions: `(dimension, value, dimension, value)`.
type Pair = (usize, usize, usize, usize);

fn pairs(combo: Combo) -> Vec<Pair> {
    let values = combo.values();
    let mut pairs = Vec::new();
    for a in 0..values.len() {
        for b in a + 1..values.len() {
            pairs.push((a, values[a], b, values[b]));
        }
    }
    pairs
}

/// The `size` cells (at least those covering every pair) of the slice for
/// `seed` (see the module docs).
fn slice(cells: &[Combo], seed: u64, size: usize) -> HashSet<Combo> {
    let mut order: Vec<Combo> = cells.iter().copied().filter(|c| known_defect(*c).is_none()).collect();
    shuffle(&mut order, seed);
    let mut uncovered: HashSet<Pair> = order.iter().flat_map(|c| pairs(*c)).collect();
    let mut chosen = HashSet::new();
    while !uncovered.is_empty() {
        let gain = |c: &Combo| pairs(*c).iter().filter(|p| uncovered.contains(p)).count();
        // The first in the seed's order among those that cover the most.
        let best = order.iter().copied().fold(None, |best: Option<(Combo, usize)>, c| {
            let g = gain(&c);
            match best {
                Some((_, b)) if b >= g => best,
                _ => Some((c, g)),
            }
        });
        let Some((cell, _)) = best else { break };
        for pair in pairs(cell) {
            uncovered.remove(&pair);
        }
        order.retain(|c| *c != cell);
        chosen.insert(cell);
    }
    chosen.extend(order.into_iter().take(size.saturating_sub(chosen.len())));
    chosen
}

/// Fisher-Yates on splitmix64: the same order for the same seed on every
/// machine and toolchain.
fn shuffle(cells: &mut [Combo], seed: u64) {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    for i in (1..cells.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        cells.swap(i, j);
    }
}

/// Checks the slicing itself (a test of its own beside the cells): for
/// many seeds, a slice holds `SLICE` cells, no known defect, and every
/// pair of values two dimensions can take; the same seed gives the same
/// slice, and seeds differ.
pub fn check(cells: &[Combo]) -> Result<(), String> {
    let all_pairs: HashSet<Pair> =
        cells.iter().filter(|c| known_defect(**c).is_none()).flat_map(|c| pairs(*c)).collect();
    let mut slices = HashSet::new();
    for seed in 0..12 {
        let chosen = slice(cells, seed, SLICE);
        if chosen.len() != SLICE || chosen.iter().any(|c| known_defect(*c).is_some()) {
            return Err(format!("seed {seed}: {} cells, or a known defect among them", chosen.len()));
        }
        let covered: HashSet<Pair> = chosen.iter().flat_map(|c| pairs(*c)).collect();
        if covered != all_pairs {
            return Err(format!("seed {seed}: {} of {} pairs covered", covered.len(), all_pairs.len()));
        }
        if slice(cells, seed, SLICE) != chosen {
            return Err(format!("seed {seed}: two slices"));
        }
        let mut names: Vec<String> = chosen.iter().map(Combo::to_string).collect();
        names.sort();
        slices.insert(names);
    }
    if slices.len() < 12 {
        return Err(format!("12 seeds drew only {} slices", slices.len()));
    }
    Ok(())
}
