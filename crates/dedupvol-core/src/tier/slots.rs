//! `Slots`: the tier's in-memory slot table (one `SlotMeta` per slot on the device), the
//! map pbn → slot, and the clock hand that allocates slots and picks what to demote.
//!
//! Demotion is CLOCK with credits (second chance, bounded): an occupant starts with one
//! credit if it is a packed block and one more if its reference count at promotion was at
//! least twice the promotion threshold; every tier hit adds one (at most `CREDITS_MAX`).
//! The hand spends a credit instead of demoting, at most `HAND_SKIPS_MAX` times per
//! allocation, so large (raw) and less-referenced blocks that are not read go first.
//!
//! Invariants:
//! - `map[pbn] == slot` exactly when `meta[slot]` is `Unvalidated` or `Valid` with that
//!   pbn: a pbn has at most one slot, a slot at most one pbn (the `verify` audit checks
//!   it), so the map never holds more than `slot_count` entries.
//! - Every change of a slot's occupant (install, drop, demotion) gives it a new `token`:
//!   work begun on the old occupant (a validation read) cannot complete on the new one.
//! - A `Filling` slot is never handed out again or read until the worker installs or
//!   frees it.

use super::layout::SlotRecord;
use crate::read::cache::PbnMap;

/// Most credits an occupant holds.
const CREDITS_MAX: u8 = 3;
/// Most occupants the hand spares per allocation before it demotes whatever it points at.
const HAND_SKIPS_MAX: u32 = 64;
/// Most slots the hand passes looking for a free one for a fill.
const FILL_SCAN_MAX: usize = 256;

/// What a slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SlotState {
    /// Nothing.
    Free,
    /// Allocated to a promotion whose copy is being written.
    Filling,
    /// Found in the table at open: not served until checked against the data device.
    Unvalidated,
    /// Serves reads.
    Valid,
}

/// One slot's occupant.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlotMeta {
    pub(crate) state: SlotState,
    pub(crate) rec: SlotRecord,
    pub(crate) credits: u8,
    pub(crate) token: u64,
}

// 48 bytes a slot (docs/format.md, "Memory").
const _: () = assert!(std::mem::size_of::<SlotMeta>() <= 48);

const EMPTY: SlotMeta = SlotMeta {
    state: SlotState::Free,
    rec: SlotRecord { pbn: 0, generation: 0, content_crc: 0, packed: false, refs: 0 },
    credits: 0,
    token: 0,
};

/// The slot table, the map and the clock hand.
pub(crate) struct Slots {
    meta: Vec<SlotMeta>,
    map: PbnMap<u32>,
    hand: usize,
    next_token: u64,
    /// Occupants demoted to make room, since open.
    pub(crate) demotions: u64,
    /// Credits an occupant promoted with `refs` ≥ this gets for its reference count.
    many_refs: u32,
}

impl Slots {
    /// `count` free slots; `promote_refs` is the promotion threshold.
    pub(crate) fn new(count: u64, promote_refs: u32) -> Self {
        assert!(count <= u64::from(u32::MAX), "tier of {count} slots: slot numbers are u32");
        Slots {
            meta: vec![EMPTY; count as usize],
            map: PbnMap::default(),
            hand: 0,
            next_token: 1,
            demotions: 0,
            many_refs: promote_refs.saturating_mul(2),
        }
    }

    /// Slots in the table.
    #[cfg(any(test, feature = "verify"))]
    pub(crate) fn len(&self) -> usize {
        self.meta.len()
    }

    /// Occupied entries (validated or not).
    pub(crate) fn entries(&self) -> usize {
        self.map.len()
    }

    /// The slot holding `pbn` and its occupant.
    pub(crate) fn get(&self, pbn: u64) -> Option<(u32, SlotMeta)> {
        let &slot = self.map.get(&pbn)?;
        self.meta.get(slot as usize).map(|m| (slot, *m))
    }

    /// Slot `slot`'s occupant.
    pub(crate) fn meta(&self, slot: u32) -> Option<&SlotMeta> {
        self.meta.get(slot as usize)
    }

    fn token(&mut self) -> u64 {
        self.next_token += 1;
        self.next_token
    }

    /// Credits a new occupant starts with.
    fn initial_credits(&self, rec: &SlotRecord) -> u8 {
        u8::from(rec.packed) + u8::from(rec.refs >= self.many_refs)
    }

    /// Installs `rec` in `slot` (a `Filling` slot, or a `Free` one at open), replacing any
    /// other slot of the same pbn.
    pub(crate) fn install(&mut self, slot: u32, rec: SlotRecord, state: SlotState) {
        assert!(matches!(state, SlotState::Unvalidated | SlotState::Valid), "install as {state:?}");
        self.drop_pbn(rec.pbn);
        let token = self.token();
        let credits = self.initial_credits(&rec);
        if let Some(m) = self.meta.get_mut(slot as usize) {
            assert!(
                matches!(m.state, SlotState::Free | SlotState::Filling),
                "install into slot {slot} holding {:?}",
                m.state
            );
            *m = SlotMeta { state, rec, credits, token };
            self.map.insert(rec.pbn, slot);
        }
    }

    /// Drops `pbn`'s entry, freeing its slot; true when there was one.
    pub(crate) fn drop_pbn(&mut self, pbn: u64) -> bool {
        let Some(slot) = self.map.remove(&pbn) else { return false };
        let token = self.token();
        if let Some(m) = self.meta.get_mut(slot as usize) {
            *m = SlotMeta { token, ..EMPTY };
        }
        true
    }

    /// Frees a `Filling` slot whose promotion was abandoned.
    pub(crate) fn release(&mut self, slot: u32) {
        let token = self.token();
        if let Some(m) = self.meta.get_mut(slot as usize).filter(|m| m.state == SlotState::Filling) {
            *m = SlotMeta { token, ..EMPTY };
        }
    }

    /// Marks `slot` validated when it still holds the occupant `token` named.
    pub(crate) fn validate(&mut self, slot: u32, token: u64) -> bool {
        match self.meta.get_mut(slot as usize) {
            Some(m) if m.token == token && m.state == SlotState::Unvalidated => {
                m.state = SlotState::Valid;
                true
            }
            _ => false,
        }
    }

    /// Notes a tier hit on `slot` (a credit for the clock).
    pub(crate) fn hit(&mut self, slot: u32) {
        if let Some(m) = self.meta.get_mut(slot as usize) {
            m.credits = (m.credits + 1).min(CREDITS_MAX);
        }
    }

    /// A slot for a new copy, marked `Filling`: a free one, or the first occupant under the
    /// hand without credits (spending credits on the way, at most `HAND_SKIPS_MAX`), which
    /// is demoted. None when every slot is being filled.
    pub(crate) fn allocate(&mut self) -> Option<u32> {
        let n = self.meta.len();
        let mut skips = 0u32;
        for _ in 0..n + HAND_SKIPS_MAX as usize {
            let slot = self.hand;
            self.hand = (self.hand + 1) % n.max(1);
            let m = self.meta.get_mut(slot)?;
            match m.state {
                SlotState::Filling => continue,
                SlotState::Free => {}
                SlotState::Unvalidated | SlotState::Valid => {
                    if m.credits > 0 && skips < HAND_SKIPS_MAX {
                        m.credits -= 1;
                        skips += 1;
                        continue;
                    }
                    let pbn = m.rec.pbn;
                    self.map.remove(&pbn);
                    self.demotions += 1;
                }
            }
            let token = self.token();
            let m = self.meta.get_mut(slot)?;
            *m = SlotMeta { state: SlotState::Filling, token, ..EMPTY };
            return u32::try_from(slot).ok();
        }
        None
    }

    /// A free slot for a fill (a copy nobody asked for), marked `Filling`: never a
    /// demotion. The hand looks at most `FILL_SCAN_MAX` slots ahead; None when it finds no
    /// free one there (the fill is skipped).
    pub(crate) fn allocate_free(&mut self) -> Option<u32> {
        let n = self.meta.len();
        for _ in 0..n.min(FILL_SCAN_MAX) {
            let slot = self.hand;
            self.hand = (self.hand + 1) % n.max(1);
            if self.meta.get(slot).is_some_and(|m| m.state == SlotState::Free) {
                let token = self.token();
                let m = self.meta.get_mut(slot)?;
                *m = SlotMeta { state: SlotState::Filling, token, ..EMPTY };
                return u32::try_from(slot).ok();
            }
        }
        None
    }

    /// The record slot `slot` should have on the device now (None: empty).
    pub(crate) fn record(&self, slot: u32) -> Option<SlotRecord> {
        self.meta
            .get(slot as usize)
            .filter(|m| matches!(m.state, SlotState::Unvalidated | SlotState::Valid))
            .map(|m| m.rec)
    }

    /// Occupants not validated yet: (slot, pbn, token).
    pub(crate) fn unvalidated(&self) -> Vec<(u32, u64, u64)> {
        (0u32..)
            .zip(&self.meta)
            .filter(|(_, m)| m.state == SlotState::Unvalidated)
            .map(|(s, m)| (s, m.rec.pbn, m.token))
            .collect()
    }

    /// Drops every entry (the tier is disabled).
    pub(crate) fn clear(&mut self) {
        let pbns: Vec<u64> = self.map.keys().copied().collect();
        for p in pbns {
            self.drop_pbn(p);
        }
    }

    /// Memory held, in bytes (slot table plus map).
    pub(crate) fn memory_bytes(&self) -> u64 {
        (self.meta.capacity() * std::mem::size_of::<SlotMeta>() + self.map.capacity() * 16) as u64
    }

    /// Checks the map against the slot table (the `verify` audit).
    #[cfg(any(test, feature = "verify"))]
    pub(crate) fn audit(&self) -> Result<(), String> {
        if self.map.len() > self.meta.len() {
            return Err(format!("{} entries for {} slots", self.map.len(), self.meta.len()));
        }
        for (&pbn, &slot) in &self.map {
            match self.meta.get(slot as usize) {
                Some(m) if matches!(m.state, SlotState::Unvalidated | SlotState::Valid) && m.rec.pbn == pbn => {}
                other => return Err(format!("map sends pbn {pbn} to slot {slot}, which holds {other:?}")),
            }
        }
        let occupied = self.meta.iter().filter(|m| matches!(m.state, SlotState::Unvalidated | SlotState::Valid));
        let n = occupied.count();
        if n != self.map.len() {
            return Err(format!("{n} occupied slots but {} map entries", self.map.len()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(pbn: u64, packed: bool, refs: u32) -> SlotRecord {
        SlotRecord { pbn, generation: pbn, content_crc: 0, packed, refs }
    }

    #[test]
    fn clock_demotes_raw_low_ref_blocks_first() {
        let mut s = Slots::new(8, 5);
        for i in 0..8u64 {
            let slot = s.allocate().expect("free slot");
            // Even pbns: packed with many references; odd: raw, one reference.
            let r = if i % 2 == 0 { rec(i, true, 10) } else { rec(i, false, 1) };
            s.install(slot, r, SlotState::Valid);
        }
        for i in 100..104u64 {
            let slot = s.allocate().expect("a victim");
            s.install(slot, rec(i, false, 1), SlotState::Valid);
        }
        assert_eq!(s.demotions, 4);
        for i in (0..8u64).step_by(2) {
            assert!(s.get(i).is_some(), "packed, referenced block {i} was demoted");
        }
        for i in (1..8u64).step_by(2) {
            assert!(s.get(i).is_none(), "raw block {i} kept over packed ones");
        }
        s.audit().expect("consistent");
    }

    #[test]
    fn tokens_change_with_the_occupant() {
        let mut s = Slots::new(2, 5);
        let slot = s.allocate().expect("slot");
        s.install(slot, rec(1, false, 1), SlotState::Unvalidated);
        let (_, m) = s.get(1).expect("entry");
        assert!(s.drop_pbn(1));
        assert!(!s.validate(slot, m.token), "a dropped occupant must not become valid");
        let slot = s.allocate().expect("slot");
        s.install(slot, rec(1, false, 1), SlotState::Unvalidated);
        assert!(!s.validate(slot, m.token), "an old token must not validate a new occupant");
        let (_, m) = s.get(1).expect("entry");
        assert!(s.validate(slot, m.token));
        s.audit().expect("consistent");
    }

    #[test]
    fn allocation_fails_only_when_every_slot_is_filling() {
        let mut s = Slots::new(3, 5);
        let got: Vec<u32> = (0..3).filter_map(|_| s.allocate()).collect();
        assert_eq!(got.len(), 3);
        assert_eq!(s.allocate(), None);
        s.release(got[1]);
        assert_eq!(s.allocate(), Some(got[1]));
    }
}
