//! Recovery at open: the journal's entries are replayed into the block map and the
//! reference counts, and (read-write) the result is made durable in their pages so the
//! journal restarts empty.
//!
//! Invariants:
//! - An entry changes a page only when its sequence is above the page's: replay is
//!   idempotent, and a page written after the entry is never rolled back.
//! - Counters come from the journal after a crash, from the superblock after a clean close
//!   (repair may have corrected them after the last journal block was written), and from
//!   the superblock after a crash that left nothing to replay: the superblock carries them
//!   as of the last checkpoint (written after each one, and by recovery itself, which is one).
//!   The journal blocks that carried them may be gone: a checkpoint moves the head past
//!   them, and the first block after it may be torn.
//! - The journal restarts with entry and block sequences above every one still on disk,
//!   so a stale block can never be taken for a new one.

use super::lifecycle::{uuid_lo, write_superblock};
use crate::error::{Error, Result};
use crate::io::Dev;
use crate::metadata::block_map::BlockMap;
use crate::metadata::journal::{self, Counters, Journal};
use crate::metadata::refcount::Refcounts;
use crate::metadata::superblock::Superblock;

/// The metadata structures as recovery left them.
pub(crate) struct Recovered {
    pub(crate) map: BlockMap,
    pub(crate) rc: Refcounts,
    pub(crate) journal: Journal,
    pub(crate) counters: Counters,
    /// Informational notes for `check` (torn journal blocks, pages rebuilt).
    pub(crate) notes: Vec<String>,
}

/// Loads the block map and reference counts and replays the journal into them. A
/// read-write open then writes every page replay touched, syncs, and records the open
/// (not clean) in the superblock.
pub(crate) fn recover(
    data: &Dev,
    meta: &Dev,
    sb: &mut Superblock,
    read_only: bool,
    block_map_cache_bytes: u64,
) -> Result<Recovered> {
    let geo = sb.geometry;
    let ulo = uuid_lo(&sb.uuid);
    let was_clean = sb.clean;
    let mut notes = Vec::new();
    let mut rc = Refcounts::load(geo, ulo, meta.clone())?;
    let mut map = BlockMap::new(geo, ulo, meta.clone(), block_map_cache_bytes);
    let replay = journal::scan(meta, &geo, &sb.uuid)?;
    for (seq, e) in &replay.entries {
        let seq = *seq;
        if seq > map.page_seq(e.lba)? {
            map.set(e.lba, e.new, seq)?;
        }
        rc.replay(&e.new, &e.old, seq).map_err(|err: Error| {
            Error::corruption("journal entry", seq, "a reference count change that applies", err.to_string())
        })?;
    }
    let counters = match replay.counters {
        Some(c) if !was_clean => c,
        _ => Counters { mapped_blocks: sb.mapped_blocks, zero_blocks: sb.zero_blocks },
    };
    let next_entry_seq = (replay.max_entry_seq + 1).max(sb.next_entry_seq).max(rc.max_seq() + 1);
    let next_block_seq = replay.max_block_seq.map_or(0, |m| m + 1).max(sb.next_block_seq);
    let mut journal = Journal::new(geo, sb.uuid, next_entry_seq, next_block_seq, counters);
    if replay.damaged_blocks > 0 {
        notes.push(format!(
            "{} journal blocks outside the replayed run failed their checksum (writes torn by a crash; harmless)",
            replay.damaged_blocks
        ));
    }
    if !read_only {
        // Make the replayed state durable in the pages, so the journal can restart empty
        // with block sequences above every stale block still on disk.
        map.write_dirty(u64::MAX)?;
        rc.write_dirty(u64::MAX)?;
        meta.sync()?;
        map.note_synced();
        rc.note_synced();
        journal.note_checkpointed();
        sb.clean = false;
        // The counters as of this checkpoint: the next crash may find no block to replay
        // (the first one after it torn), and then has only these.
        sb.mapped_blocks = counters.mapped_blocks;
        sb.zero_blocks = counters.zero_blocks;
        sb.lifetime.read_write_opens += 1;
        sb.lifetime.recoveries += u64::from(!was_clean);
        let separate = geo.meta_dev_blocks > 0;
        write_superblock(data, separate.then_some(meta), sb)?;
    }
    if map.damaged_pages() > 0 || rc.damaged_pages() > 0 {
        notes.push(format!(
            "{} block map and {} refcount pages had a damaged copy and no valid one (a first write torn by a crash, rebuilt from the journal; if not, the reference and checksum audit reports the damage)",
            map.damaged_pages(), rc.damaged_pages()
        ));
    }
    Ok(Recovered { map, rc, journal, counters, notes })
}
