//! The block-map scan of the background passes (the cleaner, recompression): the map read
//! in bounded holds of the state lock, and the live fragments found, each with the
//! mappings that use it.
//!
//! Invariants:
//! - A hold reads at most `SCAN_LBAS_PER_HOLD` map entries.
//! - Correctness never rests on a scan being complete or current: an entry that does not
//!   decode, or a page that cannot be read, is skipped, and what it maps stays where it is
//!   (space, never data); the passes remap a logical block only if its entry is still the
//!   one scanned.
//! - A map page the device did not answer for in time ends the pass with the error: every
//!   page after it would hold the lock as long.

use crate::error::Result;
use crate::metadata::block_map::{BlockMap, Frag, MapEntry, Scanned};

/// Map entries read per state-lock hold while scanning.
pub(super) const SCAN_LBAS_PER_HOLD: u64 = 8192;

/// Map entries `lbas` as a background scan (cleaner, recompression) takes them, under one
/// state-lock hold: `f` gets each entry that decodes; one that does not is skipped (it
/// keeps what it maps, see the invariants). Returns where the next hold goes on (past
/// `lbas.end` when the range ended inside a page skipped whole).
///
/// A map page the device could not read is skipped whole and counted in `unreadable`:
/// what it maps stays where it is (space, never data), and the rest of the volume is
/// still cleaned, so one bad page does not stop every later pass at the same place.
/// Unless the device gave no answer in time: then the pass ends with the error, since
/// every page after it would make the lock wait as long (a RADOS volume with every OSD
/// down: the server stopped answering for hours).
pub(super) fn scan_entries(
    map: &mut BlockMap,
    lbas: std::ops::Range<u64>,
    unreadable: &mut u64,
    mut f: impl FnMut(u64, MapEntry),
) -> Result<u64> {
    let mut l = lbas.start;
    while l < lbas.end {
        match map.scan(l) {
            Scanned::Entry(e) => f(l, e),
            Scanned::Undecodable(_) => {}
            Scanned::Unreadable { error, .. } if error.is_timeout() => return Err(error),
            Scanned::Unreadable { next, .. } => {
                *unreadable += 1;
                l = next;
                continue;
            }
        }
        l += 1;
    }
    Ok(l.max(lbas.end))
}

/// A live fragment found by the scan: its mappings.
pub(super) struct Found {
    pub(super) frag: Frag,
    pub(super) uses: Vec<(u64, MapEntry)>,
}

impl Found {
    /// Its blocks still mapped, by index in the unit, in order.
    pub(super) fn live_subs(&self) -> Vec<usize> {
        let mut subs: Vec<usize> = self.uses.iter().map(|(_, e)| e.frag.sub()).collect();
        subs.sort_unstable();
        subs.dedup();
        subs
    }
}
