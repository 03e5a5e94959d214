//! The fingerprint index: a bounded, advisory map from BLAKE3 fingerprint to the physical
//! location of a stored copy.
//!
//! Layout: `capacity` entries in buckets of 8; an entry is 16 bytes (an 8-byte fingerprint
//! tag and an 8-byte location word: pbn 40 bits | state 8 bits | reuse stamp 16 bits). A bucket is
//! 128 contiguous bytes, its 8 tags then its 8 location words, so a lookup touches one
//! page and two cache lines; the table asks for huge pages (`hugemem`). In `hash`
//! verification mode each entry also keeps the remaining 24 bytes of the fingerprint so
//! a hit can be trusted on full 256-bit equality (40 bytes per entry).
//!
//! Invariants:
//! - Memory never exceeds the configured `index_memory_bytes` (the capacity is derived from it).
//! - The index is advisory: an entry may be stale or evicted at any time; a hit is only a
//!   candidate that the volume verifies (bytes, or full hash + reuse stamp) before sharing.
//! - `entries` counts the occupied slots (tag != 0), and every entry sits in the bucket
//!   its tag selects, so lookups find it (the `verify` audit checks both).

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
    /// Populates `words` and `rest` in the background; declared first so it is dropped
    /// (joined) before them.
    prefault: Vec<crate::io::hugemem::Prefault>,
    /// Per bucket: 8 tags, then 8 location words (tag 0 = empty slot).
    words: Vec<u64>,
    rest: Option<Vec<[u8; 24]>>,
    buckets: usize,
    entries: u64,
}

fn tag_of(h: &[u8; 32]) -> u64 {
    let mut t = [0u8; 8];
    t.copy_from_slice(&h[..8]);
    u64::from_le_bytes(t) | 1
}

/// The bucket comes from the tag alone (mixed, so its high bits matter too), which lets a
/// saved index be reloaded from (tag, location) pairs into a table of any size.
fn bucket_of_tag(tag: u64) -> u64 {
    tag.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29)
}

fn rest_of(h: &[u8; 32]) -> [u8; 24] {
    // Bytes 8..32: with the 8-byte tag, the whole fingerprint.
    let mut r = [0u8; 24];
    r.copy_from_slice(&h[8..]);
    r
}

impl Index {
    /// An index using at most `memory_bytes`, its memory populated in the background.
    #[cfg(test)]
    pub fn new(memory_bytes: u64, full_hash: bool) -> Self {
        Self::with_prefault(memory_bytes, full_hash, true)
    }

    /// An index using at most `memory_bytes`; with `prefault`, a background thread
    /// populates its memory (a read-only volume never inserts, so it skips that).
    #[cfg(test)]
    pub fn with_prefault(memory_bytes: u64, full_hash: bool, prefault: bool) -> Self {
        let per = if full_hash { ENTRY_BYTES_FULL_HASH } else { ENTRY_BYTES };
        let buckets = ((memory_bytes / per) as usize / BUCKET_ENTRIES).max(1);
        let cap = buckets * BUCKET_ENTRIES;
        let words: Vec<u64> = crate::io::hugemem::zeroed(2 * cap);
        let rest: Option<Vec<[u8; 24]>> = full_hash.then(|| crate::io::hugemem::zeroed(cap));
        Self::from_tables(words, rest, buckets, prefault)
    }

    /// `with_prefault`, but memory the allocator refuses is an error, not an abort (the
    /// stored index size may exceed what this machine holds).
    pub fn try_with_prefault(memory_bytes: u64, full_hash: bool, prefault: bool) -> crate::Result<Self> {
        let per = if full_hash { ENTRY_BYTES_FULL_HASH } else { ENTRY_BYTES };
        let buckets = usize::try_from(memory_bytes / per).unwrap_or(usize::MAX) / BUCKET_ENTRIES;
        let buckets = buckets.max(1);
        let refused = || {
            crate::Error::OutOfMemory(format!(
                "the fingerprint index needs {memory_bytes} bytes, which this machine cannot allocate; open with a smaller index memory (--index-memory)"
            ))
        };
        if let Some(machine) = crate::io::hugemem::physical_memory_bytes().filter(|&m| memory_bytes > m) {
            // Checked first: with overcommit the allocation itself may succeed and the
            // process be killed later, on first touch.
            return Err(crate::Error::OutOfMemory(format!(
                "the fingerprint index needs {memory_bytes} bytes but this machine has {machine}; open with a smaller index memory (--index-memory)"
            )));
        }
        let cap = buckets.checked_mul(BUCKET_ENTRIES).ok_or_else(refused)?;
        let words: Vec<u64> =
            crate::io::hugemem::try_zeroed(cap.checked_mul(2).ok_or_else(refused)?).ok_or_else(refused)?;
        let rest: Option<Vec<[u8; 24]>> = match full_hash {
            true => Some(crate::io::hugemem::try_zeroed(cap).ok_or_else(refused)?),
            false => None,
        };
        Ok(Self::from_tables(words, rest, buckets, prefault))
    }

    fn from_tables(words: Vec<u64>, rest: Option<Vec<[u8; 24]>>, buckets: usize, prefault: bool) -> Self {
        let mut threads = Vec::new();
        if prefault {
            threads.push(crate::io::hugemem::Prefault::start(&words));
            threads.extend(rest.as_deref().map(crate::io::hugemem::Prefault::start));
        }
        Index { prefault: threads, words, rest, buckets, entries: 0 }
    }

    /// Waits for the background population of the table's memory to finish.
    pub fn wait_prefault(&mut self) {
        self.prefault.iter_mut().for_each(crate::io::hugemem::Prefault::wait);
    }

    /// Entries the index can hold.
    pub fn capacity(&self) -> u64 {
        (self.words.len() / 2) as u64
    }

    /// Word position of entry `i`'s tag; its location word is `BUCKET_ENTRIES` further.
    fn tag_pos(i: usize) -> usize {
        (i / BUCKET_ENTRIES) * 2 * BUCKET_ENTRIES + i % BUCKET_ENTRIES
    }

    fn tag(&self, i: usize) -> Option<u64> {
        self.words.get(Self::tag_pos(i)).copied()
    }

    fn loc(&self, i: usize) -> Option<u64> {
        self.words.get(Self::tag_pos(i) + BUCKET_ENTRIES).copied()
    }

    fn set(&mut self, i: usize, tag: u64, loc: u64) {
        let t = Self::tag_pos(i);
        if let Some(w) = self.words.get_mut(t) {
            *w = tag;
        }
        if let Some(w) = self.words.get_mut(t + BUCKET_ENTRIES) {
            *w = loc;
        }
    }

    /// Entries held now.
    pub fn len(&self) -> u64 {
        self.entries
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
        self.range_of_tag(tag_of(h))
    }

    fn range_of_tag(&self, tag: u64) -> std::ops::Range<usize> {
        let b = (bucket_of_tag(tag) % self.buckets as u64) as usize;
        b * BUCKET_ENTRIES..(b + 1) * BUCKET_ENTRIES
    }

    fn find(&self, h: &[u8; 32]) -> Option<usize> {
        let tag = tag_of(h);
        let rest = self.rest.as_ref().map(|_| rest_of(h));
        self.range(h).find(|&i| {
            self.tag(i) == Some(tag)
                && match (&self.rest, &rest) {
                    (Some(r), Some(want)) => r.get(i) == Some(want),
                    _ => true,
                }
        })
    }

    /// The candidate location for fingerprint `h`.
    pub fn lookup(&self, h: &[u8; 32]) -> Option<Location> {
        self.find(h).and_then(|i| self.loc(i)).map(Location::unpack)
    }

    /// Records `h` at `loc`, replacing a same-fingerprint entry, an empty one, or a victim.
    pub fn insert(&mut self, h: &[u8; 32], loc: Location) {
        let i = match self.find(h) {
            Some(i) => i,
            None => {
                let r = self.range(h);
                match r.clone().find(|&i| self.tag(i) == Some(0)) {
                    Some(i) => {
                        self.entries += 1;
                        i
                    }
                    // Full bucket: replace a pseudo-random victim (advisory index, bounded memory).
                    None => r.start + (h[16] as usize % BUCKET_ENTRIES),
                }
            }
        };
        self.set(i, tag_of(h), loc.pack());
        if let Some(r) = self.rest.as_mut().and_then(|r| r.get_mut(i)) {
            *r = rest_of(h);
        }
    }

    /// Serialises every entry (tag, location word[, rest of hash]) for saving at close.
    /// `keep` decides per location whether the entry is still valid, and may rewrite its
    /// stamp (reuse stamps restart at zero on the next open).
    pub fn export(&self, keep: impl Fn(Location) -> Option<Location>) -> (u64, Vec<u8>) {
        let per = self.bytes_per_entry() as usize;
        let mut out = Vec::with_capacity(self.entries as usize * per);
        let mut n = 0;
        for i in 0..self.capacity() as usize {
            let (Some(tag), Some(loc)) = (self.tag(i), self.loc(i)) else { continue };
            if tag == 0 {
                continue;
            }
            let Some(l) = keep(Location::unpack(loc)) else { continue };
            out.extend_from_slice(&tag.to_le_bytes());
            out.extend_from_slice(&l.pack().to_le_bytes());
            if let Some(r) = self.rest.as_ref().and_then(|r| r.get(i)) {
                out.extend_from_slice(r);
            }
            n += 1;
        }
        (n, out)
    }

    /// Loads entries written by `export` (same verification mode); returns how many.
    pub fn import(&mut self, bytes: &[u8]) -> u64 {
        let per = self.bytes_per_entry() as usize;
        let mut n = 0;
        for e in bytes.chunks_exact(per) {
            let tag = crate::codec::get_u64(e, 0);
            let loc = crate::codec::get_u64(e, 8);
            if tag == 0 {
                continue;
            }
            let r = self.range_of_tag(tag);
            let Some(i) = r.clone().find(|&i| self.tag(i) == Some(0)) else {
                continue;
            };
            self.set(i, tag, loc);
            if let (Some(rest), Some(src)) = (self.rest.as_mut().and_then(|r| r.get_mut(i)), e.get(16..40)) {
                rest.copy_from_slice(src);
            }
            self.entries += 1;
            n += 1;
        }
        n
    }

    /// Forgets every entry pointing at physical block `pbn`; returns how many. A full scan:
    /// only called when the block's 16-bit reuse stamp wraps, after which a stale entry
    /// could otherwise carry a matching stamp (hash verification).
    pub fn remove_pbn(&mut self, pbn: u64) -> u64 {
        let mut n = 0;
        for i in 0..self.capacity() as usize {
            let (Some(tag), Some(loc)) = (self.tag(i), self.loc(i)) else { continue };
            if tag != 0 && Location::unpack(loc).pbn == pbn {
                self.set(i, 0, 0);
                n += 1;
            }
        }
        self.entries -= n;
        n
    }

    /// Checks the table (the `verify` audit): the entry count matches the occupied slots,
    /// every entry sits in its tag's bucket, and `check` accepts every location.
    #[cfg(any(test, feature = "verify"))]
    pub fn audit(&self, check: impl Fn(Location) -> Result<(), String>) -> Result<(), String> {
        let mut occupied = 0u64;
        for i in 0..self.capacity() as usize {
            let (Some(tag), Some(loc)) = (self.tag(i), self.loc(i)) else {
                return Err(format!("index slot {i} lies outside the table"));
            };
            if tag == 0 {
                continue;
            }
            occupied += 1;
            if !self.range_of_tag(tag).contains(&i) {
                return Err(format!("index entry {tag:#x} in slot {i}, outside its bucket"));
            }
            check(Location::unpack(loc)).map_err(|m| format!("index entry {tag:#x}: {m}"))?;
        }
        if occupied != self.entries {
            return Err(format!("index counts {} entries, {occupied} slots are occupied", self.entries));
        }
        Ok(())
    }

    /// Forgets `h` if it still points at `loc` (after a failed verification).
    pub fn remove(&mut self, h: &[u8; 32], loc: Location) {
        if let Some(i) = self.find(h) {
            if self.loc(i).map(Location::unpack) == Some(loc) {
                self.set(i, 0, 0);
                self.entries -= 1;
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
        let other = Location { pbn: 6, ..loc };
        ix.insert(&h, loc);
        ix.insert(blake3::hash(b"c").as_bytes(), other);
        assert_eq!(ix.remove_pbn(5), 1);
        assert_eq!(ix.lookup(&h), None);
        assert_eq!(ix.lookup(blake3::hash(b"c").as_bytes()), Some(other));
        assert_eq!(ix.len(), 1);
        ix.remove(blake3::hash(b"c").as_bytes(), other);
        for i in 0..100_000u32 {
            ix.insert(blake3::hash(&i.to_le_bytes()).as_bytes(), loc);
        }
        assert!(ix.len() <= ix.capacity());
        let full = Index::new(64 << 10, true);
        assert_eq!(full.bytes_per_entry(), 40);
        // Save and reload into a differently sized table.
        let mut a = Index::new(64 << 10, true);
        let h2 = *blake3::hash(b"b").as_bytes();
        a.insert(&h2, loc);
        let (n, bytes) = a.export(Some);
        assert_eq!(n, 1);
        let mut b = Index::new(1 << 20, true);
        assert_eq!(b.import(&bytes), 1);
        assert_eq!(b.lookup(&h2), Some(loc));
    }
}
