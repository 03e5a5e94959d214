//! The volume index: the compact in-memory part of the fingerprint index. It maps a few
//! bits of a fingerprint to the chapter and record page that may hold its record; the
//! record itself (full fingerprint, location) lives in the chapter ring.
//!
//! Layout: `capacity` slots of 5 bytes in buckets of `BUCKET_SLOTS`, as two arrays (a
//! 4-byte word per slot: a 13-bit fingerprint tag, the 3-bit group of the record in its
//! page and the low 16 bits of the virtual chapter; a 1-byte page number per slot). A
//! fingerprint has two buckets, from bytes 0..4 and 16..20, and goes to the emptier one
//! (two choices keep buckets of 8 from overflowing at 90% load, where one choice loses
//! about a quarter of the buckets); the tag comes from bytes 8..10, so a false match (up
//! to `GROUP_RECORDS` records compared for nothing, one page read if the page is not
//! cached) needs 13 more equal bits: about one absent lookup in 570 with 90% full
//! buckets (14.4 slots of 2^13 tags). Why the group: a hit then compares at most `GROUP_RECORDS` neighbouring
//! records (a few cache lines) instead of scanning its page, which is cold in the CPU's
//! caches on most lookups. Why the chapter sits in the word: inserting and sweeping
//! decide on tags and ages, so they read one array; the page byte is read only for a
//! tag that matches.
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

use crate::dedup::chapter::{Name, RING_CHAPTERS_MAX};
use crate::error::{Error, Result};
use crate::io::aligned::AlignedBuf;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Slots per bucket.
pub const BUCKET_SLOTS: usize = 8;
/// Bytes of memory per slot.
pub const SLOT_BYTES: u64 = 5;
/// Records of a page per group (the part of a page a slot names).
pub const GROUP_RECORDS: usize = 12;
/// Chapters over which a full sweep of dead slots is spread.
const SWEEP_CHAPTERS: u64 = 16384;
const _: () = assert!(RING_CHAPTERS_MAX + SWEEP_CHAPTERS < 1 << 16);
/// Records ahead whose buckets `insert_prepared` prefetches: enough misses in flight to
/// cover the memory latency, few enough that the prefetched lines are still in L1.
const PREFETCH_AHEAD: usize = 16;
/// Records from which `insert_prepared` uses a second thread (below, the thread would cost
/// more than it saves).
const PARALLEL_RECORDS_MIN: usize = 4096;
/// Buckets of a table at most (a bucket key has 32 bits: `bucket_pair`); 170 GB of slots.
const BUCKETS_MAX: u64 = 1 << 32;
/// The share of slots the table is sized to fill (buckets of 8 overflow rarely below it).
pub const LOAD_PERCENT: u64 = 90;

/// A record read from the ring by the rebuild, made ready to insert by the decoder while
/// it holds no lock (`PreparedRun::push`): its two buckets, its word and its page. 24
/// bytes where the record is 56, and its fingerprint hashed once: the inserting threads
/// only read these, in order, and touch the table.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct Prepared {
    a: u64,
    b: u64,
    word: u32,
    page: u32,
}

impl Prepared {
    fn pair(&self) -> (usize, usize) {
        (self.a as usize, self.b as usize)
    }
}

/// The records of one half of a `PreparedRun`, in a buffer mapped on its own: the lists
/// are large and short-lived, and heap memory freed by a thread of the rebuild would stay
/// resident in its arena (`AlignedBuf`).
#[derive(Default)]
struct Half {
    buf: Option<AlignedBuf>,
    len: usize,
}

impl Half {
    /// Records the buffer holds at most.
    fn capacity(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.as_slice().len() / std::mem::size_of::<Prepared>())
    }

    /// Every slot of the buffer, typed.
    fn slots(&self) -> &[Prepared] {
        let bytes = self.buf.as_ref().map_or(&[][..], AlignedBuf::as_slice);
        let n = bytes.len() / std::mem::size_of::<Prepared>();
        <[Prepared]>::ref_from_prefix_with_elems(bytes, n).map_or(&[][..], |(s, _)| s)
    }

    /// The records held.
    fn records(&self) -> &[Prepared] {
        self.slots().get(..self.len).unwrap_or_default()
    }

    /// Appends `p`; false when the buffer is full.
    fn push(&mut self, p: Prepared) -> bool {
        let Some(bytes) = self.buf.as_mut().map(AlignedBuf::as_mut_slice) else { return false };
        let n = bytes.len() / std::mem::size_of::<Prepared>();
        let Ok((slots, _)) = <[Prepared]>::mut_from_prefix_with_elems(bytes, n) else { return false };
        let Some(slot) = slots.get_mut(self.len) else { return false };
        *slot = p;
        self.len += 1;
        true
    }
}

/// Records prepared for a table of `buckets` buckets, apart by the half of the table
/// their buckets are in (a fingerprint's two buckets are in the same half), so that each
/// half is inserted by its own thread from a list of its own.
#[derive(Default)]
pub struct PreparedRun {
    buckets: usize,
    halves: [Half; 2],
    /// The lowest and highest chapter pushed since the last `clear`.
    chapters: Option<(u64, u64)>,
}

impl PreparedRun {
    /// Empties the run for a table of `buckets` buckets (`VolumeIndex::bucket_count`),
    /// with room for `records` records (either half may get them all); keeps its memory
    /// when it is large enough. False when the memory cannot be had.
    pub fn clear(&mut self, buckets: usize, records: usize) -> bool {
        self.buckets = buckets;
        self.chapters = None;
        let bytes = records.max(1).saturating_mul(std::mem::size_of::<Prepared>());
        self.halves.iter_mut().all(|h| {
            h.len = 0;
            if h.capacity() < records {
                h.buf = AlignedBuf::new(bytes);
            }
            h.capacity() >= records
        })
    }

    /// The table size the records were prepared for, and the lowest and highest chapter
    /// among them (what `VolumeIndex::insert_prepared` checks).
    pub fn chapters(&self) -> (usize, Option<(u64, u64)>) {
        (self.buckets, self.chapters)
    }

    /// Records held.
    pub fn len(&self) -> usize {
        self.halves.iter().map(|h| h.len).sum()
    }

    /// Adds the record of name `n` (read from a name page, or made from a record's
    /// fingerprint) at `position` of page `page` of chapter `vcn`; false when its half is
    /// full (more records than `clear` made room for).
    pub fn push(&mut self, n: &Name, vcn: u64, page: u64, position: u64) -> bool {
        debug_assert!(page <= 0xFF && (position as usize) < crate::dedup::chapter::RECORDS_PER_PAGE);
        let (a, b) = bucket_pair(self.buckets, n);
        let upper = usize::from(a >= self.buckets / 2);
        let word = word_of(tag_of(n), position, vcn);
        let prepared = Prepared { a: a as u64, b: b as u64, word, page: u32::from(page as u8) };
        if !self.halves.get_mut(upper).is_some_and(|half| half.push(prepared)) {
            return false;
        }
        let (lo, hi) = self.chapters.unwrap_or((vcn, vcn));
        self.chapters = Some((lo.min(vcn), hi.max(vcn)));
        true
    }

    /// Each half's records in `[from, to)` of the run, as fractions of each half's length
    /// (`parts` equal parts, part `k`): the batches the rebuild inserts per hold of the
    /// table's lock.
    pub fn part(&self, k: usize, parts: usize) -> [&[Prepared]; 2] {
        self.halves.each_ref().map(|h| {
            let at = |k: usize| h.len * k / parts.max(1);
            h.records().get(at(k)..at(k + 1)).unwrap_or_default()
        })
    }
}

/// A slot matching a fingerprint (`VolumeIndex::candidates`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// Virtual chapter.
    pub vcn: u64,
    /// Page in the chapter.
    pub page: u64,
    /// Positions in the page where the record may be.
    pub positions: std::ops::Range<usize>,
}

/// The compact table.
pub struct VolumeIndex {
    /// Populates the arrays in the background; declared first so it is joined first.
    prefault: Vec<crate::io::hugemem::Prefault>,
    /// Per slot: tag, group and chapter (`word_of`; 0 = empty).
    words: Vec<u32>,
    /// Per slot: the record's page in its chapter.
    pages: Vec<u8>,
    /// Where slot 0 is in `words` and in `pages`: each array has one bucket more than
    /// needed, and its buckets start where a bucket never straddles two cache lines (a
    /// 32-byte bucket of words in one 64-byte line, not two: one miss per bucket, not
    /// one and a half).
    words_at: usize,
    pages_at: usize,
    /// Slots (`buckets * BUCKET_SLOTS`).
    cap: usize,
    buckets: usize,
    entries: u64,
    sweep_cursor: usize,
}

/// Bits of the fingerprint tag, and where the word keeps it and the record's group (the
/// chapter number is the word's low 16 bits).
const TAG_BITS: u32 = 13;
const TAG_SHIFT: u32 = 19;
const GROUP_SHIFT: u32 = 16;
const GROUP_MASK: u32 = 0x7;
const _: () = assert!(
    TAG_BITS + TAG_SHIFT == 32
        && GROUP_SHIFT + 3 == TAG_SHIFT
        && crate::dedup::chapter::RECORDS_PER_PAGE.div_ceil(GROUP_RECORDS) <= GROUP_MASK as usize + 1
);

fn tag_of(n: &Name) -> u32 {
    let t = n.tag_bits() & ((1 << TAG_BITS) - 1);
    t.max(1)
}

/// The word of a slot: tag, group of the record's position in its page, chapter.
fn word_of(tag: u32, position: u64, vcn: u64) -> u32 {
    let group = (position / GROUP_RECORDS as u64) as u32 & GROUP_MASK;
    tag << TAG_SHIFT | group << GROUP_SHIFT | u32::from(vcn as u16)
}

/// The chapter number (low 16 bits) of a word.
fn chapter_of(w: u32) -> u16 {
    w as u16
}

/// The positions in its page that a word's group covers.
fn group_of(w: u32) -> std::ops::Range<usize> {
    let first = (w >> GROUP_SHIFT & GROUP_MASK) as usize * GROUP_RECORDS;
    first..(first + GROUP_RECORDS).min(crate::dedup::chapter::RECORDS_PER_PAGE)
}

/// Age of chapter number `ch` seen from the open chapter `open`, modulo 2^16.
fn age(open: u64, ch: u16) -> u64 {
    u64::from((open as u16).wrapping_sub(ch))
}

/// The two bucket numbers of name `n` in a table of `buckets` buckets (at most
/// `BUCKETS_MAX`): the first anywhere, chosen by its first key, the second by its second
/// key in the same half of the table as the first (so that each half can be filled on its
/// own: `insert_prepared`). A key is scaled onto a range by a multiply and a shift (a
/// division would cost tens of cycles per lookup and per rebuilt record); fingerprint
/// bits are uniform, so 32 of them spread evenly over up to 2^32 buckets.
fn bucket_pair(buckets: usize, n: &Name) -> (usize, usize) {
    debug_assert!(buckets as u64 <= BUCKETS_MAX);
    let scale = |key: u32, n: usize| ((u64::from(key) * n as u64) >> 32) as usize;
    let a = scale(n.a, buckets);
    let half = buckets / 2;
    let (start, len) = if a < half { (0, half) } else { (half, buckets - half) };
    (a, start + scale(n.b, len))
}

/// The slots of a run of buckets, from bucket `first` on, borrowed to change them (the
/// whole table, or one half of it for one of the rebuild's two inserting threads).
struct Slots<'a> {
    words: &'a mut [u32],
    pages: &'a mut [u8],
    first: usize,
}

impl Slots<'_> {
    /// Where slot `i` of the table is in this run (None: outside it).
    fn local(&self, i: usize) -> Option<usize> {
        i.checked_sub(self.first * BUCKET_SLOTS).filter(|&l| l < self.words.len())
    }

    fn set(&mut self, i: usize, word: u32, page: u8) {
        if let Some(l) = self.local(i) {
            if let (Some(w), Some(p)) = (self.words.get_mut(l), self.pages.get_mut(l)) {
                *w = word;
                *p = page;
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

    /// Asks the CPU to bring both buckets of `pair` (their words, and their page bytes,
    /// which a taken slot writes) towards the core. A hint: it never faults and changes
    /// nothing.
    #[inline]
    fn prefetch(&self, (a, b): (usize, usize)) {
        #[cfg(target_arch = "x86_64")]
        for s in [a * BUCKET_SLOTS, b * BUCKET_SLOTS] {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let l = s.wrapping_sub(self.first * BUCKET_SLOTS);
            let w = self.words.as_ptr().wrapping_add(l).cast::<i8>();
            let p = self.pages.as_ptr().wrapping_add(l).cast::<i8>();
            // SAFETY: prefetch instructions never fault, whatever the address, and do not
            // change memory; the pointers are only hints (`wrapping_add` keeps them
            // defined even out of range).
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(w);
                _mm_prefetch::<_MM_HINT_T0>(p);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (a, b);
    }

    /// `VolumeIndex::insert` into buckets `pair` of a fingerprint with tag `tag`; true when
    /// it took an empty slot. Each bucket's words are read once, as one array (compared
    /// and counted in vector registers).
    fn place(
        &mut self,
        tag: u32,
        word: u32,
        page: u8,
        (open, ring_chapters): (u64, u64),
        pair: (usize, usize),
    ) -> bool {
        let (pa, pb) = pair;
        let new_age = age(open, chapter_of(word));
        let (wa, wb) = (self.bucket_words(pa), self.bucket_words(pb));
        // One bucket twice (a one-bucket table, or chance) is looked at once.
        let both = [(pa, wa), (pb, wb)];
        let buckets = both.get(..if pa == pb { 1 } else { 2 }).unwrap_or_default();
        // An empty slot of the emptier bucket, even when a slot has the same tag: with 13
        // bits that is as likely another fingerprint (a collision, whose entry must not be
        // lost) as an older record of this one (which then lingers, harmless: lookups try
        // the newest candidate first, and it dies with its chapter).
        let free = |w: &[u32; BUCKET_SLOTS]| w.iter().filter(|&&x| x == 0).count();
        let emptier = buckets.iter().rev().max_by_key(|(_, w)| free(w));
        if let Some((b, k)) = emptier.and_then(|(b, w)| Some((b, w.iter().position(|&x| x == 0)?))) {
            self.set(b * BUCKET_SLOTS + k, word, page);
            return true;
        }
        // Both buckets full: the oldest slot (the first of equals), from the words already
        // read; a dead one (its chapter left the window, not swept yet) goes first.
        let oldest = buckets
            .iter()
            .flat_map(|(b, w)| {
                w.iter().enumerate().map(move |(k, &x)| (b * BUCKET_SLOTS + k, age(open, chapter_of(x))))
            })
            .min_by_key(|&(_, a)| std::cmp::Reverse(a));
        if let Some((i, _)) = oldest.filter(|&(_, a)| a >= ring_chapters) {
            self.set(i, word, page);
            return false;
        }
        // Then a slot with the same tag yields to the newer record.
        for (b, w) in buckets {
            if let Some((k, &x)) = w.iter().enumerate().find(|(_, &x)| x >> TAG_SHIFT == tag) {
                if age(open, chapter_of(x)) >= new_age {
                    self.set(b * BUCKET_SLOTS + k, word, page);
                }
                return false;
            }
        }
        // Else the oldest live slot, if older than the new record.
        if let Some((i, _)) = oldest.filter(|&(_, a)| a >= new_age) {
            self.set(i, word, page);
        }
        false
    }

    /// Inserts `recs` (whose buckets are all in this run), prefetching `PREFETCH_AHEAD`
    /// records ahead and leaving out those whose chapter is outside the window; returns
    /// the slots newly taken. The words hold chapters modulo 2^16: the caller makes sure
    /// every record is less than 2^16 chapters behind `open` (`insert_prepared`).
    fn insert_all(&mut self, recs: &[Prepared], open: u64, ring_chapters: u64) -> u64 {
        let mut added = 0;
        for (i, r) in recs.iter().enumerate() {
            if let Some(ahead) = recs.get(i + PREFETCH_AHEAD) {
                self.prefetch(ahead.pair());
            }
            if age(open, chapter_of(r.word)) < ring_chapters {
                let (word, page) = (r.word, r.page as u8);
                added += u64::from(self.place(word >> TAG_SHIFT, word, page, (open, ring_chapters), r.pair()));
            }
        }
        added
    }
}

impl VolumeIndex {
    /// A table of at most `memory_bytes`; memory the machine refuses is an error.
    pub fn try_new(memory_bytes: u64, prefault: bool) -> Result<Self> {
        let slots = usize::try_from(memory_bytes / SLOT_BYTES).unwrap_or(usize::MAX);
        // One bucket of each array is the room to align the others.
        let buckets = (slots / BUCKET_SLOTS).saturating_sub(1).clamp(1, BUCKETS_MAX as usize);
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
        let pages: Vec<u8> = crate::io::hugemem::try_zeroed(cap + BUCKET_SLOTS).ok_or_else(refused)?;
        // Elements from the array's start to the first multiple of a bucket's size.
        let skew = |p: usize, elem: usize| (p.next_multiple_of(elem * BUCKET_SLOTS) - p) / elem;
        let (words_at, pages_at) = (skew(words.as_ptr() as usize, 4), skew(pages.as_ptr() as usize, 1));
        let mut threads = Vec::new();
        if prefault {
            threads.push(crate::io::hugemem::Prefault::start(&words));
            threads.push(crate::io::hugemem::Prefault::start(&pages));
        }
        Ok(VolumeIndex {
            prefault: threads,
            words,
            pages,
            words_at,
            pages_at,
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
        (self.words.len() as u64) * 4 + self.pages.len() as u64
    }

    /// The two bucket numbers of name `n` (see `bucket_pair`).
    fn bucket_pair(&self, n: &Name) -> (usize, usize) {
        bucket_pair(self.buckets, n)
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

    /// The two buckets of name `n` (the same one twice in a one-bucket table).
    fn buckets_of(&self, n: &Name) -> [std::ops::Range<usize>; 2] {
        Self::ranges(self.bucket_pair(n))
    }

    /// The slots of both buckets of name `n`.
    fn bucket(&self, n: &Name) -> impl Iterator<Item = usize> {
        let [a, b] = self.buckets_of(n);
        a.chain(b)
    }

    fn word(&self, i: usize) -> u32 {
        self.words.get(self.words_at + i).copied().unwrap_or(0)
    }

    fn page(&self, i: usize) -> u8 {
        self.pages.get(self.pages_at + i).copied().unwrap_or(0)
    }

    fn clear(&mut self, i: usize) {
        if let Some(w) = self.words.get_mut(self.words_at + i) {
            *w = 0;
        }
    }

    /// Every live slot whose tag matches `h`, newest first: its virtual chapter, page,
    /// and the positions in the page where the record may be (a group of at most
    /// `GROUP_RECORDS`). `open` is the open chapter, `ring_chapters` the window in
    /// chapters.
    pub fn candidates(&self, h: &[u8; 32], open: u64, ring_chapters: u64) -> Vec<Candidate> {
        let name = Name::of(h);
        let tag = tag_of(&name);
        let mut out: Vec<Candidate> = self
            .bucket(&name)
            .filter_map(|i| {
                let w = self.word(i);
                let a = age(open, chapter_of(w));
                (w != 0 && w >> TAG_SHIFT == tag && a < ring_chapters && a <= open).then(|| Candidate {
                    vcn: open - a,
                    page: u64::from(self.page(i)),
                    positions: group_of(w),
                })
            })
            .collect();
        if out.len() > 1 {
            out.sort_unstable_by_key(|c| std::cmp::Reverse((c.vcn, c.page, c.positions.start)));
        }
        out
    }

    /// Points `h` at record `position` of page `page` of chapter `vcn` (the open chapter
    /// `open`, or one being rebuilt): takes an empty slot, else one with the same tag,
    /// else the oldest (dead ones first).
    pub fn insert(&mut self, h: &[u8; 32], (vcn, page, position): (u64, u64, u64), open: u64, ring_chapters: u64) {
        debug_assert!(page <= 0xFF && (position as usize) < crate::dedup::chapter::RECORDS_PER_PAGE && vcn <= open);
        let name = Name::of(h);
        let pair = self.bucket_pair(&name);
        let tag = tag_of(&name);
        if self.slots_mut(..).place(tag, word_of(tag, position, vcn), page as u8, (open, ring_chapters), pair) {
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
        let (w, p) = (self.words_at + first * BUCKET_SLOTS, self.pages_at + first * BUCKET_SLOTS);
        let n = end.saturating_sub(first) * BUCKET_SLOTS;
        Slots {
            words: self.words.get_mut(w..w + n).unwrap_or_default(),
            pages: self.pages.get_mut(p..p + n).unwrap_or_default(),
            first,
        }
    }

    /// Buckets of the table (what `PreparedRun::new` needs).
    pub fn bucket_count(&self) -> usize {
        self.buckets
    }

    /// Inserts records read from the ring by the rebuild (the halves of part of a
    /// `PreparedRun`, whose chapters span `chapters`), as `insert` would one by one,
    /// leaving out those whose chapter is outside the window of `ring_chapters` chapters
    /// before `open`. Each record lands in two random buckets of a table of hundreds of
    /// MB, a cache miss each, so: the buckets of the record `PREFETCH_AHEAD` places ahead
    /// are prefetched (the misses overlap instead of queueing), and a large batch is
    /// inserted by two threads, one per half of the table, which share nothing. Records
    /// prepared for a table of another size are not inserted (dedup lost, nothing else).
    pub fn insert_prepared(
        &mut self,
        [low, high]: [&[Prepared]; 2],
        (buckets, chapters): (usize, Option<(u64, u64)>),
        open: u64,
        ring_chapters: u64,
    ) {
        debug_assert_eq!(buckets, self.buckets, "records prepared for another table");
        let Some((oldest, newest)) = chapters.filter(|_| buckets == self.buckets) else {
            return;
        };
        // Nothing live: every chapter left the window. Else every record is less than
        // 2^16 chapters behind `open` (a run spans far fewer than 2^15 chapters, the
        // window at most 2^15), so the 16-bit ages `insert_all` computes are exact.
        if newest > open || open - newest >= ring_chapters {
            return;
        }
        debug_assert!(newest - oldest < 1 << 15 && ring_chapters <= 1 << 15);
        let half = self.buckets / 2;
        if low.len() + high.len() < PARALLEL_RECORDS_MIN || half == 0 {
            let mut all = self.slots_mut(..);
            let added = all.insert_all(low, open, ring_chapters) + all.insert_all(high, open, ring_chapters);
            self.entries += added;
            return;
        }
        let (mut lower, mut upper) = {
            let Slots { words, pages, first } = self.slots_mut(..);
            let (w0, w1) = words.split_at_mut((half * BUCKET_SLOTS).min(words.len()));
            let (p0, p1) = pages.split_at_mut((half * BUCKET_SLOTS).min(pages.len()));
            (Slots { words: w0, pages: p0, first }, Slots { words: w1, pages: p1, first: first + half })
        };
        let mut alone = false;
        let added = std::thread::scope(|sc| {
            let upper = &mut upper;
            let helper = std::thread::Builder::new()
                .name("dedupvol-index-insert".into())
                .spawn_scoped(sc, move || upper.insert_all(high, open, ring_chapters));
            let added = lower.insert_all(low, open, ring_chapters);
            match helper {
                Ok(h) => added + h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
                Err(_) => {
                    // No thread: this one does the upper half too, once the scope ends.
                    alone = true;
                    added
                }
            }
        });
        let added = added + if alone { upper.insert_all(high, open, ring_chapters) } else { 0 };
        self.entries += added;
    }

    /// Forgets `h` if it points at page `page` of chapter `vcn`.
    pub fn remove(&mut self, h: &[u8; 32], vcn: u64, page: u64) {
        let name = Name::of(h);
        let tag = tag_of(&name);
        let found = self.bucket(&name).find(|&i| {
            let w = self.word(i);
            w != 0 && w >> TAG_SHIFT == tag && u64::from(self.page(i)) == page && chapter_of(w) == vcn as u16
        });
        if let Some(i) = found {
            self.clear(i);
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
            let w = self.word(i);
            if w != 0 && age(open, chapter_of(w)) >= ring_chapters {
                self.clear(i);
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
        let mut t = VolumeIndex::try_new(5 << 10, false).expect("table");
        assert_eq!(t.memory_bytes(), 5 << 10);
        t.insert(&h(1), (3, 7, 80), 3, 4);
        assert_eq!(t.candidates(&h(1), 3, 4), vec![cand(3, 7, 72..84)]);
        t.insert(&h(1), (5, 2, 9), 5, 4);
        assert_eq!(t.candidates(&h(1), 5, 4), vec![cand(5, 2, 0..12), cand(3, 7, 72..84)], "newest first");
        assert_eq!(t.candidates(&h(1), 9, 4), vec![], "chapter 5 left the 4-chapter window at 9");
        assert_eq!(t.candidates(&h(2), 5, 4), vec![]);
        t.remove(&h(1), 5, 2);
        t.remove(&h(1), 3, 7);
        assert_eq!(t.len(), 0);
        for i in 0..10_000 {
            t.insert(&h(i), (u64::from(i / 100), 0, u64::from(i % 84)), u64::from(i / 100), 4);
            t.sweep(u64::from(i / 100), 4);
        }
        assert!(t.len() <= t.capacity());
        t.audit().expect("audit");
    }

    fn cand(vcn: u64, page: u64, positions: std::ops::Range<usize>) -> Candidate {
        Candidate { vcn, page, positions }
    }

    /// A record as the rebuild reads it: fingerprint, chapter, page, position.
    type Rebuilt = ([u8; 32], u64, u64, u64);

    fn rebuilt(i: u64, per_chapter: u64) -> Rebuilt {
        let r = i % per_chapter;
        (h(i as u32), i / per_chapter, r / 84, r % 84)
    }

    /// Inserts `recs` as the rebuild does, `batch` records per `insert_prepared`.
    fn insert_rebuilt(t: &mut VolumeIndex, recs: &[Rebuilt], batch: usize, open: u64, ring: u64) {
        let mut run = PreparedRun::default();
        for c in recs.chunks(batch) {
            assert!(run.clear(t.bucket_count(), c.len()));
            for (hash, vcn, page, position) in c {
                assert!(run.push(&Name::of(hash), *vcn, *page, *position));
            }
            t.insert_prepared(run.part(0, 1), run.chapters(), open, ring);
        }
    }

    #[test]
    fn a_tag_collision_keeps_both_entries() {
        // Two fingerprints with the same buckets and the same 13-bit tag, differing in the
        // bytes the table never looks at: a newer record of one must not evict the other
        // while its buckets have room.
        let a = h(1);
        let mut b = a;
        b[30] ^= 0xFF;
        let (na, nb) = (Name::of(&a), Name::of(&b));
        assert_eq!((tag_of(&na), bucket_pair(64, &na)), (tag_of(&nb), bucket_pair(64, &nb)));
        let mut t = VolumeIndex::try_new(5 * 8 * 65, false).expect("table");
        t.insert(&a, (1, 0, 3), 1, 8);
        t.insert(&b, (2, 4, 40), 2, 8);
        assert_eq!(t.candidates(&a, 2, 8), vec![cand(2, 4, 36..48), cand(1, 0, 0..12)]);
        assert_eq!(t.len(), 2);
    }

    /// While no bucket pair is full, every fingerprint inserted is found where it was put,
    /// whatever its tag collides with (6 of these 16,000 inserts evicted another
    /// fingerprint's entry under the rule that took a same-tag slot first).
    #[test]
    fn every_entry_is_found_while_buckets_have_room() {
        let mut t = VolumeIndex::try_new(5 * 8 * 4096, false).expect("table");
        let (open, ring) = (1000, 1001);
        let n = 16_000u32;
        for i in 0..n {
            let (vcn, page, position) = (u64::from(i) / 16, u64::from(i) % 7, u64::from(i) % 84);
            t.insert(&h(i), (vcn, page, position), open, ring);
        }
        assert_eq!(t.len(), u64::from(n));
        for i in 0..n {
            let (vcn, page, position) = (u64::from(i) / 16, u64::from(i) % 7, u64::from(i) % 84);
            let found = t.candidates(&h(i), open, ring);
            assert!(
                found.iter().any(|c| c.vcn == vcn && c.page == page && c.positions.contains(&(position as usize))),
                "fingerprint {i} lost: {found:?}"
            );
        }
    }

    #[test]
    fn every_position_of_a_page_is_in_its_group() {
        for p in 0..crate::dedup::chapter::RECORDS_PER_PAGE {
            let w = word_of(1, p as u64, 0);
            assert!(group_of(w).contains(&p) && group_of(w).len() <= GROUP_RECORDS, "position {p}");
        }
    }

    #[test]
    fn batch_insert_matches_one_by_one() {
        // A table small enough that buckets fill and overflow, with repeated fingerprints
        // (the newer record must win) and chapters that left the window.
        let per_chapter = 300;
        let mut recs: Vec<Rebuilt> = (0..6000).map(|i| rebuilt(i, per_chapter)).collect();
        recs.extend((0..600).map(|i| (rebuilt(i * 7, per_chapter).0, 19, 0, 0)));
        let (open, ring) = (20, 16);
        let mut one = VolumeIndex::try_new(5 * 4096, false).expect("table");
        one.insert(&h(5), (20, 1, 1), 20, ring);
        for (hash, vcn, page, position) in &recs {
            if open - vcn < ring {
                one.insert(hash, (*vcn, *page, *position), open, ring);
            }
        }
        // Slot by slot, not the raw arrays: each table starts at its own alignment offset
        // (`words_at`), which depends on where the allocator put it.
        let slots = |t: &VolumeIndex| (0..t.cap).map(|i| (t.word(i), t.page(i))).collect::<Vec<_>>();
        // All at once (two threads), and in batches too small for a second thread.
        for per_batch in [recs.len(), 1000] {
            let mut batch = VolumeIndex::try_new(5 * 4096, false).expect("table");
            batch.insert(&h(5), (20, 1, 1), 20, ring);
            insert_rebuilt(&mut batch, &recs, per_batch, open, ring);
            assert!(slots(&one) == slots(&batch) && one.len() == batch.len(), "batches of {per_batch}");
            assert_eq!(batch.candidates(&h(5), open, ring), vec![cand(20, 1, 0..12)], "the session's own record");
            assert_eq!(batch.candidates(&h(7), open, ring).first(), Some(&cand(19, 0, 0..12)), "the newer first");
            assert!(batch.candidates(&h(1), open, ring).is_empty(), "chapter 0 is outside the window");
            batch.audit().expect("audit");
        }
    }

    #[test]
    fn a_run_whose_chapters_all_left_the_window_is_not_inserted() {
        let mut t = VolumeIndex::try_new(5 * 4096, false).expect("table");
        // Chapters 0..4, seen from chapter 2^16 + 2 with a 16-chapter window: their 16-bit
        // numbers look only 2..6 chapters old.
        let recs: Vec<Rebuilt> = (0..64).map(|i| rebuilt(i, 16)).collect();
        insert_rebuilt(&mut t, &recs, 64, (1 << 16) + 2, 16);
        assert_eq!(t.len(), 0);
        insert_rebuilt(&mut t, &recs, 64, 10, 16);
        assert_eq!(t.len(), 64);
    }

    /// Time per record of the rebuild's inserts into a table of `DEDUPVOL_MEASURE_ENTRIES`
    /// (default 16.7 M, a 64 GiB window) entries, one by one and in batches.
    #[test]
    #[ignore = "a measurement: allocates and fills a table of about 100 MB twice"]
    fn measure_insert_rate() {
        let n: u64 = std::env::var("DEDUPVOL_MEASURE_ENTRIES").ok().and_then(|v| v.parse().ok()).unwrap_or(16_770_000);
        let per_chapter = 162 * 84;
        let chapters = n.div_ceil(per_chapter) + 1;
        let recs: Vec<Rebuilt> = (0..n)
            .map(|i| (*blake3::hash(&i.to_le_bytes()).as_bytes(), i / per_chapter, i % per_chapter / 84, i % 84))
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
            if batched {
                // The preparing included, as the rebuild's decoder does it.
                insert_rebuilt(&mut t, &recs, 16384, chapters, chapters + 1);
            } else {
                for (hash, vcn, page, position) in &recs {
                    t.insert(hash, (*vcn, *page, *position), chapters, chapters + 1);
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
                n as f64 / 84.0 * 4096.0 / s / 1e6
            );
        }
    }
}
