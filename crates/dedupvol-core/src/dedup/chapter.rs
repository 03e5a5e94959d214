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
//! Invariants:
//! - Every page is self-describing (volume, virtual chapter, epoch, page number, record
//!   count) and sealed by a crc32c over the whole 4 KiB: a torn, stale or foreign page is
//!   recognised on its own and skipped (`decode_page` refuses it).
//! - All records of a chapter share one epoch (the session that made them): a new
//!   session, or a reuse stamp that wraps, opens a new chapter.
//! - Records are advisory: nothing read from a page is trusted for sharing without the
//!   checks of `Deduper` (block in use; current stamp or byte verification).

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
}

impl RingLayout {
    /// The layout of an index area of `blocks` blocks at `start_block` for `mode`; `None`
    /// when it cannot hold two chapters (no persistent index). Depends on the area and the
    /// mode alone, so a volume needs no further setting to find its chapters.
    pub fn for_area(start_block: u64, blocks: u64, mode: IndexMode) -> Option<RingLayout> {
        if blocks < 2 {
            return None;
        }
        let pages_min = Self::pages_min(mode).min(blocks / 2).max(1);
        let pages = (blocks / RING_CHAPTERS_TARGET).clamp(pages_min, CHAPTER_PAGES_MAX);
        let pages = pages.max(blocks.div_ceil(RING_CHAPTERS_MAX)).min(CHAPTER_PAGES_MAX);
        let chapters = (blocks / pages).min(RING_CHAPTERS_MAX);
        (chapters >= 2).then_some(RingLayout { start_block, chapters, pages_per_chapter: pages })
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
    /// than the window, since the open chapter is part of the ring).
    pub fn blocks_for_window(window_blocks: u64, mode: IndexMode) -> u64 {
        let pages = window_blocks.div_ceil(RECORDS_PER_PAGE as u64);
        pages + pages.div_ceil(RING_CHAPTERS_TARGET).max(Self::pages_min(mode))
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
        self.chapters * self.pages_per_chapter
    }

    /// Device byte offset of page `page` of virtual chapter `vcn`.
    pub fn page_offset(&self, vcn: u64, page: u64) -> u64 {
        debug_assert!(page < self.pages_per_chapter);
        (self.start_block + (vcn % self.chapters) * self.pages_per_chapter + page) * BLOCK_SIZE_U64
    }
}

/// Encodes a record page.
pub fn encode_page(uuid_lo: u64, h: PageHeader, records: &[Record]) -> Vec<u8> {
    debug_assert!(records.len() <= RECORDS_PER_PAGE && usize::from(h.count) == records.len());
    let mut buf = vec![0u8; BLOCK_SIZE];
    put_u32(&mut buf, 0, CHAPTER_MAGIC);
    put_u64(&mut buf, 8, uuid_lo);
    put_u64(&mut buf, 16, h.vcn);
    put_u32(&mut buf, 24, h.epoch);
    put_u16(&mut buf, 28, h.page);
    put_u16(&mut buf, 30, h.count);
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
    if buf.len() != BLOCK_SIZE || get_u32(buf, 0) != CHAPTER_MAGIC || get_u64(buf, 8) != uuid_lo {
        return None;
    }
    if !crc_ok(buf, CHAPTER_CRC_OFFSET) {
        return None;
    }
    let h =
        PageHeader { vcn: get_u64(buf, 16), epoch: get_u32(buf, 24), page: get_u16(buf, 28), count: get_u16(buf, 30) };
    let body = buf.get(CHAPTER_PAGE_HEADER_BYTES..CHAPTER_PAGE_HEADER_BYTES + usize::from(h.count) * RECORD_BYTES)?;
    if usize::from(h.count) > RECORDS_PER_PAGE {
        return None;
    }
    Some((h, body.chunks_exact(RECORD_BYTES).filter_map(|r| r.first_chunk::<32>())))
}

/// Decodes a record page of volume `uuid_lo`; `None` for a page that is torn, stale from
/// another volume, never written, or whose count does not fit.
pub fn decode_page(buf: &[u8], uuid_lo: u64) -> Option<(PageHeader, Vec<Record>)> {
    if buf.len() != BLOCK_SIZE || get_u32(buf, 0) != CHAPTER_MAGIC || get_u64(buf, 8) != uuid_lo {
        return None;
    }
    if !crc_ok(buf, CHAPTER_CRC_OFFSET) {
        return None;
    }
    let h =
        PageHeader { vcn: get_u64(buf, 16), epoch: get_u32(buf, 24), page: get_u16(buf, 28), count: get_u16(buf, 30) };
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
        let recs: Vec<Record> = (0..RECORDS_PER_PAGE as u64)
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
            .collect();
        let h = PageHeader { vcn: 9, epoch: 3, page: 2, count: RECORDS_PER_PAGE as u16 };
        let mut page = encode_page(42, h, &recs);
        assert_eq!(decode_page(&page, 42), Some((h, recs)));
        assert_eq!(decode_page(&page, 43), None, "another volume's page");
        if let Some(b) = page.get_mut(100) {
            *b ^= 1;
        }
        assert_eq!(decode_page(&page, 42), None, "torn page");
    }

    #[test]
    fn layouts_fit_their_area() {
        for mode in [IndexMode::Dense, IndexMode::Sparse] {
            assert_eq!(RingLayout::for_area(10, 1, mode), None);
            for blocks in [2u64, 3, 100, 1024, 5000, 1 << 20, 1 << 23, 1 << 30] {
                let r = RingLayout::for_area(10, blocks, mode).expect("layout");
                assert!(r.blocks() <= blocks && r.chapters >= 2 && r.chapters <= RING_CHAPTERS_MAX);
                assert!((1..=CHAPTER_PAGES_MAX).contains(&r.pages_per_chapter));
            }
            for window in [1000u64, 1 << 20, 1 << 28] {
                let r = RingLayout::for_area(0, RingLayout::blocks_for_window(window, mode), mode).expect("layout");
                assert!(r.window_blocks() >= window, "{r:?} covers less than {window} blocks");
            }
        }
    }
}
