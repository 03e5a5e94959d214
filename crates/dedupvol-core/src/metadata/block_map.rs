//! The block map: logical block → physical location, in checksummed two-slot pages with a
//! bounded in-memory cache.
//!
//! Invariants:
//! - A page's `seq` is the journal sequence of the newest entry applied to it, and every
//!   journal entry with a smaller sequence that touches the page is applied too (entries
//!   are applied in sequence order under the volume lock). Replay applies an entry to a
//!   page only when `entry.seq > page.seq`, which makes replay idempotent.
//! - Write-ahead rule: a dirty page is written only when `page.seq <= durable_seq`.
//! - Two slots per page: a write goes to the slot not holding the newest durable copy, and
//!   a page is never written twice between metadata syncs, so a torn write leaves the
//!   previous copy intact; the journal still holds every entry newer than that copy.
//! - The cache holds at most `capacity_pages` pages except transiently, when every page
//!   is dirty with entries not yet durable (bounded by the journal's pending-entry bound),
//!   or by up to `READAHEAD_PAGES` pages read ahead until the next eviction.
//! - A page read ahead is only inserted where the cache holds no copy (a cached copy is
//!   never older than the device's), so read-ahead never replaces newer state.
//! - A clean cached page is either empty and never written (seq 0) or a sealed copy of
//!   the slot it came from or went to, so evicting it loses nothing.
//!
//! `set` asserts the sequence order and `write_page` the write-ahead rule (both O(1));
//! the `verify` audit decodes every cached page and checks the clean ones' seals.

use crate::codec::{get_u32, get_u64, put_u32, put_u64};
use crate::config::{BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::error::{Error, Result};
use crate::io::{Dev, IoKind};
use crate::metadata::layout::{Geometry, BM_ENTRIES_PER_PAGE};
use crate::read::cache::{PbnMap, PbnSet};

/// Pages read with one request on a cache miss at most (see `load_with_readahead`).
const READAHEAD_PAGES: u64 = 16;

/// Page header bytes (magic, crc, page index, applied seq, uuid low half).
pub const PAGE_HEADER_BYTES: usize = 32;
/// Bytes per encoded map entry.
pub const MAP_ENTRY_BYTES: usize = 16;
/// Magic of a block map page ("DVBM").
pub const BM_PAGE_MAGIC: u32 = u32::from_le_bytes(*b"DVBM");
/// Offset of a page's checksum field.
pub const PAGE_CRC_OFFSET: usize = 4;

const _: () = assert!(PAGE_HEADER_BYTES + BM_ENTRIES_PER_PAGE as usize * MAP_ENTRY_BYTES <= BLOCK_SIZE);

/// Entry state: never written or discarded (reads as zeros).
pub const STATE_UNMAPPED: u8 = 0;
/// Entry state: written with zeros (reads as zeros, no physical block).
pub const STATE_ZERO: u8 = 1;
/// Entry state: stored raw in physical block `pbn`.
pub const STATE_RAW: u8 = 2;
/// Entry state: a compressed fragment (`Frag`) starting in physical block `pbn`.
pub const STATE_FRAGMENT: u8 = 3;
/// Logical blocks one compressed unit (an extent) holds at most (64 KiB).
pub const UNIT_BLOCKS_MAX: u8 = 16;

/// Bit of a fragment's codec byte marking it settled: compressed again by the
/// recompressor at the volume's rest level (format versions 4 and 5), so no later pass
/// takes it. The low bits are the codec (`Compression::code`); the mark changes nothing
/// about how the fragment decodes.
pub const FRAG_SETTLED: u8 = 0x80;

/// Where a compressed fragment lies and what it decodes to. A fragment is a byte range
/// that starts `off` bytes into its first physical block and may run on into the
/// following blocks; it decodes to `unit_blocks()` logical blocks, of which the entry's
/// block is number `sub()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Frag {
    /// Codec of the fragment (`Compression::code`), with `FRAG_SETTLED` when settled.
    pub codec: u8,
    /// Low nibble: blocks in the unit minus one; high nibble: this block's index in it.
    pub unit: u8,
    /// Byte offset of the fragment in its first physical block (below 4096).
    pub off: u16,
    /// Compressed length in bytes (at least 1).
    pub len: u16,
}

impl Frag {
    /// A fragment of `len` bytes at `off`, block `sub` of a unit of `blocks`.
    pub fn new(codec: u8, off: u16, len: u16, blocks: u8, sub: u8) -> Self {
        debug_assert!((1..=UNIT_BLOCKS_MAX).contains(&blocks) && sub < blocks && usize::from(off) < BLOCK_SIZE);
        Frag { codec, unit: (blocks - 1) | (sub << 4), off, len }
    }
    /// The codec the fragment decodes with (None: not a known codec).
    pub fn compression(&self) -> Option<crate::config::Compression> {
        crate::config::Compression::from_code(self.codec & !FRAG_SETTLED)
    }
    /// Compressed again at the volume's rest level (`FRAG_SETTLED`).
    pub fn settled(&self) -> bool {
        self.codec & FRAG_SETTLED != 0
    }
    /// The same fragment marked settled.
    pub fn marked(&self) -> Self {
        Frag { codec: self.codec | FRAG_SETTLED, ..*self }
    }
    /// The same fragment without the settled mark: mappings of one fragment may differ in
    /// the mark alone, so this is what says whether two name the same fragment.
    pub fn unmarked(&self) -> Self {
        Frag { codec: self.codec & !FRAG_SETTLED, ..*self }
    }
    /// Logical blocks the unit decodes to.
    pub fn unit_blocks(&self) -> usize {
        usize::from(self.unit & 0x0f) + 1
    }
    /// This entry's block within the unit.
    pub fn sub(&self) -> usize {
        usize::from(self.unit >> 4)
    }
    /// Physical blocks the fragment touches, counted from its first.
    pub fn span(&self) -> u64 {
        (u64::from(self.off) + u64::from(self.len)).div_ceil(BLOCK_SIZE_U64)
    }
    /// The same fragment as block `sub` of its unit.
    pub fn with_sub(&self, sub: usize) -> Self {
        Frag { unit: (self.unit & 0x0f) | ((sub as u8 & 0x0f) << 4), ..*self }
    }
    /// A key naming this block of the fragment among those starting in the same physical
    /// block: the offset (12 bits) and the block within the unit (4 bits).
    pub fn key(&self) -> u16 {
        (self.off & 0x0fff) | (u16::from(self.unit >> 4) << 12)
    }
}

/// One logical block's mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MapEntry {
    /// Physical data block (relative to the data region): the raw block, or the first
    /// block a fragment touches; 0 for unmapped/zero.
    pub pbn: u64,
    /// One of the `STATE_*` values.
    pub state: u8,
    /// crc32c of the 4 KiB logical content (0 for unmapped/zero).
    pub crc: u32,
    /// The fragment (all zero unless `state` is `STATE_FRAGMENT`).
    pub frag: Frag,
}

impl MapEntry {
    /// The unmapped entry.
    pub const UNMAPPED: MapEntry = MapEntry { pbn: 0, state: STATE_UNMAPPED, crc: 0, frag: Frag::ZERO };
    /// The written-zeros entry.
    pub const ZERO: MapEntry = MapEntry { pbn: 0, state: STATE_ZERO, crc: 0, frag: Frag::ZERO };

    /// A raw-block mapping.
    pub fn raw(pbn: u64, crc: u32) -> Self {
        MapEntry { pbn, state: STATE_RAW, crc, frag: Frag::ZERO }
    }
    /// A fragment mapping.
    pub fn fragment(pbn: u64, frag: Frag, crc: u32) -> Self {
        MapEntry { pbn, state: STATE_FRAGMENT, crc, frag }
    }
    /// True when the entry references a physical block.
    pub fn is_data(&self) -> bool {
        self.state == STATE_RAW || self.state == STATE_FRAGMENT
    }
    /// The fragment, if this is one.
    pub fn fragment_of(&self) -> Option<Frag> {
        (self.state == STATE_FRAGMENT).then_some(self.frag)
    }
    /// Physical blocks the entry references: `pbn..pbn + span` (0 for unmapped/zero).
    pub fn span(&self) -> u64 {
        match self.state {
            STATE_RAW => 1,
            STATE_FRAGMENT => self.frag.span(),
            _ => 0,
        }
    }
    /// The physical blocks the entry references.
    pub fn blocks(&self) -> std::ops::Range<u64> {
        self.pbn..self.pbn + self.span()
    }
    /// Encodes into 16 bytes: pbn (5 bytes LE), state (1), codec (1), unit (1), offset
    /// (u16), length (u16), crc (4).
    pub fn encode(&self, out: &mut [u8]) {
        let p = self.pbn.to_le_bytes();
        let c = self.crc.to_le_bytes();
        let f = self.frag;
        let o = f.off.to_le_bytes();
        let l = f.len.to_le_bytes();
        let b: [u8; MAP_ENTRY_BYTES] =
            [p[0], p[1], p[2], p[3], p[4], self.state, f.codec, f.unit, o[0], o[1], l[0], l[1], c[0], c[1], c[2], c[3]];
        if let Some(o) = out.get_mut(..MAP_ENTRY_BYTES) {
            o.copy_from_slice(&b);
        }
    }
    /// Decodes one encoded entry. `Err` says what was found instead of an entry (an unknown
    /// state, a fragment that cannot be one, or a slice that is not one entry long); the
    /// caller knows which structure and address it came from and reports the corruption.
    pub fn decode(b: &[u8]) -> Result<MapEntry, String> {
        let (Some(pbn), Some(&state), true) = (b.get(..5), b.get(5), b.len() == MAP_ENTRY_BYTES) else {
            return Err(format!("{} bytes where a {MAP_ENTRY_BYTES}-byte entry belongs", b.len()));
        };
        let mut p = [0u8; 8];
        if let Some(dst) = p.get_mut(..5) {
            dst.copy_from_slice(pbn);
        }
        let frag = Frag {
            codec: b.get(6).copied().unwrap_or(0),
            unit: b.get(7).copied().unwrap_or(0),
            off: crate::codec::get_u16(b, 8),
            len: crate::codec::get_u16(b, 10),
        };
        let e = MapEntry { pbn: u64::from_le_bytes(p), state, crc: get_u32(b, 12), frag };
        match state {
            STATE_UNMAPPED | STATE_ZERO | STATE_RAW if frag == Frag::ZERO => Ok(e),
            STATE_FRAGMENT => {
                if usize::from(frag.off) >= BLOCK_SIZE || frag.len == 0 || frag.sub() >= frag.unit_blocks() {
                    Err(format!(
                        "fragment of {} bytes at offset {}, block {} of {}",
                        frag.len,
                        frag.off,
                        frag.sub(),
                        frag.unit_blocks()
                    ))
                } else if frag.compression().is_none_or(|c| c == crate::config::Compression::None) {
                    Err(format!("fragment codec {}", frag.codec))
                } else {
                    Ok(e)
                }
            }
            STATE_UNMAPPED | STATE_ZERO | STATE_RAW => Err(format!("entry state {state} with fragment bytes set")),
            _ => Err(format!("unknown entry state {state}")),
        }
    }
}

impl Frag {
    /// No fragment.
    pub const ZERO: Frag = Frag { codec: 0, unit: 0, off: 0, len: 0 };
}

/// Which slot of a two-slot page holds the newest valid copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotPick {
    /// The chosen slot (None: neither slot holds a valid copy; the page is empty).
    pub slot: Option<u8>,
    /// The chosen copy's applied seq (0 when empty).
    pub seq: u64,
    /// A slot carried this volume's identity but failed its checksum (torn or corrupt).
    pub damaged: bool,
}

/// Picks the newest valid copy of a two-slot page. `both` holds slot 0 then slot 1.
pub fn pick_slot(both: &[u8], magic: u32, page_index: u64, uuid_lo: u64) -> SlotPick {
    let mut pick = SlotPick { slot: None, seq: 0, damaged: false };
    for s in 0..2u8 {
        let Some(b) = both.get(usize::from(s) * BLOCK_SIZE..(usize::from(s) + 1) * BLOCK_SIZE) else {
            continue;
        };
        let ours = get_u32(b, 0) == magic && get_u64(b, 8) == page_index && get_u64(b, 24) == uuid_lo;
        if !ours {
            continue;
        }
        if !crate::codec::crc_ok(b, PAGE_CRC_OFFSET) {
            pick.damaged = true;
            continue;
        }
        let seq = get_u64(b, 16);
        if pick.slot.is_none() || seq > pick.seq {
            pick.slot = Some(s);
            pick.seq = seq;
        }
    }
    pick
}

/// Fills a page header and checksum.
pub fn seal_page(buf: &mut [u8], magic: u32, page_index: u64, seq: u64, uuid_lo: u64) {
    put_u32(buf, 0, magic);
    put_u64(buf, 8, page_index);
    put_u64(buf, 16, seq);
    put_u64(buf, 24, uuid_lo);
    crate::codec::seal_crc(buf, PAGE_CRC_OFFSET);
}

/// A block map page whose checksum holds but whose entry for `lba` does not decode.
fn bad_entry(page: u64, lba: u64, found: String) -> Error {
    Error::corruption("block map page", page, "a known entry state", format!("logical block {lba}: {found}"))
}

struct CachedPage {
    buf: Box<[u8]>,
    seq: u64,
    dirty: bool,
    latest_slot: Option<u8>,
    used: u64,
}

/// One step of a scan through the map (`BlockMap::scan`).
#[derive(Debug)]
pub enum Scanned {
    /// The entry.
    Entry(MapEntry),
    /// The entry does not decode: a problem of that entry alone; the scan goes on with the
    /// next one.
    Undecodable(Error),
    /// The device could not read the entry's page: the scan goes on at `next`, the first
    /// logical block past that page.
    Unreadable {
        /// Where the scan goes on.
        next: u64,
        /// The device's error.
        error: Error,
    },
}

/// The paged block map with its bounded cache.
pub struct BlockMap {
    geo: Geometry,
    uuid_lo: u64,
    meta: Dev,
    pages: PbnMap<CachedPage>,
    capacity_pages: usize,
    tick: u64,
    written_unsynced: PbnSet,
    /// Cache hits since open.
    hits: u64,
    /// Cache misses since open.
    misses: u64,
    /// Pages found with a damaged slot and no valid copy (treated as empty; see format.md).
    damaged_pages: u64,
    /// Pages a read-ahead covered when it failed (a page the device cannot read lies
    /// among them): later read-aheads stop short of them, and they are read one by one.
    /// Without it, every uncached page before such a page asked for it again in its own
    /// read-ahead.
    no_readahead: std::ops::Range<u64>,
}

impl BlockMap {
    /// An empty cache over the block map region of `meta`.
    pub fn new(geo: Geometry, uuid_lo: u64, meta: Dev, cache_bytes: u64) -> Self {
        let capacity_pages = (cache_bytes / BLOCK_SIZE_U64).max(16) as usize;
        BlockMap {
            geo,
            uuid_lo,
            meta,
            pages: PbnMap::default(),
            capacity_pages,
            tick: 0,
            written_unsynced: PbnSet::default(),
            hits: 0,
            misses: 0,
            damaged_pages: 0,
            no_readahead: 0..0,
        }
    }

    fn slot_offset(&self, page: u64, slot: u8) -> u64 {
        (self.geo.block_map_start + 2 * page + u64::from(slot)) * BLOCK_SIZE_U64
    }

    fn locate(&self, lba: u64) -> Result<(u64, usize)> {
        if lba >= self.geo.logical_blocks {
            // Callers check ranges (requests) or the journal scan does (replay).
            return Err(Error::internal(
                "block map asked for a logical block beyond the volume",
                format!("logical block {lba}, volume of {}", self.geo.logical_blocks),
            ));
        }
        Ok((lba / BM_ENTRIES_PER_PAGE, PAGE_HEADER_BYTES + (lba % BM_ENTRIES_PER_PAGE) as usize * MAP_ENTRY_BYTES))
    }

    /// Reads a page from disk (both slots) without caching it.
    pub fn read_page(&mut self, page: u64) -> Result<(Box<[u8]>, SlotPick)> {
        let mut both = vec![0u8; 2 * BLOCK_SIZE];
        self.meta.read(IoKind::BlockMap, &mut both, self.slot_offset(page, 0))?;
        self.parse_page(page, &both)
    }

    /// The newest valid copy of `page` from its two slots as read (`both`).
    fn parse_page(&mut self, page: u64, both: &[u8]) -> Result<(Box<[u8]>, SlotPick)> {
        let pick = pick_slot(both, BM_PAGE_MAGIC, page, self.uuid_lo);
        if pick.damaged && pick.slot.is_none() {
            self.damaged_pages += 1;
        }
        let buf: Box<[u8]> = match pick.slot {
            // `pick_slot` only picks a slot it found whole in `both`.
            Some(s) => match both.get(usize::from(s) * BLOCK_SIZE..(usize::from(s) + 1) * BLOCK_SIZE) {
                Some(b) => b.into(),
                None => {
                    return Err(Error::internal(
                        "block map slot picked outside the bytes read",
                        format!("page {page} slot {s}, {} bytes read", both.len()),
                    ))
                }
            },
            None => vec![0u8; BLOCK_SIZE].into_boxed_slice(),
        };
        Ok((buf, pick))
    }

    /// Reads `page` and the uncached pages right after it (up to `READAHEAD_PAGES`) with
    /// one device request, and caches them. Why: a sequential writer misses every page of a
    /// fresh region in turn, each miss a device round trip under the state lock; one larger
    /// read costs about the same as one page. If the larger read fails, `page` alone is
    /// read, so a bad neighbour never fails a request, and the pages it covered are read
    /// one by one from then on (`no_readahead`); unless it timed out: a device that
    /// gave no answer in time is not asked again (a second timeout under the state lock).
    fn load_with_readahead(&mut self, page: u64, tick: u64) -> Result<()> {
        let mut n = 1u64;
        while n < READAHEAD_PAGES
            && page + n < self.geo.block_map_pages
            && !self.no_readahead.contains(&(page + n))
            && !self.pages.contains_key(&(page + n))
        {
            n += 1;
        }
        let mut all = vec![0u8; 2 * BLOCK_SIZE * n as usize];
        let ahead =
            if n == 1 { None } else { Some(self.meta.read(IoKind::BlockMap, &mut all, self.slot_offset(page, 0))) };
        match ahead {
            Some(Ok(())) => {}
            Some(Err(e)) if e.is_timeout() => return Err(e),
            None | Some(Err(_)) => {
                if n > 1 {
                    self.no_readahead = page..page + n;
                }
                let loaded = self.read_page(page)?;
                self.insert_loaded(page, loaded, tick);
                return Ok(());
            }
        }
        for (k, both) in all.chunks_exact(2 * BLOCK_SIZE).enumerate() {
            let p = page + k as u64;
            let loaded = self.parse_page(p, both)?;
            self.insert_loaded(p, loaded, tick);
        }
        Ok(())
    }

    /// Caches a page just read from the device (clean).
    fn insert_loaded(&mut self, page: u64, (buf, pick): (Box<[u8]>, SlotPick), tick: u64) {
        self.pages.insert(page, CachedPage { buf, seq: pick.seq, dirty: false, latest_slot: pick.slot, used: tick });
    }

    fn page_mut(&mut self, page: u64) -> Result<&mut CachedPage> {
        self.tick += 1;
        let tick = self.tick;
        if self.pages.contains_key(&page) {
            self.hits += 1;
        } else {
            self.misses += 1;
            self.load_with_readahead(page, tick)?;
        }
        let p = self
            .pages
            .get_mut(&page)
            .ok_or_else(|| Error::internal("block map cache lost a page it just loaded", format!("page {page}")))?;
        p.used = tick;
        Ok(p)
    }

    /// A grow: the block map now covers `logical_blocks` in `pages` pages (never fewer).
    pub fn set_logical_blocks(&mut self, logical_blocks: u64, pages: u64) {
        assert!(pages >= self.geo.block_map_pages, "block map pages never decrease");
        assert!(pages * BM_ENTRIES_PER_PAGE >= logical_blocks, "block map pages must cover the logical size");
        self.geo.logical_blocks = logical_blocks;
        self.geo.block_map_pages = pages;
    }

    /// The first logical block after the page holding `lba` (at most the logical size,
    /// always past `lba`).
    fn page_end(&self, lba: u64) -> u64 {
        ((lba / BM_ENTRIES_PER_PAGE + 1) * BM_ENTRIES_PER_PAGE).min(self.geo.logical_blocks).max(lba + 1)
    }

    /// The mapping of `lba` as a scan moving forward through the map takes it (`check`,
    /// scrub, the cleaner and recompression passes). A page the device could not read is
    /// reported with the first block past it, where the scan goes on: asking the device
    /// again for each of its entries, under the state lock, would hold the lock for one
    /// device timeout per entry when the device does not answer (a RADOS volume with every
    /// OSD down).
    pub fn scan(&mut self, lba: u64) -> Scanned {
        match self.get(lba) {
            Ok(e) => Scanned::Entry(e),
            Err(error @ Error::Io { .. }) => Scanned::Unreadable { next: self.page_end(lba), error },
            Err(error) => Scanned::Undecodable(error),
        }
    }

    /// The mapping of `lba`.
    pub fn get(&mut self, lba: u64) -> Result<MapEntry> {
        let (page, off) = self.locate(lba)?;
        let p = self.page_mut(page)?;
        #[expect(clippy::indexing_slicing, reason = "`locate` keeps the entry inside the page's BLOCK_SIZE buffer")]
        let bytes = &p.buf[off..off + MAP_ENTRY_BYTES];
        MapEntry::decode(bytes).map_err(|found| bad_entry(page, lba, found))
    }

    /// The applied seq of the page holding `lba`.
    pub fn page_seq(&mut self, lba: u64) -> Result<u64> {
        let (page, _) = self.locate(lba)?;
        Ok(self.page_mut(page)?.seq)
    }

    /// Sets the mapping of `lba` as journal entry `seq`; returns the previous mapping.
    pub fn set(&mut self, lba: u64, e: MapEntry, seq: u64) -> Result<MapEntry> {
        let (page, off) = self.locate(lba)?;
        let p = self.page_mut(page)?;
        assert!(seq >= p.seq, "journal entries must be applied in order (page {page}: {seq} < {})", p.seq);
        #[expect(clippy::indexing_slicing, reason = "`locate` keeps the entry inside the page's BLOCK_SIZE buffer")]
        let slot = &mut p.buf[off..off + MAP_ENTRY_BYTES];
        let old = MapEntry::decode(slot).map_err(|found| bad_entry(page, lba, found))?;
        e.encode(slot);
        p.seq = seq;
        p.dirty = true;
        Ok(old)
    }

    fn write_page(&mut self, page: u64, durable_seq: u64) -> Result<()> {
        if self.written_unsynced.contains(&page) {
            // Both slots would hold unsynced copies: make the previous one durable first.
            self.meta.sync()?;
            self.written_unsynced.clear();
        }
        let uuid_lo = self.uuid_lo;
        let (slot, offset, buf) = {
            let p = self
                .pages
                .get_mut(&page)
                .ok_or_else(|| Error::internal("write of a block map page not in the cache", format!("page {page}")))?;
            let slot = p.latest_slot.map_or(0, |s| 1 - s);
            let seq = p.seq;
            assert!(seq <= durable_seq, "block map: page {page} with entry {seq} written before it is durable");
            seal_page(&mut p.buf, BM_PAGE_MAGIC, page, seq, uuid_lo);
            (slot, 0, p.buf.clone())
        };
        let _ = offset;
        self.meta.write(IoKind::BlockMap, &buf, self.slot_offset(page, slot))?;
        if let Some(p) = self.pages.get_mut(&page) {
            p.latest_slot = Some(slot);
            p.dirty = false;
        }
        self.written_unsynced.insert(page);
        Ok(())
    }

    /// Evicts least recently used pages while over capacity; writes dirty victims whose
    /// entries are durable (`seq <= durable_seq`). Pages with undurable entries stay.
    pub fn evict(&mut self, durable_seq: u64) -> Result<()> {
        if self.pages.len() <= self.capacity_pages {
            return Ok(());
        }
        let target = self.capacity_pages - self.capacity_pages / 8;
        let mut victims: Vec<(u64, u64)> =
            self.pages.iter().filter(|(_, p)| !p.dirty || p.seq <= durable_seq).map(|(&i, p)| (p.used, i)).collect();
        victims.sort_unstable();
        let excess = self.pages.len() - target;
        for &(_, page) in victims.iter().take(excess) {
            if self.pages.get(&page).is_some_and(|p| p.dirty) {
                self.write_page(page, durable_seq)?;
            }
            self.pages.remove(&page);
        }
        Ok(())
    }

    /// Drops every clean page from the cache (tests: the next lookups read the device).
    #[cfg(test)]
    pub(crate) fn drop_clean_pages(&mut self) {
        self.pages.retain(|_, p| p.dirty);
    }

    /// Writes every dirty page whose entries are durable; returns how many were written.
    /// The caller syncs the metadata device before reclaiming journal space.
    pub fn write_dirty(&mut self, durable_seq: u64) -> Result<u64> {
        let mut dirty: Vec<u64> =
            self.pages.iter().filter(|(_, p)| p.dirty && p.seq <= durable_seq).map(|(&i, _)| i).collect();
        dirty.sort_unstable();
        for &page in &dirty {
            self.write_page(page, durable_seq)?;
        }
        Ok(dirty.len() as u64)
    }

    /// Called after a metadata sync: every written copy is now durable.
    pub fn note_synced(&mut self) {
        self.written_unsynced.clear();
    }

    /// Pages in the cache.
    pub fn cached_pages(&self) -> usize {
        self.pages.len()
    }

    /// Cache hits since open.
    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Cache misses since open.
    pub fn misses(&self) -> u64 {
        self.misses
    }

    /// Pages found with a damaged slot and no valid copy since open.
    pub fn damaged_pages(&self) -> u64 {
        self.damaged_pages
    }

    /// Checks every cached page (the `verify` audit): it lies inside the block map, its
    /// entries decode, and a clean page that came from or went to a slot is that slot's
    /// sealed copy (right page, seq and checksum), so evicting it loses nothing.
    #[cfg(any(test, feature = "verify"))]
    pub fn audit(&self) -> std::result::Result<(), String> {
        for (&page, p) in &self.pages {
            if page >= self.geo.block_map_pages {
                return Err(format!("block map cache holds page {page} beyond {}", self.geo.block_map_pages));
            }
            if p.buf.len() != BLOCK_SIZE {
                return Err(format!("block map page {page} is cached with {} bytes", p.buf.len()));
            }
            let first = page * BM_ENTRIES_PER_PAGE;
            let last = (first + BM_ENTRIES_PER_PAGE).min(self.geo.logical_blocks);
            for (k, e) in p.buf.get(PAGE_HEADER_BYTES..).unwrap_or_default().chunks_exact(MAP_ENTRY_BYTES).enumerate() {
                let lba = first + k as u64;
                match MapEntry::decode(e) {
                    Ok(m) if lba >= last && m != MapEntry::UNMAPPED => {
                        return Err(format!("block map page {page} maps logical block {lba} beyond the volume"));
                    }
                    Ok(_) => {}
                    Err(err) => return Err(format!("block map page {page}, logical block {lba}: {err}")),
                }
            }
            if p.dirty || p.latest_slot.is_none() {
                if !p.dirty && p.seq != 0 {
                    return Err(format!("clean block map page {page} with no copy on the device has seq {}", p.seq));
                }
                continue;
            }
            let sealed = get_u32(&p.buf, 0) == BM_PAGE_MAGIC
                && get_u64(&p.buf, 8) == page
                && get_u64(&p.buf, 16) == p.seq
                && get_u64(&p.buf, 24) == self.uuid_lo
                && crate::codec::crc_ok(&p.buf, PAGE_CRC_OFFSET);
            if !sealed {
                return Err(format!("clean block map page {page} (seq {}) is not a sealed copy", p.seq));
            }
        }
        Ok(())
    }

    /// Cached pages with changes not written yet.
    #[cfg(feature = "verify")]
    pub fn dirty_pages(&self) -> usize {
        self.pages.values().filter(|p| p.dirty).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_bad_states_are_corruption() {
        for e in [
            MapEntry::UNMAPPED,
            MapEntry::ZERO,
            MapEntry::raw((1 << 40) - 1, 0xdead_beef),
            MapEntry::fragment(7, Frag::new(2, 4095, 65535, 16, 15), 1),
            MapEntry::fragment(9, Frag::new(1, 0, 1, 1, 0), 2),
            MapEntry::fragment(11, Frag::new(2 | FRAG_SETTLED, 100, 900, 4, 3), 3),
        ] {
            let mut b = [0u8; MAP_ENTRY_BYTES];
            e.encode(&mut b);
            assert_eq!(MapEntry::decode(&b).expect("decode"), e);
        }
        let mut b = [0u8; MAP_ENTRY_BYTES];
        b[5] = 4;
        assert_eq!(MapEntry::decode(&b), Err("unknown entry state 4".into()));
        assert!(MapEntry::decode(&b[..9]).is_err(), "a short slice is not an unmapped entry");
        // A fragment of no bytes, of an unknown codec, or naming a block past its unit.
        b[5] = STATE_FRAGMENT;
        assert!(MapEntry::decode(&b).is_err());
        b[6] = 2;
        b[10] = 1;
        assert!(MapEntry::decode(&b).is_ok());
        b[6] = 9;
        assert!(MapEntry::decode(&b).is_err());
        // The settled mark on a known codec decodes; on none or an unknown one it does not.
        b[6] = 2 | FRAG_SETTLED;
        let settled = MapEntry::decode(&b).expect("settled zstd");
        assert!(settled.frag.settled() && settled.frag.compression() == Some(crate::config::Compression::Zstd));
        for c in [FRAG_SETTLED, 9 | FRAG_SETTLED] {
            b[6] = c;
            assert!(MapEntry::decode(&b).is_err(), "codec byte {c:#x}");
        }
        b[6] = 2;
        b[7] = 0x21;
        assert!(MapEntry::decode(&b).is_err(), "block 2 of a unit of 2");
        // A raw entry with fragment bytes set is not one.
        let mut r = [0u8; MAP_ENTRY_BYTES];
        MapEntry::raw(5, 9).encode(&mut r);
        r[8] = 1;
        assert!(MapEntry::decode(&r).is_err());
    }

    #[test]
    fn newest_valid_slot_wins_and_torn_slot_is_skipped() {
        let mut both = vec![0u8; 2 * BLOCK_SIZE];
        seal_page(&mut both[..BLOCK_SIZE], BM_PAGE_MAGIC, 5, 10, 42);
        seal_page(&mut both[BLOCK_SIZE..], BM_PAGE_MAGIC, 5, 11, 42);
        assert_eq!(pick_slot(&both, BM_PAGE_MAGIC, 5, 42).slot, Some(1));
        both[BLOCK_SIZE + 600] ^= 1;
        let p = pick_slot(&both, BM_PAGE_MAGIC, 5, 42);
        assert_eq!((p.slot, p.seq, p.damaged), (Some(0), 10, true));
        assert_eq!(pick_slot(&both, BM_PAGE_MAGIC, 6, 42).slot, None, "wrong page index");
        assert_eq!(pick_slot(&both, BM_PAGE_MAGIC, 5, 43).slot, None, "foreign volume");
    }
}
