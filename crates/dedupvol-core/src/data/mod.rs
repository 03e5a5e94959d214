//! Data placement: the packer of compressed fragments, placed blocks waiting to be
//! written (staging), the writer of data blocks, and the placement layer that maps
//! physical blocks to devices.

pub(crate) mod packer;
pub(crate) mod placement;
pub(crate) mod staging;
pub(crate) mod writer;

use crate::metadata::block_map::MapEntry;
use packer::Packer;
use staging::Staging;

/// Decodes the logical content `e` refers to when its physical block is not on the device
/// yet: a fragment of an open packed block, or a staged or in-flight block. None: the
/// device holds it. Some(false): the block is unwritten but does not hold what `e` says.
/// Constant time: open packed blocks are at most `packer::OPEN_BLOCKS_MAX`, and staged
/// blocks are found by pbn.
pub(crate) fn read_unwritten(packer: &Packer, staging: &Staging, e: &MapEntry, out: &mut [u8]) -> Option<bool> {
    if packer.is_open(e.pbn) {
        // The open block is a packed block: a raw mapping to it is stale.
        return Some(e.slot().and_then(|slot| packer.unpack_open(e.pbn, slot, out)).is_some_and(|r| r.is_ok()));
    }
    let block = staging.get(e.pbn)?;
    Some(match e.slot() {
        None if out.len() == block.len() => {
            out.copy_from_slice(block);
            true
        }
        None => false,
        Some(slot) => packer::unpack(block, e.pbn, slot, out).is_ok(),
    })
}
