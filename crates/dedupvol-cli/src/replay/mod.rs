//! The trace replayer: issues the records of an FIU trace against a target and measures
//! response times.
//!
//! Steps:
//! 1. (`--warmup-writes`) A first pass over the trace finds the blocks read before the
//!    trace writes them; they are written, untimed, with the content the read's md5 names,
//!    then flushed — so a trace cut from a longer one reads real data.
//! 2. The dispatcher (this thread) reads records in order, turns each into a job of whole
//!    4 KiB blocks and hands it to `queue_depth` workers. With `native` timing it first
//!    waits for the record's time (relative to the first record); with `fast` it goes as
//!    soon as a slot is free.
//! 3. A worker fills write data from the record's md5, or reads and compares with what the
//!    replay last wrote there, and records the response time in its histograms.
//! 4. After the last completion, the target is flushed (timed apart) and closed.
//!
//! Invariants:
//! - Requests touching a common block never overlap in time: a job waits until every
//!   earlier job on its blocks has completed. So the order of the trace holds per block,
//!   and a read's expected content (taken at dispatch) is what the target must return.
//! - At most `queue_depth` jobs are in flight, and memory is bounded by the trace's
//!   distinct blocks (the expected-content map: about 40 bytes per block, only with
//!   verification or warmup), not its length.
//! - Equal content keys give byte-identical blocks and different keys different blocks
//!   (the key is stamped into the block), so the target dedups exactly where the trace has
//!   equal md5s. A one-block record whose md5 is that of 4 KiB of zeros is written as zeros.
//! - Response time runs from issue (fast) or from the scheduled time (native), so a
//!   target that falls behind the trace's pace shows it in the figures.
//! - The first failure (target error, verification mismatch, bad trace line) stops the
//!   replay and is reported with the trace file and line.
//! - SIGINT or SIGTERM (when the command watches them) stops dispatching; the requests in
//!   flight complete, the target is flushed and closed, and the report covers what ran.

pub mod target;

use anyhow::{anyhow, Context};
use dedupvol_workload::table::{num, Table};
use dedupvol_workload::trace::{TraceOp, TraceReader, TraceRecord, TRACE_BLOCK_BYTES};
use dedupvol_workload::{Content, ContentModel, DataSpec};
use hdrhistogram::Histogram;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use target::Target;

/// The md5 of 4 KiB of zeros: such a block is written as zeros, so zero detection works.
pub const ZERO_BLOCK_MD5: [u8; 16] =
    [0x62, 0x0f, 0x0b, 0x67, 0xa9, 0x1f, 0x7f, 0x74, 0x15, 0x1b, 0xc5, 0xbe, 0x74, 0x5b, 0x71, 0x10];
/// Most workers (requests in flight).
pub const QUEUE_DEPTH_MAX: usize = 256;
/// Longest response time the histograms hold, in nanoseconds (longer ones count as this).
pub const LATENCY_NS_MAX: u64 = 3_600_000_000_000;
/// Histogram precision: 3 significant digits (0.1% error on every percentile).
const LATENCY_SIGNIFICANT_DIGITS: u8 = 3;
/// Longest warmup write, in blocks (consecutive warmup blocks are coalesced up to it).
pub const WARMUP_RUN_BLOCKS_MAX: u64 = 256;
/// Longest sleep of native timing between checks for a stop signal.
const SLEEP_SLICE: Duration = Duration::from_millis(100);
/// Seed of the block contents: fixed, so every replay of a trace writes the same bytes.
const CONTENT_SEED: u64 = 0xF1_0B10C5;

/// When requests are issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Timing {
    /// At the trace's timestamps, relative to the first record.
    Native,
    /// As fast as the queue depth allows.
    Fast,
}

/// How to replay.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// When requests are issued.
    pub timing: Timing,
    /// Requests in flight (worker threads).
    pub queue_depth: usize,
    /// Write the blocks the trace reads before writing them, first.
    pub warmup_writes: bool,
    /// Replay only this many records.
    pub limit_ops: Option<u64>,
    /// Compare read data with what the replay last wrote.
    pub verify: bool,
    /// Share of a block's bytes LZ4 saves (0..1).
    pub compress_fraction: f64,
}

/// A block's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Zero,
    Key(u64),
}

fn block_of(rec: &TraceRecord, k: u64) -> Block {
    if rec.block_count() == 1 && rec.md5 == ZERO_BLOCK_MD5 {
        Block::Zero
    } else {
        Block::Key(rec.content_key(k))
    }
}

struct Job {
    line: u64,
    op: TraceOp,
    first_block: u64,
    /// Write: every block's content. Read: the expected content, where known.
    contents: Vec<Option<Block>>,
    /// Issue (fast) or scheduled (native) time.
    issued: Instant,
    timed: bool,
}

/// Jobs and blocks in flight.
#[derive(Default)]
struct Flight {
    jobs: usize,
    blocks: HashMap<u64, u32>,
}

struct Shared {
    flight: Mutex<Flight>,
    changed: Condvar,
    stop: AtomicBool,
    error: Mutex<Option<anyhow::Error>>,
}

/// Locks ignoring poison: a panicking worker is reported by its join, and the counters it
/// guarded are only used to wait, never trusted as results.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn fail(&self, e: anyhow::Error) {
        let mut slot = lock(&self.error);
        if slot.is_none() {
            *slot = Some(e);
        }
        self.stop.store(true, Ordering::SeqCst);
        self.changed.notify_all();
    }

    /// Waits for a free slot and for no in-flight job on `first..first+n`, then claims both.
    fn admit(&self, first: u64, n: u64, queue_depth: usize) {
        let mut f = lock(&self.flight);
        while !self.stop.load(Ordering::SeqCst)
            && (f.jobs >= queue_depth || (first..first + n).any(|b| f.blocks.contains_key(&b)))
        {
            f = self.changed.wait(f).unwrap_or_else(|e| e.into_inner());
        }
        f.jobs += 1;
        for b in first..first + n {
            *f.blocks.entry(b).or_insert(0) += 1;
        }
    }

    fn release(&self, first: u64, n: u64) {
        let mut f = lock(&self.flight);
        f.jobs -= 1;
        for b in first..first + n {
            if let Some(c) = f.blocks.get_mut(&b) {
                *c -= 1;
                if *c == 0 {
                    f.blocks.remove(&b);
                }
            }
        }
        self.changed.notify_all();
    }

    fn wait_idle(&self) {
        let mut f = lock(&self.flight);
        while f.jobs > 0 {
            f = self.changed.wait(f).unwrap_or_else(|e| e.into_inner());
        }
    }
}

fn histogram() -> Histogram<u64> {
    // Constant bounds, valid by construction (low >= 1, high >= 2 x low, 3 digits <= 5).
    Histogram::new_with_bounds(1, LATENCY_NS_MAX, LATENCY_SIGNIFICANT_DIGITS).expect("valid histogram bounds")
}

/// What one worker measured.
struct WorkerTally {
    reads: Histogram<u64>,
    writes: Histogram<u64>,
    read_bytes: u64,
    write_bytes: u64,
    verified_blocks: u64,
}

/// A 4 KiB-aligned buffer (O_DIRECT), grown to the largest request seen.
struct AlignedBuf {
    raw: Vec<u8>,
}

impl AlignedBuf {
    fn get(&mut self, len: usize) -> &mut [u8] {
        let align = TRACE_BLOCK_BYTES as usize;
        if self.raw.len() < len + align {
            self.raw = vec![0u8; len + align];
        }
        let off = self.raw.as_ptr().align_offset(align);
        &mut self.raw[off..off + len]
    }
}

struct WorkerCtx<'a> {
    id: usize,
    target: &'a dyn Target,
    shared: &'a Shared,
    model: &'a ContentModel,
    trace: &'a str,
}

fn fill_block(model: &ContentModel, b: Block, out: &mut [u8]) {
    match b {
        Block::Zero => out.fill(0),
        Block::Key(k) => model.fill(Content::Data(k), out),
    }
}

fn worker(ctx: WorkerCtx<'_>, rx: &Mutex<Receiver<Job>>) -> WorkerTally {
    let mut t =
        WorkerTally { reads: histogram(), writes: histogram(), read_bytes: 0, write_bytes: 0, verified_blocks: 0 };
    let mut buf = AlignedBuf { raw: Vec::new() };
    let mut expect = vec![0u8; TRACE_BLOCK_BYTES as usize];
    loop {
        let job = match lock(rx).recv() {
            Ok(j) => j,
            Err(_) => break,
        };
        let n = job.contents.len() as u64;
        if !ctx.shared.stop.load(Ordering::SeqCst) {
            if let Err(e) = run_job(&ctx, &job, &mut buf, &mut expect, &mut t) {
                let what = match job.op {
                    TraceOp::Read => "read",
                    TraceOp::Write => "write",
                };
                ctx.shared.fail(
                    e.context(format!("{}:{}: {what} of {n} blocks at block {}", ctx.trace, job.line, job.first_block)),
                );
            }
        }
        ctx.shared.release(job.first_block, n);
    }
    t
}

fn run_job(
    ctx: &WorkerCtx<'_>,
    job: &Job,
    buf: &mut AlignedBuf,
    expect: &mut [u8],
    t: &mut WorkerTally,
) -> anyhow::Result<()> {
    let bs = TRACE_BLOCK_BYTES as usize;
    let len = job.contents.len() * bs;
    let data = buf.get(len);
    let offset = job.first_block * TRACE_BLOCK_BYTES;
    match job.op {
        TraceOp::Write => {
            for (c, out) in job.contents.iter().zip(data.chunks_exact_mut(bs)) {
                fill_block(ctx.model, c.unwrap_or(Block::Zero), out);
            }
            ctx.target.write(ctx.id, offset, data)?;
            if job.timed {
                t.writes.saturating_record(job.issued.elapsed().as_nanos().min(u128::from(LATENCY_NS_MAX)) as u64);
                t.write_bytes += len as u64;
            }
        }
        TraceOp::Read => {
            ctx.target.read(ctx.id, offset, data)?;
            let elapsed = job.issued.elapsed();
            if job.timed {
                t.reads.saturating_record(elapsed.as_nanos().min(u128::from(LATENCY_NS_MAX)) as u64);
                t.read_bytes += len as u64;
            }
            for (k, (c, got)) in job.contents.iter().zip(data.chunks_exact(bs)).enumerate() {
                let Some(b) = c else { continue };
                fill_block(ctx.model, *b, expect);
                if got != expect {
                    let at = got.iter().zip(expect.iter()).position(|(a, b)| a != b).unwrap_or(0);
                    return Err(anyhow!(
                        "verification failed: block {} (byte offset {}) differs from what the replay last wrote there, first at byte {at} of the block",
                        job.first_block + k as u64,
                        (job.first_block + k as u64) * TRACE_BLOCK_BYTES
                    ));
                }
                t.verified_blocks += 1;
            }
        }
    }
    Ok(())
}

/// Response times of one kind of request.
#[derive(Debug, Clone, Serialize)]
pub struct OpSummary {
    /// Requests.
    pub ops: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Mean response time, in microseconds.
    pub mean_us: f64,
    /// Median, in microseconds.
    pub p50_us: f64,
    /// 99th percentile, in microseconds.
    pub p99_us: f64,
    /// Longest, in microseconds.
    pub max_us: f64,
}

impl OpSummary {
    fn of(h: &Histogram<u64>, bytes: u64) -> OpSummary {
        let us = |ns: f64| ns / 1000.0;
        if h.is_empty() {
            return OpSummary { ops: 0, bytes, mean_us: 0.0, p50_us: 0.0, p99_us: 0.0, max_us: 0.0 };
        }
        OpSummary {
            ops: h.len(),
            bytes,
            mean_us: us(h.mean()),
            p50_us: us(h.value_at_quantile(0.5) as f64),
            p99_us: us(h.value_at_quantile(0.99) as f64),
            max_us: us(h.max() as f64),
        }
    }
}

/// Everything a replay measured.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    /// The trace file.
    pub trace: String,
    /// The target.
    pub target: String,
    /// When requests were issued.
    pub timing: Timing,
    /// Requests in flight at most.
    pub queue_depth: usize,
    /// Whether reads were verified.
    pub verify: bool,
    /// Share of a written block's bytes LZ4 saves, in percent.
    pub compress_pct: f64,
    /// Records replayed (timed).
    pub records: u64,
    /// Records of size 0, skipped.
    pub empty_records: u64,
    /// Blocks written before the timed replay.
    pub warmup_blocks: u64,
    /// Time of the warmup writes and their flush, in seconds.
    pub warmup_seconds: f64,
    /// Read blocks compared with the expected bytes.
    pub verified_blocks: u64,
    /// Timed replay, first issue to last completion, in seconds.
    pub seconds: f64,
    /// The final flush, in seconds.
    pub flush_seconds: f64,
    /// Reads.
    pub reads: OpSummary,
    /// Writes.
    pub writes: OpSummary,
    /// Reads and writes together.
    pub all: OpSummary,
    /// A signal stopped the replay before the end of the trace.
    pub interrupted: bool,
    /// The engine's statistics after the replay (`vol:` targets; JSON only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<serde_json::Value>,
}

impl ReplayReport {
    /// The report as a table with a header and a summary line.
    pub fn render(&self) -> String {
        let mut t = Table::new(&["op", "ops", "MiB", "mean µs", "p50 µs", "p99 µs", "max µs"]);
        for (name, s) in [("read", &self.reads), ("write", &self.writes), ("all", &self.all)] {
            t.row(vec![
                name.into(),
                s.ops.to_string(),
                format!("{:.1}", s.bytes as f64 / (1u64 << 20) as f64),
                num(Some(s.mean_us), 1),
                num(Some(s.p50_us), 1),
                num(Some(s.p99_us), 1),
                num(Some(s.max_us), 1),
            ]);
        }
        let ops = self.all.ops;
        let rate = if self.seconds > 0.0 { ops as f64 / self.seconds } else { 0.0 };
        let mb_s = if self.seconds > 0.0 { self.all.bytes as f64 / 1e6 / self.seconds } else { 0.0 };
        let verify = if self.verify {
            format!("verification on ({} read blocks checked)", self.verified_blocks)
        } else {
            "verification off".into()
        };
        let warm = if self.warmup_blocks > 0 {
            format!("; warmup: {} blocks in {:.3} s (untimed)", self.warmup_blocks, self.warmup_seconds)
        } else {
            String::new()
        };
        let stopped = if self.interrupted { " — interrupted: the records before the signal" } else { "" };
        format!(
            "dedupvol replay — {} → {}{stopped}\ntiming {}, queue depth {}, {verify}, written blocks {:.0}% compressible (LZ4), 4 KiB blocks\n{}total: {ops} requests in {:.3} s ({rate:.0} requests/s, {mb_s:.1} MB/s); final flush {:.3} s{warm}\n",
            self.trace,
            self.target,
            match self.timing {
                Timing::Native => "native (trace timestamps)",
                Timing::Fast => "fast",
            },
            self.queue_depth,
            self.compress_pct,
            t.render(),
            self.seconds,
            self.flush_seconds,
        )
    }
}

/// Finds the blocks read before the trace writes them, with the content the read names.
fn warmup_blocks(path: &Path, limit: u64) -> anyhow::Result<BTreeMap<u64, Block>> {
    let mut written = HashSet::new();
    let mut warm = BTreeMap::new();
    for rec in TraceReader::open(path)?.take(limit as usize) {
        let rec = rec?;
        for k in 0..rec.block_count() {
            let b = rec.first_block() + k;
            match rec.op {
                TraceOp::Write => {
                    written.insert(b);
                }
                TraceOp::Read => {
                    if !written.contains(&b) {
                        warm.entry(b).or_insert_with(|| block_of(&rec, k));
                    }
                }
            }
        }
    }
    Ok(warm)
}

/// Replays the trace at `path` against `target` (closed at the end, also on failure).
pub fn replay(path: &Path, target: Box<dyn Target>, opts: &ReplayOptions) -> anyhow::Result<ReplayReport> {
    let result = replay_open(path, target.as_ref(), opts);
    let described = target.describe();
    let closed = target.close();
    let report = result?;
    closed.with_context(|| format!("closing {described}"))?;
    Ok(report)
}

fn replay_open(path: &Path, target: &dyn Target, opts: &ReplayOptions) -> anyhow::Result<ReplayReport> {
    let trace = path.display().to_string();
    let qd = opts.queue_depth.clamp(1, QUEUE_DEPTH_MAX);
    let limit = opts.limit_ops.unwrap_or(u64::MAX);
    let model = ContentModel::new(DataSpec::new(0.0, opts.compress_fraction, CONTENT_SEED))
        .map_err(|e| crate::usage(format!("--compress-pct: {e}")))?;
    let warm = if opts.warmup_writes { warmup_blocks(path, limit)? } else { BTreeMap::new() };
    let mut reader = TraceReader::open(path)?;
    let shared = Shared {
        flight: Mutex::new(Flight::default()),
        changed: Condvar::new(),
        stop: AtomicBool::new(false),
        error: Mutex::new(None),
    };
    let size = target.size_bytes();
    let (tx, rx) = sync_channel::<Job>(qd);
    let rx = Mutex::new(rx);
    let mut expected: HashMap<u64, Block> = HashMap::new();
    let keep_expected = opts.verify;

    let (tallies, outcome) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..qd)
            .map(|id| {
                let ctx = WorkerCtx { id, target, shared: &shared, model: &model, trace: &trace };
                let rx = &rx;
                s.spawn(move || worker(ctx, rx))
            })
            .collect();
        let outcome = dispatch(
            &mut reader,
            &tx,
            &shared,
            &warm,
            &mut expected,
            keep_expected,
            size,
            target,
            opts,
            qd,
            limit,
            &trace,
        );
        drop(tx);
        let tallies: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
        (tallies, outcome)
    });
    let mut reads = histogram();
    let mut writes = histogram();
    let (mut read_bytes, mut write_bytes, mut verified_blocks) = (0, 0, 0);
    for t in tallies {
        let t = t.map_err(|_| anyhow!("a replay worker panicked"))?;
        reads.add(&t.reads).map_err(|e| anyhow!("merging histograms: {e}"))?;
        writes.add(&t.writes).map_err(|e| anyhow!("merging histograms: {e}"))?;
        read_bytes += t.read_bytes;
        write_bytes += t.write_bytes;
        verified_blocks += t.verified_blocks;
    }
    if let Some(e) = lock(&shared.error).take() {
        return Err(e);
    }
    let d = outcome?;
    let f0 = Instant::now();
    target.flush()?;
    let flush_seconds = f0.elapsed().as_secs_f64();
    let mut all = histogram();
    all.add(&reads).map_err(|e| anyhow!("merging histograms: {e}"))?;
    all.add(&writes).map_err(|e| anyhow!("merging histograms: {e}"))?;
    Ok(ReplayReport {
        trace,
        target: target.describe(),
        timing: opts.timing,
        queue_depth: qd,
        verify: opts.verify,
        compress_pct: opts.compress_fraction * 100.0,
        records: d.records,
        empty_records: d.empty_records,
        warmup_blocks: warm.len() as u64,
        warmup_seconds: d.warmup.as_secs_f64(),
        verified_blocks,
        seconds: d.end.saturating_duration_since(d.start).as_secs_f64(),
        flush_seconds,
        reads: OpSummary::of(&reads, read_bytes),
        writes: OpSummary::of(&writes, write_bytes),
        all: OpSummary::of(&all, read_bytes + write_bytes),
        interrupted: d.interrupted,
        engine: target.engine_stats(),
    })
}

fn interrupted() -> bool {
    crate::interrupt::signal().is_some()
}

struct Dispatched {
    interrupted: bool,
    records: u64,
    empty_records: u64,
    warmup: Duration,
    start: Instant,
    end: Instant,
}

#[expect(clippy::too_many_arguments, reason = "the dispatcher's inputs are the replay's whole state")]
fn dispatch(
    reader: &mut TraceReader<std::io::BufReader<std::fs::File>>,
    tx: &SyncSender<Job>,
    shared: &Shared,
    warm: &BTreeMap<u64, Block>,
    expected: &mut HashMap<u64, Block>,
    keep_expected: bool,
    size: u64,
    target: &dyn Target,
    opts: &ReplayOptions,
    qd: usize,
    limit: u64,
    trace: &str,
) -> anyhow::Result<Dispatched> {
    // 1. Warmup: runs of consecutive blocks, untimed, then a flush.
    let w0 = Instant::now();
    let mut run: Vec<(u64, Block)> = Vec::new();
    let send_run = |run: &mut Vec<(u64, Block)>| -> anyhow::Result<()> {
        let Some(&(first, _)) = run.first() else { return Ok(()) };
        let n = run.len() as u64;
        if (first + n).saturating_mul(TRACE_BLOCK_BYTES) > size {
            return Err(anyhow!(
                "{trace}: the trace reads block {} (byte {}), beyond the target's {size} bytes",
                first + n - 1,
                (first + n - 1) * TRACE_BLOCK_BYTES
            ));
        }
        shared.admit(first, n, qd);
        let job = Job {
            line: 0,
            op: TraceOp::Write,
            first_block: first,
            contents: run.iter().map(|&(_, b)| Some(b)).collect(),
            issued: Instant::now(),
            timed: false,
        };
        run.clear();
        tx.send(job).map_err(|_| anyhow!("the replay workers stopped"))
    };
    for (&b, &c) in warm {
        if shared.stop.load(Ordering::SeqCst) || interrupted() {
            break;
        }
        let contiguous = run.last().is_some_and(|&(last, _)| last + 1 == b);
        if !contiguous || run.len() as u64 >= WARMUP_RUN_BLOCKS_MAX {
            send_run(&mut run)?;
        }
        run.push((b, c));
        if keep_expected {
            expected.insert(b, c);
        }
    }
    send_run(&mut run)?;
    shared.wait_idle();
    if !warm.is_empty() && !shared.stop.load(Ordering::SeqCst) {
        target.flush().context("flushing the warmup writes")?;
    }
    let warmup = w0.elapsed();

    // 2. The timed replay.
    let start = Instant::now();
    let mut first_ts = None;
    let mut records = 0u64;
    let mut empty_records = 0u64;
    while records + empty_records < limit {
        if shared.stop.load(Ordering::SeqCst) || interrupted() {
            break;
        }
        let Some(rec) = reader.next() else { break };
        let rec = rec?;
        let n = rec.block_count();
        if n == 0 {
            empty_records += 1;
            continue;
        }
        let first = rec.first_block();
        let end_bytes = (first + n).saturating_mul(TRACE_BLOCK_BYTES);
        if end_bytes > size {
            return Err(anyhow!(
                "{trace}:{}: the record reaches byte {end_bytes}, beyond the target's {size} bytes (replay onto a larger target)",
                rec.line
            ));
        }
        let contents: Vec<Option<Block>> = match rec.op {
            TraceOp::Write => (0..n)
                .map(|k| {
                    let b = block_of(&rec, k);
                    if keep_expected {
                        expected.insert(first + k, b);
                    }
                    Some(b)
                })
                .collect(),
            TraceOp::Read => (0..n).map(|k| expected.get(&(first + k)).copied()).collect(),
        };
        let issued = match opts.timing {
            Timing::Fast => {
                shared.admit(first, n, qd);
                Instant::now()
            }
            Timing::Native => {
                let t0 = *first_ts.get_or_insert(rec.ts_ns);
                let at = start + Duration::from_nanos(rec.ts_ns.saturating_sub(t0));
                // In slices, so a signal during a long idle period of the trace is seen.
                loop {
                    let now = Instant::now();
                    if at <= now || interrupted() {
                        break;
                    }
                    std::thread::sleep((at - now).min(SLEEP_SLICE));
                }
                if interrupted() {
                    break;
                }
                shared.admit(first, n, qd);
                at
            }
        };
        records += 1;
        let job = Job { line: rec.line, op: rec.op, first_block: first, contents, issued, timed: true };
        if tx.send(job).is_err() {
            break;
        }
    }
    shared.wait_idle();
    Ok(Dispatched { interrupted: interrupted(), records, empty_records, warmup, start, end: Instant::now() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    /// A RAM disk that silently drops writes to one block, as a broken target would.
    struct LossyTarget {
        data: Mutex<Vec<u8>>,
        lost_block: u64,
    }

    impl Target for LossyTarget {
        fn describe(&self) -> String {
            "lossy RAM disk".into()
        }
        fn size_bytes(&self) -> u64 {
            lock(&self.data).len() as u64
        }
        fn read(&self, _: usize, offset: u64, buf: &mut [u8]) -> anyhow::Result<()> {
            let d = lock(&self.data);
            buf.copy_from_slice(&d[offset as usize..offset as usize + buf.len()]);
            Ok(())
        }
        fn write(&self, _: usize, offset: u64, data: &[u8]) -> anyhow::Result<()> {
            if offset / TRACE_BLOCK_BYTES != self.lost_block {
                lock(&self.data)[offset as usize..offset as usize + data.len()].copy_from_slice(data);
            }
            Ok(())
        }
        fn flush(&self) -> anyhow::Result<()> {
            Ok(())
        }
        fn close(self: Box<Self>) -> anyhow::Result<()> {
            Ok(())
        }
    }

    fn run(lost_block: u64, qd: usize) -> anyhow::Result<ReplayReport> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("t.fiu");
        let mut f = std::fs::File::create(&path)?;
        for b in 0..64u64 {
            writeln!(f, "{} 1 p {} 8 W 8 0 {:032x}", b, b * 8, b % 7 + 1)?;
        }
        for b in 0..64u64 {
            writeln!(f, "{} 1 p {} 8 r 8 0 {:032x}", 100 + b, b * 8, b % 7 + 1)?;
        }
        drop(f);
        let t = Box::new(LossyTarget { data: Mutex::new(vec![0u8; 64 << 12]), lost_block });
        let opts = ReplayOptions {
            timing: Timing::Fast,
            queue_depth: qd,
            warmup_writes: false,
            limit_ops: None,
            verify: true,
            compress_fraction: 0.5,
        };
        replay(&path, t, &opts).map_err(|e| anyhow!("{e:#}"))
    }

    #[test]
    fn requests_on_a_common_block_keep_their_order_at_any_queue_depth() {
        // Each of 4 blocks is written and read back 500 times with a new content each time,
        // and one 4-block write spans them all: a read overtaking its write would differ.
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("order.fiu");
        let mut f = std::fs::File::create(&path).expect("create");
        for i in 0..500u64 {
            for b in 0..4u64 {
                writeln!(f, "{i} 1 p {} 8 W 8 0 {:032x}", b * 8, i * 4 + b + 1).expect("write");
                writeln!(f, "{i} 1 p {} 8 R 8 0 {:032x}", b * 8, i * 4 + b + 1).expect("write");
            }
            writeln!(f, "{i} 1 p 0 32 W 8 0 {:032x}", i + 10_000).expect("write");
            writeln!(f, "{i} 1 p 8 8 R 8 0 {:032x}", i + 10_000).expect("write");
        }
        drop(f);
        let t = Box::new(LossyTarget { data: Mutex::new(vec![0u8; 64 << 12]), lost_block: u64::MAX });
        let opts = ReplayOptions {
            timing: Timing::Fast,
            queue_depth: 16,
            warmup_writes: false,
            limit_ops: None,
            verify: true,
            compress_fraction: 0.0,
        };
        let r = replay(&path, t, &opts).expect("replay in order");
        assert_eq!(r.verified_blocks, 500 * 5);
    }

    #[test]
    fn a_target_that_loses_a_write_fails_verification_naming_the_line() {
        let good = run(u64::MAX, 4).expect("a faithful target replays");
        assert_eq!((good.reads.ops, good.writes.ops, good.verified_blocks), (64, 64, 64));
        let e = run(37, 4).expect_err("the lost write must be caught").to_string();
        // Line 64 + 37 + 1 reads block 37.
        assert!(e.contains("t.fiu:102: read of 1 blocks at block 37"), "{e}");
        assert!(e.contains("verification failed: block 37"), "{e}");
    }
}
