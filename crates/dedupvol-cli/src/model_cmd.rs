//! `dedupvol model`: size a server before buying it. Parses the parameters, measures (or
//! loads) the per-core rates, and prints the comparison table or JSON; the model itself is
//! `dedupvol_workload::model`.

use anyhow::Context;
use clap::Args;
use dedupvol_core::parse_size;
use dedupvol_workload::model::{
    measure_rates, sweep, Codec, Devices, MemorySettings, Mix, ModelInput, Placement, Prices, Projection, Rates,
};
use dedupvol_workload::table::Table;
use std::path::PathBuf;
use std::process::ExitCode;

/// Long help: the formulas, so a reader of `--help` can check a row by hand.
pub const MODEL_LONG_ABOUT: &str = "\
Project the throughput and cost of a server (cores × SSDs, with or without an NVDIMM as \
the metadata device, or over a remote RADOS pool) from the stage rates measured on this \
machine per core, for a reduction mix. Prints a comparison table: throughput, the resource \
that bounds it, DRAM, usable capacity after reduction, cost, cost per GB/s and per usable TB.

Per 4 KiB block B of the mix (z zeros, d duplicates of the non-zero blocks, c the share of \
a unique block's bytes the codec saves, r the share of reads; u = (1-z)(1-d) unique \
blocks; p = u(1-c) stored bytes per logical byte):

  (1) CPU µs per block = (1-r)(1-z)(B/BLAKE3 + B/crc32c) + (1-r)u(B/probe + B/codec)
                       + r(1-z)(B/crc32c + B/decompress) + m
      m = (1-r)(u m_unique + (1-u) m_write) + r m_read
      CPU bound = cores × B / (1)
  (2) lock bound = min(volumes, cores) × B / m
      (a volume's metadata work runs under its state lock, one core at a time)
  (3) data devices bound = SSDs / (w/ssd_write + rd/ssd_read), w = (1-r)(p + M_w without \
an NVDIMM), rd = r(1-z)(1-c); a RADOS pool: remote_mb_s / (w + rd)
  (4) NVDIMM bound = nvdimm_write / ((1-r) M_w)
  throughput = the smallest bound, named in the table.
  usable TB = raw TB / (p + M_h without an NVDIMM); NVDIMM GB = usable × M_h
  DRAM = 64 MiB a volume + 4.125 B per physical block (counts, stamps, bitmap)
       + 6/0.9 B per indexed block (dense; sparse: one block in 16)
       + the block map cache and content cache of each volume
  cost = cores × price-core + DRAM × price-dram-gb + raw TB × price-ssd-tb (RADOS: × \
replicas) + NVDIMM × price-nvdimm-gb

M_w and M_h are the metadata bytes written and held per logical byte, from the on-disk \
format (journal entries, block map and reference count pages, index records). The rates \
are one core's: BLAKE3 and crc32c on 4 KiB blocks, the write path's probe, zstd and LZ4 on \
64 KiB extents, and the engine's own per-block cost (m_write: duplicate writes to an \
in-memory volume less their hashing; m_unique: unique writes, stored raw, less their \
hashing; m_read: reads served from its cache). They take about \
three seconds to measure; --save-rates keeps them for --rates. docs/design.md, \"Sizing \
model\", explains every term.";

/// `dedupvol model`.
#[derive(Args)]
pub struct ModelArgs {
    /// Percent of non-zero 4 KiB blocks that duplicate stored data.
    #[arg(long, default_value_t = 75.0)]
    dup: f64,
    /// Percent of a unique block's bytes the codec saves (0: incompressible).
    #[arg(long, default_value_t = 50.0)]
    compress: f64,
    /// Percent of all-zero blocks.
    #[arg(long, default_value_t = 0.0)]
    zero: f64,
    /// Percent of the logical bytes moved that are reads (the rest are writes).
    #[arg(long, default_value_t = 0.0)]
    read: f64,
    /// The volume's codec: zstd or lz4.
    #[arg(long, value_enum, default_value = "zstd")]
    codec: CodecArg,
    /// Core counts to compare, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,16,32")]
    cores: Vec<u32>,
    /// Data SSD counts to compare, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    ssds: Vec<u32>,
    /// Volumes served: each has its own state lock, and its own caches in DRAM.
    #[arg(long, default_value_t = 1)]
    volumes: u32,
    /// Where the metadata lives: ssds (with the data), nvdimm (a fast metadata device), or
    /// both (a row each).
    #[arg(long, value_enum, default_value = "both")]
    metadata: MetaArg,
    /// One SSD's sequential write bandwidth, MB/s.
    #[arg(long, default_value_t = 2000.0)]
    ssd_write_mb_s: f64,
    /// One SSD's read bandwidth, MB/s.
    #[arg(long, default_value_t = 3000.0)]
    ssd_read_mb_s: f64,
    /// One SSD's capacity, TB (decimal).
    #[arg(long, default_value_t = 3.84)]
    ssd_tb: f64,
    /// The NVDIMM's write bandwidth, MB/s.
    #[arg(long, default_value_t = 2000.0)]
    nvdimm_write_mb_s: f64,
    /// Also project the data in a remote Ceph RADOS pool of this client bandwidth, MB/s
    /// (replication included; the RADOS projection in the benchmark docs uses 2500 per OSD
    /// node for large writes).
    #[arg(long)]
    remote_mb_s: Option<f64>,
    /// The remote pool's client-visible capacity, TB.
    #[arg(long, default_value_t = 100.0)]
    remote_tb: f64,
    /// RADOS replicas: raw TB bought per client TB.
    #[arg(long, default_value_t = 3)]
    remote_replicas: u32,
    /// Block map cache of each volume (the engine's default: 128M).
    #[arg(long, default_value = "128M")]
    block_map_cache: String,
    /// Content cache of each volume (serve's default: 1G).
    #[arg(long, default_value = "1G")]
    content_cache: String,
    /// Sparse fingerprint index (a slot per 16 indexed blocks) instead of dense.
    #[arg(long)]
    sparse_index: bool,
    /// Price of one core (its share of the CPU and the server), in dollars.
    #[arg(long, default_value_t = 50.0)]
    price_core: f64,
    /// Price of one GB of DRAM.
    #[arg(long, default_value_t = 4.0)]
    price_dram_gb: f64,
    /// Price of one TB of data SSD (and of a RADOS pool's raw TB).
    #[arg(long, default_value_t = 80.0)]
    price_ssd_tb: f64,
    /// Price of one GB of NVDIMM.
    #[arg(long, default_value_t = 12.0)]
    price_nvdimm_gb: f64,
    /// Read the per-core rates from this JSON file (saved by --save-rates) instead of
    /// measuring them.
    #[arg(long, value_name = "FILE")]
    rates: Option<PathBuf>,
    /// Save the rates used to this JSON file.
    #[arg(long, value_name = "FILE")]
    save_rates: Option<PathBuf>,
    /// Seed of the data the rates are measured on.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

/// `--codec`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CodecArg {
    /// zstd at the engine's default level.
    Zstd,
    /// LZ4.
    Lz4,
}

/// `--metadata`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MetaArg {
    /// Metadata on the data SSDs.
    Ssds,
    /// Metadata on an NVDIMM.
    Nvdimm,
    /// Both, one row each.
    Both,
}

/// The JSON document of `--json`.
#[derive(serde::Serialize)]
struct ModelJson<'a> {
    input: &'a ModelInput,
    rows: &'a [Projection],
}

impl ModelArgs {
    pub fn run(self) -> anyhow::Result<ExitCode> {
        let pct = |name: &str, v: f64| -> anyhow::Result<f64> {
            if !(v.is_finite() && (0.0..=100.0).contains(&v)) {
                usage_bail!("--{name} {v}: must be a percentage from 0 to 100");
            }
            Ok(v / 100.0)
        };
        let mix = Mix {
            zero: pct("zero", self.zero)?,
            dup: pct("dup", self.dup)?,
            compress: pct("compress", self.compress)?,
            read: pct("read", self.read)?,
        };
        mix.validate().map_err(crate::usage)?;
        if self.cores.is_empty() || self.cores.contains(&0) {
            usage_bail!("--cores: every count must be at least 1");
        }
        if self.ssds.is_empty() || self.ssds.contains(&0) {
            usage_bail!("--ssds: every count must be at least 1");
        }
        let size = |name: &str, s: &str| parse_size(s).map_err(|e| crate::usage(format!("--{name} {s}: {e}")));
        let memory = MemorySettings {
            block_map_cache_bytes: size("block-map-cache", &self.block_map_cache)?,
            content_cache_bytes: size("content-cache", &self.content_cache)?,
            sparse_index: self.sparse_index,
        };
        let rates = match &self.rates {
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
                let r: Rates = serde_json::from_str(&text)
                    .map_err(|e| crate::usage(format!("{}: not a rates file: {e}", path.display())))?;
                r.validate().map_err(|e| crate::usage(format!("{}: {e}", path.display())))?;
                r
            }
            None => measure_rates(mix.compress.min(0.99), self.seed).context("measuring the per-core rates")?,
        };
        if let Some(path) = &self.save_rates {
            let text = serde_json::to_string_pretty(&rates)?;
            std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
        }
        let input = ModelInput {
            rates,
            mix,
            codec: match self.codec {
                CodecArg::Zstd => Codec::Zstd,
                CodecArg::Lz4 => Codec::Lz4,
            },
            devices: Devices {
                ssd_write_mb_s: self.ssd_write_mb_s,
                ssd_read_mb_s: self.ssd_read_mb_s,
                ssd_tb: self.ssd_tb,
                nvdimm_write_mb_s: self.nvdimm_write_mb_s,
                remote_mb_s: self.remote_mb_s,
                remote_tb: self.remote_tb,
                remote_replicas: self.remote_replicas,
            },
            memory,
            prices: Prices {
                core: self.price_core,
                dram_gb: self.price_dram_gb,
                ssd_tb: self.price_ssd_tb,
                nvdimm_gb: self.price_nvdimm_gb,
            },
        };
        input.validate().map_err(crate::usage)?;
        let mut placements = match self.metadata {
            MetaArg::Ssds => vec![Placement::Ssds],
            MetaArg::Nvdimm => vec![Placement::SsdsNvdimm],
            MetaArg::Both => vec![Placement::Ssds, Placement::SsdsNvdimm],
        };
        if self.remote_mb_s.is_some() {
            placements.extend(match self.metadata {
                MetaArg::Ssds => vec![Placement::Remote],
                MetaArg::Nvdimm => vec![Placement::RemoteNvdimm],
                MetaArg::Both => vec![Placement::Remote, Placement::RemoteNvdimm],
            });
        }
        let rows = sweep(&input, &self.cores, &self.ssds, self.volumes, &placements).map_err(crate::usage)?;
        if self.json {
            outln!("{}", serde_json::to_string_pretty(&ModelJson { input: &input, rows: &rows })?)?;
            return Ok(ExitCode::SUCCESS);
        }
        print_table(&input, self.volumes, &rows)?;
        Ok(ExitCode::SUCCESS)
    }
}

/// The rates, the mix, and the comparison table.
fn print_table(input: &ModelInput, volumes: u32, rows: &[Projection]) -> std::io::Result<()> {
    let r = &input.rates;
    let m = &input.mix;
    outln!("per-core rates ({}):", r.measured_on)?;
    outln!(
        "  BLAKE3 {:.0} MB/s, crc32c {:.0} MB/s, probe {:.0} MB/s, zstd {:.0}/{:.0} MB/s, LZ4 {:.0}/{:.0} MB/s \
         (compress/decompress), metadata {:.2} µs per duplicate, {:.2} per unique, {:.2} per read block",
        r.blake3_mb_s,
        r.crc32c_mb_s,
        r.probe_mb_s,
        r.zstd_compress_mb_s,
        r.zstd_decompress_mb_s,
        r.lz4_compress_mb_s,
        r.lz4_decompress_mb_s,
        r.write_metadata_us_per_block,
        r.write_unique_metadata_us_per_block,
        r.read_metadata_us_per_block
    )?;
    outln!(
        "mix: {:.0}% zero, {:.0}% of the rest duplicates, {:.0}% saved by {} on unique blocks, {:.0}% reads: \
         {:.2}x reduction; {} volume(s)",
        m.zero * 100.0,
        m.dup * 100.0,
        m.compress * 100.0,
        match input.codec {
            Codec::Zstd => "zstd",
            Codec::Lz4 => "LZ4",
        },
        m.read * 100.0,
        1.0 / m.stored(),
        volumes
    )?;
    let d = &input.devices;
    outln!(
        "devices: SSD {:.0} MB/s write, {:.0} MB/s read, {} TB; NVDIMM {:.0} MB/s write{}",
        d.ssd_write_mb_s,
        d.ssd_read_mb_s,
        d.ssd_tb,
        d.nvdimm_write_mb_s,
        d.remote_mb_s.map_or(String::new(), |v| format!(
            "; RADOS {v:.0} MB/s, {} TB, {} replicas",
            d.remote_tb, d.remote_replicas
        ))
    )?;
    let p = &input.prices;
    outln!("prices: core {}, DRAM {}/GB, SSD {}/TB, NVDIMM {}/GB\n", p.core, p.dram_gb, p.ssd_tb, p.nvdimm_gb)?;
    let mut t = Table::new(&[
        "cores",
        "storage",
        "GB/s",
        "bound",
        "CPU GB/s",
        "lock GB/s",
        "dev GB/s",
        "DRAM GB",
        "NVDIMM GB",
        "usable TB",
        "cost $",
        "$/GB/s",
        "$/usable TB",
    ]);
    for row in rows {
        let c = &row.config;
        let storage = match c.storage {
            Placement::Ssds => format!("{} SSD", c.ssds),
            Placement::SsdsNvdimm => format!("{} SSD + NVDIMM", c.ssds),
            Placement::Remote => "RADOS".into(),
            Placement::RemoteNvdimm => "RADOS + NVDIMM".into(),
        };
        t.row(vec![
            c.cores.to_string(),
            storage,
            format!("{:.2}", row.throughput_mb_s / 1000.0),
            row.bound.name().into(),
            format!("{:.2}", row.cpu_mb_s / 1000.0),
            format!("{:.2}", row.lock_mb_s / 1000.0),
            format!("{:.2}", row.data_mb_s / 1000.0),
            format!("{:.1}", row.dram_gb),
            if row.nvdimm_gb > 0.0 { format!("{:.1}", row.nvdimm_gb) } else { "-".into() },
            format!("{:.1}", row.usable_tb),
            format!("{:.0}", row.cost),
            format!("{:.0}", row.cost_per_gb_s),
            format!("{:.1}", row.cost_per_usable_tb),
        ]);
    }
    outln!("{}", t.render().trim_end())
}
