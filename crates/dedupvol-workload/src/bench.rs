//! The in-process engine benchmark (`dedupvol bench`): writes a workload into a freshly
//! formatted volume with several writer threads and prints the engine's speed beside the
//! machine's primitives and a no-reduction baseline measured in the same run.
//!
//! Scenarios:
//! - `seq`: generated data ([`DataSpec`]) written in `request_bytes` requests; request `k`
//!   goes to offset `k × request_bytes` and writer `k mod threads` issues it;
//! - `overwrite`: the logical range is first filled (untimed) with the same kind of data,
//!   then random 4 KiB writes at uniformly random aligned offsets are timed (writes/s);
//! - `ingest`: a real file read in `request_bytes` chunks (page cache warmed first, so the
//!   disk the file lives on is not what is measured).
//!
//! Every timed run ends with a `flush()` inside the clock: with the async write policy an
//! acknowledged write is only in memory, and a figure that leaves data there is not a write
//! speed. The baselines are the same requests into a volume formatted with
//! `--dedup off --compression none`, and raw `pwrite` into a plain file (+ fdatasync).
//!
//! Invariants:
//! - The data is generated before the clock starts (the generator is not measured).
//! - Write amplification counts every byte the engine wrote to its devices during the timed
//!   phase (`stats.io`), over the logical bytes written and over the ideal (the unique
//!   chunks' stored sizes, computed by the estimator on the same bytes).

use crate::content::{ContentModel, DataSpec, BLOCK_BYTES, LANE_BLOCKS};
use crate::estimate::{EstimateOptions, EstimateReport, Estimator};
use crate::primitives::{measure_cpu, measure_disk_seq_write, CpuPrimitives, DiskFigure, RemoveOnDrop};
use crate::rng::WyRand;
use dedupvol_core::{
    Compression, DedupVerify, FileStorage, FormatOptions, IoMode, IoStats, OpenOptions, Stats, Storage, Volume,
    WritePolicy,
};
use serde::Serialize;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The cleaner passes after the timed phase of an overwrite run.
#[derive(Debug, Clone, Serialize)]
pub struct FinalClean {
    /// Reduction at the end of the timed phase.
    pub reduction_before: f64,
    /// Reduction after the passes.
    pub reduction_after: f64,
    /// Passes run.
    pub passes: usize,
    /// Compressed bytes the passes wrote again.
    pub bytes_moved: u64,
    /// The estimate's reduction of the volume's live content (read back after the passes).
    pub live_estimate: f64,
}

/// What the recompression of deferred data did after the timed phase.
#[derive(Debug, Clone, Serialize)]
pub struct FinalRecompress {
    /// Reduction at the end of the timed phase (deferred data stored with LZ4).
    pub reduction_before: f64,
    /// Reduction once every fragment is at rest (the volume's codec; settled at the rest
    /// level when the volume has one).
    pub reduction_after: f64,
    /// Logical bytes compressed again.
    pub bytes_recompressed: u64,
    /// Bytes the passes stored (their device writes of data).
    pub bytes_written: u64,
    /// Fragments settled where they were (too little gain to write them again).
    pub fragments_marked: u64,
    /// Seconds the passes took.
    pub seconds: f64,
}

/// The data an overwrite run's volume wrote on its own, against what its client wrote.
#[derive(Debug, Clone, Serialize)]
pub struct BackgroundWrites {
    /// Data bytes the client's writes stored in the timed phase (device data writes in the
    /// phase less the cleaner's moves in it).
    pub client_bytes: u64,
    /// Bytes the cleaner moved during the timed phase.
    pub cleaner_timed_bytes: u64,
    /// Device data writes after the timed phase: the final cleaner pass and the settling
    /// passes (with their cleaner passes).
    pub after_bytes: u64,
}

impl BackgroundWrites {
    /// Background data writes over the client's.
    pub fn ratio(&self) -> f64 {
        (self.cleaner_timed_bytes + self.after_bytes) as f64 / self.client_bytes.max(1) as f64
    }
}

/// How often the engine run's cleaner looks at the dead-space hint, and the hint that
/// starts a pass (as `serve` runs it).
const CLEANER_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);
/// See `CLEANER_INTERVAL`.
pub const CLEANER_TRIGGER_BYTES: u64 = 8 << 20;
use std::time::Instant;

/// Bytes of scenario data the CPU primitives are measured on.
const PRIMITIVE_SAMPLE_BYTES: usize = 8 << 20;
/// Bytes written by the disk sequential-write measurement.
const DISK_SEQ_BYTES: u64 = 512 << 20;
/// Extra physical space beyond the data, for metadata and slack, in bytes.
const PHYSICAL_SLACK_BYTES: u64 = 1 << 30;

/// What one scenario writes.
#[derive(Debug, Clone, Serialize)]
pub enum Scenario {
    /// Generated data written sequentially.
    Seq {
        /// The data.
        data: DataSpec,
        /// Total bytes written.
        size_bytes: u64,
    },
    /// Random 4 KiB overwrites of a prefilled range.
    Overwrite {
        /// The data (prefill and overwrites).
        data: DataSpec,
        /// Logical range, in bytes.
        range_bytes: u64,
        /// Timed 4 KiB writes.
        writes: u64,
    },
    /// Real files, each placed at the next 4 KiB-aligned offset (as a filesystem would
    /// place them; unaligned concatenation would hide block-level duplicates).
    Ingest {
        /// The files.
        paths: Vec<PathBuf>,
    },
}

/// A speed goal, printed beside the measurement.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    /// Minimum value.
    pub min: f64,
    /// "MB/s" or "writes/s".
    pub unit: String,
}

/// Common settings.
#[derive(Debug, Clone, Serialize)]
pub struct BenchOptions {
    /// Directory for the volume and baseline files (same filesystem as the disk figure).
    pub dir: PathBuf,
    /// A file or block device to use instead of temp files (engine volume, baseline
    /// volume and raw writes in turn; its contents are destroyed, the path is kept).
    pub target_path: Option<PathBuf>,
    /// Writer threads.
    pub threads: usize,
    /// Request size of `seq` and `ingest`, in bytes.
    pub request_bytes: usize,
    /// Compression of the engine volume.
    pub compression: Compression,
    /// Its level (zstd; 0 for the default).
    pub compression_level: i8,
    /// Its rest level (`FormatOptions::rest_level`; None: the format default).
    pub rest_level: Option<i8>,
    /// Overwrite runs: the cleaner passes after the timed phase, and their victims' live
    /// bytes at most (`CleanOptions::live_max`; None: the engine's default).
    pub final_clean_passes: usize,
    /// See `final_clean_passes`.
    pub final_clean_live_max: Option<u32>,
    /// Write policy of the engine volume.
    pub write_policy: WritePolicy,
    /// Also run the no-reduction volume and raw-file baselines.
    pub baselines: bool,
    /// Also estimate the data's ideal reduction and measure the one-core primitives on it
    /// (off: the engine run alone, as `--mode scaling` repeats it once per worker count;
    /// the estimate is then empty and the ideal 0).
    pub reference: bool,
    /// Index memory of the engine volume, in bytes.
    pub index_memory_bytes: u64,
    /// Duplicate verification of the engine volume.
    pub verify: DedupVerify,
    /// How the engine and no-reduction volumes open their file or device.
    pub io_mode: IoMode,
    /// Print phase timings to stderr.
    pub verbose: bool,
    /// How the engine volume batches small writes.
    pub batch: dedupvol_core::BatchOptions,
    /// The engine volume predicts unique chunks (`OpenOptions::unique_predictor`).
    pub unique_predictor: bool,
    /// The engine volume's `OpenOptions::defer_compression_micros`.
    pub defer_compression_micros: u64,
    /// The engine volume's `OpenOptions::workers`.
    pub workers: Option<usize>,
}

impl BenchOptions {
    /// How the engine volume (and the no-reduction baseline) are opened: the pipeline
    /// settings this benchmark varies, the engine's defaults otherwise.
    fn engine_open_options(&self) -> OpenOptions {
        OpenOptions {
            batch: self.batch,
            unique_predictor: self.unique_predictor,
            defer_compression_micros: self.defer_compression_micros,
            workers: self.workers,
            ..OpenOptions::default()
        }
    }
}

/// One timed run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunFigure {
    /// Logical bytes written in the timed phase.
    pub bytes: u64,
    /// Write requests in the timed phase.
    pub ops: u64,
    /// Seconds, including the final flush.
    pub seconds: f64,
    /// Seconds of the final flush alone.
    pub flush_seconds: f64,
    /// MB/s (10^6 bytes per second).
    pub mb_s: f64,
    /// Requests per second.
    pub ops_s: f64,
}

impl RunFigure {
    fn new(bytes: u64, ops: u64, seconds: f64, flush_seconds: f64) -> Self {
        RunFigure {
            bytes,
            ops,
            seconds,
            flush_seconds,
            mb_s: bytes as f64 / seconds / 1e6,
            ops_s: ops as f64 / seconds,
        }
    }
}

/// Device bytes written by category in the timed phase.
#[derive(Debug, Clone, Default, Serialize)]
pub struct IoBreakdown {
    /// Data blocks written.
    pub data_write: u64,
    /// Journal written.
    pub journal_write: u64,
    /// Block map pages written.
    pub block_map_write: u64,
    /// Refcount pages written.
    pub refcount_write: u64,
    /// Index written.
    pub index_write: u64,
    /// Superblocks written.
    pub superblock_write: u64,
    /// Data read for client reads / read-modify-write.
    pub data_read: u64,
    /// Block map pages read.
    pub block_map_read: u64,
    /// Reads to verify duplicates.
    pub verify_read: u64,
    /// fdatasync calls.
    pub syncs: u64,
}

impl IoBreakdown {
    fn between(a: &IoStats, b: &IoStats) -> Self {
        IoBreakdown {
            data_write: b.data_write.bytes - a.data_write.bytes,
            journal_write: b.journal_write.bytes - a.journal_write.bytes,
            block_map_write: b.block_map_write.bytes - a.block_map_write.bytes,
            refcount_write: b.refcount_write.bytes - a.refcount_write.bytes,
            index_write: b.index_write.bytes - a.index_write.bytes,
            superblock_write: b.superblock_write.bytes - a.superblock_write.bytes,
            data_read: b.data_read.bytes - a.data_read.bytes,
            block_map_read: b.block_map_read.bytes - a.block_map_read.bytes,
            verify_read: b.verify_read.bytes - a.verify_read.bytes,
            syncs: b.syncs - a.syncs,
        }
    }
    /// All bytes written.
    pub fn written(&self) -> u64 {
        self.data_write
            + self.journal_write
            + self.block_map_write
            + self.refcount_write
            + self.index_write
            + self.superblock_write
    }
}

/// What one scenario measured.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioResult {
    /// Short name.
    pub name: String,
    /// The data and pattern in words.
    pub description: String,
    /// The speed goal, if any.
    pub target: Option<Target>,
    /// One-core primitives on this scenario's data.
    pub primitives: Option<CpuPrimitives>,
    /// The engine (dedup + compression as configured).
    pub engine: Option<RunFigure>,
    /// Error of the engine run, if it failed.
    pub engine_error: Option<String>,
    /// The same requests into a `--dedup off --compression none` volume.
    pub no_reduction_volume: Option<RunFigure>,
    /// Error of the baseline volume run, if it failed.
    pub no_reduction_error: Option<String>,
    /// The same requests as raw pwrite into a file (+ fdatasync).
    pub raw_file: Option<RunFigure>,
    /// Engine stats after the timed phase.
    pub stats: Option<Stats>,
    /// Device bytes by category written in the timed phase.
    pub io: Option<IoBreakdown>,
    /// Overwrite runs: the cleaner passes after the timed phase.
    pub final_clean: Option<FinalClean>,
    /// Runs with deferred compression: recompression after the timed phase.
    pub final_recompress: Option<FinalRecompress>,
    /// Overwrite runs: the device writes of data the volume made on its own (cleaner and
    /// settling) against the client's, from the start of the timed phase to the end of the
    /// passes after it.
    pub background: Option<BackgroundWrites>,
    /// Estimator on the same bytes (the ideal).
    pub estimate: Option<EstimateReport>,
    /// Ideal bytes of the timed phase: unique chunks at their stored (compressed) size.
    pub ideal_bytes: u64,
    /// Device bytes written / logical bytes written.
    pub write_amp_logical: Option<f64>,
    /// Device bytes written / ideal bytes.
    pub write_amp_ideal: Option<f64>,
}

/// Generated or file-backed requests, prepared before the clock starts.
enum Source {
    /// Contiguous data; request k covers `[k*req, (k+1)*req)`.
    Memory { data: Vec<u8>, req: usize },
    /// Files read in requests of `req` bytes: `(file, volume offset, length)`.
    Files { files: Vec<(File, u64, u64)>, req: usize },
    /// Per-thread 4 KiB random writes: offsets and their data.
    Random { per_thread: Vec<(Vec<u64>, Vec<u8>)> },
}

/// What a writer does with each of its requests: (offset, bytes).
type RequestFn<'a> = dyn FnMut(u64, &[u8]) -> Result<(), String> + 'a;

impl Source {
    fn total_bytes(&self) -> u64 {
        match self {
            Source::Memory { data, .. } => data.len() as u64,
            Source::Files { files, .. } => {
                files.iter().map(|f| f.2.div_ceil(BLOCK_BYTES as u64) * BLOCK_BYTES as u64).sum()
            }
            Source::Random { per_thread } => per_thread.iter().map(|p| p.1.len() as u64).sum(),
        }
    }

    fn total_ops(&self) -> u64 {
        match self {
            Source::Memory { data, req } => data.len().div_ceil(*req) as u64,
            Source::Files { files, req } => files.iter().map(|f| f.2.div_ceil(*req as u64)).sum(),
            Source::Random { per_thread } => per_thread.iter().map(|p| p.0.len() as u64).sum(),
        }
    }

    /// Calls `f(offset, bytes)` for every request of writer `t` of `n`.
    fn for_each(&self, t: usize, n: usize, f: &mut RequestFn<'_>) -> Result<(), String> {
        match self {
            Source::Memory { data, req } => {
                for (k, chunk) in data.chunks(*req).enumerate().skip(t).step_by(n) {
                    f((k * req) as u64, chunk)?;
                }
            }
            Source::Files { files, req } => {
                let mut buf = vec![0u8; *req];
                let req = *req as u64;
                // Request units numbered across all files; writer t takes every n-th.
                let mut unit = 0usize;
                for (file, base, len) in files {
                    let mut off = 0u64;
                    while off < *len {
                        if unit % n == t {
                            let want = (*len - off).min(req) as usize;
                            // Pad the tail to whole blocks with zeros, as import does.
                            let padded = want.div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
                            buf[..padded].fill(0);
                            file.read_exact_at(&mut buf[..want], off)
                                .map_err(|e| format!("reading input at {off}: {e}"))?;
                            f(base + off, &buf[..padded])?;
                        }
                        unit += 1;
                        off += req;
                    }
                }
            }
            Source::Random { per_thread } => {
                if let Some((offs, data)) = per_thread.get(t) {
                    for (o, d) in offs.iter().zip(data.chunks_exact(BLOCK_BYTES)) {
                        f(*o, d)?;
                    }
                }
            }
        }
        Ok(())
    }
}

fn generate(model: &ContentModel, first_index: u64, bytes: u64, threads: usize) -> Vec<u8> {
    let mut data = vec![0u8; bytes as usize];
    let per = (bytes as usize / BLOCK_BYTES).div_ceil(threads.max(1)) * BLOCK_BYTES;
    std::thread::scope(|s| {
        for (k, part) in data.chunks_mut(per.max(BLOCK_BYTES)).enumerate() {
            s.spawn(move || model.fill_range(first_index + (k * per / BLOCK_BYTES) as u64, part));
        }
    });
    data
}

fn is_block_device(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).map(|m| m.file_type().is_block_device()).unwrap_or(false)
}

/// Formats a volume at `path` and opens it. A temp file is recreated; a user-given file is
/// extended when needed, a block device used as it is.
fn fresh_volume(
    path: &Path,
    temp: bool,
    logical: u64,
    physical: u64,
    fmt: &FormatOptions,
    io_mode: IoMode,
    open: &OpenOptions,
) -> Result<Volume, String> {
    if temp {
        let _ = std::fs::remove_file(path);
    }
    let size = if is_block_device(path) { None } else { Some(physical) };
    let dev: Arc<dyn Storage> = Arc::new(
        match size {
            Some(_) => FileStorage::create_with(path, size, io_mode),
            None => FileStorage::open_with(path, false, io_mode),
        }
        .map_err(|e| format!("creating {}: {e}", path.display()))?,
    );
    let mut opts = fmt.clone();
    opts.logical_size_bytes = logical;
    Volume::format(dev, None, &opts, true).map_err(|e| format!("formatting {}: {e}", path.display()))?;
    let dev: Arc<dyn Storage> =
        Arc::new(FileStorage::open_with(path, false, io_mode).map_err(|e| format!("opening {}: {e}", path.display()))?);
    let vol = Volume::open(dev, None, open).map_err(|e| format!("opening volume {}: {e}", path.display()))?;
    // The clock measures steady state: the index's memory is populated before it starts.
    vol.wait_ready();
    Ok(vol)
}

/// Writes `source` with `threads` writers into `vol`; returns (seconds, flush seconds).
fn timed_volume_writes(vol: &Arc<Volume>, source: &Source, threads: usize) -> Result<(f64, f64), String> {
    let start = Instant::now();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let vol = Arc::clone(vol);
                s.spawn(move || {
                    source.for_each(t, threads, &mut |off, d| {
                        vol.write(off, d, false).map_err(|e| format!("engine write at {off} ({} bytes): {e}", d.len()))
                    })
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| h.join().map_err(|_| "writer thread panicked".to_string())?)
    })?;
    let flush_start = Instant::now();
    vol.flush().map_err(|e| format!("final flush: {e}"))?;
    Ok((start.elapsed().as_secs_f64(), flush_start.elapsed().as_secs_f64()))
}

fn timed_raw_writes(
    path: &Path,
    temp: bool,
    size: u64,
    source: &Source,
    threads: usize,
    io_mode: IoMode,
) -> Result<RunFigure, String> {
    if temp {
        let _ = std::fs::remove_file(path);
    }
    // Through the engine's own storage layer, in the same I/O mode as the volumes: the
    // baseline differs from them only by the absence of reduction and metadata.
    let f = if is_block_device(path) {
        FileStorage::open_with(path, false, io_mode)
    } else {
        FileStorage::create_with(path, Some(size), io_mode)
    }
    .map_err(|e| format!("creating {}: {e}", path.display()))?;
    let start = Instant::now();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let f = &f;
                s.spawn(move || {
                    source.for_each(t, threads, &mut |off, d| {
                        f.write_at(d, off).map_err(|e| format!("pwrite at {off}: {e}"))
                    })
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| h.join().map_err(|_| "writer thread panicked".to_string())?)
    })?;
    let fs = Instant::now();
    f.sync().map_err(|e| format!("fdatasync {}: {e}", path.display()))?;
    let flush = fs.elapsed().as_secs_f64();
    Ok(RunFigure::new(source.total_bytes(), source.total_ops(), start.elapsed().as_secs_f64(), flush))
}

/// Prefill (untimed) for the overwrite scenario.
fn prefill(vol: &Volume, model: &ContentModel, range: u64) -> Result<(), String> {
    const STEP_BYTES: u64 = 8 << 20;
    let mut buf = vec![0u8; STEP_BYTES as usize];
    let mut off = 0;
    while off < range {
        let n = (range - off).min(STEP_BYTES) as usize;
        model.fill_range(off / BLOCK_BYTES as u64, &mut buf[..n]);
        vol.write(off, &buf[..n], false).map_err(|e| format!("prefill write at {off}: {e}"))?;
        off += n as u64;
    }
    vol.flush().map_err(|e| format!("prefill flush: {e}"))
}

/// Settles the volume (recompression passes until one finds nothing to do), untimed.
fn settle_now(vol: &Volume) -> Result<FinalRecompress, String> {
    let before = vol.stats();
    let t = std::time::Instant::now();
    let r = vol
        .settle(&dedupvol_core::RecompressOptions::default(), &|| false)
        .map_err(|e| format!("recompression: {e}"))?;
    Ok(FinalRecompress {
        reduction_before: before.reduction_ratio,
        reduction_after: vol.stats().reduction_ratio,
        bytes_recompressed: r.bytes_recompressed,
        bytes_written: r.bytes_after,
        fragments_marked: r.fragments_marked,
        seconds: t.elapsed().as_secs_f64(),
    })
}

fn ideal_bytes(r: &EstimateReport) -> u64 {
    r.physical_bytes - r.packing_overhead_bytes
}

/// Runs one scenario. Failures of the engine are recorded in the result, not returned, so a
/// table still shows the primitives and baselines.
pub fn run_scenario(
    name: &str,
    scenario: &Scenario,
    target: Option<Target>,
    opts: &BenchOptions,
) -> Result<ScenarioResult, String> {
    let threads = opts.threads.max(1);
    // A given path (file or block device) serves all three runs in turn and is kept; temp
    // files are removed even on error paths.
    let temp = opts.target_path.is_none();
    let in_dir = |what: &str| opts.dir.join(format!(".dedupvol-bench-{}-{what}", std::process::id()));
    let vol_path = opts.target_path.clone().unwrap_or_else(|| in_dir("vol"));
    let base_path = opts.target_path.clone().unwrap_or_else(|| in_dir("base"));
    let raw_path = opts.target_path.clone().unwrap_or_else(|| in_dir("raw"));
    let _cleanup =
        temp.then(|| (RemoveOnDrop(vol_path.clone()), RemoveOnDrop(base_path.clone()), RemoveOnDrop(raw_path.clone())));
    let remove = |p: &Path| {
        if temp {
            let _ = std::fs::remove_file(p);
        }
    };
    let est_opts = EstimateOptions {
        chunk_bytes: BLOCK_BYTES,
        threads,
        compression: opts.compression,
        compression_level: opts.compression_level,
        policies: false,
    };
    let t0 = Instant::now();
    let phase = |what: &str| {
        if opts.verbose {
            eprintln!("    [{name}] {what} at {:.1} s", t0.elapsed().as_secs_f64());
        }
    };

    // Prepare the requests, the estimate of the ideal, and the primitives' sample.
    let (source, description, logical, model, estimate, ideal, sample) = match scenario {
        Scenario::Seq { data, size_bytes } => {
            let model = ContentModel::new(data.clone())?;
            let size = size_bytes.div_ceil(opts.request_bytes as u64) * opts.request_bytes as u64;
            let bytes = generate(&model, 0, size, threads);
            let mut est = Estimator::new(est_opts.clone())?;
            if opts.reference {
                est.feed(&bytes);
            }
            let sample = bytes[..bytes.len().min(PRIMITIVE_SAMPLE_BYTES)].to_vec();
            let desc = format!(
                "{}; {} MiB in {} KiB sequential requests, {threads} writers",
                data.describe(),
                size >> 20,
                opts.request_bytes >> 10
            );
            let report = est.finish();
            let ideal = ideal_bytes(&report);
            (Source::Memory { data: bytes, req: opts.request_bytes }, desc, size, Some(model), report, ideal, sample)
        }
        Scenario::Overwrite { data, range_bytes, writes } => {
            let model = ContentModel::new(data.clone())?;
            let blocks = range_bytes / BLOCK_BYTES as u64;
            // Prefill takes lane 0 indices 0..blocks; overwrites continue in the same lane so
            // their duplicates are drawn from the prefill and each other.
            let mut est = Estimator::new(est_opts.clone())?;
            let mut buf = vec![0u8; 8 << 20];
            let mut i = 0;
            while i < blocks {
                let n = (blocks - i).min((buf.len() / BLOCK_BYTES) as u64) as usize;
                model.fill_range(i, &mut buf[..n * BLOCK_BYTES]);
                if opts.reference {
                    est.feed(&buf[..n * BLOCK_BYTES]);
                }
                i += n as u64;
            }
            let before = ideal_bytes(est.report());
            let per = writes.div_ceil(threads as u64);
            let mut per_thread = Vec::new();
            let mut next = blocks;
            for t in 0..threads {
                let mut rng = WyRand::new(data.seed ^ 0x0E5E_A7E5 ^ t as u64);
                let offs: Vec<u64> = (0..per).map(|_| rng.below(blocks) * BLOCK_BYTES as u64).collect();
                let d = generate(&model, next, per * BLOCK_BYTES as u64, 1);
                next += per;
                if opts.reference {
                    est.feed(&d);
                }
                per_thread.push((offs, d));
            }
            let report = est.finish();
            let ideal = ideal_bytes(&report).saturating_sub(before);
            let sample =
                per_thread.first().map(|p| p.1[..p.1.len().min(PRIMITIVE_SAMPLE_BYTES)].to_vec()).unwrap_or_default();
            let desc = format!(
                "{}; random 4 KiB overwrites of a {} MiB range (prefilled with the same data), {} writes, {threads} writers",
                data.describe(),
                range_bytes >> 20,
                per * threads as u64
            );
            debug_assert!(next < LANE_BLOCKS);
            (Source::Random { per_thread }, desc, *range_bytes, Some(model), report, ideal, sample)
        }
        Scenario::Ingest { paths } => {
            let mut files = Vec::new();
            let mut base = 0u64;
            let mut est = Estimator::new(est_opts.clone())?;
            let mut sample = Vec::new();
            for path in paths {
                let file = File::open(path).map_err(|e| format!("opening {}: {e}", path.display()))?;
                let len = file.metadata().map_err(|e| format!("stat {}: {e}", path.display()))?.len();
                if len == 0 {
                    return Err(format!("{} is empty", path.display()));
                }
                // Warms the page cache and computes the ideal in one pass.
                if opts.reference {
                    est.scan_path(path)?;
                }
                if sample.is_empty() {
                    sample = vec![0u8; (len as usize).min(PRIMITIVE_SAMPLE_BYTES) / BLOCK_BYTES * BLOCK_BYTES];
                    file.read_exact_at(&mut sample, 0).map_err(|e| format!("reading {}: {e}", path.display()))?;
                }
                files.push((file, base, len));
                base += len.div_ceil(BLOCK_BYTES as u64) * BLOCK_BYTES as u64;
            }
            let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
            let desc = format!(
                "{} file(s) ({} MiB): {}; each at the next 4 KiB-aligned offset, {} KiB sequential requests, {threads} writers (page cache warm)",
                paths.len(),
                base >> 20,
                names.join(", "),
                opts.request_bytes >> 10
            );
            let report = est.finish();
            let ideal = ideal_bytes(&report);
            (
                Source::Files { files, req: opts.request_bytes },
                desc,
                base.max(BLOCK_BYTES as u64),
                None,
                report,
                ideal,
                sample,
            )
        }
    };
    phase("data generated and estimated");
    let primitives = if opts.reference && sample.len() >= BLOCK_BYTES { Some(measure_cpu(&sample)) } else { None };
    let physical = logical + source.total_bytes() + PHYSICAL_SLACK_BYTES;

    let fmt = FormatOptions {
        compression: opts.compression,
        compression_level: opts.compression_level,
        rest_level: opts.rest_level,
        write_policy: opts.write_policy,
        index_memory_bytes: opts.index_memory_bytes,
        verify: opts.verify,
        ..FormatOptions::default()
    };
    let mut result = ScenarioResult {
        name: name.to_string(),
        description,
        target,
        primitives,
        engine: None,
        engine_error: None,
        no_reduction_volume: None,
        no_reduction_error: None,
        raw_file: None,
        stats: None,
        io: None,
        final_clean: None,
        final_recompress: None,
        background: None,
        estimate: Some(estimate),
        ideal_bytes: ideal,
        write_amp_logical: None,
        write_amp_ideal: None,
    };

    phase("primitives measured");
    let is_overwrite = matches!(scenario, Scenario::Overwrite { .. });
    let engine = (|| -> Result<(RunFigure, Stats, IoBreakdown), String> {
        let vol = Arc::new(fresh_volume(
            &vol_path,
            temp,
            logical,
            physical,
            &fmt,
            opts.io_mode,
            &opts.engine_open_options(),
        )?);
        phase("engine volume formatted");
        if let (true, Some(m)) = (is_overwrite, &model) {
            prefill(&vol, m, logical)?;
            phase("engine volume prefilled");
        }
        let before_stats = vol.stats();
        let before = &before_stats.io;
        // The cleaner runs beside the writers, as it does under `serve`.
        let cleaner = dedupvol_core::Cleaner::spawn(
            &vol,
            CLEANER_INTERVAL,
            CLEANER_TRIGGER_BYTES,
            dedupvol_core::CleanOptions::default(),
        );
        let (secs, flush) = timed_volume_writes(&vol, &source, threads)?;
        drop(cleaner);
        phase("engine timed phase done");
        let timed_end = vol.stats();
        let io = IoBreakdown::between(before, &timed_end.io);
        if is_overwrite {
            // What the cleaner reaches once it has caught up with the writers: one more
            // pass, untimed, reported beside the timed figures.
            let mut copts = dedupvol_core::CleanOptions::default();
            if let Some(v) = opts.final_clean_live_max {
                copts.live_max = v;
            }
            let passes = opts.final_clean_passes.max(1);
            let mut moved = 0;
            for _ in 0..passes {
                moved += vol.clean(&copts).map_err(|e| format!("cleaner: {e}"))?.bytes_moved;
                vol.flush().map_err(|e| format!("flush: {e}"))?;
            }
            // The ideal of what the volume holds now: its live content read back and
            // estimated (the estimate of the written stream counts overwritten data too).
            let mut live = Estimator::new(est_opts.clone())?;
            let mut buf = vec![0u8; 4 << 20];
            let mut at = 0u64;
            while at < logical {
                let n = (logical - at).min(buf.len() as u64) as usize;
                let chunk = buf.get_mut(..n).unwrap_or_default();
                vol.read(at, chunk).map_err(|e| format!("reading the volume back: {e}"))?;
                live.feed(chunk);
                at += n as u64;
            }
            result.final_clean = Some(FinalClean {
                reduction_before: timed_end.reduction_ratio,
                reduction_after: vol.stats().reduction_ratio,
                passes,
                bytes_moved: moved,
                live_estimate: live.finish().reduction_ratio,
            });
        }
        if opts.defer_compression_micros > 0 || fmt.effective_rest_level() != 0 {
            // Deferred compression, or a rest level: what the idle volume's recompression
            // reaches, untimed, reported beside the timed figures (passes until one finds
            // nothing to do).
            result.final_recompress = Some(settle_now(&vol)?);
        }
        let stats = vol.stats();
        if is_overwrite {
            let cleaner_timed =
                timed_end.counters.cleaner_bytes_moved.saturating_sub(before_stats.counters.cleaner_bytes_moved);
            result.background = Some(BackgroundWrites {
                client_bytes: io.data_write.saturating_sub(cleaner_timed),
                cleaner_timed_bytes: cleaner_timed,
                after_bytes: stats.io.data_write.bytes.saturating_sub(timed_end.io.data_write.bytes),
            });
        }
        if let Ok(v) = Arc::try_unwrap(vol) {
            v.close().map_err(|e| format!("closing the volume: {e}"))?;
        }
        Ok((RunFigure::new(source.total_bytes(), source.total_ops(), secs, flush), stats, io))
    })();
    remove(&vol_path);
    phase("engine volume closed and removed");
    match engine {
        Ok((fig, stats, io)) => {
            let written = io.written();
            result.write_amp_logical = Some(written as f64 / fig.bytes.max(1) as f64);
            result.write_amp_ideal = (ideal > 0).then(|| written as f64 / ideal as f64);
            result.engine = Some(fig);
            result.stats = Some(stats);
            result.io = Some(io);
        }
        Err(e) => result.engine_error = Some(e),
    }

    if opts.baselines {
        // No codec: so no codec level and no rest level either (a zstd run's would be refused).
        let base_fmt = FormatOptions {
            compression: Compression::None,
            compression_level: 0,
            rest_level: None,
            dedup: false,
            ..fmt.clone()
        };
        let base = (|| -> Result<RunFigure, String> {
            let vol = Arc::new(fresh_volume(
                &base_path,
                temp,
                logical,
                physical,
                &base_fmt,
                opts.io_mode,
                &opts.engine_open_options(),
            )?);
            if let (true, Some(m)) = (is_overwrite, &model) {
                prefill(&vol, m, logical)?;
            }
            let (secs, flush) = timed_volume_writes(&vol, &source, threads)?;
            if let Ok(v) = Arc::try_unwrap(vol) {
                v.close().map_err(|e| format!("closing the baseline volume: {e}"))?;
            }
            Ok(RunFigure::new(source.total_bytes(), source.total_ops(), secs, flush))
        })();
        remove(&base_path);
        phase("no-reduction volume done");
        match base {
            Ok(f) => result.no_reduction_volume = Some(f),
            Err(e) => result.no_reduction_error = Some(e),
        }
        result.raw_file = Some(timed_raw_writes(&raw_path, temp, logical, &source, threads, opts.io_mode)?);
        phase("raw file done");
    }
    Ok(result)
}

/// The first `PRIMITIVE_SAMPLE_BYTES` of a scenario's data (generated, or read from its
/// first file): what the primitives are measured on.
pub fn scenario_sample(scenario: &Scenario) -> Result<Vec<u8>, String> {
    match scenario {
        Scenario::Seq { data, .. } | Scenario::Overwrite { data, .. } => {
            let model = ContentModel::new(data.clone())?;
            Ok(generate(&model, 0, PRIMITIVE_SAMPLE_BYTES as u64, 1))
        }
        Scenario::Ingest { paths } => {
            let path = paths.first().ok_or("no input file")?;
            let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let mut buf = Vec::with_capacity(PRIMITIVE_SAMPLE_BYTES);
            std::io::Read::read_to_end(&mut std::io::Read::take(f, PRIMITIVE_SAMPLE_BYTES as u64), &mut buf)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            buf.truncate(buf.len() / BLOCK_BYTES * BLOCK_BYTES);
            Ok(buf)
        }
    }
}

/// Only the one-core CPU primitives on `PRIMITIVE_SAMPLE_BYTES` of `data` (no engine run).
pub fn primitives_only(name: &str, data: &DataSpec) -> Result<ScenarioResult, String> {
    let model = ContentModel::new(data.clone())?;
    let sample = generate(&model, 0, PRIMITIVE_SAMPLE_BYTES as u64, 1);
    Ok(ScenarioResult {
        name: name.to_string(),
        description: format!("{}; primitives only (no engine run)", data.describe()),
        target: None,
        primitives: Some(measure_cpu(&sample)),
        engine: None,
        engine_error: None,
        no_reduction_volume: None,
        no_reduction_error: None,
        raw_file: None,
        stats: None,
        io: None,
        final_clean: None,
        final_recompress: None,
        background: None,
        estimate: None,
        ideal_bytes: 0,
        write_amp_logical: None,
        write_amp_ideal: None,
    })
}

/// The whole benchmark output.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// UTC time of the run (RFC 3339).
    pub date: String,
    /// Host name, CPU model and core count, kernel.
    pub machine: String,
    /// The command line.
    pub command: String,
    /// Settings.
    pub options: BenchOptions,
    /// Disk sequential write speed of the benchmark directory's filesystem.
    pub disk_seq_write: Option<DiskFigure>,
    /// Scenarios in order.
    pub scenarios: Vec<ScenarioResult>,
}

/// Measures the disk under `dir` (write + fdatasync of a 512 MiB temp file).
pub fn disk_seq(dir: &Path) -> Result<DiskFigure, String> {
    measure_disk_seq_write(dir, DISK_SEQ_BYTES).map_err(|e| format!("disk write test in {}: {e}", dir.display()))
}

/// Host, CPU and kernel, in one line.
pub fn machine_description() -> String {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mem_gib = read("/proc/meminfo")
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|k| k.parse::<u64>().ok())
        .map(|k| k >> 20)
        .unwrap_or(0);
    let kernel = read("/proc/sys/kernel/osrelease").trim().to_string();
    let host = read("/proc/sys/kernel/hostname").trim().to_string();
    format!("{host}: {cpu}, {cores} cores, {mem_gib} GiB RAM, Linux {kernel}")
}

/// UTC now as RFC 3339, without a date library.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}
