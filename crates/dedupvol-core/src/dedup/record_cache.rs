//! The record cache: chapter record pages kept in memory, so most lookups that the volume
//! index answers need no device read.
//!
//! Two shapes, one per index mode:
//! - dense: single pages, keyed by (virtual chapter, page), evicted by CLOCK (a page hit
//!   since the hand last passed gets a second chance), so pages of the recent chapters
//!   (which enter as their chapter closes) and of hot ones stay;
//! - sparse: whole chapters, loaded when a sampled fingerprint ("hook") leads to one, with
//!   a map from every record's fingerprint prefix to its place, so the neighbours of a
//!   hook, written together with it, are found without further reads.
//!
//! Invariants:
//! - Bounded: at most `pages_max` pages (dense) or `chapters_max` chapters (sparse).
//! - Pages are immutable once cached (`Arc`); a record's `current` flag was decided when
//!   its page was decoded, so the cache is emptied whenever the epoch changes.
//! - Every sparse map entry names a cached chapter (removed with it).

use crate::dedup::chapter::Record;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Records of one page (dense) or chapter (sparse).
pub type Records = Arc<Vec<Record>>;

/// Prefix of a fingerprint used as a hash-map key (the full fingerprint is compared on a hit).
pub fn prefix(h: &[u8; 32]) -> u64 {
    crate::codec::get_u64(h, 0)
}

/// Dense: a CLOCK cache of record pages.
pub struct PageCache {
    pages: HashMap<(u64, u64), (Records, bool)>,
    clock: VecDeque<(u64, u64)>,
    pages_max: usize,
    records: usize,
    generation: u64,
}

impl PageCache {
    /// A cache of at most `pages_max` pages.
    pub fn new(pages_max: usize) -> Self {
        PageCache {
            pages: HashMap::new(),
            clock: VecDeque::new(),
            pages_max: pages_max.max(1),
            records: 0,
            generation: 0,
        }
    }

    /// Times the cache was emptied.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Adds a page read for a request made at `generation`, unless the cache was emptied
    /// since.
    pub fn put_at(&mut self, generation: u64, vcn: u64, page: u64, records: Records) {
        if generation == self.generation {
            self.put(vcn, page, records);
        }
    }

    /// Records held (each `size_of::<Record>()` bytes in memory).
    pub fn records(&self) -> usize {
        self.records
    }

    /// The page, marking it referenced.
    pub fn get(&mut self, vcn: u64, page: u64) -> Option<Records> {
        self.pages.get_mut(&(vcn, page)).map(|(r, referenced)| {
            *referenced = true;
            r.clone()
        })
    }

    /// True when the page is cached (not marked referenced).
    pub fn has(&self, vcn: u64, page: u64) -> bool {
        self.pages.contains_key(&(vcn, page))
    }

    /// Adds a page, evicting by CLOCK when full.
    pub fn put(&mut self, vcn: u64, page: u64, records: Records) {
        if let Some(e) = self.pages.get_mut(&(vcn, page)) {
            self.records = self.records + records.len() - e.0.len();
            e.0 = records;
            return;
        }
        // Each referenced page passed costs one step; bounded by twice the cache.
        let mut steps = 2 * self.clock.len();
        while self.pages.len() >= self.pages_max && steps > 0 {
            steps -= 1;
            let Some(key) = self.clock.pop_front() else { break };
            match self.pages.get_mut(&key) {
                Some((_, referenced)) if *referenced => {
                    *referenced = false;
                    self.clock.push_back(key);
                }
                _ => {
                    if let Some((r, _)) = self.pages.remove(&key) {
                        self.records -= r.len();
                    }
                }
            }
        }
        self.records += records.len();
        self.pages.insert((vcn, page), (records, false));
        self.clock.push_back((vcn, page));
        debug_assert!(self.pages.len() <= self.pages_max && self.clock.len() == self.pages.len());
    }

    /// Pages held.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.pages.clear();
        self.clock.clear();
        self.records = 0;
        self.generation += 1;
    }
}

/// Sparse: whole chapters, FIFO, with a fingerprint-prefix map over their records.
pub struct ChapterCache {
    chapters: HashMap<u64, Records>,
    order: VecDeque<u64>,
    by_prefix: HashMap<u64, (u64, u32)>,
    chapters_max: usize,
    records: usize,
    generation: u64,
}

impl ChapterCache {
    /// A cache of at most `chapters_max` chapters.
    pub fn new(chapters_max: usize) -> Self {
        ChapterCache {
            chapters: HashMap::new(),
            order: VecDeque::new(),
            by_prefix: HashMap::new(),
            chapters_max: chapters_max.max(1),
            records: 0,
            generation: 0,
        }
    }

    /// Times the cache was emptied.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Adds a chapter read for a request made at `generation`, unless the cache was
    /// emptied since.
    pub fn put_at(&mut self, generation: u64, vcn: u64, records: Records) {
        if generation == self.generation {
            self.put(vcn, records);
        }
    }

    /// True when chapter `vcn` is cached.
    pub fn has(&self, vcn: u64) -> bool {
        self.chapters.contains_key(&vcn)
    }

    /// The record for `h` among the cached chapters, with its chapter and whether it lies
    /// in the chapter's last page.
    pub fn find(&self, h: &[u8; 32]) -> Option<(u64, Record, bool)> {
        let (vcn, i) = self.by_prefix.get(&prefix(h))?;
        let recs = self.chapters.get(vcn)?;
        let r = recs.get(*i as usize)?;
        let near_end = *i as usize + crate::dedup::chapter::RECORDS_PER_PAGE >= recs.len();
        (r.hash == *h).then_some((*vcn, *r, near_end))
    }

    /// Adds chapter `vcn`, evicting the oldest added when full.
    pub fn put(&mut self, vcn: u64, records: Records) {
        if self.chapters.contains_key(&vcn) {
            return;
        }
        while self.chapters.len() >= self.chapters_max {
            let Some(old) = self.order.pop_front() else { break };
            if let Some(recs) = self.chapters.remove(&old) {
                self.records -= recs.len();
                for r in recs.iter() {
                    let p = prefix(&r.hash);
                    if self.by_prefix.get(&p).is_some_and(|(v, _)| *v == old) {
                        self.by_prefix.remove(&p);
                    }
                }
            }
        }
        for (i, r) in records.iter().enumerate() {
            self.by_prefix.insert(prefix(&r.hash), (vcn, i as u32));
        }
        self.records += records.len();
        self.chapters.insert(vcn, records);
        self.order.push_back(vcn);
        debug_assert!(self.chapters.len() <= self.chapters_max);
    }

    /// Forgets `h` (its record failed verification).
    pub fn forget(&mut self, h: &[u8; 32]) {
        if self.find(h).is_some() {
            self.by_prefix.remove(&prefix(h));
        }
    }

    /// Records held.
    pub fn records(&self) -> usize {
        self.records
    }

    /// Memory held beyond the records themselves: the fingerprint-prefix map.
    pub fn map_bytes(&self) -> usize {
        self.by_prefix.capacity() * (std::mem::size_of::<(u64, (u64, u32))>() + 1)
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.chapters.clear();
        self.order.clear();
        self.by_prefix.clear();
        self.records = 0;
        self.generation += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dedup::index::Location;

    fn rec(i: u64) -> Record {
        Record {
            hash: *blake3::hash(&i.to_le_bytes()).as_bytes(),
            loc: Location { pbn: i, state: 2, frag: crate::metadata::block_map::Frag::ZERO, stamp: 0, current: false },
        }
    }

    #[test]
    fn caches_stay_bounded_and_keep_referenced_pages() {
        let mut c = PageCache::new(2);
        c.put(1, 0, Arc::new(vec![rec(1)]));
        c.put(2, 0, Arc::new(vec![rec(2)]));
        assert!(c.get(1, 0).is_some());
        c.put(3, 0, Arc::new(vec![rec(3)]));
        assert_eq!(c.len(), 2);
        assert!(c.get(1, 0).is_some(), "the referenced page got a second chance");
        assert!(c.get(2, 0).is_none());

        let mut s = ChapterCache::new(1);
        s.put(5, Arc::new(vec![rec(1), rec(2)]));
        assert_eq!(s.find(&rec(2).hash).map(|(v, r, _)| (v, r.loc.pbn)), Some((5, 2)));
        s.put(6, Arc::new(vec![rec(3)]));
        assert_eq!(s.find(&rec(2).hash), None);
        assert_eq!(s.records(), 1);
    }
}
