//! `serve --metrics ADDR`: the server's and the volume's figures as OpenMetrics text (the
//! format Prometheus scrapes) at `http://ADDR/metrics`, encoded with `prometheus-client`.
//!
//! Each scrape takes one [`Report`] per export (the same the admin socket gives `dedupvol
//! stats`) and encodes them (with several exports, every series labelled `export="NAME"`): the engine keeps its
//! own counters, so nothing here counts anything, and a scrape costs one statistics
//! snapshot and one pass over the reference counts per volume.
//!
//! Series (all prefixed `dedupvol_`; docs/nbd.md lists them with their labels):
//! space (`logical_size_bytes`, `logical_used_bytes`, `physical_size_bytes`,
//! `physical_used_bytes`, `physical_free_bytes`, `metadata_bytes`, `space_saving_percent`,
//! `reduction_ratio`, `savings_bytes{mechanism}`), the reduction split
//! (`blocks_written_total{outcome}`), device I/O (`device_io_bytes_total` and
//! `device_io_ops_total{category,direction}`, `device_syncs_total`), caches
//! (`cache_lookups_total{cache,result}`, `block_map_cached_pages`), journal and packer
//! (`journal_commits_total`, `checkpoints_total`, `packed_blocks_written_total`), the index,
//! the tier, NBD requests (`nbd_requests_total`, `nbd_request_bytes_total`,
//! `nbd_fua_requests_total`, `nbd_request_errors_total{command}`,
//! `nbd_request_duration_seconds{command}` histograms), failures by kind
//! (`errors_total{kind}`), connections, and the reference-count histogram
//! (`refcount_blocks{refs_max}`, `refcount_references{refs_max}`).
//!
//! Invariants:
//! - The HTTP side is bounded like the admin socket: one client at a time with timeouts
//!   (`service`), a request head of at most [`REQUEST_HEAD_BYTES_MAX`], one answer, close.
//! - Every series exists from the first scrape on (zero until something happens), so
//!   dashboards and `rate()` see no gaps.

use crate::admin::{Report, Source};
use crate::service::Service;
use dedupvol_nbd::{ListenAddr, Listener};
use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::io::{self, Read, Write};

/// Longest HTTP request head read.
pub const REQUEST_HEAD_BYTES_MAX: usize = 8 << 10;
/// Bytes of an oversized request read and dropped after refusing it.
const DRAIN_BYTES_MAX: u64 = 64 << 10;
/// The content type of OpenMetrics text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(String, String)>;

/// A counter or gauge family taken from a snapshot: values are set, never incremented.
#[derive(Debug)]
struct Sampled {
    kind: MetricType,
    samples: Vec<(Labels, f64)>,
}

impl EncodeMetric for Sampled {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        fn value(kind: MetricType, e: &mut MetricEncoder, v: f64) -> Result<(), std::fmt::Error> {
            match kind {
                // Counters are whole numbers here; integers keep them exact past 2^53.
                MetricType::Counter => e.encode_counter::<(), _, u64>(&(v as u64), None),
                _ => e.encode_gauge(&v),
            }
        }
        for (labels, v) in &self.samples {
            if labels.is_empty() {
                // An unlabelled series is written bare (`name value`, not `name{} value`).
                value(self.kind, &mut encoder, *v)?;
            } else {
                value(self.kind, &mut encoder.encode_family(labels)?, *v)?;
            }
        }
        Ok(())
    }
    fn metric_type(&self) -> MetricType {
        self.kind
    }
}

/// One histogram: its labels, the sum of observations, and per-bucket counts with their
/// upper bounds (the last bound is +Inf, written `f64::MAX`).
type HistogramSample = (Labels, f64, Vec<(f64, u64)>);

/// Histograms from bucket counts kept elsewhere (the server's latency buckets).
#[derive(Debug)]
struct Histograms {
    samples: Vec<HistogramSample>,
}

impl EncodeMetric for Histograms {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (labels, sum, buckets) in &self.samples {
            let count = buckets.iter().map(|b| b.1).sum();
            encoder.encode_family(labels)?.encode_histogram::<()>(*sum, count, buckets, None)?;
        }
        Ok(())
    }
    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect()
}

/// A counter or gauge family being collected: name, help, type, samples.
type SampledFamily = (String, String, MetricType, Vec<(Labels, f64)>);

/// Collects families, each series labelled with its export, and registers them under
/// the `dedupvol` prefix at the end (a family several exports report is registered once,
/// with every export's samples).
#[derive(Default)]
struct Families {
    sampled: Vec<SampledFamily>,
    histograms: Vec<(String, String, Vec<HistogramSample>)>,
    /// The export whose figures are being added (None: server-wide figures, unlabelled).
    export: Option<String>,
}

impl Families {
    fn label(&self, mut l: Labels) -> Labels {
        if let Some(e) = &self.export {
            l.insert(0, ("export".to_string(), e.clone()));
        }
        l
    }
    fn add(&mut self, name: &str, help: &str, kind: MetricType, samples: Vec<(Labels, f64)>) {
        let samples: Vec<(Labels, f64)> = samples.into_iter().map(|(l, v)| (self.label(l), v)).collect();
        match self.sampled.iter_mut().find(|f| f.0 == name) {
            Some(f) => f.3.extend(samples),
            None => self.sampled.push((name.to_string(), help.to_string(), kind, samples)),
        }
    }
    fn histogram(&mut self, name: &str, help: &str, samples: Vec<HistogramSample>) {
        let samples: Vec<HistogramSample> = samples.into_iter().map(|(l, s, b)| (self.label(l), s, b)).collect();
        match self.histograms.iter_mut().find(|f| f.0 == name) {
            Some(f) => f.2.extend(samples),
            None => self.histograms.push((name.to_string(), help.to_string(), samples)),
        }
    }
    fn gauge(&mut self, name: &str, help: &str, v: f64) {
        self.add(name, help, MetricType::Gauge, vec![(Vec::new(), v)]);
    }
    fn counter(&mut self, name: &str, help: &str, v: u64) {
        self.add(name, help, MetricType::Counter, vec![(Vec::new(), v as f64)]);
    }
    fn text(self) -> String {
        let mut registry = Registry::with_prefix("dedupvol");
        for (name, help, kind, samples) in self.sampled {
            registry.register(name, help, Sampled { kind, samples });
        }
        for (name, help, samples) in self.histograms {
            registry.register(name, help, Histograms { samples });
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
}

/// Every export's report as OpenMetrics text. With several exports every series carries an
/// `export` label, except the server-wide uptime and refused connections (taken from the
/// first report); a server of one export writes its series without it, as a single-volume
/// scrape configuration expects.
pub fn encode_all(reports: &[Report]) -> String {
    let mut f = Families::default();
    if let Some(first) = reports.first() {
        f.gauge("uptime_seconds", "Seconds since the server started", first.uptime_seconds);
        f.counter(
            "nbd_connections_refused",
            "NBD connections refused at the connection limit",
            first.server.connections_refused,
        );
    }
    let several = reports.len() > 1;
    for r in reports {
        f.export = several.then(|| r.export.clone());
        encode_into(&mut f, r);
    }
    f.text()
}

/// One report's series.
fn encode_into(f: &mut Families, r: &Report) {
    let (g, c) = (MetricType::Gauge, MetricType::Counter);
    if let Some(v) = &r.volume {
        let free = v.data_blocks_total.saturating_sub(v.data_blocks_used) * 4096;
        let saving = if v.logical_bytes_used == 0 {
            0.0
        } else {
            100.0 * (1.0 - v.physical_data_bytes_used as f64 / v.logical_bytes_used as f64)
        };
        f.gauge("logical_size_bytes", "Logical size of the volume", v.logical_size_bytes as f64);
        f.gauge("logical_used_bytes", "Logical bytes mapped to data", v.logical_bytes_used as f64);
        f.gauge("physical_size_bytes", "Size of the data device", v.physical_size_bytes as f64);
        f.gauge("physical_used_bytes", "Physical bytes in use for data", v.physical_data_bytes_used as f64);
        f.gauge("physical_free_bytes", "Physical data bytes free for new data", free as f64);
        f.gauge("metadata_bytes", "Bytes of metadata regions", v.metadata_bytes as f64);
        f.gauge("space_saving_percent", "Share of logical data that takes no physical space", saving);
        f.gauge("reduction_ratio", "Logical bytes in use per physical byte (0: nothing stored)", v.reduction_ratio);
        let s = &v.savings;
        f.add(
            "savings_bytes",
            "Logical bytes not stored, by mechanism",
            g,
            vec![
                (labels(&[("mechanism", "zero")]), s.zero_bytes as f64),
                (labels(&[("mechanism", "dedup")]), s.dedup_bytes as f64),
                (labels(&[("mechanism", "compression")]), s.compression_bytes as f64),
            ],
        );
        let k = &v.counters;
        f.add(
            "blocks_written",
            "4 KiB blocks written by clients since open, by what the pipeline made of them",
            c,
            vec![
                (labels(&[("outcome", "zero")]), k.zero_blocks as f64),
                (labels(&[("outcome", "dedup")]), k.dedup_hits as f64),
                (labels(&[("outcome", "compressed")]), k.compressed_blocks as f64),
                (labels(&[("outcome", "raw")]), k.raw_blocks as f64),
            ],
        );
        f.counter("dedup_verify_failures", "Dedup candidates rejected by verification", k.dedup_verify_failures);
        f.counter(
            "refcount_cap_copies",
            "Duplicates stored again because a count was at its cap",
            k.refcount_cap_copies,
        );
        f.counter("packed_blocks_written", "Packed physical blocks written (packer output)", k.packed_blocks_written);
        f.counter("journal_commits", "Group commits of the recovery journal", k.commits);
        f.counter("checkpoints", "Checkpoints (block map and refcount pages written)", k.checkpoints);
        f.add(
            "cache_lookups",
            "Cache lookups since open, by cache and result",
            c,
            vec![
                (labels(&[("cache", "content"), ("result", "hit")]), k.content_cache_hits as f64),
                (labels(&[("cache", "content"), ("result", "miss")]), k.content_cache_misses as f64),
                (labels(&[("cache", "block_map"), ("result", "hit")]), k.block_map_cache_hits as f64),
                (labels(&[("cache", "block_map"), ("result", "miss")]), k.block_map_cache_misses as f64),
            ],
        );
        f.gauge("block_map_cached_pages", "Block map pages in memory", v.block_map_cached_pages as f64);
        f.gauge("index_entries", "Entries in the fingerprint index", v.index_entries as f64);
        f.gauge("index_capacity_entries", "Capacity of the fingerprint index", v.index_capacity as f64);
        f.gauge("index_memory_bytes", "Memory of the fingerprint index", v.index_memory_bytes as f64);
        let io = &v.io;
        let figures = [
            ("data", "write", io.data_write),
            ("data", "read", io.data_read),
            ("journal", "write", io.journal_write),
            ("journal", "read", io.journal_read),
            ("block_map", "write", io.block_map_write),
            ("block_map", "read", io.block_map_read),
            ("refcount", "write", io.refcount_write),
            ("refcount", "read", io.refcount_read),
            ("index", "write", io.index_write),
            ("index", "read", io.index_read),
            ("verify", "read", io.verify_read),
            ("superblock", "write", io.superblock_write),
            ("superblock", "read", io.superblock_read),
            ("tier_fill", "read", io.tier_fill_read),
        ];
        let per = |pick: fn(&dedupvol_core::IoFigure) -> u64| {
            figures
                .iter()
                .map(move |(cat, dir, fig)| (labels(&[("category", cat), ("direction", dir)]), pick(fig) as f64))
        };
        f.add("device_io_bytes", "Device bytes moved since open, by category", c, per(|x| x.bytes).collect());
        f.add("device_io_ops", "Device operations since open, by category", c, per(|x| x.ops).collect());
        f.counter("device_syncs", "Durability barriers (fdatasync) since open", io.syncs);
        let t = v.tier.clone().unwrap_or_default();
        f.gauge(
            "tier_enabled",
            "1 when a hot-chunk tier is in use",
            f64::from(u8::from(v.tier.is_some() && !t.disabled)),
        );
        f.gauge("tier_capacity_bytes", "Bytes of hot-chunk tier slots", t.capacity_bytes as f64);
        f.gauge("tier_entries", "Blocks the tier holds a copy of", t.entries as f64);
        f.add(
            "tier_reads",
            "Data block reads while a tier is configured, by where they were served from",
            c,
            vec![(labels(&[("result", "hit")]), t.hits as f64), (labels(&[("result", "miss")]), t.misses as f64)],
        );
        f.add(
            "tier_promotions",
            "Blocks copied to the tier, by reason",
            c,
            vec![
                (labels(&[("reason", "refcount")]), t.promotions_write as f64),
                (labels(&[("reason", "reread")]), t.promotions_read as f64),
                (labels(&[("reason", "fill")]), t.fills as f64),
                (labels(&[("reason", "dropped")]), t.promotions_dropped as f64),
            ],
        );
        f.counter("tier_demotions", "Tier copies demoted to make room", t.demotions);
        f.counter("tier_written_bytes", "Bytes of block copies written to the tier", t.slot_bytes_written);
        f.add(
            "tier_errors",
            "Tier problems, by kind",
            c,
            vec![
                (labels(&[("kind", "validation")]), t.validation_failures as f64),
                (labels(&[("kind", "slot_crc")]), t.slot_crc_failures as f64),
                (labels(&[("kind", "device")]), t.device_errors as f64),
            ],
        );
        let bucket =
            |b: &dedupvol_core::RefcountBucket, v: u64| (labels(&[("refs_max", &b.refs_max.to_string())]), v as f64);
        f.add(
            "refcount_blocks",
            "Physical blocks in use whose reference count is at most refs_max (and above the previous bucket)",
            g,
            r.refcount_histogram.iter().map(|b| bucket(b, b.blocks)).collect(),
        );
        f.add(
            "refcount_references",
            "References held by the blocks of each refcount bucket",
            g,
            r.refcount_histogram.iter().map(|b| bucket(b, b.references)).collect(),
        );
    }
    let s = &r.server;
    let per_command = |pick: fn(&dedupvol_nbd::metrics::CommandFigures) -> u64| {
        s.commands.iter().map(|k| (labels(&[("command", &k.command)]), pick(k) as f64)).collect::<Vec<_>>()
    };
    f.add("nbd_requests", "NBD requests executed, by command", c, per_command(|k| k.requests));
    f.add("nbd_request_bytes", "Bytes NBD requests covered, by command", c, per_command(|k| k.bytes));
    f.add("nbd_fua_requests", "NBD requests with the FUA flag, by command", c, per_command(|k| k.fua));
    f.add("nbd_request_errors", "NBD requests the volume failed, by command", c, per_command(|k| k.errors));
    f.add(
        "errors",
        "Failed requests by kind (device, checksum, no_space, read_only, invalid, other; rejected: refused by the protocol checks)",
        c,
        s.errors.iter().map(|(k, n)| (labels(&[("kind", k)]), *n as f64)).collect(),
    );
    let histograms = s
        .commands
        .iter()
        .map(|k| {
            let l = &k.latency;
            let bounds = l.bounds_us.iter().map(|&b| b as f64 / 1e6).chain(std::iter::once(f64::MAX));
            (labels(&[("command", &k.command)]), l.sum_us as f64 / 1e6, bounds.zip(l.counts.iter().copied()).collect())
        })
        .collect();
    f.histogram(
        "nbd_request_duration_seconds",
        "Time from an NBD request read to its reply written, by command",
        histograms,
    );
    f.counter("nbd_connections", "NBD connections served since start", s.connections_accepted);
    f.gauge("nbd_connections_open", "NBD connections open now", s.connections_open as f64);
}

/// Starts the endpoint on `addr` (HOST:PORT) for every export in `sources`.
pub fn start(addr: &str, sources: Vec<Source>) -> anyhow::Result<Service> {
    let listener = Listener::bind(&ListenAddr::Tcp(addr.to_string()))?;
    Ok(Service::spawn("metrics", listener, move |s| answer(s, &sources))?)
}

/// Reads one HTTP request head and answers it.
fn answer(s: &mut dedupvol_nbd::stream::Stream, sources: &[Source]) -> io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(buf.get(..n).unwrap_or_default());
        if head.len() > REQUEST_HEAD_BYTES_MAX {
            respond(s, "431 Request Header Fields Too Large", "text/plain", "request head too large\n")?;
            // Closing with unread bytes would reset the connection and could discard the
            // answer before the client reads it: end our side, then drain a little.
            s.shutdown(std::net::Shutdown::Write)?;
            let _ = io::copy(&mut s.take(DRAIN_BYTES_MAX), &mut io::sink());
            return Ok(());
        }
    }
    let line = String::from_utf8_lossy(&head);
    let mut words = line.split_whitespace();
    match (words.next(), words.next()) {
        (Some("GET"), Some(path)) if path == "/metrics" || path.starts_with("/metrics?") => {
            let reports: Vec<Report> = sources.iter().map(Source::report).collect();
            respond(s, "200 OK", CONTENT_TYPE, &encode_all(&reports))
        }
        (Some("GET"), Some("/")) => respond(s, "200 OK", "text/plain", "dedupvol metrics: see /metrics\n"),
        (Some("GET"), _) => respond(s, "404 Not Found", "text/plain", "not found; try /metrics\n"),
        _ => respond(s, "405 Method Not Allowed", "text/plain", "only GET\n"),
    }
}

fn respond(s: &mut dedupvol_nbd::stream::Stream, status: &str, kind: &str, body: &str) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    s.flush()
}
