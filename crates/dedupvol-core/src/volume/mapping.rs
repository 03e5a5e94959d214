//! Mapping changes: the one place where a logical block's mapping, the reference counts
//! and the journal change together, and the unmapping requests built on it (discard,
//! write-zeroes).
//!
//! Invariants:
//! - Every change is checked before anything changes (`check_inc`/`check_dec`): a refused
//!   reference leaves map, counts and journal as they were, so the request fails alone.
//! - Map, counts and journal change together under the state lock, with the entry's
//!   journal sequence: replay reproduces exactly this change.
//! - A block whose last reference goes is freed only once the change is durable
//!   (`free_later`), and leaves deduplication, the content cache and the hot-chunk tier
//!   at once.
//! - A journal block of write-once journaling whose mapping changes leaves the weak-hash
//!   pool under the same hold (`woj_forget`); a write re-enters it after the change.
//! - A block is queued for the tier only on the transition of its count to exactly the
//!   threshold (packed) or twice it (raw), so a block is offered once per life.

use super::state::State;
use super::Volume;
use crate::config::BLOCK_SIZE_U64;
use crate::error::{Error, Result};
use crate::metadata::block_map::MapEntry;
use crate::pipeline::segments;

use crate::data::packer::fragments_reaching;

/// The bytes of fragment `f` one of its mappings going away leaves dead, for the cleaner's
/// dead-space hint: its share of the unit (an extent of n blocks, each block 1/n of the
/// fragment), rounded up. Why not the whole fragment: a random overwrite of one block of a
/// 16-block extent kills 1/16 of it, and counting the whole fragment for each block ran
/// the cleaner's full-map passes up to 16 times as often as the space dying called for.
/// (A fragment that dedup shares is still counted once per mapping: the hint is a trigger,
/// and a pass sums the real live bytes before it moves anything.)
fn dead_share(f: &crate::metadata::block_map::Frag) -> u64 {
    u64::from(f.len).div_ceil(f.unit_blocks().max(1) as u64)
}

/// Blocks handled per state-lock hold for discard / write-zeroes of large ranges.
const UNMAP_BLOCKS_PER_LOCK: u64 = 8192;

impl Volume {
    /// Journals and applies one mapping change; None when it changes nothing.
    pub(crate) fn apply_entry(&self, st: &mut State, lba: u64, new: MapEntry) -> Result<Option<u64>> {
        let old = st.map.get(lba)?;
        if old == new {
            return Ok(None);
        }
        if new.is_data() {
            st.rc.check_inc(&new)?;
        }
        if old.is_data() {
            st.rc.check_dec(&old)?;
        }
        let seq = st.journal.append(lba, new, old);
        self.woj_forget(lba);
        st.map.set(lba, new, seq)?;
        if new.is_data() {
            st.rc.inc(&new, seq)?;
            self.tier_note_refs(st, &new);
        }
        // A mark set in place (`recompress`) keeps the same fragment in use: nothing died.
        let same_fragment = old.pbn == new.pbn
            && old.fragment_of().zip(new.fragment_of()).is_some_and(|(o, n)| o.unmarked() == n.unmarked());
        if let Some(f) = old.fragment_of().filter(|_| !same_fragment) {
            st.red.dead_fragment_bytes_hint += dead_share(&f);
        }
        if let Some(f) = new.fragment_of().filter(|f| !self.at_rest(f)) {
            st.fast_codec_hint = st.fast_codec_hint.saturating_add(u64::from(f.len));
        }
        if old.is_data() {
            let mut freed: Vec<u64> = Vec::new();
            st.rc.dec(&old, seq, |p| freed.push(p))?;
            for &pbn in &freed {
                st.alloc.free_later(pbn, seq);
                // Nothing can read a block without references: its cached copy only takes
                // room from live blocks (under overwrites, the cache would fill with them).
                self.cache.lock().remove(pbn);
                // Under the same hold that frees it: no tier copy of the block's previous
                // life can be served once it is reused.
                if let Some(t) = &self.tier {
                    t.forget(pbn);
                }
                if st.dedup.note_freed(pbn) {
                    st.red.stamp_wrap_scans += 1;
                }
            }
            // A freed block may hold the tail of dead fragments that start in one of the
            // blocks before it (a fragment touches at most FRAGMENT_SPAN_MAX blocks), whose
            // first blocks live on for their neighbours. Their index records must not be
            // proven by those blocks' reuse stamps any more, nor verified from their
            // decoded copies in the cache, once the freed block can be reused: the stamps
            // are renewed (byte verification then reads the reused block and fails) and
            // the decoded copies of fragments starting there dropped. Their physical
            // blocks stay cached: they are live and unchanged, and a fragment decoded from
            // them and the reused block fails its checksum as one read from the device
            // would. Only blocks freed by a fragment's death can hold such tails: a raw
            // block is never part of a run, so no fragment runs into it, and a block whose
            // last reference was a raw mapping had no fragment touching it (that would have
            // held a reference). Skipping raw frees keeps random overwrites of raw data from
            // renewing their neighbours' stamps.
            let fragment_freed = old.fragment_of().is_some();
            if let (true, Some(&lo), Some(&hi)) = (fragment_freed, freed.iter().min(), freed.iter().max()) {
                let mut cache = self.cache.lock();
                for q in fragments_reaching(lo).start..hi {
                    if st.rc.get(q) > 0 {
                        if st.dedup.void_stamp(q) {
                            st.red.stamp_wrap_scans += 1;
                        }
                        cache.remove_decoded(q);
                    }
                }
            }
        }
        st.counters.apply(&old, &new);
        Ok(Some(seq))
    }

    /// Queues `e`'s block for the hot-chunk tier when its reference count just reached the
    /// threshold (packed blocks) or twice it (raw blocks). A packed block still open in the
    /// packer is left to `tier_on_seal`. State lock held; no I/O.
    fn tier_note_refs(&self, st: &State, e: &MapEntry) {
        let Some(t) = &self.tier else { return };
        let refs = u32::from(st.rc.get(e.pbn));
        let packed = e.fragment_of().is_some();
        let at = if packed { t.promote_refs() } else { t.promote_refs().saturating_mul(2) };
        // A fragment running on into further blocks is left to fills: the tier holds
        // whole blocks, and one block of such a fragment serves no read alone.
        if refs != at || st.packer.is_open(e.pbn) || e.span() > 1 {
            return;
        }
        let content = st.staging.get(e.pbn).cloned().or_else(|| self.cache.lock().peek(e.pbn));
        t.promote_written(e.pbn, content, packed, refs, Some((e.crc, e.fragment_of())));
    }

    /// A packed block being sealed: queued for the tier when its fragments already have
    /// the threshold's references (they were counted while it was open), else offered
    /// as a fill.
    pub(crate) fn tier_on_seal(&self, st: &State, pbn: u64, block: &crate::read::cache::Block) {
        let Some(t) = &self.tier else { return };
        let refs = u32::from(st.rc.get(pbn));
        // A threshold of 0 turns write-path promotion off.
        if t.promote_refs() > 0 && refs >= t.promote_refs() {
            t.promote_written(pbn, Some(block.clone()), true, refs, None);
        } else {
            t.offer_written(pbn, block, true);
        }
    }

    /// Maps a byte range to `to` (unmapped or zero); partial blocks are zeroed in place.
    pub(crate) fn unmap(&self, offset: u64, len: u64, to: MapEntry, fua: bool) -> Result<()> {
        self.check_writable()?;
        self.check_range(offset, len)?;
        let watched = self.woj_watched(offset, len);
        let mut last_seq = 0;
        for seg in segments(offset, len, UNMAP_BLOCKS_PER_LOCK) {
            if !seg.whole {
                let zeros = vec![0u8; seg.len as usize];
                last_seq = last_seq.max(self.rmw(seg.lba, seg.within, &zeros)?);
                continue;
            }
            {
                let mut st = self.state.lock();
                for i in 0..seg.len / BLOCK_SIZE_U64 {
                    match self.apply_entry(&mut st, seg.lba + i, to) {
                        Ok(s) => last_seq = last_seq.max(s.unwrap_or(0)),
                        // Nothing changed yet: a read error loading the first page is clean.
                        Err(e @ Error::Io { .. }) if i == 0 => return Err(e),
                        Err(e) => return self.fail(e),
                    }
                }
                self.note_pressure(&st);
                let durable = st.journal.durable_seq();
                let r = st.map.evict(durable);
                self.guard(r)?;
            }
            self.after_write(false, last_seq)?;
        }
        self.after_write(fua, last_seq)?;
        self.woj_after_write(watched);
        Ok(())
    }
}
