//! The volume: the public API (format, open, read, write, flush, discard, write-zeroes,
//! close, stats) over the pipeline, the dedup decision, the data placement and the
//! metadata structures.
//!
//! A write (docs/design.md, "A write"), per batch of at most 4 MiB of whole blocks:
//! 1. `pipeline::fingerprint` — zero check, BLAKE3, crc32c (no lock, parallel);
//! 2. `pipeline::reduce::find_candidates` — dedup candidates (state lock);
//! 3. `pipeline::reduce::verify_and_compress` — verification reads, compression (no lock);
//! 4. `Volume::place_batch` (`pipeline::place`) — claim or place each chunk, stage its data, journal and
//!    apply the mapping change (state lock);
//! 5. `Volume::hand_off` — a full staging buffer goes to the data writer (no lock);
//! 6. `Volume::after_write` — FUA, the sync policy or journal pressure commit.
//!
//! A read (docs/design.md, "A read"): `read/` looks every mapping up under one short hold
//! of the state lock, answers unwritten blocks from memory, then reads the rest without
//! the lock, in runs, through the content cache, checking every block's crc.
//!
//! Invariants:
//! - Data a visible mapping references is on the device (written, not necessarily synced)
//!   or held in memory by `Staging` or the open packed blocks; a commit writes the staged
//!   data, waits for every earlier write in flight, syncs data, then writes the journal
//!   blocks and syncs them before reporting durability (the durability contract).
//! - Lock order: an `rmw` stripe (held across a partial block's read and write) before
//!   `commit_lock` before `state` before `sb`; `cache`, the ticket set and `Health` are
//!   taken alone or innermost. The data-writer thread takes no volume lock.
//! - After a failed device write or sync the volume is failed: it refuses writes, since
//!   what reached the device is unknown (a failed fsync is never retried and assumed good).
//! - The content a block map entry points to always hashes (crc32c) to the entry's crc; a
//!   read that finds otherwise retries once from the mapping, then reports corruption.

pub(crate) mod block_status;
pub(crate) mod cleaner;
mod commit;
pub(crate) mod grow;
mod lifecycle;
pub(crate) mod recompress;
pub(crate) use lifecycle::{uuid_hex, uuid_lo, OpenNote};
mod mapping;
mod recovery;
mod report;
mod scan;
pub(crate) mod state;
mod woj;
mod write;

#[cfg(test)]
mod tests;

use crate::config::{Compression, WritePolicy, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::data::placement::DataDevice;
use crate::data::writer::{DataWriter, Health, Tickets};
use crate::error::{Error, Result};
use crate::io::{Dev, IoCounters};
use crate::metadata::block_map::MapEntry;
use crate::metadata::layout::Geometry;
use crate::metadata::superblock::Superblock;
use crate::obs::stats::LifetimeCounters;
use crate::pipeline::executor::CpuPool;
use crate::pipeline::segments;
use crate::read::cache::ContentCache;
use crate::sync::Mutex;
use crate::tier::Tier;
use state::State;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Stripes of the read-modify-write lock (unaligned writes to one block are serialised).
const RMW_STRIPES: usize = 64;

/// An open volume. Share it between threads with `Arc`; every method takes `&self`.
pub struct Volume {
    pub(crate) data: DataDevice,
    pub(crate) meta: Dev,
    /// The geometry at open: its region starts and slab size hold for the volume's life; the
    /// sizes a grow changes are read from `logical_blocks`, `DataDevice::blocks` and `sb`.
    pub(crate) geo: Geometry,
    /// Logical blocks exported now: `geo.logical_blocks` until a grow (`Volume::grow`)
    /// raises it, after the superblock names the new size.
    pub(crate) logical_blocks: AtomicU64,
    pub(crate) sb: Mutex<Superblock>,
    /// The state lock stays parking_lot's: the cleaner's and settling's scans release and
    /// take it again in tight loops, and parking_lot hands a contended lock to a waiting
    /// client now and then (eventual fairness), where a plain futex mutex lets the thread
    /// that just released it take it back first every time. Every other lock of the volume
    /// is a `crate::sync::Mutex`, whose waiters sleep instead of yielding in a loop.
    pub(crate) state: parking_lot::Mutex<State>,
    pub(crate) commit_lock: Mutex<()>,
    /// Tickets of data writes in flight outside the state lock. A commit waits for every
    /// ticket issued before it took its journal batch, so the data sync covers them.
    pub(crate) tickets: Arc<Tickets>,
    /// Writes full staging batches in the background (None: read-only, or inline writes).
    pub(crate) writer: Option<DataWriter>,
    /// Runs the pipeline's parallel stages.
    pub(crate) exec: std::sync::Arc<CpuPool>,
    /// Computes stage 1's fingerprints and stage 3's compression (`OpenOptions::offload`).
    pub(crate) offload: crate::pipeline::offload::Offloader,
    /// The unique-chunk predictor (None: dedup off, write-once journaling on, or turned
    /// off). Taken alone, once per batch to predict and once to record.
    pub(crate) predictor: Option<Mutex<crate::dedup::predictor::Predictor>>,
    /// Deferred compression's gauge (None: off; `OpenOptions::defer_compression_micros`).
    pub(crate) defer: Option<Arc<crate::pipeline::defer::Deferral>>,
    /// Combines small writes into batches (`pipeline::batcher`).
    pub(crate) batcher: crate::pipeline::batcher::Batcher,
    /// Taken once per read request for its lookups and once per run it reads: the read
    /// path's most contended lock.
    pub(crate) cache: Mutex<ContentCache>,
    pub(crate) rmw: [Mutex<()>; RMW_STRIPES],
    pub(crate) io: Arc<IoCounters>,
    pub(crate) policy: WritePolicy,
    pub(crate) dedup: bool,
    /// The codec the write path stores with: the volume's, unless this session was opened
    /// with another (`OpenOptions::store_codec`).
    pub(crate) compression: Compression,
    /// `compression`'s level in effect (`config::effective_level`).
    pub(crate) compression_level: i8,
    /// The volume's codec and level in effect (the superblock's): what the cleaner and the
    /// recompressor store with, and what a fragment of another codec is brought to.
    pub(crate) volume_codec: (Compression, i8),
    /// zstd level data at rest is brought to (the superblock's; 0: off): with it on, the
    /// recompressor's target is a zstd fragment marked settled, not the volume's codec.
    /// Changed only by `set_rest_level`, under the state lock.
    pub(crate) rest_level: std::sync::atomic::AtomicI8,
    /// Client read calls served (`read`, `read_shared`): the cleaner thread spends idle
    /// work only when neither reads nor writes came lately.
    pub(crate) reads_served: std::sync::atomic::AtomicU64,
    /// Newly written blocks enter the content cache (see `OpenOptions::cache_writes`).
    pub(crate) cache_writes: bool,
    /// The volume's extent cap in blocks (the superblock's, 0 read as the largest;
    /// `FormatOptions::extent_blocks_max`). Changed only by `set_extent_blocks_max`,
    /// under the state lock.
    pub(crate) extent_blocks_max: std::sync::atomic::AtomicU8,
    /// This open's own cap (`OpenOptions::extent_blocks_max`): the smaller of the two is
    /// the largest extent formed (`extent_max`).
    pub(crate) extent_open_cap: u8,
    /// The volume's zstd dictionary (None: not trained yet, or no dictionary area), used
    /// for units at rest (`data::dictionary`). Set once, by `install_dictionary`; taken
    /// alone (innermost).
    pub(crate) dictionary: Mutex<Option<Arc<crate::data::dictionary::Dictionary>>>,
    /// A settling pass of this session has trained (or tried to): one attempt per session.
    pub(crate) dictionary_tried: AtomicBool,
    /// `OpenOptions::dictionary_train_min_bytes`.
    pub(crate) dictionary_train_min: usize,
    pub(crate) read_only: bool,
    pub(crate) health: Arc<Health>,
    /// Set under the state lock whenever entries are appended or a batch is taken: the
    /// pending journal entries have reached the point where a writer should commit. Lets
    /// `after_write` decide without taking the state lock again.
    pub(crate) journal_pressure: AtomicBool,
    /// Problems noticed while opening (superblock copies, torn journal blocks), for `check`.
    pub(crate) open_notes: Vec<lifecycle::OpenNote>,
    /// Lifetime counters as loaded at open (this open counted): this process's counters
    /// are added to these, never to a figure that already includes them.
    pub(crate) lifetime_base: LifetimeCounters,
    /// The hot-chunk tier (None: not configured, or it could not be opened).
    pub(crate) tier: Option<Tier>,
    /// Why the tier is not used, or was re-initialised, at open.
    pub(crate) tier_notes: Vec<String>,
    /// The current or last scrub's figures (innermost lock).
    pub(crate) scrub: Mutex<Option<crate::check::scrub::ScrubStatus>>,
    /// Write-once journaling (None: off). Taken after the state lock, or alone; never
    /// held across I/O.
    pub(crate) woj: Option<Mutex<crate::woj::Woj>>,
}

impl Volume {
    /// Writes `data` at byte `offset`. With `fua` (or the sync policy) the write is durable
    /// when this returns.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, data.len() as u64)?;
        let watched = self.woj_watched(offset, data.len() as u64);
        let mut last_seq = 0u64;
        for seg in segments(offset, data.len() as u64, crate::pipeline::WRITE_BLOCKS_PER_BATCH) {
            #[expect(clippy::indexing_slicing, reason = "`segments` cuts `data.len()` bytes into segments inside it")]
            let src = &data[seg.pos as usize..(seg.pos + seg.len) as usize];
            let seq = if seg.whole { self.write_blocks(seg.lba, src)? } else { self.rmw(seg.lba, seg.within, src)? };
            last_seq = last_seq.max(seq);
        }
        self.after_write(fua, last_seq)?;
        // A superblock or partition table was rewritten: the journal may have moved.
        self.woj_after_write(watched);
        Ok(())
    }

    /// Writes several requests as one batch through the pipeline's stages, as the batcher
    /// combines the small writes of concurrent clients (`pipeline::batcher`): requests
    /// apply in order (a later one wins where they overlap) and the call returns once all
    /// are applied. A request that is not whole blocks, or of more than 64 blocks, and
    /// every request of a volume with write-once journaling, is written on its own, in
    /// order; a failed batch has its requests written again on their own (an error then
    /// belongs to the first request that fails). With `fua` (or the sync policy) all of
    /// them are durable when this returns.
    pub fn write_many(&self, reqs: &[(u64, &[u8])], fua: bool) -> Result<()> {
        self.check_writable()?;
        for &(offset, data) in reqs {
            self.check_range(offset, data.len() as u64)?;
        }
        let batchable = |&(offset, data): &(u64, &[u8])| {
            (offset | data.len() as u64) & (BLOCK_SIZE_U64 - 1) == 0
                && !data.is_empty()
                && data.len() <= crate::pipeline::batcher::REQUEST_CHUNKS_MAX * BLOCK_SIZE
        };
        if self.woj.is_some() || !reqs.iter().all(batchable) {
            for &(offset, data) in reqs {
                self.write(offset, data, fua)?;
            }
            return Ok(());
        }
        let mut lbas = crate::pipeline::lbas::Lbas::empty();
        let mut buf = Vec::with_capacity(reqs.iter().map(|(_, d)| d.len()).sum());
        for &(offset, data) in reqs {
            lbas.push(buf.len() / BLOCK_SIZE, offset / BLOCK_SIZE_U64);
            buf.extend_from_slice(data);
        }
        let seq = match self.write_batch_once(&lbas, &buf) {
            Ok(seq) => seq,
            Err(_) => {
                // As the batcher does: each request alone, which also commits and retries
                // when the volume was full of blocks awaiting a commit.
                let mut last = 0;
                for &(offset, data) in reqs {
                    last = last.max(self.write_blocks(offset / BLOCK_SIZE_U64, data)?);
                }
                last
            }
        };
        self.after_write(fua, seq)
    }

    /// Reads `buf.len()` bytes at byte `offset`.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        self.reads_served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.read_range(offset, buf)
    }

    /// Reads like `read`, but whole raw blocks found in the content cache are handed back
    /// as shared, immutable buffers instead of being copied: `parts` gets one slot per 4 KiB
    /// block of `buf`; where it holds a block, that block is the data and `buf`'s block is
    /// left as it was. For callers that send what they read (the NBD server sends the parts
    /// with one vectored write), so a cached block costs no copy. A range that is not whole
    /// blocks is read into `buf` with every part None.
    pub fn read_shared(&self, offset: u64, buf: &mut [u8], parts: &mut Vec<Option<crate::block::Block>>) -> Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        self.reads_served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        parts.clear();
        // Block size is a power of two: a low bit set in either means a partial block.
        if (offset | buf.len() as u64) & (BLOCK_SIZE_U64 - 1) != 0 {
            return self.read_range(offset, buf);
        }
        parts.resize(buf.len() / crate::BLOCK_SIZE, None);
        self.read_range_shared(offset, buf, Some(parts.as_mut_slice()))
    }

    /// Makes every write completed before this call durable.
    pub fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.check_not_failed()?;
        let target = self.state.lock().journal.last_assigned_seq();
        self.commit_to(target)
    }

    /// Discards a byte range: it reads back as zeros and its space is freed.
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.unmap(offset, len, MapEntry::UNMAPPED, false)
    }

    /// Writes zeros to a byte range without data I/O (space is freed).
    pub fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.unmap(offset, len, MapEntry::ZERO, fua)
    }

    /// Waits for the work an open starts in the background (populating the fingerprint
    /// index's memory) to finish. Nothing needs it for correctness; a benchmark calls it
    /// so that its clock measures steady-state writes rather than first-touch page faults.
    pub fn wait_ready(&self) {
        self.state.lock().dedup.wait_ready();
    }

    /// Waits until the fingerprint index's rebuild from its chapter ring, started by the
    /// open, is done (a manual one is run to its end). Nothing needs it for correctness;
    /// tests and benchmarks call it to measure dedup with the whole window indexed.
    pub fn wait_index_rebuilt(&self) {
        // The thread is taken out of the state and joined without the state lock, so
        // writers go on meanwhile.
        let thread = self.state.lock().dedup.index_mut().take_rebuild_thread();
        if let Some(mut t) = thread {
            t.wait();
        }
        while self.index_rebuild_step() {}
    }

    /// Runs one step of the index rebuild (`IndexRebuild::Manual`: one sequential read of
    /// chapters and their insertion); false when the rebuild is done. Holds the state lock
    /// for its read, which only the simulator and tests, who ask for it, accept.
    pub fn index_rebuild_step(&self) -> bool {
        self.state.lock().dedup.index_mut().rebuild_step()
    }

    /// What opening the hot-chunk tier noticed: why it is not used (its device could not
    /// be opened or read; the volume works without it) or why it was re-initialised.
    /// Empty when no tier was asked for or all went well.
    pub fn tier_notes(&self) -> &[String] {
        &self.tier_notes
    }

    /// Waits until the hot-chunk tier has written every queued promotion and validated
    /// the entries it found at open (no-op without a tier). Nothing needs it for
    /// correctness; tests and benchmarks call it to observe a settled tier.
    pub fn wait_tier_idle(&self) {
        if let Some(t) = &self.tier {
            t.wait_idle();
        }
    }

    /// True when the data device is read and written with direct I/O (no page cache).
    pub fn direct_io(&self) -> bool {
        self.data.dev().is_direct()
    }

    /// Logical size in bytes (read per NBD connection: a grow shows at the next connect).
    pub fn logical_size(&self) -> u64 {
        self.logical_blocks() * BLOCK_SIZE_U64
    }

    /// Logical blocks exported now.
    pub(crate) fn logical_blocks(&self) -> u64 {
        self.logical_blocks.load(Ordering::Acquire)
    }

    /// The write policy in effect.
    pub fn write_policy(&self) -> WritePolicy {
        self.policy
    }

    /// The metadata device path recorded at format, if any.
    pub fn meta_path(&self) -> Option<String> {
        self.sb.lock().meta_path.clone()
    }

    /// The volume's geometry now (a grow changes it).
    pub fn geometry(&self) -> Geometry {
        self.sb.lock().geometry
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        let size = self.logical_size();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(Error::OutOfRange { offset, len, size }),
        }
    }

    pub(crate) fn check_not_failed(&self) -> Result<()> {
        self.health.check()
    }

    fn check_writable(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        self.check_not_failed()
    }

    /// Marks the volume failed after an error that may have left device state unknown.
    pub(crate) fn fail<T>(&self, e: Error) -> Result<T> {
        self.health.fail(&e);
        Err(e)
    }

    /// Fails the volume when `r` is an error.
    pub(crate) fn guard<T>(&self, r: Result<T>) -> Result<T> {
        match r {
            Ok(v) => Ok(v),
            Err(e) => self.fail(e),
        }
    }
}

/// The extent cap a superblock's byte stands for: 0 (volumes formatted before the setting
/// existed, or without one) is the largest unit. (Decoding refuses a byte above it.)
pub(crate) fn extent_setting(byte: u8) -> u8 {
    if byte == 0 {
        crate::metadata::block_map::UNIT_BLOCKS_MAX
    } else {
        byte
    }
}
