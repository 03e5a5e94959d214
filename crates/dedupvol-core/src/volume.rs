//! (being written) The public Volume API.
use crate::config::{FormatOptions, OpenOptions};
use crate::error::{Error, Result};
use crate::stats::Stats;
use crate::storage::Storage;
use std::sync::Arc;

/// An open volume. Safe to share between threads (`&self` methods).
pub struct Volume {
    _p: (),
}

impl Volume {
    /// Formats `data` (and `meta` when given) as a new volume. Refuses to overwrite an
    /// existing volume unless `force`.
    pub fn format(_data: Arc<dyn Storage>, _meta: Option<Arc<dyn Storage>>, _opts: &FormatOptions, _force: bool) -> Result<()> {
        Err(Error::InvalidArgument("not yet".into()))
    }
    /// Opens a volume, replaying the journal when it was not closed cleanly.
    pub fn open(_data: Arc<dyn Storage>, _meta: Option<Arc<dyn Storage>>, _opts: &OpenOptions) -> Result<Volume> {
        Err(Error::InvalidArgument("not yet".into()))
    }
    /// Logical size in bytes.
    pub fn logical_size(&self) -> u64 {
        0
    }
    /// Reads `buf.len()` bytes at byte `offset`.
    pub fn read(&self, _offset: u64, _buf: &mut [u8]) -> Result<()> {
        Err(Error::InvalidArgument("not yet".into()))
    }
    /// Writes `data` at byte `offset`; with `fua` the write is durable when this returns.
    pub fn write(&self, _offset: u64, _data: &[u8], _fua: bool) -> Result<()> {
        Err(Error::InvalidArgument("not yet".into()))
    }
    /// Makes every write completed before this call durable.
    pub fn flush(&self) -> Result<()> {
        Err(Error::InvalidArgument("not yet".into()))
    }
    /// Discards a byte range: it reads back as zeros and its space is freed.
    pub fn discard(&self, _offset: u64, _len: u64) -> Result<()> {
        Err(Error::InvalidArgument("not yet".into()))
    }
    /// Writes zeros to a byte range (no data I/O; space is freed).
    pub fn write_zeroes(&self, _offset: u64, _len: u64, _fua: bool) -> Result<()> {
        Err(Error::InvalidArgument("not yet".into()))
    }
    /// A statistics snapshot.
    pub fn stats(&self) -> Stats {
        unimplemented!()
    }
    /// Flushes everything, writes all metadata and marks the volume clean.
    pub fn close(self) -> Result<()> {
        Ok(())
    }
}
