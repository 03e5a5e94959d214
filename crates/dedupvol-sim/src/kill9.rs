//! The child side of the real-process crash test (`tests/kill9.rs`): a deterministic write
//! workload on a real file, with a line on stdout after every completed flush.
//!
//! Invariants:
//! - Iteration `k` writes exactly `writes_of_iteration(k)` and then flushes; "flushed k" is
//!   printed only after that flush returned Ok, so every write of iterations `≤ k` is durable
//!   once the parent has read the line.
//! - The child never prints "flushed k+1" before the writes of iteration `k+1` are issued,
//!   so when it is killed after printing "flushed K", only iterations `K+1` and `K+2`
//!   (written, possibly flushed but not yet reported) may also have reached the file.

use crate::content::{self, Class, BLOCK};
use dedupvol_core::{Compression, DedupVerify, FileStorage, FormatOptions, OpenOptions, Storage, Volume, WritePolicy};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

/// Logical blocks of the child's volume.
pub const CHILD_LOGICAL_BLOCKS: u64 = 2048;
/// Bytes of the child's data file.
pub const CHILD_FILE_BYTES: u64 = 32 << 20;
/// Blocks written per iteration.
pub const WRITES_PER_ITERATION: u64 = 8;
/// Iterations the child runs at most (it is normally killed long before).
pub const CHILD_ITERATIONS_MAX: u64 = 10_000_000;

/// Format options of the child's volume.
pub fn child_format_options() -> FormatOptions {
    FormatOptions {
        logical_size_bytes: CHILD_LOGICAL_BLOCKS * BLOCK as u64,
        compression: Compression::Lz4,
        dedup: true,
        index_memory_bytes: 256 << 10,
        write_policy: WritePolicy::Async,
        slab_size_bytes: 1 << 20,
        verify: DedupVerify::Bytes,
        journal_size_bytes: Some(256 << 10),
        ..FormatOptions::default()
    }
}

/// Open options of the child's volume (small caches, so pages are evicted and written).
pub fn child_open_options() -> OpenOptions {
    OpenOptions { block_map_cache_bytes: 64 << 10, content_cache_bytes: 256 << 10, ..OpenOptions::default() }
}

/// The writes (logical block, content id) of iteration `k`.
pub fn writes_of_iteration(k: u64) -> Vec<(u64, u64)> {
    (0..WRITES_PER_ITERATION)
        .map(|j| {
            let n = k * WRITES_PER_ITERATION + j;
            // A multiplicative walk over the logical blocks mixes overwrites and new blocks.
            let lba = n.wrapping_mul(7919) % CHILD_LOGICAL_BLOCKS;
            let class = match n % 7 {
                0 => Class::Zero,
                1 | 2 => Class::Duplicate,
                3 | 4 => Class::Compressible,
                _ => Class::Unique,
            };
            (lba, content::make(class, n + 1))
        })
        .collect()
}

fn die(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("child-writer: {what}: {e}");
    std::process::exit(3);
}

/// Runs the child: formats `path` when it does not exist, then writes iterations
/// `start..` forever, printing "flushed k" after each flush. With `lie` it prints the line
/// without flushing (the negative control of the kill -9 test: it must be caught).
pub fn child_writer(path: &Path, start: u64, lie: bool) {
    let fresh = !path.exists();
    let file = FileStorage::create(path, Some(CHILD_FILE_BYTES)).unwrap_or_else(|e| die("create", e));
    let data: Arc<dyn Storage> = Arc::new(file);
    if fresh {
        Volume::format(data.clone(), None, &child_format_options(), false).unwrap_or_else(|e| die("format", e));
    }
    let vol = Volume::open(data, None, &child_open_options()).unwrap_or_else(|e| die("open", e));
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let _ = writeln!(out, "ready");
    let _ = out.flush();
    let mut buf = vec![0u8; BLOCK];
    for k in start..start + CHILD_ITERATIONS_MAX {
        for (lba, id) in writes_of_iteration(k) {
            content::fill(id, &mut buf);
            vol.write(lba * BLOCK as u64, &buf, false).unwrap_or_else(|e| die("write", e));
        }
        if !lie {
            vol.flush().unwrap_or_else(|e| die("flush", e));
        }
        if writeln!(out, "flushed {k}").and_then(|()| out.flush()).is_err() {
            return;
        }
    }
}
