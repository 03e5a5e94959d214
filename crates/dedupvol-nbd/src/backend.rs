//! What the NBD server serves: a byte-addressed disk behind the [`Backend`] trait.
//!
//! The trait is implemented for [`dedupvol_core::Volume`] (the real engine) and for
//! [`MemBackend`] (a RAM disk for protocol tests that must not depend on the engine).
//!
//! Invariants:
//! - Every method takes `&self` and may be called from many threads at once; a backend
//!   shared by all connections is what makes `NBD_FLAG_CAN_MULTI_CONN` truthful: `flush`
//!   covers every write that completed before it, on any connection.
//! - Errors carry the host errno the frontend maps to an NBD error code, plus context.

use dedupvol_core::{Extent, ExtentKind, Volume};
use parking_lot::RwLock;

/// A backend failure: the errno to report, what kind of failure it was (for the server's
/// counters), and a message for the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} (errno {errno})")]
pub struct BackendError {
    /// Host errno (EIO, ENOSPC, EINVAL, EROFS, ...).
    pub errno: i32,
    /// The failure's kind.
    pub kind: ErrorKind,
    /// What went wrong.
    pub message: String,
}

/// What kind of failure a backend error is; several kinds share an errno (EIO).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The device failed a read, write or sync (or the volume refuses writes after one).
    Device,
    /// Stored data or metadata did not match its checksum.
    Checksum,
    /// The volume is full.
    NoSpace,
    /// The volume or export is read-only.
    ReadOnly,
    /// The request was out of range or otherwise invalid.
    Invalid,
    /// Anything else.
    Other,
}

impl BackendError {
    /// An error whose kind follows from its errno (a backend without finer knowledge).
    pub fn new(errno: i32, message: impl Into<String>) -> Self {
        let kind = match errno {
            libc::EIO => ErrorKind::Device,
            libc::ENOSPC => ErrorKind::NoSpace,
            libc::EROFS | libc::EPERM => ErrorKind::ReadOnly,
            libc::EINVAL => ErrorKind::Invalid,
            _ => ErrorKind::Other,
        };
        BackendError { errno, kind, message: message.into() }
    }
}

/// A disk the server can export.
pub trait Backend: Send + Sync {
    /// Size in bytes.
    fn size(&self) -> u64;
    /// Fills `buf` from byte `offset`.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError>;
    /// Reads like `read`, but may hand whole 4 KiB blocks back as shared buffers instead
    /// of copying them into `buf`: where `parts[i]` holds a block, it is the data of block
    /// `i` and `buf`'s block `i` is left as it was; an empty `parts` means `buf` holds all.
    fn read_shared(
        &self,
        offset: u64,
        buf: &mut [u8],
        parts: &mut Vec<Option<dedupvol_core::block::Block>>,
    ) -> Result<(), BackendError> {
        parts.clear();
        self.read(offset, buf)
    }
    /// Writes `data` at `offset`; durable on return when `fua`.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), BackendError>;
    /// Makes every write completed before the call durable.
    fn flush(&self) -> Result<(), BackendError>;
    /// Discards a range; it reads back as zeros.
    fn trim(&self, offset: u64, len: u64) -> Result<(), BackendError>;
    /// Writes zeros to a range; durable on return when `fua`.
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), BackendError>;
    /// Which parts of a range are holes that read as zeros: consecutive runs covering a
    /// non-empty prefix of a non-empty range, at most `extents_max` of them. The default
    /// reports it all as data, which is always true enough (clients then read it).
    fn block_status(&self, offset: u64, len: u64, extents_max: usize) -> Result<Vec<Extent>, BackendError> {
        let _ = extents_max;
        match offset.checked_add(len) {
            Some(end) if end <= self.size() => Ok(vec![Extent { len, kind: ExtentKind::Data }]),
            _ => Err(BackendError::new(libc::EINVAL, format!("{offset}+{len} beyond {}", self.size()))),
        }
    }
}

fn engine_error(op: &str, offset: u64, len: u64, e: dedupvol_core::Error) -> BackendError {
    use dedupvol_core::Error as E;
    let kind = match &e {
        E::Corruption(_) => ErrorKind::Checksum,
        E::Io { .. } | E::Failed(_) => ErrorKind::Device,
        E::NoSpace(_) => ErrorKind::NoSpace,
        E::ReadOnly => ErrorKind::ReadOnly,
        E::OutOfRange { .. } | E::InvalidArgument(_) => ErrorKind::Invalid,
        _ => ErrorKind::Other,
    };
    BackendError { errno: e.errno(), kind, message: format!("{op} at {offset}+{len}: {e}") }
}

impl Backend for Volume {
    fn size(&self) -> u64 {
        self.logical_size()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        Volume::read(self, offset, buf).map_err(|e| engine_error("read", offset, buf.len() as u64, e))
    }
    fn read_shared(
        &self,
        offset: u64,
        buf: &mut [u8],
        parts: &mut Vec<Option<dedupvol_core::block::Block>>,
    ) -> Result<(), BackendError> {
        Volume::read_shared(self, offset, buf, parts).map_err(|e| engine_error("read", offset, buf.len() as u64, e))
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), BackendError> {
        Volume::write(self, offset, data, fua).map_err(|e| engine_error("write", offset, data.len() as u64, e))
    }
    fn flush(&self) -> Result<(), BackendError> {
        Volume::flush(self).map_err(|e| engine_error("flush", 0, 0, e))
    }
    fn trim(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        Volume::discard(self, offset, len).map_err(|e| engine_error("trim", offset, len, e))
    }
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), BackendError> {
        Volume::write_zeroes(self, offset, len, fua).map_err(|e| engine_error("write-zeroes", offset, len, e))
    }
    fn block_status(&self, offset: u64, len: u64, extents_max: usize) -> Result<Vec<Extent>, BackendError> {
        Volume::block_status(self, offset, len, extents_max).map_err(|e| engine_error("block-status", offset, len, e))
    }
}

/// Largest RAM disk [`MemBackend`] will allocate.
pub const MEM_BACKEND_BYTES_MAX: u64 = 4 << 30;

/// A RAM disk: for protocol tests. Flush is a no-op (nothing is volatile).
pub struct MemBackend {
    data: RwLock<Vec<u8>>,
    read_only: bool,
}

impl MemBackend {
    /// A zero-filled disk of `size` bytes (at most [`MEM_BACKEND_BYTES_MAX`]).
    pub fn new(size: u64, read_only: bool) -> Result<Self, BackendError> {
        if size > MEM_BACKEND_BYTES_MAX {
            return Err(BackendError::new(
                libc::EINVAL,
                format!("memory backend of {size} bytes exceeds {MEM_BACKEND_BYTES_MAX}"),
            ));
        }
        let len = usize::try_from(size).map_err(|_| BackendError::new(libc::EINVAL, "size"))?;
        Ok(MemBackend { data: RwLock::new(vec![0; len]), read_only })
    }

    fn range(&self, offset: u64, len: u64) -> Result<std::ops::Range<usize>, BackendError> {
        let size = self.size();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(offset as usize..end as usize),
            _ => Err(BackendError::new(libc::EINVAL, format!("{offset}+{len} beyond {size}"))),
        }
    }

    fn check_writable(&self) -> Result<(), BackendError> {
        if self.read_only {
            return Err(BackendError::new(libc::EROFS, "memory backend is read-only"));
        }
        Ok(())
    }
}

impl Backend for MemBackend {
    fn size(&self) -> u64 {
        self.data.read().len() as u64
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        let r = self.range(offset, buf.len() as u64)?;
        let data = self.data.read();
        let src = data.get(r).ok_or_else(|| BackendError::new(libc::EINVAL, "range"))?;
        buf.copy_from_slice(src);
        Ok(())
    }
    fn write(&self, offset: u64, src: &[u8], _fua: bool) -> Result<(), BackendError> {
        self.check_writable()?;
        let r = self.range(offset, src.len() as u64)?;
        let mut data = self.data.write();
        let dst = data.get_mut(r).ok_or_else(|| BackendError::new(libc::EINVAL, "range"))?;
        dst.copy_from_slice(src);
        Ok(())
    }
    fn flush(&self) -> Result<(), BackendError> {
        Ok(())
    }
    fn trim(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        self.write_zeroes(offset, len, false)
    }
    /// All-zero 4 KiB blocks (and partial blocks at the ends) are holes: a RAM disk has no
    /// allocation, and this lets protocol tests see both kinds without the engine.
    fn block_status(&self, offset: u64, len: u64, extents_max: usize) -> Result<Vec<Extent>, BackendError> {
        let r = self.range(offset, len)?;
        let data = self.data.read();
        let bytes = data.get(r).ok_or_else(|| BackendError::new(libc::EINVAL, "range"))?;
        let mut out: Vec<Extent> = Vec::new();
        // The first piece ends at a block boundary, so later pieces are aligned blocks.
        let first = ((4096 - offset % 4096) % 4096).min(len) as usize;
        let (head, rest) = bytes.split_at(first);
        for piece in std::iter::once(head).chain(rest.chunks(4096)).filter(|p| !p.is_empty()) {
            let kind = if piece.iter().all(|&b| b == 0) { ExtentKind::Hole } else { ExtentKind::Data };
            let full = out.len() == extents_max.max(1);
            match out.last_mut() {
                Some(last) if last.kind == kind => last.len += piece.len() as u64,
                _ if full => break,
                _ => out.push(Extent { len: piece.len() as u64, kind }),
            }
        }
        Ok(out)
    }
    fn write_zeroes(&self, offset: u64, len: u64, _fua: bool) -> Result<(), BackendError> {
        self.check_writable()?;
        let r = self.range(offset, len)?;
        let mut data = self.data.write();
        let dst = data.get_mut(r).ok_or_else(|| BackendError::new(libc::EINVAL, "range"))?;
        dst.fill(0);
        Ok(())
    }
}
