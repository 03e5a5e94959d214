//! Write-once journaling (WOJ): checkpoint writes shared with their journal copies, never
//! on a weak hash alone; journal discovery on a real ext4 image and after a superblock write.
mod common;
use common::*;
use dedupvol_core::{OpenOptions, Storage, Volume, WojMode, WojStats};
use std::sync::Arc;

const JOURNAL_BLOCKS: u64 = 64;

fn woj_volume(mask: u64, dedup: bool) -> (Arc<dedupvol_core::MemStorage>, Volume) {
    let (dev, vol) = mem_volume(16 << 20, 8 << 20, |o| o.dedup = dedup);
    vol.close().expect("close");
    let opts = OpenOptions {
        woj: WojMode::Range { offset: 0, len: JOURNAL_BLOCKS * 4096 },
        woj_weak_hash_mask: mask,
        ..small_open()
    };
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &opts).expect("open");
    (dev, vol)
}

fn woj(v: &Volume) -> WojStats {
    v.stats().woj.expect("woj on")
}

fn read(v: &Volume, lba: u64) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    v.read(lba * 4096, &mut b).expect("read");
    b
}

#[test]
fn a_checkpoint_write_shares_its_journal_copy() {
    let (_dev, v) = woj_volume(u64::MAX, false);
    let blocks: Vec<Vec<u8>> = (0..8).map(|i| block(100 + i, 1)).collect();
    // Journal writes (with a flush between, as a commit does), then the checkpoint.
    v.write(4096 * 3, &blocks.concat(), false).expect("journal write");
    v.flush().expect("flush");
    let before = v.stats().data_blocks_used;
    v.write(4096 * 500, &blocks.concat(), false).expect("checkpoint write");
    v.flush().expect("flush");
    let w = woj(&v);
    assert_eq!(w.hits, 8, "{w:?}");
    assert_eq!(w.bytes_not_written, 8 * 4096);
    assert_eq!(v.stats().data_blocks_used, before, "the checkpoint stored nothing new");
    for (i, b) in blocks.iter().enumerate() {
        assert_eq!(&read(&v, 500 + i as u64), b);
    }
    // Entries leave once used: the same content again elsewhere is stored.
    v.write(4096 * 700, &blocks[0], false).expect("write");
    assert_eq!(woj(&v).hits, 8);
    v.close().expect("close");
}

#[test]
fn a_journal_block_overwritten_before_its_checkpoint_is_not_shared() {
    let (_dev, v) = woj_volume(u64::MAX, false);
    let a = block(7, 1);
    v.write(4096 * 10, &a, false).expect("journal write");
    v.write(4096 * 10, &block(8, 1), false).expect("journal overwrite");
    v.write(4096 * 300, &a, false).expect("checkpoint");
    assert_eq!(woj(&v).hits, 0);
    assert_eq!(read(&v, 300), a);
    v.close().expect("close");
}

/// The central promise: with every weak hash forced equal, a write whose content differs
/// from the journal block is never shared with it. Regression: a chunk whose WOJ candidate
/// was dropped skipped BLAKE3, and with dedup on it was looked up and recorded in the
/// index under an all-zero fingerprint, which hash verification then trusted: the next
/// such chunk was shared with the previous one (found by this test and the simulator).
#[test]
fn forced_weak_hash_collisions_never_share_wrong_data() {
    for dedup in [false, true] {
        let (dev, v) = woj_volume(0, dedup);
        let j = block(1, 1);
        v.write(4096 * 5, &j, false).expect("journal write");
        for i in 0..20u64 {
            let other = block(1000 + i, (i % 2) as u8);
            v.write(4096 * (200 + i), &other, false).expect("write");
            assert_eq!(read(&v, 200 + i), other, "dedup {dedup}: block {i}");
        }
        let w = woj(&v);
        assert_eq!(w.hits, 0, "{w:?}");
        assert!(w.collisions >= 20, "{w:?}");
        // And the real copy is still shared under the same forced hash.
        v.write(4096 * 400, &j, false).expect("checkpoint");
        assert_eq!(woj(&v).hits, 1);
        assert_eq!(read(&v, 400), j);
        v.close().expect("close");
        let rep = dedupvol_core::check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
        assert!(rep.is_clean(), "{:?}", rep.problems);
    }
}

/// A chunk with a WOJ candidate skips its crc32c: shared, its map entry takes the journal
/// copy's crc (equal bytes); should the share fall through (a forced weak-hash collision
/// here), the crc is computed before the chunk is stored. Either way every map entry's crc
/// must be its content's (the memory audit and the offline check read every mapping),
/// for raw and packed journal copies, with dedup off and on.
#[test]
fn shared_and_fallen_through_checkpoint_writes_carry_their_own_crc() {
    for (mask, dedup) in [(u64::MAX, false), (u64::MAX, true), (0x3, false), (0x3, true)] {
        let (dev, v) = woj_volume(mask, dedup);
        // Rounds of: a compressible (packed) or random (raw) journal copy; blocks without a
        // journal copy (under the 2-bit mask, about one in four collides with it); the
        // copy's checkpoint. The pool holds one entry at a time, so none is invalidated.
        let copies: Vec<Vec<u8>> = (0..16).map(|i| block(300 + i, (i % 2) as u8)).collect();
        for (i, c) in copies.iter().enumerate() {
            let i = i as u64;
            v.write(4096 * (8 + i), c, false).expect("journal write");
            for k in 0..4 {
                v.write(4096 * (601 + 8 * i + k), &block(900 + 4 * i + k, (k % 2) as u8), false).expect("other");
            }
            v.write(4096 * (600 + 8 * i), c, false).expect("checkpoint");
        }
        let w = woj(&v);
        assert_eq!(w.hits, 16, "mask {mask:#x} dedup {dedup}: {w:?}");
        assert_eq!(w.collisions > 0, mask != u64::MAX, "mask {mask:#x} dedup {dedup}: {w:?}");
        v.audit_memory().unwrap_or_else(|e| panic!("mask {mask:#x} dedup {dedup}: {e}"));
        for (i, c) in copies.iter().enumerate() {
            let i = i as u64;
            assert_eq!(&read(&v, 600 + 8 * i), c);
            for k in 0..4 {
                assert_eq!(read(&v, 601 + 8 * i + k), block(900 + 4 * i + k, (k % 2) as u8));
            }
        }
        v.close().expect("close");
        let rep = dedupvol_core::check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
        assert!(rep.is_clean(), "mask {mask:#x} dedup {dedup}: {:?}", rep.problems);
    }
}

#[test]
fn jbd2_descriptor_and_commit_blocks_never_enter_the_pool() {
    let (_dev, v) = woj_volume(u64::MAX, false);
    let mut d = block(3, 1);
    d[0..4].copy_from_slice(&0xC03B_3998u32.to_be_bytes());
    d[4..8].copy_from_slice(&1u32.to_be_bytes());
    v.write(4096 * 2, &d, false).expect("descriptor");
    v.write(4096 * 900, &d, false).expect("same bytes elsewhere");
    let w = woj(&v);
    assert_eq!((w.hits, w.journal_meta_blocks, w.inserts), (0, 1, 0), "{w:?}");
    v.close().expect("close");
}

#[test]
fn a_second_journal_block_with_the_same_content_invalidates_the_entry() {
    let (_dev, v) = woj_volume(u64::MAX, false);
    let a = block(9, 1);
    v.write(4096 * 20, &a, false).expect("journal 1");
    v.write(4096 * 21, &a, false).expect("journal 2");
    v.write(4096 * 800, &a, false).expect("checkpoint");
    let w = woj(&v);
    assert_eq!((w.hits, w.invalidations), (0, 1), "{w:?}");
    assert_eq!(read(&v, 800), a);
    v.close().expect("close");
}

/// A real ext4 image (mkfs.ext4) written onto an auto-mode volume, superblock block last
/// (as mkfs does): the write of the superblock re-runs discovery, which finds the journal
/// inode's extent where debugfs says it is.
#[test]
fn discovery_finds_the_journal_of_a_real_ext4_image() {
    let have = |t: &str| std::process::Command::new(t).arg("-V").output().is_ok();
    if !have("mkfs.ext4") || !have("debugfs") {
        eprintln!("SKIPPED discovery_finds_the_journal_of_a_real_ext4_image: mkfs.ext4 or debugfs missing");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let img = dir.path().join("fs.img");
    std::fs::write(&img, vec![0u8; 64 << 20]).expect("image");
    let ok = std::process::Command::new("mkfs.ext4").args(["-q", "-F", "-b", "4096"]).arg(&img).status();
    assert!(ok.is_ok_and(|s| s.success()), "mkfs.ext4 failed");
    let out = std::process::Command::new("debugfs").args(["-R", "stat <8>"]).arg(&img).output().expect("debugfs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    // "(0-1023):1234-2257" in the EXTENTS section.
    let ext = text.lines().skip_while(|l| !l.starts_with("EXTENTS")).nth(1).unwrap_or("").to_string();
    let first: u64 =
        ext.split(':').nth(1).and_then(|r| r.split('-').next()).and_then(|x| x.trim().parse().ok()).expect(&text);
    let bytes = std::fs::read(&img).expect("read image");

    let (dev, vol) = mem_volume(128 << 20, 64 << 20, |o| o.dedup = false);
    vol.close().expect("close");
    let v =
        Volume::open(dev as Arc<dyn Storage>, None, &OpenOptions { woj: WojMode::Auto, ..small_open() }).expect("open");
    assert!(woj(&v).ranges.is_empty(), "nothing on a fresh volume");
    v.write(4096, &bytes[4096..], false).expect("image body");
    assert!(woj(&v).ranges.is_empty(), "no superblock yet");
    v.write(0, &bytes[..4096], false).expect("superblock block");
    let w = woj(&v);
    assert_eq!(w.ranges.first().map(|r| r.offset), Some(first * 4096), "{w:?}\n{text}");
    assert!(w.journal_blocks >= 1024 && w.pool_bytes <= 16 * w.journal_blocks, "{w:?}");
    // The file system re-made without a journal: discovery drops it.
    v.write_zeroes(0, 4096, false).expect("wipe");
    assert!(woj(&v).ranges.is_empty());
    v.close().expect("close");
}

/// Four threads share one journal: each writes runs of fresh blocks into it at positions
/// other threads overwrite too, flushes now and then, and writes the same contents to its
/// own home region, so checkpoint writes race with overwrites of their journal copies
/// (freed blocks, reused after commits). With a full and with a 3-bit weak hash, every
/// home block must read back as its thread last wrote it, and the audits stay clean.
#[test]
fn concurrent_journal_overwrites_and_checkpoints() {
    const THREADS: u64 = 4;
    const HOME_BLOCKS: u64 = 128;
    for mask in [u64::MAX, 0x7] {
        let (dev, vol) = mem_volume(64 << 20, (JOURNAL_BLOCKS + THREADS * HOME_BLOCKS) * 4096, |o| {
            o.dedup = mask != u64::MAX;
            o.journal_size_bytes = Some(512 << 10);
        });
        vol.close().expect("close");
        let opts = OpenOptions {
            woj: WojMode::Range { offset: 0, len: JOURNAL_BLOCKS * 4096 },
            woj_weak_hash_mask: mask,
            ..small_open()
        };
        let vol = Arc::new(Volume::open(dev.clone() as Arc<dyn Storage>, None, &opts).expect("open"));
        let last: Vec<Vec<u64>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    let vol = vol.clone();
                    s.spawn(move || {
                        let mut home = vec![0u64; HOME_BLOCKS as usize];
                        for round in 0..40u64 {
                            let n = 1 + (round % 4);
                            let jpos = (round * 7 + t * 13) % (JOURNAL_BLOCKS - n);
                            let seeds: Vec<u64> = (0..n).map(|i| (t << 40) | (round << 8) | i).collect();
                            let buf: Vec<u8> = seeds.iter().flat_map(|&x| block(x, (x % 2) as u8)).collect();
                            vol.write(jpos * 4096, &buf, false).expect("journal write");
                            if round % 3 == 0 {
                                vol.flush().expect("flush");
                            }
                            let hpos = (round * 5) % (HOME_BLOCKS - n);
                            let off = (JOURNAL_BLOCKS + t * HOME_BLOCKS + hpos) * 4096;
                            vol.write(off, &buf, round % 5 == 0).expect("checkpoint write");
                            for (i, &x) in seeds.iter().enumerate() {
                                home[(hpos + i as u64) as usize] = x + 1;
                            }
                        }
                        home
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("writer")).collect()
        });
        for (t, home) in last.iter().enumerate() {
            for (i, &x) in home.iter().enumerate() {
                let want = if x == 0 { vec![0u8; 4096] } else { block(x - 1, ((x - 1) % 2) as u8) };
                let lba = JOURNAL_BLOCKS + t as u64 * HOME_BLOCKS + i as u64;
                assert_eq!(read(&vol, lba), want, "mask {mask:#x}: thread {t} home block {i}");
            }
        }
        let w = woj(&vol);
        assert!(w.hits > 0, "mask {mask:#x}: {w:?}");
        vol.audit_memory().expect("memory audit");
        Arc::try_unwrap(vol).ok().expect("sole owner").close().expect("close");
        let r = dedupvol_core::check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
        assert!(r.is_clean(), "{:?}", r.problems);
    }
}
