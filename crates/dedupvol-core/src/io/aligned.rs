//! Page-aligned buffers for direct I/O, and a bounded pool of bounce buffers.
//!
//! Direct I/O (`O_DIRECT`) needs the memory, the offset and the length aligned to the
//! device's logical block size. The engine's blocks live in ordinary heap memory, so data
//! written or read directly passes through a bounce buffer: a user-space copy between warm
//! buffers, far cheaper than the kernel's copy into freshly allocated page-cache pages it
//! replaces.
//!
//! Invariants:
//! - An `AlignedBuf` is at least `ALIGN`-aligned, a whole number of its alignment long,
//!   zeroed when made, and never reallocated; it is freed the way it was made (heap
//!   layout, or its own mapping).
//! - A bounce buffer is `BOUNCE_BYTES` long and lent to one call at a time; at most
//!   `BOUNCE_POOL_MAX` idle ones are kept.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Mutex;

/// Alignment of direct I/O memory, offsets and lengths: covers 512 B and 4 KiB sectors.
pub const ALIGN: usize = 4096;
/// Size of a bounce buffer; larger transfers go through it in pieces.
pub const BOUNCE_BYTES: usize = 2 << 20;
/// Alignment of a bounce buffer: one transparent huge page, so a whole transfer is one
/// physically contiguous segment and the block layer need not split it into several
/// device requests (a virtio disk takes ~254 segments per request; each request costs
/// the VM an exit to notify the host).
const BOUNCE_ALIGN: usize = 2 << 20;

/// Length from which an `ALIGN`-aligned buffer is mapped from the kernel on its own rather
/// than taken from the heap. Why: such buffers are short-lived and large (the index
/// rebuild's reads), and glibc keeps freed heap memory of a thread's arena resident (its
/// trim threshold rises with the mmap threshold as mapped blocks are freed); a mapping
/// goes back to the system the moment it is dropped.
const MAPPED_BYTES_MIN: usize = 1 << 20;

/// A zeroed, `ALIGN`-aligned buffer of fixed length: from the heap, or a mapping of its own
/// (`MAPPED_BYTES_MIN`).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    align: usize,
    mapped: bool,
}

// SAFETY: the buffer is uniquely owned heap memory, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of `len` bytes rounded up to `ALIGN` (at least one unit); None when the
    /// allocation fails.
    pub fn new(len: usize) -> Option<Self> {
        Self::with_align(len, ALIGN)
    }

    /// A buffer of `len` bytes rounded up to `align` (a power of two, at least `ALIGN`).
    fn with_align(len: usize, align: usize) -> Option<Self> {
        let len = len.max(1).checked_next_multiple_of(align)?;
        if align == ALIGN && len >= MAPPED_BYTES_MIN {
            // SAFETY: an anonymous private mapping of `len` bytes at an address the kernel
            // picks: page-aligned (ALIGN is the page size) and zeroed; no other memory is
            // touched.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return None;
            }
            return Some(AlignedBuf { ptr: NonNull::new(p.cast::<u8>())?, len, align, mapped: true });
        }
        let layout = Layout::from_size_align(len, align).ok()?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        Some(AlignedBuf { ptr: NonNull::new(p)?, len, align, mapped: false })
    }

    /// The whole buffer, to read.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed at allocation) bytes owned by self;
        // the shared borrow of self rules out a `&mut` access meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The whole buffer.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed at allocation) bytes owned by self,
        // and the &mut borrow of self makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: mapped in `with_align` with exactly this address and length, and
            // unmapped only here.
            unsafe { libc::munmap(self.ptr.as_ptr().cast::<libc::c_void>(), self.len) };
            return;
        }
        if let Ok(layout) = Layout::from_size_align(self.len, self.align) {
            // SAFETY: allocated in `new` with exactly this layout, and freed only here.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// Bounce buffers kept for reuse at most: retained memory stays bounded however many
/// threads do I/O (NBD workers, writers), and reused buffers stay warm.
const BOUNCE_POOL_MAX: usize = 8;

static POOL: Mutex<Vec<AlignedBuf>> = Mutex::new(Vec::new());

/// Runs `f` with a bounce buffer of `BOUNCE_BYTES` taken from the pool (or made, on huge
/// pages where the kernel offers them), then returns the buffer to the pool. None when a
/// buffer cannot be allocated.
pub fn with_bounce<R>(f: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
    let pooled = POOL.lock().unwrap_or_else(|e| e.into_inner()).pop();
    let mut b = match pooled {
        Some(b) => b,
        None => {
            let mut b = AlignedBuf::with_align(BOUNCE_BYTES, BOUNCE_ALIGN)?;
            crate::io::hugemem::advise(b.as_mut_slice());
            b
        }
    };
    let slice = b.as_mut_slice();
    debug_assert!(slice.len() == BOUNCE_BYTES && is_aligned_ptr(slice.as_ptr()));
    let r = f(slice);
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if pool.len() < BOUNCE_POOL_MAX {
        pool.push(b);
    }
    Some(r)
}

/// True when `offset` and `len` are whole `ALIGN` units.
pub fn is_aligned(offset: u64, len: usize) -> bool {
    offset.is_multiple_of(ALIGN as u64) && len.is_multiple_of(ALIGN)
}

/// True when memory at `p` may be handed to direct I/O as it is.
pub fn is_aligned_ptr(p: *const u8) -> bool {
    (p as usize).is_multiple_of(ALIGN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_rounded() {
        let mut b = AlignedBuf::new(5000).expect("alloc");
        let s = b.as_mut_slice();
        assert_eq!(s.len(), 8192);
        assert!(is_aligned_ptr(s.as_ptr()));
        assert!(s.iter().all(|&x| x == 0));
        let n = with_bounce(|b| {
            assert!(is_aligned_ptr(b.as_ptr()));
            // A nested call gets a buffer of its own, never an alias of this one.
            let inner = with_bounce(|c| c.as_ptr() as usize).expect("inner");
            assert_ne!(inner, b.as_ptr() as usize);
            b.len()
        });
        assert_eq!(n, Some(BOUNCE_BYTES));
        assert!(is_aligned(8192, 4096) && !is_aligned(512, 4096) && !is_aligned(4096, 100));
    }
}
