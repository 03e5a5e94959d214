//! The fingerprint index: a bounded, advisory map from BLAKE3 fingerprint to the physical
//! location of a stored copy.
//!
//! Layout: `capacity` entries in buckets of 8; an entry is 16 bytes (8-byte fingerprint tag
//! + 8-byte location word: pbn 40 bits | state 8 bits | reuse stamp 16 bits). In `hash`
//! verification mode each entry also keeps the remaining 24 bytes of the fingerprint so
//! a hit can be trusted on full 256-bit equality (40 bytes per entry).
//!
//! Invariants:
//! - Memory never exceeds the configured `index_memory_bytes` (the capacity is derived from it).
//! - The index is advisory: an entry may be stale or evicted at any time; a hit is only a
//!   candidate that the volume verifies (bytes, or full hash + reuse stamp) before sharing.

/// Entries per bucket.
pub const BUCKET_ENTRIES: usize = 8;
/// Bytes per entry in `bytes` verification mode.
pub const ENTRY_BYTES: u64 = 16;
/// Bytes per entry in `hash` verification mode.
pub const ENTRY_BYTES_FULL_HASH: u64 = 40;

/// Where a fingerprint's copy lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Physical block.
    pub pbn: u64,
    /// Map entry state (raw or packed slot).
    pub state: u8,
    /// Reuse stamp of the block when the entry was made (hash mode).
    pub stamp: u16,
}

impl Location {
    fn pack(&self) -> u64 {
        (self.pbn & ((1 << 40) - 1)) | (u64::from(self.state) << 40) | (u64::from(self.stamp) << 48)
    }
    fn unpack(w: u64) -> Self {
        Location { pbn: w & ((1 << 40) - 1), state: (w >> 40) as u8, stamp: (w >> 48) as u16 }
    }
}

/// The index.
pub struct Index {
    tags: Vec<u64>,
    locs: Vec<u64>,
    rest: Option<Vec<[u8; 24]>>,
    buckets: usize,
    entries: u64,
}

fn tag_of(h: &[u8; 32]) -> u64 {
    let mut t = [0u8; 8];
    t.copy_from_slice(&h[..8]);
    u64::from_le_bytes(t) | 1
}

fn bucket_key(h: &[u8; 32]) -> u64 {
    let mut t = [0u8; 8];
    t.copy_from_slice(&h[8..16]);
    u64::from_le_bytes(t)
}

fn rest_of(h: &[u8; 32]) -> [u8; 24] {
    let mut r = [0u8; 24];
    r.copy_from_slice(&h[8..]);
    r
}

impl Index {
    /// An index using at most `memory_bytes`.
    pub fn new(memory_bytes: u64, full_hash: bool) -> Self {
        let per = if full_hash { ENTRY_BYTES_FULL_HASH } else { ENTRY_BYTES };
        let buckets = ((memory_bytes / per) as usize / BUCKET_ENTRIES).max(1);
        let cap = buckets * BUCKET_ENTRIES;
        Index {
            tags: vec![0; cap],
            locs: vec![0; cap],
            rest: full_hash.then(|| vec![[0u8; 24]; cap]),
            buckets,
            entries: 0,
        }
    }

    /// Entries the index can hold.
    pub fn capacity(&self) -> u64 {
        self.tags.len() as u64
    }

    /// Entries held now.
    pub fn len(&self) -> u64 {
        self.entries
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Bytes per entry.
    pub fn bytes_per_entry(&self) -> u64 {
        if self.rest.is_some() {
            ENTRY_BYTES_FULL_HASH
        } else {
            ENTRY_BYTES
        }
    }

    /// Memory used by the table.
    pub fn memory_bytes(&self) -> u64 {
        self.capacity() * self.bytes_per_entry()
    }

    fn range(&self, h: &[u8; 32]) -> std::ops::Range<usize> {
        let b = (bucket_key(h) % self.buckets as u64) as usize;
        b * BUCKET_ENTRIES..(b + 1) * BUCKET_ENTRIES
    }

    fn find(&self, h: &[u8; 32]) -> Option<usize> {
        let tag = tag_of(h);
        let rest = self.rest.as_ref().map(|_| rest_of(h));
        self.range(h).find(|&i| {
            self.tags.get(i) == Some(&tag)
                && match (&self.rest, &rest) {
                    (Some(r), Some(want)) => r.get(i) == Some(want),
                    _ => true,
                }
        })
    }

    /// The candidate location for fingerprint `h`.
    pub fn lookup(&self, h: &[u8; 32]) -> Option<Location> {
        self.find(h).and_then(|i| self.locs.get(i)).map(|&w| Location::unpack(w))
    }

    /// Records `h` at `loc`, replacing a same-fingerprint entry, an empty one, or a victim.
    pub fn insert(&mut self, h: &[u8; 32], loc: Location) {
        let i = match self.find(h) {
            Some(i) => i,
            None => {
                let r = self.range(h);
                match r.clone().find(|&i| self.tags.get(i) == Some(&0)) {
                    Some(i) => {
                        self.entries += 1;
                        i
                    }
                    // Full bucket: replace a pseudo-random victim (advisory index, bounded memory).
                    None => r.start + (h[16] as usize % BUCKET_ENTRIES),
                }
            }
        };
        if let (Some(t), Some(l)) = (self.tags.get_mut(i), self.locs.get_mut(i)) {
            *t = tag_of(h);
            *l = loc.pack();
        }
        if let Some(r) = self.rest.as_mut().and_then(|r| r.get_mut(i)) {
            *r = rest_of(h);
        }
    }

    /// Forgets `h` if it still points at `loc` (after a failed verification).
    pub fn remove(&mut self, h: &[u8; 32], loc: Location) {
        if let Some(i) = self.find(h) {
            if self.locs.get(i).map(|&w| Location::unpack(w)) == Some(loc) {
                if let Some(t) = self.tags.get_mut(i) {
                    *t = 0;
                    self.entries -= 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_lookup_insert_remove() {
        let mut ix = Index::new(64 << 10, false);
        assert_eq!(ix.memory_bytes(), 64 << 10);
        let h = *blake3::hash(b"a").as_bytes();
        let loc = Location { pbn: 5, state: 2, stamp: 0 };
        ix.insert(&h, loc);
        assert_eq!(ix.lookup(&h), Some(loc));
        ix.remove(&h, loc);
        assert_eq!(ix.lookup(&h), None);
        for i in 0..100_000u32 {
            ix.insert(blake3::hash(&i.to_le_bytes()).as_bytes(), loc);
        }
        assert!(ix.len() <= ix.capacity());
        let full = Index::new(64 << 10, true);
        assert_eq!(full.bytes_per_entry(), 40);
    }
}
