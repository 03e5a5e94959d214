//! The storage trait the engine sits on, and its real and in-memory implementations.
//!
//! Invariants:
//! - `write_at` may be cached by the device; only `sync` makes earlier writes durable
//!   (a disk with a volatile write cache, docs/design.md, durability contract).
//! - Reads and writes are whole and positioned: a short read or write is an error.
//! - Every byte the engine moves is counted in `IoCounters` under exactly one category, so
//!   write amplification and the overhead breakdown are computed from real traffic.
//! - A `FileStorage` in direct mode moves every aligned request with `O_DIRECT` (through a
//!   bounce buffer when the memory is not aligned) and only requests direct I/O cannot take
//!   through the page cache; the kernel keeps the two coherent (a direct write writes back
//!   and drops cached pages of its range), and the engine never has both kinds in flight
//!   on one block.

use crate::aligned::{self, BOUNCE_BYTES};
use crate::error::{Error, Result};
use parking_lot::RwLock;
use serde::Serialize;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// Size of the device in bytes.
    fn len(&self) -> u64;
    /// True when the device has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A human-readable name for error messages.
    fn name(&self) -> String {
        "device".to_string()
    }
}

/// Buffers per `pwritev` call (Linux's IOV_MAX).
const IOVECS_PER_CALL: usize = 1024;

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
            other => Err(Error::InvalidArgument(format!("I/O mode must be auto, direct or buffered, not {other:?}"))),
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
        })
    }
}

/// A regular file or block device, with `pread`/`pwrite` and `fdatasync`.
pub struct FileStorage {
    /// Buffered descriptor: the lock, `fdatasync`, and requests direct I/O cannot take.
    file: File,
    /// `O_DIRECT` descriptor on the same file, when asked for and supported.
    direct: Option<File>,
    /// Regular file in direct mode: one bit per `PREALLOC_REGION_BYTES` region already
    /// allocated with `fallocate` (see `preallocate`).
    prealloc: Option<Vec<AtomicU64>>,
    len: u64,
    name: String,
}

/// Granularity at which a regular file's regions are allocated before their first direct
/// write.
const PREALLOC_REGION_BYTES: u64 = 64 << 20;

impl FileStorage {
    /// Opens an existing file or block device (direct I/O where supported).
    pub fn open(path: &Path, read_only: bool) -> Result<Self> {
        Self::open_with(path, read_only, IoMode::Direct)
    }

    /// Opens an existing file or block device with the given I/O mode.
    pub fn open_with(path: &Path, read_only: bool, mode: IoMode) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| open_error(path, e))?;
        Self::from_file(file, path, read_only, mode)
    }

    /// Opens `path`, creating it as a regular file of `size_bytes` when given (a file is only
    /// ever extended, never truncated; a block device must already be large enough).
    pub fn create(path: &Path, size_bytes: Option<u64>) -> Result<Self> {
        Self::create_with(path, size_bytes, IoMode::Direct)
    }

    /// `create` with the given I/O mode.
    pub fn create_with(path: &Path, size_bytes: Option<u64>, mode: IoMode) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(size_bytes.is_some())
            .truncate(false)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| open_error(path, e))?;
        // Locked before the file is extended: a volume another process has open must not
        // change size under it (`from_file` takes the same lock again, which is a no-op).
        lock(&file, path, false)?;
        if let Some(size) = size_bytes {
            let meta = file.metadata().map_err(|e| Error::io(format!("stat {}", path.display()), e))?;
            if meta.file_type().is_file() {
                if meta.len() < size {
                    file.set_len(size)
                        .map_err(|e| Error::io(format!("extending {} to {size} bytes", path.display()), e))?;
                }
            } else if device_len(&file, path)? < size {
                return Err(Error::InvalidArgument(format!(
                    "{} is a device smaller than the requested physical size {size}",
                    path.display()
                )));
            }
        }
        Self::from_file(file, path, false, mode)
    }

    fn from_file(file: File, path: &Path, read_only: bool, mode: IoMode) -> Result<Self> {
        if file.metadata().is_ok_and(|m| m.is_dir()) {
            // Said plainly: read-only, a directory opens fine and would later look "too small".
            return Err(not_a_directory(path));
        }
        lock(&file, path, read_only)?;
        let len = device_len(&file, path)?;
        let direct = match mode {
            IoMode::Direct | IoMode::Auto => open_direct(&file, path, read_only, len),
            IoMode::Buffered => None,
        };
        let regular = file.metadata().map(|m| m.file_type().is_file()).unwrap_or(false);
        let prealloc = (direct.is_some() && regular && !read_only)
            .then(|| (0..len.div_ceil(PREALLOC_REGION_BYTES).div_ceil(64)).map(|_| AtomicU64::new(0)).collect());
        Ok(FileStorage { file, direct, prealloc, len, name: path.display().to_string() })
    }

    /// Allocates (as unwritten extents, which read as zeros) the regions of a sparse
    /// regular file that `[offset, offset + len)` touches, once per region. Why: a direct
    /// write into a hole makes ext4 hold the inode lock exclusively until the write
    /// completes, stalling every other direct read or write of the file (block map reads
    /// under the state lock among them); into allocated extents it holds the lock shared.
    /// Best effort: a failure leaves the write to find out for itself.
    fn preallocate(&self, offset: u64, len: usize) {
        let Some(bits) = &self.prealloc else { return };
        let first = offset / PREALLOC_REGION_BYTES;
        let last = (offset + len.max(1) as u64 - 1) / PREALLOC_REGION_BYTES;
        for r in first..=last {
            let Some(word) = bits.get((r / 64) as usize) else { return };
            let bit = 1u64 << (r % 64);
            if word.load(Ordering::Relaxed) & bit != 0 || word.fetch_or(bit, Ordering::Relaxed) & bit != 0 {
                continue;
            }
            let start = r * PREALLOC_REGION_BYTES;
            let n = PREALLOC_REGION_BYTES.min(self.len.saturating_sub(start));
            if let (Ok(o), Ok(n)) = (i64::try_from(start), i64::try_from(n)) {
                use std::os::fd::AsRawFd;
                // SAFETY: plain syscall on an fd this struct owns; no memory is passed. Mode
                // KEEP_SIZE never changes the file's size; the result is advisory (above).
                unsafe { libc::fallocate(self.file.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, o, n) };
            }
        }
    }

    /// The same storage without its direct descriptor: every request goes through the
    /// page cache.
    pub fn into_buffered(mut self) -> Self {
        self.direct = None;
        self.prealloc = None;
        self
    }

    /// The `O_DIRECT` descriptor when `[offset, offset + len)` can go through it.
    fn direct_for(&self, offset: u64, len: usize) -> Option<&File> {
        self.direct.as_ref().filter(|_| aligned::is_aligned(offset, len))
    }
}

/// Opens a second, `O_DIRECT` descriptor on the file `file` has open, and checks with one
/// aligned read that the file system takes direct I/O. None where it does not (the
/// storage then stays buffered: slower, never wrong).
fn open_direct(file: &File, path: &Path, read_only: bool, len: u64) -> Option<File> {
    use std::os::fd::AsRawFd;
    // Through /proc the new descriptor is certain to name the same file, even if `path`
    // was replaced in between.
    let same = std::path::PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    let target = if same.exists() { same.as_path() } else { path };
    let d = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(libc::O_CLOEXEC | libc::O_DIRECT)
        .open(target)
        .ok()?;
    if len >= aligned::ALIGN as u64 {
        let mut probe = aligned::AlignedBuf::new(aligned::ALIGN)?;
        d.read_exact_at(probe.as_mut_slice(), 0).ok()?;
    }
    Some(d)
}

/// Reads `buf` at `offset` through the direct descriptor `d` (both aligned), via the
/// pooled bounce buffer when `buf`'s memory is not aligned.
fn read_direct(d: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    if aligned::is_aligned_ptr(buf.as_ptr()) {
        return d.read_exact_at(buf, offset);
    }
    let mut pos = offset;
    for piece in buf.chunks_mut(BOUNCE_BYTES) {
        aligned::with_bounce(|b| {
            let t = b.get_mut(..piece.len()).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
            d.read_exact_at(t, pos)?;
            piece.copy_from_slice(t);
            Ok::<(), io::Error>(())
        })
        .ok_or_else(no_bounce)??;
        pos += piece.len() as u64;
    }
    Ok(())
}

/// Writes `bufs` back to back at `offset` through the direct descriptor `d` (offset and
/// total length aligned), gathered into a pooled bounce buffer one piece at a time.
fn write_direct(d: &File, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
    if let [one] = bufs {
        if aligned::is_aligned_ptr(one.as_ptr()) {
            return d.write_all_at(one, offset);
        }
    }
    let total: usize = bufs.iter().map(|b| b.len()).sum();
    let mut src = bufs.iter().copied();
    let mut cur: &[u8] = &[];
    let mut done = 0usize;
    while done < total {
        let n = (total - done).min(BOUNCE_BYTES);
        aligned::with_bounce(|b| {
            let piece = b.get_mut(..n).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
            let mut fill = 0usize;
            while fill < n {
                if cur.is_empty() {
                    cur = src.next().ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
                    continue;
                }
                let k = cur.len().min(n - fill);
                let (head, rest) = cur.split_at(k);
                piece
                    .get_mut(fill..fill + k)
                    .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?
                    .copy_from_slice(head);
                cur = rest;
                fill += k;
            }
            d.write_all_at(piece, offset + done as u64)
        })
        .ok_or_else(no_bounce)??;
        done += n;
    }
    Ok(())
}

fn no_bounce() -> io::Error {
    io::Error::new(io::ErrorKind::OutOfMemory, "no bounce buffer for direct I/O")
}

/// True for the error a file system gives when it refuses direct I/O for a request.
fn direct_refused(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

/// Takes an advisory `flock` for as long as the file is open: exclusive for writers,
/// shared for readers, so two processes never write one volume at once (which would
/// corrupt it) and nobody audits a volume that is being written. Fails at once if held.
fn lock(file: &File, path: &Path, read_only: bool) -> Result<()> {
    use std::os::fd::AsRawFd;
    let mode = if read_only { libc::LOCK_SH } else { libc::LOCK_EX };
    // SAFETY: flock on a file descriptor owned by `file`, valid for the call.
    let r = unsafe { libc::flock(file.as_raw_fd(), mode | libc::LOCK_NB) };
    if r == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::WouldBlock {
        let holders = file.metadata().map(|m| lock_holders(&m)).unwrap_or_default();
        let who = if holders.is_empty() { String::new() } else { format!(": held by {}", holders.join(", ")) };
        return Err(Error::InUse(format!(
            "{} is in use by another process (already being served, or open for writing){who}",
            path.display()
        )));
    }
    Err(Error::io(format!("locking {}", path.display()), e))
}

/// Who holds an `flock` on the file `md` describes, from `/proc/locks` ("process 1234
/// (dedupvol serve vol.img)"); empty where that is unknown (not Linux, no /proc). A
/// `flock` cannot be queried with `F_GETLK`, but the kernel lists it with its owner's pid.
fn lock_holders(md: &std::fs::Metadata) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let Ok(locks) = std::fs::read_to_string("/proc/locks") else { return Vec::new() };
    let (major, minor) = (libc::major(md.dev()) as u64, libc::minor(md.dev()) as u64);
    let mut pids: Vec<u32> = Vec::new();
    for line in locks.lines() {
        // "3: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"; waiters are marked "->".
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.get(1) != Some(&"FLOCK") {
            continue;
        }
        let (Some(pid), Some(id)) = (f.get(4).and_then(|p| p.parse::<u32>().ok()), f.get(5)) else { continue };
        let mut parts = id.split(':');
        let dev_ino = (
            parts.next().and_then(|x| u64::from_str_radix(x, 16).ok()),
            parts.next().and_then(|x| u64::from_str_radix(x, 16).ok()),
            parts.next().and_then(|x| x.parse::<u64>().ok()),
        );
        if dev_ino == (Some(major), Some(minor), Some(md.ino())) && !pids.contains(&pid) {
            pids.push(pid);
        }
    }
    pids.iter()
        .map(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|b| {
                    let words: Vec<String> = b
                        .split(|&c| c == 0)
                        .filter(|w| !w.is_empty())
                        .map(|w| String::from_utf8_lossy(w).into())
                        .collect();
                    words.join(" ")
                })
                .unwrap_or_default();
            if cmd.is_empty() {
                format!("process {pid}")
            } else {
                let cmd: String = cmd.chars().take(160).collect();
                format!("process {pid} ({cmd})")
            }
        })
        .collect()
}

/// An open that failed: a directory said plainly, anything else as the OS error.
fn open_error(path: &Path, e: io::Error) -> Error {
    match e.raw_os_error() {
        Some(libc::EISDIR) => not_a_directory(path),
        _ => Error::io(format!("opening {}", path.display()), e),
    }
}

fn not_a_directory(path: &Path) -> Error {
    Error::InvalidArgument(format!("{} is a directory, not a file or block device", path.display()))
}

fn device_len(file: &File, path: &Path) -> Result<u64> {
    let meta = file.metadata().map_err(|e| Error::io(format!("stat {}", path.display()), e))?;
    if meta.file_type().is_block_device() {
        // Seeking to the end is the portable way to learn a block device's size.
        use std::io::Seek;
        let mut f = file;
        f.seek(io::SeekFrom::End(0)).map_err(|e| Error::io(format!("sizing {}", path.display()), e))
    } else {
        Ok(meta.len())
    }
}

impl Storage for FileStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if let Some(d) = self.direct_for(offset, buf.len()) {
            match read_direct(d, buf, offset) {
                Err(e) if direct_refused(&e) => {}
                r => return r,
            }
        }
        self.file.read_exact_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_vectored_at(&[buf], offset)
    }
    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if let Some(d) = self.direct_for(offset, total) {
            self.preallocate(offset, total);
            match write_direct(d, bufs, offset) {
                Err(e) if direct_refused(&e) => {}
                r => return r,
            }
        }
        if let [one] = bufs {
            return self.file.write_all_at(one, offset);
        }
        let mut off = offset;
        for group in bufs.chunks(IOVECS_PER_CALL) {
            let iov: Vec<libc::iovec> = group
                .iter()
                .map(|b| libc::iovec { iov_base: b.as_ptr() as *mut libc::c_void, iov_len: b.len() })
                .collect();
            let total: usize = group.iter().map(|b| b.len()).sum();
            let at = i64::try_from(off).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
            // SAFETY: every iovec points into a live slice of `group` for the whole call, and
            // pwritev only reads from them.
            let n = unsafe {
                libc::pwritev(std::os::fd::AsRawFd::as_raw_fd(&self.file), iov.as_ptr(), iov.len() as libc::c_int, at)
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            let done = usize::try_from(n).unwrap_or(0);
            if done < total {
                // Short (or interrupted) write: finish buffer by buffer from where it stopped.
                let mut skip = done;
                let mut pos = off + done as u64;
                for b in group {
                    if skip >= b.len() {
                        skip -= b.len();
                        continue;
                    }
                    let rest = b.get(skip..).unwrap_or(&[]);
                    self.file.write_all_at(rest, pos)?;
                    pos += rest.len() as u64;
                    skip = 0;
                }
            }
            off += total as u64;
        }
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn is_direct(&self) -> bool {
        self.direct.is_some()
    }
    fn start_writeback(&self, offset: u64, len: u64) {
        if self.direct.is_some() {
            // Direct writes are on the device (its cache) when they return.
            return;
        }
        let (Ok(off), Ok(n)) = (i64::try_from(offset), i64::try_from(len)) else { return };
        // SAFETY: plain syscall on an fd this struct owns; no memory is passed. The result is
        // ignored: this is only a hint, and a write error is reported by the next fdatasync.
        unsafe {
            libc::sync_file_range(std::os::fd::AsRawFd::as_raw_fd(&self.file), off, n, libc::SYNC_FILE_RANGE_WRITE);
        }
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn name(&self) -> String {
        self.name.clone()
    }
}

/// A RAM-backed device. Every write is immediately "durable" (no crash model: the
/// simulator crate provides one).
pub struct MemStorage {
    chunks: Vec<RwLock<Vec<u8>>>,
    len: u64,
}

const MEM_CHUNK_BYTES: u64 = 1 << 20;

impl MemStorage {
    /// A zero-filled device of `len` bytes (memory is committed lazily per 1 MiB chunk).
    pub fn new(len: u64) -> Self {
        let n = len.div_ceil(MEM_CHUNK_BYTES);
        MemStorage { chunks: (0..n).map(|_| RwLock::new(Vec::new())).collect(), len }
    }

    fn for_each_chunk(
        &self,
        offset: u64,
        len: usize,
        mut f: impl FnMut(&RwLock<Vec<u8>>, usize, usize, usize),
    ) -> io::Result<()> {
        if offset.checked_add(len as u64).is_none_or(|end| end > self.len) {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "access beyond end of memory device"));
        }
        let mut done = 0usize;
        while done < len {
            let pos = offset + done as u64;
            let chunk = (pos / MEM_CHUNK_BYTES) as usize;
            let within = (pos % MEM_CHUNK_BYTES) as usize;
            let n = (len - done).min(MEM_CHUNK_BYTES as usize - within);
            let lock = self.chunks.get(chunk).ok_or_else(|| io::Error::other("chunk index"))?;
            f(lock, within, done, n);
            done += n;
        }
        Ok(())
    }
}

#[expect(clippy::indexing_slicing, reason = "for_each_chunk bounds every range to the device and the 1 MiB chunk")]
impl Storage for MemStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let len = buf.len();
        self.for_each_chunk(offset, len, |lock, within, done, n| {
            let c = lock.read();
            let dst = &mut buf[done..done + n];
            if c.is_empty() {
                dst.fill(0);
            } else {
                dst.copy_from_slice(&c[within..within + n]);
            }
        })
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.for_each_chunk(offset, buf.len(), |lock, within, done, n| {
            let mut c = lock.write();
            if c.is_empty() {
                c.resize(MEM_CHUNK_BYTES as usize, 0);
            }
            c[within..within + n].copy_from_slice(&buf[done..done + n]);
        })
    }
    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn name(&self) -> String {
        "memory".to_string()
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
    fn len(&self) -> u64 {
        (**self).len()
    }
    fn name(&self) -> String {
        (**self).name()
    }
}

/// What a device access was for: the categories of the paper's I/O overhead breakdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    /// Client data blocks (raw or packed) written or read back for a client read.
    Data,
    /// Recovery journal blocks.
    Journal,
    /// Block map pages.
    BlockMap,
    /// Reference count pages.
    Refcount,
    /// Fingerprint index save/load.
    Index,
    /// Reads of stored data to verify a duplicate before sharing it.
    Verify,
    /// Superblock copies.
    Superblock,
}

/// Bytes and operations for one category and direction.
#[derive(Debug, Default)]
pub struct IoCounter {
    /// Bytes moved.
    pub bytes: AtomicU64,
    /// Device operations issued.
    pub ops: AtomicU64,
}

impl IoCounter {
    fn add(&self, bytes: usize) {
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.ops.fetch_add(1, Ordering::Relaxed);
    }
    fn snapshot(&self) -> IoFigure {
        IoFigure { bytes: self.bytes.load(Ordering::Relaxed), ops: self.ops.load(Ordering::Relaxed) }
    }
}

/// A snapshot of one counter.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct IoFigure {
    /// Bytes moved.
    pub bytes: u64,
    /// Operations issued.
    pub ops: u64,
}

/// Live I/O counters by category, shared by all of a volume's devices.
#[derive(Debug, Default)]
pub struct IoCounters {
    data_write: IoCounter,
    data_read: IoCounter,
    journal_write: IoCounter,
    journal_read: IoCounter,
    block_map_write: IoCounter,
    block_map_read: IoCounter,
    refcount_write: IoCounter,
    refcount_read: IoCounter,
    index_write: IoCounter,
    index_read: IoCounter,
    verify_read: IoCounter,
    superblock_write: IoCounter,
    superblock_read: IoCounter,
    syncs: AtomicU64,
}

impl IoCounters {
    fn counter(&self, kind: IoKind, write: bool) -> &IoCounter {
        match (kind, write) {
            (IoKind::Data, true) => &self.data_write,
            (IoKind::Data, false) => &self.data_read,
            (IoKind::Journal, true) => &self.journal_write,
            (IoKind::Journal, false) => &self.journal_read,
            (IoKind::BlockMap, true) => &self.block_map_write,
            (IoKind::BlockMap, false) => &self.block_map_read,
            (IoKind::Refcount, true) => &self.refcount_write,
            (IoKind::Refcount, false) => &self.refcount_read,
            (IoKind::Index, true) => &self.index_write,
            (IoKind::Index, false) => &self.index_read,
            (IoKind::Verify, _) => &self.verify_read,
            (IoKind::Superblock, true) => &self.superblock_write,
            (IoKind::Superblock, false) => &self.superblock_read,
        }
    }

    /// A point-in-time copy for stats.
    pub fn snapshot(&self) -> IoStats {
        IoStats {
            data_write: self.data_write.snapshot(),
            data_read: self.data_read.snapshot(),
            journal_write: self.journal_write.snapshot(),
            journal_read: self.journal_read.snapshot(),
            block_map_write: self.block_map_write.snapshot(),
            block_map_read: self.block_map_read.snapshot(),
            refcount_write: self.refcount_write.snapshot(),
            refcount_read: self.refcount_read.snapshot(),
            index_write: self.index_write.snapshot(),
            index_read: self.index_read.snapshot(),
            verify_read: self.verify_read.snapshot(),
            superblock_write: self.superblock_write.snapshot(),
            superblock_read: self.superblock_read.snapshot(),
            syncs: self.syncs.load(Ordering::Relaxed),
        }
    }
}

/// I/O counters by category (bytes and operations), as reported by `stats`.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct IoStats {
    /// Client data written to the data device (raw and packed blocks).
    pub data_write: IoFigure,
    /// Data blocks read to serve client reads.
    pub data_read: IoFigure,
    /// Recovery journal blocks written.
    pub journal_write: IoFigure,
    /// Journal blocks read (recovery).
    pub journal_read: IoFigure,
    /// Block map pages written.
    pub block_map_write: IoFigure,
    /// Block map pages read (cache misses).
    pub block_map_read: IoFigure,
    /// Reference count pages written.
    pub refcount_write: IoFigure,
    /// Reference count pages read (open).
    pub refcount_read: IoFigure,
    /// Fingerprint index saved.
    pub index_write: IoFigure,
    /// Fingerprint index loaded.
    pub index_read: IoFigure,
    /// Data read to verify duplicates (cache misses only).
    pub verify_read: IoFigure,
    /// Superblock writes.
    pub superblock_write: IoFigure,
    /// Superblock reads.
    pub superblock_read: IoFigure,
    /// Durability barriers (fdatasync) issued, all devices.
    pub syncs: u64,
}

impl IoStats {
    /// Total bytes written to all devices.
    pub fn total_written_bytes(&self) -> u64 {
        self.data_write.bytes
            + self.journal_write.bytes
            + self.block_map_write.bytes
            + self.refcount_write.bytes
            + self.index_write.bytes
            + self.superblock_write.bytes
    }
}

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
    /// True when both handles are the same device object.
    pub fn same_as(&self, other: &Dev) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_vectored_write_matches_joined_write() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = FileStorage::create(&dir.path().join("v"), Some(16 << 20)).expect("create");
        // More buffers than one pwritev takes, of uneven sizes.
        let bufs: Vec<Vec<u8>> = (0..2500u32).map(|i| vec![(i % 253) as u8; 1 + (i as usize * 7) % 4096]).collect();
        let refs: Vec<&[u8]> = bufs.iter().map(|b| &b[..]).collect();
        f.write_vectored_at(&refs, 12345).expect("write");
        let joined = bufs.concat();
        let mut back = vec![0u8; joined.len()];
        f.read_at(&mut back, 12345).expect("read");
        assert_eq!(back, joined);
    }

    #[test]
    fn direct_and_buffered_files_agree() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = crate::codec::test_random_bytes(7, 3 * BOUNCE_BYTES + 5 * 4096);
        for mode in [IoMode::Direct, IoMode::Buffered] {
            let path = dir.path().join(format!("{mode:?}"));
            let f = FileStorage::create_with(&path, Some(64 << 20), mode).expect("create");
            // The temp directory is on a file system that takes O_DIRECT (ext4, tmpfs since
            // Linux 6.6); without it this test would not exercise the direct path at all.
            assert_eq!(f.is_direct(), mode == IoMode::Direct, "{}", path.display());
            // Unaligned memory in uneven pieces, larger than the bounce buffer: gathered.
            let (a, rest) = data.split_at(4096 * 3 + 1);
            let (b, c) = rest.split_at(BOUNCE_BYTES + 4095);
            f.write_vectored_at(&[a, b, c], 8192).expect("vectored write");
            // Unaligned destination memory, then an aligned one, then an unaligned offset.
            let mut back = vec![0u8; data.len() + 1];
            f.read_at(&mut back[1..], 8192).expect("read");
            assert!(back[1..] == data[..]);
            let mut al = crate::aligned::AlignedBuf::new(data.len()).expect("alloc");
            let al = al.as_mut_slice();
            f.read_at(al, 8192).expect("aligned read");
            assert!(al[..] == data[..]);
            let mut odd = vec![0u8; 1000];
            f.read_at(&mut odd, 8192 + 77).expect("unaligned read");
            assert!(odd[..] == data[77..1077]);
            // An unaligned write (page-cache path) is seen by a later direct read.
            f.write_at(&[0xAB; 100], 8192 + 4096 + 10).expect("unaligned write");
            f.read_at(&mut al[..8192], 8192).expect("read after unaligned write");
            assert!(al[4096 + 10..4096 + 110].iter().all(|&x| x == 0xAB));
            assert!(al[..4096 + 10] == data[..4096 + 10]);
            f.sync().expect("sync");
            // Direct mode allocated the touched 64 MiB region before writing (unwritten
            // extents); buffered mode left the rest of the file a hole.
            use std::os::unix::fs::MetadataExt;
            let allocated = std::fs::metadata(&path).expect("stat").blocks() * 512;
            assert_eq!(allocated >= 64 << 20, mode == IoMode::Direct, "{mode:?}: {allocated} bytes allocated");
        }
    }

    #[test]
    fn mem_storage_round_trip_across_chunks() {
        let m = MemStorage::new(3 * MEM_CHUNK_BYTES);
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let off = MEM_CHUNK_BYTES - 5000;
        m.write_at(&data, off).expect("write");
        let mut back = vec![0u8; data.len()];
        m.read_at(&mut back, off).expect("read");
        assert_eq!(back, data);
        assert!(m.read_at(&mut back, 3 * MEM_CHUNK_BYTES - 10).is_err());
    }
}
