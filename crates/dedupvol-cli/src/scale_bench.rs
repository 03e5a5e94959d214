//! `dedupvol bench --mode scaling`: how the write pipeline's parallel stages scale with
//! the threads they run on. The same scenario (generated `--dup`/`--compress` data, or
//! `--file`) is written into a fresh volume with exactly 1, 2, … `--workers` stage threads
//! (`OpenOptions::workers`: a large batch is hashed and compressed on those threads only,
//! never on the writers'), the worker counts taken in turn within each of `--rounds`
//! rounds, because this kind of machine drifts within minutes.
//!
//! Each worker count runs twice: once with the whole machine, and once with the process
//! confined to as many cores as it has workers. Why both: the work outside the stages (the
//! writers, index and placement under the state lock, the data writer, the kernel's direct
//! writes) runs on whatever core is free, so on a machine with few cores one worker
//! given every core is not a one-core baseline: its outside work has the other cores to
//! itself, and two workers then share those cores with it. The confined runs measure
//! throughput against cores; the unconfined ones, against stage threads.
//!
//! Beside it, the machine's own limit: the same per-chunk work (BLAKE3 and the volume's
//! codec on 4 KiB chunks of the scenario's data) on independent buffers, one thread
//! against N, with nothing shared. A pipeline cannot scale better than that.

use crate::affinity;
use dedupvol_workload::bench::{self, BenchOptions, Scenario};
use dedupvol_workload::table::Table;
use std::time::{Duration, Instant};

/// One run: workers, whether the process was confined to as many cores, MB/s, and the
/// stages' busy seconds (fingerprint, compress, index + place).
struct Run {
    workers: usize,
    confined: bool,
    mb_s: f64,
    busy: [f64; 3],
}

/// Runs the scaling benchmark and prints its tables.
pub fn run(
    name: &str,
    scenario: &Scenario,
    opts: &BenchOptions,
    workers_max: usize,
    rounds: usize,
    sample: &[u8],
) -> anyhow::Result<()> {
    let mut runs: Vec<Run> = Vec::new();
    // The machine's limit is measured in every round, beside the runs it bounds.
    let mut limits: Vec<Vec<f64>> = Vec::new();
    let cpus = affinity::allowed()?;
    if cpus.len() < workers_max {
        eprintln!("  this process may use {} core(s): worker counts beyond that run with every core only", cpus.len());
    }
    for round in 0..rounds {
        eprintln!("  round {} of {rounds}: the machine's limit …", round + 1);
        limits.push(machine_limit(sample, workers_max, opts.compression, opts.compression_level));
        let kinds = (1..=workers_max).flat_map(|w| [(w, false), (w, true)]);
        for (workers, confined) in kinds.filter(|&(w, confined)| !confined || w <= cpus.len()) {
            let mut o = opts.clone();
            o.workers = Some(workers);
            o.baselines = false;
            // The machine's limit is measured above, on the same sample; the estimate and
            // the one-core primitives would only be repeated for every run.
            o.reference = false;
            o.verbose = false;
            let on = if confined { format!(" on {workers} core(s)") } else { String::new() };
            eprintln!("  round {} of {rounds}: {workers} worker(s){on} …", round + 1);
            if confined {
                affinity::confine(cpus.get(..workers).unwrap_or(&cpus))?;
            }
            let r = bench::run_scenario(name, scenario, None, &o).map_err(anyhow::Error::msg);
            // Every core again before anything else runs, whatever the run's outcome.
            affinity::confine(&cpus)?;
            let r = r?;
            if let Some(e) = r.engine_error {
                anyhow::bail!("the engine run with {workers} worker(s) failed: {e}");
            }
            let mb_s = r.engine.map(|e| e.mb_s).unwrap_or(0.0);
            let busy = r.stats.as_ref().map_or([0.0; 3], |s| {
                let p = &s.pipeline;
                [
                    p.fingerprint.busy_micros as f64 / 1e6,
                    p.compress.busy_micros as f64 / 1e6,
                    (p.index.busy_micros + p.place.busy_micros) as f64 / 1e6,
                ]
            });
            runs.push(Run { workers, confined, mb_s, busy });
        }
    }
    println!(
        "## {name}: {} writer(s), {} KiB requests, {rounds} round(s) interleaved\n",
        opts.threads,
        opts.request_bytes >> 10
    );
    for confined in [false, true] {
        let title = if confined {
            "workers confined to as many cores (throughput against cores)"
        } else {
            "workers with every core (throughput against stage threads)"
        };
        println!("### {title}\n");
        println!("{}", scaling_table(&runs, confined, workers_max, &limits).render());
    }
    println!(
        "machine limit: BLAKE3 on 4 KiB chunks and {:?} on 64 KiB units of the same data, on N threads each with its own buffer, \
         against one thread (nothing shared: no pipeline scales better). Busy seconds: wall time a stage held work \
         (summed over batches in flight).",
        opts.compression
    );
    Ok(())
}

/// The table of one kind of run (confined or not): MB/s per worker count, against one
/// worker of the same kind, round by round.
fn scaling_table(runs: &[Run], confined: bool, workers_max: usize, limits: &[Vec<f64>]) -> Table {
    let kind: Vec<&Run> = runs.iter().filter(|r| r.confined == confined).collect();
    let mean_of = |w: usize, f: &dyn Fn(&Run) -> f64| {
        let v: Vec<f64> = kind.iter().copied().filter(|r| r.workers == w).map(f).collect();
        v.iter().sum::<f64>() / v.len().max(1) as f64
    };
    let base = mean_of(1, &|r| r.mb_s);
    let mut t = Table::new(&[
        "workers",
        "MB/s per round",
        "MB/s mean",
        "vs 1 worker",
        "per-round pairs vs 1 worker",
        "fingerprint busy s",
        "compress busy s",
        "index + place busy s",
        "machine limit per round",
    ]);
    for w in 1..=workers_max {
        let mine: Vec<&Run> = kind.iter().copied().filter(|r| r.workers == w).collect();
        if mine.is_empty() {
            // A confined count beyond the cores this process may use: not run.
            continue;
        }
        let ones: Vec<&Run> = kind.iter().copied().filter(|r| r.workers == 1).collect();
        let pairs: Vec<String> =
            mine.iter().zip(&ones).map(|(m, o)| format!("{:.2}", m.mb_s / o.mb_s.max(f64::MIN_POSITIVE))).collect();
        t.row(vec![
            w.to_string(),
            mine.iter().map(|r| format!("{:.0}", r.mb_s)).collect::<Vec<_>>().join(", "),
            format!("{:.0}", mean_of(w, &|r| r.mb_s)),
            format!("{:.2}x", mean_of(w, &|r| r.mb_s) / base.max(f64::MIN_POSITIVE)),
            pairs.join(", "),
            format!("{:.2}", mean_of(w, &|r| r.busy[0])),
            format!("{:.2}", mean_of(w, &|r| r.busy[1])),
            format!("{:.2}", mean_of(w, &|r| r.busy[2])),
            limits.iter().filter_map(|l| l.get(w - 1)).map(|x| format!("{x:.2}x")).collect::<Vec<_>>().join(", "),
        ]);
    }
    t
}

/// Speedup of N threads over one (index N - 1) doing the stages' per-chunk work on
/// independent copies of `sample`, for N in 1..=`max`.
fn machine_limit(sample: &[u8], max: usize, codec: dedupvol_core::Compression, level: i8) -> Vec<f64> {
    let sample = &sample[..sample.len() - sample.len() % (64 << 10)];
    if sample.is_empty() {
        return Vec::new();
    }
    // Per 64 KiB of data: sixteen 4 KiB fingerprints and probes, and one extent compressed
    // unless a block was found incompressible, as a sequential write of new data costs the
    // stages.
    let work = |buf: &[u8], until: Instant| -> u64 {
        let mut units = 0u64;
        for unit in buf.chunks_exact(64 << 10).cycle() {
            if Instant::now() >= until {
                break;
            }
            let mut raw = false;
            for c in unit.chunks_exact(4096) {
                std::hint::black_box(blake3::hash(c));
                raw |= dedupvol_core::incompressible(codec, c);
            }
            if !raw {
                std::hint::black_box(dedupvol_core::extent_size(codec, level, unit));
            }
            units += 1;
        }
        units
    };
    let span = Duration::from_millis(1500);
    let rate = |n: usize| -> f64 {
        let until = Instant::now() + span;
        let total: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|_| {
                    let copy = sample.to_vec();
                    s.spawn(move || work(&copy, until))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).sum()
        });
        total as f64
    };
    let one = rate(1).max(1.0);
    (1..=max).map(|n| if n == 1 { 1.0 } else { rate(n) / one }).collect()
}
