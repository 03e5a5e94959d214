//! The rebuild of the volume index from the chapter ring, after a volume opens.
//!
//! Two parts (docs/design.md, "The fingerprint index", crashes):
//! 1. `find_newest` (at open, before the volume accepts I/O): the newest chapter in the
//!    ring, by a binary search over the chapter slots' first pages (a few dozen 4 KiB
//!    reads whatever the ring's size), so the session knows which chapter to open next;
//! 2. the rebuild proper, in the background (`Rebuilder::run_pipelined`, three threads)
//!    or one step at a time by the caller (`Rebuilder::step`): reads the window's
//!    chapters in ring order, oldest first, in sequential reads of `READ_BYTES`; checks
//!    and decodes the pages holding no lock, preparing each record (the hooks, in sparse
//!    mode) for its insert: its two buckets, word and page (`PreparedRun`); then inserts
//!    them into the volume index under the table's own lock, `INSERT_BATCH` at a time
//!    (`VolumeIndex::insert_prepared`: prefetched, on two threads). In the background the
//!    reads, the decoding and the inserts overlap, so the rebuild runs at the slower of
//!    the device and the inserts, not at their sum. Writers keep running meanwhile: a
//!    chapter not rebuilt yet only misses duplicates.
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
//! - Bounded: `READ_BUFFERS` read buffers of `READ_BYTES` and `PREPARED_RUNS + 1` lists
//!   of prepared records (one of each, stepped by hand), returned to the system at the
//!   end; a stop request ends the rebuild at the next run (close, or the volume dropped).
//! - Runs are inserted in ring order, each once; every page passes the same checks
//!   whenever it was read.

use super::chapter::{chapter_names, page_records, Name, RingLayout, RECORDS_PER_PAGE};
use super::index::{is_hook, Shared};
use super::volume_index::PreparedRun;
use crate::config::{IndexMode, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::io::aligned::AlignedBuf;
use crate::io::{Dev, IoKind};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Largest read of the rebuild (whole chapters, in ring order).
pub const READ_BYTES: u64 = 8 << 20;
/// Read buffers of a background rebuild: one being inserted, one being read, and two read
/// ahead, so that neither the device nor the inserting threads wait on the other's
/// jitter.
const READ_BUFFERS: usize = 4;
/// Lists of prepared records a background rebuild's decoder may fill ahead of the inserts.
const PREPARED_RUNS: usize = 2;
/// Records inserted per hold of the volume index's lock.
const INSERT_BATCH: usize = 16384;
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

/// How the window's chapters (up to `newest`) are cut into runs, one sequential read each:
/// of their name pages when the ring has them, else of their record pages.
#[derive(Debug, Clone, Copy)]
struct Runs {
    ring: RingLayout,
    newest: u64,
}

impl Runs {
    /// Bytes read per chapter.
    fn chapter_bytes(&self) -> u64 {
        self.ring.rebuild_pages() * BLOCK_SIZE_U64
    }

    /// Chapters per read buffer (at least one).
    fn per_read(&self) -> u64 {
        (READ_BYTES / self.chapter_bytes()).max(1)
    }

    /// Bytes of a read buffer: a whole read, or more when a chapter is larger.
    fn buffer_bytes(&self) -> usize {
        (self.per_read() * self.chapter_bytes()) as usize
    }

    /// The next run from chapter `*next` on (its first chapter and length), past the
    /// chapters that left the window since the session opened (not worth reading: counted
    /// done), and moves `*next` past it; None when no chapter is left. A run is at most a
    /// read's worth, up to the newest chapter and to the end of the ring (its chapters are
    /// in consecutive slots).
    fn next(&self, next: &mut u64, shared: &Shared) -> Option<(u64, u64)> {
        let chapters = self.ring.chapters;
        let open = shared.open_vcn.load(Ordering::Acquire);
        let first_live = (open + 1).saturating_sub(chapters);
        let skipped = first_live.saturating_sub(*next).min((self.newest + 1).saturating_sub(*next));
        let p = &shared.progress;
        p.chapters_done.fetch_add(skipped, Ordering::Relaxed);
        *next += skipped;
        if *next > self.newest {
            return None;
        }
        let v0 = *next;
        let n = self.per_read().min(self.newest + 1 - v0).min(chapters - v0 % chapters);
        *next += n;
        p.bytes_read.fetch_add(n * self.chapter_bytes(), Ordering::Relaxed);
        p.bytes_covered.fetch_add(n * self.ring.pages_per_chapter * BLOCK_SIZE_U64, Ordering::Relaxed);
        Some((v0, n))
    }

    /// Reads the run of `n` chapters from `v0` into `buf`; false when the read failed.
    fn read(&self, meta: &Dev, v0: u64, n: u64, buf: &mut AlignedBuf) -> bool {
        let len = (n * self.chapter_bytes()) as usize;
        buf.as_mut_slice()
            .get_mut(..len)
            .is_some_and(|chunk| meta.read(IoKind::Index, chunk, self.ring.rebuild_offset(v0)).is_ok())
    }
}

/// How the pages of a run are checked and their records prepared, holding no lock.
#[derive(Clone)]
struct Decoding {
    ring: RingLayout,
    uuid_lo: u64,
    mode: IndexMode,
    /// Pages of this epoch or later were written by this session: skipped.
    epoch_first: u32,
    /// Buckets of the volume index (its size never changes).
    buckets: usize,
    /// Reads the record pages of a chapter whose names are incomplete.
    meta: Dev,
}

impl Decoding {
    /// Prepares the run of `n` chapters from `v0` read into `buf` (`run`); None: the read
    /// failed, its pages are counted skipped and `recs` is emptied. False when the lists
    /// could not get their memory.
    fn read_run(&self, buf: Option<&AlignedBuf>, v0: u64, n: u64, shared: &Shared, recs: &mut PreparedRun) -> bool {
        let len = (n * self.ring.rebuild_pages() * BLOCK_SIZE_U64) as usize;
        match buf.and_then(|b| b.as_slice().get(..len)) {
            Some(chunk) => self.run(chunk, v0, shared, recs),
            None => {
                shared.progress.pages_skipped.fetch_add(n * self.ring.rebuild_pages(), Ordering::Relaxed);
                recs.clear(self.buckets, 0)
            }
        }
    }

    /// Checks the pages of the run of chapters from `v0` in `chunk` (their name pages, or
    /// their record pages in a ring without names) and prepares their records (the hooks,
    /// sparse: each one's buckets, word and page) into `recs`, emptied first; counts the
    /// records read and the pages skipped. A chapter whose names are incomplete (cut short
    /// by a crash before its close, or torn) has its record pages read here instead.
    /// False when the lists could not get their memory (the rebuild then ends: dedup lost,
    /// nothing else).
    fn run(&self, chunk: &[u8], v0: u64, shared: &Shared, recs: &mut PreparedRun) -> bool {
        let chapter_bytes = (self.ring.rebuild_pages() * BLOCK_SIZE_U64) as usize;
        // A read holds at most this many records.
        let most = chunk.len() / chapter_bytes * self.ring.records_per_chapter() as usize;
        if !recs.clear(self.buckets, most) {
            shared.stop.store(true, Ordering::Relaxed);
            return false;
        }
        let mut counts = (0u64, 0u64);
        let mut fallback: Option<AlignedBuf> = None;
        for (k, pages) in chunk.chunks_exact(chapter_bytes).enumerate() {
            let vcn = v0 + k as u64;
            if !self.ring.has_names() {
                self.records(pages, vcn, recs, &mut counts);
                continue;
            }
            if let Some((_, names)) = chapter_names(pages, self.uuid_lo, vcn, self.epoch_first) {
                counts.0 += names.len() as u64;
                for (r, name) in names.iter().enumerate() {
                    if self.mode == IndexMode::Dense || name.is_hook() {
                        let (page, at) = (r / RECORDS_PER_PAGE, r % RECORDS_PER_PAGE);
                        // Room was made for every record of the read.
                        let pushed = recs.push(name, vcn, page as u64, at as u64);
                        debug_assert!(pushed);
                    }
                }
                continue;
            }
            // Incomplete names: the chapter's record pages, read on their own (one buffer
            // for every such chapter of the run).
            let bytes = (self.ring.pages_per_chapter * BLOCK_SIZE_U64) as usize;
            shared.progress.chapters_without_names.fetch_add(1, Ordering::Relaxed);
            if fallback.is_none() {
                fallback = AlignedBuf::new(bytes);
            }
            let read = fallback.as_mut().and_then(|b| {
                let c = b.as_mut_slice().get_mut(..bytes)?;
                shared.progress.bytes_read.fetch_add(bytes as u64, Ordering::Relaxed);
                self.meta.read(IoKind::Index, c, self.ring.page_offset(vcn, 0)).ok()?;
                Some(&*c)
            });
            match read {
                Some(pages) => self.records(pages, vcn, recs, &mut counts),
                None => counts.1 += self.ring.pages_per_chapter,
            }
        }
        let p = &shared.progress;
        p.records.fetch_add(counts.0, Ordering::Relaxed);
        p.pages_skipped.fetch_add(counts.1, Ordering::Relaxed);
        true
    }

    /// Prepares the records of the record pages `pages` of chapter `vcn` into `recs`;
    /// adds the records read and the pages skipped to `counts`.
    fn records(&self, pages: &[u8], vcn: u64, recs: &mut PreparedRun, counts: &mut (u64, u64)) {
        for (i, b) in pages.chunks_exact(BLOCK_SIZE).enumerate() {
            let ok =
                |h: &super::chapter::PageHeader| h.vcn == vcn && usize::from(h.page) == i && h.epoch < self.epoch_first;
            let Some((_, it)) = page_records(b, self.uuid_lo).filter(|(h, _)| ok(h)) else {
                counts.1 += 1;
                continue;
            };
            for (at, hash) in it.enumerate() {
                counts.0 += 1;
                if self.mode == IndexMode::Dense || is_hook(hash) {
                    // Room was made for every record of the read.
                    let pushed = recs.push(&Name::of(hash), vcn, i as u64, at as u64);
                    debug_assert!(pushed);
                }
            }
        }
    }
}

/// Inserts the prepared records of a run into the volume index, `INSERT_BATCH` per hold
/// of its lock; a chapter that left the window meanwhile is left out (its slots would be
/// dead on arrival).
fn insert(shared: &Shared, recs: &PreparedRun, ring_chapters: u64) {
    let parts = recs.len().div_ceil(INSERT_BATCH);
    for k in 0..parts {
        let mut t = shared.table.lock();
        let open = shared.open_vcn.load(Ordering::Acquire);
        t.insert_prepared(recs.part(k, parts), recs.chapters(), open, ring_chapters);
    }
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
    recs: PreparedRun,
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
            recs: PreparedRun::default(),
            started: std::time::Instant::now(),
        }
    }

    /// True when every chapter was read (or the rebuild was stopped).
    pub fn done(&self) -> bool {
        self.next_vcn > self.newest || self.shared.stop.load(Ordering::Relaxed)
    }

    /// Reads, checks and inserts the next run of chapters (contiguous slots, at most
    /// `READ_BYTES`), one read at a time. Returns false once there is nothing left.
    pub fn step(&mut self) -> bool {
        if self.done() {
            self.finish();
            return false;
        }
        let Some((v0, n)) = self.runs().next(&mut self.next_vcn, &self.shared) else {
            self.finish();
            return false;
        };
        // One buffer for every step: a whole read, or less when a chapter is larger.
        let Some(mut cur) = self.buf.take().or_else(|| AlignedBuf::new(self.runs().buffer_bytes())) else {
            // No memory for the read buffer: the rebuild ends (dedup lost, nothing else).
            self.shared.stop.store(true, Ordering::Relaxed);
            self.finish();
            return false;
        };
        let ok = self.runs().read(&self.meta, v0, n, &mut cur);
        self.process(v0, n, ok.then_some(&cur));
        self.buf = Some(cur);
        true
    }

    /// Runs the whole rebuild as a pipeline of three threads (a background rebuild): a
    /// reader reads run after run into up to `READ_BUFFERS` buffers, a decoder checks and
    /// prepares them into up to `PREPARED_RUNS` lists, and this thread inserts those. The
    /// device is kept busy whenever the inserts fall behind (they take about as long as
    /// the reads) and vice versa, and the decoding (a fifth of the work) runs beside both.
    fn run_pipelined(&mut self) {
        let (runs, decoding, ring_chapters) = (self.runs(), self.decoding(), self.ring.chapters);
        let (meta, shared) = (self.meta.clone(), self.shared.clone());
        let mut cursor = self.next_vcn;
        let finished = std::thread::scope(|sc| {
            use std::sync::mpsc::{channel, sync_channel};
            let (free_tx, free_rx) = channel::<AlignedBuf>();
            let (full_tx, full_rx) = sync_channel::<(u64, u64, bool, AlignedBuf)>(READ_BUFFERS);
            let (spent_tx, spent_rx) = channel::<PreparedRun>();
            let (ready_tx, ready_rx) = sync_channel::<(u64, PreparedRun)>(PREPARED_RUNS);
            let (cursor, reader_shared, decoder_shared) = (&mut cursor, &shared, &shared);
            let reader = move || {
                let mut made = 0;
                while !reader_shared.stop.load(Ordering::Relaxed) {
                    let Some((v0, n)) = runs.next(cursor, reader_shared) else { break };
                    // A returned buffer, else a new one while fewer than READ_BUFFERS exist,
                    // else wait for one.
                    let buf = free_rx.try_recv().ok().or_else(|| {
                        let b = (made < READ_BUFFERS).then(|| AlignedBuf::new(runs.buffer_bytes())).flatten();
                        made += usize::from(b.is_some());
                        b
                    });
                    let Some(mut buf) = buf.or_else(|| (made > 0).then(|| free_rx.recv().ok()).flatten()) else {
                        // No memory for a read buffer: the rebuild ends (dedup lost).
                        reader_shared.stop.store(true, Ordering::Relaxed);
                        break;
                    };
                    let ok = runs.read(&meta, v0, n, &mut buf);
                    if full_tx.send((v0, n, ok, buf)).is_err() {
                        break;
                    }
                }
            };
            let decoder = move || {
                let mut made = 0;
                for (v0, n, ok, buf) in full_rx.iter() {
                    // A list the inserter is done with, else a new one while fewer than
                    // PREPARED_RUNS + 1 exist (one more than the channel holds: the
                    // inserter's), else wait for one.
                    let recs = spent_rx.try_recv().ok().or_else(|| {
                        made += 1;
                        (made <= PREPARED_RUNS + 1).then(PreparedRun::default)
                    });
                    let Some(mut recs) = recs.or_else(|| spent_rx.recv().ok()) else { break };
                    if !decoding.read_run(ok.then_some(&buf), v0, n, decoder_shared, &mut recs) {
                        break;
                    }
                    // The reader may have ended: the buffer is then dropped here.
                    let _ = free_tx.send(buf);
                    if ready_tx.send((n, recs)).is_err() {
                        break;
                    }
                }
            };
            let spawn = |name: &str| std::thread::Builder::new().name(format!("dedupvol-index-{name}"));
            // The decoder first: without a reader it ends at once (its channel closed), and
            // nothing was read.
            let Ok(decoder) = spawn("decode").spawn_scoped(sc, decoder) else {
                return false;
            };
            let Ok(reader) = spawn("read").spawn_scoped(sc, reader) else {
                let _ = decoder.join();
                return false;
            };
            for (n, recs) in ready_rx.iter() {
                if self.shared.stop.load(Ordering::Relaxed) {
                    break;
                }
                insert(&self.shared, &recs, ring_chapters);
                self.count_done(n);
                let _ = spent_tx.send(recs);
            }
            // The decoder ends at its next send or wait for a list, then the reader at its.
            drop((ready_rx, spent_tx));
            let _ = decoder.join();
            let _ = reader.join();
            true
        });
        if finished {
            self.next_vcn = cursor;
        }
        // Without the threads, the rebuild goes on one step at a time.
        while self.step() {}
    }

    /// Inserts the run of `n` chapters from `v0` read into `buf` (None: the read failed,
    /// its pages are skipped) and counts it done. The lists are kept for the whole rebuild
    /// (freed at its end: fresh ones per step would leave the allocator holding tens of MiB).
    fn process(&mut self, v0: u64, n: u64, buf: Option<&AlignedBuf>) {
        let mut recs = std::mem::take(&mut self.recs);
        if self.decoding().read_run(buf, v0, n, &self.shared, &mut recs) {
            insert(&self.shared, &recs, self.ring.chapters);
        }
        self.recs = recs;
        self.count_done(n);
    }

    /// Counts `n` more chapters done.
    fn count_done(&self, n: u64) {
        let p = &self.shared.progress;
        p.chapters_done.fetch_add(n, Ordering::Relaxed);
        p.millis.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// How the window's chapters are cut into reads.
    fn runs(&self) -> Runs {
        Runs { ring: self.ring, newest: self.newest }
    }

    /// What the decoding of a run needs.
    fn decoding(&self) -> Decoding {
        let buckets = self.shared.table.lock().bucket_count();
        Decoding {
            ring: self.ring,
            uuid_lo: self.uuid_lo,
            mode: self.mode,
            epoch_first: self.epoch_first,
            buckets,
            meta: self.meta.clone(),
        }
    }

    fn finish(&mut self) {
        let p = &self.shared.progress;
        if p.running.swap(false, Ordering::Relaxed) {
            p.millis.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
        }
        // The read buffer and the lists go back to the system here: they are mapped on
        // their own (`AlignedBuf`), not taken from the heap, whose freed memory glibc
        // would keep resident in the rebuild threads' arenas.
        self.buf = None;
        self.recs = PreparedRun::default();
    }
}

/// The background thread running a rebuild; stopped and joined when dropped.
pub struct RebuildThread {
    shared: Arc<Shared>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl RebuildThread {
    /// Runs `r` to its end on a thread of its own; `r` back when no thread could be made
    /// (the caller then runs it itself).
    pub fn start(mut r: Rebuilder) -> Result<Self, Box<Rebuilder>> {
        let shared = r.shared.clone();
        let (tx, rx) = std::sync::mpsc::sync_channel::<Rebuilder>(1);
        let spawned = std::thread::Builder::new().name("dedupvol-index-rebuild".into()).spawn(move || {
            let Ok(mut r) = rx.recv() else { return };
            // On its own thread the rebuild can afford more buffers and a reader beside it.
            r.run_pipelined();
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
            Err(_) => Err(Box::new(r)),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{FormatOptions, OpenOptions};
    use crate::dedup::chapter::{encode_names, encode_page, PageHeader, Record};
    use crate::dedup::index::{IndexRebuild, Location};
    use crate::io::{FileStorage, IoCounters, IoMode, Storage};
    use crate::volume::Volume;
    use std::time::Instant;

    /// CPU time of the whole process, in seconds.
    fn cpu_seconds() -> f64 {
        // SAFETY: getrusage writes only the struct it is given, zeroed beforehand.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
        let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
        t(u.ru_utime) + t(u.ru_stime)
    }

    /// RSS of the process, after returning the heap's free memory to the kernel (so
    /// that memory freed before a measurement is not counted in it).
    fn rss_bytes() -> u64 {
        // SAFETY: malloc_trim only returns free heap memory to the kernel.
        unsafe {
            libc::malloc_trim(0);
        }
        let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|k| k.parse::<u64>().ok())
            .map_or(0, |k| k << 10)
    }

    /// The mappings holding at least 2 MiB of RSS (start address, size, RSS, name).
    fn big_mappings() -> Vec<(String, u64, u64, String)> {
        let s = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
        let mut out = Vec::new();
        let mut cur: Option<(String, u64, String)> = None;
        for l in s.lines() {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.first().is_some_and(|a| a.contains('-') && !a.ends_with(':')) {
                let (a, b) = f[0].split_once('-').unwrap_or(("0", "0"));
                let size = u64::from_str_radix(b, 16).unwrap_or(0) - u64::from_str_radix(a, 16).unwrap_or(0);
                cur = Some((a.to_string(), size, f.get(5).unwrap_or(&"").to_string()));
            } else if f.first() == Some(&"Rss:") {
                let kb: u64 = f.get(1).and_then(|k| k.parse().ok()).unwrap_or(0);
                if let Some((a, size, name)) = cur.take().filter(|_| kb >= 2048) {
                    out.push((a, size >> 20, kb >> 10, name));
                }
            }
        }
        out
    }

    /// A fingerprint for record `i` (distinct, spread like BLAKE3 output).
    fn fp(i: u64) -> [u8; 32] {
        let mut out = [0u8; 32];
        let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x1234_5678;
        for c in out.chunks_mut(8) {
            x ^= x >> 31;
            x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x ^= x >> 29;
            c.copy_from_slice(&x.to_le_bytes());
        }
        out
    }

    /// Writes `bytes` at `off` of `file` (direct I/O wants an aligned buffer).
    fn write_aligned(file: &Arc<dyn Storage>, bytes: &[u8], off: u64) {
        let mut a = AlignedBuf::new(bytes.len()).expect("buffer");
        a.as_mut_slice().get_mut(..bytes.len()).expect("len").copy_from_slice(bytes);
        file.write_at(a.as_mut_slice().get(..bytes.len()).expect("len"), off).expect("write ring");
    }

    /// Fills every slot of `ring` with a full chapter of distinct synthetic records, as
    /// after 1.5 turns of the ring, and its name pages when the ring has them and `names`
    /// (else the name area is zeroed); returns the newest chapter.
    fn fill_ring(file: &Arc<dyn Storage>, ring: &RingLayout, ulo: u64, names: bool) -> u64 {
        let newest = ring.chapters + ring.chapters / 2 - 1;
        let chapter_bytes = (ring.pages_per_chapter * BLOCK_SIZE_U64) as usize;
        let name_bytes = (ring.name_pages_per_chapter * BLOCK_SIZE_U64) as usize;
        let per_write = (READ_BYTES as usize / chapter_bytes).max(1);
        let mut buf: Vec<u8> = Vec::with_capacity(per_write * chapter_bytes);
        let mut name_buf: Vec<u8> = Vec::with_capacity(per_write * name_bytes);
        let mut first_slot = 0;
        for slot in 0..ring.chapters {
            let vcn = if slot <= newest % ring.chapters {
                newest - newest % ring.chapters + slot
            } else {
                newest - newest % ring.chapters - ring.chapters + slot
            };
            let mut chapter = Vec::new();
            for p in 0..ring.pages_per_chapter {
                let base = (vcn * ring.pages_per_chapter + p) * RECORDS_PER_PAGE as u64;
                let recs: Vec<Record> = (0..RECORDS_PER_PAGE as u64)
                    .map(|i| Record {
                        hash: fp(base + i),
                        loc: Location {
                            pbn: (base + i) % 1000,
                            state: 2,
                            frag: crate::metadata::block_map::Frag::ZERO,
                            stamp: 0,
                            current: false,
                        },
                    })
                    .collect();
                let h = PageHeader { vcn, epoch: 1, page: p as u16, count: RECORDS_PER_PAGE as u16 };
                buf.extend_from_slice(&encode_page(ulo, h, &recs));
                chapter.extend(recs);
            }
            if ring.has_names() {
                let mut n = if names { encode_names(ulo, vcn, 1, &chapter) } else { Vec::new() };
                n.resize(name_bytes, 0);
                name_buf.extend_from_slice(&n);
            }
            if buf.len() >= per_write * chapter_bytes || slot + 1 == ring.chapters {
                write_aligned(file, &buf, (ring.start_block + first_slot * ring.pages_per_chapter) * BLOCK_SIZE_U64);
                if ring.has_names() {
                    write_aligned(file, &name_buf, ring.name_offset(first_slot, 0));
                }
                buf.clear();
                name_buf.clear();
                first_slot = slot + 1;
            }
        }
        newest
    }

    /// The background rebuild (reader, decoder and inserter threads, buffers reused run
    /// after run) must index exactly what the rebuild stepped by hand does: the same
    /// records, pages and entries, slot for slot where it matters (every fingerprint of
    /// the window found); and a ring whose name pages are missing must rebuild the same
    /// from its record pages. A ring of 290 MiB of chapters (58 MiB of names): eight runs
    /// of names, more than the buffers and lists the pipeline has.
    #[test]
    fn the_background_rebuild_indexes_what_the_stepped_one_does() {
        let window = 24u64 << 30;
        let fmt = FormatOptions {
            logical_size_bytes: 64 << 20,
            dedup_window_bytes: Some(window),
            index_memory_bytes: 64 << 20,
            ..FormatOptions::default()
        };
        let size = window / 101 * 2 * 32;
        let dev = Arc::new(crate::io::MemStorage::new(size));
        let file: Arc<dyn Storage> = dev.clone();
        Volume::format(file.clone(), None, &fmt, false).expect("format");
        let meta = Dev::new(file.clone(), Arc::new(IoCounters::default()));
        let (sb, _) = crate::metadata::superblock::Superblock::read(&meta, 0).expect("superblock");
        assert!(sb.index_names, "a new volume's ring keeps names");
        let ring =
            RingLayout::for_area(sb.geometry.index_start, sb.geometry.index_blocks, IndexMode::Dense, sb.index_names)
                .expect("ring");
        let name_bytes = ring.chapters * ring.name_pages_per_chapter * BLOCK_SIZE_U64;
        assert!(name_bytes > (READ_BUFFERS + PREPARED_RUNS + 1) as u64 * READ_BYTES, "{name_bytes}");
        let mut seen = Vec::new();
        for names in [true, false] {
            let newest = fill_ring(&file, &ring, crate::codec::get_u64(&sb.uuid, 0), names);
            for how in [IndexRebuild::Manual, IndexRebuild::Background] {
                let opts = OpenOptions { index_rebuild: how, ..OpenOptions::default() };
                let vol = Volume::open(file.clone(), None, &opts).expect("open");
                if how == IndexRebuild::Manual {
                    while vol.index_rebuild_step() {}
                }
                vol.wait_index_rebuilt();
                let s = vol.stats();
                assert!(!s.index.rebuild_running && s.index.rebuild_chapters_done == s.index.rebuild_chapters_total);
                // The window's chapters but the oldest (its slot is the one reopened).
                let chapters = ring.chapters - 1;
                let records = chapters * ring.pages_per_chapter * RECORDS_PER_PAGE as u64;
                let run = format!("{how:?}, names {names}");
                assert_eq!((s.index.rebuild_records, s.index.rebuild_pages_skipped), (records, 0), "{run}");
                assert!(s.index_entries >= records * 99 / 100, "{run}: {} entries of {records}", s.index_entries);
                // Names read, or names read and found missing, then the records.
                let (pages, fallbacks) = match names {
                    true => (ring.name_pages_per_chapter, 0),
                    false => (ring.name_pages_per_chapter + ring.pages_per_chapter, chapters),
                };
                assert_eq!(
                    (s.index.rebuild_bytes, s.index.rebuild_chapters_without_names),
                    (chapters * pages * BLOCK_SIZE_U64, fallbacks),
                    "{run}"
                );
                assert_eq!(s.index.rebuild_covered_bytes, chapters * ring.pages_per_chapter * BLOCK_SIZE_U64);
                // Every fingerprint of the newest chapter and of one mid-window is found; the
                // oldest chapter loses a few (a full bucket evicts its oldest slot), the same
                // ones whichever way the rebuild ran.
                let per_chapter = ring.pages_per_chapter * RECORDS_PER_PAGE as u64;
                let missing = |vcn: u64| {
                    let state = vol.state.lock();
                    let index = state.dedup.index();
                    (0..per_chapter).filter(|i| index.lookup(&fp(vcn * per_chapter + i)).is_none()).collect::<Vec<_>>()
                };
                for vcn in [newest, newest - chapters / 2] {
                    let m = missing(vcn).len() as u64;
                    assert!(m * 100 <= per_chapter, "{run}: chapter {vcn}: {m} of {per_chapter} missing");
                }
                seen.push((s.index_entries, missing(newest + 1 - chapters)));
                vol.close().expect("close");
            }
        }
        assert!(seen.windows(2).all(|w| w.first() == w.last()), "the rebuilds differ");
        // A close in the middle of the pipeline stops its three threads, and the next open
        // rebuilds the whole window again (from the names, written again).
        fill_ring(&file, &ring, crate::codec::get_u64(&sb.uuid, 0), true);
        let bg = OpenOptions { index_rebuild: IndexRebuild::Background, ..OpenOptions::default() };
        let vol = Volume::open(file.clone(), None, &bg).expect("open");
        let t = Instant::now();
        vol.close().expect("close during the rebuild");
        assert!(t.elapsed().as_secs() < 10, "close took {:?}", t.elapsed());
        let vol = Volume::open(file, None, &bg).expect("open");
        vol.wait_index_rebuilt();
        let s = vol.stats();
        assert_eq!(Some(s.index_entries), seen.first().map(|(entries, _)| *entries), "after a stopped rebuild");
        assert_eq!(s.index.rebuild_chapters_without_names, 0);
    }

    /// Measures, on a volume whose chapter ring is full of synthetic records: how long
    /// `open` takes before the volume accepts I/O, the first write after it, the rebuild's
    /// read rate beside the device's own sequential read rate, and the RSS per indexed
    /// block. Run with `cargo test --release -p dedupvol-core measure_open_and_rebuild --
    /// --ignored --nocapture`; `DEDUPVOL_MEASURE_DIR` (default /tmp) holds the sparse
    /// volume file, `DEDUPVOL_MEASURE_WINDOW_GIB` (default 256) the dedup window,
    /// `DEDUPVOL_MEASURE_MODE` dense or sparse, and `DEDUPVOL_MEASURE_SMAPS` (set) lists
    /// the mappings holding 2 MiB of RSS or more before the open and after the rebuild.
    #[test]
    #[ignore = "a measurement that writes the chapter ring of a large window to a file"]
    fn measure_open_and_rebuild() {
        let dir = std::env::var("DEDUPVOL_MEASURE_DIR").unwrap_or_else(|_| "/tmp".into());
        let window_gib: u64 =
            std::env::var("DEDUPVOL_MEASURE_WINDOW_GIB").ok().and_then(|v| v.parse().ok()).unwrap_or(256);
        let mode = match std::env::var("DEDUPVOL_MEASURE_MODE").as_deref() {
            Ok("sparse") => IndexMode::Sparse,
            _ => IndexMode::Dense,
        };
        let path = std::path::PathBuf::from(dir).join(format!("dedupvol-measure-{}.img", std::process::id()));
        let window = window_gib << 30;
        let fmt = FormatOptions {
            logical_size_bytes: 1 << 30,
            dedup_window_bytes: Some(window),
            index_memory_bytes: 8 << 30,
            index_mode: mode,
            ..FormatOptions::default()
        };
        // The ring is at most 1/32 of a device without a metadata device.
        let size = (window / 101 * 2 * 32).max(64 << 30);
        Volume::format_path(&path, Some(size), None, &fmt, true).expect("format");
        let file: Arc<dyn Storage> = Arc::new(FileStorage::open_with(&path, false, IoMode::Direct).expect("open"));
        let dev = Dev::new(file.clone(), Arc::new(IoCounters::default()));
        let (sb, _) = crate::metadata::superblock::Superblock::read(&dev, 0).expect("superblock");
        let ring = RingLayout::for_area(sb.geometry.index_start, sb.geometry.index_blocks, mode, sb.index_names)
            .expect("ring");
        let ulo = crate::codec::get_u64(&sb.uuid, 0);
        let t = Instant::now();
        fill_ring(&file, &ring, ulo, true);
        file.sync().expect("sync");
        let ring_bytes = ring.chapters * ring.pages_per_chapter * BLOCK_SIZE_U64;
        println!(
            "ring: {} chapters of {} pages ({} MiB), written in {:.1} s",
            ring.chapters,
            ring.pages_per_chapter,
            ring_bytes >> 20,
            t.elapsed().as_secs_f64()
        );
        // The device's own sequential read rate over the ring (direct I/O, READ_BYTES a read).
        let mut rd = AlignedBuf::new(READ_BYTES as usize).expect("buffer");
        let t = Instant::now();
        let mut off = ring.start_block * BLOCK_SIZE_U64;
        let end = off + ring_bytes;
        while off < end {
            let n = (end - off).min(READ_BYTES) as usize;
            file.read_at(rd.as_mut_slice().get_mut(..n).expect("len"), off).expect("read");
            off += n as u64;
        }
        let dev_rate = ring_bytes as f64 / t.elapsed().as_secs_f64() / 1e6;
        println!("device sequential read over the ring: {dev_rate:.0} MB/s");
        drop((file, dev));
        // What the volume costs without its index: opened with the smallest volume index
        // and no rebuild, given the same 1 MiB write as the measured open below (the
        // write path's buffers and compression contexts), twice, measuring the second
        // open. Why twice: glibc raises its
        // mmap threshold when a mapped block of at most 32 MiB is freed (the first close
        // frees the refcount and reuse-stamp tables), so from then on those tables come
        // from the heap, where `calloc` zeroes them and they count in RSS at once; the
        // measured open below is in that state too.
        let control = OpenOptions {
            index_rebuild: IndexRebuild::Manual,
            index_memory_bytes: Some(64 << 10),
            ..OpenOptions::default()
        };
        let data = crate::codec::test_random_bytes(9, 1 << 20);
        let mut rss_without_index = 0;
        for _ in 0..2 {
            let rss_before = rss_bytes();
            let v = Volume::open_path(&path, None, &control).expect("open");
            v.wait_ready();
            v.write(0, &data, false).expect("write");
            v.flush().expect("flush");
            rss_without_index = rss_bytes().saturating_sub(rss_before);
            v.close().expect("close");
        }
        let rss0 = rss_bytes();
        if std::env::var("DEDUPVOL_MEASURE_SMAPS").is_ok() {
            for (a, size, rss, name) in big_mappings() {
                println!("before open: mapping {a}: {size} MiB, RSS {rss} MiB {name}");
            }
        }
        let opts = OpenOptions { index_rebuild: IndexRebuild::Background, ..OpenOptions::default() };
        let t = Instant::now();
        let vol = Volume::open_path(&path, None, &opts).expect("open");
        let open_s = t.elapsed().as_secs_f64();
        vol.write(0, &data, false).expect("write");
        vol.flush().expect("flush");
        let first_write_s = t.elapsed().as_secs_f64();
        let s0 = vol.stats().index;
        let cpu0 = cpu_seconds();
        vol.wait_index_rebuilt();
        let rebuild_cpu_s = cpu_seconds() - cpu0;
        let total_s = t.elapsed().as_secs_f64();
        let s = vol.stats();
        let rss1 = rss_bytes();
        if std::env::var("DEDUPVOL_MEASURE_SMAPS").is_ok() {
            for (a, size, rss, name) in big_mappings() {
                println!("mapping {a}: {size} MiB, RSS {rss} MiB {name}");
            }
        }
        let secs = s.index.rebuild_millis.max(1) as f64 / 1e3;
        let rate = s.index.rebuild_covered_bytes as f64 / secs / 1e6;
        let read_rate = s.index.rebuild_bytes as f64 / secs / 1e6;
        println!(
            "open returned after {open_s:.3} s ({} probe reads, {} ms); first 1 MiB write + flush done at {first_write_s:.3} s, rebuild then {}/{} chapters",
            s0.rebuild_probe_reads, s0.rebuild_probe_millis, s0.rebuild_chapters_done, s0.rebuild_chapters_total
        );
        println!(
            "rebuild: {} records; {} MiB of chapters covered in {} ms = {rate:.0} MB/s ({:.0}% of the device's sequential rate), reading {} MiB ({read_rate:.0} MB/s; {} chapters from their records); all done {total_s:.2} s after open began",
            s.index.rebuild_records,
            s.index.rebuild_covered_bytes >> 20,
            s.index.rebuild_millis,
            rate * 100.0 / dev_rate,
            s.index.rebuild_bytes >> 20,
            s.index.rebuild_chapters_without_names
        );
        println!(
            "rebuild CPU time (the process's, from the first write's end to the rebuild's): {rebuild_cpu_s:.2} s = {:.0} MB/s of chapters covered per CPU second, {:.0} ns per record",
            s.index.rebuild_covered_bytes as f64 / rebuild_cpu_s / 1e6,
            rebuild_cpu_s * 1e9 / s.index.rebuild_records.max(1) as f64
        );
        println!(
            "volume index: {} entries, {} bytes ({:.2} B/entry); RSS {} MiB → {} MiB, of which {} MiB without the index: {:.2} bytes of RSS per indexed 4 KiB block ({} GiB of window)",
            s.index_entries,
            s.index_memory_bytes,
            s.index.memory_bytes_per_entry,
            rss0 >> 20,
            rss1 >> 20,
            rss_without_index >> 20,
            (rss1.saturating_sub(rss0 + rss_without_index)) as f64 / (s.index.window_bytes / BLOCK_SIZE_U64) as f64,
            s.index.window_bytes >> 30
        );
        let usage = vol.memory_usage();
        for (what, bytes) in &usage {
            println!("  {what}: {:.1} MiB", *bytes as f64 / 1048576.0);
        }
        // The reuse stamps are allocated with the index but only the pages of blocks freed
        // since the open are resident: the upper bound counts them all.
        let of = |name: &str| usage.iter().find(|(w, _)| *w == name).map_or(0, |(_, b)| *b);
        println!(
            "volume index + every reuse stamp resident: {:.2} bytes per indexed 4 KiB block",
            (of("fingerprint volume index") + of("reuse stamps")) as f64
                / (s.index.window_bytes / BLOCK_SIZE_U64) as f64
        );
        vol.close().expect("close");
        let _ = std::fs::remove_file(&path);
    }
}
