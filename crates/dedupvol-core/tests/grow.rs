//! Growing a volume: the logical size of an open volume into its block map's room, and a
//! closed volume's logical size and data device beyond it (regions move, the chapter ring
//! gives way), shrinking when nothing mapped is lost.

mod common;

use common::block;
use dedupvol_core::{resize_closed, FormatOptions, MemStorage, OpenOptions, Storage, Volume};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const B: u64 = 4096;

/// A device whose visible size can be raised, as a file that is extended.
struct Growable {
    inner: MemStorage,
    len: AtomicU64,
}

impl Storage for Growable {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        if offset + buf.len() as u64 > self.len() {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "beyond the end"));
        }
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        if offset + buf.len() as u64 > self.len() {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "beyond the end"));
        }
        self.inner.write_at(buf, offset)
    }
    fn sync(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn len(&self) -> u64 {
        self.len.load(Ordering::Relaxed)
    }
}

fn growable(len: u64, capacity: u64) -> Arc<Growable> {
    Arc::new(Growable { inner: MemStorage::new(capacity), len: AtomicU64::new(len) })
}

fn format(dev: Arc<dyn Storage>, logical: u64, tweak: impl FnOnce(&mut FormatOptions)) {
    let mut o = FormatOptions {
        logical_size_bytes: logical,
        index_memory_bytes: 1 << 20,
        slab_size_bytes: 1 << 20,
        ..FormatOptions::default()
    };
    tweak(&mut o);
    Volume::format(dev, None, &o, false).expect("format");
}

fn open(dev: &Arc<dyn Storage>) -> Volume {
    Volume::open(dev.clone(), None, &common::small_open()).expect("open")
}

fn check_blocks(v: &Volume, lbas: impl IntoIterator<Item = u64>) {
    let mut buf = vec![0u8; B as usize];
    for l in lbas {
        v.read(l * B, &mut buf).unwrap_or_else(|e| panic!("read of block {l}: {e}"));
        assert_eq!(buf, block(l, (l % 2) as u8), "block {l}");
    }
}

#[test]
fn an_open_volume_grows_into_its_room_and_keeps_its_data() {
    let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
    format(dev.clone(), 16 << 20, |o| o.max_logical_size_bytes = Some(64 << 20));
    let v = open(&dev);
    let old_blocks = (16 << 20) / B;
    for l in (0..old_blocks).step_by(97) {
        v.write(l * B, &block(l, (l % 2) as u8), false).expect("write");
    }
    assert!(v.write(old_blocks * B, &block(0, 0), false).is_err(), "beyond the end before the grow");
    let r = v.grow(Some(48 << 20), None).expect("grow");
    assert_eq!((r.logical_size_before, r.logical_size_after), (16 << 20, 48 << 20));
    assert!(r.online && r.moved.is_empty());
    assert_eq!(v.logical_size(), 48 << 20);
    for l in (old_blocks..3 * old_blocks).step_by(89) {
        v.write(l * B, &block(l, (l % 2) as u8), false).expect("write in the new space");
    }
    let e = v.grow(Some(1 << 30), None).expect_err("beyond the room");
    assert!(e.to_string().contains("room"), "{e}");
    let e = v.grow(Some(8 << 20), None).expect_err("an open volume does not shrink");
    assert!(e.to_string().contains("only grows"), "{e}");
    assert!(v.grow(None, Some(128 << 20)).is_err(), "a data device not extended yet cannot grow");
    v.flush().expect("flush");
    // Dropped without close: recovery replays entries for blocks of the new space.
    drop(v);
    let v = open(&dev);
    assert_eq!(v.logical_size(), 48 << 20);
    check_blocks(&v, (0..old_blocks).step_by(97));
    check_blocks(&v, (old_blocks..3 * old_blocks).step_by(89));
    assert!(v.audit(false).expect("audit").is_clean());
    v.close().expect("close");
}

#[test]
fn a_closed_volume_grows_beyond_its_room_taking_ring_blocks() {
    let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
    format(dev.clone(), 16 << 20, |o| {
        o.max_logical_size_bytes = Some(16 << 20);
        o.dedup_window_bytes = Some(32 << 20);
    });
    let v = open(&dev);
    for l in (0..4096).step_by(7) {
        v.write(l * B, &block(l, (l % 2) as u8), false).expect("write");
    }
    let before = v.geometry();
    v.close().expect("close");
    let r = resize_closed(dev.clone(), None, Some(64 << 20), None, &OpenOptions::default()).expect("grow");
    assert_eq!(r.logical_size_after, 64 << 20);
    assert!(r.index_blocks_after < r.index_blocks_before, "{r:?}");
    let v = open(&dev);
    let g = v.geometry();
    assert_eq!(g.block_map_start, before.block_map_start);
    assert_eq!(g.data_start, before.data_start, "data never moves");
    check_blocks(&v, (0..4096).step_by(7));
    let far = (64 << 20) / B - 1;
    v.write(far * B, &block(far, (far % 2) as u8), false).expect("write at the new end");
    check_blocks(&v, [far]);
    // Duplicates still share after the ring moved.
    v.write(8192 * B, &block(7, 1), true).expect("write a duplicate");
    assert!(v.audit(false).expect("audit").is_clean());
    v.close().expect("close");
}

#[test]
fn a_shrink_refuses_to_lose_mapped_blocks_and_unmaps_zeros() {
    let dev: Arc<dyn Storage> = Arc::new(MemStorage::new(64 << 20));
    format(dev.clone(), 16 << 20, |_| {});
    let v = open(&dev);
    v.write(0, &block(0, 0), false).expect("write");
    v.write(3000 * B, &block(3000, 0), false).expect("write beyond the new end");
    v.write_zeroes(2500 * B, 4 * B, false).expect("zeros beyond the new end");
    v.close().expect("close");
    let e = resize_closed(dev.clone(), None, Some(2048 * B), None, &OpenOptions::default()).expect_err("data lost");
    assert!(e.to_string().contains("would lose 1 mapped blocks"), "{e}");
    assert!(e.to_string().contains(&format!("byte {}", 3000 * B)), "{e}");
    let v = open(&dev);
    assert_eq!(v.logical_size(), 16 << 20, "a refused shrink changes nothing");
    v.discard(3000 * B, B).expect("discard");
    v.close().expect("close");
    let r = resize_closed(dev.clone(), None, Some(2048 * B), None, &OpenOptions::default()).expect("shrink");
    assert_eq!(r.zero_blocks_unmapped, 4);
    let v = open(&dev);
    assert_eq!(v.logical_size(), 2048 * B);
    check_blocks(&v, [0]);
    let rep = v.audit(false).expect("audit");
    assert!(rep.is_clean(), "{:?}", rep.problems);
    assert_eq!(rep.zero_blocks, 0, "the zero blocks beyond the end were unmapped");
    // Growing again: the old space reads as zeros.
    drop(rep);
    let r = v.grow(Some(16 << 20), None).expect("grow again");
    assert_eq!(r.logical_size_after, 16 << 20);
    let mut buf = vec![1u8; B as usize];
    v.read(2500 * B, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == 0));
    v.read(3000 * B, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == 0));
    v.close().expect("close");
}

#[test]
fn an_open_volume_grows_its_data_device_and_allocates_from_the_new_slabs() {
    let dev = growable(16 << 20, 64 << 20);
    let d: Arc<dyn Storage> = dev.clone();
    format(d.clone(), 128 << 20, |o| o.compression = dedupvol_core::Compression::None);
    let v = open(&d);
    let total = v.stats().data_blocks_total;
    let mut written = 0u64;
    while v.write(written * B, &block(written, 1), false).is_ok() {
        written += 1;
        assert!(written < 2 * total, "the volume never filled");
    }
    dev.len.store(48 << 20, Ordering::Relaxed);
    let r = v.grow(None, Some(48 << 20)).expect("grow the data device while open");
    assert!(r.online && r.data_blocks_after > 2 * total, "{r:?}");
    assert_eq!(v.stats().data_blocks_total, r.data_blocks_after);
    for l in written..written + total {
        v.write(l * B, &block(l, 1), false).expect("the new slabs take writes at once");
    }
    v.flush().expect("flush");
    let rep = v.audit(false).expect("audit");
    assert!(rep.is_clean(), "{:?}", rep.problems);
    drop(v); // a crash: recovery replays entries that name blocks of the new slabs
    let v = open(&d);
    assert_eq!(v.stats().data_blocks_total, r.data_blocks_after);
    let mut buf = vec![0u8; B as usize];
    for l in (0..written + total).step_by(11) {
        v.read(l * B, &mut buf).expect("read");
        assert_eq!(buf, block(l, 1), "block {l}");
    }
    assert!(v.audit(false).expect("audit").is_clean());
    v.close().expect("close");
}

#[test]
fn a_grown_data_device_gives_new_slabs_and_moves_the_counts_when_they_lack_room() {
    for room in [true, false] {
        let dev = growable(24 << 20, 96 << 20);
        let d: Arc<dyn Storage> = dev.clone();
        format(d.clone(), 128 << 20, |o| {
            o.compression = dedupvol_core::Compression::None;
            if !room {
                o.max_physical_size_bytes = Some(24 << 20);
            }
        });
        let v = open(&d);
        let total = v.stats().data_blocks_total;
        // Fill the data region with unique blocks until it is full.
        let mut written = 0u64;
        while v.write(written * B, &block(written, 1), false).is_ok() {
            written += 1;
            assert!(written < 2 * total, "the volume never filled");
        }
        assert!(written + 16 >= total, "{written} of {total} blocks written");
        v.close().ok();
        dev.len.store(96 << 20, Ordering::Relaxed);
        let r = resize_closed(d.clone(), None, None, Some(96 << 20), &OpenOptions::default()).expect("grow");
        assert_eq!(r.moved.is_empty(), room, "{r:?}");
        let v = open(&d);
        assert!(v.stats().data_blocks_total > 3 * total);
        for l in written..written + 2 * total {
            v.write(l * B, &block(l, 1), false).expect("the new slabs take writes");
        }
        v.flush().expect("flush");
        let mut buf = vec![0u8; B as usize];
        for l in (0..written + 2 * total).step_by(13) {
            v.read(l * B, &mut buf).expect("read");
            assert_eq!(buf, block(l, 1), "block {l} (room {room})");
        }
        let rep = v.audit(false).expect("audit");
        assert!(rep.is_clean(), "{:?}", rep.problems);
        v.close().expect("close");
        let e = resize_closed(d.clone(), None, None, Some(24 << 20), &OpenOptions::default()).expect_err("shrink");
        assert!(e.to_string().contains("cannot shrink"), "{e}");
    }
}
