//! Reopen after a clean close and after dropping the volume without closing it (the
//! process-crash case on a device without a volatile cache: flushed data must survive,
//! and recovery replays the journal).
mod common;
use common::*;
use dedupvol_core::{check_volume, FileStorage, FormatOptions, OpenOptions, Storage, Volume};
use std::sync::Arc;

#[test]
fn drop_without_close_keeps_flushed_and_fua_writes() {
    let (dev, vol) = mem_volume(32 << 20, 8 << 20, |o| o.journal_size_bytes = Some(256 << 10));
    for lba in 0..1000u64 {
        vol.write(lba * 4096 % (8 << 20), &block(lba, (lba % 2) as u8), false).expect("w");
    }
    vol.flush().expect("flush");
    vol.write(0, &block(77, 0), true).expect("fua");
    vol.write(4096, &block(78, 0), false).expect("unflushed");
    drop(vol);
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &small_open()).expect("recover");
    let mut b = vec![0u8; 4096];
    vol.read(0, &mut b).expect("r");
    assert_eq!(b, block(77, 0), "FUA write lost");
    vol.read(4096, &mut b).expect("r");
    assert!(b == block(78, 0) || b == block(1, 1), "block 1 holds neither old nor new data");
    for lba in 2..1000u64 {
        vol.read(lba * 4096, &mut b).expect("r");
        assert_eq!(b, block(lba, (lba % 2) as u8), "flushed block {lba} lost");
    }
    vol.close().expect("close");
    let r = check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
    assert!(r.is_clean(), "{:?}", r.problems);
}

#[test]
fn file_volume_with_separate_metadata_device_reopens_and_survives_superblock_damage() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = dir.path().join("data.img");
    let meta = dir.path().join("meta.img");
    std::fs::File::create(&meta).and_then(|f| f.set_len(16 << 20)).expect("meta file");
    let opts = FormatOptions {
        logical_size_bytes: 64 << 20,
        index_memory_bytes: 1 << 20,
        slab_size_bytes: 1 << 20,
        ..FormatOptions::default()
    };
    Volume::format_path(&data, Some(32 << 20), Some(&meta), &opts, false).expect("format");
    assert!(Volume::format_path(&data, None, Some(&meta), &opts, false).is_err(), "must refuse without force");
    let vol = Volume::open_path(&data, None, &OpenOptions::default()).expect("open via recorded meta path");
    vol.write(8192, &block(5, 0), false).expect("w");
    vol.close().expect("close");
    // Corrupt superblock copy A: the open falls back to copy B.
    let f = std::fs::OpenOptions::new().write(true).open(&data).expect("open");
    std::os::unix::fs::FileExt::write_all_at(&f, &[0xAB; 64], 100).expect("corrupt");
    drop(f);
    let vol =
        Volume::open_path(&data, Some(&meta), &OpenOptions::default()).expect("open with one bad superblock copy");
    let mut b = vec![0u8; 4096];
    vol.read(8192, &mut b).expect("r");
    assert_eq!(b, block(5, 0));
    assert!(vol.stats().separate_metadata_device);
    vol.close().expect("close");
    let d: Arc<dyn Storage> = Arc::new(FileStorage::open(&data, true).expect("d"));
    let m: Arc<dyn Storage> = Arc::new(FileStorage::open(&meta, true).expect("m"));
    let r = check_volume(d, Some(m), false).expect("check");
    assert!(r.is_clean(), "{:?}", r.problems);
}

#[test]
fn running_out_of_space_is_enospc_and_freeing_space_recovers() {
    // Thin provisioning: 64 MiB logical on a device with far fewer data blocks.
    let (_dev, vol) = mem_volume(6 << 20, 64 << 20, |o| {
        o.compression = dedupvol_core::Compression::None;
        o.journal_size_bytes = Some(256 << 10);
        o.index_memory_bytes = 64 << 10;
    });
    let mut lba = 0u64;
    let err = loop {
        match vol.write(lba * 4096, &block(lba, 1), false) {
            Ok(()) => lba += 1,
            Err(e) => break e,
        }
        assert!(lba < 16384, "never ran out of space");
    };
    assert_eq!(err.errno(), libc_enospc(), "{err}");
    let mut b = vec![0u8; 4096];
    vol.read(0, &mut b).expect("still readable");
    assert_eq!(b, block(0, 1));
    vol.discard(0, 64 * 4096).expect("discard works when full");
    // Overwrites work again without an explicit flush: the engine commits to reuse space.
    vol.write(lba * 4096, &block(lba, 1), false).expect("space is back");
    vol.write(4096 * 100, &block(5, 1), false).expect("overwrite");
    vol.close().expect("close");
}

fn libc_enospc() -> i32 {
    28
}

#[test]
fn io_mode_auto_follows_the_verification_mode() {
    use dedupvol_core::{DedupVerify, IoMode};
    let dir = tempfile::tempdir().expect("tmp");
    for (verify, direct) in [(DedupVerify::Hash, true), (DedupVerify::Bytes, false)] {
        let path = dir.path().join(format!("{verify:?}.img"));
        let opts = FormatOptions {
            logical_size_bytes: 64 << 20,
            index_memory_bytes: 1 << 20,
            slab_size_bytes: 1 << 20,
            verify,
            ..FormatOptions::default()
        };
        Volume::format_path(&path, Some(32 << 20), None, &opts, false).expect("format");
        // The temp directory's file system takes O_DIRECT (ext4, tmpfs since Linux 6.6).
        let vol = Volume::open_path(&path, None, &OpenOptions::default()).expect("open");
        assert_eq!(vol.direct_io(), direct, "{verify:?} with io auto");
        vol.write(0, &block(7, 0), true).expect("write");
        vol.close().expect("close");
        for (mode, want) in [(IoMode::Direct, true), (IoMode::Buffered, false)] {
            let o = OpenOptions { io_mode: mode, ..OpenOptions::default() };
            let vol = Volume::open_path(&path, None, &o).expect("reopen");
            assert_eq!(vol.direct_io(), want, "{verify:?} with {mode:?}");
            let mut b = vec![0u8; 4096];
            vol.read(0, &mut b).expect("read");
            assert_eq!(b, block(7, 0));
            vol.close().expect("close");
        }
    }
}

/// Read-cached I/O (writes direct, data reads through the page cache): overwrites, frees
/// and reuse of physical blocks must never let a page cached from a block's earlier life
/// answer a read of its new content (the kernel drops cached pages of a direct write's
/// range; a block failing its checksum after a cached read is dropped and re-read).
#[test]
fn read_cached_io_reads_back_every_overwrite_and_reuse() {
    use dedupvol_core::IoMode;
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("rc.img");
    let opts = FormatOptions {
        logical_size_bytes: 16 << 20,
        index_memory_bytes: 1 << 20,
        slab_size_bytes: 1 << 20,
        ..FormatOptions::default()
    };
    Volume::format_path(&path, Some(8 << 20), None, &opts, false).expect("format");
    let o = OpenOptions { io_mode: IoMode::ReadCached, content_cache_bytes: 0, ..OpenOptions::default() };
    let vol = Volume::open_path(&path, None, &o).expect("open");
    assert!(vol.direct_io(), "read-cached writes with O_DIRECT");
    let blocks = 1024u64; // 4 MiB of a 8 MiB device: rounds of overwrites reuse freed blocks
    for round in 0..6u64 {
        let mut data = Vec::with_capacity(blocks as usize * 4096);
        for lba in 0..blocks {
            data.extend_from_slice(&content(lba, round));
        }
        vol.write(0, &data, false).expect("write");
        vol.flush().expect("flush");
        // Whole-range and single-block reads: runs and lone blocks take different paths.
        let mut back = vec![0u8; data.len()];
        vol.read(0, &mut back).expect("read");
        assert!(back == data, "round {round}: a read returned other content");
        for lba in (0..blocks).step_by(97) {
            let mut b = vec![0u8; 4096];
            vol.read(lba * 4096, &mut b).expect("read one");
            assert_eq!(b, content(lba, round), "round {round}, block {lba}");
        }
    }
    vol.close().expect("close");
}

/// Block `lba`'s content in `round`: odd blocks incompressible (raw), even ones compressible
/// (packed), so both kinds of physical block are freed and reused.
fn content(lba: u64, round: u64) -> Vec<u8> {
    block(lba * 1000 + round, (lba % 2) as u8)
}
