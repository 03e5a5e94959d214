//! Geometry: where every region lives, in 4 KiB blocks, on the data and metadata devices.
//!
//! ```text
//! metadata device (or the data device when there is none):
//!   [0] superblock A  [1] superblock B  [journal] [refcount pages ×2 slots]
//!   [block map pages ×2 slots] [fingerprint index: chapter ring]
//! data device:
//!   [0] superblock A  [1] superblock B  (metadata here when no metadata device)
//!   [data region: slabs of slab_blocks data blocks, the last one possibly short]
//! ```
//!
//! Invariants:
//! - Regions do not overlap and lie inside their device (`Geometry::validate`).
//! - Page `p`'s slot `s` (s in 0..2) of the block map is block `block_map_start + 2p + s`;
//!   likewise for refcount pages. Journal block with sequence `b` lives at
//!   `journal_start + b % journal_blocks`.

use crate::config::BLOCK_SIZE_U64;
use crate::error::{Error, Result};

/// Block map entries per 4 KiB page (32-byte header + 406 × 10-byte entries).
pub const BM_ENTRIES_PER_PAGE: u64 = 406;
/// Reference-count entries per 4 KiB page (32-byte header + 2032 × 2 bytes).
pub const RC_ENTRIES_PER_PAGE: u64 = 2032;
/// Blocks reserved at the start of each device for the two superblock copies.
pub const SUPERBLOCK_BLOCKS: u64 = 2;
/// Smallest data region accepted.
pub const DATA_BLOCKS_MIN: u64 = 64;
/// Journal size bounds, in blocks.
pub const JOURNAL_BLOCKS_MIN: u64 = 64;
/// Largest automatically chosen journal (32 MiB).
pub const JOURNAL_BLOCKS_AUTO_MAX: u64 = 8192;

/// The placement of every region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Logical blocks exported.
    pub logical_blocks: u64,
    /// Blocks of the data device.
    pub data_dev_blocks: u64,
    /// Blocks of the metadata device (0 when metadata shares the data device).
    pub meta_dev_blocks: u64,
    /// First journal block (metadata device).
    pub journal_start: u64,
    /// Journal length in blocks.
    pub journal_blocks: u64,
    /// First refcount block (metadata device).
    pub refcount_start: u64,
    /// Refcount pages (each occupies two slots).
    pub refcount_pages: u64,
    /// First block map block (metadata device).
    pub block_map_start: u64,
    /// Block map pages (each occupies two slots).
    pub block_map_pages: u64,
    /// First block of the fingerprint index's chapter ring (metadata device).
    pub index_start: u64,
    /// Length of the chapter ring area in blocks.
    pub index_blocks: u64,
    /// First data block (data device).
    pub data_start: u64,
    /// Data blocks in the data region.
    pub data_blocks: u64,
    /// Blocks per slab.
    pub slab_blocks: u64,
}

impl Geometry {
    /// Lays out a new volume.
    pub fn compute(
        logical_blocks: u64,
        data_dev_bytes: u64,
        meta_dev_bytes: Option<u64>,
        slab_blocks: u64,
        journal_bytes: Option<u64>,
        index_wanted_blocks: u64,
    ) -> Result<Geometry> {
        let data_dev_blocks = data_dev_bytes / BLOCK_SIZE_U64;
        let meta_dev_blocks = meta_dev_bytes.map_or(0, |b| b / BLOCK_SIZE_U64);
        let journal_blocks = match journal_bytes {
            Some(j) => j / BLOCK_SIZE_U64,
            None => (data_dev_blocks / 64).clamp(JOURNAL_BLOCKS_MIN, JOURNAL_BLOCKS_AUTO_MAX),
        };
        // Refcount pages are sized for the whole data device (an upper bound on the data region).
        let refcount_pages = data_dev_blocks.div_ceil(RC_ENTRIES_PER_PAGE).max(1);
        let block_map_pages = logical_blocks.div_ceil(BM_ENTRIES_PER_PAGE);
        // Without a metadata device the ring takes at most 1/32 of the data device.
        let index_blocks =
            if meta_dev_bytes.is_some() { index_wanted_blocks } else { index_wanted_blocks.min(data_dev_blocks / 32) };
        let journal_start = SUPERBLOCK_BLOCKS;
        let refcount_start = journal_start + journal_blocks;
        let block_map_start = refcount_start + 2 * refcount_pages;
        let index_start = block_map_start + 2 * block_map_pages;
        let meta_end = index_start + index_blocks;
        let data_start = if meta_dev_bytes.is_some() {
            if meta_end > meta_dev_blocks {
                return Err(Error::InvalidArgument(format!(
                    "metadata device too small: needs at least {} bytes for this logical size (has {})",
                    meta_end * BLOCK_SIZE_U64,
                    meta_dev_blocks * BLOCK_SIZE_U64
                )));
            }
            SUPERBLOCK_BLOCKS
        } else {
            meta_end
        };
        let needed = data_start + DATA_BLOCKS_MIN;
        if data_dev_blocks < needed {
            return Err(Error::InvalidArgument(format!(
                "device too small: {} bytes, but metadata for this logical size plus a minimal data region needs at least {} bytes",
                data_dev_blocks * BLOCK_SIZE_U64,
                needed * BLOCK_SIZE_U64
            )));
        }
        let g = Geometry {
            logical_blocks,
            data_dev_blocks,
            meta_dev_blocks,
            journal_start,
            journal_blocks,
            refcount_start,
            refcount_pages,
            block_map_start,
            block_map_pages,
            index_start,
            index_blocks,
            data_start,
            data_blocks: data_dev_blocks - data_start,
            slab_blocks,
        };
        // The checks above refuse every argument that could break an invariant.
        g.validate().map_err(|e| Error::internal("computed geometry breaks its invariants", e.to_string()))?;
        Ok(g)
    }

    /// Checks the invariants (also run on geometry read back from a superblock). A broken
    /// one is corruption of a "superblock copy" (address 0: `Superblock::read` names the copy).
    pub fn validate(&self) -> Result<()> {
        let meta_blocks = if self.meta_dev_blocks > 0 { self.meta_dev_blocks } else { self.data_dev_blocks };
        let ok = self.logical_blocks > 0
            && self.journal_blocks >= JOURNAL_BLOCKS_MIN
            && self.journal_start >= SUPERBLOCK_BLOCKS
            && self.refcount_start == self.journal_start + self.journal_blocks
            && self.refcount_pages * RC_ENTRIES_PER_PAGE >= self.data_blocks
            && self.block_map_start == self.refcount_start + 2 * self.refcount_pages
            && self.block_map_pages * BM_ENTRIES_PER_PAGE >= self.logical_blocks
            && self.index_start == self.block_map_start + 2 * self.block_map_pages
            && self.index_start + self.index_blocks <= meta_blocks
            && self.data_start >= SUPERBLOCK_BLOCKS
            && (self.meta_dev_blocks > 0 || self.data_start >= self.index_start + self.index_blocks)
            && self.data_blocks >= DATA_BLOCKS_MIN
            && self.data_start + self.data_blocks <= self.data_dev_blocks
            && self.slab_blocks > 0;
        if ok {
            Ok(())
        } else {
            Err(Error::corruption(
                "superblock copy",
                0,
                "a geometry whose regions fit their devices without overlapping",
                format!("inconsistent volume geometry {self:?}"),
            ))
        }
    }

    /// Number of slabs (the last may be short).
    pub fn slab_count(&self) -> u64 {
        self.data_blocks.div_ceil(self.slab_blocks)
    }

    /// Bytes of metadata regions (including superblocks on both devices).
    pub fn metadata_bytes(&self) -> u64 {
        let sb = if self.meta_dev_blocks > 0 { 2 * SUPERBLOCK_BLOCKS } else { SUPERBLOCK_BLOCKS };
        (sb + self.journal_blocks + 2 * self.refcount_pages + 2 * self.block_map_pages + self.index_blocks)
            * BLOCK_SIZE_U64
    }

    /// Device byte offset of data block `pbn` (data device).
    pub fn data_offset(&self, pbn: u64) -> u64 {
        (self.data_start + pbn) * BLOCK_SIZE_U64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_valid_and_refuse_tiny_devices() {
        let g = Geometry::compute(1 << 18, 256 << 20, None, 256, None, 256).expect("layout");
        assert!(g.data_blocks > 60_000);
        assert!(Geometry::compute(1 << 18, 1 << 20, None, 256, None, 256).is_err());
        let g2 = Geometry::compute(1 << 30, 256 << 20, Some(64 << 30), 256, None, 256).expect("meta layout");
        assert_eq!(g2.data_start, 2);
        assert!(Geometry::compute(1 << 30, 256 << 20, Some(1 << 20), 256, None, 256).is_err());
    }
}
