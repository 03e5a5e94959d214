//! Stage 4 (state lock held): where each chunk goes — a verified duplicate, a slot in an
//! open packed block, or a raw block — and the journalled mapping change.
//!
//! Invariants:
//! - Every page a batch touches is loaded before the first change, so a metadata read
//!   error fails the request without changing anything.
//! - A fragment never lands in an open packed block whose reference count is at the cap
//!   (the count covers every slot of the block; the new copy exists because of the cap).
//! - A placed block is staged (or written) before its mapping is applied, so a visible
//!   mapping always has its data on the device or in `Staging`.

use super::{chunk, Plan};
use crate::config::Compression;
use crate::data::packer;
use crate::data::writer::write_merged;
use crate::dedup::verify::content_matches;
use crate::dedup::Claim;
use crate::error::{Error, Result};
use crate::metadata::block_map::MapEntry;
use crate::metadata::refcount::REFCOUNT_MAX;
use crate::read::cache::Block;
use crate::volume::state::State;
use crate::volume::Volume;

/// Staged blocks past which `stage` writes under the lock (a batch is at most
/// `WRITE_BLOCKS_PER_BATCH` blocks, so this bounds the buffer at 8 MiB).
const STAGED_BLOCKS_HARD_MAX: usize = 2048;

impl Volume {
    /// Places every chunk of a batch and applies its mapping change; returns the last
    /// journal sequence used. `looked_up_at` is the reuse generation of stage 2.
    pub(crate) fn place_batch(
        &self,
        st: &mut State,
        lba0: u64,
        buf: &[u8],
        plans: &mut [Plan],
        looked_up_at: u64,
    ) -> Result<u64> {
        for i in 0..plans.len() as u64 {
            st.map.get(lba0 + i)?;
        }
        let mut last = st.journal.last_assigned_seq();
        for (i, p) in plans.iter_mut().enumerate() {
            let e = self.place(st, p, chunk(buf, i), looked_up_at)?;
            if let Some(seq) = self.apply_entry(st, lba0 + i as u64, e)? {
                last = seq;
            }
            self.woj_note_write(lba0 + i as u64, p, chunk(buf, i));
            st.red.blocks_written += 1;
        }
        Ok(last)
    }

    /// Decides where one chunk goes (docs/design.md, "Sharing or storing a chunk").
    fn place(&self, st: &mut State, p: &mut Plan, chunk: &[u8], looked_up_at: u64) -> Result<MapEntry> {
        let Plan::Data(d) = p else {
            st.red.zero_blocks += 1;
            return Ok(MapEntry::ZERO);
        };
        if let Some(c) = d.woj.take() {
            if let Some(e) = self.woj_claim(st, &c, looked_up_at) {
                return Ok(e);
            }
            // The share fell through: the chunk is stored like any other.
            if c.verified && d.frag.is_none() && self.compression != Compression::None {
                d.frag = packer::compress(self.compression, self.compression_level, chunk);
            }
        }
        // Stored or shared by the index, a chunk carries its own crc (WOJ skipped it).
        d.ensure_crc(chunk);
        // The index is asked, and told, only under the chunk's real fingerprint.
        if self.dedup && !d.hashed {
            d.hash = *blake3::hash(chunk).as_bytes();
            d.hashed = true;
        }
        if self.dedup {
            let State { dedup, rc, red, packer, staging, .. } = &mut *st;
            let in_memory = |loc: crate::dedup::index::Location| {
                let e = MapEntry { pbn: loc.pbn, state: loc.state, crc: 0 };
                let mut out = [0u8; crate::config::BLOCK_SIZE];
                match crate::data::read_unwritten(packer, staging, &e, &mut out) {
                    Some(ok) => ok && out == chunk,
                    None => {
                        self.cache.lock().get(loc.pbn).is_some_and(|b| content_matches(&b, loc.pbn, loc.state, chunk))
                    }
                }
            };
            if let Claim::Share(loc) = dedup.claim(&d.hash, d.cand, looked_up_at, rc, red, in_memory) {
                st.red.dedup_hits += 1;
                return Ok(MapEntry { pbn: loc.pbn, state: loc.state, crc: d.crc });
            }
        }
        // A chunk verified in stage 3 skipped compression; the claim refused its candidate.
        if d.frag.is_none() && self.compression != Compression::None && d.cand.verified {
            d.frag = packer::compress(self.compression, self.compression_level, chunk);
        }
        let e = match d.frag.as_deref() {
            Some(f) => {
                let (pbn, slot) = self.pack(st, f)?;
                st.red.compressed_blocks += 1;
                MapEntry::packed(pbn, slot, d.crc)
            }
            None => {
                let pbn = self.alloc_block(st)?;
                let block = d.raw.take().unwrap_or_else(|| Block::from(chunk));
                // A journal block is what its checkpoint write will be compared with, maybe
                // a whole journal's worth of writes later: cached as if already read once,
                // so it is not the first thing evicted (the same buffer staging holds).
                let journal_copy = d.journal.then(|| block.clone());
                if let Some(t) = &self.tier {
                    t.offer_written(pbn, &block, false);
                }
                // A raw block is the chunk itself: its crc is the map entry's.
                self.stage(st, pbn, block, Some(d.crc))?;
                if let Some(b) = journal_copy {
                    // `stage` put it already when written blocks are cached.
                    if self.cache_writes {
                        self.cache.lock().touch(pbn);
                    } else {
                        self.cache.lock().put_hot(pbn, b, d.crc);
                    }
                }
                st.red.raw_blocks += 1;
                MapEntry::raw(pbn, d.crc)
            }
        };
        if self.dedup {
            st.dedup.record(&d.hash, &e);
        }
        Ok(e)
    }

    /// Adds a fragment to an open packed block below the reference cap, opening a new
    /// block (and sealing the oldest when all are open) when none takes it.
    fn pack(&self, st: &mut State, frag: &[u8]) -> Result<(u64, u8)> {
        let rc = &st.rc;
        if let Some(placed) = st.packer.try_add(frag, |pbn| rc.get(pbn) < REFCOUNT_MAX) {
            return Ok(placed);
        }
        if !st.packer.can_open() {
            if let Some((pbn, block, _)) = st.packer.seal_oldest() {
                self.tier_on_seal(st, pbn, &block);
                self.stage(st, pbn, block, None)?;
                st.red.packed_blocks_written += 1;
            }
        }
        let pbn = self.alloc_block(st)?;
        st.packer.open(pbn);
        st.packer.try_add(frag, |p| p == pbn).ok_or_else(|| {
            Error::corruption(
                "packer",
                pbn,
                format!("room for a fragment of {} bytes in an empty block", frag.len()),
                "no room",
            )
        })
    }

    /// A free data block; its cached copy (the block's previous life) is dropped, so no
    /// index entry for that content verifies against it while the block is refilled.
    pub(crate) fn alloc_block(&self, st: &mut State) -> Result<u64> {
        if let Some(p) = st.alloc.alloc() {
            // A referenced block, or one an unwritten batch still answers for, would have
            // its content replaced under a live mapping.
            assert!(
                st.rc.get(p) == 0 && st.staging.get(p).is_none(),
                "allocator handed out block {p} (count {}, unwritten copy {})",
                st.rc.get(p),
                st.staging.get(p).is_some()
            );
            self.cache.lock().remove(p);
            return Ok(p);
        }
        Err(Error::NoSpace(format!(
            "all {} data blocks are in use ({} await a flush to be reused)",
            self.data.blocks(),
            st.alloc.pending_len()
        )))
    }

    /// Writes every open packed block that holds fragments.
    pub(crate) fn seal_packer(&self, st: &mut State) -> Result<()> {
        for (pbn, block, count) in st.packer.seal_all() {
            if count == 0 {
                st.alloc.unreserve(pbn);
            } else {
                self.tier_on_seal(st, pbn, &block);
                self.stage(st, pbn, block, None)?;
                st.red.packed_blocks_written += 1;
            }
        }
        Ok(())
    }

    /// Queues a placed data block for writing (and caches it when writes are cached). The
    /// writer that fills the buffer writes it outside the lock; a buffer past its hard
    /// bound (one huge request) is written here.
    pub(crate) fn stage(&self, st: &mut State, pbn: u64, block: Block, crc: Option<u32>) -> Result<()> {
        if self.cache_writes {
            let crc = crc.unwrap_or_else(|| crate::read::cache::block_crc(&block));
            self.cache.lock().put(pbn, block.clone(), crc);
        }
        st.staging.push(pbn, block);
        if st.staging.staged_len() >= STAGED_BLOCKS_HARD_MAX {
            write_merged(&self.data, st.staging.take_for_inline_write(), false)?;
        }
        Ok(())
    }
}
