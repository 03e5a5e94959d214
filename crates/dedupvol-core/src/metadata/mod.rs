//! The volume's metadata structures: geometry, superblock, block map, reference counts,
//! the allocator that derives from them, and the recovery journal that keeps them
//! crash-consistent. Each structure keeps its own invariants.

pub(crate) mod allocator;
pub(crate) mod block_map;
pub(crate) mod journal;
pub(crate) mod layout;
pub(crate) mod refcount;
pub(crate) mod stripe;
pub(crate) mod superblock;
