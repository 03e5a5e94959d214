//! Large zeroed tables (fingerprint index, reference counts, reuse stamps) backed by
//! transparent huge pages where the kernel offers them.
//!
//! Why: these tables are touched at random. With 4 KiB pages the first write to a page
//! faults twice (the shared zero page on the first read, then copy-on-write with a TLB
//! shootdown to every core), and steady-state lookups miss the TLB. 2 MiB pages cut both
//! by 512x. The advice is only advice: with THP off the table behaves as a plain `Vec`.
//!
//! A table can also be populated in the background (`Prefault`), so the data path does
//! not take those faults (and the 2 MiB clears) while it holds the volume's state lock.
//!
//! Invariants:
//! - A table is exactly `vec![T::default(); n]` (all zero); only `madvise` is applied.
//! - Only whole 2 MiB-aligned spans inside the allocation are advised.
//! - A `Prefault` never reads or writes the table through Rust; it only asks the kernel to
//!   populate its pages, and it is joined (on drop) before its table may be freed.

/// Size of an x86-64 transparent huge page.
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// A zeroed table of `n` elements, advised to use huge pages.
pub fn zeroed<T: Clone + Default>(n: usize) -> Vec<T> {
    let v = vec![T::default(); n];
    advise(&v);
    v
}

/// Element types whose all-zero bit pattern is their `Default` value, so a table of them
/// can come straight from zeroed memory (`try_zeroed`).
///
/// # Safety
/// Implement only for types where every byte zero is a valid value equal to `T::default()`.
pub unsafe trait ZeroDefault: Clone + Default {}
// SAFETY: integers and byte arrays are valid and default when all bytes are zero.
unsafe impl ZeroDefault for u64 {}
// SAFETY: as above.
unsafe impl ZeroDefault for u8 {}
// SAFETY: as above.
unsafe impl ZeroDefault for u16 {}
// SAFETY: as above.
unsafe impl ZeroDefault for u32 {}
// SAFETY: as above.
unsafe impl ZeroDefault for [u8; 24] {}

/// `zeroed`, but a table the allocator cannot provide is `None` instead of an abort. Why:
/// the index's size is stored in the volume and may exceed what this machine can hold
/// (formatted elsewhere); opening it must then be a clear error, not a crash.
pub fn try_zeroed<T: ZeroDefault>(n: usize) -> Option<Vec<T>> {
    if n == 0 || std::mem::size_of::<T>() == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(n).ok()?;
    // SAFETY: `layout` has a non-zero size (n > 0, T not zero-sized). A non-null result is
    // a zeroed allocation of `n` elements with `T`'s alignment from the global allocator,
    // which is what `Vec::from_raw_parts` needs (capacity = length = n); every element is
    // initialised because all-zero is a valid `T` (`ZeroDefault`).
    let v = unsafe {
        let p = std::alloc::alloc_zeroed(layout).cast::<T>();
        if p.is_null() {
            return None;
        }
        Vec::from_raw_parts(p, n, n)
    };
    advise(&v);
    Some(v)
}

/// The machine's physical memory in bytes (None where the OS does not say).
pub fn physical_memory_bytes() -> Option<u64> {
    // SAFETY: sysconf only reads system configuration.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    if pages <= 0 || page <= 0 {
        return None;
    }
    (pages as u64).checked_mul(page as u64)
}

/// Advises the whole 2 MiB-aligned spans inside `v` to use huge pages.
pub(crate) fn advise<T>(v: &[T]) {
    let start = v.as_ptr() as usize;
    let end = start.saturating_add(std::mem::size_of_val(v));
    let a = start.next_multiple_of(HUGE_PAGE_BYTES);
    let b = end / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
    if b > a {
        // SAFETY: [a, b) lies inside the live allocation of `v`; MADV_HUGEPAGE changes only
        // how the kernel backs the pages, never their contents. Its result is ignored
        // because the advice is optional (THP may be disabled).
        unsafe {
            libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_HUGEPAGE);
        }
    }
}

/// Size of a base page.
const SMALL_PAGE_BYTES: usize = 4096;
/// Bytes populated per `madvise` call, so dropping a `Prefault` stops it promptly.
const PREFAULT_STEP_BYTES: usize = 16 << 20;

/// A background thread populating a table's pages. Its owner must drop it before the table:
/// declare the `Prefault` field before the table's field.
pub struct Prefault {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Prefault {
    /// Starts populating `v`'s pages (writable, zero-filled) in the background.
    pub fn start<T>(v: &[T]) -> Prefault {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        // Whole 4 KiB pages inside the table only (madvise wants page-aligned ranges).
        let first = v.as_ptr() as usize;
        let start = first.next_multiple_of(SMALL_PAGE_BYTES);
        let len = (first + std::mem::size_of_val(v)).saturating_sub(start) / SMALL_PAGE_BYTES * SMALL_PAGE_BYTES;
        let flag = std::sync::Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("dedupvol-prefault".into())
            .spawn(move || {
                let mut off = 0;
                while off < len && !flag.load(Ordering::Relaxed) {
                    let n = (len - off).min(PREFAULT_STEP_BYTES);
                    // SAFETY: [start + off, +n) lies inside the table, which stays allocated
                    // until this thread is joined (the owner drops the Prefault first).
                    // MADV_POPULATE_WRITE faults pages in without changing their contents,
                    // so it cannot race with the owner's reads and writes. Failure (an old
                    // kernel) only means the faults happen later, on first touch.
                    let r = unsafe { libc::madvise((start + off) as *mut libc::c_void, n, libc::MADV_POPULATE_WRITE) };
                    if r != 0 {
                        break;
                    }
                    off += n;
                }
            })
            .ok();
        Prefault { stop, thread }
    }
}

impl Prefault {
    /// Waits until every page is populated (or population gave up).
    pub fn wait(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Prefault {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.wait();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn zeroed_is_a_plain_zero_vec() {
        let v: Vec<u64> = super::zeroed(3 << 20);
        assert_eq!(v.len(), 3 << 20);
        assert!(v.iter().all(|&x| x == 0));
        let w: Vec<[u8; 24]> = super::zeroed(5);
        assert_eq!(w, vec![[0u8; 24]; 5]);
    }

    #[test]
    fn try_zeroed_is_zero_and_refuses_impossible_sizes() {
        let v: Vec<[u8; 24]> = super::try_zeroed(3 << 16).expect("small table");
        assert!(v.iter().all(|x| *x == [0u8; 24]));
        assert!(super::try_zeroed::<u64>(usize::MAX / 4).is_none());
        assert!(super::try_zeroed::<u64>(0).is_some_and(|v| v.is_empty()));
    }

    #[test]
    fn prefault_keeps_contents_while_the_owner_writes() {
        let mut v: Vec<u64> = super::zeroed(8 << 20);
        let p = super::Prefault::start(&v);
        for (i, x) in v.iter_mut().enumerate().step_by(4096) {
            *x = i as u64;
        }
        drop(p);
        assert!(v.iter().enumerate().all(|(i, &x)| x == if i % 4096 == 0 { i as u64 } else { 0 }));
    }
}
