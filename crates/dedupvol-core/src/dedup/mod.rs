//! Deduplication: one `Deduper` owns the whole decision to share a chunk with a stored
//! copy — lookup, verification, claim — and the staleness rules it rests on: reuse
//! stamps and epochs (hash verification; in both modes, for LZ4 units that span blocks)
//! and the reuse generation (byte verification).
//!
//! A chunk's path (docs/design.md, "Sharing or storing a chunk"):
//! 1. `lookup` (state lock): a candidate from the index, only if its block is in use and,
//!    when its stamp can be trusted, the stamp still matches;
//! 2. verification: a record of this epoch, with hash verification, is proven by the
//!    256-bit fingerprint and the stamp; any other candidate (byte verification, or a
//!    record from an earlier session or epoch) has its content compared, from memory when
//!    it is not on the device yet (decided in step 1) or by `verify::by_read` (no lock);
//! 3. `claim` (state lock, at placement): re-checks the candidate against everything that
//!    may have changed since step 1, or finds a duplicate stored meanwhile.
//!
//! Decision table of `claim` for a verified candidate whose block is in use below the cap
//! (`current`: the record is of this epoch; `stale`: blocks were released for reuse since
//! step 1):
//!
//! | hash verification | current | proof               | stale | decision          |
//! |-------------------|---------|---------------------|-------|-------------------|
//! | yes               | yes     | stamp matches       | any   | Share             |
//! | yes               | yes     | stamp differs       | any   | Store             |
//! | yes               | no      | bytes compared      | no    | Share, re-record  |
//! | any               | any     | bytes compared      | yes   | Store             |
//! | no                | any     | bytes compared      | no    | Share             |
//!
//! Invariants:
//! - Sharing never rests on a stale record: a block freed since a record was made has a
//!   new stamp (hash verification); a record whose stamp could no longer tell (an earlier
//!   session, whose stamps were not kept, or before a stamp wrapped: an earlier epoch) is
//!   compared byte for byte, and so is every candidate of a session whose fingerprints
//!   come from an offload backend the volume was given (`distrust`); a new reuse
//!   generation voids every byte verification done before it.
//! - A block's reference count never exceeds the cap (`Refcounts::cap`) through sharing: a candidate at
//!   the cap is refused and the chunk stored as a new copy.
//! - The index is advisory: losing it loses dedup, never data.
//! - A block whose content failed its checksum is never a candidate until it is freed
//!   (`damaged`, at most `DAMAGED_MAX` blocks; past that a new epoch makes every record
//!   need byte verification).
//! - A block of a fragment that spans several blocks, decodes to several and checks
//!   nothing end to end (LZ4) is shared under a record of this epoch only while its stamp
//!   matches, and under an older record only when every other block of its decoded unit
//!   hashes to a record of the index (`usable`, `vouched`), in both modes: comparing one
//!   block cannot tell whether its later blocks were reused.
//! - Every open-chapter record names a data block of this volume by a raw or packed-slot
//!   state, and there is one reuse stamp per data block (the `verify` audit checks both).

pub(crate) mod chapter;
pub(crate) mod index;
pub(crate) mod predictor;
pub(crate) mod rebuild;
pub(crate) mod record_cache;
pub(crate) mod verify;
pub(crate) mod volume_index;

use crate::dedup::index::{Fetch, Index, Location};
use crate::metadata::block_map::MapEntry;
use crate::metadata::refcount::Refcounts;
use crate::obs::stats::ReductionCounters;
use crate::read::cache::Block;
use std::collections::{HashMap, HashSet};

/// True when `loc` is a block of a fragment whose decoding checks nothing end to end (LZ4:
/// the block format has no checksum; a zstd frame carries its content checksum), that runs
/// over more than one block (its later blocks may have been reused under it) and that
/// decodes to more than one block: comparing the one block with a chunk then leaves the
/// others, which the reused bytes may have produced, unchecked. (A fragment of one block is
/// compared whole.)
fn unchecked_span(loc: &Location) -> bool {
    let e = loc.entry(0);
    e.span() > 1
        && e.fragment_of()
            .is_some_and(|f| f.unit_blocks() > 1 && f.compression() == Some(crate::config::Compression::Lz4))
}

/// Most damaged blocks remembered one by one.
const DAMAGED_MAX: usize = 1 << 16;

/// The dedup decision's state (guarded by the volume's state lock).
pub(crate) struct Deduper {
    index: Index,
    /// Per-block reuse stamps. Hash verification proves records by them; with byte
    /// verification they still tell whether an unchecked fragment's blocks were reused
    /// (`unchecked_span`).
    stamps: Vec<u16>,
    /// Hash verification: a record of this epoch whose stamp matches is proof.
    hash: bool,
    /// Bumped whenever freed blocks become reusable; a byte verification done before a
    /// bump is stale.
    reuse_gen: u64,
    /// Blocks whose content failed its checksum, until they are freed.
    damaged: HashSet<u64>,
    /// Fingerprints come from a backend whose BLAKE3 is not proof (`distrust`): no
    /// candidate is proven by its stamp, every one is compared byte for byte.
    distrusted: bool,
    /// Units already vouched for or not (`vouched`), by fragment (first block, offset), with
    /// the first block's stamp then: the blocks of one unit arrive one after another, each
    /// with the candidate its lookup found before the first was claimed. Valid while the
    /// stamp is unchanged (a tail freed under the unit renews it); at most
    /// `VOUCH_MEMO_MAX` entries, forgotten all at once when full.
    vouches: HashMap<(u64, u16), (u16, bool)>,
}

/// Units `Deduper::vouches` remembers at most.
const VOUCH_MEMO_MAX: usize = 1 << 16;

/// What `claim` decided for a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claim {
    /// Share this stored copy.
    Share(Location),
    /// Store the chunk as a new copy.
    Store,
}

/// A chunk's candidate after lookup and verification.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Candidate {
    /// The index's candidate, if any.
    pub(crate) loc: Option<Location>,
    /// True once the candidate is proven to hold the chunk.
    pub(crate) verified: bool,
}

impl Deduper {
    /// A deduper over `index`, with a reuse stamp per data block; `hash_mode` proves
    /// records of this epoch by them.
    pub(crate) fn new(index: Index, hash_mode: bool, data_blocks: u64) -> Self {
        Deduper {
            index,
            stamps: crate::io::hugemem::zeroed(data_blocks as usize),
            hash: hash_mode,
            reuse_gen: 0,
            damaged: HashSet::new(),
            distrusted: false,
            vouches: HashMap::new(),
        }
    }

    /// From now on every candidate is verified by its bytes, as with byte verification:
    /// the session's fingerprints come from an offload backend whose results are checked,
    /// and a wrong BLAKE3 must cost a duplicate, never share another chunk's content. The
    /// records still carry stamps; the next session, of a new epoch, compares them too.
    pub(crate) fn distrust(&mut self) {
        self.distrusted = true;
    }

    /// True when fingerprints are trusted on full 256-bit equality plus the reuse stamp.
    pub(crate) fn hash_mode(&self) -> bool {
        self.hash
    }

    /// The reuse generation now; `claim` compares it with the one seen at lookup.
    pub(crate) fn generation(&self) -> u64 {
        self.reuse_gen
    }

    /// True when `loc`'s reuse stamp is its block's current one: the block has not been
    /// freed since the index entry was made.
    fn stamp_matches(&self, loc: &Location) -> bool {
        self.stamps.get(loc.pbn as usize) == Some(&loc.stamp)
    }

    /// The current reuse stamp of `pbn` (0 beyond the data region).
    fn stamp_of(&self, pbn: u64) -> u16 {
        self.stamps.get(pbn as usize).copied().unwrap_or(0)
    }

    /// True when `loc`'s stamp decides whether its block changed since: hash verification
    /// and a record of this epoch.
    fn by_stamp(&self, loc: &Location) -> bool {
        self.hash_mode() && loc.current && !self.distrusted
    }

    /// True when `loc` may be offered at all: its block is in use now (a free block could
    /// be reallocated before placement without any generation bump), not damaged, and its
    /// stamp matches when the stamp can tell.
    ///
    /// A block of an LZ4 fragment that spans several blocks (`unchecked_span`) needs more
    /// than its own bytes compared: a fragment that died may have had its later blocks freed
    /// and reused while its first block lived on, and nothing in an LZ4 block tells such a
    /// unit from an intact one (the reused data can parse to the unit's length with the
    /// compared block intact). A record of this epoch whose stamp no longer matches is such
    /// a case (freeing a block that may hold a dead fragment's tail renews the stamp of the
    /// block it starts in), in either verification mode; a record the stamp cannot speak for
    /// (an earlier session or epoch) is vouched for at `claim` (`vouched`).
    fn usable(&self, loc: &Location, rc: &Refcounts) -> bool {
        rc.min_of(&loc.entry(0)) > 0
            && !self.damaged.contains(&loc.pbn)
            && (!self.by_stamp(loc) || self.stamp_matches(loc))
            && !(unchecked_span(loc) && loc.current && !self.stamp_matches(loc))
    }

    /// True when `loc` must be vouched for by the rest of its unit before it is shared: a
    /// block of an unchecked span whose record's stamp cannot tell (see `usable`).
    fn needs_vouch(&self, loc: &Location) -> bool {
        unchecked_span(loc) && !(loc.current && self.stamp_matches(loc))
    }

    /// The records that vouch for `loc`'s whole unit, or None. `unit` gives the unit's
    /// decoded blocks in order (from the content cache: byte verification of `loc` put
    /// them there), `loc`'s own already compared with the chunk. Every other block must
    /// hash to a record of the index: then the whole unit decoded to contents the volume
    /// stored, which bytes reused under the fragment would not give (garbage that hashes to
    /// a recorded fingerprint is as unlikely as a BLAKE3 collision). The record may name
    /// another copy: a block of the unit stored again since (a duplicate that could not be
    /// vouched for then) must not make its neighbours unprovable. A block without a record
    /// (a sparse index, a window that moved on, a record page not in memory) leaves the
    /// unit unvouched: the chunk is stored again, and nothing is lost but the duplicate.
    /// The records returned are those naming this fragment, to renew.
    fn vouched(
        &self,
        loc: &Location,
        unit: &impl Fn(Location) -> Option<Vec<Block>>,
    ) -> Option<Vec<([u8; 32], Location)>> {
        let f = loc.frag;
        let blocks = unit(*loc)?;
        if blocks.len() != f.unit_blocks() {
            return None;
        }
        let mut records = Vec::with_capacity(blocks.len());
        for (k, b) in blocks.iter().enumerate().filter(|&(k, _)| k != f.sub()) {
            let h = *blake3::hash(b).as_bytes();
            let l = self.index.lookup_cached(&h, false).loc?;
            if l.pbn == loc.pbn && l.state == loc.state && l.frag.unmarked() == f.with_sub(k).unmarked() {
                records.push((h, l));
            }
        }
        Some(records)
    }

    /// Step 1: the candidate for `hash`, from memory. A record proven by its stamp comes
    /// back verified; any other is left for byte verification. The `Fetch`, if any, names
    /// a record page to read without the state lock: with no candidate, the lookup is worth
    /// asking again once it is read (`first`: a chunk's first lookup, for statistics).
    pub(crate) fn lookup(&self, hash: &[u8; 32], rc: &Refcounts, first: bool) -> (Candidate, Option<Fetch>) {
        let found = self.index.lookup_cached(hash, first);
        let loc = found.loc.filter(|l| self.usable(l, rc));
        (Candidate { loc, verified: loc.is_some_and(|l| self.by_stamp(&l)) }, found.fetch)
    }

    /// Step 3: the final decision at placement, by the table in docs/design.md.
    /// `looked_up_at` is the generation `lookup` ran under; `in_memory` verifies a location
    /// from memory only (unwritten blocks, the content cache), never with I/O; `unit` gives
    /// the decoded blocks of a location's unit from the content cache (`vouched`).
    #[expect(
        clippy::too_many_arguments,
        reason = "the chunk, its candidate, the state it is checked against and two views of memory"
    )]
    pub(crate) fn claim(
        &mut self,
        hash: &[u8; 32],
        cand: Candidate,
        looked_up_at: u64,
        rc: &Refcounts,
        red: &mut ReductionCounters,
        in_memory: impl Fn(Location) -> bool,
        unit: impl Fn(Location) -> Option<Vec<Block>>,
    ) -> Claim {
        let stale = self.reuse_gen != looked_up_at;
        match cand {
            Candidate { loc: Some(loc), verified: true } => {
                let c = rc.max_of(&loc.entry(0));
                let live = rc.min_of(&loc.entry(0)) > 0;
                let proven = if self.by_stamp(&loc) { self.stamp_matches(&loc) } else { !stale };
                if c >= rc.cap() {
                    red.refcount_cap_copies += 1;
                } else if live && !self.damaged.contains(&loc.pbn) && proven {
                    if let Some(others) = self.vouch_if_needed(&loc, &unit) {
                        return self.share(hash, loc, others);
                    }
                    // Not vouched for: as a failed verification.
                    red.dedup_verify_failures += 1;
                }
            }
            Candidate { loc: Some(_), verified: false } => {
                red.dedup_verify_failures += 1;
                self.index.remove(hash);
            }
            Candidate { loc: None, .. } => {}
        }
        // A duplicate stored by this request or a concurrent writer since the lookup: only
        // taken when it can be verified from memory.
        let Some(loc) = self.index.lookup_cached(hash, false).loc.filter(|l| Some(*l) != cand.loc) else {
            return Claim::Store;
        };
        if !self.usable(&loc, rc) || rc.max_of(&loc.entry(0)) >= rc.cap() {
            return Claim::Store;
        }
        let proven = if self.by_stamp(&loc) { self.stamp_matches(&loc) } else { in_memory(loc) };
        match self.vouch_if_needed(&loc, &unit).filter(|_| proven) {
            Some(others) => self.share(hash, loc, others),
            None => Claim::Store,
        }
    }

    /// Shares `loc`, renewing its record and those that vouched for its unit (`others`).
    fn share(&mut self, hash: &[u8; 32], loc: Location, others: Vec<([u8; 32], Location)>) -> Claim {
        self.refresh(hash, loc);
        for (h, l) in others {
            self.refresh(&h, l);
        }
        Claim::Share(loc)
    }

    /// The records to refresh with `loc` when its unit is vouched for (none needed: an
    /// empty list), or None when it needs vouching and is not vouched for.
    fn vouch_if_needed(
        &mut self,
        loc: &Location,
        unit: &impl Fn(Location) -> Option<Vec<Block>>,
    ) -> Option<Vec<([u8; 32], Location)>> {
        if !self.needs_vouch(loc) {
            return Some(Vec::new());
        }
        let key = (loc.pbn, loc.frag.off);
        let stamp = self.stamp_of(loc.pbn);
        if let Some(&(at, ok)) = self.vouches.get(&key) {
            if at == stamp {
                return ok.then(Vec::new);
            }
        }
        let r = self.vouched(loc, unit);
        if self.vouches.len() >= VOUCH_MEMO_MAX {
            self.vouches.clear();
        }
        self.vouches.insert(key, (stamp, r.is_some()));
        r
    }

    /// A record from an earlier epoch just proved right: records it again in the open
    /// chapter, with the block's current stamp, so the next duplicate needs no byte
    /// verification and the hot fingerprint stays in the window.
    fn refresh(&mut self, hash: &[u8; 32], loc: Location) {
        if !loc.current {
            let stamp = self.stamp_of(loc.pbn);
            self.index.insert(hash, Location { stamp, current: true, ..loc });
        }
    }

    /// Records a newly stored chunk under its fingerprint, stamped with its block's stamp.
    pub(crate) fn record(&mut self, hash: &[u8; 32], e: &MapEntry) {
        let stamp = self.stamp_of(e.pbn);
        self.index.insert(hash, Location { stamp, current: true, ..Location::of(e) });
    }

    /// Freed blocks became reusable: every byte verification done before now is stale.
    pub(crate) fn note_reuse(&mut self) {
        self.reuse_gen += 1;
    }

    /// A block lost its last reference: its records become stale (new stamp; a stamp that
    /// wraps to a value an old record may carry starts a new epoch, after which every
    /// older record needs byte verification). Returns true when the stamp wrapped.
    pub(crate) fn note_freed(&mut self, pbn: u64) -> bool {
        self.damaged.remove(&pbn);
        self.void_stamp(pbn)
    }

    /// Gives `pbn` a new reuse stamp, so records made under the old one need byte
    /// verification; true when the stamp wrapped (a new epoch began).
    pub(crate) fn void_stamp(&mut self, pbn: u64) -> bool {
        let wrapped = self.stamps.get_mut(pbn as usize).is_some_and(|s| {
            *s = s.wrapping_add(1);
            *s == 0
        });
        if wrapped {
            self.new_epoch();
        }
        wrapped
    }

    /// Takes a block whose stored content failed its checksum out of deduplication: no
    /// index entry may lead a new write to it, since hash verification would trust the
    /// entry and share the damaged copy.
    pub(crate) fn forget_damaged(&mut self, pbn: u64) {
        // Records of the block in chapters on the device cannot be found by block, so
        // the block is remembered until it is freed; the new stamp also voids its records.
        if self.damaged.len() >= DAMAGED_MAX {
            self.damaged.clear();
            self.new_epoch();
        }
        self.damaged.insert(pbn);
        self.void_stamp(pbn);
    }

    /// A new index epoch (a stamp wrapped): no older record is proven by its stamp, and
    /// no unit's remembered vouching outcome stands, its stamp having come round again.
    fn new_epoch(&mut self) {
        self.index.new_epoch();
        self.vouches.clear();
    }

    /// A grow: the data region now holds `data_blocks` blocks (new ones at stamp 0).
    pub(crate) fn grow(&mut self, data_blocks: u64) {
        assert!(self.stamps.len() as u64 <= data_blocks, "the data region never shrinks");
        self.stamps.resize(data_blocks as usize, 0);
    }

    /// True when `pbn` was found damaged and not freed since: nothing may be shared onto
    /// it (write-once journaling asks too).
    pub(crate) fn is_damaged(&self, pbn: u64) -> bool {
        self.damaged.contains(&pbn)
    }

    /// Checks the index and the stamps against the volume's data region (the `verify`
    /// audit).
    #[cfg(any(test, feature = "verify"))]
    pub(crate) fn audit(&self, data_blocks: u64) -> Result<(), String> {
        if self.stamps.len() as u64 != data_blocks {
            return Err(format!("{} reuse stamps for {data_blocks} data blocks", self.stamps.len()));
        }
        self.index.audit(|l| {
            let e = l.entry(0);
            match (e.is_data() && l.pbn < data_blocks) || self.damaged.contains(&l.pbn) {
                true => Ok(()),
                false => Err(format!("location {l:?} is not a data block of the volume")),
            }
        })
    }

    /// Waits for the index memory to be populated (see `Volume::wait_ready`).
    pub(crate) fn wait_ready(&mut self) {
        self.index.wait_prefault();
    }

    /// The index, for statistics.
    pub(crate) fn index(&self) -> &Index {
        &self.index
    }

    /// The index, to rebuild it and to hand its pages to commits.
    pub(crate) fn index_mut(&mut self) -> &mut Index {
        &mut self.index
    }

    /// Memory of the reuse stamps in bytes.
    pub(crate) fn stamp_bytes(&self) -> u64 {
        2 * self.stamps.len() as u64
    }

    /// The current reuse stamp of `pbn` (tests).
    #[cfg(test)]
    pub(crate) fn stamp(&self, pbn: u64) -> Option<u16> {
        self.stamps.get(pbn as usize).copied()
    }

    /// Sets the reuse stamp of `pbn`, as if it had been reused that often (tests).
    #[cfg(test)]
    pub(crate) fn set_stamp(&mut self, pbn: u64, stamp: u16) {
        if let Some(s) = self.stamps.get_mut(pbn as usize) {
            *s = stamp;
        }
    }
}
