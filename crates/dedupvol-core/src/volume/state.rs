//! Everything the state lock protects.

use crate::data::packer::Packer;
use crate::data::staging::Staging;
use crate::dedup::Deduper;
use crate::metadata::allocator::Allocator;
use crate::metadata::block_map::{BlockMap, MapEntry};
use crate::metadata::journal::{Counters, Journal};
use crate::metadata::refcount::Refcounts;
use crate::obs::stats::ReductionCounters;

/// The volume's mutable state, behind `Volume::state`.
pub(crate) struct State {
    pub(crate) map: BlockMap,
    pub(crate) rc: Refcounts,
    pub(crate) alloc: Allocator,
    pub(crate) journal: Journal,
    pub(crate) packer: Packer,
    pub(crate) dedup: Deduper,
    /// Mapped and zero blocks as of the newest journal entry.
    pub(crate) counters: Counters,
    pub(crate) red: ReductionCounters,
    /// Placed data blocks not on the device yet: they answer reads and verifications
    /// for their pbns until written.
    pub(crate) staging: Staging,
    /// Where the cleaner's next window of the data region starts.
    pub(crate) cleaner_window: u64,
    /// Bytes of fragments mapped with a codec other than the volume's since the last
    /// recompression pass that found none (`u64::MAX` at open: not known yet). Zero means
    /// a pass would find nothing, so the idle cleaner thread does not scan.
    pub(crate) fast_codec_hint: u64,
}

impl State {
    /// The content `e` refers to when its block is not on the device yet (see
    /// `data::read_unwritten`).
    pub(crate) fn unwritten(&self, e: &MapEntry, out: &mut [u8]) -> Option<bool> {
        crate::data::read_unwritten(&self.packer, &self.staging, e, out)
    }
}
