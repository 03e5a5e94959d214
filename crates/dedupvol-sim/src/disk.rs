//! A simulated machine with one or two simulated disks, driven by one seeded RNG.
//!
//! Each [`SimDisk`] implements [`dedupvol_core::Storage`]. The disks of a machine share one
//! RNG, one operation counter and one crash switch, so a crash is a whole-machine power
//! failure and the order of faults depends only on the seed and the sequence of I/O calls.
//!
//! Model of one disk: a `durable` image (the media) and a `current` image (what reads see:
//! the media plus the volatile write cache), plus the list of `pending` writes not yet made
//! durable by `sync`.
//!
//! Invariants:
//! - Every byte where `current` and `durable` differ is covered by some pending write
//!   (so `sync` only needs to copy the pending ranges from `current` to `durable`).
//! - After `sync` returns Ok, `durable == current` for every byte written before the call.
//! - After [`SimMachine::power_cycle`], `current == durable` and nothing is pending.
//! - `bad_current` / `bad_durable` hold every 4 KiB block whose content differs from what
//!   the engine last wrote there because of an injected *persistent* fault (lost or
//!   misdirected write, bit flip). Loss or tearing of unsynced writes at a crash is not
//!   a fault: it is the normal behaviour of a volatile cache, and the engine must cope.
//! - Persistent faults only ever touch the configured *data region* of a disk (never
//!   metadata, which has no redundant copy); transient faults (read errors, bits flipped in
//!   transit) may touch any read of the data region, and read errors any read at all.
//! - After the crash point is reached every I/O call fails until `power_cycle`.

use parking_lot::Mutex;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeSet;
use std::io;
use std::ops::Range;
use std::sync::Arc;

/// Bytes of a sector: the unit of tearing.
pub const SECTOR_BYTES: u64 = 512;
/// Bytes of a block: the unit of fault bookkeeping.
pub const BLOCK_BYTES: u64 = 4096;
/// Unsynced bytes a disk's write cache holds before it destages writes on its own.
pub const CACHE_BYTES_MAX: u64 = 8 << 20;
/// Recently written data blocks remembered as targets for bit flips and misdirection.
pub const RECENT_BLOCKS_MAX: usize = 4096;
/// Persistent faults (lost, misdirected, bit flips) injected per power cycle, at most.
pub const PERSISTENT_FAULTS_PER_CYCLE_MAX: u64 = 4;

/// Which fault kinds are enabled, and how often (parts per million of eligible calls).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultConfig {
    /// At a power failure, unsynced writes may be lost and the rest land in any order.
    pub crash_loss: bool,
    /// At a power failure, a surviving unsynced write may be torn at sector granularity.
    pub torn_writes: bool,
    /// The cache may write unsynced data to the media early, out of order.
    pub destage: bool,
    /// Data-region writes acknowledged but never stored.
    pub lost_writes: bool,
    /// Data-region writes stored at another data-region offset.
    pub misdirected_writes: bool,
    /// Transient `io::Error` on reads.
    pub read_errors: bool,
    /// Persistent bit flips in written data-region blocks.
    pub bit_flips: bool,
    /// Bits flipped in a read's buffer only (data region).
    pub read_flips: bool,
    /// Transient `io::Error` on writes (nothing written) and syncs (nothing made durable).
    pub write_errors: bool,
    /// Probability of a write or sync error per call, ppm.
    pub write_error_ppm: u32,
    /// Probability of a lost write per data-region write, ppm.
    pub lost_write_ppm: u32,
    /// Probability of a misdirected write per data-region write, ppm.
    pub misdirect_ppm: u32,
    /// Probability of a transient read error per read, ppm.
    pub read_error_ppm: u32,
    /// Probability of a persistent bit flip per write call, ppm.
    pub bit_flip_ppm: u32,
    /// Probability of a flipped bit in transit per data-region read, ppm.
    pub read_flip_ppm: u32,
    /// Probability of an early destage per write, ppm.
    pub destage_ppm: u32,
}

impl FaultConfig {
    /// No faults at all (crashes still drop the cache when `crash_loss` is later set).
    pub fn none() -> Self {
        FaultConfig {
            crash_loss: false,
            torn_writes: false,
            destage: false,
            lost_writes: false,
            misdirected_writes: false,
            read_errors: false,
            bit_flips: false,
            read_flips: false,
            write_errors: false,
            write_error_ppm: 0,
            lost_write_ppm: 0,
            misdirect_ppm: 0,
            read_error_ppm: 0,
            bit_flip_ppm: 0,
            read_flip_ppm: 0,
            destage_ppm: 0,
        }
    }

    /// True when some fault can make data-region content persistently wrong.
    pub fn has_persistent_data_faults(&self) -> bool {
        self.lost_writes || self.misdirected_writes || self.bit_flips
    }
}

/// Faults injected so far, by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Power failures.
    pub power_failures: u64,
    /// Crashes that kept the whole cache (a process kill, not a power failure).
    pub process_crashes: u64,
    /// Unsynced writes dropped at a power failure.
    pub unsynced_lost: u64,
    /// Unsynced writes torn at a power failure.
    pub torn: u64,
    /// Unsynced writes destaged early.
    pub destaged: u64,
    /// Lost writes.
    pub lost_writes: u64,
    /// Misdirected writes.
    pub misdirected_writes: u64,
    /// Transient read errors.
    pub read_errors: u64,
    /// Persistent bit flips.
    pub bit_flips: u64,
    /// Bits flipped in transit.
    pub read_flips: u64,
    /// Superblock copies corrupted (one of two, never the newer).
    pub superblock_copies: u64,
    /// Writes refused with an error.
    pub write_errors: u64,
    /// Syncs refused with an error.
    pub sync_errors: u64,
}

impl FaultCounts {
    /// Adds `o` into `self`.
    pub fn add(&mut self, o: &FaultCounts) {
        self.power_failures += o.power_failures;
        self.process_crashes += o.process_crashes;
        self.unsynced_lost += o.unsynced_lost;
        self.torn += o.torn;
        self.destaged += o.destaged;
        self.lost_writes += o.lost_writes;
        self.misdirected_writes += o.misdirected_writes;
        self.read_errors += o.read_errors;
        self.bit_flips += o.bit_flips;
        self.read_flips += o.read_flips;
        self.superblock_copies += o.superblock_copies;
        self.write_errors += o.write_errors;
        self.sync_errors += o.sync_errors;
    }

    /// One line, every kind.
    pub fn summary(&self) -> String {
        format!(
            "power_failures={} process_crashes={} unsynced_lost={} torn={} destaged={} lost_writes={} misdirected={} read_errors={} bit_flips={} read_flips={} superblock_copies={} write_errors={} sync_errors={}",
            self.power_failures,
            self.process_crashes,
            self.unsynced_lost,
            self.torn,
            self.destaged,
            self.lost_writes,
            self.misdirected_writes,
            self.read_errors,
            self.bit_flips,
            self.read_flips,
            self.superblock_copies,
            self.write_errors,
            self.sync_errors
        )
    }
}

/// Monotonic counters the checker uses to attribute an engine error to an injected fault.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Evidence {
    /// Transient faults returned (read errors, bits flipped in transit).
    pub transient: u64,
    /// Reads that returned at least one block marked bad by a persistent fault.
    pub bad_reads: u64,
    /// I/O calls refused because the machine had crashed.
    pub crashed_calls: u64,
}

impl Evidence {
    /// True when anything happened between `earlier` and `self`.
    pub fn any_since(&self, earlier: &Evidence) -> bool {
        self != earlier
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PendingKind {
    Clean,
    /// Never stored; `offset` is where the engine wanted it.
    Lost,
    /// Stored at `offset`, intended for `from`.
    Misdirected {
        from: u64,
    },
}

#[derive(Debug, Clone)]
struct Pending {
    offset: u64,
    data: Vec<u8>,
    kind: PendingKind,
}

struct Disk {
    durable: Vec<u8>,
    current: Vec<u8>,
    pending: Vec<Pending>,
    pending_bytes: u64,
    bad_current: BTreeSet<u64>,
    bad_durable: BTreeSet<u64>,
    data_region: Option<Range<u64>>,
    recent_data_blocks: Vec<u64>,
    recent_next: usize,
}

fn blocks_touched(offset: u64, len: u64) -> Range<u64> {
    offset / BLOCK_BYTES..(offset + len).div_ceil(BLOCK_BYTES)
}

fn blocks_covered(offset: u64, len: u64) -> Range<u64> {
    offset.div_ceil(BLOCK_BYTES)..(offset + len) / BLOCK_BYTES
}

impl Disk {
    fn in_data_region(&self, offset: u64, len: u64) -> bool {
        self.data_region.as_ref().is_some_and(|r| offset >= r.start && offset + len <= r.end)
    }

    fn remember_data_blocks(&mut self, offset: u64, len: u64) {
        for b in blocks_covered(offset, len) {
            if self.recent_data_blocks.len() < RECENT_BLOCKS_MAX {
                self.recent_data_blocks.push(b);
            } else {
                self.recent_data_blocks[self.recent_next] = b;
                self.recent_next = (self.recent_next + 1) % RECENT_BLOCKS_MAX;
            }
        }
    }

    fn overlaps_pending(&self, offset: u64, len: u64) -> bool {
        self.pending.iter().any(|p| {
            let (a, b) = match p.kind {
                PendingKind::Misdirected { from } => (p.offset.min(from), p.offset.max(from) + p.data.len() as u64),
                _ => (p.offset, p.offset + p.data.len() as u64),
            };
            a < offset + len && offset < b
        })
    }

    /// Writes the cache's current content of `p`'s ranges back to the media (what `sync`
    /// does for every pending write, and an early destage for one).
    fn write_back(&mut self, p: &Pending) {
        let len = p.data.len() as u64;
        let mut ranges = vec![(p.offset, len)];
        if let PendingKind::Misdirected { from } = p.kind {
            ranges.push((from, len));
        }
        for (o, l) in ranges {
            let r = o as usize..(o + l) as usize;
            self.durable[r.clone()].copy_from_slice(&self.current[r]);
            for b in blocks_touched(o, l) {
                if self.bad_current.contains(&b) {
                    self.bad_durable.insert(b);
                } else {
                    self.bad_durable.remove(&b);
                }
            }
        }
    }

    /// Applies a pending write (whole, or only the sectors in `sectors`) to the media.
    fn apply_to_durable(&mut self, p: &Pending, sectors: Option<&[bool]>) {
        let len = p.data.len() as u64;
        match p.kind {
            PendingKind::Lost => {
                self.bad_durable.extend(blocks_touched(p.offset, len));
            }
            PendingKind::Clean | PendingKind::Misdirected { .. } => {
                match sectors {
                    None => {
                        let o = p.offset as usize;
                        self.durable[o..o + p.data.len()].copy_from_slice(&p.data);
                    }
                    Some(keep) => {
                        for (i, k) in keep.iter().enumerate() {
                            if *k {
                                let s = i * SECTOR_BYTES as usize;
                                let e = (s + SECTOR_BYTES as usize).min(p.data.len());
                                let o = p.offset as usize;
                                self.durable[o + s..o + e].copy_from_slice(&p.data[s..e]);
                            }
                        }
                    }
                }
                if let PendingKind::Misdirected { from } = p.kind {
                    self.bad_durable.extend(blocks_touched(from, len));
                    self.bad_durable.extend(blocks_touched(p.offset, len));
                } else if sectors.is_none() {
                    for b in blocks_covered(p.offset, len) {
                        self.bad_durable.remove(&b);
                    }
                }
            }
        }
    }
}

struct MachineState {
    rng: ChaCha8Rng,
    disks: Vec<Disk>,
    cfg: FaultConfig,
    faults_enabled: bool,
    crashed: bool,
    crash_countdown: Option<u64>,
    persistent_this_cycle: u64,
    counts: FaultCounts,
    evidence: Evidence,
    ops: u64,
    trace: u64,
    content_trace: u64,
    /// The most recent persistent faults: (disk, first block, blocks, what).
    fault_log: std::collections::VecDeque<(usize, u64, u64, String)>,
    /// Reads bypass crash points, faults and the trace (diagnostic audits must not
    /// perturb the run they observe).
    passthrough: bool,
    /// Print every traced I/O call (`DEDUPVOL_SIM_TRACE=1`), to find where two runs part.
    dump_trace: bool,
}

/// Persistent faults remembered for failure reports.
pub const FAULT_LOG_MAX: usize = 256;

impl MachineState {
    fn log_fault(&mut self, disk: usize, offset: u64, len: u64, what: String) {
        if self.fault_log.len() == FAULT_LOG_MAX {
            self.fault_log.pop_front();
        }
        let r = blocks_touched(offset, len);
        let what = format!("{what} (I/O call {})", self.ops);
        self.fault_log.push_back((disk, r.start, r.end - r.start, what));
    }
}

impl MachineState {
    fn chance(&mut self, ppm: u32) -> bool {
        ppm > 0 && self.rng.gen_range(0..1_000_000u32) < ppm
    }

    fn trace(&mut self, kind: u64, disk: usize, offset: u64, len: u64, crc: u32) {
        // FNV-style folds of every I/O call: two runs of one seed must give the same
        // structural trace (which call, where, how long: what every fault decision depends
        // on). The content trace also folds the written bytes; it differs between runs when
        // the engine stamps something time-dependent, like a volume UUID, into its blocks.
        if self.dump_trace {
            eprintln!("io {} kind={kind} disk={disk} off={offset} len={len}", self.ops);
        }
        for v in [kind, disk as u64, offset, len] {
            self.trace = (self.trace ^ v).wrapping_mul(0x100_0000_01b3);
        }
        self.content_trace = (self.content_trace ^ self.trace ^ u64::from(crc)).wrapping_mul(0x100_0000_01b3);
    }

    /// Counts one I/O call against the crash point; true when the call must fail.
    fn tick(&mut self) -> bool {
        if self.passthrough {
            return false;
        }
        self.ops += 1;
        if self.crashed {
            self.evidence.crashed_calls += 1;
            return true;
        }
        if let Some(n) = self.crash_countdown {
            if n == 0 {
                self.crashed = true;
                self.crash_countdown = None;
                self.evidence.crashed_calls += 1;
                return true;
            }
            self.crash_countdown = Some(n - 1);
        }
        false
    }

    fn persistent_budget_left(&self) -> bool {
        self.persistent_this_cycle < PERSISTENT_FAULTS_PER_CYCLE_MAX
    }

    fn maybe_destage(&mut self, d: usize) {
        let cfg_destage = self.cfg.destage && self.faults_enabled;
        let disk_over = self.disks[d].pending_bytes > CACHE_BYTES_MAX;
        if !(disk_over || (cfg_destage && self.chance(self.cfg.destage_ppm))) {
            return;
        }
        if self.disks[d].pending.is_empty() {
            return;
        }
        // A full cache destages the oldest write (keeps memory bounded without making the
        // fault model depend on it); a destage fault picks any write.
        let i = if cfg_destage { self.rng.gen_range(0..self.disks[d].pending.len()) } else { 0 };
        let disk = &mut self.disks[d];
        let p = disk.pending.remove(i);
        disk.write_back(&p);
        // Older writes wholly inside the destaged one are superseded in the cache.
        let (s, e) = (p.offset, p.offset + p.data.len() as u64);
        let mut j = 0;
        let mut k = 0;
        disk.pending.retain(|q| {
            let older = j < i;
            j += 1;
            let inside = q.kind == PendingKind::Clean && q.offset >= s && q.offset + q.data.len() as u64 <= e;
            if older && inside {
                k += 1;
                false
            } else {
                true
            }
        });
        disk.pending_bytes = disk.pending.iter().map(|q| q.data.len() as u64).sum();
        if cfg_destage {
            self.counts.destaged += 1 + k;
        }
    }

    fn maybe_bit_flip(&mut self, d: usize) {
        if !(self.faults_enabled && self.cfg.bit_flips && self.persistent_budget_left()) {
            return;
        }
        if !self.chance(self.cfg.bit_flip_ppm) || self.disks[d].recent_data_blocks.is_empty() {
            return;
        }
        let n = self.disks[d].recent_data_blocks.len();
        let b = self.disks[d].recent_data_blocks[self.rng.gen_range(0..n)];
        // Flipping under a pending write would make `current` and `durable` disagree
        // outside the pending bookkeeping; such blocks are skipped.
        if self.disks[d].overlaps_pending(b * BLOCK_BYTES, BLOCK_BYTES) {
            return;
        }
        let bit = self.rng.gen_range(0..BLOCK_BYTES * 8);
        let byte = (b * BLOCK_BYTES + bit / 8) as usize;
        let disk = &mut self.disks[d];
        disk.current[byte] ^= 1 << (bit % 8);
        disk.durable[byte] ^= 1 << (bit % 8);
        disk.bad_current.insert(b);
        disk.bad_durable.insert(b);
        self.log_fault(d, b * BLOCK_BYTES, BLOCK_BYTES, format!("bit {} of block {b} flipped", bit));
        self.counts.bit_flips += 1;
        self.persistent_this_cycle += 1;
    }
}

/// A machine: disks, a seeded RNG, a crash switch. Shared by its disks.
pub struct SimMachine {
    state: Mutex<MachineState>,
}

/// One simulated disk of a machine.
pub struct SimDisk {
    machine: Arc<SimMachine>,
    index: usize,
    len: u64,
    name: String,
}

fn crash_error() -> io::Error {
    io::Error::other("simulated machine has crashed")
}

impl SimMachine {
    /// A machine with no disks; `seed` drives every random choice.
    pub fn new(seed: u64, cfg: FaultConfig) -> Arc<Self> {
        Arc::new(SimMachine {
            state: Mutex::new(MachineState {
                rng: ChaCha8Rng::seed_from_u64(seed ^ 0x5157_4449_534b),
                disks: Vec::new(),
                cfg,
                faults_enabled: false,
                crashed: false,
                crash_countdown: None,
                persistent_this_cycle: 0,
                counts: FaultCounts::default(),
                evidence: Evidence::default(),
                ops: 0,
                trace: 0xcbf2_9ce4_8422_2325,
                content_trace: 0xcbf2_9ce4_8422_2325,
                fault_log: std::collections::VecDeque::new(),
                passthrough: false,
                dump_trace: std::env::var_os("DEDUPVOL_SIM_TRACE").is_some(),
            }),
        })
    }

    /// Adds a zero-filled disk of `len` bytes (a multiple of 4096).
    pub fn add_disk(self: &Arc<Self>, name: &str, len: u64) -> Arc<SimDisk> {
        assert!(len.is_multiple_of(BLOCK_BYTES), "disk length must be whole blocks");
        let mut st = self.state.lock();
        let index = st.disks.len();
        st.disks.push(Disk {
            durable: vec![0; len as usize],
            current: vec![0; len as usize],
            pending: Vec::new(),
            pending_bytes: 0,
            bad_current: BTreeSet::new(),
            bad_durable: BTreeSet::new(),
            data_region: None,
            recent_data_blocks: Vec::new(),
            recent_next: 0,
        });
        Arc::new(SimDisk { machine: Arc::clone(self), index, len, name: name.to_string() })
    }

    /// Marks a byte range of disk `index` as the data region (block-aligned).
    pub fn set_data_region(&self, index: usize, region: Range<u64>) {
        assert!(region.start.is_multiple_of(BLOCK_BYTES) && region.end.is_multiple_of(BLOCK_BYTES));
        self.state.lock().disks[index].data_region = Some(region);
    }

    /// While on, reads see the cache image with no fault, no crash tick and no trace.
    pub fn set_passthrough(&self, on: bool) {
        self.state.lock().passthrough = on;
    }

    /// Turns fault injection on or off (crashes armed with `arm_crash` still happen).
    pub fn set_faults_enabled(&self, on: bool) {
        self.state.lock().faults_enabled = on;
    }

    /// The crash happens at the `after_calls`-th I/O call from now (0: the next one).
    pub fn arm_crash(&self, after_calls: u64) {
        self.state.lock().crash_countdown = Some(after_calls);
    }

    /// Cancels an armed crash that has not happened yet.
    pub fn disarm_crash(&self) {
        self.state.lock().crash_countdown = None;
    }

    /// True once the crash point was reached (every I/O fails until `power_cycle`).
    pub fn is_crashed(&self) -> bool {
        self.state.lock().crashed
    }

    /// Crashes the machine now (no more I/O), as a `kill -9` or power cut would.
    pub fn crash_now(&self) {
        self.state.lock().crashed = true;
    }

    /// Restarts the machine after a crash. With `power_loss`, each unsynced write is kept
    /// or dropped at random, kept ones may be torn, and they land in a random order; without,
    /// the cache survives (a process crash: the OS still holds the writes).
    pub fn power_cycle(&self, power_loss: bool) {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let faults = st.faults_enabled;
        let power_loss = power_loss && st.cfg.crash_loss && faults;
        let keep_ppm: u32 = st.rng.gen_range(0..=1_000_000);
        let torn_ppm: u32 = if st.cfg.torn_writes && faults { st.rng.gen_range(0..=500_000) } else { 0 };
        if power_loss {
            st.counts.power_failures += 1;
        } else {
            st.counts.process_crashes += 1;
        }
        for d in 0..st.disks.len() {
            let pending = std::mem::take(&mut st.disks[d].pending);
            let mut kept: Vec<(Pending, Option<Vec<bool>>)> = Vec::new();
            if power_loss {
                for p in pending {
                    if !st.chance(keep_ppm) {
                        st.counts.unsynced_lost += 1;
                        // A lost write that was also a fault still leaves its target wrong.
                        if let PendingKind::Lost = p.kind {
                            st.disks[d].bad_durable.extend(blocks_touched(p.offset, p.data.len() as u64));
                        }
                        if let PendingKind::Misdirected { from } = p.kind {
                            st.disks[d].bad_durable.extend(blocks_touched(from, p.data.len() as u64));
                        }
                        continue;
                    }
                    let sectors = p.data.len().div_ceil(SECTOR_BYTES as usize);
                    let torn = if sectors > 1 && st.chance(torn_ppm) {
                        st.counts.torn += 1;
                        Some((0..sectors).map(|_| st.rng.gen_bool(0.5)).collect())
                    } else {
                        None
                    };
                    kept.push((p, torn));
                }
                kept.shuffle(&mut st.rng);
            } else {
                kept = pending.into_iter().map(|p| (p, None)).collect();
            }
            let disk = &mut st.disks[d];
            for (p, torn) in &kept {
                disk.apply_to_durable(p, torn.as_deref());
            }
            disk.current.copy_from_slice(&disk.durable);
            disk.bad_current = disk.bad_durable.clone();
            disk.pending_bytes = 0;
        }
        st.crashed = false;
        st.crash_countdown = None;
        st.persistent_this_cycle = 0;
    }

    /// Fault counts so far.
    pub fn counts(&self) -> FaultCounts {
        self.state.lock().counts.clone()
    }

    /// Attribution counters so far.
    pub fn evidence(&self) -> Evidence {
        self.state.lock().evidence
    }

    /// A hash of every I/O call so far (same seed ⇒ same value, or the run is not reproducible).
    pub fn trace_hash(&self) -> u64 {
        self.state.lock().trace
    }

    /// A hash of every I/O call and every written byte so far.
    pub fn content_trace_hash(&self) -> u64 {
        self.state.lock().content_trace
    }

    /// I/O calls so far.
    pub fn io_calls(&self) -> u64 {
        self.state.lock().ops
    }

    /// Blocks of disk `index` currently marked bad by persistent faults.
    pub fn bad_blocks(&self, index: usize) -> usize {
        self.state.lock().disks[index].bad_current.len()
    }

    /// True when media block `block` (4 KiB units) of disk `index` was hit by a persistent fault.
    pub fn is_bad_on_media(&self, index: usize, block: u64) -> bool {
        self.state.lock().disks[index].bad_durable.contains(&block)
    }

    /// The logged persistent faults that touched block `block` of disk `index`.
    pub fn faults_touching(&self, index: usize, block: u64) -> Vec<String> {
        let st = self.state.lock();
        st.fault_log
            .iter()
            .filter(|(d, first, n, _)| *d == index && block >= *first && block < first + n)
            .map(|(_, _, _, w)| w.clone())
            .collect()
    }

    /// Media block `block` (4 KiB) of disk `index`.
    pub fn media_block(&self, index: usize, block: u64) -> Vec<u8> {
        let st = self.state.lock();
        let o = (block * BLOCK_BYTES) as usize;
        st.disks[index].durable[o..o + BLOCK_BYTES as usize].to_vec()
    }

    /// Flips one random bit of media block `block` of disk `index` while the machine is
    /// powered off (no pending writes), e.g. in one of two redundant metadata copies. Not
    /// marked bad: the engine must survive it completely.
    pub fn corrupt_redundant_copy(&self, index: usize, block: u64) {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        assert!(st.disks[index].pending.is_empty(), "redundant copies are corrupted only between power cycles");
        let bit = st.rng.gen_range(0..BLOCK_BYTES * 8);
        let byte = (block * BLOCK_BYTES + bit / 8) as usize;
        let disk = &mut st.disks[index];
        disk.durable[byte] ^= 1 << (bit % 8);
        disk.current[byte] ^= 1 << (bit % 8);
        st.counts.superblock_copies += 1;
    }

    /// A copy of the media image of disk `index` (tests).
    pub fn durable_image(&self, index: usize) -> Vec<u8> {
        self.state.lock().disks[index].durable.clone()
    }

    /// A copy of what reads of disk `index` see (tests).
    pub fn current_image(&self, index: usize) -> Vec<u8> {
        self.state.lock().disks[index].current.clone()
    }

    /// A random number from the machine's RNG (lets the driver share the one seed stream).
    pub fn random_below(&self, n: u64) -> u64 {
        self.state.lock().rng.gen_range(0..n.max(1))
    }
}

impl SimDisk {
    /// The disk's index in its machine.
    pub fn index(&self) -> usize {
        self.index
    }
}

impl dedupvol_core::Storage for SimDisk {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let mut guard = self.machine.state.lock();
        let st = &mut *guard;
        let len = buf.len() as u64;
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read beyond end of simulated disk"));
        }
        if st.passthrough {
            buf.copy_from_slice(&st.disks[self.index].current[offset as usize..(offset + len) as usize]);
            return Ok(());
        }
        st.trace(1, self.index, offset, len, 0);
        if st.tick() {
            return Err(crash_error());
        }
        if st.faults_enabled && st.cfg.read_errors && st.chance(st.cfg.read_error_ppm) {
            st.counts.read_errors += 1;
            st.evidence.transient += 1;
            return Err(io::Error::other("simulated transient read error"));
        }
        let disk = &st.disks[self.index];
        buf.copy_from_slice(&disk.current[offset as usize..(offset + len) as usize]);
        if blocks_touched(offset, len).any(|b| disk.bad_current.contains(&b)) {
            st.evidence.bad_reads += 1;
        }
        let in_data = disk.in_data_region(offset, len);
        if in_data && st.faults_enabled && st.cfg.read_flips && !buf.is_empty() && st.chance(st.cfg.read_flip_ppm) {
            let bit = st.rng.gen_range(0..len * 8);
            buf[(bit / 8) as usize] ^= 1 << (bit % 8);
            st.counts.read_flips += 1;
            st.evidence.transient += 1;
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let mut guard = self.machine.state.lock();
        let st = &mut *guard;
        let len = buf.len() as u64;
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "write beyond end of simulated disk"));
        }
        st.trace(2, self.index, offset, len, crc32c::crc32c(buf));
        if st.tick() {
            return Err(crash_error());
        }
        if st.faults_enabled && st.cfg.write_errors && st.chance(st.cfg.write_error_ppm) {
            st.counts.write_errors += 1;
            st.evidence.transient += 1;
            return Err(io::Error::other("simulated write error"));
        }
        let d = self.index;
        let in_data = st.disks[d].in_data_region(offset, len);
        let faulty = in_data && st.faults_enabled && st.persistent_budget_left();
        let mut kind = PendingKind::Clean;
        let mut store_at = offset;
        if faulty && st.cfg.lost_writes && st.chance(st.cfg.lost_write_ppm) {
            kind = PendingKind::Lost;
        } else if faulty && st.cfg.misdirected_writes && st.chance(st.cfg.misdirect_ppm) {
            let region = st.disks[d].data_region.clone().unwrap_or(0..0);
            let slots = (region.end - region.start).saturating_sub(len) / BLOCK_BYTES;
            let to = region.start + st.rng.gen_range(0..=slots) * BLOCK_BYTES;
            if to != offset {
                kind = PendingKind::Misdirected { from: offset };
                store_at = to;
            }
        }
        let disk = &mut st.disks[d];
        match kind {
            PendingKind::Clean => {
                disk.current[offset as usize..(offset + len) as usize].copy_from_slice(buf);
                for b in blocks_covered(offset, len) {
                    disk.bad_current.remove(&b);
                }
            }
            PendingKind::Lost => {
                disk.bad_current.extend(blocks_touched(offset, len));
            }
            PendingKind::Misdirected { from } => {
                disk.current[store_at as usize..(store_at + len) as usize].copy_from_slice(buf);
                disk.bad_current.extend(blocks_touched(from, len));
                disk.bad_current.extend(blocks_touched(store_at, len));
            }
        }
        disk.pending_bytes += len;
        disk.pending.push(Pending { offset: store_at, data: buf.to_vec(), kind });
        if in_data {
            disk.remember_data_blocks(offset, len);
        }
        match kind {
            PendingKind::Clean => {}
            PendingKind::Lost => {
                st.counts.lost_writes += 1;
                st.persistent_this_cycle += 1;
                st.log_fault(d, offset, len, format!("write of {len} bytes at block {} lost", offset / BLOCK_BYTES));
            }
            PendingKind::Misdirected { from } => {
                st.counts.misdirected_writes += 1;
                st.persistent_this_cycle += 1;
                let what = format!(
                    "write of {len} bytes for block {} misdirected to block {}",
                    from / BLOCK_BYTES,
                    store_at / BLOCK_BYTES
                );
                st.log_fault(d, from, len, what.clone());
                st.log_fault(d, store_at, len, what);
            }
        }
        st.maybe_destage(d);
        st.maybe_bit_flip(d);
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        let mut guard = self.machine.state.lock();
        let st = &mut *guard;
        st.trace(3, self.index, 0, 0, 0);
        if st.tick() {
            return Err(crash_error());
        }
        if st.faults_enabled && st.cfg.write_errors && st.chance(st.cfg.write_error_ppm) {
            // Nothing is made durable; the writes stay in the cache and may still be lost.
            st.counts.sync_errors += 1;
            st.evidence.transient += 1;
            return Err(io::Error::other("simulated sync error"));
        }
        let disk = &mut st.disks[self.index];
        let pending = std::mem::take(&mut disk.pending);
        for p in &pending {
            disk.write_back(p);
        }
        disk.pending_bytes = 0;
        Ok(())
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn name(&self) -> String {
        self.name.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dedupvol_core::Storage;

    fn crash_only() -> FaultConfig {
        FaultConfig { crash_loss: true, torn_writes: true, ..FaultConfig::none() }
    }

    #[test]
    fn synced_writes_survive_and_unsynced_may_not() {
        for seed in 0..64 {
            let m = SimMachine::new(seed, crash_only());
            m.set_faults_enabled(true);
            let d = m.add_disk("d", 64 * BLOCK_BYTES);
            d.write_at(&[1u8; 4096], 0).expect("write");
            d.sync().expect("sync");
            d.write_at(&[2u8; 4096], 0).expect("write");
            d.write_at(&[3u8; 8192], 4096).expect("write");
            let mut b = vec![0u8; 4096];
            d.read_at(&mut b, 0).expect("read");
            assert_eq!(b, vec![2u8; 4096], "reads see the cache");
            m.crash_now();
            assert!(d.read_at(&mut b, 0).is_err(), "I/O fails after the crash point");
            m.power_cycle(true);
            d.read_at(&mut b, 0).expect("read");
            // Block 0: the synced 1s, the unsynced 2s, or a sector-wise mix of the two.
            for s in b.chunks(512) {
                assert!(s.iter().all(|&x| x == s[0]) && (s[0] == 1 || s[0] == 2), "seed {seed}: sector {s:?}");
            }
            let mut c = vec![0u8; 8192];
            d.read_at(&mut c, 4096).expect("read");
            for s in c.chunks(512) {
                assert!(s.iter().all(|&x| x == s[0]) && (s[0] == 0 || s[0] == 3), "seed {seed}");
            }
            assert!(
                m.durable_image(0) == m.current_image(0),
                "seed {seed}: media differs from cache after power cycle"
            );
        }
    }

    #[test]
    fn sync_makes_the_cache_durable_even_with_destage() {
        let cfg = FaultConfig { destage: true, destage_ppm: 500_000, crash_loss: true, ..FaultConfig::none() };
        let m = SimMachine::new(7, cfg);
        m.set_faults_enabled(true);
        let d = m.add_disk("d", 64 * BLOCK_BYTES);
        for i in 0..200u64 {
            let off = (i * 7919 % 60) * 512;
            d.write_at(&vec![i as u8; 1024 + (i as usize % 3) * 512], off).expect("write");
            if i % 37 == 0 {
                d.sync().expect("sync");
                assert!(m.durable_image(0) == m.current_image(0), "media differs from cache after sync at {i}");
            }
        }
        d.sync().expect("sync");
        let before = m.current_image(0);
        m.crash_now();
        m.power_cycle(true);
        assert!(m.current_image(0) == before, "a synced disk loses nothing");
    }

    #[test]
    fn persistent_faults_stay_in_the_data_region_and_are_evidenced() {
        let cfg = FaultConfig {
            lost_writes: true,
            lost_write_ppm: 300_000,
            misdirected_writes: true,
            misdirect_ppm: 300_000,
            bit_flips: true,
            bit_flip_ppm: 300_000,
            ..FaultConfig::none()
        };
        let m = SimMachine::new(11, cfg);
        let d = m.add_disk("d", 64 * BLOCK_BYTES);
        d.write_at(&[9u8; 4096 * 8], 0).expect("write");
        d.sync().expect("sync");
        m.set_data_region(0, 32 * BLOCK_BYTES..64 * BLOCK_BYTES);
        m.set_faults_enabled(true);
        for i in 0..40u64 {
            d.write_at(&[i as u8 + 1; 4096], (32 + i % 32) * BLOCK_BYTES).expect("write");
            d.write_at(&[5u8; 4096], (i % 8) * BLOCK_BYTES).expect("metadata write");
        }
        d.sync().expect("sync");
        let img = m.durable_image(0);
        assert!(img[..8 * 4096].iter().all(|&x| x == 5), "metadata blocks were never faulted");
        assert!(img[8 * 4096..32 * 4096].iter().all(|&x| x == 0), "nothing outside the data region was hit");
        let c = m.counts();
        assert!(c.lost_writes + c.misdirected_writes + c.bit_flips > 0);
        assert!(c.lost_writes + c.misdirected_writes + c.bit_flips <= PERSISTENT_FAULTS_PER_CYCLE_MAX);
        assert!(m.bad_blocks(0) > 0);
        let before = m.evidence();
        let mut b = vec![0u8; 32 * 4096];
        d.read_at(&mut b, 32 * BLOCK_BYTES).expect("read");
        assert!(m.evidence().bad_reads > before.bad_reads, "reading a faulted block is evidenced");
    }
}
