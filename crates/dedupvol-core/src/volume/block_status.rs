//! Allocation queries: which logical ranges hold data and which read as zeros without
//! holding any (`Volume::block_status`), and how many physical blocks carry each reference
//! count (`Volume::refcount_histogram`). Both serve operators and clients that skip holes
//! (NBD `base:allocation`, `qemu-img map`), never the data path.
//!
//! Invariants:
//! - A hole extent covers only blocks whose map entry is unmapped or zero: every byte of
//!   it reads back as zero. Data extents may read as zeros too (a block is not scanned).
//! - Extents are consecutive, non-empty, alternate in kind (runs of one kind are merged),
//!   and cover a prefix of the asked range that is never empty when the range is not.
//! - The state lock is held once per `BLOCK_STATUS_BLOCKS_PER_HOLD` blocks at most, and a
//!   call looks at `BLOCK_STATUS_BLOCKS_MAX` blocks at most, so one query cannot hold up
//!   writes for long or run without end; the answer is then a prefix the caller continues.
//! - The histogram holds the state lock once per `HISTOGRAM_BLOCKS_PER_HOLD` blocks: it is
//!   a sum over moments, exact only while nothing writes.

use super::Volume;
use crate::config::BLOCK_SIZE_U64;
use crate::error::Result;
use crate::metadata::refcount::REFCOUNT_MAX;

/// Map entries looked up per hold of the state lock (64 MiB of logical space, 41 block map
/// pages): a lookup that misses the block map cache reads pages under the lock.
pub const BLOCK_STATUS_BLOCKS_PER_HOLD: u64 = 16 << 10;
/// Blocks one call looks at, at most (4 GiB, the longest NBD request).
pub const BLOCK_STATUS_BLOCKS_MAX: u64 = 1 << 20;
/// Reference counts summed per hold of the state lock.
const HISTOGRAM_BLOCKS_PER_HOLD: usize = 1 << 20;

/// What a run of logical bytes holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExtentKind {
    /// Stored data (compressed, shared or raw).
    Data,
    /// No physical space: never written, discarded, or written with zeros. Reads as zeros.
    Hole,
}

/// A run of logical bytes of one kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Extent {
    /// Bytes in the run (never 0).
    pub len: u64,
    /// What they hold.
    pub kind: ExtentKind,
}

/// One bucket of the reference-count histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RefcountBucket {
    /// Counts up to and including this value fall here (powers of two, then the cap).
    pub refs_max: u32,
    /// Physical blocks in use with a reference count in (previous bucket's max, refs_max].
    pub blocks: u64,
    /// Sum of those blocks' reference counts (logical blocks and fragments pointing at them).
    pub references: u64,
}

/// Appends `len` bytes of `kind` to `out`, merging with the last run when it is the same.
fn push(out: &mut Vec<Extent>, len: u64, kind: ExtentKind) {
    match out.last_mut() {
        Some(last) if last.kind == kind => last.len += len,
        _ => out.push(Extent { len, kind }),
    }
}

impl Volume {
    /// The allocation of bytes `offset..offset + len`, as merged runs of data and holes.
    /// Stops early (at a run boundary or after `BLOCK_STATUS_BLOCKS_MAX` blocks) once
    /// `extents_max` runs are found; the runs always cover a non-empty prefix of a
    /// non-empty range. Reads no data, only the block map.
    pub fn block_status(&self, offset: u64, len: u64, extents_max: usize) -> Result<Vec<Extent>> {
        self.check_range(offset, len)?;
        let mut out: Vec<Extent> = Vec::new();
        if len == 0 {
            return Ok(out);
        }
        let extents_max = extents_max.max(1);
        let end = offset + len;
        let first_lba = offset / BLOCK_SIZE_U64;
        let last_lba = (end - 1) / BLOCK_SIZE_U64;
        let stop_lba = last_lba.min(first_lba + BLOCK_STATUS_BLOCKS_MAX - 1);
        let mut lba = first_lba;
        'holds: while lba <= stop_lba {
            let hold_end = stop_lba.min(lba + BLOCK_STATUS_BLOCKS_PER_HOLD - 1);
            let mut st = self.state.lock();
            while lba <= hold_end {
                let e = st.map.get(lba)?;
                let kind = if e.is_data() { ExtentKind::Data } else { ExtentKind::Hole };
                // The asked range may start or end inside a block.
                let from = offset.max(lba * BLOCK_SIZE_U64);
                let to = end.min((lba + 1) * BLOCK_SIZE_U64);
                if out.len() == extents_max && out.last().is_some_and(|l| l.kind != kind) {
                    break 'holds;
                }
                push(&mut out, to - from, kind);
                lba += 1;
            }
            // As the read path does: pages this query loaded must not grow the cache.
            let durable = st.journal.durable_seq();
            st.map.evict(durable)?;
        }
        debug_assert!(!out.is_empty() && out.iter().map(|e| e.len).sum::<u64>() <= len);
        Ok(out)
    }

    /// Physical blocks in use by reference count, in buckets 1, 2, 3–4, 5–8, … up to the
    /// cap (the table `zpool status -D` prints for a dedup table). Scans every count: call
    /// it for reports, not per request.
    pub fn refcount_histogram(&self) -> Vec<RefcountBucket> {
        let mut bounds: Vec<u32> = Vec::new();
        let mut b = 1u32;
        while b < u32::from(REFCOUNT_MAX) {
            bounds.push(b);
            b *= 2;
        }
        bounds.push(u32::from(REFCOUNT_MAX));
        let mut buckets: Vec<RefcountBucket> =
            bounds.iter().map(|&refs_max| RefcountBucket { refs_max, blocks: 0, references: 0 }).collect();
        // Counts are u8: a table of 256 tallies per hold, folded into buckets at the end.
        let mut tally = [0u64; 256];
        let mut from = 0usize;
        loop {
            let st = self.state.lock();
            let counts = st.rc.counts();
            let Some(part) = counts.get(from..counts.len().min(from + HISTOGRAM_BLOCKS_PER_HOLD)) else { break };
            if part.is_empty() {
                break;
            }
            for &c in part {
                if let Some(t) = tally.get_mut(usize::from(c)) {
                    *t += 1;
                }
            }
            from += part.len();
        }
        for (count, &n) in tally.iter().enumerate().skip(1) {
            let count = count as u32;
            if let Some(bucket) = buckets.iter_mut().find(|b| count <= b.refs_max) {
                bucket.blocks += n;
                bucket.references += n * u64::from(count);
            }
        }
        buckets
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{FormatOptions, OpenOptions, BLOCK_SIZE};
    use crate::io::{MemStorage, Storage};
    use std::sync::Arc;

    fn volume() -> Volume {
        let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
        let opts = FormatOptions {
            logical_size_bytes: 16 << 20,
            index_memory_bytes: 1 << 20,
            slab_size_bytes: 1 << 20,
            ..FormatOptions::default()
        };
        Volume::format(dev.clone(), None, &opts, false).expect("format");
        Volume::open(dev, None, &OpenOptions::default()).expect("open")
    }

    const B: u64 = BLOCK_SIZE_U64;
    fn hole(len: u64) -> Extent {
        Extent { len, kind: ExtentKind::Hole }
    }
    fn data(len: u64) -> Extent {
        Extent { len, kind: ExtentKind::Data }
    }

    #[test]
    fn unmapped_zero_and_discarded_blocks_are_holes() {
        let v = volume();
        let size = v.logical_size();
        assert_eq!(v.block_status(0, size, 16).expect("status"), vec![hole(size)]);
        let block: Vec<u8> = (0..BLOCK_SIZE).map(|i| (i % 251) as u8 + 1).collect();
        // Blocks 2, 3 data; 4 written with zeros (a hole); 5 data; 6 data then discarded.
        v.write(2 * B, &[block.clone(), block.clone()].concat(), false).expect("write");
        v.write(4 * B, &vec![0u8; BLOCK_SIZE], false).expect("zeros");
        v.write(5 * B, &block, false).expect("write");
        v.write(6 * B, &block, false).expect("write");
        v.discard(6 * B, B).expect("discard");
        let got = v.block_status(0, 8 * B, 16).expect("status");
        assert_eq!(got, vec![hole(2 * B), data(2 * B), hole(B), data(B), hole(2 * B)]);
        // Unaligned: starts inside block 1, ends inside block 5.
        let got = v.block_status(B + 100, 4 * B, 16).expect("status");
        assert_eq!(got, vec![hole(B - 100), data(2 * B), hole(B), data(100)]);
        // The extent bound stops at a run boundary, leaving a non-empty prefix.
        assert_eq!(v.block_status(0, 8 * B, 2).expect("status"), vec![hole(2 * B), data(2 * B)]);
        assert_eq!(v.block_status(0, 8 * B, 0).expect("status"), vec![hole(2 * B)]);
        assert!(v.block_status(0, 0, 4).expect("empty").is_empty());
        assert!(v.block_status(size - 1, 2, 4).is_err(), "past the end is an error");
    }

    #[test]
    fn histogram_counts_shared_blocks() {
        let v = volume();
        let block: Vec<u8> = (0..BLOCK_SIZE).map(|i| (i * 31 % 253) as u8).collect();
        for i in 0..5 {
            v.write(i * B, &block, false).expect("write");
        }
        let other: Vec<u8> = (0..BLOCK_SIZE).map(|i| (i * 7 % 13) as u8 + 200).collect();
        v.write(10 * B, &other, false).expect("write");
        let h = v.refcount_histogram();
        assert_eq!(h.first().map(|b| b.refs_max), Some(1));
        assert_eq!(h.last().map(|b| b.refs_max), Some(u32::from(REFCOUNT_MAX)));
        let blocks: u64 = h.iter().map(|b| b.blocks).sum();
        let refs: u64 = h.iter().map(|b| b.references).sum();
        assert!(blocks >= 1 && refs >= 6, "{h:?}");
        // The five copies share one block: it sits in the 5..=8 bucket.
        assert!(h.iter().any(|b| b.refs_max == 8 && b.blocks >= 1), "{h:?}");
    }

    #[test]
    fn runs_merge_and_alternate() {
        let mut v = Vec::new();
        push(&mut v, 4096, ExtentKind::Hole);
        push(&mut v, 100, ExtentKind::Hole);
        push(&mut v, 4096, ExtentKind::Data);
        push(&mut v, 4096, ExtentKind::Hole);
        assert_eq!(
            v,
            vec![
                Extent { len: 4196, kind: ExtentKind::Hole },
                Extent { len: 4096, kind: ExtentKind::Data },
                Extent { len: 4096, kind: ExtentKind::Hole },
            ]
        );
    }
}
