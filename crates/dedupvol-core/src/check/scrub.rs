//! Scrub: reads every referenced data block and every block map and refcount page from
//! the device, checks them against their checksums, reports damage and (with `repair`)
//! rewrites damaged data blocks from a good copy, on an open volume that keeps serving.
//!
//! Steps (`Volume::scrub`):
//! 1. metadata: both slots of every refcount and block map page, `SCRUB_PAGES_PER_LOCK`
//!    pages per hold of the state lock (a checkpoint or an eviction writes pages under
//!    that lock, so a page is never read half-written), both superblock copies of each
//!    device, and both copies of the volume's dictionary (with `repair`, a damaged copy
//!    is written again from the dictionary in use);
//! 2. data: the block map is walked `SCRUB_LBAS_PER_LOCK` entries per hold of the state
//!    lock; blocks not on the device yet (staged, in an open packed block) are skipped;
//!    the others are read without the lock, straight from the device (never the content
//!    cache or the tier: the scrub must see what the device holds), in runs of
//!    consecutive blocks, and each referenced raw block or packed fragment is checked
//!    against the crc in its map entry;
//! 3. a mismatch is confirmed under the state lock: the entry must still be the one read
//!    and its block still on the device (the block may have been freed and reused since
//!    the walk), and the block is read again there;
//! 4. confirmed damage: with `repair`, a good copy of the whole physical block (the
//!    hot-chunk tier's, checked against its slot crc; the content cache's, checked
//!    against the crc it entered with) that decodes to the entry's crc is written back in
//!    place, synced and read back; otherwise the block leaves deduplication, the cache
//!    and the tier (`forget_damaged`), and its logical blocks are reported lost;
//! 5. throttle: after each chunk the scrub sleeps until its reads are within the rate.
//!
//! Invariants:
//! - The state lock is held for at most `SCRUB_LBAS_PER_LOCK` map lookups, or
//!   `SCRUB_PAGES_PER_LOCK` page reads, or one confirmation (two 4 KiB reads and at most
//!   one 4 KiB write and a sync), never for a run of data reads.
//! - A repair only rewrites a physical block in place, with bytes proven to be that
//!   block's content (a copy whose referenced fragments decode to their entries' crcs),
//!   while the state lock holds the block referenced: a referenced block's content never
//!   changes, so no newer client data is ever overwritten. Logical blocks are never
//!   remapped by a scrub.
//! - Reports are bounded: `DAMAGE_LISTED_MAX` damaged locations, `LOST_RANGES_LISTED_MAX`
//!   lost ranges; beyond them only counts grow.

use crate::check::LostRange;
use crate::config::{BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::data::packer;
use crate::error::{Error, Result};
use crate::io::IoKind;
use crate::metadata::block_map::{pick_slot, MapEntry, Scanned, BM_PAGE_MAGIC};
use crate::metadata::refcount::RC_PAGE_MAGIC;
use crate::metadata::superblock::Superblock;
use crate::volume::Volume;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Map entries looked up per hold of the state lock.
const SCRUB_LBAS_PER_LOCK: u64 = 4096;
/// Metadata pages (two slots each) read per hold of the state lock (128 KiB).
const SCRUB_PAGES_PER_LOCK: u64 = 16;
/// Data blocks read with one request (1 MiB).
const SCRUB_RUN_BLOCKS_MAX: usize = 256;
/// Damaged locations listed in a report.
const DAMAGE_LISTED_MAX: usize = 1000;
/// Lost logical ranges listed in a report.
const LOST_RANGES_LISTED_MAX: usize = 1000;
/// Metadata findings listed in a report.
const METADATA_LISTED_MAX: usize = 100;
/// Longest single throttling sleep, so a cancel is seen soon.
const THROTTLE_SLEEP_MAX: Duration = Duration::from_millis(200);

/// How to scrub.
#[derive(Debug, Clone, Default)]
pub struct ScrubOptions {
    /// Rewrite damaged data blocks from a good copy (tier, content cache) where one exists.
    pub repair: bool,
    /// Bound on the scrub's device reads, in bytes per second (None: as fast as it goes).
    pub rate_bytes_per_sec: Option<u64>,
    /// Set to stop the scrub early (it returns what it found so far).
    pub cancel: Option<Arc<AtomicBool>>,
}

/// Progress and outcome of the current or last scrub (in `Stats::scrub`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ScrubStatus {
    /// Still running.
    pub running: bool,
    /// Repair was asked for.
    pub repair: bool,
    /// Start, in seconds since the Unix epoch.
    pub started_unix: u64,
    /// End, in seconds since the Unix epoch (None while running).
    pub finished_unix: Option<u64>,
    /// Seconds spent so far.
    pub seconds: f64,
    /// Logical blocks whose mapping was looked at.
    pub logical_blocks_scanned: u64,
    /// Logical blocks of the volume.
    pub logical_blocks_total: u64,
    /// Data blocks read from the device.
    pub blocks_read: u64,
    /// Block map and refcount pages read (both slots).
    pub metadata_pages_read: u64,
    /// Bytes read from the devices.
    pub bytes_read: u64,
    /// Damaged data locations found (a raw block, or a packed block's fragment).
    pub damaged: u64,
    /// Of those, repaired from a good copy.
    pub repaired: u64,
    /// Logical blocks whose data is lost (mapped to damage that was not repaired).
    pub lost_blocks: u64,
    /// Metadata page copies or superblock copies found damaged.
    pub metadata_damaged: u64,
    /// Stopped before the end.
    pub cancelled: bool,
    /// Why the scrub stopped with an error.
    pub error: Option<String>,
}

/// One damaged data location.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScrubDamage {
    /// The physical block.
    pub pbn: u64,
    /// The fragment block (`Frag::key`: offset, block in its unit), for a fragment.
    pub slot: Option<u16>,
    /// The block could not be read at all.
    pub unreadable: bool,
    /// Where the good copy came from ("tier", "content cache"), when repaired.
    pub repaired_from: Option<String>,
    /// Logical blocks that map to it (as found by this scrub, at most 8).
    pub lbas: Vec<u64>,
}

/// What a scrub found.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScrubReport {
    /// Figures.
    pub status: ScrubStatus,
    /// Damaged data locations (at most `DAMAGE_LISTED_MAX`).
    pub damage: Vec<ScrubDamage>,
    /// Lost logical ranges in bytes (damage not repaired; at most `LOST_RANGES_LISTED_MAX`).
    pub lost_ranges: Vec<LostRange>,
    /// Metadata findings (damaged page or superblock copies).
    pub metadata: Vec<String>,
}

impl ScrubReport {
    /// True when nothing damaged is left (none found, or all repaired).
    pub fn is_clean(&self) -> bool {
        self.status.error.is_none() && self.status.damaged == self.status.repaired && self.status.metadata_damaged == 0
    }
}

fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A location to check: a logical block and its entry, as the walk found it.
#[derive(Clone, Copy)]
struct Ref {
    lba: u64,
    e: MapEntry,
}

/// Checks the content of `e`'s blocks (`span`, from its first block on) for `e`: a raw
/// block's crc, or the fragment's decoded crc.
fn matches(span: &[u8], e: &MapEntry, out: &mut [u8]) -> bool {
    match e.fragment_of() {
        None => span.get(..BLOCK_SIZE).is_some_and(|b| crc32c::crc32c(b) == e.crc),
        Some(f) => packer::decode_block(e.pbn, &f, span, out).is_ok() && crc32c::crc32c(out) == e.crc,
    }
}

struct Run<'a> {
    vol: &'a Volume,
    opts: &'a ScrubOptions,
    report: ScrubReport,
    started: Instant,
    /// Bytes read since `started`, for the throttle.
    throttle_bytes: u64,
    /// Lost logical blocks, merged.
    lost: Vec<std::ops::Range<u64>>,
}

impl Volume {
    /// The current or last scrub of this process (None: none ran).
    pub fn scrub_status(&self) -> Option<ScrubStatus> {
        self.scrub.lock().clone()
    }

    /// Scrubs the volume (see the module header); one scrub at a time. Safe while clients
    /// read and write. `repair` needs a writable volume.
    pub fn scrub(&self, opts: &ScrubOptions) -> Result<ScrubReport> {
        if opts.repair && self.read_only {
            return Err(Error::ReadOnly);
        }
        {
            let mut s = self.scrub.lock();
            if s.as_ref().is_some_and(|s| s.running) {
                return Err(Error::InvalidArgument("a scrub of this volume is already running".into()));
            }
            *s = Some(ScrubStatus {
                running: true,
                repair: opts.repair,
                started_unix: now_unix(),
                logical_blocks_total: self.logical_blocks(),
                ..ScrubStatus::default()
            });
        }
        let mut run = Run {
            vol: self,
            opts,
            report: ScrubReport::default(),
            started: Instant::now(),
            throttle_bytes: 0,
            lost: Vec::new(),
        };
        run.report.status = self.scrub_status().unwrap_or_default();
        let r = run.metadata().and_then(|()| run.data());
        let mut report = run.finish(r.as_ref().err());
        report.status.running = false;
        *self.scrub.lock() = Some(report.status.clone());
        r.map(|()| report)
    }
}

impl Run<'_> {
    fn cancelled(&self) -> bool {
        self.opts.cancel.as_ref().is_some_and(|c| c.load(Ordering::Relaxed))
    }

    fn publish(&mut self) {
        self.report.status.seconds = self.started.elapsed().as_secs_f64();
        self.report.status.lost_blocks = self.lost.iter().map(|r| r.end - r.start).sum();
        *self.vol.scrub.lock() = Some(self.report.status.clone());
    }

    fn read_bytes(&mut self, n: u64) {
        self.report.status.bytes_read += n;
        self.throttle_bytes += n;
    }

    /// Sleeps until the bytes read are within the rate (in short naps, watching cancel).
    fn throttle(&mut self) {
        let Some(rate) = self.opts.rate_bytes_per_sec.filter(|&r| r > 0) else { return };
        let due = Duration::from_secs_f64(self.throttle_bytes as f64 / rate as f64);
        while !self.cancelled() {
            let Some(wait) = due.checked_sub(self.started.elapsed()).filter(|w| !w.is_zero()) else { break };
            std::thread::sleep(wait.min(THROTTLE_SLEEP_MAX));
        }
    }

    fn metadata_finding(&mut self, m: String) {
        self.report.status.metadata_damaged += 1;
        if self.report.metadata.len() < METADATA_LISTED_MAX {
            self.report.metadata.push(m);
        }
    }

    /// Step 1: both slots of every page, and the superblock copies.
    fn metadata(&mut self) -> Result<()> {
        let vol = self.vol;
        for (dev, role) in std::iter::once((vol.data.dev(), 0u8)).chain(vol.separate_meta().map(|m| (m, 1u8))) {
            match Superblock::read(dev, role) {
                Ok((_, notes)) => notes.into_iter().for_each(|n| self.metadata_finding(n)),
                Err(e) => self.metadata_finding(format!("superblock of {}: {e}", dev.name())),
            }
            self.read_bytes(2 * BLOCK_SIZE_U64);
        }
        self.dictionary()?;
        let geo = vol.geometry();
        let ulo = crate::volume::uuid_lo(&vol.sb.lock().uuid);
        let regions = [
            ("refcount", RC_PAGE_MAGIC, geo.refcount_start, geo.refcount_pages),
            ("block map", BM_PAGE_MAGIC, geo.block_map_start, geo.block_map_pages),
        ];
        let mut buf = vec![0u8; 2 * BLOCK_SIZE * SCRUB_PAGES_PER_LOCK as usize];
        for (name, magic, start, pages) in regions {
            let mut p = 0;
            while p < pages {
                if self.cancelled() {
                    return Ok(());
                }
                let n = (pages - p).min(SCRUB_PAGES_PER_LOCK);
                #[expect(clippy::indexing_slicing, reason = "n <= SCRUB_PAGES_PER_LOCK, the buffer's size in pages")]
                let b = &mut buf[..2 * BLOCK_SIZE * n as usize];
                {
                    let _st = vol.state.lock();
                    vol.meta.read(IoKind::Scrub, b, (start + 2 * p) * BLOCK_SIZE_U64)?;
                }
                for (k, both) in b.chunks_exact(2 * BLOCK_SIZE).enumerate() {
                    let page = p + k as u64;
                    let pick = pick_slot(both, magic, page, ulo);
                    if !pick.damaged {
                        continue;
                    }
                    // The damaged copy's header says how new it was, when it survived.
                    let claimed = |s: usize| both.get(s * BLOCK_SIZE + 16..s * BLOCK_SIZE + 24);
                    let newer = (0..2).filter(|&s| Some(s as u8) != pick.slot).any(|s| {
                        claimed(s).and_then(|c| c.try_into().ok()).map(u64::from_le_bytes).is_some_and(|q| q > pick.seq)
                    });
                    let what = match (pick.slot, newer) {
                        (None, _) => "no valid copy (its entries read as empty)",
                        (Some(_), true) => "its newest copy is damaged; an older copy is in use",
                        (Some(_), false) => {
                            "an older copy is damaged (a torn write; the next write of the page replaces it)"
                        }
                    };
                    self.metadata_finding(format!("{name} page {page}: {what}"));
                }
                self.report.status.metadata_pages_read += n;
                self.read_bytes(2 * BLOCK_SIZE_U64 * n);
                p += n;
                self.publish();
                self.throttle();
            }
        }
        Ok(())
    }

    /// Step 1, the dictionary: both copies of the installed dictionary
    /// (`Volume::audit_dictionary_copies`). With `repair`, a damaged copy is written again
    /// from the dictionary in use; a failed write fails the volume, as any failed metadata
    /// write.
    fn dictionary(&mut self) -> Result<()> {
        let audit = match self.vol.audit_dictionary_copies(self.opts.repair) {
            Ok(a) => a,
            Err(e) => return self.vol.fail(e),
        };
        self.read_bytes(audit.bytes_read);
        for d in audit.damaged {
            let what = d.describe();
            if !d.repaired {
                self.metadata_finding(what);
            } else if self.report.metadata.len() < METADATA_LISTED_MAX {
                self.report.metadata.push(format!("{what}, rewritten"));
            }
        }
        Ok(())
    }

    /// Step 2: the block map in chunks, the data in runs.
    fn data(&mut self) -> Result<()> {
        let vol = self.vol;
        let mut scratch = vec![0u8; BLOCK_SIZE];
        let mut lba = 0;
        while lba < vol.logical_blocks() {
            if self.cancelled() {
                self.report.status.cancelled = true;
                return Ok(());
            }
            let end = (lba + SCRUB_LBAS_PER_LOCK).min(vol.logical_blocks());
            let mut by_pbn: BTreeMap<u64, Vec<Ref>> = BTreeMap::new();
            let mut map_error: Option<(u64, String)> = None;
            let mut unreadable = 0u64;
            {
                let mut st = vol.state.lock();
                let mut next = lba;
                while next < end {
                    let l = next;
                    next += 1;
                    // An unreadable page (or an undecodable entry): the blocks it maps
                    // cannot be checked; the finding names the first, and the walk goes
                    // on, past the rest of a page the device could not read.
                    let e = match st.map.scan(l) {
                        Scanned::Entry(e) => e,
                        Scanned::Undecodable(err) => {
                            unreadable += 1;
                            map_error.get_or_insert((l, err.to_string()));
                            continue;
                        }
                        Scanned::Unreadable { next: past, error } => {
                            next = past.min(end);
                            unreadable += next - l;
                            map_error.get_or_insert((l, error.to_string()));
                            continue;
                        }
                    };
                    if !e.is_data() || st.unwritten(&e, &mut scratch).is_some() {
                        continue;
                    }
                    by_pbn.entry(e.pbn).or_default().push(Ref { lba: l, e });
                }
                let d = st.journal.durable_seq();
                st.map.evict(d)?;
            }
            self.report.status.logical_blocks_scanned += end - lba;
            if let Some((first, err)) = &map_error {
                let n = unreadable;
                self.metadata_finding(format!(
                    "block map entries of {n} logical blocks from {first} unreadable: {err}"
                ));
            }
            self.check_chunk(&by_pbn)?;
            lba = end;
            self.publish();
            self.throttle();
        }
        Ok(())
    }

    /// Reads the chunk's blocks in runs and checks every reference.
    fn check_chunk(&mut self, by_pbn: &BTreeMap<u64, Vec<Ref>>) -> Result<()> {
        let vol = self.vol;
        let pbns: Vec<u64> = by_pbn.keys().copied().collect();
        let mut run = vec![0u8; SCRUB_RUN_BLOCKS_MAX * BLOCK_SIZE];
        let mut out = vec![0u8; BLOCK_SIZE];
        let mut i = 0;
        while i < pbns.len() {
            let first = pbns.get(i).copied().unwrap_or(0);
            let mut n = 1;
            while n < SCRUB_RUN_BLOCKS_MAX && pbns.get(i + n) == Some(&(first + n as u64)) {
                n += 1;
            }
            #[expect(clippy::indexing_slicing, reason = "n <= SCRUB_RUN_BLOCKS_MAX, the buffer's size in blocks")]
            let buf = &mut run[..n * BLOCK_SIZE];
            let whole = vol.data.read(IoKind::Scrub, first, buf, "block map entry").is_ok();
            self.read_bytes((n * BLOCK_SIZE) as u64);
            self.report.status.blocks_read += n as u64;
            for k in 0..n {
                let pbn = first + k as u64;
                let refs = by_pbn.get(&pbn).map_or(&[][..], |v| v.as_slice());
                // A run that failed to read is confirmed block by block under the lock; a
                // fragment running on past the run is read on its own.
                let mut bad: Vec<Ref> = Vec::new();
                for r in refs {
                    let span = r.e.span() as usize;
                    let ok = match buf.get(k * BLOCK_SIZE..(k + span) * BLOCK_SIZE).filter(|_| whole) {
                        Some(b) => matches(b, &r.e, &mut out),
                        None if whole => {
                            let mut b = vec![0u8; span * BLOCK_SIZE];
                            let read = vol.data.read(IoKind::Scrub, pbn, &mut b, "block map entry").is_ok();
                            self.read_bytes((span * BLOCK_SIZE) as u64);
                            read && matches(&b, &r.e, &mut out)
                        }
                        None => false,
                    };
                    if !ok {
                        bad.push(*r);
                    }
                }
                if !bad.is_empty() {
                    self.confirm(pbn, &bad)?;
                }
            }
            i += n;
        }
        Ok(())
    }

    /// Steps 3 and 4 for the suspect references of one physical block.
    fn confirm(&mut self, pbn: u64, suspects: &[Ref]) -> Result<()> {
        let vol = self.vol;
        let span = suspects.iter().map(|r| r.e.span()).max().unwrap_or(1).max(1) as usize;
        let mut block = vec![0u8; span * BLOCK_SIZE];
        let mut out = vec![0u8; BLOCK_SIZE];
        let mut st = vol.state.lock();
        // Still referenced as found, and on the device: then the read below sees the
        // block's one content (a referenced block is never rewritten).
        let mut still = Vec::new();
        for r in suspects {
            if st.map.get(r.lba)? == r.e && st.unwritten(&r.e, &mut out).is_none() {
                still.push(*r);
            }
        }
        if still.is_empty() {
            return Ok(());
        }
        let readable = vol.data.read(IoKind::Scrub, pbn, &mut block, "block map entry").is_ok();
        self.read_bytes((span * BLOCK_SIZE) as u64);
        let damaged: Vec<Ref> = still.into_iter().filter(|r| !readable || !matches(&block, &r.e, &mut out)).collect();
        if damaged.is_empty() {
            return Ok(());
        }
        // One finding per damaged location (the raw block, or each damaged slot).
        let mut slots: BTreeMap<Option<u16>, Vec<u64>> = BTreeMap::new();
        for r in &damaged {
            slots.entry(if readable { r.e.fragment_of().map(|f| f.key()) } else { None }).or_default().push(r.lba);
        }
        // Copies are of whole blocks: a fragment running on into further blocks is not
        // repaired from one.
        let source = if self.opts.repair && span == 1 { self.good_copy(pbn, &damaged, &mut out) } else { None };
        let repaired = match source {
            Some((from, copy)) => {
                let ok = vol.rewrite_in_place(pbn, &copy).is_ok()
                    && vol.data.read(IoKind::Scrub, pbn, &mut block, "block map entry").is_ok()
                    && damaged.iter().all(|r| matches(&block, &r.e, &mut out));
                ok.then_some(from)
            }
            None => None,
        };
        if repaired.is_none() {
            vol.forget_damaged(&mut st, pbn);
        }
        drop(st);
        for (slot, lbas) in slots {
            self.report.status.damaged += 1;
            if repaired.is_some() {
                self.report.status.repaired += 1;
            } else {
                for &l in &lbas {
                    match self.lost.last_mut() {
                        Some(r) if r.end == l => r.end += 1,
                        _ => self.lost.push(l..l + 1),
                    }
                }
            }
            if self.report.damage.len() < DAMAGE_LISTED_MAX {
                self.report.damage.push(ScrubDamage {
                    pbn,
                    slot,
                    unreadable: !readable,
                    repaired_from: repaired.map(str::to_string),
                    lbas: lbas.into_iter().take(8).collect(),
                });
            }
        }
        Ok(())
    }

    /// A copy of `pbn`'s whole block that decodes to every damaged reference's crc: the
    /// tier's (its slot crc checked on read), else the content cache's (checked against
    /// the crc it entered with). Called under the state lock.
    fn good_copy(&self, pbn: u64, refs: &[Ref], out: &mut [u8]) -> Option<(&'static str, Vec<u8>)> {
        let vol = self.vol;
        let mut proves = |b: &[u8]| b.len() == BLOCK_SIZE && refs.iter().all(|r| matches(b, &r.e, out));
        if let Some(b) = vol.tier.as_ref().and_then(|t| t.read(pbn)) {
            if proves(&b) {
                return Some(("tier", b.to_vec()));
            }
        }
        let cached = vol.cache.lock().get_with_crc(pbn);
        if let Some((b, crc)) = cached {
            if crc32c::crc32c(&b) == crc && proves(&b) {
                return Some(("content cache", b.to_vec()));
            }
        }
        None
    }

    fn finish(mut self, err: Option<&Error>) -> ScrubReport {
        self.report.status.error = err.map(|e| e.to_string());
        self.report.status.finished_unix = Some(now_unix());
        self.publish();
        self.report.lost_ranges = self
            .lost
            .iter()
            .take(LOST_RANGES_LISTED_MAX)
            .map(|r| LostRange { offset: r.start * BLOCK_SIZE_U64, len: (r.end - r.start) * BLOCK_SIZE_U64 })
            .collect();
        self.report
    }
}

impl Volume {
    /// Writes `content` over data block `pbn` in place and syncs the data device. Only for
    /// a scrub's repair, under the state lock, with content proven to be the block's.
    fn rewrite_in_place(&self, pbn: u64, content: &[u8]) -> Result<()> {
        if !self.data.contains(pbn) || content.len() != BLOCK_SIZE {
            return Err(Error::internal("scrub repair of a block outside the data region", format!("pbn {pbn}")));
        }
        let r =
            self.data.dev().write(IoKind::Scrub, content, self.geo.data_offset(pbn)).and_then(|()| self.data.sync());
        // A failed write or sync leaves the device unknown: the failed-volume rule.
        self.guard(r)
    }
}
