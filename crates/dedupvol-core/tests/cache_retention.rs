//! Overwriting raw (incompressible) data must not evict the cached copies of the blocks
//! around the freed one: only a fragment's death can leave tails of dead fragments in the
//! blocks before it, so only then are their cached copies dropped.
mod common;
use common::*;
use dedupvol_core::{OpenOptions, Storage, Volume};
use std::sync::Arc;

#[test]
fn overwriting_raw_blocks_keeps_their_neighbours_cached() {
    let (dev, vol) = mem_volume(64 << 20, 16 << 20, |_| {});
    vol.close().expect("close");
    let opts = OpenOptions { content_cache_bytes: 8 << 20, cache_writes: Some(true), ..small_open() };
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &opts).expect("open");
    // 64 incompressible blocks, one request each (raw blocks, consecutive on the device).
    for lba in 0..64u64 {
        vol.write(lba * 4096, &block(1_000 + lba, 1), false).expect("write");
    }
    vol.flush().expect("flush");
    let mut b = vec![0u8; 4096];
    for lba in 0..64u64 {
        vol.read(lba * 4096, &mut b).expect("read");
    }
    // Overwrite every fourth block: each frees the raw block that held it.
    for lba in (3..64u64).step_by(4) {
        vol.write(lba * 4096, &block(9_000 + lba, 1), false).expect("overwrite");
    }
    vol.flush().expect("flush");
    let before = vol.stats().counters;
    for lba in (0..64u64).filter(|l| l % 4 != 3) {
        vol.read(lba * 4096, &mut b).expect("read");
        assert!(b == block(1_000 + lba, 1), "block {lba}");
    }
    let after = vol.stats().counters;
    let misses = after.content_cache_misses - before.content_cache_misses;
    assert_eq!(
        misses, 0,
        "reads of untouched raw blocks missed the cache {misses} times after their neighbours were overwritten"
    );
    vol.close().expect("close");
}
