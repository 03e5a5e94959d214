//! The write pipeline's scheduling features: the unique-chunk predictor and deferred
//! compression change when and how chunks are compressed, never what reads back, what is
//! shared, or what the audit finds.
mod common;
use common::*;
use dedupvol_core::{OpenOptions, Storage, Volume};
use std::sync::Arc;

/// Writes `n` requests of 16 compressible blocks, every fourth request a repeat of an
/// earlier one; returns the expected contents by block.
fn write_mix(vol: &Volume, n: u64) -> Vec<Vec<u8>> {
    let mut want = Vec::new();
    for r in 0..n {
        let src = if r % 4 == 3 { r / 2 } else { r };
        let mut buf = Vec::new();
        for b in 0..16 {
            buf.extend_from_slice(&block(src * 100 + b, 0));
        }
        vol.write(r * 16 * 4096, &buf, false).expect("write");
        want.extend(buf.chunks(4096).map(|c| c.to_vec()));
    }
    want
}

fn read_all(vol: &Volume, want: &[Vec<u8>]) {
    for (lba, w) in want.iter().enumerate() {
        let mut b = vec![0u8; 4096];
        vol.read(lba as u64 * 4096, &mut b).expect("read");
        assert!(&b == w, "block {lba}");
    }
}

fn reopen(dev: &Arc<dedupvol_core::MemStorage>, vol: Volume, opts: &OpenOptions) -> Volume {
    vol.close().expect("close");
    Volume::open(dev.clone() as Arc<dyn Storage>, None, opts).expect("open")
}

#[test]
fn the_predictor_guesses_repeats_and_changes_nothing_stored() {
    let (dev, vol) = mem_volume(64 << 20, 16 << 20, |_| {});
    let vol = reopen(&dev, vol, &OpenOptions { unique_predictor: true, ..small_open() });
    let want = write_mix(&vol, 64);
    read_all(&vol, &want);
    let st = vol.stats();
    let p = st.pipeline.predictor;
    assert!(p.enabled);
    assert_eq!(p.unique_right + p.unique_wrong + p.duplicate_right + p.duplicate_wrong, 64 * 16);
    assert!(p.accuracy > 0.97, "{p:?}");
    assert!(p.memory_bytes_per_entry <= 2.0);
    // The same data without the predictor stores exactly as much.
    let (dev2, vol2) = mem_volume(64 << 20, 16 << 20, |_| {});
    let vol2 = reopen(&dev2, vol2, &OpenOptions { unique_predictor: false, ..small_open() });
    write_mix(&vol2, 64);
    let st2 = vol2.stats();
    assert!(!st2.pipeline.predictor.enabled);
    assert_eq!(st.data_blocks_used, st2.data_blocks_used);
    assert_eq!(st.counters.dedup_hits, st2.counters.dedup_hits);
    close_and_check(dev, vol);
}

#[test]
fn deferred_chunks_are_stored_with_the_fast_codec_and_read_back() {
    let (dev, vol) = mem_volume(64 << 20, 16 << 20, |_| {});
    // A budget of 1 us: every batch is past it, so it is deferred whole, and its chunks
    // skip the incompressibility probe (the mix's incompressible blocks are then found by
    // LZ4 alone and stored raw).
    let opts = OpenOptions { defer_compression_micros: 1, ..small_open() };
    let vol = reopen(&dev, vol, &opts);
    let want = write_mix(&vol, 32);
    read_all(&vol, &want);
    let d = vol.stats().pipeline.deferral;
    assert!(d.enabled && d.deferred_chunks > 0 && d.inline_chunks == 0, "{d:?}");
    let vol = reopen(&dev, vol, &opts);
    read_all(&vol, &want);
    close_and_check(dev, vol);
}

#[test]
fn requests_written_as_one_batch_apply_in_order() {
    let (dev, vol) = mem_volume(64 << 20, 16 << 20, |_| {});
    let a: Vec<u8> = (0..4).flat_map(|b| block(10 + b, 0)).collect();
    let b: Vec<u8> = (0..2).flat_map(|k| block(20 + k, 0)).collect();
    let c = block(30, 1);
    // b overlaps a's blocks 1 and 2 (the later request wins); c is an incompressible
    // block far away; the last request repeats a's first block inside the same batch.
    vol.write_many(&[(0, &a), (4096, &b), (100 * 4096, &c), (7 * 4096, &a[..4096])], false).expect("write_many");
    let mut want: Vec<Vec<u8>> = a.chunks(4096).map(|x| x.to_vec()).collect();
    want[1] = b[..4096].to_vec();
    want[2] = b[4096..].to_vec();
    for (lba, w) in want.iter().enumerate() {
        let mut got = vec![0u8; 4096];
        vol.read(lba as u64 * 4096, &mut got).expect("read");
        assert!(&got == w, "block {lba}");
    }
    let mut got = vec![0u8; 4096];
    vol.read(100 * 4096, &mut got).expect("read");
    assert!(got == c);
    vol.read(7 * 4096, &mut got).expect("read");
    assert!(got == a[..4096], "a repeat inside the batch reads back");
    assert!(vol.stats().counters.dedup_hits >= 1, "the repeat of a's first block is shared");
    close_and_check(dev, vol);
}

#[test]
fn a_batch_with_a_partial_block_is_written_request_by_request() {
    let (dev, vol) = mem_volume(64 << 20, 16 << 20, |_| {});
    let a = block(1, 0);
    let part = block(2, 0);
    vol.write_many(&[(0, &a), (4096 + 512, &part[..1024])], true).expect("write_many");
    let mut got = vec![0u8; 8192];
    vol.read(0, &mut got).expect("read");
    assert!(got[..4096] == a[..]);
    assert!(got[4096 + 512..4096 + 1536] == part[..1024] && got[4096..4096 + 512].iter().all(|&x| x == 0));
    close_and_check(dev, vol);
}
