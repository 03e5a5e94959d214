//! Deferred compression: when the chunks waiting for compression would take longer than a
//! latency budget to compress with the volume's codec, the excess is compressed with the
//! fast codec (LZ4, in its accelerated mode: `DEFER_LZ4_ACCELERATION`) instead of making
//! the client wait; the cleaner's recompression pass
//! brings it to the volume's codec when the volume is idle.
//!
//! The gauge counts the chunks in compression across every writer and batch, and keeps a
//! moving average of what the volume's codec costs per chunk on this machine. A batch's
//! jobs are given their codec in order before they run: a job that starts beyond
//! `budget × workers / cost per chunk` chunks of backlog gets the fast codec.
//!
//! Invariants:
//! - Only the codec changes, never what is stored or shared: a deferred fragment is a
//!   valid fragment of its own codec, read like any other.
//! - Every chunk counted in by `assign` is counted out when its `Backlog` drops, so the
//!   gauge returns to zero when no compression runs (asserted by the tests).

use super::reduce::Job;
use crate::config::Compression;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The acceleration of LZ4's fast mode for deferred units (`packer::compress_probed`). Why
/// not the default mode: deferral exists to keep up with a burst, and what it stores is
/// compressed again at idle. On a tar of /usr in 64 KiB units, acceleration 8 compressed
/// 1.17x faster than lz4_flex at 1.71x instead of 1.89x; on the benchmark's generated
/// half-compressible data, 3x faster at the same ratio.
pub(crate) const DEFER_LZ4_ACCELERATION: i8 = 8;

/// The per-chunk cost assumed before any measurement (zstd-1 on 4 KiB of text on one
/// core of the machine this was written on, rounded up).
const COST_NS_DEFAULT: u64 = 10_000;

/// The deferral figures (`PipelineStats::deferral`).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct DeferralStats {
    /// Deferral is on (`OpenOptions::defer_compression_micros` > 0).
    pub enabled: bool,
    /// The latency budget, in microseconds.
    pub budget_micros: u64,
    /// Chunks compressed with the fast codec because the volume's codec could not keep up.
    pub deferred_chunks: u64,
    /// Chunks compressed with the volume's codec.
    pub inline_chunks: u64,
    /// The measured cost of the volume's codec per chunk, in nanoseconds (moving average).
    pub cost_ns_per_chunk: u64,
}

/// The gauge (shared by every writer of a volume).
pub(crate) struct Deferral {
    budget_ns: u64,
    /// The cost never changes (a fixed cost given at open: reproducible decisions).
    fixed: bool,
    codec: Compression,
    in_flight: AtomicU64,
    cost_ns: AtomicU64,
    deferred: AtomicU64,
    inline: AtomicU64,
}

/// Chunks of one batch counted in the gauge until dropped.
pub(crate) struct Backlog {
    gauge: Option<Arc<Deferral>>,
    chunks: u64,
}

impl Drop for Backlog {
    fn drop(&mut self) {
        if let Some(g) = &self.gauge {
            g.in_flight.fetch_sub(self.chunks, Ordering::AcqRel);
        }
    }
}

impl Deferral {
    /// A gauge for a volume compressing with `codec`, deferring beyond `budget_micros`.
    /// `fixed_cost_ns`: a per-chunk cost to use instead of measuring it.
    pub(crate) fn new(codec: Compression, budget_micros: u64, fixed_cost_ns: Option<u64>) -> Self {
        Deferral {
            budget_ns: budget_micros.saturating_mul(1000),
            fixed: fixed_cost_ns.is_some(),
            codec,
            in_flight: AtomicU64::new(0),
            cost_ns: AtomicU64::new(fixed_cost_ns.unwrap_or(COST_NS_DEFAULT).max(1)),
            deferred: AtomicU64::new(0),
            inline: AtomicU64::new(0),
        }
    }

    /// True when a batch of `chunks` would take the backlog past the budget: the whole
    /// batch then gets the fast codec (`assign` with `all`), and the caller skips the
    /// incompressibility probe, whose byte histogram and LZ4 attempt cost about as much
    /// as the LZ4 compression that answers the same question (a unit LZ4 cannot shrink
    /// enough is stored raw). Deciding per batch rather than per job defers at most one
    /// batch more than the budget asks, and saves the probe on every deferred chunk.
    pub(crate) fn defers_all(this: Option<&Arc<Deferral>>, workers: usize, chunks: usize) -> bool {
        this.is_some_and(|g| {
            g.defers() && g.in_flight.load(Ordering::Acquire).saturating_add(chunks as u64) > g.allowed(workers)
        })
    }

    /// The volume's codec is one deferral can replace with a faster one.
    fn defers(&self) -> bool {
        self.codec != Compression::Lz4 && self.codec != Compression::None
    }

    /// Chunks in compression beyond which a job is deferred.
    fn allowed(&self, workers: usize) -> u64 {
        let cost = self.cost_ns.load(Ordering::Relaxed).max(1);
        self.budget_ns.saturating_mul(workers.max(1) as u64) / cost
    }

    /// Gives each job its codec (in order) and counts the batch's chunks in. Without a
    /// gauge (`this` None) every job keeps the volume's codec; with `all` (the caller saw
    /// `defers_all`, and probed nothing) every job gets the fast codec.
    pub(crate) fn assign(this: Option<&Arc<Deferral>>, jobs: &mut [Job], workers: usize, all: bool) -> Backlog {
        let Some(g) = this else { return Backlog { gauge: None, chunks: 0 } };
        if !g.defers() {
            return Backlog { gauge: None, chunks: 0 };
        }
        let total: u64 = jobs.iter().map(|j| j.n as u64).sum();
        let before = g.in_flight.fetch_add(total, Ordering::AcqRel);
        let allowed = if all { 0 } else { g.allowed(workers) };
        let mut at = before;
        let (mut deferred, mut inline) = (0u64, 0u64);
        for job in jobs.iter_mut() {
            at += job.n as u64;
            if at > allowed {
                job.codec = Compression::Lz4;
                deferred += job.n as u64;
            } else {
                inline += job.n as u64;
            }
        }
        g.deferred.fetch_add(deferred, Ordering::Relaxed);
        g.inline.fetch_add(inline, Ordering::Relaxed);
        Backlog { gauge: Some(g.clone()), chunks: total }
    }

    /// Records what compressing `chunks` chunks with the volume's codec took.
    pub(crate) fn note_cost(this: Option<&Arc<Deferral>>, chunks: usize, elapsed_ns: u64) {
        let Some(g) = this else { return };
        if chunks == 0 || g.fixed {
            return;
        }
        let per = elapsed_ns / chunks as u64;
        // A moving average over about 16 jobs: quick to follow the data, slow to jitter.
        let old = g.cost_ns.load(Ordering::Relaxed);
        g.cost_ns.store((old * 15 + per) / 16, Ordering::Relaxed);
    }

    pub(crate) fn stats(&self) -> DeferralStats {
        DeferralStats {
            enabled: true,
            budget_micros: self.budget_ns / 1000,
            deferred_chunks: self.deferred.load(Ordering::Relaxed),
            inline_chunks: self.inline.load(Ordering::Relaxed),
            cost_ns_per_chunk: self.cost_ns.load(Ordering::Relaxed),
        }
    }

    /// The calling thread's CPU time in nanoseconds: what compression costs, whatever else
    /// the machine runs (wall time would count the time other threads held the core).
    pub(crate) fn thread_cpu_ns() -> u64 {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes one timespec through a valid pointer.
        let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        if r != 0 {
            return 0;
        }
        (ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
    }

    #[cfg(test)]
    fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jobs(n: usize) -> Vec<Job> {
        (0..n).map(|i| Job { first: i, n: 1, unit: None, singles: Vec::new(), codec: Compression::Zstd }).collect()
    }

    #[test]
    fn the_excess_beyond_the_budget_gets_the_fast_codec_and_the_gauge_drains() {
        // 1 ms budget at 10 us a chunk on 2 workers: 200 chunks inline.
        let g = Arc::new(Deferral::new(Compression::Zstd, 1000, Some(10_000)));
        let mut a = jobs(150);
        let first = Deferral::assign(Some(&g), &mut a, 2, false);
        assert!(a.iter().all(|j| j.codec == Compression::Zstd));
        let mut b = jobs(100);
        assert!(!Deferral::defers_all(Some(&g), 2, 50), "150 in flight and 50 more: 200 allowed");
        assert!(Deferral::defers_all(Some(&g), 2, 51), "one more than allowed");
        let second = Deferral::assign(Some(&g), &mut b, 2, false);
        assert_eq!(b.iter().filter(|j| j.codec == Compression::Lz4).count(), 50, "the 50 beyond the backlog of 200");
        assert_eq!(g.in_flight(), 250);
        drop((first, second));
        assert_eq!(g.in_flight(), 0);
        let s = g.stats();
        assert_eq!((s.deferred_chunks, s.inline_chunks), (50, 200));
        // Without a gauge nothing changes.
        let mut c = jobs(5000);
        drop(Deferral::assign(None, &mut c, 2, false));
        assert!(c.iter().all(|j| j.codec == Compression::Zstd));
    }
}
