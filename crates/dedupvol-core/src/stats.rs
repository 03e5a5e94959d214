//! Volume statistics, as `dedupvol stats --json` reports them.
//!
//! Invariants:
//! - Space figures are exact (derived from the block map and reference counts the engine
//!   keeps), never estimates; I/O figures come from the device counters.

use crate::config::{Compression, DedupVerify, WritePolicy};
use crate::storage::IoStats;
use serde::Serialize;

/// Savings split by mechanism, in logical bytes that did not become physical bytes.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Savings {
    /// Logical bytes written as zero blocks (no data I/O, no space).
    pub zero_bytes: u64,
    /// Logical bytes that were stored as references to existing data.
    pub dedup_bytes: u64,
    /// Bytes saved by compressing unique blocks (4 KiB minus the packed fragment size).
    pub compression_bytes: u64,
}

/// Counters of the reduction pipeline since open.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReductionCounters {
    /// 4 KiB blocks written by clients.
    pub blocks_written: u64,
    /// Of those, all-zero blocks.
    pub zero_blocks: u64,
    /// Of those, blocks shared with existing data.
    pub dedup_hits: u64,
    /// Index candidates rejected by verification (stale entry or different bytes).
    pub dedup_verify_failures: u64,
    /// Duplicates written as a new copy because the reference count was at its cap.
    pub refcount_cap_copies: u64,
    /// Unique blocks stored compressed in packed blocks.
    pub compressed_blocks: u64,
    /// Unique blocks stored raw (incompressible or compression off).
    pub raw_blocks: u64,
    /// Packed physical blocks written.
    pub packed_blocks_written: u64,
    /// Group commits (journal writes followed by a sync).
    pub commits: u64,
    /// Checkpoints (block map + refcount pages written, journal space reclaimed).
    pub checkpoints: u64,
    /// Content cache hits (reads and verifications served from memory).
    pub content_cache_hits: u64,
    /// Content cache misses.
    pub content_cache_misses: u64,
    /// Block map cache hits.
    pub block_map_cache_hits: u64,
    /// Block map cache misses (page reads).
    pub block_map_cache_misses: u64,
    /// Full index scans after a block's reuse stamp wrapped (hash verification).
    pub stamp_wrap_scans: u64,
}

/// A full statistics snapshot.
#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    /// Volume UUID (hex).
    pub uuid: String,
    /// Logical size in bytes.
    pub logical_size_bytes: u64,
    /// Logical bytes currently mapped to data (excludes zero/unmapped blocks).
    pub logical_bytes_used: u64,
    /// Size of the data device in bytes.
    pub physical_size_bytes: u64,
    /// Physical data blocks in the data region.
    pub data_blocks_total: u64,
    /// Physical data blocks in use.
    pub data_blocks_used: u64,
    /// Physical bytes in use for data.
    pub physical_data_bytes_used: u64,
    /// Bytes of metadata regions (journal, block map, refcounts, index, superblocks).
    pub metadata_bytes: u64,
    /// Whether metadata lives on a separate device.
    pub separate_metadata_device: bool,
    /// logical_bytes_used / physical_data_bytes_used (0 when nothing is stored).
    pub reduction_ratio: f64,
    /// Savings split by mechanism, for the data currently mapped.
    pub savings: Savings,
    /// Pipeline counters since open.
    pub counters: ReductionCounters,
    /// Entries in the fingerprint index now.
    pub index_entries: u64,
    /// Capacity of the fingerprint index in entries.
    pub index_capacity: u64,
    /// Memory of the fingerprint index in bytes.
    pub index_memory_bytes: u64,
    /// Bytes per index entry.
    pub index_bytes_per_entry: u64,
    /// Block map pages in the cache now.
    pub block_map_cached_pages: u64,
    /// Compression setting.
    pub compression: Compression,
    /// Dedup setting.
    pub dedup: bool,
    /// Verification mode.
    pub verify: DedupVerify,
    /// Write policy in effect.
    pub write_policy: WritePolicy,
    /// I/O counters by category.
    pub io: IoStats,
}
