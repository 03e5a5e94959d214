//! A regular file or block device, read and written with `pread`/`pwrite`, optionally
//! with `O_DIRECT`.
//!
//! Invariants:
//! - A `FileStorage` in direct mode moves every aligned request with `O_DIRECT` (through a
//!   bounce buffer when the memory is not aligned; a write of aligned pieces, such as 4 KiB
//!   blocks on page boundaries, goes as they are) and only requests direct I/O cannot take
//!   through the page cache; the kernel keeps the two coherent (a direct write writes back
//!   and drops cached pages of its range), and the engine never has both kinds in flight
//!   on one block.
//! - The device is locked (`flock`) while open: a second process gets `Error::InUse`.

use super::aligned::{self, BOUNCE_BYTES};
use super::{IoMode, Storage};
use crate::error::{Error, Result};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Buffers per `pwritev` call (Linux's IOV_MAX).
const IOVECS_PER_CALL: usize = 1024;

/// A regular file or block device, with `pread`/`pwrite` and `fdatasync`.
pub struct FileStorage {
    /// Buffered descriptor: the lock, `fdatasync`, and requests direct I/O cannot take.
    file: File,
    /// `O_DIRECT` descriptor on the same file, when asked for and supported.
    direct: Option<File>,
    /// Regular file in direct mode: one bit per `PREALLOC_REGION_BYTES` region already
    /// allocated with `fallocate` (see `preallocate`).
    prealloc: Option<Vec<AtomicU64>>,
    /// `IoMode::ReadCached`: `read_cached_at` reads through `file` (the page cache).
    cached_reads: bool,
    /// Size in bytes; only grows (`refresh_len`).
    len: AtomicU64,
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
            IoMode::Direct | IoMode::Auto | IoMode::ReadCached => open_direct(&file, path, read_only, len),
            IoMode::Buffered => None,
        };
        let regular = file.metadata().map(|m| m.file_type().is_file()).unwrap_or(false);
        let prealloc = (direct.is_some() && regular && !read_only)
            .then(|| (0..len.div_ceil(PREALLOC_REGION_BYTES).div_ceil(64)).map(|_| AtomicU64::new(0)).collect());
        let cached_reads = mode == IoMode::ReadCached && direct.is_some();
        if cached_reads {
            // The engine reads what it needs in runs of its own: kernel readahead around a
            // random 4 KiB block read only multiplies the device reads of a cold cache.
            // SAFETY: plain syscall on an fd this function owns; no memory is passed. Advisory.
            unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&file), 0, 0, libc::POSIX_FADV_RANDOM) };
        }
        Ok(FileStorage {
            file,
            direct,
            prealloc,
            cached_reads,
            len: AtomicU64::new(len),
            name: path.display().to_string(),
        })
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
            let n = PREALLOC_REGION_BYTES.min(self.len.load(Ordering::Relaxed).saturating_sub(start));
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
        self.cached_reads = false;
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

/// Writes `bufs` back to back at `offset` through `f`, a `pwritev` per `IOVECS_PER_CALL`
/// buffers; a short write is finished buffer by buffer. Through a direct descriptor every
/// buffer must be aligned (address and length; see `write_direct`).
fn write_gathered(f: &File, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
    if let [one] = bufs {
        return f.write_all_at(one, offset);
    }
    let mut off = offset;
    for group in bufs.chunks(IOVECS_PER_CALL) {
        let iov: Vec<libc::iovec> =
            group.iter().map(|b| libc::iovec { iov_base: b.as_ptr() as *mut libc::c_void, iov_len: b.len() }).collect();
        let total: usize = group.iter().map(|b| b.len()).sum();
        let at = i64::try_from(off).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: every iovec points into a live slice of `group` for the whole call, and
        // pwritev only reads from them.
        let n =
            unsafe { libc::pwritev(std::os::fd::AsRawFd::as_raw_fd(f), iov.as_ptr(), iov.len() as libc::c_int, at) };
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
                #[expect(clippy::indexing_slicing, reason = "`skip < b.len()` (checked just above)")]
                let rest = &b[skip..];
                f.write_all_at(rest, pos)?;
                pos += rest.len() as u64;
                skip = 0;
            }
        }
        off += total as u64;
    }
    Ok(())
}

/// Writes `bufs` back to back at `offset` through the direct descriptor `d` (offset and
/// total length aligned), gathered into a pooled bounce buffer one piece at a time.
fn write_direct(d: &File, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
    // Buffers that are all aligned, as the allocator places 4 KiB blocks (a size-class
    // allocator puts them on page boundaries), go to the device as they are: the bounce
    // copy cost a memcpy of every byte the data writer wrote.
    if bufs.iter().all(|b| aligned::is_aligned_ptr(b.as_ptr()) && b.len().is_multiple_of(aligned::ALIGN)) {
        return write_gathered(d, bufs, offset);
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
    // The kernel renders /proc/locks one page at a time and resumes each read() at a
    // record index, so a lock released elsewhere between two reads shifts the list and
    // can hide the holder's line. Reading in large pieces makes that rare and a few
    // retries make it vanish; an empty answer after them means the holder really left.
    for _ in 0..LOCK_LIST_READS {
        let holders = lock_holders_once(md);
        if !holders.is_empty() {
            return holders;
        }
    }
    Vec::new()
}

/// How many times `lock_holders` reads /proc/locks before it concludes nobody is listed.
const LOCK_LIST_READS: usize = 4;

/// /proc/locks read whole, in reads of a bounded buffer (`read_to_string` starts with a
/// 32-byte probe read, which is what splits the list most often).
fn read_proc_locks() -> Option<String> {
    use std::io::Read;
    const PIECE: usize = 64 << 10;
    const MAX: usize = 16 << 20;
    let mut f = File::open("/proc/locks").ok()?;
    let mut out = Vec::new();
    let mut piece = vec![0u8; PIECE];
    loop {
        let n = f.read(&mut piece).ok()?;
        if n == 0 || out.len() + n > MAX {
            break;
        }
        out.extend_from_slice(piece.get(..n)?);
    }
    String::from_utf8(out).ok()
}

fn lock_holders_once(md: &std::fs::Metadata) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let Some(locks) = read_proc_locks() else { return Vec::new() };
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
        write_gathered(&self.file, bufs, offset)
    }
    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn is_direct(&self) -> bool {
        self.direct.is_some()
    }
    fn read_cached_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if self.cached_reads {
            return self.file.read_exact_at(buf, offset);
        }
        self.read_at(buf, offset)
    }
    fn reads_cached(&self) -> bool {
        self.cached_reads
    }
    fn drop_cached(&self, offset: u64, len: u64) {
        let (Ok(off), Ok(n)) = (i64::try_from(offset), i64::try_from(len)) else { return };
        // SAFETY: plain syscall on an fd this struct owns; no memory is passed. Advisory.
        unsafe {
            libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&self.file), off, n, libc::POSIX_FADV_DONTNEED);
        }
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
        self.len.load(Ordering::Relaxed)
    }
    fn refresh_len(&self) -> u64 {
        if let Ok(now) = device_len(&self.file, Path::new(&self.name)) {
            self.len.fetch_max(now, Ordering::Relaxed);
        }
        self.len()
    }
    fn name(&self) -> String {
        self.name.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: naming a lock's holder read /proc/locks with `read_to_string`, whose
    /// first read() is 32 bytes; a lock released elsewhere between that read and the next
    /// shifted the kernel's list and hid the holder, so "in use" came without its pid.
    #[test]
    fn the_holder_is_named_while_other_locks_come_and_go() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().expect("tempdir");
        let held = File::create(dir.path().join("held")).expect("create");
        // SAFETY: flock on a descriptor owned by `held`, valid for the call.
        assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
        let md = held.metadata().expect("metadata");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let churn = {
            let (stop, other) = (stop.clone(), File::create(dir.path().join("other")).expect("create"));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: flock on a descriptor owned by `other`, valid for the calls.
                    unsafe {
                        libc::flock(other.as_raw_fd(), libc::LOCK_EX);
                        libc::flock(other.as_raw_fd(), libc::LOCK_UN);
                    }
                }
            })
        };
        let me = format!("process {} ", std::process::id());
        let missed = (0..20_000).filter(|_| !lock_holders(&md).iter().any(|h| h.starts_with(&me))).count();
        stop.store(true, Ordering::Relaxed);
        churn.join().expect("churn thread");
        assert_eq!(missed, 0, "the holder went unnamed in {missed} of 20,000 lookups");
    }

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
            let mut al = crate::io::aligned::AlignedBuf::new(data.len()).expect("alloc");
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
            // Aligned pieces (4 KiB blocks as the allocator places them), more than one
            // pwritev takes, in an order the device does not hold them in memory: written
            // as they are, back to back.
            let mut pieces: Vec<crate::io::aligned::AlignedBuf> = (0..IOVECS_PER_CALL + 3)
                .map(|i| {
                    let mut p = crate::io::aligned::AlignedBuf::new(4096).expect("alloc");
                    p.as_mut_slice().fill((i % 251) as u8);
                    p
                })
                .collect();
            pieces.reverse();
            let refs: Vec<&[u8]> = pieces.iter_mut().map(|p| &*p.as_mut_slice()).collect();
            f.write_vectored_at(&refs, 1 << 20).expect("aligned vectored write");
            let mut back = crate::io::aligned::AlignedBuf::new(refs.len() * 4096).expect("alloc");
            let back = back.as_mut_slice();
            f.read_at(back, 1 << 20).expect("read of the aligned pieces");
            assert!(back.chunks_exact(4096).zip(&refs).all(|(got, want)| got == *want), "{mode:?}: aligned pieces");
        }
    }
}
