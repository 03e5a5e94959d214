//! The checker's model of the durability contract (docs/design.md), per logical block.
//!
//! A block's content is a *version*: the content id of each of its eight 512-byte sectors
//! (a full-block write of id `c` is `[c; 8]`; a partial write replaces some sectors). The
//! contract is block by block, so a read must match one whole allowed version — a torn mix
//! of two versions is a failure even when each sector alone would be allowed.
//!
//! For every logical block the model keeps two small sets of versions:
//! - `now`: what a read may return at this moment (one id, unless a write to the block
//!   failed, in which case it may or may not have happened);
//! - `after_crash`: what a read may return after a crash at this moment: the last durable
//!   content plus every later acknowledged (or failed) write.
//!
//! Invariants:
//! - `now ⊆ after_crash`, and neither is empty. Untouched blocks are `{ZERO}` for both.
//! - An acknowledged durable write (FUA, `sync` policy) collapses both sets to its content.
//! - A completed flush sets `after_crash := now` for every block.
//! - A crash sets `now := after_crash`; a value read back after recovery collapses both
//!   sets to it (recovery must not leave a state that a second crash could undo).
//! - Set sizes are bounded by `ALLOWED_CONTENTS_MAX`: a workload that would exceed it
//!   (too many writes to one block between flushes) is a driver bug, caught by an assert.

use crate::content::ZERO;
use std::collections::BTreeMap;

/// Sectors per block.
pub const SECTORS: usize = 8;
/// A block's content: the content id of each sector.
pub type Version = [u64; SECTORS];
/// The zero block.
pub const ZERO_VERSION: Version = [ZERO; SECTORS];

/// The version of a full-block write of content `id`.
pub fn full(id: u64) -> Version {
    [id; SECTORS]
}

/// Most contents one block may be allowed to hold at once.
pub const ALLOWED_CONTENTS_MAX: usize = 64;

#[derive(Debug, Clone)]
struct BlockState {
    now: Vec<Version>,
    after_crash: Vec<Version>,
}

fn add(set: &mut Vec<Version>, id: Version) {
    if !set.contains(&id) {
        set.push(id);
        assert!(
            set.len() <= ALLOWED_CONTENTS_MAX,
            "model: more than {ALLOWED_CONTENTS_MAX} contents allowed for one block"
        );
    }
}

/// The contract's allowed contents for every touched logical block.
#[derive(Debug, Clone, Default)]
pub struct Model {
    blocks: BTreeMap<u64, BlockState>,
}

impl Model {
    /// A freshly formatted volume: every block reads as zeros.
    pub fn new() -> Self {
        Model::default()
    }

    fn state(&mut self, lba: u64) -> &mut BlockState {
        self.blocks
            .entry(lba)
            .or_insert_with(|| BlockState { now: vec![ZERO_VERSION], after_crash: vec![ZERO_VERSION] })
    }

    /// The versions a write of content `id` to sectors `sectors` of `lba` produces: one per
    /// version the block may hold now (usually exactly one).
    pub fn written(&self, lba: u64, id: u64, sectors: std::ops::Range<usize>) -> Vec<Version> {
        let mut out = Vec::new();
        for mut v in self.allowed_now(lba) {
            for s in sectors.clone() {
                v[s] = id;
            }
            if !out.contains(&v) {
                out.push(v);
            }
        }
        out
    }

    /// A write to `lba` that leaves it holding one of `versions` completed; `durable` for
    /// FUA writes and the `sync` policy.
    pub fn write_acked(&mut self, lba: u64, versions: &[Version], durable: bool) {
        let s = self.state(lba);
        s.now = versions.to_vec();
        if durable {
            s.after_crash = versions.to_vec();
        } else {
            for v in versions {
                add(&mut s.after_crash, *v);
            }
        }
    }

    /// A write to `lba` that would leave one of `versions` returned an error: it may or
    /// may not have happened, and may or may not be durable.
    pub fn write_failed(&mut self, lba: u64, versions: &[Version]) {
        let s = self.state(lba);
        for v in versions {
            add(&mut s.now, *v);
            add(&mut s.after_crash, *v);
        }
    }

    /// A flush completed: everything acknowledged before it is durable.
    pub fn flush_completed(&mut self) {
        for s in self.blocks.values_mut() {
            s.after_crash = s.now.clone();
        }
    }

    /// The machine crashed.
    pub fn crashed(&mut self) {
        for s in self.blocks.values_mut() {
            s.now = s.after_crash.clone();
        }
    }

    /// What a read of `lba` may return now.
    pub fn allowed_now(&self, lba: u64) -> Vec<Version> {
        self.blocks.get(&lba).map_or_else(|| vec![ZERO_VERSION], |s| s.now.clone())
    }

    /// What a read of `lba` may return after a crash now.
    pub fn allowed_after_crash(&self, lba: u64) -> Vec<Version> {
        self.blocks.get(&lba).map_or_else(|| vec![ZERO_VERSION], |s| s.after_crash.clone())
    }

    /// A read returned `id` (which the caller checked is allowed): the block holds it.
    pub fn observed(&mut self, lba: u64, id: Version, collapse_after_crash: bool) {
        let s = self.state(lba);
        s.now = vec![id];
        if collapse_after_crash {
            s.after_crash = vec![id];
        }
    }

    /// Every block ever written, in order.
    pub fn touched(&self) -> Vec<u64> {
        self.blocks.keys().copied().collect()
    }

    /// Number of touched blocks.
    pub fn touched_count(&self) -> usize {
        self.blocks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flush_fua_and_crash_follow_the_contract() {
        let f = full;
        let mut m = Model::new();
        m.write_acked(1, &[f(10)], false);
        m.write_acked(1, &[f(11)], false);
        assert_eq!(m.allowed_now(1), vec![f(11)]);
        assert_eq!(m.allowed_after_crash(1), vec![ZERO_VERSION, f(10), f(11)]);
        m.flush_completed();
        assert_eq!(m.allowed_after_crash(1), vec![f(11)]);
        m.write_acked(1, &[f(12)], true);
        assert_eq!(m.allowed_after_crash(1), vec![f(12)]);
        m.write_failed(1, &[f(13)]);
        assert_eq!(m.allowed_now(1), vec![f(12), f(13)]);
        m.write_acked(2, &[f(20)], false);
        m.crashed();
        assert_eq!(m.allowed_now(2), vec![ZERO_VERSION, f(20)]);
        assert_eq!(m.allowed_now(1), vec![f(12), f(13)]);
        m.observed(2, ZERO_VERSION, true);
        assert_eq!(m.allowed_after_crash(2), vec![ZERO_VERSION]);
        assert_eq!(m.allowed_now(3), vec![ZERO_VERSION]);
        let partial = m.written(2, 30, 2..4);
        assert_eq!(partial, vec![[0, 0, 30, 30, 0, 0, 0, 0]]);
    }
}
