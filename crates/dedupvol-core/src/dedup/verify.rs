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
use crate::sync::Mutex;

/// Whether the logical content `e` maps to equals `chunk`, from the content cache alone: a
/// raw block, a decoded block of a fragment, or a fragment whose blocks are all cached
/// (then decoded whole: `decode_unit`, its blocks offered to the cache when `e`'s equals
/// `chunk`). None when the cache lacks any of it.
pub(crate) fn matches(cache: &mut ContentCache, e: &MapEntry, chunk: &[u8]) -> Option<bool> {
    let Some(f) = e.fragment_of() else { return cache.get(e.pbn).map(|b| *b == *chunk) };
    if let Some((b, _)) = cache.get_fragment(e.pbn, f.key()) {
        return Some(*b == *chunk);
    }
    let blocks: Vec<Block> = e.blocks().map_while(|p| cache.get(p)).collect();
    if blocks.len() as u64 != e.span() {
        return None;
    }
    let Some((unit, mine)) = decode_unit(e, &blocks.concat()) else { return Some(false) };
    Some(offer_if_equal(cache, e.pbn, unit, &mine, chunk))
}

/// Decodes the whole unit of `e`'s fragment from the contents of its blocks back to back:
/// every block of the unit (its key and content, to offer to the cache as decoded fragment
/// blocks: `offer_if_equal`) and `e`'s own. Why the whole unit: the duplicates of an extent
/// written again arrive block after block, each verified against its own block of the
/// same unit; decoding the unit once instead of up to each block (half a unit on average)
/// cut the CPU of re-importing data stored by an earlier session (whose records are
/// verified byte for byte) several times over for 64 KiB extents. The offered blocks are
/// checked against their map entries' crcs when a read uses them, as every cached block is.
fn decode_unit(e: &MapEntry, span: &[u8]) -> Option<(Vec<(u16, Block)>, Block)> {
    let f = e.fragment_of()?;
    let bytes = packer::fragment_bytes(e.pbn, &f, span).ok()?;
    let mut unit = vec![0u8; f.unit_blocks() * BLOCK_SIZE];
    // Checked end to end: nothing else tells a fragment whose later blocks were reused.
    packer::decompress_checked(e.pbn, &f, bytes, &mut unit).ok()?;
    let blocks: Vec<(u16, Block)> =
        unit.chunks_exact(BLOCK_SIZE).enumerate().map(|(sub, b)| (f.with_sub(sub).key(), Block::from(b))).collect();
    let mine = blocks.get(f.sub())?.1.clone();
    Some((blocks, mine))
}

/// Whether `mine` (the candidate's block of a decoded unit) equals `chunk`; if so, offers
/// every decoded block of the unit starting in `pbn` to the cache. Only then: a unit
/// decoded from blocks reused since (an index record outliving its data) is garbage, and
/// must not replace a live fragment's decoded blocks under the same keys.
fn offer_if_equal(cache: &mut ContentCache, pbn: u64, blocks: Vec<(u16, Block)>, mine: &[u8], chunk: &[u8]) -> bool {
    if mine != chunk {
        return false;
    }
    for (key, b) in blocks {
        let crc = crate::read::cache::block_crc(&b);
        cache.fill_fragment_soon(pbn, key, b, crc);
    }
    true
}

/// Reads the candidate's content (content cache first, else a verification read of the
/// blocks it touches) and compares it with `chunk`. Takes no volume lock.
pub(crate) fn by_read(data: &DataDevice, cache: &Mutex<ContentCache>, loc: Location, chunk: &[u8]) -> bool {
    let e = loc.entry(0);
    if !e.is_data() || !data.contains(e.pbn) || !data.contains(e.pbn + e.span() - 1) {
        return false;
    }
    if let Some(equal) = matches(&mut cache.lock(), &e, chunk) {
        return equal;
    }
    let mut buf = vec![0u8; e.span() as usize * BLOCK_SIZE];
    if data.read(IoKind::Verify, e.pbn, &mut buf, "fingerprint index entry").is_err() {
        return false;
    }
    // Decoded before the cache's lock is taken.
    let unit = e.fragment_of().and_then(|_| decode_unit(&e, &buf));
    let mut c = cache.lock();
    for (p, bytes) in e.blocks().zip(buf.chunks_exact(BLOCK_SIZE)) {
        c.fill(p, Block::from(bytes), crate::read::cache::block_crc(bytes));
    }
    match (e.fragment_of(), unit) {
        (None, _) => buf == chunk,
        (Some(_), Some((blocks, mine))) => offer_if_equal(&mut c, e.pbn, blocks, &mine, chunk),
        (Some(_), None) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Compression;
    use crate::metadata::block_map::Frag;

    fn block_of(p: u64) -> Vec<u8> {
        vec![p as u8; BLOCK_SIZE]
    }

    /// Re-importing data an earlier session stored verifies each duplicate against its
    /// block of a 64 KiB extent; each used to decompress its unit up to that block (a
    /// re-import ran at 83 MB/s where the first ran at 340). The first verification must
    /// leave the whole unit decoded in the cache, so the other fifteen decode nothing.
    #[test]
    fn verifying_one_block_of_an_extent_caches_its_whole_unit() {
        let blocks = 16usize;
        let data: Vec<u8> = (0..blocks * BLOCK_SIZE).map(|i| (i / 7 % 251) as u8 ^ (i / BLOCK_SIZE) as u8).collect();
        let frag = packer::compress(Compression::Zstd, 1, &data).expect("compressible");
        // The fragment at offset 100 of physical block 40, its blocks in the cache raw.
        let mut span = vec![0u8; (100 + frag.len()).div_ceil(BLOCK_SIZE) * BLOCK_SIZE];
        span.get_mut(100..100 + frag.len()).expect("room").copy_from_slice(&frag);
        let f = |sub: usize| Frag::new(Compression::Zstd.code(), 100, frag.len() as u16, blocks as u8, sub as u8);
        // A cache nearly full of other blocks, as during a long import (decoded fragment
        // blocks are otherwise kept only while it has room).
        let mut cache = ContentCache::new(4 << 20);
        for p in 1000..1920u64 {
            cache.fill(p, Block::from(block_of(p)), crate::read::cache::block_crc(&block_of(p)));
        }
        for (k, b) in span.chunks_exact(BLOCK_SIZE).enumerate() {
            cache.fill(40 + k as u64, Block::from(b), crate::read::cache::block_crc(b));
        }
        let block = |sub: usize| data.get(sub * BLOCK_SIZE..(sub + 1) * BLOCK_SIZE).expect("block");
        let e = MapEntry::fragment(40, f(3), crc32c::crc32c(block(3)));
        // A chunk that differs is not a duplicate, and leaves nothing decoded behind (the
        // unit might be garbage decoded from blocks reused since).
        assert_eq!(matches(&mut cache, &e, block(4)), Some(false));
        assert!(cache.get_fragment(40, f(3).key()).is_none(), "a failed comparison offered its unit");
        assert_eq!(matches(&mut cache, &e, block(3)), Some(true), "decoded from the cached blocks");
        for sub in 0..blocks {
            let (b, crc) = cache.get_fragment(40, f(sub).key()).unwrap_or_else(|| panic!("block {sub} not cached"));
            assert!(&*b == block(sub) && crc == crate::read::cache::block_crc(block(sub)), "block {sub}");
        }
    }

    /// A fragment no mapping uses any more, whose second block was freed and reused (a raw
    /// block of other data) while its first block lives on for a neighbour: an index record
    /// naming it must fail verification. zstd decodes such a frame without an error and,
    /// more often than not, with its first block intact; only the frame's checksum tells.
    #[test]
    fn a_fragment_whose_later_block_was_reused_does_not_verify() {
        let blocks = 8usize;
        // Half compressible: runs of a byte, and random stretches.
        let noise = crate::codec::test_random_bytes(0x9e37_79b9_7f4a_7c15, blocks * BLOCK_SIZE);
        let mut data = vec![0u8; blocks * BLOCK_SIZE];
        for (k, (run, random)) in data.chunks_mut(64).zip(noise.chunks(64)).enumerate() {
            if k % 3 == 0 {
                run.copy_from_slice(random);
            } else {
                run.fill((k % 16) as u8);
            }
        }
        let frag = packer::compress(Compression::Zstd, 1, &data).expect("compressible");
        let mut span = vec![0u8; (100 + frag.len()).div_ceil(BLOCK_SIZE) * BLOCK_SIZE];
        assert!(span.len() >= 3 * BLOCK_SIZE, "the fragment runs into a third block");
        span.get_mut(100..100 + frag.len()).expect("room").copy_from_slice(&frag);
        // Block 41 reused: a raw block of other data.
        let other = crate::codec::test_random_bytes(41, BLOCK_SIZE);
        span.get_mut(BLOCK_SIZE..2 * BLOCK_SIZE).expect("block 41").copy_from_slice(&other);
        let mut cache = ContentCache::new(4 << 20);
        for (k, b) in span.chunks_exact(BLOCK_SIZE).enumerate() {
            cache.fill(40 + k as u64, Block::from(b), crate::read::cache::block_crc(b));
        }
        let first = data.get(..BLOCK_SIZE).expect("block 0");
        let f = Frag::new(Compression::Zstd.code(), 100, frag.len() as u16, blocks as u8, 0);
        let e = MapEntry::fragment(40, f, crc32c::crc32c(first));
        assert_eq!(matches(&mut cache, &e, first), Some(false), "the reused block passed for the fragment's");
        assert!(cache.get_fragment(40, f.key()).is_none(), "a unit decoded from a reused block was offered");
    }
}
