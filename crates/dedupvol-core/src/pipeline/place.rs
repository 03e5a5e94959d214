//! Stage 4 (state lock held): where each chunk goes — a verified duplicate, a fragment
//! in the open run (its own, or the extent it was compressed in), or a raw block — and
//! the journalled mapping change.
//!
//! Invariants:
//! - Every page a batch touches is loaded before the first change, so a metadata read
//!   error fails the request without changing anything.
//! - A fragment never starts in a block whose reference count is at the cap (the count
//!   covers every fragment touching the block; the new copy may exist because of the cap).
//! - An extent is packed once, when the first of its chunks is stored; its other chunks
//!   map to the same fragment.
//! - A placed block is staged (or held by the open run) before its mapping is applied,
//!   so a visible mapping always has its data on the device or in memory; a sealed run's
//!   blocks are staged in one go.

use super::lbas::Lbas;
use super::{chunk, Plan, Unit};
use crate::config::Compression;
use crate::data::packer;
use crate::data::writer::write_merged;
use crate::dedup::Claim;
use crate::error::{Error, Result};
use crate::metadata::block_map::{Frag, MapEntry};
use crate::read::cache::Block;
use crate::volume::state::State;
use crate::volume::Volume;

/// Staged blocks past which `stage` writes under the lock (a batch is at most
/// `WRITE_BLOCKS_PER_BATCH` blocks, so this bounds the buffer at 8 MiB).
const STAGED_BLOCKS_HARD_MAX: usize = 2048;
/// Room a new run reserves at once (32 KiB): blocks allocated meanwhile for raw data
/// then land after it, not in the way of its growth.
const RUN_RESERVE_BYTES: u64 = 128 << 10;

impl Volume {
    /// Places every chunk of a batch and applies its mapping change; returns the last
    /// journal sequence used. `looked_up_at` is the reuse generation of stage 2.
    pub(crate) fn place_batch(
        &self,
        st: &mut State,
        lbas: &Lbas,
        buf: &[u8],
        plans: &mut [Plan],
        units: &mut [Unit],
        looked_up_at: u64,
    ) -> Result<u64> {
        for i in 0..plans.len() {
            st.map.get(lbas.at(i))?;
        }
        let mut last = st.journal.last_assigned_seq();
        for (i, p) in plans.iter_mut().enumerate() {
            let e = self.place(st, p, units, chunk(buf, i), looked_up_at)?;
            if let Some(seq) = self.apply_entry(st, lbas.at(i), e)? {
                last = seq;
            }
            self.woj_note_write(lbas.at(i), p, chunk(buf, i));
            st.red.blocks_written += 1;
        }
        Ok(last)
    }

    /// Decides where one chunk goes (docs/design.md, "Sharing or storing a chunk").
    fn place(
        &self,
        st: &mut State,
        p: &mut Plan,
        units: &mut [Unit],
        chunk: &[u8],
        looked_up_at: u64,
    ) -> Result<MapEntry> {
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
                d.frag_codec = self.compression;
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
                let e = loc.entry(0);
                let mut out = [0u8; crate::config::BLOCK_SIZE];
                match crate::data::read_unwritten(packer, staging, &e, &mut out) {
                    Some(ok) => ok && out == chunk,
                    None => crate::dedup::verify::matches(&mut self.cache.lock(), &e, chunk).unwrap_or(false),
                }
            };
            // The decoded blocks of a candidate's unit, as byte verification left them in
            // the content cache (`Deduper::vouched`).
            let unit = |loc: crate::dedup::index::Location| {
                let mut cache = self.cache.lock();
                (0..loc.frag.unit_blocks())
                    .map(|k| cache.get_fragment(loc.pbn, loc.frag.with_sub(k).key()).map(|(b, _)| b))
                    .collect::<Option<Vec<_>>>()
            };
            if let Claim::Share(loc) = dedup.claim(&d.hash, d.cand, looked_up_at, rc, red, in_memory, unit) {
                st.red.dedup_hits += 1;
                return Ok(loc.entry(d.crc));
            }
        }
        // A chunk verified in stage 3, or repeated in its batch, skipped compression; the
        // claim refused its candidate (or its first copy).
        if d.frag.is_none() && self.compression != Compression::None && (d.cand.verified || d.batch_dup) {
            d.frag = packer::compress(self.compression, self.compression_level, chunk);
            d.frag_codec = self.compression;
        }
        // The chunk's extent, packed by the first of its chunks stored.
        let in_unit = match d.unit.and_then(|(u, sub)| units.get_mut(u).map(|unit| (unit, sub))) {
            Some((unit, sub)) => {
                let placed = match unit.placed {
                    Some(at) => Some(at),
                    None => {
                        let at = self.pack(st, &unit.frag)?;
                        unit.placed = at;
                        at
                    }
                };
                placed.map(|(pbn, off)| {
                    let f = Frag::new(unit.codec.code(), off, unit.frag.len() as u16, unit.blocks, sub);
                    MapEntry::fragment(pbn, f, d.crc)
                })
            }
            None => None,
        };
        if d.unit.is_some() && in_unit.is_none() && d.frag.is_none() && d.raw.is_none() {
            // No run could take the extent (free space too scattered): the chunk alone.
            d.frag = packer::compress(self.compression, self.compression_level, chunk);
            d.frag_codec = self.compression;
        }
        let single = match (in_unit, d.frag.as_deref()) {
            (Some(e), _) => Some(e),
            (None, Some(f)) => self.pack(st, f)?.map(|(pbn, off)| {
                debug_assert!(d.frag_codec != Compression::None, "a fragment records the codec that made it");
                MapEntry::fragment(pbn, Frag::new(d.frag_codec.code(), off, f.len() as u16, 1, 0), d.crc)
            }),
            (None, None) => None,
        };
        let e = match single {
            Some(e) => {
                st.red.compressed_blocks += 1;
                e
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

    /// Appends a fragment to the open run, growing the run into the free blocks after it
    /// or sealing it and opening a new one when it lacks room; returns the fragment's first
    /// block and offset. None when no run can take it (a fragment longer than the free
    /// blocks in a row the allocator finds): the caller stores the data otherwise.
    pub(crate) fn pack(&self, st: &mut State, frag: &[u8]) -> Result<Option<(u64, u16)>> {
        let len = frag.len() as u64;
        if let Some((tail, _)) = st.packer.tail() {
            self.grow_run(st, len);
            let room = st.packer.tail().map_or(0, |(_, r)| r);
            if room >= len && st.rc.get(tail) < st.rc.cap() {
                return Ok(st.packer.try_add(frag));
            }
            self.seal_packer(st)?;
        }
        let pbn = self.alloc_block(st)?;
        st.packer.open(pbn);
        self.grow_run(st, len.max(RUN_RESERVE_BYTES));
        if st.packer.tail().is_some_and(|(_, room)| room >= len) {
            return Ok(st.packer.try_add(frag));
        }
        self.seal_packer(st)?;
        Ok(None)
    }

    /// Reserves the free blocks right after the open run until it has `want` bytes of
    /// room, it is full, or the next block is busy.
    fn grow_run(&self, st: &mut State, want: u64) {
        while let (Some((_, room)), Some(next)) = (st.packer.tail(), st.packer.next_block()) {
            if room >= want || !st.alloc.try_reserve(next) {
                break;
            }
            self.prepare_block(st, next);
            st.packer.extend(next);
        }
    }

    /// A free data block; its cached copy (the block's previous life) is dropped, so no
    /// index entry for that content verifies against it while the block is refilled.
    pub(crate) fn alloc_block(&self, st: &mut State) -> Result<u64> {
        if let Some(p) = st.alloc.alloc() {
            self.prepare_block(st, p);
            return Ok(p);
        }
        Err(Error::NoSpace(format!(
            "all {} data blocks are in use ({} await a flush to be reused)",
            self.data.blocks(),
            st.alloc.pending_len()
        )))
    }

    /// A block just taken from the allocator: checked free, and its cached copy (the
    /// block's previous life) dropped with the decoded blocks of fragments that may run
    /// into it, so no index entry for that content verifies against it while the block is
    /// refilled.
    fn prepare_block(&self, st: &State, p: u64) {
        // A referenced block, or one an unwritten batch still answers for, would have
        // its content replaced under a live mapping.
        assert!(
            st.rc.get(p) == 0 && st.staging.get(p).is_none(),
            "allocator handed out block {p} (count {}, unwritten copy {})",
            st.rc.get(p),
            st.staging.get(p).is_some()
        );
        self.cache.lock().remove_for_reuse(p);
    }

    /// Writes the open run's filled blocks (staged together) and unreserves the rest.
    pub(crate) fn seal_packer(&self, st: &mut State) -> Result<()> {
        let sealed = st.packer.seal();
        for pbn in sealed.unused {
            st.alloc.unreserve(pbn);
        }
        for (pbn, block) in &sealed.blocks {
            self.tier_on_seal(st, *pbn, block);
        }
        st.red.packed_blocks_written += sealed.blocks.len() as u64;
        if self.cache_writes {
            let mut cache = self.cache.lock();
            for (pbn, block) in &sealed.blocks {
                cache.put(*pbn, block.clone(), crate::read::cache::block_crc(block));
            }
        }
        for (pbn, block) in sealed.blocks {
            st.staging.push(pbn, block);
        }
        if st.staging.staged_len() >= STAGED_BLOCKS_HARD_MAX {
            write_merged(&self.data, st.staging.take_for_inline_write(), false)?;
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
