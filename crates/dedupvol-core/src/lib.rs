//! dedupvol-core: an inline deduplicating and compressing block storage engine.
//!
//! A [`Volume`] is a thin-provisioned virtual disk of 4 KiB logical blocks stored on one data
//! device (and optionally a separate metadata device). Every write is split into 4 KiB
//! chunks; zero chunks cost no I/O; others are fingerprinted with BLAKE3, shared with an
//! existing copy when the fingerprint index finds a verified duplicate, and otherwise
//! compressed (LZ4/zstd), packed several to a physical block, and appended to a
//! log-structured data slab. A recovery journal with group commit makes the block map and
//! reference counts crash-consistent; see `docs/format.md` and `docs/design.md` for the
//! durability contract.
//!
//! The crate has no network dependencies; the NBD server and the CLI build on it.

pub mod aligned;
pub mod allocator;
pub mod block_map;
pub mod cache;
pub mod check;
pub mod codec;
pub mod config;
mod data_writer;
pub mod error;
pub mod hugemem;
pub mod index;
pub mod journal;
pub mod layout;
pub mod packer;
pub mod refcount;
pub mod stats;
pub mod storage;
pub mod superblock;
pub mod volume;

pub use check::{check_volume, check_volume_with, CheckOptions, CheckReport, LostRange, Problem};
pub use config::{parse_size, Compression, DedupVerify, FormatOptions, OpenOptions, WritePolicy, BLOCK_SIZE};
pub use error::{Error, Result};
pub use stats::{LifetimeCounters, Stats};
pub use storage::{FileStorage, IoKind, IoMode, IoStats, MemStorage, Storage};
pub use volume::Volume;
