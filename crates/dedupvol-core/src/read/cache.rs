//! The read-only content cache under the reduction layer: recently written or read
//! physical blocks, by physical block number. It serves client reads and duplicate
//! verification without device reads (the paper's DRAM cache optimisation).
//!
//! Invariants:
//! - At most `capacity_blocks` blocks are held (CLOCK eviction), and every held block
//!   has a place in the CLOCK order (the `verify` audit checks both).
//! - A cached block equals the device's content of that block, except transiently after
//!   a race with reuse; readers that see a checksum mismatch drop the entry and re-read.
//! - Writers replace the entry (`put`); readers only fill absent entries (`fill`), so a
//!   slow reader cannot overwrite newer content with older.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

/// A cached 4 KiB physical block.
pub type Block = Arc<[u8]>;

/// A zeroed, unshared block, allocated once (`Arc::from(Vec)` would copy it).
pub(crate) fn new_block() -> Block {
    std::iter::repeat_n(0u8, crate::config::BLOCK_SIZE).collect()
}

/// The content cache.
pub struct ContentCache {
    map: PbnMap<(Block, bool)>,
    order: VecDeque<u64>,
    capacity_blocks: usize,
    /// Hits since open.
    hits: u64,
    /// Misses since open.
    misses: u64,
}

/// A map keyed by block or page number, hashed with `PbnHasher`.
pub type PbnMap<V> = HashMap<u64, V, BuildHasherDefault<PbnHasher>>;
/// A set of block or page numbers, hashed with `PbnHasher`.
pub type PbnSet = std::collections::HashSet<u64, BuildHasherDefault<PbnHasher>>;

/// Hashes a pbn key with one multiply (SipHash costs more than the lookup it serves;
/// keys are block numbers, not attacker-chosen strings, and the order of the map is never
/// used, so the cache stays deterministic).
#[derive(Default)]
pub struct PbnHasher(u64);

impl Hasher for PbnHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(26);
    }
}

impl ContentCache {
    /// A cache of `capacity_bytes` (0 disables it).
    pub fn new(capacity_bytes: u64) -> Self {
        ContentCache {
            map: HashMap::default(),
            order: VecDeque::new(),
            capacity_blocks: (capacity_bytes / crate::config::BLOCK_SIZE_U64) as usize,
            hits: 0,
            misses: 0,
        }
    }

    /// Looks up a block.
    pub fn get(&mut self, pbn: u64) -> Option<Block> {
        match self.map.get_mut(&pbn) {
            Some((b, referenced)) => {
                *referenced = true;
                self.hits += 1;
                Some(b.clone())
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// True when `pbn` is cached (not counted as a hit or a miss).
    pub fn contains(&self, pbn: u64) -> bool {
        self.map.contains_key(&pbn)
    }

    /// Stores freshly written content (replaces any entry).
    pub fn put(&mut self, pbn: u64, block: Block) {
        if self.capacity_blocks == 0 {
            return;
        }
        if self.map.insert(pbn, (block, false)).is_none() {
            self.order.push_back(pbn);
        }
        self.shrink();
    }

    /// Stores content read from the device unless newer content is already cached.
    pub fn fill(&mut self, pbn: u64, block: Block) {
        if self.capacity_blocks == 0 || self.map.contains_key(&pbn) {
            return;
        }
        self.map.insert(pbn, (block, false));
        self.order.push_back(pbn);
        self.shrink();
    }

    /// Drops an entry (after a checksum mismatch).
    pub fn remove(&mut self, pbn: u64) {
        self.map.remove(&pbn);
    }

    fn shrink(&mut self) {
        let mut budget = 2 * self.order.len() + 8;
        while self.map.len() > self.capacity_blocks && budget > 0 {
            budget -= 1;
            let Some(pbn) = self.order.pop_front() else { break };
            match self.map.get_mut(&pbn) {
                Some((_, referenced)) if *referenced => {
                    *referenced = false;
                    self.order.push_back(pbn);
                }
                Some(_) => {
                    self.map.remove(&pbn);
                }
                None => {}
            }
        }
        if self.order.len() > 2 * self.capacity_blocks + 64 {
            // Keep the surviving order (not HashMap order): eviction must be deterministic
            // so one simulator seed replays the same I/O.
            let map = &self.map;
            let mut seen = std::collections::HashSet::new();
            self.order.retain(|p| map.contains_key(p) && seen.insert(*p));
        }
    }

    /// Blocks cached.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Lookups that found their block since open.
    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Lookups that did not since open.
    pub fn misses(&self) -> u64 {
        self.misses
    }

    /// Checks the bound and that eviction can reach every held block (the `verify` audit).
    #[cfg(any(test, feature = "verify"))]
    pub fn audit(&self) -> Result<(), String> {
        if self.map.len() > self.capacity_blocks {
            return Err(format!("content cache holds {} blocks, above {}", self.map.len(), self.capacity_blocks));
        }
        let ordered: PbnSet = self.order.iter().copied().collect();
        match self.map.keys().find(|p| !ordered.contains(p)) {
            Some(p) => Err(format!("content cache holds block {p} outside its eviction order")),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_fill_does_not_overwrite() {
        let mut c = ContentCache::new(4 * 4096);
        for i in 0..10u64 {
            c.put(i, Arc::from(vec![i as u8; 4096]));
        }
        assert!(c.len() <= 4);
        c.put(100, Arc::from(vec![1u8; 4096]));
        c.fill(100, Arc::from(vec![2u8; 4096]));
        assert_eq!(c.get(100).map(|b| b[0]), Some(1));
    }
}
