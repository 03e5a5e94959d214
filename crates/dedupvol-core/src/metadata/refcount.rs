//! Reference counts of every physical data block, all in memory, persisted in checksummed
//! two-slot pages.
//!
//! Invariants:
//! - `count[pbn]` equals the number of block map entries whose stored data touches `pbn`
//!   (a raw block, or a fragment that starts in, runs through or ends in it) once the
//!   journal is applied; it never exceeds `REFCOUNT_MAX`. A block is free exactly when
//!   its count is zero: a fragment crossing into the next block keeps both alive.
//! - `used_blocks` is the number of non-zero counts (`inc` and `dec` keep it; the
//!   `verify` audit recounts it).
//! - Pages follow the block map's rules: applied-seq idempotency, the write-ahead rule,
//!   and two slots never both unsynced.

use crate::config::{BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::error::{Error, Result};
use crate::io::{Dev, IoKind};
use crate::metadata::block_map::{pick_slot, seal_page, MapEntry, PAGE_HEADER_BYTES};
use crate::metadata::layout::{Geometry, RC_ENTRIES_PER_PAGE};
use crate::read::cache::PbnSet;

/// Largest reference count; a duplicate whose stored data touches a block at the cap is
/// stored as a new copy. Why not 65,535: a copy per 4,000 references costs 0.025 % of
/// the space those references save, and the cap stays reachable by the tests of what
/// happens there.
pub const REFCOUNT_MAX: u16 = 4_000;
/// Magic of a refcount page ("DVRC").
pub const RC_PAGE_MAGIC: u32 = u32::from_le_bytes(*b"DVRC");
/// Pages read per I/O when loading.
const LOAD_PAGES_PER_IO: u64 = 128;

const _: () = assert!(PAGE_HEADER_BYTES + RC_ENTRIES_PER_PAGE as usize * 2 == BLOCK_SIZE);

/// All reference counts of a volume.
pub struct Refcounts {
    geo: Geometry,
    uuid_lo: u64,
    meta: Dev,
    count: Vec<u16>,
    page_seq: Vec<u64>,
    page_dirty: Vec<bool>,
    latest_slot: Vec<Option<u8>>,
    written_unsynced: PbnSet,
    used_blocks: u64,
    /// The cap sharing respects (`OpenOptions::refcount_cap`, at most `REFCOUNT_MAX`).
    cap: u16,
    /// Pages found with a damaged slot and no valid copy.
    damaged_pages: u64,
}

impl Refcounts {
    /// A grow: the data region is now `geo.data_blocks` blocks in `geo.refcount_pages`
    /// pages (never fewer). The new blocks have no references; the new pages were never
    /// written (their slots read as empty), so they are clean.
    pub fn grow(&mut self, geo: Geometry) {
        assert!(geo.data_blocks >= self.geo.data_blocks && geo.refcount_pages >= self.geo.refcount_pages);
        assert!(geo.refcount_pages * RC_ENTRIES_PER_PAGE >= geo.data_blocks);
        self.count.resize(geo.data_blocks as usize, 0);
        let pages = geo.refcount_pages as usize;
        self.page_seq.resize(pages, 0);
        self.page_dirty.resize(pages, false);
        self.latest_slot.resize(pages, None);
        self.geo = geo;
    }

    /// Loads every refcount page from `meta`.
    pub fn load(geo: Geometry, uuid_lo: u64, meta: Dev) -> Result<Self> {
        let n = geo.data_blocks as usize;
        let pages = geo.refcount_pages;
        let mut rc = Refcounts {
            geo,
            uuid_lo,
            meta,
            count: crate::io::hugemem::zeroed(n),
            page_seq: vec![0; pages as usize],
            page_dirty: vec![false; pages as usize],
            latest_slot: vec![None; pages as usize],
            written_unsynced: PbnSet::default(),
            used_blocks: 0,
            cap: REFCOUNT_MAX,
            damaged_pages: 0,
        };
        let mut first = 0u64;
        while first < pages {
            let take = (pages - first).min(LOAD_PAGES_PER_IO);
            let mut buf = vec![0u8; (2 * take) as usize * BLOCK_SIZE];
            rc.meta.read(IoKind::Refcount, &mut buf, (geo.refcount_start + 2 * first) * BLOCK_SIZE_U64)?;
            for i in 0..take {
                let page = first + i;
                #[expect(clippy::indexing_slicing, reason = "`buf` holds two blocks for each of the `take` pages")]
                let both = &buf[(2 * i) as usize * BLOCK_SIZE..(2 * i + 2) as usize * BLOCK_SIZE];
                let pick = pick_slot(both, RC_PAGE_MAGIC, page, uuid_lo);
                if pick.damaged && pick.slot.is_none() {
                    rc.damaged_pages += 1;
                }
                let Some(s) = pick.slot else { continue };
                #[expect(
                    clippy::indexing_slicing,
                    reason = "`pick_slot` picks slot 0 or 1 of the two blocks in `both`"
                )]
                let src = &both[usize::from(s) * BLOCK_SIZE..(usize::from(s) + 1) * BLOCK_SIZE];
                let base = page * RC_ENTRIES_PER_PAGE;
                for j in 0..RC_ENTRIES_PER_PAGE {
                    let pbn = base + j;
                    if pbn >= geo.data_blocks {
                        break;
                    }
                    let off = PAGE_HEADER_BYTES + 2 * j as usize;
                    let c = crate::codec::get_u16(src, off);
                    if c > REFCOUNT_MAX {
                        return Err(Error::corruption(
                            "refcount page",
                            page,
                            format!("counts of at most {REFCOUNT_MAX}"),
                            format!("count {c} for physical block {pbn}"),
                        ));
                    }
                    if let Some(cc) = rc.count.get_mut(pbn as usize) {
                        *cc = c;
                    }
                }
                if let (Some(sq), Some(ls)) =
                    (rc.page_seq.get_mut(page as usize), rc.latest_slot.get_mut(page as usize))
                {
                    *sq = pick.seq;
                    *ls = Some(s);
                }
            }
            first += take;
        }
        rc.used_blocks = rc.count.iter().filter(|&&c| c > 0).count() as u64;
        Ok(rc)
    }

    /// Reference count of `pbn` (0 when out of range).
    pub fn get(&self, pbn: u64) -> u16 {
        self.count.get(pbn as usize).copied().unwrap_or(0)
    }

    /// Blocks with a non-zero count.
    pub fn used_blocks(&self) -> u64 {
        self.used_blocks
    }

    /// The reference count at which sharing stops (`OpenOptions::refcount_cap`).
    pub fn cap(&self) -> u16 {
        self.cap
    }

    /// Sets the cap sharing respects (clamped to 1..=`REFCOUNT_MAX`).
    pub fn set_cap(&mut self, cap: u16) {
        self.cap = cap.clamp(1, REFCOUNT_MAX);
    }

    /// The highest count among the blocks `e` touches (0 for unmapped/zero entries).
    pub fn max_of(&self, e: &MapEntry) -> u16 {
        e.blocks().map(|p| self.get(p)).max().unwrap_or(0)
    }

    /// The lowest count among the blocks `e` touches: zero when any of them is free.
    pub fn min_of(&self, e: &MapEntry) -> u16 {
        e.blocks().map(|p| self.get(p)).min().unwrap_or(0)
    }

    /// All counts (for the allocator and audits).
    pub fn counts(&self) -> &[u16] {
        &self.count
    }

    fn page_of(pbn: u64) -> usize {
        (pbn / RC_ENTRIES_PER_PAGE) as usize
    }

    /// Applied seq of the page holding `pbn`.
    pub fn page_seq(&self, pbn: u64) -> u64 {
        self.page_seq.get(Self::page_of(pbn)).copied().unwrap_or(u64::MAX)
    }

    fn touch(&mut self, pbn: u64, seq: u64) {
        let p = Self::page_of(pbn);
        if let (Some(s), Some(d)) = (self.page_seq.get_mut(p), self.page_dirty.get_mut(p)) {
            *s = (*s).max(seq);
            *d = true;
        }
    }

    /// A mapping names a physical block past the end of the data region.
    fn beyond_data_region(&self, pbn: u64) -> Error {
        Error::corruption(
            "reference to physical block",
            pbn,
            format!("a block below {} (the data region)", self.geo.data_blocks),
            "a block beyond the data region",
        )
    }

    /// Fails, changing nothing, when `inc(e)` would: a block of `e` lies beyond the data
    /// region or is at `REFCOUNT_MAX`.
    pub fn check_inc(&self, e: &MapEntry) -> Result<()> {
        for pbn in e.blocks() {
            match self.count.get(pbn as usize) {
                None => return Err(self.beyond_data_region(pbn)),
                Some(&c) if c >= REFCOUNT_MAX => {
                    return Err(Error::corruption(
                        "reference count of physical block",
                        pbn,
                        format!("room for one more reference (at most {REFCOUNT_MAX})"),
                        format!("count {c}"),
                    ))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Fails, changing nothing, when `dec(e)` would: a block of `e` lies beyond the data
    /// region or has no reference left.
    pub fn check_dec(&self, e: &MapEntry) -> Result<()> {
        for pbn in e.blocks() {
            match self.count.get(pbn as usize) {
                None => return Err(self.beyond_data_region(pbn)),
                Some(0) => {
                    return Err(Error::corruption(
                        "reference count of physical block",
                        pbn,
                        "a reference to drop",
                        "count 0 (the reference count would go below zero)",
                    ))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Adds a reference for `e` (a data mapping) to every block it touches, as journal
    /// entry `seq`.
    pub fn inc(&mut self, e: &MapEntry, seq: u64) -> Result<()> {
        self.check_inc(e)?;
        for pbn in e.blocks() {
            let Some(c) = self.count.get_mut(pbn as usize) else {
                return Err(self.beyond_data_region(pbn));
            };
            if *c == 0 {
                self.used_blocks += 1;
            }
            *c += 1;
            assert!(*c <= REFCOUNT_MAX, "refcount: block {pbn} at {c}");
            self.touch(pbn, seq);
        }
        Ok(())
    }

    /// Drops a reference for `e` from every block it touches as journal entry `seq`;
    /// calls `freed` with each block that became free.
    pub fn dec(&mut self, e: &MapEntry, seq: u64, mut freed: impl FnMut(u64)) -> Result<()> {
        self.check_dec(e)?;
        for pbn in e.blocks() {
            let Some(c) = self.count.get_mut(pbn as usize) else {
                return Err(self.beyond_data_region(pbn));
            };
            *c -= 1;
            if *c == 0 {
                assert!(self.used_blocks > 0, "refcount: freeing block {pbn} with no block counted used");
                self.used_blocks -= 1;
                freed(pbn);
            }
            self.touch(pbn, seq);
        }
        Ok(())
    }

    /// Replays journal entry `seq` (`old` → `new`) onto the counts: each block's change
    /// applies only where the block's page has not seen `seq` yet (idempotent replay). All
    /// decisions are taken before any change, since applying one raises a page's seq.
    pub fn replay(&mut self, new: &MapEntry, old: &MapEntry, seq: u64) -> Result<()> {
        let inc: Vec<u64> = new.blocks().filter(|&p| seq > self.page_seq(p)).collect();
        let dec: Vec<u64> = old.blocks().filter(|&p| seq > self.page_seq(p)).collect();
        for pbn in inc {
            self.check_inc(&MapEntry::raw(pbn, 0))?;
            self.inc(&MapEntry::raw(pbn, 0), seq)?;
        }
        for pbn in dec {
            self.dec(&MapEntry::raw(pbn, 0), seq, |_| {})?;
        }
        Ok(())
    }

    /// Overwrites the count of `pbn` (repair only).
    pub fn set_for_repair(&mut self, pbn: u64, count: u16, seq: u64) {
        if let Some(c) = self.count.get_mut(pbn as usize) {
            if *c > 0 {
                self.used_blocks -= 1;
            }
            *c = count;
            if count > 0 {
                self.used_blocks += 1;
            }
        }
        self.touch(pbn, seq);
    }

    fn encode_page(&self, page: u64) -> Vec<u8> {
        let mut buf = vec![0u8; BLOCK_SIZE];
        let base = page * RC_ENTRIES_PER_PAGE;
        for j in 0..RC_ENTRIES_PER_PAGE {
            let pbn = base + j;
            if pbn >= self.geo.data_blocks {
                break;
            }
            let off = PAGE_HEADER_BYTES + 2 * j as usize;
            crate::codec::put_u16(&mut buf, off, self.get(pbn));
        }
        let seq = self.page_seq.get(page as usize).copied().unwrap_or(0);
        seal_page(&mut buf, RC_PAGE_MAGIC, page, seq, self.uuid_lo);
        buf
    }

    /// Writes every dirty page whose applied seq is durable; returns pages written.
    pub fn write_dirty(&mut self, durable_seq: u64) -> Result<u64> {
        let mut written = 0;
        for page in 0..self.geo.refcount_pages {
            let p = page as usize;
            let dirty = self.page_dirty.get(p).copied().unwrap_or(false);
            if !dirty || self.page_seq.get(p).copied().unwrap_or(u64::MAX) > durable_seq {
                continue;
            }
            if self.written_unsynced.contains(&page) {
                self.meta.sync()?;
                self.written_unsynced.clear();
            }
            let slot = self.latest_slot.get(p).copied().flatten().map_or(0, |s| 1 - s);
            let buf = self.encode_page(page);
            self.meta.write(
                IoKind::Refcount,
                &buf,
                (self.geo.refcount_start + 2 * page + u64::from(slot)) * BLOCK_SIZE_U64,
            )?;
            if let (Some(ls), Some(d)) = (self.latest_slot.get_mut(p), self.page_dirty.get_mut(p)) {
                *ls = Some(slot);
                *d = false;
            }
            self.written_unsynced.insert(page);
            written += 1;
        }
        Ok(written)
    }

    /// Called after a metadata sync.
    pub fn note_synced(&mut self) {
        self.written_unsynced.clear();
    }

    /// Largest applied seq over all pages.
    pub fn max_seq(&self) -> u64 {
        self.page_seq.iter().copied().max().unwrap_or(0)
    }

    /// Pages found with a damaged slot and no valid copy at load.
    pub fn damaged_pages(&self) -> u64 {
        self.damaged_pages
    }

    /// Pages with changes not written yet.
    #[cfg(feature = "verify")]
    pub fn dirty_pages(&self) -> usize {
        self.page_dirty.iter().filter(|&&d| d).count()
    }

    /// Recounts every block (the `verify` audit): counts within the cap and the running
    /// total equal to the recount.
    #[cfg(any(test, feature = "verify"))]
    pub fn audit(&self) -> std::result::Result<(), String> {
        let pages = self.geo.refcount_pages as usize;
        if self.count.len() as u64 != self.geo.data_blocks
            || self.page_seq.len() != pages
            || self.page_dirty.len() != pages
            || self.latest_slot.len() != pages
        {
            return Err("refcount tables do not match the geometry".into());
        }
        let mut used = 0u64;
        for (pbn, &c) in self.count.iter().enumerate() {
            if c > REFCOUNT_MAX {
                return Err(format!("physical block {pbn} has count {c}"));
            }
            used += u64::from(c > 0);
        }
        if used != self.used_blocks {
            return Err(format!("refcount total {} used, recounted {used}", self.used_blocks));
        }
        Ok(())
    }
}
