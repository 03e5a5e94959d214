//! Write-once journaling (WOJ): a file system that journals its data (ext4
//! `data=journal`, ext3) writes every block twice, first into its journal, then to its
//! home location (the checkpoint). The engine finds the journal (`ext4::discover`, or a
//! range given by the user), keeps a weak fingerprint (xxh3-64) of every block written
//! into it (`pool::Pool`), and shares a later write outside the journal whose fingerprint
//! matches with the journal block's physical copy: a reference and a map update, no data
//! written, no BLAKE3 and no fingerprint index (docs/design.md, "Write-once journaling").
//!
//! A share never rests on the weak hash. Identity is confirmed by comparing bytes: the
//! journal copy is recent, so it is usually still in memory (`Staging`, an open packed
//! block, or the content cache, which journal writes always enter while WOJ is on);
//! otherwise it is read back once. A shared chunk takes the journal copy's crc32c for its
//! map entry (equal bytes, equal crc), so a checkpoint write costs one xxh3 pass and one
//! compare, no crc32c and no BLAKE3 (`pipeline::fingerprint`). Why not a second 64-bit
//! hash in the pool entry: it would not fit the 16 bytes per journal block next to the key,
//! and two non-cryptographic hashes can both be made to collide by a user who controls
//! what two files contain: the bytes are the only proof that a tenant cannot forge.
//!
//! Decision table for a chunk written outside the journal (stage: where it is decided):
//!
//! | stage | pool entry for its weak hash | journal block's map entry | content | decision |
//! |---|---|---|---|---|
//! | 1 | none or invalid | – | – | not WOJ's: BLAKE3 and the index when dedup is on |
//! | 2 | changed since stage 1 (overwritten, used, re-discovered) | – | – | drop the candidate (`stale`) |
//! | 2 | valid | not data, count 0 or at the cap, damaged | – | drop (`stale`) |
//! | 2 | valid | data | unwritten block decodes to other bytes | drop (`collisions`) |
//! | 3 | valid | data, on the device | cached or read copy differs | drop (`collisions`) |
//! | 4 | – | count 0 or at the cap, damaged, or blocks reused since stage 2 | – | store (`stale`) |
//! | 4 | – | otherwise | equal | **share** (the copy's location and crc); the entry leaves the pool (`hits`) |
//!
//! A dropped candidate falls back to the normal path (crc32c, and BLAKE3 when dedup is on,
//! computed then). A chunk written into the journal replaces its block's pool entry, unless it is
//! jbd2's own descriptor, commit, revoke or superblock block (`ext4::is_jbd2_meta`), or
//! zeros; any other mapping change of a journal block (discard, write-zeroes) removes it.
//!
//! Invariants:
//! - Memory is bounded by the journal's size: `pool::Pool` holds 13 bytes per journal
//!   block, for at most `pool::POOL_JOURNAL_BLOCKS_MAX` blocks; runs at most
//!   `ext4::RANGES_MAX`.
//! - Nothing of WOJ is persisted or needed for correctness: after a crash the pool starts
//!   empty, and a share is a mapping change like any dedup hit (journalled, counted).
//! - Lock order: the state lock before the WOJ lock; the WOJ lock is held for no I/O.
//! - A pool entry for journal block `j` always describes the content last mapped at `j`'s
//!   logical block (updated under the state lock with the mapping change); `epoch` changes
//!   whenever the journal runs do, and a candidate of another epoch is dropped.

pub(crate) mod ext4;
pub(crate) mod pool;

use crate::config::BLOCK_SIZE_U64;
use crate::error::{Error, Result};
pub use ext4::JournalRange;
use pool::{Found as PoolFound, Inserted, Pool};
use serde::{Deserialize, Serialize};

/// Where the journal of a file system on the volume is (`OpenOptions::woj`,
/// `serve --woj`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WojMode {
    /// No write-once journaling.
    #[default]
    Off,
    /// Find ext3/ext4 journals on the volume (whole volume, MBR or GPT partitions), and
    /// look again whenever a superblock or partition table is rewritten.
    Auto,
    /// A journal at this byte range (an external journal, or any other journal region).
    Range {
        /// First byte.
        offset: u64,
        /// Length in bytes.
        len: u64,
    },
}

impl std::str::FromStr for WojMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(WojMode::Off),
            "auto" => Ok(WojMode::Auto),
            _ => {
                let bad = || Error::InvalidArgument(format!("--woj must be auto, off or OFFSET:LENGTH, not {s:?}"));
                let (o, l) = s.split_once(':').ok_or_else(bad)?;
                let offset = crate::config::parse_size(o).map_err(|_| bad())?;
                let len = crate::config::parse_size(l).map_err(|_| bad())?;
                if len == 0 {
                    return Err(bad());
                }
                Ok(WojMode::Range { offset, len })
            }
        }
    }
}

impl std::fmt::Display for WojMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WojMode::Off => f.write_str("off"),
            WojMode::Auto => f.write_str("auto"),
            WojMode::Range { offset, len } => write!(f, "{offset}:{len}"),
        }
    }
}

/// Write-once journaling figures of this session (`Stats::woj`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct WojStats {
    /// `auto`, or the range given.
    pub mode: String,
    /// Journal ranges in use, in volume bytes.
    pub ranges: Vec<JournalRange>,
    /// What discovery found, or why it found nothing.
    pub notes: Vec<String>,
    /// 4 KiB journal blocks the pool covers.
    pub journal_blocks: u64,
    /// Entries in the pool (invalid ones included).
    pub pool_entries: u64,
    /// Memory of the pool in bytes.
    pub pool_bytes: u64,
    /// Blocks written into the journal that entered the pool.
    pub inserts: u64,
    /// jbd2 descriptor, commit, revoke and superblock blocks kept out of the pool.
    pub journal_meta_blocks: u64,
    /// Journal blocks whose weak hash another journal block already had (never shared).
    pub invalidations: u64,
    /// Writes outside the journal whose weak hash found a pool entry.
    pub lookups_hit: u64,
    /// Writes shared with their journal copy.
    pub hits: u64,
    /// Candidates whose content differed (weak hash, and possibly crc, collided).
    pub collisions: u64,
    /// Candidates dropped because the journal block changed or its copy was reused or
    /// at the reference cap before the share.
    pub stale: u64,
    /// Hits confirmed from memory (unwritten block or content cache).
    pub confirmed_in_memory: u64,
    /// Hits confirmed by reading the journal copy back.
    pub confirmed_by_read: u64,
    /// Data bytes not written thanks to WOJ.
    pub bytes_not_written: u64,
    /// Discoveries run (at open and after superblock or partition table writes).
    pub discoveries: u64,
}

/// A run of journal blocks: logical blocks `lba..lba + blocks` are journal blocks
/// `j0..j0 + blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    lba: u64,
    blocks: u64,
    j0: u64,
}

/// A WOJ candidate found in stage 1 for one chunk (see the decision table).
#[derive(Debug, Clone, Copy)]
pub(crate) struct WojCand {
    /// The journal block holding content with the chunk's weak hash.
    pub(crate) j: u32,
    /// `Woj::epoch` at the lookup.
    pub(crate) epoch: u64,
    /// The journal block's map entry (stage 2).
    pub(crate) entry: Option<crate::metadata::block_map::MapEntry>,
    /// Content compared equal.
    pub(crate) verified: bool,
    /// Confirmed by a device read rather than from memory.
    pub(crate) by_read: bool,
}

/// The WOJ state of a volume (behind `Volume::woj`).
pub(crate) struct Woj {
    mode: WojMode,
    /// Applied to every weak hash: `u64::MAX`, or fewer bits to force collisions (tests).
    mask: u64,
    volume_bytes: u64,
    runs: Vec<Run>,
    ranges: Vec<JournalRange>,
    notes: Vec<String>,
    watch: Vec<u64>,
    pool: Pool,
    epoch: u64,
    pub(crate) stats: WojStats,
}

impl Woj {
    /// WOJ for a volume of `volume_bytes`, with no journal known yet; None when off.
    pub(crate) fn new(mode: WojMode, mask: u64, volume_bytes: u64) -> Option<Self> {
        if mode == WojMode::Off {
            return None;
        }
        Some(Woj {
            mode,
            mask,
            volume_bytes,
            runs: Vec::new(),
            ranges: Vec::new(),
            notes: Vec::new(),
            watch: Vec::new(),
            pool: Pool::new(0),
            epoch: 0,
            stats: WojStats { mode: mode.to_string(), ..WojStats::default() },
        })
    }

    /// The mode asked for.
    pub(crate) fn mode(&self) -> WojMode {
        self.mode
    }

    /// The mask weak hashes are cut to (`u64::MAX` unless a test forces collisions).
    pub(crate) fn mask(&self) -> u64 {
        self.mask
    }

    /// Installs what discovery found. The pool is kept when the journal did not move,
    /// else started afresh under a new epoch.
    pub(crate) fn install(&mut self, found: ext4::Found) {
        self.stats.discoveries += 1;
        self.notes = found.notes;
        self.watch = found.watch;
        if found.ranges == self.ranges {
            return;
        }
        let mut runs = Vec::with_capacity(found.ranges.len());
        let mut j0 = 0u64;
        for r in &found.ranges {
            // Whole 4 KiB blocks inside the range only.
            let first = r.offset.div_ceil(BLOCK_SIZE_U64);
            let end = ((r.offset + r.len) / BLOCK_SIZE_U64).min(self.volume_bytes / BLOCK_SIZE_U64);
            let blocks = end.saturating_sub(first).min(pool::POOL_JOURNAL_BLOCKS_MAX - j0);
            if blocks > 0 {
                runs.push(Run { lba: first, blocks, j0 });
                j0 += blocks;
            }
        }
        assert!(runs.windows(2).all(|w| matches!(w, [a, b] if a.lba + a.blocks <= b.lba)), "journal runs overlap");
        self.runs = runs;
        self.ranges = found.ranges;
        self.pool = Pool::new(j0);
        self.epoch += 1;
    }

    /// Discovery for a `Range` mode: the range itself.
    pub(crate) fn fixed(&self) -> Option<ext4::Found> {
        match self.mode {
            WojMode::Range { offset, len } => {
                let len = len.min(self.volume_bytes.saturating_sub(offset));
                let ranges = if len > 0 { vec![JournalRange { offset, len }] } else { Vec::new() };
                let note = if len > 0 {
                    format!("journal range given: {offset}:{len}")
                } else {
                    format!("journal range given at byte {offset} lies past the volume's end: ignored")
                };
                Some(ext4::Found { ranges, watch: Vec::new(), notes: vec![note] })
            }
            _ => None,
        }
    }

    /// True when a write to `lba..lba + n` touches a block whose rewrite calls for a new
    /// discovery (auto mode only).
    pub(crate) fn watched(&self, lba: u64, n: u64) -> bool {
        self.mode == WojMode::Auto && self.watch.iter().any(|w| (lba..lba.saturating_add(n)).contains(w))
    }

    /// The journal block at logical block `lba`, if it is one.
    pub(crate) fn j_of(&self, lba: u64) -> Option<u32> {
        let i = self.runs.partition_point(|r| r.lba + r.blocks <= lba);
        let r = self.runs.get(i)?;
        (r.lba <= lba).then(|| (r.j0 + (lba - r.lba)) as u32)
    }

    /// The logical block of journal block `j`.
    pub(crate) fn lba_of(&self, j: u32) -> Option<u64> {
        let j = u64::from(j);
        let i = self.runs.partition_point(|r| r.j0 + r.blocks <= j);
        let r = self.runs.get(i)?;
        (r.j0 <= j).then(|| r.lba + (j - r.j0))
    }

    /// True when no journal is known.
    pub(crate) fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Stage 1: the candidate for a chunk written outside the journal.
    pub(crate) fn lookup(&mut self, weak: u64) -> Option<WojCand> {
        match self.pool.lookup(weak) {
            PoolFound::Block(j) => {
                self.stats.lookups_hit += 1;
                Some(WojCand { j, epoch: self.epoch, entry: None, verified: false, by_read: false })
            }
            PoolFound::Invalid | PoolFound::None => None,
        }
    }

    /// Stage 2: the candidate's journal block still holds content with this weak hash.
    pub(crate) fn still(&self, c: &WojCand, weak: u64) -> bool {
        c.epoch == self.epoch && self.pool.hash_of(c.j) == Some(weak.max(1))
    }

    /// Journal block `j` was written with content of weak hash `weak` (None: zeros, or
    /// jbd2 metadata, which never enters the pool).
    pub(crate) fn note_journal_write(&mut self, j: u32, weak: Option<u64>) {
        match weak {
            Some(h) => match self.pool.insert(j, h) {
                Inserted::New => self.stats.inserts += 1,
                Inserted::Invalidated | Inserted::AlreadyInvalid => self.stats.invalidations += 1,
                Inserted::Same => {}
            },
            None => {
                self.pool.remove(j);
            }
        }
    }

    /// Journal block `j` changed mapping (overwritten, discarded, zeroed): its entry leaves.
    pub(crate) fn forget(&mut self, j: u32) {
        self.pool.remove(j);
    }

    /// A share was made from journal block `j`: its entry leaves the pool.
    pub(crate) fn used(&mut self, j: u32, by_read: bool) {
        self.pool.remove(j);
        self.stats.hits += 1;
        self.stats.bytes_not_written += BLOCK_SIZE_U64;
        if by_read {
            self.stats.confirmed_by_read += 1;
        } else {
            self.stats.confirmed_in_memory += 1;
        }
    }

    /// A snapshot of the figures.
    pub(crate) fn snapshot(&self) -> WojStats {
        WojStats {
            ranges: self.ranges.clone(),
            notes: self.notes.clone(),
            journal_blocks: self.pool.blocks(),
            pool_entries: self.pool.entries(),
            pool_bytes: self.pool.bytes(),
            ..self.stats.clone()
        }
    }

    /// The pool's invariants (the `verify` audit).
    #[cfg(any(test, feature = "verify"))]
    pub(crate) fn audit(&self) -> std::result::Result<(), String> {
        self.pool.audit()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse() {
        assert_eq!("off".parse::<WojMode>().ok(), Some(WojMode::Off));
        assert_eq!("auto".parse::<WojMode>().ok(), Some(WojMode::Auto));
        assert_eq!("1M:64M".parse::<WojMode>().ok(), Some(WojMode::Range { offset: 1 << 20, len: 64 << 20 }));
        assert!("1M".parse::<WojMode>().is_err());
        assert!("1M:0".parse::<WojMode>().is_err());
        assert!("x:y".parse::<WojMode>().is_err());
    }

    #[test]
    fn a_range_past_the_end_is_ignored() {
        let w = Woj::new(WojMode::Range { offset: 1 << 30, len: 4096 }, u64::MAX, 1 << 20).expect("on");
        assert!(w.fixed().is_some_and(|f| f.ranges.is_empty()));
    }

    #[test]
    fn journal_blocks_map_both_ways() {
        let mut w = Woj::new(WojMode::Auto, u64::MAX, 1 << 30).expect("on");
        w.install(ext4::Found {
            ranges: vec![
                JournalRange { offset: 4096 * 10, len: 4096 * 5 },
                JournalRange { offset: 4096 * 100 + 1, len: 4096 * 3 },
            ],
            ..ext4::Found::default()
        });
        assert_eq!(w.j_of(9), None);
        assert_eq!(w.j_of(10), Some(0));
        assert_eq!(w.j_of(14), Some(4));
        assert_eq!(w.j_of(15), None);
        // The unaligned range keeps its two whole blocks.
        assert_eq!(w.j_of(100), None);
        assert_eq!(w.j_of(101), Some(5));
        assert_eq!(w.j_of(102), Some(6));
        assert_eq!(w.j_of(103), None);
        for j in 0..7 {
            assert_eq!(w.lba_of(j).and_then(|l| w.j_of(l)), Some(j));
        }
        assert_eq!(w.lba_of(7), None);
    }
}
