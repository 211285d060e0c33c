//! "No allocation proportional to anything but the input": every target
//! runs its parsers under [`bounded`], which fails the run when one
//! allocation exceeds [`PER_INPUT_BYTE`] bytes per input byte plus
//! [`SLACK`]. libFuzzer's `-malloc_limit_mb` catches the same from outside,
//! with a coarser bound (it counts megabytes).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes one allocation may take per byte of input: the `http` crate
/// keeps about 72 bytes per header line (a line can be one byte), in a
/// vector that doubles as it grows; a JSON array of zeros (`[0,0,...]`)
/// becomes a 32-byte value per two bytes. A bound per byte still catches
/// what matters: a size read from the input, or growth faster than it.
pub const PER_INPUT_BYTE: usize = 256;
/// Bytes one allocation may take whatever the input: a buffer, a table.
pub const SLACK: usize = 64 * 1024;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, noting the largest allocation asked for.
struct Noting;

// SAFETY: every call is passed to `System` unchanged.
unsafe impl GlobalAlloc for Noting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Noting = Noting;

/// Runs `f` on an input of `input_len` bytes and panics if one allocation
/// it made exceeded the bound.
pub fn bounded<R>(input_len: usize, f: impl FnOnce() -> R) -> R {
    LARGEST.store(0, Ordering::Relaxed);
    let out = f();
    let largest = LARGEST.load(Ordering::Relaxed);
    let bound = input_len.saturating_mul(PER_INPUT_BYTE).saturating_add(SLACK);
    assert!(largest <= bound, "one allocation of {largest} bytes for an input of {input_len} bytes (bound {bound})");
    out
}
