//! The hot-chunk tier (after SAR, "SSD-assisted restore"): a fast device holding copies
//! of selected physical blocks of the data device, raw or packed, so that reads of them
//! skip the slow data device. The tier is a cache: never the only copy of anything, never
//! needed for correctness, and a lost or damaged tier costs only speed.
//!
//! What is promoted:
//! - write path (`apply_entry`): a packed block when its reference count reaches the
//!   threshold (`promote_refcount`, default 5); a raw block only at twice the threshold,
//!   since a packed block holds up to 14 blocks' data in one slot and a raw one only one.
//!   A packed block still open in the packer is promoted when it is sealed.
//! - read path: a block read again while still in the recent-reads LRU (`RecentReads`),
//!   unless it came in a sequential run (two or more physically consecutive blocks in one
//!   device request are never noted).
//! - fills: while fewer than `fill_percent` of the slots are in use or claimed, every
//!   block written (raw, or packed at its sealing) is copied too, into a free slot only:
//!   a fill never demotes. First reads of fresh data, which no hotness policy can reach,
//!   then skip the data device; once the tier is that full, only hot blocks get in and
//!   push out cold ones.
//!
//! How: promotions go to a bounded queue (`PROMOTE_QUEUE_MAX`; a full queue drops and
//! counts) served by one background thread (`worker`), which writes copies in batches to
//! slots handed out by a clock hand (consecutive slots in one request), then the slot
//! table pages covering them. Content comes from what the caller had in hand (the read's
//! block, the staged or sealed block, the content cache), else the worker reads the data
//! device itself. Demotion: see `slots`.
//!
//! Invariants:
//! - The state lock is never held during tier I/O; the tier's lock is innermost (taken
//!   under the state lock, never holding another).
//! - A pbn freed or found damaged leaves the tier at once (`forget`, under the state lock
//!   that frees it), and any promotion of it in flight is voided (its `pending` token
//!   goes): no copy of a pbn's previous life is served after the pbn could be reused. A
//!   read-path promotion carries the pbn's forget epoch from the read's lookup, so a read
//!   of a previous life cannot promote it either.
//! - Every tier read is checked against the slot's recorded crc, then by the read path
//!   against the map entry's crc; a mismatch drops the entry and the block is read from
//!   the data device.
//! - Entries found at open serve reads only after their block on the data device was
//!   read and matched the record's crc (`validate`), and only if nothing dropped them
//!   meanwhile (the slot's token).
//! - Memory is bounded: the map and slot table by the slot count (at most
//!   `TIER_SLOTS_MAX`), the queue by `PROMOTE_QUEUE_MAX`, the LRU by `RECENT_READS_MAX`.

pub(crate) mod layout;
mod recent;
mod slots;
mod worker;

use crate::config::{TierDevice, TierOptions, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::data::placement::DataDevice;
use crate::error::{Error, Result};
use crate::io::{FileStorage, IoMode, Storage};
use crate::metadata::block_map::Frag;
use crate::obs::stats::TierStats;
use crate::read::cache::{new_block, Block, PbnMap};
use layout::{TierGeometry, TIER_RECORDS_PER_PAGE, TIER_RECORD_BYTES};
use parking_lot::{Condvar, Mutex};
use recent::RecentReads;
use slots::{SlotState, Slots};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Promotions waiting at most; further ones are dropped (and counted).
const PROMOTE_QUEUE_MAX: usize = 1024;
/// Promotions the worker writes per batch (256 KiB of slots).
const PROMOTE_BATCH_MAX: usize = 64;
/// Blocks the recent-reads LRU remembers.
const RECENT_READS_MAX: usize = 16384;
/// Tier device errors after which the tier is disabled for the session.
const DEVICE_ERRORS_MAX: u64 = 16;
/// Buckets of forget epochs (pbn modulo this).
const FORGET_BUCKETS: usize = 4096;
/// Slot table pages read per request at open (1 MiB).
const SCAN_PAGES_PER_IO: u64 = 256;

/// One queued promotion.
pub(crate) struct Job {
    pbn: u64,
    /// The `pending` token: the promotion is void once it is gone.
    token: u64,
    content: Option<Block>,
    packed: bool,
    refs: u32,
    origin: Origin,
    /// The map entry that made the block hot (crc, and the fragment when compressed):
    /// the content must decode to it, or the promotion is abandoned (content taken from
    /// the content cache may be a previous life's after a race with reuse).
    check: Option<(u32, Option<Frag>)>,
}

/// Why a block is promoted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// Its reference count reached the threshold.
    Refs,
    /// It was read again while remembered.
    Read,
    /// Written while the tier had room (`TierOptions::fill_percent`): takes a free slot
    /// or none, never demotes.
    Fill,
}

/// What the tier's lock protects.
struct Inner {
    slots: Slots,
    recent: RecentReads,
    queue: VecDeque<Job>,
    /// pbn → token of its promotion queued or in flight.
    pending: PbnMap<u64>,
    next_token: u64,
    /// Generation of the next slot written (tier-wide, increasing).
    next_gen: u64,
    /// Occupants found at open still to validate: (slot, pbn, token).
    to_validate: Vec<(u32, u64, u64)>,
    /// The worker is processing a batch.
    busy: bool,
    stop: bool,
}

/// Counters since open.
#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    promotions_write: AtomicU64,
    promotions_read: AtomicU64,
    fills: AtomicU64,
    dropped: AtomicU64,
    slot_bytes_written: AtomicU64,
    validation_failures: AtomicU64,
    slot_crc_failures: AtomicU64,
    device_errors: AtomicU64,
}

/// What the volume and the worker share.
pub(crate) struct Shared {
    dev: Arc<dyn Storage>,
    geo: TierGeometry,
    data: DataDevice,
    promote_refs: u32,
    /// Slots in use (or queued) below which written blocks are copied too.
    fill_below: u64,
    inner: Mutex<Inner>,
    /// Wakes the worker.
    wake: Condvar,
    /// Wakes `wait_idle`.
    idle: Condvar,
    disabled: AtomicBool,
    /// Bumped by `forget` for every pbn of the bucket.
    forgets: Vec<AtomicU64>,
    c: Counters,
}

/// The tier of an open volume: the shared state and its worker thread.
pub(crate) struct Tier {
    sh: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

/// Opens the tier's device.
fn open_device(opts: &TierOptions) -> Result<Arc<dyn Storage>> {
    match &opts.device {
        TierDevice::Storage(s) => Ok(s.clone()),
        TierDevice::Path(p) => {
            let f = if p.exists() {
                match opts.size_bytes {
                    // An existing regular file smaller than the size asked for is extended.
                    Some(size) if std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.len() < size) => {
                        FileStorage::create_with(p, Some(size), IoMode::Direct)?
                    }
                    _ => FileStorage::open_with(p, false, IoMode::Direct)?,
                }
            } else {
                let size = opts.size_bytes.ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "tier device {} does not exist: give a size to create it",
                        p.display()
                    ))
                })?;
                FileStorage::create_with(p, Some(size), IoMode::Direct)?
            };
            Ok(Arc::new(f))
        }
    }
}

fn io_err(what: &str, dev: &dyn Storage, e: std::io::Error) -> Error {
    Error::io(format!("{what} of hot-chunk tier {}", dev.name()), e)
}

/// The newest valid record of each referenced pbn in the slot table: (slot, record).
fn scan_table(
    dev: &dyn Storage,
    geo: &TierGeometry,
    data: &DataDevice,
    counts: &[u16],
) -> Result<(Vec<(u32, layout::SlotRecord)>, u64)> {
    let mut best: PbnMap<(u32, layout::SlotRecord)> = PbnMap::default();
    let mut max_gen = 0u64;
    let mut page = 0u64;
    while page < geo.table_pages {
        let take = (geo.table_pages - page).min(SCAN_PAGES_PER_IO);
        let mut buf = vec![0u8; take as usize * BLOCK_SIZE];
        dev.read_at(&mut buf, geo.page_offset(page)).map_err(|e| io_err("reading the slot table", dev, e))?;
        for (i, rec) in buf.chunks_exact(TIER_RECORD_BYTES).enumerate() {
            let slot = page * TIER_RECORDS_PER_PAGE as u64 + i as u64;
            if slot >= geo.slot_count {
                break;
            }
            let Some(r) = layout::decode_record(slot, rec) else { continue };
            max_gen = max_gen.max(r.generation);
            // A block no longer referenced (or outside the data region) is not worth a slot.
            let referenced = data.contains(r.pbn) && counts.get(r.pbn as usize).is_some_and(|&c| c > 0);
            if !referenced {
                continue;
            }
            let newer = best.get(&r.pbn).is_none_or(|(_, old)| r.generation > old.generation);
            if newer {
                best.insert(r.pbn, (slot as u32, r));
            }
        }
        page += take;
    }
    let mut found: Vec<(u32, layout::SlotRecord)> = best.into_values().collect();
    found.sort_unstable_by_key(|(s, _)| *s);
    Ok((found, max_gen))
}

/// Writes an empty slot table, then the header.
fn initialise(dev: &dyn Storage, geo: &TierGeometry, uuid: &[u8; 16]) -> Result<()> {
    let mut page = 0u64;
    while page < geo.table_pages {
        let take = (geo.table_pages - page).min(SCAN_PAGES_PER_IO);
        let zeros = vec![0u8; take as usize * BLOCK_SIZE];
        dev.write_at(&zeros, geo.page_offset(page)).map_err(|e| io_err("clearing the slot table", dev, e))?;
        page += take;
    }
    // The table is empty before a header says it belongs to this volume.
    dev.sync().map_err(|e| io_err("syncing", dev, e))?;
    dev.write_at(&layout::encode_header(uuid, geo), 0).map_err(|e| io_err("writing the header", dev, e))?;
    dev.sync().map_err(|e| io_err("syncing", dev, e))
}

impl Tier {
    /// Opens the tier for volume `uuid` whose blocks have reference counts `counts`; None
    /// (with a note saying why) when it cannot be used. A header of another volume, of
    /// another layout or garbage re-initialises the tier (noted too).
    pub(crate) fn open(
        opts: &TierOptions,
        uuid: &[u8; 16],
        data: DataDevice,
        counts: &[u16],
        notes: &mut Vec<String>,
    ) -> Option<Tier> {
        match Self::try_open(opts, uuid, data, counts, notes) {
            Ok(t) => Some(t),
            Err(e) => {
                notes.push(format!("hot-chunk tier not used (reads go to the data device): {e}"));
                None
            }
        }
    }

    fn try_open(
        opts: &TierOptions,
        uuid: &[u8; 16],
        data: DataDevice,
        counts: &[u16],
        notes: &mut Vec<String>,
    ) -> Result<Tier> {
        let dev = open_device(opts)?;
        let bytes = opts.size_bytes.map_or(dev.len(), |s| s.min(dev.len()));
        let geo = TierGeometry::for_device(bytes).ok_or_else(|| {
            Error::InvalidArgument(format!("tier device {} of {bytes} bytes is too small for a slot", dev.name()))
        })?;
        let mut header = vec![0u8; BLOCK_SIZE];
        dev.read_at(&mut header, 0).map_err(|e| io_err("reading the header", &*dev, e))?;
        let mut slots = Slots::new(geo.slot_count, opts.promote_refcount);
        let mut next_gen = 1;
        match layout::check_header(&header, uuid, &geo) {
            Ok(()) => {
                let (found, max_gen) = scan_table(&*dev, &geo, &data, counts)?;
                next_gen = max_gen + 1;
                for (slot, rec) in found {
                    slots.install(slot, rec, SlotState::Unvalidated);
                }
            }
            Err(why) => {
                notes.push(format!("hot-chunk tier {} initialised empty: {why}", dev.name()));
                initialise(&*dev, &geo, uuid)?;
            }
        }
        let to_validate = slots.unvalidated();
        let sh = Arc::new(Shared {
            dev,
            geo,
            data,
            promote_refs: opts.promote_refcount,
            fill_below: geo.slot_count * u64::from(opts.fill_percent.min(100)) / 100,
            inner: Mutex::new(Inner {
                slots,
                recent: RecentReads::new(RECENT_READS_MAX),
                queue: VecDeque::new(),
                pending: PbnMap::default(),
                next_token: 0,
                next_gen,
                to_validate,
                busy: false,
                stop: false,
            }),
            wake: Condvar::new(),
            idle: Condvar::new(),
            disabled: AtomicBool::new(false),
            forgets: (0..FORGET_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            c: Counters::default(),
        });
        let for_worker = sh.clone();
        let worker = std::thread::Builder::new()
            .name("dedupvol-tier".into())
            .spawn(move || worker::run(&for_worker))
            .map_err(|e| Error::io("starting the hot-chunk tier thread", e))?;
        Ok(Tier { sh, worker: Some(worker) })
    }

    /// The write path's promotion threshold.
    pub(crate) fn promote_refs(&self) -> u32 {
        self.sh.promote_refs
    }

    /// Queues a promotion from the write path (state lock held; `content` when the caller
    /// has the block in memory; `check`: the entry it must decode to, when the content is
    /// not known to be the block's current one).
    pub(crate) fn promote_written(
        &self,
        pbn: u64,
        content: Option<Block>,
        packed: bool,
        refs: u32,
        check: Option<(u32, Option<Frag>)>,
    ) {
        let mut g = self.sh.inner.lock();
        self.sh.queue(&mut g, pbn, content, packed, refs, Origin::Refs, check);
    }

    /// Offers a block being written (state lock held): copied to a free slot while the
    /// tier has room (`TierOptions::fill_percent`), so its first read skips the data
    /// device. `block` is the content being written, so nothing needs checking.
    pub(crate) fn offer_written(&self, pbn: u64, block: &Block, packed: bool) {
        let sh = &self.sh;
        if sh.fill_below == 0 || sh.disabled.load(Ordering::Relaxed) {
            return;
        }
        let mut g = sh.inner.lock();
        // In use, about to be, and already asked for: a fill never pushes out anything.
        let claimed = (g.slots.entries() + g.pending.len()) as u64;
        if claimed < sh.fill_below && g.queue.len() < PROMOTE_QUEUE_MAX / 2 {
            sh.queue(&mut g, pbn, Some(block.clone()), packed, 0, Origin::Fill, None);
        }
    }

    /// The forget epoch of `pbn`, taken under the state lock at a read's lookup.
    pub(crate) fn epoch(&self, pbn: u64) -> u64 {
        self.sh.bucket(pbn).map_or(0, |b| b.load(Ordering::Acquire))
    }

    /// Notes a lone read of `pbn`'s raw content or packed `slot` (checked against the map
    /// entry the read looked up at forget epoch `epoch`); a second read of the same data
    /// while remembered promotes the block. (A freed block is not taken out of the LRU:
    /// the epoch keeps a read of its previous life from promoting it, and a remembered
    /// read only makes the block's next read count as a re-read.)
    pub(crate) fn note_read(&self, pbn: u64, frag: Option<Frag>, block: &Block, refs: u32, epoch: u64) {
        // A fragment running on into further blocks is never promoted: the tier holds
        // whole blocks, and one block of it serves no read alone.
        if frag.is_some_and(|f| f.span() > 1) {
            return;
        }
        let slot = frag.map(|f| f.key());
        if self.sh.disabled.load(Ordering::Relaxed) {
            return;
        }
        let mut g = self.sh.inner.lock();
        // Freed since the read's lookup: the content may be the block's previous life.
        if self.epoch(pbn) != epoch || g.slots.get(pbn).is_some() {
            return;
        }
        if g.recent.touch(recent::key(pbn, slot)) {
            // Checked by the read against the entry it looked up at `epoch`.
            self.sh.queue(&mut g, pbn, Some(block.clone()), slot.is_some(), refs, Origin::Read, None);
        }
    }

    /// True when a validated copy of `pbn` serves reads.
    pub(crate) fn holds(&self, pbn: u64) -> bool {
        !self.sh.disabled.load(Ordering::Relaxed)
            && self.sh.inner.lock().slots.get(pbn).is_some_and(|(_, m)| m.state == SlotState::Valid)
    }

    /// Counts data block reads that went to the data device.
    pub(crate) fn note_misses(&self, n: u64) {
        self.sh.c.misses.fetch_add(n, Ordering::Relaxed);
    }

    /// `pbn`'s copy when the tier holds a validated one whose content matches the slot's
    /// recorded crc (a mismatch drops the entry); a device error counts towards disabling
    /// the tier. None: read the data device (counted as a miss).
    pub(crate) fn read(&self, pbn: u64) -> Option<Block> {
        let sh = &self.sh;
        if sh.disabled.load(Ordering::Relaxed) {
            return None;
        }
        let found = sh.inner.lock().slots.get(pbn).filter(|(_, m)| m.state == SlotState::Valid);
        let Some((slot, m)) = found else {
            sh.c.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let mut b = new_block();
        let read = match b.get_mut() {
            Some(buf) => sh.dev.read_at(buf, sh.geo.slot_offset(u64::from(slot))),
            None => Err(std::io::Error::other("a fresh block is shared")),
        };
        if read.is_err() {
            sh.device_error();
            sh.c.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let mut g = sh.inner.lock();
        let same = g.slots.meta(slot).is_some_and(|now| now.token == m.token);
        if crc32c::crc32c(&b) != m.rec.content_crc {
            // Torn, misdirected or rotten; or the slot was refilled meanwhile (then the
            // entry is gone already and nothing is dropped).
            if same {
                g.slots.drop_pbn(pbn);
                sh.c.slot_crc_failures.fetch_add(1, Ordering::Relaxed);
            }
            sh.c.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        if same {
            g.slots.hit(slot);
        }
        sh.c.hits.fetch_add(1, Ordering::Relaxed);
        Some(b)
    }

    /// Drops everything the tier holds or is about to hold of `pbn` (freed, found damaged,
    /// or a checksum mismatch on read). Called under the state lock that frees it.
    pub(crate) fn forget(&self, pbn: u64) {
        if let Some(b) = self.sh.bucket(pbn) {
            b.fetch_add(1, Ordering::AcqRel);
        }
        let mut g = self.sh.inner.lock();
        g.pending.remove(&pbn);
        g.slots.drop_pbn(pbn);
    }

    /// Waits until the queue is empty, no batch is being written and every entry found at
    /// open is validated (for tests and benchmarks; nothing needs it for correctness).
    pub fn wait_idle(&self) {
        let mut g = self.sh.inner.lock();
        while (g.busy || !g.queue.is_empty() || !g.to_validate.is_empty()) && !g.stop {
            self.sh.idle.wait(&mut g);
        }
    }

    /// The tier's figures now.
    pub(crate) fn stats(&self) -> TierStats {
        let c = &self.sh.c;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (entries, demotions) = {
            let g = self.sh.inner.lock();
            (g.slots.entries() as u64, g.slots.demotions)
        };
        let (hits, misses) = (get(&c.hits), get(&c.misses));
        TierStats {
            capacity_slots: self.sh.geo.slot_count,
            capacity_bytes: self.sh.geo.slot_count * BLOCK_SIZE_U64,
            entries,
            hits,
            misses,
            hit_share: if hits + misses == 0 { 0.0 } else { hits as f64 / (hits + misses) as f64 },
            promotions_write: get(&c.promotions_write),
            promotions_read: get(&c.promotions_read),
            fills: get(&c.fills),
            promotions_dropped: get(&c.dropped),
            demotions,
            slot_bytes_written: get(&c.slot_bytes_written),
            validation_failures: get(&c.validation_failures),
            slot_crc_failures: get(&c.slot_crc_failures),
            device_errors: get(&c.device_errors),
            disabled: self.sh.disabled.load(Ordering::Relaxed),
        }
    }

    /// Memory held: (slot table and map, queue and recent reads), in bytes.
    pub(crate) fn memory_bytes(&self) -> (u64, u64) {
        let g = self.sh.inner.lock();
        let queued: u64 = g.queue.iter().filter(|j| j.content.is_some()).count() as u64 * BLOCK_SIZE_U64;
        let queue = (g.queue.capacity() * std::mem::size_of::<Job>() + g.pending.capacity() * 16) as u64;
        (g.slots.memory_bytes(), queue + queued + g.recent.memory_bytes())
    }

    /// Checks the map against the slot table and every bound (the `verify` audit).
    #[cfg(any(test, feature = "verify"))]
    pub(crate) fn audit(&self) -> std::result::Result<(), String> {
        let g = self.sh.inner.lock();
        g.slots.audit()?;
        g.recent.audit()?;
        if g.slots.len() as u64 != self.sh.geo.slot_count || self.sh.geo.slot_count > layout::TIER_SLOTS_MAX {
            return Err(format!("{} slots in memory for {} on the device", g.slots.len(), self.sh.geo.slot_count));
        }
        if g.queue.len() > PROMOTE_QUEUE_MAX || g.pending.len() > PROMOTE_QUEUE_MAX + PROMOTE_BATCH_MAX {
            return Err(format!("{} queued, {} pending promotions", g.queue.len(), g.pending.len()));
        }
        Ok(())
    }
}

impl Shared {
    fn bucket(&self, pbn: u64) -> Option<&AtomicU64> {
        self.forgets.get((pbn % FORGET_BUCKETS as u64) as usize)
    }

    /// Queues a promotion of `pbn` unless it is held, already queued, or the queue is full.
    #[expect(clippy::too_many_arguments, reason = "the fields of one `Job`, named at both call sites")]
    fn queue(
        &self,
        g: &mut Inner,
        pbn: u64,
        content: Option<Block>,
        packed: bool,
        refs: u32,
        origin: Origin,
        check: Option<(u32, Option<Frag>)>,
    ) {
        if self.disabled.load(Ordering::Relaxed) || g.slots.get(pbn).is_some() || g.pending.contains_key(&pbn) {
            return;
        }
        if g.queue.len() >= PROMOTE_QUEUE_MAX {
            self.c.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        g.next_token += 1;
        let token = g.next_token;
        g.pending.insert(pbn, token);
        g.queue.push_back(Job { pbn, token, content, packed, refs, origin, check });
        self.wake.notify_one();
    }

    /// Counts a tier device error; past `DEVICE_ERRORS_MAX` the tier is disabled for the
    /// session and everything it holds is dropped.
    fn device_error(&self) {
        let n = self.c.device_errors.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= DEVICE_ERRORS_MAX && !self.disabled.swap(true, Ordering::AcqRel) {
            let mut g = self.inner.lock();
            g.slots.clear();
            g.queue.clear();
            g.pending.clear();
            g.to_validate.clear();
            self.idle.notify_all();
        }
    }
}

impl Drop for Tier {
    fn drop(&mut self) {
        self.sh.inner.lock().stop = true;
        self.sh.wake.notify_all();
        self.sh.idle.notify_all();
        if let Some(h) = self.worker.take() {
            let _ = h.join();
        }
        // Best effort: a copy that did not reach the device is only a lost copy.
        let _ = self.sh.dev.sync();
    }
}
