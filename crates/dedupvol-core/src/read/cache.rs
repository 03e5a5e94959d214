//! The read-only content cache under the reduction layer: recently written or read
//! physical blocks, by physical block number. It serves client reads and duplicate
//! verification without device reads.
//!
//! Admission and eviction are S3-FIFO (`quick_cache`): a block enters a small probationary
//! queue and reaches the main queue only when it is read again, so a long sequential scan
//! passes through the small queue and cannot flush the blocks that are read repeatedly.
//!
//! Invariants:
//! - At most the capacity (bytes / 4 KiB) of blocks are held (the `verify` audit checks it).
//! - A cached block equals the device's content of that block, except transiently after
//!   a race with reuse; readers that see a checksum mismatch drop the entry and re-read.
//! - Writers replace the entry (`put`); readers only fill absent entries (`fill`), so a
//!   slow reader cannot overwrite newer content with older.
//! - Besides physical blocks it holds decompressed blocks of compressed fragments, keyed
//!   by `fragment_key(pbn, key)` (the fragment's first block and `Frag::key`, in a key
//!   space no pbn reaches): a re-read of compressed data then costs neither a
//!   decompression nor a copy. Removing a pbn removes the decoded blocks of fragments
//!   starting in it; reallocating one (`remove_for_reuse`) also those of fragments that
//!   may run into it. Reads admit them only while the cache has spare room
//!   (`fill_fragment`); verification admits a unit's blocks regardless
//!   (`fill_fragment_soon`).
//! - `fragment_keys` lists, per pbn, the keys of decoded blocks that may be cached for
//!   it, at most `FRAGMENT_KEYS_PER_PBN` each and `2 × capacity` in all (past that, every
//!   decoded block is dropped and the lists start again): removing a pbn without a list
//!   costs one lookup (every overwrite removes its old block, and most blocks never had
//!   fragments cached).
//! - Each entry keeps the crc32c of its 4 KiB, computed from that content when it entered
//!   (an `Arc` never changes): a read of a raw block compares it with the map entry's crc
//!   instead of hashing the block again, which is as strong a check of the same bytes.
//! - Eviction is deterministic (a fixed hasher, no randomness): one simulator seed replays
//!   the same I/O.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A cached 4 KiB physical block.
pub use crate::block::Block;

/// Top bit of a key: a decompressed fragment, not a physical block.
const FRAGMENT_KEY_BIT: u64 = 1 << 63;
/// Decoded blocks cached per pbn at most (fragments starting in it, blocks of extents).
const FRAGMENT_KEYS_PER_PBN: usize = 64;

/// The key of the decoded block `key` (`Frag::key`) of a fragment starting in block `pbn`.
pub(crate) fn fragment_key(pbn: u64, key: u16) -> u64 {
    debug_assert!(pbn < FRAGMENT_KEY_BIT >> 16, "pbn {pbn} beyond the fragment key space");
    FRAGMENT_KEY_BIT | (pbn << 16) | u64::from(key)
}

/// The crc32c a cache entry keeps for `block`.
pub(crate) fn block_crc(block: &[u8]) -> u32 {
    crc32c::crc32c(block)
}

/// A zeroed, unshared 4 KiB block.
pub(crate) fn new_block() -> Block {
    Block::zeroed(crate::config::BLOCK_SIZE)
}

/// The S3-FIFO table: one weight unit per block, keys hashed with `PbnHasher`.
type Table = quick_cache::unsync::Cache<
    u64,
    Cached,
    quick_cache::UnitWeighter,
    BuildHasherDefault<PbnHasher>,
    quick_cache::unsync::DefaultLifecycle<u64, Cached>,
>;

/// What `get_many` found for one key.
pub(crate) struct Found {
    pub(crate) block: Block,
    /// crc32c of `block`.
    pub(crate) crc: u32,
    /// `block` is the decompressed fragment asked for, not the physical block.
    pub(crate) fragment: bool,
}

/// Asks the CPU to bring the cache line holding a block's reference count (just before
/// its data) and the first line of its data towards the core. A hint: it never faults
/// and changes nothing.
#[inline]
fn prefetch(data: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // An `Arc`'s counts sit in the 16 bytes before its data.
        let counts = data.wrapping_sub(16);
        // SAFETY: prefetch instructions never fault, whatever the address, and do not
        // change memory; the pointers are only hints.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(counts.cast::<i8>());
            _mm_prefetch::<_MM_HINT_T0>(data.cast::<i8>());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// A cached block and the crc32c of its content.
#[derive(Clone)]
struct Cached {
    block: Block,
    crc: u32,
}

/// The content cache (callers serialise access: the volume keeps it behind a mutex).
pub struct ContentCache {
    /// None when the capacity is zero (caching off).
    table: Option<Table>,
    /// Hits since open.
    hits: u64,
    /// Misses since open.
    misses: u64,
    /// Keys of decoded blocks that may be cached, per pbn (see the invariants).
    fragment_keys: PbnMap<Vec<u16>>,
    /// Keys listed in `fragment_keys`.
    fragment_keys_total: usize,
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
        let capacity_blocks = (capacity_bytes / crate::config::BLOCK_SIZE_U64) as usize;
        let table = (capacity_blocks > 0).then(|| {
            Table::with(
                capacity_blocks,
                capacity_blocks as u64,
                quick_cache::UnitWeighter,
                BuildHasherDefault::default(),
                quick_cache::unsync::DefaultLifecycle::default(),
            )
        });
        ContentCache { table, hits: 0, misses: 0, fragment_keys: PbnMap::default(), fragment_keys_total: 0 }
    }

    /// Looks up a block (a hit counts towards keeping it).
    pub fn get(&mut self, pbn: u64) -> Option<Block> {
        self.get_with_crc(pbn).map(|(b, _)| b)
    }

    /// Looks up a block and the crc32c of its content.
    pub fn get_with_crc(&mut self, pbn: u64) -> Option<(Block, u32)> {
        let found = self.table.as_ref().and_then(|t| t.get(&pbn)).map(|c| (c.block.clone(), c.crc));
        match found {
            Some(_) => self.hits += 1,
            None => self.misses += 1,
        }
        found
    }

    /// The cached block without counting a hit or a miss or touching its hotness (the
    /// tier takes content it is offered from here).
    pub fn peek(&self, pbn: u64) -> Option<Block> {
        self.table.as_ref().and_then(|t| t.peek(&pbn)).map(|c| c.block.clone())
    }

    /// True when `pbn` is cached (not counted as a hit or a miss, and no use of the block).
    pub fn contains(&self, pbn: u64) -> bool {
        self.table.as_ref().is_some_and(|t| t.contains_key(&pbn))
    }

    /// Stores freshly written content (replaces any entry); `crc` is its crc32c
    /// (`block_crc`), computed by the caller outside the cache lock.
    pub fn put(&mut self, pbn: u64, block: Block, crc: u32) {
        debug_assert_eq!(crc, block_crc(&block), "content cache put of pbn {pbn} with a wrong crc");
        if let Some(t) = self.table.as_mut() {
            t.insert(pbn, Cached { block, crc });
        }
    }

    /// `put`, and counted as used once (not as a hit), so that the block is not evicted
    /// before anything reads it: a journal block kept for write-once journaling, which
    /// its checkpoint write compares with only after up to a journal's worth of writes.
    pub fn put_hot(&mut self, pbn: u64, block: Block, crc: u32) {
        self.put(pbn, block, crc);
        self.touch(pbn);
    }

    /// Counts a cached block as used once (not as a hit); nothing when it is not cached.
    pub fn touch(&mut self, pbn: u64) {
        if let Some(t) = self.table.as_ref() {
            let _ = t.get(&pbn);
        }
    }

    /// Stores content read from the device unless newer content is already cached; `crc`
    /// as for `put`.
    pub fn fill(&mut self, pbn: u64, block: Block, crc: u32) {
        debug_assert_eq!(crc, block_crc(&block), "content cache fill of pbn {pbn} with a wrong crc");
        if let Some(t) = self.table.as_mut() {
            if !t.contains_key(&pbn) {
                t.insert(pbn, Cached { block, crc });
            }
        }
    }

    /// Drops a physical block and its decompressed fragments (freed block, checksum
    /// mismatch, reallocation).
    pub fn remove(&mut self, pbn: u64) {
        if let Some(t) = self.table.as_mut() {
            t.remove(&pbn);
        }
        self.remove_decoded(pbn);
    }

    /// Drops block `pbn`, about to be written with new content (reallocated), and the
    /// decompressed blocks of every fragment that may run into it: those starting in it or
    /// in the blocks before it that a fragment can reach it from
    /// (`packer::fragments_reaching`). Why the neighbours: a decoded block stands for the
    /// content of every block its fragment touches, and verification offers decoded blocks
    /// of fragments no mapping uses any more (an index record outliving its data), whose
    /// tail may be this block; after the reuse such a decoded block would no longer match
    /// the device, and verification compares against it.
    pub fn remove_for_reuse(&mut self, pbn: u64) {
        self.remove(pbn);
        for q in crate::data::packer::fragments_reaching(pbn) {
            self.remove_decoded(q);
        }
    }

    /// Drops the decompressed fragments starting in `pbn` and keeps the physical block: a
    /// dead fragment starting there may run into a block freed since, and its decoded copy
    /// must not vouch for it any more; the physical block still equals the device's, so a
    /// decode from it (with the reused block read afresh) fails its checksum as a device
    /// read would.
    pub fn remove_decoded(&mut self, pbn: u64) {
        let Some(t) = self.table.as_mut() else { return };
        if let Some(keys) = self.fragment_keys.remove(&pbn) {
            self.fragment_keys_total -= keys.len();
            for k in keys {
                t.remove(&fragment_key(pbn, k));
            }
        }
    }

    /// Stores a decoded block of a fragment starting in `pbn` (`key`: `Frag::key`), only
    /// while the cache has spare room (under 7/8 full). Why: compressed blocks hold several
    /// fragments in 4 KiB, their decoded copies take 4 KiB each; when the working set does
    /// not fit, caching the denser physical blocks serves more reads from memory. Replaces
    /// an entry under the same key (a block reused since holds another fragment there).
    pub fn fill_fragment(&mut self, pbn: u64, key: u16, block: Block, crc: u32) {
        self.fill_decoded(pbn, key, block, crc, false);
    }

    /// `fill_fragment` of a decoded block about to be asked for (the rest of a unit whose
    /// blocks a re-write verifies one after another), stored even when the cache is nearly
    /// full: it enters the probationary queue like any fill, and goes if it is not used.
    pub fn fill_fragment_soon(&mut self, pbn: u64, key: u16, block: Block, crc: u32) {
        self.fill_decoded(pbn, key, block, crc, true);
    }

    /// True when `fill_fragment` would keep a decoded block now (a cache with spare room):
    /// a reader that gets false need not copy and checksum the other blocks of a unit it
    /// decodes only to have them dropped.
    pub fn admits_decoded(&self) -> bool {
        self.table.as_ref().is_some_and(|t| (t.len() as u64) < t.capacity() - t.capacity() / 8)
    }

    fn fill_decoded(&mut self, pbn: u64, key: u16, block: Block, crc: u32, even_if_full: bool) {
        if !even_if_full && !self.admits_decoded() {
            return;
        }
        let Some(t) = self.table.as_mut() else { return };
        if self.fragment_keys_total >= 2 * t.capacity() as usize {
            for (p, keys) in self.fragment_keys.drain() {
                for k in keys {
                    t.remove(&fragment_key(p, k));
                }
            }
            self.fragment_keys_total = 0;
        }
        let keys = self.fragment_keys.entry(pbn).or_default();
        if !keys.contains(&key) {
            if keys.len() >= FRAGMENT_KEYS_PER_PBN {
                return;
            }
            keys.push(key);
            self.fragment_keys_total += 1;
        }
        debug_assert_eq!(crc, block_crc(&block), "content cache fill of a fragment of pbn {pbn} with a wrong crc");
        t.insert(fragment_key(pbn, key), Cached { block, crc });
    }

    /// Looks up a decompressed fragment and its crc32c; only a hit is counted (a miss
    /// goes on to the packed block, which counts it).
    pub fn get_fragment(&mut self, pbn: u64, key: u16) -> Option<(Block, u32)> {
        let found = self.table.as_ref().and_then(|t| t.get(&fragment_key(pbn, key))).map(|c| (c.block.clone(), c.crc));
        if found.is_some() {
            self.hits += 1;
        }
        found
    }

    /// Looks up many blocks at once, as `get_fragment` then `get_with_crc` would one by one
    /// (`None` keys are skipped): a block's decompressed fragment when `slot` is given and
    /// cached, else the physical block. Why two passes: taking a reference to a cached
    /// block is a locked increment of its count, which on x86 waits for that (usually
    /// cold) cache line before any later load may proceed, so one-by-one lookups of a
    /// request's scattered blocks pay their memory latencies in series. The first pass
    /// only finds entries and prefetches their counts, so the misses overlap; the second
    /// takes the references.
    pub(crate) fn get_many(&mut self, keys: &[Option<(u64, Option<u16>)>]) -> Vec<Option<Found>> {
        let Some(t) = self.table.as_ref() else {
            self.misses += keys.iter().filter(|k| k.is_some()).count() as u64;
            return keys.iter().map(|_| None).collect();
        };
        let entries: Vec<Option<(&Cached, bool)>> = keys
            .iter()
            .map(|k| {
                let (pbn, slot) = (*k)?;
                let found = match slot.and_then(|s| t.get(&fragment_key(pbn, s))) {
                    Some(c) => Some((c, true)),
                    None => t.get(&pbn).map(|c| (c, false)),
                };
                if let Some((c, _)) = found {
                    prefetch(c.block.header_ptr());
                }
                found
            })
            .collect();
        let (mut hits, mut misses) = (0u64, 0u64);
        let out = keys
            .iter()
            .zip(entries)
            .map(|(k, e)| match e {
                Some((c, fragment)) => {
                    hits += 1;
                    Some(Found { block: c.block.clone(), crc: c.crc, fragment })
                }
                None => {
                    misses += u64::from(k.is_some());
                    None
                }
            })
            .collect();
        self.hits += hits;
        self.misses += misses;
        out
    }

    /// Blocks cached.
    pub fn len(&self) -> usize {
        self.table.as_ref().map_or(0, |t| t.len())
    }

    /// Lookups that found their block since open.
    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Lookups that did not since open.
    pub fn misses(&self) -> u64 {
        self.misses
    }

    /// Checks the bound (the `verify` audit).
    #[cfg(any(test, feature = "verify"))]
    pub fn audit(&self) -> Result<(), String> {
        let (held, bound) = (self.len() as u64, self.table.as_ref().map_or(0, |t| t.capacity()));
        if held > bound {
            return Err(format!("content cache holds {held} blocks, above {bound}"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_fill_does_not_overwrite() {
        let mut c = ContentCache::new(4 * 4096);
        for i in 0..10u64 {
            let b: Block = Block::from(vec![i as u8; 4096]);
            c.put(i, b.clone(), block_crc(&b));
        }
        assert!(c.len() <= 4);
        let (one, two): (Block, Block) = (Block::from(vec![1u8; 4096]), Block::from(vec![2u8; 4096]));
        c.put(100, one.clone(), block_crc(&one));
        c.fill(100, two.clone(), block_crc(&two));
        assert_eq!(c.get(100).map(|b| b[0]), Some(1));
    }

    /// A 1 MiB-at-a-time sequential scan of ten times the cache must not flush blocks that
    /// are read again and again: with CLOCK the scan evicted all of them.
    #[test]
    fn a_sequential_scan_does_not_flush_the_hot_blocks() {
        let block: Block = Block::from(vec![7u8; 4096]);
        let mut c = ContentCache::new(1024 * 4096);
        let hot: Vec<u64> = (0..200).map(|i| 1_000_000 + i * 7).collect();
        for _ in 0..4 {
            for &p in &hot {
                if c.get(p).is_none() {
                    c.fill(p, block.clone(), block_crc(&block));
                }
            }
        }
        for p in 0..10 * 1024u64 {
            if c.get(p).is_none() {
                c.fill(p, block.clone(), block_crc(&block));
            }
            if p % 256 == 255 {
                // The hot set is read between chunks of the scan, as a workload does.
                for &h in hot.iter().step_by(10) {
                    c.get(h);
                }
            }
        }
        let kept = hot.iter().filter(|&&p| c.contains(p)).count();
        assert!(kept >= 180, "the scan flushed the hot set: {kept} of {} hot blocks kept", hot.len());
        c.audit().expect("bound");
    }

    #[test]
    fn removing_a_pbn_removes_its_fragments_only() {
        let mut c = ContentCache::new(64 * 4096);
        let b = |v: u8| -> Block { Block::from(vec![v; 4096]) };
        c.fill_fragment(7, 0, b(1), block_crc(&b(1)));
        c.fill_fragment(7, 13, b(2), block_crc(&b(2)));
        c.fill_fragment(9, 3, b(3), block_crc(&b(3)));
        c.fill(8, b(4), block_crc(&b(4)));
        assert!(c.get_fragment(7, 13).is_some());
        c.remove(8);
        assert!(c.get(8).is_none());
        assert!(c.get_fragment(7, 0).is_some() && c.get_fragment(9, 3).is_some(), "another pbn's fragments went");
        c.remove(7);
        assert!(c.get_fragment(7, 0).is_none() && c.get_fragment(7, 13).is_none(), "a removed pbn's fragment stayed");
        assert!(c.get_fragment(9, 3).is_some());
        // Cached again after its removal (the block reused and packed again): removed again.
        c.fill_fragment(7, 5, b(5), block_crc(&b(5)));
        c.remove(7);
        assert!(c.get_fragment(7, 5).is_none());
    }

    #[test]
    fn get_many_finds_what_one_by_one_lookups_find() {
        let mut c = ContentCache::new(64 * 4096);
        let b = |v: u8| -> Block { Block::from(vec![v; 4096]) };
        c.fill(3, b(3), block_crc(&b(3)));
        c.fill(4, b(4), block_crc(&b(4)));
        c.fill_fragment(4, 2, b(42), block_crc(&b(42)));
        let keys = [Some((3, None)), None, Some((4, Some(2))), Some((4, Some(1))), Some((5, None)), Some((6, Some(0)))];
        let (h0, m0) = (c.hits(), c.misses());
        let got = c.get_many(&keys);
        let summary: Vec<Option<(u8, u32, bool)>> =
            got.iter().map(|f| f.as_ref().map(|f| (f.block[0], f.crc, f.fragment))).collect();
        assert_eq!(
            summary,
            vec![
                Some((3, block_crc(&b(3)), false)),
                None,
                Some((42, block_crc(&b(42)), true)),
                // No fragment for slot 1: the packed block itself.
                Some((4, block_crc(&b(4)), false)),
                None,
                None,
            ]
        );
        assert_eq!((c.hits() - h0, c.misses() - m0), (3, 2));
        let mut off = ContentCache::new(0);
        assert!(off.get_many(&keys).iter().all(Option::is_none));
        assert_eq!(off.misses(), 5);
    }

    #[test]
    fn zero_capacity_caches_nothing() {
        let mut c = ContentCache::new(0);
        let b: Block = Block::from(vec![1u8; 4096]);
        c.put(1, b.clone(), block_crc(&b));
        c.fill(2, b.clone(), block_crc(&b));
        assert_eq!(c.len(), 0);
        assert!(c.get(1).is_none());
    }

    /// A decoded block stands for every block its fragment touches: reallocating any of
    /// them drops it (verification compares against decoded blocks of fragments no
    /// mapping uses any more, whose tail blocks may be reused).
    #[test]
    fn reusing_a_block_drops_the_decoded_fragments_that_may_run_into_it() {
        let mut c = ContentCache::new(1 << 20);
        let b = |v: u8| -> Block { Block::from(vec![v; 4096]) };
        c.fill_fragment_soon(10, 5, b(1), block_crc(&b(1)));
        c.fill_fragment_soon(30, 5, b(2), block_crc(&b(2)));
        c.remove_for_reuse(27);
        assert!(c.get_fragment(10, 5).is_some(), "a fragment starting in 10 touches 26 at most");
        c.remove_for_reuse(12);
        assert!(c.get_fragment(10, 5).is_none(), "a fragment starting in 10 may run into 12");
        assert!(c.get_fragment(30, 5).is_some(), "30 is after 12");
        c.remove_for_reuse(30);
        assert!(c.get_fragment(30, 5).is_none());
    }
}
