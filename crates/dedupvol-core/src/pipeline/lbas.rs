//! The logical blocks of a batch's chunks: one run of consecutive blocks (a request), or
//! the runs of several requests combined into one batch (`batcher`).
//!
//! Invariants:
//! - Runs are kept in chunk order, the first starts at chunk 0, and each starts after the
//!   previous one (asserted in `push`); chunk `i` belongs to the last run starting at or
//!   before `i`.
//! - Two chunks are neighbours (`continues`) only inside one run: chunks of different
//!   requests never form one extent, even when their blocks happen to be adjacent, so a
//!   random 4 KiB write stays a single block whatever was combined with it.

/// Where each chunk of a batch goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Lbas {
    /// (first chunk, its logical block) per run.
    runs: Vec<(usize, u64)>,
}

impl Lbas {
    /// One run of consecutive blocks from `lba0`.
    pub(crate) fn run(lba0: u64) -> Self {
        Lbas { runs: vec![(0, lba0)] }
    }

    /// No runs yet: `push` adds them.
    pub(crate) fn empty() -> Self {
        Lbas { runs: Vec::new() }
    }

    /// Adds a run whose first chunk is `first` (after every chunk of the previous run).
    pub(crate) fn push(&mut self, first: usize, lba: u64) {
        debug_assert!(
            self.runs.last().map_or(first == 0, |&(f, _)| first > f),
            "runs are pushed in chunk order, the first at chunk 0"
        );
        self.runs.push((first, lba));
    }

    /// Runs (requests) in the batch.
    #[cfg(test)]
    pub(crate) fn runs(&self) -> usize {
        self.runs.len()
    }

    /// The run holding chunk `i`.
    fn run_of(&self, i: usize) -> (usize, u64) {
        let k = self.runs.partition_point(|&(f, _)| f <= i);
        self.runs.get(k.wrapping_sub(1)).copied().unwrap_or((0, 0))
    }

    /// The logical block of chunk `i`.
    pub(crate) fn at(&self, i: usize) -> u64 {
        let (first, lba) = self.run_of(i);
        lba + (i - first) as u64
    }

    /// True when chunk `i` follows chunk `i - 1` in the same run (same request, next block).
    pub(crate) fn continues(&self, i: usize) -> bool {
        i > 0 && self.run_of(i).0 < i
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_map_to_their_runs_and_runs_do_not_join() {
        let one = Lbas::run(100);
        assert_eq!((one.at(0), one.at(5)), (100, 105));
        assert!(!one.continues(0) && one.continues(1) && one.continues(9));
        let mut l = Lbas::empty();
        l.push(0, 7);
        l.push(1, 8); // adjacent block, but another request
        l.push(3, 500);
        assert_eq!((l.at(0), l.at(1), l.at(2), l.at(3), l.at(4)), (7, 8, 9, 500, 501));
        assert!(!l.continues(1), "a new request starts a new run even at the next block");
        assert!(l.continues(2) && !l.continues(3) && l.continues(4));
        assert_eq!(l.runs(), 3);
    }
}
