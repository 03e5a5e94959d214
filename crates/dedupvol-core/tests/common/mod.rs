//! Shared helpers for the engine's integration tests.
#![allow(dead_code)]

use dedupvol_core::{FormatOptions, MemStorage, OpenOptions, Storage, Volume};
use std::sync::Arc;

/// A formatted in-memory volume: (data device, volume).
pub fn mem_volume(physical: u64, logical: u64, tweak: impl FnOnce(&mut FormatOptions)) -> (Arc<MemStorage>, Volume) {
    let dev = Arc::new(MemStorage::new(physical));
    let mut opts = FormatOptions {
        logical_size_bytes: logical,
        index_memory_bytes: 1 << 20,
        slab_size_bytes: 1 << 20,
        ..FormatOptions::default()
    };
    tweak(&mut opts);
    Volume::format(dev.clone() as Arc<dyn Storage>, None, &opts, false).expect("format");
    let vol = Volume::open(dev.clone() as Arc<dyn Storage>, None, &small_open()).expect("open");
    (dev, vol)
}

/// Closes `vol` cleanly, then asserts that `check` finds nothing wrong on `dev`.
pub fn close_and_check(dev: Arc<MemStorage>, vol: Volume) {
    vol.close().expect("close");
    let r = dedupvol_core::check_volume(dev as Arc<dyn Storage>, None, false).expect("check");
    assert!(r.is_clean(), "{:?}", r.problems);
}

/// Open options with small caches so eviction paths run.
pub fn small_open() -> OpenOptions {
    OpenOptions { block_map_cache_bytes: 64 << 10, content_cache_bytes: 256 << 10, ..OpenOptions::default() }
}

/// Deterministic block content: `kind` 0 = compressible text-like, 1 = random.
pub fn block(seed: u64, kind: u8) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = vec![0u8; 4096];
    for (i, b) in out.iter_mut().enumerate() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let text = b"the quick brown fox ";
        *b = if kind == 0 && i % 8 != 0 { text.get(i % text.len()).copied().unwrap_or(b' ') } else { x as u8 };
    }
    out
}
