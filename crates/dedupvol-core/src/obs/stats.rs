//! Volume statistics, as `dedupvol stats --json` reports them.
//!
//! Two kinds of counters: `ReductionCounters` and `IoStats` count what *this process* did
//! since it opened the volume; `LifetimeCounters` count what happened to the volume over
//! its whole life, kept in the superblock (docs/format.md).
//!
//! Invariants:
//! - Space figures are exact (derived from the block map and reference counts the engine
//!   keeps), never estimates; I/O figures come from the device counters.
//! - Lifetime counters only grow: a read-write open loads them, adds this process's
//!   counters to the loaded figures (never to figures already added), and writes the sum
//!   at every checkpoint and at close. After a crash they stand as of the last checkpoint.

use crate::config::{Compression, DedupVerify, WritePolicy};
use crate::obs::io::IoStats;
use serde::{Deserialize, Serialize};

/// Savings split by mechanism, in logical bytes that did not become physical bytes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Savings {
    /// Logical bytes written as zero blocks (no data I/O, no space).
    pub zero_bytes: u64,
    /// Logical bytes stored as references to existing data (estimated: the mapped bytes
    /// times the share of the volume's data writes that were duplicates over its life).
    pub dedup_bytes: u64,
    /// Bytes saved by compressing unique data: the rest of the mapped bytes, less the
    /// physical bytes in use.
    pub compression_bytes: u64,
}

/// Counters of the reduction pipeline in this process (since open).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
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
    /// Reuse stamps that wrapped, each starting a new index epoch (hash verification).
    pub stamp_wrap_scans: u64,
    /// Cleaner passes that moved fragments out of partly dead blocks.
    pub cleaner_passes: u64,
    /// Fragments the cleaner moved.
    pub cleaner_fragments_moved: u64,
    /// Compressed bytes the cleaner wrote again (its write amplification, against the
    /// client's data bytes written).
    pub cleaner_bytes_moved: u64,
    /// Logical blocks whose mapping the cleaner changed.
    pub cleaner_blocks_remapped: u64,
    /// Compressed bytes of fragments dropped from the map since the last cleaner pass
    /// (a hint of dead space: a fragment shared by several blocks counts once per block).
    pub dead_fragment_bytes_hint: u64,
    /// Recompression passes (fragments not at rest brought there: another codec than the
    /// volume's, or not yet settled at its rest level).
    pub recompress_passes: u64,
    /// Fragments the recompressor replaced (stored again).
    pub recompress_fragments: u64,
    /// Fragments it settled where they were (marked, no data written: storing them again
    /// would not have paid).
    #[serde(default)]
    pub recompress_fragments_marked: u64,
    /// Logical bytes the recompressor compressed again.
    pub recompress_bytes: u64,
    /// Compressed bytes it saved: the old fragments' bytes less the new ones'.
    pub recompress_bytes_saved: u64,
}

/// A full statistics snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
    /// Pipeline counters of this process (since open).
    pub counters: ReductionCounters,
    /// Counters over the volume's life, up to now.
    pub lifetime: LifetimeCounters,
    /// Entries in the in-memory volume index now (occupied slots).
    pub index_entries: u64,
    /// Capacity of the volume index in entries (slots).
    pub index_capacity: u64,
    /// Memory of the volume index in bytes.
    pub index_memory_bytes: u64,
    /// Bytes of the volume index per slot.
    pub index_bytes_per_entry: u64,
    /// The fingerprint index in detail: chapters, window, lookups, cache, rebuild.
    pub index: IndexFigures,
    /// Block map pages in the cache now.
    pub block_map_cached_pages: u64,
    /// Compression setting.
    pub compression: Compression,
    /// Its level (zstd; 0 for codecs without levels).
    #[serde(default)]
    pub compression_level: i8,
    /// zstd level data at rest is recompressed to while idle (0: off).
    #[serde(default)]
    pub rest_level: i8,
    /// Largest extent formed now, in 4 KiB blocks (`Volume::extent_max`).
    #[serde(default)]
    pub extent_blocks_max: u8,
    /// The volume's zstd dictionary (`data::dictionary`), as (id, bytes); None: none yet.
    #[serde(default)]
    pub dictionary: Option<(u32, u32)>,
    /// The volume has a dictionary area (volumes formatted before dictionaries have none).
    #[serde(default)]
    pub dictionary_area: bool,
    /// Dedup setting.
    pub dedup: bool,
    /// Verification mode.
    pub verify: DedupVerify,
    /// Write policy in effect.
    pub write_policy: WritePolicy,
    /// I/O counters of this process by category.
    pub io: IoStats,
    /// Bytes each data device moved (this process), for a volume striped over several;
    /// empty for one data device.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub data_devices: Vec<crate::io::DataDeviceIo>,
    /// The hot-chunk tier of this session (None: no tier configured or it could not be
    /// opened).
    pub tier: Option<TierStats>,
    /// The current or last scrub of this process (None: none ran).
    #[serde(default)]
    pub scrub: Option<crate::check::scrub::ScrubStatus>,
    /// Write-once journaling of this session (None: off).
    #[serde(default)]
    pub woj: Option<crate::woj::WojStats>,
    /// The write pipeline: batches, stages, queue and latency.
    #[serde(default)]
    pub pipeline: crate::pipeline::batcher::PipelineStats,
}

/// Figures of the fingerprint index (counters since open).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct IndexFigures {
    /// `dense` or `sparse`.
    pub mode: String,
    /// Volume index memory per occupied slot, in bytes (the table is sized for a full
    /// window; lower is better, 6 / load factor at a full window).
    pub memory_bytes_per_entry: f64,
    /// Memory of the record cache, in bytes: its decoded records (48 bytes each, 101 a
    /// page) and their bookkeeping.
    pub cache_bytes: u64,
    /// Chapters in the ring.
    pub chapters: u64,
    /// Chapters used so far (at most `chapters`).
    pub chapters_used: u64,
    /// Records per chapter.
    pub records_per_chapter: u64,
    /// Data the ring covers (the dedup window), in bytes.
    pub window_bytes: u64,
    /// Lookups.
    pub lookups: u64,
    /// Lookups answered from memory alone.
    pub lookups_without_io: u64,
    /// Record pages read from the metadata device.
    pub page_reads: u64,
    /// Record pages found in the cache.
    pub page_cache_hits: u64,
    /// Whole chapters loaded by a hook (sparse).
    pub chapter_loads: u64,
    /// Failed chapter writes (dedup lost, no data).
    pub write_errors: u64,
    /// The rebuild of the volume index from the ring is under way (in the background;
    /// duplicates in chapters not rebuilt yet are missed meanwhile).
    #[serde(default)]
    pub rebuild_running: bool,
    /// Chapters of the window the rebuild reads.
    #[serde(default)]
    pub rebuild_chapters_total: u64,
    /// Chapters of the window rebuilt so far.
    #[serde(default)]
    pub rebuild_chapters_done: u64,
    /// First pages of chapter slots read at open to find the newest chapter (before the
    /// volume accepts I/O).
    #[serde(default)]
    pub rebuild_probe_reads: u64,
    /// Time those reads took, in milliseconds.
    #[serde(default)]
    pub rebuild_probe_millis: u64,
    /// Time the rebuild took (so far, while it runs), in milliseconds.
    pub rebuild_millis: u64,
    /// Records the rebuild read.
    pub rebuild_records: u64,
    /// Bytes the rebuild read (name pages, and record pages where names were missing).
    pub rebuild_bytes: u64,
    /// Bytes of the record pages of the chapters rebuilt: the part of the window covered
    /// (reading names instead of records covers it about five times faster).
    #[serde(default)]
    pub rebuild_covered_bytes: u64,
    /// Chapters rebuilt from their record pages because their names were incomplete (the
    /// chapter open at a crash, names torn, or a volume made without name pages).
    #[serde(default)]
    pub rebuild_chapters_without_names: u64,
    /// Pages of the window's chapters the rebuild skipped (torn, stale, never written).
    pub rebuild_pages_skipped: u64,
}

/// Figures of the hot-chunk tier in this process (since open).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TierStats {
    /// Slots on the tier device.
    pub capacity_slots: u64,
    /// Bytes of slots (`capacity_slots` × 4 KiB).
    pub capacity_bytes: u64,
    /// Blocks the tier holds a copy of now (validated or not).
    pub entries: u64,
    /// Data block reads served by the tier.
    pub hits: u64,
    /// Data block reads that went to the data device while a tier was configured.
    pub misses: u64,
    /// hits / (hits + misses): the share of data block reads the tier served (0 without reads).
    pub hit_share: f64,
    /// Blocks copied because their reference count reached the threshold.
    pub promotions_write: u64,
    /// Blocks copied because they were read again soon.
    pub promotions_read: u64,
    /// Blocks copied as they were written, while the tier had room.
    pub fills: u64,
    /// Promotions dropped (queue full, or no slot free of in-flight copies).
    pub promotions_dropped: u64,
    /// Copies demoted to make room.
    pub demotions: u64,
    /// Bytes of block copies written to the tier device.
    pub slot_bytes_written: u64,
    /// Entries found at open whose block no longer matched the data device.
    pub validation_failures: u64,
    /// Tier reads whose content did not match the slot's recorded crc (torn or misdirected).
    pub slot_crc_failures: u64,
    /// Tier device read and write errors.
    pub device_errors: u64,
    /// True when repeated device errors disabled the tier for the session.
    pub disabled: bool,
}

/// Declares `LifetimeCounters` from one list of fields, in on-disk order, with the
/// conversions to and from the on-disk words (so the order is written down once).
macro_rules! lifetime_counters {
    ($($(#[$doc:meta])* $field:ident,)*) => {
        /// Counters over a volume's whole life, persisted in the superblock: every read-write
        /// open adds what its process did. Read-only opens (`stats`, `info`, `check`, `export`)
        /// add nothing. The field order is the on-disk order (`to_words`).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
        pub struct LifetimeCounters {
            $($(#[$doc])* pub $field: u64,)*
        }

        impl LifetimeCounters {
            /// Counters stored on disk.
            pub const WORDS: usize = [$(stringify!($field)),*].len();

            /// The counters in on-disk order.
            pub fn to_words(&self) -> [u64; Self::WORDS] {
                [$(self.$field),*]
            }

            /// The inverse of `to_words`.
            pub fn from_words(w: [u64; Self::WORDS]) -> Self {
                let [$($field),*] = w;
                Self { $($field),* }
            }
        }
    };
}

lifetime_counters! {
    /// Read-write opens, this one included.
    read_write_opens,
    /// Read-write opens that found the volume not closed cleanly (journal replayed).
    recoveries,
    /// 4 KiB blocks written by clients.
    blocks_written,
    /// Of those, all-zero blocks.
    zero_blocks,
    /// Of those, blocks shared with existing data.
    dedup_hits,
    /// Index candidates rejected by verification.
    dedup_verify_failures,
    /// Duplicates written as a new copy because the reference count was at its cap.
    refcount_cap_copies,
    /// Unique blocks stored compressed in packed blocks.
    compressed_blocks,
    /// Unique blocks stored raw.
    raw_blocks,
    /// Packed physical blocks written.
    packed_blocks_written,
    /// Group commits.
    commits,
    /// Checkpoints.
    checkpoints,
    /// Full index scans after a reuse stamp wrapped.
    stamp_wrap_scans,
    /// Bytes written to the data device for client data.
    data_write_bytes,
    /// Bytes of data read to serve client reads.
    data_read_bytes,
    /// Bytes of data read to verify duplicates.
    verify_read_bytes,
    /// Bytes of metadata written (journal, block map, refcounts, index, superblocks).
    metadata_write_bytes,
    /// Durability barriers (fdatasync) issued.
    syncs,
}

impl LifetimeCounters {
    /// These counters plus one process's (saturating: a damaged record must not panic).
    pub fn plus_process(&self, red: &ReductionCounters, io: &IoStats) -> Self {
        let add = |a: u64, b: u64| a.saturating_add(b);
        let metadata_write_bytes = [io.block_map_write, io.refcount_write, io.index_write, io.superblock_write]
            .iter()
            .fold(io.journal_write.bytes, |sum, f| add(sum, f.bytes));
        Self {
            read_write_opens: self.read_write_opens,
            recoveries: self.recoveries,
            blocks_written: add(self.blocks_written, red.blocks_written),
            zero_blocks: add(self.zero_blocks, red.zero_blocks),
            dedup_hits: add(self.dedup_hits, red.dedup_hits),
            dedup_verify_failures: add(self.dedup_verify_failures, red.dedup_verify_failures),
            refcount_cap_copies: add(self.refcount_cap_copies, red.refcount_cap_copies),
            compressed_blocks: add(self.compressed_blocks, red.compressed_blocks),
            raw_blocks: add(self.raw_blocks, red.raw_blocks),
            packed_blocks_written: add(self.packed_blocks_written, red.packed_blocks_written),
            commits: add(self.commits, red.commits),
            checkpoints: add(self.checkpoints, red.checkpoints),
            stamp_wrap_scans: add(self.stamp_wrap_scans, red.stamp_wrap_scans),
            data_write_bytes: add(self.data_write_bytes, io.data_write.bytes),
            data_read_bytes: add(self.data_read_bytes, io.data_read.bytes),
            verify_read_bytes: add(self.verify_read_bytes, io.verify_read.bytes),
            metadata_write_bytes: add(self.metadata_write_bytes, metadata_write_bytes),
            syncs: add(self.syncs, io.syncs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::obs::io::IoFigure;

    #[test]
    fn words_round_trip_in_field_order() {
        let w: [u64; LifetimeCounters::WORDS] = std::array::from_fn(|i| 1000 + i as u64);
        let c = LifetimeCounters::from_words(w);
        assert_eq!(c.to_words(), w);
        assert_eq!((c.read_write_opens, c.blocks_written, c.syncs), (1000, 1002, 1017));
    }

    #[test]
    fn process_counters_add_to_the_loaded_ones() {
        let base = LifetimeCounters { read_write_opens: 2, blocks_written: 10, syncs: u64::MAX, ..Default::default() };
        let red = ReductionCounters { blocks_written: 5, checkpoints: 1, ..Default::default() };
        let io = IoStats {
            syncs: 3,
            journal_write: IoFigure { bytes: 4096, ops: 1 },
            superblock_write: IoFigure { bytes: 8192, ops: 2 },
            ..Default::default()
        };
        let now = base.plus_process(&red, &io);
        assert_eq!((now.read_write_opens, now.blocks_written, now.checkpoints), (2, 15, 1));
        assert_eq!(now.metadata_write_bytes, 12288);
        assert_eq!(now.syncs, u64::MAX, "saturates instead of wrapping");
    }
}
