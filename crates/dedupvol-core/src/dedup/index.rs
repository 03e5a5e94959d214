//! The fingerprint index, in two levels (docs/design.md, "The fingerprint index"):
//! full records in the chapter ring on the metadata device (`chapter`), and in memory a
//! compact volume index from fingerprint bits to (chapter, page) (`volume_index`) plus a
//! bounded cache of record pages (`record_cache`).
//!
//! A lookup (the volume's state lock held):
//! 1. dense: the volume index names the candidate pages (usually none: no I/O); a page
//!    of the open chapter is in memory, another comes from the record cache or one
//!    4 KiB read; the full fingerprint is compared in the page;
//! 2. sparse: the open chapter and the cached chapters are searched by fingerprint; only
//!    a hook (1 fingerprint in `SPARSE_SAMPLE`) is in the volume index, and a hook that
//!    names an uncached chapter loads that whole chapter (one sequential read), so the
//!    records written together with it are found in memory next.
//!
//! New records go to the open chapter; a full chapter is written and the next one opened,
//! which drops the oldest chapter of the ring (the window). The open chapter's new pages
//! are handed to each journal commit (`take_dirty`), so a record is on the device once
//! the write it describes is durable. At open the volume index is rebuilt from the ring.
//!
//! Invariants:
//! - Memory is bounded: the table by `index_memory_bytes`, the caches by page counts.
//! - The index is advisory: a record may be stale, lost or torn at any time; `Deduper`
//!   trusts a record only when its block is in use and either its stamp is current (a
//!   record of this epoch) or the bytes were compared.
//! - `current` is true exactly for records of this epoch: the epoch changes only between
//!   chapters (a new epoch closes the open chapter and empties the caches).
//! - Epochs are never reused: a session's first epoch is `session << EPOCH_SESSION_SHIFT`
//!   (the superblock's read-write open count, persisted before anything is written) and
//!   above every epoch in the ring; a session that runs out of its `2^EPOCH_SESSION_SHIFT`
//!   epochs stops trusting stamps altogether (`stamps_untrusted`). A page whose epoch is
//!   not below the session's first was not written by an earlier session and is skipped.
//! - The open chapter holds fewer than `records_per_chapter` records.

use super::chapter::{decode_page, encode_page, PageHeader, Record, RingLayout, RECORDS_PER_PAGE};
use super::record_cache::{prefix, ChapterCache, PageCache, Records};
use super::volume_index::{VolumeIndex, LOAD_PERCENT, SLOT_BYTES};
use crate::config::{IndexMode, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::error::Result;
use crate::io::{Dev, IoKind};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Closed chapters' pages waiting for the next commit, at most (past it they are written
/// at once, under the state lock).
const PENDING_BYTES_MAX: usize = 8 << 20;
/// Largest read of the rebuild at open (whole chapters, in ring order).
const REBUILD_READ_BYTES: u64 = 4 << 20;
/// Epochs each session may use (a new one per reuse stamp that wraps).
pub const EPOCH_SESSION_SHIFT: u32 = 10;
/// One fingerprint in `SPARSE_SAMPLE` is a hook in sparse mode.
pub const SPARSE_SAMPLE: u64 = 32;
/// Record cache budget in pages (16 MiB): single pages (dense) or whole chapters (sparse).
pub const RECORD_CACHE_PAGES: u64 = 4096;

/// Where a fingerprint's copy lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Physical block.
    pub pbn: u64,
    /// Map entry state (raw or packed slot).
    pub state: u8,
    /// Reuse stamp of the block when the record was made (hash verification).
    pub stamp: u16,
    /// The record was made in this epoch, so its stamp can be compared with the block's
    /// (not stored: decided when the record is read).
    pub current: bool,
}

impl Location {
    /// The 8-byte location word: pbn 40 bits | state 8 bits | stamp 16 bits.
    pub fn pack(&self) -> u64 {
        (self.pbn & ((1 << 40) - 1)) | (u64::from(self.state) << 40) | (u64::from(self.stamp) << 48)
    }
    /// The location of a word (`current` false: the caller decides).
    pub fn unpack(w: u64) -> Self {
        Location { pbn: w & ((1 << 40) - 1), state: (w >> 40) as u8, stamp: (w >> 48) as u16, current: false }
    }
}

/// Counters of the index's work.
#[derive(Default)]
struct Counters {
    lookups: AtomicU64,
    lookups_with_io: AtomicU64,
    page_reads: AtomicU64,
    page_cache_hits: AtomicU64,
    chapter_loads: AtomicU64,
    write_errors: AtomicU64,
    chapters_closed: AtomicU64,
}

/// What the rebuild at open found.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rebuild {
    /// Wall time in milliseconds.
    pub millis: u64,
    /// Records read (all of them, hooks or not).
    pub records: u64,
    /// Chapters inside the window found on the device.
    pub chapters: u64,
    /// Pages of those chapters skipped (torn, stale, never written).
    pub pages_skipped: u64,
    /// Bytes read.
    pub bytes_read: u64,
}

/// The index's figures, for statistics.
#[derive(Debug, Clone, Copy)]
pub struct IndexStats {
    /// Dense or sparse.
    pub mode: IndexMode,
    /// Occupied slots of the volume index.
    pub entries: u64,
    /// Memory of the volume index.
    pub table_bytes: u64,
    /// Memory of the cached record pages (4 KiB each).
    pub cache_bytes: u64,
    /// Chapters in the ring.
    pub chapters: u64,
    /// Chapters opened so far (the open one included) since the volume was made.
    pub chapters_used: u64,
    /// Records per chapter.
    pub records_per_chapter: u64,
    /// Data the ring covers, in bytes (the dedup window).
    pub window_bytes: u64,
    /// Lookups.
    pub lookups: u64,
    /// Lookups that read the device.
    pub lookups_with_io: u64,
    /// Record pages read.
    pub page_reads: u64,
    /// Record pages found in the cache.
    pub page_cache_hits: u64,
    /// Whole chapters loaded (sparse).
    pub chapter_loads: u64,
    /// Failed chapter writes (the index is advisory: only dedup is lost).
    pub write_errors: u64,
    /// The rebuild at open.
    pub rebuild: Rebuild,
}

/// The index.
pub struct Index {
    mode: IndexMode,
    table: VolumeIndex,
    ring: RingLayout,
    /// None: the ring lives in memory only (no index area); closed chapters are lost.
    meta: Option<Dev>,
    uuid_lo: u64,
    epoch: u32,
    /// The session used up its epochs: no record is `current`, all are verified by bytes.
    stamps_untrusted: bool,
    open_vcn: u64,
    open: Vec<Record>,
    /// Sparse: fingerprint prefix → position in `open`.
    open_by_prefix: HashMap<u64, u32>,
    /// First page of the open chapter changed since it was last handed out.
    dirty_from: Option<usize>,
    /// Pages of closed chapters not handed out yet, and their bytes.
    pending: DirtyPages,
    pending_bytes: usize,
    pages: Mutex<PageCache>,
    chapters: Mutex<ChapterCache>,
    counters: Counters,
    rebuild: Rebuild,
}

/// Runs of record pages to write: each the device offset of its first page and the pages
/// back to back.
pub type DirtyPages = Vec<(u64, Vec<u8>)>;

/// Writes record pages handed out by `Index::take_dirty` (by a commit, without the
/// index); false when a write failed, which costs dedup only.
pub fn write_pages(meta: &Dev, pages: &DirtyPages) -> bool {
    pages.iter().fold(true, |ok, (off, bytes)| meta.write(IoKind::Index, bytes, *off).is_ok() && ok)
}

/// True for the sampled fingerprints that enter the sparse volume index.
pub fn is_hook(h: &[u8; 32]) -> bool {
    u64::from(crate::codec::get_u32(h, 12)) % SPARSE_SAMPLE == 0
}

impl Index {
    /// An index over the ring of `area_blocks` blocks at `area_start` on `meta` (None: in
    /// memory only), its volume index at most `memory_bytes_max`; empty until `rebuild`.
    pub fn new(
        mode: IndexMode,
        meta: Option<Dev>,
        area: (u64, u64),
        uuid_lo: u64,
        memory_bytes_max: u64,
        prefault: bool,
    ) -> Result<Self> {
        let (ring, meta) = match RingLayout::for_area(area.0, area.1, mode) {
            Some(r) => (r, meta),
            None => (RingLayout { start_block: 0, chapters: 2, pages_per_chapter: 1 }, None),
        };
        let memory = Self::memory_wanted(mode, &ring).min(memory_bytes_max);
        let table = VolumeIndex::try_new(memory, prefault)?;
        let cache_chapters = (RECORD_CACHE_PAGES / ring.pages_per_chapter).max(2) as usize;
        Ok(Index {
            mode,
            table,
            ring,
            meta,
            uuid_lo,
            epoch: 1,
            stamps_untrusted: false,
            open_vcn: 0,
            open: Vec::new(),
            open_by_prefix: HashMap::new(),
            dirty_from: None,
            pending: Vec::new(),
            pending_bytes: 0,
            pages: Mutex::new(PageCache::new(RECORD_CACHE_PAGES as usize)),
            chapters: Mutex::new(ChapterCache::new(cache_chapters)),
            counters: Counters::default(),
            rebuild: Rebuild::default(),
        })
    }

    /// Volume index memory for a full window of `ring` (at `LOAD_PERCENT` load).
    pub fn memory_wanted(mode: IndexMode, ring: &RingLayout) -> u64 {
        let entries = match mode {
            IndexMode::Dense => ring.window_blocks(),
            IndexMode::Sparse => ring.window_blocks().div_ceil(SPARSE_SAMPLE),
        };
        let slots = (entries * 100).div_ceil(LOAD_PERCENT).next_multiple_of(super::volume_index::BUCKET_SLOTS as u64);
        slots.max(super::volume_index::BUCKET_SLOTS as u64) * SLOT_BYTES
    }

    /// Waits for the volume index's memory to be populated.
    pub fn wait_prefault(&mut self) {
        self.table.wait_prefault();
    }

    /// The ring's layout.
    #[cfg(test)]
    pub fn ring(&self) -> RingLayout {
        self.ring
    }

    /// Slots of the volume index.
    pub fn capacity(&self) -> u64 {
        self.table.capacity()
    }

    /// Occupied slots of the volume index.
    pub fn len(&self) -> u64 {
        self.table.len()
    }

    /// Memory of the volume index.
    pub fn memory_bytes(&self) -> u64 {
        self.table.memory_bytes()
    }

    /// Bytes of the volume index per slot.
    pub fn bytes_per_entry(&self) -> u64 {
        SLOT_BYTES
    }

    /// Memory of cached record pages.
    pub fn cache_bytes(&self) -> u64 {
        let pages = self.pages.lock().len() as u64;
        let recs = self.chapters.lock().records() as u64;
        pages * BLOCK_SIZE_U64 + recs.div_ceil(RECORDS_PER_PAGE as u64) * BLOCK_SIZE_U64
    }

    fn records_per_chapter(&self) -> usize {
        self.ring.records_per_chapter() as usize
    }

    /// True when chapter `vcn` is inside the window.
    fn in_window(&self, vcn: u64) -> bool {
        vcn <= self.open_vcn && self.open_vcn - vcn < self.ring.chapters
    }

    /// The candidate location for fingerprint `h`.
    pub fn lookup(&self, h: &[u8; 32]) -> Option<Location> {
        self.counters.lookups.fetch_add(1, Ordering::Relaxed);
        let mut io = false;
        let found = match self.mode {
            IndexMode::Dense => self.lookup_dense(h, &mut io),
            IndexMode::Sparse => self.lookup_sparse(h, &mut io),
        };
        if io {
            self.counters.lookups_with_io.fetch_add(1, Ordering::Relaxed);
        }
        found
    }

    fn lookup_dense(&self, h: &[u8; 32], io: &mut bool) -> Option<Location> {
        for (vcn, page, position) in self.table.candidates(h, self.open_vcn, self.ring.chapters) {
            // The slot names the newest record of its fingerprint (a block at the reference
            // cap got a new copy recorded after it, and took the slot); another
            // fingerprint's record there is a tag collision: the next candidate.
            let at = position as usize;
            let found = if vcn == self.open_vcn {
                self.open.get(page as usize * RECORDS_PER_PAGE + at).filter(|r| r.hash == *h).copied()
            } else {
                self.page(vcn, page, io).and_then(|p| p.get(at).filter(|r| r.hash == *h).copied())
            };
            if let Some(r) = found {
                return Some(r.loc);
            }
        }
        None
    }

    fn lookup_sparse(&self, h: &[u8; 32], io: &mut bool) -> Option<Location> {
        let p = prefix(h);
        if let Some(r) = self.open_by_prefix.get(&p).and_then(|&i| self.open.get(i as usize)).filter(|r| r.hash == *h) {
            return Some(r.loc);
        }
        let cached = self.chapters.lock().find(h);
        if let Some((vcn, r, near_end)) = cached {
            if self.in_window(vcn) {
                // Readahead: a stream reaching the end of a chapter goes on into the next,
                // which it would otherwise find only at that chapter's first hook.
                if near_end && vcn + 1 < self.open_vcn && !self.chapters.lock().has(vcn + 1) {
                    self.load_chapter(vcn + 1, io);
                }
                return Some(r.loc);
            }
        }
        if !is_hook(h) {
            return None;
        }
        for (vcn, _, _) in self.table.candidates(h, self.open_vcn, self.ring.chapters) {
            if vcn == self.open_vcn || self.chapters.lock().has(vcn) {
                continue;
            }
            self.load_chapter(vcn, io);
            if let Some((_, r, _)) = self.chapters.lock().find(h) {
                return Some(r.loc);
            }
        }
        None
    }

    /// Loads closed chapter `vcn` into the chapter cache (sets `io`).
    fn load_chapter(&self, vcn: u64, io: &mut bool) {
        if let Some(recs) = self.read_chapter(vcn) {
            *io = true;
            self.counters.chapter_loads.fetch_add(1, Ordering::Relaxed);
            self.chapters.lock().put(vcn, recs);
        }
    }

    /// Page `page` of closed chapter `vcn`: from the cache, else read (sets `io`).
    fn page(&self, vcn: u64, page: u64, io: &mut bool) -> Option<Records> {
        if let Some(p) = self.pages.lock().get(vcn, page) {
            self.counters.page_cache_hits.fetch_add(1, Ordering::Relaxed);
            return Some(p);
        }
        let meta = self.meta.as_ref()?;
        let mut buf = vec![0u8; BLOCK_SIZE];
        *io = true;
        self.counters.page_reads.fetch_add(1, Ordering::Relaxed);
        meta.read(IoKind::Index, &mut buf, self.ring.page_offset(vcn, page)).ok()?;
        let recs = self.decode(&buf, vcn, page)?;
        self.pages.lock().put(vcn, page, recs.clone());
        Some(recs)
    }

    /// The records of page `page` of chapter `vcn` in `buf`, if it is that page.
    fn decode(&self, buf: &[u8], vcn: u64, page: u64) -> Option<Records> {
        let (hd, mut recs) = decode_page(buf, self.uuid_lo)?;
        if hd.vcn != vcn || u64::from(hd.page) != page {
            return None;
        }
        let current = hd.epoch == self.epoch && !self.stamps_untrusted;
        recs.iter_mut().for_each(|r| r.loc.current = current);
        Some(Arc::new(recs))
    }

    /// Every record of closed chapter `vcn` (one sequential read).
    fn read_chapter(&self, vcn: u64) -> Option<Records> {
        let meta = self.meta.as_ref()?;
        let ppc = self.ring.pages_per_chapter;
        let mut buf = vec![0u8; (ppc * BLOCK_SIZE_U64) as usize];
        self.counters.page_reads.fetch_add(ppc, Ordering::Relaxed);
        meta.read(IoKind::Index, &mut buf, self.ring.page_offset(vcn, 0)).ok()?;
        let mut all = Vec::new();
        for (i, b) in buf.chunks_exact(BLOCK_SIZE).enumerate() {
            if let Some(recs) = self.decode(b, vcn, i as u64) {
                all.extend(recs.iter().copied());
            }
        }
        Some(Arc::new(all))
    }

    /// Records `h` at `loc` (a block stored, or a record refreshed) in the open chapter.
    pub fn insert(&mut self, h: &[u8; 32], loc: Location) {
        let idx = self.open.len();
        let page = idx / RECORDS_PER_PAGE;
        self.open.push(Record { hash: *h, loc: Location { current: !self.stamps_untrusted, ..loc } });
        match self.mode {
            IndexMode::Dense => {
                self.table.insert(h, self.open_vcn, page as u64, (idx % RECORDS_PER_PAGE) as u64, self.open_vcn)
            }
            IndexMode::Sparse => {
                self.open_by_prefix.insert(prefix(h), idx as u32);
                if is_hook(h) {
                    self.table.insert(h, self.open_vcn, page as u64, (idx % RECORDS_PER_PAGE) as u64, self.open_vcn);
                }
            }
        }
        self.dirty_from = Some(self.dirty_from.map_or(page, |d| d.min(page)));
        if self.open.len() >= self.records_per_chapter() {
            self.close_chapter();
        }
        debug_assert!(self.open.len() < self.records_per_chapter());
    }

    /// Encodes pages `from..` of the open chapter, back to back.
    fn encode_open(&self, from: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, recs) in self.open.chunks(RECORDS_PER_PAGE).enumerate().skip(from) {
            let h = PageHeader { vcn: self.open_vcn, epoch: self.epoch, page: i as u16, count: recs.len() as u16 };
            out.extend_from_slice(&encode_page(self.uuid_lo, h, recs));
        }
        out
    }

    /// The open chapter's pages changed since the last hand-out, as (offset, bytes).
    fn take_open(&mut self) -> Option<(u64, Vec<u8>)> {
        let from = self.dirty_from.take()?;
        self.meta.as_ref()?;
        Some((self.ring.page_offset(self.open_vcn, from as u64), self.encode_open(from)))
    }

    /// The pages of chapters closed since the last call and the open chapter's changed
    /// pages: the journal commit writes them (outside the state lock) before its sync, so
    /// the records of every durable write are durable too.
    pub fn take_dirty(&mut self) -> DirtyPages {
        let mut out = std::mem::take(&mut self.pending);
        self.pending_bytes = 0;
        out.extend(self.take_open());
        out
    }

    /// Writes what `take_dirty` handed out (a failure costs dedup only, and is counted).
    pub fn write_dirty(&self, meta: &Dev, dirty: &DirtyPages) {
        if !write_pages(meta, dirty) {
            self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Writes the open chapter's unwritten pages, keeps its pages in the cache, and opens
    /// the next chapter, dropping the oldest one of the window.
    fn close_chapter(&mut self) {
        if self.open.is_empty() {
            return;
        }
        // Its pages wait for the next commit, which writes them outside the state lock;
        // a long stretch without commits writes them here instead (bounded memory).
        if let Some(d) = self.take_open() {
            self.pending_bytes += d.1.len();
            self.pending.push(d);
        }
        if self.pending_bytes > PENDING_BYTES_MAX {
            let d = std::mem::take(&mut self.pending);
            self.pending_bytes = 0;
            if let Some(meta) = &self.meta {
                self.write_dirty(meta, &d);
            }
        }
        let open = std::mem::take(&mut self.open);
        match self.mode {
            IndexMode::Dense => {
                let mut cache = self.pages.lock();
                for (i, recs) in open.chunks(RECORDS_PER_PAGE).enumerate() {
                    cache.put(self.open_vcn, i as u64, Arc::new(recs.to_vec()));
                }
            }
            IndexMode::Sparse => self.chapters.lock().put(self.open_vcn, Arc::new(open)),
        }
        self.open_by_prefix.clear();
        self.open_vcn += 1;
        self.counters.chapters_closed.fetch_add(1, Ordering::Relaxed);
        self.table.sweep(self.open_vcn, self.ring.chapters);
    }

    /// Starts a new epoch: every record made so far stops being `current` (a reuse stamp
    /// wrapped, so an old record's stamp could match again).
    pub fn new_epoch(&mut self) {
        self.close_chapter();
        let next = self.epoch.wrapping_add(1);
        if next.trailing_zeros() >= EPOCH_SESSION_SHIFT {
            // The next session's first epoch: stay, and trust no stamp from now on.
            self.stamps_untrusted = true;
        } else {
            self.epoch = next;
        }
        self.pages.lock().clear();
        self.chapters.lock().clear();
    }

    /// Forgets `h` (its record failed verification).
    pub fn remove(&mut self, h: &[u8; 32]) {
        for (vcn, page, _) in self.table.candidates(h, self.open_vcn, self.ring.chapters) {
            self.table.remove(h, vcn, page);
        }
        let p = prefix(h);
        if self.open_by_prefix.get(&p).and_then(|&i| self.open.get(i as usize)).is_some_and(|r| r.hash == *h) {
            self.open_by_prefix.remove(&p);
        }
        self.chapters.lock().forget(h);
    }

    /// Rebuilds the volume index from the ring (at open): the first page of every slot
    /// says which chapter it holds; the chapters of the window are then read in ring
    /// order, several per sequential read, and their records (hooks only, in sparse mode) enter
    /// the volume index. The next chapter follows the newest found; the epoch is the first
    /// of read-write session `session`, or above every epoch found if that is higher.
    pub fn rebuild(&mut self, session: u64) {
        let base = u32::try_from(session).unwrap_or(u32::MAX).checked_shl(EPOCH_SESSION_SHIFT).unwrap_or(0);
        let base = if u64::from(base) >> EPOCH_SESSION_SHIFT == session { base } else { 0 };
        let Some(meta) = self.meta.clone() else { return };
        let t0 = std::time::Instant::now();
        let ring = self.ring;
        let mut heads: Vec<Option<u64>> = vec![None; ring.chapters as usize];
        let mut epoch_max = 0u32;
        let mut buf = vec![0u8; BLOCK_SIZE];
        let mut bytes_read = 0u64;
        for slot in 0..ring.chapters {
            let off = (ring.start_block + slot * ring.pages_per_chapter) * BLOCK_SIZE_U64;
            bytes_read += BLOCK_SIZE_U64;
            if meta.read(IoKind::Index, &mut buf, off).is_err() {
                continue;
            }
            if let Some((h, _)) = decode_page(&buf, self.uuid_lo) {
                if h.page == 0 && h.vcn % ring.chapters == slot {
                    if let Some(s) = heads.get_mut(slot as usize) {
                        *s = Some(h.vcn);
                    }
                    epoch_max = epoch_max.max(h.epoch);
                }
            }
        }
        // Past the last epoch counter value, the session trusts no stamp (as above).
        self.epoch = base.max(epoch_max.saturating_add(1)).max(1);
        self.stamps_untrusted = (base == 0 && session > 0) || epoch_max == u32::MAX;
        let Some(newest) = heads.iter().flatten().copied().max() else {
            self.rebuild = Rebuild { millis: t0.elapsed().as_millis() as u64, bytes_read, ..Rebuild::default() };
            return;
        };
        self.open_vcn = newest + 1;
        let mut r = Rebuild::default();
        // The window's chapters in ring order, in reads of up to `REBUILD_READ_BYTES`: the
        // volume index keeps the newer record whatever the order it sees them in.
        let first = self.open_vcn.saturating_sub(ring.chapters - 1);
        let run = (REBUILD_READ_BYTES / (ring.pages_per_chapter * BLOCK_SIZE_U64)).max(1);
        let chapter_bytes = (ring.pages_per_chapter * BLOCK_SIZE_U64) as usize;
        let mut buf = vec![0u8; run as usize * chapter_bytes];
        let mut slot = 0;
        while slot < ring.chapters {
            let n = run.min(ring.chapters - slot);
            let want: Vec<Option<u64>> = (slot..slot + n)
                .map(|s| heads.get(s as usize).copied().flatten().filter(|&v| v >= first && v < self.open_vcn))
                .collect();
            let start = slot;
            slot += n;
            if want.iter().all(Option::is_none) {
                continue;
            }
            let Some(chunk) = buf.get_mut(..n as usize * chapter_bytes) else { break };
            bytes_read += chunk.len() as u64;
            let off = (ring.start_block + start * ring.pages_per_chapter) * BLOCK_SIZE_U64;
            if meta.read(IoKind::Index, chunk, off).is_err() {
                continue;
            }
            for (vcn, pages) in want.iter().zip(chunk.chunks_exact(chapter_bytes)) {
                let Some(vcn) = *vcn else { continue };
                r.chapters += 1;
                for (i, b) in pages.chunks_exact(BLOCK_SIZE).enumerate() {
                    let valid = |h: &PageHeader| h.vcn == vcn && usize::from(h.page) == i && h.epoch < self.epoch;
                    let Some((_, recs)) = decode_page(b, self.uuid_lo).filter(|(h, _)| valid(h)) else {
                        r.pages_skipped += 1;
                        continue;
                    };
                    for (at, rec) in recs.iter().enumerate() {
                        if self.mode == IndexMode::Dense || is_hook(&rec.hash) {
                            self.table.insert(&rec.hash, vcn, i as u64, at as u64, self.open_vcn);
                        }
                    }
                    r.records += recs.len() as u64;
                }
            }
        }
        r.bytes_read = bytes_read;
        r.millis = t0.elapsed().as_millis() as u64;
        self.rebuild = r;
    }

    /// The index's figures.
    pub fn stats(&self) -> IndexStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        IndexStats {
            mode: self.mode,
            entries: self.table.len(),
            table_bytes: self.table.memory_bytes(),
            cache_bytes: self.cache_bytes(),
            chapters: self.ring.chapters,
            chapters_used: (self.open_vcn + 1).min(self.ring.chapters),
            records_per_chapter: self.ring.records_per_chapter(),
            window_bytes: self.ring.window_blocks() * BLOCK_SIZE_U64,
            lookups: get(&c.lookups),
            lookups_with_io: get(&c.lookups_with_io),
            page_reads: get(&c.page_reads),
            page_cache_hits: get(&c.page_cache_hits),
            chapter_loads: get(&c.chapter_loads),
            write_errors: get(&c.write_errors),
            rebuild: self.rebuild,
        }
    }

    /// Checks the volume index and that `check` accepts every open-chapter record (the
    /// `verify` audit).
    #[cfg(any(test, feature = "verify"))]
    pub fn audit(
        &self,
        check: impl Fn(Location) -> std::result::Result<(), String>,
    ) -> std::result::Result<(), String> {
        self.table.audit()?;
        if self.open.len() >= self.records_per_chapter() {
            return Err(format!(
                "the open chapter holds {} records, a chapter {}",
                self.open.len(),
                self.records_per_chapter()
            ));
        }
        for r in &self.open {
            check(r.loc).map_err(|m| format!("record {:02x?}: {m}", r.hash.get(..8)))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::{IoCounters, MemStorage};

    fn h(i: u64) -> [u8; 32] {
        *blake3::hash(&i.to_le_bytes()).as_bytes()
    }

    fn loc(i: u64) -> Location {
        Location { pbn: i, state: 1, stamp: 0, current: true }
    }

    fn dev() -> Dev {
        Dev::new(Arc::new(MemStorage::new(8 << 20)), Arc::new(IoCounters::default()))
    }

    #[test]
    fn dense_records_survive_a_rebuild_and_the_ring_drops_the_oldest() {
        let meta = dev();
        // 8 blocks: 8 chapters of one page (101 records), a window of 808 blocks.
        let mut ix = Index::new(IndexMode::Dense, Some(meta.clone()), (16, 8), 7, 1 << 20, false).expect("index");
        assert_eq!(ix.ring().chapters, 8);
        for i in 0..1000 {
            ix.insert(&h(i), loc(i));
        }
        assert_eq!(ix.lookup(&h(999)).map(|l| l.pbn), Some(999));
        assert_eq!(ix.lookup(&h(500)).map(|l| l.pbn), Some(500));
        assert_eq!(ix.lookup(&h(5)), None, "chapter 0 left the window");
        let d = ix.take_dirty();
        ix.write_dirty(&meta, &d);
        let mut re = Index::new(IndexMode::Dense, Some(meta.clone()), (16, 8), 7, 1 << 20, false).expect("index");
        re.rebuild(2);
        let l = re.lookup(&h(999)).expect("open chapter record written with the commit");
        assert_eq!((l.pbn, l.current), (999, false), "records of an earlier epoch are not current");
        // The rebuild opened chapter 10, so chapter 2 (records 202..303) left the window.
        assert_eq!(re.lookup(&h(400)).map(|l| l.pbn), Some(400));
        assert_eq!(re.lookup(&h(300)), None);
        assert_eq!(re.stats().rebuild.records, 6 * 101 + 91, "chapters 3..=8 and the 91 records of chapter 9");
        // A torn page is skipped: the rest of the ring still rebuilds.
        let mut torn = vec![0u8; BLOCK_SIZE];
        meta.read(IoKind::Index, &mut torn, re.ring().page_offset(3, 0)).expect("read");
        if let Some(b) = torn.get_mut(2000) {
            *b ^= 0xff;
        }
        meta.write(IoKind::Index, &torn, re.ring().page_offset(3, 0)).expect("write");
        let mut re2 = Index::new(IndexMode::Dense, Some(meta), (16, 8), 7, 1 << 20, false).expect("index");
        re2.rebuild(3);
        assert_eq!(re2.lookup(&h(3 * 101 + 5)), None, "the torn chapter's records are gone");
        assert_eq!(re2.lookup(&h(500)).map(|l| l.pbn), Some(500));
    }

    #[test]
    fn sparse_hooks_bring_their_neighbours() {
        let meta = dev();
        let mut ix = Index::new(IndexMode::Sparse, Some(meta.clone()), (0, 64), 7, 1 << 20, false).expect("index");
        let rpc = ix.ring().records_per_chapter();
        for i in 0..3 * rpc {
            ix.insert(&h(i), loc(i));
        }
        let d = ix.take_dirty();
        ix.write_dirty(&meta, &d);
        let mut re = Index::new(IndexMode::Sparse, Some(meta), (0, 64), 7, 1 << 20, false).expect("index");
        re.rebuild(2);
        // Chapter 2 is in the window (the rebuild opened chapter 3, dropping chapter 0).
        let hook = (2 * rpc..3 * rpc).find(|&i| is_hook(&h(i))).expect("a hook in chapter 2");
        let plain = (2 * rpc..3 * rpc).find(|&i| !is_hook(&h(i))).expect("a non-hook");
        assert_eq!(re.lookup(&h(plain)), None, "nothing loaded yet");
        assert_eq!(re.lookup(&h(hook)).map(|l| l.pbn), Some(hook));
        assert_eq!(re.lookup(&h(plain)).map(|l| l.pbn), Some(plain), "the hook loaded its chapter");
        assert!(re.len() < rpc, "only hooks are in memory");
    }
}
