//! Regression tests for two engine bugs that cost data or availability.
//!
//! 1. **A hot block in an open packed block failed the whole volume.** The reference count
//!    covers every slot of a packed block. When a compressible block reached
//!    `REFCOUNT_MAX` references while its packed block was still open, the next duplicate
//!    was (rightly) stored as a new copy — but compressed into the *same* open block, whose
//!    count was at the cap; `Refcounts::inc` then failed half-way through the mapping
//!    change and the volume was marked failed: that write got EIO, and so did every later
//!    write or flush from any client until a restart (`qemu-io -c 'write -P 0x57 0 1M'`;
//!    `yes | head -c 2M > f` on ext4 gave "JBD2: I/O error").
//! 2. **Hash mode deduplicated new writes onto a rotten block.** With `--verify hash` a
//!    duplicate is trusted by fingerprint alone, so after one byte of a stored block
//!    flipped, writing the same content again (elsewhere or at the damaged block) returned
//!    OK and read back EIO; `check --repair` could not heal it and later writes still read
//!    EIO. A block whose checksum failed must leave deduplication at once, and a write of
//!    its content must store a fresh copy.

mod common;

use common::{block, mem_volume, small_open};
use dedupvol_core::format::REFCOUNT_MAX;
use dedupvol_core::{check_volume, check_volume_with, CheckOptions, DedupVerify, MemStorage, Problem, Storage, Volume};
use std::sync::Arc;

const B: usize = 4096;

fn reopen(dev: &Arc<MemStorage>) -> Volume {
    Volume::open(dev.clone() as Arc<dyn Storage>, None, &small_open()).expect("reopen")
}

#[test]
fn many_copies_of_one_compressible_block_in_one_request_do_not_fail_the_volume() {
    let (dev, vol) = mem_volume(64 << 20, 64 << 20, |_| {});
    // One repeated compressible block, more times than the cap, in one request: every
    // reference comes before any flush, so the first copy's run is still open when the
    // cap is reached.
    let one = vec![0x57u8; B];
    let data: Vec<u8> = one.repeat(usize::from(REFCOUNT_MAX) + 96);
    vol.write(0, &data, false).expect("a hot block must never fail a write");
    // Once more, and with two alternating contents, still without a flush.
    let two: Vec<u8> = [block(1, 0), block(2, 0)].concat().repeat(300);
    vol.write(16 << 20, &data, false).expect("second copy");
    vol.write(32 << 20, &two, false).expect("alternating contents");
    // The volume is healthy for everyone: more writes and a flush work.
    vol.write(40 << 20, &block(3, 1), false).expect("later write");
    vol.flush().expect("flush");
    let s = vol.stats();
    assert!(s.counters.refcount_cap_copies >= 2, "cap copies: {}", s.counters.refcount_cap_copies);
    let mut back = vec![0u8; data.len()];
    vol.read(0, &mut back).expect("read");
    assert!(back == data);
    let mut back2 = vec![0u8; two.len()];
    vol.read(32 << 20, &mut back2).expect("read alternating");
    assert!(back2 == two);
    vol.close().expect("close");
    let r = check_volume(dev.clone() as Arc<dyn Storage>, None, false).expect("check");
    assert!(r.is_clean(), "{:?}", r.problems);
}

#[test]
fn hot_block_across_many_small_writes_stays_below_the_cap() {
    let (dev, vol) = mem_volume(64 << 20, 64 << 20, |_| {});
    let one = block(7, 0);
    let n = 3 * usize::from(REFCOUNT_MAX) + 5;
    for i in 0..n {
        vol.write((i * B) as u64, &one, false).expect("write of a hot block");
    }
    vol.flush().expect("flush");
    vol.close().expect("close");
    let vol = reopen(&dev);
    let mut back = vec![0u8; B];
    for i in 0..n {
        vol.read((i * B) as u64, &mut back).expect("read");
        assert!(back == one, "block {i}");
    }
    vol.close().expect("close");
    let r = check_volume(dev.clone() as Arc<dyn Storage>, None, false).expect("check");
    assert!(r.is_clean(), "{:?}", r.problems);
}

/// Device offset of the (single) data block holding exactly `content`.
fn find_block(dev: &MemStorage, vol: &Volume, content: &[u8]) -> u64 {
    let geo = vol.geometry();
    let mut buf = vec![0u8; B];
    for pbn in 0..geo.data_blocks {
        dev.read_at(&mut buf, geo.data_offset(pbn)).expect("read device");
        if buf == content {
            return geo.data_offset(pbn);
        }
    }
    panic!("block not found on the device");
}

fn flip_byte(dev: &MemStorage, at: u64) {
    let mut b = [0u8; 1];
    dev.read_at(&mut b, at).expect("read");
    b[0] ^= 0x40;
    dev.write_at(&b, at).expect("write");
}

#[test]
fn hash_mode_stores_a_fresh_copy_of_a_block_found_rotten() {
    let (dev, vol) = mem_volume(64 << 20, 32 << 20, |o| o.verify = DedupVerify::Hash);
    let content = block(11, 1); // incompressible: stored raw, easy to find
    vol.write(0, &content, false).expect("write");
    vol.flush().expect("flush");
    vol.close().expect("close");
    let vol = reopen(&dev);
    let at = find_block(&dev, &vol, &content);
    flip_byte(&dev, at + 100);
    let mut back = vec![0u8; B];
    assert!(vol.read(0, &mut back).is_err(), "the damage is detected");
    // The same content, written at a new block and at the damaged one, is stored afresh.
    vol.write(B as u64, &content, false).expect("write elsewhere");
    vol.read(B as u64, &mut back).expect("the new copy reads back");
    assert!(back == content);
    vol.write(0, &content, false).expect("rewrite the damaged block");
    vol.flush().expect("flush");
    vol.read(0, &mut back).expect("the rewritten block heals");
    assert!(back == content);
    vol.close().expect("close");
    let r = check_volume(dev.clone() as Arc<dyn Storage>, None, false).expect("check");
    assert!(r.is_clean(), "the damaged block was freed by the rewrite: {:?}", r.problems);
}

#[test]
fn check_repair_takes_a_rotten_block_out_of_dedup_and_can_unmap_what_was_lost() {
    let (dev, vol) = mem_volume(64 << 20, 32 << 20, |o| o.verify = DedupVerify::Hash);
    let content = block(12, 1);
    // Two logical blocks share the copy; a third block is healthy.
    vol.write(0, &content, false).expect("write");
    vol.write(B as u64, &content, false).expect("write duplicate");
    vol.write(2 * B as u64, &block(13, 1), false).expect("write other");
    vol.close().expect("close");
    {
        let vol = reopen(&dev);
        let at = find_block(&dev, &vol, &content);
        vol.close().expect("close");
        flip_byte(&dev, at + 7);
    }
    let data = dev.clone() as Arc<dyn Storage>;
    let r = check_volume(data.clone(), None, false).expect("check");
    let pbn = match r.problems.as_slice() {
        [Problem::ChecksumMismatch { pbn, slot: None, lbas }] => {
            assert_eq!(lbas, &[0, 1]);
            *pbn
        }
        other => panic!("expected one checksum problem, got {other:?}"),
    };
    assert_eq!(r.lost_blocks, 2);
    assert_eq!(r.lost_ranges.len(), 1);
    assert_eq!((r.lost_ranges[0].offset, r.lost_ranges[0].len), (0, 2 * B as u64));

    // --repair: counts are fine, the lost data stays reported, and a write of the block's
    // content after the repair stores a fresh copy (its record is of an earlier session,
    // compared byte for byte, which the damage fails).
    let r = check_volume_with(data.clone(), None, CheckOptions { repair: true, ..CheckOptions::default() })
        .expect("repair");
    assert!(!r.unrepaired.is_empty() && !r.lost_unmapped);
    let vol = reopen(&dev);
    vol.write(8 * B as u64, &content, false).expect("write after repair");
    let mut back = vec![0u8; B];
    vol.read(8 * B as u64, &mut back).expect("fresh copy reads back");
    assert!(back == content);
    assert!(vol.read(0, &mut back).is_err(), "the lost block still reports its loss");
    vol.close().expect("close");

    // --repair --unmap-lost: the lost blocks read as zeros, the volume is clean, the
    // damaged block is freed, and nothing else changed.
    let r = check_volume_with(
        data.clone(),
        None,
        CheckOptions { repair: true, unmap_lost: true, ..CheckOptions::default() },
    )
    .expect("unmap");
    assert!(r.unrepaired.is_empty() && r.lost_unmapped, "{:?}", r.unrepaired);
    assert_eq!(r.lost_blocks, 2);
    let r = check_volume(data.clone(), None, false).expect("check after unmap");
    assert!(r.is_clean(), "{:?}", r.problems);
    let vol = reopen(&dev);
    vol.read(0, &mut back).expect("read unmapped");
    assert!(back.iter().all(|&b| b == 0));
    vol.read(2 * B as u64, &mut back).expect("untouched block");
    assert!(back == block(13, 1));
    vol.read(8 * B as u64, &mut back).expect("fresh copy");
    assert!(back == content);
    vol.close().expect("close");
    let _ = pbn;
}

/// Hash verification trusts a fingerprint recorded in this session until the copy behind
/// it is seen damaged: a rewrite of damage nobody has read yet is shared with it (checking
/// every duplicate would be byte verification, with its reads), the read reports it, and
/// from then on a rewrite stores a fresh copy. A record from an earlier session is compared
/// byte for byte, so after a reopen the damage is caught by the first rewrite.
#[test]
fn hash_mode_heals_damage_on_the_rewrite_after_it_was_seen() {
    let (dev, vol) = mem_volume(64 << 20, 32 << 20, |o| o.verify = DedupVerify::Hash);
    let content = block(14, 1);
    vol.write(0, &content, false).expect("write");
    vol.flush().expect("flush");
    let at = find_block(&dev, &vol, &content);
    flip_byte(&dev, at + 2000);
    vol.write(0, &content, false).expect("rewrite in place");
    let mut back = vec![0u8; B];
    assert!(vol.read(0, &mut back).is_err(), "damage nobody had read is still reported, never returned");
    vol.write(0, &content, false).expect("rewrite after the damage was seen");
    vol.read(0, &mut back).expect("healed by the rewrite");
    assert!(back == content);
    vol.close().expect("close");
    let r = check_volume(dev.clone() as Arc<dyn Storage>, None, false).expect("check");
    assert!(r.is_clean(), "{:?}", r.problems);

    // After a reopen: the record is of an earlier session, so the rewrite reads and compares.
    let vol = reopen(&dev);
    let other = block(15, 1);
    vol.write(B as u64, &other, false).expect("write");
    vol.close().expect("close");
    let vol = reopen(&dev);
    let at = find_block(&dev, &vol, &other);
    flip_byte(&dev, at + 100);
    vol.write(B as u64, &other, false).expect("rewrite after a reopen");
    vol.read(B as u64, &mut back).expect("the damaged copy was not shared");
    assert!(back == other);
    assert_eq!(vol.stats().counters.dedup_verify_failures, 1);
    vol.close().expect("close");
}

/// `n` bytes of noise, then zeros: compresses to a little over `n` bytes.
fn half_noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut b: Vec<u8> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    b.resize(B, 0);
    b
}

/// A fragment crossing into the next block dies; that next block is freed and reused by
/// a run still in memory. A duplicate of the dead fragment's content must not be shared
/// with it: its first block still holds its bytes, the device still holds the old second
/// block, but the second block's new content is about to replace them.
#[test]
fn a_dead_fragment_whose_next_block_was_reused_is_never_shared() {
    for verify in [DedupVerify::Bytes, DedupVerify::Hash] {
        let (dev, vol) = mem_volume(64 << 20, 32 << 20, |o| o.verify = verify);
        // About 2 KiB of fragment in block 0, then a 2-block extent of about 3.8 KiB that
        // runs on into block 1.
        vol.write(0, &half_noise(1, 2000), false).expect("first fragment");
        let extent = [half_noise(2, 1900), half_noise(3, 1900)].concat();
        vol.write(131 * B as u64, &extent, false).expect("extent");
        vol.flush().expect("flush");
        // The extent dies (block 1 is freed once this is durable); block 0 lives on.
        vol.write(131 * B as u64, &[half_noise(4, 100), half_noise(5, 100)].concat(), false).expect("overwrite");
        vol.flush().expect("flush");
        // A new run takes the freed block, still in memory, and a duplicate of the dead
        // extent's first block arrives.
        reuse_block_1_then_write_a_duplicate(&dev, vol, &extent[..B], verify);
    }
}

/// Writes a fresh fragment (a new run taking the freed block 1) and then `dup`, the
/// content of a dead fragment's block; checks it reads back and the volume checks clean.
fn reuse_block_1_then_write_a_duplicate(dev: &Arc<MemStorage>, vol: Volume, dup: &[u8], verify: DedupVerify) {
    vol.write(B as u64, &half_noise(6, 3000), false).expect("reuses block 1");
    vol.write(137 * B as u64, dup, false).expect("duplicate of the dead block");
    vol.flush().expect("flush");
    let mut back = vec![0u8; B];
    vol.read(137 * B as u64, &mut back).expect("read");
    assert!(back == dup, "{verify:?}: the duplicate reads back wrong");
    vol.close().expect("close");
    let r = check_volume(dev.clone() as Arc<dyn Storage>, None, false).expect("check");
    assert!(r.is_clean(), "{verify:?}: {:?}", r.problems);
}

/// As above, but the dead fragment's next block is freed later, by the death of another
/// fragment that starts there: the first dead fragment must still never be shared.
#[test]
fn a_dead_fragment_is_not_shared_after_a_later_death_frees_its_next_block() {
    for verify in [DedupVerify::Bytes, DedupVerify::Hash] {
        let (dev, vol) = mem_volume(64 << 20, 32 << 20, |o| o.verify = verify);
        // Block 0: a 2 KiB fragment, then the extent running into block 1, then a
        // fragment that starts in block 1.
        vol.write(0, &half_noise(1, 2000), false).expect("first fragment");
        let extent = [half_noise(2, 1900), half_noise(3, 1900)].concat();
        vol.write(131 * B as u64, &extent, false).expect("extent");
        vol.write(200 * B as u64, &half_noise(7, 1500), false).expect("fragment in block 1");
        vol.flush().expect("flush");
        // The extent dies; block 1 lives on for the third fragment.
        vol.write(131 * B as u64, &[half_noise(4, 100), half_noise(5, 100)].concat(), false).expect("overwrite");
        vol.flush().expect("flush");
        // The third fragment dies: block 1 is freed (block 0 lives on for the first one).
        vol.write(200 * B as u64, &half_noise(8, 100), false).expect("overwrite the third");
        vol.flush().expect("flush");
        // Block 1 reused by a run still in memory, then a duplicate of the dead extent.
        reuse_block_1_then_write_a_duplicate(&dev, vol, &extent[..B], verify);
    }
}
