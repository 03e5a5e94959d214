//! Deterministic block contents with a target duplicate fraction and compressibility.
//!
//! A data stream is a sequence of 4 KiB blocks numbered by their *stream index* `i`
//! (0, 1, 2, …). [`ContentModel::content_of`] maps every index to a [`Content`]: a zero
//! block, or the block of a *content id*. A block whose content id equals its own index is
//! the first occurrence of that content (a unique block); a duplicate points back to the
//! content of an earlier index, drawn uniformly from a sliding *working set* of the
//! previous `working_set_blocks` indices (Vdbench's dedup sets, fio's
//! `dedupe_mode=working_set`) — duplicates are spread over the working set, never adjacent
//! copies.
//!
//! Invariants:
//! - Everything is a pure function of `(seed, index)`: any thread can generate any block
//!   in any order and get the same bytes, so writers and verifiers need no shared state.
//! - Blocks of different content ids differ (the id is stamped into the first 8 bytes and
//!   seeds the random bytes); blocks of the same id are byte-identical.
//! - Indices are grouped in lanes of 2^40 blocks (one per parallel stream); a duplicate
//!   points to an earlier index of its own lane, and the first index of a lane is unique.
//! - A duplicate always resolves to an earlier index whose decision was "unique", so the
//!   duplicate chain is finite (strictly decreasing indices).
//! - Of the non-zero blocks, the fraction of duplicates converges to `dup_fraction` once the
//!   stream is longer than a few blocks (index 0 is always unique).
//! - Compressibility: a block is `random_fraction` random bytes and the rest a repeated
//!   8-byte word, interleaved in 256-byte segments; `random_fraction` is calibrated with
//!   LZ4 (the engine's default codec) so that the mean LZ4 output of a unique block is
//!   `(1 - compress_fraction) × 4096` bytes.

use crate::rng::{mix64, unit_f64, WyRand};
use serde::Serialize;

/// The dedup unit and block size of generated data, in bytes.
pub const BLOCK_BYTES: usize = 4096;
/// Interleaving granularity of random and repeated bytes, in bytes.
const SEGMENT_BYTES: usize = 256;
/// Blocks sampled when calibrating compressibility.
const CALIBRATION_SAMPLE_BLOCKS: u64 = 48;
/// Bisection steps when calibrating compressibility (2^-24 resolution of the fraction).
const CALIBRATION_STEPS: u32 = 24;
/// Stream indices form lanes of this many blocks; duplicates never cross a lane, so
/// parallel streams (lane `k` starts at `k × LANE_BLOCKS`) each have the spec's ratios.
pub const LANE_BLOCKS: u64 = 1 << 40;
/// Draws of a unique, non-zero duplicate source before falling back to following a chain.
const DUP_SOURCE_ATTEMPTS: u32 = 64;

/// What the data looks like. Percentages are fractions in `0.0..=1.0`.
#[derive(Debug, Clone, Serialize)]
pub struct DataSpec {
    /// Fraction of non-zero blocks that duplicate an earlier block.
    pub dup_fraction: f64,
    /// Fraction of a unique block's bytes LZ4 saves (0 = incompressible, 0.5 = halves it).
    pub compress_fraction: f64,
    /// Fraction of blocks that are all zeros.
    pub zero_fraction: f64,
    /// Duplicates are drawn from this many preceding blocks (`u64::MAX`: all of them;
    /// serialized as `null` then, so JSON readers never see the sentinel as a size).
    #[serde(serialize_with = "working_set_json")]
    pub working_set_blocks: u64,
    /// Seed of every choice and every random byte.
    pub seed: u64,
}

/// `working_set_blocks` in JSON: the number, or `null` for "all earlier blocks".
fn working_set_json<S: serde::Serializer>(blocks: &u64, s: S) -> Result<S::Ok, S::Error> {
    if *blocks == u64::MAX {
        s.serialize_none()
    } else {
        s.serialize_some(blocks)
    }
}

impl DataSpec {
    /// A spec with no zero blocks and an unbounded working set.
    pub fn new(dup_fraction: f64, compress_fraction: f64, seed: u64) -> Self {
        DataSpec { dup_fraction, compress_fraction, zero_fraction: 0.0, working_set_blocks: u64::MAX, seed }
    }

    /// Checks that every fraction is within `0..=1` (compressibility below 1: a block
    /// keeps at least its id).
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in
            [("dup", self.dup_fraction), ("compress", self.compress_fraction), ("zero", self.zero_fraction)]
        {
            if !(0.0..=1.0).contains(&v) || v.is_nan() {
                return Err(format!("{name} fraction {v} must be between 0 and 1 (percent / 100)"));
            }
        }
        if self.compress_fraction > 0.99 {
            return Err(format!("compressibility {} must be at most 0.99", self.compress_fraction));
        }
        if self.working_set_blocks == 0 {
            return Err("working set must hold at least one block".into());
        }
        Ok(())
    }

    /// One line naming the data, for table headers.
    pub fn describe(&self) -> String {
        let ws = if self.working_set_blocks == u64::MAX {
            "all earlier blocks".to_string()
        } else {
            format!("{} MiB", (self.working_set_blocks * BLOCK_BYTES as u64) >> 20)
        };
        format!(
            "{:.0}% duplicates (working set: {ws}), {:.0}% compressible (LZ4), {:.0}% zero blocks, 4 KiB dedup unit, seed {}",
            self.dup_fraction * 100.0,
            self.compress_fraction * 100.0,
            self.zero_fraction * 100.0,
            self.seed
        )
    }
}

/// The content of one stream block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    /// All zeros.
    Zero,
    /// The block of this content id (the stream index of its first occurrence).
    Data(u64),
}

/// A calibrated generator for one [`DataSpec`].
#[derive(Debug, Clone)]
pub struct ContentModel {
    spec: DataSpec,
    /// Random bytes per block, calibrated for the target LZ4 ratio.
    random_bytes: usize,
}

impl ContentModel {
    /// Calibrates the random fraction for `spec` (a few milliseconds).
    pub fn new(spec: DataSpec) -> Result<Self, String> {
        spec.validate()?;
        let mut model = ContentModel { spec, random_bytes: BLOCK_BYTES };
        model.random_bytes = model.calibrate();
        Ok(model)
    }

    /// The spec this model generates.
    pub fn spec(&self) -> &DataSpec {
        &self.spec
    }

    /// Random bytes per unique block after calibration.
    pub fn random_bytes(&self) -> usize {
        self.random_bytes
    }

    fn calibrate(&self) -> usize {
        let target = (1.0 - self.spec.compress_fraction) * BLOCK_BYTES as f64;
        if self.spec.compress_fraction <= 0.0 {
            return BLOCK_BYTES;
        }
        let mut lo = 0usize;
        let mut hi = BLOCK_BYTES;
        let mut buf = vec![0u8; BLOCK_BYTES];
        // Mean LZ4 size grows monotonically with the random byte count: bisect on it.
        for _ in 0..CALIBRATION_STEPS {
            if hi - lo <= 1 {
                break;
            }
            let mid = (lo + hi) / 2;
            let mut total = 0usize;
            for id in 0..CALIBRATION_SAMPLE_BLOCKS {
                fill_with(&mut buf, self.spec.seed ^ 0xCA11_B8A7, id, mid);
                total += lz4_flex::block::compress(&buf).len();
            }
            let mean = total as f64 / CALIBRATION_SAMPLE_BLOCKS as f64;
            if mean < target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// The content of stream block `index`.
    pub fn content_of(&self, index: u64) -> Content {
        let s = &self.spec;
        if self.is_zero(index) {
            return Content::Zero;
        }
        let mut i = index;
        loop {
            let h = mix64(s.seed ^ 0xD0B1_1CA7_E5E7_u64, i);
            let lane_start = i & !(LANE_BLOCKS - 1);
            if i == lane_start || unit_f64(h) >= s.dup_fraction {
                return Content::Data(i);
            }
            let lo = i.saturating_sub(s.working_set_blocks).max(lane_start);
            let span = i - lo;
            // Draw until the source is itself a first occurrence, so every unique block in
            // the working set is equally likely to be copied (following duplicate chains
            // instead would make early blocks ever more popular and blow past the
            // engine's reference-count cap).
            let mut fallback = None;
            for attempt in 0..DUP_SOURCE_ATTEMPTS {
                let j = lo + mix64(h, u64::from(attempt)) % span;
                if self.is_zero(j) {
                    continue;
                }
                if j == lane_start || unit_f64(mix64(s.seed ^ 0xD0B1_1CA7_E5E7_u64, j)) >= s.dup_fraction {
                    return Content::Data(j);
                }
                fallback.get_or_insert(j);
            }
            match fallback {
                Some(j) => i = j,
                None => return Content::Data(i),
            }
        }
    }

    fn is_zero(&self, index: u64) -> bool {
        self.spec.zero_fraction > 0.0 && unit_f64(mix64(self.spec.seed ^ 0x2E60_B10C, index)) < self.spec.zero_fraction
    }

    /// Writes the bytes of `content` into `buf` (exactly [`BLOCK_BYTES`] long).
    pub fn fill(&self, content: Content, buf: &mut [u8]) {
        assert_eq!(buf.len(), BLOCK_BYTES, "blocks are generated whole");
        match content {
            Content::Zero => buf.fill(0),
            Content::Data(id) => fill_with(buf, self.spec.seed, id, self.random_bytes),
        }
    }

    /// Writes stream blocks `first_index..` into `buf` (a whole number of blocks).
    pub fn fill_range(&self, first_index: u64, buf: &mut [u8]) {
        assert_eq!(buf.len() % BLOCK_BYTES, 0, "ranges are whole blocks");
        for (k, block) in buf.chunks_exact_mut(BLOCK_BYTES).enumerate() {
            self.fill(self.content_of(first_index + k as u64), block);
        }
    }
}

/// Fills one block for content `id`: `random_bytes` random bytes spread over 256-byte
/// segments (Bresenham-style, so the random share is even across the block), the rest a
/// repeated per-block 8-byte word that LZ4 shrinks to almost nothing.
fn fill_with(buf: &mut [u8], seed: u64, id: u64, random_bytes: usize) {
    let mut rng = WyRand::new(mix64(seed ^ 0xB10C_DA7A, id));
    let word = rng.next_u64().to_le_bytes();
    let segments = BLOCK_BYTES / SEGMENT_BYTES;
    let mut random_left = random_bytes;
    for (k, seg) in buf.chunks_exact_mut(SEGMENT_BYTES).enumerate() {
        // Random bytes for this segment: an even share of what is left.
        let segs_left = segments - k;
        let r = random_left.div_ceil(segs_left).min(SEGMENT_BYTES);
        random_left -= r;
        let (rand_part, fill_part) = seg.split_at_mut(r);
        rng.fill(rand_part);
        for (n, b) in fill_part.iter_mut().enumerate() {
            *b = word[n % 8];
        }
    }
    // The id makes blocks of different content ids distinct even with no random bytes.
    if let Some(head) = buf.get_mut(..8) {
        head.copy_from_slice(&id.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn dup_fraction_is_reached_and_duplicates_are_not_adjacent() {
        let m = ContentModel::new(DataSpec::new(0.75, 0.5, 7)).expect("model");
        let n = 100_000u64;
        let mut unique = 0u64;
        let mut adjacent = 0u64;
        let mut prev = None;
        for i in 0..n {
            let c = m.content_of(i);
            if c == Content::Data(i) {
                unique += 1;
            }
            if prev == Some(c) {
                adjacent += 1;
            }
            prev = Some(c);
        }
        let dup = 1.0 - unique as f64 / n as f64;
        assert!((dup - 0.75).abs() < 0.01, "dup fraction {dup}");
        assert!(adjacent < n / 200, "{adjacent} adjacent copies");
    }

    #[test]
    fn compressibility_is_calibrated_for_lz4() {
        for target in [0.0, 0.15, 0.35, 0.5, 0.8] {
            let m = ContentModel::new(DataSpec::new(0.0, target, 3)).expect("model");
            let mut buf = vec![0u8; BLOCK_BYTES];
            let mut total = 0usize;
            let blocks = 500u64;
            for i in 0..blocks {
                m.fill(m.content_of(i), &mut buf);
                total += lz4_flex::block::compress(&buf).len().min(BLOCK_BYTES);
            }
            let saved = 1.0 - total as f64 / (blocks as f64 * BLOCK_BYTES as f64);
            assert!((saved - target).abs() < 0.02, "target {target}, LZ4 saved {saved}");
        }
    }

    #[test]
    fn same_index_same_bytes_and_unique_blocks_differ() {
        let m = ContentModel::new(DataSpec::new(0.5, 0.9, 11)).expect("model");
        let mut a = vec![0u8; BLOCK_BYTES];
        let mut b = vec![0u8; BLOCK_BYTES];
        let mut seen = HashSet::new();
        for i in 0..2000 {
            m.fill(m.content_of(i), &mut a);
            m.fill(m.content_of(i), &mut b);
            assert_eq!(a, b);
            if m.content_of(i) == Content::Data(i) {
                assert!(seen.insert(blake3::hash(&a)), "unique block {i} repeats earlier bytes");
            }
        }
    }

    #[test]
    fn zero_fraction_and_working_set_are_honoured() {
        let mut spec = DataSpec::new(0.9, 0.0, 5);
        spec.zero_fraction = 0.2;
        spec.working_set_blocks = 64;
        let m = ContentModel::new(spec).expect("model");
        let n = 50_000u64;
        let mut zeros = 0;
        for i in 0..n {
            match m.content_of(i) {
                Content::Zero => zeros += 1,
                Content::Data(id) => assert!(id <= i),
            }
        }
        let z = zeros as f64 / n as f64;
        assert!((z - 0.2).abs() < 0.01, "zero fraction {z}");
    }

    #[test]
    fn bad_specs_are_rejected() {
        assert!(ContentModel::new(DataSpec::new(1.5, 0.0, 0)).is_err());
        assert!(ContentModel::new(DataSpec::new(0.5, -0.1, 0)).is_err());
        assert!(ContentModel::new(DataSpec::new(0.5, 1.0, 0)).is_err());
    }
}
