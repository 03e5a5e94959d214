//! The volume's side of write-once journaling (`crate::woj`): discovery through the
//! volume's own read path, the share decision of stage 4, and keeping the weak-hash pool
//! in step with every mapping change of a journal block.
//!
//! Invariants:
//! - A share is made only for a candidate whose bytes were compared equal (stage 2 from
//!   memory, stage 3 from the content cache or a read), whose block is still in use below
//!   the reference cap and not damaged, and when no freed block became reusable since
//!   stage 2 (the reuse generation, as for byte-verified dedup): the compared block is
//!   still the one shared.
//! - The pool is changed only under the state lock (with the mapping change), or by a
//!   discovery, which replaces it whole under a new epoch.

use super::state::State;
use super::Volume;
use crate::config::BLOCK_SIZE_U64;
use crate::metadata::block_map::MapEntry;
use crate::pipeline::Plan;
use crate::woj::{ext4, WojCand, WojMode};

/// Discovery reads through the volume's read path (a client's own writes, cached or not).
struct VolumeReader<'a>(&'a Volume);

impl ext4::Reader for VolumeReader<'_> {
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> bool {
        self.0.read(offset, buf).is_ok()
    }
}

impl Volume {
    /// Finds the journal (auto), or takes the range given, and installs it. No lock held
    /// while reading.
    pub(crate) fn woj_discover(&self) {
        let Some(w) = &self.woj else { return };
        let (mode, fixed) = {
            let g = w.lock();
            (g.mode(), g.fixed())
        };
        let found = match (mode, fixed) {
            (_, Some(f)) => f,
            (WojMode::Auto, None) => ext4::discover(&mut VolumeReader(self), self.logical_size()),
            _ => return,
        };
        w.lock().install(found);
    }

    /// True when a write to these bytes must be followed by a new discovery.
    pub(crate) fn woj_watched(&self, offset: u64, len: u64) -> bool {
        let Some(w) = &self.woj else { return false };
        let first = offset / BLOCK_SIZE_U64;
        let n = (offset + len).div_ceil(BLOCK_SIZE_U64) - first;
        w.lock().watched(first, n)
    }

    /// Stage 4 for a chunk with a WOJ candidate (state lock held): the journal copy's map
    /// entry when the share stands, else None (the chunk is stored). The entry keeps the
    /// copy's crc32c: the chunk's bytes were compared equal to the copy's, so it is the
    /// chunk's too, and the chunk's own was never computed (`fingerprint`).
    pub(crate) fn woj_claim(&self, st: &State, c: &WojCand, looked_up_at: u64) -> Option<MapEntry> {
        let w = self.woj.as_ref()?;
        let e = c.entry?;
        if !c.verified {
            w.lock().stats.collisions += 1;
            return None;
        }
        let refs = st.rc.max_of(&e);
        if st.rc.min_of(&e) == 0
            || refs >= st.rc.cap()
            || st.dedup.is_damaged(e.pbn)
            || st.dedup.generation() != looked_up_at
        {
            w.lock().stats.stale += 1;
            return None;
        }
        // Stage 2 took only data entries.
        assert!(e.is_data(), "WOJ candidate {e:?} is not data");
        w.lock().used(c.j, c.by_read);
        Some(e)
    }

    /// After a chunk's mapping change (state lock held): a chunk written into the journal
    /// enters the pool, unless it is zeros or jbd2's own metadata. (Its raw copy entered
    /// the content cache when it was placed, `place`; a packed one is decoded from its open
    /// block while it is open, else read back once.)
    pub(crate) fn woj_note_write(&self, lba: u64, p: &Plan, chunk: &[u8]) {
        let Some(w) = &self.woj else { return };
        let mut w = w.lock();
        let Some(j) = w.j_of(lba) else { return };
        let weak = match p {
            Plan::Data(_) if ext4::is_jbd2_meta(chunk) => {
                w.stats.journal_meta_blocks += 1;
                None
            }
            Plan::Data(d) => Some(d.weak),
            Plan::Zero => None,
        };
        w.note_journal_write(j, weak);
    }

    /// A journal block's mapping changed (state lock held): its entry leaves the pool.
    pub(crate) fn woj_forget(&self, lba: u64) {
        let Some(w) = &self.woj else { return };
        let mut w = w.lock();
        if let Some(j) = w.j_of(lba) {
            w.forget(j);
        }
    }

    /// After a write that touched a superblock or partition table: looks again.
    pub(crate) fn woj_after_write(&self, watched: bool) {
        if watched {
            self.woj_discover();
        }
    }
}
