//! Workloads: data ([`DataSpec`]) plus an access pattern, the presets from the papers, and
//! the deterministic I/O stream a benchmark replays.
//!
//! A [`Workload`] says what data is written (dedup, compression, zeros) and how it is
//! accessed (read share, random share, request-size mixes for reads and writes). An
//! [`IoStream`] turns it into a sequence of [`IoOp`]s over a logical range; every 4 KiB
//! block a write carries takes the next *write stream index*, whose bytes come from the
//! [`ContentModel`] — so the dedup and compression ratios of the written data are those of
//! the spec, whatever the access pattern.
//!
//! Invariants:
//! - Offsets and lengths are multiples of 4 KiB and every op lies inside the range.
//! - The stream is a pure function of the workload, the range and the seed.
//! - Each size mix has positive total weight and sizes that are non-zero multiples of 4 KiB.

use crate::content::{ContentModel, DataSpec, BLOCK_BYTES, LANE_BLOCKS};
use crate::rng::{mix64, WyRand};
use serde::Serialize;

/// A weighted request-size distribution.
#[derive(Debug, Clone, Serialize)]
pub struct SizeMix {
    /// `(size_bytes, weight)` pairs.
    pub entries: Vec<(u64, f64)>,
}

impl SizeMix {
    /// One fixed size.
    pub fn fixed(size_bytes: u64) -> Self {
        SizeMix { entries: vec![(size_bytes, 1.0)] }
    }

    /// Mean request size in bytes.
    pub fn mean_bytes(&self) -> f64 {
        let w: f64 = self.entries.iter().map(|e| e.1).sum();
        self.entries.iter().map(|(s, x)| *s as f64 * x).sum::<f64>() / w
    }

    /// Largest size in the mix, in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.0).max().unwrap_or(BLOCK_BYTES as u64)
    }

    fn pick(&self, rng: &mut WyRand) -> u64 {
        let total: f64 = self.entries.iter().map(|e| e.1).sum();
        let mut x = rng.unit() * total;
        for (s, w) in &self.entries {
            if x < *w {
                return *s;
            }
            x -= w;
        }
        self.entries.last().map(|e| e.0).unwrap_or(BLOCK_BYTES as u64)
    }

    /// fio's `bssplit` syntax (`8k/50:64k/25:...`), for the suite.
    pub fn to_fio_bssplit(&self) -> String {
        let total: f64 = self.entries.iter().map(|e| e.1).sum();
        let mut pcts: Vec<u64> = self.entries.iter().map(|e| (e.1 / total * 100.0).round() as u64).collect();
        // fio wants the percentages to sum to exactly 100.
        let sum: u64 = pcts.iter().sum();
        if let Some(first) = pcts.first_mut() {
            *first = (*first + 100).saturating_sub(sum);
        }
        self.entries.iter().zip(pcts).map(|((s, _), p)| format!("{}k/{p}", s / 1024)).collect::<Vec<_>>().join(":")
    }

    fn validate(&self) -> Result<(), String> {
        if self.entries.is_empty() || self.entries.iter().map(|e| e.1).sum::<f64>() <= 0.0 {
            return Err("a size mix needs at least one entry with positive weight".into());
        }
        for (s, w) in &self.entries {
            if *s == 0 || *s % BLOCK_BYTES as u64 != 0 || *w < 0.0 {
                return Err(format!("request size {s} must be a non-zero multiple of 4096 with weight >= 0"));
            }
        }
        Ok(())
    }
}

/// Data plus access pattern.
#[derive(Debug, Clone, Serialize)]
pub struct Workload {
    /// Preset name or "custom".
    pub name: String,
    /// The data written.
    pub data: DataSpec,
    /// Fraction of ops that are reads.
    pub read_fraction: f64,
    /// Fraction of ops at a random offset (the rest continue where the previous op ended).
    pub random_fraction: f64,
    /// Read request sizes.
    pub read_sizes: SizeMix,
    /// Write request sizes.
    pub write_sizes: SizeMix,
}

/// Names of the presets, in the order `--help` lists them.
pub const PRESET_NAMES: [&str; 6] = ["write-low", "write-medium", "write-high", "mixed-medium", "sql", "vdi"];

impl Workload {
    /// A preset from the papers (Vdbench models of the POMACS 2022 evaluation).
    ///
    /// - write-low / write-medium / write-high: write-only, 35/35, 50/50, 80/80 percent
    ///   dedup/compression, sizes 4–64 KiB (mean 20 KiB), half random;
    /// - mixed-medium: write-medium data with 50% reads;
    /// - sql: 68% reads, 80% random, mean 52 KiB reads and 32 KiB writes, 50% dedup +
    ///   15% compression (about 65% reduction);
    /// - vdi: the same access, 79% dedup + 18% compression.
    pub fn preset(name: &str, seed: u64) -> Result<Workload, String> {
        let small_mix = SizeMix { entries: vec![(4096, 0.4), (16384, 0.3), (32768, 0.15), (65536, 0.15)] };
        // mean 0.5*8 + 0.25*64 + 0.25*128 = 52 KiB
        let sql_reads = SizeMix { entries: vec![(8192, 0.5), (65536, 0.25), (131072, 0.25)] };
        // mean 0.5*8 + 0.25*16 + 0.25*96 = 32 KiB
        let sql_writes = SizeMix { entries: vec![(8192, 0.5), (16384, 0.25), (98304, 0.25)] };
        let w = |name: &str, dup: f64, comp: f64, read: f64, random: f64, rs: SizeMix, ws: SizeMix| Workload {
            name: name.to_string(),
            data: DataSpec::new(dup, comp, seed),
            read_fraction: read,
            random_fraction: random,
            read_sizes: rs,
            write_sizes: ws,
        };
        Ok(match name {
            "write-low" => w(name, 0.35, 0.35, 0.0, 0.5, small_mix.clone(), small_mix),
            "write-medium" => w(name, 0.50, 0.50, 0.0, 0.5, small_mix.clone(), small_mix),
            "write-high" => w(name, 0.80, 0.80, 0.0, 0.5, small_mix.clone(), small_mix),
            "mixed-medium" => w(name, 0.50, 0.50, 0.5, 0.5, small_mix.clone(), small_mix),
            "sql" => w(name, 0.50, 0.15, 0.68, 0.8, sql_reads, sql_writes),
            "vdi" => w(name, 0.79, 0.18, 0.68, 0.8, sql_reads, sql_writes),
            _ => return Err(format!("unknown preset {name:?}; presets: {}", PRESET_NAMES.join(", "))),
        })
    }

    /// Checks fractions and size mixes.
    pub fn validate(&self) -> Result<(), String> {
        self.data.validate()?;
        for (n, v) in [("read", self.read_fraction), ("random", self.random_fraction)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{n} fraction {v} must be between 0 and 1"));
            }
        }
        self.read_sizes.validate()?;
        self.write_sizes.validate()
    }
}

/// Read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum IoKind {
    /// Read `len` bytes.
    Read,
    /// Write `len` bytes of stream blocks starting at `first_block`.
    Write {
        /// Write stream index of the first 4 KiB block (feeds [`ContentModel::content_of`]).
        first_block: u64,
    },
}

/// One request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct IoOp {
    /// Read or write.
    pub kind: IoKind,
    /// Byte offset (4 KiB aligned).
    pub offset: u64,
    /// Byte length (multiple of 4 KiB).
    pub len: u64,
}

/// The deterministic op sequence of a workload over `range_bytes`.
pub struct IoStream {
    workload: Workload,
    range_bytes: u64,
    rng: WyRand,
    cursor: u64,
    next_block: u64,
}

impl IoStream {
    /// A stream of `workload` over `[0, range_bytes)`; `stream_id` separates the streams of
    /// parallel writers (each gets its own op choices and its own block indices).
    pub fn new(workload: Workload, range_bytes: u64, stream_id: u64) -> Result<Self, String> {
        workload.validate()?;
        let max = workload.read_sizes.max_bytes().max(workload.write_sizes.max_bytes());
        if range_bytes < max || !range_bytes.is_multiple_of(BLOCK_BYTES as u64) {
            return Err(format!("range {range_bytes} must be a multiple of 4096 of at least {max} bytes"));
        }
        let seed = mix64(workload.data.seed ^ 0x5712_EA77, stream_id);
        Ok(IoStream {
            workload,
            range_bytes,
            rng: WyRand::new(seed),
            cursor: 0,
            // Parallel streams draw block indices from their own lanes.
            next_block: stream_id * LANE_BLOCKS,
        })
    }

    /// A content model for this stream's data.
    pub fn content_model(&self) -> Result<ContentModel, String> {
        ContentModel::new(self.workload.data.clone())
    }
}

impl Iterator for IoStream {
    type Item = IoOp;
    fn next(&mut self) -> Option<IoOp> {
        let read = self.rng.unit() < self.workload.read_fraction;
        let len = if read {
            self.workload.read_sizes.pick(&mut self.rng)
        } else {
            self.workload.write_sizes.pick(&mut self.rng)
        };
        let random = self.rng.unit() < self.workload.random_fraction;
        let slots = (self.range_bytes - len) / BLOCK_BYTES as u64 + 1;
        let offset = if random || self.cursor + len > self.range_bytes {
            if random {
                self.rng.below(slots) * BLOCK_BYTES as u64
            } else {
                0
            }
        } else {
            self.cursor
        };
        self.cursor = offset + len;
        let kind = if read {
            IoKind::Read
        } else {
            let first_block = self.next_block;
            self.next_block += len / BLOCK_BYTES as u64;
            IoKind::Write { first_block }
        };
        Some(IoOp { kind, offset, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sql_preset_matches_its_description() {
        let w = Workload::preset("sql", 1).expect("preset");
        assert!((w.read_sizes.mean_bytes() - 52.0 * 1024.0).abs() < 1.0);
        assert!((w.write_sizes.mean_bytes() - 32.0 * 1024.0).abs() < 1.0);
        let ops: Vec<IoOp> = IoStream::new(w, 1 << 30, 0).expect("stream").take(20_000).collect();
        let reads = ops.iter().filter(|o| o.kind == IoKind::Read).count() as f64 / ops.len() as f64;
        assert!((reads - 0.68).abs() < 0.02, "read share {reads}");
        for o in &ops {
            assert_eq!(o.offset % 4096, 0);
            assert!(o.offset + o.len <= 1 << 30);
        }
    }

    #[test]
    fn every_preset_is_valid_and_unknown_ones_fail() {
        for p in PRESET_NAMES {
            Workload::preset(p, 0).expect("preset").validate().expect("valid");
        }
        assert!(Workload::preset("oltp", 0).is_err());
    }

    #[test]
    fn sequential_streams_continue_and_wrap() {
        let mut w = Workload::preset("write-low", 0).expect("preset");
        w.random_fraction = 0.0;
        w.write_sizes = SizeMix::fixed(8192);
        w.read_sizes = SizeMix::fixed(8192);
        let ops: Vec<IoOp> = IoStream::new(w, 32768, 0).expect("stream").take(6).collect();
        let offsets: Vec<u64> = ops.iter().map(|o| o.offset).collect();
        assert_eq!(offsets, vec![0, 8192, 16384, 24576, 0, 8192]);
    }

    #[test]
    fn bssplit_sums_to_100() {
        let w = Workload::preset("sql", 0).expect("preset");
        assert_eq!(w.read_sizes.to_fio_bssplit(), "8k/50:64k/25:128k/25");
    }
}
