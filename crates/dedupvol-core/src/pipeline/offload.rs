//! The compute backend of the pipeline's two compute stages: fingerprints (stage 1) and
//! compression (stage 3) run behind the `Offload` trait, so an accelerator (GPU, FPGA, QAT)
//! can take them without touching the engine; `CpuOffload` runs them on the `CpuPool`.
//!
//! A backend computes, the engine decides. A call is a whole batch: the backend is handed
//! every chunk (or unit) of it and returns once each has its answer, however it queues
//! them on its device; calls arrive from several writer threads at once.
//!
//! Invariants:
//! - The engine's checks never move into a backend: what is shared, stored or recorded is
//!   decided by the stages (byte verification, the claim, stage 4's re-checks), whatever a
//!   backend answered.
//! - The results of a backend the volume was given (`OpenOptions::offload`) are checked
//!   before use (`Offloader`): a zero claim is re-scanned, a crc32c recomputed, a fragment
//!   decompressed and compared with its source; a result that fails is recomputed by the
//!   CPU code and counted. Its BLAKE3 fingerprints are never trusted alone: the volume
//!   verifies every dedup candidate by its bytes for the session (`Deduper::distrust`).
//! - The built-in `CpuOffload` runs the very functions those checks would use
//!   (`print_chunk`, `compress_unit`), so its results are taken as they are. Stage 1 runs
//!   `print_chunks`, which hashes 16 chunks side by side and answers exactly as
//!   `print_chunk` one by one (tested against it, and `blake3_many` against `blake3::hash`).
//! - A batch's answer has exactly one result per chunk or unit, in order: the output
//!   slices are sized by the engine, and a backend cannot change their length.

use super::blake3_many;
use super::executor::{for_each, for_each_group, for_each_weighted, CpuPool, Executor};
use crate::config::{Compression, BLOCK_SIZE};
use crate::data::packer;
use crate::metadata::block_map::{Frag, UNIT_BLOCKS_MAX};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What a fingerprint batch asks for each chunk (the same for every chunk of a call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrintOp {
    /// Check whether the chunk is all zeros first; a zero chunk gets `Prints::zero` and
    /// nothing else.
    pub zero_check: bool,
    /// The weak hash (xxh3-64 with seed 0) ANDed with this mask (None: not wanted, 0).
    pub weak_mask: Option<u64>,
    /// crc32c (Castagnoli) of the chunk.
    pub crc32c: bool,
    /// BLAKE3-256 of the chunk (unkeyed, default hasher).
    pub blake3: bool,
}

/// One chunk's answer to a fingerprint batch. Fields not asked for are left zero.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prints {
    /// The chunk is all zeros (only when `PrintOp::zero_check`).
    pub zero: bool,
    pub weak: u64,
    pub crc32c: u32,
    pub blake3: [u8; 32],
}

/// One unit of a compression batch: `data` is 1 to `UNIT_BLOCKS_MAX` whole 4 KiB blocks,
/// compressed as one fragment.
#[derive(Debug, Clone, Copy)]
pub struct CompressUnit<'a> {
    pub data: &'a [u8],
    /// `Lz4` (an LZ4 block, no frame) or `Zstd` (one zstd frame).
    pub codec: Compression,
    /// The zstd level (already resolved: never 0); for `Lz4`, above 1, the acceleration of
    /// LZ4's fast mode (deferred units), else LZ4's default mode.
    pub level: i8,
    /// Report the time spent on this unit (`Compressed::busy_ns`): the deferral gauge
    /// measures what compression costs per chunk from it.
    pub timed: bool,
}

/// One unit's answer to a compression batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Compressed {
    /// The fragment: decodes with `codec` to exactly the unit's bytes and is at most
    /// `fragment_limit(blocks)` long. None: not worth it (the unit is stored raw).
    pub bytes: Option<Vec<u8>>,
    /// Nanoseconds of the backend's time this unit took (when `timed`; 0 otherwise). A CPU
    /// counts its thread's CPU time; an accelerator its engine time.
    pub busy_ns: u64,
}

/// How much work a backend takes at once: the deferral gauge divides its latency budget
/// by it, and a batcher may size batches from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    /// Units worked on at the same time (CPU threads; an accelerator's engines times the
    /// depth of its submission queue). At least 1.
    pub parallel: usize,
    /// Chunks per call below which the backend gains nothing from being handed more at
    /// once (the CPU splits a batch across its threads from 64 chunks).
    pub batch_chunks: usize,
}

/// A backend that failed a whole batch (a device error, a full queue it will not wait
/// on): the engine computes that batch on the CPU and counts it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("offload backend {backend}: {reason}")]
pub struct OffloadError {
    pub backend: String,
    pub reason: String,
}

/// A compute backend for the pipeline's fingerprint and compression stages. Its contract
/// (docs/design.md, "The offload interface"): answer every chunk or unit of a call before
/// returning, with the algorithms named by `PrintOp` and `CompressUnit`; the engine checks
/// the results of any backend it did not build.
pub trait Offload: Send + Sync {
    /// A short name for statistics (`cpu`, `qat0`).
    fn name(&self) -> &str;
    /// How much work the backend takes at once.
    fn capacity(&self) -> Capacity;
    /// Fingerprints every chunk of `chunks` (each exactly 4 KiB) into `out` (one per chunk,
    /// the same length).
    fn fingerprint(&self, op: PrintOp, chunks: &[&[u8]], out: &mut [Prints]) -> Result<(), OffloadError>;
    /// Compresses every unit of `units` into `out` (one per unit, the same length).
    fn compress(&self, units: &[CompressUnit<'_>], out: &mut [Compressed]) -> Result<(), OffloadError>;
}

impl std::fmt::Debug for dyn Offload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Offload({})", self.name())
    }
}

/// Stage 1's work on one chunk, as the CPU does it.
pub fn print_chunk(op: PrintOp, c: &[u8]) -> Prints {
    let mut p = Prints::default();
    if op.zero_check && crate::codec::is_zero(c) {
        p.zero = true;
        return p;
    }
    if let Some(m) = op.weak_mask {
        p.weak = xxhash_rust::xxh3::xxh3_64(c) & m;
    }
    if op.blake3 {
        p.blake3 = *blake3::hash(c).as_bytes();
    }
    if op.crc32c {
        p.crc32c = crc32c::crc32c(c);
    }
    p
}

/// `print_chunk` of every chunk of `chunks` into `out` (as long), with the BLAKE3 hashes
/// of up to `blake3_many::GROUP` chunks computed side by side: what `CpuOffload` runs.
pub fn print_chunks(op: PrintOp, chunks: &[&[u8]], out: &mut [Prints]) {
    if let ([c], [o]) = (chunks, &mut *out) {
        // A single chunk (a 4 KiB write) has nothing to hash beside it.
        *o = print_chunk(op, c);
        return;
    }
    for (cs, os) in chunks.chunks(blake3_many::GROUP).zip(out.chunks_mut(blake3_many::GROUP)) {
        let mut strong: [&[u8]; blake3_many::GROUP] = [&[]; blake3_many::GROUP];
        let mut at = [0usize; blake3_many::GROUP];
        let mut n = 0;
        for (k, (c, o)) in cs.iter().zip(os.iter_mut()).enumerate() {
            *o = print_chunk(PrintOp { blake3: false, ..op }, c);
            if op.blake3 && !o.zero {
                if let (Some(s), Some(a)) = (strong.get_mut(n), at.get_mut(n)) {
                    (*s, *a) = (*c, k);
                    n += 1;
                }
            }
        }
        let mut hashes = [[0u8; 32]; blake3_many::GROUP];
        if let (Some(ins), Some(outs)) = (strong.get(..n), hashes.get_mut(..n)) {
            blake3_many::hash_chunks(ins, outs);
        }
        for (&k, h) in at.iter().zip(&hashes).take(n) {
            if let Some(o) = os.get_mut(k) {
                o.blake3 = *h;
            }
        }
    }
}

/// Stage 3's work on one unit, as the CPU does it (the caller ran the incompressibility
/// probe already).
pub fn compress_unit(u: &CompressUnit<'_>) -> Compressed {
    let t = if u.timed { super::defer::Deferral::thread_cpu_ns() } else { 0 };
    let bytes = packer::compress_probed(u.codec, u.level, u.data, false);
    let busy_ns = if u.timed { super::defer::Deferral::thread_cpu_ns().saturating_sub(t) } else { 0 };
    Compressed { bytes, busy_ns }
}

/// The CPU backend: the process's pool (or a volume's own), through `for_each` (`print_chunks`
/// on runs of chunks for stage 1).
pub struct CpuOffload {
    pool: Arc<CpuPool>,
}

impl CpuOffload {
    /// On the process's shared pool (what a volume uses by default).
    pub fn new() -> Self {
        CpuOffload { pool: CpuPool::shared() }
    }

    /// On a pool of its own of exactly `workers` threads.
    pub fn with_workers(workers: usize) -> Self {
        CpuOffload { pool: Arc::new(CpuPool::with_workers(workers)) }
    }

    pub(crate) fn on(pool: Arc<CpuPool>) -> Self {
        CpuOffload { pool }
    }
}

impl Default for CpuOffload {
    fn default() -> Self {
        Self::new()
    }
}

/// A batch whose output was not sized to its input: the engine's bug, reported as the
/// backend's failure so the engine falls back rather than panics.
fn mismatch(ins: usize, outs: usize) -> OffloadError {
    OffloadError { backend: "cpu".into(), reason: format!("{ins} inputs for {outs} results") }
}

impl Offload for CpuOffload {
    fn name(&self) -> &str {
        "cpu"
    }

    fn capacity(&self) -> Capacity {
        Capacity { parallel: self.pool.width(), batch_chunks: super::executor::PARALLEL_CHUNKS_MIN }
    }

    fn fingerprint(&self, op: PrintOp, chunks: &[&[u8]], out: &mut [Prints]) -> Result<(), OffloadError> {
        if chunks.len() != out.len() {
            return Err(mismatch(chunks.len(), out.len()));
        }
        for_each_group(&*self.pool, out, blake3_many::GROUP, |i, run| {
            if let Some(cs) = chunks.get(i..i + run.len()) {
                print_chunks(op, cs, run);
            }
        });
        Ok(())
    }

    fn compress(&self, units: &[CompressUnit<'_>], out: &mut [Compressed]) -> Result<(), OffloadError> {
        if units.len() != out.len() {
            return Err(mismatch(units.len(), out.len()));
        }
        let chunks = units.iter().map(|u| u.data.len().div_ceil(crate::config::BLOCK_SIZE)).sum();
        for_each_weighted(&*self.pool, out, chunks, |i, o| {
            if let Some(u) = units.get(i) {
                *o = compress_unit(u);
            }
        });
        Ok(())
    }
}

/// The offload figures (`PipelineStats::offload`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct OffloadStats {
    /// The backend's name (`Offload::name`).
    pub backend: String,
    /// Its results are checked (a backend given at open); false for the built-in CPU one.
    pub checked: bool,
    pub parallel: usize,
    pub fingerprint_calls: u64,
    pub fingerprint_chunks: u64,
    pub compress_calls: u64,
    pub compress_units: u64,
    /// Results the engine's checks refused (recomputed on the CPU).
    pub rejected_results: u64,
    /// Calls the backend failed as a whole (computed on the CPU).
    pub failed_calls: u64,
}

/// The engine's handle on its backend: calls it, checks what a given backend answers, and
/// falls back to the CPU functions for whatever fails.
pub(crate) struct Offloader {
    backend: Arc<dyn Offload>,
    /// Check every result (a backend from `OpenOptions::offload`).
    checked: bool,
    fp_calls: AtomicU64,
    fp_chunks: AtomicU64,
    c_calls: AtomicU64,
    c_units: AtomicU64,
    rejected: AtomicU64,
    failed: AtomicU64,
}

impl Offloader {
    /// The built-in CPU backend on `pool` (unchecked), or `given` (checked).
    pub(crate) fn new(pool: Arc<CpuPool>, given: Option<Arc<dyn Offload>>) -> Self {
        let checked = given.is_some();
        let backend = given.unwrap_or_else(|| Arc::new(CpuOffload::on(pool)));
        Offloader {
            backend,
            checked,
            fp_calls: AtomicU64::new(0),
            fp_chunks: AtomicU64::new(0),
            c_calls: AtomicU64::new(0),
            c_units: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        }
    }

    /// Units the backend works on at once (at least 1).
    pub(crate) fn parallel(&self) -> usize {
        self.backend.capacity().parallel.max(1)
    }

    /// One fingerprint batch: a `Prints` per chunk, in order, checked when the backend is.
    pub(crate) fn fingerprint(&self, exec: &dyn Executor, op: PrintOp, chunks: &[&[u8]]) -> Vec<Prints> {
        let mut out = vec![Prints::default(); chunks.len()];
        if chunks.is_empty() {
            return out;
        }
        self.fp_calls.fetch_add(1, Ordering::Relaxed);
        self.fp_chunks.fetch_add(chunks.len() as u64, Ordering::Relaxed);
        let chunk = |i: usize| chunks.get(i).copied().unwrap_or(&[]);
        let answered = self.backend.fingerprint(op, chunks, &mut out);
        self.settle(exec, answered, &mut out, |i, o| prints_ok(op, chunk(i), o), |i| print_chunk(op, chunk(i)));
        out
    }

    /// One compression batch: a `Compressed` per unit, in order, checked when the backend is.
    pub(crate) fn compress(&self, exec: &dyn Executor, units: &[CompressUnit<'_>]) -> Vec<Compressed> {
        let mut out: Vec<Compressed> = vec![Compressed::default(); units.len()];
        if units.is_empty() {
            return out;
        }
        self.c_calls.fetch_add(1, Ordering::Relaxed);
        self.c_units.fetch_add(units.len() as u64, Ordering::Relaxed);
        let answered = self.backend.compress(units, &mut out);
        self.settle(
            exec,
            answered,
            &mut out,
            |i, o| units.get(i).is_some_and(|u| fragment_ok(u, o)),
            |i| units.get(i).map(compress_unit).unwrap_or_default(),
        );
        out
    }

    /// After a backend call that `answered` into `out`: a failed call is computed again on
    /// the CPU (`cpu`), and a checked backend's results that fail `ok` are replaced by the
    /// CPU's; both counted.
    fn settle<T: Send>(
        &self,
        exec: &dyn Executor,
        answered: Result<(), OffloadError>,
        out: &mut [T],
        ok: impl Fn(usize, &T) -> bool + Sync,
        cpu: impl Fn(usize) -> T + Sync,
    ) {
        match answered {
            Ok(()) if self.checked => {
                let rejected = AtomicU64::new(0);
                for_each(exec, out, |i, o| {
                    if !ok(i, o) {
                        rejected.fetch_add(1, Ordering::Relaxed);
                        *o = cpu(i);
                    }
                });
                self.rejected.fetch_add(rejected.into_inner(), Ordering::Relaxed);
            }
            Ok(()) => {}
            Err(_) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                for_each(exec, out, |i, o| *o = cpu(i));
            }
        }
    }

    /// The figures of `PipelineStats::offload`.
    pub(crate) fn stats(&self) -> OffloadStats {
        OffloadStats {
            backend: self.backend.name().to_string(),
            checked: self.checked,
            parallel: self.parallel(),
            fingerprint_calls: self.fp_calls.load(Ordering::Relaxed),
            fingerprint_chunks: self.fp_chunks.load(Ordering::Relaxed),
            compress_calls: self.c_calls.load(Ordering::Relaxed),
            compress_units: self.c_units.load(Ordering::Relaxed),
            rejected_results: self.rejected.load(Ordering::Relaxed),
            failed_calls: self.failed.load(Ordering::Relaxed),
        }
    }
}

/// The checks of a given backend's prints that matter for correctness: a chunk called
/// zero must be zero (else it would be mapped to zeros: data lost), and its crc32c right
/// (it becomes the map entry's checksum: a wrong one makes good data read as damaged).
/// The weak hash only finds write-once journaling candidates, which are compared byte for
/// byte; BLAKE3 only finds dedup candidates, which the session verifies by their bytes.
fn prints_ok(op: PrintOp, c: &[u8], p: &Prints) -> bool {
    if p.zero {
        return op.zero_check && crate::codec::is_zero(c);
    }
    !op.crc32c || crc32c::crc32c(c) == p.crc32c
}

/// A given backend's fragment is stored only if it is short enough to be worth it and
/// decodes, with the engine's decoder, to exactly the unit's bytes.
fn fragment_ok(u: &CompressUnit<'_>, o: &Compressed) -> bool {
    let Some(f) = &o.bytes else { return true };
    let blocks = u.data.len() / BLOCK_SIZE;
    if blocks == 0 || blocks > usize::from(UNIT_BLOCKS_MAX) || !u.data.len().is_multiple_of(BLOCK_SIZE) {
        return false;
    }
    if f.is_empty() || f.len() > packer::fragment_limit(blocks) {
        return false;
    }
    let Ok(len) = u16::try_from(f.len()) else { return false };
    let frag = Frag::new(u.codec.code(), 0, len, blocks as u8, 0);
    let mut back = vec![0u8; blocks * BLOCK_SIZE];
    // Checked end to end, its frame checksum included: byte verification of this
    // fragment's records will check it (`packer::decompress_checked`).
    packer::decompress_checked(0, &frag, f, &mut back).is_ok() && back == u.data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_backend_answers_as_print_chunk_does_one_by_one() {
        // Zero chunks among the data ones (no BLAKE3 for them), every op, several runs
        // of the side-by-side hash, through the pool as a volume calls it.
        let data: Vec<Vec<u8>> = (0..150u64)
            .map(|i| if i % 7 == 3 { vec![0; BLOCK_SIZE] } else { crate::codec::test_random_bytes(i, BLOCK_SIZE) })
            .collect();
        let chunks: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let cpu = CpuOffload::with_workers(2);
        for (zero_check, weak, crc32c, blake3) in
            [(true, true, true, true), (false, false, false, true), (true, false, true, false)]
        {
            let op = PrintOp { zero_check, weak_mask: weak.then_some(u64::MAX), crc32c, blake3 };
            let mut out = vec![Prints::default(); chunks.len()];
            cpu.fingerprint(op, &chunks, &mut out).expect("fingerprint");
            for (i, (c, o)) in chunks.iter().zip(&out).enumerate() {
                assert_eq!(*o, print_chunk(op, c), "chunk {i}, {op:?}");
            }
        }
    }

    #[test]
    fn checks_refuse_a_false_zero_a_wrong_crc_and_a_bad_fragment() {
        let op = PrintOp { zero_check: true, weak_mask: None, crc32c: true, blake3: true };
        let data = crate::codec::test_random_bytes(7, BLOCK_SIZE);
        let good = print_chunk(op, &data);
        assert!(prints_ok(op, &data, &good));
        assert!(!prints_ok(op, &data, &Prints { zero: true, ..Prints::default() }));
        assert!(!prints_ok(op, &data, &Prints { crc32c: good.crc32c ^ 1, ..good }));
        // A wrong BLAKE3 passes: dedup candidates are verified by their bytes instead.
        assert!(prints_ok(op, &data, &Prints { blake3: [9; 32], ..good }));

        let text: Vec<u8> = (0..2 * BLOCK_SIZE).map(|i| b"abcabcabd"[i % 9]).collect();
        for codec in [Compression::Lz4, Compression::Zstd] {
            let u = CompressUnit { data: &text, codec, level: 1, timed: false };
            let ok = compress_unit(&u);
            assert!(ok.bytes.is_some() && fragment_ok(&u, &ok), "{codec:?}");
            let mut bad = ok.clone();
            if let Some(b) = bad.bytes.as_mut().and_then(|b| b.last_mut()) {
                *b ^= 0x55;
            }
            assert!(!fragment_ok(&u, &bad), "{codec:?}: a flipped byte");
            let long = Compressed { bytes: Some(vec![0; packer::fragment_limit(2) + 1]), busy_ns: 0 };
            assert!(!fragment_ok(&u, &long), "{codec:?}: too long to be worth it");
            assert!(fragment_ok(&u, &Compressed::default()), "not worth it is always allowed");
        }
    }
}
