//! `dedupvol bench --mode stripe`: what node-wide dedup over striped devices keeps and
//! what dedup per device loses, on the same stream of data in three configurations:
//!
//! - (a) one volume striped over N device files (the metadata, and so the dedup index,
//!   covers every device);
//! - (b) N independent single-device volumes, volume `i % N` receiving stripe-unit-sized
//!   piece `i` of the stream (what N nodes, or N devices each deduplicating alone, see);
//! - (c) one volume on one file.
//!
//! The stream is cut into pieces of one stripe unit (1 MiB), so (a) and (b) place the
//! same bytes on the same device. Each configuration writes every piece in order (one
//! writer; the engine's own threads compress and hash), flushes and closes; the time of
//! those calls is the MB/s (reading or generating the input is outside the clock). The
//! devices are sparse files in --dir, removed afterwards.

use anyhow::Context;
use dedupvol_core::{FormatOptions, IoMode, OpenOptions, Volume};
use dedupvol_workload::ContentModel;
use serde::Serialize;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Bytes per piece of the stream: one stripe unit.
const PIECE_BYTES: u64 = dedupvol_core::format::STRIPE_UNIT_BLOCKS * 4096;
/// Room each device gets beyond its share of the stream, for metadata (on the first).
const DEVICE_SLACK_BYTES: u64 = 256 << 20;

/// Where the stream comes from.
pub enum Source {
    /// Generated data of `bytes` bytes.
    Generated(Box<ContentModel>, u64, String),
    /// Files back to back, each from a 4 KiB-aligned offset of the stream.
    Files(Vec<PathBuf>),
}

/// The settings every volume of the run gets.
pub struct Settings {
    pub devices: usize,
    pub dir: PathBuf,
    pub compression: dedupvol_core::Compression,
    pub compression_level: i8,
    pub index_memory_bytes: u64,
    pub io_mode: IoMode,
}

/// One configuration's figures.
#[derive(Serialize)]
pub struct Row {
    pub config: String,
    pub logical_bytes: u64,
    pub physical_bytes: u64,
    pub ratio: f64,
    /// Written blocks shared with stored data (dedup hits), all volumes together.
    pub dedup_blocks: u64,
    /// Data bytes written to each device (one entry per device of the configuration).
    pub device_bytes: Vec<u64>,
    pub seconds: f64,
    pub mb_per_s: f64,
}

/// The whole report.
#[derive(Serialize)]
pub struct Report {
    pub data: String,
    pub stream_bytes: u64,
    pub piece_bytes: u64,
    pub rows: Vec<Row>,
    /// Physical bytes of (b) over (a), minus one: the reduction per-device dedup loses.
    pub per_device_extra_physical: f64,
}

impl Source {
    fn describe(&self) -> String {
        match self {
            Source::Generated(_, bytes, spec) => format!("generated {} MiB: {spec}", bytes >> 20),
            Source::Files(p) => p.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" + "),
        }
    }

    /// Bytes of the stream (each file padded to 4 KiB).
    fn len(&self) -> anyhow::Result<u64> {
        match self {
            Source::Generated(_, bytes, _) => Ok(*bytes),
            Source::Files(paths) => paths.iter().try_fold(0u64, |acc, p| {
                let m = std::fs::metadata(p).with_context(|| format!("reading {}", p.display()))?;
                Ok(acc + m.len().next_multiple_of(4096))
            }),
        }
    }

    /// Calls `f(piece_index, piece)` for each piece of the stream in order; the last one
    /// may be short (a multiple of 4 KiB).
    fn for_each_piece(&self, mut f: impl FnMut(u64, &[u8]) -> anyhow::Result<()>) -> anyhow::Result<()> {
        let mut buf = vec![0u8; PIECE_BYTES as usize];
        match self {
            Source::Generated(model, bytes, _) => {
                let mut done = 0u64;
                let mut i = 0;
                while done < *bytes {
                    let n = (*bytes - done).min(PIECE_BYTES) as usize;
                    let piece = buf.get_mut(..n).context("piece")?;
                    model.fill_range(done / 4096, piece);
                    f(i, piece)?;
                    done += n as u64;
                    i += 1;
                }
            }
            Source::Files(paths) => {
                let mut fill = 0usize;
                let mut i = 0;
                for p in paths {
                    let mut file = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
                    loop {
                        let room = buf.get_mut(fill..).context("piece")?;
                        let n = file.read(room).with_context(|| format!("reading {}", p.display()))?;
                        fill += n;
                        if fill == buf.len() {
                            f(i, &buf)?;
                            i += 1;
                            fill = 0;
                        }
                        if n == 0 {
                            break;
                        }
                    }
                    // The next file starts at a block boundary, zero-padded.
                    let aligned = fill.next_multiple_of(4096);
                    buf.get_mut(fill..aligned).context("padding")?.fill(0);
                    fill = aligned;
                    if fill == buf.len() {
                        f(i, &buf)?;
                        i += 1;
                        fill = 0;
                    }
                }
                if fill > 0 {
                    f(i, buf.get(..fill).context("last piece")?)?;
                }
            }
        }
        Ok(())
    }
}

/// Removes the device files when the run ends, however it ends.
struct Files(Vec<PathBuf>);
impl Drop for Files {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn format_opts(s: &Settings, logical: u64, index_memory: u64) -> FormatOptions {
    FormatOptions {
        logical_size_bytes: logical,
        compression: s.compression,
        compression_level: s.compression_level,
        index_memory_bytes: index_memory,
        ..FormatOptions::default()
    }
}

fn open(path: &Path, s: &Settings) -> anyhow::Result<Volume> {
    Volume::open_path(path, None, &OpenOptions { io_mode: s.io_mode, ..OpenOptions::default() })
        .with_context(|| format!("opening {}", path.display()))
}

/// Writes the stream into `vols` (piece `i` to volume `i % vols.len()`, at its next
/// piece offset), flushes and closes them; returns the rows' figures.
fn write_all(
    src: &Source,
    vols: Vec<Volume>,
    config: String,
    per_device: impl Fn(&[dedupvol_core::Stats]) -> Vec<u64>,
) -> anyhow::Result<Row> {
    let n = vols.len() as u64;
    let mut busy = Duration::ZERO;
    src.for_each_piece(|i, piece| {
        let vol = vols.get((i % n) as usize).context("volume")?;
        let t = Instant::now();
        vol.write((i / n) * PIECE_BYTES, piece, false).with_context(|| format!("{config}: writing piece {i}"))?;
        busy += t.elapsed();
        Ok(())
    })?;
    let t = Instant::now();
    for v in &vols {
        v.flush()?;
    }
    let stats: Vec<dedupvol_core::Stats> = vols.iter().map(|v| v.stats()).collect();
    for v in vols {
        v.close()?;
    }
    busy += t.elapsed();
    let logical: u64 = stats.iter().map(|s| s.logical_bytes_used).sum();
    let physical: u64 = stats.iter().map(|s| s.physical_data_bytes_used).sum();
    let seconds = busy.as_secs_f64();
    Ok(Row {
        config,
        logical_bytes: logical,
        physical_bytes: physical,
        ratio: if physical == 0 { 0.0 } else { logical as f64 / physical as f64 },
        dedup_blocks: stats.iter().map(|s| s.lifetime.dedup_hits).sum(),
        device_bytes: per_device(&stats),
        seconds,
        mb_per_s: if seconds > 0.0 { logical as f64 / 1e6 / seconds } else { 0.0 },
    })
}

/// Runs the three configurations.
pub fn run(src: &Source, s: &Settings) -> anyhow::Result<Report> {
    let n = s.devices as u64;
    let stream = src.len()?;
    let pieces = stream.div_ceil(PIECE_BYTES).max(1);
    let tag = format!("dedupvol-stripe-bench-{}", std::process::id());
    let path = |name: String| s.dir.join(format!("{tag}-{name}"));
    let mut rows = Vec::new();

    // (a) One volume striped over N files.
    let share = pieces.div_ceil(n) * PIECE_BYTES;
    let dev_bytes = share + share / 8 + DEVICE_SLACK_BYTES;
    let a: Vec<PathBuf> = (0..n).map(|i| path(format!("striped{i}"))).collect();
    let _cleanup_a = Files(a.clone());
    let (first, extra) = a.split_first().context("devices")?;
    Volume::format_path_striped(
        first,
        extra,
        Some(dev_bytes),
        None,
        &format_opts(s, pieces * PIECE_BYTES, s.index_memory_bytes),
        true,
    )
    .context("formatting the striped volume")?;
    eprintln!("  (a) one volume striped over {n} files …");
    rows.push(write_all(src, vec![open(first, s)?], format!("(a) 1 volume striped over {n} devices"), |st| {
        st.iter().flat_map(|x| x.data_devices.iter().map(|d| d.data_written_bytes)).collect()
    })?);
    drop(_cleanup_a);

    // (b) N volumes, every Nth piece each.
    let b: Vec<PathBuf> = (0..n).map(|i| path(format!("alone{i}"))).collect();
    let _cleanup_b = Files(b.clone());
    for p in &b {
        Volume::format_path(
            p,
            Some(dev_bytes),
            None,
            &format_opts(s, share, (s.index_memory_bytes / n).max(1 << 20)),
            true,
        )
        .with_context(|| format!("formatting {}", p.display()))?;
    }
    eprintln!("  (b) {n} volumes, every {n}th piece each …");
    let vols = b.iter().map(|p| open(p, s)).collect::<anyhow::Result<Vec<_>>>()?;
    rows.push(write_all(src, vols, format!("(b) {n} volumes, dedup per device"), |st| {
        st.iter().map(|x| x.lifetime.data_write_bytes).collect()
    })?);
    drop(_cleanup_b);

    // (c) One volume on one file.
    let c = path("single".into());
    let _cleanup_c = Files(vec![c.clone()]);
    let single_bytes = pieces * PIECE_BYTES + pieces * PIECE_BYTES / 8 + DEVICE_SLACK_BYTES;
    Volume::format_path(
        &c,
        Some(single_bytes),
        None,
        &format_opts(s, pieces * PIECE_BYTES, s.index_memory_bytes),
        true,
    )
    .context("formatting the single volume")?;
    eprintln!("  (c) one volume on one file …");
    rows.push(write_all(src, vec![open(&c, s)?], "(c) 1 volume on 1 device".into(), |st| {
        st.iter().map(|x| x.lifetime.data_write_bytes).collect()
    })?);

    let phys = |i: usize| rows.get(i).map_or(0, |r| r.physical_bytes) as f64;
    let extra = if phys(0) > 0.0 { phys(1) / phys(0) - 1.0 } else { 0.0 };
    Ok(Report {
        data: src.describe(),
        stream_bytes: stream,
        piece_bytes: PIECE_BYTES,
        rows,
        per_device_extra_physical: extra,
    })
}

/// The report as a table.
pub fn render(r: &Report) -> String {
    let mib = |b: u64| format!("{:.1}", b as f64 / (1 << 20) as f64);
    let mut out = format!(
        "data: {} ({} MiB, pieces of {} KiB)\n\n{:<38} {:>7} {:>11} {:>12} {:>12} {:>8}  per-device data written (MiB)\n",
        r.data,
        r.stream_bytes >> 20,
        r.piece_bytes >> 10,
        "configuration",
        "ratio",
        "logical MiB",
        "physical MiB",
        "dedup blocks",
        "MB/s"
    );
    for row in &r.rows {
        let spread = match (row.device_bytes.iter().min(), row.device_bytes.iter().max()) {
            (Some(&lo), Some(&hi)) if row.device_bytes.len() > 1 && lo > 0 => {
                format!("  (max/min {:.3})", hi as f64 / lo as f64)
            }
            _ => String::new(),
        };
        out.push_str(&format!(
            "{:<38} {:>7.2} {:>11} {:>12} {:>12} {:>8.1}  {}{spread}\n",
            row.config,
            row.ratio,
            mib(row.logical_bytes),
            mib(row.physical_bytes),
            row.dedup_blocks,
            row.mb_per_s,
            row.device_bytes.iter().map(|&b| mib(b)).collect::<Vec<_>>().join(" / ")
        ));
    }
    out.push_str(&format!(
        "\nper-device dedup stores {:.1}% more physical bytes than the striped volume's node-wide dedup\n",
        r.per_device_extra_physical * 100.0
    ));
    out
}
