//! dedupvol-core: an inline deduplicating and compressing block storage engine.
//!
//! A [`Volume`] is a thin-provisioned virtual disk of 4 KiB logical blocks stored on one data
//! device (and optionally a separate metadata device). Every write is split into 4 KiB
//! chunks; zero chunks cost no I/O; others are fingerprinted with BLAKE3, shared with an
//! existing copy when the fingerprint index finds a verified duplicate, and otherwise
//! compressed (LZ4/zstd), packed several to a physical block, and appended to a
//! log-structured data slab. A recovery journal with group commit makes the block map and
//! reference counts crash-consistent; see `docs/format.md` and `docs/design.md` for the
//! durability contract.
//!
//! The crate has no network dependencies; the NBD server and the CLI build on it.
//!
//! Modules (all private; this file re-exports the public API):
//! - `volume`: the public `Volume` — lifecycle, recovery, commit, the write driver,
//!   mapping changes, statistics;
//! - `pipeline`: the write stages (fingerprint, reduce, place) and their executor;
//! - `dedup`: the `Deduper` (lookup, verification, claim), the two-level fingerprint index
//!   (volume index in memory, chapter ring on the metadata device, record cache);
//! - `data`: the packer, staging of unwritten blocks, the data writer, placement;
//! - `read`: the read path and the content cache;
//! - `metadata`: geometry, superblock, block map, reference counts, allocator, journal;
//! - `io`: the storage trait and its implementations; `obs`: statistics and counters;
//! - `tier`: the hot-chunk tier (copies of hot physical blocks on a fast device);
//! - `check`: the offline audit and repair;
//! - `woj`: write-once journaling (journal discovery, the weak-hash pool);
//! - `sync`: the mutex of the hot locks (waiters sleep, never yield in a loop);
//! - `block`: `Block`, the shared immutable 4 KiB block of the cache, staging and replies.

pub mod block;
mod check;
mod codec;
mod config;
mod data;
mod dedup;
mod error;
mod io;
mod metadata;
mod obs;
mod pipeline;
mod read;
pub mod sync;
mod tier;
mod volume;
mod woj;

pub use check::scrub::{ScrubDamage, ScrubOptions, ScrubReport, ScrubStatus};
pub use check::{check_volume, check_volume_with, CheckOptions, CheckReport, IndexAudit, LostRange, Problem};
pub use config::{
    compression_name, effective_level, parse_compression, parse_size, Compression, DedupVerify, FormatOptions,
    IndexMode, OpenOptions, TierDevice, TierOptions, WritePolicy, BLOCK_SIZE, REST_LEVEL_DEFAULT,
    TIER_FILL_PERCENT_DEFAULT, TIER_PROMOTE_REFCOUNT_DEFAULT, ZSTD_LEVEL_DEFAULT, ZSTD_LEVEL_MAX, ZSTD_LEVEL_MIN,
};
pub use dedup::index::IndexRebuild;
pub use dedup::predictor::PredictorStats;
pub use error::{Corruption, Error, Result};
pub use io::{
    create_device, open_device, DataDeviceIo, FileStorage, IoMode, MemStorage, RadosStorage, RadosUrl, Storage,
    StripedStorage,
};
pub use metadata::layout::{Geometry, GrowthRoom};
pub use obs::io::{IoFigure, IoKind, IoStats};
pub use obs::stats::{IndexFigures, LifetimeCounters, ReductionCounters, Savings, Stats, TierStats};
pub use pipeline::batcher::{BatchOptions, PipelineStats, StageStats};
pub use pipeline::defer::DeferralStats;
pub use pipeline::offload::{
    compress_unit, print_chunk, print_chunks, Capacity, CompressUnit, Compressed, CpuOffload, Offload, OffloadError,
    OffloadStats, PrintOp, Prints,
};
pub use volume::block_status::{
    Extent, ExtentKind, RefcountBucket, BLOCK_STATUS_BLOCKS_MAX, BLOCK_STATUS_BLOCKS_PER_HOLD,
};
pub use volume::cleaner::{
    CleanOptions, CleanReport, Cleaner, CleanerOptions, CLEANER_DUTY_DEFAULT, RECOMPRESS_IDLE_DEFAULT,
};
pub use volume::grow::{resize_closed, resize_path, GrowReport};
pub use volume::recompress::{RecompressOptions, RecompressReport};
pub use volume::Volume;
pub use woj::{JournalRange, WojMode, WojStats};

/// The size of the fragment the engine would store for the 4 KiB `block` under `codec`
/// at `level` (0: the codec's default), or None when it would store the block raw: the
/// write path's own decision, incompressible check included, for estimators.
pub fn fragment_size(codec: Compression, level: i8, block: &[u8]) -> Option<usize> {
    if block.len() != BLOCK_SIZE {
        return None;
    }
    data::packer::compress(codec, level, block).map(|f| f.len())
}

/// The size of the fragment the engine would store for whole 4 KiB blocks written
/// together as one extent (`blocks`, 2 to 16 of them), or None when it would not store
/// them as one: for estimators.
pub fn extent_size(codec: Compression, level: i8, blocks: &[u8]) -> Option<usize> {
    let n = blocks.len() / BLOCK_SIZE;
    if n < 2 || n > usize::from(metadata::block_map::UNIT_BLOCKS_MAX) || !blocks.len().is_multiple_of(BLOCK_SIZE) {
        return None;
    }
    data::packer::compress_probed(codec, level, blocks, false).map(|f| f.len())
}

/// A zstd dictionary trained from data as a volume trains its own at rest
/// (`data::dictionary`), for estimators.
pub struct TrainedDictionary(data::dictionary::Dictionary);

impl TrainedDictionary {
    /// Trains one from `samples` (pieces of data of up to 16 KiB, as a volume samples
    /// its units); None when the trainer keeps nothing (too few samples, or nothing
    /// common to them).
    pub fn train(samples: &[&[u8]]) -> Option<TrainedDictionary> {
        data::dictionary::train(samples, 1 << 16).map(TrainedDictionary)
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.0.bytes.len()
    }

    /// Never true: a trained dictionary holds at least its header.
    pub fn is_empty(&self) -> bool {
        self.0.bytes.is_empty()
    }

    /// The size of the fragment a volume stores at rest for whole 4 KiB `blocks` (at
    /// most 16 KiB of them: larger units are compressed without the dictionary) at zstd
    /// `level`, or None when it would store them raw.
    pub fn fragment_size(&self, level: i8, blocks: &[u8]) -> Option<usize> {
        data::packer::compress_with(Compression::Zstd, level, blocks, Some(&self.0)).map(|f| f.len())
    }
}

/// True when the write path's probe takes the 4 KiB `block` for incompressible: it is
/// then stored raw and never joins an extent. For estimators.
pub fn incompressible(codec: Compression, block: &[u8]) -> bool {
    codec == Compression::None || data::packer::incompressible(block)
}

/// The on-disk format: its constants and the superblock decoder, for tools that inspect
/// devices. `docs/format.md` describes every byte; a test checks it against these names.
pub mod format {
    pub use crate::config::REST_LEVEL_DEFAULT;
    pub use crate::data::dictionary::{DICT_BYTES_MAX, DICT_UNIT_BYTES_MAX};
    pub use crate::data::packer::RUN_BLOCKS_MAX;
    pub use crate::dedup::chapter::{
        CHAPTER_MAGIC, CHAPTER_PAGES_MAX, CHAPTER_PAGE_HEADER_BYTES, RECORDS_PER_PAGE, RECORD_BYTES, RING_CHAPTERS_MAX,
    };
    pub use crate::dedup::index::SPARSE_SAMPLE;
    pub use crate::dedup::volume_index::SLOT_BYTES as INDEX_SLOT_BYTES;
    pub use crate::io::RADOS_OBJECT_BYTES;
    pub use crate::metadata::block_map::{FRAG_SETTLED, MAP_ENTRY_BYTES, PAGE_HEADER_BYTES, UNIT_BLOCKS_MAX};
    pub use crate::metadata::journal::{
        JOURNAL_ENTRIES_PER_BLOCK, JOURNAL_ENTRY_BYTES, JOURNAL_HEADER_BYTES, JOURNAL_MAGIC,
    };
    pub use crate::metadata::layout::{BM_ENTRIES_PER_PAGE, DICT_AREA_BLOCKS, RC_ENTRIES_PER_PAGE};
    pub use crate::metadata::refcount::REFCOUNT_MAX;
    pub use crate::metadata::stripe::{
        MemberHeader, MemberHeaderRaw, StripeLayout, StripeRaw, DATA_DEVICES_MAX, MEMBER_DATA_START_BLOCKS,
        STRIPE_PATH_BYTES_MAX, STRIPE_RECORD_OFFSET, STRIPE_UNIT_BLOCKS,
    };
    pub use crate::metadata::superblock::{
        DictRaw, LifetimeRaw, Superblock, SuperblockRaw, DICT_MAGIC, DICT_RECORD_OFFSET, FORMAT_VERSION,
        FORMAT_VERSION_DICT, FORMAT_VERSION_DICT_STRIPED, FORMAT_VERSION_REST, FORMAT_VERSION_REST_STRIPED,
        FORMAT_VERSION_STRIPED, LIFETIME_RECORD_OFFSET, SUPERBLOCK_MAGIC,
    };
    pub use crate::tier::layout::{
        SlotRecordRaw as TierSlotRecordRaw, TierHeaderRaw, TIER_FORMAT_VERSION, TIER_HEADER_BYTES, TIER_MAGIC,
        TIER_RECORDS_PER_PAGE, TIER_RECORD_BYTES, TIER_SLOTS_MAX, TIER_SLOT_BYTES,
    };
}
