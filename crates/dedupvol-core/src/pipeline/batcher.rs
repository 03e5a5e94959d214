//! The batcher: small writes from every connection and thread are combined into batches,
//! so the pipeline's stages run once per batch instead of once per request.
//!
//! A writer puts a copy of its blocks in the open batch and waits. While fewer than
//! `BatchOptions::leaders_max` batches are in the stages, a waiting writer becomes the
//! leader of the open batch: it closes it (at once, or when it holds `chunks_wanted`
//! chunks, or when `wait_micros` have passed since its first request, whichever comes
//! first), runs
//! the stages for every request in it (the pipeline's parallel stages use every core), and
//! hands each writer its outcome. Under light load a batch is one request and costs no
//! wait; under load batches grow by themselves, because requests arriving while the stages
//! run gather in the next batch (like a journal's group commit).
//!
//! Invariants:
//! - A batch holds at most `chunks_max` chunks (asserted when it is closed); the open batch
//!   and the closed batches not yet finished hold at most `queue_chunks_max` chunks between
//!   them: a writer that finds no room waits (backpressure to clients).
//! - At most `leaders_max` batches run the stages at once.
//! - Every request put in a batch gets exactly one outcome: the last journal sequence of
//!   its mapping changes, or `Retry` (the batch failed: the writer writes its request on
//!   its own, so an error reaches exactly the requests it belongs to, and a full volume
//!   commits and retries as a lone write does).
//! - Requests of one batch are placed in arrival order; any order is allowed between
//!   writes in flight together, and a writer is answered only once its batch is applied.

use super::lbas::Lbas;
use crate::config::BLOCK_SIZE;
use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest request the batcher takes, in chunks (256 KiB): larger requests are batches of
/// their own already and go through the stages directly (no copy).
pub(crate) const REQUEST_CHUNKS_MAX: usize = 64;

/// How batches are made (`OpenOptions::batch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BatchOptions {
    /// Combine small writes at all (off: every write runs the stages alone).
    pub enabled: bool,
    /// Chunks per batch at most.
    pub chunks_max: usize,
    /// Chunks at which a leader stops waiting for more (`wait_micros`) and closes its
    /// batch: what the stages' backend needs to be busy (0: `chunks_max`). A volume opened
    /// with an offload backend takes the backend's `Capacity::batch_chunks` when this is 0.
    pub chunks_wanted: usize,
    /// How long a leader may keep its batch open for more requests, in microseconds
    /// (0: it closes the batch at once; batches still grow under load, see the module
    /// docs). A bound on the latency batching adds.
    pub wait_micros: u64,
    /// Batches in the stages at once (one can be in a locked stage while another hashes
    /// or compresses).
    pub leaders_max: usize,
    /// Chunks waiting or running in batches at most, before writers wait for room.
    pub queue_chunks_max: usize,
}

impl Default for BatchOptions {
    /// Off by default with the CPU backend: on a 2-core machine, 32 writer threads of 4 KiB
    /// requests ran 2.3x faster each running the stages itself than handing requests to a
    /// batch leader (the hand-off costs a thread wake-up per request, more than hashing
    /// and compressing 4 KiB; docs/design.md, "The write pipeline"). Batches are what an
    /// offload engine needs, and what many cores would share.
    fn default() -> Self {
        BatchOptions {
            enabled: false,
            chunks_max: 1024,
            chunks_wanted: 0,
            wait_micros: 0,
            leaders_max: 2,
            queue_chunks_max: 8192,
        }
    }
}

impl BatchOptions {
    /// The options with every bound at least 1 and a batch able to hold the largest
    /// request it is given.
    fn sane(mut self) -> Self {
        self.chunks_max = self.chunks_max.max(REQUEST_CHUNKS_MAX);
        self.leaders_max = self.leaders_max.max(1);
        self.queue_chunks_max = self.queue_chunks_max.max(self.chunks_max);
        if self.chunks_wanted == 0 || self.chunks_wanted > self.chunks_max {
            self.chunks_wanted = self.chunks_max;
        }
        self
    }
}

/// What a writer gets back from its batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Applied: the last journal sequence of the request's mapping changes.
    Done(u64),
    /// The batch failed: write the request alone.
    Retry,
}

/// One request waiting in a batch.
struct Slot {
    outcome: Mutex<Option<Outcome>>,
    queued_at: Instant,
    /// The writer, woken alone when its outcome is set (waking every waiting writer for
    /// each batch cost more than the batch on a busy machine).
    writer: std::thread::Thread,
}

/// A batch being filled, or closed and handed to a leader.
pub(crate) struct Batch {
    /// The requests' blocks, back to back.
    pub(crate) buf: Vec<u8>,
    /// Where each chunk goes (one run per request).
    pub(crate) lbas: Lbas,
    slots: Vec<Arc<Slot>>,
    opened: Instant,
}

impl Batch {
    fn new() -> Self {
        Batch { buf: Vec::new(), lbas: Lbas::empty(), slots: Vec::new(), opened: Instant::now() }
    }

    fn chunks(&self) -> usize {
        self.buf.len() / BLOCK_SIZE
    }

    /// Requests in the batch.
    pub(crate) fn requests(&self) -> usize {
        self.slots.len()
    }
}

struct Queue {
    open: Batch,
    /// Chunks in the open batch and in batches being run.
    chunks_held: usize,
    leaders: usize,
}

/// Longest a parked writer sleeps before it looks at the queue again (a safety net: every
/// state change that concerns it also unparks it).
const PARK_MAX: Duration = Duration::from_millis(5);

/// Time and work of one stage, summed over batches.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct StageStats {
    /// Batches through the stage.
    pub batches: u64,
    /// Chunks through the stage.
    pub chunks: u64,
    /// Wall-clock time batches spent in the stage, in microseconds.
    pub busy_micros: u64,
    /// `busy_micros` over the time the volume has been open (above 1 when batches overlap
    /// in the stage).
    pub utilisation: f64,
}

/// The pipeline's figures (`Stats::pipeline`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct PipelineStats {
    /// Small writes are combined into batches.
    pub batching: bool,
    /// Requests that went through the batcher.
    pub batched_requests: u64,
    /// Batches the batcher closed.
    pub batches: u64,
    /// Mean requests per batch.
    pub requests_per_batch: f64,
    /// Mean chunks per batch (the batcher's and the direct large writes').
    pub chunks_per_batch: f64,
    /// Batches that failed and whose requests were written alone.
    pub batches_retried: u64,
    /// Times a writer waited for room (backpressure).
    pub backpressure_waits: u64,
    /// Chunks waiting or in the stages right now, and the most seen.
    pub queue_chunks: u64,
    pub queue_chunks_peak: u64,
    /// Latency of writes through the pipeline, in microseconds: a batched request's from
    /// queueing to its outcome, another's from the start of its stages to their end.
    pub latency_p50_micros: u64,
    pub latency_p99_micros: u64,
    pub latency_max_micros: u64,
    /// Stage 1: zero check, weak hash, crc32c and fingerprint.
    pub fingerprint: StageStats,
    /// Stage 2: journal copies and index lookups (state lock).
    pub index: StageStats,
    /// Stage 3: verification reads and compression.
    pub compress: StageStats,
    /// Stage 4: dedup claims, packing, staging and the journalled mapping changes (state lock).
    pub place: StageStats,
    /// The unique-chunk predictor.
    pub predictor: crate::dedup::predictor::PredictorStats,
    /// Deferred compression.
    pub deferral: super::defer::DeferralStats,
    /// The compute backend of stages 1 and 3.
    pub offload: super::offload::OffloadStats,
}

/// The stages, in order, for `Batcher::note_stage`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Stage {
    Fingerprint,
    Index,
    Compress,
    Place,
}

/// Counters behind `PipelineStats` (own lock, never held with another).
struct Counters {
    batched_requests: u64,
    batches: u64,
    all_batches: u64,
    all_chunks: u64,
    retried: u64,
    waits: u64,
    peak: u64,
    stages: [StageStats; 4],
    latency: Option<hdrhistogram::Histogram<u64>>,
}

/// Latencies above this (60 s) are recorded as this.
const LATENCY_MICROS_MAX: u64 = 60_000_000;

/// The batcher of one volume.
pub(crate) struct Batcher {
    opts: BatchOptions,
    q: Mutex<Queue>,
    /// Signals outcomes, room, and a free leader place.
    cv: Condvar,
    counters: Mutex<Counters>,
    started: Instant,
}

impl Batcher {
    /// The chunks at which a waiting leader closes its batch (`BatchOptions::chunks_wanted`).
    #[cfg(test)]
    pub(crate) fn chunks_wanted(&self) -> usize {
        self.opts.chunks_wanted
    }

    pub(crate) fn new(opts: BatchOptions) -> Self {
        Batcher {
            opts: opts.sane(),
            q: Mutex::new(Queue { open: Batch::new(), chunks_held: 0, leaders: 0 }),
            cv: Condvar::new(),
            counters: Mutex::new(Counters {
                batched_requests: 0,
                batches: 0,
                all_batches: 0,
                all_chunks: 0,
                retried: 0,
                waits: 0,
                peak: 0,
                stages: [StageStats::default(); 4],
                latency: hdrhistogram::Histogram::new_with_bounds(1, LATENCY_MICROS_MAX, 2).ok(),
            }),
            started: Instant::now(),
        }
    }

    /// True when a write of `chunks` whole blocks goes through the batcher.
    pub(crate) fn takes(&self, chunks: usize) -> bool {
        self.opts.enabled && chunks > 0 && chunks <= REQUEST_CHUNKS_MAX
    }

    /// Writes `buf` (whole blocks from `lba`) as part of a batch: `run` runs the stages for
    /// a closed batch (on whichever writer leads it) and returns the last journal sequence
    /// of each request's changes, in order, or an error for the whole batch.
    pub(crate) fn write(
        &self,
        lba: u64,
        buf: &[u8],
        run: impl Fn(&Batch) -> std::result::Result<Vec<u64>, ()>,
    ) -> Outcome {
        let chunks = buf.len() / BLOCK_SIZE;
        debug_assert!(
            self.takes(chunks) && buf.len().is_multiple_of(BLOCK_SIZE),
            "the batcher takes whole small writes"
        );
        let slot =
            Arc::new(Slot { outcome: Mutex::new(None), queued_at: Instant::now(), writer: std::thread::current() });
        let mut q = self.q.lock();
        // Backpressure: wait for room for this request.
        let mut waited = false;
        while q.chunks_held + chunks > self.opts.queue_chunks_max || q.open.chunks() + chunks > self.opts.chunks_max {
            waited = true;
            // A full open batch with a free leader place is closed by the next leader: be it.
            if q.leaders < self.opts.leaders_max && q.open.chunks() > 0 {
                q = self.lead(q, &run, false);
                continue;
            }
            self.cv.wait(&mut q);
        }
        if waited {
            self.counters.lock().waits += 1;
        }
        if q.open.slots.is_empty() {
            q.open.opened = Instant::now();
        }
        let first = q.open.chunks();
        q.open.lbas.push(first, lba);
        q.open.buf.extend_from_slice(buf);
        q.open.slots.push(slot.clone());
        q.chunks_held += chunks;
        if q.open.chunks() >= self.opts.chunks_max {
            // A leader keeping the batch open for more requests closes it now.
            self.cv.notify_all();
        }
        let held = q.chunks_held as u64;
        {
            let mut c = self.counters.lock();
            c.peak = c.peak.max(held);
        }
        loop {
            if let Some(o) = *slot.outcome.lock() {
                return o;
            }
            if q.leaders < self.opts.leaders_max && !q.open.slots.is_empty() {
                q = self.lead(q, &run, true);
                continue;
            }
            // Parked until a leader sets this outcome, or a leader place frees up while
            // this request still waits in the open batch (`lead` wakes its first writer).
            drop(q);
            std::thread::park_timeout(PARK_MAX);
            q = self.q.lock();
        }
    }

    /// Closes the open batch (after the wait the options allow, when `may_wait`), runs it
    /// with the queue unlocked and hands out its outcomes; returns the queue locked again.
    fn lead<'a>(
        &'a self,
        mut q: parking_lot::MutexGuard<'a, Queue>,
        run: &impl Fn(&Batch) -> std::result::Result<Vec<u64>, ()>,
        may_wait: bool,
    ) -> parking_lot::MutexGuard<'a, Queue> {
        q.leaders += 1;
        if may_wait && self.opts.wait_micros > 0 {
            let deadline = q.open.opened + Duration::from_micros(self.opts.wait_micros);
            while q.open.chunks() < self.opts.chunks_wanted && Instant::now() < deadline {
                if self.cv.wait_until(&mut q, deadline).timed_out() {
                    break;
                }
            }
        }
        let batch = std::mem::replace(&mut q.open, Batch::new());
        assert!(batch.chunks() <= self.opts.chunks_max, "a batch holds at most chunks_max chunks");
        drop(q);
        let result = run(&batch);
        let now = Instant::now();
        {
            let mut c = self.counters.lock();
            c.batches += 1;
            c.batched_requests += batch.slots.len() as u64;
            if result.is_err() {
                c.retried += 1;
            }
            if let Some(h) = c.latency.as_mut() {
                for s in &batch.slots {
                    let us = now.duration_since(s.queued_at).as_micros().clamp(1, u128::from(LATENCY_MICROS_MAX));
                    let _ = h.record(us as u64);
                }
            }
        }
        let seqs = result.ok().filter(|s| s.len() == batch.slots.len());
        for (k, s) in batch.slots.iter().enumerate() {
            let o = match seqs.as_ref().and_then(|v| v.get(k)) {
                Some(&seq) => Outcome::Done(seq),
                None => Outcome::Retry,
            };
            *s.outcome.lock() = Some(o);
        }
        for s in &batch.slots {
            s.writer.unpark();
        }
        let mut q = self.q.lock();
        q.leaders -= 1;
        q.chunks_held -= batch.chunks();
        // A leader place is free: the open batch's first writer leads it next. Writers
        // waiting for room (backpressure) wait on the condition variable.
        if let Some(next) = q.open.slots.first() {
            next.writer.unpark();
        }
        self.cv.notify_all();
        q
    }

    /// Records the latency of a write that ran its stages alone (batching off, a large
    /// request, or a retry), so that the figures compare with and without batching.
    pub(crate) fn note_latency(&self, elapsed: Duration) {
        let us = elapsed.as_micros().clamp(1, u128::from(LATENCY_MICROS_MAX)) as u64;
        if let Some(h) = self.counters.lock().latency.as_mut() {
            let _ = h.record(us);
        }
    }

    /// Counts a batch through `stage` (`elapsed` of wall-clock time).
    pub(crate) fn note_stage(&self, stage: Stage, chunks: usize, elapsed: Duration) {
        let mut c = self.counters.lock();
        if matches!(stage, Stage::Fingerprint) {
            c.all_batches += 1;
            c.all_chunks += chunks as u64;
        }
        if let Some(s) = c.stages.get_mut(stage as usize) {
            s.batches += 1;
            s.chunks += chunks as u64;
            s.busy_micros += elapsed.as_micros() as u64;
        }
    }

    /// The figures as of now.
    pub(crate) fn stats(&self) -> PipelineStats {
        let held = self.q.lock().chunks_held as u64;
        let c = self.counters.lock();
        let up = self.started.elapsed().as_micros().max(1) as f64;
        let stage = |k: usize| {
            let mut s = c.stages.get(k).copied().unwrap_or_default();
            s.utilisation = s.busy_micros as f64 / up;
            s
        };
        let q = |p: f64| c.latency.as_ref().map_or(0, |h| h.value_at_quantile(p));
        PipelineStats {
            batching: self.opts.enabled,
            batched_requests: c.batched_requests,
            batches: c.batches,
            requests_per_batch: if c.batches == 0 { 0.0 } else { c.batched_requests as f64 / c.batches as f64 },
            chunks_per_batch: if c.all_batches == 0 { 0.0 } else { c.all_chunks as f64 / c.all_batches as f64 },
            batches_retried: c.retried,
            backpressure_waits: c.waits,
            queue_chunks: held,
            queue_chunks_peak: c.peak,
            latency_p50_micros: q(0.5),
            latency_p99_micros: q(0.99),
            latency_max_micros: c.latency.as_ref().map_or(0, |h| h.max()),
            fingerprint: stage(0),
            index: stage(1),
            compress: stage(2),
            place: stage(3),
            predictor: Default::default(),
            deferral: Default::default(),
            offload: Default::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Requests from many threads: every one gets its own outcome, batches never exceed
    /// their bound, and requests are combined when they arrive while a batch runs.
    #[test]
    fn concurrent_requests_are_combined_and_each_gets_its_outcome() {
        let b = Arc::new(Batcher::new(BatchOptions { chunks_max: 64, leaders_max: 1, ..BatchOptions::default() }));
        let most = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let (b, most) = (b.clone(), most.clone());
                std::thread::spawn(move || {
                    for k in 0..50u64 {
                        let lba = t * 1000 + k;
                        let buf = vec![t as u8; BLOCK_SIZE];
                        let o = b.write(lba, &buf, |batch| {
                            most.fetch_max(batch.requests(), Ordering::Relaxed);
                            assert!(batch.chunks() <= 64);
                            std::thread::sleep(Duration::from_micros(200));
                            // The "sequence" of each request is its block: the test checks
                            // each writer is answered with its own.
                            Ok((0..batch.requests()).map(|r| batch.lbas.at(r)).collect())
                        });
                        assert_eq!(o, Outcome::Done(lba));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("writer thread");
        }
        let s = b.stats();
        assert_eq!(s.batched_requests, 400);
        assert!(most.load(Ordering::Relaxed) > 1, "requests arriving during a batch are combined");
        assert!(s.batches < 400);
        assert_eq!(s.queue_chunks, 0);
    }

    /// A leader allowed to wait a long time for more requests closes its batch as soon as
    /// it holds the chunks its backend wants, not at `chunks_max`.
    #[test]
    fn a_batch_holding_the_chunks_wanted_closes_without_waiting() {
        let opts = BatchOptions {
            enabled: true,
            chunks_max: 1024,
            chunks_wanted: 64,
            wait_micros: 60_000_000,
            ..BatchOptions::default()
        };
        let b = Batcher::new(opts);
        let started = Instant::now();
        let buf = vec![7u8; REQUEST_CHUNKS_MAX * BLOCK_SIZE];
        let o = b.write(0, &buf, |batch| Ok((0..batch.requests()).map(|r| batch.lbas.at(r)).collect()));
        assert_eq!(o, Outcome::Done(0));
        assert!(started.elapsed() < Duration::from_secs(30), "the leader waited for chunks_max");
        // 0 means chunks_max; a wish beyond chunks_max is bounded by it.
        assert_eq!(BatchOptions { chunks_wanted: 0, ..opts }.sane().chunks_wanted, 1024);
        assert_eq!(BatchOptions { chunks_wanted: 5000, ..opts }.sane().chunks_wanted, 1024);
    }

    #[test]
    fn a_failed_batch_tells_every_request_to_retry() {
        let b = Batcher::new(BatchOptions::default());
        let o = b.write(5, &[0u8; BLOCK_SIZE], |_| Err(()));
        assert_eq!(o, Outcome::Retry);
        assert_eq!(b.stats().batches_retried, 1);
    }
}
