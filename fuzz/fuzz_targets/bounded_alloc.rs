//! The allocator every target runs under: the system's, except that a single allocation
//! over [`LIMIT`] aborts (a crash libFuzzer reports with its input): a loader must refuse a
//! file that claims a huge size before it allocates anything of that size.

use std::alloc::{GlobalAlloc, Layout, System};

/// The largest single allocation a loader may make on a fuzz input (the inputs are at most
/// a few MiB; the largest legitimate allocation is a copy of one).
pub const LIMIT: usize = 64 << 20;

pub struct Bounded;

fn check(size: usize) {
    if size > LIMIT {
        eprintln!("an allocation of {size} bytes (over {LIMIT})");
        std::process::abort();
    }
}

// SAFETY: forwards to the system allocator unchanged (after the size check).
unsafe impl GlobalAlloc for Bounded {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        // SAFETY: the caller's layout, as given.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        // SAFETY: as for alloc.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: allocated by this allocator with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check(new_size);
        // SAFETY: as for alloc.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
