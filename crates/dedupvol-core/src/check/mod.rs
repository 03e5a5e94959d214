//! The volume audit behind `dedupvol check`: every reference count equals the references
//! to its block, no physical block is leaked or used twice, every checksum is valid, and
//! the space counters are exact.
//!
//! Invariants:
//! - A read-only audit writes nothing (a dirty volume is replayed in memory only).
//! - `repair` only changes what can be recomputed from the block map (reference counts,
//!   counters, superblock copies); mappings to unreadable data are reported, not dropped.

pub(crate) mod scrub;

use crate::config::{OpenOptions, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::data::packer;
use crate::error::Result;
use crate::io::{IoKind, Storage};
use crate::metadata::block_map::{MapEntry, Scanned};
use crate::metadata::journal::Counters;
use crate::metadata::refcount::REFCOUNT_MAX;
use crate::volume::{OpenNote, Volume};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;

/// Problems listed in full before the report summarises the rest.
const PROBLEMS_LISTED_MAX: usize = 100;
/// Lost logical ranges listed in full before the report only counts them.
const LOST_RANGES_LISTED_MAX: usize = 1000;
/// Data blocks read with one request by the audit (1 MiB).
const CHECK_READ_BLOCKS_MAX: usize = 256;
/// Logical blocks named in one checksum problem.
const PROBLEM_LBAS_MAX: usize = 8;
/// Fingerprint records audited at most (the newest chapters first; about 64 bytes of
/// memory each while the audit runs).
const INDEX_RECORDS_AUDITED_MAX: usize = 1 << 21;

/// What the audit can find wrong. Callers (the CLI, the simulator) match on the variant,
/// never on the message text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Problem {
    /// Found while opening: superblock copies, the journal.
    Open {
        /// What was found.
        message: String,
    },
    /// A block map page could not be read or decoded.
    MapUnreadable {
        /// The logical block whose mapping is unknown.
        lba: u64,
        /// The error.
        error: String,
    },
    /// A mapping points past the data region.
    BeyondDataRegion {
        /// The logical block.
        lba: u64,
        /// Where it points.
        pbn: u64,
    },
    /// A physical block is referenced both as a raw block and as holding fragments.
    RawAndPacked {
        /// The physical block.
        pbn: u64,
    },
    /// A physical block (or a block of a fragment) is referenced with two different
    /// contents, or two fragments overlap. After a lost or misdirected data write this is
    /// the trace of a stale dedup match.
    UsedTwice {
        /// The physical block (the fragment's first).
        pbn: u64,
        /// The fragment's offset and block in its unit (`Frag::key`), for a fragment.
        slot: Option<u16>,
    },
    /// A block has a reference count but no references.
    Leaked {
        /// The physical block.
        pbn: u64,
        /// Its recorded count.
        count: u16,
    },
    /// A block's reference count differs from its references.
    WrongCount {
        /// The physical block.
        pbn: u64,
        /// Its recorded count.
        count: u16,
        /// References counted in the block map.
        references: u32,
    },
    /// The space counters differ from the block map.
    Counters {
        /// Recorded mapped blocks.
        recorded_mapped: u64,
        /// Recorded zero blocks.
        recorded_zero: u64,
        /// Counted mapped blocks.
        counted_mapped: u64,
        /// Counted zero blocks.
        counted_zero: u64,
    },
    /// A referenced physical block could not be read.
    Unreadable {
        /// The physical block.
        pbn: u64,
        /// The device error.
        error: String,
    },
    /// Stored data does not match its checksum: its logical blocks' data is lost.
    ChecksumMismatch {
        /// The physical block.
        pbn: u64,
        /// The fragment block (`Frag::key`), for a fragment.
        slot: Option<u16>,
        /// Some of the logical blocks that map to it (at most `PROBLEM_LBAS_MAX`).
        lbas: Vec<u64>,
    },
    /// A chapter's name pages check but disagree with its record pages. The index is
    /// advisory (a wrong name costs missed duplicates, never data), but names are made
    /// from the records beside them, so this is a defect of the build that wrote them.
    IndexNames {
        /// The virtual chapter.
        chapter: u64,
    },
}

impl Problem {
    /// The physical data block whose damage this problem can be a consequence of.
    pub fn data_block(&self) -> Option<u64> {
        self.data_blocks().map(|r| r.start)
    }

    /// The physical data blocks whose damage this problem can be a consequence of: the
    /// block named, and for a fragment (which may run on into the blocks after its first)
    /// the blocks it can touch.
    pub fn data_blocks(&self) -> Option<std::ops::Range<u64>> {
        match self {
            Problem::UsedTwice { pbn, slot: Some(_) } | Problem::ChecksumMismatch { pbn, slot: Some(_), .. } => {
                Some(*pbn..*pbn + crate::data::packer::FRAGMENT_SPAN_MAX)
            }
            Problem::UsedTwice { pbn, .. }
            | Problem::RawAndPacked { pbn }
            | Problem::Unreadable { pbn, .. }
            | Problem::ChecksumMismatch { pbn, .. } => Some(*pbn..*pbn + 1),
            _ => None,
        }
    }
}

fn block_name(pbn: u64, slot: Option<u16>) -> String {
    match slot {
        Some(k) => format!("fragment at offset {} of physical block {pbn}, block {}", k & 0x0fff, k >> 12),
        None => format!("physical block {pbn}"),
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Problem::Open { message } => write!(f, "{message}"),
            Problem::MapUnreadable { lba, error } => write!(f, "logical block {lba}: block map unreadable: {error}"),
            Problem::BeyondDataRegion { lba, pbn } => {
                write!(f, "logical block {lba} maps to physical block {pbn} beyond the data region")
            }
            Problem::RawAndPacked { pbn } => {
                write!(f, "physical block {pbn} is used twice: as a raw block and for compressed fragments")
            }
            Problem::UsedTwice { pbn, slot } => {
                write!(f, "{} is used twice: referenced with different contents", block_name(*pbn, *slot))
            }
            Problem::Leaked { pbn, count } => {
                write!(f, "physical block {pbn} is leaked: reference count {count} but no references")
            }
            Problem::WrongCount { pbn, count, references } => {
                write!(f, "physical block {pbn}: reference count {count} but {references} references")
            }
            Problem::Counters { recorded_mapped, recorded_zero, counted_mapped, counted_zero } => write!(
                f,
                "space counters are wrong: recorded {recorded_mapped} mapped / {recorded_zero} zero blocks, \
                 counted {counted_mapped} / {counted_zero}"
            ),
            Problem::Unreadable { pbn, error } => write!(f, "physical block {pbn} unreadable: {error}"),
            Problem::IndexNames { chapter } => write!(
                f,
                "fingerprint index chapter {chapter}: its name pages disagree with its records (costs dedup only)"
            ),
            Problem::ChecksumMismatch { pbn, slot, lbas } => {
                let l: Vec<String> = lbas.iter().map(u64::to_string).collect();
                write!(
                    f,
                    "{}: checksum mismatch (data lost for logical blocks {})",
                    block_name(*pbn, *slot),
                    l.join(", ")
                )
            }
        }
    }
}

/// A damaged location found by the audit.
struct Damage {
    pbn: u64,
    /// The fragment block that failed its checksum (`Frag::key`; None: a raw block).
    slot: Option<u16>,
    /// The block could not be read at all: everything touching it is lost.
    unreadable: bool,
}

/// A fragment as the block map uses it: its shape and each referenced block's crc.
struct FragUse {
    frag: crate::metadata::block_map::Frag,
    crcs: Vec<Option<u32>>,
}

/// A run of logical blocks whose data is lost, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct LostRange {
    /// First byte.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// What `check` may change.
#[derive(Debug, Clone, Copy, Default)]
pub struct CheckOptions {
    /// Fix what can be recomputed from the block map (counts, counters, superblock copies)
    /// and take damaged blocks out of deduplication.
    pub repair: bool,
    /// With `repair`: unmap logical blocks whose data is lost (they then read as zeros),
    /// so the volume is clean again. Off by default: zeros are not the data written.
    pub unmap_lost: bool,
    /// Fingerprint index memory for this open (None: the volume's setting), for a volume
    /// whose index this machine cannot hold.
    pub index_memory_bytes: Option<u64>,
}

/// The fingerprint index's records audited against the block map and the stored data.
/// A stale record is not a problem: the index is advisory, every overwrite leaves the
/// records of the blocks it freed behind, and the write path never trusts a record
/// without proof (a current reuse stamp or a byte comparison). These figures say how
/// much of the window still leads to data, and that nothing stale is in use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct IndexAudit {
    /// Chapters of the window read.
    pub chapters: u64,
    /// Record pages skipped (torn, stale, never written).
    pub pages_skipped: u64,
    /// Records audited.
    pub records: u64,
    /// Records whose location holds data with their fingerprint: they can lead to a share.
    pub live: u64,
    /// Records whose block (or packed slot) is no longer referenced: freed.
    pub stale_freed: u64,
    /// Records whose location is referenced but holds other content: freed and reused.
    pub stale_reused: u64,
    /// Records whose location holds damaged data (fails its checksum, or unreadable).
    pub stale_damaged: u64,
    /// Records naming a block outside the data region.
    pub beyond_data_region: u64,
    /// Records of the window not audited (past `INDEX_RECORDS_AUDITED_MAX`).
    pub not_audited: u64,
    /// Chapters whose name pages are complete and were compared with their records
    /// (those whose record pages are all of the names' session and hold as many records).
    pub names_compared: u64,
    /// Of those, chapters whose names disagree with their records (a problem: names are
    /// made from the records they sit beside).
    pub names_wrong: u64,
    /// Chapters whose complete names do not describe the records beside them: another
    /// session's names (a chapter number opened again after a crash lost the earlier
    /// use's first record page), or records torn since. Costs that chapter's dedup.
    pub names_stale: u64,
}

/// Result of auditing a volume.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CheckReport {
    /// Problems found (empty when clean).
    pub problems: Vec<Problem>,
    /// Problems beyond `PROBLEMS_LISTED_MAX` (counted, not listed).
    pub problems_not_listed: u64,
    /// Observations that are not problems (e.g. journal blocks torn by a crash).
    pub notes: Vec<String>,
    /// What `repair` fixed.
    pub repaired: Vec<String>,
    /// What could not be repaired.
    pub unrepaired: Vec<String>,
    /// Logical blocks mapped to data.
    pub mapped_blocks: u64,
    /// Logical blocks mapped as zeros.
    pub zero_blocks: u64,
    /// Physical blocks referenced.
    pub used_blocks: u64,
    /// Physical blocks whose content was read and checksummed.
    pub blocks_verified: u64,
    /// Logical blocks whose data is lost (mapped to damaged or unreadable data).
    pub lost_blocks: u64,
    /// The lost logical blocks as byte ranges (at most `LOST_RANGES_LISTED_MAX`).
    pub lost_ranges: Vec<LostRange>,
    /// Whether the lost blocks were unmapped (`CheckOptions::unmap_lost`).
    pub lost_unmapped: bool,
    /// The fingerprint index's records against the block map (statistics, not problems).
    pub index: IndexAudit,
}

impl CheckReport {
    /// True when nothing is wrong.
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty() && self.problems_not_listed == 0
    }

    fn problem(&mut self, p: Problem) {
        if self.problems.len() < PROBLEMS_LISTED_MAX {
            self.problems.push(p);
        } else {
            self.problems_not_listed += 1;
        }
    }
}

/// Opens the volume on `data` (and `meta`), audits it, and (with `repair`) fixes what can
/// be recomputed, then closes it.
pub fn check_volume(data: Arc<dyn Storage>, meta: Option<Arc<dyn Storage>>, repair: bool) -> Result<CheckReport> {
    check_volume_with(data, meta, CheckOptions { repair, ..CheckOptions::default() })
}

/// `check_volume` with every option.
pub fn check_volume_with(
    data: Arc<dyn Storage>,
    meta: Option<Arc<dyn Storage>>,
    copts: CheckOptions,
) -> Result<CheckReport> {
    let repair = copts.repair;
    let opts = OpenOptions {
        read_only: !repair,
        content_cache_bytes: 0,
        block_map_cache_bytes: 16 << 20,
        index_memory_bytes: copts.index_memory_bytes,
        ..OpenOptions::default()
    };
    let vol = Volume::open(data, meta, &opts)?;
    let report = vol.audit_with(copts)?;
    vol.close()?;
    Ok(report)
}

/// What `Volume::audit_dictionary_copies` found.
#[derive(Default)]
pub(crate) struct DictionaryAudit {
    /// The damaged copies.
    pub damaged: Vec<DamagedCopy>,
    /// Bytes read to check them.
    pub bytes_read: u64,
}

/// A damaged copy of the volume's dictionary.
pub(crate) struct DamagedCopy {
    /// "A" or "B".
    pub copy: &'static str,
    /// What was found instead of the dictionary.
    pub found: String,
    /// Written again from the dictionary in use.
    pub repaired: bool,
}

impl DamagedCopy {
    /// How `check` and scrub name it: "dictionary copy A: damaged (what was found)".
    pub fn describe(&self) -> String {
        format!("dictionary copy {}: damaged ({})", self.copy, self.found)
    }
}

impl Volume {
    /// Audits the open volume (best run with no concurrent writers).
    pub fn audit(&self, repair: bool) -> Result<CheckReport> {
        self.audit_with(CheckOptions { repair, ..CheckOptions::default() })
    }

    /// Audits the open volume with every option (best run with no concurrent writers).
    pub fn audit_with(&self, copts: CheckOptions) -> Result<CheckReport> {
        let repair = copts.repair;
        let mut report = CheckReport::default();
        for n in &self.open_notes {
            match n {
                OpenNote::Info(note) => report.notes.push(note.clone()),
                OpenNote::SuperblockCopy(m) => report.problem(Problem::Open { message: m.clone() }),
            }
        }
        self.audit_dictionary(repair, &mut report)?;
        let geo = self.geometry();
        let nblocks = geo.data_blocks as usize;
        let mut refs = vec![0u32; nblocks];
        let mut raw_crc: HashMap<u64, u32> = HashMap::new();
        // Fragments by first block and offset: their shape and each referenced block's crc.
        let mut frags: std::collections::BTreeMap<(u64, u16), FragUse> = std::collections::BTreeMap::new();
        let mut kind = vec![0u8; nblocks]; // 0 none, 1 raw, 2 fragments
        let mut counted = Counters::default();
        let mut referers: HashMap<u64, Vec<(u64, MapEntry)>> = HashMap::new();
        let mut st = self.state.lock();
        // A page the device could not read, and why: the rest of its entries are reported
        // unreadable without asking the device again (once per entry, under the state lock).
        let mut unreadable: Option<(u64, String)> = None;
        for lba in 0..self.logical_blocks() {
            if let Some((_, error)) = unreadable.as_ref().filter(|(until, _)| lba < *until) {
                report.problem(Problem::MapUnreadable { lba, error: error.clone() });
                continue;
            }
            let e = match st.map.scan(lba) {
                Scanned::Entry(e) => e,
                Scanned::Undecodable(err) => {
                    report.problem(Problem::MapUnreadable { lba, error: err.to_string() });
                    continue;
                }
                Scanned::Unreadable { next, error } => {
                    unreadable = Some((next, error.to_string()));
                    report.problem(Problem::MapUnreadable { lba, error: error.to_string() });
                    continue;
                }
            };
            counted.apply(&MapEntry::UNMAPPED, &e);
            if lba % 65536 == 65535 {
                let d = st.journal.durable_seq();
                st.map.evict(d)?;
            }
            if !e.is_data() {
                continue;
            }
            if e.pbn.checked_add(e.span()).is_none_or(|end| end > geo.data_blocks) {
                report.problem(Problem::BeyondDataRegion { lba, pbn: e.pbn });
                continue;
            }
            let k = if e.fragment_of().is_some() { 2 } else { 1 };
            for p in e.blocks() {
                if let Some(r) = refs.get_mut(p as usize) {
                    *r += 1;
                }
                let prev = kind.get(p as usize).copied().unwrap_or(0);
                if prev != 0 && prev != k {
                    report.problem(Problem::RawAndPacked { pbn: p });
                }
                if let Some(kk) = kind.get_mut(p as usize) {
                    *kk = k;
                }
            }
            match e.fragment_of() {
                None => {
                    if let Some(&c) = raw_crc.get(&e.pbn) {
                        if c != e.crc {
                            report.problem(Problem::UsedTwice { pbn: e.pbn, slot: None });
                        }
                    }
                    raw_crc.insert(e.pbn, e.crc);
                }
                Some(f) => {
                    let u = frags
                        .entry((e.pbn, f.off))
                        .or_insert_with(|| FragUse { frag: f, crcs: vec![None; f.unit_blocks()] });
                    // The settled mark may differ between mappings of one fragment (a crash
                    // between marks set in place); it changes nothing about the fragment.
                    let same_shape = u.frag.with_sub(0).unmarked() == f.with_sub(0).unmarked();
                    match u.crcs.get_mut(f.sub()) {
                        Some(Some(c)) if *c != e.crc || !same_shape => {
                            report.problem(Problem::UsedTwice { pbn: e.pbn, slot: Some(f.key()) })
                        }
                        Some(slot) if same_shape => *slot = Some(e.crc),
                        _ => report.problem(Problem::UsedTwice { pbn: e.pbn, slot: Some(f.key()) }),
                    }
                }
            }
            if referers.len() < 1 << 20 || referers.contains_key(&e.pbn) {
                referers.entry(e.pbn).or_default().push((lba, e));
            }
        }
        // Fragments lie back to back in their runs: one that starts inside another is the
        // trace of a stale or misdirected mapping.
        let mut end_of_last = 0u64;
        for (&(pbn, off), u) in &frags {
            let start = pbn * BLOCK_SIZE_U64 + u64::from(off);
            if start < end_of_last {
                report.problem(Problem::UsedTwice { pbn, slot: Some(u.frag.key()) });
            }
            end_of_last = end_of_last.max(start + u64::from(u.frag.len));
        }
        report.mapped_blocks = counted.mapped_blocks;
        report.zero_blocks = counted.zero_blocks;
        // Reference counts.
        let mut fixes: Vec<(u64, u16)> = Vec::new();
        for (pbn, &r) in refs.iter().enumerate() {
            let pbn = pbn as u64;
            let have = st.rc.get(pbn);
            if r > 0 {
                report.used_blocks += 1;
            }
            if u32::from(have) != r {
                if have > 0 && r == 0 {
                    report.problem(Problem::Leaked { pbn, count: have });
                } else {
                    report.problem(Problem::WrongCount { pbn, count: have, references: r });
                }
                if r <= u32::from(REFCOUNT_MAX) {
                    fixes.push((pbn, r as u16));
                } else {
                    report
                        .unrepaired
                        .push(format!("physical block {pbn} has {r} references, above the cap {REFCOUNT_MAX}"));
                }
            }
        }
        if counted != st.counters {
            report.problem(Problem::Counters {
                recorded_mapped: st.counters.mapped_blocks,
                recorded_zero: st.counters.zero_blocks,
                counted_mapped: counted.mapped_blocks,
                counted_zero: counted.zero_blocks,
            });
        }
        // The index's records, by location, to compare with the data read below.
        let (chapters, source) = (st.dedup.index().window_chapters(), st.dedup.index().source());
        drop(st);
        let mut records: HashMap<(u64, Option<u16>), Vec<[u8; 32]>> = HashMap::new();
        for vcn in chapters {
            if report.index.records as usize >= INDEX_RECORDS_AUDITED_MAX {
                report.index.not_audited += source.chapter_records(vcn).0.len() as u64;
                continue;
            }
            let (recs, skipped, epochs) = source.chapter_records(vcn);
            report.index.chapters += 1;
            report.index.pages_skipped += skipped;
            if let Some((epoch, names)) = source.chapter_names(vcn) {
                if names.len() == recs.len() && epochs.iter().all(|&e| e == epoch) {
                    report.index.names_compared += 1;
                    if names.iter().zip(&recs).any(|(n, r)| *n != crate::dedup::chapter::Name::of(&r.hash)) {
                        report.index.names_wrong += 1;
                        report.problem(Problem::IndexNames { chapter: vcn });
                    }
                } else {
                    // Names of another session than the records (a chapter number used
                    // again after a crash lost the first use's page 0), or records torn.
                    report.index.names_stale += 1;
                }
            }
            for r in recs {
                report.index.records += 1;
                if r.loc.pbn >= geo.data_blocks {
                    report.index.beyond_data_region += 1;
                } else if refs.get(r.loc.pbn as usize).is_some_and(|&n| n > 0) {
                    let key = r.loc.entry(0).fragment_of().map(|f| f.key());
                    records.entry((r.loc.pbn, key)).or_default().push(r.hash);
                } else {
                    report.index.stale_freed += 1;
                }
            }
        }
        // Data checksums: every referenced block is read and every referenced fragment decoded.
        let mut buf = vec![0u8; BLOCK_SIZE];
        let mut damaged: Vec<Damage> = Vec::new();
        // Used blocks are read in runs of up to CHECK_READ_BLOCKS_MAX (one request each, not
        // one per 4 KiB: under direct I/O that is 10x faster); a run that fails to read is
        // read again block by block, to name the unreadable ones.
        let mut run = vec![0u8; CHECK_READ_BLOCKS_MAX * BLOCK_SIZE];
        let mut run_pbns = 0u64..0u64;
        let mut unreadable: std::collections::HashSet<u64> = std::collections::HashSet::new();
        let used = |p: u64| refs.get(p as usize).is_some_and(|&r| r > 0);
        for pbn in 0..geo.data_blocks {
            if !used(pbn) {
                continue;
            }
            report.blocks_verified += 1;
            if !run_pbns.contains(&pbn) {
                let end = (pbn + CHECK_READ_BLOCKS_MAX as u64).min(geo.data_blocks);
                let last = (pbn..end).rev().find(|&p| used(p)).unwrap_or(pbn);
                let len = (last - pbn + 1) as usize * BLOCK_SIZE;
                #[expect(
                    clippy::indexing_slicing,
                    reason = "`len` is at most CHECK_READ_BLOCKS_MAX blocks, the size of `run`"
                )]
                let dst = &mut run[..len];
                run_pbns = match self.data.read(IoKind::Verify, pbn, dst, "block map entry") {
                    Ok(()) => pbn..last + 1,
                    Err(_) => 0..0,
                };
            }
            let at = (pbn - run_pbns.start) as usize * BLOCK_SIZE;
            match run.get(at..at + BLOCK_SIZE).filter(|_| run_pbns.contains(&pbn)) {
                Some(b) => buf.copy_from_slice(b),
                None => {
                    if let Err(e) = self.data.read(IoKind::Verify, pbn, &mut buf, "block map entry") {
                        let lost: u64 = records.extract_if(|k, _| k.0 == pbn).map(|(_, v)| v.len() as u64).sum();
                        report.index.stale_damaged += lost;
                        report.problem(Problem::Unreadable { pbn, error: e.to_string() });
                        damaged.push(Damage { pbn, slot: None, unreadable: true });
                        unreadable.insert(pbn);
                        continue;
                    }
                }
            }
            let lbas_of = |slot: Option<u16>| -> Vec<u64> {
                referers
                    .get(&pbn)
                    .map(|v| {
                        v.iter()
                            .filter(|(_, e)| e.fragment_of().map(|f| f.key()) == slot)
                            .take(PROBLEM_LBAS_MAX)
                            .map(|(l, _)| *l)
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let mut contents: Vec<(Option<u16>, Option<Vec<u8>>)> = Vec::new();
            if let Some(&crc) = raw_crc.get(&pbn) {
                let ok = crc32c::crc32c(&buf) == crc;
                if !ok {
                    report.problem(Problem::ChecksumMismatch { pbn, slot: None, lbas: lbas_of(None) });
                    damaged.push(Damage { pbn, slot: None, unreadable: false });
                }
                contents.push((None, ok.then(|| buf.clone())));
            }
            // The fragments starting in this block: their blocks from the run, else read.
            for (&(_, off), u) in frags.range((pbn, 0)..=(pbn, u16::MAX)) {
                let span_len = u.frag.span() as usize * BLOCK_SIZE;
                let from_run = run_pbns.contains(&pbn) && run_pbns.contains(&(pbn + u.frag.span() - 1));
                let span: Option<Vec<u8>> = if from_run {
                    run.get(at..at + span_len).map(<[u8]>::to_vec)
                } else {
                    let mut b = vec![0u8; span_len];
                    self.data.read(IoKind::Verify, pbn, &mut b, "block map entry").ok().map(|()| b)
                };
                let mut unit = vec![0u8; u.frag.unit_blocks() * BLOCK_SIZE];
                let decoded = span.as_deref().is_some_and(|sp| {
                    packer::fragment_bytes(pbn, &u.frag, sp)
                        .and_then(|bytes| packer::decompress(pbn, &u.frag, bytes, &mut unit))
                        .is_ok()
                });
                for (sub, crc) in u.crcs.iter().enumerate() {
                    let Some(crc) = *crc else { continue };
                    let key = u.frag.with_sub(sub).key();
                    let block = unit.get(sub * BLOCK_SIZE..(sub + 1) * BLOCK_SIZE);
                    let ok = decoded && block.is_some_and(|b| crc32c::crc32c(b) == crc);
                    if !ok {
                        debug_assert_eq!(off, u.frag.off);
                        report.problem(Problem::ChecksumMismatch { pbn, slot: Some(key), lbas: lbas_of(Some(key)) });
                        damaged.push(Damage { pbn, slot: Some(key), unreadable: false });
                    }
                    contents.push((Some(key), if ok { block.map(<[u8]>::to_vec) } else { None }));
                }
            }
            audit_records(&mut records, &mut report.index, pbn, &contents);
        }
        // Records left name a referenced block in a form (raw, or a slot) nobody uses.
        report.index.stale_freed += records.values().map(|v| v.len() as u64).sum::<u64>();
        // Damaged blocks leave deduplication at once, so no write shares them again (after
        // a reopen their records are of an earlier epoch, compared byte for byte before
        // any sharing, which damaged content fails).
        if !damaged.is_empty() {
            let mut st = self.state.lock();
            let pbns: std::collections::BTreeSet<u64> = damaged.iter().map(|d| d.pbn).collect();
            for pbn in pbns {
                self.forget_damaged(&mut st, pbn);
            }
        }
        let lost = if damaged.is_empty() { Vec::new() } else { self.lost_lbas(&damaged)? };
        report.lost_blocks = lost.iter().map(|r| r.end - r.start).sum();
        report.lost_ranges = lost
            .iter()
            .take(LOST_RANGES_LISTED_MAX)
            .map(|r| LostRange { offset: r.start * BLOCK_SIZE_U64, len: (r.end - r.start) * BLOCK_SIZE_U64 })
            .collect();
        let unmap = repair && copts.unmap_lost && !self.read_only;
        for d in &damaged {
            let what = block_name(d.pbn, d.slot);
            let why = if d.unreadable { "cannot be read" } else { "does not match its checksum" };
            if unmap {
                report.repaired.push(format!("{what}: data lost ({why}); its logical blocks were unmapped"));
            } else {
                report.unrepaired.push(format!("{what}: stored data {why}"));
            }
        }
        if repair && !self.read_only {
            let mut st = self.state.lock();
            // Repaired pages need a sequence above every journal entry, so that neither a
            // replay nor the older copy in the other slot (same seq) can win over them.
            let seq = st.journal.assign_written_seq();
            for &(pbn, count) in &fixes {
                st.rc.set_for_repair(pbn, count, seq);
                report.repaired.push(format!("physical block {pbn}: reference count set to {count}"));
            }
            if counted != st.counters {
                st.counters = counted;
                st.journal.reset_counters(counted);
                report.repaired.push("space counters recomputed".into());
            }
            st.alloc = crate::metadata::allocator::Allocator::from_counts(st.rc.counts(), geo.slab_blocks);
            if self.open_notes.iter().any(|n| matches!(n, OpenNote::SuperblockCopy(_))) {
                report.repaired.push("superblock copies rewritten".into());
            }
            if !damaged.is_empty() {
                report.repaired.push(format!(
                    "{} damaged physical block(s) taken out of deduplication: writes of their content store a fresh copy",
                    damaged.len()
                ));
            }
            drop(st);
            self.flush()?;
            if unmap {
                // Reference counts are exact now, so the unmaps free the damaged blocks.
                for r in &lost {
                    self.discard(r.start * BLOCK_SIZE_U64, (r.end - r.start) * BLOCK_SIZE_U64)?;
                }
                report.lost_unmapped = true;
                self.flush()?;
            }
        }
        Ok(report)
    }

    /// Both copies of the volume's dictionary against the superblock's length, crc32c and
    /// id: a damaged copy is a problem, and with `repair` it is written again.
    fn audit_dictionary(&self, repair: bool, report: &mut CheckReport) -> Result<()> {
        for d in self.audit_dictionary_copies(repair)?.damaged {
            let what = d.describe();
            report.problem(Problem::Open { message: what.clone() });
            if d.repaired {
                report.repaired.push(format!("{what}: written again from the dictionary in use"));
            } else {
                report.unrepaired.push(what);
            }
        }
        Ok(())
    }

    /// Both copies of the installed dictionary (none: nothing to audit) read and checked
    /// against the superblock's length, crc32c and id, for `check` and scrub. With
    /// `repair` (a writable volume), a damaged copy is written again from the dictionary
    /// in use, which matched them when the volume opened, and synced; a failed write is
    /// the error.
    pub(crate) fn audit_dictionary_copies(&self, repair: bool) -> Result<DictionaryAudit> {
        let mut audit = DictionaryAudit::default();
        let Some(info) = self.sb.lock().dictionary else { return Ok(audit) };
        let area = self.geo.dict_area();
        let copies = crate::data::dictionary::check_copies(&self.meta, &area, &info);
        audit.bytes_read = 2 * u64::from(info.len);
        let in_use = self.dictionary.lock().clone();
        for (copy, state) in copies.into_iter().enumerate() {
            let Err(found) = state else { continue };
            let repaired = match (&in_use, repair && !self.read_only) {
                (Some(d), true) => {
                    crate::data::dictionary::rewrite_copy(&self.meta, &area, copy, d)?;
                    true
                }
                _ => false,
            };
            audit.damaged.push(DamagedCopy { copy: if copy == 0 { "A" } else { "B" }, found, repaired });
        }
        Ok(audit)
    }

    /// Every logical block mapped to a damaged location, as merged runs of block numbers.
    fn lost_lbas(&self, damaged: &[Damage]) -> Result<Vec<std::ops::Range<u64>>> {
        // (pbn, None) stands for the whole block: a raw block, or one that cannot be read.
        let lost: std::collections::HashSet<(u64, Option<u16>)> =
            damaged.iter().map(|d| (d.pbn, if d.unreadable { None } else { d.slot })).collect();
        let hit = |e: &MapEntry| {
            e.blocks().any(|p| lost.contains(&(p, None))) || lost.contains(&(e.pbn, e.fragment_of().map(|f| f.key())))
        };
        let mut runs: Vec<std::ops::Range<u64>> = Vec::new();
        let mut st = self.state.lock();
        // Past the end of a page the device could not read (not asked again per entry).
        let mut skip_until = 0;
        for lba in 0..self.logical_blocks() {
            if lba < skip_until {
                continue;
            }
            // An unreadable map page was reported already; its blocks cannot be named.
            let e = match st.map.scan(lba) {
                Scanned::Entry(e) => e,
                Scanned::Unreadable { next, .. } => {
                    skip_until = next;
                    continue;
                }
                Scanned::Undecodable(_) => continue,
            };
            if lba % 65536 == 65535 {
                let d = st.journal.durable_seq();
                st.map.evict(d)?;
            }
            if !(e.is_data() && hit(&e)) {
                continue;
            }
            match runs.last_mut() {
                Some(r) if r.end == lba => r.end += 1,
                _ => runs.push(lba..lba + 1),
            }
        }
        Ok(runs)
    }
}

/// Compares the records naming physical block `pbn` with what it holds (`contents`: per
/// raw block or fragment block starting there, its content when it matched its checksum):
/// live when the content at their location is referenced, matches its checksum and has
/// their fingerprint; counted stale otherwise. Audited records leave `records`.
fn audit_records(
    records: &mut HashMap<(u64, Option<u16>), Vec<[u8; 32]>>,
    audit: &mut IndexAudit,
    pbn: u64,
    contents: &[(Option<u16>, Option<Vec<u8>>)],
) {
    if records.is_empty() {
        return;
    }
    for (key, content) in contents {
        let Some(hashes) = records.remove(&(pbn, *key)) else { continue };
        let content: Option<Option<&[u8]>> = Some(content.as_deref());
        let n = hashes.len() as u64;
        match content {
            None => audit.stale_freed += n,
            Some(None) => audit.stale_damaged += n,
            Some(Some(c)) => {
                let h = *blake3::hash(c).as_bytes();
                let live = hashes.iter().filter(|&&x| x == h).count() as u64;
                audit.live += live;
                audit.stale_reused += n - live;
            }
        }
    }
}
