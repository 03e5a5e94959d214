//! Volume commands: format, info, import, export, stats, check.

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use dedupvol_core::{
    parse_size, DedupVerify, FormatOptions, IoMode, OpenOptions, TierOptions, TierStats, Volume, WritePolicy,
    BLOCK_SIZE, TIER_FILL_PERCENT_DEFAULT, TIER_PROMOTE_REFCOUNT_DEFAULT,
};
use indicatif::{ProgressBar, ProgressStyle};
use std::fs::File;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Subcommand)]
pub enum VolumeCommand {
    /// Format a file or block device as a new volume.
    Format(FormatArgs),
    /// Show a volume's geometry and settings.
    Info(InfoArgs),
    /// Copy a file, block device or stdin (-) into the volume.
    Import(crate::copy::ImportArgs),
    /// Copy the volume's logical contents out to a file, block device, pipe or stdout (-).
    Export(crate::copy::ExportArgs),
    /// Show space, savings, and counters kept over the volume's life; on a served volume,
    /// the running server's live figures (--watch redraws them).
    Stats(crate::stats_cmd::StatsArgs),
    /// Audit a closed volume: reference counts, leaks, double use, checksums.
    Check(CheckArgs),
    /// Grow a volume's logical size (also while served) or its data device (closed), or
    /// shrink its logical size when nothing mapped is lost.
    Grow(crate::grow_cmd::GrowArgs),
    /// Change a setting of an existing volume (also while served): its rest level, its extent cap.
    Tune(crate::tune_cmd::TuneArgs),
    /// Read every stored block and metadata page and verify its checksum (a served volume
    /// is scrubbed by its server, throttled, while it serves); --repair rewrites damaged
    /// blocks from a good copy.
    Scrub(crate::scrub_cmd::ScrubArgs),
}

/// `info`'s arguments.
#[derive(Args)]
pub struct InfoArgs {
    #[command(flatten)]
    vol: OpenArgs,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct FormatArgs {
    /// File or block device.
    path: PathBuf,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
    /// Client-visible size (K/M/G/T suffixes); may exceed the physical size (thin provisioning).
    #[arg(long, value_parser = size)]
    logical_size: u64,
    /// Create or extend the file to this size (each data device's, when there are several).
    #[arg(long, value_parser = size)]
    physical_size: Option<u64>,
    /// Stripe the data region over this device too (repeat for more; at most 8 data
    /// devices with PATH). A file or block device, under the same size rules as PATH; the
    /// volume records its path and a header on it, and finds it again by itself.
    /// Duplicates are found across every device: the metadata stays on PATH (or
    /// --meta-device).
    #[arg(long = "data-device", value_name = "DEVICE")]
    data_device: Vec<PathBuf>,
    /// Put the journal, block map and reference counts on this (fast) device: a file, a
    /// block device or rados://POOL/NAME.
    #[arg(long)]
    meta_device: Option<PathBuf>,
    /// Create the metadata device with this size when it does not exist yet (a file, or a
    /// device in RADOS).
    #[arg(long, value_parser = size, requires = "meta_device")]
    meta_size: Option<u64>,
    /// Compressor: zstd (level 1), zstd:LEVEL (-7..=19; higher is smaller and slower),
    /// lz4 (the fast option) or none.
    #[arg(long, default_value = "zstd")]
    compression: String,
    /// zstd level data at rest is compressed to while the volume is idle (no client I/O
    /// for a second): writes compress fast, and the idle volume compresses them once more,
    /// harder, in the background (decoding is as fast at any level). 1..=19, or off.
    /// Default: 6 for zstd volumes, off for the others.
    #[arg(long)]
    rest_level: Option<String>,
    /// Largest extent: a run of blocks written together (a large request) is compressed
    /// as units of up to this size (4K..64K, a multiple of 4K; 4K compresses every block
    /// alone). Larger units compress better; a random 4 KiB read of one decodes the unit
    /// up to the block it wants, so smaller units read faster. Changeable later with
    /// `tune`. Default: 16K for zstd volumes with a rest level (data at rest is then
    /// compressed with a dictionary trained from the volume's own data, and 16 KiB units
    /// store nearly what 64 KiB ones do), 64K for the others.
    #[arg(long, value_parser = extent_size)]
    extent_max: Option<u8>,
    /// Deduplicate: on or off.
    #[arg(long, default_value = "on")]
    dedup: String,
    /// Upper bound on the in-memory fingerprint index (5 bytes per indexed block in dense
    /// mode, per 16 blocks in sparse mode, at 90% load). Without --dedup-window it also
    /// sets the window: as much data as this memory indexes, at most the data device.
    #[arg(long, value_parser = size, default_value = "64M")]
    index_memory: u64,
    /// Data the fingerprint index covers (K/M/G/T): its records live in a ring of chapters
    /// on the metadata device (about 1% of the window), the oldest dropped as it wraps.
    #[arg(long, value_parser = size)]
    dedup_window: Option<u64>,
    /// In-memory index: dense (every fingerprint) or sparse (1 in 16, as hooks that load
    /// their chapter; a 16x larger window per byte of memory).
    #[arg(long, default_value = "dense")]
    index: String,
    /// sync: durable before acknowledgement; async: durable at flush/FUA.
    #[arg(long, default_value = "async")]
    write_policy: String,
    /// Data slab size (power of two, 1M..32G).
    #[arg(long, value_parser = size, default_value = "32M")]
    slab_size: u64,
    /// Duplicate verification: hash (trust BLAKE3-256, default) or bytes (read and compare
    /// the candidate).
    #[arg(long, default_value = "hash")]
    verify: String,
    /// Journal size (default: 1/64 of the device, 256K..32M).
    #[arg(long, value_parser = size)]
    journal_size: Option<u64>,
    /// Logical size the block map gets room for, so the volume can grow to it while served
    /// (default: twice --logical-size, within about 1/64 of the metadata area).
    #[arg(long, value_parser = size)]
    max_logical_size: Option<u64>,
    /// Data device size the reference counts get room for (default: four times the data
    /// device, within the same room).
    #[arg(long, value_parser = size)]
    max_physical_size: Option<u64>,
    /// Overwrite an existing volume.
    #[arg(long)]
    force: bool,
}

#[derive(Args)]
pub struct OpenArgs {
    /// The volume's data file or device.
    pub(crate) path: PathBuf,
    /// Metadata device (default: the path recorded at format).
    #[arg(long)]
    pub(crate) meta_device: Option<PathBuf>,
    /// Device I/O: auto (direct for hash verification, buffered for bytes), direct
    /// (O_DIRECT where supported), buffered (page cache) or read-cached (writes direct, data
    /// reads through the page cache).
    #[arg(long, default_value = "auto")]
    pub(crate) io: IoMode,
    /// Memory for the fingerprint index in this session (default: the size chosen at
    /// format); a smaller one opens the volume on a machine with less memory.
    #[arg(long, value_parser = size)]
    pub(crate) index_memory: Option<u64>,
}

/// The hot-chunk tier of a read-write session (`serve`, `import`).
#[derive(Args, Clone)]
pub struct TierArgs {
    /// A fast device or file holding copies of hot blocks (shared by many references, or
    /// read again and again), read instead of the data device. A cache: a tier that
    /// cannot be used only costs speed (a warning says why).
    #[arg(long)]
    pub(crate) tier_device: Option<PathBuf>,
    /// Bytes of the tier device to use (K/M/G/T); required to create a tier file that
    /// does not exist yet (default: the whole device or file).
    #[arg(long, value_parser = size, requires = "tier_device")]
    pub(crate) tier_size: Option<u64>,
    /// Reference count at which a compressed (packed) block is copied to the tier; an
    /// uncompressed block is copied at twice it.
    #[arg(long, default_value_t = TIER_PROMOTE_REFCOUNT_DEFAULT, requires = "tier_device")]
    pub(crate) tier_promote_refs: u32,
    /// While less than this percent of the tier is in use, newly written blocks are
    /// copied to it too (first reads of fresh data then skip the data device); 0: only
    /// hot blocks are copied.
    #[arg(long, default_value_t = TIER_FILL_PERCENT_DEFAULT, value_parser = clap::value_parser!(u8).range(0..=100), requires = "tier_device")]
    pub(crate) tier_fill_percent: u8,
}

impl TierArgs {
    /// The tier's open options (None without --tier-device).
    pub(crate) fn options(&self) -> Option<TierOptions> {
        self.tier_device.as_ref().map(|p| {
            let mut t = TierOptions::path(p);
            t.size_bytes = self.tier_size;
            t.promote_refcount = self.tier_promote_refs;
            t.fill_percent = self.tier_fill_percent;
            t
        })
    }
}

/// Prints what opening the tier noticed (why it is not used, or was re-initialised).
pub(crate) fn warn_tier_notes(v: &Volume) {
    for n in v.tier_notes() {
        // Not eprintln!: a closed stderr must not stop the command.
        let _ = writeln!(std::io::stderr(), "dedupvol: warning: {n}");
    }
}

/// One line of tier figures, for a session's summary.
pub(crate) fn tier_summary(t: &TierStats) -> String {
    format!(
        "hot-chunk tier: {} of {} slots in use, {} hits / {} misses ({:.1}% of data block reads), \
         {} + {} promotions (references + re-reads), {} fills, {} dropped, {} demoted, {} written, \
         {} validation failures, {} slot crc failures, {} device errors{}",
        t.entries,
        t.capacity_slots,
        t.hits,
        t.misses,
        100.0 * t.hit_share,
        t.promotions_write,
        t.promotions_read,
        t.fills,
        t.promotions_dropped,
        t.demotions,
        human(t.slot_bytes_written),
        t.validation_failures,
        t.slot_crc_failures,
        t.device_errors,
        if t.disabled { " (disabled after device errors)" } else { "" }
    )
}

#[derive(Args)]
pub struct CheckArgs {
    #[command(flatten)]
    vol: OpenArgs,
    /// Fix what can be recomputed (reference counts, counters, superblock copies) and take
    /// damaged blocks out of deduplication.
    #[arg(long)]
    repair: bool,
    /// With --repair: unmap logical blocks whose data is lost (they then read as zeros) and
    /// list their ranges. Without it, lost blocks keep reading as I/O errors.
    #[arg(long, requires = "repair")]
    unmap_lost: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// `check` exit codes, as fsck's.
const CHECK_CLEAN: u8 = 0;
const CHECK_REPAIRED: u8 = 1;
const CHECK_PROBLEMS_LEFT: u8 = 4;
const CHECK_OPERATION_ERROR: u8 = 8;

pub(crate) fn size(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

fn on_off(s: &str) -> anyhow::Result<bool> {
    match s {
        "on" | "true" | "yes" => Ok(true),
        "off" | "false" | "no" => Ok(false),
        _ => usage_bail!("--dedup must be on or off, not {s:?}"),
    }
}

pub(crate) fn open(a: &OpenArgs, read_only: bool) -> anyhow::Result<Volume> {
    open_with_tier(a, read_only, None)
}

/// `open` with a hot-chunk tier (warnings about it go to stderr).
pub(crate) fn open_with_tier(a: &OpenArgs, read_only: bool, tier: Option<TierOptions>) -> anyhow::Result<Volume> {
    let opts =
        OpenOptions { read_only, io_mode: a.io, index_memory_bytes: a.index_memory, tier, ..OpenOptions::default() };
    let v = Volume::open_path(&a.path, a.meta_device.as_deref(), &opts);
    if let Ok(v) = &v {
        warn_tier_notes(v);
    }
    v.with_context(|| format!("opening volume {}", a.path.display()))
}

/// Write-once journaling in a few lines: the journal ranges found and what sharing did.
pub(crate) fn woj_summary(w: &dedupvol_core::WojStats) -> Vec<String> {
    let mut out = Vec::new();
    if w.ranges.is_empty() {
        out.push(format!("woj ({}): no file-system journal found", w.mode));
    }
    for r in &w.ranges {
        out.push(format!("woj ({}): journal at bytes {}..{} ({})", w.mode, r.offset, r.offset + r.len, human(r.len)));
    }
    for n in &w.notes {
        out.push(format!("woj: {n}"));
    }
    out.push(format!(
        "woj: pool {} entries of {} journal blocks ({}), {} inserted, {} jbd2 blocks skipped, {} invalidated",
        w.pool_entries,
        w.journal_blocks,
        human(w.pool_bytes),
        w.inserts,
        w.journal_meta_blocks,
        w.invalidations
    ));
    out.push(format!(
        "woj: {} checkpoint writes shared ({} confirmed in memory, {} by a read), {} collisions, {} stale, {} not written",
        w.hits,
        w.confirmed_in_memory,
        w.confirmed_by_read,
        w.collisions,
        w.stale,
        human(w.bytes_not_written)
    ));
    out
}

pub(crate) fn human(b: u64) -> String {
    const U: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", U[i])
    }
}

pub(crate) fn progress(total: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_message(what.to_string());
    pb
}

impl VolumeCommand {
    pub fn run(self) -> anyhow::Result<ExitCode> {
        match self {
            VolumeCommand::Format(a) => format(a),
            VolumeCommand::Info(a) => info(a),
            VolumeCommand::Import(a) => crate::copy::import(a),
            VolumeCommand::Export(a) => crate::copy::export(a),
            VolumeCommand::Stats(a) => crate::stats_cmd::run(a),
            VolumeCommand::Check(a) => check(a),
            VolumeCommand::Grow(a) => crate::grow_cmd::run(a),
            VolumeCommand::Scrub(a) => crate::scrub_cmd::run(a),
            VolumeCommand::Tune(a) => crate::tune_cmd::run(a),
        }
    }
}

/// `--extent-max`: a size of 4 KiB to 64 KiB in whole 4 KiB blocks, as blocks.
pub(crate) fn extent_size(s: &str) -> Result<u8, String> {
    let bytes = size(s)?;
    let max = u64::from(dedupvol_core::format::UNIT_BLOCKS_MAX);
    if bytes == 0 || !bytes.is_multiple_of(4096) || bytes / 4096 > max {
        return Err(format!("{s}: an extent size from 4K to {}K in steps of 4K", max * 4));
    }
    u8::try_from(bytes / 4096).map_err(|e| e.to_string())
}

/// `--rest-level`: a zstd level, or off (0).
pub(crate) fn parse_rest_level(s: &str) -> anyhow::Result<i8> {
    if s == "off" {
        return Ok(0);
    }
    s.parse::<i8>().map_err(|_| crate::usage(format!("--rest-level {s}: a zstd level (1..=19) or off")))
}

fn format(a: FormatArgs) -> anyhow::Result<ExitCode> {
    let (compression, compression_level) = dedupvol_core::parse_compression(&a.compression).map_err(crate::usage)?;
    let opts = FormatOptions {
        logical_size_bytes: a.logical_size,
        compression,
        compression_level,
        rest_level: a.rest_level.as_deref().map(parse_rest_level).transpose()?,
        dedup: on_off(&a.dedup)?,
        index_memory_bytes: a.index_memory,
        dedup_window_bytes: a.dedup_window,
        index_mode: a.index.parse::<dedupvol_core::IndexMode>().map_err(crate::usage)?,
        write_policy: a.write_policy.parse::<WritePolicy>().map_err(crate::usage)?,
        slab_size_bytes: a.slab_size,
        verify: a.verify.parse::<DedupVerify>().map_err(crate::usage)?,
        journal_size_bytes: a.journal_size,
        max_logical_size_bytes: a.max_logical_size,
        max_physical_size_bytes: a.max_physical_size,
        extent_blocks_max: a.extent_max,
    };
    // Values wrong whatever the target: usage errors (exit 2), before the target is touched.
    opts.validate().map_err(crate::usage)?;
    if a.physical_size == Some(0) {
        usage_bail!("--physical-size must be larger than zero");
    }
    let in_rados = dedupvol_core::RadosUrl::parse(&a.path).is_some();
    let before = match std::fs::metadata(&a.path) {
        // A RADOS device is created, or its size checked, by the engine.
        _ if in_rados => None,
        Ok(m) if m.is_dir() => bail!("{} is a directory", a.path.display()),
        Ok(m) => Some(m),
        Err(_) if a.physical_size.is_none() => {
            bail!("{} does not exist: pass --physical-size to create it", a.path.display())
        }
        Err(_) => None,
    };
    if let (Some(m), Some(want)) = (&before, a.physical_size) {
        use std::os::unix::fs::FileTypeExt;
        if m.file_type().is_block_device() {
            let dev = File::open(&a.path).with_context(|| format!("opening {}", a.path.display()))?;
            let have = crate::probe::device_len(&dev, &a.path)?;
            if have != want {
                bail!(
                    "{} is a block device of {} bytes; --physical-size {want} cannot change it (leave the option out)",
                    a.path.display(),
                    have
                );
            }
        }
    }
    let mut created_extra = Vec::new();
    for d in &a.data_device {
        match std::fs::metadata(d) {
            Ok(m) if m.is_dir() => bail!("data device {} is a directory", d.display()),
            Ok(_) => {}
            Err(_) if a.physical_size.is_none() => {
                bail!("data device {} does not exist: pass --physical-size to create it", d.display())
            }
            Err(_) => created_extra.push(d.clone()),
        }
    }
    if !a.force {
        for target in std::iter::once(&a.path).chain(a.meta_device.as_ref()).chain(&a.data_device) {
            if let Some(what) = crate::probe::foreign_content(target)? {
                bail!("{} {what}; formatting would destroy it (pass --force to overwrite)", target.display());
            }
        }
    }
    if let (Some(m), Some(bytes)) = (&a.meta_device, a.meta_size) {
        // Created (or found with this size) and closed again: format opens it as it is.
        dedupvol_core::create_device(m, Some(bytes))
            .with_context(|| format!("creating the metadata device {}", m.display()))?;
    }
    let formatted =
        Volume::format_path_striped(&a.path, &a.data_device, a.physical_size, a.meta_device.as_deref(), &opts, a.force)
            .with_context(|| format!("formatting {}", a.path.display()));
    if let Err(e) = formatted {
        for d in &created_extra {
            let _ = std::fs::remove_file(d);
        }
        // Leave the target as it was: a file we created goes, a file we grew shrinks back.
        match &before {
            None => {
                let _ = std::fs::remove_file(&a.path);
            }
            Some(m) if m.is_file() => {
                if let Ok(f) = std::fs::OpenOptions::new().write(true).open(&a.path) {
                    if f.metadata().map(|n| n.len() > m.len()).unwrap_or(false) {
                        let _ = f.set_len(m.len());
                    }
                }
            }
            Some(_) => {}
        }
        return Err(e);
    }
    let vol = open(
        &OpenArgs { path: a.path.clone(), meta_device: a.meta_device.clone(), io: IoMode::Auto, index_memory: None },
        true,
    )?;
    let s = vol.stats();
    if a.json {
        let j = serde_json::json!({
            "path": a.path,
            "uuid": s.uuid,
            "logical_size_bytes": s.logical_size_bytes,
            "data_blocks": s.data_blocks_total,
            "data_bytes": s.data_blocks_total * BLOCK_SIZE as u64,
            "metadata_bytes": s.metadata_bytes,
            "separate_metadata_device": s.separate_metadata_device,
            "data_devices": s.data_devices.iter().map(|d| &d.name).collect::<Vec<_>>(),
        });
        outln!("{}", serde_json::to_string_pretty(&j)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "formatted {}: logical {} on {} of data blocks ({}), metadata {}{}, uuid {}",
        a.path.display(),
        human(s.logical_size_bytes),
        human(s.data_blocks_total * BLOCK_SIZE as u64),
        s.data_blocks_total,
        human(s.metadata_bytes),
        if s.separate_metadata_device { " on the metadata device" } else { "" },
        s.uuid
    )?;
    Ok(ExitCode::SUCCESS)
}

fn info(args: InfoArgs) -> anyhow::Result<ExitCode> {
    let a = &args.vol;
    // Read-only journal discovery too: `info` says where a file system's journal is.
    let opts = OpenOptions {
        read_only: true,
        io_mode: a.io,
        index_memory_bytes: a.index_memory,
        woj: dedupvol_core::WojMode::Auto,
        ..OpenOptions::default()
    };
    let vol = Volume::open_path(&a.path, a.meta_device.as_deref(), &opts)
        .with_context(|| format!("opening volume {}", a.path.display()))?;
    let g = vol.geometry();
    let s = vol.stats();
    if args.json {
        let mem = vol.memory_usage();
        let j = serde_json::json!({
            "path": a.path,
            "uuid": s.uuid,
            "logical_size_bytes": s.logical_size_bytes,
            "logical_blocks": g.logical_blocks,
            "data_blocks": g.data_blocks,
            "slab_blocks": g.slab_blocks,
            "slabs": g.slab_count(),
            "metadata_bytes": s.metadata_bytes,
            "separate_metadata_device": s.separate_metadata_device,
            "data_devices": s.data_devices,
            "journal_blocks": g.journal_blocks,
            "block_map_pages": g.block_map_pages,
            "refcount_pages": g.refcount_pages,
            "compression": s.compression,
            "compression_level": s.compression_level,
            "rest_level": s.rest_level,
            "extent_blocks_max": s.extent_blocks_max,
            "dictionary_id": s.dictionary.map(|d| d.0),
            "dictionary_bytes": s.dictionary.map(|d| d.1),
            "dedup": s.dedup,
            "verify": s.verify,
            "direct_io": vol.direct_io(),
            "write_policy": s.write_policy,
            "index": s.index,
            "index_capacity": s.index_capacity,
            "index_bytes_per_entry": s.index_bytes_per_entry,
            "index_memory_bytes": s.index_memory_bytes,
            "woj": s.woj,
            "memory": mem.iter().map(|(what, b)| serde_json::json!({"what": what, "bytes": b})).collect::<Vec<_>>(),
            "rss_bytes": rss_bytes(),
        });
        outln!("{}", serde_json::to_string_pretty(&j)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!("volume          {}", a.path.display())?;
    outln!("uuid            {}", s.uuid)?;
    outln!("logical size    {} ({} blocks)", human(s.logical_size_bytes), g.logical_blocks)?;
    outln!(
        "data region     {} ({} blocks, {} slabs of {})",
        human(g.data_blocks * 4096),
        g.data_blocks,
        g.slab_count(),
        human(g.slab_blocks * 4096)
    )?;
    if !s.data_devices.is_empty() {
        outln!(
            "  striped over  {} data devices, {} of data each, in units of {}",
            s.data_devices.len(),
            human(g.data_blocks / s.data_devices.len() as u64 * 4096),
            human(dedupvol_core::format::STRIPE_UNIT_BLOCKS * 4096)
        )?;
        for d in &s.data_devices {
            outln!("  device {}      {} ({})", d.index, d.name, human(d.size_bytes))?;
        }
    }
    outln!(
        "metadata        {}{}",
        human(s.metadata_bytes),
        match (s.separate_metadata_device, vol.meta_path()) {
            (true, Some(p)) => format!(" (separate device {p})"),
            (true, None) => " (separate device)".to_string(),
            _ => String::new(),
        }
    )?;
    outln!("  journal       {} blocks", g.journal_blocks)?;
    outln!("  block map     {} pages x 2 slots", g.block_map_pages)?;
    outln!("  refcounts     {} pages x 2 slots", g.refcount_pages)?;
    if s.data_devices.is_empty() {
        outln!(
            "  growth room   logical up to {}, data device up to {} (without moving metadata; also while served)",
            human(g.max_logical_blocks() * 4096),
            human(g.max_data_dev_blocks() * 4096)
        )?;
    } else {
        outln!(
            "  growth room   logical up to {} (without moving metadata; also while served); the striped data region is fixed",
            human(g.max_logical_blocks() * 4096)
        )?;
    }
    outln!(
        "compression     {}{}",
        dedupvol_core::compression_name(s.compression, s.compression_level),
        if s.rest_level != 0 { format!(", at rest zstd:{} (while idle)", s.rest_level) } else { String::new() }
    )?;
    outln!("extents         up to {} KiB", u32::from(s.extent_blocks_max) * 4)?;
    match (s.dictionary, s.dictionary_area, s.rest_level != 0) {
        (Some((id, bytes)), _, _) => outln!(
            "dictionary      {:.1} KiB (id {id}), trained from this volume's data: units of up to 16 KiB at rest use it",
            f64::from(bytes) / 1024.0
        )?,
        (None, true, true) => outln!("dictionary      none yet (trained by the first settling of enough data)")?,
        (None, true, false) => outln!("dictionary      none (trained only in volumes with a rest level)")?,
        (None, false, _) => outln!("dictionary      none (no dictionary area: formatted before dictionaries)")?,
    }
    outln!("dedup           {} (verify {})", if s.dedup { "on" } else { "off" }, s.verify)?;
    let io = if dedupvol_core::RadosUrl::parse(&a.path).is_some() {
        "RADOS objects of 4 MiB (no page cache)"
    } else if vol.direct_io() {
        "direct (O_DIRECT)"
    } else {
        "buffered (page cache)"
    };
    outln!("device I/O      {io}")?;
    outln!(
        "index           {} ({} slots of {} B, {}), window {} in {} chapters of {} records",
        s.index.mode,
        s.index_capacity,
        s.index_bytes_per_entry,
        human(s.index_memory_bytes),
        human(s.index.window_bytes),
        s.index.chapters,
        s.index.records_per_chapter
    )?;
    outln!("write policy    {}", s.write_policy)?;
    if let Some(w) = &s.woj {
        for l in woj_summary(w) {
            outln!("{l}")?;
        }
    }
    let mem = vol.memory_usage();
    outln!(
        "memory          {} in engine structures (measured process RSS {})",
        human(mem.iter().map(|(_, b)| b).sum()),
        rss_bytes().map_or_else(|| "unknown".into(), human)
    )?;
    for (what, b) in mem {
        outln!("  {what:<34} {}", human(b))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn check(a: CheckArgs) -> anyhow::Result<ExitCode> {
    match check_report(&a) {
        Ok(code) => Ok(code),
        // A command-line mistake is a usage error (2) here too, as in every command.
        Err(e) if e.chain().any(|c| c.is::<crate::UsageError>()) => Err(e),
        Err(e) => {
            // fsck's "operational error": the audit itself could not run.
            eprintln!("dedupvol: error: {}", crate::error_line(&e));
            Ok(ExitCode::from(CHECK_OPERATION_ERROR))
        }
    }
}

fn check_report(a: &CheckArgs) -> anyhow::Result<ExitCode> {
    // Learn the metadata device first: the data file's lock is exclusive with --repair.
    let meta_path = match &a.vol.meta_device {
        Some(m) => Some(m.clone()),
        None => recorded_meta(&a.vol.path)?,
    };
    // A striped volume's data device is the stripe over all of its devices.
    let data = Volume::open_data_path(&a.vol.path, !a.repair, IoMode::Direct)
        .with_context(|| format!("opening {}", a.vol.path.display()))?;
    let meta = match meta_path {
        Some(m) => Some(dedupvol_core::open_device(&m, !a.repair, IoMode::Direct, false)?),
        None => None,
    };
    let copts = dedupvol_core::CheckOptions {
        repair: a.repair,
        unmap_lost: a.unmap_lost,
        index_memory_bytes: a.vol.index_memory,
    };
    let r = dedupvol_core::check_volume_with(data, meta, copts)
        .with_context(|| format!("checking {}", a.vol.path.display()))?;
    let repaired = a.repair && r.unrepaired.is_empty();
    let code = if r.is_clean() {
        CHECK_CLEAN
    } else if repaired {
        CHECK_REPAIRED
    } else {
        CHECK_PROBLEMS_LEFT
    };
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&r)?)?;
    } else {
        outln!(
            "checked {}: {} mapped + {} zero logical blocks, {} physical blocks in use, {} verified",
            a.vol.path.display(),
            r.mapped_blocks,
            r.zero_blocks,
            r.used_blocks,
            r.blocks_verified
        )?;
        let x = &r.index;
        outln!(
            "index records       {} in {} chapters: {} live, stale {} freed / {} reused / {} damaged, {} beyond the data region, {} not audited, {} pages skipped (stale records are expected and never trusted); names of {} chapters compared, {} wrong, {} stale",
            x.records,
            x.chapters,
            x.live,
            x.stale_freed,
            x.stale_reused,
            x.stale_damaged,
            x.beyond_data_region,
            x.not_audited,
            x.pages_skipped,
            x.names_compared,
            x.names_wrong,
            x.names_stale
        )?;
        for n in &r.notes {
            outln!("note: {n}")?;
        }
        for p in &r.problems {
            outln!("PROBLEM: {p}")?;
        }
        if r.problems_not_listed > 0 {
            outln!("... and {} more problems", r.problems_not_listed)?;
        }
        if r.lost_blocks > 0 {
            let verb =
                if r.lost_unmapped { "lost and unmapped (now read as zeros)" } else { "lost (read as I/O errors)" };
            outln!("{} logical blocks {verb}, byte ranges:", r.lost_blocks)?;
            for l in &r.lost_ranges {
                outln!("  lost: offset {} length {}", l.offset, l.len)?;
            }
            if (r.lost_ranges.len() as u64) < r.lost_blocks
                && r.lost_ranges.iter().map(|l| l.len / 4096).sum::<u64>() < r.lost_blocks
            {
                outln!("  ... more ranges not listed")?;
            }
        }
        for p in &r.repaired {
            outln!("repaired: {p}")?;
        }
        for p in &r.unrepaired {
            outln!("NOT repaired: {p}")?;
        }
        if r.lost_blocks > 0 && !r.lost_unmapped {
            outln!("hint: `check --repair --unmap-lost` unmaps the lost blocks so the volume is clean again")?;
        }
        outln!(
            "{}",
            match code {
                CHECK_CLEAN => "clean",
                CHECK_REPAIRED => "repaired",
                _ => "problems found",
            }
        )?;
    }
    Ok(ExitCode::from(code))
}

/// Resident set size of this process (Linux /proc).
fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

fn recorded_meta(path: &Path) -> anyhow::Result<Option<PathBuf>> {
    // Only the superblock matters here: a small index, so a volume whose index this machine
    // cannot hold still gets this far (and check can then lower it with --index-memory).
    let opts = OpenOptions { read_only: true, index_memory_bytes: Some(1 << 20), ..OpenOptions::default() };
    let vol = Volume::open_path(path, None, &opts);
    match vol {
        Ok(v) => Ok(if v.geometry().meta_dev_blocks > 0 { v.meta_path().map(PathBuf::from) } else { None }),
        Err(e) => Err(anyhow::Error::new(e).context(format!("opening {}", path.display()))),
    }
}
