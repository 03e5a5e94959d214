//! Lifetime counters persist with the volume.
//!
//! The bug this pins: `dedupvol stats` on a closed volume printed only the counters of the
//! `stats` process itself, so after importing data it said `blocks_written 0`. The
//! counters now live in the superblock: written after every checkpoint and at close,
//! loaded at open, and added to by the process that has the volume open.
mod common;
use common::*;
use dedupvol_core::{OpenOptions, Storage, Volume};
use std::sync::Arc;

fn reopen(dev: &Arc<dedupvol_core::MemStorage>, read_only: bool) -> Volume {
    let opts = OpenOptions { read_only, ..small_open() };
    Volume::open(dev.clone() as Arc<dyn Storage>, None, &opts).expect("reopen")
}

#[test]
fn lifetime_counters_survive_close_and_add_up_across_opens() {
    let (dev, vol) = mem_volume(32 << 20, 8 << 20, |_| {});
    for lba in 0..100u64 {
        // 80 distinct blocks, then 20 duplicates of the first ones.
        vol.write(lba * 4096, &block(lba % 80, (lba % 2) as u8), false).expect("write");
    }
    vol.close().expect("close");

    let ro = reopen(&dev, true);
    let s = ro.stats();
    assert_eq!(s.counters.blocks_written, 0, "this process wrote nothing");
    assert_eq!(s.lifetime.blocks_written, 100);
    assert_eq!(s.lifetime.dedup_hits, 20);
    assert_eq!((s.lifetime.read_write_opens, s.lifetime.recoveries), (1, 0));
    assert!(s.lifetime.data_write_bytes > 0 && s.lifetime.metadata_write_bytes > 0 && s.lifetime.syncs > 0);
    drop(ro);
    // A read-only open adds nothing, and a second read-write open adds its own writes.
    let vol = reopen(&dev, false);
    vol.write(0, &block(1000, 1), false).expect("write");
    assert_eq!(vol.stats().lifetime.blocks_written, 101, "live figure: loaded plus this process");
    vol.close().expect("close");
    let s = reopen(&dev, true).stats();
    assert_eq!(s.lifetime.blocks_written, 101);
    assert_eq!(s.lifetime.read_write_opens, 2);
}

#[test]
fn after_a_crash_the_lifetime_counters_stand_as_of_the_last_checkpoint() {
    // A 256 KiB journal (64 blocks) checkpoints after about 32 commits.
    let (dev, vol) = mem_volume(32 << 20, 8 << 20, |o| o.journal_size_bytes = Some(256 << 10));
    let mut at_checkpoint = None;
    for lba in 0..500u64 {
        vol.write(lba * 4096, &block(lba, 1), false).expect("write");
        vol.flush().expect("flush");
        let s = vol.stats();
        if s.counters.checkpoints > 0 {
            at_checkpoint = Some(s.lifetime);
            break;
        }
    }
    let at_checkpoint = at_checkpoint.expect("a checkpoint within 500 flushed writes");
    assert!(at_checkpoint.blocks_written > 0);
    // Flushed but not checkpointed: the data survives the crash, these counts do not.
    for lba in 600..605u64 {
        vol.write(lba * 4096, &block(lba, 1), false).expect("write");
    }
    vol.flush().expect("flush");
    assert_eq!(vol.stats().counters.checkpoints, 1, "the test needs no second checkpoint");
    drop(vol); // no close: the process-crash case

    let vol = reopen(&dev, false);
    let s = vol.stats();
    assert_eq!(s.lifetime.blocks_written, at_checkpoint.blocks_written);
    assert_eq!(s.lifetime.commits, at_checkpoint.commits);
    assert_eq!(s.lifetime.checkpoints, 1);
    assert_eq!((s.lifetime.read_write_opens, s.lifetime.recoveries), (2, 1), "the recovery is counted");
    let mut b = vec![0u8; 4096];
    vol.read(604 * 4096, &mut b).expect("read");
    assert_eq!(b, block(604, 1), "flushed data survives");
    vol.close().expect("close");
    let s = reopen(&dev, true).stats();
    assert_eq!(s.lifetime.recoveries, 1);
    assert_eq!(s.lifetime.blocks_written, at_checkpoint.blocks_written);
}
