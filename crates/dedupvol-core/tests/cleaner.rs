//! The cleaner: partly dead extents and blocks are compacted, reads stay right, the
//! volume checks clean, and what it moved survives a crash.

mod common;

use common::{block, mem_volume, small_open};
use dedupvol_core::{check_volume, CleanOptions, Storage, Volume};
use std::sync::Arc;

const B: u64 = 4096;

#[test]
fn a_pass_reclaims_dead_extent_blocks_and_keeps_every_block_readable() {
    let (dev, vol) = mem_volume(64 << 20, 16 << 20, |_| {});
    // 4 MiB written in 128 KiB requests: extents of 16 blocks.
    let blocks = 1024u64;
    let data: Vec<u8> = (0..blocks).flat_map(|i| block(i, 0)).collect();
    for k in 0..blocks / 32 {
        let at = (k * 32 * B) as usize;
        vol.write(k * 32 * B, &data[at..at + 32 * B as usize], false).expect("write");
    }
    // Three blocks in four overwritten, one at a time: every extent keeps a quarter alive.
    let mut want = data.clone();
    for i in (0..blocks).filter(|i| i % 4 != 0) {
        let b = block(100_000 + i, 0);
        vol.write(i * B, &b, false).expect("overwrite");
        want[(i * B) as usize..((i + 1) * B) as usize].copy_from_slice(&b);
    }
    vol.flush().expect("flush");
    let before = vol.stats();
    let r = vol.clean(&CleanOptions::default()).expect("clean");
    vol.flush().expect("flush");
    let after = vol.stats();
    assert!(r.fragments_moved > 0 && r.blocks_remapped > 0, "{r:?}");
    assert!(
        after.data_blocks_used < before.data_blocks_used,
        "nothing reclaimed: {} -> {} blocks ({r:?})",
        before.data_blocks_used,
        after.data_blocks_used
    );
    assert_eq!(after.counters.cleaner_bytes_moved, r.bytes_moved);
    let mut back = vec![0u8; want.len()];
    vol.read(0, &mut back).expect("read");
    assert!(back == want, "content changed by the cleaner");
    // A second pass finds less to do.
    let r2 = vol.clean(&CleanOptions::default()).expect("clean again");
    assert!(r2.bytes_moved <= r.bytes_moved, "{r2:?} after {r:?}");
    // Crash without a close: the moves committed by the flush above survive, and the
    // second pass's moves, not committed, leave the old mappings.
    drop(vol);
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &small_open()).expect("recover");
    vol.read(0, &mut back).expect("read after the crash");
    assert!(back == want, "content changed across the crash");
    vol.close().expect("close");
    let rep = check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
    assert!(rep.is_clean(), "{:?}", rep.problems);
}
