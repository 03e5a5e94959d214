//! A device handle that counts every access by category.

use super::Storage;
use crate::error::{Error, Result};
use crate::obs::io::{IoCounters, IoKind};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A device plus the shared counters: every access names its category.
#[derive(Clone)]
pub struct Dev {
    inner: Arc<dyn Storage>,
    counters: Arc<IoCounters>,
}

impl Dev {
    /// Wraps a device.
    pub fn new(inner: Arc<dyn Storage>, counters: Arc<IoCounters>) -> Self {
        Dev { inner, counters }
    }
    /// Counted, contextual read.
    pub fn read(&self, kind: IoKind, buf: &mut [u8], offset: u64) -> Result<()> {
        self.counters.counter(kind, false).add(buf.len());
        self.inner.read_at(buf, offset).map_err(|e| {
            Error::io(format!("reading {} bytes ({kind:?}) at offset {offset} of {}", buf.len(), self.inner.name()), e)
        })
    }
    /// Counted, contextual read through the page cache where the device reads cached
    /// (`Storage::read_cached_at`).
    pub fn read_cached(&self, kind: IoKind, buf: &mut [u8], offset: u64) -> Result<()> {
        self.counters.counter(kind, false).add(buf.len());
        self.inner.read_cached_at(buf, offset).map_err(|e| {
            Error::io(format!("reading {} bytes ({kind:?}) at offset {offset} of {}", buf.len(), self.inner.name()), e)
        })
    }
    /// True when `read_cached` goes through the page cache.
    pub fn reads_cached(&self) -> bool {
        self.inner.reads_cached()
    }
    /// Drops the page cache's copy of a range (a hint).
    pub fn drop_cached(&self, offset: u64, len: u64) {
        self.inner.drop_cached(offset, len)
    }
    /// Counted, contextual write.
    pub fn write(&self, kind: IoKind, buf: &[u8], offset: u64) -> Result<()> {
        self.counters.counter(kind, true).add(buf.len());
        self.inner.write_at(buf, offset).map_err(|e| {
            Error::io(format!("writing {} bytes ({kind:?}) at offset {offset} of {}", buf.len(), self.inner.name()), e)
        })
    }
    /// Counted, contextual write of buffers placed back to back.
    pub fn write_vectored(&self, kind: IoKind, bufs: &[&[u8]], offset: u64) -> Result<()> {
        let len: usize = bufs.iter().map(|b| b.len()).sum();
        self.counters.counter(kind, true).add(len);
        self.inner.write_vectored_at(bufs, offset).map_err(|e| {
            Error::io(format!("writing {len} bytes ({kind:?}) at offset {offset} of {}", self.inner.name()), e)
        })
    }
    /// Starts writeback of a range just written (a hint; see `Storage::start_writeback`).
    pub fn start_writeback(&self, offset: u64, len: u64) {
        self.inner.start_writeback(offset, len);
    }
    /// Durability barrier.
    pub fn sync(&self) -> Result<()> {
        self.counters.syncs.fetch_add(1, Ordering::Relaxed);
        self.inner.sync().map_err(|e| Error::io(format!("syncing {}", self.inner.name()), e))
    }
    /// Device size in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len()
    }
    /// Looks the device's size up again (see `Storage::refresh_len`).
    pub fn refresh_len(&self) -> u64 {
        self.inner.refresh_len()
    }
    /// True when data bypasses the kernel page cache.
    pub fn is_direct(&self) -> bool {
        self.inner.is_direct()
    }
    /// True for a zero-length device.
    pub fn is_empty(&self) -> bool {
        self.inner.len() == 0
    }
    /// Device name.
    pub fn name(&self) -> String {
        self.inner.name()
    }
    /// Traffic of each data device of a striped device (empty for one device).
    pub fn data_devices_io(&self) -> Vec<super::DataDeviceIo> {
        self.inner.data_devices_io()
    }
    /// True when both handles are the same device object.
    pub fn same_as(&self, other: &Dev) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}
