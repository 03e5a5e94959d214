//! `Volume::read_shared`: cached raw blocks are handed back in place, everything else is
//! copied; put together, the parts must be exactly what `read` returns, whatever mix of
//! raw, packed, zero, unmapped, overwritten and unwritten blocks the range holds.
mod common;
use common::*;
use dedupvol_core::{OpenOptions, Storage, Volume};
use std::sync::Arc;

/// The data `read_shared` returned, joined.
fn joined(buf: &[u8], parts: &[Option<dedupvol_core::block::Block>]) -> Vec<u8> {
    if parts.is_empty() {
        return buf.to_vec();
    }
    let mut out = Vec::with_capacity(buf.len());
    for (p, own) in parts.iter().zip(buf.chunks(4096)) {
        match p {
            Some(b) => out.extend_from_slice(b),
            None => out.extend_from_slice(own),
        }
    }
    out
}

#[test]
fn shared_parts_join_to_what_read_returns() {
    let (dev, vol) = mem_volume(64 << 20, 64 << 20, |_| {});
    // Raw (random) and packed (text) blocks, a zero block, a hole, duplicates.
    let mut data = Vec::new();
    for lba in 0..512u64 {
        let b = match lba % 7 {
            0 => vec![0u8; 4096],
            1 | 2 => block(lba, 0),
            3 => block(5, 1),
            _ => block(lba, 1),
        };
        data.extend_from_slice(&b);
    }
    vol.write(0, &data, false).expect("write");
    vol.flush().expect("flush");
    vol.close().expect("close");
    let opts = OpenOptions { content_cache_bytes: 64 << 20, ..OpenOptions::default() };
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &opts).expect("reopen");
    // An overwrite still in memory (unwritten) inside the range.
    vol.write(40 * 4096, &block(999, 1), false).expect("overwrite");
    data[40 * 4096..41 * 4096].copy_from_slice(&block(999, 1));
    let mut buf = vec![0xEEu8; data.len() + 8192];
    let mut parts = Vec::new();
    // Cold: nothing cached yet, so nothing can be shared.
    vol.read_shared(0, &mut buf[..data.len()], &mut parts).expect("cold read");
    assert!(joined(&buf[..data.len()], &parts) == data, "cold shared read differs from the data");
    // Warm: the cache now holds the raw blocks and the decompressed fragments of the packed
    // ones, which all come back in place (only zero blocks and the unwritten one do not).
    buf.fill(0xEE);
    vol.read_shared(0, &mut buf[..data.len()], &mut parts).expect("warm read");
    assert!(joined(&buf[..data.len()], &parts) == data, "warm shared read differs from the data");
    let shared = parts.iter().filter(|p| p.is_some()).count();
    let nonzero = (0..512u64).filter(|&l| l % 7 != 0 && l != 40).count();
    assert_eq!(shared, nonzero, "blocks shared from the cache, of {nonzero} raw or packed blocks");
    // Past the written range (unmapped) and a range that is not whole blocks.
    let mut tail = vec![0xEEu8; 8192];
    vol.read_shared(data.len() as u64, &mut tail, &mut parts).expect("unmapped");
    assert!(joined(&tail, &parts).iter().all(|&b| b == 0));
    let mut odd = vec![0u8; 5000];
    vol.read_shared(4096 * 3 + 100, &mut odd, &mut parts).expect("unaligned");
    assert!(parts.is_empty(), "an unaligned read shares nothing");
    assert_eq!(&odd[..], &data[4096 * 3 + 100..4096 * 3 + 5100]);
    vol.close().expect("close");
}
