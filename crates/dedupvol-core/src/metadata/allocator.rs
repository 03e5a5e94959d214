//! Physical block allocation over log-structured slabs.
//!
//! Invariants:
//! - A block is busy when its reference count is non-zero, when it is reserved for data
//!   being placed, or when its last reference was dropped by a journal entry that is not
//!   yet durable. A busy block is never handed out: reusing a block whose freeing could
//!   still be undone by a crash would let old mappings read new data.
//! - `slab_free[s]` equals the number of non-busy blocks in slab `s`; `free_total` is their sum.
//! - Allocation fills the current slab front to back (large sequential writes) and moves
//!   to the slab with the most free blocks when the current one is full.
//! - `pending` is in journal-sequence order, and every block in it is busy.
//!
//! `alloc` asserts that the block it hands out was free and its counters had room;
//! `unreserve` and `free_later` assert that their block is busy; the caller asserts that
//! a block handed out has no references (`Volume::alloc_block`). `audit` checks the whole
//! bitmap against the reference counts (tests, the simulator and the `verify` feature).

use std::collections::VecDeque;

/// The slab allocator.
pub struct Allocator {
    data_blocks: u64,
    slab_blocks: u64,
    busy: Vec<u64>,
    slab_free: Vec<u64>,
    free_total: u64,
    current_slab: u64,
    cursor: u64,
    pending: VecDeque<(u64, u64)>,
}

impl Allocator {
    /// Builds the allocator from reference counts.
    pub fn from_counts(counts: &[u16], slab_blocks: u64) -> Self {
        let data_blocks = counts.len() as u64;
        let slabs = data_blocks.div_ceil(slab_blocks) as usize;
        let mut a = Allocator {
            data_blocks,
            slab_blocks,
            busy: vec![0; counts.len().div_ceil(64)],
            slab_free: vec![0; slabs],
            free_total: 0,
            current_slab: 0,
            cursor: 0,
            pending: VecDeque::new(),
        };
        for (i, &c) in counts.iter().enumerate() {
            if c > 0 {
                a.set_busy(i as u64, true);
            } else if let Some(f) = a.slab_free.get_mut(i / slab_blocks as usize) {
                *f += 1;
                a.free_total += 1;
            }
        }
        a.current_slab = a.best_slab().unwrap_or(0);
        a.cursor = a.current_slab * slab_blocks;
        a
    }

    /// Blocks that can be handed out now.
    pub fn free_blocks(&self) -> u64 {
        self.free_total
    }

    /// A grow: blocks `data_blocks..new_blocks` join the data region, free (the last
    /// slab, if it was short, fills up; new slabs follow).
    pub fn grow(&mut self, new_blocks: u64) {
        assert!(new_blocks >= self.data_blocks, "the data region never shrinks");
        let old = self.data_blocks;
        self.busy.resize(new_blocks.div_ceil(64) as usize, 0);
        self.slab_free.resize(new_blocks.div_ceil(self.slab_blocks) as usize, 0);
        let mut pbn = old;
        while pbn < new_blocks {
            let slab = pbn / self.slab_blocks;
            let end = ((slab + 1) * self.slab_blocks).min(new_blocks);
            if let Some(f) = self.slab_free.get_mut(slab as usize) {
                *f += end - pbn;
            }
            self.free_total += end - pbn;
            pbn = end;
        }
        self.data_blocks = new_blocks;
    }

    fn is_busy(&self, pbn: u64) -> bool {
        self.busy.get((pbn / 64) as usize).is_some_and(|w| w & (1 << (pbn % 64)) != 0)
    }

    fn set_busy(&mut self, pbn: u64, busy: bool) {
        if let Some(w) = self.busy.get_mut((pbn / 64) as usize) {
            if busy {
                *w |= 1 << (pbn % 64);
            } else {
                *w &= !(1 << (pbn % 64));
            }
        }
    }

    fn best_slab(&self) -> Option<u64> {
        let mut best: Option<(u64, u64)> = None;
        for (s, &f) in self.slab_free.iter().enumerate() {
            if f > 0 && best.is_none_or(|(_, bf)| f > bf) {
                best = Some((s as u64, f));
            }
        }
        best.map(|(s, _)| s)
    }

    /// Allocates one block, or None when every block is busy.
    pub fn alloc(&mut self) -> Option<u64> {
        if self.free_total == 0 {
            return None;
        }
        loop {
            let slab_end = ((self.current_slab + 1) * self.slab_blocks).min(self.data_blocks);
            if self.slab_free.get(self.current_slab as usize).copied().unwrap_or(0) > 0 {
                while self.cursor < slab_end {
                    let word = self.busy.get((self.cursor / 64) as usize).copied().unwrap_or(u64::MAX);
                    let bit = self.cursor % 64;
                    let free_bits = !word >> bit;
                    if free_bits == 0 {
                        self.cursor += 64 - bit;
                        continue;
                    }
                    let pbn = self.cursor + u64::from(free_bits.trailing_zeros());
                    if pbn >= slab_end {
                        self.cursor = slab_end;
                        break;
                    }
                    assert!(!self.is_busy(pbn), "allocator: block {pbn} handed out while busy");
                    self.set_busy(pbn, true);
                    let slab_free = self.slab_free.get_mut(self.current_slab as usize);
                    assert!(
                        self.free_total > 0 && slab_free.as_ref().is_some_and(|f| **f > 0),
                        "allocator: block {pbn} taken from slab {} with no free blocks counted",
                        self.current_slab
                    );
                    if let Some(f) = slab_free {
                        *f -= 1;
                    }
                    self.free_total -= 1;
                    self.cursor = pbn + 1;
                    return Some(pbn);
                }
                // Free blocks sit behind the cursor: rescan this slab from its start next time.
            }
            let next = self.best_slab()?;
            self.current_slab = next;
            self.cursor = next * self.slab_blocks;
        }
    }

    /// Allocates block `pbn` itself when it is free (a run of compressed data growing
    /// into the block after it); false when it is busy or beyond the region.
    pub fn try_reserve(&mut self, pbn: u64) -> bool {
        if pbn >= self.data_blocks || self.is_busy(pbn) {
            return false;
        }
        let slab = pbn / self.slab_blocks;
        let slab_free = self.slab_free.get_mut(slab as usize);
        assert!(
            self.free_total > 0 && slab_free.as_ref().is_some_and(|f| **f > 0),
            "allocator: block {pbn} reserved from slab {slab} with no free blocks counted"
        );
        if let Some(f) = slab_free {
            *f -= 1;
        }
        self.free_total -= 1;
        self.set_busy(pbn, true);
        if slab == self.current_slab && self.cursor == pbn {
            self.cursor = pbn + 1;
        }
        true
    }

    /// Returns a block that was allocated but never referenced.
    pub fn unreserve(&mut self, pbn: u64) {
        assert!(self.is_busy(pbn), "allocator: unreserving block {pbn}, which is not allocated");
        self.release(pbn);
    }

    fn release(&mut self, pbn: u64) {
        if pbn < self.data_blocks && self.is_busy(pbn) {
            self.set_busy(pbn, false);
            if let Some(f) = self.slab_free.get_mut((pbn / self.slab_blocks) as usize) {
                *f += 1;
            }
            self.free_total += 1;
            if pbn / self.slab_blocks == self.current_slab && pbn < self.cursor {
                self.cursor = pbn;
            }
        }
    }

    /// Marks `pbn` free once journal entry `seq` (which dropped its last reference) is durable.
    pub fn free_later(&mut self, pbn: u64, seq: u64) {
        assert!(self.is_busy(pbn), "allocator: block {pbn} freed by entry {seq} is not busy");
        assert!(
            self.pending.back().is_none_or(|&(_, last)| last <= seq),
            "allocator: block {pbn} freed by entry {seq} after a later entry"
        );
        self.pending.push_back((pbn, seq));
    }

    /// Releases every pending block whose freeing entry is durable; returns how many.
    pub fn release_durable(&mut self, durable_seq: u64, still_free: impl Fn(u64) -> bool) -> u64 {
        let mut n = 0;
        while let Some(&(pbn, seq)) = self.pending.front() {
            if seq > durable_seq {
                break;
            }
            self.pending.pop_front();
            // A later entry may have re-referenced the block (dedup onto a dying block is
            // refused, but repair can); only release it if it is still unreferenced.
            if still_free(pbn) {
                self.release(pbn);
                n += 1;
            }
        }
        n
    }

    /// Blocks waiting for their freeing entry to become durable.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Checks the allocator against reference counts: every referenced or pending block is
    /// busy, and the free counters match the bitmap (an audit for tests and the simulator).
    pub fn audit(&self, counts: &[u16], open_pbns: &[u64]) -> Result<(), String> {
        let mut free = 0u64;
        for pbn in 0..self.data_blocks {
            let busy = self.is_busy(pbn);
            if counts.get(pbn as usize).copied().unwrap_or(0) > 0 && !busy {
                return Err(format!("referenced block {pbn} is free in the allocator"));
            }
            if !busy {
                free += 1;
            }
        }
        for &p in open_pbns {
            if !self.is_busy(p) {
                return Err(format!("open packed block {p} is free in the allocator"));
            }
        }
        if let Some((p, _)) = self.pending.iter().find(|(p, _)| !self.is_busy(*p)) {
            return Err(format!("pending-free block {p} is already free"));
        }
        if self.pending.iter().zip(self.pending.iter().skip(1)).any(|(a, b)| a.1 > b.1) {
            return Err("pending-free blocks are not in journal order".into());
        }
        if self.current_slab as usize >= self.slab_free.len().max(1) || self.cursor > self.data_blocks {
            return Err(format!("allocator cursor {} / slab {} out of range", self.cursor, self.current_slab));
        }
        if free != self.free_total || self.slab_free.iter().sum::<u64>() != free {
            return Err(format!(
                "free counters {} / {} disagree with the bitmap ({free})",
                self.free_total,
                self.slab_free.iter().sum::<u64>()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_sequentially_and_never_reuses_before_durable() {
        let mut counts = vec![0u16; 300];
        counts[1] = 1;
        let mut a = Allocator::from_counts(&counts, 512);
        assert_eq!(a.alloc(), Some(0));
        assert_eq!(a.alloc(), Some(2), "busy block skipped");
        a.free_later(0, 10);
        assert_eq!(a.release_durable(9, |_| true), 0);
        let mut got = Vec::new();
        while let Some(p) = a.alloc() {
            got.push(p);
        }
        assert_eq!(got.len(), 297);
        assert!(!got.contains(&0) && !got.contains(&1));
        assert_eq!(a.release_durable(10, |_| true), 1);
        assert_eq!(a.alloc(), Some(0));
        assert_eq!(a.alloc(), None);
    }
}
