//! The rebuild of the volume index from the chapter ring, after a volume opens.
//!
//! Two parts (docs/design.md, "The fingerprint index", crashes):
//! 1. `find_newest` (at open, before the volume accepts I/O): the newest chapter in the
//!    ring, by a binary search over the chapter slots' first pages (a few dozen 4 KiB
//!    reads whatever the ring's size), so the session knows which chapter to open next;
//! 2. `Rebuilder::step`, repeated by a background thread (or by the caller, one step at
//!    a time): reads the window's chapters in ring order, oldest first, in sequential
//!    reads of `READ_BYTES`, checks and decodes the pages holding no lock, then inserts
//!    their records (the hooks in sparse mode) into the volume index under the table's
//!    own lock, `INSERT_BATCH` at a time. Writers keep running meanwhile: a chapter not
//!    rebuilt yet only misses duplicates.
//!
//! Invariants:
//! - Nothing read here is trusted: a page is used only if it checks (magic, crc, volume,
//!   position, the chapter its slot must hold) and was written by an earlier session
//!   (its epoch is below this session's first), and its records are of an earlier epoch,
//!   so `Deduper` compares every one of them byte for byte before sharing.
//! - The rebuild never takes the volume's state lock, only the volume index's, and holds
//!   it for at most `INSERT_BATCH` inserts; the lock order is state → table.
//! - A record newer than the rebuilt one (made by this session) is never replaced by it
//!   (the volume index keeps the newer of two records), and a chapter that left the
//!   window while the rebuild ran is not inserted.
//! - Bounded: one read buffer of `READ_BYTES`; a stop request ends the rebuild at the
//!   next step (close, or the volume dropped).

use super::chapter::{page_records, RingLayout, RECORDS_PER_PAGE};
use super::index::{is_hook, Shared};
use crate::config::{IndexMode, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::io::aligned::AlignedBuf;
use crate::io::{Dev, IoKind};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Largest read of the rebuild (whole chapters, in ring order).
pub const READ_BYTES: u64 = 16 << 20;
/// Records inserted per hold of the volume index's lock.
const INSERT_BATCH: usize = 8192;
/// Neighbouring slots probed when a chapter slot's first page does not check.
const PROBE_SPAN: u64 = 8;

/// Reads the first page of chapter slot `slot`: the chapter it holds and its epoch, if
/// the page checks.
fn head(meta: &Dev, ring: &RingLayout, uuid_lo: u64, slot: u64, buf: &mut [u8], reads: &mut u64) -> Option<(u64, u32)> {
    *reads += 1;
    let off = (ring.start_block + slot * ring.pages_per_chapter) * BLOCK_SIZE_U64;
    meta.read(IoKind::Index, buf, off).ok()?;
    let (h, _) = page_records(buf, uuid_lo)?;
    (h.page == 0 && h.vcn % ring.chapters == slot).then_some((h.vcn, h.epoch))
}

/// What `find_newest` found.
#[derive(Debug, Clone, Copy, Default)]
pub struct Newest {
    /// The newest chapter (None: an empty ring).
    pub vcn: Option<u64>,
    /// The highest epoch among the pages read.
    pub epoch_max: u32,
    /// First pages read.
    pub reads: u64,
}

/// The newest chapter of the ring, from a few of its slots' first pages.
///
/// Chapters are opened in order, so along the slots the chapter numbers rise from slot 0
/// to the newest chapter's slot, then drop once (to the oldest chapter of the window, or
/// to never-written slots). A binary search for the last slot at or above the first
/// valid slot's chapter finds the drop; a slot whose first page does not check is judged
/// by the next valid one within `PROBE_SPAN`, and the slots just past the answer are
/// probed for a newer chapter hidden behind such a hole. A ring damaged in ways this
/// misses yields an older chapter than the newest: the session then reuses slots of
/// chapters it did not rebuild (dedup lost, never correctness: every page is checked
/// against the chapter its slot must hold, and their records are verified byte for byte).
pub fn find_newest(meta: &Dev, ring: &RingLayout, uuid_lo: u64) -> Newest {
    let mut buf = vec![0u8; BLOCK_SIZE];
    let mut out = Newest::default();
    let c = ring.chapters;
    let mut probe = |slot: u64, out: &mut Newest| -> Option<(u64, u64)> {
        (slot..(slot + PROBE_SPAN).min(c)).find_map(|s| {
            let (v, e) = head(meta, ring, uuid_lo, s, &mut buf, &mut out.reads)?;
            out.epoch_max = out.epoch_max.max(e);
            Some((s, v))
        })
    };
    // An anchor: the first valid slot near the start, else any of 64 spread over the ring.
    let stride = (c / 64).max(PROBE_SPAN);
    let Some((s0, v0)) = (0..c).step_by(stride as usize).find_map(|s| probe(s, &mut out)) else {
        return out;
    };
    // Last slot in s0..c whose chapter is at least v0 (true up to the drop).
    let (mut lo, mut hi, mut best) = (s0 + 1, c, v0);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match probe(mid, &mut out) {
            Some((s, v)) if v >= v0 => {
                best = best.max(v);
                lo = s + 1;
            }
            _ => hi = mid,
        }
    }
    // A newer chapter just past a hole the search stopped at.
    let mut next = best % c + 1;
    while next < c {
        match probe(next, &mut out) {
            Some((s, v)) if v > best => {
                best = v;
                next = s + 1;
            }
            _ => break,
        }
    }
    out.vcn = Some(best);
    out
}

/// The rebuild of the window's chapters, one sequential read per step.
pub struct Rebuilder {
    meta: Dev,
    ring: RingLayout,
    uuid_lo: u64,
    mode: IndexMode,
    /// Pages of this epoch or later were written by this session: skipped.
    epoch_first: u32,
    /// The newest chapter when the session opened; the window's chapters are the
    /// `ring.chapters - 1` up to it.
    newest: u64,
    /// Chapters of the window still to read, oldest first: the next one's number.
    next_vcn: u64,
    shared: Arc<Shared>,
    buf: Option<AlignedBuf>,
    started: std::time::Instant,
}

impl Rebuilder {
    /// A rebuild of the chapters up to `newest` (the session opened `newest + 1`).
    pub fn new(
        meta: Dev,
        ring: RingLayout,
        uuid_lo: u64,
        mode: IndexMode,
        epoch_first: u32,
        newest: u64,
        shared: Arc<Shared>,
    ) -> Self {
        let first = (newest + 2).saturating_sub(ring.chapters);
        let p = &shared.progress;
        p.chapters_total.store(newest + 1 - first, Ordering::Relaxed);
        p.running.store(true, Ordering::Relaxed);
        Rebuilder {
            meta,
            ring,
            uuid_lo,
            mode,
            epoch_first,
            newest,
            next_vcn: first,
            shared,
            buf: None,
            started: std::time::Instant::now(),
        }
    }

    /// True when every chapter was read (or the rebuild was stopped).
    pub fn done(&self) -> bool {
        self.next_vcn > self.newest || self.shared.stop.load(Ordering::Relaxed)
    }

    /// Reads, checks and inserts the next run of chapters (contiguous slots, at most
    /// `READ_BYTES`). Returns false once there is nothing left.
    pub fn step(&mut self) -> bool {
        if self.done() {
            self.finish();
            return false;
        }
        let ring = self.ring;
        let chapter_bytes = ring.pages_per_chapter * BLOCK_SIZE_U64;
        let per_read = (READ_BYTES / chapter_bytes).max(1);
        // Chapters that left the window since the session opened are not worth reading.
        let open = self.shared.open_vcn.load(Ordering::Acquire);
        let first_live = (open + 1).saturating_sub(ring.chapters);
        let skipped = first_live.saturating_sub(self.next_vcn).min(self.newest + 1 - self.next_vcn);
        let p = &self.shared.progress;
        p.chapters_done.fetch_add(skipped, Ordering::Relaxed);
        self.next_vcn += skipped;
        if self.next_vcn > self.newest {
            self.finish();
            return false;
        }
        // A run of chapters in consecutive slots (it ends where the ring wraps).
        let v0 = self.next_vcn;
        let slot0 = v0 % ring.chapters;
        let n = per_read.min(self.newest + 1 - v0).min(ring.chapters - slot0);
        let len = (n * chapter_bytes) as usize;
        if self.buf.is_none() {
            // One buffer for every step: a whole read, or less when a chapter is larger.
            self.buf = AlignedBuf::new((per_read * chapter_bytes) as usize);
        }
        let Some(chunk) = self.buf.as_mut().and_then(|b| b.as_mut_slice().get_mut(..len)) else {
            // No memory for the read buffer: the rebuild ends (dedup lost, nothing else).
            self.shared.stop.store(true, Ordering::Relaxed);
            self.finish();
            return false;
        };
        self.next_vcn += n;
        p.bytes_read.fetch_add(len as u64, Ordering::Relaxed);
        if self.meta.read(IoKind::Index, chunk, ring.page_offset(v0, 0)).is_err() {
            p.pages_skipped.fetch_add(n * ring.pages_per_chapter, Ordering::Relaxed);
            p.chapters_done.fetch_add(n, Ordering::Relaxed);
            return true;
        }
        // Decoded holding no lock: (fingerprint, chapter, page, position).
        let mut recs: Vec<([u8; 32], u64, u64, u64)> = Vec::with_capacity(
            if self.mode == IndexMode::Dense { n as usize * ring.records_per_chapter() as usize } else { 0 },
        );
        let (mut records, mut skipped_pages) = (0u64, 0u64);
        for (k, pages) in chunk.chunks_exact(chapter_bytes as usize).enumerate() {
            let vcn = v0 + k as u64;
            for (i, b) in pages.chunks_exact(BLOCK_SIZE).enumerate() {
                let ok = |h: &super::chapter::PageHeader| {
                    h.vcn == vcn && usize::from(h.page) == i && h.epoch < self.epoch_first
                };
                let Some((_, it)) = page_records(b, self.uuid_lo).filter(|(h, _)| ok(h)) else {
                    skipped_pages += 1;
                    continue;
                };
                for (at, hash) in it.enumerate() {
                    records += 1;
                    if self.mode == IndexMode::Dense || is_hook(hash) {
                        recs.push((*hash, vcn, i as u64, at as u64));
                    }
                }
            }
        }
        debug_assert!(recs.len() as u64 <= n * ring.pages_per_chapter * RECORDS_PER_PAGE as u64);
        for batch in recs.chunks(INSERT_BATCH) {
            let mut t = self.shared.table.lock();
            let open = self.shared.open_vcn.load(Ordering::Acquire);
            for (h, vcn, page, at) in batch {
                // Left the window meanwhile: its slot would be dead on arrival.
                if open - vcn < ring.chapters {
                    t.insert(h, *vcn, *page, *at, open);
                }
            }
        }
        p.records.fetch_add(records, Ordering::Relaxed);
        p.pages_skipped.fetch_add(skipped_pages, Ordering::Relaxed);
        p.chapters_done.fetch_add(n, Ordering::Relaxed);
        p.millis.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
        true
    }

    fn finish(&mut self) {
        let p = &self.shared.progress;
        if p.running.swap(false, Ordering::Relaxed) {
            p.millis.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
        }
        self.buf = None;
    }
}

/// The background thread running a rebuild; stopped and joined when dropped.
pub struct RebuildThread {
    shared: Arc<Shared>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl RebuildThread {
    /// Runs `r` to its end on a thread of its own; None when no thread could be made
    /// (the caller then runs it itself).
    pub fn start(mut r: Rebuilder) -> Result<Self, Rebuilder> {
        let shared = r.shared.clone();
        let (tx, rx) = std::sync::mpsc::sync_channel::<Rebuilder>(1);
        let spawned = std::thread::Builder::new().name("dedupvol-index-rebuild".into()).spawn(move || {
            let Ok(mut r) = rx.recv() else { return };
            while r.step() {}
        });
        match spawned {
            Ok(handle) => {
                // The thread is waiting on the channel; a send cannot fail while it lives.
                if let Err(std::sync::mpsc::SendError(back)) = tx.send(r) {
                    r = back;
                    r.shared.stop.store(true, Ordering::Relaxed);
                    r.finish();
                }
                Ok(RebuildThread { shared, handle: Some(handle) })
            }
            Err(_) => Err(r),
        }
    }

    /// Asks the thread to stop after its current step and waits for it.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.shared.progress.running.store(false, Ordering::Relaxed);
    }

    /// Waits for the rebuild to end on its own.
    pub fn wait(&mut self) {
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for RebuildThread {
    fn drop(&mut self) {
        self.stop();
    }
}
