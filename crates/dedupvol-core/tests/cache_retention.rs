//! Overwriting data must not evict the cached copies of the blocks around the freed one.
//! Only a fragment's death can leave tails of dead fragments in the blocks before it, and
//! then only the decoded copies of fragments starting there are dropped: the physical
//! blocks are live and unchanged.
mod common;
use common::*;
use dedupvol_core::{OpenOptions, Storage, Volume};
use std::sync::Arc;

/// A volume with an 8 MiB content cache filled by writes, `n` blocks of `kind` (see
/// `block`) written one request each from lba 0, flushed, and read once.
fn written_and_read(n: u64, kind: u8) -> Volume {
    let (dev, vol) = mem_volume(64 << 20, 16 << 20, |_| {});
    vol.close().expect("close");
    let opts = OpenOptions { content_cache_bytes: 8 << 20, cache_writes: Some(true), ..small_open() };
    let vol = Volume::open(dev as Arc<dyn Storage>, None, &opts).expect("open");
    for lba in 0..n {
        vol.write(lba * 4096, &block(1_000 + lba, kind), false).expect("write");
    }
    vol.flush().expect("flush");
    let mut b = vec![0u8; 4096];
    for lba in 0..n {
        vol.read(lba * 4096, &mut b).expect("read");
    }
    vol
}

#[test]
fn overwriting_raw_blocks_keeps_their_neighbours_cached() {
    // 64 incompressible blocks, one request each (raw blocks, consecutive on the device).
    let vol = written_and_read(64, 1);
    let mut b = vec![0u8; 4096];
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

#[test]
fn a_fragments_death_keeps_its_neighbours_physical_blocks_cached() {
    // 256 compressible blocks, one request each: single-block fragments packed several to
    // a physical block, some running on into the next.
    let n = 256u64;
    let vol = written_and_read(n, 0);
    let mut b = vec![0u8; 4096];
    let used_before = vol.stats().physical_data_bytes_used;
    // Overwrite a run in the middle with incompressible data: every fragment of the
    // physical blocks inside it dies, so those blocks are freed and the rule about the
    // blocks before them runs.
    let (lo, hi) = (96u64, 160u64);
    for lba in lo..hi {
        vol.write(lba * 4096, &block(9_000 + lba, 1), false).expect("overwrite");
    }
    vol.flush().expect("flush");
    let s = vol.stats();
    assert!(
        s.physical_data_bytes_used < used_before + (hi - lo) * 4096,
        "the overwrite freed no packed block, so the test proves nothing"
    );
    let before = s.counters;
    for lba in (0..n).filter(|l| !(lo..hi).contains(l)) {
        vol.read(lba * 4096, &mut b).expect("read");
        assert!(b == block(1_000 + lba, 0), "block {lba}");
    }
    let after = vol.stats().counters;
    let misses = after.content_cache_misses - before.content_cache_misses;
    assert_eq!(misses, 0, "reads of live fragments missed the cache {misses} times after a run of fragments died");
    vol.close().expect("close");
}
