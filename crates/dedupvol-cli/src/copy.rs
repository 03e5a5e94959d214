//! `import` and `export`: copying between a volume and a regular file, a block device, a
//! pipe or character device, or stdin / stdout (`-`).
//!
//! | other side                  | import reads                  | export writes                                       |
//! |-----------------------------|-------------------------------|-----------------------------------------------------|
//! | regular file                | positioned, several streams   | created or truncated, sized; zero chunks left holes |
//! | block device                | positioned, several streams   | positioned, every chunk (zeros too); never resized  |
//! | pipe, char device, `-`      | one stream, in order          | one stream, in order                                |
//!
//! Invariants:
//! - The other side is never one of the volume's own devices (data or metadata), however
//!   it is named (symlink, second device node, stdin/stdout redirected): compared by device
//!   and inode, or by the device a node names, before anything is truncated or written.
//! - An interrupted import (SIGINT/SIGTERM) has copied a prefix of its input: every chunk
//!   begun is finished, the volume is flushed and closed, and the message names the
//!   `--offset` / `--input-offset` that resume it.
//! - `export --skip-bad` loses only the blocks that cannot be read (located one by one), and
//!   lists them; without it, the error names the first bad block's logical offset.

use crate::interrupt;
use crate::volume_cmds::{human, open, progress, size, OpenArgs};
use anyhow::{bail, Context};
use clap::Args;
use dedupvol_core::{Error, IoMode, Volume, BLOCK_SIZE};
use std::fs::{File, Metadata};
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Bytes moved per request (a whole number of blocks).
const COPY_CHUNK_BYTES: usize = 1 << 20;
/// Copy streams for positioned sources and destinations.
const COPY_STREAMS_MAX: usize = 4;
/// How long a stream read waits before looking for a stop request again.
const POLL_INTERVAL_MS: i32 = 200;

#[derive(Args)]
pub struct ImportArgs {
    #[command(flatten)]
    vol: OpenArgs,
    /// File, block device or image to copy in; - reads stdin.
    file: PathBuf,
    /// Byte offset in the volume where the input (after --input-offset) starts (K/M/G/T).
    #[arg(long, value_parser = size, default_value = "0")]
    offset: u64,
    /// Bytes of the input to skip first; with --offset, resumes an interrupted import.
    #[arg(long, value_parser = size, default_value = "0")]
    input_offset: u64,
    #[command(flatten)]
    tier: crate::volume_cmds::TierArgs,
    /// After the copy, bring the whole volume to rest before closing: compress everything
    /// once more at the volume's rest level (see `format --rest-level`), as a served
    /// volume does by itself while idle. Ctrl-C stops it between passes; what is done stays.
    #[arg(long)]
    settle: bool,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
#[command(
    after_help = "With --io auto, export reads through the page cache: a whole-volume scan gains from the kernel's readahead."
)]
pub struct ExportArgs {
    #[command(flatten)]
    vol: OpenArgs,
    /// Destination: a file (created or truncated), a block device (at least the volume's
    /// logical size), a pipe or character device, or - for stdout.
    file: PathBuf,
    /// Write zeros for blocks that cannot be read (damaged), carry on, and list the lost
    /// logical byte ranges at the end (exit status 1 when any were lost).
    #[arg(long)]
    skip_bad: bool,
    /// Print the result as JSON (on stderr when the data goes to stdout).
    #[arg(long)]
    json: bool,
}

/// What identifies a file for "is it the volume itself": a device node names the device
/// (two nodes of one disk are the same target; block and character numbers are separate
/// spaces); anything else is its inode.
#[derive(PartialEq, Eq)]
enum Identity {
    Block(u64),
    Char(u64),
    Inode(u64, u64),
}

fn identity(m: &Metadata) -> Identity {
    let t = m.file_type();
    if t.is_block_device() {
        Identity::Block(m.rdev())
    } else if t.is_char_device() {
        Identity::Char(m.rdev())
    } else {
        Identity::Inode(m.dev(), m.ino())
    }
}

/// Refuses when `other` (named `name`) is the volume's data or metadata device; `what` says
/// what would happen ("imported from itself").
fn refuse_volume_itself(vol: &Volume, a: &OpenArgs, other: &Metadata, name: &str, what: &str) -> anyhow::Result<()> {
    let meta = match &a.meta_device {
        Some(m) => Some(m.clone()),
        None if vol.geometry().meta_dev_blocks > 0 => vol.meta_path().map(PathBuf::from),
        None => None,
    };
    let mine = identity(other);
    // A RADOS device is no local file: nothing local can be it.
    let local = |p: &PathBuf| dedupvol_core::RadosUrl::parse(p).is_none();
    for dev in std::iter::once(a.path.clone()).chain(meta).filter(local) {
        let m = std::fs::metadata(&dev).with_context(|| format!("stat {}", dev.display()))?;
        if identity(&m) == mine {
            bail!(
                "{name} is the volume's own {} ({}): the volume would be {what}",
                if dev == a.path { "device" } else { "metadata device" },
                dev.display()
            );
        }
    }
    Ok(())
}

/// How messages name a path given on the command line (`-` is a standard stream).
fn display_name(p: &Path, stream: &str) -> String {
    if p.as_os_str() == "-" {
        stream.to_string()
    } else {
        p.display().to_string()
    }
}

/// A duplicate of one of our standard streams as a plain `File` (unbuffered; closing it
/// leaves the original open).
fn stdio_file(fd: std::os::fd::BorrowedFd<'_>, what: &str) -> anyhow::Result<File> {
    Ok(File::from(fd.try_clone_to_owned().with_context(|| format!("duplicating {what}"))?))
}

// ----------------------------------------------------------------------------------------
// import
// ----------------------------------------------------------------------------------------

/// Where import reads from.
enum Source {
    /// Regular file or block device of `len` bytes: positioned reads.
    Positioned { file: File, len: u64 },
    /// Pipe, character device or stdin: read in order until end of file.
    Stream(File),
}

pub fn import(a: ImportArgs) -> anyhow::Result<ExitCode> {
    // Before the volume starts its threads, so they never take the signals.
    interrupt::watch()?;
    let name = display_name(&a.file, "stdin");
    let (source, src_meta) = if a.file.as_os_str() == "-" {
        let f = stdio_file(std::io::stdin().as_fd(), "stdin")?;
        let m = f.metadata().context("stat stdin")?;
        (Source::Stream(f), m)
    } else {
        let m = std::fs::metadata(&a.file).with_context(|| format!("opening {}", a.file.display()))?;
        if m.is_dir() {
            bail!("{} is a directory", a.file.display());
        }
        let file = File::open(&a.file).with_context(|| format!("opening {}", a.file.display()))?;
        let t = m.file_type();
        let source = if t.is_file() {
            Source::Positioned { len: m.len(), file }
        } else if t.is_block_device() {
            Source::Positioned { len: crate::probe::device_len(&file, &a.file)?, file }
        } else {
            Source::Stream(file)
        };
        (source, m)
    };
    let vol = Arc::new(crate::volume_cmds::open_with_tier(&a.vol, false, a.tier.options())?);
    let start = std::time::Instant::now();
    let copy = || -> anyhow::Result<u64> {
        refuse_volume_itself(&vol, &a.vol, &src_meta, &name, "imported from itself")?;
        Ok(match &source {
            Source::Positioned { file, len } => {
                if a.input_offset > *len {
                    bail!("--input-offset {} is past the end of {} ({len} bytes)", a.input_offset, name);
                }
                let n = len - a.input_offset;
                if a.offset.checked_add(n).is_none_or(|e| e > vol.logical_size()) {
                    bail!(
                        "{} ({n} bytes) at offset {} does not fit in the volume ({} bytes)",
                        name,
                        a.offset,
                        vol.logical_size()
                    );
                }
                let pb = progress(n, "import");
                let (base, skip) = (a.offset, a.input_offset);
                let done = for_each_chunk(
                    n,
                    || interrupt::signal().is_some(),
                    |off, buf| {
                        file.read_exact_at(buf, skip + off)
                            .with_context(|| format!("reading {} at {}", name, skip + off))?;
                        vol.write(base + off, buf, false)
                            .with_context(|| format!("writing at volume offset {}", base + off))?;
                        pb.inc(buf.len() as u64);
                        Ok(())
                    },
                )?;
                pb.finish_and_clear();
                done
            }
            Source::Stream(f) => import_stream(&vol, f, &a, &name)?,
        })
    };
    let copied = copy();
    // Even after an error: what was copied is flushed, and the volume closed cleanly (no
    // journal replay at the next open).
    let flushed = vol.flush().context("flushing");
    let secs = start.elapsed().as_secs_f64();
    let s = vol.stats();
    let settled = if a.settle && copied.is_ok() && flushed.is_ok() && interrupt::signal().is_none() {
        let t = std::time::Instant::now();
        let r = vol
            .settle(&dedupvol_core::RecompressOptions::default(), &|| interrupt::signal().is_some())
            .context("settling");
        Some(r.map(|r| (r, t.elapsed().as_secs_f64(), vol.stats())))
    } else {
        None
    };
    let closed = match Arc::try_unwrap(vol) {
        Ok(v) => v.close().context("closing"),
        Err(_) => Err(anyhow::anyhow!("volume still shared")),
    };
    let copied = copied?;
    flushed?;
    closed?;
    let settled = settled.transpose()?;
    // A stop during settling leaves the copy whole: only a stop during the copy is an
    // interrupted import.
    if let Some(sig) = interrupt::signal().filter(|_| settled.is_none()) {
        let (input_end, volume_end) = (a.input_offset + copied, a.offset + copied);
        eprintln!(
            "dedupvol: import interrupted by {}: copied {copied} bytes ({}): input bytes {}..{input_end} are in the volume at offsets {}..{volume_end}, flushed; the volume was closed cleanly",
            interrupt::name(sig),
            human(copied),
            a.input_offset,
            a.offset,
        );
        eprintln!(
            "dedupvol: to resume: dedupvol import {} {} --offset {volume_end} --input-offset {input_end}",
            a.vol.path.display(),
            a.file.display()
        );
        return Ok(ExitCode::from(u8::try_from(128 + sig).unwrap_or(1)));
    }
    if a.json {
        let j = serde_json::json!({
            "bytes": copied,
            "seconds": secs,
            "mb_per_s": copied as f64 / secs.max(1e-9) / 1e6,
            "logical_bytes_used": s.logical_bytes_used,
            "physical_data_bytes_used": s.physical_data_bytes_used,
            "reduction_ratio": s.reduction_ratio,
            "settled": settled.as_ref().map(|(r, secs, after)| serde_json::json!({
                "seconds": secs,
                "logical_bytes_recompressed": r.bytes_recompressed,
                "bytes_stored": r.bytes_after,
                "work_left": r.more,
                "physical_data_bytes_used": after.physical_data_bytes_used,
                "reduction_ratio": after.reduction_ratio,
            })),
        });
        outln!("{}", serde_json::to_string_pretty(&j)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "imported {} in {:.2}s ({:.1} MB/s); volume now {} logical in {} physical (ratio {})",
        human(copied),
        secs,
        copied as f64 / secs.max(1e-9) / 1e6,
        human(s.logical_bytes_used),
        human(s.physical_data_bytes_used),
        crate::ratio_text(s.reduction_ratio)
    )?;
    if let Some((r, secs, after)) = settled {
        outln!(
            "settled {} at rest level {} in {:.2}s ({:.1} MB/s){}: volume now {} physical (ratio {})",
            human(r.bytes_recompressed),
            after.rest_level,
            secs,
            r.bytes_recompressed as f64 / secs.max(1e-9) / 1e6,
            if r.more { ", stopped with work left" } else { "" },
            human(after.physical_data_bytes_used),
            crate::ratio_text(after.reduction_ratio)
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Copies a stream into the volume until its end (or a stop request); returns the bytes
/// copied after `--input-offset`.
fn import_stream(vol: &Volume, f: &File, a: &ImportArgs, name: &str) -> anyhow::Result<u64> {
    let mut buf = vec![0u8; COPY_CHUNK_BYTES];
    // Skip --input-offset bytes: a stream cannot seek.
    let mut skipped = 0u64;
    while skipped < a.input_offset {
        let want = (a.input_offset - skipped).min(COPY_CHUNK_BYTES as u64) as usize;
        match read_interruptible(f, &mut buf[..want]).with_context(|| format!("reading {}", name))? {
            None => return Ok(0),
            Some(0) => bail!("{} ended after {skipped} bytes, before --input-offset {}", name, a.input_offset),
            Some(n) => skipped += n as u64,
        }
    }
    let pb = progress(0, "import");
    let mut pos = a.offset;
    let mut eof = false;
    while !eof && interrupt::signal().is_none() {
        let mut n = 0;
        while n < buf.len() {
            match read_interruptible(f, &mut buf[n..]).with_context(|| format!("reading {}", name))? {
                // Stopping: what was read is still written below (a stream cannot be re-read).
                None => break,
                Some(0) => {
                    eof = true;
                    break;
                }
                Some(r) => n += r,
            }
        }
        if n == 0 {
            break;
        }
        if pos.checked_add(n as u64).is_none_or(|e| e > vol.logical_size()) {
            bail!(
                "{} is larger than the volume: it continues past the volume's end ({} bytes) after {} bytes were copied from --offset {}",
                name,
                vol.logical_size(),
                pos - a.offset,
                a.offset
            );
        }
        vol.write(pos, &buf[..n], false).with_context(|| format!("writing at volume offset {pos}"))?;
        pos += n as u64;
        pb.inc(n as u64);
    }
    pb.finish_and_clear();
    Ok(pos - a.offset)
}

/// One `read` from `f` that gives up (None) when a stop was requested while it waited.
fn read_interruptible(f: &File, buf: &mut [u8]) -> std::io::Result<Option<usize>> {
    use std::os::fd::AsRawFd;
    loop {
        if interrupt::signal().is_some() {
            return Ok(None);
        }
        let mut pfd = libc::pollfd { fd: f.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut pfd, 1, POLL_INTERVAL_MS) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            continue;
        }
        match (&*f).read(buf) {
            Ok(n) => return Ok(Some(n)),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

// ----------------------------------------------------------------------------------------
// export
// ----------------------------------------------------------------------------------------

/// Where export writes to.
enum Sink {
    /// A regular file, sized to the volume: zero chunks stay holes.
    File(File),
    /// A block device: every chunk is written (the device may hold old data).
    Device(File),
    /// Pipe, character device or stdout: written in order.
    Stream(File),
}

pub fn export(a: ExportArgs) -> anyhow::Result<ExitCode> {
    // A whole-volume scan: `auto` means buffered here, whatever the verification mode, so
    // the kernel's readahead serves the packed blocks; direct I/O reads each with its own
    // 4 KiB request (2 GiB of mixed-medium data, cold cache: 17.3 s direct, 1.7 s buffered).
    let io = if a.vol.io == IoMode::Auto { IoMode::Buffered } else { a.vol.io };
    let vol = open(
        &OpenArgs {
            path: a.vol.path.clone(),
            meta_device: a.vol.meta_device.clone(),
            io,
            index_memory: a.vol.index_memory,
        },
        true,
    )?;
    let size = vol.logical_size();
    let to_stdout = a.file.as_os_str() == "-";
    let out_name = display_name(&a.file, "stdout");
    let sink = if to_stdout {
        let f = stdio_file(std::io::stdout().as_fd(), "stdout")?;
        refuse_volume_itself(&vol, &a.vol, &f.metadata().context("stat stdout")?, &out_name, "exported into itself")?;
        Sink::Stream(f)
    } else {
        match std::fs::metadata(&a.file) {
            Ok(m) if m.is_dir() => bail!("{} is a directory", a.file.display()),
            Ok(m) => {
                // Checked before anything is opened for writing: creating the file would
                // truncate the volume itself.
                refuse_volume_itself(&vol, &a.vol, &m, &out_name, "exported into itself")?;
                let t = m.file_type();
                if t.is_file() {
                    Sink::File(File::create(&a.file).with_context(|| format!("creating {}", a.file.display()))?)
                } else {
                    // Never created, truncated or resized: a device or pipe is what it is.
                    let f = std::fs::OpenOptions::new()
                        .write(true)
                        .open(&a.file)
                        .with_context(|| format!("opening {}", a.file.display()))?;
                    if t.is_block_device() {
                        let have = crate::probe::device_len(&f, &a.file)?;
                        if have < size {
                            bail!(
                                "{} holds {have} bytes, less than the volume's logical size {size}",
                                a.file.display()
                            );
                        }
                        Sink::Device(f)
                    } else {
                        Sink::Stream(f)
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Sink::File(File::create(&a.file).with_context(|| format!("creating {}", a.file.display()))?)
            }
            Err(e) => return Err(e).with_context(|| format!("opening {}", a.file.display())),
        }
    };
    let pb = progress(size, "export");
    let lost = Mutex::new(Vec::<u64>::new());
    let read = |pos: u64, buf: &mut [u8]| read_chunk(&vol, pos, buf, a.skip_bad, &lost);
    let never = || false;
    let written = |what: &str| format!("writing {what}");
    match &sink {
        Sink::File(out) | Sink::Device(out) => {
            // A regular file is sized first and stays sparse where the volume reads as
            // zeros; a device is never resized, and its old content must be overwritten.
            let sparse = matches!(sink, Sink::File(_));
            if sparse {
                out.set_len(size).context("sizing the output")?;
            }
            for_each_chunk(size, never, |pos, buf| {
                read(pos, buf)?;
                if !sparse || buf.iter().any(|&b| b != 0) {
                    out.write_all_at(buf, pos).with_context(|| written(&out_name))?;
                }
                pb.inc(buf.len() as u64);
                Ok(())
            })?;
            out.sync_all().with_context(|| format!("syncing {}", a.file.display()))?;
        }
        Sink::Stream(out) => {
            let mut buf = vec![0u8; COPY_CHUNK_BYTES];
            let mut pos = 0;
            while pos < size {
                let n = (size - pos).min(COPY_CHUNK_BYTES as u64) as usize;
                read(pos, &mut buf[..n])?;
                (&*out).write_all(&buf[..n]).with_context(|| written(&out_name))?;
                pos += n as u64;
                pb.inc(n as u64);
            }
        }
    }
    pb.finish_and_clear();
    let mut lost = lost.into_inner().unwrap_or_else(|e| e.into_inner());
    lost.sort_unstable();
    if a.json {
        let ranges: Vec<serde_json::Value> = merge_runs(&lost)
            .into_iter()
            .map(|(first, count)| {
                serde_json::json!({"offset": first * BLOCK_SIZE as u64, "len": count * BLOCK_SIZE as u64})
            })
            .collect();
        let j = serde_json::json!({
            "bytes": size,
            "destination": out_name,
            "lost_blocks": lost.len(),
            "lost_ranges": ranges,
        });
        let text = serde_json::to_string_pretty(&j)?;
        // The data itself may be on stdout.
        if to_stdout {
            eprintln!("{text}");
        } else {
            outln!("{text}")?;
        }
        return Ok(if lost.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) });
    }
    let summary = format!("exported {} to {out_name}", human(size));
    // The data itself may be on stdout.
    if to_stdout {
        eprintln!("{summary}");
    } else {
        outln!("{summary}")?;
    }
    if lost.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    let ranges = merge_runs(&lost);
    eprintln!(
        "dedupvol: export: {} unreadable blocks ({}) were written as zeros; lost logical byte ranges:",
        lost.len(),
        human(lost.len() as u64 * BLOCK_SIZE as u64)
    );
    for (first, count) in ranges {
        eprintln!("  lost: offset {} length {}", first * BLOCK_SIZE as u64, count * BLOCK_SIZE as u64);
    }
    Ok(ExitCode::from(1))
}

/// True for read errors that mean "this block's data cannot be had" (not a usage error).
fn unreadable(e: &Error) -> bool {
    matches!(e, Error::Corruption(_) | Error::Io { .. })
}

/// Reads `buf` at `pos`. When the chunk fails, reads it block by block to find the bad
/// blocks: the error then names the right logical offset, and with `skip_bad` only those
/// blocks become zeros (their numbers are added to `lost`).
fn read_chunk(vol: &Volume, pos: u64, buf: &mut [u8], skip_bad: bool, lost: &Mutex<Vec<u64>>) -> anyhow::Result<()> {
    match vol.read(pos, buf) {
        Ok(()) => return Ok(()),
        Err(e) if !unreadable(&e) => {
            return Err(anyhow::Error::new(e).context(format!("reading the volume at offset {pos}")));
        }
        Err(_) => {}
    }
    let mut off = pos;
    for block in buf.chunks_mut(BLOCK_SIZE) {
        if let Err(e) = vol.read(off, block) {
            if !skip_bad || !unreadable(&e) {
                let hint = if unreadable(&e) {
                    " (export --skip-bad writes zeros for unreadable blocks and carries on)"
                } else {
                    ""
                };
                bail!("reading the volume at offset {off} (logical block {}): {e}{hint}", off / BLOCK_SIZE as u64);
            }
            block.fill(0);
            lost.lock().unwrap_or_else(|e| e.into_inner()).push(off / BLOCK_SIZE as u64);
        }
        off += block.len() as u64;
    }
    Ok(())
}

/// Sorted block numbers as (first, count) runs.
fn merge_runs(sorted: &[u64]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &b in sorted {
        match runs.last_mut() {
            Some((first, count)) if *first + *count == b => *count += 1,
            _ => runs.push((b, 1)),
        }
    }
    runs
}

/// Calls `f(offset, buffer)` for every `COPY_CHUNK_BYTES` chunk of `[0, len)` (the last may
/// be shorter) from several threads, until done, `stop()` says so, or an error (returned).
/// Returns the bytes done: since no chunk is begun after a stop and every chunk begun is
/// finished, they are the prefix `[0, returned)`.
fn for_each_chunk(
    len: u64,
    stop: impl Fn() -> bool + Sync,
    f: impl Fn(u64, &mut [u8]) -> anyhow::Result<()> + Sync,
) -> anyhow::Result<u64> {
    let streams = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, COPY_STREAMS_MAX);
    let next = AtomicU64::new(0);
    let failed = AtomicBool::new(false);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..streams)
            .map(|_| {
                s.spawn(|| -> anyhow::Result<()> {
                    let mut buf = vec![0u8; COPY_CHUNK_BYTES];
                    while !failed.load(Ordering::Relaxed) && !stop() {
                        let off = next.fetch_add(COPY_CHUNK_BYTES as u64, Ordering::Relaxed);
                        if off >= len {
                            break;
                        }
                        let n = (len - off).min(COPY_CHUNK_BYTES as u64) as usize;
                        if let Err(e) = f(off, &mut buf[..n]) {
                            failed.store(true, Ordering::Relaxed);
                            return Err(e);
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| w.join().map_err(|_| anyhow::anyhow!("copy thread panicked"))?)
    })?;
    Ok(next.load(Ordering::Relaxed).min(len))
}

#[cfg(test)]
mod tests {
    #[test]
    fn runs_merge_adjacent_blocks_only() {
        assert_eq!(super::merge_runs(&[1, 2, 3, 7, 9, 10]), vec![(1, 3), (7, 1), (9, 2)]);
        assert!(super::merge_runs(&[]).is_empty());
    }
}
