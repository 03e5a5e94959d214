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
/// Records ahead whose buckets `insert_rebuilt` prefetches: enough misses in flight to
/// cover the memory latency, few enough that the prefetched lines are still in L1.
const PREFETCH_AHEAD: usize = 16;
/// Records from which `insert_rebuilt` uses a second thread (below, the thread would cost
/// more than it saves).
const PARALLEL_RECORDS_MIN: usize = 4096;
/// The share of slots the table is sized to fill (buckets of 8 overflow rarely below it).
pub const LOAD_PERCENT: u64 = 90;

/// A record read from the ring by the rebuild: its fingerprint and where it is.
#[derive(Debug, Clone, Copy)]
pub struct RebuiltRecord {
    /// The full fingerprint.
    pub hash: [u8; 32],
    /// Virtual chapter.
    pub vcn: u64,
    /// Page in the chapter.
    pub page: u64,
    /// Position in the page.
    pub position: u64,
}

/// The compact table.
pub struct VolumeIndex {
    /// Populates the arrays in the background; declared first so it is joined first.
    prefault: Vec<crate::io::hugemem::Prefault>,
    /// Per slot: tag << 8 | page (0 = empty).
    words: Vec<u32>,
    /// Per slot: low 16 bits of the virtual chapter.
    chapters: Vec<u16>,
    /// Where slot 0 is in `words` and in `chapters`: each array has one bucket more than
    /// needed, and its buckets start where a bucket never straddles two cache lines (a
    /// 32-byte bucket of words in one 64-byte line, not two: one miss per bucket, not
    /// one and a half).
    words_at: usize,
    chapters_at: usize,
    /// Slots (`buckets * BUCKET_SLOTS`).
    cap: usize,
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

/// The two bucket numbers of `h` in a table of `buckets` buckets: the first anywhere, the
/// second in the same half of the table as the first (so that each half can be filled on
/// its own: `insert_rebuilt`). Keys are scaled onto a range by a multiply and a shift (a
/// division would cost tens of cycles per lookup and per rebuilt record).
fn bucket_pair(buckets: usize, h: &[u8; 32]) -> (usize, usize) {
    let scale = |key: u64, n: usize| ((u128::from(key) * n as u128) >> 64) as usize;
    let a = scale(bucket_key(h, 0), buckets);
    let half = buckets / 2;
    let (start, len) = if a < half { (0, half) } else { (half, buckets - half) };
    (a, start + scale(bucket_key(h, 16), len))
}

/// The slots of a run of buckets, from bucket `first` on, borrowed to change them (the
/// whole table, or one half of it for one of the rebuild's two inserting threads).
struct Slots<'a> {
    words: &'a mut [u32],
    chapters: &'a mut [u16],
    first: usize,
}

impl Slots<'_> {
    /// Where slot `i` of the table is in this run (None: outside it).
    fn local(&self, i: usize) -> Option<usize> {
        i.checked_sub(self.first * BUCKET_SLOTS).filter(|&l| l < self.words.len())
    }

    fn slot(&self, i: usize) -> (u32, u16) {
        self.local(i)
            .map_or((0, 0), |l| (self.words.get(l).copied().unwrap_or(0), self.chapters.get(l).copied().unwrap_or(0)))
    }

    fn set(&mut self, i: usize, word: u32, ch: u16) {
        if let Some(l) = self.local(i) {
            if let (Some(w), Some(c)) = (self.words.get_mut(l), self.chapters.get_mut(l)) {
                *w = word;
                *c = ch;
            }
        }
    }

    /// The words of bucket `b` (all empty for a bucket outside the run, which the
    /// callers never ask for).
    fn bucket_words(&self, b: usize) -> [u32; BUCKET_SLOTS] {
        self.local(b * BUCKET_SLOTS)
            .and_then(|l| self.words.get(l..l + BUCKET_SLOTS))
            .and_then(|s| s.try_into().ok())
            .unwrap_or([0; BUCKET_SLOTS])
    }

    /// Asks the CPU to bring both buckets of `pair` (their words and chapter numbers)
    /// towards the core. A hint: it never faults and changes nothing.
    #[inline]
    fn prefetch(&self, (a, b): (usize, usize)) {
        #[cfg(target_arch = "x86_64")]
        for s in [a * BUCKET_SLOTS, b * BUCKET_SLOTS] {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let l = s.wrapping_sub(self.first * BUCKET_SLOTS);
            let w = self.words.as_ptr().wrapping_add(l).cast::<i8>();
            let c = self.chapters.as_ptr().wrapping_add(l).cast::<i8>();
            // SAFETY: prefetch instructions never fault, whatever the address, and do not
            // change memory; the pointers are only hints (`wrapping_add` keeps them
            // defined even out of range).
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(w);
                _mm_prefetch::<_MM_HINT_T0>(c);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (a, b);
    }

    /// `VolumeIndex::insert` into buckets `pair` of a fingerprint with tag `tag`; true when
    /// it took an empty slot. Each bucket's words are read once, as one array (compared
    /// and counted in vector registers), and the chapter numbers only when a tag matches
    /// or both buckets are full.
    fn place(&mut self, tag: u32, word: u32, vcn: u64, open: u64, (pa, pb): (usize, usize)) -> bool {
        let new_age = age(open, vcn as u16);
        let (wa, wb) = (self.bucket_words(pa), self.bucket_words(pb));
        // One bucket twice (a one-bucket table, or chance) is looked at once.
        let both = [(pa, wa), (pb, wb)];
        let buckets = both.get(..if pa == pb { 1 } else { 2 }).unwrap_or_default();
        for (b, w) in buckets {
            if let Some(k) = w.iter().position(|&x| x >> TAG_SHIFT == tag) {
                // The same fingerprint (or a 24-bit collision): the newer record wins.
                let i = b * BUCKET_SLOTS + k;
                if age(open, self.slot(i).1) >= new_age {
                    self.set(i, word, vcn as u16);
                }
                return false;
            }
        }
        // No slot of its own yet: an empty slot of the emptier bucket.
        let free = |w: &[u32; BUCKET_SLOTS]| w.iter().filter(|&&x| x == 0).count();
        let emptier = buckets.iter().rev().max_by_key(|(_, w)| free(w));
        if let Some((b, k)) = emptier.and_then(|(b, w)| Some((b, w.iter().position(|&x| x == 0)?))) {
            self.set(b * BUCKET_SLOTS + k, word, vcn as u16);
            return true;
        }
        let [ra, rb] = VolumeIndex::ranges((pa, pb));
        let mut victim = None;
        let mut victim_age = 0;
        for i in ra.chain(rb) {
            let a = age(open, self.slot(i).1);
            if victim.is_none() || a > victim_age {
                (victim, victim_age) = (Some(i), a);
            }
        }
        // Both buckets full: the oldest slot goes (dead ones are older than any live one).
        if let Some(i) = victim.filter(|_| victim_age >= new_age) {
            self.set(i, word, vcn as u16);
        }
        false
    }

    /// `insert_rebuilt` of `recs` (whose buckets are all in this run) in a table of
    /// `buckets` buckets, prefetching `PREFETCH_AHEAD` records ahead; returns the slots
    /// newly taken.
    fn insert_all<'r>(
        &mut self,
        buckets: usize,
        recs: impl Iterator<Item = &'r RebuiltRecord>,
        open: u64,
        ring_chapters: u64,
    ) -> u64 {
        let live = |r: &RebuiltRecord| r.vcn <= open && open - r.vcn < ring_chapters;
        let mut ahead: [Option<((usize, usize), &RebuiltRecord)>; PREFETCH_AHEAD] = [None; PREFETCH_AHEAD];
        let (mut recs, mut added, mut i) = (recs.fuse(), 0, 0usize);
        loop {
            // The record prefetched `PREFETCH_AHEAD` rounds ago goes in, then its place in
            // `ahead` takes the next one.
            let at = i % PREFETCH_AHEAD;
            i += 1;
            if let Some((pair, r)) = ahead.get_mut(at).and_then(Option::take).filter(|(_, r)| live(r)) {
                debug_assert!(r.page <= 0xFF && r.position <= u64::from(POSITION_MASK));
                let tag = tag_of(&r.hash);
                added += u64::from(self.place(tag, word_of(tag, r.page, r.position), r.vcn, open, pair));
            }
            match recs.next() {
                Some(r) => {
                    let pair = bucket_pair(buckets, &r.hash);
                    self.prefetch(pair);
                    if let Some(a) = ahead.get_mut(at) {
                        *a = Some((pair, r));
                    }
                }
                None if ahead.iter().all(Option::is_none) => return added,
                None => {}
            }
        }
    }
}

impl VolumeIndex {
    /// A table of at most `memory_bytes`; memory the machine refuses is an error.
    pub fn try_new(memory_bytes: u64, prefault: bool) -> Result<Self> {
        let slots = usize::try_from(memory_bytes / SLOT_BYTES).unwrap_or(usize::MAX);
        // One bucket of each array is the room to align the others.
        let buckets = (slots / BUCKET_SLOTS).saturating_sub(1).max(1);
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
        let words: Vec<u32> = crate::io::hugemem::try_zeroed(cap + BUCKET_SLOTS).ok_or_else(refused)?;
        let chapters: Vec<u16> = crate::io::hugemem::try_zeroed(cap + BUCKET_SLOTS).ok_or_else(refused)?;
        // Elements from the array's start to the first multiple of a bucket's size.
        let skew = |p: usize, elem: usize| (p.next_multiple_of(elem * BUCKET_SLOTS) - p) / elem;
        let (words_at, chapters_at) = (skew(words.as_ptr() as usize, 4), skew(chapters.as_ptr() as usize, 2));
        let mut threads = Vec::new();
        if prefault {
            threads.push(crate::io::hugemem::Prefault::start(&words));
            threads.push(crate::io::hugemem::Prefault::start(&chapters));
        }
        Ok(VolumeIndex {
            prefault: threads,
            words,
            chapters,
            words_at,
            chapters_at,
            cap,
            buckets,
            entries: 0,
            sweep_cursor: 0,
        })
    }

    /// Waits for the background population of the memory.
    pub fn wait_prefault(&mut self) {
        self.prefault.iter_mut().for_each(crate::io::hugemem::Prefault::wait);
    }

    /// Slots.
    pub fn capacity(&self) -> u64 {
        self.cap as u64
    }

    /// Non-empty slots (live, or dead and not swept yet).
    pub fn len(&self) -> u64 {
        self.entries
    }

    /// Memory of the table (its slots and the bucket of room in each array).
    pub fn memory_bytes(&self) -> u64 {
        (self.words.len() as u64) * 4 + (self.chapters.len() as u64) * 2
    }

    /// The two bucket numbers of `h` (see `bucket_pair`).
    fn bucket_pair(&self, h: &[u8; 32]) -> (usize, usize) {
        bucket_pair(self.buckets, h)
    }

    /// The slots of buckets `pair` (the second empty when both are the same).
    fn ranges((a, b): (usize, usize)) -> [std::ops::Range<usize>; 2] {
        let range = |b: usize| b * BUCKET_SLOTS..(b + 1) * BUCKET_SLOTS;
        if a == b {
            [range(a), 0..0]
        } else {
            [range(a), range(b)]
        }
    }

    /// The two buckets of `h` (the same one twice in a one-bucket table).
    fn buckets_of(&self, h: &[u8; 32]) -> [std::ops::Range<usize>; 2] {
        Self::ranges(self.bucket_pair(h))
    }

    /// The slots of both buckets of `h`.
    fn bucket(&self, h: &[u8; 32]) -> impl Iterator<Item = usize> {
        let [a, b] = self.buckets_of(h);
        a.chain(b)
    }

    fn slot(&self, i: usize) -> (u32, u16) {
        (
            self.words.get(self.words_at + i).copied().unwrap_or(0),
            self.chapters.get(self.chapters_at + i).copied().unwrap_or(0),
        )
    }

    fn set(&mut self, i: usize, word: u32, ch: u16) {
        if let (Some(w), Some(c)) = (self.words.get_mut(self.words_at + i), self.chapters.get_mut(self.chapters_at + i))
        {
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
        let pair = self.bucket_pair(h);
        let tag = tag_of(h);
        if self.slots_mut(..).place(tag, word_of(tag, page, position), vcn, open, pair) {
            self.entries += 1;
        }
    }

    /// The slots of the buckets in `range` (the whole table: `..`), to change them.
    fn slots_mut(&mut self, range: impl std::ops::RangeBounds<usize>) -> Slots<'_> {
        use std::ops::Bound;
        let first = match range.start_bound() {
            Bound::Included(&b) => b,
            Bound::Excluded(&b) => b + 1,
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&b) => b + 1,
            Bound::Excluded(&b) => b,
            Bound::Unbounded => self.buckets,
        };
        let (w, c) = (self.words_at + first * BUCKET_SLOTS, self.chapters_at + first * BUCKET_SLOTS);
        let n = end.saturating_sub(first) * BUCKET_SLOTS;
        Slots {
            words: self.words.get_mut(w..w + n).unwrap_or_default(),
            chapters: self.chapters.get_mut(c..c + n).unwrap_or_default(),
            first,
        }
    }

    /// Inserts records read from the ring by the rebuild, as `insert` would one by one,
    /// leaving out those whose chapter is outside the window of `ring_chapters` chapters
    /// before `open`. Each record lands in two random buckets of a table of hundreds of
    /// MB, a cache miss each, so: the buckets of the record `PREFETCH_AHEAD` places ahead
    /// are prefetched (the misses overlap instead of queueing), and a large batch is
    /// inserted by two threads, one per half of the table (a fingerprint's two buckets are
    /// in the same half), which share nothing.
    pub fn insert_rebuilt(&mut self, recs: &[RebuiltRecord], open: u64, ring_chapters: u64) {
        let buckets = self.buckets;
        let half = buckets / 2;
        let upper = |r: &&RebuiltRecord| bucket_pair(buckets, &r.hash).0 >= half;
        if recs.len() < PARALLEL_RECORDS_MIN || half == 0 {
            self.entries += self.slots_mut(..).insert_all(buckets, recs.iter(), open, ring_chapters);
            return;
        }
        let (mut low, mut high) = {
            let Slots { words, chapters, first } = self.slots_mut(..);
            let (w0, w1) = words.split_at_mut((half * BUCKET_SLOTS).min(words.len()));
            let (c0, c1) = chapters.split_at_mut((half * BUCKET_SLOTS).min(chapters.len()));
            (Slots { words: w0, chapters: c0, first }, Slots { words: w1, chapters: c1, first: first + half })
        };
        let mut alone = false;
        let added = std::thread::scope(|sc| {
            let high = &mut high;
            let helper = std::thread::Builder::new()
                .name("dedupvol-index-insert".into())
                .spawn_scoped(sc, move || high.insert_all(buckets, recs.iter().filter(upper), open, ring_chapters));
            let added = low.insert_all(buckets, recs.iter().filter(|r| !upper(r)), open, ring_chapters);
            match helper {
                Ok(h) => added + h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
                Err(_) => {
                    // No thread: this one does the upper half too, once the scope ends.
                    alone = true;
                    added
                }
            }
        });
        let added =
            added + if alone { high.insert_all(buckets, recs.iter().filter(upper), open, ring_chapters) } else { 0 };
        self.entries += added;
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
        let cap = self.cap;
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

    fn rebuilt(i: u64, per_chapter: u64) -> RebuiltRecord {
        let r = i % per_chapter;
        RebuiltRecord { hash: h(i as u32), vcn: i / per_chapter, page: r / 101, position: r % 101 }
    }

    #[test]
    fn batch_insert_matches_one_by_one() {
        // A table small enough that buckets fill and overflow, with repeated fingerprints
        // (the newer record must win) and chapters that left the window.
        let per_chapter = 300;
        let mut recs: Vec<RebuiltRecord> = (0..6000).map(|i| rebuilt(i, per_chapter)).collect();
        recs.extend((0..600).map(|i| RebuiltRecord { vcn: 19, ..rebuilt(i * 7, per_chapter) }));
        let (open, ring) = (20, 16);
        let mut one = VolumeIndex::try_new(6 * 4096, false).expect("table");
        let mut batch = VolumeIndex::try_new(6 * 4096, false).expect("table");
        one.insert(&h(5), 20, 1, 1, 20);
        batch.insert(&h(5), 20, 1, 1, 20);
        for r in &recs {
            if open - r.vcn < ring {
                one.insert(&r.hash, r.vcn, r.page, r.position, open);
            }
        }
        batch.insert_rebuilt(&recs, open, ring);
        // Slot by slot, not the raw arrays: each table starts at its own alignment offset
        // (`words_at`), which depends on where the allocator put it.
        let slots = |t: &VolumeIndex| (0..t.cap).map(|i| t.slot(i)).collect::<Vec<_>>();
        assert!(slots(&one) == slots(&batch) && one.len() == batch.len());
        assert_eq!(batch.candidates(&h(5), open, ring), vec![(20, 1, 1)], "the session's own record stays");
        assert_eq!(batch.candidates(&h(7), open, ring), vec![(19, 0, 7)], "the newer record wins");
        assert!(batch.candidates(&h(1), open, ring).is_empty(), "chapter 0 is outside the window");
        batch.audit().expect("audit");
    }

    /// Time per record of the rebuild's inserts into a table of `DEDUPVOL_MEASURE_ENTRIES`
    /// (default 16.7 M, a 64 GiB window) entries, one by one and in batches.
    #[test]
    #[ignore = "a measurement: allocates and fills a table of about 100 MB twice"]
    fn measure_insert_rate() {
        let n: u64 = std::env::var("DEDUPVOL_MEASURE_ENTRIES").ok().and_then(|v| v.parse().ok()).unwrap_or(16_770_000);
        let per_chapter = 162 * 101;
        let chapters = n.div_ceil(per_chapter) + 1;
        let recs: Vec<RebuiltRecord> = (0..n)
            .map(|i| {
                let mut r = rebuilt(0, per_chapter);
                r.hash = *blake3::hash(&i.to_le_bytes()).as_bytes();
                RebuiltRecord { vcn: i / per_chapter, page: i % per_chapter / 101, position: i % 101, ..r }
            })
            .collect();
        let memory = (n * 100).div_ceil(LOAD_PERCENT) * SLOT_BYTES;
        for batched in [false, true] {
            let mut t = VolumeIndex::try_new(memory, true).expect("table");
            t.wait_prefault();
            let cpu = || {
                // SAFETY: getrusage writes only the struct it is given, zeroed beforehand.
                let mut u: libc::rusage = unsafe { std::mem::zeroed() };
                // SAFETY: as above.
                unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
                let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
                t(u.ru_utime) + t(u.ru_stime)
            };
            let (start, cpu0) = (std::time::Instant::now(), cpu());
            for c in recs.chunks(8192) {
                if batched {
                    t.insert_rebuilt(c, chapters, chapters + 1);
                } else {
                    for r in c {
                        t.insert(&r.hash, r.vcn, r.page, r.position, chapters);
                    }
                }
            }
            let (wall, s) = (start.elapsed().as_secs_f64(), cpu() - cpu0);
            let thp = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
            let thp = thp.lines().find(|l| l.starts_with("AnonHugePages")).unwrap_or("").to_string();
            println!(
                "{}: {} entries in {:.3} s of the process's CPU ({wall:.3} s), {:.1} ns per record = {:.0} MB/s of chapters ({thp})",
                if batched { "batch" } else { "one by one" },
                t.len(),
                s,
                s * 1e9 / n as f64,
                n as f64 / 101.0 * 4096.0 / s / 1e6
            );
        }
    }
}
