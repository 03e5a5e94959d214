//! The unique-chunk predictor: a Bloom filter over the cheap hash (xxh3-64) of recently
//! written chunks, asked before the fingerprint (BLAKE3) is known, so that the
//! compression of chunks predicted unique runs in the same parallel pass as their
//! fingerprinting instead of after the index lookup.
//!
//! A prediction is only a schedule: a chunk predicted unique that the index then finds
//! stored has its early compression thrown away (the cost of that mistake: the wasted
//! compression), and a chunk predicted duplicate that turns out unique is compressed
//! after the lookup, as without a predictor (the cost: nothing but the lost overlap).
//!
//! Invariants:
//! - Nothing decides sharing or storing on a prediction: the index and verification do.
//! - Memory is bounded: two filter generations of `BITS_PER_ENTRY / 2` bits for each
//!   entry of the index's window; when the current generation has taken half the window's
//!   entries it becomes the previous one and a new, empty generation starts, so the
//!   filter forgets as the index's window does and its false-positive rate stays at the
//!   rate it was sized for.

use fastbloom::BloomFilter;
use serde::{Deserialize, Serialize};

/// Filter bits per index entry, both generations together (2 bytes: a false-positive rate
/// near 0.5% per generation at its fill limit, 7 hashes).
pub(crate) const BITS_PER_ENTRY: u64 = 16;
/// The fewest entries a generation is sized for.
const GENERATION_ENTRIES_MIN: u64 = 4096;

/// The predictor's figures (`PipelineStats::predictor`).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct PredictorStats {
    /// The predictor is on (dedup on, write-once journaling off).
    pub enabled: bool,
    /// Chunks predicted unique that were stored.
    pub unique_right: u64,
    /// Chunks predicted unique that the index found stored (their early compression was
    /// wasted).
    pub unique_wrong: u64,
    /// Chunks predicted duplicate that were shared.
    pub duplicate_right: u64,
    /// Chunks predicted duplicate that were stored (compressed after the lookup).
    pub duplicate_wrong: u64,
    /// Share of right predictions.
    pub accuracy: f64,
    /// Compression of chunks predicted unique, thrown away, in bytes of input.
    pub wasted_compress_bytes: u64,
    /// Memory of both filter generations, in bytes.
    pub memory_bytes: u64,
    /// `memory_bytes` per entry of the index's window.
    pub memory_bytes_per_entry: f64,
    /// Generations started since the open.
    pub rotations: u64,
}

/// The filter and its counters (behind the volume's predictor lock, taken once per batch
/// to predict and once to record).
pub(crate) struct Predictor {
    current: BloomFilter,
    previous: BloomFilter,
    /// Entries put in `current` (including repeats: the bound is on work, not on
    /// distinct entries, which errs on the side of rotating early).
    current_entries: u64,
    generation_entries: u64,
    pub(crate) stats: PredictorStats,
}

impl Predictor {
    /// A predictor for an index window of `window_entries` entries.
    pub(crate) fn new(window_entries: u64) -> Self {
        let generation_entries = (window_entries / 2).max(GENERATION_ENTRIES_MIN);
        let bits = (generation_entries * BITS_PER_ENTRY).div_ceil(64) * 64;
        let make = || BloomFilter::with_num_bits(bits as usize).expected_items(generation_entries as usize);
        let memory = 2 * bits / 8;
        Predictor {
            current: make(),
            previous: make(),
            current_entries: 0,
            generation_entries,
            stats: PredictorStats {
                enabled: true,
                memory_bytes: memory,
                memory_bytes_per_entry: memory as f64 / (generation_entries * 2) as f64,
                ..PredictorStats::default()
            },
        }
    }

    /// True when a chunk of this cheap hash is predicted unique (not written recently).
    pub(crate) fn predict_unique(&self, weak: u64) -> bool {
        !self.current.contains_hash(weak) && !self.previous.contains_hash(weak)
    }

    /// Records a written chunk's cheap hash.
    pub(crate) fn insert(&mut self, weak: u64) {
        if self.current_entries >= self.generation_entries {
            std::mem::swap(&mut self.current, &mut self.previous);
            self.current.clear();
            self.current_entries = 0;
            self.stats.rotations += 1;
        }
        self.current.insert_hash(weak);
        self.current_entries += 1;
        debug_assert!(self.current_entries <= self.generation_entries, "a generation holds at most its share");
    }

    /// Counts one chunk's prediction against what the index decided.
    pub(crate) fn score(&mut self, predicted_unique: bool, stored: bool, early_bytes: u64) {
        let s = &mut self.stats;
        match (predicted_unique, stored) {
            (true, true) => s.unique_right += 1,
            (true, false) => {
                s.unique_wrong += 1;
                s.wasted_compress_bytes += early_bytes;
            }
            (false, false) => s.duplicate_right += 1,
            (false, true) => s.duplicate_wrong += 1,
        }
        let all = s.unique_right + s.unique_wrong + s.duplicate_right + s.duplicate_wrong;
        s.accuracy = (s.unique_right + s.duplicate_right) as f64 / all.max(1) as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_chunks_are_predicted_duplicate_and_memory_stays_bounded() {
        let mut p = Predictor::new(100_000);
        assert!(p.predict_unique(42));
        p.insert(42);
        assert!(!p.predict_unique(42));
        // False positives at the fill limit stay near the rate the filter was sized for.
        for h in 0..50_000u64 {
            p.insert(h.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        }
        let fp = (1_000_000..1_100_000u64).filter(|h| !p.predict_unique(h.wrapping_mul(0x9E37_79B9_7F4A_7C15))).count();
        assert!(fp < 2_000, "{fp} false positives in 100,000");
        assert!(p.stats.memory_bytes_per_entry <= 2.0);
        // A generation rotation forgets the oldest entries, not the recent ones.
        for h in 0..60_000u64 {
            p.insert(h.wrapping_mul(0x2545_F491_4F6C_DD1D));
        }
        assert!(p.stats.rotations >= 1);
        assert!(!p.predict_unique(59_999u64.wrapping_mul(0x2545_F491_4F6C_DD1D)));
    }

    #[test]
    fn scores_add_up() {
        let mut p = Predictor::new(1000);
        p.score(true, true, 4096);
        p.score(true, false, 4096);
        p.score(false, false, 0);
        p.score(false, true, 0);
        assert_eq!(p.stats.accuracy, 0.5);
        assert_eq!(p.stats.wasted_compress_bytes, 4096);
    }
}
