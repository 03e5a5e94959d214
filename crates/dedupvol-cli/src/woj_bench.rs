//! `dedupvol bench --mode woj`: the CPU cost of write-once journaling against BLAKE3
//! dedup, in process, on an in-memory volume (no NBD, no file system, no disk: what is
//! left is the engine's own CPU).
//!
//! The workload replays what ext4 `data=journal` sends a block device: transactions of
//! `--woj-txn-blocks` fresh random 4 KiB blocks, each written into a 64 MiB journal region
//! behind a jbd2 descriptor block and followed by a commit block and a flush (the fsync),
//! then, whenever the journal is half full, the checkpoint: every journaled block written
//! to its home location (sequential or random), and a flush. All data is generated before
//! the clock starts. Each configuration (none, BLAKE3 dedup, WOJ alone, both) runs on a
//! fresh volume (its in-memory device touched first) with the `--compression` given
//! (none: the WOJ paper's dedup-only setting; zstd: the engine's default); the process's
//! user+system CPU time comes from getrusage.

use dedupvol_core::{Compression, FormatOptions, MemStorage, OpenOptions, Storage, Volume, WojMode};
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Instant;

/// The journal region: 64 MiB at the front of the volume (16,384 journal blocks).
const JOURNAL_BYTES: u64 = 64 << 20;
const B: usize = 4096;
/// Runs per configuration; the one with the least CPU is reported.
const REPEATS: usize = 3;

/// User + system CPU seconds of this process (every thread), to the microsecond
/// (getrusage; /proc's clock ticks are 10 ms, a tenth of a small run's CPU).
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct it is given, which is plain data.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF and a valid pointer to a rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// One configuration's figures.
pub(crate) struct Row {
    pub(crate) name: &'static str,
    pub(crate) logical: u64,
    pub(crate) device: u64,
    pub(crate) cpu: f64,
    pub(crate) secs: f64,
    pub(crate) woj_hits: u64,
    pub(crate) dedup_hits: u64,
    pub(crate) pool_bytes: u64,
    pub(crate) index_bytes: u64,
}

fn jbd2_block(kind: u32, seq: u64) -> Vec<u8> {
    let mut b = vec![0u8; B];
    b[0..4].copy_from_slice(&0xC03B_3998u32.to_be_bytes());
    b[4..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&seq.to_be_bytes());
    b
}

/// Writes zeros over the whole in-memory device before the clock starts: it allocates and
/// zeroes its memory on a first write, a cost of this stand-in (page faults, up to a third
/// of the engine's CPU in a profile) that no real device has.
fn touch(dev: &MemStorage) -> std::io::Result<()> {
    let zeros = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < dev.len() {
        let n = (dev.len() - at).min(zeros.len() as u64) as usize;
        dev.write_at(&zeros[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

/// Runs one configuration over `data` (the application's blocks, in write order).
/// The data and settings every configuration runs with.
struct Setup<'a> {
    /// The application's blocks, in write order.
    data: &'a [u8],
    txn_blocks: usize,
    compression: Compression,
    level: i8,
}

fn run_config(name: &'static str, dedup: bool, woj: bool, s: &Setup<'_>, random_home: bool) -> anyhow::Result<Row> {
    let (data, txn_blocks) = (s.data, s.txn_blocks);
    let blocks = data.len() / B;
    let logical = JOURNAL_BYTES + (blocks as u64 * B as u64) * 2;
    let dev = Arc::new(MemStorage::new(logical + (256 << 20)));
    touch(&dev)?;
    let fopts = FormatOptions {
        logical_size_bytes: logical.div_ceil(1 << 20) << 20,
        compression: s.compression,
        compression_level: s.level,
        dedup,
        index_memory_bytes: 64 << 20,
        ..FormatOptions::default()
    };
    Volume::format(dev.clone() as Arc<dyn Storage>, None, &fopts, false)?;
    let oopts = OpenOptions {
        woj: if woj { WojMode::Range { offset: 0, len: JOURNAL_BYTES } } else { WojMode::Off },
        ..OpenOptions::default()
    };
    let v = Volume::open(dev as Arc<dyn Storage>, None, &oopts)?;
    v.wait_ready();
    let journal_blocks = (JOURNAL_BYTES as usize) / B;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(16);
    let home_base = JOURNAL_BYTES;
    let s0 = v.stats();
    let (c0, t0) = (cpu_seconds(), Instant::now());
    let mut cursor = 0usize;
    let mut pending: Vec<usize> = Vec::new();
    let mut seq = 0u64;
    let mut txn = Vec::with_capacity((txn_blocks + 1) * B);
    for first in (0..blocks).step_by(txn_blocks) {
        let n = txn_blocks.min(blocks - first);
        if cursor + n + 2 > journal_blocks {
            cursor = 0;
        }
        seq += 1;
        txn.clear();
        txn.extend_from_slice(&jbd2_block(1, seq));
        txn.extend_from_slice(&data[first * B..(first + n) * B]);
        v.write((cursor * B) as u64, &txn, false)?;
        v.write(((cursor + n + 1) * B) as u64, &jbd2_block(2, seq), false)?;
        v.flush()?;
        cursor += n + 2;
        pending.extend(first..first + n);
        // Checkpoint once half the journal holds transactions not checkpointed.
        if pending.len() * 2 >= journal_blocks || first + n == blocks {
            if random_home {
                for &b in &pending {
                    let home = rng.gen_range(0..blocks);
                    v.write(home_base + (home * B) as u64, &data[b * B..(b + 1) * B], false)?;
                }
            } else {
                let (lo, hi) = (pending[0], pending[pending.len() - 1] + 1);
                v.write(home_base + (lo * B) as u64, &data[lo * B..hi * B], false)?;
            }
            v.flush()?;
            pending.clear();
        }
    }
    let (cpu, secs) = (cpu_seconds() - c0, t0.elapsed().as_secs_f64());
    let s1 = v.stats();
    let w = s1.woj.clone().unwrap_or_default();
    let row = Row {
        name,
        logical: (s1.counters.blocks_written - s0.counters.blocks_written) * B as u64,
        device: s1.io.data_write.bytes - s0.io.data_write.bytes,
        cpu,
        secs,
        woj_hits: w.hits,
        dedup_hits: s1.counters.dedup_hits,
        pool_bytes: w.pool_bytes,
        index_bytes: if dedup { s1.index_memory_bytes } else { 0 },
    };
    v.close()?;
    Ok(row)
}

/// Single-core speed of the two fingerprints over `data`, in MB/s: BLAKE3-256, and xxh3-64
/// followed by the 4 KiB comparison that confirms a WOJ hit.
fn primitives(data: &[u8]) -> (f64, f64) {
    let t = Instant::now();
    let mut x = 0u8;
    for c in data.chunks_exact(B) {
        x ^= blake3::hash(c).as_bytes()[0];
    }
    let blake = data.len() as f64 / 1e6 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut y = 0u64;
    let mut prev: &[u8] = &data[..B];
    for c in data.chunks_exact(B) {
        y ^= xxhash_rust::xxh3::xxh3_64(c);
        y ^= u64::from(c == prev);
        prev = c;
    }
    let woj = data.len() as f64 / 1e6 / t.elapsed().as_secs_f64();
    std::hint::black_box((x, y));
    (blake, woj)
}

/// Runs every configuration and prints the tables.
pub(crate) fn run(
    mib: u64,
    txn_blocks: usize,
    configs: &str,
    compression: Compression,
    level: i8,
) -> anyhow::Result<()> {
    let blocks = (mib << 20) as usize / B;
    let mut data = vec![0u8; blocks * B];
    rand_chacha::ChaCha8Rng::seed_from_u64(7).fill(&mut data[..]);
    let (blake, woj) = primitives(&data);
    let lv = if level != 0 { format!(" level {level}") } else { String::new() };
    let setup = Setup { data: &data, txn_blocks, compression, level };
    println!("data: {mib} MiB of random 4 KiB blocks; journal region 64 MiB; {txn_blocks} blocks per transaction (an fsync every {txn_blocks} writes); compression {compression:?}{lv}; in-memory devices; least CPU of {REPEATS} runs per configuration\n");
    println!("| primitive (one core) | MB/s |\n|---|---|");
    println!("| BLAKE3-256 of 4 KiB | {blake:.0} |");
    println!("| xxh3-64 of 4 KiB + 4 KiB compare | {woj:.0} |");
    let chosen: Vec<(&'static str, bool, bool)> =
        [("none", false, false), ("blake3", true, false), ("woj", false, true), ("both", true, true)]
            .into_iter()
            .filter(|(name, _, _)| configs.split(',').any(|c| c == *name))
            .collect();
    // A discarded run first (thread pools, allocator arenas, first-touch page faults), of a
    // configuration asked for, so that a profile of one configuration holds only its code.
    if let Some(&(_, dedup, w)) = chosen.first() {
        run_config("warm-up", dedup, w, &setup, false)?;
    }
    for random_home in [false, true] {
        let mut rows: Vec<Row> = Vec::new();
        for &(name, dedup, w) in &chosen {
            // The least CPU of `REPEATS` runs: other processes on the machine only add.
            let mut best: Option<Row> = None;
            for _ in 0..REPEATS {
                let r = run_config(name, dedup, w, &setup, random_home)?;
                if best.as_ref().is_none_or(|b| r.cpu < b.cpu) {
                    best = Some(r);
                }
            }
            rows.extend(best);
        }
        // `none`'s CPU per byte it stored: what storing a byte costs without any reduction.
        let base = rows.iter().find(|r| r.name == "none").map(|r| r.cpu / r.device.max(1) as f64);
        println!("\n{} checkpoints:\n", if random_home { "random" } else { "sequential" });
        // What the reduction itself costs: the configuration's CPU less what storing the
        // bytes it stored costs at `none`'s rate, per GB written.
        let reduction = |r: &Row| base.map(|b| (r.cpu - b * r.device as f64) / (r.logical as f64 / 1e9));
        println!("| config | logical MiB | device MiB | saved | CPU s/GB | CPU s/GB of the reduction | MB/s (logical) | WOJ shares | dedup hits | pool bytes | index table bytes |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        for r in &rows {
            let per = r.cpu / (r.logical as f64 / 1e9);
            println!(
                "| {} | {:.1} | {:.1} | {:.1}% | {:.2} | {} | {:.0} | {} | {} | {} | {} |",
                r.name,
                r.logical as f64 / 1048576.0,
                r.device as f64 / 1048576.0,
                100.0 * (1.0 - r.device as f64 / r.logical as f64),
                per,
                reduction(r).map_or("-".into(), |x| format!("{x:.3}")),
                r.logical as f64 / 1e6 / r.secs,
                r.woj_hits,
                r.dedup_hits,
                r.pool_bytes,
                r.index_bytes
            );
        }
        let of = |n: &str| rows.iter().find(|r| r.name == n).and_then(reduction);
        if let (Some(b), Some(w)) = (of("blake3"), of("woj")) {
            println!("\nCPU of the reduction, BLAKE3 / WOJ: {:.1}x", b / w.max(1e-9));
        }
    }
    Ok(())
}
