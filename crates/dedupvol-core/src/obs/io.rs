//! Live I/O counters by category: the data of the I/O overhead breakdown.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};

/// What a device access was for: the categories of the paper's I/O overhead breakdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    /// Client data blocks (raw or packed) written or read back for a client read.
    Data,
    /// Recovery journal blocks.
    Journal,
    /// Block map pages.
    BlockMap,
    /// Reference count pages.
    Refcount,
    /// Fingerprint index chapter ring: record pages written and read, the rebuild.
    Index,
    /// Reads of stored data to verify a duplicate before sharing it.
    Verify,
    /// Superblock copies.
    Superblock,
    /// Data blocks read to fill or validate the hot-chunk tier.
    TierFill,
    /// Data blocks and metadata pages read by a scrub, and blocks its repair rewrote.
    Scrub,
}

/// Bytes and operations for one category and direction.
#[derive(Debug, Default)]
pub struct IoCounter {
    /// Bytes moved.
    pub bytes: AtomicU64,
    /// Device operations issued.
    pub ops: AtomicU64,
}

impl IoCounter {
    pub(crate) fn add(&self, bytes: usize) {
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.ops.fetch_add(1, Ordering::Relaxed);
    }
    fn snapshot(&self) -> IoFigure {
        IoFigure { bytes: self.bytes.load(Ordering::Relaxed), ops: self.ops.load(Ordering::Relaxed) }
    }
}

/// A snapshot of one counter.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct IoFigure {
    /// Bytes moved.
    pub bytes: u64,
    /// Operations issued.
    pub ops: u64,
}

/// Live I/O counters by category, shared by all of a volume's devices.
#[derive(Debug, Default)]
pub struct IoCounters {
    data_write: IoCounter,
    data_read: IoCounter,
    journal_write: IoCounter,
    journal_read: IoCounter,
    block_map_write: IoCounter,
    block_map_read: IoCounter,
    refcount_write: IoCounter,
    refcount_read: IoCounter,
    index_write: IoCounter,
    index_read: IoCounter,
    verify_read: IoCounter,
    superblock_write: IoCounter,
    superblock_read: IoCounter,
    tier_fill_read: IoCounter,
    scrub_read: IoCounter,
    scrub_write: IoCounter,
    pub(crate) syncs: AtomicU64,
}

impl IoCounters {
    pub(crate) fn counter(&self, kind: IoKind, write: bool) -> &IoCounter {
        match (kind, write) {
            (IoKind::Data, true) => &self.data_write,
            (IoKind::Data, false) => &self.data_read,
            (IoKind::Journal, true) => &self.journal_write,
            (IoKind::Journal, false) => &self.journal_read,
            (IoKind::BlockMap, true) => &self.block_map_write,
            (IoKind::BlockMap, false) => &self.block_map_read,
            (IoKind::Refcount, true) => &self.refcount_write,
            (IoKind::Refcount, false) => &self.refcount_read,
            (IoKind::Index, true) => &self.index_write,
            (IoKind::Index, false) => &self.index_read,
            (IoKind::Verify, _) => &self.verify_read,
            (IoKind::Superblock, true) => &self.superblock_write,
            (IoKind::Superblock, false) => &self.superblock_read,
            (IoKind::TierFill, _) => &self.tier_fill_read,
            (IoKind::Scrub, false) => &self.scrub_read,
            (IoKind::Scrub, true) => &self.scrub_write,
        }
    }

    /// A point-in-time copy for stats.
    pub fn snapshot(&self) -> IoStats {
        IoStats {
            data_write: self.data_write.snapshot(),
            data_read: self.data_read.snapshot(),
            journal_write: self.journal_write.snapshot(),
            journal_read: self.journal_read.snapshot(),
            block_map_write: self.block_map_write.snapshot(),
            block_map_read: self.block_map_read.snapshot(),
            refcount_write: self.refcount_write.snapshot(),
            refcount_read: self.refcount_read.snapshot(),
            index_write: self.index_write.snapshot(),
            index_read: self.index_read.snapshot(),
            verify_read: self.verify_read.snapshot(),
            superblock_write: self.superblock_write.snapshot(),
            superblock_read: self.superblock_read.snapshot(),
            tier_fill_read: self.tier_fill_read.snapshot(),
            scrub_read: self.scrub_read.snapshot(),
            scrub_write: self.scrub_write.snapshot(),
            syncs: self.syncs.load(Ordering::Relaxed),
        }
    }
}

/// I/O counters by category (bytes and operations), as reported by `stats`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct IoStats {
    /// Client data written to the data device (raw and packed blocks).
    pub data_write: IoFigure,
    /// Data blocks read to serve client reads.
    pub data_read: IoFigure,
    /// Recovery journal blocks written.
    pub journal_write: IoFigure,
    /// Journal blocks read (recovery).
    pub journal_read: IoFigure,
    /// Block map pages written.
    pub block_map_write: IoFigure,
    /// Block map pages read (cache misses).
    pub block_map_read: IoFigure,
    /// Reference count pages written.
    pub refcount_write: IoFigure,
    /// Reference count pages read (open).
    pub refcount_read: IoFigure,
    /// Fingerprint index chapter pages written.
    pub index_write: IoFigure,
    /// Fingerprint index record pages read (lookups, hooks, the rebuild at open).
    pub index_read: IoFigure,
    /// Data read to verify duplicates (cache misses only).
    pub verify_read: IoFigure,
    /// Superblock writes.
    pub superblock_write: IoFigure,
    /// Superblock reads.
    pub superblock_read: IoFigure,
    /// Data blocks read from the data device to fill or validate the hot-chunk tier.
    pub tier_fill_read: IoFigure,
    /// Data blocks and metadata pages read by scrubs.
    #[serde(default)]
    pub scrub_read: IoFigure,
    /// Data blocks rewritten by scrub repairs.
    #[serde(default)]
    pub scrub_write: IoFigure,
    /// Durability barriers (fdatasync) issued, all devices.
    pub syncs: u64,
}

impl IoStats {
    /// Total bytes written to all devices.
    pub fn total_written_bytes(&self) -> u64 {
        self.data_write.bytes
            + self.journal_write.bytes
            + self.block_map_write.bytes
            + self.refcount_write.bytes
            + self.index_write.bytes
            + self.superblock_write.bytes
    }
}
