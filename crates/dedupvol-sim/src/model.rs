//! The checker's model of the durability contract (DESIGN.md §4), per logical block.
//!
//! For every logical block the model keeps two small sets of content ids:
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

/// Most contents one block may be allowed to hold at once.
pub const ALLOWED_CONTENTS_MAX: usize = 64;

#[derive(Debug, Clone)]
struct BlockState {
    now: Vec<u64>,
    after_crash: Vec<u64>,
}

fn add(set: &mut Vec<u64>, id: u64) {
    if !set.contains(&id) {
        set.push(id);
        assert!(set.len() <= ALLOWED_CONTENTS_MAX, "model: more than {ALLOWED_CONTENTS_MAX} contents allowed for one block");
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
        self.blocks.entry(lba).or_insert_with(|| BlockState { now: vec![ZERO], after_crash: vec![ZERO] })
    }

    /// A write of `id` to `lba` completed; `durable` for FUA writes and the `sync` policy.
    pub fn write_acked(&mut self, lba: u64, id: u64, durable: bool) {
        let s = self.state(lba);
        s.now = vec![id];
        if durable {
            s.after_crash = vec![id];
        } else {
            add(&mut s.after_crash, id);
        }
    }

    /// A write of `id` to `lba` returned an error: it may or may not have happened, and
    /// may or may not be durable.
    pub fn write_failed(&mut self, lba: u64, id: u64) {
        let s = self.state(lba);
        add(&mut s.now, id);
        add(&mut s.after_crash, id);
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
    pub fn allowed_now(&self, lba: u64) -> Vec<u64> {
        self.blocks.get(&lba).map_or_else(|| vec![ZERO], |s| s.now.clone())
    }

    /// What a read of `lba` may return after a crash now.
    pub fn allowed_after_crash(&self, lba: u64) -> Vec<u64> {
        self.blocks.get(&lba).map_or_else(|| vec![ZERO], |s| s.after_crash.clone())
    }

    /// A read returned `id` (which the caller checked is allowed): the block holds it.
    pub fn observed(&mut self, lba: u64, id: u64, collapse_after_crash: bool) {
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
        let mut m = Model::new();
        m.write_acked(1, 10, false);
        m.write_acked(1, 11, false);
        assert_eq!(m.allowed_now(1), vec![11]);
        assert_eq!(m.allowed_after_crash(1), vec![ZERO, 10, 11]);
        m.flush_completed();
        assert_eq!(m.allowed_after_crash(1), vec![11]);
        m.write_acked(1, 12, true);
        assert_eq!(m.allowed_after_crash(1), vec![12]);
        m.write_failed(1, 13);
        assert_eq!(m.allowed_now(1), vec![12, 13]);
        m.write_acked(2, 20, false);
        m.crashed();
        assert_eq!(m.allowed_now(2), vec![ZERO, 20]);
        assert_eq!(m.allowed_now(1), vec![12, 13]);
        m.observed(2, ZERO, true);
        assert_eq!(m.allowed_after_crash(2), vec![ZERO]);
        assert_eq!(m.allowed_now(3), vec![ZERO]);
    }
}
