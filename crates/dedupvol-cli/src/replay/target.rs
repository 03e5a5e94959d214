//! Where a replay sends its requests: a dedupvol volume opened in-process, a raw file or
//! block device, or an NBD server.
//!
//! Invariants:
//! - Every target is shared by the replay workers; `worker` (0-based, below the worker
//!   count given at open) picks per-worker state, such as an NBD connection each, so no two
//!   workers wait on one socket.
//! - Offsets and lengths are whole 4 KiB blocks (the trace is rounded out to them), which
//!   is what O_DIRECT needs; buffers handed in are 4 KiB-aligned.
//! - A failure says which target and which request.

use anyhow::{bail, Context};
use dedupvol_core::{OpenOptions, Volume};
use dedupvol_nbd::{NbdClient, NbdUri};
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

/// A replay target.
pub trait Target: Send + Sync {
    /// One line naming the target.
    fn describe(&self) -> String;
    /// Bytes addressable (`u64::MAX` for a regular file, which grows).
    fn size_bytes(&self) -> u64;
    /// Reads `buf.len()` bytes at `offset`.
    fn read(&self, worker: usize, offset: u64, buf: &mut [u8]) -> anyhow::Result<()>;
    /// Writes `data` at `offset`.
    fn write(&self, worker: usize, offset: u64, data: &[u8]) -> anyhow::Result<()>;
    /// Makes completed writes durable.
    fn flush(&self) -> anyhow::Result<()>;
    /// Closes the target cleanly (a volume writes its checkpoint).
    fn close(self: Box<Self>) -> anyhow::Result<()>;
    /// The engine's statistics after the replay (cache, tier and device figures), for
    /// targets that have them.
    fn engine_stats(&self) -> Option<serde_json::Value> {
        None
    }
}

/// How to open a `vol:` target.
#[derive(Debug, Default, Clone)]
pub struct VolumeTargetOptions {
    /// A separate metadata device (default: found from the superblock).
    pub meta_device: Option<PathBuf>,
    /// Content cache size, in bytes (default: the engine's).
    pub content_cache_bytes: Option<u64>,
    /// The hot-chunk tier (none by default).
    pub tier: Option<dedupvol_core::TierOptions>,
}

/// Opens `spec`: `vol:PATH`, `file:PATH`, `nbd://…` or `nbd+unix://…`.
pub fn open(
    spec: &str,
    workers: usize,
    direct: bool,
    vol: &VolumeTargetOptions,
    nbd_timeout: Duration,
) -> anyhow::Result<Box<dyn Target>> {
    if let Some(p) = spec.strip_prefix("vol:") {
        if direct {
            return Err(crate::usage("--direct applies to file: targets (a volume chooses its own I/O mode)"));
        }
        return Ok(Box::new(VolumeTarget::open(Path::new(p), vol)?));
    }
    if vol.meta_device.is_some() || vol.content_cache_bytes.is_some() || vol.tier.is_some() {
        return Err(crate::usage("--meta-device, --cache-size and --tier-device apply to vol: targets only"));
    }
    if let Some(p) = spec.strip_prefix("file:") {
        return Ok(Box::new(FileTarget::open(Path::new(p), direct)?));
    }
    if spec.starts_with("nbd://") || spec.starts_with("nbd+unix://") {
        if direct {
            return Err(crate::usage("--direct applies to file: targets only"));
        }
        let uri = NbdUri::parse(spec).map_err(crate::usage)?;
        return Ok(Box::new(NbdTarget::connect(uri, workers, nbd_timeout)?));
    }
    Err(crate::usage(format!(
        "--target {spec:?}: expected vol:PATH, file:PATH, nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH"
    )))
}

/// A dedupvol volume in this process.
pub struct VolumeTarget {
    path: PathBuf,
    volume: Volume,
}

impl VolumeTarget {
    fn open(path: &Path, o: &VolumeTargetOptions) -> anyhow::Result<Self> {
        let mut opts = OpenOptions::default();
        if let Some(b) = o.content_cache_bytes {
            opts.content_cache_bytes = b;
        }
        opts.tier = o.tier.clone();
        let volume = Volume::open_path(path, o.meta_device.as_deref(), &opts)
            .with_context(|| format!("opening volume {}", path.display()))?;
        crate::volume_cmds::warn_tier_notes(&volume);
        Ok(VolumeTarget { path: path.to_path_buf(), volume })
    }
}

impl Target for VolumeTarget {
    fn describe(&self) -> String {
        format!("volume {} (in-process, default open options)", self.path.display())
    }
    fn size_bytes(&self) -> u64 {
        self.volume.logical_size()
    }
    fn read(&self, _worker: usize, offset: u64, buf: &mut [u8]) -> anyhow::Result<()> {
        self.volume.read(offset, buf).with_context(|| format!("volume read of {} bytes at {offset}", buf.len()))
    }
    fn write(&self, _worker: usize, offset: u64, data: &[u8]) -> anyhow::Result<()> {
        self.volume
            .write(offset, data, false)
            .with_context(|| format!("volume write of {} bytes at {offset}", data.len()))
    }
    fn flush(&self) -> anyhow::Result<()> {
        self.volume.flush().context("volume flush")
    }
    fn engine_stats(&self) -> Option<serde_json::Value> {
        self.volume.wait_tier_idle();
        serde_json::to_value(self.volume.stats()).ok()
    }
    fn close(self: Box<Self>) -> anyhow::Result<()> {
        let path = self.path.clone();
        self.volume.close().with_context(|| format!("closing volume {}", path.display()))
    }
}

/// A raw file or block device, with positioned reads and writes.
pub struct FileTarget {
    path: PathBuf,
    file: File,
    direct: bool,
    size_bytes: u64,
}

impl FileTarget {
    fn open(path: &Path, direct: bool) -> anyhow::Result<Self> {
        let mut o = std::fs::OpenOptions::new();
        o.read(true).write(true);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        let file = o.open(path).with_context(|| format!("opening {}", path.display()))?;
        let meta = file.metadata().with_context(|| format!("stat {}", path.display()))?;
        let size_bytes = if meta.is_file() {
            // A regular file grows with writes, and reads past its end are zeros (as in a
            // sparse file), so it bounds nothing.
            u64::MAX
        } else {
            use std::io::Seek;
            (&file).seek(std::io::SeekFrom::End(0)).with_context(|| format!("size of {}", path.display()))?
        };
        Ok(FileTarget { path: path.to_path_buf(), file, direct, size_bytes })
    }
}

impl Target for FileTarget {
    fn describe(&self) -> String {
        format!("file {}{}", self.path.display(), if self.direct { " (O_DIRECT)" } else { " (buffered)" })
    }
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }
    fn read(&self, _worker: usize, offset: u64, buf: &mut [u8]) -> anyhow::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let n = self
                .file
                .read_at(&mut buf[done..], offset + done as u64)
                .with_context(|| format!("pread of {} bytes at {offset} in {}", buf.len(), self.path.display()))?;
            if n == 0 {
                // Past the end of a regular file: a hole.
                buf[done..].fill(0);
                break;
            }
            done += n;
        }
        Ok(())
    }
    fn write(&self, _worker: usize, offset: u64, data: &[u8]) -> anyhow::Result<()> {
        self.file
            .write_all_at(data, offset)
            .with_context(|| format!("pwrite of {} bytes at {offset} in {}", data.len(), self.path.display()))
    }
    fn flush(&self) -> anyhow::Result<()> {
        self.file.sync_data().with_context(|| format!("fdatasync {}", self.path.display()))
    }
    fn close(self: Box<Self>) -> anyhow::Result<()> {
        Ok(())
    }
}

/// An NBD export, one connection per worker.
pub struct NbdTarget {
    uri: NbdUri,
    connections: Vec<Mutex<Option<NbdClient>>>,
    size_bytes: u64,
}

impl NbdTarget {
    fn connect(uri: NbdUri, workers: usize, timeout: Duration) -> anyhow::Result<Self> {
        let mut connections = Vec::with_capacity(workers);
        for i in 0..workers.max(1) {
            let c = NbdClient::connect(&uri, timeout).with_context(|| format!("connection {} to {uri}", i + 1))?;
            if c.read_only() {
                bail!("{uri}: the export is read-only; a replay writes");
            }
            connections.push(Mutex::new(Some(c)));
        }
        let size_bytes = lock(&connections[0]).as_ref().map_or(0, NbdClient::size_bytes);
        Ok(NbdTarget { uri, connections, size_bytes })
    }

    fn with<T>(&self, worker: usize, f: impl FnOnce(&mut NbdClient) -> anyhow::Result<T>) -> anyhow::Result<T> {
        let slot = &self.connections[worker % self.connections.len()];
        let mut guard = lock(slot);
        match guard.as_mut() {
            Some(c) => f(c),
            None => bail!("{}: connection {} is closed", self.uri, worker + 1),
        }
    }
}

impl Target for NbdTarget {
    fn describe(&self) -> String {
        format!("NBD {} ({} connections)", self.uri, self.connections.len())
    }
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }
    fn read(&self, worker: usize, offset: u64, buf: &mut [u8]) -> anyhow::Result<()> {
        self.with(worker, |c| Ok(c.read(offset, buf)?))
    }
    fn write(&self, worker: usize, offset: u64, data: &[u8]) -> anyhow::Result<()> {
        self.with(worker, |c| Ok(c.write(offset, data)?))
    }
    fn flush(&self) -> anyhow::Result<()> {
        // One flush per connection: right whether or not the server offers multi-connection
        // consistency, and it only happens at the end of a phase.
        for w in 0..self.connections.len() {
            self.with(w, |c| Ok(c.flush()?))?;
        }
        Ok(())
    }
    fn close(self: Box<Self>) -> anyhow::Result<()> {
        for slot in &self.connections {
            let taken = lock(slot).take();
            if let Some(c) = taken {
                c.disconnect().with_context(|| format!("disconnecting from {}", self.uri))?;
            }
        }
        Ok(())
    }
}

/// Locks a connection slot; a worker that panicked holding it left the client out of step,
/// which its next call reports, so the poison itself carries no extra news.
fn lock(m: &Mutex<Option<NbdClient>>) -> std::sync::MutexGuard<'_, Option<NbdClient>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
