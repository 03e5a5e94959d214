//! `dedupvol-sim`: run one seed (`--seed N`), many (`--seeds N`, `--minutes M` soak), or act
//! as the child of the real-process crash test (`--child-writer FILE`).

use clap::Parser;
use dedupvol_sim::{run_seed, FaultKinds, RunStats, SimOptions, ToyVolume};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(name = "dedupvol-sim", about = "Deterministic crash and fault simulation of the dedupvol engine")]
struct Args {
    /// Run exactly this seed (add -v to see every operation).
    #[arg(long)]
    seed: Option<u64>,
    /// Run this many seeds (from --start).
    #[arg(long)]
    seeds: Option<u64>,
    /// First seed of a --seeds run.
    #[arg(long, default_value_t = 0)]
    start: u64,
    /// Stop a --seeds run after this many minutes (soak).
    #[arg(long)]
    minutes: Option<f64>,
    /// Fault kinds: all, none, or a comma list of crash, cache-loss, torn, destage, lost,
    /// misdirect, read-error, bitflip, read-flip, sb-copy, write-error.
    #[arg(long, default_value = "all")]
    faults: String,
    /// Workload operations per seed.
    #[arg(long, default_value_t = 400)]
    ops: u64,
    /// Engine: dedupvol (the real one), dedupvol-striped (the real one, its data region
    /// striped over parts of the data disk; no persistent data faults) or toy (the
    /// simulator's self-test engine).
    #[arg(long, default_value = "dedupvol")]
    engine: String,
    /// Print every operation.
    #[arg(long, short)]
    verbose: bool,
    /// Run the engine's in-memory audit after every operation (slow; diagnosis).
    #[arg(long)]
    audit_every_op: bool,
    /// Only block-aligned writes.
    #[arg(long)]
    no_partial_writes: bool,
    /// Let the engine write data batches from its background thread, as in production
    /// (runs are then not reproducible call for call).
    #[arg(long)]
    background_writes: bool,
    /// Duplicate contents compress, so hot blocks reach the reference cap in open packed blocks.
    #[arg(long)]
    compressible_duplicates: bool,
    /// Rewrite blocks found corrupt with their own content and require them to read back.
    #[arg(long)]
    heal_rewrites: bool,
    /// Percent of seeds run with write-once journaling on a random journal range.
    #[arg(long, default_value_t = dedupvol_sim::driver::WOJ_PCT_DEFAULT)]
    woj_pct: u32,
    /// Store every session's data with the other codec and run recompression passes
    /// (some with a crash inside) between operations.
    #[arg(long)]
    recompress: bool,
    /// Some writes are several small requests written as one batch (the batcher's path),
    /// with crashes anywhere in them.
    #[arg(long)]
    combined_writes: bool,
    /// Format volumes with random extent caps and change them between operations (some
    /// changes with a crash inside).
    #[arg(long)]
    extent_caps: bool,
    /// Stop at the first failing seed.
    #[arg(long)]
    fail_fast: bool,
    /// Run each seed twice and require identical I/O traces.
    #[arg(long)]
    check_determinism: bool,
    /// Child mode of the kill -9 test: format FILE (when absent), write and flush forever,
    /// print "flushed N" after each flush.
    #[arg(long, value_name = "FILE")]
    child_writer: Option<std::path::PathBuf>,
    /// First iteration of --child-writer.
    #[arg(long, default_value_t = 1)]
    child_start: u64,
    /// --child-writer prints "flushed N" without flushing (negative control of the test).
    #[arg(long, hide = true)]
    child_lie: bool,
}

fn run_one(engine: &str, seed: u64, opts: &SimOptions) -> Result<RunStats, dedupvol_sim::Failure> {
    if engine == "toy" {
        run_seed::<ToyVolume>(seed, opts)
    } else if engine == "dedupvol-striped" {
        run_seed::<dedupvol_sim::StripedVolume>(seed, opts)
    } else {
        run_seed::<dedupvol_core::Volume>(seed, opts)
    }
}

fn main() {
    let args = Args::parse();
    if let Some(path) = &args.child_writer {
        dedupvol_sim::kill9::child_writer(path, args.child_start, args.child_lie);
        return;
    }
    if !["toy", "dedupvol", "dedupvol-striped"].contains(&args.engine.as_str()) {
        eprintln!("unknown engine {:?} (dedupvol, dedupvol-striped or toy)", args.engine);
        std::process::exit(2);
    }
    let faults = match FaultKinds::parse(&args.faults) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let opts = SimOptions {
        faults,
        ops: args.ops,
        verbose: args.verbose,
        audit_every_op: args.audit_every_op,
        partial_writes: !args.no_partial_writes,
        background_writes: args.background_writes,
        compressible_duplicates: args.compressible_duplicates,
        heal_rewrites: args.heal_rewrites,
        woj_pct: args.woj_pct.min(100),
        recompress: args.recompress,
        combined_writes: args.combined_writes,
        extent_caps: args.extent_caps,
    };
    if let Some(seed) = args.seed {
        let opts = SimOptions { verbose: args.verbose, ..opts };
        match run_one(&args.engine, seed, &opts) {
            Ok(s) => {
                println!("seed {seed}: ok — {}", figures(&s));
                println!("trace {:#018x} content-trace {:#018x}", s.trace, s.content_trace);
            }
            Err(f) => {
                eprintln!("{f}");
                std::process::exit(1);
            }
        }
        return;
    }
    let count = args.seeds.unwrap_or(if args.minutes.is_some() { u64::MAX } else { 100 });
    let deadline = args.minutes.map(|m| Instant::now() + Duration::from_secs_f64(m * 60.0));
    let started = Instant::now();
    let mut total = RunStats::default();
    let mut failures = Vec::new();
    let mut seeds_run = 0u64;
    let mut nondeterministic = Vec::new();
    let mut content_differs = 0u64;
    let mut last_report = Instant::now();
    for seed in args.start..args.start.saturating_add(count) {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        seeds_run += 1;
        match run_one(&args.engine, seed, &opts) {
            Ok(s) => {
                if args.check_determinism {
                    if let Ok(s2) = run_one(&args.engine, seed, &opts) {
                        if s2.trace != s.trace {
                            eprintln!("seed {seed}: NOT REPRODUCIBLE (I/O trace {:#x} vs {:#x})", s.trace, s2.trace);
                            nondeterministic.push(seed);
                        } else if s2.content_trace != s.content_trace {
                            content_differs += 1;
                        }
                    }
                }
                total.add(&s);
            }
            Err(f) => {
                eprintln!("{f}");
                failures.push(f);
                if args.fail_fast {
                    break;
                }
            }
        }
        if last_report.elapsed() > Duration::from_secs(60) {
            last_report = Instant::now();
            println!(
                "[{:.0}s] seeds {seeds_run} failures {} — {}",
                started.elapsed().as_secs_f64(),
                failures.len(),
                figures(&total)
            );
        }
    }
    println!(
        "seeds run: {seeds_run} (from {}) in {:.1}s, engine {}, faults {}",
        args.start,
        started.elapsed().as_secs_f64(),
        args.engine,
        faults.to_arg()
    );
    println!("passed: {}  failed: {}", seeds_run - failures.len() as u64, failures.len());
    println!("{}", figures(&total));
    println!("faults injected: {}", total.faults.summary());
    println!("engine coverage: {:?}", total.coverage);
    if content_differs > 0 {
        println!("seeds whose I/O sequence repeated exactly but whose written bytes differed between two runs: {content_differs}");
    }
    if !nondeterministic.is_empty() {
        println!("non-reproducible seeds: {nondeterministic:?}");
    }
    for f in &failures {
        println!("FAILED seed {}: {}\n  replay: {}", f.seed, f.message, f.replay);
    }
    if !failures.is_empty() || !nondeterministic.is_empty() {
        std::process::exit(1);
    }
}

fn figures(s: &RunStats) -> String {
    format!(
        "ops={} writes={} reads={} flushes={} zeroings={} crashes={} (in recovery {}, in close {}) recoveries={} read_only_recoveries={} clean_checks={} blocks_verified={} corruption_detected={} stale_dedup_after_fault={} heals={} no_space={} restarts={} rebuild_steps={} (crashes in them {}, records rebuilt {}, pages skipped {}) cleaner_passes={} (crashes in them {}) recompress_passes={} (fragments {}, crashes in them {}) rest_level_changes={} extent_cap_changes={} (crashes in either {}) dictionaries_installed={} combined_writes={} io_calls={}",
        s.ops,
        s.writes,
        s.reads,
        s.flushes,
        s.zeroings,
        s.crashes,
        s.crashes_in_recovery,
        s.crashes_in_close,
        s.recoveries,
        s.read_only_recoveries,
        s.clean_checks,
        s.blocks_verified,
        s.corruption_detected,
        s.stale_dedup_after_fault,
        s.heals,
        s.no_space,
        s.restarts,
        s.rebuild_steps,
        s.crashes_in_rebuild,
        s.coverage.index_rebuild_records,
        s.coverage.index_rebuild_pages_skipped,
        s.cleaner_passes,
        s.crashes_in_clean,
        s.recompress_passes,
        s.fragments_recompressed,
        s.crashes_in_recompress,
        s.rest_level_changes,
        s.extent_cap_changes,
        s.crashes_in_tune,
        s.dictionaries_installed,
        s.combined_writes,
        s.io_calls
    )
}
