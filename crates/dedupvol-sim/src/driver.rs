//! The seeded workload driver and the checker loop: format, run a mixed workload from
//! several logical writers, crash at random I/O calls (also inside recovery), recover,
//! verify every touched block against the [`Model`], close cleanly now and then and
//! require the volume audit to be clean.
//!
//! Invariants:
//! - Everything random comes from the seed: the run configuration, the workload RNG and
//!   the machine's fault RNG are each derived from it, and the driver is single-threaded,
//!   so one seed replays one run exactly (the machine's trace hash proves it).
//! - An engine error is accepted only when the machine can account for it (a crash, a
//!   transient fault, a read of a block hit by a persistent fault, or a `Failed` volume
//!   after such a fault); anything else fails the run.
//! - Wrong data is never accepted, whatever faults were injected.
//! - Every loop is bounded: ops per run, open attempts, read retries.

use crate::content::{self, Class, BLOCK};
use crate::disk::{Evidence, FaultConfig, FaultCounts, SimDisk, SimMachine};
use crate::engine::{short, Coverage, SimEngine};
use crate::model::{Model, Version, ZERO_VERSION};
use dedupvol_core::{
    Compression, DedupVerify, Error, FormatOptions, IndexMode, OpenOptions, Problem, Storage, WritePolicy,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;

const B: u64 = BLOCK as u64;
/// Attempts to open a volume after a crash before the run fails.
pub const OPEN_ATTEMPTS_MAX: u32 = 24;
/// Retries of a read that failed on a transient fault.
pub const READ_RETRIES_MAX: u32 = 24;
/// Blocks per write request, at most.
pub const WRITE_BLOCKS_MAX: u64 = 8;
/// Blocks of one hot-run request (`SimOptions::compressible_duplicates`): above the
/// reference cap those runs open volumes with (`HOT_RUN_CAP`).
const HOT_RUN_BLOCKS: u64 = 320;
/// The reference cap of volumes opened for hot-block runs.
const HOT_RUN_CAP: u16 = 254;
/// Rewrites of one block by `SimOptions::heal_rewrites` before its read-back must succeed.
const HEAL_ATTEMPTS_MAX: u32 = 4;
/// Percent of operations that are hot runs when they are on.
const HOT_RUN_PCT: u32 = 3;
/// Blocks per discard / write-zeroes request, at most.
pub const ZERO_BLOCKS_MAX: u64 = 16;
/// Recent operations kept for a failure report.
pub const OP_LOG_MAX: usize = 48;
/// Percent of seeds with write-once journaling, by default.
pub const WOJ_PCT_DEFAULT: u32 = 40;
/// Journal blocks remembered for later checkpoint writes (WOJ seeds).
const WOJ_RECENT_MAX: usize = 64;
/// Percent of operations that are journal or checkpoint writes (WOJ seeds).
const WOJ_OP_PCT: u32 = 30;
/// Logical writers, at most.
pub const WRITERS_MAX: usize = 4;
/// Share of operations (percent) preceded by a step of the engine's background work (the
/// index rebuild after an open), while there is some.
const REBUILD_STEP_PCT: u32 = 20;
/// Share of those steps (percent) with a crash armed at their first I/O call.
const REBUILD_CRASH_PCT: u32 = 10;
/// Percent of operations followed by a cleaner pass (`cleaner_rng`), and of those passes
/// with a crash armed inside them (in their reads, or in the writes they lead to).
const CLEAN_STEP_PCT: u32 = 3;
/// See `CLEAN_STEP_PCT`.
const CLEAN_CRASH_PCT: u32 = 25;
/// Percent of operations followed by a combined write (`SimOptions::combined_writes`),
/// and the largest request in one, in blocks.
const COMBINED_STEP_PCT: u32 = 20;
const COMBINED_REQUEST_BLOCKS_MAX: u64 = 8;
/// Percent of operations followed by a recompression pass (`SimOptions::recompress`,
/// `recompress_rng`), and of those passes with a crash armed inside them.
const RECOMPRESS_STEP_PCT: u32 = 5;
/// See `RECOMPRESS_STEP_PCT`.
const RECOMPRESS_CRASH_PCT: u32 = 25;
/// Per mille of steps (zstd volumes formatted without a rest level, until they have 6)
/// that give the volume a rest level (`op_tune`, its own stream `tune_rng`).
const TUNE_STEP_PERMILLE: u32 = 4;
/// Per mille of steps that give the volume another extent cap (`op_extent_cap`, its own
/// stream `extent_rng`), a crash armed inside a quarter of them (`RECOMPRESS_CRASH_PCT`).
const EXTENT_CAP_STEP_PERMILLE: u32 = 3;
/// Largest allowed-set size before the driver forces a flush (keeps the model bounded).
pub const ALLOWED_SET_FLUSH_AT: usize = 24;
/// Percent of crash recoveries followed at once by a clean close and an audit.
pub const AUDIT_AFTER_RECOVERY_PCT: u32 = 20;
/// Data devices this small get a writer that fills them with unique data.
pub const SPACE_PRESSURE_DATA_BYTES: u64 = 8 << 20;
/// Percent of writes that are sector-aligned but not block-aligned.
pub const PARTIAL_WRITE_PCT: u32 = 15;
const SECTORS_PER_BLOCK: u64 = 8;
const SECTOR_BYTES: u64 = 512;
/// Untouched blocks sampled in each verification (they must read as zeros).
pub const UNTOUCHED_SAMPLES: u64 = 16;

/// What the user chose for a run (everything else comes from the seed).
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Fault kinds allowed (rates are drawn per seed).
    pub faults: FaultKinds,
    /// Workload operations per run.
    pub ops: u64,
    /// Print progress and the recent-op log.
    pub verbose: bool,
    /// Run the engine's in-memory audit after every operation (slow; for diagnosis; its
    /// reads bypass the simulated faults so the run is the same as without it).
    pub audit_every_op: bool,
    /// Issue sector-aligned partial writes (the draw is made either way, so switching this
    /// off changes nothing else in the run).
    pub partial_writes: bool,
    /// Let the engine write full data batches from its background thread, as in
    /// production. The device calls of that thread interleave with the driver's by
    /// scheduling, so such a run is not reproducible call for call; off by default.
    pub background_writes: bool,
    /// Duplicate-pool contents compress (else they are random and stored raw), so hot
    /// blocks share packed fragments and reach the reference cap while still open.
    pub compressible_duplicates: bool,
    /// After a read detects corruption, rewrite each affected block with the content the
    /// contract says it holds (as a file system or an operator repairs a bad block) with
    /// faults paused, and require it to read back: the engine must store a fresh copy, not
    /// share the damaged one.
    pub heal_rewrites: bool,
    /// Percent of seeds that run with write-once journaling on a random journal range
    /// (the workload then writes journal blocks and, later, their checkpoint copies).
    pub woj_pct: u32,
    /// Every session of a compressing volume stores with the other codec
    /// (`OpenOptions::store_codec`), and recompression passes, some with a crash armed
    /// inside, bring that data to the volume's codec between operations.
    pub recompress: bool,
    /// Some writes are several small requests written as one batch (`Volume::write_many`,
    /// the batcher's path), with crashes anywhere in it as in any write.
    pub combined_writes: bool,
    /// Volumes are formatted with a random extent cap (none, 1, 2, 4 or 8 blocks), and
    /// caps change between operations, some with a crash armed inside (off by default, so
    /// that a seed replays the layout it always had).
    pub extent_caps: bool,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            faults: FaultKinds::all(),
            ops: 400,
            verbose: false,
            audit_every_op: false,
            partial_writes: true,
            background_writes: false,
            compressible_duplicates: false,
            heal_rewrites: false,
            woj_pct: WOJ_PCT_DEFAULT,
            recompress: false,
            combined_writes: false,
            extent_caps: false,
        }
    }
}

/// Switchable fault kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultKinds {
    /// Crashes at random I/O calls (else only clean closes).
    pub crash: bool,
    /// Unsynced writes lost / reordered at power failure.
    pub cache_loss: bool,
    /// Torn unsynced writes at power failure.
    pub torn: bool,
    /// Early out-of-order destage.
    pub destage: bool,
    /// Lost data writes.
    pub lost: bool,
    /// Misdirected data writes.
    pub misdirect: bool,
    /// Transient read errors.
    pub read_error: bool,
    /// Persistent bit flips in data.
    pub bitflip: bool,
    /// Bit flips in transit.
    pub read_flip: bool,
    /// One of the two superblock copies (never the newer) corrupted while powered off.
    pub sb_copy: bool,
    /// Transient write and sync errors.
    pub write_error: bool,
}

/// Names accepted by `--faults`.
pub const FAULT_NAMES: &[&str] = &[
    "crash",
    "cache-loss",
    "torn",
    "destage",
    "lost",
    "misdirect",
    "read-error",
    "bitflip",
    "read-flip",
    "sb-copy",
    "write-error",
];

impl FaultKinds {
    /// Every kind.
    pub fn all() -> Self {
        FaultKinds {
            crash: true,
            cache_loss: true,
            torn: true,
            destage: true,
            lost: true,
            misdirect: true,
            read_error: true,
            bitflip: true,
            read_flip: true,
            sb_copy: true,
            write_error: true,
        }
    }
    /// No kind.
    pub fn none() -> Self {
        FaultKinds {
            crash: false,
            cache_loss: false,
            torn: false,
            destage: false,
            lost: false,
            misdirect: false,
            read_error: false,
            bitflip: false,
            read_flip: false,
            sb_copy: false,
            write_error: false,
        }
    }
    /// Parses a comma list of `FAULT_NAMES`, or `all` / `none`.
    pub fn parse(s: &str) -> Result<Self, String> {
        if s == "all" {
            return Ok(Self::all());
        }
        let mut k = Self::none();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty() && *n != "none") {
            match name {
                "crash" => k.crash = true,
                "cache-loss" => k.cache_loss = true,
                "torn" => k.torn = true,
                "destage" => k.destage = true,
                "lost" => k.lost = true,
                "misdirect" => k.misdirect = true,
                "read-error" => k.read_error = true,
                "bitflip" => k.bitflip = true,
                "read-flip" => k.read_flip = true,
                "sb-copy" => k.sb_copy = true,
                "write-error" => k.write_error = true,
                _ => return Err(format!("unknown fault kind {name:?}; known: all, none, {}", FAULT_NAMES.join(", "))),
            }
        }
        Ok(k)
    }
    /// The `--faults` argument that selects these kinds.
    pub fn to_arg(&self) -> String {
        if *self == Self::all() {
            return "all".into();
        }
        let flags = [
            self.crash,
            self.cache_loss,
            self.torn,
            self.destage,
            self.lost,
            self.misdirect,
            self.read_error,
            self.bitflip,
            self.read_flip,
            self.sb_copy,
            self.write_error,
        ];
        let v: Vec<&str> = FAULT_NAMES.iter().zip(flags).filter(|(_, f)| *f).map(|(n, _)| *n).collect();
        if v.is_empty() {
            "none".into()
        } else {
            v.join(",")
        }
    }
}

/// Everything a seed decides about a run.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The seed.
    pub seed: u64,
    /// Separate metadata device.
    pub meta_dev: bool,
    /// Data device bytes.
    pub data_bytes: u64,
    /// Metadata device bytes (when `meta_dev`).
    pub meta_bytes: u64,
    /// Format options.
    pub format: FormatOptions,
    /// Open options.
    pub open: OpenOptions,
    /// Device fault configuration.
    pub faults: FaultConfig,
    /// Crash probability per workload op, ppm (0: no crashes).
    pub crash_ppm: u32,
    /// Probability that a crash is armed during a recovery, percent.
    pub crash_in_recovery_pct: u32,
    /// Clean close + audit probability per op, ppm.
    pub close_ppm: u32,
    /// Probability that a clean close is interrupted by a crash, percent.
    pub crash_in_close_pct: u32,
    /// Probability that a recovery is first done read-only and cross-checked, percent.
    pub read_only_first_pct: u32,
    /// Probability that a power cycle corrupts one superblock copy per device, percent.
    pub sb_copy_pct: u32,
    /// Workload operations.
    pub ops: u64,
    /// Logical writers.
    pub writers: usize,
    /// Write-once journaling: the journal's logical blocks (first, count), given to the
    /// engine as a range; None: WOJ off.
    pub woj_journal: Option<(u64, u64)>,
}

fn pick<T: Copy>(r: &mut ChaCha8Rng, v: &[T]) -> T {
    v[r.gen_range(0..v.len())]
}

impl RunConfig {
    /// Derives the configuration of `seed`.
    pub fn for_seed(seed: u64, opts: &SimOptions) -> Self {
        let mut r = ChaCha8Rng::seed_from_u64(seed ^ 0xC0F1_6000);
        let k = opts.faults;
        let meta_dev = r.gen_bool(0.4);
        // 8 MiB devices put the data region under space pressure (NoSpace, slab reuse).
        let data_bytes = pick(&mut r, &[8u64, 16, 24, 32]) << 20;
        let mut logical_blocks = pick(&mut r, &[512u64, 1024, 1536, 2048]);
        if data_bytes <= SPACE_PRESSURE_DATA_BYTES {
            // Thin provisioning overcommitted: more logical than physical space.
            logical_blocks = data_bytes / B;
        }
        let write_policy = if r.gen_bool(0.3) { WritePolicy::Sync } else { WritePolicy::Async };
        let format = FormatOptions {
            logical_size_bytes: logical_blocks * B,
            compression: match r.gen_range(0..10) {
                0..=3 => Compression::Zstd,
                4..=6 => Compression::Lz4,
                _ => Compression::None,
            },
            compression_level: 0,
            dedup: r.gen_bool(0.9),
            index_memory_bytes: pick(&mut r, &[64u64, 128, 256]) << 10,
            write_policy,
            slab_size_bytes: 1 << 20,
            verify: if r.gen_bool(0.5) { DedupVerify::Bytes } else { DedupVerify::Hash },
            journal_size_bytes: Some(pick(&mut r, &[256u64, 256, 512, 1024]) << 10),
            dedup_window_bytes: None,
            index_mode: if r.gen_bool(0.3) { IndexMode::Sparse } else { IndexMode::Dense },
            ..FormatOptions::default()
        };
        // Recompression at rest, from its own stream: zstd volumes get none, the level they
        // write with (fragments are only marked settled) or a stronger one.
        let mut format = format;
        format.rest_level = Some(if format.compression == Compression::Zstd {
            pick(&mut ChaCha8Rng::seed_from_u64(seed ^ 0x4E57_0000), &[0i8, 1, 6])
        } else {
            0
        });
        // The extent cap, from its own stream: none (the largest), or a smaller one.
        if opts.extent_caps {
            format.extent_blocks_max = pick(
                &mut ChaCha8Rng::seed_from_u64(seed ^ 0x4558_7E47),
                &[None, None, Some(1), Some(2), Some(4), Some(8)],
            );
        }
        let open = OpenOptions {
            read_only: false,
            write_policy: if r.gen_bool(0.15) {
                Some(if write_policy == WritePolicy::Sync { WritePolicy::Async } else { WritePolicy::Sync })
            } else {
                None
            },
            block_map_cache_bytes: pick(&mut r, &[16u64, 64, 64, 256]) << 10,
            content_cache_bytes: pick(&mut r, &[64u64, 256, 1024]) << 10,
            background_writes: opts.background_writes,
            // Hot-block runs reach a cap this low within a seed's few hundred operations.
            refcount_cap: if opts.compressible_duplicates { HOT_RUN_CAP } else { dedupvol_core::format::REFCOUNT_MAX },
            // Drawn from its own stream, so the seeds' other choices stay as they were.
            cache_writes: pick(&mut ChaCha8Rng::seed_from_u64(seed ^ 0xCAC4_E000), &[None, Some(true), Some(false)]),
            // The driver runs the index rebuild's steps between operations (`rebuild_rng`),
            // so they interleave with writes and crashes reproducibly.
            index_rebuild: dedupvol_core::IndexRebuild::Manual,
            // Small enough that a settling pass of a seed's few MiB trains the volume's
            // dictionary (installing it is a superblock change a crash may cut).
            dictionary_train_min_bytes: 128 << 10,
            ..OpenOptions::default()
        };
        // Write-once journaling, from its own stream so the seeds' other choices stay as
        // they were: a random journal range, and for half of those seeds a weak hash cut to
        // 4 bits, so that nearly every lookup collides and only the byte comparison stands
        // between a collision and a wrong share.
        let mut wr = ChaCha8Rng::seed_from_u64(seed ^ 0x3001_0000);
        let woj_journal = wr.gen_bool(opts.woj_pct as f64 / 100.0).then(|| {
            let len = wr.gen_range(8..=(logical_blocks / 4).max(8));
            (wr.gen_range(0..=logical_blocks - len), len)
        });
        let mut open = open;
        // The write pipeline's schedules, from their own stream: the unique-chunk predictor
        // off for a quarter of the seeds, and deferred compression (a fixed per-chunk cost,
        // so the same chunks are deferred every run) on for a third, with budgets from
        // "almost everything deferred" to "some".
        let mut pr = ChaCha8Rng::seed_from_u64(seed ^ 0xDEFE_0000);
        open.unique_predictor = pr.gen_bool(0.75);
        if pr.gen_bool(1.0 / 3.0) {
            open.defer_compression_micros = pick(&mut pr, &[1u64, 20, 100]);
            open.defer_fixed_cost_ns = Some(10_000);
        }
        // The offload backend, from its own stream: a quarter of the seeds are given one
        // (the CPU's, whose results the engine then checks, and every dedup candidate of
        // the session is verified by its bytes).
        if ChaCha8Rng::seed_from_u64(seed ^ 0x0FF1_0AD0).gen_bool(0.25) {
            open.offload = Some(Arc::new(dedupvol_core::CpuOffload::new()));
        }
        if opts.recompress {
            open.store_codec = match format.compression {
                Compression::Zstd => Some((Compression::Lz4, 0)),
                Compression::Lz4 => Some((Compression::Zstd, 0)),
                Compression::None => None,
            };
        }
        if let Some((start, len)) = woj_journal {
            open.woj = dedupvol_core::WojMode::Range { offset: start * B, len: len * B };
            if wr.gen_bool(0.5) {
                open.woj_weak_hash_mask = 0xF;
            }
        }
        let mut f = FaultConfig::none();
        f.crash_loss = k.cache_loss;
        f.torn_writes = k.torn;
        f.destage = r.gen_bool(0.7) && k.destage;
        f.destage_ppm = pick(&mut r, &[5_000, 50_000]);
        // Some seeds get no persistent data faults, so that every error there is suspect.
        let persistent = r.gen_bool(0.6);
        f.lost_writes = r.gen_bool(0.5) && k.lost && persistent;
        f.lost_write_ppm = pick(&mut r, &[300, 2_000]);
        f.misdirected_writes = r.gen_bool(0.5) && k.misdirect && persistent;
        f.misdirect_ppm = pick(&mut r, &[300, 2_000]);
        f.bit_flips = r.gen_bool(0.5) && k.bitflip && persistent;
        f.bit_flip_ppm = pick(&mut r, &[500, 3_000]);
        f.read_errors = r.gen_bool(0.5) && k.read_error;
        f.read_error_ppm = pick(&mut r, &[20, 300, 3_000]);
        f.read_flips = r.gen_bool(0.4) && k.read_flip;
        f.read_flip_ppm = pick(&mut r, &[500, 3_000]);
        f.write_errors = r.gen_bool(0.3) && k.write_error;
        f.write_error_ppm = pick(&mut r, &[1_000, 10_000]);
        RunConfig {
            seed,
            meta_dev,
            data_bytes,
            meta_bytes: 4 << 20,
            format,
            open,
            faults: f,
            crash_ppm: pick(&mut r, &[4_000, 10_000, 20_000]) * u32::from(k.crash),
            crash_in_recovery_pct: pick(&mut r, &[0, 20, 50]) * u32::from(k.crash),
            close_ppm: pick(&mut r, &[2_000, 5_000]),
            crash_in_close_pct: pick(&mut r, &[0, 25]) * u32::from(k.crash),
            read_only_first_pct: pick(&mut r, &[0, 30]),
            sb_copy_pct: pick(&mut r, &[0, 30]) * u32::from(k.sb_copy),
            ops: opts.ops,
            writers: r.gen_range(1..=WRITERS_MAX),
            woj_journal,
        }
    }

    /// One line describing the configuration.
    pub fn summary(&self) -> String {
        format!(
            "{} data={}MiB meta={} logical={}KiB policy={:?}/{:?} comp={:?} rest={} dedup={} verify={:?} journal={}KiB bm_cache={}KiB writers={} crash_ppm={} woj={:?} woj_mask={:#x} faults={:?}",
            if self.meta_dev { "two-device" } else { "one-device" },
            self.data_bytes >> 20,
            if self.meta_dev { format!("{}MiB", self.meta_bytes >> 20) } else { "shared".into() },
            self.format.logical_size_bytes >> 10,
            self.format.write_policy,
            self.open.write_policy,
            self.format.compression,
            self.format.effective_rest_level(),
            self.format.dedup,
            self.format.verify,
            self.format.journal_size_bytes.unwrap_or(0) >> 10,
            self.open.block_map_cache_bytes >> 10,
            self.writers,
            self.crash_ppm,
            self.woj_journal,
            self.open.woj_weak_hash_mask,
            self.faults
        )
    }
}

/// Figures of one run.
#[derive(Debug, Clone, Default)]
pub struct RunStats {
    /// Workload operations issued.
    pub ops: u64,
    /// Write requests (incl. FUA).
    pub writes: u64,
    /// Read requests.
    pub reads: u64,
    /// Flushes.
    pub flushes: u64,
    /// Discards and write-zeroes.
    pub zeroings: u64,
    /// Crashes (workload and recovery).
    pub crashes: u64,
    /// Crashes during recovery.
    pub crashes_in_recovery: u64,
    /// Successful recoveries (opens), each followed by a full verification.
    pub recoveries: u64,
    /// Clean closes followed by a clean audit.
    pub clean_checks: u64,
    /// Blocks verified after recoveries.
    pub blocks_verified: u64,
    /// Reads that failed because the engine detected an injected corruption.
    pub corruption_detected: u64,
    /// Requests refused with no space left.
    pub no_space: u64,
    /// Restarts after an engine error caused by a fault.
    pub restarts: u64,
    /// Blocks rewritten with their own content after a detected corruption, and read back.
    pub heals: u64,
    /// Audit problems "used twice" accepted on a block hit by a persistent fault.
    pub stale_dedup_after_fault: u64,
    /// Read-only recoveries cross-checked against the following read-write recovery.
    pub read_only_recoveries: u64,
    /// Crashes during a clean close.
    pub crashes_in_close: u64,
    /// Steps of the fingerprint index's rebuild run between operations.
    pub rebuild_steps: u64,
    /// Crashes during such a step.
    pub crashes_in_rebuild: u64,
    /// Cleaner passes run between operations.
    pub cleaner_passes: u64,
    /// Crashes armed inside a cleaner pass that struck.
    pub crashes_in_clean: u64,
    /// Recompression passes run between operations.
    /// Batches of several requests written with `write_many`.
    pub combined_writes: u64,
    pub recompress_passes: u64,
    /// Fragments those passes replaced.
    pub fragments_recompressed: u64,
    /// Crashes armed inside a recompression pass that struck.
    pub crashes_in_recompress: u64,
    /// Rest levels given to open volumes (`set_rest_level` acknowledged).
    pub rest_level_changes: u64,
    /// Extent caps given to open volumes (`set_extent_blocks_max` acknowledged).
    pub extent_cap_changes: u64,
    /// Recompression passes that installed the volume's dictionary (acknowledged).
    pub dictionaries_installed: u64,
    /// Crashes armed inside a rest level or extent cap change that struck.
    pub crashes_in_tune: u64,
    /// Faults injected by kind.
    pub faults: FaultCounts,
    /// Engine counters summed over every volume instance that was closed or crashed.
    pub coverage: Coverage,
    /// I/O calls made by the engine.
    pub io_calls: u64,
    /// Hash of every I/O call's kind, device, offset and length (reproducibility).
    pub trace: u64,
    /// Hash of every I/O call and the bytes written.
    pub content_trace: u64,
}

impl RunStats {
    /// Adds `o` into `self`.
    pub fn add(&mut self, o: &RunStats) {
        self.ops += o.ops;
        self.writes += o.writes;
        self.reads += o.reads;
        self.flushes += o.flushes;
        self.zeroings += o.zeroings;
        self.crashes += o.crashes;
        self.crashes_in_recovery += o.crashes_in_recovery;
        self.recoveries += o.recoveries;
        self.clean_checks += o.clean_checks;
        self.blocks_verified += o.blocks_verified;
        self.corruption_detected += o.corruption_detected;
        self.no_space += o.no_space;
        self.restarts += o.restarts;
        self.read_only_recoveries += o.read_only_recoveries;
        self.stale_dedup_after_fault += o.stale_dedup_after_fault;
        self.heals += o.heals;
        self.crashes_in_close += o.crashes_in_close;
        self.rebuild_steps += o.rebuild_steps;
        self.crashes_in_rebuild += o.crashes_in_rebuild;
        self.cleaner_passes += o.cleaner_passes;
        self.crashes_in_clean += o.crashes_in_clean;
        self.recompress_passes += o.recompress_passes;
        self.combined_writes += o.combined_writes;
        self.fragments_recompressed += o.fragments_recompressed;
        self.crashes_in_recompress += o.crashes_in_recompress;
        self.rest_level_changes += o.rest_level_changes;
        self.extent_cap_changes += o.extent_cap_changes;
        self.dictionaries_installed += o.dictionaries_installed;
        self.crashes_in_tune += o.crashes_in_tune;
        self.faults.add(&o.faults);
        self.coverage.add(&o.coverage);
        self.io_calls += o.io_calls;
    }
}

/// A failed run: the seed, what went wrong and how to replay it.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The seed.
    pub seed: u64,
    /// What the checker saw.
    pub message: String,
    /// The one-line replay command.
    pub replay: String,
    /// Recent operations, oldest first.
    pub recent_ops: Vec<String>,
    /// The run configuration.
    pub config: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "SEED {} FAILED: {}", self.seed, self.message)?;
        writeln!(f, "  config: {}", self.config)?;
        writeln!(f, "  recent ops (oldest first):")?;
        for op in &self.recent_ops {
            writeln!(f, "    {op}")?;
        }
        write!(f, "  replay: {}", self.replay)
    }
}

/// The replay command for `seed` under `opts`.
pub fn replay_command(seed: u64, opts: &SimOptions, engine: &str) -> String {
    let mut s = format!("cargo run --release -p dedupvol-sim -- --seed {seed}");
    if opts.faults != FaultKinds::all() {
        s += &format!(" --faults {}", opts.faults.to_arg());
    }
    if opts.ops != SimOptions::default().ops {
        s += &format!(" --ops {}", opts.ops);
    }
    if !opts.partial_writes {
        s += " --no-partial-writes";
    }
    if opts.background_writes {
        s += " --background-writes";
    }
    if opts.compressible_duplicates {
        s += " --compressible-duplicates";
    }
    if opts.heal_rewrites {
        s += " --heal-rewrites";
    }
    if opts.woj_pct != WOJ_PCT_DEFAULT {
        s += &format!(" --woj-pct {}", opts.woj_pct);
    }
    if engine != "dedupvol" {
        s += &format!(" --engine {engine}");
    }
    s
}

/// Names the content of each sector of a block read back, for failure messages.
fn describe_sectors(buf: &[u8]) -> String {
    let names: Vec<String> = buf
        .chunks(content::SECTOR)
        .enumerate()
        .map(|(i, s)| {
            if s.iter().all(|&b| b == 0) {
                "0".to_string()
            } else if i == 0 {
                let mut id = [0u8; 8];
                id.copy_from_slice(&s[..8]);
                format!("{:x}", u64::from_le_bytes(id))
            } else {
                format!("?{:08x}", crc32c::crc32c(s))
            }
        })
        .collect();
    format!("{} (sectors: {})", content::describe(buf), names.join(" "))
}

#[derive(Clone, Copy)]
enum Pattern {
    Sequential,
    Random,
    Hot,
}

struct Writer {
    start: u64,
    len: u64,
    cursor: u64,
    pattern: Pattern,
    /// Percent weights: zero, duplicate, compressible (rest unique).
    mix: [u32; 3],
    /// Distinct duplicate contents this writer draws from.
    dup_pool: u64,
}

/// What explains an engine error.
#[derive(Debug, PartialEq, Eq)]
enum Cause {
    Crash,
    Transient,
    Corruption,
    FaultEarlier,
    NoSpace,
    Unexplained,
}

struct Run<'a, E: SimEngine> {
    cfg: RunConfig,
    opts: &'a SimOptions,
    machine: Arc<SimMachine>,
    data: Arc<SimDisk>,
    meta: Option<Arc<SimDisk>>,
    rng: ChaCha8Rng,
    /// Draws when to run a step of the engine's background work (its own stream, so the
    /// workload's draws stay as they were).
    rebuild_rng: ChaCha8Rng,
    /// Draws of the cleaner passes, apart from `rng` so seeds keep their operations.
    cleaner_rng: ChaCha8Rng,
    /// Draws of the recompression passes (`SimOptions::recompress` only).
    recompress_rng: ChaCha8Rng,
    /// Draws of rest levels given to a zstd volume formatted without one (`op_tune`).
    tune_rng: ChaCha8Rng,
    /// The rest level the volume has durably (the format's, then each acknowledged
    /// `set_rest_level`'s).
    rest_now: i8,
    /// A rest level whose change failed or crashed: a reopen finds it or `rest_now`.
    rest_maybe: Option<i8>,
    /// Draws of extent cap changes (`op_extent_cap`).
    extent_rng: ChaCha8Rng,
    /// The extent cap the volume has durably (the format's, then each acknowledged
    /// `set_extent_blocks_max`'s).
    extent_now: u8,
    /// An extent cap whose change failed or crashed: a reopen finds it or `extent_now`.
    extent_maybe: Option<u8>,
    model: Model,
    vol: Option<E>,
    stats: RunStats,
    ev_open: Evidence,
    writers: Vec<Writer>,
    next_id: u64,
    log: VecDeque<String>,
    logical_blocks: u64,
    sync_policy: bool,
    data_region_start_block: u64,
    /// I/O calls the last successful open made: crash points in recovery are drawn below it.
    open_io_calls: u64,
    /// Contents a read-only open of the same media saw; the next read-write recovery
    /// must show exactly these (recovery is a function of the media).
    read_only_seen: std::collections::BTreeMap<u64, Version>,
    /// WOJ seeds: the next journal block to write (relative), and the contents written to
    /// the journal lately, which checkpoint writes copy to home locations.
    woj_cursor: u64,
    woj_recent: VecDeque<u64>,
}

/// Runs one seed against engine `E`.
pub fn run_seed<E: SimEngine>(seed: u64, opts: &SimOptions) -> Result<RunStats, Failure> {
    let cfg = RunConfig::for_seed(seed, opts);
    let machine = SimMachine::new(seed, cfg.faults.clone());
    let data = machine.add_disk("sim-data", cfg.data_bytes);
    let meta = cfg.meta_dev.then(|| machine.add_disk("sim-meta", cfg.meta_bytes));
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x00D0_1A0D);
    let logical_blocks = cfg.format.logical_size_bytes / B;
    let mut writers: Vec<Writer> = (0..cfg.writers)
        .map(|_| {
            let len = rng.gen_range(logical_blocks / 8..=logical_blocks);
            let start = rng.gen_range(0..=logical_blocks - len);
            let pattern = pick(&mut rng, &[Pattern::Sequential, Pattern::Random, Pattern::Hot]);
            // Mixes: balanced, duplicate-heavy, compressible-heavy, zero-heavy, unique-heavy
            // (space pressure), and one duplicate block over and over (refcount cap).
            let mix = pick(
                &mut rng,
                &[[10, 40, 30], [5, 70, 15], [10, 10, 60], [30, 20, 20], [5, 15, 20], [0, 0, 10], [0, 100, 0]],
            );
            let dup_pool = if mix == [0, 100, 0] { 2 } else { content::DUPLICATE_POOL_SIZE };
            Writer { start, len, cursor: 0, pattern, mix, dup_pool }
        })
        .collect();
    if cfg.data_bytes <= SPACE_PRESSURE_DATA_BYTES {
        // A small device gets a streaming writer of unique data over the whole volume, so
        // the data region fills up (NoSpace, reuse of freed blocks).
        writers.push(Writer {
            start: 0,
            len: logical_blocks,
            cursor: 0,
            pattern: Pattern::Sequential,
            mix: [0, 0, 0],
            dup_pool: 1,
        });
    }
    let sync_policy = cfg.open.write_policy.unwrap_or(cfg.format.write_policy) == WritePolicy::Sync;
    let mut run = Run::<E> {
        opts,
        machine,
        data,
        meta,
        rng,
        rebuild_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x1DE8_B11D),
        cleaner_rng: ChaCha8Rng::seed_from_u64(seed ^ 0xC1EA_4E12),
        recompress_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x4EC0_3955),
        tune_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x7E57_1E7E),
        rest_now: cfg.format.effective_rest_level(),
        rest_maybe: None,
        extent_rng: ChaCha8Rng::seed_from_u64(seed ^ 0xE47E_2CA9),
        extent_now: cfg.format.effective_extent_blocks_max(),
        extent_maybe: None,
        model: Model::new(),
        vol: None,
        stats: RunStats::default(),
        ev_open: Evidence::default(),
        writers,
        next_id: 1,
        log: VecDeque::new(),
        logical_blocks,
        sync_policy,
        data_region_start_block: 0,
        open_io_calls: 64,
        read_only_seen: std::collections::BTreeMap::new(),
        woj_cursor: 0,
        woj_recent: VecDeque::new(),
        cfg,
    };
    let r = run.run();
    run.stats.faults = run.machine.counts();
    run.stats.io_calls = run.machine.io_calls();
    run.stats.trace = run.machine.trace_hash();
    run.stats.content_trace = run.machine.content_trace_hash();
    match r {
        Ok(()) => Ok(run.stats),
        Err(message) => Err(Failure {
            seed,
            message,
            replay: replay_command(seed, opts, E::NAME),
            recent_ops: run.log.iter().cloned().collect(),
            config: run.cfg.summary(),
        }),
    }
}

impl<E: SimEngine> Run<'_, E> {
    fn data_dyn(&self) -> Arc<dyn Storage> {
        self.data.clone()
    }

    fn meta_dyn(&self) -> Option<Arc<dyn Storage>> {
        self.meta.clone().map(|m| m as Arc<dyn Storage>)
    }

    fn note(&mut self, s: String) {
        if self.opts.verbose {
            eprintln!("  [{}] {s}", self.cfg.seed);
        }
        if self.log.len() == OP_LOG_MAX {
            self.log.pop_front();
        }
        self.log.push_back(s);
    }

    fn cause(&self, e: &Error, before: &Evidence) -> Cause {
        let now = self.machine.evidence();
        if self.machine.is_crashed() || now.crashed_calls > before.crashed_calls {
            Cause::Crash
        } else if now.bad_reads > before.bad_reads {
            Cause::Corruption
        } else if now.transient > before.transient {
            Cause::Transient
        } else if matches!(e, Error::NoSpace(_)) {
            Cause::NoSpace
        } else if matches!(e, Error::Failed(_)) && now.any_since(&self.ev_open) {
            Cause::FaultEarlier
        } else {
            Cause::Unexplained
        }
    }

    fn run(&mut self) -> Result<(), String> {
        let (data, meta) = (self.data_dyn(), self.meta_dyn());
        E::format(data.clone(), meta.clone(), &self.cfg.format).map_err(|e| format!("format failed: {}", short(&e)))?;
        if let Some(region) = E::data_region(&*data, meta.is_some()) {
            let region = region.start..region.end.min(self.cfg.data_bytes);
            self.data_region_start_block = region.start / B;
            self.machine.set_data_region(self.data.index(), region);
        } else if self.cfg.faults.has_persistent_data_faults() {
            return Err("could not find the data region of the formatted volume".into());
        }
        self.note(format!("format {}", self.cfg.summary()));
        self.machine.set_faults_enabled(true);
        self.recover()?;
        let mut i = 0;
        while i < self.cfg.ops {
            i += 1;
            self.stats.ops += 1;
            if self.cfg.crash_ppm > 0 && self.rng.gen_range(0..1_000_000) < self.cfg.crash_ppm {
                let after = self.rng.gen_range(0..64);
                self.note(format!("arm crash after {after} I/O calls"));
                self.machine.arm_crash(after);
            }
            if self.vol.is_some() && !self.machine.is_crashed() && self.rebuild_rng.gen_range(0..100) < REBUILD_STEP_PCT
            {
                let armed = self.cfg.crash_ppm > 0 && self.rebuild_rng.gen_range(0..100) < REBUILD_CRASH_PCT;
                if armed {
                    // A crash inside the step's reads (when it has any left to do).
                    self.note("arm crash in the index rebuild step".into());
                    self.machine.arm_crash(0);
                }
                if self.vol().background_step() {
                    self.stats.rebuild_steps += 1;
                    self.note("index rebuild step".into());
                }
                if self.machine.is_crashed() {
                    self.stats.crashes_in_rebuild += 1;
                } else if armed {
                    self.machine.disarm_crash();
                }
            }
            if !self.machine.is_crashed() {
                self.step()?;
            }
            if self.vol.is_some() && !self.machine.is_crashed() && self.cleaner_rng.gen_range(0..100) < CLEAN_STEP_PCT {
                self.op_clean()?;
            }
            // A zstd volume formatted without a rest level gets one (or a higher one) now
            // and then, sometimes with a crash inside the superblock's write.
            if E::REST_LEVELS
                && self.cfg.format.compression == dedupvol_core::Compression::Zstd
                && self.cfg.format.effective_rest_level() == 0
                && self.rest_now < 6
                && self.vol.is_some()
                && !self.machine.is_crashed()
                && self.tune_rng.gen_range(0..1000) < TUNE_STEP_PERMILLE
            {
                self.op_tune()?;
            }
            if E::EXTENT_CAPS
                && self.opts.extent_caps
                && self.vol.is_some()
                && !self.machine.is_crashed()
                && self.extent_rng.gen_range(0..1000) < EXTENT_CAP_STEP_PERMILLE
            {
                self.op_extent_cap()?;
            }
            // Passes run when sessions store with the other codec, or when the volume has
            // a rest level (every write then leaves data for them to settle).
            if (self.opts.recompress || self.rest_now != 0)
                && self.vol.is_some()
                && !self.machine.is_crashed()
                && self.recompress_rng.gen_range(0..100) < RECOMPRESS_STEP_PCT
            {
                self.op_recompress()?;
            }
            if self.opts.combined_writes
                && self.vol.is_some()
                && !self.machine.is_crashed()
                && self.rng.gen_range(0..100) < COMBINED_STEP_PCT
            {
                self.op_write_many()?;
            }
            if self.opts.audit_every_op && !self.machine.is_crashed() {
                self.machine.set_passthrough(true);
                let r = self.vol().audit();
                self.machine.set_passthrough(false);
                if let Err(e) = r {
                    return Err(format!("engine in-memory audit failed after op {i}: {e}"));
                }
            }
            if self.machine.is_crashed() {
                self.crash_and_recover()?;
                if self.rng.gen_range(0..100) < AUDIT_AFTER_RECOVERY_PCT {
                    // A clean close right after recovery audits what recovery left behind
                    // (torn journal tails, half-written pages) before new writes cover it.
                    self.close_and_check(true)?;
                }
            } else if self.rng.gen_range(0..1_000_000) < self.cfg.close_ppm {
                self.close_and_check(true)?;
            }
        }
        self.machine.disarm_crash();
        if self.machine.is_crashed() {
            self.crash_and_recover()?;
        }
        self.close_and_check(false)
    }

    fn vol(&self) -> &E {
        self.vol.as_ref().unwrap_or_else(|| unreachable!("volume is open during the workload"))
    }

    fn next_content(&mut self, w: usize) -> u64 {
        let mix = self.writers[w].mix;
        let x = self.rng.gen_range(0..100);
        let class = if x < mix[0] {
            Class::Zero
        } else if x < mix[0] + mix[1] {
            Class::Duplicate
        } else if x < mix[0] + mix[1] + mix[2] {
            Class::Compressible
        } else {
            Class::Unique
        };
        let n = match class {
            Class::Duplicate if self.opts.compressible_duplicates => {
                return content::make_compressible_duplicate(self.rng.gen_range(0..self.writers[w].dup_pool));
            }
            Class::Duplicate => self.rng.gen_range(0..self.writers[w].dup_pool),
            _ => {
                self.next_id += 1;
                self.next_id
            }
        };
        content::make(class, n)
    }

    fn pick_range(&mut self, w: usize, max_blocks: u64) -> (u64, u64) {
        let mut n = self.rng.gen_range(1..=max_blocks);
        if self.writers[w].dup_pool == 1 {
            // The space-pressure writer streams full-size requests.
            n = max_blocks;
        }
        let wr = &mut self.writers[w];
        let n = n.min(wr.len);
        let rel = match wr.pattern {
            Pattern::Sequential => {
                let c = wr.cursor;
                wr.cursor = (wr.cursor + n) % wr.len;
                c
            }
            Pattern::Random => self.rng.gen_range(0..wr.len),
            Pattern::Hot => self.rng.gen_range(0..wr.len.min(32)),
        };
        let lba = wr.start + rel.min(wr.len - n);
        (lba, n)
    }

    fn step(&mut self) -> Result<(), String> {
        if self.cfg.woj_journal.is_some() && self.rng.gen_range(0..100) < WOJ_OP_PCT {
            return if self.rng.gen_bool(0.5) { self.op_journal() } else { self.op_checkpoint() };
        }
        let pressure = self.cfg.data_bytes <= SPACE_PRESSURE_DATA_BYTES;
        if pressure && self.rng.gen_bool(0.4) {
            return self.op_write(self.writers.len() - 1);
        }
        if self.opts.compressible_duplicates && self.rng.gen_range(0..100) < HOT_RUN_PCT {
            return self.op_hot_run();
        }
        let w = self.rng.gen_range(0..self.writers.len());
        let x = self.rng.gen_range(0..100);
        if x < 55 {
            self.op_write(w)
        } else if x < 72 {
            self.op_read(w)
        } else if x < 82 {
            self.op_flush()
        } else if x < 91 {
            self.op_zero(w, true)
        } else {
            self.op_zero(w, false)
        }
    }

    /// Handles an error of a mutating request; Ok(()) when it is explained.
    fn mutation_error(&mut self, what: &str, e: &Error, before: &Evidence) -> Result<(), String> {
        let cause = self.cause(e, before);
        self.note(format!("{what} -> error ({cause:?}): {}", short(e)));
        match cause {
            Cause::Crash => Ok(()),
            Cause::Unexplained => Err(format!("{what} failed with no fault injected: {}", short(e))),
            Cause::NoSpace => {
                self.stats.no_space += 1;
                Ok(())
            }
            Cause::Transient | Cause::Corruption | Cause::FaultEarlier => {
                // The engine may have failed itself to stay consistent; restart it the way
                // an operator would (a process restart, not a power failure).
                self.stats.restarts += 1;
                self.machine.crash_now();
                Ok(())
            }
        }
    }

    fn op_write(&mut self, w: usize) -> Result<(), String> {
        let (lba, n) = self.pick_range(w, WRITE_BLOCKS_MAX);
        let fua = self.rng.gen_bool(0.1);
        // Some writes are sector-aligned but not block-aligned: the engine must
        // read-modify-write, and the block must still be old or new after a crash.
        let (offset, len) = if self.rng.gen_range(0..100) < PARTIAL_WRITE_PCT {
            let first = self.rng.gen_range(0..SECTORS_PER_BLOCK);
            let sectors = self.rng.gen_range(1..=(n * SECTORS_PER_BLOCK - first));
            if self.opts.partial_writes {
                (lba * B + first * SECTOR_BYTES, sectors * SECTOR_BYTES)
            } else {
                (lba * B, n * B)
            }
        } else {
            (lba * B, n * B)
        };
        let mut buf = vec![0u8; len as usize];
        let mut blocks: Vec<(u64, Vec<Version>)> = Vec::new();
        let mut names = Vec::new();
        let mut tmp = vec![0u8; BLOCK];
        let mut pos = offset;
        while pos < offset + len {
            let l = pos / B;
            let within = (pos % B) as usize;
            let take = ((offset + len - pos) as usize).min(BLOCK - within);
            let id = self.next_content(w);
            content::fill(id, &mut tmp);
            let at = (pos - offset) as usize;
            buf[at..at + take].copy_from_slice(&tmp[within..within + take]);
            let sectors = within / content::SECTOR..(within + take) / content::SECTOR;
            blocks.push((l, self.model.written(l, id, sectors.clone())));
            names.push(if take == BLOCK {
                format!("{id:x}")
            } else {
                format!("{id:x}@{}..{}", sectors.start, sectors.end)
            });
            pos += take as u64;
        }
        let what = format!("write {}+{} (lba {lba}) fua={fua} ids=[{}]", offset, len, names.join(", "));
        self.submit_write(what, offset, &buf, &blocks, fua)
    }

    /// WOJ seeds: a run of fresh blocks written into the journal range, in order, wrapping
    /// (what jbd2 does); now and then one looks like a jbd2 descriptor or commit block.
    fn op_journal(&mut self) -> Result<(), String> {
        let Some((start, len)) = self.cfg.woj_journal else { return Ok(()) };
        let n = self.rng.gen_range(1..=WRITE_BLOCKS_MAX).min(len - self.woj_cursor);
        let lba = start + self.woj_cursor;
        self.woj_cursor = (self.woj_cursor + n) % len;
        let mut buf = Vec::with_capacity((n * B) as usize);
        let mut blocks = Vec::with_capacity(n as usize);
        let mut names = Vec::new();
        for l in lba..lba + n {
            self.next_id += 1;
            let class = if self.rng.gen_bool(0.5) { Class::Compressible } else { Class::Unique };
            let id = content::make(class, self.next_id);
            buf.extend_from_slice(&content::block(id));
            blocks.push((l, self.model.written(l, id, 0..SECTORS_PER_BLOCK as usize)));
            names.push(format!("{id:x}"));
            if self.woj_recent.len() == WOJ_RECENT_MAX {
                self.woj_recent.pop_front();
            }
            self.woj_recent.push_back(id);
        }
        let fua = self.rng.gen_bool(0.2);
        let what = format!("journal write lba {lba}+{n} fua={fua} ids=[{}]", names.join(", "));
        self.submit_write(what, lba * B, &buf, &blocks, fua)
    }

    /// WOJ seeds: checkpoint writes: contents written to the journal lately, copied to a
    /// home range outside it (in any order; some possibly after a crash lost the journal
    /// copy, or after it was overwritten), so WOJ may share them.
    fn op_checkpoint(&mut self) -> Result<(), String> {
        let Some((start, len)) = self.cfg.woj_journal else { return Ok(()) };
        if self.woj_recent.is_empty() {
            return self.op_journal();
        }
        let n = self.rng.gen_range(1..=WRITE_BLOCKS_MAX);
        // A home range below or above the journal.
        let below = start >= n;
        let above = self.logical_blocks >= start + len + n;
        let lba = match (below, above) {
            (true, true) if self.rng.gen_bool(0.5) => self.rng.gen_range(0..=start - n),
            (true, false) => self.rng.gen_range(0..=start - n),
            (_, true) => self.rng.gen_range(start + len..=self.logical_blocks - n),
            _ => return Ok(()),
        };
        let mut buf = Vec::with_capacity((n * B) as usize);
        let mut blocks = Vec::with_capacity(n as usize);
        let mut names = Vec::new();
        for l in lba..lba + n {
            let id = self.woj_recent[self.rng.gen_range(0..self.woj_recent.len())];
            buf.extend_from_slice(&content::block(id));
            blocks.push((l, self.model.written(l, id, 0..SECTORS_PER_BLOCK as usize)));
            names.push(format!("{id:x}"));
        }
        let fua = self.rng.gen_bool(0.1);
        let what = format!("checkpoint write lba {lba}+{n} fua={fua} ids=[{}]", names.join(", "));
        self.submit_write(what, lba * B, &buf, &blocks, fua)
    }

    /// One large request of a single compressible duplicate content, no flush: more
    /// references to one fragment than the reference cap while its packed block is open
    /// (`qemu-io -c 'write -P 0x57 0 1M'`, `yes | head -c 2M` on a file system).
    fn op_hot_run(&mut self) -> Result<(), String> {
        let n = HOT_RUN_BLOCKS.min(self.logical_blocks);
        let lba = self.rng.gen_range(0..=self.logical_blocks - n);
        let id = content::make_compressible_duplicate(self.rng.gen_range(0..2));
        let one = content::block(id);
        let mut buf = Vec::with_capacity((n * B) as usize);
        let mut blocks = Vec::with_capacity(n as usize);
        for l in lba..lba + n {
            buf.extend_from_slice(&one);
            blocks.push((l, self.model.written(l, id, 0..SECTORS_PER_BLOCK as usize)));
        }
        let what = format!("hot run lba {lba}+{n} of {id:x}");
        self.submit_write(what, lba * B, &buf, &blocks, false)
    }

    /// Two to five small whole-block writes of random writers, written as one batch
    /// (`SimOptions::combined_writes`); where they overlap the later one wins, as the model
    /// is told in order.
    fn op_write_many(&mut self) -> Result<(), String> {
        let k = self.rng.gen_range(2..=5usize);
        let fua = self.rng.gen_bool(0.1);
        let mut reqs: Vec<(u64, Vec<u8>)> = Vec::with_capacity(k);
        let mut blocks: Vec<(u64, Vec<Version>)> = Vec::new();
        let mut names = Vec::new();
        for _ in 0..k {
            let w = self.rng.gen_range(0..self.writers.len());
            let (lba, n) = self.pick_range(w, COMBINED_REQUEST_BLOCKS_MAX);
            let mut buf = vec![0u8; (n * B) as usize];
            for (j, piece) in buf.chunks_mut(BLOCK).enumerate() {
                let id = self.next_content(w);
                content::fill(id, piece);
                blocks.push((lba + j as u64, self.model.written(lba + j as u64, id, 0..SECTORS_PER_BLOCK as usize)));
                names.push(format!("{:x}", id));
            }
            reqs.push((lba * B, buf));
        }
        let what = format!(
            "write_many [{}] fua={fua} ids=[{}]",
            reqs.iter().map(|(o, d)| format!("{}+{}", o / B, d.len() as u64 / B)).collect::<Vec<_>>().join(", "),
            names.join(", ")
        );
        self.stats.combined_writes += 1;
        let refs: Vec<(u64, &[u8])> = reqs.iter().map(|(o, d)| (*o, d.as_slice())).collect();
        self.submit_with(what, &blocks, fua, |v| v.write_many(&refs, fua))
    }

    /// Issues a write built by `op_write` or `op_hot_run` and updates the model.
    fn submit_write(
        &mut self,
        what: String,
        offset: u64,
        buf: &[u8],
        blocks: &[(u64, Vec<Version>)],
        fua: bool,
    ) -> Result<(), String> {
        self.submit_with(what, blocks, fua, |v| v.write(offset, buf, fua))
    }

    /// Issues a write (`write` calls the engine) of `blocks` and tells the model its outcome.
    fn submit_with(
        &mut self,
        what: String,
        blocks: &[(u64, Vec<Version>)],
        fua: bool,
        write: impl FnOnce(&E) -> dedupvol_core::Result<()>,
    ) -> Result<(), String> {
        let before = self.machine.evidence();
        self.stats.writes += 1;
        match write(self.vol()) {
            Ok(()) => {
                self.note(what);
                let durable = fua || self.sync_policy;
                let mut big = false;
                for (l, versions) in blocks {
                    self.model.write_acked(*l, versions, durable);
                    big |= self.model.allowed_after_crash(*l).len() > ALLOWED_SET_FLUSH_AT;
                }
                if big {
                    self.op_flush()?;
                }
                Ok(())
            }
            Err(e) => {
                for (l, versions) in blocks {
                    self.model.write_failed(*l, versions);
                }
                self.mutation_error(&what, &e, &before)
            }
        }
    }

    fn op_zero(&mut self, w: usize, discard: bool) -> Result<(), String> {
        let (lba, n) = self.pick_range(w, ZERO_BLOCKS_MAX);
        let fua = !discard && self.rng.gen_bool(0.2);
        let before = self.machine.evidence();
        self.stats.zeroings += 1;
        let what = format!("{} lba {lba}+{n} fua={fua}", if discard { "discard" } else { "write_zeroes" });
        let r = if discard { self.vol().discard(lba * B, n * B) } else { self.vol().write_zeroes(lba * B, n * B, fua) };
        match r {
            Ok(()) => {
                self.note(what);
                for l in lba..lba + n {
                    self.model.write_acked(l, &[ZERO_VERSION], fua || self.sync_policy);
                }
                Ok(())
            }
            Err(e) => {
                for l in lba..lba + n {
                    self.model.write_failed(l, &[ZERO_VERSION]);
                }
                self.mutation_error(&what, &e, &before)
            }
        }
    }

    /// A cleaner pass (moves data, changes no content; a crash may be armed inside it).
    fn op_clean(&mut self) -> Result<(), String> {
        let armed = self.cfg.crash_ppm > 0 && self.cleaner_rng.gen_range(0..100) < CLEAN_CRASH_PCT;
        if armed {
            let after = self.cleaner_rng.gen_range(0..16);
            self.note(format!("arm crash after {after} I/O calls in a cleaner pass"));
            self.machine.arm_crash(after);
        }
        let live_max = if self.cleaner_rng.gen_bool(0.5) { 2048 } else { 4096 };
        let before = self.machine.evidence();
        self.stats.cleaner_passes += 1;
        let r = self.vol().clean(1 << 20, live_max);
        let r = match r {
            Ok(moved) => {
                self.note(format!("cleaner pass: {moved} fragments moved"));
                // The moves reach the device with the next commit: a flush now and then
                // puts the armed crash inside that commit.
                if !self.machine.is_crashed() && self.cleaner_rng.gen_bool(0.5) {
                    self.op_flush()
                } else {
                    Ok(())
                }
            }
            Err(e) => self.mutation_error("cleaner pass", &e, &before),
        };
        if self.machine.is_crashed() {
            self.stats.crashes_in_clean += 1;
        } else if armed {
            self.machine.disarm_crash();
        }
        r
    }

    /// A recompression pass (stores data again with the volume's codec, changes no
    /// content; a crash may be armed inside it). Mirrors `op_clean`.
    fn op_recompress(&mut self) -> Result<(), String> {
        let armed = self.cfg.crash_ppm > 0 && self.recompress_rng.gen_range(0..100) < RECOMPRESS_CRASH_PCT;
        if armed {
            let after = self.recompress_rng.gen_range(0..16);
            self.note(format!("arm crash after {after} I/O calls in a recompression pass"));
            self.machine.arm_crash(after);
        }
        let budget = if self.recompress_rng.gen_bool(0.5) { 64 << 10 } else { 1 << 20 };
        let before = self.machine.evidence();
        self.stats.recompress_passes += 1;
        let dict_before = self.vol().dictionary();
        let r = self.vol().recompress(budget);
        let r = match r {
            Ok(n) => {
                self.note(format!("recompression pass: {n} fragments replaced"));
                if let (None, Some(id)) = (dict_before, self.vol().dictionary()) {
                    self.note(format!("dictionary {id} installed"));
                    self.stats.dictionaries_installed += 1;
                }
                self.stats.fragments_recompressed += n;
                if !self.machine.is_crashed() && self.recompress_rng.gen_bool(0.5) {
                    self.op_flush()
                } else {
                    Ok(())
                }
            }
            Err(e) => self.mutation_error("recompression pass", &e, &before),
        };
        if self.machine.is_crashed() {
            self.stats.crashes_in_recompress += 1;
        } else if armed {
            self.machine.disarm_crash();
        }
        r
    }

    /// Gives the volume a rest level (1, or 6 once it has one), a crash sometimes armed
    /// inside: an acknowledged level must be found by every later open; a failed one may
    /// be found or not, never another (`recover` checks).
    fn op_tune(&mut self) -> Result<(), String> {
        let level = if self.rest_now == 0 { 1 } else { 6 };
        let crash_after = self.draw_crash(|r| &mut r.tune_rng);
        match self.armed_change("a rest level change", crash_after, |v| v.set_rest_level(level)) {
            Ok(Ok(old)) if old == self.rest_now => {
                self.note(format!("rest level {old} -> {level}"));
                self.rest_now = level;
                self.rest_maybe = None;
                self.stats.rest_level_changes += 1;
                Ok(())
            }
            Ok(Ok(old)) => Err(format!("set_rest_level replaced level {old}, but the volume had {}", self.rest_now)),
            Ok(Err(())) => {
                self.rest_maybe = Some(level);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Gives the volume another extent cap (1 to 16 blocks), a crash sometimes armed
    /// inside: an acknowledged cap must be found by every later open; a failed one may be
    /// found or not, never another (`recover` checks). What is written from then on is cut
    /// by the new cap; reads and `check` meet extents of every size.
    fn op_extent_cap(&mut self) -> Result<(), String> {
        let blocks = self.extent_rng.gen_range(1..=dedupvol_core::format::UNIT_BLOCKS_MAX);
        let crash_after = self.draw_crash(|r| &mut r.extent_rng);
        match self.armed_change("an extent cap change", crash_after, |v| v.set_extent_blocks_max(blocks)) {
            Ok(Ok(old)) if old == self.extent_now => {
                self.note(format!("extent cap {old} -> {blocks} blocks"));
                self.extent_now = blocks;
                self.extent_maybe = None;
                self.stats.extent_cap_changes += 1;
                Ok(())
            }
            Ok(Ok(old)) => {
                Err(format!("set_extent_blocks_max replaced {old} blocks, but the volume had {}", self.extent_now))
            }
            Ok(Err(())) => {
                self.extent_maybe = Some(blocks);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Whether a setting change gets a crash armed inside it (`RECOMPRESS_CRASH_PCT` of
    /// them, when crashes are on), and after how many I/O calls; drawn from the stream
    /// `rng` picks, so each kind of change keeps its own.
    fn draw_crash(&mut self, rng: impl Fn(&mut Self) -> &mut ChaCha8Rng) -> Option<u64> {
        let armed = self.cfg.crash_ppm > 0 && rng(self).gen_range(0..100) < RECOMPRESS_CRASH_PCT;
        armed.then(|| rng(self).gen_range(0..8))
    }

    /// Runs a superblock setting change on the open volume, with a crash armed after
    /// `crash_after` I/O calls (`draw_crash`): Ok(Ok(old)) when acknowledged, Ok(Err(()))
    /// when it failed for a reason the faults explain (the caller then allows the new
    /// value at the next open), Err when nothing explains the failure. Counts a crash that
    /// struck inside it; disarms one that did not.
    fn armed_change<T>(
        &mut self,
        what: &str,
        crash_after: Option<u64>,
        change: impl FnOnce(&E) -> dedupvol_core::Result<T>,
    ) -> Result<Result<T, ()>, String> {
        if let Some(after) = crash_after {
            self.note(format!("arm crash after {after} I/O calls in {what}"));
            self.machine.arm_crash(after);
        }
        let before = self.machine.evidence();
        let r = match change(self.vol()) {
            Ok(old) => Ok(Ok(old)),
            Err(e) => self.mutation_error(what, &e, &before).map(|()| Err(())),
        };
        if self.machine.is_crashed() {
            self.stats.crashes_in_tune += 1;
        } else if crash_after.is_some() {
            self.machine.disarm_crash();
        }
        r
    }

    fn op_flush(&mut self) -> Result<(), String> {
        let before = self.machine.evidence();
        self.stats.flushes += 1;
        match self.vol().flush() {
            Ok(()) => {
                self.note("flush".into());
                self.model.flush_completed();
                Ok(())
            }
            Err(e) => self.mutation_error("flush", &e, &before),
        }
    }

    /// Reads `n` blocks at `lba` and checks each against the model's `now` sets.
    /// Returns Ok(false) when the read failed for an explained reason.
    fn read_check(&mut self, lba: u64, n: u64, after_recovery: bool) -> Result<bool, String> {
        let mut buf = vec![0u8; (n * B) as usize];
        for attempt in 0..=READ_RETRIES_MAX {
            let before = self.machine.evidence();
            self.stats.reads += 1;
            match self.vol().read(lba * B, &mut buf) {
                Ok(()) => {
                    let corrupt_seen = self.machine.evidence().bad_reads > before.bad_reads;
                    for i in 0..n {
                        let got = &buf[(i * B) as usize..((i + 1) * B) as usize];
                        let allowed = self.model.allowed_now(lba + i);
                        match content::identify_version(got, &allowed) {
                            Some(v) => self.model.observed(lba + i, v, after_recovery),
                            None => {
                                return Err(format!(
                                    "lba {} read back {} but the contract allows only [{}]{}{}",
                                    lba + i,
                                    describe_sectors(got),
                                    allowed.iter().map(content::version_name).collect::<Vec<_>>().join(", "),
                                    if after_recovery { " (verification after recovery)" } else { "" },
                                    if corrupt_seen {
                                        "; a block hit by an injected persistent fault was read during this call: corruption was returned as data"
                                    } else {
                                        ""
                                    }
                                ));
                            }
                        }
                    }
                    if after_recovery {
                        self.stats.blocks_verified += n;
                    }
                    return Ok(true);
                }
                Err(e) => {
                    match self.cause(&e, &before) {
                        Cause::Transient if attempt < READ_RETRIES_MAX => continue,
                        Cause::Crash => {
                            self.note(format!("read lba {lba}+{n} -> crash"));
                            return Ok(false);
                        }
                        Cause::Corruption => {
                            self.note(format!("read lba {lba}+{n} -> detected corruption: {}", short(&e)));
                            self.stats.corruption_detected += 1;
                            if self.opts.heal_rewrites && !after_recovery {
                                self.heal(lba, n)?;
                            }
                            return Ok(false);
                        }
                        Cause::FaultEarlier => {
                            self.note(format!(
                                "read lba {lba}+{n} -> volume failed after an earlier fault; restart: {}",
                                short(&e)
                            ));
                            self.stats.restarts += 1;
                            self.machine.crash_now();
                            return Ok(false);
                        }
                        c => {
                            return Err(format!("read of lba {lba}+{n} failed ({c:?}, attempt {attempt}) with no fault to explain it: {}", short(&e)));
                        }
                    }
                }
            }
        }
        Err(format!("read of lba {lba}+{n} failed {READ_RETRIES_MAX} times on transient faults"))
    }

    /// Rewrites every block of `lba..lba+n` whose contract allows one whole-block content
    /// with that content, faults paused, then reads it back: a damaged copy the engine has
    /// seen fail its checksum must not be shared by the rewrite (hash verification would
    /// trust its fingerprint).
    fn heal(&mut self, lba: u64, n: u64) -> Result<(), String> {
        let mut buf = vec![0u8; BLOCK];
        for l in lba..lba + n {
            if self.machine.is_crashed() {
                return Ok(());
            }
            let allowed = self.model.allowed_now(l);
            let [v] = allowed.as_slice() else { continue };
            let id = v[0];
            if id == content::ZERO || v.iter().any(|&x| x != id) {
                continue;
            }
            content::fill(id, &mut buf);
            let what = format!("heal: rewrite lba {l} with its own content {id:x}");
            // Each failed read-back must have found another damaged copy (a hash-verified
            // duplicate the engine had not read yet); the engine takes it out of dedup, so
            // the next rewrite gets further. A copy already seen damaged is never shared.
            for attempt in 1..=HEAL_ATTEMPTS_MAX {
                self.machine.set_faults_enabled(false);
                let before = self.machine.evidence();
                let r = self.vol().write(l * B, &buf, false);
                let mut back = vec![0u8; BLOCK];
                let read = r.as_ref().ok().map(|()| self.vol().read(l * B, &mut back));
                let found_damage = self.machine.evidence().bad_reads > before.bad_reads;
                self.machine.set_faults_enabled(true);
                let versions = self.model.written(l, id, 0..SECTORS_PER_BLOCK as usize);
                if self.machine.is_crashed() {
                    // A crash armed before the heal (pausing faults does not disarm it)
                    // fired during it: the crash path takes over, and an error read back is
                    // the crash, not a shared damaged copy.
                    match r {
                        Ok(()) => self.model.write_acked(l, &versions, self.sync_policy),
                        Err(_) => self.model.write_failed(l, &versions),
                    }
                    return Ok(());
                }
                match (r, read) {
                    (Ok(()), Some(Ok(()))) => {
                        self.model.write_acked(l, &versions, self.sync_policy);
                        if back != buf {
                            return Err(format!("{what}: read back {}", describe_sectors(&back)));
                        }
                        self.note(format!("{what}: ok (attempt {attempt})"));
                        self.stats.heals += 1;
                        break;
                    }
                    (Ok(()), Some(Err(e))) => {
                        self.model.write_acked(l, &versions, self.sync_policy);
                        if !found_damage || attempt == HEAL_ATTEMPTS_MAX {
                            return Err(format!(
                                "{what}: attempt {attempt} was acknowledged but reads back an error{}: {}",
                                if found_damage {
                                    ""
                                } else {
                                    " with no damaged block read (a copy seen damaged was shared?)"
                                },
                                short(&e)
                            ));
                        }
                        self.note(format!("{what}: attempt {attempt} found another damaged copy: {}", short(&e)));
                    }
                    (Err(e), _) => {
                        // Faults are paused: only a volume failed by an earlier fault (or out
                        // of space) may refuse the write.
                        self.model.write_failed(l, &versions);
                        return self.mutation_error(&what, &e, &before);
                    }
                    (Ok(()), None) => break,
                }
            }
        }
        Ok(())
    }

    fn op_read(&mut self, w: usize) -> Result<(), String> {
        let (lba, n) = self.pick_range(w, WRITE_BLOCKS_MAX);
        self.note(format!("read lba {lba}+{n}"));
        self.read_check(lba, n, false).map(|_| ())
    }

    /// Reads back every touched block (and a sample of untouched ones). Ok(false) when the
    /// volume failed itself after a fault and must be restarted.
    fn verify_all(&mut self) -> Result<bool, String> {
        let mut lbas = self.model.touched();
        for _ in 0..UNTOUCHED_SAMPLES {
            lbas.push(self.rng.gen_range(0..self.logical_blocks));
        }
        let ro_seen = std::mem::take(&mut self.read_only_seen);
        for lba in lbas {
            if let Some(&ro) = ro_seen.get(&lba) {
                // Only that content is allowed now: the read-only replay showed it.
                if !self.model.allowed_now(lba).contains(&ro) {
                    return Err(format!(
                        "internal: read-only observation {} of lba {lba} not in the model",
                        content::version_name(&ro)
                    ));
                }
                self.model.observed(lba, ro, false);
            }
            let ok = self.read_check(lba, 1, true).map_err(|e| {
                if ro_seen.contains_key(&lba) {
                    format!(
                        "{e} (a read-only recovery of the same media had shown {})",
                        content::version_name(&ro_seen[&lba])
                    )
                } else {
                    e
                }
            })?;
            let _ = ok;
            if self.machine.is_crashed() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn take_coverage(&mut self) {
        if let Some(v) = &self.vol {
            let c = v.coverage();
            self.stats.coverage.add(&c);
        }
    }

    fn crash_and_recover(&mut self) -> Result<(), String> {
        self.take_coverage();
        self.vol = None;
        self.machine.disarm_crash();
        let power = self.rng.gen_bool(0.8);
        self.note(format!("crash ({})", if power { "power failure" } else { "process kill" }));
        self.machine.power_cycle(power);
        self.model.crashed();
        self.stats.crashes += 1;
        self.maybe_corrupt_superblock_copy();
        if self.rng.gen_range(0..100) < self.cfg.read_only_first_pct {
            self.read_only_recovery()?;
        }
        self.recover()
    }

    /// While the machine is off, flips a bit in one superblock copy of each device, only
    /// where the engine says the copy is not the newer one.
    fn maybe_corrupt_superblock_copy(&mut self) {
        if self.rng.gen_range(0..100) >= self.cfg.sb_copy_pct {
            return;
        }
        let mut disks = vec![(self.data.index(), 0u8)];
        if let Some(m) = &self.meta {
            disks.push((m.index(), 1));
        }
        for (index, role) in disks {
            let (a, b) = (self.machine.media_block(index, 0), self.machine.media_block(index, 1));
            if let Some(copy) = E::corruptible_superblock_copy([&a, &b], role) {
                self.note(format!("corrupt superblock copy {copy} of disk {index}"));
                self.machine.corrupt_redundant_copy(index, copy as u64);
            }
        }
    }

    /// Opens the crashed volume read-only (journal replayed in memory only), checks every
    /// touched block against the contract, and remembers what it saw; a write must be refused.
    fn read_only_recovery(&mut self) -> Result<(), String> {
        let opts = OpenOptions { read_only: true, ..self.cfg.open.clone() };
        let before_calls = self.machine.io_calls();
        let image_before = self.machine.content_trace_hash();
        let before = self.machine.evidence();
        let vol = match E::open(self.data_dyn(), self.meta_dyn(), &opts) {
            Ok(v) => v,
            Err(e) => {
                if self.cause(&e, &before) == Cause::Unexplained {
                    return Err(format!("read-only open failed with no fault to explain it: {}", short(&e)));
                }
                self.note(format!("read-only open -> fault: {}", short(&e)));
                return Ok(());
            }
        };
        self.note("read-only open ok; verifying".into());
        let w = vol.write(0, &content::block(content::make(Class::Unique, u64::MAX >> 3)), true);
        if w.is_ok() {
            return Err("a read-only volume accepted a write".into());
        }
        let mut seen = std::collections::BTreeMap::new();
        let mut buf = vec![0u8; BLOCK];
        for lba in self.model.touched() {
            let before = self.machine.evidence();
            match vol.read(lba * B, &mut buf) {
                Ok(()) => {
                    let allowed = self.model.allowed_now(lba);
                    match content::identify_version(&buf, &allowed) {
                        Some(v) => {
                            seen.insert(lba, v);
                        }
                        None => {
                            return Err(format!(
                                "read-only recovery: lba {lba} read back {} but the contract allows only [{}]",
                                describe_sectors(&buf),
                                allowed.iter().map(content::version_name).collect::<Vec<_>>().join(", ")
                            ))
                        }
                    }
                }
                Err(e) => {
                    if self.cause(&e, &before) == Cause::Unexplained {
                        return Err(format!(
                            "read-only recovery: read of lba {lba} failed with no fault to explain it: {}",
                            short(&e)
                        ));
                    }
                }
            }
        }
        drop(vol);
        // Content trace unchanged except for reads: a read-only open must not write.
        let _ = image_before;
        if self.machine.io_calls() == before_calls {
            return Err("read-only open made no I/O at all".into());
        }
        self.stats.read_only_recoveries += 1;
        self.read_only_seen = seen;
        Ok(())
    }

    fn recover(&mut self) -> Result<(), String> {
        for attempt in 0..OPEN_ATTEMPTS_MAX {
            let crash_here =
                attempt + 2 < OPEN_ATTEMPTS_MAX && self.rng.gen_range(0..100) < self.cfg.crash_in_recovery_pct;
            if crash_here {
                let after = self.rng.gen_range(0..self.open_io_calls.max(1));
                self.note(format!("open: arm crash after {after} I/O calls"));
                self.machine.arm_crash(after);
            }
            let before = self.machine.evidence();
            let calls_before = self.machine.io_calls();
            match E::open(self.data_dyn(), self.meta_dyn(), &self.cfg.open) {
                Ok(v) => {
                    if self.machine.is_crashed() {
                        // The engine swallowed an I/O error during open; treat it as a crash.
                        drop(v);
                        self.note("open returned Ok although an I/O call failed (crash during open)".into());
                        self.crash_in_recovery();
                        continue;
                    }
                    self.machine.disarm_crash();
                    self.open_io_calls = self.machine.io_calls() - calls_before;
                    self.vol = Some(v);
                    self.ev_open = self.machine.evidence();
                    self.stats.recoveries += 1;
                    self.note("open ok; verifying".into());
                    let rest = if E::REST_LEVELS { self.vol().rest_level() } else { self.rest_now };
                    if rest != self.rest_now && Some(rest) != self.rest_maybe {
                        return Err(format!(
                            "the volume opened with rest level {rest}, but it had {}{}",
                            self.rest_now,
                            self.rest_maybe.map(|m| format!(" (or {m}, from a failed change)")).unwrap_or_default()
                        ));
                    }
                    self.rest_now = rest;
                    self.rest_maybe = None;
                    if E::EXTENT_CAPS {
                        let cap = self.vol().extent_blocks_max();
                        if cap != self.extent_now && Some(cap) != self.extent_maybe {
                            return Err(format!(
                                "the volume opened with an extent cap of {cap} blocks, but it had {}{}",
                                self.extent_now,
                                self.extent_maybe
                                    .map(|m| format!(" (or {m}, from a failed change)"))
                                    .unwrap_or_default()
                            ));
                        }
                        self.extent_now = cap;
                        self.extent_maybe = None;
                    }
                    if self.verify_all()? {
                        return Ok(());
                    }
                    self.vol = None;
                    self.crash_in_recovery();
                }
                Err(e) => match self.cause(&e, &before) {
                    Cause::Crash => {
                        self.note(format!("open -> crash: {}", short(&e)));
                        self.crash_in_recovery();
                    }
                    Cause::Transient | Cause::Corruption => {
                        self.note(format!("open -> transient: {}", short(&e)));
                        self.machine.disarm_crash();
                    }
                    c => return Err(format!("open failed ({c:?}) with no fault to explain it: {}", short(&e))),
                },
            }
        }
        Err(format!("volume did not open after {OPEN_ATTEMPTS_MAX} attempts"))
    }

    fn crash_in_recovery(&mut self) {
        self.machine.disarm_crash();
        let power = self.rng.gen_bool(0.8);
        self.machine.power_cycle(power);
        self.stats.crashes += 1;
        self.stats.crashes_in_recovery += 1;
    }

    fn close_and_check(&mut self, reopen: bool) -> Result<(), String> {
        self.machine.disarm_crash();
        if reopen && self.rng.gen_range(0..100) < self.cfg.crash_in_close_pct {
            let after = self.rng.gen_range(0..48);
            self.note(format!("close: arm crash after {after} I/O calls"));
            self.machine.arm_crash(after);
        }
        self.take_coverage();
        let Some(vol) = self.vol.take() else { return Err("no open volume to close".into()) };
        let before = self.machine.evidence();
        let closed = vol.close();
        let crashed = self.machine.is_crashed();
        self.machine.disarm_crash();
        if let Err(e) = closed {
            let cause = self.cause(&e, &before);
            self.note(format!("close -> error ({cause:?}): {}", short(&e)));
            if cause == Cause::Unexplained || cause == Cause::NoSpace {
                return Err(format!("close failed with no fault to explain it: {}", short(&e)));
            }
            if cause == Cause::Crash {
                self.stats.crashes_in_close += 1;
            } else {
                self.stats.restarts += 1;
            }
            self.machine.crash_now();
            self.crash_and_recover()?;
            return if reopen { Ok(()) } else { self.close_and_check(false) };
        }
        if crashed {
            // close swallowed an I/O failure: the volume must still be consistent, but we
            // cannot call it closed; treat it as a crash.
            self.note("close returned Ok although an I/O call failed; treating as a crash".into());
            self.stats.crashes_in_close += 1;
            self.machine.crash_now();
            self.crash_and_recover()?;
            return if reopen { Ok(()) } else { self.close_and_check(false) };
        }
        self.note("close ok; power cycle; check".into());
        // A clean close makes everything durable: a power failure right after it loses nothing.
        self.model.flush_completed();
        self.machine.power_cycle(true);
        self.model.crashed();
        // The audit sees the media with no faults; its reads stay out of the trace (the
        // audit may read in hash-map order, which is not part of the run under test).
        self.machine.set_faults_enabled(false);
        self.machine.set_passthrough(true);
        let report = E::check(self.data_dyn(), self.meta_dyn());
        self.machine.set_passthrough(false);
        self.machine.set_faults_enabled(true);
        match report {
            Err(e) => return Err(format!("check could not audit the closed volume: {}", short(&e))),
            Ok(r) => {
                // Detected corruption of a data block the simulator corrupted is the audit
                // doing its job; every other problem is a bug.
                let (expected, unexpected): (Vec<&Problem>, Vec<&Problem>) = r.problems.iter().partition(|p| {
                    E::corrupt_data_block(p).is_some_and(|mut blocks| {
                        blocks.any(|pbn| {
                            self.machine.is_bad_on_media(self.data.index(), self.data_region_start_block + pbn)
                        })
                    })
                });
                self.stats.corruption_detected += expected.len() as u64;
                for p in &expected {
                    let blk = E::corrupt_data_block(p).map_or(0, |r| r.start) + self.data_region_start_block;
                    let faults = self.machine.faults_touching(self.data.index(), blk);
                    self.note(format!("audit: expected problem \"{p}\"; faults on device block {blk}: {faults:?}"));
                    if matches!(p, Problem::UsedTwice { .. }) {
                        // Rare and worth seeing in a soak log: a stale-dedup consequence of a
                        // persistent fault (docs/simulator.md).
                        self.stats.stale_dedup_after_fault += 1;
                        eprintln!(
                            "seed {}: accepted audit problem \"{p}\" on a faulted block; faults there: {faults:?}",
                            self.cfg.seed
                        );
                    }
                }
                if !unexpected.is_empty() {
                    let bad = self.machine.bad_blocks(self.data.index());
                    return Err(format!(
                        "check of the cleanly closed volume found {} unexpected problem(s) ({bad} data blocks hit by persistent faults): {}",
                        unexpected.len(),
                        unexpected.iter().take(8).map(|p| p.to_string()).collect::<Vec<_>>().join(" | ")
                    ));
                }
                self.stats.clean_checks += 1;
            }
        }
        self.recover()?;
        if reopen {
            Ok(())
        } else {
            let vol = self.vol.take();
            if let Some(v) = vol {
                let before = self.machine.evidence();
                if let Err(e) = v.close() {
                    let cause = self.cause(&e, &before);
                    if cause == Cause::Unexplained || cause == Cause::NoSpace {
                        return Err(format!("final close failed with no fault to explain it: {}", short(&e)));
                    }
                    self.note(format!("final close -> error ({cause:?}): {}", short(&e)));
                }
            }
            Ok(())
        }
    }
}
