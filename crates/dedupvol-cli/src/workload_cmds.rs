//! Workload commands: `bench` (in-process engine benchmark), `gen` (generated data files)
//! and `estimate` (what the engine would save on existing data).
//!
//! These are thin: argument parsing and printing; the work lives in `dedupvol-workload`.

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use dedupvol_core::{
    parse_size, DedupVerify, FileStorage, FormatOptions, IoMode, OpenOptions, Storage, Volume, WritePolicy,
};
use dedupvol_workload::bench::{self, BenchOptions, BenchReport, Scenario, Target};
use dedupvol_workload::table::{num, render_bench, render_estimate, Table};
use dedupvol_workload::{ContentModel, DataSpec, EstimateOptions, EstimateReport, Estimator, Workload, PRESET_NAMES};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

#[derive(Subcommand)]
pub enum WorkloadCommand {
    /// Benchmark the engine in-process: generated data (or a real file) into a fresh volume,
    /// printed beside BLAKE3/LZ4/zstd/disk speeds and a no-reduction baseline.
    Bench(Box<BenchArgs>),
    /// Write a generated data file with a target dedup and compression ratio.
    Gen(GenArgs),
    /// Estimate the zero/dedup/compression savings of files or devices, without writing.
    Estimate(EstimateArgs),
}

/// What `bench` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchMode {
    /// Sequential writes of generated data (--dup, --compress, --size).
    Seq,
    /// Random 4 KiB overwrites over --range (writes/s).
    Overwrite,
    /// A real file (--file) in --request-size chunks.
    Ingest,
    /// Only the machine's primitives (BLAKE3/LZ4/zstd on the --dup/--compress data, disk).
    Primitives,
    /// Four speed targets, each printed beside its goal: 75% dup + 50% compressible,
    /// unique incompressible, --file (if given, e.g. a kernel source tar), random 4 KiB
    /// overwrites.
    Targets,
    /// Write-once journaling against BLAKE3 dedup: CPU per GB and blocks saved on a
    /// replayed ext4 data=journal stream (in memory; see --woj-mib, --woj-txn-blocks).
    Woj,
    /// The same data (--file, else generated --dup/--compress/--size) into one volume
    /// striped over --data-devices files, into as many single-device volumes each given
    /// every Nth 1 MiB piece (dedup per device), and into one volume on one file: ratio,
    /// physical and per-device bytes, MB/s.
    Stripe,
    /// How the write pipeline scales with its stage threads: the --dup/--compress data
    /// (or --file) written with exactly 1, 2, … --workers stage threads (default: one per
    /// core), each count once with every core and once confined to as many cores, --rounds
    /// rounds interleaved, beside the machine's own limit for the same work.
    Scaling,
}

#[derive(Args)]
pub struct BenchArgs {
    /// What to run.
    #[arg(long, value_enum, default_value = "seq")]
    mode: BenchMode,
    /// --mode woj: MiB of application data written (each block journaled, then
    /// checkpointed).
    #[arg(long, default_value_t = 256)]
    woj_mib: u64,
    /// --mode woj: blocks per transaction (an fsync every this many writes).
    #[arg(long, default_value_t = 10)]
    woj_txn_blocks: usize,
    /// --mode woj: configurations to run (none, blake3, woj, both).
    #[arg(long, default_value = "none,blake3,woj,both")]
    woj_configs: String,
    /// Percent of 4 KiB blocks that duplicate an earlier block (drawn from the working set).
    #[arg(long, default_value_t = 75.0)]
    dup: f64,
    /// Percent of a unique block's bytes LZ4 saves.
    #[arg(long, default_value_t = 50.0)]
    compress: f64,
    /// Percent of all-zero blocks.
    #[arg(long, default_value_t = 0.0)]
    zero: f64,
    /// Duplicates are drawn from this much preceding data (default: all of it).
    #[arg(long)]
    working_set: Option<String>,
    /// Seed of the generated data.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Bytes written by `seq` scenarios.
    #[arg(long, default_value = "1G")]
    size: String,
    /// Writer threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Request size of `seq` and `ingest`.
    #[arg(long, default_value = "128K")]
    request_size: String,
    /// Logical range of `overwrite`.
    #[arg(long, default_value = "4G")]
    range: String,
    /// Timed 4 KiB writes of `overwrite`.
    #[arg(long, default_value_t = 400_000)]
    writes: u64,
    /// Input file(s) of `ingest` (e.g. uncompressed Linux kernel source tars); repeat the
    /// flag for several files, each placed at the next 4 KiB-aligned offset.
    #[arg(long)]
    file: Vec<PathBuf>,
    /// Directory for the volume and the baseline files (default: the system temp dir).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Use this file or block device for the volume (and then the baselines) instead of
    /// temp files in --dir. Its contents are destroyed, so one holding a volume or any
    /// other data is refused without --force; the path is kept afterwards.
    #[arg(long)]
    volume: Option<PathBuf>,
    /// Let --volume overwrite a path that holds a volume or other data.
    #[arg(long, requires = "volume")]
    force: bool,
    /// Compression of the engine volume: zstd, zstd:LEVEL, lz4 or none.
    #[arg(long, default_value = "zstd")]
    compression: String,
    /// The engine volume's rest level (as `format`): after the timed phase, recompression
    /// at rest runs until done and its ratio is printed beside the timed one.
    #[arg(long)]
    rest_level: Option<String>,
    /// Overwrite mode: cleaner passes after the timed phase (each once over the data
    /// region), before the volume settles.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    final_clean_passes: u32,
    /// Overwrite mode: the live bytes (of 4096) a data block holds at most to be cleaned
    /// by those passes (default: the engine's, half a block). Higher reclaims more space
    /// for more writes.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    final_clean_live_max: Option<u32>,
    /// Write policy of the engine volume.
    #[arg(long, default_value = "async")]
    write_policy: String,
    /// Fingerprint index memory of the engine volume.
    #[arg(long, default_value = "256M")]
    index_memory: String,
    /// Duplicate verification of the engine volume (bytes or hash; default: the engine's).
    #[arg(long)]
    verify: Option<String>,
    /// How the volumes and the raw baseline do I/O: auto (the engine's default: direct for
    /// hash verification, buffered for bytes), direct (O_DIRECT) or buffered (page cache).
    #[arg(long, default_value = "auto")]
    io: String,
    /// Combine small writes of concurrent writers into batches (on or off).
    #[arg(long, default_value = "off")]
    batch: String,
    /// How long a batch may wait for more requests, in microseconds (0: it closes at once).
    #[arg(long, default_value_t = 0)]
    batch_wait_us: u64,
    /// Predict unique chunks so their compression runs beside fingerprinting (on or off).
    #[arg(long, default_value = "off")]
    predictor: String,
    /// Deferred compression's budget in microseconds (0: never defer; see `serve
    /// --defer-compression-us`).
    #[arg(long, default_value_t = 0)]
    defer_us: u64,
    /// Threads of the engine volume's parallel stages, exactly (default: the process's
    /// pool, one per core); --mode scaling: the most it tries (default: one per core).
    #[arg(long)]
    workers: Option<usize>,
    /// --mode scaling: rounds, each running every worker count once.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Batches in the pipeline's stages at once.
    #[arg(long, default_value_t = dedupvol_core::BatchOptions::default().leaders_max)]
    batch_leaders: usize,
    /// Skip the no-reduction volume and raw-file baselines.
    #[arg(long)]
    no_baseline: bool,
    /// Skip the disk sequential-write measurement.
    #[arg(long)]
    no_disk: bool,
    /// --mode stripe: data devices of the striped volume (and independent volumes).
    #[arg(long, default_value_t = 4)]
    data_devices: usize,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct GenArgs {
    /// A preset (its data: write-low, write-medium, write-high, mixed-medium, sql, vdi);
    /// --dup/--compress/--zero override it.
    #[arg(long)]
    preset: Option<String>,
    /// Percent duplicates.
    #[arg(long)]
    dup: Option<f64>,
    /// Percent compressible (LZ4 savings on unique blocks).
    #[arg(long)]
    compress: Option<f64>,
    /// Percent zero blocks.
    #[arg(long)]
    zero: Option<f64>,
    /// Duplicates are drawn from this much preceding data (default: all of it).
    #[arg(long)]
    working_set: Option<String>,
    /// Bytes to write (rounded up to 4 KiB).
    #[arg(long)]
    size: String,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output file.
    #[arg(short = 'o', long)]
    output: PathBuf,
    /// Print the generated data's description as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct EstimateArgs {
    /// Files or block devices.
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    /// Chunk size: 4K, 8K, 16K or 32K (the engine uses 4K).
    #[arg(long, default_value = "4K")]
    chunk_size: String,
    /// Compression of the modelled volume: zstd, zstd:LEVEL, lz4 or none (as `format`).
    #[arg(long, default_value = "zstd")]
    compression: String,
    /// Also price other ways of storing the compressed data: 4 KiB fragments in 512-byte
    /// sectors or byte for byte, 16/64/128 KiB compressed extents, and (zstd) data at rest:
    /// 64 KiB extents, and 16 KiB extents with a dictionary trained from the data (4K
    /// chunks only).
    #[arg(long)]
    policies: bool,
    /// Also import the data into a temporary volume and compare with the engine's stats.
    #[arg(long)]
    compare_engine: bool,
    /// Directory for the temporary volume of --compare-engine.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

impl WorkloadCommand {
    pub fn run(self) -> anyhow::Result<ExitCode> {
        match self {
            WorkloadCommand::Bench(a) => run_bench(*a),
            WorkloadCommand::Gen(a) => run_gen(a),
            WorkloadCommand::Estimate(a) => run_estimate(a),
        }
    }
}

fn pct(name: &str, v: f64) -> anyhow::Result<f64> {
    if !(0.0..=100.0).contains(&v) {
        usage_bail!("--{name} {v} must be a percentage between 0 and 100");
    }
    Ok(v / 100.0)
}

fn working_set_blocks(ws: &Option<String>) -> anyhow::Result<u64> {
    match ws {
        None => Ok(u64::MAX),
        Some(s) => {
            let b = parse_size(s).map_err(|e| crate::usage(format!("--working-set {s}: {e}")))?;
            if b < 4096 {
                usage_bail!("--working-set {s} must be at least 4K");
            }
            Ok(b / 4096)
        }
    }
}

/// A size option (K/M/G/T suffixes); a malformed one is a usage error.
fn size_arg(name: &str, s: &str) -> anyhow::Result<u64> {
    parse_size(s).map_err(|e| crate::usage(format!("--{name} {s}: {e}")))
}

fn run_bench(a: BenchArgs) -> anyhow::Result<ExitCode> {
    if a.mode == BenchMode::Woj {
        if a.woj_mib == 0 || a.woj_mib > 8192 || !(1..=1000).contains(&a.woj_txn_blocks) {
            usage_bail!("--woj-mib must be 1..8192 and --woj-txn-blocks 1..1000");
        }
        let (compression, level) = dedupvol_core::parse_compression(&a.compression)
            .map_err(|e| crate::usage(format!("--compression: {e}")))?;
        crate::woj_bench::run(a.woj_mib, a.woj_txn_blocks, &a.woj_configs, compression, level)?;
        return Ok(ExitCode::SUCCESS);
    }
    if a.mode == BenchMode::Stripe {
        return run_stripe_bench(&a);
    }
    if let (Some(p), false) = (&a.volume, a.force) {
        refuse_if_holding_data(p)?;
    }
    let dir = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    if !dir.is_dir() {
        bail!("--dir {} is not a directory", dir.display());
    }
    if a.threads == 0 || a.threads > 256 {
        usage_bail!("--threads {} must be between 1 and 256", a.threads);
    }
    let request_bytes = size_arg("request-size", &a.request_size)?;
    if request_bytes == 0 || request_bytes % 4096 != 0 || request_bytes > 64 << 20 {
        usage_bail!("--request-size {} must be a multiple of 4K up to 64M", a.request_size);
    }
    let (compression, compression_level) =
        dedupvol_core::parse_compression(&a.compression).map_err(|e| crate::usage(format!("--compression: {e}")))?;
    let write_policy: WritePolicy = a.write_policy.parse().map_err(|e| crate::usage(format!("--write-policy: {e}")))?;
    let size = size_arg("size", &a.size)?;
    if size < 4096 {
        usage_bail!("--size {} must be at least 4K", a.size);
    }
    let range = size_arg("range", &a.range)?;
    if range < 4096 || range % 4096 != 0 {
        usage_bail!("--range {} must be a non-zero multiple of 4K", a.range);
    }
    // The scenarios generate their data in memory before the clock starts (so the timed run
    // measures the engine, not the generator): a size the machine cannot hold is refused
    // here, not met with an allocation abort.
    let held_bytes = match a.mode {
        BenchMode::Seq => size,
        BenchMode::Targets => size.max(a.writes.saturating_mul(4096)),
        BenchMode::Overwrite => a.writes.saturating_mul(4096),
        BenchMode::Scaling if a.file.is_empty() => size,
        BenchMode::Ingest | BenchMode::Primitives | BenchMode::Woj | BenchMode::Stripe | BenchMode::Scaling => 0,
    };
    if let Some(avail) = crate::memory::mem_available_bytes() {
        if held_bytes > avail {
            bail!(
                "this run generates {held_bytes} bytes of data in memory (--size, --writes x 4K), more than the \
                 {avail} bytes available"
            );
        }
    }
    let mut spec = DataSpec::new(pct("dup", a.dup)?, pct("compress", a.compress)?, a.seed);
    spec.zero_fraction = pct("zero", a.zero)?;
    spec.working_set_blocks = working_set_blocks(&a.working_set)?;
    spec.validate().map_err(crate::usage)?;
    let verify: DedupVerify = match &a.verify {
        Some(v) => v.parse().map_err(|e| crate::usage(format!("--verify: {e}")))?,
        None => FormatOptions::default().verify,
    };
    let opts = BenchOptions {
        dir: dir.clone(),
        target_path: a.volume.clone(),
        threads: a.threads,
        request_bytes: request_bytes as usize,
        compression,
        compression_level,
        rest_level: a.rest_level.as_deref().map(crate::volume_cmds::parse_rest_level).transpose()?,
        final_clean_passes: a.final_clean_passes as usize,
        final_clean_live_max: a.final_clean_live_max,
        write_policy,
        baselines: !a.no_baseline,
        reference: true,
        index_memory_bytes: size_arg("index-memory", &a.index_memory)?,
        verify,
        io_mode: a
            .io
            .parse::<IoMode>()
            .map_err(|e| crate::usage(format!("--io: {e}")))?
            .for_verify(verify == DedupVerify::Hash),
        verbose: !a.json,
        defer_compression_micros: a.defer_us,
        workers: a.workers,
        unique_predictor: match a.predictor.as_str() {
            "on" => true,
            "off" => false,
            other => return Err(crate::usage(format!("--predictor: expected on or off, got {other:?}"))),
        },
        batch: dedupvol_core::BatchOptions {
            enabled: match a.batch.as_str() {
                "on" => true,
                "off" => false,
                other => return Err(crate::usage(format!("--batch: expected on or off, got {other:?}"))),
            },
            wait_micros: a.batch_wait_us,
            leaders_max: a.batch_leaders,
            ..Default::default()
        },
    };
    let mb = |v: f64| Some(Target { min: v, unit: "MB/s".into() });
    let mut scenarios: Vec<(String, Scenario, Option<Target>)> = Vec::new();
    let overwrite = |data: DataSpec| Scenario::Overwrite { data, range_bytes: range, writes: a.writes };
    match a.mode {
        BenchMode::Seq => scenarios.push((
            format!("seq-dup{}-comp{}", a.dup, a.compress),
            Scenario::Seq { data: spec.clone(), size_bytes: size },
            None,
        )),
        BenchMode::Primitives | BenchMode::Woj | BenchMode::Stripe => {}
        BenchMode::Scaling => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let max = a.workers.unwrap_or(cores);
            if a.json {
                usage_bail!("--mode scaling prints tables only (no --json)");
            }
            if !(2..=8).contains(&max) || !(1..=20).contains(&a.rounds) {
                usage_bail!(
                    "--mode scaling needs --workers 2..8 (default: the cores, here {cores}) and --rounds 1..20"
                );
            }
            let (name, sc) = if a.file.is_empty() {
                (format!("seq-dup{}-comp{}", a.dup, a.compress), Scenario::Seq { data: spec.clone(), size_bytes: size })
            } else {
                ("ingest".to_string(), Scenario::Ingest { paths: a.file.clone() })
            };
            let sample = bench::scenario_sample(&sc).map_err(anyhow::Error::msg)?;
            crate::scale_bench::run(&name, &sc, &opts, max, a.rounds, &sample)?;
            return Ok(ExitCode::SUCCESS);
        }
        BenchMode::Overwrite => scenarios.push(("overwrite-4k".into(), overwrite(spec.clone()), None)),
        BenchMode::Ingest => {
            if a.file.is_empty() {
                usage_bail!("--mode ingest needs --file PATH");
            }
            scenarios.push(("ingest".into(), Scenario::Ingest { paths: a.file.clone() }, None));
        }
        BenchMode::Targets => {
            scenarios.push((
                "dup75-comp50".into(),
                Scenario::Seq { data: DataSpec::new(0.75, 0.5, a.seed), size_bytes: size },
                mb(1000.0),
            ));
            scenarios.push((
                "unique-incompressible".into(),
                Scenario::Seq { data: DataSpec::new(0.0, 0.0, a.seed), size_bytes: size },
                mb(600.0),
            ));
            if a.file.is_empty() {
                eprintln!("dedupvol bench: no --file given: the kernel-tar ingest target is skipped");
            } else {
                scenarios.push(("ingest-file".into(), Scenario::Ingest { paths: a.file.clone() }, mb(400.0)));
            }
            scenarios.push((
                "overwrite-4k".into(),
                overwrite(spec.clone()),
                Some(Target { min: 100_000.0, unit: "writes/s".into() }),
            ));
        }
    }
    if !a.json {
        let disk = if a.no_disk { "" } else { "the disk and " };
        eprintln!("dedupvol bench: measuring {disk}{} scenario(s) in {} …", scenarios.len(), dir.display());
    }
    let disk_seq_write = if a.no_disk { None } else { Some(bench::disk_seq(&dir).map_err(anyhow::Error::msg)?) };
    let mut results = Vec::new();
    if a.mode == BenchMode::Primitives {
        results.push(
            bench::primitives_only(&format!("dup{}-comp{}", a.dup, a.compress), &spec).map_err(anyhow::Error::msg)?,
        );
    }
    for (name, sc, target) in &scenarios {
        if !a.json {
            eprintln!("  running {name} …");
        }
        results.push(bench::run_scenario(name, sc, target.clone(), &opts).map_err(anyhow::Error::msg)?);
    }
    let report = BenchReport {
        date: bench::utc_now(),
        machine: bench::machine_description(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        options: opts,
        disk_seq_write,
        scenarios: results,
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        out!("{}", render_bench(&report))?;
    }
    // A scenario whose engine run failed is an operation error (the table says which).
    let failed = report.scenarios.iter().any(|s| s.engine_error.is_some());
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

/// `bench --mode stripe` (see `stripe_bench`).
fn run_stripe_bench(a: &BenchArgs) -> anyhow::Result<ExitCode> {
    let max = dedupvol_core::format::DATA_DEVICES_MAX;
    if !(2..=max).contains(&a.data_devices) {
        usage_bail!("--data-devices {} must be 2..={max}", a.data_devices);
    }
    let dir = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    if !dir.is_dir() {
        bail!("--dir {} is not a directory", dir.display());
    }
    let (compression, compression_level) =
        dedupvol_core::parse_compression(&a.compression).map_err(|e| crate::usage(format!("--compression: {e}")))?;
    let source = if a.file.is_empty() {
        let mut spec = DataSpec::new(pct("dup", a.dup)?, pct("compress", a.compress)?, a.seed);
        spec.zero_fraction = pct("zero", a.zero)?;
        spec.working_set_blocks = working_set_blocks(&a.working_set)?;
        let size = size_arg("size", &a.size)?.next_multiple_of(4096);
        let describe = spec.describe();
        let model = ContentModel::new(spec).map_err(crate::usage)?;
        crate::stripe_bench::Source::Generated(Box::new(model), size, describe)
    } else {
        crate::stripe_bench::Source::Files(a.file.clone())
    };
    let verify = FormatOptions::default().verify;
    let settings = crate::stripe_bench::Settings {
        devices: a.data_devices,
        dir,
        compression,
        compression_level,
        index_memory_bytes: size_arg("index-memory", &a.index_memory)?,
        io_mode: a
            .io
            .parse::<IoMode>()
            .map_err(|e| crate::usage(format!("--io: {e}")))?
            .for_verify(verify == DedupVerify::Hash),
    };
    if !a.json {
        eprintln!("dedupvol bench: striped against per-device dedup against one device, in {}", settings.dir.display());
    }
    let report = crate::stripe_bench::run(&source, &settings)?;
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        out!("{}", crate::stripe_bench::render(&report))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Refuses a `bench --volume` target that holds a dedupvol volume or any other data (the
/// bench formats it three times over); a missing, empty or all-zero target is fine.
fn refuse_if_holding_data(p: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::FileExt;
    let f = match std::fs::File::open(p) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("opening --volume {}", p.display())),
    };
    if f.metadata().is_ok_and(|m| m.is_dir()) {
        bail!("--volume {} is a directory", p.display());
    }
    let magic = dedupvol_core::format::SUPERBLOCK_MAGIC;
    let mut head = vec![0u8; magic.len()];
    let holds_volume = f.read_exact_at(&mut head, 0).is_ok() && head[..] == magic[..];
    let what =
        if holds_volume { Some("holds a dedupvol volume".to_string()) } else { crate::probe::foreign_content(p)? };
    if let Some(what) = what {
        bail!("--volume {} {what}; the benchmark would destroy it (pass --force to overwrite)", p.display());
    }
    Ok(())
}

fn run_gen(a: GenArgs) -> anyhow::Result<ExitCode> {
    let mut spec = match &a.preset {
        Some(p) => Workload::preset(p, a.seed).map_err(crate::usage)?.data,
        None => {
            if a.dup.is_none() && a.compress.is_none() {
                usage_bail!("give --preset ({}) or --dup/--compress", PRESET_NAMES.join(", "));
            }
            DataSpec::new(0.0, 0.0, a.seed)
        }
    };
    if let Some(d) = a.dup {
        spec.dup_fraction = pct("dup", d)?;
    }
    if let Some(c) = a.compress {
        spec.compress_fraction = pct("compress", c)?;
    }
    if let Some(z) = a.zero {
        spec.zero_fraction = pct("zero", z)?;
    }
    spec.working_set_blocks = working_set_blocks(&a.working_set)?;
    let size = match size_arg("size", &a.size)?.checked_next_multiple_of(4096) {
        Some(0) => usage_bail!("--size must be larger than zero"),
        Some(s) => s,
        None => usage_bail!("--size {} is too large", a.size),
    };
    let model = ContentModel::new(spec.clone()).map_err(crate::usage)?;
    // A size the file system cannot hold is refused before a byte is written: writing until
    // ENOSPC would fill the disk for everyone and leave a useless partial file.
    if let Some(free) = free_bytes_for(&a.output) {
        if size > free {
            bail!(
                "--size {} ({size} bytes) is more than the {free} bytes free where {} would be written",
                a.size,
                a.output.display()
            );
        }
    }
    let mut out = std::fs::File::create(&a.output).with_context(|| format!("creating {}", a.output.display()))?;
    const STEP_BYTES: u64 = 8 << 20;
    let mut buf = vec![0u8; STEP_BYTES as usize];
    let start = Instant::now();
    let mut done = 0u64;
    let written = (|| -> anyhow::Result<()> {
        while done < size {
            let n = (size - done).min(STEP_BYTES) as usize;
            model.fill_range(done / 4096, &mut buf[..n]);
            out.write_all(&buf[..n]).with_context(|| format!("writing {}", a.output.display()))?;
            done += n as u64;
        }
        out.sync_all().with_context(|| format!("syncing {}", a.output.display()))
    })();
    if let Err(e) = written {
        // A partial regular file is of no use (a device or pipe is left alone).
        if std::fs::metadata(&a.output).is_ok_and(|m| m.is_file()) {
            let _ = std::fs::remove_file(&a.output);
        }
        return Err(e);
    }
    let secs = start.elapsed().as_secs_f64();
    if a.json {
        outln!(
            "{}",
            serde_json::json!({"output": a.output, "bytes": size, "data": spec, "random_bytes_per_block": model.random_bytes(), "seconds": secs})
        )?;
    } else {
        outln!("wrote {} MiB to {} in {:.2} s: {}", size >> 20, a.output.display(), secs, spec.describe())?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Bytes free for an unprivileged writer where `output` would be created, or `None` when
/// `output` is not a regular file (a device, a pipe) or the file system cannot say.
fn free_bytes_for(output: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let existing = match std::fs::metadata(output) {
        Ok(m) if !m.is_file() => return None,
        Ok(m) => m.len(),
        Err(_) => 0,
    };
    let dir = match output.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes one struct into `st`; `c` is a valid NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    // The file being replaced gives its blocks back when it is truncated.
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64).saturating_add(existing))
}

/// What the engine achieved on the same bytes, for `estimate --compare-engine`.
#[derive(serde::Serialize)]
struct EngineComparison {
    logical_bytes_used: u64,
    physical_data_bytes_used: u64,
    reduction_ratio: f64,
    savings_zero_bytes: u64,
    savings_dedup_bytes: u64,
    savings_compression_bytes: u64,
    estimate_error_percent: f64,
    import_mb_s: f64,
}

fn run_estimate(a: EstimateArgs) -> anyhow::Result<ExitCode> {
    let chunk = size_arg("chunk-size", &a.chunk_size)? as usize;
    let (compression, compression_level) =
        dedupvol_core::parse_compression(&a.compression).map_err(|e| crate::usage(format!("--compression: {e}")))?;
    let mut est = Estimator::new(EstimateOptions {
        chunk_bytes: chunk,
        compression,
        compression_level,
        policies: a.policies,
        ..Default::default()
    })
    .map_err(|e| crate::usage(format!("--chunk-size {}: {e}", a.chunk_size)))?;
    for p in &a.paths {
        est.scan_path(p).map_err(anyhow::Error::msg)?;
    }
    let report = est.finish();
    let cmp = if a.compare_engine {
        if chunk != 4096 {
            usage_bail!("--compare-engine needs --chunk-size 4K (the engine's chunk)");
        }
        Some(compare_engine(&a.paths, &report, a.dir.as_deref())?)
    } else {
        None
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&serde_json::json!({"estimate": report, "engine": cmp}))?)?;
    } else {
        out!("{}", render_estimate(&report))?;
        if let Some(c) = &cmp {
            let mut t = Table::new(&["", "estimate", "engine"]);
            let mib = |b: u64| format!("{:.1}", b as f64 / 1048576.0);
            t.row(vec![
                "reduction ratio".into(),
                num(Some(report.reduction_ratio), 3),
                num(Some(c.reduction_ratio), 3),
            ]);
            t.row(vec!["physical MiB".into(), mib(report.physical_bytes), mib(c.physical_data_bytes_used)]);
            t.row(vec!["zero saved MiB".into(), mib(report.savings_zero_bytes), mib(c.savings_zero_bytes)]);
            t.row(vec!["dedup saved MiB".into(), mib(report.savings_dedup_bytes), mib(c.savings_dedup_bytes)]);
            t.row(vec![
                "compression saved MiB".into(),
                mib(report.savings_compression_bytes),
                mib(c.savings_compression_bytes),
            ]);
            outln!(
                "\nestimate vs engine (same bytes imported into a fresh {} volume at {:.0} MB/s):\n{}physical-size error of the estimate: {:+.2}%",
                dedupvol_core::compression_name(report.compression, report.compression_level),
                c.import_mb_s,
                t.render(),
                c.estimate_error_percent
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Imports `paths` (each at the next 4 KiB-aligned offset) into a fresh volume and reads
/// back its stats.
fn compare_engine(paths: &[PathBuf], report: &EstimateReport, dir: Option<&Path>) -> anyhow::Result<EngineComparison> {
    let dir = dir.map(Path::to_path_buf).unwrap_or_else(std::env::temp_dir);
    let vol_path = dir.join(format!(".dedupvol-estimate-{}", std::process::id()));
    struct Rm(PathBuf);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _rm = Rm(vol_path.clone());
    let logical = report.scanned_bytes.max(4096);
    let physical = logical + (1 << 30);
    let dev: Arc<dyn Storage> = Arc::new(FileStorage::create(&vol_path, Some(physical))?);
    let fmt = FormatOptions {
        logical_size_bytes: logical,
        index_memory_bytes: 256 << 20,
        compression: report.compression,
        compression_level: report.compression_level,
        ..FormatOptions::default()
    };
    Volume::format(dev, None, &fmt, true).with_context(|| format!("formatting {}", vol_path.display()))?;
    let dev: Arc<dyn Storage> = Arc::new(FileStorage::open(&vol_path, false)?);
    let vol = Volume::open(dev, None, &OpenOptions::default()).with_context(|| "opening the comparison volume")?;
    let start = Instant::now();
    let mut off = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for p in paths {
        let mut f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
        loop {
            let mut filled = 0;
            while filled < buf.len() {
                let n = std::io::Read::read(&mut f, &mut buf[filled..])
                    .with_context(|| format!("reading {}", p.display()))?;
                if n == 0 {
                    break;
                }
                filled += n;
            }
            if filled == 0 {
                break;
            }
            let padded = filled.div_ceil(4096) * 4096;
            buf[filled..padded].fill(0);
            vol.write(off, &buf[..padded], false).with_context(|| format!("writing at {off}"))?;
            off += padded as u64;
            if filled < buf.len() {
                break;
            }
        }
    }
    vol.flush()?;
    let secs = start.elapsed().as_secs_f64();
    let s = vol.stats();
    vol.close()?;
    let err = if s.physical_data_bytes_used > 0 {
        (report.physical_bytes as f64 / s.physical_data_bytes_used as f64 - 1.0) * 100.0
    } else {
        0.0
    };
    Ok(EngineComparison {
        logical_bytes_used: s.logical_bytes_used,
        physical_data_bytes_used: s.physical_data_bytes_used,
        reduction_ratio: s.reduction_ratio,
        savings_zero_bytes: s.savings.zero_bytes,
        savings_dedup_bytes: s.savings.dedup_bytes,
        savings_compression_bytes: s.savings.compression_bytes,
        estimate_error_percent: err,
        import_mb_s: off as f64 / secs / 1e6,
    })
}
