//! `dedupvol scrub`: reads every referenced data block and metadata page of a volume from
//! its devices and checks them; `--repair` rewrites damaged blocks from a good copy. A
//! served volume is scrubbed by its server in the background (admin socket requests
//! `scrub`, `scrub-status`), throttled by `--rate`, while clients keep reading and
//! writing; this command follows it until it ends.
//!
//! Exit codes, as `check`'s: 0 clean; 1 damage found and all of it repaired; 4 damage
//! left; 8 the scrub could not run, or was cancelled before the end without finding
//! damage (`--cancel` from another shell).

use crate::volume_cmds::{human, OpenArgs};
use anyhow::Context;
use clap::Args;
use dedupvol_core::{OpenOptions, ScrubOptions, ScrubReport, ScrubStatus, Volume};
use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often a client polls a served scrub's progress.
const POLL_INTERVAL: Duration = Duration::from_millis(200);

const SCRUB_CLEAN: u8 = 0;
const SCRUB_REPAIRED: u8 = 1;
const SCRUB_DAMAGE_LEFT: u8 = 4;
const SCRUB_OPERATION_ERROR: u8 = 8;

#[derive(Args)]
pub struct ScrubArgs {
    #[command(flatten)]
    vol: OpenArgs,
    /// Rewrite damaged blocks from a good copy (the hot-chunk tier, the content cache);
    /// damage without one is reported and the block leaves deduplication.
    #[arg(long)]
    repair: bool,
    /// Bound on the scrub's reads, in MB/s (10^6 bytes; default: unthrottled).
    #[arg(long)]
    rate: Option<f64>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// Stop the scrub a server of the volume is running (it reports what it found so far).
    #[arg(long, conflicts_with_all = ["repair", "rate"])]
    cancel: bool,
}

/// A lock that a panicked holder does not poison for good (the guarded values stay
/// consistent: each is replaced whole).
trait LockNow<T> {
    fn lock_now(&self) -> MutexGuard<'_, T>;
}

impl<T> LockNow<T> for Mutex<T> {
    fn lock_now(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The background scrub of a server (at most one). Dropping it cancels and joins it.
#[derive(Default)]
pub struct Jobs {
    job: Mutex<Option<Job>>,
}

struct Job {
    cancel: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// The finished scrub's report, or why it failed.
    result: Arc<Mutex<Option<Result<ScrubReport, String>>>>,
}

impl Jobs {
    /// The admin socket's answer to `scrub …`, `scrub-status` and `scrub-cancel`.
    pub(crate) fn answer(&self, vol: &Arc<Volume>, request: &str) -> serde_json::Value {
        let mut words = request.split_whitespace();
        match words.next() {
            Some("scrub") => {}
            Some("scrub-status") => {
                let g = self.job.lock_now();
                let result = g.as_ref().and_then(|j| j.result.lock_now().clone());
                let (report, error) = match result {
                    Some(Ok(r)) => (Some(r), None),
                    Some(Err(e)) => (None, Some(e)),
                    None => (None, None),
                };
                return serde_json::json!({ "status": vol.scrub_status(), "report": report, "failed": error });
            }
            Some("scrub-cancel") => {
                if let Some(j) = self.job.lock_now().as_ref() {
                    j.cancel.store(true, Ordering::Relaxed);
                }
                return serde_json::json!({ "cancelled": true });
            }
            _ => return serde_json::json!({ "error": format!("unknown request {request:?}") }),
        }
        let mut opts = ScrubOptions::default();
        for w in words {
            match w.split_once('=') {
                None if w == "repair" => opts.repair = true,
                Some(("rate", v)) => match v.parse::<u64>() {
                    Ok(r) if r > 0 => opts.rate_bytes_per_sec = Some(r),
                    _ => return serde_json::json!({ "error": format!("scrub rate {v:?} is not a positive number") }),
                },
                _ => return serde_json::json!({ "error": format!("unknown scrub argument {w:?}") }),
            }
        }
        let mut g = self.job.lock_now();
        if g.as_ref().is_some_and(|j| j.thread.as_ref().is_some_and(|t| !t.is_finished())) {
            return serde_json::json!({ "error": "a scrub of this volume is already running" });
        }
        if let Some(mut old) = g.take() {
            old.join();
        }
        let cancel = Arc::new(AtomicBool::new(false));
        opts.cancel = Some(cancel.clone());
        let result = Arc::new(Mutex::new(None));
        let (v, out) = (vol.clone(), result.clone());
        let spawned = std::thread::Builder::new().name("scrub".into()).spawn(move || {
            let r = v.scrub(&opts).map_err(|e| e.to_string());
            *out.lock_now() = Some(r);
        });
        match spawned {
            Ok(t) => {
                *g = Some(Job { cancel, thread: Some(t), result });
                serde_json::json!({ "started": true })
            }
            Err(e) => serde_json::json!({ "error": format!("starting the scrub thread: {e}") }),
        }
    }
}

impl Job {
    fn join(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Jobs {
    fn drop(&mut self) {
        if let Some(j) = self.job.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner).as_mut() {
            j.join();
        }
    }
}

pub fn run(a: ScrubArgs) -> anyhow::Result<ExitCode> {
    if a.cancel {
        if crate::admin::request(&a.vol.path, "scrub-cancel")?.is_none() {
            anyhow::bail!("nobody serves {}: no scrub to cancel", a.vol.path.display());
        }
        outln!("asked the server of {} to stop its scrub", a.vol.path.display())?;
        return Ok(ExitCode::SUCCESS);
    }
    let rate = match a.rate {
        None => None,
        Some(r) if r.is_finite() && r > 0.0 => Some((r * 1e6) as u64),
        Some(_) => usage_bail!("--rate must be a positive number of MB/s"),
    };
    let result = match served(&a, rate) {
        Ok(Some(r)) => Ok(r),
        Ok(None) => local(&a, rate),
        Err(e) => Err(e),
    };
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            let _ = writeln_err(&format!("dedupvol: error: {}", crate::error_line(&e)));
            return Ok(ExitCode::from(SCRUB_OPERATION_ERROR));
        }
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        print(&a.vol.path, &report)?;
    }
    let s = &report.status;
    Ok(ExitCode::from(if s.error.is_some() {
        SCRUB_OPERATION_ERROR
    } else if !report.is_clean() {
        SCRUB_DAMAGE_LEFT
    } else if s.cancelled {
        SCRUB_OPERATION_ERROR
    } else if s.damaged > 0 {
        SCRUB_REPAIRED
    } else {
        SCRUB_CLEAN
    }))
}

fn writeln_err(line: &str) -> std::io::Result<()> {
    use std::io::Write;
    writeln!(std::io::stderr().lock(), "{line}")
}

/// Asks the server of the volume to scrub and follows it. `Ok(None)`: nobody serves it.
fn served(a: &ScrubArgs, rate: Option<u64>) -> anyhow::Result<Option<ScrubReport>> {
    let path = &a.vol.path;
    let mut line = String::from("scrub");
    if a.repair {
        line.push_str(" repair");
    }
    if let Some(r) = rate {
        line.push_str(&format!(" rate={r}"));
    }
    if crate::admin::request(path, &line)?.is_none() {
        return Ok(None);
    }
    let tty = std::io::stderr().is_terminal() && !a.json;
    loop {
        std::thread::sleep(POLL_INTERVAL);
        let Some((answer, sock)) = crate::admin::request(path, "scrub-status")? else {
            anyhow::bail!("the server of {} stopped during the scrub", path.display());
        };
        let v: serde_json::Value =
            serde_json::from_str(&answer).with_context(|| format!("decoding the answer of {}", sock.display()))?;
        if let Some(e) = v.get("failed").and_then(|e| e.as_str()) {
            anyhow::bail!("the server's scrub failed: {e}");
        }
        if let Some(r) = v.get("report").filter(|r| !r.is_null()) {
            if tty {
                let _ = writeln_err("");
            }
            return Ok(Some(serde_json::from_value(r.clone()).context("decoding the scrub report")?));
        }
        if tty {
            if let Some(s) = v.get("status").and_then(|s| serde_json::from_value::<ScrubStatus>(s.clone()).ok()) {
                use std::io::Write;
                let _ = write!(std::io::stderr().lock(), "\r{}", progress_line(&s));
            }
        }
    }
}

fn local(a: &ScrubArgs, rate: Option<u64>) -> anyhow::Result<ScrubReport> {
    // The scrub reads the device directly. A closed volume has no good copy to repair
    // from: its content cache starts empty, and a tier's entries are validated against
    // the data device at open (a damaged block's copy fails that), so none is opened.
    let opts = OpenOptions {
        read_only: !a.repair,
        io_mode: a.vol.io,
        index_memory_bytes: a.vol.index_memory,
        ..OpenOptions::default()
    };
    let vol = Volume::open_path(&a.vol.path, a.vol.meta_device.as_deref(), &opts)
        .with_context(|| format!("opening volume {}", a.vol.path.display()))?;
    let r = vol.scrub(&ScrubOptions { repair: a.repair, rate_bytes_per_sec: rate, cancel: None });
    let closed = vol.close();
    let r = r.with_context(|| format!("scrubbing {}", a.vol.path.display()))?;
    closed.with_context(|| format!("closing {}", a.vol.path.display()))?;
    Ok(r)
}

fn progress_line(s: &ScrubStatus) -> String {
    let pct = if s.logical_blocks_total == 0 {
        100.0
    } else {
        100.0 * s.logical_blocks_scanned as f64 / s.logical_blocks_total as f64
    };
    format!(
        "scrub {pct:5.1}%: {} blocks read ({}), {} damaged, {} repaired",
        s.blocks_read,
        human(s.bytes_read),
        s.damaged,
        s.repaired
    )
}

fn print(path: &Path, r: &ScrubReport) -> std::io::Result<()> {
    let s = &r.status;
    let rate = if s.seconds > 0.0 { s.bytes_read as f64 / s.seconds / 1e6 } else { 0.0 };
    outln!(
        "scrub of {}{}: {} data blocks and {} metadata pages read ({} in {:.2} s, {rate:.1} MB/s)",
        path.display(),
        if s.cancelled { " (cancelled)" } else { "" },
        s.blocks_read,
        s.metadata_pages_read,
        human(s.bytes_read),
        s.seconds
    )?;
    outln!(
        "damaged: {} ({} repaired), logical blocks lost: {}, metadata findings: {}",
        s.damaged,
        s.repaired,
        s.lost_blocks,
        s.metadata_damaged
    )?;
    for d in &r.damage {
        let lbas: Vec<String> = d.lbas.iter().map(u64::to_string).collect();
        outln!(
            "  physical block {}{}: {} (logical blocks {}){}",
            d.pbn,
            d.slot.map(|s| format!(" slot {s}")).unwrap_or_default(),
            if d.unreadable { "unreadable" } else { "checksum mismatch" },
            lbas.join(", "),
            d.repaired_from.as_ref().map(|f| format!(": repaired from the {f}")).unwrap_or_default()
        )?;
    }
    for l in &r.lost_ranges {
        outln!("  lost: bytes {}..{} ({})", l.offset, l.offset + l.len, human(l.len))?;
    }
    for m in &r.metadata {
        outln!("  metadata: {m}")?;
    }
    if let Some(e) = &s.error {
        outln!("  stopped by an error: {e}")?;
    }
    Ok(())
}
