//! Scrub: every referenced block and metadata page is read from the device and checked;
//! damage is reported with the logical blocks it costs, repaired from a good copy when
//! one exists, and never reported for blocks that clients change while it runs.

mod common;

use common::{block, mem_volume, small_open};
use dedupvol_core::format::Superblock;
use dedupvol_core::{MemStorage, OpenOptions, ScrubOptions, Storage, Volume};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const B: u64 = 4096;

fn data_start(dev: &MemStorage) -> u64 {
    let mut sb = vec![0u8; B as usize];
    dev.read_at(&mut sb, 0).expect("read superblock");
    Superblock::decode(&sb, 0).expect("decode").expect("superblock").geometry.data_start
}

/// The device block (absolute) holding exactly `content`.
fn find_block(dev: &MemStorage, content: &[u8]) -> u64 {
    let start = data_start(dev);
    let mut b = vec![0u8; B as usize];
    (start..dev.len() / B)
        .find(|&blk| {
            dev.read_at(&mut b, blk * B).expect("read");
            b == content
        })
        .expect("content on the device")
}

fn flip(dev: &MemStorage, blk: u64, at: usize) {
    let mut b = vec![0u8; B as usize];
    dev.read_at(&mut b, blk * B).expect("read");
    *b.get_mut(at).expect("a byte inside the block") ^= 0x5a;
    dev.write_at(&b, blk * B).expect("write");
}

fn reopen(dev: &Arc<MemStorage>, cache: bool) -> Volume {
    let opts = if cache { small_open() } else { OpenOptions { content_cache_bytes: 0, ..small_open() } };
    Volume::open(dev.clone() as Arc<dyn Storage>, None, &opts).expect("open")
}

#[test]
fn a_clean_volume_scrubs_clean_and_counts_what_it_read() {
    let (dev, v) = mem_volume(32 << 20, 16 << 20, |o| o.compression = dedupvol_core::Compression::None);
    for l in 0..100 {
        v.write(l * B, &block(l % 60, 1), false).expect("write");
    }
    v.close().expect("close");
    let v = reopen(&dev, false);
    let r = v.scrub(&ScrubOptions::default()).expect("scrub");
    assert!(r.is_clean(), "{r:?}");
    assert_eq!(r.status.blocks_read, 60, "each stored block read once: {r:?}");
    assert_eq!(r.status.logical_blocks_scanned, (16 << 20) / B);
    assert!(r.status.metadata_pages_read > 0);
    let s = v.stats().scrub.expect("stats show the last scrub");
    assert!(!s.running && s.finished_unix.is_some());
    v.close().expect("close");
}

#[test]
fn damage_is_reported_with_its_logical_blocks_and_leaves_deduplication() {
    let (dev, v) = mem_volume(32 << 20, 16 << 20, |o| o.compression = dedupvol_core::Compression::None);
    let victim = block(7, 1);
    v.write(10 * B, &victim, false).expect("write");
    v.write(11 * B, &victim, false).expect("write a duplicate");
    v.write(12 * B, &block(8, 1), false).expect("write");
    v.close().expect("close");
    flip(&dev, find_block(&dev, &victim), 100);
    let v = reopen(&dev, false);
    let r = v.scrub(&ScrubOptions { repair: true, ..ScrubOptions::default() }).expect("scrub");
    assert!(!r.is_clean());
    assert_eq!((r.status.damaged, r.status.repaired, r.status.lost_blocks), (1, 0, 2), "{r:?}");
    assert_eq!(r.damage[0].lbas, vec![10, 11]);
    assert_eq!(r.lost_ranges.len(), 1);
    assert_eq!((r.lost_ranges[0].offset, r.lost_ranges[0].len), (10 * B, 2 * B));
    // Out of deduplication: writing the content again stores a fresh copy, which heals.
    v.write(20 * B, &victim, true).expect("write the content again");
    let mut out = vec![0u8; B as usize];
    v.read(20 * B, &mut out).expect("the new copy reads back");
    assert_eq!(out, victim);
    assert!(v.read(10 * B, &mut out).is_err(), "the damaged block is still an error");
    v.close().expect("close");
}

#[test]
fn repair_rewrites_a_damaged_block_from_the_content_cache() {
    let (dev, v) = mem_volume(32 << 20, 16 << 20, |o| o.compression = dedupvol_core::Compression::None);
    let victim = block(3, 1);
    v.write(5 * B, &victim, true).expect("write");
    let mut out = vec![0u8; B as usize];
    v.read(5 * B, &mut out).expect("read fills the content cache");
    flip(&dev, find_block(&dev, &victim), 9);
    let plain = v.scrub(&ScrubOptions::default()).expect("scrub");
    assert_eq!((plain.status.damaged, plain.status.repaired), (1, 0), "{plain:?}");
    v.close().expect("close");
    // A scrub without repair took the block out of the cache: damage it again and repair.
    let v = reopen(&dev, true);
    let blk = find_block(&dev, &{
        let mut d = victim.clone();
        d[9] ^= 0x5a;
        d
    });
    flip(&dev, blk, 9); // undo: the device holds the good content again
    v.read(5 * B, &mut out).expect("read fills the content cache");
    flip(&dev, blk, 9);
    let r = v.scrub(&ScrubOptions { repair: true, ..ScrubOptions::default() }).expect("scrub");
    assert_eq!((r.status.damaged, r.status.repaired), (1, 1), "{r:?}");
    assert!(r.is_clean());
    assert_eq!(r.damage[0].repaired_from.as_deref(), Some("content cache"));
    v.close().expect("close");
    let v = reopen(&dev, false);
    v.read(5 * B, &mut out).expect("the device holds good data again");
    assert_eq!(out, victim);
    assert!(v.scrub(&ScrubOptions::default()).expect("scrub").is_clean());
    v.close().expect("close");
}

#[test]
fn a_damaged_fragment_costs_only_its_own_blocks() {
    let (dev, v) = mem_volume(32 << 20, 16 << 20, |_| {});
    for l in 0..8 {
        v.write(l * B, &block(l, 0), false).expect("write compressible");
    }
    v.close().expect("close");
    // Written one at a time, the blocks are eight fragments back to back from the start of
    // the first data block: damage the first one's bytes.
    let start = data_start(&dev);
    flip(&dev, start, 1);
    let v = reopen(&dev, false);
    let r = v.scrub(&ScrubOptions::default()).expect("scrub");
    assert_eq!(r.status.damaged, 1, "{r:?}");
    assert_eq!(r.damage[0].slot, Some(0), "the fragment at offset 0, block 0 of its unit");
    assert_eq!(r.status.lost_blocks, 1);
    v.close().expect("close");
}

#[test]
fn a_damaged_page_copy_is_a_metadata_finding() {
    let (dev, v) = mem_volume(32 << 20, 16 << 20, |_| {});
    v.write(0, &block(1, 1), false).expect("write");
    v.close().expect("close");
    let mut sb = vec![0u8; B as usize];
    dev.read_at(&mut sb, 0).expect("read");
    let geo = Superblock::decode(&sb, 0).expect("decode").expect("sb").geometry;
    // Damaged while open (an open replays the journal over a page it finds empty).
    let v = reopen(&dev, false);
    let mut hit = false;
    for slot in 0..2 {
        let at = geo.block_map_start + slot;
        dev.read_at(&mut sb, at * B).expect("read");
        if &sb[..4] == b"DVBM" {
            flip(&dev, at, 2000);
            hit = true;
        }
    }
    assert!(hit, "no copy of block map page 0 at {} ({geo:?})", geo.block_map_start);
    let r = v.scrub(&ScrubOptions::default()).expect("scrub");
    assert!(r.status.metadata_damaged >= 1, "{r:?}");
    assert!(r.metadata.iter().any(|m| m.starts_with("block map page 0")), "{:?}", r.metadata);
}

#[test]
fn a_scrub_during_writes_reports_no_damage_and_honours_its_rate() {
    let (_dev, v) = mem_volume(64 << 20, 32 << 20, |_| {});
    let v = Arc::new(v);
    for l in 0..2048 {
        v.write(l * B, &block(l, (l % 2) as u8), false).expect("write");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (v, stop) = (v.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let l = (i * 7919) % 4096;
                v.write(l * B, &block(l + i, (i % 2) as u8), false).expect("write while scrubbing");
                if i.is_multiple_of(64) {
                    v.discard(((i * 31) % 4096) * B, 8 * B).expect("discard");
                    v.flush().expect("flush");
                }
                i += 1;
            }
            i
        })
    };
    let t = std::time::Instant::now();
    let r = v.scrub(&ScrubOptions { rate_bytes_per_sec: Some(8 << 20), ..ScrubOptions::default() }).expect("scrub");
    let took = t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let writes = writer.join().expect("writer");
    assert!(writes > 0);
    assert_eq!(r.status.damaged, 0, "no damage invented by concurrent writes: {r:?}");
    let floor = r.status.bytes_read as f64 / (8 << 20) as f64;
    assert!(took >= floor * 0.9, "read {} bytes in {took:.2} s at 8 MiB/s", r.status.bytes_read);
    assert!(v.scrub(&ScrubOptions::default()).is_ok(), "a finished scrub lets the next one run");
}

#[test]
fn repair_rewrites_a_damaged_block_from_the_hot_chunk_tier() {
    let (dev, v) = mem_volume(32 << 20, 16 << 20, |o| o.compression = dedupvol_core::Compression::None);
    v.close().expect("close");
    let tier: Arc<dyn Storage> = Arc::new(MemStorage::new(4 << 20));
    let t = dedupvol_core::TierOptions { fill_percent: 100, ..dedupvol_core::TierOptions::storage(tier) };
    let opts = OpenOptions { content_cache_bytes: 0, tier: Some(t), ..small_open() };
    let v = Volume::open(dev.clone() as Arc<dyn Storage>, None, &opts).expect("open with a tier");
    let victim = block(21, 1);
    v.write(9 * B, &victim, true).expect("write");
    v.wait_tier_idle();
    assert!(v.stats().tier.expect("tier").entries > 0, "the fill copied the block to the tier");
    flip(&dev, find_block(&dev, &victim), 1234);
    let r = v.scrub(&ScrubOptions { repair: true, ..ScrubOptions::default() }).expect("scrub");
    assert_eq!((r.status.damaged, r.status.repaired), (1, 1), "{r:?}");
    assert_eq!(r.damage[0].repaired_from.as_deref(), Some("tier"));
    assert_eq!(r.damage[0].lbas, vec![9]);
    v.close().expect("close");
    let v = reopen(&dev, false);
    assert!(v.scrub(&ScrubOptions::default()).expect("scrub").is_clean(), "the device holds good data again");
    v.close().expect("close");
}
