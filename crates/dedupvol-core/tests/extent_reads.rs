//! Measurement (ignored by default): random 4 KiB reads of data stored as 64 KiB extents
//! against the same data stored block by block, on a file-backed volume with the content
//! cache off. Run with
//! `DEDUPVOL_EXTENT_READS_FILE=some.tar cargo test --release -p dedupvol-core --test extent_reads -- --ignored --nocapture`
//! (default: a generated, compressible file). `DEDUPVOL_EXTENT_READS_CAPS=4,8` measures only
//! those caps (in blocks; default 4, 8 and 16). `DEDUPVOL_EXTENT_READS_SETTLE=1` settles
//! the volume at its rest level (zstd 6, with the dictionary trained from the data)
//! before the reads, as an idle volume would be.

use dedupvol_core::{FileStorage, FormatOptions, IoMode, OpenOptions, Storage, Volume};
use std::sync::Arc;
use std::time::Instant;

const B: usize = 4096;
const BYTES: usize = 256 << 20;
const READS: usize = 100_000;

fn data() -> Vec<u8> {
    match std::env::var_os("DEDUPVOL_EXTENT_READS_FILE") {
        Some(p) => {
            let mut d = std::fs::read(p).expect("read the file");
            d.truncate(BYTES);
            d.resize(BYTES, 0);
            d
        }
        None => (0..BYTES / B).flat_map(|i| text_block(i as u64)).collect(),
    }
}

fn text_block(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..B)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if i % 5 == 0 {
                x as u8
            } else {
                let text = b"lorem ipsum dolor sit amet ";
                text.get(i % text.len()).copied().unwrap_or(b' ')
            }
        })
        .collect()
}

/// Writes `data` in requests of `request` bytes, then times random 4 KiB reads.
fn run(path: &std::path::Path, data: &[u8], request: usize, extent: u8) -> (f64, f64) {
    let _ = std::fs::remove_file(path);
    let dev: Arc<dyn Storage> =
        Arc::new(FileStorage::create_with(path, Some((BYTES as u64) * 2), IoMode::Direct).expect("create the file"));
    // The volume allows every size; each run's open cap picks its own.
    let fmt =
        FormatOptions { logical_size_bytes: BYTES as u64, extent_blocks_max: Some(16), ..FormatOptions::default() };
    Volume::format(dev.clone(), None, &fmt, true).expect("format");
    let opts = OpenOptions { content_cache_bytes: 0, extent_blocks_max: extent, ..OpenOptions::default() };
    let vol = Volume::open(dev.clone(), None, &opts).expect("open");
    for (k, c) in data.chunks(request).enumerate() {
        vol.write((k * request) as u64, c, false).expect("write");
    }
    vol.flush().expect("flush");
    if std::env::var_os("DEDUPVOL_EXTENT_READS_SETTLE").is_some() {
        vol.settle(&dedupvol_core::RecompressOptions::default(), &|| false).expect("settle");
    }
    let ratio = vol.stats().reduction_ratio;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut b = vec![0u8; B];
    let t = Instant::now();
    for _ in 0..READS {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let lba = x % (BYTES / B) as u64;
        vol.read(lba * B as u64, &mut b).expect("read");
        assert!(data.get(lba as usize * B..(lba as usize + 1) * B) == Some(&b[..]));
    }
    let rate = READS as f64 / t.elapsed().as_secs_f64();
    vol.close().expect("close");
    let _ = std::fs::remove_file(path);
    (rate, ratio)
}

#[test]
#[ignore = "a measurement: run it on purpose (see the module docs)"]
fn random_reads_of_extents_against_single_blocks() {
    let data = data();
    let dir = std::env::temp_dir();
    let path = dir.join(format!("dedupvol-extent-reads-{}.img", std::process::id()));
    let caps: Vec<u8> = match std::env::var("DEDUPVOL_EXTENT_READS_CAPS") {
        Ok(v) => v.split(',').map(|c| c.trim().parse().expect("DEDUPVOL_EXTENT_READS_CAPS: blocks, 1..=16")).collect(),
        Err(_) => vec![4, 8, 16],
    };
    // Interleaved, twice each: this machine's speed drifts.
    for round in 0..2 {
        // Settling regroups single blocks into extents of the open's cap: one block, to
        // keep them single.
        let settle = std::env::var_os("DEDUPVOL_EXTENT_READS_SETTLE").is_some();
        let (single, r1) = run(&path, &data, B, if settle { 1 } else { 16 });
        for &blocks in &caps {
            let (extent, r2) = run(&path, &data, 128 << 10, blocks);
            println!(
                "round {round}: random 4 KiB reads/s: single blocks {single:.0} (stored {r1:.2}x), {} KiB extents {extent:.0} (stored {r2:.2}x): {:.2}x",
                u32::from(blocks) * 4,
                extent / single
            );
        }
    }
}
