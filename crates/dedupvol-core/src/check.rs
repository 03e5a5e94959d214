//! The volume audit behind `dedupvol check`: every reference count equals the references
//! to its block, no physical block is leaked or used twice, every checksum is valid, and
//! the space counters are exact.
//!
//! Invariants:
//! - A read-only audit writes nothing (a dirty volume is replayed in memory only).
//! - `repair` only changes what can be recomputed from the block map (reference counts,
//!   counters, superblock copies); mappings to unreadable data are reported, not dropped.

use crate::block_map::MapEntry;
use crate::config::{OpenOptions, BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::error::Result;
use crate::journal::Counters;
use crate::packer;
use crate::refcount::REFCOUNT_MAX;
use crate::storage::{IoKind, Storage};
use crate::volume::Volume;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;

/// Problems listed in full before the report summarises the rest.
const PROBLEMS_LISTED_MAX: usize = 100;

/// Result of auditing a volume.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CheckReport {
    /// Problems found (empty when clean).
    pub problems: Vec<String>,
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
}

impl CheckReport {
    /// True when nothing is wrong.
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty() && self.problems_not_listed == 0
    }

    fn problem(&mut self, p: String) {
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
    let opts = OpenOptions {
        read_only: !repair,
        content_cache_bytes: 0,
        block_map_cache_bytes: 16 << 20,
        ..OpenOptions::default()
    };
    let vol = Volume::open(data, meta, &opts)?;
    let report = vol.audit(repair)?;
    vol.close()?;
    Ok(report)
}

impl Volume {
    /// Audits the open volume (best run with no concurrent writers).
    pub fn audit(&self, repair: bool) -> Result<CheckReport> {
        let mut report = CheckReport::default();
        for n in &self.open_notes {
            match n.strip_prefix("note: ") {
                Some(note) => report.notes.push(note.to_string()),
                None => report.problem(n.clone()),
            }
        }
        let geo = self.geo;
        let nblocks = geo.data_blocks as usize;
        let mut refs = vec![0u32; nblocks];
        let mut raw_crc: HashMap<u64, u32> = HashMap::new();
        let mut frag_crc: HashMap<(u64, u8), u32> = HashMap::new();
        let mut kind = vec![0u8; nblocks]; // 0 none, 1 raw, 2 packed
        let mut max_slot = vec![0u8; nblocks];
        let mut counted = Counters::default();
        let mut referers: HashMap<u64, Vec<(u64, MapEntry)>> = HashMap::new();
        let mut st = self.state.lock();
        for lba in 0..geo.logical_blocks {
            let e = match st.map.get(lba) {
                Ok(e) => e,
                Err(err) => {
                    report.problem(format!("logical block {lba}: block map unreadable: {err}"));
                    continue;
                }
            };
            counted.apply(&MapEntry::UNMAPPED, &e);
            if lba % 65536 == 65535 {
                let d = st.journal.durable_seq;
                st.map.evict(d)?;
            }
            if !e.is_data() {
                continue;
            }
            let Some(r) = refs.get_mut(e.pbn as usize) else {
                report.problem(format!("logical block {lba} maps to physical block {} beyond the data region", e.pbn));
                continue;
            };
            *r += 1;
            let k = if e.slot().is_some() { 2 } else { 1 };
            let prev = kind.get(e.pbn as usize).copied().unwrap_or(0);
            if prev != 0 && prev != k {
                report.problem(format!("physical block {} is used twice: as a raw block and as a packed block", e.pbn));
            }
            if let Some(kk) = kind.get_mut(e.pbn as usize) {
                *kk = k;
            }
            match e.slot() {
                None => {
                    if let Some(&c) = raw_crc.get(&e.pbn) {
                        if c != e.crc {
                            report.problem(format!(
                                "physical block {} is used twice: referenced with different contents",
                                e.pbn
                            ));
                        }
                    }
                    raw_crc.insert(e.pbn, e.crc);
                }
                Some(s) => {
                    if let Some(&c) = frag_crc.get(&(e.pbn, s)) {
                        if c != e.crc {
                            report.problem(format!(
                                "physical block {} slot {s} is used twice: referenced with different contents",
                                e.pbn
                            ));
                        }
                    }
                    frag_crc.insert((e.pbn, s), e.crc);
                    if let Some(m) = max_slot.get_mut(e.pbn as usize) {
                        *m = (*m).max(s + 1);
                    }
                }
            }
            if referers.len() < 1 << 20 || referers.contains_key(&e.pbn) {
                referers.entry(e.pbn).or_default().push((lba, e));
            }
        }
        report.mapped_blocks = counted.mapped_blocks;
        report.zero_blocks = counted.zero_blocks;
        // Reference counts.
        let mut fixes: Vec<(u64, u8, u8)> = Vec::new();
        for (pbn, &r) in refs.iter().enumerate() {
            let pbn = pbn as u64;
            let have = st.rc.get(pbn);
            let frags =
                if kind.get(pbn as usize) == Some(&2) { max_slot.get(pbn as usize).copied().unwrap_or(1) } else { 1 };
            if r > 0 {
                report.used_blocks += 1;
            }
            if u32::from(have) != r {
                if have > 0 && r == 0 {
                    report.problem(format!("physical block {pbn} is leaked: reference count {have} but no references"));
                } else {
                    report.problem(format!("physical block {pbn}: reference count {have} but {r} references"));
                }
                if r <= u32::from(REFCOUNT_MAX) {
                    fixes.push((pbn, r as u8, frags));
                } else {
                    report
                        .unrepaired
                        .push(format!("physical block {pbn} has {r} references, above the cap {REFCOUNT_MAX}"));
                }
            }
        }
        if counted != st.counters {
            report.problem(format!(
                "space counters are wrong: recorded {} mapped / {} zero blocks, counted {} / {}",
                st.counters.mapped_blocks, st.counters.zero_blocks, counted.mapped_blocks, counted.zero_blocks
            ));
        }
        // Data checksums: every referenced block is read and every referenced fragment decoded.
        drop(st);
        let mut buf = vec![0u8; BLOCK_SIZE];
        let mut out = vec![0u8; BLOCK_SIZE];
        for (pbn, &r) in refs.iter().enumerate() {
            if r == 0 {
                continue;
            }
            let pbn = pbn as u64;
            report.blocks_verified += 1;
            if let Err(e) = self.data.read(IoKind::Verify, &mut buf, geo.data_offset(pbn)) {
                report.problem(format!("physical block {pbn} unreadable: {e}"));
                continue;
            }
            let mut check = |slot: Option<u8>, crc: u32, what: String, report: &mut CheckReport| {
                let ok = match slot {
                    None => crc32c::crc32c(&buf) == crc,
                    Some(s) => packer::unpack(&buf, s, &mut out).is_ok() && crc32c::crc32c(&out) == crc,
                };
                if !ok {
                    let lbas: Vec<String> = referers
                        .get(&pbn)
                        .map(|v| {
                            v.iter().filter(|(_, e)| e.slot() == slot).take(8).map(|(l, _)| l.to_string()).collect()
                        })
                        .unwrap_or_default();
                    report.problem(format!(
                        "{what}: checksum mismatch (data lost for logical blocks {})",
                        lbas.join(", ")
                    ));
                    report.unrepaired.push(format!("{what}: stored data does not match its checksum"));
                }
            };
            if let Some(&crc) = raw_crc.get(&pbn) {
                check(None, crc, format!("physical block {pbn}"), &mut report);
            }
            for s in 0..max_slot.get(pbn as usize).copied().unwrap_or(0) {
                if let Some(&crc) = frag_crc.get(&(pbn, s)) {
                    check(Some(s), crc, format!("physical block {pbn} slot {s}"), &mut report);
                }
            }
        }
        if repair && !self.read_only {
            let mut st = self.state.lock();
            // Repaired pages need a sequence above every journal entry, so that neither a
            // replay nor the older copy in the other slot (same seq) can win over them.
            let seq = st.journal.next_entry_seq;
            st.journal.next_entry_seq += 1;
            st.journal.durable_seq = seq;
            for &(pbn, count, frags) in &fixes {
                st.rc.set_for_repair(pbn, count, frags, seq);
                report.repaired.push(format!("physical block {pbn}: reference count set to {count}"));
            }
            if counted != st.counters {
                st.counters = counted;
                st.journal.reset_counters(counted);
                report.repaired.push("space counters recomputed".into());
            }
            st.alloc = crate::allocator::Allocator::from_counts(st.rc.counts(), geo.slab_blocks);
            if self.open_notes.iter().any(|n| n.contains("superblock")) {
                report.repaired.push("superblock copies rewritten".into());
            }
            drop(st);
            self.flush()?;
        }
        let _ = BLOCK_SIZE_U64;
        Ok(report)
    }
}
