//! The reduction pipeline: how a batch of whole 4 KiB chunks becomes mapping changes.
//!
//! Stages, in the order `Volume::write_batch_once` runs them (docs/design.md, "A write"):
//! 1. `fingerprint` (no lock, parallel): zero check, the weak hash and the write-once
//!    journaling candidate (WOJ on), crc32c and BLAKE3 fingerprint (dedup on) of the chunks
//!    without a WOJ candidate, computed by the volume's `offload` backend;
//! 2. `reduce::resolve_woj`, `reduce::find_candidates` (state lock): journal copies, and
//!    dedup candidates from the index;
//! 3. `reduce::verify_and_compress` (no lock, parallel): byte verification of
//!    candidates, then compression of the chunks without a verified duplicate: runs of
//!    consecutive compressible chunks as extents of up to `UNIT_BLOCKS_MAX` blocks, the
//!    others alone, compressed by the `offload` backend;
//! 4. `place` (state lock): the dedup claim, packing (an extent once, for its first
//!    chunk stored) or a raw block, staging, and the journalled mapping change.
//!
//! Invariants:
//! - A batch holds at most `WRITE_BLOCKS_PER_BATCH` chunks, which bounds the state-lock
//!   hold of stages 2 and 4 and the memory of one batch's plans, whatever the request size.
//! - Stages 1 and 3 take no volume lock; everything they decide is re-checked in stage 4.
//! - A backend's results are used only as `offload::Offloader` passed them: checked, for a
//!   backend the volume was given.
//! - The index is asked and told only under a chunk's real BLAKE3 fingerprint (`hashed`):
//!   a chunk that skipped BLAKE3 for a WOJ candidate gets it in stage 3 or 4 when the
//!   candidate falls through.
//! - A chunk is stored, or shared by the index, only with its own crc32c (`crc_done`); a
//!   chunk shared with its journal copy takes the copy's crc, the bytes being equal.

pub(crate) mod batcher;
pub(crate) mod blake3_many;
pub(crate) mod defer;
pub(crate) mod executor;
pub(crate) mod fingerprint;
pub(crate) mod lbas;
pub(crate) mod offload;
pub(crate) mod place;
pub(crate) mod reduce;

use crate::config::{Compression, BLOCK_SIZE_U64};
use crate::dedup::Candidate;
use crate::read::cache::Block;

/// Blocks placed per state-lock hold by one write (4 MiB).
pub(crate) const WRITE_BLOCKS_PER_BATCH: u64 = 1024;

/// How one chunk of a write will be stored.
pub(crate) enum Plan {
    /// All zeros: mapped to the zero state, no data stored.
    Zero,
    /// Data to share or store.
    Data(DataPlan),
}

/// A data chunk's fingerprints and what the stages decided for it so far.
pub(crate) struct DataPlan {
    /// BLAKE3 of the chunk (zero when dedup is off, or not computed yet: see `hashed`).
    pub(crate) hash: [u8; 32],
    /// `hash` was computed. With write-once journaling a chunk that found its journal copy
    /// skips BLAKE3; should the share fall through, it is computed then.
    pub(crate) hashed: bool,
    /// The weak hash (xxh3-64) of write-once journaling (0 when it is off).
    pub(crate) weak: u64,
    /// The write-once journaling candidate (a journal block with the same weak hash).
    pub(crate) woj: Option<crate::woj::WojCand>,
    /// The chunk is written into a file system's journal (write-once journaling): its
    /// stored copy is kept in the content cache, where checkpoint writes compare with it.
    pub(crate) journal: bool,
    /// crc32c of the chunk: the map entry's checksum (valid once `crc_done`).
    pub(crate) crc: u32,
    /// `crc` was computed. A chunk with a WOJ candidate skips it: shared, it takes its
    /// journal copy's crc; should the share fall through, it is computed then
    /// (`ensure_crc`, stage 3 or 4), before anything stores or records the chunk.
    pub(crate) crc_done: bool,
    /// The dedup candidate and whether it is proven equal.
    pub(crate) cand: Candidate,
    /// The compressed fragment of the chunk alone, when compression pays.
    pub(crate) frag: Option<Vec<u8>>,
    /// The codec of `frag`: the volume's, or the fast one when compression was deferred.
    pub(crate) frag_codec: Compression,
    /// The extent the chunk was compressed in (an index into the batch's units) and its
    /// block there.
    pub(crate) unit: Option<(usize, u8)>,
    /// The incompressibility probe turned the chunk away (stage 3).
    pub(crate) incompressible: bool,
    /// An earlier chunk of the same batch has the same fingerprint: stage 4 shares it, so
    /// stage 3 neither puts it in an extent nor compresses it.
    pub(crate) batch_dup: bool,
    /// The chunk's own copy when it will be stored raw, made outside the state lock.
    pub(crate) raw: Option<Block>,
    /// The unique-chunk predictor's guess (None: no predictor): true when the chunk was
    /// predicted unique, so stage 1 compressed it early.
    pub(crate) predicted_unique: Option<bool>,
    /// The incompressibility probe has run (stage 1 for chunks predicted unique).
    pub(crate) probed: bool,
    /// Stage 3 adopted stage 1's compression of the chunk (its fragment, raw copy or
    /// extent are set): nothing is left to compress.
    pub(crate) early: bool,
}

impl DataPlan {
    /// A data chunk's plan with only its weak hash known: nothing computed or decided yet.
    pub(crate) fn new(weak: u64) -> Self {
        DataPlan {
            hash: [0u8; 32],
            hashed: false,
            weak,
            woj: None,
            journal: false,
            crc: 0,
            crc_done: false,
            cand: Candidate::default(),
            frag: None,
            frag_codec: Compression::None,
            unit: None,
            incompressible: false,
            batch_dup: false,
            raw: None,
            predicted_unique: None,
            probed: false,
            early: false,
        }
    }

    /// Computes the chunk's crc32c if it is not known yet.
    pub(crate) fn ensure_crc(&mut self, chunk: &[u8]) {
        if !self.crc_done {
            self.crc = crc32c::crc32c(chunk);
            self.crc_done = true;
        }
    }
}

/// Consecutive chunks of a batch compressed as one unit (an extent).
pub(crate) struct Unit {
    /// Chunks in the unit (2..=`UNIT_BLOCKS_MAX`).
    pub(crate) blocks: u8,
    /// The compressed unit.
    pub(crate) frag: Vec<u8>,
    /// Its codec: the volume's, or the fast one when compression was deferred.
    pub(crate) codec: Compression,
    /// Where stage 4 packed it: first block and offset (None until a chunk of it is stored).
    pub(crate) placed: Option<(u64, u16)>,
}

/// A piece of a byte range: part of one block, or a run of whole blocks.
pub(crate) struct Segment {
    /// First logical block.
    pub(crate) lba: u64,
    /// Byte offset inside that block (0 for whole blocks).
    pub(crate) within: usize,
    /// Offset of the piece from the start of the range.
    pub(crate) pos: u64,
    /// Length of the piece in bytes.
    pub(crate) len: u64,
    /// True for a run of whole blocks.
    pub(crate) whole: bool,
}

/// Splits `offset..offset+len` into partial-block pieces and whole-block runs of at most
/// `max_blocks` blocks, in order.
pub(crate) fn segments(offset: u64, len: u64, max_blocks: u64) -> impl Iterator<Item = Segment> {
    let mut pos = 0u64;
    std::iter::from_fn(move || {
        if pos >= len {
            return None;
        }
        let off = offset + pos;
        let lba = off / BLOCK_SIZE_U64;
        let within = (off % BLOCK_SIZE_U64) as usize;
        let left = len - pos;
        let seg = if within != 0 || left < BLOCK_SIZE_U64 {
            Segment { lba, within, pos, len: (BLOCK_SIZE_U64 - within as u64).min(left), whole: false }
        } else {
            Segment { lba, within: 0, pos, len: (left / BLOCK_SIZE_U64).min(max_blocks) * BLOCK_SIZE_U64, whole: true }
        };
        pos += seg.len;
        Some(seg)
    })
}

/// The `i`th 4 KiB chunk of `buf`.
#[expect(clippy::indexing_slicing, reason = "plans are made one per whole chunk of `buf`, and `i` indexes the plans")]
pub(crate) fn chunk(buf: &[u8], i: usize) -> &[u8] {
    let b = crate::config::BLOCK_SIZE;
    &buf[i * b..(i + 1) * b]
}
