//! `dedupvol stats PATH [--json] [--watch [--interval S] [--count N]]`.
//!
//! A served volume is asked through its admin socket (see `admin`): the running server's
//! figures, live, with its NBD counters and the refcount histogram. A volume nobody serves
//! is opened read-only and reported as of its last close. `--watch` needs a server and
//! redraws every interval, with rates computed between two reports.

use crate::admin::{self, Report};
use crate::volume_cmds::{human, open, tier_summary, OpenArgs};
use clap::Args;
use dedupvol_core::{RefcountBucket, Stats};
use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

/// Shortest `--interval` (a redraw costs the server a statistics snapshot and a refcount pass).
const INTERVAL_MIN_SECONDS: f64 = 0.1;

#[derive(Args)]
pub struct StatsArgs {
    #[command(flatten)]
    vol: OpenArgs,
    /// Machine-readable output: `lifetime` counts over the volume's life (as of its last
    /// close or checkpoint); `counters` and `io` count the serving process (or this one, for
    /// a volume nobody serves); `refcount_histogram` buckets physical blocks by references.
    /// A served volume adds `server` (NBD requests, latency, errors, connections), `export`,
    /// `address`, `pid` and `uptime_seconds`.
    #[arg(long)]
    json: bool,
    /// Redraw a live view of a served volume until interrupted (with --json: one JSON
    /// report per line).
    #[arg(long)]
    watch: bool,
    /// Seconds between redraws with --watch.
    #[arg(long, default_value_t = 2.0, requires = "watch")]
    interval: f64,
    /// Stop after this many redraws with --watch (default: until interrupted).
    #[arg(long, requires = "watch")]
    count: Option<u64>,
}

pub fn run(a: StatsArgs) -> anyhow::Result<ExitCode> {
    if a.watch {
        return watch(&a);
    }
    if let Some(r) = admin::query(&a.vol.path)? {
        if a.json {
            outln!("{}", serde_json::to_string_pretty(&r)?)?;
        } else {
            print_report(&r, None)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let vol = open(&a.vol, true)?;
    let s = vol.stats();
    let histogram = vol.refcount_histogram();
    if a.json {
        // The same fields a served volume reports, less the server's.
        let mut j = serde_json::to_value(&s)?;
        if let Some(m) = j.as_object_mut() {
            m.insert("refcount_histogram".into(), serde_json::to_value(&histogram)?);
        }
        outln!("{}", serde_json::to_string_pretty(&j)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    print_stats(&s)?;
    print_histogram(&histogram)?;
    Ok(ExitCode::SUCCESS)
}

fn watch(a: &StatsArgs) -> anyhow::Result<ExitCode> {
    if !(a.interval.is_finite() && a.interval >= INTERVAL_MIN_SECONDS) {
        usage_bail!("--interval must be at least {INTERVAL_MIN_SECONDS} seconds");
    }
    let interval = Duration::from_secs_f64(a.interval);
    let clear = !a.json && std::io::stdout().is_terminal();
    let mut previous: Option<Report> = None;
    let mut frames = 0u64;
    loop {
        let Some(r) = admin::query(&a.vol.path)? else {
            if previous.is_some() {
                outln!("dedupvol: the server of {} stopped", a.vol.path.display())?;
                return Ok(ExitCode::SUCCESS);
            }
            anyhow::bail!(
                "{} is not being served (no server answers on {}); --watch shows a running server",
                a.vol.path.display(),
                admin::socket_path(&a.vol.path)?.display()
            );
        };
        if a.json {
            outln!("{}", serde_json::to_string(&r)?)?;
        } else {
            if clear {
                out!("\x1b[H\x1b[2J")?;
            } else if previous.is_some() {
                outln!()?;
            }
            print_report(&r, previous.as_ref())?;
        }
        previous = Some(r);
        frames += 1;
        if a.count.is_some_and(|c| frames >= c) {
            return Ok(ExitCode::SUCCESS);
        }
        std::thread::sleep(interval);
    }
}

/// A served volume's report; with `previous`, rates since it.
fn print_report(r: &Report, previous: Option<&Report>) -> anyhow::Result<()> {
    outln!(
        "served by pid {} on {} (export {}) for {:.0} s; {} connection(s) open, {} served, {} refused",
        r.pid,
        r.address,
        r.export,
        r.uptime_seconds,
        r.server.connections_open,
        r.server.connections_accepted,
        r.server.connections_refused
    )?;
    if let Some(s) = &r.volume {
        print_stats(s)?;
    }
    let elapsed = previous.map(|p| r.uptime_seconds - p.uptime_seconds).filter(|e| *e > 0.0);
    outln!(
        "nbd: {:<13} {:>10} {:>12} {:>7} {:>10} {:>10}{}",
        "command",
        "requests",
        "bytes",
        "errors",
        "mean",
        "p99 <=",
        if elapsed.is_some() { "      req/s       MiB/s" } else { "" }
    )?;
    for c in &r.server.commands {
        let mean = if c.requests == 0 { 0.0 } else { c.latency.sum_us as f64 / c.requests as f64 };
        let mut rate = String::new();
        if let (Some(e), Some(p)) =
            (elapsed, previous.and_then(|p| p.server.commands.iter().find(|x| x.command == c.command)))
        {
            let reqs = c.requests.saturating_sub(p.requests) as f64 / e;
            let mib = c.bytes.saturating_sub(p.bytes) as f64 / e / (1 << 20) as f64;
            rate = format!(" {reqs:>10.1} {mib:>11.2}");
        }
        outln!(
            "     {:<13} {:>10} {:>12} {:>7} {:>8.0}us {:>10}{rate}",
            c.command,
            c.requests,
            human(c.bytes),
            c.errors,
            mean,
            p99(&c.latency)
        )?;
    }
    let errors: Vec<String> = r.server.errors.iter().filter(|e| e.1 > 0).map(|(k, n)| format!("{k} {n}")).collect();
    outln!("errors              {}", if errors.is_empty() { "none".into() } else { errors.join(", ") })?;
    print_histogram(&r.refcount_histogram)?;
    Ok(())
}

/// The latency bucket bound holding the 99th percentile ("> last" past the last bound).
fn p99(l: &dedupvol_nbd::metrics::Latency) -> String {
    let total: u64 = l.counts.iter().sum();
    if total == 0 {
        return "-".into();
    }
    let want = total - total / 100;
    let mut seen = 0;
    for (i, n) in l.counts.iter().enumerate() {
        seen += n;
        if seen >= want {
            return match l.bounds_us.get(i) {
                Some(b) if *b >= 1000 => format!("{}ms", b / 1000),
                Some(b) => format!("{b}us"),
                None => format!(">{}ms", l.bounds_us.last().copied().unwrap_or(0) / 1000),
            };
        }
    }
    "-".into()
}

fn print_histogram(h: &[RefcountBucket]) -> anyhow::Result<()> {
    let used: Vec<&RefcountBucket> = h.iter().filter(|b| b.blocks > 0).collect();
    if used.is_empty() {
        return Ok(());
    }
    outln!("refcount histogram  (physical blocks by references, as zpool status -D)")?;
    outln!("     {:>9} {:>12} {:>12} {:>12}", "refs <=", "blocks", "references", "physical")?;
    for b in used {
        outln!("     {:>9} {:>12} {:>12} {:>12}", b.refs_max, b.blocks, b.references, human(b.blocks * 4096))?;
    }
    Ok(())
}

fn print_stats(s: &Stats) -> anyhow::Result<()> {
    outln!("logical size        {}", human(s.logical_size_bytes))?;
    outln!("logical in use      {}", human(s.logical_bytes_used))?;
    outln!(
        "physical data used  {} of {} ({} blocks)",
        human(s.physical_data_bytes_used),
        human(s.data_blocks_total * 4096),
        s.data_blocks_used
    )?;
    outln!("metadata            {}", human(s.metadata_bytes))?;
    // An empty volume has no ratio: "-" rather than a misleading 0.00:1.
    outln!("reduction ratio     {}", crate::ratio_text(s.reduction_ratio))?;
    outln!("savings: zero       {}", human(s.savings.zero_bytes))?;
    outln!("savings: dedup      {}", human(s.savings.dedup_bytes))?;
    outln!("savings: compress   {}", human(s.savings.compression_bytes))?;
    outln!(
        "index               {}: {} / {} entries, {} ({:.1} B/entry), window {}, {} / {} chapters used",
        s.index.mode,
        s.index_entries,
        s.index_capacity,
        human(s.index_memory_bytes),
        s.index.memory_bytes_per_entry,
        human(s.index.window_bytes),
        s.index.chapters_used,
        s.index.chapters
    )?;
    outln!(
        "index rebuild       {}{} / {} chapters ({} of records covered), {} records, {} read in {} ms ({} chapters from their records, {} pages skipped; newest chapter found in {} reads, {} ms)",
        if s.index.rebuild_running { "running: " } else { "" },
        s.index.rebuild_chapters_done,
        s.index.rebuild_chapters_total,
        human(s.index.rebuild_covered_bytes),
        s.index.rebuild_records,
        human(s.index.rebuild_bytes),
        s.index.rebuild_millis,
        s.index.rebuild_chapters_without_names,
        s.index.rebuild_pages_skipped,
        s.index.rebuild_probe_reads,
        s.index.rebuild_probe_millis
    )?;
    outln!(
        "index lookups       {} ({} without I/O), {} page reads, {} page cache hits, {} chapter loads",
        s.index.lookups,
        s.index.lookups_without_io,
        s.index.page_reads,
        s.index.page_cache_hits,
        s.index.chapter_loads
    )?;
    if let Some(t) = &s.tier {
        outln!("{}", tier_summary(t))?;
    }
    // This process's background work (a served volume's, through its admin socket).
    let c = &s.counters;
    outln!(
        "cleaner             {} passes, {} fragments moved ({}), {} blocks remapped",
        c.cleaner_passes,
        c.cleaner_fragments_moved,
        human(c.cleaner_bytes_moved),
        c.cleaner_blocks_remapped
    )?;
    outln!(
        "recompression       {} passes, {} fragments moved, {} settled in place, {} recompressed, {} saved{}",
        c.recompress_passes,
        c.recompress_fragments,
        c.recompress_fragments_marked,
        human(c.recompress_bytes),
        human(c.recompress_bytes_saved),
        if s.rest_level != 0 { format!(" (data at rest: zstd:{})", s.rest_level) } else { String::new() }
    )?;
    if let Some(sc) = &s.scrub {
        outln!(
            "scrub               {} {}: {} blocks and {} metadata pages read ({}), {} damaged, {} repaired, {} logical blocks lost{}",
            if sc.running { "running since" } else { "last, started" },
            sc.started_unix,
            sc.blocks_read,
            sc.metadata_pages_read,
            human(sc.bytes_read),
            sc.damaged,
            sc.repaired,
            sc.lost_blocks,
            if sc.running {
                format!(", {}/{} logical blocks", sc.logical_blocks_scanned, sc.logical_blocks_total)
            } else {
                format!(" in {:.1} s", sc.seconds)
            }
        )?;
    }
    if let Some(w) = &s.woj {
        for l in crate::volume_cmds::woj_summary(w) {
            outln!("{l}")?;
        }
    }
    let p = &s.pipeline;
    if p.fingerprint.batches > 0 {
        outln!(
            "pipeline            {} batches of {:.1} chunks on {}, write latency p50 {} us, p99 {} us; stage utilisation fingerprint {:.2}, index {:.2}, compress {:.2}, place {:.2}",
            p.fingerprint.batches,
            p.chunks_per_batch,
            offload_label(&p.offload),
            p.latency_p50_micros,
            p.latency_p99_micros,
            p.fingerprint.utilisation,
            p.index.utilisation,
            p.compress.utilisation,
            p.place.utilisation
        )?;
        if p.batching {
            outln!(
                "  batcher           {} requests in {} batches ({} retried alone), queue {} chunks (peak {}), {} backpressure waits",
                p.batched_requests,
                p.batches,
                p.batches_retried,
                p.queue_chunks,
                p.queue_chunks_peak,
                p.backpressure_waits
            )?;
        }
    }
    let pr = &p.predictor;
    if pr.enabled && pr.unique_right + pr.unique_wrong + pr.duplicate_right + pr.duplicate_wrong > 0 {
        outln!(
            "  unique predictor  accuracy {:.2}% (wrong: {} predicted unique, {} predicted duplicate), {} of early compression wasted, {} ({:.2} B per index entry)",
            pr.accuracy * 100.0,
            pr.unique_wrong,
            pr.duplicate_wrong,
            human(pr.wasted_compress_bytes),
            human(pr.memory_bytes),
            pr.memory_bytes_per_entry
        )?;
    }
    let d = &p.deferral;
    if d.enabled {
        outln!(
            "  deferral          budget {} us: {} chunks compressed with LZ4 to recompress later, {} with the volume's codec",
            d.budget_micros,
            d.deferred_chunks,
            d.inline_chunks
        )?;
    }
    for d in &s.data_devices {
        outln!(
            "data device {}       {} data read, {} data written{} ({})",
            d.index,
            human(d.data_read_bytes),
            human(d.data_written_bytes),
            if d.head_read_bytes + d.head_written_bytes > 0 {
                format!(", {} + {} superblock and metadata", human(d.head_read_bytes), human(d.head_written_bytes))
            } else {
                String::new()
            },
            d.name
        )?;
    }
    // Kept in the volume (updated at checkpoints and close), not counted by this process.
    let l = &s.lifetime;
    outln!("lifetime: opens     {} read-write ({} after a crash)", l.read_write_opens, l.recoveries)?;
    outln!(
        "lifetime: written   {} blocks (zero {}, deduplicated {}, compressed {}, raw {})",
        l.blocks_written,
        l.zero_blocks,
        l.dedup_hits,
        l.compressed_blocks,
        l.raw_blocks
    )?;
    outln!(
        "lifetime: device    {} data + {} metadata written, {} data read, {} read to verify, {} syncs",
        human(l.data_write_bytes),
        human(l.metadata_write_bytes),
        human(l.data_read_bytes),
        human(l.verify_read_bytes),
        l.syncs
    )?;
    Ok(())
}

/// The compute backend for the pipeline line: its name, and for a checked backend the
/// results the engine refused and the calls it failed.
fn offload_label(o: &dedupvol_core::OffloadStats) -> String {
    let name = if o.backend.is_empty() { "cpu" } else { o.backend.as_str() };
    if o.checked {
        format!("{name} (checked: {} results refused, {} calls failed)", o.rejected_results, o.failed_calls)
    } else {
        name.to_string()
    }
}
