//! The fingerprint index across crashes. The index used to be saved only at a clean
//! close: after a kill -9, writing the same 64 MiB again stored a second copy with no
//! dedup at all. Its records now reach the chapter ring with every journal commit and
//! the in-memory index is rebuilt from the ring at open, so a crash loses at most the
//! records of writes that were not durable anyway.
mod common;
use common::*;
use dedupvol_core::{DedupVerify, FormatOptions, IndexMode, MemStorage, OpenOptions, Storage, Volume};
use std::sync::Arc;

const MIB: u64 = 1 << 20;

/// 1 MiB of mixed data (two thirds compressible, one third random) for chunk `c`.
fn chunk(c: u64) -> Vec<u8> {
    (0..256u64).flat_map(|i| block(c * 256 + i, u8::from((c * 256 + i).is_multiple_of(3)))).collect()
}

fn format(dev: &Arc<MemStorage>, tweak: impl FnOnce(&mut FormatOptions)) {
    let mut o = FormatOptions {
        logical_size_bytes: 256 * MIB,
        index_memory_bytes: 4 * MIB,
        slab_size_bytes: MIB,
        ..FormatOptions::default()
    };
    tweak(&mut o);
    Volume::format(dev.clone() as Arc<dyn Storage>, None, &o, false).expect("format");
}

fn open(dev: &Arc<MemStorage>) -> Volume {
    Volume::open(dev.clone() as Arc<dyn Storage>, None, &OpenOptions::default()).expect("open")
}

fn write_range(vol: &Volume, at: u64, chunks: std::ops::Range<u64>) {
    for (i, c) in chunks.enumerate() {
        vol.write(at + i as u64 * MIB, &chunk(c), false).expect("write");
    }
    vol.flush().expect("flush");
}

/// Writes 64 MiB, "crashes" (drops the volume without closing it) or closes cleanly,
/// reopens and writes the same 64 MiB elsewhere. Returns (blocks used after the first
/// copy, after the second, dedup hits of the second).
fn rewrite_after(crash: bool, tweak: impl FnOnce(&mut FormatOptions)) -> (u64, u64, u64) {
    let dev = Arc::new(MemStorage::new(400 * MIB));
    format(&dev, tweak);
    let vol = open(&dev);
    write_range(&vol, 0, 0..64);
    let first = vol.stats().data_blocks_used;
    if crash {
        drop(vol);
    } else {
        vol.close().expect("close");
    }
    let vol = open(&dev);
    vol.wait_index_rebuilt();
    assert!(vol.stats().index.rebuild_records >= 64 * 256 - 256, "{:?}", vol.stats().index);
    write_range(&vol, 128 * MIB, 0..64);
    let s = vol.stats();
    let mut back = vec![0u8; MIB as usize];
    for c in [0u64, 17, 63] {
        vol.read(128 * MIB + c * MIB, &mut back).expect("read");
        assert!(back == chunk(c), "chunk {c} of the second copy reads back wrong");
    }
    vol.close().expect("close");
    let r = dedupvol_core::check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
    assert!(r.is_clean(), "{:?}", r.problems);
    (first, s.data_blocks_used, s.counters.dedup_hits)
}

#[test]
fn a_crash_does_not_forget_dedup() {
    for verify in [DedupVerify::Hash, DedupVerify::Bytes] {
        let (first, second, hits) = rewrite_after(true, |o| o.verify = verify);
        assert!(hits >= 64 * 256 * 99 / 100, "{verify}: only {hits} of {} blocks deduplicated after a crash", 64 * 256);
        assert!(second <= first + first / 100, "{verify}: physical use went from {first} to {second} blocks");
        let (_, clean_second, clean_hits) = rewrite_after(false, |o| o.verify = verify);
        assert!(hits * 100 >= clean_hits * 99, "{verify}: crash {hits} hits, clean close {clean_hits}");
        assert!(second <= clean_second + clean_second / 100);
    }
}

#[test]
fn sparse_mode_dedups_neighbours_of_its_hooks() {
    let (_, _, dense) = rewrite_after(true, |o| o.index_mode = IndexMode::Dense);
    let (first, second, sparse) = rewrite_after(true, |o| o.index_mode = IndexMode::Sparse);
    assert!(sparse * 100 >= dense * 95, "sparse kept {sparse} of dense's {dense} dedup hits");
    assert!(second <= first + first / 20, "sparse: physical use went from {first} to {second} blocks");
}

/// The window is a volume setting: data older than it no longer dedups, newer data does.
#[test]
fn the_ring_wraps_and_drops_the_oldest_chapters() {
    let dev = Arc::new(MemStorage::new(400 * MIB));
    format(&dev, |o| o.dedup_window_bytes = Some(8 * MIB));
    let vol = open(&dev);
    let window = vol.stats().index.window_bytes;
    assert!((8 * MIB..10 * MIB).contains(&window), "window {window}");
    write_range(&vol, 0, 0..32);
    let before = vol.stats().counters.dedup_hits;
    write_range(&vol, 64 * MIB, 0..2);
    let old = vol.stats().counters.dedup_hits - before;
    write_range(&vol, 96 * MIB, 30..32);
    let recent = vol.stats().counters.dedup_hits - before - old;
    assert_eq!(old, 0, "data 30 MiB back, beyond an 8 MiB window, still deduplicated");
    assert_eq!(recent, 512, "data 2 MiB back did not deduplicate");
    let s = vol.stats().index;
    assert_eq!(s.chapters_used, s.chapters, "the ring has wrapped");
    vol.close().expect("close");
}

/// The rebuild at open used to run before `open` returned, at about 140 MB/s of chapters,
/// so a large window kept a volume from accepting I/O for seconds to minutes. It now runs
/// beside the writers: a volume opened with a rebuild still to do must serve reads and
/// writes correctly (records not rebuilt yet only miss duplicates), dedup what it has
/// rebuilt, and close cleanly in the middle of it.
#[test]
fn writes_during_a_rebuild_are_correct_and_close_stops_it() {
    let dev = Arc::new(MemStorage::new(400 * MIB));
    format(&dev, |_| {});
    let vol = open(&dev);
    write_range(&vol, 0, 0..64);
    drop(vol);
    let manual = OpenOptions { index_rebuild: dedupvol_core::IndexRebuild::Manual, ..OpenOptions::default() };
    // Nothing rebuilt yet: the same data is stored again, and reads back right.
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &manual).expect("open");
    assert!(vol.stats().index.rebuild_running, "{:?}", vol.stats().index);
    write_range(&vol, 64 * MIB, 0..4);
    let before = vol.stats().counters.dedup_hits;
    // One step rebuilds up to 8 MiB of chapters: the whole window here.
    assert!(vol.index_rebuild_step() || !vol.stats().index.rebuild_running);
    while vol.index_rebuild_step() {}
    let s = vol.stats().index;
    assert!(!s.rebuild_running && s.rebuild_chapters_done == s.rebuild_chapters_total, "{s:?}");
    write_range(&vol, 128 * MIB, 4..64);
    let hits = vol.stats().counters.dedup_hits - before;
    assert!(hits >= 60 * 256 * 99 / 100, "only {hits} duplicates found once rebuilt");
    let mut back = vec![0u8; MIB as usize];
    for (at, c) in [(64 * MIB, 0u64), (67 * MIB, 3), (128 * MIB, 4), (187 * MIB, 63)] {
        vol.read(at, &mut back).expect("read");
        assert!(back == chunk(c), "chunk {c} at {at} reads back wrong");
    }
    drop(vol);
    // A clean close in the middle of a rebuild.
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &manual).expect("open");
    write_range(&vol, 200 * MIB, 0..2);
    vol.close().expect("close while rebuilding");
    let bg = OpenOptions { index_rebuild: dedupvol_core::IndexRebuild::Background, ..OpenOptions::default() };
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &bg).expect("open");
    vol.close().expect("close right after a background rebuild started");
    let r = dedupvol_core::check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
    assert!(r.is_clean(), "{:?}", r.problems);
}

/// `check` audits the index's records: live ones lead to data with their fingerprint,
/// stale ones (blocks freed by overwrites, or reused) are counted, never problems.
#[test]
fn check_counts_live_and_stale_records() {
    let dev = Arc::new(MemStorage::new(400 * MIB));
    format(&dev, |_| {});
    let vol = open(&dev);
    write_range(&vol, 0, 0..8);
    // Overwrite half of it with other data: the first half's records go stale.
    write_range(&vol, 0, 100..104);
    vol.close().expect("close");
    let r = dedupvol_core::check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
    assert!(r.is_clean(), "{:?}", r.problems);
    let x = r.index;
    assert_eq!(x.records, 12 * 256, "{x:?}");
    assert_eq!(x.live, 8 * 256, "{x:?}");
    assert_eq!(x.stale_freed + x.stale_reused, 4 * 256, "{x:?}");
    assert_eq!((x.stale_damaged, x.beyond_data_region, x.not_audited), (0, 0, 0), "{x:?}");
    // Every chapter's names were written (the last one's at the close) and match.
    assert!(x.chapters >= 1, "{x:?}");
    assert_eq!((x.names_compared, x.names_wrong), (x.chapters, 0), "{x:?}");
}
