//! Trace commands: `trace generate` (an FIU-format trace with the FIU traces' reference
//! skew), `trace stats` (that skew, measured on any FIU trace) and `replay` (a trace against
//! a volume, a file or device, or an NBD server, with response times).
//!
//! These are thin: argument parsing and printing; the trace format and the generator live
//! in `dedupvol-workload`, the replayer in [`crate::replay`].

use crate::replay::{self, target, ReplayOptions, Timing};
use anyhow::Context;
use clap::{Args, Subcommand};
use dedupvol_core::parse_size;
use dedupvol_workload::trace::TraceReader;
use dedupvol_workload::trace_gen::{generate, TraceGenSpec};
use dedupvol_workload::trace_stats::RefStatsBuilder;
use std::io::BufWriter;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Subcommand)]
pub enum TraceCommand {
    /// Generate or inspect block traces in the FIU format.
    #[command(subcommand)]
    Trace(TraceSub),
    /// Replay an FIU block trace against a volume, a file or block device, or an NBD server,
    /// and print response times.
    Replay(ReplayArgs),
}

#[derive(Subcommand)]
pub enum TraceSub {
    /// Write an FIU-format trace whose reference skew matches the FIU traces (about 6% of
    /// unique chunks referenced more than 10 times; chunks referenced more than 5 times about
    /// 4.5% of the chunks but 42% of the accesses), and print its statistics.
    Generate(GenerateArgs),
    /// Print the reference-skew statistics of an FIU-format trace (generated or real).
    Stats(StatsArgs),
}

#[derive(Args)]
pub struct GenerateArgs {
    /// Output file.
    output: PathBuf,
    /// Records to write.
    #[arg(long)]
    ops: u64,
    /// Seed of every choice.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Percent of records that are reads.
    #[arg(long, default_value_t = 68.0)]
    read_pct: f64,
    /// Address space, in 4 KiB blocks.
    #[arg(long, default_value_t = 1 << 18)]
    blocks: u64,
    /// Mean request rate of the timestamps, per second (exponential inter-arrival times).
    #[arg(long, default_value_t = 2000.0)]
    iops: f64,
    /// Zipf exponent of the reads' skew over written addresses (0: uniform).
    #[arg(long, default_value_t = 0.8)]
    read_skew: f64,
    /// Print the statistics as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct StatsArgs {
    /// The trace file.
    trace: PathBuf,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ReplayArgs {
    /// The trace file (FIU format).
    trace: PathBuf,
    /// vol:PATH (a dedupvol volume, opened in this process), file:PATH (a file or block
    /// device), nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH.
    #[arg(long)]
    target: String,
    /// native: each request at its trace timestamp (relative to the first); fast: as fast as
    /// --queue-depth allows.
    #[arg(long, value_enum, default_value = "fast")]
    timing: Timing,
    /// Requests in flight (one worker thread each; one NBD connection each).
    #[arg(long, default_value_t = 8)]
    queue_depth: usize,
    /// Before the timed replay, write every block the trace reads before it writes it, with
    /// the content the read names (real traces read data written before they start).
    #[arg(long)]
    warmup_writes: bool,
    /// Replay only the first N records.
    #[arg(long)]
    limit_ops: Option<u64>,
    /// Compare read data with what the replay last wrote there (default: on for vol: and
    /// file: targets, off for NBD).
    #[arg(long, overrides_with = "no_verify")]
    verify: bool,
    /// Do not compare read data.
    #[arg(long, overrides_with = "verify")]
    no_verify: bool,
    /// Percent of a written block's bytes LZ4 saves (contents are made from the md5).
    #[arg(long, default_value_t = 50.0)]
    compress_pct: f64,
    /// file: targets: open with O_DIRECT.
    #[arg(long)]
    direct: bool,
    /// vol: targets: the separate metadata device (default: found from the superblock).
    #[arg(long)]
    meta_device: Option<PathBuf>,
    /// vol: targets: the content cache size (default: the engine's).
    #[arg(long)]
    cache_size: Option<String>,
    /// The hot-chunk tier of a `vol:` target.
    #[command(flatten)]
    tier: crate::volume_cmds::TierArgs,
    /// NBD targets: seconds one socket read or write may wait before the replay fails.
    #[arg(long, default_value_t = 60)]
    nbd_timeout: u64,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

impl TraceCommand {
    pub fn run(self) -> anyhow::Result<ExitCode> {
        match self {
            TraceCommand::Trace(TraceSub::Generate(a)) => run_generate(a),
            TraceCommand::Trace(TraceSub::Stats(a)) => run_stats(a),
            TraceCommand::Replay(a) => run_replay(a),
        }
    }
}

fn run_generate(a: GenerateArgs) -> anyhow::Result<ExitCode> {
    if !(0.0..100.0).contains(&a.read_pct) {
        usage_bail!("--read-pct {} must be at least 0 and below 100", a.read_pct);
    }
    if a.ops == 0 {
        usage_bail!("--ops must be at least 1");
    }
    let spec = TraceGenSpec {
        ops: a.ops,
        seed: a.seed,
        read_fraction: a.read_pct / 100.0,
        blocks: a.blocks,
        iops: a.iops,
        read_skew: a.read_skew,
        ..TraceGenSpec::new(a.ops, a.seed)
    };
    spec.validate().map_err(crate::usage)?;
    let file = std::fs::File::create(&a.output).with_context(|| format!("creating {}", a.output.display()))?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    let stats = generate(&spec, &mut out).with_context(|| format!("writing {}", a.output.display()))?;
    drop(out);
    if a.json {
        let v = serde_json::json!({ "output": a.output.display().to_string(), "spec": spec, "stats": stats });
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        outln!(
            "dedupvol trace generate — {}: {} records, seed {}, {:.0}% reads, {} blocks of 4 KiB ({} MiB), {} IOPS, read skew {}",
            a.output.display(),
            spec.ops,
            spec.seed,
            spec.read_fraction * 100.0,
            spec.blocks,
            (spec.blocks * 4096) >> 20,
            spec.iops,
            spec.read_skew
        )?;
        out!("{}", stats.render())?;
    }
    Ok(ExitCode::SUCCESS)
}

fn run_stats(a: StatsArgs) -> anyhow::Result<ExitCode> {
    let mut b = RefStatsBuilder::new();
    for r in TraceReader::open(&a.trace)? {
        b.add(&r?);
    }
    let stats = b.finish();
    if a.json {
        let v = serde_json::json!({ "trace": a.trace.display().to_string(), "stats": stats });
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        outln!("dedupvol trace stats — {}", a.trace.display())?;
        out!("{}", stats.render())?;
    }
    Ok(ExitCode::SUCCESS)
}

fn run_replay(a: ReplayArgs) -> anyhow::Result<ExitCode> {
    if a.queue_depth == 0 || a.queue_depth > replay::QUEUE_DEPTH_MAX {
        usage_bail!("--queue-depth {} must be between 1 and {}", a.queue_depth, replay::QUEUE_DEPTH_MAX);
    }
    if !(0.0..=99.0).contains(&a.compress_pct) {
        usage_bail!("--compress-pct {} must be between 0 and 99", a.compress_pct);
    }
    if a.nbd_timeout == 0 {
        usage_bail!("--nbd-timeout must be at least 1 second");
    }
    let content_cache_bytes = a
        .cache_size
        .as_deref()
        .map(|s| parse_size(s).map_err(|e| crate::usage(format!("--cache-size {s}: {e}"))))
        .transpose()?;
    // Before any thread starts: a signal then stops the replay at a request boundary, and
    // a volume target is flushed and closed rather than left to journal replay.
    crate::interrupt::watch()?;
    let vol =
        target::VolumeTargetOptions { meta_device: a.meta_device.clone(), content_cache_bytes, tier: a.tier.options() };
    let is_nbd = a.target.starts_with("nbd");
    let verify = if a.no_verify { false } else { a.verify || !is_nbd };
    // Fail on an unreadable trace before opening (and perhaps recovering) the target.
    std::fs::File::open(&a.trace).with_context(|| format!("opening trace {}", a.trace.display()))?;
    let t = target::open(&a.target, a.queue_depth, a.direct, &vol, Duration::from_secs(a.nbd_timeout))?;
    let opts = ReplayOptions {
        timing: a.timing,
        queue_depth: a.queue_depth,
        warmup_writes: a.warmup_writes,
        limit_ops: a.limit_ops,
        verify,
        compress_fraction: a.compress_pct / 100.0,
    };
    let report = replay::replay(&a.trace, t, &opts)?;
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        out!("{}", report.render())?;
    }
    match crate::interrupt::signal() {
        // As the shell reports a command a signal stopped, after the partial report.
        Some(sig) => Ok(ExitCode::from(u8::try_from(128 + sig).unwrap_or(1))),
        None => Ok(ExitCode::SUCCESS),
    }
}
