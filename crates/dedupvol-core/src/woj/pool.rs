//! The weak-hash pool: for each block of a file system's journal, the weak fingerprint
//! (xxh3-64) of what was last written there, and a table that finds a journal block by
//! fingerprint. A checkpoint write looks its fingerprint up here to find the journal copy
//! it repeats (WOJ, docs/design.md "Write-once journaling").
//!
//! Layout (13 bytes per journal block, no location stored: the journal block's own map
//! entry is the location, read when a hit is resolved):
//! - `hashes[j]`: the weak hash of journal block `j`'s content, 0 when `j` has no entry;
//! - `table`: open addressing with linear probing over `slots_for(journal_blocks)` slots
//!   (1.25 per journal block, so it is never more than 80% full); a slot holds `j + 1`
//!   (0: empty), with `INVALID` set once a second journal block with the same hash came.
//!
//! Invariants:
//! - A slot names a journal block whose `hashes` entry is non-zero; a hash has at most one
//!   slot, reachable by probing from its home slot without crossing an empty slot
//!   (deletion shifts back, it leaves no tombstones).
//! - `live` is the number of occupied slots, at most `hashes.len()` (one per block at most),
//!   so probing always ends at an empty slot.
//! - An `INVALID` slot is never returned by `lookup`: two journal blocks share its hash.
//! - Memory is fixed at construction: `hashes.len() * 8 + table.len() * 4` bytes.

/// Most journal blocks a pool covers (64 GiB of 4 KiB journal blocks); `j + 1` and the
/// `INVALID` bit fit a u32.
pub(crate) const POOL_JOURNAL_BLOCKS_MAX: u64 = 1 << 24;

/// Set in a slot whose hash two journal blocks had: never shared.
const INVALID: u32 = 1 << 31;

/// Table slots for a journal of `blocks` blocks: 1.25 per block, at least 8.
fn slots_for(blocks: usize) -> usize {
    (blocks + blocks / 4).max(8)
}

/// What `insert` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Inserted {
    /// A new entry.
    New,
    /// The block already had this entry (a rewrite of the same content).
    Same,
    /// Another journal block holds the same hash: the entry is now invalid.
    Invalidated,
    /// The hash was already invalid.
    AlreadyInvalid,
}

/// What `lookup` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// No entry for the hash.
    None,
    /// Two journal blocks had the hash: never shared.
    Invalid,
    /// Journal block `j` holds content with the hash.
    Block(u32),
}

/// The weak-hash pool of one journal (see the module docs).
pub(crate) struct Pool {
    hashes: Vec<u64>,
    table: Vec<u32>,
    live: usize,
}

impl Pool {
    /// An empty pool for `blocks` journal blocks (at most `POOL_JOURNAL_BLOCKS_MAX`).
    pub(crate) fn new(blocks: u64) -> Self {
        let blocks = blocks.min(POOL_JOURNAL_BLOCKS_MAX) as usize;
        Pool { hashes: vec![0; blocks], table: vec![0; slots_for(blocks)], live: 0 }
    }

    /// Journal blocks covered.
    pub(crate) fn blocks(&self) -> u64 {
        self.hashes.len() as u64
    }

    /// Occupied slots (valid and invalid entries).
    pub(crate) fn entries(&self) -> u64 {
        self.live as u64
    }

    /// Memory held, in bytes.
    pub(crate) fn bytes(&self) -> u64 {
        (self.hashes.len() * 8 + self.table.len() * 4) as u64
    }

    /// The weak hash of journal block `j`'s content, if it has an entry.
    pub(crate) fn hash_of(&self, j: u32) -> Option<u64> {
        self.hashes.get(j as usize).copied().filter(|h| *h != 0)
    }

    fn home(&self, h: u64) -> usize {
        // Multiply-shift onto the table's length: no power-of-two rounding of memory.
        ((u128::from(h) * self.table.len() as u128) >> 64) as usize
    }

    fn next(&self, s: usize) -> usize {
        if s + 1 == self.table.len() {
            0
        } else {
            s + 1
        }
    }

    /// The hash held by a slot's journal block (0 for an empty slot).
    fn slot_hash(&self, v: u32) -> u64 {
        match (v & !INVALID).checked_sub(1) {
            Some(j) => self.hashes.get(j as usize).copied().unwrap_or(0),
            None => 0,
        }
    }

    /// The slot holding `h`, if any.
    fn find(&self, h: u64) -> Option<usize> {
        let mut s = self.home(h);
        for _ in 0..self.table.len() {
            let v = *self.table.get(s)?;
            if v == 0 {
                return None;
            }
            if self.slot_hash(v) == h {
                return Some(s);
            }
            s = self.next(s);
        }
        None
    }

    /// The journal block holding content with weak hash `h`.
    pub(crate) fn lookup(&self, h: u64) -> Found {
        let h = nonzero(h);
        match self.find(h).and_then(|s| self.table.get(s).copied()) {
            None => Found::None,
            Some(v) if v & INVALID != 0 => Found::Invalid,
            Some(v) => Found::Block(v - 1),
        }
    }

    /// Journal block `j` now holds content with weak hash `h` (its previous entry, if any,
    /// is replaced).
    pub(crate) fn insert(&mut self, j: u32, h: u64) -> Inserted {
        let h = nonzero(h);
        if self.hash_of(j) == Some(h)
            && self.find(h).and_then(|s| self.table.get(s)).is_some_and(|v| v & !INVALID == j + 1)
        {
            return Inserted::Same;
        }
        self.remove(j);
        let Some(slot_of_j) = self.hashes.get_mut(j as usize) else { return Inserted::Same };
        *slot_of_j = h;
        let mut s = self.home(h);
        for _ in 0..self.table.len() {
            let Some(&v) = self.table.get(s) else { break };
            if v == 0 {
                if let Some(t) = self.table.get_mut(s) {
                    *t = j + 1;
                    self.live += 1;
                }
                assert!(self.live <= self.hashes.len(), "pool: more entries than journal blocks");
                return Inserted::New;
            }
            if self.slot_hash(v) == h {
                // Another journal block holds the same hash: which one a checkpoint write
                // repeats is unknown, so neither is offered. `j` keeps its hash (so a
                // later overwrite of `j` finds nothing to remove) but no slot.
                if v & INVALID != 0 {
                    return Inserted::AlreadyInvalid;
                }
                if let Some(t) = self.table.get_mut(s) {
                    *t |= INVALID;
                }
                return Inserted::Invalidated;
            }
            s = self.next(s);
        }
        // Unreachable while `live < table.len()`; the entry is simply not kept.
        Inserted::Same
    }

    /// Journal block `j` was overwritten, freed or used: its entry leaves. Returns true
    /// when it had a slot.
    pub(crate) fn remove(&mut self, j: u32) -> bool {
        let Some(h) = self.hash_of(j) else { return false };
        if let Some(x) = self.hashes.get_mut(j as usize) {
            *x = 0;
        }
        let mut s = self.home(h);
        let mut at = None;
        for _ in 0..self.table.len() {
            let Some(&v) = self.table.get(s) else { break };
            if v == 0 {
                break;
            }
            if v & !INVALID == j + 1 {
                at = Some(s);
                break;
            }
            s = self.next(s);
        }
        let Some(mut hole) = at else { return false };
        if let Some(t) = self.table.get_mut(hole) {
            *t = 0;
        }
        self.live -= 1;
        // Backward-shift deletion: move later members of the run into the hole when their
        // home slot does not lie cyclically in (hole, k].
        let mut k = self.next(hole);
        for _ in 0..self.table.len() {
            let Some(&v) = self.table.get(k) else { break };
            if v == 0 {
                break;
            }
            let home = self.home(self.slot_hash(v));
            let stays = if hole <= k { hole < home && home <= k } else { hole < home || home <= k };
            if !stays {
                if let Some(t) = self.table.get_mut(hole) {
                    *t = v;
                }
                if let Some(t) = self.table.get_mut(k) {
                    *t = 0;
                }
                hole = k;
            }
            k = self.next(k);
        }
        true
    }

    /// Checks the invariants of the module docs (tests and the `verify` audit).
    #[cfg(any(test, feature = "verify"))]
    pub(crate) fn audit(&self) -> Result<(), String> {
        let mut live = 0;
        for (s, &v) in self.table.iter().enumerate() {
            if v == 0 {
                continue;
            }
            live += 1;
            let h = self.slot_hash(v);
            if h == 0 {
                return Err(format!("slot {s} names journal block {} without a hash", (v & !INVALID) - 1));
            }
            if self.find(h) != Some(s) {
                return Err(format!("slot {s} (hash {h:#x}) is not reachable from its home slot"));
            }
        }
        if live != self.live || live > self.hashes.len() {
            return Err(format!("{live} occupied slots, {} counted, {} journal blocks", self.live, self.hashes.len()));
        }
        Ok(())
    }
}

/// Weak hashes are never 0 in the pool (0 marks a block without an entry).
fn nonzero(h: u64) -> u64 {
    h.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::collections::HashMap;

    #[test]
    fn insert_lookup_remove() {
        let mut p = Pool::new(100);
        assert_eq!(p.insert(3, 77), Inserted::New);
        assert_eq!(p.lookup(77), Found::Block(3));
        assert_eq!(p.insert(3, 77), Inserted::Same);
        assert_eq!(p.insert(5, 77), Inserted::Invalidated);
        assert_eq!(p.lookup(77), Found::Invalid);
        assert_eq!(p.insert(6, 77), Inserted::AlreadyInvalid);
        // The representative goes: the hash is unknown again, the others are not offered.
        assert!(p.remove(3));
        assert_eq!(p.lookup(77), Found::None);
        assert!(!p.remove(5));
        assert_eq!(p.entries(), 0);
        p.audit().expect("audit");
        assert!(p.bytes() <= 16 * 100);
    }

    #[test]
    fn memory_is_at_most_16_bytes_per_journal_block() {
        for blocks in [8u64, 1000, 32768, 65536] {
            let p = Pool::new(blocks);
            assert!(p.bytes() <= 16 * blocks.max(8), "{blocks} blocks: {} bytes", p.bytes());
        }
    }

    /// Random operations against a map of journal block → hash, with a hash space small
    /// enough that most entries collide: the pool must answer exactly as the model says.
    #[test]
    fn matches_a_model_under_heavy_collisions() {
        for seed in 0..20u64 {
            let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let blocks = r.gen_range(1..200u32);
            let space = r.gen_range(1..400u64);
            let mut p = Pool::new(u64::from(blocks));
            let mut model: HashMap<u32, u64> = HashMap::new();
            // Hashes made invalid, and which block represents each hash in the table.
            let mut rep: HashMap<u64, (u32, bool)> = HashMap::new();
            for _ in 0..2000 {
                let j = r.gen_range(0..blocks);
                if r.gen_bool(0.6) {
                    let h = r.gen_range(1..=space);
                    if model.get(&j) == Some(&h) && rep.get(&h).is_some_and(|(b, _)| *b == j) {
                        p.insert(j, h);
                        continue;
                    }
                    if let Some(old) = model.remove(&j) {
                        if rep.get(&old).is_some_and(|(b, _)| *b == j) {
                            rep.remove(&old);
                        }
                    }
                    let got = p.insert(j, h);
                    model.insert(j, h);
                    match rep.get_mut(&h) {
                        None => {
                            rep.insert(h, (j, false));
                            assert_eq!(got, Inserted::New, "seed {seed}");
                        }
                        Some((_, inv)) => {
                            assert_eq!(got, if *inv { Inserted::AlreadyInvalid } else { Inserted::Invalidated });
                            *inv = true;
                        }
                    }
                } else {
                    let had = p.remove(j);
                    let old = model.remove(&j);
                    let was_rep = old.is_some_and(|h| rep.get(&h).is_some_and(|(b, _)| *b == j));
                    assert_eq!(had, was_rep, "seed {seed}");
                    if was_rep {
                        rep.remove(&old.unwrap_or(0));
                    }
                }
                p.audit().unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            }
            for h in 1..=space {
                let want = match rep.get(&h) {
                    None => Found::None,
                    Some((_, true)) => Found::Invalid,
                    Some((b, false)) => Found::Block(*b),
                };
                assert_eq!(p.lookup(h), want, "seed {seed} hash {h}");
            }
            assert_eq!(p.entries(), rep.len() as u64);
        }
    }
}
