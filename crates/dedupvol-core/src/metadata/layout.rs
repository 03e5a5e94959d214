//! Geometry: where every region lives, in 4 KiB blocks, on the data and metadata devices.
//!
//! ```text
//! metadata device (or the data device when there is none):
//!   [0] superblock A  [1] superblock B  [journal] [refcount pages ×2 slots]
//!   [block map pages ×2 slots] [fingerprint index: chapter ring] [dictionary area]
//! data device:
//!   [0] superblock A  [1] superblock B  (metadata here when no metadata device)
//!   [data region: slabs of slab_blocks data blocks, the last one possibly short]
//! ```
//!
//! Growth room: the refcount and block map regions may be followed by free blocks (made at
//! format, `GrowthRoom`) that a grow extends them into (`Geometry::grown_in_place`); a grow
//! of a closed volume may also move them, or move and shrink the chapter ring, which holds
//! nothing needed for correctness (`Geometry::plan_resize`).
//!
//! Invariants:
//! - Regions (journal, refcount pages, block map pages, chapter ring, dictionary area) do
//!   not overlap and
//!   lie inside the metadata area of their device, after the superblocks
//!   (`Geometry::validate`); they may lie in any order and with free blocks between them.
//! - A page count never decreases over a volume's life, so the slots of a page index
//!   beyond the old count never held a copy of that page: growing reads them as empty.
//! - Page `p`'s slot `s` (s in 0..2) of the block map is block `block_map_start + 2p + s`;
//!   likewise for refcount pages. Journal block with sequence `b` lives at
//!   `journal_start + b % journal_blocks`.

use crate::config::BLOCK_SIZE_U64;
use crate::error::{Error, Result};

/// Block map entries per 4 KiB page (32-byte header + 254 × 16-byte entries).
pub const BM_ENTRIES_PER_PAGE: u64 = 254;
/// Reference-count entries per 4 KiB page (32-byte header + 2032 × 2-byte counts).
pub const RC_ENTRIES_PER_PAGE: u64 = 2032;
/// Blocks reserved at the start of each device for the two superblock copies.
pub const SUPERBLOCK_BLOCKS: u64 = 2;
/// Smallest data region accepted.
pub const DATA_BLOCKS_MIN: u64 = 64;
/// Journal size bounds, in blocks.
pub const JOURNAL_BLOCKS_MIN: u64 = 64;
/// Largest automatically chosen journal (32 MiB).
pub const JOURNAL_BLOCKS_AUTO_MAX: u64 = 8192;
/// Blocks of the dictionary area a volume gets at format: two copies of a dictionary of
/// at most `data::dictionary::DICT_BYTES_MAX` (`data::dictionary`).
pub const DICT_AREA_BLOCKS: u64 = 64;

/// The placement of every region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Logical blocks exported.
    pub logical_blocks: u64,
    /// Blocks of the data device.
    pub data_dev_blocks: u64,
    /// Blocks of the metadata device (0 when metadata shares the data device).
    pub meta_dev_blocks: u64,
    /// First journal block (metadata device).
    pub journal_start: u64,
    /// Journal length in blocks.
    pub journal_blocks: u64,
    /// First refcount block (metadata device).
    pub refcount_start: u64,
    /// Refcount pages (each occupies two slots).
    pub refcount_pages: u64,
    /// First block map block (metadata device).
    pub block_map_start: u64,
    /// Block map pages (each occupies two slots).
    pub block_map_pages: u64,
    /// First block of the fingerprint index's chapter ring (metadata device).
    pub index_start: u64,
    /// Length of the chapter ring area in blocks.
    pub index_blocks: u64,
    /// First block of the dictionary area (metadata device; 0 with `dict_blocks` 0: a
    /// volume formatted before dictionaries existed, or whose metadata device had no room).
    pub dict_start: u64,
    /// Blocks of the dictionary area (`DICT_AREA_BLOCKS`, or 0: none).
    pub dict_blocks: u64,
    /// First data block (data device).
    pub data_start: u64,
    /// Data blocks in the data region.
    pub data_blocks: u64,
    /// Blocks per slab.
    pub slab_blocks: u64,
}

impl Geometry {
    /// Lays out a new volume without growth room.
    pub fn compute(
        logical_blocks: u64,
        data_dev_bytes: u64,
        meta_dev_bytes: Option<u64>,
        slab_blocks: u64,
        journal_bytes: Option<u64>,
        index_wanted_blocks: u64,
    ) -> Result<Geometry> {
        Self::compute_with_room(
            logical_blocks,
            data_dev_bytes,
            meta_dev_bytes,
            slab_blocks,
            journal_bytes,
            index_wanted_blocks,
            GrowthRoom::NONE,
        )
    }

    /// Lays out a new volume whose refcount and block map regions have room to grow to
    /// `room` without moving.
    pub fn compute_with_room(
        logical_blocks: u64,
        data_dev_bytes: u64,
        meta_dev_bytes: Option<u64>,
        slab_blocks: u64,
        journal_bytes: Option<u64>,
        index_wanted_blocks: u64,
        room: GrowthRoom,
    ) -> Result<Geometry> {
        let data_dev_blocks = data_dev_bytes / BLOCK_SIZE_U64;
        let meta_dev_blocks = meta_dev_bytes.map_or(0, |b| b / BLOCK_SIZE_U64);
        let journal_blocks = match journal_bytes {
            Some(j) => j / BLOCK_SIZE_U64,
            None => (data_dev_blocks / 64).clamp(JOURNAL_BLOCKS_MIN, JOURNAL_BLOCKS_AUTO_MAX),
        };
        // Refcount pages are sized for the whole data device (an upper bound on the data region).
        let refcount_pages = data_dev_blocks.div_ceil(RC_ENTRIES_PER_PAGE).max(1);
        let block_map_pages = logical_blocks.div_ceil(BM_ENTRIES_PER_PAGE);
        // Without a metadata device the ring takes at most 1/32 of the data device.
        let index_blocks =
            if meta_dev_bytes.is_some() { index_wanted_blocks } else { index_wanted_blocks.min(data_dev_blocks / 32) };
        let refcount_room_pages = room.max_data_dev_blocks.div_ceil(RC_ENTRIES_PER_PAGE).max(refcount_pages);
        let block_map_room_pages = room.max_logical_blocks.div_ceil(BM_ENTRIES_PER_PAGE).max(block_map_pages);
        let journal_start = SUPERBLOCK_BLOCKS;
        let refcount_start = journal_start + journal_blocks;
        let block_map_start = refcount_start + 2 * refcount_room_pages;
        let index_start = block_map_start + 2 * block_map_room_pages;
        // The dictionary area after the ring; on a metadata device only if it has room
        // (a volume without one compresses without a dictionary).
        let dict_start = index_start + index_blocks;
        let dict_blocks = if meta_dev_bytes.is_some() && dict_start + DICT_AREA_BLOCKS > meta_dev_blocks {
            0
        } else {
            DICT_AREA_BLOCKS
        };
        let dict_start = if dict_blocks == 0 { 0 } else { dict_start };
        let meta_end = index_start + index_blocks + dict_blocks;
        let data_start = if meta_dev_bytes.is_some() {
            if meta_end > meta_dev_blocks {
                return Err(Error::InvalidArgument(format!(
                    "metadata device too small: needs at least {} bytes for this logical size (has {})",
                    meta_end * BLOCK_SIZE_U64,
                    meta_dev_blocks * BLOCK_SIZE_U64
                )));
            }
            SUPERBLOCK_BLOCKS
        } else {
            meta_end
        };
        let needed = data_start + DATA_BLOCKS_MIN;
        if data_dev_blocks < needed {
            return Err(Error::InvalidArgument(format!(
                "device too small: {} bytes, but metadata for this logical size plus a minimal data region needs at least {} bytes",
                data_dev_blocks * BLOCK_SIZE_U64,
                needed * BLOCK_SIZE_U64
            )));
        }
        let g = Geometry {
            logical_blocks,
            data_dev_blocks,
            meta_dev_blocks,
            journal_start,
            journal_blocks,
            refcount_start,
            refcount_pages,
            block_map_start,
            block_map_pages,
            index_start,
            index_blocks,
            dict_start,
            dict_blocks,
            data_start,
            data_blocks: data_dev_blocks - data_start,
            slab_blocks,
        };
        // The checks above refuse every argument that could break an invariant.
        g.validate().map_err(|e| Error::internal("computed geometry breaks its invariants", e.to_string()))?;
        Ok(g)
    }

    /// Checks the invariants (also run on geometry read back from a superblock). A broken
    /// one is corruption of a "superblock copy" (address 0: `Superblock::read` names the copy).
    pub fn validate(&self) -> Result<()> {
        let regions = self.regions();
        let inside = regions
            .iter()
            .all(|r| r.is_empty() && r.start == 0 || r.start >= SUPERBLOCK_BLOCKS && r.end <= self.meta_end_limit());
        let apart = regions.iter().enumerate().all(|(i, a)| regions.iter().skip(i + 1).all(|b| !overlaps(a, b)));
        let ok = self.logical_blocks > 0
            && self.journal_blocks >= JOURNAL_BLOCKS_MIN
            && self.refcount_pages.saturating_mul(RC_ENTRIES_PER_PAGE) >= self.data_blocks
            && self.block_map_pages.saturating_mul(BM_ENTRIES_PER_PAGE) >= self.logical_blocks
            && regions.iter().all(|r| r.start <= r.end)
            && inside
            && apart
            && self.data_start >= SUPERBLOCK_BLOCKS
            && self.data_blocks >= DATA_BLOCKS_MIN
            && self.data_start.checked_add(self.data_blocks).is_some_and(|e| e <= self.data_dev_blocks)
            && self.slab_blocks > 0;
        if ok {
            Ok(())
        } else {
            Err(Error::corruption(
                "superblock copy",
                0,
                "a geometry whose regions fit their devices without overlapping",
                format!("inconsistent volume geometry {self:?}"),
            ))
        }
    }

    /// Number of slabs (the last may be short).
    pub fn slab_count(&self) -> u64 {
        self.data_blocks.div_ceil(self.slab_blocks)
    }

    /// Bytes of metadata regions (including superblocks on both devices, and the growth
    /// room between regions).
    pub fn metadata_bytes(&self) -> u64 {
        let sb = if self.meta_dev_blocks > 0 { SUPERBLOCK_BLOCKS } else { 0 };
        let end = self.regions().iter().map(|r| r.end).max().unwrap_or(SUPERBLOCK_BLOCKS);
        (sb + end) * BLOCK_SIZE_U64
    }

    /// The metadata regions as block ranges of the metadata device: journal, refcount
    /// slots, block map slots, chapter ring, dictionary area (empty when none; ends
    /// saturate: `validate` refuses them).
    pub fn regions(&self) -> [std::ops::Range<u64>; 5] {
        let span = |start: u64, len: u64| start..start.saturating_add(len);
        [
            span(self.journal_start, self.journal_blocks),
            span(self.refcount_start, self.refcount_pages.saturating_mul(2)),
            span(self.block_map_start, self.block_map_pages.saturating_mul(2)),
            span(self.index_start, self.index_blocks),
            span(self.dict_start, self.dict_blocks),
        ]
    }

    /// The dictionary area (empty when the volume has none). It never moves: a resize
    /// plans around it.
    pub fn dict_area(&self) -> std::ops::Range<u64> {
        self.regions()[4].clone()
    }

    /// Where the metadata area ends: the metadata device's end, or the data region's start
    /// when metadata shares the data device.
    pub fn meta_end_limit(&self) -> u64 {
        if self.meta_dev_blocks > 0 {
            self.meta_dev_blocks
        } else {
            self.data_start
        }
    }

    /// Pages the refcount region can hold without moving (its room included).
    pub fn refcount_room_pages(&self) -> u64 {
        self.room_after(&self.regions()[1]) / 2
    }

    /// Pages the block map region can hold without moving (its room included).
    pub fn block_map_room_pages(&self) -> u64 {
        self.room_after(&self.regions()[2]) / 2
    }

    /// Blocks from `r.start` to the next region's start (or the metadata area's end).
    fn room_after(&self, r: &std::ops::Range<u64>) -> u64 {
        let next = self
            .regions()
            .iter()
            .filter(|o| o.start < o.end && o.start != r.start)
            .map(|o| o.start)
            .filter(|&s| s >= r.end)
            .min();
        next.unwrap_or(self.meta_end_limit()).min(self.meta_end_limit()).saturating_sub(r.start)
    }

    /// The largest logical size (blocks) the block map has room for without moving.
    pub fn max_logical_blocks(&self) -> u64 {
        self.block_map_room_pages() * BM_ENTRIES_PER_PAGE
    }

    /// The largest data device (blocks) the reference counts have room for without moving.
    pub fn max_data_dev_blocks(&self) -> u64 {
        self.refcount_room_pages() * RC_ENTRIES_PER_PAGE + self.data_start
    }

    /// This geometry with `logical_blocks` and a data device of `data_dev_blocks`, the
    /// refcount and block map regions extended into their room; nothing moves, so an open
    /// volume can take it. `Err` says what is short.
    pub fn grown_in_place(&self, logical_blocks: u64, data_dev_blocks: u64) -> std::result::Result<Geometry, String> {
        if logical_blocks == 0 {
            return Err("the logical size must be larger than zero".into());
        }
        if data_dev_blocks < self.data_dev_blocks {
            return Err(format!(
                "the data device cannot shrink ({} blocks recorded, {data_dev_blocks} asked)",
                self.data_dev_blocks
            ));
        }
        let mut g = *self;
        g.logical_blocks = logical_blocks;
        g.block_map_pages = self.block_map_pages.max(logical_blocks.div_ceil(BM_ENTRIES_PER_PAGE));
        if g.block_map_pages > self.block_map_room_pages() {
            return Err(format!(
                "the block map has room for {} bytes of logical size ({} pages), {} asked",
                self.max_logical_blocks() * BLOCK_SIZE_U64,
                self.block_map_room_pages(),
                logical_blocks * BLOCK_SIZE_U64
            ));
        }
        g.data_dev_blocks = data_dev_blocks;
        g.data_blocks = data_dev_blocks - self.data_start;
        g.refcount_pages = self.refcount_pages.max(data_dev_blocks.div_ceil(RC_ENTRIES_PER_PAGE));
        if g.refcount_pages > self.refcount_room_pages() {
            return Err(format!(
                "the reference counts have room for a data device of {} bytes ({} pages), {} asked",
                self.max_data_dev_blocks() * BLOCK_SIZE_U64,
                self.refcount_room_pages(),
                data_dev_blocks * BLOCK_SIZE_U64
            ));
        }
        g.validate().map_err(|e| e.to_string())?;
        Ok(g)
    }

    /// A resize of a closed volume: `grown_in_place` where the room suffices; otherwise the
    /// refcount or block map region moves to free blocks of the metadata area (its pages
    /// are copied there first: the returned `RegionCopy`s), the chapter ring moving or
    /// shrinking out of the way. `meta_dev_blocks` is the metadata device's size now
    /// (ignored without one): a grown metadata device gives room. The logical size may
    /// shrink (the block map keeps its pages); the data device may not.
    pub fn plan_resize(
        &self,
        logical_blocks: u64,
        data_dev_blocks: u64,
        meta_dev_blocks: u64,
    ) -> std::result::Result<(Geometry, Vec<RegionCopy>), String> {
        let mut base = *self;
        if self.meta_dev_blocks > 0 {
            base.meta_dev_blocks = meta_dev_blocks.max(self.meta_dev_blocks);
        }
        if let Ok(g) = base.grown_in_place(logical_blocks, data_dev_blocks) {
            return Ok((g, Vec::new()));
        }
        if logical_blocks == 0 || data_dev_blocks < self.data_dev_blocks {
            return base.grown_in_place(logical_blocks, data_dev_blocks).map(|g| (g, Vec::new()));
        }
        let mut g = base;
        g.logical_blocks = logical_blocks;
        g.block_map_pages = self.block_map_pages.max(logical_blocks.div_ceil(BM_ENTRIES_PER_PAGE));
        g.data_dev_blocks = data_dev_blocks;
        g.data_blocks = data_dev_blocks - self.data_start;
        g.refcount_pages = self.refcount_pages.max(data_dev_blocks.div_ceil(RC_ENTRIES_PER_PAGE));
        let limit = g.meta_end_limit();
        let journal = g.journal_start..g.journal_start + g.journal_blocks;
        // Fixed regions: the journal and the dictionary area never move.
        let dict = g.dict_area();
        let mut copies = Vec::new();
        // The ring is left out while the two page regions find their place.
        let (old_rc, old_bm) = (self.regions()[1].clone(), self.regions()[2].clone());
        let fits = |start: u64, len: u64, others: &[std::ops::Range<u64>]| -> bool {
            let r = start..start.saturating_add(len);
            r.end <= limit && others.iter().all(|o| !overlaps(&r, o))
        };
        // The block map's extension in place, kept free for it when nothing but the ring
        // (and the refcount region, which then moves) is in its way.
        let rc_len = 2 * g.refcount_pages;
        let bm_len = 2 * g.block_map_pages;
        let bm_in_place = g.block_map_start..g.block_map_start.saturating_add(bm_len);
        let bm_keep = if fits(g.block_map_start, bm_len, &[journal.clone(), dict.clone()]) {
            bm_in_place
        } else {
            old_bm.clone()
        };
        // Refcount region: in place if its extension meets nothing but the ring.
        if !fits(g.refcount_start, rc_len, &[journal.clone(), dict.clone(), bm_keep.clone()]) {
            let start =
                first_free(limit, rc_len, &[journal.clone(), dict.clone(), old_bm.clone(), old_rc.clone(), bm_keep])
                    .ok_or_else(|| no_room("reference counts", rc_len, limit))?;
            copies.push(RegionCopy { from: old_rc.start, to: start, blocks: old_rc.end - old_rc.start });
            g.refcount_start = start;
        }
        let rc_now = g.refcount_start..g.refcount_start + rc_len;
        if !fits(g.block_map_start, bm_len, &[journal.clone(), dict.clone(), rc_now.clone()]) {
            // Never over a copy's source: the old geometry stays whole until the switch.
            let start = first_free(
                limit,
                bm_len,
                &[journal.clone(), dict.clone(), rc_now.clone(), old_bm.clone(), old_rc.clone()],
            )
            .ok_or_else(|| no_room("block map", bm_len, limit))?;
            copies.push(RegionCopy { from: old_bm.start, to: start, blocks: old_bm.end - old_bm.start });
            g.block_map_start = start;
        }
        let bm_now = g.block_map_start..g.block_map_start + bm_len;
        // A region that moved leaves its old blocks free only after the superblock names
        // the new layout; the ring must not take them in the same resize (a crash would
        // leave the old geometry pointing at them while they are unchanged anyway, but the
        // copies' sources must stay intact until then).
        let mut taken = vec![journal, rc_now, bm_now];
        if !dict.is_empty() {
            taken.push(dict);
        }
        taken.extend(copies.iter().map(|c| c.from..c.from + c.blocks));
        let ring = g.index_start..g.index_start + g.index_blocks;
        if taken.iter().any(|t| overlaps(t, &ring)) || ring.end > limit {
            // The largest free run, at most the ring's old size: outside the regions' room
            // for growth, unless that costs the ring more than half of what it could have.
            let rooms = [
                g.refcount_start..g.refcount_start + 2 * g.refcount_pages.max(self.refcount_room_pages()),
                g.block_map_start..g.block_map_start + 2 * g.block_map_pages.max(self.block_map_room_pages()),
            ];
            let with_rooms: Vec<std::ops::Range<u64>> = taken.iter().cloned().chain(rooms).collect();
            let kept = largest_free(SUPERBLOCK_BLOCKS, limit, &with_rooms);
            let any = largest_free(SUPERBLOCK_BLOCKS, limit, &taken);
            let (start, len) =
                if 2 * kept.1.min(self.index_blocks) >= any.1.min(self.index_blocks) { kept } else { any };
            let len = len.min(self.index_blocks);
            g.index_start = start;
            g.index_blocks = len;
        }
        g.validate().map_err(|e| e.to_string())?;
        Ok((g, copies))
    }

    /// Device byte offset of data block `pbn` (data device).
    pub fn data_offset(&self, pbn: u64) -> u64 {
        (self.data_start + pbn) * BLOCK_SIZE_U64
    }
}

/// Room to leave for growth at format, as the largest sizes the regions cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrowthRoom {
    /// Largest logical size, in blocks, the block map region is sized for.
    pub max_logical_blocks: u64,
    /// Largest data device, in blocks, the refcount region is sized for.
    pub max_data_dev_blocks: u64,
}

impl GrowthRoom {
    /// No room: regions exactly as large as the volume needs.
    pub const NONE: GrowthRoom = GrowthRoom { max_logical_blocks: 0, max_data_dev_blocks: 0 };
    /// Share of the metadata area the default room may take: 1/64 (1.6%).
    pub const DEFAULT_SHARE_DIVISOR: u64 = 64;

    /// The default room: reference counts for a data device up to 4 times as large and a
    /// block map for twice the logical size, within 1/64 of the metadata area (the
    /// metadata device, else the data device); the counts get at most a quarter of it.
    pub fn default_for(logical_blocks: u64, data_dev_blocks: u64, meta_dev_blocks: Option<u64>) -> GrowthRoom {
        let budget_blocks = meta_dev_blocks.unwrap_or(data_dev_blocks) / Self::DEFAULT_SHARE_DIVISOR;
        let rc_pages = data_dev_blocks.div_ceil(RC_ENTRIES_PER_PAGE).max(1);
        let bm_pages = logical_blocks.div_ceil(BM_ENTRIES_PER_PAGE);
        let rc_extra = (3 * rc_pages).min(budget_blocks / 4 / 2);
        let bm_extra = bm_pages.min(budget_blocks.saturating_sub(2 * rc_extra) / 2);
        GrowthRoom {
            max_logical_blocks: (bm_pages + bm_extra).saturating_mul(BM_ENTRIES_PER_PAGE),
            max_data_dev_blocks: (rc_pages + rc_extra).saturating_mul(RC_ENTRIES_PER_PAGE),
        }
    }
}

/// Blocks of the metadata device a resize copies before the superblock names their new
/// place: `blocks` blocks from `from` to `to` (they never overlap).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionCopy {
    /// First source block.
    pub from: u64,
    /// First destination block.
    pub to: u64,
    /// Blocks copied.
    pub blocks: u64,
}

fn overlaps(a: &std::ops::Range<u64>, b: &std::ops::Range<u64>) -> bool {
    a.start < b.end && b.start < a.end && a.start < a.end && b.start < b.end
}

fn no_room(what: &str, blocks: u64, limit: u64) -> String {
    format!(
        "no free run of {blocks} blocks for the {what} in the metadata area ({limit} blocks); \
         a larger metadata device (or, without one, a volume formatted with more room) is needed"
    )
}

/// The lowest start of a free run of `len` blocks in `[SUPERBLOCK_BLOCKS, limit)`.
fn first_free(limit: u64, len: u64, taken: &[std::ops::Range<u64>]) -> Option<u64> {
    let mut starts: Vec<u64> = std::iter::once(SUPERBLOCK_BLOCKS).chain(taken.iter().map(|t| t.end)).collect();
    starts.sort_unstable();
    starts.into_iter().find(|&s| {
        let r = s..s.saturating_add(len);
        s >= SUPERBLOCK_BLOCKS && r.end <= limit && taken.iter().all(|t| !overlaps(&r, t))
    })
}

/// The largest free run in `[from, limit)` as (start, length).
fn largest_free(from: u64, limit: u64, taken: &[std::ops::Range<u64>]) -> (u64, u64) {
    let mut t: Vec<std::ops::Range<u64>> = taken.iter().filter(|r| r.start < r.end).cloned().collect();
    t.sort_by_key(|r| r.start);
    let mut best = (from, 0);
    let mut at = from;
    for r in t.iter().chain(std::iter::once(&(limit..limit))) {
        if r.start > at && r.start - at > best.1 {
            best = (at, r.start.min(limit) - at);
        }
        at = at.max(r.end);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_valid_and_refuse_tiny_devices() {
        let g = Geometry::compute(1 << 18, 256 << 20, None, 256, None, 256).expect("layout");
        assert!(g.data_blocks > 60_000);
        assert!(Geometry::compute(1 << 18, 1 << 20, None, 256, None, 256).is_err());
        let g2 = Geometry::compute(1 << 30, 256 << 20, Some(64 << 30), 256, None, 256).expect("meta layout");
        assert_eq!(g2.data_start, 2);
        assert!(Geometry::compute(1 << 30, 256 << 20, Some(1 << 20), 256, None, 256).is_err());
    }

    #[test]
    fn room_lets_regions_grow_in_place_and_no_further() {
        let room = GrowthRoom { max_logical_blocks: 1 << 19, max_data_dev_blocks: (512 << 20) / 4096 };
        let g = Geometry::compute_with_room(1 << 18, 256 << 20, None, 256, None, 256, room).expect("layout");
        assert!(g.max_logical_blocks() >= 1 << 19);
        let big = g.grown_in_place(1 << 19, g.data_dev_blocks).expect("grows into its room");
        assert_eq!(big.block_map_start, g.block_map_start);
        assert_eq!(big.index_start, g.index_start, "the ring does not move");
        assert!(g.grown_in_place((1 << 19) + 4096, g.data_dev_blocks).is_err(), "beyond the room");
        assert!(g.grown_in_place(1 << 18, g.data_dev_blocks - 1).is_err(), "the data device never shrinks");
        let wider = g.grown_in_place(1 << 18, (384 << 20) / 4096).expect("data device grows");
        assert_eq!(wider.data_blocks, (384 << 20) / 4096 - g.data_start);
        assert!(wider.refcount_pages > g.refcount_pages);
    }

    #[test]
    fn a_resize_beyond_the_room_takes_the_ring() {
        let g = Geometry::compute(1 << 16, 256 << 20, None, 256, None, 2048).expect("layout");
        assert_eq!(g.max_logical_blocks(), g.block_map_pages * BM_ENTRIES_PER_PAGE);
        let (big, copies) = g.plan_resize(1 << 17, g.data_dev_blocks, 0).expect("takes ring blocks");
        assert!(copies.is_empty(), "the block map extends over the ring");
        assert_eq!(big.block_map_start, g.block_map_start);
        assert!(big.index_blocks < g.index_blocks && big.index_blocks > 0);
        // The refcount region is boxed in by the block map: it moves, its pages copied.
        let (wide, copies) = g.plan_resize(1 << 16, g.data_dev_blocks * 2, 0).expect("counts move");
        assert_eq!(copies.len(), 1);
        assert_eq!(copies[0].from, g.refcount_start);
        assert_eq!(copies[0].to, wide.refcount_start);
        assert!(wide.refcount_pages * RC_ENTRIES_PER_PAGE >= wide.data_blocks);
        wide.validate().expect("valid");
        // Nothing fits: a clear refusal.
        assert!(g.plan_resize(1 << 30, g.data_dev_blocks, 0).is_err());
    }

    #[test]
    fn the_default_room_stays_within_its_share() {
        for (l, d) in [(1u64 << 18, 1u64 << 16), (1 << 28, 1 << 22), (1 << 16, 1 << 26)] {
            let room = GrowthRoom::default_for(l, d, None);
            let g = Geometry::compute_with_room(l, d * 4096, None, 256, None, 0, room).expect("layout");
            let plain = Geometry::compute(l, d * 4096, None, 256, None, 0).expect("layout");
            assert!(g.data_start - plain.data_start <= d / GrowthRoom::DEFAULT_SHARE_DIVISOR + 2);
            assert!(g.max_logical_blocks() >= l && g.max_data_dev_blocks() >= d);
        }
    }
}
