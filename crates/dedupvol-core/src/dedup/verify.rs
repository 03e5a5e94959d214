//! Byte verification of a dedup candidate: is the stored copy the same 4 KiB as the chunk?
//!
//! Invariants:
//! - A candidate that cannot be read, or lies outside the data region, is simply not a
//!   duplicate: verification never fails a write.
//! - A block read for verification enters the content cache with `fill`, never `put`, so a
//!   slow verification cannot replace newer content.

use crate::config::BLOCK_SIZE;
use crate::data::packer;
use crate::data::placement::DataDevice;
use crate::dedup::index::Location;
use crate::io::IoKind;
use crate::metadata::block_map::MapEntry;
use crate::read::cache::{Block, ContentCache};
use parking_lot::Mutex;

/// The logical content `e` maps to, from the content cache alone: a raw block, a decoded
/// block of a fragment, or a fragment whose blocks are all cached. None when the cache
/// lacks any of it.
pub(crate) fn from_cache(cache: &mut ContentCache, e: &MapEntry) -> Option<Block> {
    let Some(f) = e.fragment_of() else { return cache.get(e.pbn) };
    if let Some((b, _)) = cache.get_fragment(e.pbn, f.key()) {
        return Some(b);
    }
    let blocks: Vec<Block> = e.blocks().map_while(|p| cache.get(p)).collect();
    if blocks.len() as u64 != e.span() {
        return None;
    }
    decode(e, &blocks.concat())
}

/// Decodes `e`'s block from the contents of its blocks back to back.
fn decode(e: &MapEntry, span: &[u8]) -> Option<Block> {
    let f = e.fragment_of()?;
    let mut out = crate::read::cache::new_block();
    let dst = std::sync::Arc::get_mut(&mut out)?;
    packer::decode_block(e.pbn, &f, span, dst).ok()?;
    Some(out)
}

/// Reads the candidate's content (content cache first, else a verification read of the
/// blocks it touches) and compares it with `chunk`. Takes no volume lock.
pub(crate) fn by_read(data: &DataDevice, cache: &Mutex<ContentCache>, loc: Location, chunk: &[u8]) -> bool {
    let e = loc.entry(0);
    if !e.is_data() || !data.contains(e.pbn) || !data.contains(e.pbn + e.span() - 1) {
        return false;
    }
    if let Some(b) = from_cache(&mut cache.lock(), &e) {
        return *b == *chunk;
    }
    let mut buf = vec![0u8; e.span() as usize * BLOCK_SIZE];
    if data.read(IoKind::Verify, e.pbn, &mut buf, "fingerprint index entry").is_err() {
        return false;
    }
    {
        let mut c = cache.lock();
        for (p, bytes) in e.blocks().zip(buf.chunks_exact(BLOCK_SIZE)) {
            c.fill(p, Block::from(bytes), crate::read::cache::block_crc(bytes));
        }
    }
    match e.fragment_of() {
        None => buf == chunk,
        Some(_) => decode(&e, &buf).is_some_and(|b| *b == *chunk),
    }
}
