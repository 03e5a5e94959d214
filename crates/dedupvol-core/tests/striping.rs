//! A volume striped over several data devices: format over four files, write, read,
//! reopen and check; a missing, swapped or foreign device is refused with an error that
//! names it, and nothing on any device changes; duplicates are shared across devices;
//! the devices carry even shares of the data traffic.
mod common;
use common::block;
use dedupvol_core::{
    check_volume, DataDeviceIo, Error, FileStorage, FormatOptions, IoMode, OpenOptions, Storage, Volume,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const DEVICE_BYTES: u64 = 40 << 20;

fn opts(logical: u64) -> FormatOptions {
    FormatOptions {
        logical_size_bytes: logical,
        index_memory_bytes: 1 << 20,
        slab_size_bytes: 1 << 20,
        ..FormatOptions::default()
    }
}

/// Four device files in a fresh directory, formatted as one striped volume.
fn striped_files(logical: u64) -> (tempfile::TempDir, Vec<PathBuf>) {
    let dir = tempfile::tempdir().expect("tmp");
    let paths: Vec<PathBuf> = ["d0", "d1", "d2", "d3"].iter().map(|n| dir.path().join(n)).collect();
    let (first, rest) = paths.split_first().expect("four paths");
    Volume::format_path_striped(first, rest, Some(DEVICE_BYTES), None, &opts(logical), false).expect("format");
    (dir, paths)
}

fn open(path: &Path) -> dedupvol_core::Result<Volume> {
    Volume::open_path(path, None, &OpenOptions::default())
}

fn check_clean(first: &Path) {
    let data = Volume::open_data_path(first, true, IoMode::Direct).expect("stripe for check");
    let r = check_volume(data, None, false).expect("check");
    assert!(r.is_clean(), "{:?}", r.problems);
}

/// Block `i` of the test pattern: every third block repeats an earlier one.
fn pattern(i: u64) -> Vec<u8> {
    if i % 3 == 2 {
        block(i / 3, 1)
    } else {
        block(i, (i % 2) as u8)
    }
}

fn contents(paths: &[PathBuf]) -> Vec<Vec<u8>> {
    paths.iter().map(|p| std::fs::read(p).expect("read device file")).collect()
}

#[test]
fn four_files_write_read_reopen_and_check() {
    let (_dir, paths) = striped_files(64 << 20);
    let vol = open(&paths[0]).expect("open");
    assert_eq!(vol.stats().data_devices.len(), 4);
    let g = vol.geometry();
    assert_eq!(g.data_blocks % (4 * dedupvol_core::format::STRIPE_UNIT_BLOCKS), 0, "whole units on each device");
    let n = 6000u64; // 23 MiB: every device holds several units
    for i in 0..n {
        vol.write(i * 4096, &pattern(i), false).expect("write");
    }
    vol.flush().expect("flush");
    let mut b = vec![0u8; 4096];
    for i in (0..n).step_by(7) {
        vol.read(i * 4096, &mut b).expect("read");
        assert_eq!(b, pattern(i), "block {i} before reopen");
    }
    let written: Vec<u64> = vol.stats().data_devices.iter().map(|d| d.data_written_bytes).collect();
    assert!(written.iter().all(|&w| w > 0), "every device received data: {written:?}");
    vol.close().expect("close");
    let vol = open(&paths[0]).expect("reopen");
    for i in 0..n {
        vol.read(i * 4096, &mut b).expect("read");
        assert_eq!(b, pattern(i), "block {i} after reopen");
    }
    vol.close().expect("close");
    check_clean(&paths[0]);
    // Dropped without close (a crash): the journal replays onto the stripe.
    let vol = open(&paths[0]).expect("open");
    vol.write(0, &block(999, 1), true).expect("fua write");
    drop(vol);
    let vol = open(&paths[0]).expect("recover");
    vol.read(0, &mut b).expect("read");
    assert_eq!(b, block(999, 1));
    vol.close().expect("close");
    check_clean(&paths[0]);
}

#[test]
fn a_missing_swapped_or_foreign_device_is_refused_and_nothing_changes() {
    let (dir, paths) = striped_files(16 << 20);
    let vol = open(&paths[0]).expect("open");
    for i in 0..2000u64 {
        vol.write(i * 4096, &pattern(i), false).expect("write");
    }
    vol.close().expect("close");
    let before = contents(&paths);
    let refused = |want_index: u32, want: &str| {
        match open(&paths[0]) {
            Err(Error::DataDevice { index, reason, .. }) => {
                assert_eq!(index, want_index, "{reason}");
                assert!(reason.contains(want), "reason {reason:?} lacks {want:?}");
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("opened without device {want_index}"),
        }
        // A read-only open and check refuse it the same way.
        assert!(Volume::open_data_path(&paths[0], true, IoMode::Direct).is_err());
    };
    // Missing.
    let aside = dir.path().join("aside");
    std::fs::rename(&paths[3], &aside).expect("rename");
    refused(3, "cannot be opened");
    std::fs::rename(&aside, &paths[3]).expect("rename back");
    // Swapped.
    std::fs::rename(&paths[1], &aside).expect("rename");
    std::fs::rename(&paths[2], &paths[1]).expect("rename");
    std::fs::rename(&aside, &paths[2]).expect("rename");
    refused(1, "swapped");
    std::fs::rename(&paths[1], &aside).expect("rename");
    std::fs::rename(&paths[2], &paths[1]).expect("rename");
    std::fs::rename(&aside, &paths[2]).expect("rename");
    // Another volume's device in its place.
    let (_other_dir, other) = striped_files(16 << 20);
    std::fs::rename(&paths[2], &aside).expect("rename");
    std::fs::copy(&other[2], &paths[2]).expect("copy foreign");
    refused(2, "belongs to volume");
    // A blank device in its place.
    std::fs::File::create(&paths[2]).and_then(|f| f.set_len(DEVICE_BYTES)).expect("blank");
    refused(2, "no dedupvol header");
    std::fs::rename(&aside, &paths[2]).expect("rename back");
    assert!(contents(&paths) == before, "a refused open changed a device");
    // An extra device given as the volume is named as what it is.
    match open(&paths[1]) {
        Err(Error::NotAVolume(m)) => assert!(m.contains("data device 1 of 4"), "{m}"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("opened an extra device as a volume"),
    }
    // The first device alone is not the volume.
    let first = Arc::new(FileStorage::open_with(&paths[0], true, IoMode::Direct).expect("file"));
    let ro = OpenOptions { read_only: true, ..OpenOptions::default() };
    assert!(matches!(Volume::open(first, None, &ro), Err(Error::InvalidArgument(_))));
    // Everything back: the data is intact.
    let vol = open(&paths[0]).expect("open with all devices");
    let mut b = vec![0u8; 4096];
    for i in 0..2000u64 {
        vol.read(i * 4096, &mut b).expect("read");
        assert_eq!(b, pattern(i), "block {i}");
    }
    vol.close().expect("close");
    check_clean(&paths[0]);
    // Its physical size is fixed: a grow of the data region is refused.
    let vol = open(&paths[0]).expect("open");
    assert!(vol.grow(None, Some(DEVICE_BYTES * 8)).is_err());
    vol.close().expect("close");
}

fn data_written(d: &[DataDeviceIo]) -> Vec<u64> {
    d.iter().map(|d| d.data_written_bytes).collect()
}

/// The block map and index are shared by the whole stripe: a block stored in the first
/// device's unit is found again when its copy is written while the allocator fills a unit
/// of another device, and no device receives the copy.
#[test]
fn a_block_in_one_stripe_deduplicates_a_copy_landing_in_another() {
    let (_dir, paths) = striped_files(64 << 20);
    let vol = open(&paths[0]).expect("open");
    let x = block(42_000_000, 1);
    vol.write(0, &x, false).expect("write x");
    vol.flush().expect("flush");
    let first = data_written(&vol.stats().data_devices);
    assert!(first[0] > 0 && first[1..].iter().all(|&w| w == 0), "x landed in device 0's unit: {first:?}");
    // Unique data until the allocator is well into device 3's first unit.
    let unit_blocks = dedupvol_core::format::STRIPE_UNIT_BLOCKS;
    for i in 1..3 * unit_blocks + 20 {
        vol.write(i * 4096, &block(i, 1), false).expect("write");
    }
    vol.flush().expect("flush");
    let before = vol.stats();
    let b = data_written(&before.data_devices);
    assert!(b[3] > 0, "the allocator moved on to device 3: {b:?}");
    // The copy: no data written anywhere, one more dedup hit.
    let lba = 4 * unit_blocks;
    vol.write(lba * 4096, &x, false).expect("write copy");
    vol.flush().expect("flush");
    let after = vol.stats();
    assert_eq!(data_written(&after.data_devices), b, "the copy was stored instead of shared");
    assert_eq!(after.data_blocks_used, before.data_blocks_used);
    assert!(after.counters.dedup_hits > before.counters.dedup_hits, "no dedup hit");
    // A new block lands where the copy would have: not on device 0.
    vol.write((lba + 1) * 4096, &block(7_777_777, 1), false).expect("write new");
    vol.flush().expect("flush");
    let c = data_written(&vol.stats().data_devices);
    assert_eq!(c[0], b[0], "the allocator is on another device than x's: {b:?} -> {c:?}");
    let mut r = vec![0u8; 4096];
    vol.read(lba * 4096, &mut r).expect("read copy");
    assert_eq!(r, x);
    vol.close().expect("close");
    check_clean(&paths[0]);
}

/// Sequential then random writes: each device's share of the data written and read
/// back is within 10% of every other's.
#[test]
fn per_device_bytes_are_balanced_on_sequential_and_random_writes() {
    let (_dir, paths) = striped_files(128 << 20);
    let vol = open(&paths[0]).expect("open");
    let seq_blocks = 12_288u64; // 48 MiB, incompressible
    for i in 0..seq_blocks {
        vol.write(i * 4096, &block(i, 1), false).expect("write");
    }
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for j in 0..4096u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let lba = x % seq_blocks;
        vol.write(lba * 4096, &block(1_000_000 + j, 1), false).expect("write");
    }
    vol.flush().expect("flush");
    let mut b = vec![0u8; 4096];
    for i in 0..seq_blocks {
        vol.read(i * 4096, &mut b).expect("read");
    }
    let d = vol.stats().data_devices;
    for (what, v) in [("written", data_written(&d)), ("read", d.iter().map(|d| d.data_read_bytes).collect::<Vec<_>>())]
    {
        eprintln!("bytes {what} per device: {v:?}");
        let (lo, hi) = (*v.iter().min().expect("devices"), *v.iter().max().expect("devices"));
        assert!(lo > 0 && hi * 10 <= lo * 11, "bytes {what} per device out of balance: {v:?}");
    }
    vol.close().expect("close");
}

/// A single-device volume without a rest level keeps format version 2 and no stripe
/// record: it reads as before, and a build that knows only version 2 still reads it. With
/// the default rest level it is version 4, striped version 5 (a build that does not know
/// settled fragments refuses them by the version).
#[test]
fn a_single_device_volume_keeps_version_2() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("one");
    let no_rest = FormatOptions { rest_level: Some(0), ..opts(16 << 20) };
    Volume::format_path(&path, Some(16 << 20), None, &no_rest, false).expect("format");
    let b = std::fs::read(&path).expect("read");
    assert_eq!(&b[12..16], &dedupvol_core::format::FORMAT_VERSION.to_le_bytes());
    let rest = dir.path().join("rest");
    Volume::format_path(&rest, Some(16 << 20), None, &opts(16 << 20), false).expect("format");
    let r = std::fs::read(&rest).expect("read");
    assert_eq!(&r[12..16], &dedupvol_core::format::FORMAT_VERSION_REST.to_le_bytes());
    assert_eq!(r[211] as i8, dedupvol_core::format::REST_LEVEL_DEFAULT);
    let off = dedupvol_core::format::STRIPE_RECORD_OFFSET;
    assert!(b[off..off + 4].iter().all(|&x| x == 0), "no stripe record");
    let vol = open(&path).expect("open");
    assert!(vol.stats().data_devices.is_empty());
    vol.close().expect("close");
    let (_d, striped) = striped_files(16 << 20);
    let b = std::fs::read(&striped[0]).expect("read");
    assert_eq!(&b[12..16], &dedupvol_core::format::FORMAT_VERSION_REST_STRIPED.to_le_bytes());
    assert_eq!(&b[off..off + 4], b"DVST");
}

/// In-memory devices striped in hand, as the simulator does.
#[test]
fn memory_devices_striped_in_hand() {
    let devs: Vec<Arc<dyn Storage>> =
        (0..3).map(|_| Arc::new(dedupvol_core::MemStorage::new(24 << 20)) as Arc<dyn Storage>).collect();
    let extra = devs[1..].iter().enumerate().map(|(i, d)| (d.clone(), format!("mem{}", i + 1))).collect();
    Volume::format_striped(devs[0].clone(), extra, None, &opts(32 << 20), false).expect("format");
    let stripe = Volume::stripe_devices(devs[0].clone(), devs[1..].to_vec()).expect("stripe");
    let vol = Volume::open(stripe.clone(), None, &OpenOptions::default()).expect("open");
    for i in 0..3000u64 {
        vol.write(i * 4096, &pattern(i), false).expect("write");
    }
    vol.close().expect("close");
    assert!(check_volume(stripe, None, false).expect("check").is_clean());
    // Devices out of order are refused.
    let swapped = vec![devs[2].clone(), devs[1].clone()];
    assert!(matches!(Volume::stripe_devices(devs[0].clone(), swapped), Err(Error::DataDevice { index: 1, .. })));
}

/// With a metadata device, the first data device keeps only its superblocks before its
/// units; the metadata device's superblock carries the same stripe record.
#[test]
fn striped_with_a_metadata_device() {
    let dir = tempfile::tempdir().expect("tmp");
    let paths: Vec<PathBuf> = ["d0", "d1", "d2"].iter().map(|n| dir.path().join(n)).collect();
    let meta = dir.path().join("meta");
    std::fs::File::create(&meta).and_then(|f| f.set_len(16 << 20)).expect("meta file");
    Volume::format_path_striped(&paths[0], &paths[1..], Some(8 << 20), Some(&meta), &opts(32 << 20), false)
        .expect("format");
    let vol = open(&paths[0]).expect("open via the recorded paths");
    assert_eq!(vol.geometry().data_start, 2);
    for i in 0..3000u64 {
        vol.write(i * 4096, &pattern(i), false).expect("write");
    }
    vol.close().expect("close");
    let vol = open(&paths[0]).expect("reopen");
    let mut b = vec![0u8; 4096];
    for i in 0..3000u64 {
        vol.read(i * 4096, &mut b).expect("read");
        assert_eq!(b, pattern(i), "block {i}");
    }
    vol.close().expect("close");
    let data = Volume::open_data_path(&paths[0], true, IoMode::Direct).expect("stripe");
    let m = dedupvol_core::open_device(&meta, true, IoMode::Direct, false).expect("meta");
    assert!(check_volume(data, Some(m), false).expect("check").is_clean());
}
