//! The recovery journal: a circular region of checksummed blocks recording every mapping
//! change, written by group commit and replayed on open.
//!
//! Invariants:
//! - Entry sequences are dense and increasing; block sequences are dense and increasing;
//!   block `b` is stored at position `b % journal_blocks`.
//! - A block is written once and never rewritten in place (a partly filled block is closed
//!   at its commit), so a crash can only tear blocks that were never durable.
//! - Blocks are written only after the data they reference is synced, and a commit is
//!   durable once the metadata device is synced; recovery replays the contiguous run of
//!   valid blocks that starts at the newest block's `head_block_seq` and stops at the first
//!   gap — everything after a gap was never synced.
//! - Space between `head_block_seq` and `next_block_seq` is live; the head advances only
//!   after a checkpoint has synced every page holding an entry older than the new head.
//! - `head_block_seq <= next_block_seq <= head_block_seq + journal_blocks`, and
//!   `durable_seq < next_entry_seq - pending.len()`: pending entries are never durable.
//!   The journal alone moves its sequences (`append`, `take_batch`, `mark_durable`,
//!   `note_checkpointed`, `assign_written_seq`), and each asserts what it keeps.

use crate::codec::{get_u32, get_u64, put_u32, put_u64};
use crate::config::{BLOCK_SIZE, BLOCK_SIZE_U64};
use crate::error::{Error, Result};
use crate::io::{Dev, IoKind};
use crate::metadata::block_map::{MapEntry, MAP_ENTRY_BYTES};
use crate::metadata::layout::Geometry;
use std::collections::HashMap;

/// Magic at offset 0 of a journal block.
pub const JOURNAL_MAGIC: [u8; 8] = *b"DVJOURNL";
/// Journal block header bytes.
pub const JOURNAL_HEADER_BYTES: usize = 80;
/// Bytes per journal entry: lba (8) + new mapping (10) + old mapping (10).
pub const JOURNAL_ENTRY_BYTES: usize = 8 + 2 * MAP_ENTRY_BYTES;
/// Entries per journal block.
pub const JOURNAL_ENTRIES_PER_BLOCK: usize = (BLOCK_SIZE - JOURNAL_HEADER_BYTES) / JOURNAL_ENTRY_BYTES;
/// Offset of the checksum field.
pub const JOURNAL_CRC_OFFSET: usize = 8;
/// Journal blocks read per I/O during recovery.
const SCAN_BLOCKS_PER_IO: u64 = 256;

const _: () = assert!(JOURNAL_ENTRIES_PER_BLOCK == 100);
const _: () = assert!(JOURNAL_HEADER_BYTES + JOURNAL_ENTRIES_PER_BLOCK * JOURNAL_ENTRY_BYTES <= BLOCK_SIZE);

/// One mapping change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalEntry {
    /// Logical block.
    pub lba: u64,
    /// Mapping after the change.
    pub new: MapEntry,
    /// Mapping before the change.
    pub old: MapEntry,
}

/// Running volume counters carried in each journal block (as of its last entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// Logical blocks mapped to data.
    pub mapped_blocks: u64,
    /// Logical blocks mapped as zeros.
    pub zero_blocks: u64,
}

impl Counters {
    /// Applies one mapping change.
    pub fn apply(&mut self, old: &MapEntry, new: &MapEntry) {
        if old.is_data() {
            self.mapped_blocks = self.mapped_blocks.saturating_sub(1);
        } else if old.state == crate::metadata::block_map::STATE_ZERO {
            self.zero_blocks = self.zero_blocks.saturating_sub(1);
        }
        if new.is_data() {
            self.mapped_blocks += 1;
        } else if new.state == crate::metadata::block_map::STATE_ZERO {
            self.zero_blocks += 1;
        }
    }
}

/// Journal blocks ready to write, produced under the volume lock and written outside it.
#[derive(Debug, Default)]
pub struct CommitBatch {
    /// (device offset, block) pairs in block-sequence order.
    pub blocks: Vec<(u64, Vec<u8>)>,
    /// Last entry sequence the batch makes durable.
    pub last_seq: u64,
}

/// The journal's in-memory state.
pub struct Journal {
    geo: Geometry,
    uuid: [u8; 16],
    /// Next entry sequence to assign.
    next_entry_seq: u64,
    /// Next block sequence to write.
    next_block_seq: u64,
    /// Oldest block still needed by recovery.
    head_block_seq: u64,
    /// Newest entry sequence known durable.
    durable_seq: u64,
    pending: Vec<JournalEntry>,
    encoded: Counters,
}

impl Journal {
    /// A journal continuing after `next_entry_seq` / `next_block_seq`, with counters as of
    /// the last entry before them.
    pub fn new(geo: Geometry, uuid: [u8; 16], next_entry_seq: u64, next_block_seq: u64, counters: Counters) -> Self {
        Journal {
            geo,
            uuid,
            next_entry_seq,
            next_block_seq,
            head_block_seq: next_block_seq,
            durable_seq: next_entry_seq.saturating_sub(1),
            pending: Vec::new(),
            encoded: counters,
        }
    }

    /// Replaces the running counters (repair).
    pub fn reset_counters(&mut self, c: Counters) {
        self.encoded = c;
    }

    /// The newest entry sequence assigned (0 before the first).
    pub fn last_assigned_seq(&self) -> u64 {
        self.next_entry_seq.saturating_sub(1)
    }

    /// The next entry sequence `append` will assign.
    pub fn next_entry_seq(&self) -> u64 {
        self.next_entry_seq
    }

    /// The next block sequence a commit will write.
    pub fn next_block_seq(&self) -> u64 {
        self.next_block_seq
    }

    /// The newest entry sequence known durable.
    pub fn durable_seq(&self) -> u64 {
        self.durable_seq
    }

    /// Records that every entry up to `seq` is durable (a batch's journal blocks synced).
    pub fn mark_durable(&mut self, seq: u64) {
        assert!(
            seq < self.next_entry_seq - self.pending.len() as u64,
            "journal: entry {seq} made durable before it was written"
        );
        self.durable_seq = self.durable_seq.max(seq);
    }

    /// Records that every page the live journal blocks describe is written and synced:
    /// recovery needs none of them, and their space is free again.
    pub fn note_checkpointed(&mut self) {
        assert!(self.pending.is_empty(), "journal: checkpoint with {} entries not committed", self.pending.len());
        self.head_block_seq = self.next_block_seq;
    }

    /// A sequence for a change made outside the journal and written straight to the pages
    /// (repair): assigned and durable at once.
    pub fn assign_written_seq(&mut self) -> u64 {
        assert!(self.pending.is_empty(), "journal: repair with {} entries not committed", self.pending.len());
        let seq = self.next_entry_seq;
        self.next_entry_seq += 1;
        self.durable_seq = seq;
        seq
    }

    /// Records a change; returns its sequence.
    pub fn append(&mut self, lba: u64, new: MapEntry, old: MapEntry) -> u64 {
        let seq = self.next_entry_seq;
        self.next_entry_seq += 1;
        self.pending.push(JournalEntry { lba, new, old });
        seq
    }

    /// Entries not yet written.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Entries allowed to wait before a commit is forced: a quarter of the journal.
    pub fn pending_entries_max(&self) -> usize {
        (self.geo.journal_blocks as usize / 4).max(1) * JOURNAL_ENTRIES_PER_BLOCK
    }

    /// Live journal blocks.
    pub fn used_blocks(&self) -> u64 {
        assert!(self.head_block_seq <= self.next_block_seq, "journal: head passed the next block");
        self.next_block_seq - self.head_block_seq
    }

    /// Checks the sequences against each other (the `verify` audit; each is also asserted
    /// where it moves).
    #[cfg(any(test, feature = "verify"))]
    pub fn audit(&self) -> std::result::Result<(), String> {
        let written = self.next_entry_seq.checked_sub(self.pending.len() as u64);
        if self.head_block_seq > self.next_block_seq
            || self.next_block_seq - self.head_block_seq > self.geo.journal_blocks
            || written.is_none_or(|w| self.durable_seq >= w && self.durable_seq != 0)
        {
            return Err(format!(
                "journal sequences out of order: head {} next block {} of {}, durable {} next entry {} pending {}",
                self.head_block_seq,
                self.next_block_seq,
                self.geo.journal_blocks,
                self.durable_seq,
                self.next_entry_seq,
                self.pending.len()
            ));
        }
        Ok(())
    }

    /// True when a checkpoint should reclaim space (more than half the journal is live).
    pub fn wants_checkpoint(&self) -> bool {
        self.used_blocks() > self.geo.journal_blocks / 2
    }

    /// Encodes every pending entry into blocks. The caller writes them after syncing data.
    pub fn take_batch(&mut self) -> Result<CommitBatch> {
        let mut batch = CommitBatch { blocks: Vec::new(), last_seq: self.next_entry_seq - 1 };
        if self.pending.is_empty() {
            return Ok(batch);
        }
        let needed = self.pending.len().div_ceil(JOURNAL_ENTRIES_PER_BLOCK) as u64;
        if self.used_blocks() + needed > self.geo.journal_blocks {
            return Err(Error::Failed(format!(
                "journal overflow: {} live + {needed} new blocks exceed {} (checkpoint missed)",
                self.used_blocks(),
                self.geo.journal_blocks
            )));
        }
        let mut first_seq = self.next_entry_seq - self.pending.len() as u64;
        for chunk in self.pending.chunks(JOURNAL_ENTRIES_PER_BLOCK) {
            let mut buf = vec![0u8; BLOCK_SIZE];
            if let Some(m) = buf.get_mut(..8) {
                m.copy_from_slice(&JOURNAL_MAGIC);
            }
            put_u32(&mut buf, 12, chunk.len() as u32);
            if let Some(u) = buf.get_mut(16..32) {
                u.copy_from_slice(&self.uuid);
            }
            put_u64(&mut buf, 32, self.next_block_seq);
            put_u64(&mut buf, 40, first_seq);
            put_u64(&mut buf, 48, self.head_block_seq);
            for (i, e) in chunk.iter().enumerate() {
                let off = JOURNAL_HEADER_BYTES + i * JOURNAL_ENTRY_BYTES;
                put_u64(&mut buf, off, e.lba);
                if let Some(s) = buf.get_mut(off + 8..off + 8 + MAP_ENTRY_BYTES) {
                    e.new.encode(s);
                }
                if let Some(s) = buf.get_mut(off + 8 + MAP_ENTRY_BYTES..off + JOURNAL_ENTRY_BYTES) {
                    e.old.encode(s);
                }
                self.encoded.apply(&e.old, &e.new);
            }
            put_u64(&mut buf, 56, self.encoded.mapped_blocks);
            put_u64(&mut buf, 64, self.encoded.zero_blocks);
            crate::codec::seal_crc(&mut buf, JOURNAL_CRC_OFFSET);
            let pos = self.next_block_seq % self.geo.journal_blocks;
            batch.blocks.push(((self.geo.journal_start + pos) * BLOCK_SIZE_U64, buf));
            self.next_block_seq += 1;
            first_seq += chunk.len() as u64;
        }
        self.pending.clear();
        Ok(batch)
    }
}

/// Writes a batch, merging blocks that are adjacent on the device into one write.
pub fn write_batch(meta: &Dev, batch: &CommitBatch) -> Result<()> {
    let mut i = 0;
    while let Some((start, first)) = batch.blocks.get(i) {
        let mut run = first.clone();
        let mut next = start + BLOCK_SIZE_U64;
        i += 1;
        while let Some((off, b)) = batch.blocks.get(i) {
            if *off != next {
                break;
            }
            run.extend_from_slice(b);
            next += BLOCK_SIZE_U64;
            i += 1;
        }
        meta.write(IoKind::Journal, &run, *start)?;
    }
    Ok(())
}

/// What recovery found in the journal.
#[derive(Debug, Default)]
pub struct Replay {
    /// Entries to replay, with their sequences, in order.
    pub entries: Vec<(u64, JournalEntry)>,
    /// Highest block sequence of any valid block (replayed or not).
    pub max_block_seq: Option<u64>,
    /// Highest entry sequence of any valid block.
    pub max_entry_seq: u64,
    /// Counters as of the last replayed block.
    pub counters: Option<Counters>,
    /// Blocks of this volume whose checksum failed (torn or corrupt).
    pub damaged_blocks: u64,
    /// Blocks replayed.
    pub blocks_replayed: u64,
}

struct Scanned {
    first_entry_seq: u64,
    head: u64,
    counters: Counters,
    entries: Vec<JournalEntry>,
}

/// Scans the whole journal region and returns the entries to replay.
pub fn scan(meta: &Dev, geo: &Geometry, uuid: &[u8; 16]) -> Result<Replay> {
    let mut found: HashMap<u64, (u64, Scanned)> = HashMap::new();
    let mut replay = Replay::default();
    let mut pos = 0u64;
    while pos < geo.journal_blocks {
        let take = (geo.journal_blocks - pos).min(SCAN_BLOCKS_PER_IO);
        let mut buf = vec![0u8; take as usize * BLOCK_SIZE];
        meta.read(IoKind::Journal, &mut buf, (geo.journal_start + pos) * BLOCK_SIZE_U64)?;
        for (i, b) in buf.chunks_exact(BLOCK_SIZE).enumerate() {
            let p = pos + i as u64;
            if b.get(..8) != Some(&JOURNAL_MAGIC[..]) || b.get(16..32) != Some(&uuid[..]) {
                continue;
            }
            if !crate::codec::crc_ok(b, JOURNAL_CRC_OFFSET) {
                replay.damaged_blocks += 1;
                continue;
            }
            let block_seq = get_u64(b, 32);
            let count = get_u32(b, 12) as usize;
            if block_seq % geo.journal_blocks != p || count == 0 || count > JOURNAL_ENTRIES_PER_BLOCK {
                replay.damaged_blocks += 1;
                continue;
            }
            let mut entries = Vec::with_capacity(count);
            for k in 0..count {
                let off = JOURNAL_HEADER_BYTES + k * JOURNAL_ENTRY_BYTES;
                // A block whose checksum holds but whose entry does not decode was written
                // that way: not a torn write, so it is corruption, not a gap.
                let bad = |half: &str, found: String| {
                    Error::corruption(
                        "journal block",
                        block_seq,
                        "entries with known mapping states",
                        format!("entry {k} ({half} mapping): {found}"),
                    )
                };
                #[expect(
                    clippy::indexing_slicing,
                    reason = "`count <= JOURNAL_ENTRIES_PER_BLOCK`, and that many entries fit a BLOCK_SIZE block (const assert)"
                )]
                let (new, old) =
                    (&b[off + 8..off + 8 + MAP_ENTRY_BYTES], &b[off + 8 + MAP_ENTRY_BYTES..off + JOURNAL_ENTRY_BYTES]);
                let new = MapEntry::decode(new).map_err(|f| bad("new", f))?;
                let old = MapEntry::decode(old).map_err(|f| bad("old", f))?;
                let lba = get_u64(b, off);
                if lba >= geo.logical_blocks {
                    return Err(Error::corruption(
                        "journal block",
                        block_seq,
                        format!("entries for logical blocks below {}", geo.logical_blocks),
                        format!("entry {k} for logical block {lba}"),
                    ));
                }
                entries.push(JournalEntry { lba, new, old });
            }
            let s = Scanned {
                first_entry_seq: get_u64(b, 40),
                head: get_u64(b, 48),
                counters: Counters { mapped_blocks: get_u64(b, 56), zero_blocks: get_u64(b, 64) },
                entries,
            };
            replay.max_block_seq = Some(replay.max_block_seq.map_or(block_seq, |m| m.max(block_seq)));
            replay.max_entry_seq = replay.max_entry_seq.max(s.first_entry_seq + count as u64 - 1);
            found.insert(p, (block_seq, s));
        }
        pos += take;
    }
    let Some(max_block) = replay.max_block_seq else {
        return Ok(replay);
    };
    let head = found.get(&(max_block % geo.journal_blocks)).map_or(max_block, |(_, s)| s.head);
    let mut b = head;
    let mut expect_entry: Option<u64> = None;
    while b <= max_block && b - head < geo.journal_blocks {
        let Some((seq, s)) = found.get(&(b % geo.journal_blocks)) else {
            break;
        };
        if *seq != b || expect_entry.is_some_and(|x| x != s.first_entry_seq) {
            break;
        }
        for (k, e) in s.entries.iter().enumerate() {
            replay.entries.push((s.first_entry_seq + k as u64, *e));
        }
        expect_entry = Some(s.first_entry_seq + s.entries.len() as u64);
        replay.counters = Some(s.counters);
        replay.blocks_replayed += 1;
        b += 1;
    }
    Ok(replay)
}
