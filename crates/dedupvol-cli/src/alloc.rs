//! The process's memory allocator: jemalloc, with two changes of behaviour.
//!
//! Why jemalloc rather than glibc malloc: the write path allocates a 4 KiB block per chunk
//! on the NBD worker that received it and frees it on the data-writer thread once it is on
//! the device (or on whichever thread evicts it from the content cache). glibc serves such
//! cross-thread frees through locked arenas; on 8–128 KiB random writes that cost showed
//! as 8 % of the server's CPU. With jemalloc's thread caches those writes ran 1.16–1.24x
//! faster at 90 % reducible (within drift at 0 %) and peak RSS fell 7–22 %
//! (docs/benchmarks/2026-11-29/allocator).
//!
//! Invariants:
//! - Two arenas (`narenas:2`): every thread's freed memory is reusable by the others, so
//!   the server's memory stays near what the content cache counts (more arenas each keep
//!   their own free memory, as glibc's did).
//! - A zeroed allocation up to `MEMSET_ZEROED_MAX` is an allocation and a `memset`. jemalloc
//!   zeroes a recycled extent for `calloc` with `madvise(MADV_DONTNEED)`, which flushes the
//!   TLB of every core and faults each page back in on first touch; the read path's decode
//!   buffers (a zeroed buffer per compressed unit read) made that a third of the server's
//!   CPU under 1 MiB sequential reads. Larger zeroed allocations (index tables made once)
//!   still come from `calloc`, whose fresh pages are zero without being touched.

use std::alloc::{GlobalAlloc, Layout};
use tikv_jemallocator::Jemalloc;

/// Zeroed allocations up to this size are filled by `memset` (see the module's invariants).
const MEMSET_ZEROED_MAX: usize = 4 << 20;

/// jemalloc's options, read once at its start (the symbol its prefixed build looks for).
#[repr(transparent)]
pub struct MallocConf(*const std::ffi::c_char);
// SAFETY: a pointer to a static, immutable C string.
unsafe impl Sync for MallocConf {}

#[used]
#[export_name = "_rjem_malloc_conf"]
pub static MALLOC_CONF: MallocConf = MallocConf(c"narenas:2".as_ptr());

/// The global allocator (see the module's comment).
pub struct Allocator;

// SAFETY: every call is forwarded to jemalloc with the caller's layout; `alloc_zeroed`
// returns memory it zeroed itself or jemalloc's zeroed memory.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { Jemalloc.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > MEMSET_ZEROED_MAX {
            // SAFETY: forwarded with the caller's guarantees.
            return unsafe { Jemalloc.alloc_zeroed(layout) };
        }
        // SAFETY: forwarded with the caller's guarantees; a non-null result holds
        // `layout.size()` writable bytes.
        unsafe {
            let p = Jemalloc.alloc(layout);
            if !p.is_null() {
                std::ptr::write_bytes(p, 0, layout.size());
            }
            p
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { Jemalloc.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { Jemalloc.realloc(ptr, layout, new_size) }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn zeroed_allocations_are_zero_after_reuse() {
        // Dirty memory of every size class the memset path covers, freed, then asked for
        // zeroed again: whichever extent comes back must read as zeros.
        for size in [64usize, 4096, 16 << 10, 200 << 10, 1 << 20, 4 << 20, 5 << 20] {
            drop(vec![0xA5u8; size]);
            let v = vec![0u8; size];
            assert!(v.iter().all(|&b| b == 0), "a zeroed allocation of {size} bytes was not zero");
        }
    }
}
