//! Group commit and checkpoint: how journal entries become durable, and how the journal's
//! space is reclaimed.
//!
//! A commit (docs/design.md, "Durability"):
//! 1. `take_commit` (state lock): seal the packer, write the staged data, encode the
//!    pending entries into journal blocks, note the first ticket not to wait for;
//! 2. `write_commit` (no state lock needed): write the fingerprint index's new record
//!    pages, wait for earlier data writes in flight, sync data, write the journal blocks,
//!    sync them;
//! 3. `finish_commit` (state lock): publish the entries as durable, release freed blocks.
//!
//! Invariants:
//! - Journal blocks are written only after every data block their entries reference is
//!   synced, and a failed data write in flight fails the volume before its journal.
//! - Freed blocks become allocatable only once the entries that freed them are durable,
//!   and after the batches that may still answer for them are forgotten.
//! - Concurrent callers queue on `commit_lock` and find their entries already durable.

use super::state::State;
use super::Volume;
use crate::data::writer::write_merged;
use crate::dedup::index::DirtyPages;
use crate::error::Result;
use crate::metadata::journal::{self, CommitBatch};
use std::sync::atomic::Ordering;

impl Volume {
    /// Step 1 (state lock held). Returns the batch and the first ticket its data sync need
    /// not wait for: every entry in the batch refers to data written already, written
    /// here, or in a write with an earlier ticket.
    fn take_commit(&self, st: &mut State) -> Result<(CommitBatch, u64, DirtyPages)> {
        self.seal_packer(st)?;
        write_merged(&self.data, st.staging.take_for_inline_write(), false)?;
        st.staging.prune(&self.tickets);
        let ticket = self.tickets.next();
        let batch = st.journal.take_batch()?;
        // Taken after the batch: every entry in it was placed, and recorded, before.
        let pages = st.dedup.index_mut().take_dirty();
        self.note_pressure(st);
        Ok((batch, ticket, pages))
    }

    /// Commits what is pending once the journal's pending entries reached the commit point
    /// (`journal_pressure`; no state lock held). Client writes do this after each request
    /// (`after_write`); background passes (the cleaner, the recompressor) remap many blocks
    /// with no client write to commit them, so they call this after each hold: without
    /// it, a pass over gigabytes piles up more entries than the journal holds, and the
    /// commit that finally comes fails the volume (journal overflow).
    pub(crate) fn commit_if_pressed(&self) -> Result<()> {
        if !self.journal_pressure.load(Ordering::Acquire) {
            return Ok(());
        }
        let target = self.state.lock().journal.last_assigned_seq();
        self.commit_to(target)
    }

    /// Records whether pending journal entries call for a commit (state lock held).
    pub(crate) fn note_pressure(&self, st: &State) {
        let full = st.journal.pending_len() >= st.journal.pending_entries_max();
        self.journal_pressure.store(full, Ordering::Release);
    }

    /// Step 2: waits for the data writes in flight with a ticket below `ticket`, then
    /// syncs data, writes the journal blocks and syncs them. Needs no state lock (and may
    /// hold it: finishing writers never take it).
    /// The open chapter's new index pages go out with the journal blocks, under the same
    /// sync (their failure costs dedup only).
    fn write_commit(&self, batch: &CommitBatch, ticket: u64, pages: &DirtyPages) -> Result<()> {
        crate::dedup::index::write_pages(&self.meta, pages);
        if batch.blocks.is_empty() {
            return Ok(());
        }
        self.tickets.wait_below(ticket);
        // A failed in-flight write leaves the device state unknown: no journal for it.
        self.check_not_failed()?;
        self.data.sync()?;
        journal::write_batch(&self.meta, batch)?;
        self.meta.sync()
    }

    /// Step 3 (state lock held): publishes a written batch as durable.
    fn finish_commit(&self, st: &mut State, batch: &CommitBatch) {
        if batch.blocks.is_empty() {
            return;
        }
        st.journal.mark_durable(batch.last_seq);
        // The commit waited for every data write issued before it: forget those batches
        // now, before blocks are released below, so no completed batch can answer for a
        // block after it is reused (and reads after a flush see the device).
        st.staging.prune(&self.tickets);
        st.map.note_synced();
        st.rc.note_synced();
        let rc = &st.rc;
        if st.alloc.release_durable(batch.last_seq, |pbn| rc.get(pbn) == 0) > 0 {
            st.dedup.note_reuse();
        }
        st.red.commits += 1;
    }

    /// Makes every journal entry up to `target` durable.
    pub(crate) fn commit_to(&self, target: u64) -> Result<()> {
        let _c = self.commit_lock.lock();
        self.check_not_failed()?;
        let (batch, ticket, pages) = {
            let mut st = self.state.lock();
            if st.journal.durable_seq() >= target && !st.packer.has_fragments() {
                return Ok(());
            }
            let r = self.take_commit(&mut st);
            self.guard(r)?
        };
        let r = self.write_commit(&batch, ticket, &pages);
        self.guard(r)?;
        let mut st = self.state.lock();
        self.finish_commit(&mut st, &batch);
        if st.journal.wants_checkpoint() {
            let r = self.checkpoint(&mut st).and_then(|()| self.persist_counters(&st));
            self.guard(r)?;
        }
        let durable = st.journal.durable_seq();
        let r = st.map.evict(durable);
        self.guard(r)
    }

    /// Commits everything, writes every dirty page, syncs, and reclaims journal space.
    /// Caller holds the commit lock and the state lock.
    pub(crate) fn checkpoint(&self, st: &mut State) -> Result<()> {
        let (batch, ticket, pages) = self.take_commit(st)?;
        self.write_commit(&batch, ticket, &pages)?;
        self.finish_commit(st, &batch);
        let durable = st.journal.durable_seq();
        st.map.write_dirty(durable)?;
        st.rc.write_dirty(durable)?;
        self.meta.sync()?;
        st.map.note_synced();
        st.rc.note_synced();
        st.journal.note_checkpointed();
        st.red.checkpoints += 1;
        #[cfg(feature = "verify")]
        self.audit_checkpoint(st)?;
        Ok(())
    }

    /// After a checkpoint every structure passes its audit, every page is clean and the
    /// journal is empty (the `verify` feature). A violation fails the checkpoint, and with
    /// it the volume, with the structure named.
    #[cfg(feature = "verify")]
    fn audit_checkpoint(&self, st: &State) -> Result<()> {
        let left = (st.map.dirty_pages(), st.rc.dirty_pages(), st.journal.used_blocks(), st.journal.pending_len());
        let r = match left {
            (0, 0, 0, 0) => self.audit_structures(st),
            (m, r, j, p) => Err(format!(
                "checkpoint left {m} block map and {r} refcount pages dirty, {j} journal blocks live, {p} entries pending"
            )),
        };
        r.map_err(|m| crate::error::Error::internal("structure audit at checkpoint", m))
    }
}
