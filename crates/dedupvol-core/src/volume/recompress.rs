//! The recompressor: brings data at rest to where the volume wants it, while the volume
//! is idle. Two jobs, one pass:
//! - data stored with another codec than the volume's (the fast codec, when compression
//!   could not keep up with a burst, or a session opened with `OpenOptions::store_codec`)
//!   is brought to the volume's codec, so the volume ends at the ratio inline compression
//!   would have given;
//! - in a volume with a rest level (`FormatOptions::rest_level`), every fragment not yet
//!   settled is compressed again with zstd at that level and marked settled
//!   (`block_map::FRAG_SETTLED`): writes pay for a fast level, data at rest gets a strong
//!   one, once. Decoding costs the same at any zstd level, so reads lose nothing.
//!
//! Built on the cleaner's machinery: the same bounded scan, the same checked reads, the
//! same append to the open run and remap of mappings unchanged since the scan.
//!
//! A pass: (1) scans the block map in holds of `SCAN_LBAS_PER_HOLD` entries, collecting
//! every fragment not at rest (`Volume::at_rest`; at most `FOUND_MAX`); (2) groups them:
//! a unit whose live blocks are mapped in unit order (`placement`: each block at the
//! lowest logical block it is mapped at past the previous block's; duplicates elsewhere go
//! with it) is *ordered*, and ordered units that follow each other logically, at most
//! `RUN_GAP_BLOCKS` apart, are merged into one run and cut again into near-equal units of
//! at most `extent_blocks_max` blocks, as the write path cuts a run of chunks (so data
//! stored as single blocks, such as random overwrites, becomes extents again, across the
//! duplicates between them); a unit mapped only out of order is a group of its own, its
//! live blocks; (3) reads and decodes each group's fragments and checks every block
//! against its mappings' crcs, then compresses the group with the
//! target codec and level (no lock; the groups of a hold side by side on the volume's
//! pool); (4) under the state lock, appends the new unit to the open run (or stores its
//! blocks raw when the codec cannot shrink it), remaps every logical block still mapped
//! exactly as scanned, and records the new copies in the index; when settling, a group
//! whose move would not pay (`MOVE_GAIN_DIVISOR`) is instead marked settled in place.
//!
//! Decision, per fragment found by the scan:
//!
//! | at rest | its blocks in the open run or `Staging` | unit ordered | group |
//! |---|---|---|---|
//! | yes | – | – | not taken |
//! | no | yes | – | not taken (next pass: it is written by then) |
//! | no | no | yes | merged with the ordered units logically next to it |
//! | no | no | no | alone: its live blocks as one unit |
//!
//! Raw blocks are never taken: a block stored raw because compression was deferred looks
//! like one the probe found incompressible, and trying every raw block again would spend
//! the CPU on data that does not shrink. Deferral should store the fast codec instead.
//!
//! Invariants:
//! - As for the cleaner: a logical block is remapped only if its entry is still the one
//!   scanned, under the hold that appends the new copy; a fragment is moved only after
//!   every block of it that a mapping uses decoded to that mapping's crc.
//! - A group's new unit holds exactly its blocks, in the order the remap assumes, and at
//!   most `UNIT_BLOCKS_MAX` of them (asserted: blocks × 4 KiB = the bytes compressed).
//! - The mappings of one stored fragment carry the same entry bits, except that some may
//!   carry the mark and others not yet: marks set in place (`mark_settled`) are separate
//!   journal entries, so a crash between them, or a duplicate shared between a scan and
//!   its marks, leaves a fragment partly marked. The scan then finds only the unmarked
//!   mappings and a later pass marks them too; the mark never changes what a mapping
//!   decodes to.
//! - A settled fragment is never taken again (with the rest level on, it is at rest).
//! - The first idle pass after an open reads the whole block map once (what an earlier
//!   session left is not known); later passes run only when new mappings not at rest
//!   were made (`State::fast_codec_hint`).
//! - A pass compresses at most `RecompressOptions::budget_bytes` logical bytes (at least
//!   one group) and holds the state lock for at most `SCAN_LBAS_PER_HOLD` map entries or
//!   `GROUPS_PER_HOLD` groups at a time.
//! - Everything it writes goes through the commit path of client writes.
//! - When settling, groups of at most `dictionary::DICT_UNIT_BYTES_MAX` are compressed
//!   with the volume's dictionary. The first settling pass of a session that finds enough
//!   data trains and installs one first (`train_dictionary`, once a session); it is used
//!   only after `install_dictionary` returned, so a durable superblock names it before
//!   any fragment compressed with it is written. Training runs on the pass's thread, no
//!   lock held (about a second for its 8 MiB of samples; a client arriving meanwhile
//!   waits for the pass as for any other).

use super::scan::{scan_entries, Found, SCAN_LBAS_PER_HOLD};
use super::Volume;
use crate::config::Compression;
use crate::config::BLOCK_SIZE;
use crate::data::dictionary::Dictionary;
use crate::data::packer;
use crate::error::{Error, Result};
use crate::metadata::block_map::{Frag, MapEntry};
use std::collections::BTreeMap;

/// Groups placed per state-lock hold.
const GROUPS_PER_HOLD: usize = 16;
/// Fragments one pass collects at most (bounds its memory; the rest wait for the next).
const FOUND_MAX: usize = 1 << 20;

/// What a pass may do.
#[derive(Debug, Clone)]
pub struct RecompressOptions {
    /// Logical bytes a pass compresses at most (at least one group).
    pub budget_bytes: u64,
}

impl Default for RecompressOptions {
    fn default() -> Self {
        // 32 MiB: about a tenth of a second of zstd-1 on one core, and under half a second
        // of zstd-6 (the default rest level) on two: a client that comes back waits for
        // at most that before the idle work yields.
        RecompressOptions { budget_bytes: 32 << 20 }
    }
}

/// What a pass did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RecompressReport {
    /// Logical blocks scanned.
    pub scanned_blocks: u64,
    /// Fragments not at rest found (another codec, or not settled).
    pub fragments_found: u64,
    /// Fragments replaced.
    pub fragments_recompressed: u64,
    /// Logical bytes compressed again.
    pub bytes_recompressed: u64,
    /// Compressed bytes of the fragments replaced.
    pub bytes_before: u64,
    /// Bytes stored for them now.
    pub bytes_after: u64,
    /// Logical blocks remapped.
    pub blocks_remapped: u64,
    /// Fragments settled where they were (the rest level did not shrink them enough to be
    /// worth writing again): their mappings only gained the mark.
    pub fragments_marked: u64,
    /// Mappings that gained the mark in place.
    pub blocks_marked: u64,
    /// Block map pages the device could not read: skipped, what they map left as it is.
    pub map_pages_unreadable: u64,
    /// True when the pass stopped on its budget (or its collection bound) with fragments
    /// not at rest left.
    pub more: bool,
}

impl RecompressReport {
    /// Adds another pass's figures (`more` is the caller's to set).
    fn add(&mut self, r: &RecompressReport) {
        self.scanned_blocks += r.scanned_blocks;
        self.fragments_found += r.fragments_found;
        self.fragments_recompressed += r.fragments_recompressed;
        self.bytes_recompressed += r.bytes_recompressed;
        self.bytes_before += r.bytes_before;
        self.bytes_after += r.bytes_after;
        self.blocks_remapped += r.blocks_remapped;
        self.fragments_marked += r.fragments_marked;
        self.blocks_marked += r.blocks_marked;
        self.map_pages_unreadable += r.map_pages_unreadable;
    }
}

/// The fragments one new unit replaces: each with the blocks of its unit that go into it
/// (by index in the old unit, in order).
struct Group {
    members: Vec<(Found, Vec<usize>)>,
}

impl Group {
    fn blocks(&self) -> usize {
        self.members.iter().map(|(_, subs)| subs.len()).sum()
    }
}

/// A group read and compressed (no lock): its blocks, the new unit (None: store raw), the
/// fingerprints of its blocks when dedup is on.
struct Ready {
    blocks: Vec<u8>,
    frag: Option<Vec<u8>>,
    hashes: Vec<[u8; 32]>,
}

/// Logical blocks a run of units may skip between one unit's last live block and the
/// next unit's first and still be one run. The skipped blocks are mapped elsewhere
/// (duplicates of other data, blocks already at rest), zero, or unmapped: the write
/// path's extents skip such blocks too (a unit holds the unique chunks of a request, in
/// order), and data of 2/3 duplicates leaves a unique block every third one or so. A run
/// broken at every such block would be stored again as units of one or two blocks.
const RUN_GAP_BLOCKS: u64 = 16;

/// Where a unit's live blocks `subs` are, as (first, last) logical block, when they are
/// mapped in unit order: each block at the lowest logical block it is mapped at past the
/// previous block's (a block shared by several places, a duplicate, goes with the place
/// that keeps the order; its other mappings follow it when it moves). None for a unit
/// mapped only out of order.
fn placement(f: &Found, subs: &[usize]) -> Option<(u64, u64)> {
    let mut span: Option<(u64, u64)> = None;
    for &s in subs {
        let after = span.map(|(_, last)| last);
        let l =
            f.uses.iter().filter(|(l, e)| e.frag.sub() == s && after.is_none_or(|a| *l > a)).map(|(l, _)| *l).min()?;
        span = Some((span.map_or(l, |(first, _)| first), l));
    }
    span
}

/// Near-equal cut of a run of `run` blocks into units of at most `max`: a run of 20 makes
/// two of 10, not 16 and 4 (the write path's cut).
fn cut(run: usize, max: usize) -> Vec<usize> {
    let units = run.div_ceil(max.max(1));
    let size = run.div_ceil(units.max(1));
    let mut out = Vec::with_capacity(units);
    let mut left = run;
    while left > 0 {
        let n = size.min(left);
        out.push(n);
        left -= n;
    }
    out
}

/// Settling stores fragments again only where that pays, in one of two regimes chosen
/// per pass from every fragment the scan found:
/// - *compaction*, when the physical blocks those fragments touch hold at least
///   1/`HOLEY_DIVISOR` more than their bytes (random overwrites left them scattered among
///   dead ones, in blocks the cleaner leaves because they are more than half live): every
///   group is stored again, so that once all have moved those blocks are free;
/// - otherwise the groups of one hold (16 consecutive groups, for data written in
///   sequence one stretch of the device) are stored again together when their new
///   fragments save at least 1/`MOVE_GAIN_DIVISOR` of their bytes, and are marked settled
///   where they are when not. Deciding per stretch, not per fragment, matters: a fragment
///   moved out of blocks its neighbours keep alive frees nothing until they move too, so
///   moving the few that gain among many that do not (generated or already dense data)
///   would leave holes, and moving all of a stretch that gains nothing would write it
///   again for nothing.
const MOVE_GAIN_DIVISOR: u64 = 32;
/// See `MOVE_GAIN_DIVISOR`.
const HOLEY_DIVISOR: u64 = 8;

/// True when the fragments found touch at least 1/`HOLEY_DIVISOR` more block bytes than
/// they hold: the compaction regime of `MOVE_GAIN_DIVISOR`.
fn holey(found: &[Found]) -> bool {
    let bytes: u64 = found.iter().map(|f| u64::from(f.frag.len)).sum();
    let mut touched: Vec<u64> = Vec::with_capacity(found.len() * 2);
    for f in found {
        let first = f.uses.first().map_or(0, |(_, e)| e.pbn);
        touched.extend(first..first + f.frag.span());
    }
    touched.sort_unstable();
    touched.dedup();
    touched.len() as u64 * BLOCK_SIZE as u64 >= bytes + bytes / HOLEY_DIVISOR
}

/// True when group `g` may be marked settled in place: zstd units (another codec would
/// not be at rest with the mark). Several units that a move would regroup into one are
/// markable too (the regrouping is worth what it saves, like any move), and so is a unit
/// only some of whose mappings were found: the others may carry the mark already (a
/// crash between the marks of one fragment, or a duplicate shared between a scan and its
/// marks), and marking the rest makes the fragment whole again.
fn markable(g: &Group) -> bool {
    g.members.iter().all(|(f, _)| f.frag.compression() == Some(Compression::Zstd))
}

/// Which groups of one hold a settling pass stores again (true) rather than marks in
/// place (`MOVE_GAIN_DIVISOR`): every group that is not `markable`; the markable ones in
/// the compaction regime, or when together they save at least 1/`MOVE_GAIN_DIVISOR` of
/// their bytes; never one that would be stored raw (it keeps its smaller fragment).
fn moves(batch: &[Group], ready: &[Option<Ready>], compaction: bool) -> Vec<bool> {
    let new_len = |r: &Option<Ready>| r.as_ref().and_then(|r| r.frag.as_ref()).map(|f| f.len() as u64);
    let old_len = |g: &Group| g.members.iter().map(|(f, _)| u64::from(f.frag.len)).sum::<u64>();
    let (mut old, mut new) = (0u64, 0u64);
    for (g, r) in batch.iter().zip(ready) {
        if markable(g) {
            old += old_len(g);
            new += new_len(r).unwrap_or_else(|| old_len(g));
        }
    }
    let pays = compaction || new + old / MOVE_GAIN_DIVISOR <= old;
    batch.iter().zip(ready).map(|(g, r)| !markable(g) || (pays && new_len(r).is_some())).collect()
}

/// Groups the fragments found (see the module docs), in logical order.
fn group(found: Vec<Found>, extent_max: usize) -> Vec<Group> {
    let mut placed: Vec<(u64, u64, Found, Vec<usize>)> = Vec::new();
    let mut groups: Vec<(u64, Group)> = Vec::new();
    for f in found {
        let subs = f.live_subs();
        match placement(&f, &subs) {
            Some((first, last)) => placed.push((first, last, f, subs)),
            None => {
                let first = f.uses.iter().map(|(l, _)| *l).min().unwrap_or(0);
                groups.push((first, Group { members: vec![(f, subs)] }));
            }
        }
    }
    placed.sort_by_key(|p| p.0);
    // Runs of units in logical order, each unit's live blocks whole; a run is cut at unit
    // boundaries near the write path's cut (a unit is never split: its blocks are decoded
    // together, and a unit split across two new ones would keep no benefit).
    let mut run: Vec<(u64, Found, Vec<usize>)> = Vec::new();
    let flush = |run: &mut Vec<(u64, Found, Vec<usize>)>, groups: &mut Vec<(u64, Group)>| {
        let total: usize = run.iter().map(|(_, _, subs)| subs.len()).sum();
        let mut sizes = cut(total, extent_max).into_iter();
        let mut target = sizes.next().unwrap_or(total);
        let mut current = Group { members: Vec::new() };
        let mut first = 0;
        for (l0, f, subs) in run.drain(..) {
            if !current.members.is_empty() && current.blocks() + subs.len() > target {
                groups.push((first, std::mem::replace(&mut current, Group { members: Vec::new() })));
                target = sizes.next().unwrap_or(target);
            }
            if current.members.is_empty() {
                first = l0;
            }
            current.members.push((f, subs));
        }
        if !current.members.is_empty() {
            groups.push((first, current));
        }
    };
    let mut run_last: Option<u64> = None;
    for (first, last, f, subs) in placed {
        // Units that overlap logically, or lie too far apart, start a new run.
        if run_last.is_some_and(|end| first <= end || first - end > RUN_GAP_BLOCKS) {
            flush(&mut run, &mut groups);
        }
        run_last = Some(last);
        run.push((first, f, subs));
    }
    flush(&mut run, &mut groups);
    groups.sort_by_key(|(first, _)| *first);
    groups.into_iter().map(|(_, g)| g).collect()
}

impl Volume {
    /// True when fragment `f` is where the recompressor brings data: zstd marked settled
    /// in a volume with a rest level, else the volume's codec (marked or not).
    pub(crate) fn at_rest(&self, f: &Frag) -> bool {
        if self.rest_level() != 0 {
            f.settled() && f.compression() == Some(Compression::Zstd)
        } else {
            f.compression() == Some(self.volume_codec.0)
        }
    }

    /// The codec, level and mark the recompressor stores with.
    pub(super) fn rest_target(&self) -> (Compression, i8, bool) {
        let rest = self.rest_level();
        if rest != 0 {
            (Compression::Zstd, rest, true)
        } else {
            (self.volume_codec.0, self.volume_codec.1, false)
        }
    }

    /// The zstd level data at rest is brought to (0: none).
    pub fn rest_level(&self) -> i8 {
        self.rest_level.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Sets the volume's rest level (see `FormatOptions::rest_level`), on an open volume,
    /// durably (a new superblock generation), and returns the one it replaces. A volume
    /// without one gets format version 4 (5 when striped): builds that predate rest levels
    /// refuse it from then on. A level cannot be taken away again (0): settled fragments
    /// carry a mark those versions do not have. A new level applies to fragments not
    /// settled yet; settled ones keep theirs. The cleaner thread's next idle passes settle
    /// what is not at rest.
    pub fn set_rest_level(&self, level: i8) -> Result<i8> {
        self.check_writable()?;
        if self.volume_codec.0 != Compression::Zstd {
            return Err(Error::InvalidArgument(format!(
                "a rest level is a zstd level: this volume compresses with {}",
                self.volume_codec.0
            )));
        }
        if level == 0 {
            return Err(Error::InvalidArgument(
                "a rest level cannot be taken away: settled fragments carry a mark that volumes without one \
                 do not have (set level 1, the cheapest, instead)"
                    .into(),
            ));
        }
        if !(1..=crate::config::ZSTD_LEVEL_MAX).contains(&level) {
            return Err(Error::InvalidArgument(format!(
                "rest level {level}: a zstd level from 1 to {}",
                crate::config::ZSTD_LEVEL_MAX
            )));
        }
        self.set_superblock_setting(
            level,
            |sb| &mut sb.rest_level,
            |st| {
                self.rest_level.store(level, std::sync::atomic::Ordering::Release);
                // Fragments at rest under the old rule may not be under the new one: the next
                // pass looks at every fragment.
                st.fast_codec_hint = u64::MAX;
            },
        )
    }

    /// Changes one setting of the superblock durably (a new generation), under the locks
    /// every superblock writer takes, in their order (`grow`): commit, state, superblock.
    /// `field` picks the setting; a value already set writes nothing. A write that fails
    /// puts the old value back and fails the volume (the failed-volume rule: what reached
    /// the device is unknown, and the next open finds the old value or the new one, each
    /// in a whole superblock). `then` runs under the state lock after a write (where the
    /// volume's copy of the setting changes, so two changes cannot cross). Returns the old
    /// value.
    fn set_superblock_setting<T: Copy + PartialEq>(
        &self,
        value: T,
        field: impl Fn(&mut super::Superblock) -> &mut T,
        then: impl FnOnce(&mut super::state::State),
    ) -> Result<T> {
        let _c = self.commit_lock.lock();
        let mut st = self.state.lock();
        let mut sb = self.sb.lock();
        let old = *field(&mut sb);
        if old == value {
            return Ok(old);
        }
        *field(&mut sb) = value;
        if let Err(e) = super::lifecycle::write_superblock(self.data.dev(), self.separate_meta(), &mut sb) {
            *field(&mut sb) = old;
            return self.fail(e);
        }
        then(&mut st);
        Ok(old)
    }

    /// The largest extent formed now, in blocks: the volume's cap
    /// (`FormatOptions::extent_blocks_max`) or this open's (`OpenOptions::extent_blocks_max`),
    /// the smaller.
    pub fn extent_max(&self) -> u8 {
        self.extent_blocks_max.load(std::sync::atomic::Ordering::Acquire).min(self.extent_open_cap)
    }

    /// Sets the volume's extent cap (see `FormatOptions::extent_blocks_max`), on an open
    /// volume, durably (a new superblock generation), and returns the one it replaces
    /// (the largest unit when the volume had none set). It applies to what is written
    /// and settled from now on; extents already stored keep their size. No format version
    /// changes: a build that predates the setting opens the volume and ignores it.
    pub fn set_extent_blocks_max(&self, blocks: u8) -> Result<u8> {
        self.check_writable()?;
        crate::config::check_extent_blocks_max(blocks)?;
        let old = self.set_superblock_setting(
            blocks,
            |sb| &mut sb.extent_blocks_max,
            |_| {
                self.extent_blocks_max.store(blocks, std::sync::atomic::Ordering::Release);
            },
        )?;
        Ok(super::extent_setting(old))
    }

    /// Fragment bytes not at rest mapped since the last pass that found none (`u64::MAX`:
    /// not known since the open). Zero: a pass has nothing to do.
    pub fn recompress_hint(&self) -> u64 {
        self.state.lock().fast_codec_hint
    }

    /// One recompression pass (see the module docs). Read-only volumes, and volumes
    /// without compression, do nothing.
    pub fn recompress(&self, opts: &RecompressOptions) -> Result<RecompressReport> {
        let mut report = RecompressReport::default();
        let (codec, level, settle) = self.rest_target();
        if self.read_only {
            return Ok(report);
        }
        {
            let mut st = self.state.lock();
            // Mappings made from here on count towards the next pass.
            st.fast_codec_hint = 0;
            if codec == Compression::None {
                // Nothing to bring anything to: fragments of any codec stay as they are.
                return Ok(report);
            }
            st.red.recompress_passes += 1;
        }
        // (1) The map, in chunks.
        let mut frags: BTreeMap<(u64, u16), Found> = BTreeMap::new();
        let mut lba = 0;
        while lba < self.logical_blocks() {
            let end = (lba + SCAN_LBAS_PER_HOLD).min(self.logical_blocks());
            let mut st = self.state.lock();
            let next = scan_entries(&mut st.map, lba..end, &mut report.map_pages_unreadable, |l, e| {
                let Some(f) = e.fragment_of().filter(|f| !self.at_rest(f)) else { return };
                if frags.len() >= FOUND_MAX && !frags.contains_key(&(e.pbn, f.off)) {
                    report.more = true;
                    return;
                }
                frags.entry((e.pbn, f.off)).or_insert_with(|| Found { frag: f, uses: Vec::new() }).uses.push((l, e));
            })?;
            let durable = st.journal.durable_seq();
            st.map.evict(durable)?;
            drop(st);
            report.scanned_blocks += next - lba;
            lba = next;
        }
        report.fragments_found = frags.len() as u64;
        // Fragments still in memory (the open run, Staging) wait: the read below is of the
        // device.
        let found: Vec<Found> = {
            let st = self.state.lock();
            frags
                .into_values()
                .filter(|f| {
                    let first = f.uses.first().map_or(0, |(_, e)| e.pbn);
                    let waiting =
                        (first..first + f.frag.span()).any(|p| st.staging.get(p).is_some() || st.packer.is_open(p));
                    report.more |= waiting;
                    !waiting
                })
                .collect()
        };
        // (2) Groups.
        let compaction = settle && holey(&found);
        let groups = group(found, usize::from(self.extent_max()));
        // Data at rest is compressed with the volume's dictionary, trained from the first
        // pass that finds enough of it.
        let dict = if settle {
            self.train_dictionary(&groups)?;
            self.dictionary.lock().clone()
        } else {
            None
        };
        // (3) and (4), a few groups at a time.
        let mut groups = groups.into_iter().peekable();
        while groups.peek().is_some() {
            if report.bytes_recompressed >= opts.budget_bytes {
                report.more = true;
                break;
            }
            let batch: Vec<Group> = groups.by_ref().take(GROUPS_PER_HOLD).collect();
            let ready = self.read_groups(&batch, codec, level, dict.as_deref())?;
            let moving = if settle { moves(&batch, &ready, compaction) } else { vec![true; batch.len()] };
            let mut st = self.state.lock();
            for ((g, ready), moving) in batch.iter().zip(ready).zip(moving) {
                let Some(Ready { blocks, frag, hashes }) = ready else { continue };
                let n = blocks.len() / BLOCK_SIZE;
                assert_eq!(n, g.blocks(), "a group's new unit holds exactly its blocks");
                assert!(
                    (1..=usize::from(crate::metadata::block_map::UNIT_BLOCKS_MAX)).contains(&n),
                    "a group is at most one unit: whole units are never merged past the cut"
                );
                // Only mappings unchanged since the scan move.
                let mut still: Vec<Vec<(u64, MapEntry)>> = Vec::with_capacity(g.members.len());
                for (f, _) in &g.members {
                    let mut s = Vec::new();
                    for &(l, e) in &f.uses {
                        if st.map.get(l)? == e {
                            s.push((l, e));
                        }
                    }
                    still.push(s);
                }
                if still.iter().all(Vec::is_empty) {
                    continue;
                }
                if !moving {
                    // Settled where it is: the mark on its entries, no data written.
                    report.blocks_marked += self.mark_settled(&mut st, g, &still, &hashes)?;
                    report.fragments_marked += g.members.len() as u64;
                    report.bytes_recompressed += blocks.len() as u64;
                    continue;
                }
                let Some((entries, stored)) = self.store_unit(&mut st, &blocks, frag.as_deref(), settle)? else {
                    continue;
                };
                report.bytes_after += stored;
                report.bytes_recompressed += blocks.len() as u64;
                // Block `at + k` of the new unit is block `subs[k]` of member `m`.
                let mut at = 0usize;
                for ((f, subs), still) in g.members.iter().zip(still) {
                    for (l, e) in still {
                        let Some(k) = subs.iter().position(|&s| s == e.frag.sub()) else { continue };
                        let Some(&to) = entries.get(at + k) else { continue };
                        self.apply_entry(&mut st, l, MapEntry { crc: e.crc, ..to })?;
                        report.blocks_remapped += 1;
                    }
                    report.bytes_before += u64::from(f.frag.len);
                    report.fragments_recompressed += 1;
                    at += subs.len();
                }
                // The index follows the data, as for the cleaner's moves.
                for (hash, to) in hashes.iter().zip(&entries) {
                    st.dedup.record(hash, to);
                }
            }
            self.note_pressure(&st);
            let durable = st.journal.durable_seq();
            st.map.evict(durable)?;
            drop(st);
            self.commit_if_pressed()?;
        }
        let mut st = self.state.lock();
        st.red.recompress_fragments += report.fragments_recompressed;
        st.red.recompress_fragments_marked += report.fragments_marked;
        st.red.recompress_bytes += report.bytes_recompressed;
        st.red.recompress_bytes_saved += report.bytes_before.saturating_sub(report.bytes_after);
        if report.more {
            // Left for the next pass.
            st.fast_codec_hint = st.fast_codec_hint.max(1);
        }
        Ok(report)
    }

    /// Recompression passes until one finds nothing left to take, each followed by a
    /// flush (which also writes the open run, so fragments waiting in it are taken by the
    /// next pass), then cleaner passes over the holes the moves left: brings a whole
    /// volume to rest, as `import --settle` and the benchmarks do. `stop` is asked between
    /// passes. Returns the passes' reports summed; `more` says work was left (stopped, or
    /// two passes in a row took nothing: fragments that fail their checks stay where they
    /// are, for scrub to report).
    pub fn settle(&self, opts: &RecompressOptions, stop: &dyn Fn() -> bool) -> Result<RecompressReport> {
        let mut total = RecompressReport::default();
        let mut idle_passes = 0;
        loop {
            let r = self.recompress(opts)?;
            total.add(&r);
            self.flush()?;
            idle_passes = if r.fragments_recompressed + r.fragments_marked == 0 { idle_passes + 1 } else { 0 };
            total.more = r.fragments_found > 0;
            if r.fragments_found == 0 || idle_passes >= 2 || stop() {
                break;
            }
        }
        if total.fragments_recompressed > 0 {
            // Fragments moved out of blocks that others keep alive left holes there: the
            // cleaner's passes (one per window of the data region) compact the blocks
            // left at most half live, as the serving thread's cleaner would.
            let windows = self.geo.data_blocks.div_ceil(super::cleaner::WINDOW_BLOCKS);
            for _ in 0..windows {
                if stop() {
                    break;
                }
                self.clean(&super::cleaner::CleanOptions::default())?;
                self.flush()?;
            }
        }
        Ok(total)
    }

    /// Trains the volume's dictionary from the groups a settling pass found and installs
    /// it (`data::dictionary`): when the volume has a dictionary area and no dictionary,
    /// no pass of this session tried yet, and the groups hold at least
    /// `OpenOptions::dictionary_train_min_bytes`. Samples: every n-th group's blocks (about
    /// `TRAIN_SAMPLE_BYTES` in all), decoded and checked as for the move, in pieces of
    /// the units the dictionary is used for. A trainer that finds nothing to keep leaves
    /// the volume without one until the next session.
    fn train_dictionary(&self, groups: &[Group]) -> Result<()> {
        use crate::data::dictionary;
        use std::sync::atomic::Ordering;
        if self.geo.dict_blocks == 0
            || self.dictionary_tried.load(Ordering::Acquire)
            || self.dictionary.lock().is_some()
        {
            return Ok(());
        }
        let total: usize = groups.iter().map(|g| g.blocks() * BLOCK_SIZE).sum();
        if total < self.dictionary_train_min.max(1) || self.dictionary_tried.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let stride = total.div_ceil(dictionary::TRAIN_SAMPLE_BYTES).max(1);
        let mut data: Vec<Vec<u8>> = Vec::new();
        for g in groups.iter().step_by(stride) {
            if let Some(blocks) = self.gather_group(g)? {
                data.push(blocks);
            }
        }
        let samples: Vec<&[u8]> = data.iter().flat_map(|b| b.chunks(dictionary::DICT_UNIT_BYTES_MAX)).collect();
        let uuid = self.sb.lock().uuid;
        let id = dictionary::fresh_id(&uuid, samples.first().copied().unwrap_or(&[]));
        let Some(d) = dictionary::train(&samples, id) else { return Ok(()) };
        self.install_dictionary(d)
    }

    /// Makes `d` the volume's dictionary, durably: both copies written to the dictionary
    /// area and synced, then a superblock naming it (format version 6, 7 when striped);
    /// only then is it used. A failed write fails the volume (what reached the metadata
    /// device is unknown); a crash before the superblock leaves the area unnamed, and the
    /// next session trains again.
    pub(crate) fn install_dictionary(&self, d: Dictionary) -> Result<()> {
        self.check_writable()?;
        let area = self.geo.dict_area();
        if area.is_empty() {
            return Err(Error::InvalidArgument("this volume has no dictionary area (formatted before them)".into()));
        }
        let d = std::sync::Arc::new(d);
        crate::data::dictionary::register(&d)?;
        if let Err(e) = crate::data::dictionary::write_copies(&self.meta, &area, &d) {
            return self.fail(e);
        }
        self.set_superblock_setting(Some(d.info), |sb| &mut sb.dictionary, |_| {})?;
        *self.dictionary.lock() = Some(d);
        Ok(())
    }

    /// Marks a group's fragments settled where they are (state lock held): every mapping
    /// still as scanned gets the same entry with `FRAG_SETTLED` set, and the index records
    /// of the group's blocks name the marked entries, so later duplicates share the marked
    /// fragment. Only for zstd groups (`markable`). Returns the mappings marked.
    fn mark_settled(
        &self,
        st: &mut super::state::State,
        g: &Group,
        still: &[Vec<(u64, MapEntry)>],
        hashes: &[[u8; 32]],
    ) -> Result<u64> {
        let mut marked = 0;
        for still in still {
            for &(l, e) in still {
                let to = MapEntry { frag: e.frag.marked(), ..e };
                self.apply_entry(st, l, to)?;
                marked += 1;
            }
        }
        // The group's blocks, hence its hashes, are its members' `subs` in order.
        let mut hashes = hashes.iter();
        for (f, subs) in &g.members {
            let Some(&(_, e0)) = f.uses.first() else { continue };
            for &sub in subs {
                let Some(hash) = hashes.next() else { break };
                st.dedup.record(hash, &MapEntry::fragment(e0.pbn, f.frag.with_sub(sub).marked(), 0));
            }
        }
        Ok(marked)
    }

    /// Each group read, decoded and checked one after the other (its device reads in a
    /// fixed order: the simulator replays a seed's I/O calls exactly), then compressed
    /// side by side on the volume's pool (no lock). An error when the device gave no
    /// answer in time (`Volume::decode_found`).
    fn read_groups(
        &self,
        batch: &[Group],
        codec: Compression,
        level: i8,
        dict: Option<&Dictionary>,
    ) -> Result<Vec<Option<Ready>>> {
        let gathered: Vec<Option<Vec<u8>>> = batch.iter().map(|g| self.gather_group(g)).collect::<Result<_>>()?;
        let mut out: Vec<Option<Ready>> = batch.iter().map(|_| None).collect();
        {
            let jobs: Vec<Box<dyn FnOnce() + Send + '_>> = gathered
                .into_iter()
                .zip(out.iter_mut())
                .map(|(blocks, slot)| {
                    Box::new(move || *slot = blocks.map(|b| self.compress_group(b, codec, level, dict)))
                        as Box<dyn FnOnce() + Send + '_>
                })
                .collect();
            crate::pipeline::executor::Executor::run_all(&*self.exec, jobs);
        }
        Ok(out)
    }

    /// A group's blocks, decoded and checked (no lock); None when a member cannot be read
    /// or fails its check (the group then stays where it is, for the next pass or for
    /// scrub to report); an error when the device gave no answer in time (`decode_found`).
    fn gather_group(&self, g: &Group) -> Result<Option<Vec<u8>>> {
        let mut blocks = Vec::with_capacity(g.blocks() * BLOCK_SIZE);
        for (f, subs) in &g.members {
            let Some((_, unit)) = self.decode_found(f)? else { return Ok(None) };
            for &s in subs {
                let Some(b) = unit.get(s * BLOCK_SIZE..(s + 1) * BLOCK_SIZE) else { return Ok(None) };
                blocks.extend_from_slice(b);
            }
        }
        Ok(Some(blocks))
    }

    /// A group's blocks compressed with the target codec, and their fingerprints when
    /// dedup is on (no lock, no I/O).
    fn compress_group(&self, blocks: Vec<u8>, codec: Compression, level: i8, dict: Option<&Dictionary>) -> Ready {
        let frag = packer::compress_with(codec, level, &blocks, dict);
        let hashes = if self.dedup {
            // Side by side, as stage 1 hashes (`blake3_many`): the same digests.
            let inputs: Vec<&[u8]> = blocks.chunks_exact(BLOCK_SIZE).collect();
            let mut out = vec![[0u8; 32]; inputs.len()];
            crate::pipeline::blake3_many::hash_chunks(&inputs, &mut out);
            out
        } else {
            Vec::new()
        };
        Ready { blocks, frag, hashes }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::block_map::Frag;

    fn unit(l0: u64, n: u8) -> Found {
        let uses = (0..n).map(|s| (l0 + u64::from(s), MapEntry::fragment(100, Frag::new(1, 0, 10, n, s), 0))).collect();
        Found { frag: Frag::new(1, 0, 10, n, 0), uses }
    }

    #[test]
    fn the_cut_is_the_write_paths() {
        assert_eq!(cut(20, 16), vec![10, 10]);
        assert_eq!(cut(16, 16), vec![16]);
        assert_eq!(cut(33, 16), vec![11, 11, 11]);
        assert_eq!(cut(1, 16), vec![1]);
    }

    #[test]
    fn single_blocks_in_logical_order_become_extents_again() {
        let found: Vec<Found> = (0..20).rev().map(|l| unit(l, 1)).collect();
        let g = group(found, 16);
        assert_eq!(g.iter().map(Group::blocks).collect::<Vec<_>>(), vec![10, 10]);
        let first: Vec<u64> = g[0].members.iter().map(|(f, _)| f.uses[0].0).collect();
        assert_eq!(first, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn a_far_gap_ends_a_run_and_a_duplicate_elsewhere_does_not() {
        // 0..8, then 10..14 two blocks further on (mapped elsewhere: duplicates of other
        // data), then 40..44, more than `RUN_GAP_BLOCKS` on.
        let mut found = vec![unit(0, 4), unit(4, 4), unit(10, 4), unit(40, 4)];
        // Mapped in order at 44..46 and once more at 30: it joins the run at 40.
        let mut shared = unit(44, 2);
        shared.uses.push((30, MapEntry::fragment(100, Frag::new(1, 0, 10, 2, 1), 0)));
        found.push(shared);
        // Mapped only out of order: alone.
        let mut swapped = unit(60, 2);
        for (k, (l, _)) in swapped.uses.iter_mut().enumerate() {
            *l = 61 - k as u64;
        }
        found.push(swapped);
        let g = group(found, 16);
        assert_eq!(g.iter().map(Group::blocks).collect::<Vec<_>>(), vec![12, 6, 2]);
        let joined = &g[1];
        assert_eq!(joined.members.len(), 2);
        assert_eq!(joined.members[1].0.uses.len(), 3, "the duplicate's mapping goes with the unit");
    }

    #[test]
    fn single_blocks_between_duplicates_become_extents_again() {
        // Every third logical block holds a unique block, stored alone by a random write;
        // the blocks between are duplicates mapped elsewhere. 30 of them: two extents.
        let found: Vec<Found> = (0..30).map(|k| unit(3 * k, 1)).collect();
        let g = group(found, 16);
        assert_eq!(g.iter().map(Group::blocks).collect::<Vec<_>>(), vec![15, 15]);
    }

    #[test]
    fn a_unit_with_dead_blocks_joins_a_run_with_its_live_ones() {
        // Blocks 1 and 2 of a 4-block unit are dead (overwritten): its live ones, 0 and 3
        // at logical 8 and 11, join the single blocks around it.
        let mut holey = unit(8, 4);
        holey.uses.retain(|(_, e)| e.frag.sub() == 0 || e.frag.sub() == 3);
        let g = group(vec![unit(6, 1), holey, unit(12, 1)], 16);
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].members[1].1, vec![0, 3]);
        assert_eq!(g[0].blocks(), 4);
    }

    #[test]
    fn units_that_overlap_logically_are_not_merged() {
        // 0, 2, 4 and 1, 3, 5: interleaved, each in order.
        let mut a = unit(0, 3);
        let mut b = unit(1, 3);
        for (k, (l, _)) in a.uses.iter_mut().enumerate() {
            *l = 2 * k as u64;
        }
        for (k, (l, _)) in b.uses.iter_mut().enumerate() {
            *l = 1 + 2 * k as u64;
        }
        let g = group(vec![a, b], 16);
        assert_eq!(g.iter().map(Group::blocks).collect::<Vec<_>>(), vec![3, 3]);
    }

    #[test]
    fn whole_units_are_never_split() {
        let found = vec![unit(0, 12), unit(12, 12)];
        let g = group(found, 16);
        assert_eq!(g.iter().map(Group::blocks).collect::<Vec<_>>(), vec![12, 12]);
    }
}
