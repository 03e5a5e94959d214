//! Placed data blocks that are not on the device yet: the staging buffer, the batches
//! being written outside the state lock, and an index by physical block over both, so a
//! read, a verification or the audit finds an unwritten block in constant time.
//!
//! Invariants:
//! - Every block in `staged` or in a batch of `writing` has an entry in `by_pbn`, unless a
//!   newer copy of the same pbn replaced it (newest wins: a pbn freed and reused may still
//!   sit in an older, completed batch).
//! - Every `by_pbn` entry names the generation (staging round) that holds its block:
//!   pruning a batch removes only the entries of its own generation, never a newer copy.
//! - A batch stays in `writing` (and answers for its pbns) until its ticket is no longer
//!   active, i.e. its write completed or failed; `prune` is the only way out.
//! - Generations only grow: batches in `writing` carry strictly increasing generations,
//!   all below the generation of `staged` (asserted at hand-off and when forgetting; the
//!   `verify` audit checks the whole index against the lists).

use crate::data::writer::{Batch, Tickets};
use crate::read::cache::{Block, PbnMap};

/// Blocks held for one pbn: the staging round that holds it and the block.
struct Held {
    generation: u64,
    block: Block,
}

/// Placed, unwritten data blocks (guarded by the volume's state lock).
#[derive(Default)]
pub(crate) struct Staging {
    /// Blocks placed since the last hand-off, in placement order.
    staged: Batch,
    /// Batches handed to a writer, by ticket, with their generation, oldest first.
    writing: Vec<(u64, (u64, Batch))>,
    /// The newest unwritten copy of every pbn in `staged` or `writing`.
    by_pbn: PbnMap<Held>,
    /// Generation of `staged`; bumped at every hand-off.
    generation: u64,
}

impl Staging {
    /// Queues a placed block.
    pub(crate) fn push(&mut self, pbn: u64, block: Block) {
        self.by_pbn.insert(pbn, Held { generation: self.generation, block: block.clone() });
        self.staged.push((pbn, block));
    }

    /// Blocks staged and not yet handed off.
    pub(crate) fn staged_len(&self) -> usize {
        self.staged.len()
    }

    /// The newest unwritten copy of `pbn`, if any.
    pub(crate) fn get(&self, pbn: u64) -> Option<&Block> {
        self.by_pbn.get(&pbn).map(|h| &h.block)
    }

    /// Takes the staged blocks for a write done by the caller under the state lock: once
    /// it returns they are on the device, so nothing needs to answer for them.
    pub(crate) fn take_for_inline_write(&mut self) -> Batch {
        let blocks = std::mem::take(&mut self.staged);
        self.forget(self.generation, &blocks);
        self.generation += 1;
        blocks
    }

    /// Hands the staged blocks to a write outside the state lock under `ticket`; they
    /// keep answering for their pbns until `prune` finds the ticket retired.
    pub(crate) fn hand_off(&mut self, ticket: u64) -> Batch {
        let blocks = std::mem::take(&mut self.staged);
        assert!(
            self.writing.last().is_none_or(|(_, (g, _))| *g < self.generation),
            "staging: generation {} handed off after a newer one",
            self.generation
        );
        self.writing.push((ticket, (self.generation, blocks.clone())));
        self.generation += 1;
        blocks
    }

    /// Forgets the batches whose writes have completed (their blocks are on the device).
    pub(crate) fn prune(&mut self, tickets: &Tickets) {
        let before = self.writing.len();
        let mut done = Vec::new();
        tickets.retain_active_or(&mut self.writing, |held| done.push(held));
        assert!(self.writing.len() + done.len() == before, "staging: pruning lost a batch");
        for (generation, blocks) in done {
            self.forget(generation, &blocks);
        }
    }

    /// Batches handed off and not yet pruned.
    #[cfg(test)]
    pub(crate) fn writing_len(&self) -> usize {
        self.writing.len()
    }

    fn forget(&mut self, generation: u64, blocks: &Batch) {
        assert!(generation <= self.generation, "staging: forgetting generation {generation} from the future");
        for (pbn, _) in blocks {
            if self.by_pbn.get(pbn).is_some_and(|h| h.generation == generation) {
                self.by_pbn.remove(pbn);
            }
        }
    }

    /// Checks the index against the lists (the `verify` audit): every held block is the
    /// newest copy of its pbn, and every indexed pbn is held.
    #[cfg(any(test, feature = "verify"))]
    pub(crate) fn audit(&self) -> Result<(), String> {
        let mut newest: PbnMap<u64> = PbnMap::default();
        let mut last: Option<u64> = None;
        for (_, (generation, _)) in &self.writing {
            if last.is_some_and(|l| l >= *generation) || *generation >= self.generation {
                return Err(format!("staging generations out of order: {generation} after {last:?}"));
            }
            last = Some(*generation);
        }
        for (_, (generation, blocks)) in &self.writing {
            for (pbn, _) in blocks {
                newest.insert(*pbn, *generation);
            }
        }
        for (pbn, _) in &self.staged {
            newest.insert(*pbn, self.generation);
        }
        if newest.len() != self.by_pbn.len() {
            return Err(format!("staging index holds {} pbns, the lists {}", self.by_pbn.len(), newest.len()));
        }
        for (pbn, generation) in newest {
            match self.by_pbn.get(&pbn) {
                Some(h) if h.generation == generation => {}
                _ => return Err(format!("staging index does not hold the newest copy of pbn {pbn}")),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(byte: u8) -> Block {
        Block::from(vec![byte; 16])
    }

    /// A pbn freed and reused while its old batch is still being written: the newer copy
    /// answers, and pruning the old batch must not drop it.
    #[test]
    fn newest_copy_answers_and_survives_pruning_of_older_batches() {
        let tickets = Tickets::default();
        let mut s = Staging::default();
        s.push(7, block(1));
        s.push(8, block(2));
        let t1 = tickets.issue();
        s.hand_off(t1);
        s.push(7, block(3));
        assert_eq!(s.get(7).map(|b| b[0]), Some(3));
        assert_eq!(s.get(8).map(|b| b[0]), Some(2));
        tickets.retire(&[t1]);
        s.prune(&tickets);
        assert_eq!(s.get(7).map(|b| b[0]), Some(3), "pruning the old batch dropped the newer copy");
        assert_eq!(s.get(8), None);
        s.audit().expect("audit");
        let inline = s.take_for_inline_write();
        assert_eq!(inline.len(), 1);
        assert_eq!(s.get(7), None);
        s.audit().expect("audit");
    }

    #[test]
    fn batches_in_flight_answer_until_their_ticket_retires() {
        let tickets = Tickets::default();
        let mut s = Staging::default();
        s.push(1, block(9));
        let t = tickets.issue();
        s.hand_off(t);
        s.prune(&tickets);
        assert_eq!(s.get(1).map(|b| b[0]), Some(9));
        assert_eq!(s.writing_len(), 1);
        tickets.retire(&[t]);
        s.prune(&tickets);
        assert_eq!(s.get(1), None);
        assert_eq!(s.writing_len(), 0);
    }
}
