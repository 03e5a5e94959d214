//! The machine's limits, measured in the same run as the engine: hash and compressor speed
//! per core, and the disk's sequential write bandwidth, so a benchmark prints the engine's
//! figure beside what the hardware allows.
//!
//! Invariants:
//! - Every figure is measured here and now; nothing is a constant.
//! - CPU primitives run on one thread over the bytes given (the benchmark's own data), in
//!   4 KiB chunks, for at least [`CPU_MEASURE_SECONDS_MIN`] so timer noise is negligible.
//! - Disk figures include `fdatasync`: bytes are on the device when the clock stops.

use serde::Serialize;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

/// Shortest measurement of a CPU primitive, in seconds.
pub const CPU_MEASURE_SECONDS_MIN: f64 = 0.3;
/// Chunk size of the CPU primitives, in bytes (the engine's block).
pub const PRIMITIVE_CHUNK_BYTES: usize = 4096;
/// Request size of the disk sequential write, in bytes.
pub const DISK_WRITE_REQUEST_BYTES: usize = 1 << 20;

/// One-core CPU speeds, in MB/s (10^6 bytes per second of input).
#[derive(Debug, Clone, Serialize)]
pub struct CpuPrimitives {
    /// BLAKE3 over 4 KiB chunks.
    pub blake3_mb_s: f64,
    /// LZ4 (lz4_flex block) compression of 4 KiB chunks.
    pub lz4_compress_mb_s: f64,
    /// LZ4 decompression of the same chunks.
    pub lz4_decompress_mb_s: f64,
    /// zstd level 1 compression of 4 KiB chunks.
    pub zstd1_compress_mb_s: f64,
    /// The write path's incompressibility probe on 4 KiB chunks (`dedupvol_core::incompressible`,
    /// which every unique chunk passes through when the volume compresses).
    pub probe_mb_s: f64,
    /// Share of the chunks the probe turns away as incompressible, as a fraction.
    pub probe_refused_fraction: f64,
    /// Mean LZ4 output / input over the data, as a fraction.
    pub lz4_size_fraction: f64,
    /// Mean zstd-1 output / input over the data, as a fraction.
    pub zstd1_size_fraction: f64,
}

/// Runs `f` over the 4 KiB chunks of `data` repeatedly until the minimum time has passed;
/// returns MB/s of input.
fn time_chunks(data: &[u8], mut f: impl FnMut(&[u8]) -> usize) -> (f64, usize) {
    let start = Instant::now();
    let mut bytes = 0u64;
    let mut sink = 0usize;
    loop {
        for ch in data.chunks_exact(PRIMITIVE_CHUNK_BYTES) {
            sink = sink.wrapping_add(f(ch));
            bytes += ch.len() as u64;
        }
        let t = start.elapsed().as_secs_f64();
        if t >= CPU_MEASURE_SECONDS_MIN {
            return (bytes as f64 / t / 1e6, sink);
        }
    }
}

/// Measures BLAKE3, LZ4, zstd-1 and the incompressibility probe on one core over `data` (use the benchmark's own data:
/// compressor speed depends on it). `data` should be a few MiB, whole 4 KiB chunks.
pub fn measure_cpu(data: &[u8]) -> CpuPrimitives {
    assert!(data.len() >= PRIMITIVE_CHUNK_BYTES, "need at least one chunk");
    let (blake3_mb_s, _) = time_chunks(data, |c| blake3::hash(c).as_bytes()[0] as usize);
    let (lz4_compress_mb_s, _) = time_chunks(data, |c| lz4_flex::block::compress(c).len());
    let compressed: Vec<Vec<u8>> = data.chunks_exact(PRIMITIVE_CHUNK_BYTES).map(lz4_flex::block::compress).collect();
    let lz4_total: usize = compressed.iter().map(|c| c.len()).sum();
    let start = Instant::now();
    let mut out = vec![0u8; PRIMITIVE_CHUNK_BYTES];
    let mut bytes = 0u64;
    let lz4_decompress_mb_s = loop {
        for c in &compressed {
            let n = lz4_flex::block::decompress_into(c, &mut out).unwrap_or(0);
            bytes += n as u64;
        }
        let t = start.elapsed().as_secs_f64();
        if t >= CPU_MEASURE_SECONDS_MIN {
            break bytes as f64 / t / 1e6;
        }
    };
    let mut zc = zstd::bulk::Compressor::new(1).ok();
    let mut zbuf = vec![0u8; zstd::zstd_safe::compress_bound(PRIMITIVE_CHUNK_BYTES)];
    let mut ztotal = 0usize;
    for c in data.chunks_exact(PRIMITIVE_CHUNK_BYTES) {
        ztotal += zc.as_mut().and_then(|z| z.compress_to_buffer(c, &mut zbuf).ok()).unwrap_or(c.len());
    }
    let (zstd1_compress_mb_s, _) =
        time_chunks(data, |c| zc.as_mut().and_then(|z| z.compress_to_buffer(c, &mut zbuf).ok()).unwrap_or(0));
    let zstd = dedupvol_core::Compression::Zstd;
    let (probe_mb_s, _) = time_chunks(data, |c| usize::from(dedupvol_core::incompressible(zstd, c)));
    let refused = data.chunks_exact(PRIMITIVE_CHUNK_BYTES).filter(|c| dedupvol_core::incompressible(zstd, c)).count();
    let n = (data.len() / PRIMITIVE_CHUNK_BYTES * PRIMITIVE_CHUNK_BYTES) as f64;
    CpuPrimitives {
        blake3_mb_s,
        lz4_compress_mb_s,
        lz4_decompress_mb_s,
        zstd1_compress_mb_s,
        probe_mb_s,
        probe_refused_fraction: (refused * PRIMITIVE_CHUNK_BYTES) as f64 / n,
        lz4_size_fraction: lz4_total as f64 / n,
        zstd1_size_fraction: ztotal as f64 / n,
    }
}

/// A disk write measurement.
#[derive(Debug, Clone, Serialize)]
pub struct DiskFigure {
    /// What was measured.
    pub what: String,
    /// Bytes written.
    pub bytes: u64,
    /// Seconds, including the final fdatasync.
    pub seconds: f64,
    /// MB/s (10^6 bytes per second).
    pub mb_s: f64,
    /// Write requests per second.
    pub ops_s: f64,
}

/// Sequential 1 MiB writes of `bytes` (random, incompressible data) into a new temp file in
/// `dir`, then fdatasync; the file is removed afterwards.
pub fn measure_disk_seq_write(dir: &Path, bytes: u64) -> std::io::Result<DiskFigure> {
    let path = dir.join(format!(".dedupvol-bench-seq-{}", std::process::id()));
    let _guard = RemoveOnDrop(path.clone());
    let f = OpenOptions::new().create(true).truncate(true).write(true).open(&path)?;
    let mut buf = vec![0u8; DISK_WRITE_REQUEST_BYTES];
    crate::rng::WyRand::new(0xD15C).fill(&mut buf);
    let start = Instant::now();
    let mut off = 0u64;
    while off < bytes {
        let n = (bytes - off).min(buf.len() as u64) as usize;
        f.write_all_at(&buf[..n], off)?;
        off += n as u64;
    }
    f.sync_data()?;
    let seconds = start.elapsed().as_secs_f64();
    Ok(DiskFigure {
        what: format!("sequential 1 MiB writes + fdatasync, {} MiB", bytes >> 20),
        bytes,
        seconds,
        mb_s: bytes as f64 / seconds / 1e6,
        ops_s: (bytes as f64 / DISK_WRITE_REQUEST_BYTES as f64) / seconds,
    })
}

/// Removes a temp file when dropped (also on error paths).
pub struct RemoveOnDrop(pub std::path::PathBuf);
impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::content::{ContentModel, DataSpec};

    #[test]
    fn cpu_primitives_are_positive_and_sizes_follow_the_data() {
        let m = ContentModel::new(DataSpec::new(0.0, 0.5, 1)).expect("model");
        let mut data = vec![0u8; 1 << 20];
        m.fill_range(0, &mut data);
        let p = measure_cpu(&data);
        assert!(p.blake3_mb_s > 0.0 && p.lz4_compress_mb_s > 0.0 && p.zstd1_compress_mb_s > 0.0);
        assert!((p.lz4_size_fraction - 0.5).abs() < 0.05, "lz4 fraction {}", p.lz4_size_fraction);
        assert!(p.zstd1_size_fraction < 0.6);
        assert!(p.probe_mb_s > 0.0);
        assert_eq!(p.probe_refused_fraction, 0.0, "the probe refused half-compressible chunks");
        let random = ContentModel::new(DataSpec::new(0.0, 0.0, 1)).expect("model");
        random.fill_range(0, &mut data);
        let r = measure_cpu(&data);
        assert_eq!(r.probe_refused_fraction, 1.0, "the probe let random chunks through");
    }

    #[test]
    fn disk_write_leaves_no_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = measure_disk_seq_write(dir.path(), 4 << 20).expect("disk");
        assert_eq!(f.bytes, 4 << 20);
        assert!(f.mb_s > 0.0);
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
    }
}
