//! The fingerprint index, in two levels (docs/design.md, "The fingerprint index"):
//! full records in the chapter ring on the metadata device (`chapter`), and in memory a
//! compact volume index from fingerprint bits to (chapter, page, record) (`volume_index`)
//! plus a bounded cache of record pages (`record_cache`).
//!
//! A lookup (the volume's state lock held) never reads the device (`lookup_cached`):
//! 1. dense: the volume index names the candidate records (usually none); a record of the
//!    open chapter is in memory, another is in the record cache or its page must be read:
//!    the lookup then answers with a `Fetch`, which the caller reads after letting the
//!    state lock go (`PageSource::fetch`) before asking again;
//! 2. sparse: the open chapter and the cached chapters are searched by fingerprint; only
//!    a hook (1 fingerprint in `SPARSE_SAMPLE`) is in the volume index, and a hook that
//!    names an uncached chapter asks for that whole chapter (one sequential read), so the
//!    records written together with it are found in memory next.
//!
//! New records go to the open chapter; a full chapter is written and the next one opened,
//! which drops the oldest chapter of the ring (the window). The open chapter's new pages
//! are handed to each journal commit (`take_dirty`), so a record is on the device once
//! the write it describes is durable. At open the newest chapter is found in a few reads
//! and the volume index is rebuilt from the ring in the background (`rebuild`).
//!
//! Invariants:
//! - Memory is bounded: the table by `index_memory_bytes`, the caches by page counts.
//! - The index is advisory: a record may be stale, lost or torn at any time; `Deduper`
//!   trusts a record only when its block is in use and either its stamp is current (a
//!   record of this epoch) or the bytes were compared.
//! - `current` is true exactly for records of this epoch: the epoch changes only between
//!   chapters (a new epoch closes the open chapter and empties the caches, and a page
//!   read for a request made before the emptying is not cached).
//! - Epochs are never reused: a session's first epoch is `session << EPOCH_SESSION_SHIFT`
//!   (the superblock's read-write open count, persisted before anything is written) and
//!   above every epoch seen in the ring; a session that runs out of its
//!   `2^EPOCH_SESSION_SHIFT` epochs stops trusting stamps altogether (`stamps_untrusted`).
//!   A page whose epoch is not below the session's first was not written by an earlier
//!   session and is not rebuilt.
//! - The open chapter holds fewer than `records_per_chapter` records.
//! - Lock order: the volume's state lock, then the volume index's (`Shared::table`), then
//!   a record cache's; the rebuild thread takes only the last two.

use super::chapter::{decode_page, encode_names, encode_page, PageHeader, Record, RingLayout, RECORDS_PER_PAGE};
use super::rebuild::{find_newest, RebuildThread, Rebuilder};
use super::record_cache::{prefix, ChapterCache, PageCache, Records};
use super::volume_index::{VolumeIndex, LOAD_PERCENT, SLOT_BYTES};
use crate::config::{IndexMode, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::error::Result;
use crate::io::{Dev, IoKind};
use crate::metadata::block_map::{Frag, MapEntry};
use crate::obs::stats::IndexFigures;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Closed chapters' pages waiting for the next commit, at most (past it they are written
/// at once, under the state lock).
const PENDING_BYTES_MAX: usize = 8 << 20;
/// Epochs each session may use (a new one per reuse stamp that wraps).
pub const EPOCH_SESSION_SHIFT: u32 = 10;
/// One fingerprint in `SPARSE_SAMPLE` is a hook in sparse mode. Why 16, not UDS's 32: a
/// duplicate run is found only through a hook inside it, and between two Linux source
/// tars most shared runs are short; 1 in 32 kept 93 % of dense's dedup there, 1 in 16
/// keeps 96–97 %, for 16 times dense's window per byte of memory.
pub const SPARSE_SAMPLE: u64 = 16;
/// Record cache budget in pages (101 decoded records each): single pages (dense) or
/// whole chapters (sparse).
pub const RECORD_CACHE_PAGES: u64 = 4096;
/// Chapters a rebuild reads before `open` returns, at most, with `IndexRebuild::Auto`.
pub const REBUILD_FOREGROUND_BYTES_MAX: u64 = 16 << 20;
/// Memory of a cached page besides its records: its map entry, its place in the clock,
/// the shared vector's header (an estimate, for statistics).
const PAGE_OVERHEAD_BYTES: u64 = 96;

/// Where a fingerprint's copy lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Physical block (the raw block, or the first block of the fragment).
    pub pbn: u64,
    /// Map entry state (raw or fragment).
    pub state: u8,
    /// The fragment, for a fragment.
    pub frag: Frag,
    /// Reuse stamp of the block when the record was made (hash verification).
    pub stamp: u16,
    /// The record was made in this epoch, so its stamp can be compared with the block's
    /// (not stored: decided when the record is read).
    pub current: bool,
}

/// Bytes of an encoded location.
pub const LOCATION_BYTES: usize = 16;

impl Location {
    /// The location a map entry names (stamp 0, not current).
    pub fn of(e: &MapEntry) -> Self {
        Location { pbn: e.pbn, state: e.state, frag: e.frag, stamp: 0, current: false }
    }
    /// The map entry of this location with content crc `crc`.
    pub fn entry(&self, crc: u32) -> MapEntry {
        MapEntry { pbn: self.pbn, state: self.state, crc, frag: self.frag }
    }
    /// Encodes 16 bytes: the map entry's first 12 bytes (pbn, state, codec, unit, offset,
    /// length), the reuse stamp (u16), 2 zero bytes.
    pub fn encode(&self, out: &mut [u8]) {
        let mut b = [0u8; crate::metadata::block_map::MAP_ENTRY_BYTES];
        self.entry(0).encode(&mut b);
        if let (Some(dst), Some(src)) = (out.get_mut(..12), b.get(..12)) {
            dst.copy_from_slice(src);
        }
        crate::codec::put_u16(out, 12, self.stamp);
        if let Some(z) = out.get_mut(14..16) {
            z.fill(0);
        }
    }
    /// Decodes an encoded location (`current` false: the caller decides). Bytes that do
    /// not decode as a data entry give a location no block map entry can match (state 0),
    /// which no lookup trusts.
    pub fn decode(b: &[u8]) -> Self {
        let mut e = [0u8; crate::metadata::block_map::MAP_ENTRY_BYTES];
        if let (Some(dst), Some(src)) = (e.get_mut(..12), b.get(..12)) {
            dst.copy_from_slice(src);
        }
        let stamp = crate::codec::get_u16(b, 12);
        match MapEntry::decode(&e) {
            Ok(m) if m.is_data() => Location { stamp, ..Location::of(&m) },
            _ => Location { pbn: 0, state: 0, frag: Frag::ZERO, stamp, current: false },
        }
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

/// How far the rebuild got (written by whoever runs it, read by statistics).
#[derive(Default)]
pub struct Progress {
    /// A rebuild is under way.
    pub running: AtomicBool,
    /// Chapters of the window to rebuild.
    pub chapters_total: AtomicU64,
    /// Chapters done (read, or skipped because they left the window meanwhile).
    pub chapters_done: AtomicU64,
    /// Records read.
    pub records: AtomicU64,
    /// Pages skipped (torn, stale, never written, unreadable).
    pub pages_skipped: AtomicU64,
    /// Bytes read from the ring (name pages, and record pages where names were missing).
    pub bytes_read: AtomicU64,
    /// Bytes of the record pages of the chapters rebuilt (what reading the records would
    /// have read): the window covered.
    pub bytes_covered: AtomicU64,
    /// Chapters whose names were incomplete, rebuilt from their record pages.
    pub chapters_without_names: AtomicU64,
    /// Time since the rebuild started (while running), or its total time.
    pub millis: AtomicU64,
}

/// What the index shares with the rebuild, which runs without the state lock.
pub struct Shared {
    /// The volume index.
    pub table: Mutex<VolumeIndex>,
    /// The open chapter (changed under the state lock; the rebuild reads it to leave out
    /// chapters that left the window).
    pub open_vcn: AtomicU64,
    /// The rebuild's progress.
    pub progress: Progress,
    /// Asks the rebuild to stop.
    pub stop: AtomicBool,
}

/// How the volume index is rebuilt after an open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IndexRebuild {
    /// Before `open` returns when the window's chapters are at most
    /// `REBUILD_FOREGROUND_BYTES_MAX` (a fraction of a second), else in the background
    /// (default).
    #[default]
    Auto,
    /// By a background thread; the volume accepts I/O at once.
    Background,
    /// Before `open` returns.
    Foreground,
    /// One step per `Volume::index_rebuild_step` call (deterministic tests, the simulator).
    Manual,
}

/// A record page (or a whole chapter, sparse) a lookup needs from the device, and what
/// the index was when it was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fetch {
    /// Virtual chapter.
    pub vcn: u64,
    /// Page (None: the whole chapter, sparse mode).
    pub page: Option<u64>,
    /// The epoch whose records are `current`.
    epoch: u32,
    /// False once the session stopped trusting stamps.
    trusted: bool,
    /// The record cache's generation at the request (see `record_cache`).
    generation: u64,
}

/// A lookup's answer without device I/O.
#[derive(Debug, Clone, Copy, Default)]
pub struct Lookup {
    /// The candidate.
    pub loc: Option<Location>,
    /// A page to read (outside the state lock) before asking again, when `loc` is None; or
    /// a chapter worth reading ahead, when `loc` is set.
    pub fetch: Option<Fetch>,
}

/// After a record-page read the device gave no answer to in time, lookups read no record
/// pages for this long (`PageSource::fetch`). Why: a read that fails costs dedup only, but
/// each would wait out the device's timeout again, for every page of every write batch (a
/// RADOS volume with every OSD down kept a client's writes waiting for minutes).
const UNANSWERED_PAUSE: std::time::Duration = std::time::Duration::from_secs(30);

/// Reads record pages for lookups, holding no volume lock.
#[derive(Clone)]
pub struct PageSource {
    meta: Option<Dev>,
    ring: RingLayout,
    uuid_lo: u64,
    pages: Arc<Mutex<PageCache>>,
    chapters: Arc<Mutex<ChapterCache>>,
    counters: Arc<Counters>,
    /// No record-page reads before then (`UNANSWERED_PAUSE`).
    quiet_until: Arc<Mutex<Option<std::time::Instant>>>,
}

impl PageSource {
    /// Reads what `f` names into the record cache (a failed read costs dedup only; none
    /// while paused after a read that timed out, see `UNANSWERED_PAUSE`).
    pub fn fetch(&self, f: &Fetch) {
        let Some(meta) = self.meta.as_ref() else { return };
        if self.quiet_until.lock().is_some_and(|t| std::time::Instant::now() < t) {
            return;
        }
        let failed = |e: crate::error::Error| {
            if e.is_timeout() {
                *self.quiet_until.lock() = Some(std::time::Instant::now() + UNANSWERED_PAUSE);
            }
        };
        match f.page {
            Some(page) => {
                if self.pages.lock().has(f.vcn, page) {
                    return;
                }
                let mut buf = vec![0u8; BLOCK_SIZE];
                self.counters.page_reads.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = meta.read(IoKind::Index, &mut buf, self.ring.page_offset(f.vcn, page)) {
                    return failed(e);
                }
                if let Some(recs) = decode_checked(&buf, self.uuid_lo, f, page) {
                    self.pages.lock().put_at(f.generation, f.vcn, page, recs);
                }
            }
            None => {
                if self.chapters.lock().has(f.vcn) {
                    return;
                }
                let ppc = self.ring.pages_per_chapter;
                let mut buf = vec![0u8; (ppc * BLOCK_SIZE_U64) as usize];
                self.counters.page_reads.fetch_add(ppc, Ordering::Relaxed);
                self.counters.chapter_loads.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = meta.read(IoKind::Index, &mut buf, self.ring.page_offset(f.vcn, 0)) {
                    return failed(e);
                }
                let mut all = Vec::new();
                for (i, b) in buf.chunks_exact(BLOCK_SIZE).enumerate() {
                    if let Some(recs) = decode_checked(b, self.uuid_lo, f, i as u64) {
                        all.extend(recs.iter().copied());
                    }
                }
                self.chapters.lock().put_at(f.generation, f.vcn, Arc::new(all));
            }
        }
    }
}

impl PageSource {
    /// The records of closed chapter `vcn` as found on the device (pages that do not
    /// check are skipped and counted), and the epochs of the pages they came from, for
    /// `check`'s audit.
    pub fn chapter_records(&self, vcn: u64) -> (Vec<Record>, u64, Vec<u32>) {
        let Some(meta) = self.meta.as_ref() else { return (Vec::new(), 0, Vec::new()) };
        let ppc = self.ring.pages_per_chapter;
        let mut buf = vec![0u8; (ppc * BLOCK_SIZE_U64) as usize];
        if meta.read(IoKind::Index, &mut buf, self.ring.page_offset(vcn, 0)).is_err() {
            return (Vec::new(), ppc, Vec::new());
        }
        let mut all = Vec::new();
        let mut epochs = Vec::new();
        let mut skipped = 0;
        for (i, b) in buf.chunks_exact(BLOCK_SIZE).enumerate() {
            match decode_page(b, self.uuid_lo).filter(|(h, _)| h.vcn == vcn && usize::from(h.page) == i) {
                Some((h, recs)) => {
                    all.extend(recs);
                    epochs.push(h.epoch);
                }
                None => skipped += 1,
            }
        }
        (all, skipped, epochs)
    }

    /// The epoch and names of closed chapter `vcn` as found on the device, if the ring
    /// keeps names and they are complete (`check` compares them with the records).
    pub fn chapter_names(&self, vcn: u64) -> Option<(u32, Vec<super::chapter::Name>)> {
        let meta = self.meta.as_ref()?;
        if !self.ring.has_names() {
            return None;
        }
        let mut buf = vec![0u8; (self.ring.name_pages_per_chapter * BLOCK_SIZE_U64) as usize];
        meta.read(IoKind::Index, &mut buf, self.ring.name_offset(vcn, 0)).ok()?;
        super::chapter::chapter_names(&buf, self.uuid_lo, vcn, u32::MAX)
    }
}

/// The records of page `page` of chapter `f.vcn` in `buf`, if it is that page, with
/// `current` set as the epoch of `f` says.
fn decode_checked(buf: &[u8], uuid_lo: u64, f: &Fetch, page: u64) -> Option<Records> {
    let (hd, mut recs) = decode_page(buf, uuid_lo)?;
    if hd.vcn != f.vcn || u64::from(hd.page) != page {
        return None;
    }
    let current = hd.epoch == f.epoch && f.trusted;
    recs.iter_mut().for_each(|r| r.loc.current = current);
    Some(Arc::new(recs))
}

/// The index.
pub struct Index {
    mode: IndexMode,
    shared: Arc<Shared>,
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
    pages: Arc<Mutex<PageCache>>,
    chapters: Arc<Mutex<ChapterCache>>,
    counters: Arc<Counters>,
    /// Shared by every `PageSource` (`UNANSWERED_PAUSE`).
    quiet_until: Arc<Mutex<Option<std::time::Instant>>>,
    /// A rebuild run step by step (`IndexRebuild::Manual`), or not started yet.
    rebuilder: Option<Rebuilder>,
    /// A rebuild running in the background.
    rebuild_thread: Option<RebuildThread>,
    /// Chapter slots' first pages read at open to find the newest chapter, and the time
    /// it took.
    open_probe: (u64, u64),
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
    /// memory only), with name pages when `names` (`RingLayout::for_area`), its volume
    /// index at most `memory_bytes_max`; empty until `rebuild`.
    pub fn new(
        mode: IndexMode,
        meta: Option<Dev>,
        (area_start, area_blocks, names): (u64, u64, bool),
        uuid_lo: u64,
        memory_bytes_max: u64,
        prefault: bool,
    ) -> Result<Self> {
        let (ring, meta) = match RingLayout::for_area(area_start, area_blocks, mode, names) {
            Some(r) => (r, meta),
            None => (RingLayout { start_block: 0, chapters: 2, pages_per_chapter: 1, name_pages_per_chapter: 0 }, None),
        };
        let memory = Self::memory_wanted(mode, &ring).min(memory_bytes_max);
        let table = VolumeIndex::try_new(memory, prefault)?;
        let cache_chapters = (RECORD_CACHE_PAGES / ring.pages_per_chapter).max(2) as usize;
        let shared = Arc::new(Shared {
            table: Mutex::new(table),
            open_vcn: AtomicU64::new(0),
            progress: Progress::default(),
            stop: AtomicBool::new(false),
        });
        Ok(Index {
            mode,
            shared,
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
            pages: Arc::new(Mutex::new(PageCache::new(RECORD_CACHE_PAGES as usize))),
            chapters: Arc::new(Mutex::new(ChapterCache::new(cache_chapters))),
            counters: Arc::new(Counters::default()),
            quiet_until: Arc::new(Mutex::new(None)),
            rebuilder: None,
            rebuild_thread: None,
            open_probe: (0, 0),
        })
    }

    /// Volume index memory for a full window of `ring` (at `LOAD_PERCENT` load).
    pub fn memory_wanted(mode: IndexMode, ring: &RingLayout) -> u64 {
        let entries = match mode {
            IndexMode::Dense => ring.window_blocks(),
            IndexMode::Sparse => ring.window_blocks().div_ceil(SPARSE_SAMPLE),
        };
        let slots = (entries * 100).div_ceil(LOAD_PERCENT).next_multiple_of(super::volume_index::BUCKET_SLOTS as u64);
        // One bucket more: the table's room to align its buckets to cache lines.
        (slots.max(super::volume_index::BUCKET_SLOTS as u64) + super::volume_index::BUCKET_SLOTS as u64) * SLOT_BYTES
    }

    /// Waits for the volume index's memory to be populated.
    pub fn wait_prefault(&mut self) {
        self.shared.table.lock().wait_prefault();
    }

    /// The ring's layout.
    #[cfg(test)]
    pub fn ring(&self) -> RingLayout {
        self.ring
    }

    /// Slots of the volume index.
    pub fn capacity(&self) -> u64 {
        self.shared.table.lock().capacity()
    }

    /// Occupied slots of the volume index.
    pub fn len(&self) -> u64 {
        self.shared.table.lock().len()
    }

    /// Memory of the volume index.
    pub fn memory_bytes(&self) -> u64 {
        self.shared.table.lock().memory_bytes()
    }

    /// Bytes of the volume index per slot.
    pub fn bytes_per_entry(&self) -> u64 {
        SLOT_BYTES
    }

    /// Memory of the record cache: its decoded records (`size_of::<Record>()` each) and
    /// its bookkeeping.
    pub fn cache_bytes(&self) -> u64 {
        let rec = std::mem::size_of::<Record>() as u64;
        let (pages, precs) = {
            let p = self.pages.lock();
            (p.len() as u64, p.records() as u64)
        };
        let (crecs, map) = {
            let c = self.chapters.lock();
            (c.records() as u64, c.map_bytes() as u64)
        };
        (precs + crecs) * rec + pages * PAGE_OVERHEAD_BYTES + map
    }

    fn records_per_chapter(&self) -> usize {
        self.ring.records_per_chapter() as usize
    }

    /// True when chapter `vcn` is inside the window.
    fn in_window(&self, vcn: u64) -> bool {
        vcn <= self.open_vcn && self.open_vcn - vcn < self.ring.chapters
    }

    /// Reads record pages for lookups without the state lock.
    pub fn source(&self) -> PageSource {
        PageSource {
            meta: self.meta.clone(),
            ring: self.ring,
            uuid_lo: self.uuid_lo,
            pages: self.pages.clone(),
            chapters: self.chapters.clone(),
            counters: self.counters.clone(),
            quiet_until: self.quiet_until.clone(),
        }
    }

    fn fetch_for(&self, vcn: u64, page: Option<u64>) -> Option<Fetch> {
        self.meta.as_ref()?;
        let generation = match page {
            Some(_) => self.pages.lock().generation(),
            None => self.chapters.lock().generation(),
        };
        Some(Fetch { vcn, page, epoch: self.epoch, trusted: !self.stamps_untrusted, generation })
    }

    /// The candidate location for fingerprint `h`, reading a record page when it must
    /// (tests; the write path uses `lookup_cached` and reads outside the lock).
    #[cfg(test)]
    pub fn lookup(&self, h: &[u8; 32]) -> Option<Location> {
        let first = self.lookup_cached(h, true);
        let Some(f) = first.fetch else { return first.loc };
        self.source().fetch(&f);
        first.loc.or_else(|| self.lookup_cached(h, false).loc)
    }

    /// The candidate location for fingerprint `h` from memory alone; what to read when
    /// memory cannot tell. `count`: a first lookup of `h` (statistics count those).
    pub fn lookup_cached(&self, h: &[u8; 32], count: bool) -> Lookup {
        let found = match self.mode {
            IndexMode::Dense => self.lookup_dense(h),
            IndexMode::Sparse => self.lookup_sparse(h),
        };
        if count {
            self.counters.lookups.fetch_add(1, Ordering::Relaxed);
            if found.loc.is_none() && found.fetch.is_some() {
                self.counters.lookups_with_io.fetch_add(1, Ordering::Relaxed);
            }
        }
        found
    }

    fn lookup_dense(&self, h: &[u8; 32]) -> Lookup {
        let cands = self.shared.table.lock().candidates(h, self.open_vcn, self.ring.chapters);
        let mut fetch = None;
        for super::volume_index::Candidate { vcn, page, positions } in cands {
            // The slot names the newest record of its fingerprint (a block at the reference
            // cap got a new copy recorded after it, and took the slot), somewhere in its
            // group of positions: the last record of the fingerprint there (an older one
            // may share the group). None there is a tag collision: the next candidate.
            let find = |recs: &[Record]| {
                let group = recs.get(positions.start..positions.end.min(recs.len()))?;
                group.iter().rev().find(|r| r.hash == *h).copied()
            };
            let found = if vcn == self.open_vcn {
                let first = page as usize * RECORDS_PER_PAGE;
                self.open.get(first..(first + RECORDS_PER_PAGE).min(self.open.len())).and_then(find)
            } else {
                let cached = self.pages.lock().get(vcn, page);
                match cached {
                    Some(p) => {
                        self.counters.page_cache_hits.fetch_add(1, Ordering::Relaxed);
                        find(&p)
                    }
                    None => {
                        // The newest uncached candidate is read first; a tag collision
                        // there costs one more round.
                        if fetch.is_none() {
                            fetch = self.fetch_for(vcn, Some(page));
                        }
                        None
                    }
                }
            };
            if let Some(r) = found {
                return Lookup { loc: Some(r.loc), fetch: None };
            }
        }
        Lookup { loc: None, fetch }
    }

    fn lookup_sparse(&self, h: &[u8; 32]) -> Lookup {
        let p = prefix(h);
        if let Some(r) = self.open_by_prefix.get(&p).and_then(|&i| self.open.get(i as usize)).filter(|r| r.hash == *h) {
            return Lookup { loc: Some(r.loc), fetch: None };
        }
        let cached = self.chapters.lock().find(h);
        if let Some((vcn, r, near_end)) = cached {
            if self.in_window(vcn) {
                // Readahead: a stream reaching the end of a chapter goes on into the next,
                // which it would otherwise find only at that chapter's first hook.
                let next = vcn + 1;
                let fetch = (near_end && next < self.open_vcn && !self.chapters.lock().has(next))
                    .then(|| self.fetch_for(next, None))
                    .flatten();
                return Lookup { loc: Some(r.loc), fetch };
            }
        }
        if !is_hook(h) {
            return Lookup::default();
        }
        let cands = self.shared.table.lock().candidates(h, self.open_vcn, self.ring.chapters);
        let fetch = cands
            .into_iter()
            .map(|c| c.vcn)
            .find(|&vcn| vcn != self.open_vcn && !self.chapters.lock().has(vcn))
            .and_then(|vcn| self.fetch_for(vcn, None));
        Lookup { loc: None, fetch }
    }

    /// Records `h` at `loc` (a block stored, or a record refreshed) in the open chapter.
    pub fn insert(&mut self, h: &[u8; 32], loc: Location) {
        let idx = self.open.len();
        let page = idx / RECORDS_PER_PAGE;
        self.open.push(Record { hash: *h, loc: Location { current: !self.stamps_untrusted, ..loc } });
        let (at, ring) = ((idx % RECORDS_PER_PAGE) as u64, self.ring.chapters);
        match self.mode {
            IndexMode::Dense => {
                self.shared.table.lock().insert(h, (self.open_vcn, page as u64, at), self.open_vcn, ring)
            }
            IndexMode::Sparse => {
                self.open_by_prefix.insert(prefix(h), idx as u32);
                if is_hook(h) {
                    self.shared.table.lock().insert(h, (self.open_vcn, page as u64, at), self.open_vcn, ring);
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
        self.queue_names();
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
        self.shared.open_vcn.store(self.open_vcn, Ordering::Release);
        self.counters.chapters_closed.fetch_add(1, Ordering::Relaxed);
        self.shared.table.lock().sweep(self.open_vcn, self.ring.chapters);
    }

    /// Queues the open chapter's name pages for the next commit (a ring with names): at
    /// its close, and at the volume's clean close, after which the chapter is never
    /// added to (the next session opens the chapter after it).
    fn queue_names(&mut self) {
        if !self.ring.has_names() || self.open.is_empty() || self.meta.is_none() {
            return;
        }
        let names = encode_names(self.uuid_lo, self.open_vcn, self.epoch, &self.open);
        self.pending_bytes += names.len();
        self.pending.push((self.ring.name_offset(self.open_vcn, 0), names));
    }

    /// Readies the index for the volume's clean close: the open chapter's names go with
    /// the closing checkpoint's commit, so the next open rebuilds it from them.
    pub fn prepare_close(&mut self) {
        self.queue_names();
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
        {
            let mut t = self.shared.table.lock();
            for c in t.candidates(h, self.open_vcn, self.ring.chapters) {
                t.remove(h, c.vcn, c.page);
            }
        }
        let p = prefix(h);
        if self.open_by_prefix.get(&p).and_then(|&i| self.open.get(i as usize)).is_some_and(|r| r.hash == *h) {
            self.open_by_prefix.remove(&p);
        }
        self.chapters.lock().forget(h);
    }

    /// Prepares the rebuild of the volume index from the ring (at open, before the volume
    /// accepts I/O): finds the newest chapter in a few reads (`rebuild::find_newest`) and
    /// opens the one after it, takes the first epoch of read-write session `session` (or
    /// one above every epoch seen, if higher), then rebuilds the window's chapters as
    /// `how` says.
    pub fn rebuild(&mut self, session: u64, how: IndexRebuild) {
        let base = u32::try_from(session).unwrap_or(u32::MAX).checked_shl(EPOCH_SESSION_SHIFT).unwrap_or(0);
        let base = if u64::from(base) >> EPOCH_SESSION_SHIFT == session { base } else { 0 };
        let Some(meta) = self.meta.clone() else { return };
        let t0 = std::time::Instant::now();
        let newest = find_newest(&meta, &self.ring, self.uuid_lo);
        self.open_probe = (newest.reads, t0.elapsed().as_millis() as u64);
        // Past the last epoch counter value, the session trusts no stamp (as above).
        self.epoch = base.max(newest.epoch_max.saturating_add(1)).max(1);
        self.stamps_untrusted = (base == 0 && session > 0) || newest.epoch_max == u32::MAX;
        let Some(n) = newest.vcn else { return };
        self.open_vcn = n + 1;
        self.shared.open_vcn.store(self.open_vcn, Ordering::Release);
        let mut r = Rebuilder::new(meta, self.ring, self.uuid_lo, self.mode, self.epoch, n, self.shared.clone());
        let bytes = (n + 1).min(self.ring.chapters - 1) * self.ring.pages_per_chapter * BLOCK_SIZE_U64;
        let how = match how {
            IndexRebuild::Auto if bytes <= REBUILD_FOREGROUND_BYTES_MAX => IndexRebuild::Foreground,
            IndexRebuild::Auto => IndexRebuild::Background,
            h => h,
        };
        match how {
            IndexRebuild::Foreground | IndexRebuild::Auto => while r.step() {},
            IndexRebuild::Manual => self.rebuilder = Some(r),
            IndexRebuild::Background => match RebuildThread::start(r) {
                Ok(t) => self.rebuild_thread = Some(t),
                Err(mut r) => while r.step() {},
            },
        }
    }

    /// The window's closed chapters, newest first (`check` reads their records through
    /// `source` to audit them).
    pub fn window_chapters(&self) -> Vec<u64> {
        let first = (self.open_vcn + 1).saturating_sub(self.ring.chapters);
        (first..self.open_vcn).rev().collect()
    }

    /// Runs one step of a manual rebuild; false when none is left.
    pub fn rebuild_step(&mut self) -> bool {
        let more = self.rebuilder.as_mut().is_some_and(Rebuilder::step);
        if !more {
            self.rebuilder = None;
        }
        more
    }

    /// Stops a rebuild under way (close, drop): the chapters not read yet stay unindexed.
    pub fn stop_rebuild(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(mut t) = self.rebuild_thread.take() {
            t.stop();
        }
        self.rebuilder = None;
        self.shared.progress.running.store(false, Ordering::Relaxed);
    }

    /// The background rebuild's thread, for a caller to wait for it without the state
    /// lock (dropping it stops the rebuild).
    pub fn take_rebuild_thread(&mut self) -> Option<RebuildThread> {
        self.rebuild_thread.take()
    }

    /// The index's figures.
    pub fn stats(&self) -> IndexFigures {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let p = &self.shared.progress;
        let (entries, table_bytes) = {
            let t = self.shared.table.lock();
            (t.len(), t.memory_bytes())
        };
        let lookups = get(&c.lookups);
        IndexFigures {
            mode: self.mode.to_string(),
            memory_bytes_per_entry: table_bytes as f64 / entries.max(1) as f64,
            cache_bytes: self.cache_bytes(),
            chapters: self.ring.chapters,
            chapters_used: (self.open_vcn + 1).min(self.ring.chapters),
            records_per_chapter: self.ring.records_per_chapter(),
            window_bytes: self.ring.window_blocks() * BLOCK_SIZE_U64,
            lookups,
            lookups_without_io: lookups.saturating_sub(get(&c.lookups_with_io)),
            page_reads: get(&c.page_reads),
            page_cache_hits: get(&c.page_cache_hits),
            chapter_loads: get(&c.chapter_loads),
            write_errors: get(&c.write_errors),
            rebuild_running: p.running.load(Ordering::Relaxed),
            rebuild_chapters_total: get(&p.chapters_total),
            rebuild_chapters_done: get(&p.chapters_done),
            rebuild_millis: get(&p.millis),
            rebuild_records: get(&p.records),
            rebuild_bytes: get(&p.bytes_read),
            rebuild_covered_bytes: get(&p.bytes_covered),
            rebuild_chapters_without_names: get(&p.chapters_without_names),
            rebuild_pages_skipped: get(&p.pages_skipped),
            rebuild_probe_reads: self.open_probe.0,
            rebuild_probe_millis: self.open_probe.1,
        }
    }

    /// Checks the volume index and that `check` accepts every open-chapter record (the
    /// `verify` audit).
    #[cfg(any(test, feature = "verify"))]
    pub fn audit(
        &self,
        check: impl Fn(Location) -> std::result::Result<(), String>,
    ) -> std::result::Result<(), String> {
        self.shared.table.lock().audit()?;
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

impl Drop for Index {
    fn drop(&mut self) {
        self.stop_rebuild();
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
        Location { pbn: i, state: 2, frag: Frag::ZERO, stamp: 0, current: true }
    }

    fn dev() -> Dev {
        Dev::new(Arc::new(MemStorage::new(8 << 20)), Arc::new(IoCounters::default()))
    }

    #[test]
    fn dense_records_survive_a_rebuild_and_the_ring_drops_the_oldest() {
        for names in [false, true] {
            dense_rebuild(names);
        }
    }

    /// The rebuild test of a ring with or without name pages: with them, the closed
    /// chapters are rebuilt from their names and the chapter open at the "crash" (no clean
    /// close) from its records.
    fn dense_rebuild(names: bool) {
        let meta = dev();
        // 8 chapters of one record page (R records; and a name page each, with names), a
        // window of 8 R blocks.
        const R: u64 = RECORDS_PER_PAGE as u64;
        let area = (16, if names { 16 } else { 8 }, names);
        let mut ix = Index::new(IndexMode::Dense, Some(meta.clone()), area, 7, 1 << 20, false).expect("index");
        assert_eq!((ix.ring().chapters, ix.ring().has_names()), (8, names));
        // 1000 records fill chapters 0..=10 and part of 11; the window is chapters 4..=11.
        for i in 0..1000 {
            ix.insert(&h(i), loc(i));
        }
        let last = 999 / R;
        assert_eq!(ix.lookup(&h(999)).map(|l| l.pbn), Some(999));
        assert_eq!(ix.lookup(&h(5 * R)).map(|l| l.pbn), Some(5 * R));
        assert_eq!(ix.lookup(&h(5)), None, "chapter 0 left the window");
        let d = ix.take_dirty();
        ix.write_dirty(&meta, &d);
        let mut re = Index::new(IndexMode::Dense, Some(meta.clone()), area, 7, 1 << 20, false).expect("index");
        re.rebuild(2, IndexRebuild::Foreground);
        let l = re.lookup(&h(999)).expect("open chapter record written with the commit");
        assert_eq!((l.pbn, l.current), (999, false), "records of an earlier epoch are not current");
        // The rebuild opened chapter last + 1, so chapter last - 7 left the window.
        assert_eq!(re.lookup(&h((last - 6) * R)).map(|l| l.pbn), Some((last - 6) * R));
        assert_eq!(re.lookup(&h((last - 7) * R + 3)), None);
        let st = re.stats();
        assert_eq!(st.rebuild_records, 6 * R + (1000 - last * R), "six whole chapters and the last one's records");
        // With names, only the chapter open at the end had none.
        assert_eq!(st.rebuild_chapters_without_names, u64::from(names));
        // A torn page is skipped: the rest of the ring still rebuilds.
        let torn_chapter = last - 5;
        let mut torn = vec![0u8; BLOCK_SIZE];
        meta.read(IoKind::Index, &mut torn, re.ring().page_offset(torn_chapter, 0)).expect("read");
        if let Some(b) = torn.get_mut(2000) {
            *b ^= 0xff;
        }
        meta.write(IoKind::Index, &torn, re.ring().page_offset(torn_chapter, 0)).expect("write");
        // And torn names: that chapter is rebuilt from its records.
        let names_torn = last - 3;
        if names {
            let mut page = vec![0u8; BLOCK_SIZE];
            meta.read(IoKind::Index, &mut page, re.ring().name_offset(names_torn, 0)).expect("read");
            if let Some(b) = page.get_mut(100) {
                *b ^= 0xff;
            }
            meta.write(IoKind::Index, &page, re.ring().name_offset(names_torn, 0)).expect("write");
        }
        let mut re2 = Index::new(IndexMode::Dense, Some(meta), area, 7, 1 << 20, false).expect("index");
        re2.rebuild(3, IndexRebuild::Foreground);
        assert_eq!(re2.lookup(&h(torn_chapter * R + 5)), None, "the torn chapter's records are gone");
        assert_eq!(re2.lookup(&h(names_torn * R)).map(|l| l.pbn), Some(names_torn * R));
        assert_eq!(re2.lookup(&h((last - 2) * R + 7)).map(|l| l.pbn), Some((last - 2) * R + 7));
        assert_eq!(re2.stats().rebuild_chapters_without_names, 2 * u64::from(names), "the open one and the torn one");
    }

    #[test]
    fn sparse_hooks_bring_their_neighbours() {
        let meta = dev();
        let mut ix =
            Index::new(IndexMode::Sparse, Some(meta.clone()), (0, 64, false), 7, 1 << 20, false).expect("index");
        let rpc = ix.ring().records_per_chapter();
        for i in 0..3 * rpc {
            ix.insert(&h(i), loc(i));
        }
        let d = ix.take_dirty();
        ix.write_dirty(&meta, &d);
        let mut re = Index::new(IndexMode::Sparse, Some(meta), (0, 64, false), 7, 1 << 20, false).expect("index");
        re.rebuild(2, IndexRebuild::Foreground);
        // Chapter 2 is in the window (the rebuild opened chapter 3, dropping chapter 0).
        let hook = (2 * rpc..3 * rpc).find(|&i| is_hook(&h(i))).expect("a hook in chapter 2");
        let plain = (2 * rpc..3 * rpc).find(|&i| !is_hook(&h(i))).expect("a non-hook");
        assert_eq!(re.lookup(&h(plain)), None, "nothing loaded yet");
        assert_eq!(re.lookup(&h(hook)).map(|l| l.pbn), Some(hook));
        assert_eq!(re.lookup(&h(plain)).map(|l| l.pbn), Some(plain), "the hook loaded its chapter");
        assert!(re.len() < rpc, "only hooks are in memory");
    }
}
