//! Volume settings chosen at format time and tunables chosen at open time.
//!
//! Invariants:
//! - Every size is validated (`FormatOptions::validate`) before anything is written.
//! - Format-time settings are stored in the superblock; open-time tunables are not.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// Bytes in a logical and a physical block.
pub const BLOCK_SIZE: usize = 4096;
/// `BLOCK_SIZE` as u64.
pub const BLOCK_SIZE_U64: u64 = BLOCK_SIZE as u64;

/// Compressor used for new data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// Store every block raw.
    None,
    /// LZ4 (the fast option).
    Lz4,
    /// zstd at the volume's level (`FormatOptions::compression_level`; the default codec).
    #[default]
    Zstd,
}

/// zstd level of a volume that names none: 1. On the kernel source tar and a /usr tar in
/// 4 KiB blocks it keeps 98–99 % of level 3's reduction at 1.5–2.7× its speed, and beats
/// LZ4 by 19–41 % in size (docs/benchmarks/2026-11-25/reduction).
pub const ZSTD_LEVEL_DEFAULT: i8 = 1;
/// Fastest zstd level accepted (negative levels trade ratio for speed).
pub const ZSTD_LEVEL_MIN: i8 = -7;
/// Strongest zstd level accepted: above it a 4 KiB block gains almost nothing and ingest
/// falls below 100 MB/s a core.
pub const ZSTD_LEVEL_MAX: i8 = 19;
/// zstd level data at rest is brought to in a zstd volume that names none (the
/// recompressor's, while the volume is idle; `FormatOptions::rest_level`). Why 6: on 64 KiB
/// units of a /usr tar it keeps 99 % of level 9's reduction (2.275× against 2.288×, level 1
/// 2.149×) and compresses at several times level 9's speed; decoding is as fast as level
/// 1's, so reads pay nothing for it.
pub const REST_LEVEL_DEFAULT: i8 = 6;

impl Compression {
    /// On-disk code.
    pub fn code(self) -> u8 {
        match self {
            Compression::None => 0,
            Compression::Lz4 => 1,
            Compression::Zstd => 2,
        }
    }
    /// From the on-disk code.
    pub fn from_code(c: u8) -> Option<Self> {
        match c {
            0 => Some(Compression::None),
            1 => Some(Compression::Lz4),
            2 => Some(Compression::Zstd),
            _ => None,
        }
    }
}

impl std::str::FromStr for Compression {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(Compression::None),
            "lz4" => Ok(Compression::Lz4),
            "zstd" => Ok(Compression::Zstd),
            _ => Err(Error::InvalidArgument(format!("compression must be lz4, zstd or none, not {s:?}"))),
        }
    }
}

/// Parses `zstd`, `zstd:LEVEL`, `lz4` or `none` into a codec and a level (0 for the
/// codec's default; only zstd takes a level).
pub fn parse_compression(s: &str) -> Result<(Compression, i8)> {
    let (name, level) = match s.split_once(':') {
        Some((n, l)) => (n, Some(l)),
        None => (s, None),
    };
    let codec: Compression = name.parse()?;
    let Some(level) = level else { return Ok((codec, 0)) };
    if codec != Compression::Zstd {
        return Err(Error::InvalidArgument(format!("only zstd takes a level, not {s:?}")));
    }
    match level.parse::<i8>() {
        Ok(l) if l != 0 && (ZSTD_LEVEL_MIN..=ZSTD_LEVEL_MAX).contains(&l) => Ok((codec, l)),
        _ => Err(Error::InvalidArgument(format!(
            "zstd level must be {ZSTD_LEVEL_MIN}..={ZSTD_LEVEL_MAX} and not 0, not {level:?}"
        ))),
    }
}

/// The level a volume compresses new data with: `level` when it names one, else the
/// codec's default (0 for codecs without levels).
pub fn effective_level(codec: Compression, level: i8) -> i8 {
    match codec {
        Compression::Zstd if level == 0 => ZSTD_LEVEL_DEFAULT,
        Compression::Zstd => level,
        Compression::Lz4 | Compression::None => 0,
    }
}

/// The codec and level as users type them (`zstd:1`, `lz4`).
pub fn compression_name(codec: Compression, level: i8) -> String {
    match codec {
        Compression::Zstd => format!("zstd:{}", effective_level(codec, level)),
        c => c.to_string(),
    }
}

/// The name users type (`lz4`), for messages: never the Rust variant name.
impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Compression::None => "none",
            Compression::Lz4 => "lz4",
            Compression::Zstd => "zstd",
        })
    }
}

/// When a write is acknowledged (docs/design.md, durability contract).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WritePolicy {
    /// Durable before the acknowledgement (group commit).
    Sync,
    /// Acknowledged from memory; durable at the next flush or FUA write (lazy persistence).
    Async,
}

impl std::str::FromStr for WritePolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sync" => Ok(WritePolicy::Sync),
            "async" => Ok(WritePolicy::Async),
            _ => Err(Error::InvalidArgument(format!("write policy must be sync or async, not {s:?}"))),
        }
    }
}

/// The name users type (`async`), for messages.
impl std::fmt::Display for WritePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WritePolicy::Sync => "sync",
            WritePolicy::Async => "async",
        })
    }
}

/// How a duplicate is confirmed before it is shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DedupVerify {
    /// Read the candidate (content cache, else a device read) and compare every byte.
    /// 16 index bytes per entry, but a duplicate of data no longer cached costs a read.
    Bytes,
    /// Trust equality of the full 256-bit BLAKE3 fingerprint kept in the index, checked
    /// against the block's reuse stamp. Default: no verification I/O at all, for 40 index
    /// bytes per entry.
    Hash,
}

impl std::str::FromStr for DedupVerify {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "bytes" => Ok(DedupVerify::Bytes),
            "hash" => Ok(DedupVerify::Hash),
            _ => Err(Error::InvalidArgument(format!("dedup verification must be bytes or hash, not {s:?}"))),
        }
    }
}

/// The name users type (`hash`), for messages.
impl std::fmt::Display for DedupVerify {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DedupVerify::Bytes => "bytes",
            DedupVerify::Hash => "hash",
        })
    }
}

/// How much of the fingerprint index is kept in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexMode {
    /// Every fingerprint of the window is in the in-memory volume index (5 bytes a slot).
    Dense,
    /// Only sampled "hook" fingerprints (1 in 16) are in memory; a hook that hits loads
    /// its whole chapter, so the blocks written with it dedup too. A window 16 times as
    /// large for the same memory, at the cost of duplicates with no hook nearby.
    Sparse,
}

impl IndexMode {
    /// The superblock code.
    pub fn code(self) -> u8 {
        match self {
            IndexMode::Dense => 0,
            IndexMode::Sparse => 1,
        }
    }
    /// The mode of a superblock code (an unknown code is refused by the decoder).
    pub fn from_code(c: u8) -> Option<Self> {
        match c {
            0 => Some(IndexMode::Dense),
            1 => Some(IndexMode::Sparse),
            _ => None,
        }
    }
}

impl std::str::FromStr for IndexMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "dense" => Ok(IndexMode::Dense),
            "sparse" => Ok(IndexMode::Sparse),
            _ => Err(Error::InvalidArgument(format!("index mode must be dense or sparse, not {s:?}"))),
        }
    }
}

impl std::fmt::Display for IndexMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IndexMode::Dense => "dense",
            IndexMode::Sparse => "sparse",
        })
    }
}

/// Settings fixed when a volume is formatted.
#[derive(Debug, Clone, Serialize)]
pub struct FormatOptions {
    /// Logical (client-visible) size in bytes; a multiple of 4096.
    pub logical_size_bytes: u64,
    /// Compressor for new data.
    pub compression: Compression,
    /// zstd level (`ZSTD_LEVEL_MIN..=ZSTD_LEVEL_MAX`); 0 picks `ZSTD_LEVEL_DEFAULT`.
    /// The other codecs take none: a level other than 0 with them is refused.
    pub compression_level: i8,
    /// zstd level the recompressor brings data at rest to while the volume is idle (zstd
    /// volumes only; `1..=ZSTD_LEVEL_MAX`): writes compress fast at `compression_level`,
    /// and an idle volume compresses them again, harder, once. `Some(0)`: off (data stays
    /// as written). `None`: `REST_LEVEL_DEFAULT` in a zstd volume, off otherwise.
    pub rest_level: Option<i8>,
    /// Deduplicate writes.
    pub dedup: bool,
    /// Upper bound on the in-memory part of the fingerprint index (the volume index).
    /// Without `dedup_window_bytes`, it also sets the window: as much as this memory
    /// indexes, at most the data device.
    pub index_memory_bytes: u64,
    /// Data the fingerprint index covers, in bytes (the chapter ring on the metadata
    /// device is sized for it; the oldest chapter leaves as the ring wraps). None: from
    /// `index_memory_bytes`.
    pub dedup_window_bytes: Option<u64>,
    /// Dense or sparse in-memory index.
    pub index_mode: IndexMode,
    /// Default write policy (an open may override it).
    pub write_policy: WritePolicy,
    /// Data slab size in bytes (allocation unit of the log-structured data region).
    pub slab_size_bytes: u64,
    /// Duplicate verification mode.
    pub verify: DedupVerify,
    /// Journal size; `None` picks one from the physical size.
    pub journal_size_bytes: Option<u64>,
    /// Largest logical size the block map gets room for, so that the volume can grow to it
    /// while served. `None`: twice the logical size, within the default room (about 1/64
    /// of the metadata area; `GrowthRoom::default_for`).
    pub max_logical_size_bytes: Option<u64>,
    /// Largest data device the reference counts get room for. `None`: four times the data
    /// device, within the default room.
    pub max_physical_size_bytes: Option<u64>,
    /// Largest extent the volume forms, in 4 KiB blocks (1..=`UNIT_BLOCKS_MAX`; 1: every
    /// block compressed alone). `None`: `DEFAULT_EXTENT_BLOCKS_DICT` (16 KiB) for a zstd
    /// volume with a rest level, whose data at rest is compressed with a dictionary
    /// trained from it (`data::dictionary`: small units then store nearly what 64 KiB
    /// ones do without one, and read faster), else the largest
    /// (`effective_extent_blocks_max`). Larger extents compress better;
    /// a random 4 KiB read of one decodes the extent up to the block it wants. Changeable
    /// later (`Volume::set_extent_blocks_max`).
    pub extent_blocks_max: Option<u8>,
}

impl Default for FormatOptions {
    fn default() -> Self {
        FormatOptions {
            logical_size_bytes: 1 << 30,
            compression: Compression::default(),
            compression_level: 0,
            rest_level: None,
            dedup: true,
            index_memory_bytes: 64 << 20,
            dedup_window_bytes: None,
            index_mode: IndexMode::Dense,
            write_policy: WritePolicy::Async,
            slab_size_bytes: 32 << 20,
            verify: DedupVerify::Hash,
            journal_size_bytes: None,
            max_logical_size_bytes: None,
            max_physical_size_bytes: None,
            extent_blocks_max: None,
        }
    }
}

/// The extent cap a zstd volume with a rest level gets by default, in blocks (see
/// `FormatOptions::extent_blocks_max`).
pub const DEFAULT_EXTENT_BLOCKS_DICT: u8 = 4;

/// Refuses an extent cap outside 1..=`UNIT_BLOCKS_MAX` blocks.
pub fn check_extent_blocks_max(blocks: u8) -> Result<()> {
    let max = crate::metadata::block_map::UNIT_BLOCKS_MAX;
    if (1..=max).contains(&blocks) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "extent cap of {blocks} blocks: from 1 (every block alone) to {max} ({} KiB)",
            usize::from(max) * BLOCK_SIZE / 1024
        )))
    }
}

/// Largest logical size accepted (2^40 blocks of 4 KiB = 4 PiB).
pub const LOGICAL_SIZE_BYTES_MAX: u64 = 1 << 52;
/// Largest index memory accepted.
pub const INDEX_MEMORY_BYTES_MAX: u64 = 1 << 40;
/// Largest dedup window accepted (the chapter ring's limits: 32768 chapters of 256 pages).
pub const DEDUP_WINDOW_BYTES_MAX: u64 = 32768 * 256 * 101 * BLOCK_SIZE_U64;
/// Smallest index memory accepted.
pub const INDEX_MEMORY_BYTES_MIN: u64 = 64 << 10;

impl FormatOptions {
    /// The rest level this volume gets (0: off): see `rest_level`.
    pub fn effective_rest_level(&self) -> i8 {
        match (self.rest_level, self.compression) {
            (Some(l), _) => l,
            (None, Compression::Zstd) => REST_LEVEL_DEFAULT,
            (None, _) => 0,
        }
    }

    /// The extent cap this volume gets, in blocks: see `extent_blocks_max`.
    pub fn effective_extent_blocks_max(&self) -> u8 {
        match self.extent_blocks_max {
            Some(b) => b,
            None if self.compression == Compression::Zstd && self.effective_rest_level() != 0 => {
                DEFAULT_EXTENT_BLOCKS_DICT
            }
            None => crate::metadata::block_map::UNIT_BLOCKS_MAX,
        }
    }

    /// Checks sizes before anything is written.
    pub fn validate(&self) -> Result<()> {
        if self.logical_size_bytes == 0 || !self.logical_size_bytes.is_multiple_of(BLOCK_SIZE_U64) {
            return Err(Error::InvalidArgument(format!(
                "logical size {} must be a non-zero multiple of 4096",
                self.logical_size_bytes
            )));
        }
        if self.logical_size_bytes > LOGICAL_SIZE_BYTES_MAX {
            return Err(Error::InvalidArgument(format!(
                "logical size {} exceeds the maximum {LOGICAL_SIZE_BYTES_MAX}",
                self.logical_size_bytes
            )));
        }
        if !(INDEX_MEMORY_BYTES_MIN..=INDEX_MEMORY_BYTES_MAX).contains(&self.index_memory_bytes) {
            return Err(Error::InvalidArgument(format!(
                "index memory {} must be between {INDEX_MEMORY_BYTES_MIN} and {INDEX_MEMORY_BYTES_MAX}",
                self.index_memory_bytes
            )));
        }
        if let Some(w) = self.dedup_window_bytes {
            if !(BLOCK_SIZE_U64..=DEDUP_WINDOW_BYTES_MAX).contains(&w) {
                return Err(Error::InvalidArgument(format!(
                    "dedup window {w} must be between 4096 and {DEDUP_WINDOW_BYTES_MAX} bytes"
                )));
            }
        }
        if self.compression_level != 0 {
            if self.compression != Compression::Zstd {
                return Err(Error::InvalidArgument(format!(
                    "compression level {} given, but only zstd takes a level, not {}",
                    self.compression_level, self.compression
                )));
            }
            if !(ZSTD_LEVEL_MIN..=ZSTD_LEVEL_MAX).contains(&self.compression_level) {
                return Err(Error::InvalidArgument(format!(
                    "zstd level {} must be between {ZSTD_LEVEL_MIN} and {ZSTD_LEVEL_MAX}",
                    self.compression_level
                )));
            }
        }
        if let Some(b) = self.extent_blocks_max {
            check_extent_blocks_max(b)?;
        }
        match self.rest_level {
            None | Some(0) => {}
            Some(_) if self.compression != Compression::Zstd => {
                return Err(Error::InvalidArgument(format!(
                    "a rest level is a zstd level, but this volume compresses with {}",
                    self.compression
                )));
            }
            Some(l) if !(1..=ZSTD_LEVEL_MAX).contains(&l) => {
                return Err(Error::InvalidArgument(format!(
                    "rest level {l} must be between 1 and {ZSTD_LEVEL_MAX} (0: off)"
                )));
            }
            Some(_) => {}
        }
        let slab = self.slab_size_bytes;
        if !((1 << 20)..=(1 << 35)).contains(&slab) || !slab.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "slab size {slab} must be a power of two between 1 MiB and 32 GiB"
            )));
        }
        if let Some(m) = self.max_logical_size_bytes {
            if m < self.logical_size_bytes || m > LOGICAL_SIZE_BYTES_MAX || !m.is_multiple_of(BLOCK_SIZE_U64) {
                return Err(Error::InvalidArgument(format!(
                    "maximum logical size {m} must be a multiple of 4096 between the logical size {} and {LOGICAL_SIZE_BYTES_MAX}",
                    self.logical_size_bytes
                )));
            }
        }
        if let Some(m) = self.max_physical_size_bytes {
            if m > LOGICAL_SIZE_BYTES_MAX {
                return Err(Error::InvalidArgument(format!(
                    "maximum physical size {m} exceeds {LOGICAL_SIZE_BYTES_MAX}"
                )));
            }
        }
        if let Some(j) = self.journal_size_bytes {
            if !((256 << 10)..=(4 << 30)).contains(&j) || j % BLOCK_SIZE_U64 != 0 {
                return Err(Error::InvalidArgument(format!(
                    "journal size {j} must be a multiple of 4096 between 256 KiB and 4 GiB"
                )));
            }
        }
        Ok(())
    }
}

/// Tunables chosen at open time (not stored).
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Open without writing anything (no recovery writes; a dirty volume is replayed in memory).
    pub read_only: bool,
    /// Override the stored write policy.
    pub write_policy: Option<WritePolicy>,
    /// Bound on cached block map pages, in bytes.
    pub block_map_cache_bytes: u64,
    /// Bound on the read-only content cache under the reduction layer, in bytes.
    pub content_cache_bytes: u64,
    /// Override the stored index memory.
    pub index_memory_bytes: Option<u64>,
    /// How `Volume::open_path` opens its devices (`Auto` by default: direct I/O for hash
    /// verification, buffered for byte verification).
    pub io_mode: crate::io::IoMode,
    /// Write full staging batches from a background thread (default). Off, the writer
    /// that fills a batch writes it: slower, but every device call happens on a caller's
    /// thread in a reproducible order (the simulator needs that).
    pub background_writes: bool,
    /// Whether newly written blocks enter the content cache (reads and verification reads
    /// always fill it). None: the engine decides by verification mode. Byte verification
    /// caches writes, because a duplicate of recently written data then verifies from
    /// memory instead of a device read. Hash verification never reads a candidate, so it
    /// caches only what is read: caching every write costs the write path an insertion, an
    /// eviction and a cold 4 KiB allocation per stored block under the state lock
    /// (measured: 75%-duplicate ingest 1.54-2.20 s per 2 GiB without, 1.95-2.48 s with a
    /// 64 MiB cache). A server whose clients re-read what they just wrote can turn it on.
    pub cache_writes: Option<bool>,
    /// Largest extent, in 4 KiB blocks (1 to 16; 1: every block compressed alone). Larger
    /// extents compress better; a random 4 KiB read of one decompresses up to the block it
    /// wants (measured on a 256 MiB kernel tar: see docs/design.md).
    pub extent_blocks_max: u8,
    /// Data a settling pass must find before it trains the volume's zstd dictionary
    /// (`data::dictionary::TRAIN_MIN_BYTES` by default; tests and the simulator lower it).
    pub dictionary_train_min_bytes: usize,
    /// How small writes are combined into batches for the pipeline's stages.
    pub batch: crate::pipeline::batcher::BatchOptions,
    /// Predict unique chunks from a cheap hash so that their compression runs in the same
    /// parallel pass as fingerprinting (dedup on, write-once journaling off). Default off:
    /// with the CPU doing both, on 2 cores, its xxh3 pass and filter cost 6% of the
    /// 75%-duplicate ingest for no overlap to gain (docs/design.md); it is what lets an
    /// offload engine compress while the index answers.
    pub unique_predictor: bool,
    /// Deferred compression: when the chunks waiting for compression would take longer
    /// than this many microseconds of the workers' time to compress with zstd, the excess
    /// is compressed with LZ4, and the cleaner's recompression brings it to zstd when the
    /// volume is idle (0, the default: never). For servers whose clients' latency matters
    /// more than the space saved until then.
    pub defer_compression_micros: u64,
    /// Deferred compression's cost of compressing one chunk, fixed instead of measured
    /// (None, the default: measured as the volume writes), so that which chunks are
    /// deferred is reproducible: for tests and the simulator.
    pub defer_fixed_cost_ns: Option<u64>,
    /// Threads of the pipeline's parallel stages for this volume alone, exactly (None, the
    /// default: the process's pool, as wide as its cores and shared by every volume it
    /// opens). With `Some(1)` a batch of 64 chunks or more is hashed and compressed on
    /// the one worker, not on the writer's thread, so that many writers share one thread
    /// of stage work.
    pub workers: Option<usize>,
    /// Reference count at which a duplicate gets a copy of its own (at most, and by
    /// default, `REFCOUNT_MAX`). Lower values make the cap reachable by tests of what
    /// happens there (the simulator's hot-block runs); nothing on disk depends on it.
    pub refcount_cap: u16,
    /// A hot-chunk tier: a fast device holding copies of frequently shared or frequently
    /// read physical blocks (None: no tier). Never needed for correctness: a tier that
    /// cannot be opened is left out with a warning (`Volume::tier_notes`).
    pub tier: Option<TierOptions>,
    /// Write-once journaling: find the journal of a file system on the volume and share
    /// its checkpoint writes with the journal copies (docs/design.md, "Write-once
    /// journaling"). Default off.
    pub woj: crate::woj::WojMode,
    /// Bits of the weak hash WOJ keeps (`u64::MAX`: all 64). Tests cut it to force
    /// collisions, which must never lead to a wrong share; it also turns off the crc32c
    /// pre-check, so that the byte comparison alone has to catch them.
    #[doc(hidden)]
    pub woj_weak_hash_mask: u64,
    /// How the fingerprint index is rebuilt from its chapter ring after the open: in the
    /// background (the volume accepts I/O at once; duplicates in chapters not rebuilt yet
    /// are missed meanwhile), before `open` returns, one step per
    /// `Volume::index_rebuild_step` (deterministic tests and the simulator), or (default)
    /// before `open` returns when the window's chapters are at most 16 MiB, else in the
    /// background.
    pub index_rebuild: crate::dedup::index::IndexRebuild,
    /// A volume in RADOS held by another engine: fence that engine (blocklist its client
    /// address) and break its lock instead of refusing to open (`RadosStorage`). For a
    /// server that takes over from a dead one; files ignore it.
    pub take_over: bool,
    /// Store new data with this codec and level in this session instead of the volume's
    /// (None: the volume's). Nothing on disk changes: every fragment records its codec,
    /// and `Volume::recompress` (run by the idle `Cleaner`) brings such data to the
    /// volume's codec. For tests of that path and of data stored by a fast codec.
    #[doc(hidden)]
    pub store_codec: Option<(Compression, i8)>,
    /// The compute backend of the fingerprint and compression stages (None, the default:
    /// `CpuOffload` on the volume's pool). A backend given here has its results checked
    /// and its fingerprints verified by bytes (docs/design.md, "The offload interface").
    pub offload: Option<std::sync::Arc<dyn crate::pipeline::offload::Offload>>,
}

impl OpenOptions {
    /// Whether written blocks enter the content cache on a volume verified by `verify`
    /// (`cache_writes`, else yes for byte verification only).
    pub fn writes_cached(&self, verify: DedupVerify) -> bool {
        self.cache_writes.unwrap_or(verify == DedupVerify::Bytes)
    }
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            read_only: false,
            write_policy: None,
            block_map_cache_bytes: 128 << 20,
            content_cache_bytes: 64 << 20,
            index_memory_bytes: None,
            io_mode: crate::io::IoMode::Auto,
            background_writes: true,
            cache_writes: None,
            extent_blocks_max: crate::metadata::block_map::UNIT_BLOCKS_MAX,
            dictionary_train_min_bytes: crate::data::dictionary::TRAIN_MIN_BYTES,
            batch: crate::pipeline::batcher::BatchOptions::default(),
            unique_predictor: false,
            defer_compression_micros: 0,
            defer_fixed_cost_ns: None,
            workers: None,
            refcount_cap: crate::metadata::refcount::REFCOUNT_MAX,
            tier: None,
            woj: crate::woj::WojMode::Off,
            woj_weak_hash_mask: u64::MAX,
            index_rebuild: crate::dedup::index::IndexRebuild::Auto,
            take_over: false,
            store_codec: None,
            offload: None,
        }
    }
}

/// Reference count at which a stored block is copied to the hot-chunk tier by default
/// (the SAR paper's threshold).
pub const TIER_PROMOTE_REFCOUNT_DEFAULT: u32 = 5;
/// Default share of the tier's slots (percent) below which newly written blocks are
/// copied to it as well (`TierOptions::fill_percent`).
pub const TIER_FILL_PERCENT_DEFAULT: u8 = 50;

/// Where the hot-chunk tier lives.
#[derive(Clone)]
pub enum TierDevice {
    /// A file or block device; a file that does not exist is created with
    /// `TierOptions::size_bytes`.
    Path(std::path::PathBuf),
    /// A device already open (memory-backed in tests).
    Storage(std::sync::Arc<dyn crate::io::Storage>),
}

impl std::fmt::Debug for TierDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TierDevice::Path(p) => write!(f, "Path({})", p.display()),
            TierDevice::Storage(s) => write!(f, "Storage({})", s.name()),
        }
    }
}

/// Settings of the hot-chunk tier (`OpenOptions::tier`).
#[derive(Debug, Clone)]
pub struct TierOptions {
    /// The tier's device.
    pub device: TierDevice,
    /// Bytes of the device to use (default: all of it). Required when the file does not
    /// exist yet: it is created with this size.
    pub size_bytes: Option<u64>,
    /// Reference count at which a packed block is promoted by the write path (raw blocks
    /// at twice it); default `TIER_PROMOTE_REFCOUNT_DEFAULT`. 0: only read-hot blocks are
    /// promoted.
    pub promote_refcount: u32,
    /// While fewer than this percent of the tier's slots are in use (or about to be),
    /// every newly written data block is copied to the tier too, so first reads of fresh
    /// data skip the data device; above it only hot blocks are promoted, and a fill never
    /// demotes anything. Why: a tier with free slots is flash bought and left idle, and
    /// first reads are the misses that no hotness policy can reach. 0: off (only blocks
    /// promoted for their references or re-reads). Default `TIER_FILL_PERCENT_DEFAULT`;
    /// at most 100.
    pub fill_percent: u8,
}

impl TierOptions {
    /// A tier on a file or block device, with the default threshold.
    pub fn path(path: impl Into<std::path::PathBuf>) -> Self {
        TierOptions {
            device: TierDevice::Path(path.into()),
            size_bytes: None,
            promote_refcount: TIER_PROMOTE_REFCOUNT_DEFAULT,
            fill_percent: TIER_FILL_PERCENT_DEFAULT,
        }
    }

    /// A tier on an open device, with the default threshold.
    pub fn storage(dev: std::sync::Arc<dyn crate::io::Storage>) -> Self {
        TierOptions {
            device: TierDevice::Storage(dev),
            size_bytes: None,
            promote_refcount: TIER_PROMOTE_REFCOUNT_DEFAULT,
            fill_percent: TIER_FILL_PERCENT_DEFAULT,
        }
    }
}

/// Parses `4096`, `64K`, `10M`, `2G`, `1T` (binary units; optional trailing `B`/`iB`).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                'P' => 1 << 50,
                _ => return Err(Error::InvalidArgument(format!("unknown size suffix in {s:?} (use K, M, G, T, P)"))),
            };
            (t.get(..i).unwrap_or(""), m)
        }
        _ => (t, 1),
    };
    let n: u64 = num.trim().parse().map_err(|_| {
        Error::InvalidArgument(format!("invalid size {s:?}: expected a number with an optional K/M/G/T suffix"))
    })?;
    n.checked_mul(mult).ok_or_else(|| Error::InvalidArgument(format!("size {s:?} overflows")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("4096").ok(), Some(4096));
        assert_eq!(parse_size("64K").ok(), Some(65536));
        assert_eq!(parse_size("10M").ok(), Some(10 << 20));
        assert_eq!(parse_size("2g").ok(), Some(2 << 30));
        assert_eq!(parse_size("1TiB").ok(), Some(1 << 40));
        assert!(parse_size("").is_err());
        assert!(parse_size("12X").is_err());
        assert!(parse_size("-5").is_err());
        assert!(parse_size("99999999999999999999T").is_err());
    }

    #[test]
    fn compression_parses_with_a_zstd_level() {
        assert_eq!(parse_compression("zstd").ok(), Some((Compression::Zstd, 0)));
        assert_eq!(parse_compression("zstd:3").ok(), Some((Compression::Zstd, 3)));
        assert_eq!(parse_compression("zstd:-5").ok(), Some((Compression::Zstd, -5)));
        assert_eq!(parse_compression("lz4").ok(), Some((Compression::Lz4, 0)));
        assert_eq!(parse_compression("none").ok(), Some((Compression::None, 0)));
        for bad in ["zstd:0", "zstd:20", "zstd:-8", "zstd:x", "zstd:", "lz4:1", "none:1", "gzip"] {
            assert!(parse_compression(bad).is_err(), "{bad} accepted");
        }
        assert_eq!(compression_name(Compression::Zstd, 0), "zstd:1");
        assert_eq!(compression_name(Compression::Lz4, 0), "lz4");
        let bad = FormatOptions { compression: Compression::Lz4, compression_level: 3, ..FormatOptions::default() };
        assert!(bad.validate().is_err());
        let bad = FormatOptions { compression_level: 25, ..FormatOptions::default() };
        assert!(bad.validate().is_err());
        assert!(FormatOptions { compression_level: -3, ..FormatOptions::default() }.validate().is_ok());
    }
}
