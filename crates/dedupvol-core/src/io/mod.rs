//! Device access: the storage trait the engine sits on, its file and memory
//! implementations, the counted device handle, aligned buffers for direct I/O and large
//! zeroed allocations.
//!
//! Invariants:
//! - `write_at` may be cached by the device; only `sync` makes earlier writes durable
//!   (a disk with a volatile write cache, docs/design.md, durability contract).
//! - Reads and writes are whole and positioned: a short read or write is an error.
//! - Every byte the engine moves goes through a `Dev` and is counted under exactly one
//!   `IoKind`, so write amplification and the overhead breakdown come from real traffic.

pub(crate) mod aligned;
mod dev;
mod file;
pub(crate) mod hugemem;
mod memory;
mod rados;
mod striped;

pub(crate) use crate::obs::io::{IoCounters, IoKind};
pub(crate) use dev::Dev;
pub use file::FileStorage;
pub use memory::MemStorage;
pub use rados::{RadosStorage, RadosUrl, OBJECT_BYTES as RADOS_OBJECT_BYTES};
pub use striped::StripedStorage;

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::io;
use std::sync::Arc;

/// A block device as the engine sees it: positioned reads/writes plus a durability barrier.
pub trait Storage: Send + Sync {
    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes all of `buf` at `offset` (possibly into a volatile cache).
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Writes the buffers back to back starting at `offset` (one `pwritev` where the
    /// device supports it, so merged blocks need no joining copy).
    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        self.write_at(&bufs.concat(), offset)
    }
    /// Makes every write that completed before this call durable.
    fn sync(&self) -> io::Result<()>;
    /// Hint: start writing `[offset, offset + len)` back to stable storage now, without
    /// waiting, so the next `sync` has less to do. Guarantees nothing; errors surface at `sync`.
    fn start_writeback(&self, _offset: u64, _len: u64) {}
    /// True when data bypasses the kernel page cache (`O_DIRECT`).
    fn is_direct(&self) -> bool {
        false
    }
    /// Reads exactly `buf.len()` bytes at `offset` through the kernel page cache where the
    /// device keeps one beside direct I/O (`IoMode::ReadCached`); elsewhere `read_at`.
    fn read_cached_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_at(buf, offset)
    }
    /// True when `read_cached_at` goes through the page cache while writes bypass it.
    fn reads_cached(&self) -> bool {
        false
    }
    /// Drops the page cache's copy of a range (a hint). Why: a direct write whose
    /// invalidation of the range lost a race with a cached read can leave a stale page
    /// behind; a block that fails its checksum after a cached read is dropped and re-read.
    fn drop_cached(&self, _offset: u64, _len: u64) {}
    /// Size of the device in bytes.
    fn len(&self) -> u64;
    /// Looks the size up again (a file extended while open, as a grow does) and returns
    /// it; `len` reports it from then on. Devices whose size is fixed return `len`.
    fn refresh_len(&self) -> u64 {
        self.len()
    }
    /// True when the device has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A human-readable name for error messages.
    fn name(&self) -> String {
        "device".to_string()
    }
    /// Traffic of each data device under a device striped over several (`StripedStorage`);
    /// empty for a single device.
    fn data_devices_io(&self) -> Vec<DataDeviceIo> {
        Vec::new()
    }
}

/// Bytes one data device of a striped volume moved since open.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataDeviceIo {
    /// Place in the stripe (0: the volume's first device).
    pub index: u32,
    /// Path or name.
    pub name: String,
    /// Size of the device.
    pub size_bytes: u64,
    /// Bytes read from its data units.
    pub data_read_bytes: u64,
    /// Bytes written to its data units.
    pub data_written_bytes: u64,
    /// Bytes read before the data region (superblocks, metadata; device 0 only).
    pub head_read_bytes: u64,
    /// Bytes written before the data region (device 0 only).
    pub head_written_bytes: u64,
}

/// Opens an existing device by path: a `rados://POOL/NAME` URL (`take_over`: fence its
/// current holder, see `RadosStorage`) or a file or block device (`mode`).
pub fn open_device(path: &std::path::Path, read_only: bool, mode: IoMode, take_over: bool) -> Result<Arc<dyn Storage>> {
    Ok(match RadosUrl::parse(path) {
        Some(url) => Arc::new(RadosStorage::open(&url?, read_only, take_over)?),
        None => Arc::new(FileStorage::open_with(path, read_only, mode)?),
    })
}

/// Opens a device read-write by path, creating it with `size_bytes` when given (a file is
/// created or extended; a RADOS device is created, never resized).
pub fn create_device(path: &std::path::Path, size_bytes: Option<u64>) -> Result<Arc<dyn Storage>> {
    Ok(match RadosUrl::parse(path) {
        Some(url) => Arc::new(RadosStorage::create(&url?, size_bytes)?),
        None => Arc::new(FileStorage::create(path, size_bytes)?),
    })
}

/// How a `FileStorage` moves data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IoMode {
    /// `Volume::open_path` picks: direct for a hash-verified volume, buffered for a
    /// byte-verified one (its verification reads are served from the page cache). A
    /// `FileStorage` opened with it is direct.
    #[default]
    Auto,
    /// `O_DIRECT` where the file system supports it (else buffered): no page-cache copy and
    /// no page-cache memory; the engine's content cache is the only data cache.
    Direct,
    /// Through the kernel page cache.
    Buffered,
    /// Writes bypass the page cache (`O_DIRECT`), data reads go through it: the kernel's
    /// reclaimable page cache is the read cache of raw blocks (as for a plain file), and
    /// the engine's content cache holds what the page cache cannot: written blocks and
    /// packed blocks for verification.
    ReadCached,
}

impl IoMode {
    /// The mode `Auto` stands for on a volume with (`true`) or without hash verification.
    pub fn for_verify(self, hash_verified: bool) -> IoMode {
        match self {
            IoMode::Auto if hash_verified => IoMode::Direct,
            IoMode::Auto => IoMode::Buffered,
            m => m,
        }
    }
}

impl std::str::FromStr for IoMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(IoMode::Auto),
            "direct" => Ok(IoMode::Direct),
            "buffered" => Ok(IoMode::Buffered),
            "read-cached" => Ok(IoMode::ReadCached),
            other => Err(Error::InvalidArgument(format!(
                "I/O mode must be auto, direct, buffered or read-cached, not {other:?}"
            ))),
        }
    }
}

/// The name users type (`direct`), for messages.
impl std::fmt::Display for IoMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoMode::Auto => "auto",
            IoMode::Direct => "direct",
            IoMode::Buffered => "buffered",
            IoMode::ReadCached => "read-cached",
        })
    }
}

impl<T: Storage + ?Sized> Storage for Arc<T> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (**self).read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        (**self).write_at(buf, offset)
    }
    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        (**self).write_vectored_at(bufs, offset)
    }
    fn sync(&self) -> io::Result<()> {
        (**self).sync()
    }
    fn start_writeback(&self, offset: u64, len: u64) {
        (**self).start_writeback(offset, len)
    }
    fn is_direct(&self) -> bool {
        (**self).is_direct()
    }
    fn read_cached_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (**self).read_cached_at(buf, offset)
    }
    fn reads_cached(&self) -> bool {
        (**self).reads_cached()
    }
    fn drop_cached(&self, offset: u64, len: u64) {
        (**self).drop_cached(offset, len)
    }
    fn len(&self) -> u64 {
        (**self).len()
    }
    fn refresh_len(&self) -> u64 {
        (**self).refresh_len()
    }
    fn name(&self) -> String {
        (**self).name()
    }
    fn data_devices_io(&self) -> Vec<DataDeviceIo> {
        (**self).data_devices_io()
    }
}
