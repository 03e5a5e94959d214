//! `RecentReads`: a bounded LRU of blocks' data read recently (one at a time, not as part
//! of a sequential run), keyed by physical block and fragment (`key`): reading the same
//! data again while it is still remembered makes its physical block read-hot. Reading
//! another fragment of the same block is not a re-read (a small-request scan of
//! compressed data reads each block's fragments one after the other).
//!
//! Invariants:
//! - At most `cap` blocks are remembered; the oldest touch is forgotten first.
//! - `order` holds every remembered block's latest touch plus stale touches, and never more
//!   than `2 * cap + 1` items (it is compacted when it grows past that).

use crate::read::cache::PbnMap;
use std::collections::VecDeque;

/// The LRU key of `pbn`'s raw content (`slot` None) or of one decoded block of a fragment
/// starting there (`slot`: `Frag::key`, 16 bits): the pbn in the high bits (pbns have 40
/// bits), the fragment key + 1 in the low 17.
pub(crate) fn key(pbn: u64, slot: Option<u16>) -> u64 {
    pbn << 17 | slot.map_or(0, |s| u64::from(s) + 1)
}

/// The recent-reads LRU.
pub(crate) struct RecentReads {
    /// pbn → stamp of its latest touch.
    stamp: PbnMap<u64>,
    /// Touches oldest first: (pbn, stamp); stale when the stamp is not the pbn's latest.
    order: VecDeque<(u64, u64)>,
    next: u64,
    cap: usize,
}

impl RecentReads {
    /// Remembers at most `cap` blocks.
    pub(crate) fn new(cap: usize) -> Self {
        RecentReads { stamp: PbnMap::default(), order: VecDeque::new(), next: 0, cap: cap.max(1) }
    }

    /// Notes a read of `pbn` (a `key`): true when it was still remembered from an earlier
    /// read (it is then forgotten: the caller promotes it).
    pub(crate) fn touch(&mut self, pbn: u64) -> bool {
        if self.stamp.remove(&pbn).is_some() {
            return true;
        }
        self.next += 1;
        self.stamp.insert(pbn, self.next);
        self.order.push_back((pbn, self.next));
        while self.stamp.len() > self.cap {
            match self.order.pop_front() {
                Some((p, s)) if self.stamp.get(&p) == Some(&s) => {
                    self.stamp.remove(&p);
                }
                Some(_) => {}
                None => break,
            }
        }
        if self.order.len() > 2 * self.cap {
            let stamp = &self.stamp;
            self.order.retain(|(p, s)| stamp.get(p) == Some(s));
        }
        assert!(self.stamp.len() <= self.cap, "recent reads hold {} blocks, above {}", self.stamp.len(), self.cap);
        false
    }

    /// Memory held, in bytes.
    pub(crate) fn memory_bytes(&self) -> u64 {
        (self.stamp.capacity() * 16 + self.order.capacity() * 16) as u64
    }

    /// Remembered blocks.
    #[cfg(any(test, feature = "verify"))]
    pub(crate) fn len(&self) -> usize {
        self.stamp.len()
    }

    /// Checks the bounds (the `verify` audit).
    #[cfg(any(test, feature = "verify"))]
    pub(crate) fn audit(&self) -> Result<(), String> {
        if self.stamp.len() > self.cap || self.order.len() > 2 * self.cap + 1 {
            return Err(format!(
                "recent reads: {} blocks, {} touches, bound {}",
                self.len(),
                self.order.len(),
                self.cap
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_touch_while_remembered_is_hot() {
        let mut r = RecentReads::new(4);
        assert!(!r.touch(1));
        assert!(r.touch(1));
        assert!(!r.touch(1), "a promoted block starts over");
        for p in 10..20 {
            r.touch(p);
        }
        assert!(!r.touch(1), "forgotten after 10 other reads with room for 4");
        assert!(r.len() <= 4);
        for _ in 0..100 {
            r.touch(50);
        }
        r.audit().expect("bounded");
    }

    #[test]
    fn keys_tell_slots_and_blocks_apart() {
        let keys = [
            key(7, None),
            key(7, Some(0)),
            key(7, Some(13)),
            key(7, Some(u16::MAX)),
            key(8, None),
            key(1 << 39, Some(5)),
        ];
        for (i, a) in keys.iter().enumerate() {
            for b in keys.iter().skip(i + 1) {
                assert_ne!(a, b);
            }
        }
    }
}
