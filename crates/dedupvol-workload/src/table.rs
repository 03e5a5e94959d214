//! Plain-text tables for benchmark and estimate output.
//!
//! Invariants:
//! - Columns are padded to their widest cell; the first column is left-aligned, the others
//!   right-aligned (numbers line up).
//! - A missing figure prints as `-`, a failed one as `error` (with the message below the
//!   table) — never as zero.

use crate::bench::{BenchReport, ScenarioResult};
use crate::content::BLOCK_BYTES;
use crate::estimate::EstimateReport;

/// A simple text table.
#[derive(Debug, Default)]
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with a header row.
    pub fn new(header: &[&str]) -> Self {
        Table { rows: vec![header.iter().map(|s| s.to_string()).collect()] }
    }

    /// Appends a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Renders with two spaces between columns and a rule under the header.
    pub fn render(&self) -> String {
        let cols = self.rows.iter().map(|r| r.len()).max().unwrap_or(0);
        let mut width = vec![0usize; cols];
        for r in &self.rows {
            for (i, c) in r.iter().enumerate() {
                width[i] = width[i].max(c.chars().count());
            }
        }
        let mut out = String::new();
        for (n, r) in self.rows.iter().enumerate() {
            let mut line = String::new();
            for (i, w) in width.iter().enumerate() {
                let c = r.get(i).map(String::as_str).unwrap_or("");
                if i == 0 {
                    line.push_str(&format!("{c:<w$}"));
                } else {
                    line.push_str(&format!("  {c:>w$}"));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
            if n == 0 {
                out.push_str(&"-".repeat(width.iter().sum::<usize>() + 2 * cols.saturating_sub(1)));
                out.push('\n');
            }
        }
        out
    }
}

/// `1234.5` → `"1235"`; `None` → `"-"`.
pub fn num(v: Option<f64>, decimals: usize) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.decimals$}"),
        _ => "-".into(),
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn per_ops(s: &ScenarioResult) -> bool {
    s.target.as_ref().map(|t| t.unit == "writes/s").unwrap_or(false) || s.name.starts_with("overwrite")
}

/// The value a scenario is judged by: MB/s, or writes/s for the overwrite scenario.
fn headline(s: &ScenarioResult, f: Option<&crate::bench::RunFigure>) -> Option<f64> {
    let ops = per_ops(s);
    f.map(|f| if ops { f.ops_s } else { f.mb_s })
}

/// A simple model of the fastest this scenario could go on this machine, in MB/s of
/// logical data: every block is hashed once and every unique one compressed, spread over
/// `threads` cores (`threads / (1/BLAKE3 + unique_share/LZ4)`), and the device must absorb
/// the stored bytes at the measured sequential speed (`disk × logical / stored`). The lower
/// of the two. It ignores metadata and memory copies, so it is an upper bound.
pub fn limit_model_mb_s(s: &ScenarioResult, threads: usize, disk_mb_s: Option<f64>) -> Option<f64> {
    let p = s.primitives.as_ref()?;
    let e = s.estimate.as_ref()?;
    // The volume's own codec (zstd is measured at level 1; `none` costs nothing).
    let compress_s_per_mb = match s.stats.as_ref().map(|st| st.compression) {
        Some(dedupvol_core::Compression::None) => Some(0.0),
        Some(dedupvol_core::Compression::Zstd) => Some(1.0 / p.zstd1_compress_mb_s),
        _ => Some(1.0 / p.lz4_compress_mb_s),
    }
    .filter(|v| v.is_finite())?;
    if e.chunks == 0 || p.blake3_mb_s <= 0.0 {
        return None;
    }
    let unique_share = e.unique_chunks as f64 / e.chunks as f64;
    let cpu = threads as f64 / (1.0 / p.blake3_mb_s + unique_share * compress_s_per_mb);
    let stored = e.physical_bytes.max(1) as f64;
    let disk = disk_mb_s.map(|d| d * e.scanned_bytes as f64 / stored);
    Some(disk.map_or(cpu, |d| d.min(cpu)))
}

/// The full benchmark printout: primitives, engine vs baselines vs target, reduction, I/O.
pub fn render_bench(r: &BenchReport) -> String {
    let mut out = String::new();
    // The bench opens its volumes with the engine's default open options.
    let open = dedupvol_core::OpenOptions::default();
    let cache_writes = open.writes_cached(r.options.verify);
    out.push_str(&format!("dedupvol bench — {}\nmachine: {}\ncommand: {}\n", r.date, r.machine, r.command));
    out.push_str(&format!(
        "volume: {} compression, {} write policy, {} duplicate verification, {} I/O, {} MiB content cache ({}), {} writers, final flush inside the clock, index memory populated before it\n\n",
        dedupvol_core::compression_name(r.options.compression, r.options.compression_level),
        r.options.write_policy,
        r.options.verify,
        r.options.io_mode,
        open.content_cache_bytes >> 20,
        if cache_writes { "written blocks cached" } else { "filled by reads only" },
        r.options.threads
    ));

    let mut p = Table::new(&["primitive (1 core, 4 KiB chunks of the scenario data)", "scenario", "MB/s"]);
    for s in &r.scenarios {
        if let Some(c) = &s.primitives {
            p.row(vec!["BLAKE3".into(), s.name.clone(), num(Some(c.blake3_mb_s), 0)]);
            p.row(vec![
                format!("LZ4 compress (output {:.0}% of input)", c.lz4_size_fraction * 100.0),
                s.name.clone(),
                num(Some(c.lz4_compress_mb_s), 0),
            ]);
            p.row(vec!["LZ4 decompress".into(), s.name.clone(), num(Some(c.lz4_decompress_mb_s), 0)]);
            p.row(vec![
                format!("zstd-1 compress (output {:.0}% of input)", c.zstd1_size_fraction * 100.0),
                s.name.clone(),
                num(Some(c.zstd1_compress_mb_s), 0),
            ]);
            p.row(vec![
                format!("incompressible probe ({:.0}% refused)", c.probe_refused_fraction * 100.0),
                s.name.clone(),
                num(Some(c.probe_mb_s), 0),
            ]);
        }
    }
    if let Some(d) = &r.disk_seq_write {
        p.row(vec![format!("disk: {}", d.what), "-".into(), num(Some(d.mb_s), 0)]);
    }
    out.push_str(&p.render());
    out.push('\n');

    let mut t = Table::new(&[
        "scenario",
        "unit",
        "target",
        "engine",
        "met",
        "limit model",
        "no-reduction vol",
        "raw pwrite",
        "engine/no-red",
        "engine/raw",
        "reduction",
        "WA dev/logical",
        "WA dev/ideal",
    ]);
    let disk = r.disk_seq_write.as_ref().map(|d| d.mb_s);
    for s in &r.scenarios {
        let unit = s
            .target
            .as_ref()
            .map(|t| t.unit.clone())
            .unwrap_or_else(|| if per_ops(s) { "writes/s" } else { "MB/s" }.into());
        let e = headline(s, s.engine.as_ref());
        let b = headline(s, s.no_reduction_volume.as_ref());
        let raw = headline(s, s.raw_file.as_ref());
        let met = match (&s.target, e) {
            (Some(t), Some(v)) => if v >= t.min { "yes" } else { "NO" }.to_string(),
            (Some(_), None) => "NO".into(),
            _ => "-".into(),
        };
        t.row(vec![
            s.name.clone(),
            unit,
            s.target.as_ref().map(|t| format!(">= {}", t.min)).unwrap_or_else(|| "-".into()),
            if s.engine_error.is_some() { "error".into() } else { num(e, 0) },
            met,
            if per_ops(s) {
                num(limit_model_mb_s(s, r.options.threads, disk).map(|m| m * 1e6 / BLOCK_BYTES as f64), 0)
            } else {
                num(limit_model_mb_s(s, r.options.threads, disk), 0)
            },
            if s.no_reduction_error.is_some() { "error".into() } else { num(b, 0) },
            num(raw, 0),
            num(ratio(e, b), 2),
            num(ratio(e, raw), 2),
            num(s.stats.as_ref().map(|x| x.reduction_ratio), 2),
            num(s.write_amp_logical, 3),
            num(s.write_amp_ideal, 2),
        ]);
    }
    out.push_str(&t.render());
    if r.disk_seq_write.is_none() {
        out.push_str("limit model: threads / (1/BLAKE3 + unique share/compressor) — the disk was not measured (--no-disk), so hashing and\n\
         compression only, no device and no metadata: an upper bound to compare the engine with.\n");
    } else {
        out.push_str("limit model: min(threads / (1/BLAKE3 + unique share/compressor), disk seq MB/s x logical/stored) — hashing, compression and\n\
         the device's sequential speed only, no metadata: an upper bound to compare the engine with.\n");
    }
    out.push_str(
        "         no-reduction vol: the same writes into a volume with dedup and compression off; raw pwrite: the same bytes\n         written straight to a file through the engine's storage layer; both in the run's I/O mode.\n\n",
    );

    for s in &r.scenarios {
        out.push_str(&format!("[{}] {}\n", s.name, s.description));
        if let Some(est) = &s.estimate {
            out.push_str(&format!(
                "  estimate of the same bytes: reduction {:.2}x (zero {:.1}%, dedup {:.1}%, compression {:.1}% of scanned), ideal {} MiB stored\n",
                est.reduction_ratio,
                pct(est.savings_zero_bytes, est.scanned_bytes),
                pct(est.savings_dedup_bytes, est.scanned_bytes),
                pct(est.savings_compression_bytes, est.scanned_bytes),
                s.ideal_bytes >> 20
            ));
        }
        if let Some(io) = &s.io {
            out.push_str(&format!(
                "  device bytes written in the timed phase (MiB): data {:.1}, journal {:.1}, block map {:.1}, refcounts {:.1}, index {:.1}, superblock {:.2}; read: data {:.1}, block map {:.1}, verify {:.1}; {} syncs\n",
                mib(io.data_write),
                mib(io.journal_write),
                mib(io.block_map_write),
                mib(io.refcount_write),
                mib(io.index_write),
                mib(io.superblock_write),
                mib(io.data_read),
                mib(io.block_map_read),
                mib(io.verify_read),
                io.syncs
            ));
        }
        if let Some(e) = &s.engine {
            out.push_str(&format!(
                "  engine: {:.1} MiB in {:.3} s ({:.3} s of it the final flush), {:.0} requests/s\n",
                mib(e.bytes),
                e.seconds,
                e.flush_seconds,
                e.ops_s
            ));
        }
        if let Some(st) = &s.stats {
            out.push_str(&format!(
                "  engine stats: dedup hits {}, compressed {}, raw {}, packed blocks {}, index {} entries / {} MiB, \
                 {} lookups ({:.2}% without a device read), {} record-page reads, {} record-page cache hits\n",
                st.counters.dedup_hits,
                st.counters.compressed_blocks,
                st.counters.raw_blocks,
                st.counters.packed_blocks_written,
                st.index_entries,
                st.index_memory_bytes >> 20,
                st.index.lookups,
                st.index.lookups_without_io as f64 * 100.0 / st.index.lookups.max(1) as f64,
                st.index.page_reads,
                st.index.page_cache_hits
            ));
            if let Some(fc) = &s.final_clean {
                out.push_str(&format!(
                    "  after the timed phase, {} more cleaner pass(es): reduction {:.2}x -> {:.2}x ({:.1} MiB moved); \
                     the estimate of the volume's live content (read back): {:.2}x\n",
                    fc.passes,
                    fc.reduction_before,
                    fc.reduction_after,
                    fc.bytes_moved as f64 / 1048576.0,
                    fc.live_estimate
                ));
            }
            let p = &st.pipeline;
            if p.fingerprint.batches > 0 {
                out.push_str(&format!(
                    "  pipeline: {} batches of {:.1} chunks; batcher {} ({} requests in {} batches, {:.1} per batch, \
                     {} backpressure waits); write latency p50 {} us / p99 {} us / max {} us; stage busy s: \
                     fingerprint {:.2}, index {:.2}, compress {:.2}, place {:.2}\n",
                    p.fingerprint.batches,
                    p.chunks_per_batch,
                    if p.batching { "on" } else { "off" },
                    p.batched_requests,
                    p.batches,
                    p.requests_per_batch,
                    p.backpressure_waits,
                    p.latency_p50_micros,
                    p.latency_p99_micros,
                    p.latency_max_micros,
                    p.fingerprint.busy_micros as f64 / 1e6,
                    p.index.busy_micros as f64 / 1e6,
                    p.compress.busy_micros as f64 / 1e6,
                    p.place.busy_micros as f64 / 1e6,
                ));
            }
            if let Some(fr) = &s.final_recompress {
                out.push_str(&format!(
                    "  after the timed phase, recompression at rest: reduction {:.3}x -> {:.3}x \
                     ({:.1} MiB recompressed, {:.1} MiB stored, {} fragments settled in place, in {:.2} s)\n",
                    fr.reduction_before,
                    fr.reduction_after,
                    fr.bytes_recompressed as f64 / 1048576.0,
                    fr.bytes_written as f64 / 1048576.0,
                    fr.fragments_marked,
                    fr.seconds
                ));
            }
            let d = &p.deferral;
            if d.enabled {
                out.push_str(&format!(
                    "  deferred compression: budget {} us, {} chunks deferred to LZ4, {} with the volume's codec ({} ns a chunk)\n",
                    d.budget_micros, d.deferred_chunks, d.inline_chunks, d.cost_ns_per_chunk
                ));
            }
            let pr = &p.predictor;
            if pr.enabled {
                out.push_str(&format!(
                    "  unique predictor: accuracy {:.2}% (unique {} right / {} wrong, duplicate {} right / {} wrong), \
                     {:.1} MiB of early compression wasted, {:.2} bytes per index entry\n",
                    pr.accuracy * 100.0,
                    pr.unique_right,
                    pr.unique_wrong,
                    pr.duplicate_right,
                    pr.duplicate_wrong,
                    pr.wasted_compress_bytes as f64 / 1048576.0,
                    pr.memory_bytes_per_entry
                ));
            }
            if let Some(b) = &s.background {
                out.push_str(&format!(
                    "  background data writes: {:.1} MiB (cleaner in the timed phase {:.1}, cleaning and settling after it \
                     {:.1}) = {:.3}x the client's {:.1} MiB of data writes in the timed phase\n",
                    mib(b.cleaner_timed_bytes + b.after_bytes),
                    mib(b.cleaner_timed_bytes),
                    mib(b.after_bytes),
                    b.ratio(),
                    mib(b.client_bytes)
                ));
            }
            if st.counters.cleaner_passes > 0 {
                let client = st.lifetime.data_write_bytes.saturating_sub(st.counters.cleaner_bytes_moved).max(1);
                out.push_str(&format!(
                    "  cleaner: {} passes, {} fragments moved ({:.1} MiB, {:.3}x the volume's other data writes: the client's and settling's), {} blocks remapped\n",
                    st.counters.cleaner_passes,
                    st.counters.cleaner_fragments_moved,
                    st.counters.cleaner_bytes_moved as f64 / 1048576.0,
                    st.counters.cleaner_bytes_moved as f64 / client as f64,
                    st.counters.cleaner_blocks_remapped
                ));
            }
        }
        if let Some(e) = &s.engine_error {
            out.push_str(&format!("  engine error: {e}\n"));
        }
        if let Some(e) = &s.no_reduction_error {
            out.push_str(&format!("  no-reduction volume error: {e}\n"));
        }
    }
    out
}

fn pct(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 * 100.0 / b as f64
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// The estimate printout.
pub fn render_estimate(r: &EstimateReport) -> String {
    let mut t = Table::new(&["", "chunks", "MiB", "% of scanned"]);
    let c = r.chunk_bytes;
    let row = |name: &str, chunks: u64, bytes: u64| {
        vec![
            name.to_string(),
            chunks.to_string(),
            format!("{:.1}", mib(bytes)),
            format!("{:.1}", pct(bytes, r.scanned_bytes)),
        ]
    };
    t.row(row("scanned", r.chunks, r.scanned_bytes));
    t.row(row("zero (saved)", r.zero_chunks, r.savings_zero_bytes));
    t.row(row("duplicate (saved)", r.dup_chunks, r.savings_dedup_bytes));
    t.row(row("unique", r.unique_chunks, r.unique_chunks * c));
    let saved =
        format!("  {} saved (before packing)", dedupvol_core::compression_name(r.compression, r.compression_level));
    t.row(row(&saved, r.compressed_chunks, r.compression_gross_bytes));
    t.row(row("  stored raw", r.raw_chunks, r.raw_chunks * c));
    t.row(row("  packed blocks", r.packed_blocks, r.packed_blocks * 4096));
    t.row(row("  packing overhead", r.packed_blocks, r.packing_overhead_bytes));
    t.row(row("compression saved (net)", r.compressed_chunks, r.savings_compression_bytes));
    t.row(row("physical (estimate)", r.physical_bytes / 4096, r.physical_bytes));
    let mut out = format!(
        "dedupvol estimate — {} KiB chunks, {}\n{}reduction: {:.2}x of non-zero data ({:.2}x including zeros); fingerprint set {:.1} MiB; scanned at {:.0} MB/s\n",
        c >> 10,
        r.paths.join(", "),
        t.render(),
        r.reduction_ratio,
        r.total_reduction_ratio,
        mib(r.fingerprint_set_bytes),
        r.mb_per_s
    );
    if !r.policies.is_empty() {
        let mut p = Table::new(&["storage policy (dedup at 4 KiB)", "physical MiB", "reduction"]);
        p.row(vec![
            "as written: extents of up to 64K, byte-granular (the estimate above)".into(),
            format!("{:.1}", mib(r.physical_bytes)),
            format!("{:.2}x", r.reduction_ratio),
        ]);
        for f in &r.policies {
            p.row(vec![
                f.policy.clone(),
                format!("{:.1}", mib(f.physical_bytes)),
                format!("{:.2}x", f.reduction_ratio),
            ]);
        }
        out.push_str(&format!(
            "\nthe same unique data under other storage policies ({}):\n{}",
            dedupvol_core::compression_name(r.compression, r.compression_level),
            p.render()
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align() {
        let mut t = Table::new(&["a", "bb"]);
        t.row(vec!["long name".into(), "1".into()]);
        let s = t.render();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "a          bb");
        assert_eq!(lines[2], "long name   1");
        assert_eq!(num(None, 1), "-");
        assert_eq!(num(Some(f64::NAN), 1), "-");
    }
}
