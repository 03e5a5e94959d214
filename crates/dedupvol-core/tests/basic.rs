//! Basic behaviour: round trips of every kind of block, unaligned I/O, bad input.
mod common;
use common::*;
use dedupvol_core::{Error, Storage, Volume};
use std::sync::Arc;

#[test]
fn round_trip_zero_dup_compressible_random_and_unaligned() {
    let (dev, vol) = mem_volume(64 << 20, 256 << 20, |_| {});
    let a = block(1, 0);
    let b = block(2, 1);
    vol.write(0, &a, false).expect("w");
    vol.write(4096, &b, false).expect("w");
    vol.write(8192, &a, false).expect("dup");
    vol.write(12288, &vec![0u8; 4096], false).expect("zero");
    vol.write(5000, b"hello", false).expect("unaligned");
    let mut back = vec![0u8; 16384];
    vol.read(0, &mut back).expect("r");
    let mut want_b = b.clone();
    want_b[904..909].copy_from_slice(b"hello");
    assert_eq!(&back[..4096], &a[..]);
    assert_eq!(&back[4096..8192], &want_b[..]);
    assert_eq!(&back[8192..12288], &a[..]);
    assert!(back[12288..].iter().all(|&x| x == 0));
    let s = vol.stats();
    assert!(s.counters.dedup_hits >= 1, "{s:?}");
    vol.flush().expect("flush");
    vol.close().expect("close");
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &small_open()).expect("reopen");
    let mut back2 = vec![0u8; 16384];
    vol.read(0, &mut back2).expect("r");
    assert_eq!(back, back2);
    vol.close().expect("close");
    let rep = dedupvol_core::check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
    assert!(rep.is_clean(), "{rep:?}");
}

#[test]
fn out_of_range_and_not_a_volume() {
    let (_dev, vol) = mem_volume(16 << 20, 1 << 20, |_| {});
    let mut b = vec![0u8; 4096];
    assert!(matches!(vol.read(1 << 20, &mut b), Err(Error::OutOfRange { .. })));
    assert!(matches!(vol.write((1 << 20) - 10, &b, false), Err(Error::OutOfRange { .. })));
    let blank = Arc::new(dedupvol_core::MemStorage::new(16 << 20));
    assert!(matches!(Volume::open(blank, None, &small_open()), Err(Error::NotAVolume(_))));
}

#[test]
fn fingerprint_index_survives_a_clean_close_in_both_verification_modes() {
    for verify in [dedupvol_core::DedupVerify::Bytes, dedupvol_core::DedupVerify::Hash] {
        let (dev, vol) = mem_volume(64 << 20, 64 << 20, |o| o.verify = verify);
        for i in 0..100u64 {
            vol.write(i * 4096, &block(i, 0), false).expect("w");
        }
        vol.close().expect("close");
        let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &small_open()).expect("reopen");
        assert!(vol.stats().index_entries >= 100, "{verify:?}: index not reloaded");
        for i in 0..100u64 {
            vol.write((1000 + i) * 4096, &block(i, 0), false).expect("w");
        }
        assert_eq!(vol.stats().counters.dedup_hits, 100, "{verify:?}");
        vol.close().expect("close");
        let rep = dedupvol_core::check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
        assert!(rep.is_clean(), "{rep:?}");
    }
}

#[test]
fn a_block_at_the_reference_cap_gets_a_new_copy() {
    let (dev, vol) = mem_volume(64 << 20, 48 << 20, |_| {});
    let b = block(9, 1);
    let n = 2 * u64::from(dedupvol_core::format::REFCOUNT_MAX) + 1000;
    for lba in 0..n {
        vol.write(lba * 4096, &b, false).expect("w");
    }
    let s = vol.stats();
    assert!(s.counters.refcount_cap_copies >= 2, "{:?}", s.counters);
    assert_eq!(s.data_blocks_used, 3, "{n} references need 3 copies at the cap");
    vol.close().expect("close");
    let rep = dedupvol_core::check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
    assert!(rep.is_clean(), "{rep:?}");
}
