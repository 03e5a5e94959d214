//! The sizing model: what a server built of `cores` cores and `ssds` SSDs (with or without
//! a fast metadata device, or over a remote RADOS pool) would ingest and cost, from the
//! stage rates measured on this machine per core and a reduction mix. The formulas are
//! written out in docs/design.md, "Sizing model"; this module is their one implementation.
//!
//! A projection takes, per 4 KiB logical block of the mix, the CPU time of every stage
//! (fingerprint, probe, compression, decompression, the engine's per-block metadata work),
//! the bytes each device moves, and the serial part (a volume's state lock), and divides
//! each resource's capacity by its demand: the smallest quotient is the throughput, and its
//! resource is the bound named.
//!
//! Invariants:
//! - Every rate is a positive finite number of MB/s (10^6 bytes per second of input) or
//!   µs per block; `Rates::validate` refuses anything else, so no division below is by
//!   zero or yields NaN.
//! - Every mix fraction is in `0..=1` and the mix stores something (`Mix::validate`):
//!   capacity per logical byte is finite.
//! - A projection's throughput is the minimum of its bounds, and `bound` names that
//!   minimum (asserted).
//! - Memory figures come from the engine's documented sizes (docs/format.md, "Memory") and
//!   its exported on-disk constants, never from guesses made here.
//! - Measuring is bounded: a few MiB of data, [`RATE_MEASURE_SECONDS_MIN`] per rate.

use crate::content::{ContentModel, DataSpec, BLOCK_BYTES};
use dedupvol_core::format::{
    BM_ENTRIES_PER_PAGE, INDEX_SLOT_BYTES, JOURNAL_ENTRIES_PER_BLOCK, RC_ENTRIES_PER_PAGE, RECORDS_PER_PAGE,
    SPARSE_SAMPLE,
};
use dedupvol_core::{Compression, FormatOptions, MemStorage, OpenOptions, Storage, Volume};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;

/// Version of the rates file; a file of another version is refused.
pub const RATES_VERSION: u32 = 1;
/// Shortest measurement of one rate, in seconds.
pub const RATE_MEASURE_SECONDS_MIN: f64 = 0.25;
/// Bytes of generated data the CPU rates are measured on (256 blocks: in the CPU's cache
/// as the engine's batches are, so the rate is the stage's, not the memory's).
pub const RATE_SAMPLE_BYTES: usize = 1 << 20;
/// Blocks of an extent the compression rates are measured on (the write path's largest
/// unit: docs/design.md, "A write", stage 3).
pub const RATE_EXTENT_BLOCKS: usize = 16;
/// Distinct blocks of the metadata measurement, each written `METADATA_ROUNDS` more
/// times at other addresses (every one a duplicate: no compression, no data write).
const METADATA_DISTINCT_BLOCKS: usize = 1024;
/// See [`METADATA_DISTINCT_BLOCKS`].
const METADATA_ROUNDS: usize = 16;
/// Request size of the metadata measurement: 32 blocks, below the 64 at which the engine
/// splits a batch's hashing across its pool, so the figure is one core's.
const METADATA_REQUEST_BLOCKS: usize = 32;
/// Floor of a metadata figure after subtracting hashing (timer noise must not make the
/// serial part free).
const METADATA_US_MIN: f64 = 0.05;

/// The volume index's load at a full window (docs/design.md, "The fingerprint index": sized
/// for the window at 90% load).
pub const INDEX_LOAD: f64 = 0.9;
/// Bytes of memory per physical block: reference counts (2), reuse stamps (2, hash
/// verification), the allocator bitmap (1/8) (docs/format.md, "Memory").
pub const MEMORY_PER_PHYSICAL_BLOCK_BYTES: f64 = 2.0 + 2.0 + 0.125;
/// Memory of the process besides the per-block structures and the caches: the measured
/// RSS of a fresh 1 TiB volume was 45 MiB (docs/format.md, "Memory"), rounded up.
pub const PROCESS_BASE_BYTES: f64 = 64.0 * 1048576.0;
/// Block map pages on disk hold two slots each (docs/format.md, "Block map page").
const PAGE_SLOTS: f64 = 2.0;
/// Bytes per decimal terabyte and gigabyte (prices and capacities are decimal).
const TB: f64 = 1e12;
/// See [`TB`].
const GB: f64 = 1e9;

/// Per-core stage rates, measured on one machine (or read from a file saved by an earlier
/// run). MB/s are of the stage's input (decompression: of its output).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Rates {
    /// [`RATES_VERSION`].
    pub version: u32,
    /// What the rates were measured on (host, data).
    pub measured_on: String,
    /// BLAKE3 over 4 KiB blocks (the fingerprint).
    pub blake3_mb_s: f64,
    /// crc32c over 4 KiB blocks (every map entry's checksum; every read's check).
    pub crc32c_mb_s: f64,
    /// The write path's incompressibility probe over 4 KiB blocks (entropy, then LZ4).
    pub probe_mb_s: f64,
    /// zstd (the volume's default level) over 64 KiB extents.
    pub zstd_compress_mb_s: f64,
    /// zstd decompression of those extents (MB/s of output).
    pub zstd_decompress_mb_s: f64,
    /// LZ4 over 64 KiB extents.
    pub lz4_compress_mb_s: f64,
    /// LZ4 decompression of those extents (MB/s of output).
    pub lz4_decompress_mb_s: f64,
    /// The engine's own work per written duplicate (or zero) block besides hashing: index
    /// lookup and claim, block map, reference counts and journal (µs per 4 KiB block, one
    /// core).
    pub write_metadata_us_per_block: f64,
    /// The same for a written unique block, which also allocates, stages and records its
    /// copy in the index (µs per 4 KiB block, one core; compression not included).
    pub write_unique_metadata_us_per_block: f64,
    /// The engine's own work per block read from its cache: lookup, cache, copy (µs per
    /// 4 KiB block, one core).
    pub read_metadata_us_per_block: f64,
}

/// A bad model parameter or rates file.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelError {
    /// A parameter outside its range.
    Parameter {
        /// The parameter's name, as on the command line.
        name: &'static str,
        /// Its value.
        value: String,
        /// What it must be.
        expected: &'static str,
    },
    /// A rate that is not a positive finite number.
    Rate {
        /// The rate's field name.
        name: &'static str,
        /// Its value.
        value: f64,
    },
    /// A rates file of another version.
    RatesVersion {
        /// The file's version.
        found: u32,
    },
    /// Measuring failed (the in-memory engine refused something).
    Measure(String),
}

impl std::fmt::Display for ModelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelError::Parameter { name, value, expected } => write!(f, "{name} {value}: must be {expected}"),
            ModelError::Rate { name, value } => {
                write!(f, "rate {name} is {value}: every rate must be a positive finite number")
            }
            ModelError::RatesVersion { found } => {
                write!(f, "rates file of version {found}; this build reads version {RATES_VERSION}")
            }
            ModelError::Measure(m) => write!(f, "measuring the engine's metadata cost: {m}"),
        }
    }
}

impl std::error::Error for ModelError {}

impl Rates {
    /// Refuses a rate that is not positive and finite, and a file of another version.
    pub fn validate(&self) -> Result<(), ModelError> {
        if self.version != RATES_VERSION {
            return Err(ModelError::RatesVersion { found: self.version });
        }
        for (name, value) in [
            ("blake3_mb_s", self.blake3_mb_s),
            ("crc32c_mb_s", self.crc32c_mb_s),
            ("probe_mb_s", self.probe_mb_s),
            ("zstd_compress_mb_s", self.zstd_compress_mb_s),
            ("zstd_decompress_mb_s", self.zstd_decompress_mb_s),
            ("lz4_compress_mb_s", self.lz4_compress_mb_s),
            ("lz4_decompress_mb_s", self.lz4_decompress_mb_s),
            ("write_metadata_us_per_block", self.write_metadata_us_per_block),
            ("write_unique_metadata_us_per_block", self.write_unique_metadata_us_per_block),
            ("read_metadata_us_per_block", self.read_metadata_us_per_block),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(ModelError::Rate { name, value });
            }
        }
        Ok(())
    }

    /// Compression and decompression MB/s of `codec`.
    fn codec(&self, codec: Codec) -> (f64, f64) {
        match codec {
            Codec::Zstd => (self.zstd_compress_mb_s, self.zstd_decompress_mb_s),
            Codec::Lz4 => (self.lz4_compress_mb_s, self.lz4_decompress_mb_s),
        }
    }
}

/// Runs `f` over `data` repeatedly for at least [`RATE_MEASURE_SECONDS_MIN`]; MB/s of
/// `bytes_per_pass` per pass.
fn rate(data_passes_bytes: usize, mut f: impl FnMut() -> usize) -> f64 {
    let start = Instant::now();
    let mut passes = 0u64;
    let mut sink = 0usize;
    loop {
        sink = sink.wrapping_add(f());
        passes += 1;
        let t = start.elapsed().as_secs_f64();
        if t >= RATE_MEASURE_SECONDS_MIN {
            std::hint::black_box(sink);
            return passes as f64 * data_passes_bytes as f64 / t / 1e6;
        }
    }
}

/// Measures every rate on one core: the CPU stages on generated data whose unique blocks
/// compression shrinks by `compress_fraction`, the metadata cost on an in-memory volume.
pub fn measure_rates(compress_fraction: f64, seed: u64) -> Result<Rates, ModelError> {
    if !(0.0..1.0).contains(&compress_fraction) {
        return Err(ModelError::Parameter {
            name: "--compress",
            value: format!("{}", compress_fraction * 100.0),
            expected: "at least 0 and below 100 (percent)",
        });
    }
    let model = ContentModel::new(DataSpec::new(0.0, compress_fraction, seed)).map_err(ModelError::Measure)?;
    let mut data = vec![0u8; RATE_SAMPLE_BYTES];
    model.fill_range(0, &mut data);
    let n = data.len();
    let blake3_mb_s = rate(n, || engine_prints(&data, BLAKE3_ONLY));
    let crc32c_mb_s = rate(n, || data.chunks_exact(BLOCK_BYTES).map(|c| crc32c::crc32c(c) as usize).sum());
    let probe_mb_s = rate(n, || {
        data.chunks_exact(BLOCK_BYTES).filter(|c| dedupvol_core::incompressible(Compression::Zstd, c)).count()
    });
    let extent = BLOCK_BYTES * RATE_EXTENT_BLOCKS;
    let mut zc = zstd::bulk::Compressor::new(i32::from(dedupvol_core::ZSTD_LEVEL_DEFAULT))
        .map_err(|e| ModelError::Measure(format!("zstd: {e}")))?;
    let zstd_units: Vec<Vec<u8>> = data.chunks_exact(extent).filter_map(|u| zc.compress(u).ok()).collect();
    let lz4_units: Vec<Vec<u8>> = data.chunks_exact(extent).map(lz4_flex::block::compress).collect();
    let zstd_compress_mb_s = rate(n, || {
        data.chunks_exact(extent).map(|u| dedupvol_core::extent_size(Compression::Zstd, 0, u).unwrap_or(0)).sum()
    });
    let lz4_compress_mb_s = rate(n, || {
        data.chunks_exact(extent).map(|u| dedupvol_core::extent_size(Compression::Lz4, 0, u).unwrap_or(0)).sum()
    });
    let mut out = vec![0u8; extent];
    let mut zd = zstd::bulk::Decompressor::new().map_err(|e| ModelError::Measure(format!("zstd: {e}")))?;
    let zstd_decompress_mb_s = rate(zstd_units.len() * extent, || {
        zstd_units.iter().map(|u| zd.decompress_to_buffer(u, &mut out).unwrap_or(0)).sum()
    });
    let lz4_decompress_mb_s = rate(lz4_units.len() * extent, || {
        lz4_units.iter().map(|u| lz4_flex::block::decompress_into(u, &mut out).unwrap_or(0)).sum()
    });
    let (write_us, unique_us, read_us) = measure_metadata(&model)?;
    let rates = Rates {
        version: RATES_VERSION,
        measured_on: format!(
            "{} ({} cores visible); unique blocks compression shrinks by {:.0}%, seed {seed}",
            host_name(),
            std::thread::available_parallelism().map_or(1, |n| n.get()),
            compress_fraction * 100.0
        ),
        blake3_mb_s,
        crc32c_mb_s,
        probe_mb_s,
        zstd_compress_mb_s,
        zstd_decompress_mb_s,
        lz4_compress_mb_s,
        lz4_decompress_mb_s,
        write_metadata_us_per_block: write_us.max(METADATA_US_MIN),
        write_unique_metadata_us_per_block: unique_us.max(METADATA_US_MIN),
        read_metadata_us_per_block: read_us.max(METADATA_US_MIN),
    };
    rates.validate()?;
    Ok(rates)
}

/// The host's name, for the record of where rates were measured.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map_or_else(|_| "this host".into(), |s| s.trim().to_string())
}

/// µs per block of duplicate writes and of unique writes (less their hashing), and of
/// cached reads, on an in-memory volume without compression, one writer, requests small
/// enough to stay on the caller's core. The hashing the writes did (BLAKE3 and crc32c of
/// the same blocks) is timed round by round between them, so a load that slows both is
/// subtracted with it; the median round is kept.
fn measure_metadata(model: &ContentModel) -> Result<(f64, f64, f64), ModelError> {
    let m = |e: dedupvol_core::Error| ModelError::Measure(e.to_string());
    let distinct = METADATA_DISTINCT_BLOCKS;
    // The first copies, their duplicates, then as many unique blocks.
    let total = distinct * (2 * METADATA_ROUNDS + 1);
    let logical = (total * BLOCK_BYTES) as u64;
    let dev = Arc::new(MemStorage::new(logical + (64 << 20)));
    let fmt = FormatOptions {
        logical_size_bytes: logical,
        compression: Compression::None,
        index_memory_bytes: 16 << 20,
        ..FormatOptions::default()
    };
    Volume::format(dev.clone() as Arc<dyn Storage>, None, &fmt, false).map_err(m)?;
    let open = OpenOptions { content_cache_bytes: 64 << 20, ..OpenOptions::default() };
    let vol = Volume::open(dev as Arc<dyn Storage>, None, &open).map_err(m)?;
    let mut first = vec![0u8; distinct * BLOCK_BYTES];
    model.fill_range(0, &mut first);
    let req = METADATA_REQUEST_BLOCKS * BLOCK_BYTES;
    for (k, r) in first.chunks(req).enumerate() {
        vol.write((k * req) as u64, r, false).map_err(m)?;
    }
    vol.flush().map_err(m)?;
    // Per round: the engine's time less the hashing's; the median round is kept, so a
    // burst of load from elsewhere on the machine moves the figure little.
    let round_us = |round: usize, data: &[u8]| -> Result<f64, ModelError> {
        let start = Instant::now();
        for (k, r) in data.chunks(req).enumerate() {
            vol.write(((round * distinct * BLOCK_BYTES) + k * req) as u64, r, false).map_err(m)?;
        }
        let engine_s = start.elapsed().as_secs_f64();
        let start = Instant::now();
        let op = dedupvol_core::PrintOp { crc32c: true, ..BLAKE3_ONLY };
        std::hint::black_box(data.chunks(req).map(|r| engine_prints(r, op)).sum::<usize>());
        let hash_s = start.elapsed().as_secs_f64();
        Ok((engine_s - hash_s) * 1e6 / distinct as f64)
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(METADATA_US_MIN)
    };
    let mut dup_us = Vec::with_capacity(METADATA_ROUNDS);
    for round in 1..=METADATA_ROUNDS {
        dup_us.push(round_us(round, &first)?);
    }
    let mut unique_us = Vec::with_capacity(METADATA_ROUNDS);
    let mut fresh = vec![0u8; distinct * BLOCK_BYTES];
    for round in METADATA_ROUNDS + 1..=2 * METADATA_ROUNDS {
        model.fill_range((round * distinct) as u64, &mut fresh);
        unique_us.push(round_us(round, &fresh)?);
    }
    vol.flush().map_err(m)?;
    let write_us = median(dup_us);
    let unique_us = median(unique_us);
    let timed = (distinct * METADATA_ROUNDS) as f64;
    let mut buf = vec![0u8; req];
    let start = Instant::now();
    for k in 0..(distinct * METADATA_ROUNDS) / METADATA_REQUEST_BLOCKS {
        vol.read((distinct * BLOCK_BYTES + k * req) as u64, &mut buf).map_err(m)?;
    }
    let read_us = start.elapsed().as_secs_f64() * 1e6 / timed;
    vol.close().map_err(m)?;
    Ok((write_us, unique_us, read_us))
}

/// The codec the volume compresses with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    /// zstd (the engine's default).
    Zstd,
    /// LZ4 (the fast option).
    Lz4,
}

/// The reduction and access mix. All fractions of `0..=1`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Mix {
    /// Blocks that are all zeros.
    pub zero: f64,
    /// Of the non-zero blocks, those that duplicate stored data.
    pub dup: f64,
    /// Bytes of a unique block the codec saves (0: incompressible, stored raw).
    pub compress: f64,
    /// Share of the logical bytes moved that are reads (0: all writes).
    pub read: f64,
}

impl Mix {
    /// Refuses fractions outside `0..=1`, and a mix that stores nothing (all zeros, all
    /// duplicates, or compression saving everything): its capacity would be infinite.
    pub fn validate(&self) -> Result<(), ModelError> {
        let pct = |v: f64| format!("{}", v * 100.0);
        for (name, v) in
            [("--zero", self.zero), ("--dup", self.dup), ("--compress", self.compress), ("--read", self.read)]
        {
            if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
                return Err(ModelError::Parameter { name, value: pct(v), expected: "a percentage from 0 to 100" });
            }
        }
        if self.compress >= 1.0 {
            return Err(ModelError::Parameter {
                name: "--compress",
                value: pct(self.compress),
                expected: "below 100 (a stored block keeps some bytes)",
            });
        }
        if self.zero >= 1.0 {
            return Err(ModelError::Parameter {
                name: "--zero",
                value: pct(self.zero),
                expected: "below 100 (a mix of only zeros stores nothing to size for)",
            });
        }
        if self.dup >= 1.0 {
            return Err(ModelError::Parameter {
                name: "--dup",
                value: pct(self.dup),
                expected: "below 100 (a mix of only duplicates stores nothing to size for)",
            });
        }
        Ok(())
    }

    /// Unique blocks per logical block: `u = (1 - zero) × (1 - dup)`.
    pub fn unique(&self) -> f64 {
        (1.0 - self.zero) * (1.0 - self.dup)
    }

    /// Stored data bytes per logical byte: `p = u × (1 - compress)`.
    pub fn stored(&self) -> f64 {
        self.unique() * (1.0 - self.compress)
    }
}

/// Device figures (decimal MB/s and TB).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Devices {
    /// One data SSD's sequential write bandwidth.
    pub ssd_write_mb_s: f64,
    /// One data SSD's read bandwidth.
    pub ssd_read_mb_s: f64,
    /// One data SSD's capacity.
    pub ssd_tb: f64,
    /// The fast metadata device's (NVDIMM's) write bandwidth.
    pub nvdimm_write_mb_s: f64,
    /// A remote RADOS pool's client bandwidth (replication included), if projected.
    pub remote_mb_s: Option<f64>,
    /// The remote pool's client-visible capacity.
    pub remote_tb: f64,
    /// RADOS replicas: each client TB costs this many raw TB.
    pub remote_replicas: u32,
}

/// Memory settings of the engine being sized (docs/format.md, "Memory").
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MemorySettings {
    /// The block map page cache (`block_map_cache_bytes`).
    pub block_map_cache_bytes: u64,
    /// The content cache (`serve --cache-size`).
    pub content_cache_bytes: u64,
    /// Sparse index (a slot per 16 indexed blocks) instead of dense.
    pub sparse_index: bool,
}

/// Prices, in any one currency (the defaults are US dollars).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Prices {
    /// One core (its share of the CPU and the server around it).
    pub core: f64,
    /// One GB of DRAM.
    pub dram_gb: f64,
    /// One TB of data SSD (and of the remote pool's raw capacity).
    pub ssd_tb: f64,
    /// One GB of NVDIMM (the fast metadata device).
    pub nvdimm_gb: f64,
}

/// Where the data and the metadata live (named for what a buyer chooses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Data and metadata on the SSDs.
    Ssds,
    /// Data on the SSDs, metadata on an NVDIMM (a separate fast metadata device).
    SsdsNvdimm,
    /// Data and metadata in a remote RADOS pool.
    Remote,
    /// Data in a remote RADOS pool, metadata on a local NVDIMM.
    RemoteNvdimm,
}

/// One configuration of the comparison.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Config {
    /// Cores running the engine.
    pub cores: u32,
    /// Data SSDs (0 for a remote pool).
    pub ssds: u32,
    /// Volumes served (each has its own state lock).
    pub volumes: u32,
    /// Where data and metadata live.
    pub storage: Placement,
}

/// The resource that limits a configuration's throughput.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Bound {
    /// CPU, mostly fingerprinting (BLAKE3 and crc32c).
    CpuHashing,
    /// CPU, mostly compression (probe and codec).
    CpuCompression,
    /// CPU, mostly decompression and read checks.
    CpuDecompression,
    /// CPU, mostly the engine's per-block metadata work.
    CpuMetadata,
    /// The volumes' state locks (the serial metadata work, one core per volume).
    VolumeLock,
    /// The data SSDs' bandwidth.
    DataDevices,
    /// The NVDIMM's bandwidth.
    MetadataDevice,
    /// The remote pool's bandwidth.
    Remote,
}

impl Bound {
    /// Short text for tables.
    pub fn name(self) -> &'static str {
        match self {
            Bound::CpuHashing => "CPU: hashing",
            Bound::CpuCompression => "CPU: compression",
            Bound::CpuDecompression => "CPU: decompression",
            Bound::CpuMetadata => "CPU: metadata",
            Bound::VolumeLock => "volume lock",
            Bound::DataDevices => "data SSDs",
            Bound::MetadataDevice => "NVDIMM",
            Bound::Remote => "RADOS",
        }
    }
}

/// The CPU work of one logical block of the mix, µs on one core, by stage.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CpuWork {
    /// BLAKE3 and crc32c of written blocks.
    pub hashing_us: f64,
    /// Probe and codec of written unique blocks.
    pub compression_us: f64,
    /// Decompression and crc32c of read blocks.
    pub decompression_us: f64,
    /// The engine's per-block work, written and read blocks.
    pub metadata_us: f64,
}

impl CpuWork {
    /// The CPU time of one block.
    pub fn total_us(&self) -> f64 {
        self.hashing_us + self.compression_us + self.decompression_us + self.metadata_us
    }

    /// The stage that takes most of it.
    fn largest(&self) -> Bound {
        let mut best = (Bound::CpuHashing, self.hashing_us);
        for (b, v) in [
            (Bound::CpuCompression, self.compression_us),
            (Bound::CpuDecompression, self.decompression_us),
            (Bound::CpuMetadata, self.metadata_us),
        ] {
            if v > best.1 {
                best = (b, v);
            }
        }
        best.0
    }
}

/// The per-block CPU work of a mix (docs/design.md, "Sizing model", formula (1)).
pub fn cpu_work(rates: &Rates, mix: &Mix, codec: Codec) -> CpuWork {
    let b = BLOCK_BYTES as f64;
    let w = 1.0 - mix.read;
    let (zc, zd) = rates.codec(codec);
    let nonzero = 1.0 - mix.zero;
    let compressed = mix.compress > 0.0;
    CpuWork {
        hashing_us: w * nonzero * (b / rates.blake3_mb_s + b / rates.crc32c_mb_s),
        compression_us: w * mix.unique() * (b / rates.probe_mb_s + if compressed { b / zc } else { 0.0 }),
        decompression_us: mix.read * nonzero * (b / rates.crc32c_mb_s + if compressed { b / zd } else { 0.0 }),
        metadata_us: w
            * (mix.unique() * rates.write_unique_metadata_us_per_block
                + (1.0 - mix.unique()) * rates.write_metadata_us_per_block)
            + mix.read * rates.read_metadata_us_per_block,
    }
}

/// Metadata bytes per logical byte (docs/design.md, "Sizing model", formulas (3) and (4)).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MetadataBytes {
    /// Written per logical byte written: journal, block map pages, reference count pages,
    /// index record pages.
    pub written_per_byte: f64,
    /// Held on the metadata device per logical byte stored: both block map slots, both
    /// reference count slots, the chapter ring (a dense window over the stored data).
    pub held_per_byte: f64,
}

/// The metadata bytes of a mix, from the engine's on-disk constants.
pub fn metadata_bytes(mix: &Mix) -> MetadataBytes {
    let b = BLOCK_BYTES as f64;
    let journal = b / JOURNAL_ENTRIES_PER_BLOCK as f64;
    let map_page = b / BM_ENTRIES_PER_PAGE as f64;
    let rc_page = b / RC_ENTRIES_PER_PAGE as f64;
    let record = b / RECORDS_PER_PAGE as f64;
    // Physical blocks per logical block: what is stored.
    let physical = mix.stored();
    MetadataBytes {
        written_per_byte: (journal + map_page + physical * rc_page + mix.unique() * record) / b,
        held_per_byte: (PAGE_SLOTS * map_page + physical * PAGE_SLOTS * rc_page + mix.unique() * record) / b,
    }
}

/// One row of the comparison.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Projection {
    /// The configuration.
    pub config: Config,
    /// Logical MB/s the configuration sustains for the mix (the smallest bound).
    pub throughput_mb_s: f64,
    /// What limits it.
    pub bound: Bound,
    /// The CPU bound, MB/s.
    pub cpu_mb_s: f64,
    /// The volume-lock bound, MB/s.
    pub lock_mb_s: f64,
    /// The data devices' (SSDs' or remote pool's) bound, MB/s.
    pub data_mb_s: f64,
    /// The NVDIMM's bound, MB/s (None without one).
    pub metadata_device_mb_s: Option<f64>,
    /// Raw data capacity, TB (the SSDs', or the remote pool's client-visible).
    pub raw_tb: f64,
    /// Logical TB that fit after reduction.
    pub usable_tb: f64,
    /// DRAM needed, GB.
    pub dram_gb: f64,
    /// NVDIMM needed for the metadata of the usable capacity, GB (0 without one).
    pub nvdimm_gb: f64,
    /// Cost of cores, DRAM, SSDs (or the pool's raw TB) and NVDIMM.
    pub cost: f64,
    /// Cost per GB/s of throughput.
    pub cost_per_gb_s: f64,
    /// Cost per usable TB.
    pub cost_per_usable_tb: f64,
}

/// Everything a projection needs besides the configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelInput {
    /// Per-core rates.
    pub rates: Rates,
    /// The mix.
    pub mix: Mix,
    /// The volume's codec.
    pub codec: Codec,
    /// Device figures.
    pub devices: Devices,
    /// Memory settings.
    pub memory: MemorySettings,
    /// Prices.
    pub prices: Prices,
}

impl ModelInput {
    /// Validates every input (rates, mix, device figures, prices).
    pub fn validate(&self) -> Result<(), ModelError> {
        self.rates.validate()?;
        self.mix.validate()?;
        let d = &self.devices;
        for (name, v) in [
            ("--ssd-write-mb-s", d.ssd_write_mb_s),
            ("--ssd-read-mb-s", d.ssd_read_mb_s),
            ("--ssd-tb", d.ssd_tb),
            ("--nvdimm-write-mb-s", d.nvdimm_write_mb_s),
            ("--remote-tb", d.remote_tb),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(ModelError::Parameter { name, value: format!("{v}"), expected: "a positive number" });
            }
        }
        if let Some(v) = d.remote_mb_s {
            if !(v.is_finite() && v > 0.0) {
                return Err(ModelError::Parameter {
                    name: "--remote-mb-s",
                    value: format!("{v}"),
                    expected: "a positive number",
                });
            }
        }
        if d.remote_replicas == 0 {
            return Err(ModelError::Parameter { name: "--remote-replicas", value: "0".into(), expected: "at least 1" });
        }
        let p = &self.prices;
        for (name, v) in [
            ("--price-core", p.core),
            ("--price-dram-gb", p.dram_gb),
            ("--price-ssd-tb", p.ssd_tb),
            ("--price-nvdimm-gb", p.nvdimm_gb),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ModelError::Parameter { name, value: format!("{v}"), expected: "a number of at least 0" });
            }
        }
        Ok(())
    }
}

/// Projects one configuration (docs/design.md, "Sizing model").
pub fn project(input: &ModelInput, config: &Config) -> Result<Projection, ModelError> {
    input.validate()?;
    let remote = matches!(config.storage, Placement::Remote | Placement::RemoteNvdimm);
    let nvdimm = matches!(config.storage, Placement::SsdsNvdimm | Placement::RemoteNvdimm);
    if config.cores == 0 {
        return Err(ModelError::Parameter { name: "--cores", value: "0".into(), expected: "at least 1" });
    }
    if config.volumes == 0 {
        return Err(ModelError::Parameter { name: "--volumes", value: "0".into(), expected: "at least 1" });
    }
    if !remote && config.ssds == 0 {
        return Err(ModelError::Parameter { name: "--ssds", value: "0".into(), expected: "at least 1" });
    }
    let remote_mb_s = match (remote, input.devices.remote_mb_s) {
        (true, Some(v)) => v,
        (true, None) => {
            return Err(ModelError::Parameter {
                name: "--remote-mb-s",
                value: "none".into(),
                expected: "given for a remote configuration",
            })
        }
        (false, _) => 0.0,
    };
    let mix = &input.mix;
    let d = &input.devices;
    let b = BLOCK_BYTES as f64;
    let w = 1.0 - mix.read;
    // (1) CPU: every stage's time over the cores.
    let work = cpu_work(&input.rates, mix, input.codec);
    let cpu_mb_s = f64::from(config.cores) * b / work.total_us();
    // (2) The serial part: a volume's state lock runs its metadata work on one core.
    let lock_mb_s = f64::from(config.volumes.min(config.cores)) * b / work.metadata_us;
    // (3) Devices: bytes moved per logical byte.
    let meta = metadata_bytes(mix);
    let meta_w = w * meta.written_per_byte;
    let data_w = w * mix.stored() + if nvdimm { 0.0 } else { meta_w };
    let data_r = mix.read * (1.0 - mix.zero) * (1.0 - mix.compress);
    let data_mb_s = if remote {
        remote_mb_s / (data_w + data_r)
    } else {
        f64::from(config.ssds) / (data_w / d.ssd_write_mb_s + data_r / d.ssd_read_mb_s)
    };
    let metadata_device_mb_s = (nvdimm && meta_w > 0.0).then(|| d.nvdimm_write_mb_s / meta_w);
    let mut bounds = vec![(work.largest(), cpu_mb_s), (Bound::VolumeLock, lock_mb_s)];
    bounds.push((if remote { Bound::Remote } else { Bound::DataDevices }, data_mb_s));
    if let Some(m) = metadata_device_mb_s {
        bounds.push((Bound::MetadataDevice, m));
    }
    let (bound, throughput_mb_s) =
        bounds.iter().copied().fold((Bound::DataDevices, f64::INFINITY), |a, x| if x.1 < a.1 { x } else { a });
    assert!(
        throughput_mb_s.is_finite() && bounds.iter().all(|&(_, v)| v >= throughput_mb_s),
        "the throughput is the smallest bound"
    );
    // (4) Capacity.
    let raw_tb = if remote { d.remote_tb } else { f64::from(config.ssds) * d.ssd_tb };
    let held_on_data = mix.stored() + if nvdimm { 0.0 } else { meta.held_per_byte };
    let usable_tb = raw_tb / held_on_data;
    let nvdimm_gb = if nvdimm { usable_tb * TB * meta.held_per_byte / GB } else { 0.0 };
    // (5) DRAM.
    let physical_blocks = raw_tb * TB / b;
    let slot = INDEX_SLOT_BYTES as f64 / INDEX_LOAD;
    let indexed = physical_blocks / if input.memory.sparse_index { SPARSE_SAMPLE as f64 } else { 1.0 };
    let dram_bytes = PROCESS_BASE_BYTES * f64::from(config.volumes)
        + physical_blocks * MEMORY_PER_PHYSICAL_BLOCK_BYTES
        + indexed * slot
        + f64::from(config.volumes)
            * (input.memory.block_map_cache_bytes as f64 + input.memory.content_cache_bytes as f64);
    let dram_gb = dram_bytes / GB;
    // (6) Cost.
    let p = &input.prices;
    let storage_tb = if remote { raw_tb * f64::from(d.remote_replicas) } else { raw_tb };
    let cost = f64::from(config.cores) * p.core + dram_gb * p.dram_gb + storage_tb * p.ssd_tb + nvdimm_gb * p.nvdimm_gb;
    Ok(Projection {
        config: config.clone(),
        throughput_mb_s,
        bound,
        cpu_mb_s,
        lock_mb_s,
        data_mb_s,
        metadata_device_mb_s,
        raw_tb,
        usable_tb,
        dram_gb,
        nvdimm_gb,
        cost,
        cost_per_gb_s: cost / (throughput_mb_s / 1000.0),
        cost_per_usable_tb: cost / usable_tb,
    })
}

/// Every combination of `cores` × `ssds` × `storages` (remote storages once per core
/// count, without SSDs).
pub fn sweep(
    input: &ModelInput,
    cores: &[u32],
    ssds: &[u32],
    volumes: u32,
    storages: &[Placement],
) -> Result<Vec<Projection>, ModelError> {
    let mut rows = Vec::new();
    for &c in cores {
        for &s in storages {
            if matches!(s, Placement::Remote | Placement::RemoteNvdimm) {
                rows.push(project(input, &Config { cores: c, ssds: 0, volumes, storage: s })?);
                continue;
            }
            for &n in ssds {
                rows.push(project(input, &Config { cores: c, ssds: n, volumes, storage: s })?);
            }
        }
    }
    Ok(rows)
}

/// Stage 1's BLAKE3 alone.
const BLAKE3_ONLY: dedupvol_core::PrintOp =
    dedupvol_core::PrintOp { zero_check: false, weak_mask: None, crc32c: false, blake3: true };

/// Fingerprints every 4 KiB block of `data` as the engine's CPU backend does (hashes side
/// by side, `print_chunks`); a sum of their first bytes, so the work is not optimised away.
fn engine_prints(data: &[u8], op: dedupvol_core::PrintOp) -> usize {
    let chunks: Vec<&[u8]> = data.chunks_exact(BLOCK_BYTES).collect();
    let mut out = vec![dedupvol_core::Prints::default(); chunks.len()];
    dedupvol_core::print_chunks(op, &chunks, &mut out);
    out.iter().map(|p| p.blake3[0] as usize + p.crc32c as usize).fold(0, usize::wrapping_add)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Round rates: one block hashes in 1 µs, compresses in 4 µs, metadata 0.5 µs.
    pub(crate) fn fixed_rates() -> Rates {
        Rates {
            version: RATES_VERSION,
            measured_on: "fixed".into(),
            blake3_mb_s: 4096.0 / 0.8,
            crc32c_mb_s: 4096.0 / 0.2,
            probe_mb_s: 4096.0 / 0.5,
            zstd_compress_mb_s: 4096.0 / 3.5,
            zstd_decompress_mb_s: 4096.0,
            lz4_compress_mb_s: 4096.0,
            lz4_decompress_mb_s: 8192.0,
            write_metadata_us_per_block: 0.5,
            write_unique_metadata_us_per_block: 0.5,
            read_metadata_us_per_block: 0.25,
        }
    }

    pub(crate) fn input() -> ModelInput {
        ModelInput {
            rates: fixed_rates(),
            mix: Mix { zero: 0.0, dup: 0.0, compress: 0.5, read: 0.0 },
            codec: Codec::Zstd,
            devices: Devices {
                ssd_write_mb_s: 2000.0,
                ssd_read_mb_s: 3000.0,
                ssd_tb: 4.0,
                nvdimm_write_mb_s: 4000.0,
                remote_mb_s: Some(2500.0),
                remote_tb: 100.0,
                remote_replicas: 3,
            },
            memory: MemorySettings { block_map_cache_bytes: 0, content_cache_bytes: 0, sparse_index: false },
            prices: Prices { core: 100.0, dram_gb: 0.0, ssd_tb: 0.0, nvdimm_gb: 0.0 },
        }
    }

    fn cfg(cores: u32, ssds: u32) -> Config {
        Config { cores, ssds, volumes: 64, storage: Placement::SsdsNvdimm }
    }

    #[test]
    fn the_cpu_work_of_unique_writes_follows_the_rates() {
        let w = cpu_work(&fixed_rates(), &input().mix, Codec::Zstd);
        assert!((w.hashing_us - 1.0).abs() < 1e-9, "{w:?}");
        assert!((w.compression_us - 4.0).abs() < 1e-9, "{w:?}");
        assert!((w.metadata_us - 0.5).abs() < 1e-9, "{w:?}");
        assert_eq!(w.decompression_us, 0.0);
    }

    #[test]
    fn doubling_cores_doubles_a_cpu_bound_throughput_until_the_devices_bind() {
        let i = input();
        // 5.5 µs per block and core: 744.7 MB/s per core; 2 SSDs at 2000 MB/s for half of
        // every byte (plus metadata on the NVDIMM): 8000 MB/s.
        let one = project(&i, &cfg(1, 2)).expect("1 core");
        assert_eq!(one.bound, Bound::CpuCompression);
        assert!((one.throughput_mb_s - 4096.0 / 5.5).abs() < 1e-6, "{one:?}");
        let two = project(&i, &cfg(2, 2)).expect("2 cores");
        assert!((two.throughput_mb_s - 2.0 * one.throughput_mb_s).abs() < 1e-6);
        assert_eq!(two.bound, Bound::CpuCompression);
        let many = project(&i, &cfg(64, 2)).expect("64 cores");
        assert_eq!(many.bound, Bound::DataDevices, "{many:?}");
        assert!((many.throughput_mb_s - 8000.0).abs() < 1e-6, "{many:?}");
        // More SSDs lift the device bound.
        let more = project(&i, &cfg(64, 4)).expect("4 SSDs");
        assert!((more.throughput_mb_s - 16000.0).abs() < 1e-6, "{more:?}");
        // The cost per GB/s falls as the cores pay for themselves.
        assert!((one.cost_per_gb_s - 100.0 / (one.throughput_mb_s / 1000.0)).abs() < 1e-6);
    }

    #[test]
    fn the_bound_names_the_stage_that_takes_the_most() {
        let mut i = input();
        i.mix.compress = 0.0; // stored raw: only the probe
        let p = project(&i, &cfg(1, 8)).expect("raw");
        assert_eq!(p.bound, Bound::CpuHashing, "{p:?}");
        i.mix.read = 1.0;
        i.mix.compress = 0.5;
        let p = project(&i, &cfg(1, 8)).expect("reads");
        assert_eq!(p.bound, Bound::CpuDecompression, "{p:?}");
        // One volume: its lock serialises the metadata work.
        let mut i = input();
        i.mix.dup = 0.99;
        let p = project(&i, &Config { cores: 64, ssds: 8, volumes: 1, storage: Placement::SsdsNvdimm }).expect("dup");
        assert_eq!(p.bound, Bound::VolumeLock, "{p:?}");
        assert!((p.throughput_mb_s - 4096.0 / 0.5).abs() < 1e-6, "{p:?}");
        // A remote pool binds at its bandwidth over the bytes sent.
        let i = input();
        let p =
            project(&i, &Config { cores: 64, ssds: 0, volumes: 64, storage: Placement::RemoteNvdimm }).expect("rados");
        assert_eq!(p.bound, Bound::Remote);
        assert!((p.throughput_mb_s - 5000.0).abs() < 1e-6, "{p:?}");
    }

    #[test]
    fn metadata_on_the_ssds_costs_bandwidth_and_capacity_an_nvdimm_takes_over() {
        let i = input();
        let with = project(&i, &cfg(64, 2)).expect("nvdimm");
        let without = project(&i, &Config { storage: Placement::Ssds, ..cfg(64, 2) }).expect("ssds");
        assert!(without.throughput_mb_s < with.throughput_mb_s);
        assert!(without.usable_tb < with.usable_tb);
        assert!((with.usable_tb - 16.0).abs() < 1e-9, "8 TB raw at 2:1: {with:?}");
        assert!(with.nvdimm_gb > 0.0 && without.nvdimm_gb == 0.0);
    }

    #[test]
    fn dram_follows_the_documented_sizes() {
        let mut i = input();
        i.memory.block_map_cache_bytes = 128 << 20;
        let p = project(&i, &Config { volumes: 1, ..cfg(8, 1) }).expect("dram");
        let blocks = 4e12 / 4096.0;
        let want = (PROCESS_BASE_BYTES + (128u64 << 20) as f64 + blocks * (4.125 + 5.0 / 0.9)) / 1e9;
        assert!((p.dram_gb - want).abs() < 1e-9, "{} vs {want}", p.dram_gb);
        i.memory.sparse_index = true;
        let s = project(&i, &Config { volumes: 1, ..cfg(8, 1) }).expect("sparse");
        assert!(s.dram_gb < p.dram_gb);
    }

    #[test]
    fn unique_blocks_pay_their_own_metadata_figure() {
        let mut r = fixed_rates();
        r.write_unique_metadata_us_per_block = 2.5;
        let mix = Mix { zero: 0.2, dup: 0.5, compress: 0.5, read: 0.0 };
        // u = 0.8 × 0.5 = 0.4: 0.4 × 2.5 + 0.6 × 0.5.
        let w = cpu_work(&r, &mix, Codec::Zstd);
        assert!((w.metadata_us - 1.3).abs() < 1e-9, "{w:?}");
    }

    #[test]
    fn bad_parameters_are_clear_errors() {
        let mut i = input();
        i.mix.dup = 1.2;
        let e = project(&i, &cfg(1, 1)).expect_err("dup 120");
        assert!(e.to_string().contains("--dup 120"), "{e}");
        let mut i = input();
        i.mix.zero = 1.0;
        assert!(project(&i, &cfg(1, 1)).expect_err("zero 100").to_string().contains("--zero"));
        let i = input();
        assert!(project(&i, &cfg(0, 1)).expect_err("0 cores").to_string().contains("--cores 0"));
        assert!(project(&i, &cfg(1, 0)).expect_err("0 ssds").to_string().contains("--ssds 0"));
        let mut i = input();
        i.rates.zstd_compress_mb_s = 0.0;
        assert!(matches!(project(&i, &cfg(1, 1)), Err(ModelError::Rate { name: "zstd_compress_mb_s", .. })));
        let mut i = input();
        i.rates.version = 99;
        assert!(matches!(project(&i, &cfg(1, 1)), Err(ModelError::RatesVersion { found: 99 })));
        let mut i = input();
        i.prices.core = f64::NAN;
        assert!(project(&i, &cfg(1, 1)).expect_err("nan price").to_string().contains("--price-core"));
        let mut i = input();
        i.devices.remote_mb_s = None;
        let e = project(&i, &Config { storage: Placement::Remote, ..cfg(1, 0) }).expect_err("no remote bw");
        assert!(e.to_string().contains("--remote-mb-s"), "{e}");
    }

    #[test]
    fn rates_round_trip_through_json() {
        let r = fixed_rates();
        let back: Rates = serde_json::from_str(&serde_json::to_string(&r).expect("json")).expect("parse");
        assert_eq!(back, r);
    }
}
