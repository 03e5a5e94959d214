//! The volume index: the compact in-memory part of the fingerprint index. It maps a few
//! bits of a fingerprint to the chapter and record page that may hold its record; the
//! record itself (full fingerprint, location) lives in the chapter ring.
//!
//! Layout: `capacity` slots of 6 bytes in buckets of `BUCKET_SLOTS`, as two arrays (a
//! 4-byte word per slot: a 17-bit fingerprint tag, the 7-bit position of the record in
//! its page and the 8-bit page number; a 2-byte chapter number per slot: the low 16 bits
//! of the virtual chapter). A fingerprint has two buckets, from bytes 0..8 and 16..24, and
//! goes to the emptier one (two choices keep buckets of 8 from overflowing at 90% load,
//! where one choice loses about a quarter of the buckets); the tag comes from bytes 8..11,
//! so a false match (a record compared for nothing) needs 17 more equal bits: about one
//! lookup in 8,000 with full buckets. Why the position: a hit then compares one record
//! instead of scanning its page, which is cold in the CPU's caches on most lookups.
//!
//! Invariants:
//! - Memory never exceeds the `memory_bytes` the table was made with.
//! - A slot is empty when its word is 0 (tags are never 0). A slot is live when its
//!   chapter is inside the window, `age < chapters`, where age is the distance from the
//!   open chapter modulo 2^16; a slot outside it is dead and may be reused at any time.
//! - Dead slots are swept before their age can wrap: each chapter opened sweeps
//!   `capacity / SWEEP_CHAPTERS` slots, so every slot is visited once per `SWEEP_CHAPTERS`
//!   chapters, and a ring has at most `RING_CHAPTERS_MAX` chapters, so no dead slot is
//!   older than `RING_CHAPTERS_MAX + SWEEP_CHAPTERS < 2^16` chapters (asserted).
//! - `entries` counts the non-empty slots (the `verify` audit checks it).

use crate::dedup::chapter::RING_CHAPTERS_MAX;
use crate::error::{Error, Result};

/// Slots per bucket.
pub const BUCKET_SLOTS: usize = 8;
/// Bytes of memory per slot.
pub const SLOT_BYTES: u64 = 6;
/// Chapters over which a full sweep of dead slots is spread.
const SWEEP_CHAPTERS: u64 = 16384;
const _: () = assert!(RING_CHAPTERS_MAX + SWEEP_CHAPTERS < 1 << 16);
/// The share of slots the table is sized to fill (buckets of 8 overflow rarely below it).
pub const LOAD_PERCENT: u64 = 90;

/// The compact table.
pub struct VolumeIndex {
    /// Populates the arrays in the background; declared first so it is joined first.
    prefault: Vec<crate::io::hugemem::Prefault>,
    /// Per slot: tag << 8 | page (0 = empty).
    words: Vec<u32>,
    /// Per slot: low 16 bits of the virtual chapter.
    chapters: Vec<u16>,
    buckets: usize,
    entries: u64,
    sweep_cursor: usize,
}

fn bucket_key(h: &[u8; 32], off: usize) -> u64 {
    crate::codec::get_u64(h, off).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29)
}

/// Bits of the fingerprint tag, and where the word keeps it and the record position.
const TAG_BITS: u32 = 17;
const TAG_SHIFT: u32 = 15;
const POSITION_SHIFT: u32 = 8;
const POSITION_MASK: u32 = 0x7F;
const _: () = assert!(TAG_BITS + TAG_SHIFT == 32 && crate::dedup::chapter::RECORDS_PER_PAGE <= 128);

fn tag_of(h: &[u8; 32]) -> u32 {
    let t = crate::codec::get_u32(h, 8) & ((1 << TAG_BITS) - 1);
    t.max(1)
}

/// The word of a slot: tag, record position in its page, page number.
fn word_of(tag: u32, page: u64, position: u64) -> u32 {
    tag << TAG_SHIFT | (position as u32 & POSITION_MASK) << POSITION_SHIFT | (page as u32 & 0xFF)
}

/// Age of chapter number `ch` seen from the open chapter `open`, modulo 2^16.
fn age(open: u64, ch: u16) -> u64 {
    u64::from((open as u16).wrapping_sub(ch))
}

impl VolumeIndex {
    /// A table of at most `memory_bytes`; memory the machine refuses is an error.
    pub fn try_new(memory_bytes: u64, prefault: bool) -> Result<Self> {
        let slots = usize::try_from(memory_bytes / SLOT_BYTES).unwrap_or(usize::MAX);
        let buckets = (slots / BUCKET_SLOTS).max(1);
        let cap = buckets * BUCKET_SLOTS;
        let refused = || {
            Error::OutOfMemory(format!(
                "the fingerprint index needs {memory_bytes} bytes, which this machine cannot allocate; open with a smaller index memory (--index-memory)"
            ))
        };
        if let Some(machine) = crate::io::hugemem::physical_memory_bytes().filter(|&m| memory_bytes > m) {
            // Checked first: with overcommit the allocation may succeed and the process be
            // killed later, on first touch.
            return Err(Error::OutOfMemory(format!(
                "the fingerprint index needs {memory_bytes} bytes but this machine has {machine}; open with a smaller index memory (--index-memory)"
            )));
        }
        let words: Vec<u32> = crate::io::hugemem::try_zeroed(cap).ok_or_else(refused)?;
        let chapters: Vec<u16> = crate::io::hugemem::try_zeroed(cap).ok_or_else(refused)?;
        let mut threads = Vec::new();
        if prefault {
            threads.push(crate::io::hugemem::Prefault::start(&words));
            threads.push(crate::io::hugemem::Prefault::start(&chapters));
        }
        Ok(VolumeIndex { prefault: threads, words, chapters, buckets, entries: 0, sweep_cursor: 0 })
    }

    /// Waits for the background population of the memory.
    pub fn wait_prefault(&mut self) {
        self.prefault.iter_mut().for_each(crate::io::hugemem::Prefault::wait);
    }

    /// Slots.
    pub fn capacity(&self) -> u64 {
        self.words.len() as u64
    }

    /// Non-empty slots (live, or dead and not swept yet).
    pub fn len(&self) -> u64 {
        self.entries
    }

    /// Memory of the table.
    pub fn memory_bytes(&self) -> u64 {
        self.capacity() * SLOT_BYTES
    }

    /// The two buckets of `h` (the same one twice in a one-bucket table).
    fn buckets_of(&self, h: &[u8; 32]) -> [std::ops::Range<usize>; 2] {
        let range = |off| {
            let b = (bucket_key(h, off) % self.buckets as u64) as usize;
            b * BUCKET_SLOTS..(b + 1) * BUCKET_SLOTS
        };
        let (a, b) = (range(0), range(16));
        if a == b {
            [a, 0..0]
        } else {
            [a, b]
        }
    }

    /// The slots of both buckets of `h`.
    fn bucket(&self, h: &[u8; 32]) -> impl Iterator<Item = usize> {
        let [a, b] = self.buckets_of(h);
        a.chain(b)
    }

    /// Empty slots in `r`.
    fn free_in(&self, r: &std::ops::Range<usize>) -> usize {
        r.clone().filter(|&i| self.slot(i).0 == 0).count()
    }

    fn slot(&self, i: usize) -> (u32, u16) {
        (self.words.get(i).copied().unwrap_or(0), self.chapters.get(i).copied().unwrap_or(0))
    }

    fn set(&mut self, i: usize, word: u32, ch: u16) {
        if let (Some(w), Some(c)) = (self.words.get_mut(i), self.chapters.get_mut(i)) {
            *w = word;
            *c = ch;
        }
    }

    /// The (virtual chapter, page, position in the page) of every live slot whose tag
    /// matches `h`, newest first. `open` is the open chapter, `ring_chapters` the window
    /// in chapters.
    pub fn candidates(&self, h: &[u8; 32], open: u64, ring_chapters: u64) -> Vec<(u64, u64, u64)> {
        let tag = tag_of(h);
        let mut out: Vec<(u64, u64, u64)> = self
            .bucket(h)
            .filter_map(|i| {
                let (w, ch) = self.slot(i);
                let a = age(open, ch);
                (w != 0 && w >> TAG_SHIFT == tag && a < ring_chapters && a <= open)
                    .then(|| (open - a, u64::from(w & 0xFF), u64::from(w >> POSITION_SHIFT & POSITION_MASK)))
            })
            .collect();
        if out.len() > 1 {
            out.sort_unstable_by(|x, y| y.cmp(x));
        }
        out
    }

    /// Points `h` at record `position` of page `page` of chapter `vcn` (the open chapter
    /// `open`, or one being rebuilt): replaces a slot with the same tag, else takes an
    /// empty or dead slot, else the oldest.
    pub fn insert(&mut self, h: &[u8; 32], vcn: u64, page: u64, position: u64, open: u64) {
        debug_assert!(page <= 0xFF && position <= u64::from(POSITION_MASK) && vcn <= open);
        let tag = tag_of(h);
        let word = word_of(tag, page, position);
        let mut victim = None;
        let mut victim_age = 0;
        for i in self.bucket(h) {
            let (w, ch) = self.slot(i);
            if w != 0 && w >> TAG_SHIFT == tag {
                // The same fingerprint (or a 24-bit collision): the newer record wins.
                if age(open, ch) >= age(open, vcn as u16) {
                    self.set(i, word, vcn as u16);
                }
                return;
            }
        }
        // No slot of its own yet: an empty slot of the emptier bucket.
        let [a, b] = self.buckets_of(h);
        let emptier = if self.free_in(&b) > self.free_in(&a) { b } else { a };
        if let Some(i) = emptier.clone().find(|&i| self.slot(i).0 == 0) {
            self.entries += 1;
            self.set(i, word, vcn as u16);
            return;
        }
        for i in self.bucket(h) {
            let a = age(open, self.slot(i).1);
            if victim.is_none() || a > victim_age {
                (victim, victim_age) = (Some(i), a);
            }
        }
        // A full bucket: the oldest slot goes (dead ones are older than any live one).
        if let Some(i) = victim.filter(|_| victim_age >= age(open, vcn as u16)) {
            self.set(i, word, vcn as u16);
        }
    }

    /// Forgets `h` if it points at page `page` of chapter `vcn`.
    pub fn remove(&mut self, h: &[u8; 32], vcn: u64, page: u64) {
        let tag = tag_of(h);
        let found = self.bucket(h).find(|&i| {
            let (w, ch) = self.slot(i);
            w != 0 && w >> TAG_SHIFT == tag && u64::from(w & 0xFF) == page && ch == vcn as u16
        });
        if let Some(i) = found {
            self.set(i, 0, 0);
            self.entries -= 1;
        }
    }

    /// Empties the dead slots among the next `capacity / SWEEP_CHAPTERS` (called once per
    /// chapter opened; see the invariants).
    pub fn sweep(&mut self, open: u64, ring_chapters: u64) {
        let cap = self.words.len();
        if cap == 0 {
            return;
        }
        let n = (cap as u64).div_ceil(SWEEP_CHAPTERS) as usize;
        for _ in 0..n.min(cap) {
            let i = self.sweep_cursor;
            self.sweep_cursor = (i + 1) % cap;
            let (w, ch) = self.slot(i);
            if w != 0 && age(open, ch) >= ring_chapters {
                self.set(i, 0, 0);
                self.entries -= 1;
            }
        }
    }

    /// Checks that `entries` counts the non-empty slots (the `verify` audit).
    #[cfg(any(test, feature = "verify"))]
    pub fn audit(&self) -> std::result::Result<(), String> {
        let occupied = self.words.iter().filter(|&&w| w != 0).count() as u64;
        if occupied != self.entries {
            return Err(format!("volume index counts {} entries, {occupied} slots are occupied", self.entries));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u32) -> [u8; 32] {
        *blake3::hash(&i.to_le_bytes()).as_bytes()
    }

    #[test]
    fn finds_newest_and_drops_expired_chapters() {
        let mut t = VolumeIndex::try_new(6 << 10, false).expect("table");
        assert_eq!(t.memory_bytes(), 6 << 10);
        t.insert(&h(1), 3, 7, 100, 3);
        assert_eq!(t.candidates(&h(1), 3, 4), vec![(3, 7, 100)]);
        t.insert(&h(1), 5, 2, 9, 5);
        assert_eq!(t.candidates(&h(1), 5, 4), vec![(5, 2, 9)], "the newer record replaces the older");
        assert_eq!(t.candidates(&h(1), 9, 4), vec![], "chapter 5 left the 4-chapter window at 9");
        assert_eq!(t.candidates(&h(2), 5, 4), vec![]);
        t.remove(&h(1), 5, 2);
        assert_eq!(t.len(), 0);
        for i in 0..10_000 {
            t.insert(&h(i), u64::from(i / 100), 0, u64::from(i % 100), u64::from(i / 100));
            t.sweep(u64::from(i / 100), 4);
        }
        assert!(t.len() <= t.capacity());
        t.audit().expect("audit");
    }
}
