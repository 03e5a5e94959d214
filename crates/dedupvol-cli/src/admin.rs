//! The admin socket: how `dedupvol stats` reads the figures of a volume a server holds.
//!
//! Every `serve` of a volume listens on a Unix socket named after the volume file's device
//! and inode (so every spelling of its path, symlinks included, finds it) in the runtime
//! directory ([`runtime_dir`]). A client sends one request line and reads one JSON answer:
//!
//! | request | answer |
//! |---------|--------|
//! | `stats` | a [`Report`]: the volume's statistics, the server's counters, the refcount histogram |
//! | `grow [logical=BYTES] [physical=BYTES]` | a `GrowReport` (the volume grew; new connections see the size) |
//! | `scrub [repair] [rate=BYTES_PER_SECOND]` | `{"started": true}`: a scrub runs in the background |
//! | `scrub-status` | `{"status": ScrubStatus or null, "report": ScrubReport or null, "error": ...}`: `report` once the scrub this server ran last has finished |
//! | `scrub-cancel` | `{"cancelled": true}` (the running scrub stops at its next chunk) |
//! | anything else | `{"error": "..."}` |
//!
//! Invariants:
//! - Only the owner can connect: the runtime directory is created mode 0700 and must be
//!   owned by the current user, and the socket file is made mode 0600.
//! - A stale socket (its server was killed) is replaced by the next `serve`; a socket a
//!   live server answers on is never taken over (a second read-only server of the same
//!   volume then runs without one, and says so).
//! - Requests are bounded ([`REQUEST_BYTES_MAX`]) and answered one at a time with timeouts
//!   (see `service`); answers read by the client are bounded ([`ANSWER_BYTES_MAX`]).
//! - At most one scrub runs (`scrub_cmd::Jobs`); stopping the socket cancels and joins it
//!   before the volume is closed.

use crate::service::{read_line, Service};
use anyhow::Context;
use dedupvol_core::{RefcountBucket, Stats, Volume};
use dedupvol_nbd::{ListenAddr, Listener, ServerMetrics, ServerMetricsSnapshot};
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Longest request line accepted.
pub const REQUEST_BYTES_MAX: usize = 256;
/// Longest answer a client reads.
pub const ANSWER_BYTES_MAX: u64 = 16 << 20;
/// Environment variable naming the runtime directory (overrides the defaults).
pub const RUNTIME_DIR_ENV: &str = "DEDUPVOL_RUNTIME_DIR";

/// What a running server reports about itself and its volume.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// The volume's statistics (None when serving a RAM disk). Flattened, so the JSON has
    /// the same fields as `stats --json` of a closed volume, and more.
    #[serde(flatten)]
    pub volume: Option<Stats>,
    /// Physical blocks by reference count.
    pub refcount_histogram: Vec<RefcountBucket>,
    /// The NBD server's counters since it started.
    pub server: ServerMetricsSnapshot,
    /// The export's name.
    pub export: String,
    /// Where clients connect.
    pub address: String,
    /// The server's process id.
    pub pid: u32,
    /// Seconds since the server started.
    pub uptime_seconds: f64,
}

/// Everything a report is made from; shared by the admin socket and the metrics endpoint.
#[derive(Clone)]
pub struct Source {
    /// The volume (None for a RAM disk).
    pub volume: Option<Arc<Volume>>,
    /// The export's counters (requests, its connections).
    pub metrics: Arc<ServerMetrics>,
    /// The server's own counters (connections refused at the limit); the same as
    /// `metrics` for a server of one export.
    pub server_metrics: Arc<ServerMetrics>,
    /// Export name.
    pub export: String,
    /// Client address.
    pub address: String,
    /// Start time.
    pub started: Instant,
}

impl Source {
    /// The export's NBD figures, with the server's refusals (not any export's).
    pub fn server_snapshot(&self) -> ServerMetricsSnapshot {
        let mut snap = self.metrics.snapshot();
        if !Arc::ptr_eq(&self.metrics, &self.server_metrics) {
            snap.connections_refused = self.server_metrics.snapshot().connections_refused;
        }
        snap
    }

    /// A report as of now.
    pub fn report(&self) -> Report {
        Report {
            volume: self.volume.as_ref().map(|v| v.stats()),
            refcount_histogram: self.volume.as_ref().map(|v| v.refcount_histogram()).unwrap_or_default(),
            server: self.server_snapshot(),
            export: self.export.clone(),
            address: self.address.clone(),
            pid: std::process::id(),
            uptime_seconds: self.started.elapsed().as_secs_f64(),
        }
    }
}

/// The directory admin sockets live in: `$DEDUPVOL_RUNTIME_DIR`, else
/// `$XDG_RUNTIME_DIR/dedupvol`, else `/run/dedupvol` for root, else `/tmp/dedupvol-UID`.
pub fn runtime_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(RUNTIME_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("dedupvol");
    }
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    if uid == 0 {
        PathBuf::from("/run/dedupvol")
    } else {
        PathBuf::from(format!("/tmp/dedupvol-{uid}"))
    }
}

/// The admin socket of the volume at `volume` (which must exist).
pub fn socket_path(volume: &Path) -> anyhow::Result<PathBuf> {
    if let Some(url) = dedupvol_core::RadosUrl::parse(volume) {
        // A RADOS volume has no inode: its canonical URL names the socket (FNV-1a).
        let url = url?.to_string();
        let h = url.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        return Ok(runtime_dir().join(format!("rados-{h:016x}.sock")));
    }
    let md = std::fs::metadata(volume).with_context(|| format!("finding {}", volume.display()))?;
    Ok(runtime_dir().join(format!("{:x}-{:x}.sock", md.dev(), md.ino())))
}

/// Creates the runtime directory (0700) or checks that an existing one is ours and private.
fn prepare_runtime_dir(dir: &Path) -> anyhow::Result<()> {
    if let Err(e) = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir) {
        anyhow::bail!("creating the runtime directory {}: {e}", dir.display());
    }
    let md = std::fs::symlink_metadata(dir).with_context(|| format!("checking {}", dir.display()))?;
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    if !md.is_dir() || md.uid() != uid || md.mode() & 0o077 != 0 {
        anyhow::bail!(
            "{} must be a directory owned by uid {uid} and closed to others (mode {:o})",
            dir.display(),
            md.mode() & 0o777
        );
    }
    Ok(())
}

/// Starts the admin socket of `volume_path`. `Ok(None)` (with a warning on stderr) when a
/// live server already answers on it: a second read-only server of the volume. An error
/// (runtime directory unusable) is the caller's to report; the server can run without.
pub fn start(volume_path: &Path, source: Source) -> anyhow::Result<Option<Service>> {
    let path = socket_path(volume_path)?;
    if let Some(dir) = path.parent() {
        prepare_runtime_dir(dir)?;
    }
    let listener = match Listener::bind(&ListenAddr::Unix(path.clone())) {
        Ok(l) => l,
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            tracing::warn!(
                "another server of {} answers on its admin socket {}; this one has none",
                volume_path.display(),
                path.display()
            );
            return Ok(None);
        }
        Err(e) => return Err(e).with_context(|| format!("binding the admin socket {}", path.display())),
    };
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {}", path.display()))?;
    let jobs = crate::scrub_cmd::Jobs::default();
    let service = Service::spawn("admin", listener, move |s| {
        let answer = match read_line(s, REQUEST_BYTES_MAX)? {
            Some(r) if r == "stats" => serde_json::to_string(&source.report()),
            Some(r) if r.starts_with("grow") || r.starts_with("scrub") || r.starts_with("tune") => {
                let v = match &source.volume {
                    None => serde_json::json!({ "error": "this server serves no volume" }),
                    Some(vol) if r.starts_with("grow") => crate::grow_cmd::answer(vol, &r),
                    Some(vol) if r.starts_with("tune") => crate::tune_cmd::answer(vol, &r),
                    Some(vol) => jobs.answer(vol, &r),
                };
                serde_json::to_string(&v)
            }
            Some(r) => serde_json::to_string(&serde_json::json!({ "error": format!("unknown request {r:?}") })),
            None => serde_json::to_string(&serde_json::json!({ "error": "no request line" })),
        };
        let answer = answer.map_err(io::Error::other)?;
        s.write_all(answer.as_bytes())?;
        s.write_all(b"\n")
    })
    .context("starting the admin socket thread")?;
    Ok(Some(service))
}

/// Asks the server of `volume` for its report. `Ok(None)` when no server answers (no
/// socket, or a stale one): the volume is not being served.
pub fn query(volume: &Path) -> anyhow::Result<Option<Report>> {
    let Some((answer, path)) = request(volume, "stats")? else { return Ok(None) };
    let report = serde_json::from_str(&answer).with_context(|| format!("decoding the answer of {}", path.display()))?;
    Ok(Some(report))
}

/// Sends one request line to the server of `volume` and returns its answer (and the
/// socket's path). `Ok(None)` when no server answers; an `{"error": ...}` answer is an error.
pub fn request(volume: &Path, line: &str) -> anyhow::Result<Option<(String, PathBuf)>> {
    // A path that cannot be looked at is nobody's volume; opening it says why.
    let Ok(path) = socket_path(volume) else { return Ok(None) };
    let mut s = match std::os::unix::net::UnixStream::connect(&path) {
        Ok(s) => s,
        Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused) => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("connecting to the admin socket {}", path.display())),
    };
    let timeout = Some(crate::service::CLIENT_TIMEOUT * 2);
    s.set_read_timeout(timeout)?;
    s.set_write_timeout(timeout)?;
    s.write_all(format!("{line}\n").as_bytes()).with_context(|| format!("asking {}", path.display()))?;
    let mut answer = String::new();
    (&mut s)
        .take(ANSWER_BYTES_MAX)
        .read_to_string(&mut answer)
        .with_context(|| format!("reading {}", path.display()))?;
    if let Ok(serde_json::Value::Object(m)) = serde_json::from_str::<serde_json::Value>(&answer) {
        if let Some(e) = m.get("error") {
            match e.as_str() {
                Some(text) => anyhow::bail!("the server at {} answered: {text}", path.display()),
                None => anyhow::bail!("the server at {} answered: {e}", path.display()),
            }
        }
    }
    Ok(Some((answer, path)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtime_directory_must_be_private() {
        let t = tempfile::tempdir().expect("tempdir");
        let dir = t.path().join("run");
        prepare_runtime_dir(&dir).expect("created");
        let mode = std::fs::metadata(&dir).expect("stat").mode() & 0o777;
        assert_eq!(mode, 0o700);
        prepare_runtime_dir(&dir).expect("an existing private directory is fine");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let e = prepare_runtime_dir(&dir).expect_err("open to others");
        assert!(e.to_string().contains("closed to others"), "{e}");
        let file = t.path().join("file");
        std::fs::write(&file, b"x").expect("write");
        assert!(prepare_runtime_dir(&file).is_err(), "a file is not a directory");
    }

    #[test]
    fn every_spelling_of_a_volume_path_names_one_socket() {
        let t = tempfile::tempdir().expect("tempdir");
        let vol = t.path().join("vol.img");
        std::fs::write(&vol, b"x").expect("write");
        let link = t.path().join("link.img");
        std::os::unix::fs::symlink(&vol, &link).expect("symlink");
        let dotted = t.path().join(".").join("vol.img");
        let a = socket_path(&vol).expect("path");
        assert_eq!(a, socket_path(&link).expect("path"));
        assert_eq!(a, socket_path(&dotted).expect("path"));
        assert!(socket_path(&t.path().join("missing")).is_err());
    }
}
