//! The engine under test, behind a small trait, so the driver and checker can be proven
//! on a toy engine (including deliberately broken ones) as well as run on the real one.
//!
//! Invariants:
//! - The driver reaches the engine only through this trait; the real engine's internals
//!   are read only to learn where its data region is, which superblock copy is the older,
//!   and which audit problems a persistent data fault can explain.
//! - Those interpretations err towards failing a seed: a problem the parser does not
//!   recognise is never excused.

use dedupvol_core::{check_volume, CheckReport, Error, FormatOptions, OpenOptions, Problem, Result, Storage, Volume};
use std::ops::Range;
use std::sync::Arc;

/// What the simulator needs from a volume engine.
pub trait SimEngine: Sized {
    /// A short name for reports.
    const NAME: &'static str;
    /// Formats a new volume.
    fn format(data: Arc<dyn Storage>, meta: Option<Arc<dyn Storage>>, opts: &FormatOptions) -> Result<()>;
    /// Opens (and recovers) a volume.
    fn open(data: Arc<dyn Storage>, meta: Option<Arc<dyn Storage>>, opts: &OpenOptions) -> Result<Self>;
    /// Reads at a byte offset.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()>;
    /// Writes at a byte offset.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()>;
    /// Writes several requests as one batch (applied in order; engines without batches
    /// write them one by one).
    fn write_many(&self, reqs: &[(u64, &[u8])], fua: bool) -> Result<()> {
        for &(offset, data) in reqs {
            self.write(offset, data, fua)?;
        }
        Ok(())
    }
    /// Makes completed writes durable.
    fn flush(&self) -> Result<()>;
    /// Discards a range (reads back as zeros).
    fn discard(&self, offset: u64, len: u64) -> Result<()>;
    /// Writes zeros to a range.
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()>;
    /// Clean shutdown.
    fn close(self) -> Result<()>;
    /// The engine's own in-memory invariant audit (diagnostics; Ok when it has none).
    fn audit(&self) -> std::result::Result<(), String> {
        Ok(())
    }
    /// Engine counters that show what a run reached (zero when the engine has none).
    fn coverage(&self) -> Coverage {
        Coverage::default()
    }
    /// Runs one step of the engine's background work the driver schedules itself (the
    /// fingerprint index's rebuild after an open); false when there is none left.
    fn background_step(&self) -> bool {
        false
    }
    /// Runs one cleaner pass (moves stored data, changes no content); the number of
    /// fragments moved. Engines without a cleaner move nothing.
    fn clean(&self, _budget_bytes: u64, _live_max: u32) -> Result<u64> {
        Ok(0)
    }
    /// Runs one recompression pass (stores data of another codec again with the volume's,
    /// changes no content); the number of fragments replaced. Engines without one do
    /// nothing.
    fn recompress(&self, _budget_bytes: u64) -> Result<u64> {
        Ok(0)
    }
    /// The id of the volume's trained dictionary (None: none, or no such thing).
    fn dictionary(&self) -> Option<u32> {
        None
    }
    /// True when the engine has rest levels (`set_rest_level`): the driver gives them only
    /// to such engines.
    const REST_LEVELS: bool = false;
    /// Gives the open volume a rest level (or another one); the level it replaces.
    /// Engines without rest levels keep none (Ok(0) for level 0 only).
    fn set_rest_level(&self, level: i8) -> Result<i8> {
        if level == 0 {
            Ok(0)
        } else {
            Err(Error::InvalidArgument("this engine has no rest levels".into()))
        }
    }
    /// The open volume's rest level (0: none).
    fn rest_level(&self) -> i8 {
        0
    }
    /// True when the engine has an extent cap that can change (`set_extent_blocks_max`).
    const EXTENT_CAPS: bool = false;
    /// Sets the open volume's extent cap; the cap it replaces.
    fn set_extent_blocks_max(&self, _blocks: u8) -> Result<u8> {
        Err(Error::InvalidArgument("this engine has no extent cap".into()))
    }
    /// The open volume's extent cap, in blocks.
    fn extent_blocks_max(&self) -> u8 {
        dedupvol_core::format::UNIT_BLOCKS_MAX
    }
    /// Audits a closed volume.
    fn check(data: Arc<dyn Storage>, meta: Option<Arc<dyn Storage>>) -> Result<CheckReport>;
    /// The byte range of the data device that holds only data blocks (where persistent
    /// faults are survivable), read from a freshly formatted, synced volume.
    fn data_region(data: &dyn Storage, has_meta: bool) -> Option<Range<u64>>;
    /// Given the media content of the two superblock copies of a device (`role` 0 data,
    /// 1 metadata), which copy may be corrupted with the volume still recoverable: a copy
    /// whose generation is not higher than the other, valid, copy. None when unsure.
    fn corruptible_superblock_copy(_copies: [&[u8]; 2], _role: u8) -> Option<usize> {
        None
    }
    /// When an audit problem can be a consequence of a persistent fault on data blocks,
    /// the blocks it can come from, relative to the data region (such problems are expected
    /// where the simulator injected a persistent fault, and only there).
    fn corrupt_data_block(_problem: &Problem) -> Option<std::ops::Range<u64>> {
        None
    }
}

/// What the engine reached during a run: evidence that the corner cases were exercised.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Coverage {
    /// Checkpoints (journal space reclaimed).
    pub checkpoints: u64,
    /// Group commits.
    pub commits: u64,
    /// Dedup hits.
    pub dedup_hits: u64,
    /// Duplicates stored again because the reference count was at its cap.
    pub refcount_cap_copies: u64,
    /// Packed blocks written.
    pub packed_blocks_written: u64,
    /// Block map pages read on a cache miss.
    pub block_map_cache_misses: u64,
    /// Highest percentage of data blocks in use seen at a close.
    pub data_used_pct_max: u64,
    /// Checkpoint writes shared with their journal copy (write-once journaling).
    pub woj_hits: u64,
    /// WOJ candidates whose bytes differed from the write (weak hash collisions).
    pub woj_collisions: u64,
    /// Fingerprint records the index rebuilds after opens read from the chapter ring.
    pub index_rebuild_records: u64,
    /// Record pages of the chapter ring the rebuilds skipped (torn, stale, never written).
    pub index_rebuild_pages_skipped: u64,
    /// Chapters the rebuilds covered (from their names, or their records).
    pub index_rebuild_chapters: u64,
    /// Of those, chapters rebuilt from their record pages: names incomplete (the chapter
    /// open at a crash, torn or lost name pages).
    pub index_rebuild_chapters_without_names: u64,
}

impl Coverage {
    /// Adds `o` into `self` (maximum for the percentage).
    pub fn add(&mut self, o: &Coverage) {
        self.checkpoints += o.checkpoints;
        self.commits += o.commits;
        self.dedup_hits += o.dedup_hits;
        self.refcount_cap_copies += o.refcount_cap_copies;
        self.packed_blocks_written += o.packed_blocks_written;
        self.block_map_cache_misses += o.block_map_cache_misses;
        self.data_used_pct_max = self.data_used_pct_max.max(o.data_used_pct_max);
        self.woj_hits += o.woj_hits;
        self.woj_collisions += o.woj_collisions;
        self.index_rebuild_records += o.index_rebuild_records;
        self.index_rebuild_pages_skipped += o.index_rebuild_pages_skipped;
        self.index_rebuild_chapters += o.index_rebuild_chapters;
        self.index_rebuild_chapters_without_names += o.index_rebuild_chapters_without_names;
    }
}

/// The real engine.
impl SimEngine for Volume {
    const REST_LEVELS: bool = true;
    const NAME: &'static str = "dedupvol";
    fn format(data: Arc<dyn Storage>, meta: Option<Arc<dyn Storage>>, opts: &FormatOptions) -> Result<()> {
        Volume::format(data, meta, opts, false)
    }
    fn open(data: Arc<dyn Storage>, meta: Option<Arc<dyn Storage>>, opts: &OpenOptions) -> Result<Self> {
        Volume::open(data, meta, opts)
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        Volume::read(self, offset, buf)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        Volume::write(self, offset, data, fua)
    }
    fn write_many(&self, reqs: &[(u64, &[u8])], fua: bool) -> Result<()> {
        Volume::write_many(self, reqs, fua)
    }
    fn flush(&self) -> Result<()> {
        Volume::flush(self)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        Volume::discard(self, offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        Volume::write_zeroes(self, offset, len, fua)
    }
    fn close(self) -> Result<()> {
        Volume::close(self)
    }
    fn check(data: Arc<dyn Storage>, meta: Option<Arc<dyn Storage>>) -> Result<CheckReport> {
        check_volume(data, meta, false)
    }
    fn background_step(&self) -> bool {
        self.index_rebuild_step()
    }
    fn clean(&self, budget_bytes: u64, live_max: u32) -> Result<u64> {
        Volume::clean(self, &dedupvol_core::CleanOptions { budget_bytes, live_max }).map(|r| r.fragments_moved)
    }
    fn recompress(&self, budget_bytes: u64) -> Result<u64> {
        Volume::recompress(self, &dedupvol_core::RecompressOptions { budget_bytes }).map(|r| r.fragments_recompressed)
    }
    fn dictionary(&self) -> Option<u32> {
        self.stats().dictionary.map(|d| d.0)
    }
    fn set_rest_level(&self, level: i8) -> Result<i8> {
        Volume::set_rest_level(self, level)
    }
    fn rest_level(&self) -> i8 {
        Volume::rest_level(self)
    }
    const EXTENT_CAPS: bool = true;
    fn set_extent_blocks_max(&self, blocks: u8) -> Result<u8> {
        Volume::set_extent_blocks_max(self, blocks)
    }
    fn extent_blocks_max(&self) -> u8 {
        Volume::extent_max(self)
    }
    fn audit(&self) -> std::result::Result<(), String> {
        self.audit_memory()
    }
    fn coverage(&self) -> Coverage {
        let s = self.stats();
        let c = &s.counters;
        Coverage {
            checkpoints: c.checkpoints,
            commits: c.commits,
            dedup_hits: c.dedup_hits,
            refcount_cap_copies: c.refcount_cap_copies,
            packed_blocks_written: c.packed_blocks_written,
            block_map_cache_misses: c.block_map_cache_misses,
            data_used_pct_max: s.data_blocks_used * 100 / s.data_blocks_total.max(1),
            woj_hits: s.woj.as_ref().map_or(0, |w| w.hits),
            woj_collisions: s.woj.as_ref().map_or(0, |w| w.collisions),
            index_rebuild_records: s.index.rebuild_records,
            index_rebuild_pages_skipped: s.index.rebuild_pages_skipped,
            index_rebuild_chapters: s.index.rebuild_chapters_done,
            index_rebuild_chapters_without_names: s.index.rebuild_chapters_without_names,
        }
    }
    fn data_region(data: &dyn Storage, _has_meta: bool) -> Option<Range<u64>> {
        let mut buf = vec![0u8; 4096];
        for copy in 0..2u64 {
            if data.read_at(&mut buf, copy * 4096).is_err() {
                continue;
            }
            if let Ok(Some(sb)) = dedupvol_core::format::Superblock::decode(&buf, 0) {
                let g = sb.geometry;
                return Some(g.data_start * 4096..(g.data_start + g.data_blocks) * 4096);
            }
        }
        None
    }
    fn corruptible_superblock_copy(copies: [&[u8]; 2], role: u8) -> Option<usize> {
        use dedupvol_core::format::Superblock;
        let a = Superblock::decode(copies[0], role).ok()??;
        let b = Superblock::decode(copies[1], role).ok()??;
        // Equal generations hold the same state: either copy may go. Otherwise only the
        // older one: falling back to it would lose a completed superblock update.
        Some(if a.generation <= b.generation { 0 } else { 1 })
    }
    fn corrupt_data_block(problem: &Problem) -> Option<std::ops::Range<u64>> {
        // A checksum mismatch or an unreadable block: the audit detected the damage.
        // "Used twice" (raw or packed slot): a lost or misdirected write left a block's old
        // content in place, a stale index entry pointed a duplicate of that old content at
        // it, and byte verification (rightly) matched it — the engine returned no wrong
        // data, but the block now has references with two contents.
        problem.data_blocks()
    }
}

/// Turns an engine error into a short line.
pub fn short(e: &Error) -> String {
    let s = e.to_string();
    if s.len() > 300 {
        format!("{}…", &s[..s.char_indices().take_while(|(i, _)| *i < 300).last().map_or(0, |(i, _)| i)])
    } else {
        s
    }
}
