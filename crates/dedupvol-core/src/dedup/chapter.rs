//! Chapters: the on-disk ring of fingerprint records that is the dedup window
//! (docs/format.md, "Chapter ring").
//!
//! The ring is the index area of the metadata device: `chapters` slots of
//! `pages_per_chapter` record pages each. Virtual chapter `vcn` (a number that only grows)
//! lives in slot `vcn % chapters`; the newest `chapters` virtual chapters, the open one
//! included, are the window, so opening a chapter drops the oldest. A record page holds up
//! to `RECORDS_PER_PAGE` records in the order they were made, so blocks written together
//! share a page.
//!
//! A ring made with name pages (`RingLayout::has_names`) also keeps, after every slot's record
//! pages, in an area of its own, the chapter's *names*: 10 bytes per record, the
//! fingerprint bits the volume index is built from (`Name`), written once when the chapter
//! closes. Why: rebuilding the volume index needs only those bits, so a rebuild that reads
//! the names instead of the 48-byte records reads a fifth of the bytes and covers the
//! window about five times faster than the device reads.
//!
//! Invariants:
//! - Every page is self-describing (volume, virtual chapter, epoch, page number, record
//!   count) and sealed by a crc32c over the whole 4 KiB: a torn, stale or foreign page is
//!   recognised on its own and skipped (`decode_page` refuses it).
//! - All records of a chapter share one epoch (the session that made them): a new
//!   session, or a reuse stamp that wraps, opens a new chapter.
//! - Records are advisory: nothing read from a page is trusted for sharing without the
//!   checks of `Deduper` (block in use; current stamp or byte verification).
//! - Names are advisory too, and count only when complete: a chapter's name pages are used
//!   when each of them checks, all are of one write (the same epoch and record total,
//!   stored in each page) and together they hold exactly that total; otherwise its record
//!   pages are read instead. Name `r` of a
//!   chapter is record `r` (page `r / RECORDS_PER_PAGE`), as records fill pages in order.

use crate::codec::{crc_ok, get_u16, get_u32, get_u64, put_u16, put_u32, put_u64, seal_crc};
use crate::config::{IndexMode, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::dedup::index::Location;

/// Magic of a record page ("DVCP").
pub const CHAPTER_MAGIC: u32 = u32::from_le_bytes(*b"DVCP");
/// Bytes of a record page's header.
pub const CHAPTER_PAGE_HEADER_BYTES: usize = 32;
/// Bytes of one record: the 32-byte fingerprint and the 16-byte location.
pub const RECORD_BYTES: usize = 32 + crate::dedup::index::LOCATION_BYTES;
/// Records per 4 KiB page.
pub const RECORDS_PER_PAGE: usize = 84;
/// Offset of the page checksum.
pub const CHAPTER_CRC_OFFSET: usize = 4;
/// Largest chapter, in pages (the in-memory index keeps the page number in 8 bits).
pub const CHAPTER_PAGES_MAX: u64 = 256;
/// Most chapters in the ring (the in-memory index keeps chapter numbers in 16 bits and
/// sweeps expired ones long before they could alias a live chapter).
pub const RING_CHAPTERS_MAX: u64 = 32768;
/// Smallest chapter of a sparse index, in pages.
pub const SPARSE_CHAPTER_PAGES_MIN: u64 = 20;
/// Chapters the ring aims for when it is large enough (more chapters: the window drops a
/// finer slice at a time; larger chapters: fewer, longer sequential writes).
const RING_CHAPTERS_TARGET: u64 = 1024;

/// Magic of a name page ("DVCN").
pub const NAME_MAGIC: u32 = u32::from_le_bytes(*b"DVCN");
/// Bytes of one name (`Name`).
pub const NAME_BYTES: usize = 10;
/// Names per 4 KiB page.
pub const NAMES_PER_PAGE: usize = 406;
/// Offset of the chapter's record total in a name page (after the names).
const NAME_TOTAL_OFFSET: usize = BLOCK_SIZE - 4;

const _: () = assert!(CHAPTER_PAGE_HEADER_BYTES + NAMES_PER_PAGE * NAME_BYTES <= NAME_TOTAL_OFFSET);
const _: () = assert!(CHAPTER_PAGE_HEADER_BYTES + (NAMES_PER_PAGE + 1) * NAME_BYTES > NAME_TOTAL_OFFSET);
const _: () = assert!(CHAPTER_PAGE_HEADER_BYTES + RECORDS_PER_PAGE * RECORD_BYTES <= BLOCK_SIZE);
const _: () = assert!(CHAPTER_PAGE_HEADER_BYTES + (RECORDS_PER_PAGE + 1) * RECORD_BYTES > BLOCK_SIZE);

/// One fingerprint record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// The full BLAKE3 fingerprint.
    pub hash: [u8; 32],
    /// Where its copy was stored (the stamp is the block's when the record was made).
    pub loc: Location,
}

/// The bits of a fingerprint the volume index is made from: the keys of its two buckets
/// (fingerprint bytes 0..4 and 16..20), the bits its tag comes from (bytes 8..10, low 13
/// bits), and whether it is a sparse-mode hook (bit 15 of the same field). Encoded as 10
/// bytes in that order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Name {
    /// Key of the first bucket.
    pub a: u32,
    /// Key of the second bucket.
    pub b: u32,
    /// Tag bits (low 13) and the hook flag (bit 15).
    pub tag: u16,
}

/// The bits of `tag` a name keeps from the fingerprint.
const NAME_TAG_MASK: u16 = 0x1FFF;
/// The hook flag of a name's `tag` field.
const NAME_HOOK: u16 = 0x8000;

impl Name {
    /// The name of fingerprint `h`.
    pub fn of(h: &[u8; 32]) -> Name {
        let hook = if crate::dedup::index::is_hook(h) { NAME_HOOK } else { 0 };
        Name { a: get_u32(h, 0), b: get_u32(h, 16), tag: get_u16(h, 8) & NAME_TAG_MASK | hook }
    }
    /// The 13 fingerprint bits the volume index's tag is made from.
    pub fn tag_bits(&self) -> u32 {
        u32::from(self.tag & NAME_TAG_MASK)
    }
    /// True for a sparse-mode hook.
    pub fn is_hook(&self) -> bool {
        self.tag & NAME_HOOK != 0
    }
    fn encode(&self, out: &mut [u8]) {
        put_u32(out, 0, self.a);
        put_u32(out, 4, self.b);
        put_u16(out, 8, self.tag);
    }
    fn decode(b: &[u8]) -> Name {
        Name { a: get_u32(b, 0), b: get_u32(b, 4), tag: get_u16(b, 8) }
    }
}

/// A page's header fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageHeader {
    /// Virtual chapter number.
    pub vcn: u64,
    /// Session epoch of every record in the chapter.
    pub epoch: u32,
    /// Page number inside the chapter.
    pub page: u16,
    /// Records held.
    pub count: u16,
}

/// Where the ring lives and how it is cut into chapters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingLayout {
    /// First block of the ring on the metadata device.
    pub start_block: u64,
    /// Chapter slots.
    pub chapters: u64,
    /// Record pages per chapter.
    pub pages_per_chapter: u64,
    /// Name pages per chapter (0: a ring without name pages).
    pub name_pages_per_chapter: u64,
}

impl RingLayout {
    /// The layout of an index area of `blocks` blocks at `start_block` for `mode`, with
    /// name pages when `names`; `None` when it cannot hold two chapters (no persistent
    /// index). Depends on these alone, so a volume needs no further setting to find its
    /// chapters.
    pub fn for_area(start_block: u64, blocks: u64, mode: IndexMode, names: bool) -> Option<RingLayout> {
        if blocks < 2 {
            return None;
        }
        let pages_min = Self::pages_min(mode).min(blocks / 2).max(1);
        let pages = (blocks / RING_CHAPTERS_TARGET).clamp(pages_min, CHAPTER_PAGES_MAX);
        let mut pages = pages.max(blocks.div_ceil(RING_CHAPTERS_MAX)).min(CHAPTER_PAGES_MAX);
        let mut name_pages = if names { Self::name_pages_for(pages) } else { 0 };
        // A small area whose name pages leave room for one chapter only: smaller chapters.
        while names && pages > 1 && blocks / (pages + name_pages) < 2 {
            pages -= 1;
            name_pages = Self::name_pages_for(pages);
        }
        let chapters = (blocks / (pages + name_pages)).min(RING_CHAPTERS_MAX);
        (chapters >= 2).then_some(RingLayout {
            start_block,
            chapters,
            pages_per_chapter: pages,
            name_pages_per_chapter: name_pages,
        })
    }

    /// Name pages of a chapter of `pages` record pages.
    fn name_pages_for(pages: u64) -> u64 {
        (pages * RECORDS_PER_PAGE as u64).div_ceil(NAMES_PER_PAGE as u64)
    }

    /// Pages a rebuild reads per chapter: its name pages, else its record pages.
    pub fn rebuild_pages(&self) -> u64 {
        if self.has_names() {
            self.name_pages_per_chapter
        } else {
            self.pages_per_chapter
        }
    }

    /// Device byte offset of what a rebuild reads of chapter `vcn`: its first name page,
    /// else its first record page (`rebuild_pages` of them follow).
    pub fn rebuild_offset(&self, vcn: u64) -> u64 {
        if self.has_names() {
            self.name_offset(vcn, 0)
        } else {
            self.page_offset(vcn, 0)
        }
    }

    /// True when the ring keeps name pages.
    pub fn has_names(&self) -> bool {
        self.name_pages_per_chapter > 0
    }

    /// Smallest chapter for `mode`, in pages. Sparse mode finds a chapter through its
    /// first hook, one block in `SPARSE_SAMPLE` on average: the blocks before it are lost
    /// to dedup, so its chapters are large (20 pages: about 126 hooks each).
    fn pages_min(mode: IndexMode) -> u64 {
        match mode {
            IndexMode::Dense => 1,
            IndexMode::Sparse => SPARSE_CHAPTER_PAGES_MIN,
        }
    }

    /// Ring blocks wanted for a window of `window_blocks` data blocks (one more chapter
    /// than the window, since the open chapter is part of the ring): the fewest blocks
    /// whose layout (`for_area`) covers the window.
    pub fn blocks_for_window(window_blocks: u64, mode: IndexMode, names: bool) -> u64 {
        let pages = window_blocks.div_ceil(RECORDS_PER_PAGE as u64);
        let records = pages + pages.div_ceil(RING_CHAPTERS_TARGET).max(Self::pages_min(mode));
        if !names {
            return records;
        }
        let covers = |b: u64| Self::for_area(0, b, mode, true).is_some_and(|r| r.window_blocks() >= window_blocks);
        // Name pages add a fifth or so; double it until it covers, then search downwards.
        let mut hi = records + Self::name_pages_for(records) + 2;
        while !covers(hi) && hi < u64::MAX / 4 {
            hi *= 2;
        }
        let mut lo = records;
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if covers(mid) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        hi
    }

    /// Records one chapter holds.
    pub fn records_per_chapter(&self) -> u64 {
        self.pages_per_chapter * RECORDS_PER_PAGE as u64
    }

    /// Data blocks the full ring covers: the dedup window.
    pub fn window_blocks(&self) -> u64 {
        self.chapters * self.records_per_chapter()
    }

    /// Blocks the ring occupies.
    #[cfg(test)]
    pub fn blocks(&self) -> u64 {
        self.chapters * (self.pages_per_chapter + self.name_pages_per_chapter)
    }

    /// Device byte offset of page `page` of virtual chapter `vcn`.
    pub fn page_offset(&self, vcn: u64, page: u64) -> u64 {
        debug_assert!(page < self.pages_per_chapter);
        (self.start_block + (vcn % self.chapters) * self.pages_per_chapter + page) * BLOCK_SIZE_U64
    }

    /// Device byte offset of name page `page` of virtual chapter `vcn` (the name area
    /// follows the record slots; its slots are in the same order).
    pub fn name_offset(&self, vcn: u64, page: u64) -> u64 {
        debug_assert!(page < self.name_pages_per_chapter);
        let area = self.start_block + self.chapters * self.pages_per_chapter;
        (area + (vcn % self.chapters) * self.name_pages_per_chapter + page) * BLOCK_SIZE_U64
    }
}

/// Encodes the name pages of chapter `vcn` of epoch `epoch` holding `records` (in order),
/// back to back: `ceil(len / NAMES_PER_PAGE)` pages, at least one.
pub fn encode_names(uuid_lo: u64, vcn: u64, epoch: u32, records: &[Record]) -> Vec<u8> {
    let total = u32::try_from(records.len()).unwrap_or(u32::MAX);
    let pages = records.len().div_ceil(NAMES_PER_PAGE).max(1);
    let mut out = vec![0u8; pages * BLOCK_SIZE];
    for (i, buf) in out.chunks_exact_mut(BLOCK_SIZE).enumerate() {
        let recs = records.get(i * NAMES_PER_PAGE..).unwrap_or_default();
        let recs = recs.get(..recs.len().min(NAMES_PER_PAGE)).unwrap_or_default();
        let h = PageHeader { vcn, epoch, page: i as u16, count: recs.len() as u16 };
        put_header(buf, NAME_MAGIC, uuid_lo, &h);
        for (k, r) in recs.iter().enumerate() {
            let off = CHAPTER_PAGE_HEADER_BYTES + k * NAME_BYTES;
            if let Some(dst) = buf.get_mut(off..off + NAME_BYTES) {
                Name::of(&r.hash).encode(dst);
            }
        }
        put_u32(buf, NAME_TOTAL_OFFSET, total);
        seal_crc(buf, CHAPTER_CRC_OFFSET);
    }
    out
}

/// The names of chapter `vcn` in its name pages `buf` (read from the chapter's name slot)
/// and their epoch, if they are complete and of one epoch below `epoch_below`: every page
/// up to the one holding the last name checks, belongs to `vcn`, sits at its position and
/// holds a full page of names but the last, which holds the rest of the chapter's record
/// total; all pages of one write (the same epoch and total).
pub fn chapter_names(buf: &[u8], uuid_lo: u64, vcn: u64, epoch_below: u32) -> Option<(u32, Vec<Name>)> {
    let first = read_header(buf.get(..BLOCK_SIZE)?, NAME_MAGIC, uuid_lo)?;
    let total = usize::try_from(get_u32(buf, NAME_TOTAL_OFFSET)).ok()?;
    let pages = total.div_ceil(NAMES_PER_PAGE).max(1);
    // A total the pages given cannot hold is damage (or another layout's page).
    if pages > buf.len() / BLOCK_SIZE || first.epoch >= epoch_below {
        return None;
    }
    let mut names = Vec::with_capacity(total);
    for (i, page) in buf.chunks_exact(BLOCK_SIZE).take(pages).enumerate() {
        let expect = total.saturating_sub(i * NAMES_PER_PAGE).min(NAMES_PER_PAGE);
        let h = read_header(page, NAME_MAGIC, uuid_lo)?;
        let ok = h.vcn == vcn
            && h.epoch == first.epoch
            && usize::from(h.page) == i
            && usize::from(h.count) == expect
            && get_u32(page, NAME_TOTAL_OFFSET) as usize == total;
        if !ok {
            return None;
        }
        let body = page.get(CHAPTER_PAGE_HEADER_BYTES..CHAPTER_PAGE_HEADER_BYTES + expect * NAME_BYTES)?;
        names.extend(body.chunks_exact(NAME_BYTES).map(Name::decode));
    }
    (names.len() == total).then_some((first.epoch, names))
}

/// Writes the header of a record or name page (`magic`) of volume `uuid_lo`; the crc is
/// sealed once the page is filled.
fn put_header(buf: &mut [u8], magic: u32, uuid_lo: u64, h: &PageHeader) {
    put_u32(buf, 0, magic);
    put_u64(buf, 8, uuid_lo);
    put_u64(buf, 16, h.vcn);
    put_u32(buf, 24, h.epoch);
    put_u16(buf, 28, h.page);
    put_u16(buf, 30, h.count);
}

/// The header of a 4 KiB page of kind `magic` of volume `uuid_lo`, if the page checks
/// (size, magic, volume, crc); the caller checks the fields against what it expects.
fn read_header(buf: &[u8], magic: u32, uuid_lo: u64) -> Option<PageHeader> {
    let ok = buf.len() == BLOCK_SIZE
        && get_u32(buf, 0) == magic
        && get_u64(buf, 8) == uuid_lo
        && crc_ok(buf, CHAPTER_CRC_OFFSET);
    ok.then(|| PageHeader {
        vcn: get_u64(buf, 16),
        epoch: get_u32(buf, 24),
        page: get_u16(buf, 28),
        count: get_u16(buf, 30),
    })
}

/// Encodes a record page.
pub fn encode_page(uuid_lo: u64, h: PageHeader, records: &[Record]) -> Vec<u8> {
    debug_assert!(records.len() <= RECORDS_PER_PAGE && usize::from(h.count) == records.len());
    let mut buf = vec![0u8; BLOCK_SIZE];
    put_header(&mut buf, CHAPTER_MAGIC, uuid_lo, &h);
    for (i, r) in records.iter().enumerate() {
        let off = CHAPTER_PAGE_HEADER_BYTES + i * RECORD_BYTES;
        if let Some(dst) = buf.get_mut(off..off + 32) {
            dst.copy_from_slice(&r.hash);
        }
        if let Some(dst) = buf.get_mut(off + 32..off + RECORD_BYTES) {
            r.loc.encode(dst);
        }
    }
    seal_crc(&mut buf, CHAPTER_CRC_OFFSET);
    buf
}

/// Checks a record page of volume `uuid_lo` and yields its header and the fingerprints of
/// its records in place (the rebuild's decoder: nothing is copied); `None` as for
/// `decode_page`.
pub fn page_records(buf: &[u8], uuid_lo: u64) -> Option<(PageHeader, impl Iterator<Item = &[u8; 32]>)> {
    let h = read_header(buf, CHAPTER_MAGIC, uuid_lo)?;
    let body = buf.get(CHAPTER_PAGE_HEADER_BYTES..CHAPTER_PAGE_HEADER_BYTES + usize::from(h.count) * RECORD_BYTES)?;
    if usize::from(h.count) > RECORDS_PER_PAGE {
        return None;
    }
    Some((h, body.chunks_exact(RECORD_BYTES).filter_map(|r| r.first_chunk::<32>())))
}

/// Decodes a record page of volume `uuid_lo`; `None` for a page that is torn, stale from
/// another volume, never written, or whose count does not fit.
pub fn decode_page(buf: &[u8], uuid_lo: u64) -> Option<(PageHeader, Vec<Record>)> {
    let h = read_header(buf, CHAPTER_MAGIC, uuid_lo)?;
    if usize::from(h.count) > RECORDS_PER_PAGE {
        return None;
    }
    let records = (0..usize::from(h.count))
        .filter_map(|i| {
            let off = CHAPTER_PAGE_HEADER_BYTES + i * RECORD_BYTES;
            let hash: [u8; 32] = buf.get(off..off + 32)?.try_into().ok()?;
            Some(Record { hash, loc: Location::decode(buf.get(off + 32..off + RECORD_BYTES)?) })
        })
        .collect();
    Some((h, records))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_round_trip_and_refuse_damage() {
        let recs = records(RECORDS_PER_PAGE as u64);
        let h = PageHeader { vcn: 9, epoch: 3, page: 2, count: RECORDS_PER_PAGE as u16 };
        let mut page = encode_page(42, h, &recs);
        assert_eq!(decode_page(&page, 42), Some((h, recs)));
        assert_eq!(decode_page(&page, 43), None, "another volume's page");
        if let Some(b) = page.get_mut(100) {
            *b ^= 1;
        }
        assert_eq!(decode_page(&page, 42), None, "torn page");
    }

    /// `n` records of distinct fingerprints, with a reuse stamp to round-trip.
    fn records(n: u64) -> Vec<Record> {
        (0..n)
            .map(|i| Record {
                hash: *blake3::hash(&i.to_le_bytes()).as_bytes(),
                loc: Location {
                    pbn: i,
                    state: 2,
                    frag: crate::metadata::block_map::Frag::ZERO,
                    stamp: 7,
                    current: false,
                },
            })
            .collect()
    }

    #[test]
    fn names_round_trip_only_when_complete() {
        for n in [0u64, 1, 405, 406, 407, 812, 2000] {
            let recs = records(n);
            let mut buf = encode_names(42, 9, 3, &recs);
            let want: Vec<Name> = recs.iter().map(|r| Name::of(&r.hash)).collect();
            assert_eq!(buf.len(), (n as usize).div_ceil(NAMES_PER_PAGE).max(1) * BLOCK_SIZE);
            // The slot is larger than the pages written: what follows is not read.
            buf.extend_from_slice(&[0xA5; BLOCK_SIZE]);
            assert_eq!(chapter_names(&buf, 42, 9, 4), Some((3, want.clone())), "{n} names");
            assert_eq!(chapter_names(&buf, 42, 9, 3), None, "an epoch not below the session's");
            assert_eq!(chapter_names(&buf, 42, 10, 4), None, "another chapter's names");
            assert_eq!(chapter_names(&buf, 43, 9, 4), None, "another volume's names");
            let last = (n as usize).div_ceil(NAMES_PER_PAGE).max(1) - 1;
            if let Some(b) = buf.get_mut(last * BLOCK_SIZE + 40) {
                *b ^= 1;
            }
            assert_eq!(chapter_names(&buf, 42, 9, 4), None, "a torn last page");
        }
        // A chapter that grew after its names were written (a later close rewrote page 0
        // only): the total no longer matches the next page.
        let mut old = encode_names(42, 9, 3, &records(500));
        let newer = encode_names(42, 9, 3, &records(900));
        old.get_mut(..BLOCK_SIZE).expect("page").copy_from_slice(newer.get(..BLOCK_SIZE).expect("page"));
        old.extend_from_slice(&[0; BLOCK_SIZE]);
        assert_eq!(chapter_names(&old, 42, 9, 4), None, "pages of two different writes");
        // Two sessions' names of the same chapter number and total, page 1 from the later.
        let mut first = encode_names(42, 9, 3, &records(500));
        let later = encode_names(42, 9, 5, &records(500));
        first.get_mut(BLOCK_SIZE..).expect("page 1").copy_from_slice(later.get(BLOCK_SIZE..).expect("page 1"));
        assert_eq!(chapter_names(&first, 42, 9, 6), None, "pages of two sessions");
        // A name keeps the bits the volume index needs.
        let h = *blake3::hash(b"x").as_bytes();
        let nm = Name::of(&h);
        assert_eq!((nm.a, nm.b), (get_u32(&h, 0), get_u32(&h, 16)));
        assert_eq!(nm.tag_bits(), get_u32(&h, 8) & 0x1FFF);
        assert_eq!(nm.is_hook(), crate::dedup::index::is_hook(&h));
    }

    #[test]
    fn layouts_fit_their_area() {
        for mode in [IndexMode::Dense, IndexMode::Sparse] {
            for names in [false, true] {
                assert_eq!(RingLayout::for_area(10, 1, mode, names), None);
                // A ring with names needs a name page per chapter too: 3 blocks are too few.
                let smallest = if names { 4 } else { 2 };
                for blocks in [smallest, 100, 1024, 5000, 1 << 20, 1 << 23, 1 << 30] {
                    let r = RingLayout::for_area(10, blocks, mode, names).expect("layout");
                    assert!(r.blocks() <= blocks && r.chapters >= 2 && r.chapters <= RING_CHAPTERS_MAX);
                    assert!((1..=CHAPTER_PAGES_MAX).contains(&r.pages_per_chapter));
                    assert_eq!(r.has_names(), names);
                    // The names of a full chapter fit its name pages.
                    assert!(r.name_pages_per_chapter * NAMES_PER_PAGE as u64 >= r.records_per_chapter() || !names);
                    if names {
                        let end = r.name_offset(r.chapters - 1, r.name_pages_per_chapter - 1) / BLOCK_SIZE_U64;
                        assert_eq!(end + 1, 10 + r.blocks(), "{r:?}");
                    }
                }
                for window in [1000u64, 1 << 20, 1 << 28] {
                    let blocks = RingLayout::blocks_for_window(window, mode, names);
                    let r = RingLayout::for_area(0, blocks, mode, names).expect("layout");
                    assert!(r.window_blocks() >= window, "{r:?} covers less than {window} blocks");
                    if names && window >= 1 << 20 {
                        // Names cost a fifth to a quarter more than the records alone (a tiny ring
                        // pays a name page per chapter of a page or two).
                        let plain = RingLayout::blocks_for_window(window, mode, false);
                        assert!(blocks * 100 <= plain * 130, "{blocks} blocks against {plain} without names");
                    }
                }
            }
        }
    }
}
