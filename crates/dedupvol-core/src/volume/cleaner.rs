//! The cleaner: compacts partly dead blocks of compressed data. Overwrites and discards
//! leave fragments without references inside blocks that other fragments keep alive
//! (a block is freed only when nothing touches it), so their bytes are lost space. A pass
//! finds blocks whose live fragments fill little of them, copies those fragments as they
//! are (still compressed) into the open run, and remaps the logical blocks that use them;
//! the old blocks then lose their last references and are freed.
//!
//! A pass: (1) scans the block map in bounded chunks under short state-lock holds,
//! collecting every data mapping into a window of the data region (at most
//! `WINDOW_BLOCKS` blocks, the window moving on each pass); (2) sums each block's live
//! bytes (every distinct fragment once, raw blocks as full; an extent of which only some
//! blocks are still mapped counts for that share of its bytes) and takes as victims the
//! blocks with at most `CleanOptions::live_max` live bytes; (3) reads each live fragment
//! touching a victim (no lock), checks it decodes to its mappings' checksums, and (4)
//! under the state lock appends it to the open run and remaps the logical blocks still
//! mapped to it, as journalled mapping changes like any write. A fragment whose unit is
//! whole is copied as it is; an extent with dead blocks is rewritten: its live blocks are
//! compressed again as a smaller unit (or alone), so its dead blocks go. In a volume with a
//! rest level (and space not short), what moves is stored at rest at once: compressed at
//! the rest level and marked settled (or, a zstd fragment that would not shrink, copied
//! and marked), so that the recompressor does not move it a second time. Compression
//! happens in step (3), without the lock.
//!
//! Invariants:
//! - Correctness never rests on the scan being complete or current: a logical block is
//!   remapped only if its entry is still exactly the one scanned, under the same lock
//!   hold as the append; a block still mapped to the old fragment keeps it alive (its
//!   blocks keep their counts), so a missed or newer reference costs space, never data.
//! - A fragment is moved only after its bytes decoded to the crc of a mapping that still
//!   uses it; its blocks cannot have been reused meanwhile, since a live reference keeps
//!   every block it touches.
//! - A pass moves at most `CleanOptions::budget_bytes` and holds the state lock for at
//!   most `SCAN_LBAS_PER_HOLD` map entries or `MOVES_PER_HOLD` fragments at a time.
//! - The new copies reach the device, and the old blocks are freed, through the same
//!   commit path as client writes (the durability contract is unchanged).
//! - A map page the device cannot read is asked for once, not once per entry of the page
//!   under the state lock (`scan_entries`): it is skipped whole (what it maps stays, the
//!   rest is cleaned), or, when the device gave no answer in time, it ends the pass with
//!   the error. So does a fragment's read the device gave no answer to in time
//!   (`decode_found`).

use super::scan::{scan_entries, Found, SCAN_LBAS_PER_HOLD};
use super::Volume;
use crate::config::{BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::data::packer;
use crate::error::Result;
use crate::io::IoKind;
use crate::metadata::block_map::{Frag, MapEntry};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Fragments moved per state-lock hold.
const MOVES_PER_HOLD: usize = 64;
/// Data blocks one pass considers at most (4 GiB of data): bounds its memory.
pub(super) const WINDOW_BLOCKS: u64 = 1 << 20;
/// Mappings one pass collects at most; past it, the rest keep their fragments alive.
const SCANNED_MAX: usize = 4 << 20;

/// What a pass may do.
#[derive(Debug, Clone)]
pub struct CleanOptions {
    /// Compressed bytes a pass moves at most.
    pub budget_bytes: u64,
    /// A block with at most this many live bytes is a victim.
    pub live_max: u32,
}

impl Default for CleanOptions {
    fn default() -> Self {
        // A victim at most half full: moving its live half frees a whole block, so the
        // cleaner writes at most one byte for each byte it frees.
        CleanOptions { budget_bytes: 64 << 20, live_max: (BLOCK_SIZE / 2) as u32 }
    }
}

/// What a pass did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CleanReport {
    /// Logical blocks scanned.
    pub scanned_blocks: u64,
    /// Blocks taken as victims.
    pub victims: u64,
    /// Fragments moved.
    pub fragments_moved: u64,
    /// Compressed bytes written again.
    pub bytes_moved: u64,
    /// Logical blocks remapped.
    pub blocks_remapped: u64,
    /// Block map pages the device could not read: skipped, what they map kept.
    pub map_pages_unreadable: u64,
    /// Data blocks in use before and after the pass (the freed ones count once the moves
    /// are durable).
    pub used_before: u64,
    /// See `used_before`.
    pub used_after: u64,
}

/// A fragment the cleaner moves: what it stores, and the fingerprint of each live block
/// (by index in the old unit) when dedup is on, so the index follows the move.
struct Read {
    moved: Moved,
    hashes: Vec<(usize, [u8; 32])>,
}

/// What the cleaner stores for a fragment it moves.
enum Moved {
    /// The fragment's bytes, unchanged; marked settled when true (a zstd fragment that
    /// the rest level would not shrink).
    Copy(Vec<u8>, bool),
    /// Blocks of the unit stored again: the live blocks (decoded, in unit order), their
    /// old indexes, their new fragment (compressed without the state lock; None: stored
    /// raw), and whether it is a settled one (compressed at the rest level).
    Rewrite { blocks: Vec<u8>, subs: Vec<usize>, frag: Option<Vec<u8>>, settled: bool },
}

impl Volume {
    /// True when the volume was opened read-only.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Dead-space hint: compressed bytes dropped from the map since the last pass.
    pub fn dead_bytes_hint(&self) -> u64 {
        self.state.lock().red.dead_fragment_bytes_hint
    }

    /// True when fewer than 1/`SPACE_SHORT_DIVISOR` of the data blocks can be handed out:
    /// the cleaner thread then runs its passes without pacing.
    pub fn space_short(&self) -> bool {
        let free = self.state.lock().alloc.free_blocks();
        free < self.data.blocks() / SPACE_SHORT_DIVISOR
    }

    /// One cleaner pass (see the module docs). Read-only volumes do nothing.
    pub fn clean(&self, opts: &CleanOptions) -> Result<CleanReport> {
        let mut report = CleanReport::default();
        if self.read_only {
            return Ok(report);
        }
        let (window, used_before) = {
            let mut st = self.state.lock();
            st.red.dead_fragment_bytes_hint = 0;
            st.red.cleaner_passes += 1;
            let blocks = self.data.blocks();
            let start = if blocks <= WINDOW_BLOCKS { 0 } else { st.cleaner_window % blocks };
            st.cleaner_window = start + WINDOW_BLOCKS;
            (start..(start + WINDOW_BLOCKS).min(blocks), st.rc.used_blocks())
        };
        report.used_before = used_before;
        // (1) The map, in chunks.
        let mut raw: Vec<u64> = Vec::new();
        let mut frags: BTreeMap<(u64, u16), Found> = BTreeMap::new();
        let mut collected = 0usize;
        let mut lba = 0;
        while lba < self.logical_blocks() && collected < SCANNED_MAX {
            let end = (lba + SCAN_LBAS_PER_HOLD).min(self.logical_blocks());
            let mut st = self.state.lock();
            let next = scan_entries(&mut st.map, lba..end, &mut report.map_pages_unreadable, |l, e| {
                if !e.is_data() || !window.contains(&e.pbn) {
                    return;
                }
                collected += 1;
                match e.fragment_of() {
                    None => raw.push(e.pbn),
                    Some(f) => frags
                        .entry((e.pbn, f.off))
                        .or_insert_with(|| Found { frag: f, uses: Vec::new() })
                        .uses
                        .push((l, e)),
                }
            })?;
            let durable = st.journal.durable_seq();
            st.map.evict(durable)?;
            drop(st);
            report.scanned_blocks += next - lba;
            lba = next;
        }
        // (2) Live bytes per block, and the victims.
        let mut live: HashMap<u64, u32> = HashMap::new();
        for p in raw {
            live.insert(p, BLOCK_SIZE as u32);
        }
        for (&(pbn, off), f) in &frags {
            let share = f.live_subs().len() as u64;
            let unit = f.frag.unit_blocks() as u64;
            let mut at = u64::from(off);
            let mut left = u64::from(f.frag.len);
            let mut p = pbn;
            while left > 0 {
                let here = left.min(BLOCK_SIZE_U64 - at);
                *live.entry(p).or_default() += (here * share).div_ceil(unit) as u32;
                left -= here;
                at = 0;
                p += 1;
            }
        }
        let victims: std::collections::HashSet<u64> = {
            let st = self.state.lock();
            live.iter()
                .filter(|&(&p, &b)| {
                    b <= opts.live_max && st.rc.get(p) > 0 && st.staging.get(p).is_none() && !st.packer.is_open(p)
                })
                .map(|(&p, _)| p)
                .collect()
        };
        report.victims = victims.len() as u64;
        // With a rest level, what moves is stored at rest at once (the recompressor would
        // otherwise move it a second time), unless space is short: then the faster codec.
        let settle = self.rest_level() != 0 && !self.space_short();
        // (3) and (4): the fragments touching a victim, in device order.
        let mut moving: Vec<Found> = frags
            .into_values()
            .filter(|f| {
                let first = f.uses.first().map_or(0, |(_, e)| e.pbn);
                (first..first + f.frag.span()).any(|p| victims.contains(&p))
            })
            .collect();
        // Emptiest victims first: the budget goes where a byte moved frees the most.
        let emptiest = |f: &Found| {
            let first = f.uses.first().map_or(0, |(_, e)| e.pbn);
            (first..first + f.frag.span()).filter_map(|p| live.get(&p).filter(|_| victims.contains(&p))).min().copied()
        };
        moving.sort_by_key(|f| (emptiest(f), f.uses.first().map(|(_, e)| (e.pbn, e.frag.off))));
        // Data stored at rest is compressed with the volume's dictionary where it applies.
        let dict = if settle { self.dictionary.lock().clone() } else { None };
        for batch in moving.chunks(MOVES_PER_HOLD) {
            if report.bytes_moved >= opts.budget_bytes {
                break;
            }
            let read: Vec<Option<Read>> =
                batch.iter().map(|f| self.read_fragment(f, settle, dict.as_deref())).collect::<Result<_>>()?;
            let mut st = self.state.lock();
            for (f, read) in batch.iter().zip(read) {
                let Some(Read { moved, hashes }) = read else { continue };
                let mut still: Vec<(u64, MapEntry)> = Vec::new();
                for &(l, e) in &f.uses {
                    if st.map.get(l)? == e {
                        still.push((l, e));
                    }
                }
                if still.is_empty() {
                    continue;
                }
                // Where each old block of the unit goes now.
                let placed: Vec<(usize, MapEntry)> = match moved {
                    Moved::Copy(bytes, mark) => {
                        let Some((pbn, off)) = self.pack(&mut st, &bytes)? else { continue };
                        report.bytes_moved += bytes.len() as u64;
                        (0..f.frag.unit_blocks())
                            .map(|sub| {
                                let g = Frag { off, ..f.frag.with_sub(sub) };
                                (sub, MapEntry::fragment(pbn, if mark { g.marked() } else { g }, 0))
                            })
                            .collect()
                    }
                    Moved::Rewrite { blocks, subs, frag, settled } => {
                        let Some(stored) = self.store_unit(&mut st, &blocks, frag.as_deref(), settled)? else {
                            continue;
                        };
                        report.bytes_moved += stored.1;
                        subs.into_iter().zip(stored.0).collect()
                    }
                };
                for (l, e) in still {
                    let Some(&(_, to)) = placed.iter().find(|(sub, _)| *sub == e.frag.sub()) else { continue };
                    self.apply_entry(&mut st, l, MapEntry { crc: e.crc, ..to })?;
                    report.blocks_remapped += 1;
                }
                // The index follows the data: a later duplicate finds the new copy (the old
                // records fail verification once their blocks are freed).
                for (sub, hash) in hashes {
                    if let Some(&(_, to)) = placed.iter().find(|(s, _)| *s == sub) {
                        st.dedup.record(&hash, &to);
                    }
                }
                report.fragments_moved += 1;
            }
            self.note_pressure(&st);
            let durable = st.journal.durable_seq();
            st.map.evict(durable)?;
            drop(st);
            self.commit_if_pressed()?;
        }
        {
            let mut st = self.state.lock();
            st.red.cleaner_bytes_moved += report.bytes_moved;
            st.red.cleaner_fragments_moved += report.fragments_moved;
            st.red.cleaner_blocks_remapped += report.blocks_remapped;
            report.used_after = st.rc.used_blocks();
        }
        Ok(report)
    }

    /// A live fragment as the cleaner stores it again (its bytes when every block of its
    /// unit is mapped, else its live blocks decoded and compressed again), checked against
    /// the crc of every mapping that names it (each names one block of its unit); None
    /// when it cannot be read or does not decode to them (it is then left where it is); an
    /// error when the device gave no answer in time (`decode_found`).
    /// With `settle` (a rest level, space not short), a fragment not at rest is stored at
    /// the rest level and marked settled: a whole unit compressed again when that shrinks
    /// it, else its bytes copied and marked (zstd only; other codecs are copied as they
    /// are, for the recompressor).
    /// `dict`: the volume's dictionary, for what is stored at rest.
    fn read_fragment(
        &self,
        f: &Found,
        settle: bool,
        dict: Option<&crate::data::dictionary::Dictionary>,
    ) -> Result<Option<Read>> {
        let Some((bytes, unit)) = self.decode_found(f)? else { return Ok(None) };
        let subs = f.live_subs();
        let hashes = if self.dedup {
            // Side by side, as stage 1 hashes (`blake3_many`): a unit's live blocks at once.
            let blocks: Vec<(usize, &[u8])> =
                subs.iter().filter_map(|&s| unit.get(s * BLOCK_SIZE..(s + 1) * BLOCK_SIZE).map(|b| (s, b))).collect();
            let inputs: Vec<&[u8]> = blocks.iter().map(|&(_, b)| b).collect();
            let mut out = vec![[0u8; 32]; inputs.len()];
            crate::pipeline::blake3_many::hash_chunks(&inputs, &mut out);
            blocks.iter().map(|&(s, _)| s).zip(out).collect()
        } else {
            Vec::new()
        };
        let settle = settle && !self.at_rest(&f.frag);
        let (rest_codec, rest_level, _) = self.rest_target();
        let dict = dict.filter(|_| settle);
        if subs.len() == f.frag.unit_blocks() {
            if settle {
                match packer::compress_with(rest_codec, rest_level, &unit, dict) {
                    Some(z) if z.len() < bytes.len() => {
                        let moved = Moved::Rewrite { blocks: unit, subs, frag: Some(z), settled: true };
                        return Ok(Some(Read { moved, hashes }));
                    }
                    _ if f.frag.compression() == Some(crate::config::Compression::Zstd) => {
                        return Ok(Some(Read { moved: Moved::Copy(bytes, true), hashes }));
                    }
                    _ => {}
                }
            }
            return Ok(Some(Read { moved: Moved::Copy(bytes, false), hashes }));
        }
        let live: Vec<u8> =
            subs.iter().filter_map(|&s| unit.get(s * BLOCK_SIZE..(s + 1) * BLOCK_SIZE)).flatten().copied().collect();
        let (codec, level) = if settle { (rest_codec, rest_level) } else { self.volume_codec };
        let frag = packer::compress_with(codec, level, &live, dict);
        Ok(Some(Read { moved: Moved::Rewrite { blocks: live, subs, frag, settled: settle }, hashes }))
    }

    /// A live fragment's bytes and its whole unit decoded (no lock), checked against the
    /// crc of every mapping that names it; None when it cannot be read or does not decode
    /// to them. An error when the device gave no answer in time (`Error::is_timeout`): the
    /// pass ends, rather than waiting out a timeout for each fragment left (a server
    /// stopping waits for the pass).
    pub(super) fn decode_found(&self, f: &Found) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
        let Some((_, e0)) = f.uses.first() else { return Ok(None) };
        let mut span = vec![0u8; f.frag.span() as usize * BLOCK_SIZE];
        let cached: Vec<_> = {
            let mut c = self.cache.lock();
            e0.blocks().map_while(|p| c.get(p)).collect()
        };
        if cached.len() as u64 == e0.span() {
            for (dst, b) in span.chunks_exact_mut(BLOCK_SIZE).zip(cached) {
                dst.copy_from_slice(&b);
            }
        } else {
            match self.data.read(IoKind::Data, e0.pbn, &mut span, "block map entry") {
                Ok(()) => {}
                Err(e) if e.is_timeout() => return Err(e),
                Err(_) => return Ok(None),
            }
        }
        let Ok(bytes) = packer::fragment_bytes(e0.pbn, &f.frag, &span).map(<[u8]>::to_vec) else { return Ok(None) };
        let mut unit = vec![0u8; f.frag.unit_blocks() * BLOCK_SIZE];
        if packer::decompress(e0.pbn, &f.frag, &bytes, &mut unit).is_err() {
            return Ok(None);
        }
        let ok = f.uses.iter().all(|(_, e)| {
            let at = e.frag.sub() * BLOCK_SIZE;
            unit.get(at..at + BLOCK_SIZE).is_some_and(|b| crc32c::crc32c(b) == e.crc)
        });
        Ok(ok.then_some((bytes, unit)))
    }

    /// Stores whole blocks already compressed as `frag` (state lock held; compressed as one
    /// unit, or alone for one block), or raw when `frag` is None; returns each block's new
    /// entry (crc 0: the caller's) and the bytes written, None when no run can take the
    /// unit. The fragment is of the volume's codec, or, when `settled`, of the
    /// recompressor's target codec and marked settled.
    pub(super) fn store_unit(
        &self,
        st: &mut super::state::State,
        blocks: &[u8],
        frag: Option<&[u8]>,
        settled: bool,
    ) -> Result<Option<(Vec<MapEntry>, u64)>> {
        let n = blocks.len() / BLOCK_SIZE;
        let codec = if settled { self.rest_target().0 } else { self.volume_codec.0 };
        if let Some(frag) = frag {
            let Some((pbn, off)) = self.pack(st, frag)? else { return Ok(None) };
            let entries = (0..n)
                .map(|sub| {
                    let f = Frag::new(codec.code(), off, frag.len() as u16, n as u8, sub as u8);
                    MapEntry::fragment(pbn, if settled { f.marked() } else { f }, 0)
                })
                .collect();
            return Ok(Some((entries, frag.len() as u64)));
        }
        let mut entries = Vec::with_capacity(n);
        for b in blocks.chunks_exact(BLOCK_SIZE) {
            let pbn = self.alloc_block(st)?;
            self.stage(st, pbn, crate::read::cache::Block::from(b), None)?;
            entries.push(MapEntry::raw(pbn, 0));
        }
        Ok(Some((entries, blocks.len() as u64)))
    }
}

/// How long a volume must go without client writes before the cleaner thread spends
/// its passes on recompression.
pub const RECOMPRESS_IDLE_DEFAULT: Duration = Duration::from_secs(1);

/// Share of wall-clock time the cleaner thread's passes may take while clients write and
/// free space is plentiful. Why pace at all: a pass scans the whole block map whatever it
/// frees, and under steady random overwrites the dead-space trigger is met again within a
/// second, so unpaced passes took 15-20 % of a core from the clients of a 2-core server.
pub const CLEANER_DUTY_DEFAULT: f64 = 0.1;
/// See `Volume::space_short`.
const SPACE_SHORT_DIVISOR: u64 = 8;
/// How long the cleaner thread runs no pass after one failed.
const FAILED_PASS_PAUSE: Duration = Duration::from_secs(30);

/// What a cleaner thread runs, and when.
#[derive(Debug, Clone)]
pub struct CleanerOptions {
    /// How often the thread looks.
    pub interval: Duration,
    /// Dead-space hint (bytes) at which a cleaner pass runs.
    pub trigger_bytes: u64,
    /// The cleaner passes' options.
    pub clean: CleanOptions,
    /// Recompression passes while the volume is idle (None: never).
    pub recompress: Option<super::recompress::RecompressOptions>,
    /// No client write or read for this long makes the volume idle.
    pub idle: Duration,
    /// Share of wall-clock time passes may take while clients write and space is not
    /// short (`Volume::space_short`); 1.0 or more: unpaced. An idle volume or one short of
    /// space is cleaned whenever the trigger is met.
    pub duty: f64,
}

/// A cleaner thread for a shared volume: every `interval` it runs a pass when the
/// dead-space hint reaches `trigger_bytes`, and, once no client has written or read for
/// `idle`, recompression passes while data not at rest is left; after a pass that failed,
/// none for `FAILED_PASS_PAUSE`. Stops when dropped or when the volume goes.
pub struct Cleaner {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Cleaner {
    /// Starts the thread with recompression when idle (None when it cannot be spawned).
    pub fn spawn(vol: &Arc<Volume>, interval: Duration, trigger_bytes: u64, opts: CleanOptions) -> Option<Cleaner> {
        Cleaner::spawn_with(
            vol,
            CleanerOptions {
                interval,
                trigger_bytes,
                clean: opts,
                recompress: Some(super::recompress::RecompressOptions::default()),
                idle: RECOMPRESS_IDLE_DEFAULT,
                duty: CLEANER_DUTY_DEFAULT,
            },
        )
    }

    /// Starts the thread (None when it cannot be spawned).
    pub fn spawn_with(vol: &Arc<Volume>, opts: CleanerOptions) -> Option<Cleaner> {
        let weak: Weak<Volume> = Arc::downgrade(vol);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name("dedupvol-cleaner".into())
            .spawn(move || {
                // Client writes seen at the last look (cleaning is paced while they come);
                // writes and reads together, and since when they stand still (idle work
                // waits for both).
                let mut writes: Option<u64> = None;
                let mut io: Option<(u64, u64)> = None;
                let mut idle_since = Instant::now();
                // Pacing: the next pass under client load waits until then.
                let mut not_before = Instant::now();
                // After a failed pass (a device that failed or did not answer), no pass
                // until then: the thread outlives an outage without retrying into it.
                let mut retry_at = Instant::now();
                while !flag.load(Ordering::Acquire) {
                    std::thread::sleep(opts.interval);
                    let Some(v) = weak.upgrade() else { break };
                    if Instant::now() < retry_at {
                        continue;
                    }
                    let now = v.state.lock().red.blocks_written;
                    let busy = writes != Some(now);
                    if busy {
                        writes = Some(now);
                    }
                    let now_io = (now, v.reads_served.load(Ordering::Relaxed));
                    let any_io = io != Some(now_io);
                    if any_io {
                        io = Some(now_io);
                        idle_since = Instant::now();
                    }
                    if v.dead_bytes_hint() >= opts.trigger_bytes
                        && (!busy || Instant::now() >= not_before || v.space_short())
                    {
                        let t0 = Instant::now();
                        if v.clean(&opts.clean).is_err() {
                            retry_at = Instant::now() + FAILED_PASS_PAUSE;
                            continue;
                        }
                        not_before = Instant::now() + pause_after(t0.elapsed(), opts.duty);
                    }
                    let Some(ro) = &opts.recompress else { continue };
                    if !any_io
                        && idle_since.elapsed() >= opts.idle
                        && v.recompress_hint() > 0
                        && v.recompress(ro).is_err()
                    {
                        retry_at = Instant::now() + FAILED_PASS_PAUSE;
                        // What the failed pass did not take is left for the next one.
                        let mut st = v.state.lock();
                        st.fast_codec_hint = st.fast_codec_hint.max(1);
                    }
                }
            })
            .ok()?;
        Some(Cleaner { stop, handle: Some(handle) })
    }
}

/// The pause after a pass of `took` that keeps passes to `duty` of wall-clock time.
fn pause_after(took: Duration, duty: f64) -> Duration {
    if !(duty > 0.0 && duty < 1.0) {
        return Duration::ZERO;
    }
    took.mul_f64((1.0 - duty) / duty).min(Duration::from_secs(60))
}

impl Drop for Cleaner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::pause_after;
    use std::time::Duration;

    #[test]
    fn passes_are_paced_to_their_duty() {
        let took = Duration::from_millis(30);
        assert_eq!(pause_after(took, 0.1), Duration::from_millis(270));
        assert_eq!(pause_after(took, 0.5), took);
        // Unpaced: 1.0 or more, and nonsense values.
        for duty in [1.0, 2.0, 0.0, -1.0, f64::NAN] {
            assert_eq!(pause_after(took, duty), Duration::ZERO, "duty {duty}");
        }
        // Bounded, however long a pass took.
        assert_eq!(pause_after(Duration::from_secs(100), 0.01), Duration::from_secs(60));
    }
}
