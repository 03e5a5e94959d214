//! Byte verification of a dedup candidate: is the stored copy the same 4 KiB as the chunk?
//!
//! Invariants:
//! - A candidate that cannot be read, or lies outside the data region, is simply not a
//!   duplicate: verification never fails a write.
//! - A block read for verification enters the content cache with `fill`, never `put`, so a
//!   slow verification cannot replace newer content.

use crate::config::BLOCK_SIZE;
use crate::data::packer;
use crate::data::placement::DataDevice;
use crate::dedup::index::Location;
use crate::io::IoKind;
use crate::metadata::block_map::{MapEntry, STATE_RAW};
use crate::read::cache::{new_block, ContentCache};
use parking_lot::Mutex;
use std::sync::Arc;

/// True when `block` (physical block `pbn`, raw or packed per `state`) holds `chunk`.
pub(crate) fn content_matches(block: &[u8], pbn: u64, state: u8, chunk: &[u8]) -> bool {
    if state == STATE_RAW {
        return block == chunk;
    }
    match (MapEntry { pbn: 0, state, crc: 0 }).slot() {
        Some(slot) => {
            let mut out = [0u8; BLOCK_SIZE];
            packer::unpack(block, pbn, slot, &mut out).is_ok() && out == chunk
        }
        None => false,
    }
}

/// Reads the candidate's content (content cache first, else a verification read) and
/// compares it with `chunk`. Takes no volume lock.
pub(crate) fn by_read(data: &DataDevice, cache: &Mutex<ContentCache>, loc: Location, chunk: &[u8]) -> bool {
    if !data.contains(loc.pbn) {
        return false;
    }
    let cached = cache.lock().get(loc.pbn);
    let block = match cached {
        Some(b) => b,
        None => {
            let mut b = new_block();
            let Some(buf) = Arc::get_mut(&mut b) else { return false };
            if data.read(IoKind::Verify, loc.pbn, buf, "fingerprint index entry").is_err() {
                return false;
            }
            let crc = crate::read::cache::block_crc(&b);
            cache.lock().fill(loc.pbn, b.clone(), crc);
            b
        }
    };
    content_matches(&block, loc.pbn, loc.state, chunk)
}
