//! Data placement: the packer of compressed fragments, placed blocks waiting to be
//! written (staging), the writer of data blocks, and the placement layer that maps
//! physical blocks to devices.

pub(crate) mod dictionary;
pub(crate) mod packer;
pub(crate) mod placement;
pub(crate) mod staging;
pub(crate) mod writer;
pub(crate) mod zstd_prefix;

use crate::metadata::block_map::MapEntry;
use packer::Packer;
use staging::Staging;

/// Decodes the logical content `e` refers to when its physical blocks are not on the
/// device yet: a fragment of the open run, or staged or in-flight blocks. None: the device
/// holds them. Some(false): the data is unwritten but does not hold what `e` says. Costs
/// one lookup per block `e` touches: the open run is one range, staged blocks are found
/// by pbn, and a run's blocks are staged together, so a fragment with some blocks
/// unwritten and some not is one whose blocks were reused: Some(false).
pub(crate) fn read_unwritten(packer: &Packer, staging: &Staging, e: &MapEntry, out: &mut [u8]) -> Option<bool> {
    if let Some(f) = e.fragment_of() {
        if let Some(r) = packer.decode_open(e.pbn, &f, out) {
            return Some(r.is_ok() && e.blocks().all(|p| packer.is_open(p)));
        }
        let staged: Vec<&crate::read::cache::Block> = e.blocks().filter_map(|p| staging.get(p)).collect();
        let open = e.blocks().any(|p| packer.is_open(p));
        if staged.is_empty() && !open {
            return None;
        }
        // Some of its blocks unwritten and others not: the unwritten ones were freed and
        // reused since (a run's blocks are staged together), so the location no longer
        // holds the fragment (an index record of a dead fragment).
        if open || staged.len() as u64 != e.span() {
            return Some(false);
        }
        let span: Vec<u8> = staged.iter().flat_map(|b| b.iter().copied()).collect();
        return Some(packer::decode_block(e.pbn, &f, &span, out).is_ok());
    }
    if packer.is_open(e.pbn) {
        // The open run holds fragments only: a raw mapping to it is stale.
        return Some(false);
    }
    let block = staging.get(e.pbn)?;
    Some(
        out.len() == block.len() && {
            out.copy_from_slice(block);
            true
        },
    )
}
