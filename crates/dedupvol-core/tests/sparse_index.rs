//! Sparse index locality within one write. A sparse index holds only the sampled "hook"
//! fingerprints in memory; a hook found in a request loads its whole chapter, so that
//! the blocks written together with it are found too. Only the hooks themselves used to
//! be looked up again once the chapter was read: a short duplicate run written in one
//! request kept its hook alone and stored every other block again (between two Linux
//! source tars, where most shared runs are short, a sparse index kept 74 % of dense's
//! dedup). Every chunk of the request still without a candidate is now looked up again.
mod common;
use common::*;
use dedupvol_core::{FormatOptions, IndexMode, MemStorage, OpenOptions, Storage, Volume};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const BLOCKS: u64 = 4096;
const RUN: u64 = 24;

/// The sampling rule of the sparse index (a fingerprint whose bytes 12..16, as a
/// little-endian u32, are a multiple of the sample rate); the test fails loudly if it
/// drifts, since the run it builds would then have no hook.
fn is_hook(b: &[u8]) -> bool {
    let h = blake3::hash(b);
    let w = u32::from_le_bytes([h.as_bytes()[12], h.as_bytes()[13], h.as_bytes()[14], h.as_bytes()[15]]);
    u64::from(w) % dedupvol_core::format::SPARSE_SAMPLE == 0
}

#[test]
fn a_short_run_with_one_hook_dedups_whole() {
    let dev = Arc::new(MemStorage::new(256 * MIB));
    let o = FormatOptions {
        logical_size_bytes: 128 * MIB,
        index_memory_bytes: MIB,
        slab_size_bytes: MIB,
        index_mode: IndexMode::Sparse,
        ..FormatOptions::default()
    };
    Volume::format(dev.clone() as Arc<dyn Storage>, None, &o, false).expect("format");
    let blocks: Vec<Vec<u8>> = (0..BLOCKS).map(|i| block(i, 1)).collect();
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &OpenOptions::default()).expect("open");
    for (i, c) in blocks.chunks(256).enumerate() {
        vol.write(i as u64 * MIB, &c.concat(), false).expect("write");
    }
    vol.close().expect("close");
    // A run of RUN blocks, well inside the first chapter, whose only hook is its 9th block:
    // the 8 before it and the 15 after it can be found only through the hook's chapter.
    let hooks: Vec<bool> = blocks.iter().map(|b| is_hook(b)).collect();
    let start = (100..1500)
        .find(|&j| (j..j + RUN).all(|k| hooks.get(k as usize) == Some(&(k == j + 8))))
        .expect("a run with one hook in its 9th block");
    // Reopened, the volume index holds the hooks only and no chapter is cached.
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &OpenOptions::default()).expect("open");
    vol.wait_index_rebuilt();
    let before = vol.stats().counters.dedup_hits;
    let run: Vec<u8> = (start..start + RUN).flat_map(|k| blocks[k as usize].clone()).collect();
    vol.write(64 * MIB, &run, false).expect("write");
    vol.flush().expect("flush");
    let hits = vol.stats().counters.dedup_hits - before;
    let mut back = vec![0u8; run.len()];
    vol.read(64 * MIB, &mut back).expect("read");
    assert!(back == run, "the run reads back wrong");
    assert_eq!(hits, RUN, "{hits} of the run's {RUN} blocks deduplicated");
    vol.close().expect("close");
    let r = dedupvol_core::check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
    assert!(r.is_clean(), "{:?}", r.problems);
}
